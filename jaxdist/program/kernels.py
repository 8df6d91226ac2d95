"""The kernels of an optimized XLA program, read from its HLO text (no jax): what launches
(GEMM fusions, cuBLAS and cuDNN calls, other fusions, copies, collectives), how often per
step, and each kernel's FLOPs and bytes.

Why not XLA's cost analysis alone: it counts a while loop's body once whatever its trip
count (a pipeline's tick scan, a micro-batch scan), it gives cuDNN's custom calls 0 FLOPs,
and on a program compiled without a device it is not offered at all. Here every computation
is weighed by how often it runs (`jaxdist.program.hlo.execution_counts`: trip counts, async
wrappers, conditional branches by the caller's counts), and:
- FLOPs are the matmuls': 2 x output elements x contracted size for every `dot`, wherever it
  sits (fused or not), and for every `ragged-dot` (a grouped GEMM, kept by cuDNN's ragged-dot
  fusion: each row meets one group's matrix, so the real rows' FLOPs, not groups x rows; a
  ragged dot XLA rewrote to a dense dot over all groups is that dense dot's FLOPs, since
  that is what runs; `schedule` marks either kernel `ragged`), cuBLAS GEMM calls by their dimension numbers, and cuDNN fused
  attention as its matmuls (forward 2, backward 5, of 2 B H Lq Lk D each; halved for a
  causal mask, whose masked tiles cuDNN skips). Elementwise FLOPs are left out (under 2% of
  a transformer step);
- bytes are, per kernel, its operands plus its result (what a kernel reads and writes once,
  an upper bound where it reads only a slice of an operand), except where the kernel
  updates a buffer in place: a scatter or dynamic-update-slice (fused or not) whose
  updated operand is the kernel's own operand writes its result into that buffer, so it
  moves the updates, not the buffer (`in_place_bytes`: a scatter reads and writes the rows
  it updates, a dynamic-update-slice writes its slice), and where a kernel reads an operand
  only through slices (dynamic-slice, slice, gather), which read what they return
  (`sliced_reads`), as XLA's cost analysis counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

from jaxdist.figures import Figures
from jaxdist.program.hlo import Instruction, execution_counts, trip_count, typed

# Instructions that launch nothing: control flow, tuples, views and the -done halves.
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
              "conditional", "call", "after-all", "partition-id", "replica-id",
              "opt-barrier", "add-dependency", "domain", "async-done", "async-update"}


def _bytes(arrays) -> float:
    """Bytes of arrays as a kernel moves them (a sub-byte element counts its share)."""
    return sum(a.bits / 8 for a in arrays)


def _first(ins: Instruction | None):
    """The first array of an instruction's result (None: no instruction, no array)."""
    return ins.results[0] if ins is not None and ins.results else None


def dot_flops(ins: Instruction, lhs: Instruction | None) -> float:
    """2 x output elements x the contracted size, for an HLO `dot`."""
    contracting = ins.dims_attributes.get("lhs_contracting_dims")
    lhs_array, out = _first(lhs), _first(ins)
    if contracting is None or lhs_array is None or out is None:
        return 0.0
    contracted = math.prod(lhs_array.dims[d] for d in contracting)
    return 2.0 * out.elements * contracted


def ragged_dot_flops(ins: Instruction, lhs: Instruction | None) -> float:
    """An HLO `ragged-dot` (a grouped GEMM): ragged over rows (lhs_ragged_dims not
    contracted), each row meets one group's matrix: a dot's count; ragged over the
    contracted dimension (a weight gradient, the result [groups, m, n]), each group
    contracts only its own rows: the dot's count over the groups."""
    flops = dot_flops(ins, lhs)
    ragged = ins.dims_attributes.get("lhs_ragged_dims")
    contracting = ins.dims_attributes.get("lhs_contracting_dims")
    out = _first(ins)
    if ragged is not None and contracting is not None and out is not None and \
            set(ragged) & set(contracting):
        flops /= out.dims[0]
    return flops


def gemm_call_flops(ins: Instruction, lhs: Instruction | None) -> float:
    """A cuBLAS GEMM custom call: 2 x result elements x contracted size (the result is the
    first array of its tuple; the second is cuBLAS's workspace)."""
    cfg = ins.backend_config.get("gemm_backend_config", {})
    dnums = cfg.get("dot_dimension_numbers", {})
    lhs_array, out = _first(lhs), _first(ins)
    if lhs_array is None or out is None:
        return 0.0
    contracted = math.prod(lhs_array.dims[int(d)]
                           for d in dnums.get("lhs_contracting_dimensions", []))
    return 2.0 * out.elements * contracted


