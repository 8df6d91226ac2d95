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
  an upper bound where it reads only a slice of an operand).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import defaultdict

from jaxdist.program.hlo import branches, execution_counts, instructions, trip_count

_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|f16|bf16|"
                    r"f32|f64|c64|c128)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
          "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_OPERANDS = re.compile(r"%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w]+)"')
_CONTRACT = {"lhs": re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")}
COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                  "collective-permute", "collective-broadcast", "ragged-all-to-all")
# Instructions that launch nothing: control flow, tuples, views and the -done halves.
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
              "conditional", "call", "after-all", "partition-id", "replica-id",
              "opt-barrier", "add-dependency", "domain", "async-done", "async-update"}


def arrays(shape: str) -> list[tuple[str, list[int]]]:
    """(element type, dims) of every array in an HLO shape (a tuple gives several)."""
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> float:
    return sum(_BYTES[t] * math.prod(dims) for t, dims in arrays(shape))


def _operand_names(rest: str) -> list[str]:
    """The instruction's operands: the %names before its attributes."""
    depth, end = 1, len(rest)
    for i, c in enumerate(rest):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            end = i
            break
    return _OPERANDS.findall(rest[:end])


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(out_shape: str, lhs_shape: str, rest: str) -> float:
    """2 x output elements x the contracted size, for an HLO `dot`."""
    m = _CONTRACT["lhs"].search(rest)
    lhs = arrays(lhs_shape)
    out = arrays(out_shape)
    if not m or not lhs or not out:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _dims(m.group(1)))
    return 2.0 * math.prod(out[0][1]) * contracted


def ragged_dot_flops(out_shape: str, lhs_shape: str, rest: str) -> float:
    """An HLO `ragged-dot` (a grouped GEMM): ragged over rows (lhs_ragged_dims not
    contracted), each row meets one group's matrix: a dot's count; ragged over the
    contracted dimension (a weight gradient, the result [groups, m, n]), each group
    contracts only its own rows: the dot's count over the groups."""
    flops = dot_flops(out_shape, lhs_shape, rest)
    ragged = re.search(r"lhs_ragged_dims=\{([\d,]*)\}", rest)
    contracting = _CONTRACT["lhs"].search(rest)
    out = arrays(out_shape)
    if ragged and contracting and out and \
            set(_dims(ragged.group(1))) & set(_dims(contracting.group(1))):
        flops /= out[0][1][0]
    return flops


def _backend_config(line: str) -> dict:
    m = re.search(r"backend_config=(\{.*\})", line)
    if not m:
        return {}
    text = m.group(1)
    depth = 0
    for i, c in enumerate(text):  # the JSON object ends where its braces balance
        depth += c == "{"
        depth -= c == "}"
        if depth == 0:
            try:
                return json.loads(text[:i + 1])
            except ValueError:
                return {}
    return {}


def gemm_call_flops(out_shape: str, lhs_shape: str, line: str) -> float:
    """A cuBLAS GEMM custom call: 2 x result elements x contracted size (the result is the
    first array of its tuple; the second is cuBLAS's workspace)."""
    cfg = _backend_config(line).get("gemm_backend_config", {})
    dnums = cfg.get("dot_dimension_numbers", {})
    lhs = arrays(lhs_shape)
    out = arrays(out_shape)
    if not lhs or not out:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d)] for d in dnums.get("lhs_contracting_dimensions",
                                                                  []))
    return 2.0 * math.prod(out[0][1]) * contracted


def attention_flops(operand_shapes: list[str], line: str, backward: bool) -> float:
    """cuDNN fused attention: each matmul is 2 B H Lq Lk D; forward runs QK^T and PV,
    backward recomputes QK^T and runs dV, dP, dQ, dK. B H Lq Lk is the score tensor's shape
    (`intermediate_tensor_shape` in the call's config), D = Q's elements / (B H Lq)."""
    cfg = _backend_config(line).get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    q = arrays(operand_shapes[0]) if operand_shapes else []
    if len(scores) != 4 or not q:
        return 0.0
    b, h, lq, _ = scores
    head_dim = math.prod(q[0][1]) / (b * h * lq)
    causal = str(cfg.get("mask_type", "")).upper() == "CAUSAL"
    return 2.0 * math.prod(scores) * head_dim * (5 if backward else 2) * \
        (0.5 if causal else 1.0)


def kernel_kind(op: str, line: str) -> str | None:
    """What an instruction launches, in the inventory's words; None for no kernel."""
    if op in _NO_KERNEL or op.endswith("-done"):
        return None
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in COLLECTIVE_OPS:
        return f"collective ({'async' if op.endswith('-start') else 'sync'})"
    if op == "fusion":
        kind = _FUSION_KIND.search(line)
        if kind and "gemm" in kind.group(1):
            return "gemm fusion (Triton)"
        if kind and kind.group(1).startswith("__cudnn"):
            return "cuDNN fusion"
        custom = re.search(r'"custom_fusion_config":\{"name":"([\w]+)"', line)
        if custom:
            return f"custom fusion ({custom.group(1)})"
        if kind:
            return f"custom fusion ({kind.group(1).strip('_')})"
        return "fusion"
    if op == "custom-call":
        target = (_TARGET.search(line) or [None, "?"])[1]
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