def attention_flops(ins: Instruction, q: Instruction | None, backward: bool) -> float:
    """cuDNN fused attention: each matmul is 2 B H Lq Lk D; forward runs QK^T and PV,
    backward recomputes QK^T and runs dV, dP, dQ, dK. B H Lq Lk is the score tensor's shape
    (`intermediate_tensor_shape` in the call's config), D = Q's elements / (B H Lq)."""
    cfg = ins.backend_config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    q_array = _first(q)
    if len(scores) != 4 or q_array is None:
        return 0.0
    b, h, lq, _ = scores
    head_dim = q_array.elements / (b * h * lq)
    causal = str(cfg.get("mask_type", "")).upper() == "CAUSAL"
    return 2.0 * math.prod(scores) * head_dim * (5 if backward else 2) * \
        (0.5 if causal else 1.0)


IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # op -> its updates' operand index


def _parameter_index(ins: Instruction | None) -> int | None:
    """i of `parameter(i)`, else None."""
    if ins is None or ins.op != "parameter":
        return None
    return int(ins.operand_text.strip() or -1)


def in_place_bytes(ins: Instruction, by_name: dict, roots: dict) -> float | None:
    """Bytes a kernel moves that updates one of its operands in place (a scatter or a
    dynamic-update-slice at its root, fused or not, into an operand of the kernel): its
    other operands read, the updates written (and read back first for a scatter's
    combiner); None for any other kernel."""
    root, operand_of = ins, lambda name: name  # unfused: the operands are the kernel's
    if ins.op == "fusion":
        called = ins.calls("calls")
        root = roots.get(called[0]) if called else None
        if root is None:
            return None
    if root.op not in IN_PLACE or len(root.operands) <= IN_PLACE[root.op]:
        return None
    target, updates = by_name.get(root.operands[0]), by_name.get(
        root.operands[IN_PLACE[root.op]])
    while target is not None and target.op == "bitcast" and target.operands:
        target = by_name.get(target.operands[0])
    if ins.op == "fusion":
        index = _parameter_index(target)
        if index is None or index >= len(ins.operands):
            return None
        skipped = ins.operands[index]
    else:
        if target is None:
            return None
        skipped = target.name
    if updates is None or not updates.results:
        return None
    others = sum(_bytes(by_name[n].results) for n in ins.operands
                 if n != skipped and n in by_name)
    moved = _bytes(updates.results[:1])
    return others + moved * (2 if root.op == "scatter" else 1)


SLICING = ("dynamic-slice", "slice", "gather")  # read only what they return from operand 0


def sliced_reads(program, fused: set) -> dict:
    """{(fused computation, parameter index): bytes} for every parameter of a fused
    computation that is read only as operand 0 of slicing ops (through bitcasts): the
    kernel reads the slices they return, not the whole operand."""
    users: dict[str, list] = defaultdict(list)
    for ins in program:
        if ins.computation in fused:
            for name in ins.operands:
                users[name].append(ins)

    def slices(name, depth=0) -> float | None:
        found = users.get(name)
        if not found or depth > 4:
            return None
        total = 0.0
        for user in found:
            if user.op == "bitcast":
                part = slices(user.name, depth + 1)
            elif user.op in SLICING and user.operands and user.operands[0] == name and \
                    name not in user.operands[1:]:
                part = _bytes(user.results)
            else:
                return None
            if part is None:
                return None
            total += part
        return total
    out = {}
    for ins in program:
        if ins.op == "parameter" and ins.computation in fused:
            read = slices(ins.name)
            index = _parameter_index(ins)
            if read is not None and index is not None and read < _bytes(ins.results):
                out[(ins.computation, index)] = read
    return out


def kernel_kind(ins: Instruction) -> str | None:
    """What an instruction launches, in the inventory's words; None for no kernel."""
    op = ins.op
    if op in _NO_KERNEL or op.endswith("-done"):
        return None
    if ins.collective:
        return f"collective ({'async' if op.endswith('-start') else 'sync'})"
    if op == "fusion":
        kind = ins.fusion_kind
        if kind and "gemm" in kind:
            return "gemm fusion (Triton)"
        if kind and kind.startswith("__cudnn"):
            return "cuDNN fusion"
        if ins.custom_fusion:
            return f"custom fusion ({ins.custom_fusion})"
        if kind:
            return f"custom fusion ({kind.strip('_')})"
        return "fusion"
    if op == "custom-call":
        target = ins.custom_call_target or "?"
        if target.startswith("__cublas"):
            return "gemm (cuBLAS)"
        if target.startswith("__cudnn$fmha"):
            return "attention (cuDNN) backward" if "Backward" in target else \
                "attention (cuDNN) forward"
        return f"custom-call {target}"
    if op in ("copy", "copy-start"):
        return "copy"
    if op in ("dot", "convolution", "ragged-dot"):
        return f"unfused {op}"
    if op == "async-start":
        return None  # its wrapped computation's instructions are counted where they run
    return op


def _dtype(first: Instruction | None) -> str:
    """The first operand's element type, as a jaxdist dtype name where one applies."""
    found = _first(first)
    return dtype_name(found.dtype if found is not None else "")


def dtype_name(t: str) -> str:
    """An HLO element type as a jaxdist dtype name where one applies (every FP8 type:
    float8, the tensor cores' FP8 rate)."""
    if t.startswith("f8"):
        return "float8"
    return {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}.get(t, t)


HOST_MEMORY = ":S(5)"  # XLA:GPU's layout mark of a buffer in host memory (memory space 5)


@functools.lru_cache(maxsize=4)  # a program is read by inventory(), then timed (2 threads)
def schedule(hlo_text: str) -> dict[str, list[dict]]:
    """Every computation's items in schedule order (XLA prints a scheduled module's
    instructions in the order they run): kernels {"kernel", kind, flops, bytes, dtype},
    async collective halves {"start"/"done", "name"}, copies between HBM and host memory as
    the same halves with "host_bytes", sync collectives {"sync", "name"}, and
    calls into other computations {"call", "callee", "repeat" (a while's trip count),
    "branch"}. Fusion bodies and reducers are folded into their kernel. Shared between
    callers (cached): read it, never change it."""
    program = typed(hlo_text)
    by_name = {ins.name: ins for ins in program}
    roots = {ins.computation: ins for ins in program if ins.root}
    # Computations that fusions or reducers call: folded into their caller's kernel.
    fused = {c for ins in program if ins.op == "fusion" or "to_apply=" in ins.line
             for c in ins.calls("calls", "to_apply")}
    partial_reads = sliced_reads(program, fused)
    fused_flops: dict[str, float] = defaultdict(float)
    fused_dtype: dict[str, str] = {}  # a GEMM fusion's dot operands' type (FP8 inside it)
    for ins in program:
        if ins.op in ("dot", "ragged-dot") and ins.computation in fused and ins.operands:
            count = ragged_dot_flops if ins.op == "ragged-dot" else dot_flops
            fused_flops[ins.computation] += count(ins, by_name.get(ins.operands[0]))
            fused_dtype.setdefault(ins.computation, _dtype(by_name.get(ins.operands[0])))
    out: dict[str, list[dict]] = defaultdict(list)
    for ins in program:
        comp, name, op = ins.computation, ins.name, ins.op
        if comp in fused:
            continue
        if op in ("while", "conditional", "call"):
            trip = trip_count(ins.line) if op == "while" else None
            for callee in ins.calls("body", "to_apply", "calls"):
                out[comp].append({"item": "call", "callee": callee, "branch": False,
                                  "repeat": trip or 1})
            for branch in ins.branches:
                out[comp].append({"item": "call", "callee": branch, "branch": True,
                                  "repeat": 1})
            continue
        if op == "async-start":
            called = ins.calls("calls")
            out[comp].append({"item": "start", "name": name,
                              "wraps": called[0] if called else ""})
            continue
        if op.endswith("-done"):
            out[comp].append({"item": "done", "name": ins.operands[0] if ins.operands else ""})
            continue
        if op == "copy-start" and HOST_MEMORY in ins.shape:  # to or from host memory
            out[comp].append({"item": "start", "name": name,
                              "host_bytes": _bytes(ins.results[:1])})
            continue
        kind = kernel_kind(ins)
        if kind is None:
            continue
        if kind.startswith("collective"):
            out[comp].append({"item": "start" if op.endswith("-start") else "sync",
                              "name": name})
            continue
        args = [by_name.get(n) for n in ins.operands]
        first = args[0] if args else None
        dtype = _dtype(first)
        if op == "fusion":
            called = ins.calls("calls")
            flops = fused_flops.get(called[0], 0.0) if called else 0.0
            dtype = fused_dtype.get(called[0], dtype) if called else dtype
        elif op in ("dot", "ragged-dot"):
            count = ragged_dot_flops if op == "ragged-dot" else dot_flops
            flops = count(ins, first)
        elif kind == "gemm (cuBLAS)":
            flops = gemm_call_flops(ins, first)
        elif kind.startswith("attention (cuDNN)"):
            flops = attention_flops(ins, first, kind.endswith("backward"))
        else:
            flops = 0.0
        result = ins.results[:1] if kind == "gemm (cuBLAS)" else ins.results
        nbytes = in_place_bytes(ins, by_name, roots)
        if nbytes is None:
            called = ins.calls("calls")[0] if op == "fusion" and ins.calls("calls") else None
            reads = [partial_reads.get((called, i), _bytes(by_name[n].results))
                     for i, n in enumerate(ins.operands) if n in by_name]
            if op in SLICING and args and args[0] is not None:  # unfused: its slice
                reads[0] = min(reads[0], _bytes(result))
            nbytes = sum(reads) + _bytes(result)
        out[comp].append({"item": "kernel", "kind": kind, "flops": flops, "bytes": nbytes,
                          "dtype": dtype, "seq": _seq(ins, kind),
                          "ragged": "ragged_dot" in (ins.op_name or "")})
    return dict(out)