def _parse(hlo_text: str):
    """(instructions in text order as (computation, name, op, shape, rest, line), shapes by
    name, computations that fusions or reducers call)."""
    shapes: dict[str, str] = {}
    parsed = []
    fused: set[str] = set()
    for current, name, m, line in instructions(hlo_text):
        shapes[name] = m.group("shape")
        op = m.group("op")
        if op == "fusion" or "to_apply=" in line:
            fused.update(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line))
        parsed.append((current, name, op, m.group("shape"), m.group("rest"), line))
    return parsed, shapes, fused


def _dtype(shapes: list[str]) -> str:
    """The first operand's element type, as a jaxdist dtype name where one applies."""
    found = arrays(shapes[0]) if shapes else []
    return {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}.get(
        found[0][0] if found else "", found[0][0] if found else "")


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
    parsed, shapes, fused = _parse(hlo_text)
    fused_flops: dict[str, float] = defaultdict(float)
    for comp, _, op, shape, rest, _ in parsed:
        if op in ("dot", "ragged-dot") and comp in fused:
            operands = _operand_names(rest)
            count = ragged_dot_flops if op == "ragged-dot" else dot_flops
            fused_flops[comp] += count(shape, shapes.get(operands[0], ""), rest) \
                if operands else 0.0
    wrapped = {}  # async-start name -> the computation it wraps
    out: dict[str, list[dict]] = defaultdict(list)
    for comp, name, op, shape, rest, line in parsed:
        if comp in fused:
            continue
        operands = _operand_names(rest)
        if op in ("while", "conditional", "call"):
            trip = trip_count(line) if op == "while" else None
            for callee in re.findall(r"(?:body|to_apply|calls)=%?([\w.\-]+)", line):
                out[comp].append({"item": "call", "callee": callee, "branch": False,
                                  "repeat": trip or 1})
            for branch in branches(line):
                out[comp].append({"item": "call", "callee": branch, "branch": True,
                                  "repeat": 1})
            continue
        if op == "async-start":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            wrapped[name] = called.group(1) if called else ""
            out[comp].append({"item": "start", "name": name,
                              "wraps": wrapped[name]})
            continue
        if op.endswith("-done"):
            out[comp].append({"item": "done", "name": operands[0] if operands else ""})
            continue
        if op == "copy-start" and HOST_MEMORY in shape:  # to or from host memory: a transfer
            out[comp].append({"item": "start", "name": name,
                              "host_bytes": float(next(_BYTES[t] * math.prod(d)
                                                       for t, d in arrays(shape)))})
            continue
        kind = kernel_kind(op, line)
        if kind is None:
            continue
        if kind.startswith("collective"):
            out[comp].append({"item": "start" if op.endswith("-start") else "sync",
                              "name": name})
            continue
        args = [shapes.get(n, "") for n in operands]
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            flops = fused_flops.get(called.group(1), 0.0) if called else 0.0
        elif op in ("dot", "ragged-dot"):
            count = ragged_dot_flops if op == "ragged-dot" else dot_flops
            flops = count(shape, args[0] if args else "", rest)
        elif kind == "gemm (cuBLAS)":
            flops = gemm_call_flops(shape, args[0] if args else "", line)
        elif kind.startswith("attention (cuDNN)"):
            flops = attention_flops(args, line, kind.endswith("backward"))
        else:
            flops = 0.0
        result = arrays(shape)[:1] if kind == "gemm (cuBLAS)" else arrays(shape)
        nbytes = sum(shape_bytes(a) for a in args) + sum(
            _BYTES[t] * math.prod(d) for t, d in result)
        out[comp].append({"item": "kernel", "kind": kind, "flops": flops, "bytes": nbytes,
                          "dtype": _dtype(args), "seq": _seq(line, kind),
                          "ragged": "ragged_dot" in _op_name(line)})
    return dict(out)


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def _seq(line: str, kind: str) -> int | None:
    """The key sequence length of a cuDNN attention call (its rate depends on it)."""
    if not kind.startswith("attention"):
        return None
    dims = _backend_config(line).get("cudnn_fmha_backend_config", {}).get(
        "intermediate_tensor_shape", {}).get("dimensions", [])
    return int(dims[-1]) if len(dims) == 4 else None


def inventory(hlo_text: str, branch_runs: dict[str, float] | None = None) -> dict:
    """{"kernels": {kind: {"launches", "flops", "bytes"}}, "flops", "bytes" (all kernels
    but collectives), "upper_bound"}: every kernel of the program weighed by how often it
    runs per step."""
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
    return {"kernels": dict(sorted(kernels.items())),
            "flops": sum(r["flops"] for r in kernels.values()),
            # A collective's traffic is timed as communication, not as HBM work.
            "bytes": sum(r["bytes"] for k, r in kernels.items()
                         if not k.startswith("collective")),
            "upper_bound": bound}


def format_inventory(inv: dict) -> list[str]:
    """One line per kernel kind: launches per step, GFLOP, MB."""
    lines = []
    for kind, r in inv["kernels"].items():
        lines.append(f"    {kind:<40}{r['launches']:>10,.0f} launches{r['flops'] / 1e12:>12,.3f} "
                     f"TFLOP{r['bytes'] / 1e9:>12,.3f} GB")
    return lines