def _seq(ins: Instruction, kind: str) -> int | None:
    """The key sequence length of a cuDNN attention call (its rate depends on it)."""
    if not kind.startswith("attention"):
        return None
    dims = ins.backend_config.get("cudnn_fmha_backend_config", {}).get(
        "intermediate_tensor_shape", {}).get("dimensions", [])
    return int(dims[-1]) if len(dims) == 4 else None


@dataclasses.dataclass(frozen=True)
class KernelInventory(Figures):
    """A program's kernels per step by class ({kind: {launches, flops, bytes}}), their FLOPs
    and bytes (all kernels but collectives), and whether a branch counted every time makes
    it an upper bound."""
    kernels: dict[str, dict[str, float]]
    flops: float
    bytes: float
    upper_bound: bool


def inventory(hlo_text: str, branch_runs: dict[str, float] | None = None) -> KernelInventory:
    """Every kernel of the program weighed by how often it runs per step."""
    runs, guessed = execution_counts(hlo_text, branch_runs)
    kernels: dict[str, dict] = defaultdict(lambda: {"launches": 0.0, "flops": 0.0,
                                                    "bytes": 0.0})
    bound = False
    program = schedule(hlo_text)
    # A collective inside an async-start's wrapped computation runs asynchronously.
    wrapped = {i["wraps"] for items in program.values() for i in items if i.get("wraps")}
    for comp, items in program.items():
        times = runs.get(comp, 0)
        if not times:
            continue
        for item in items:
            if item["item"] == "kernel":
                kind, flops, nbytes = item["kind"], item["flops"], item["bytes"]
            elif item["item"] in ("start", "sync") and not item.get("wraps"):
                sync = item["item"] == "sync" and comp not in wrapped
                kind, flops, nbytes = f"collective ({'sync' if sync else 'async'})", 0.0, 0.0
            else:
                continue
            bound |= comp in guessed
            row = kernels[kind]
            row["launches"] += times
            row["flops"] += flops * times
            row["bytes"] += nbytes * times
    return KernelInventory(
        kernels=dict(sorted(kernels.items())),
        flops=sum(r["flops"] for r in kernels.values()),
        # A collective's traffic is timed as communication, not as HBM work.
        bytes=sum(r["bytes"] for k, r in kernels.items() if not k.startswith("collective")),
        upper_bound=bound)


def format_inventory(kernels: dict[str, dict[str, float]]) -> list[str]:
    """One line per kernel kind of an inventory's `kernels`: launches per step, GFLOP, MB."""
    lines = []
    for kind, r in kernels.items():
        lines.append(f"    {kind:<40}{r['launches']:>10,.0f} launches{r['flops'] / 1e12:>12,.3f} "
                     f"TFLOP{r['bytes'] / 1e9:>12,.3f} GB")
    return lines
