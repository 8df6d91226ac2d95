"""What a compiled program says, per device per step (`read`): FLOPs and bytes with every loop
body weighed, collectives, the compiler's memory figures and the kernel inventory, read from
the optimized HLO through jaxdist.program.comm and jaxdist.program.kernels; XLA's own cost analysis
beside them (`xla_cost`, which closes the gap a device-less XLA:GPU program leaves); and how the
readings of two compilers differ. Where a program is compiled for: jaxdist.program.compiled."""

from __future__ import annotations

import dataclasses
import math
import weakref

from jaxdist import metrics
from jaxdist.figures import Figures
from jaxdist.program import comm, kernels


class ProgramError(RuntimeError):
    """A compiled program could not be read as promised (e.g. a private XLA binding moved)."""


_OPTIMIZED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class ProgramReading(Figures):
    """What a compiled program says per device per step (`read`): which compiler, FLOPs and
    bytes accessed (and how they were counted: `basis`), XLA's own cost counts, every
    collective (jaxdist.program.comm.collectives), the compiler's byte figures and the
    kernels by class (jaxdist.program.kernels.inventory)."""
    compiler: str
    label: str
    flops: float
    bytes_accessed: float
    basis: str
    xla_cost: dict[str, float | str]
    collectives: list[dict]
    memory: dict[str, int]
    kernels: dict[str, dict]
    kernels_upper_bound: bool
    compile_s: float | None


def _optimized(compiled) -> dict[str, object]:
    """{"text", and "modules" once fetched} of a compiled program, kept while it lives."""
    try:
        return _OPTIMIZED.setdefault(compiled, {})
    except TypeError:  # not weak-referenceable: fetched each time, not kept
        return {}


def text(compiled) -> str:
    """The optimized HLO text of a compiled program, `compiled.as_text()`, fetched once per
    program. Where the executable has no text of its own (a device-less XLA:GPU program,
    across the plugin's C API), as_text fetches the modules (serialised in the compiler and
    parsed again in jaxlib) and prints them; the text is then printed from `modules`, the
    same fetch the cost analysis uses (its second fetch was a fifth of reading such a
    program)."""
    kept = _optimized(compiled)
    if "text" not in kept:
        executable = compiled.runtime_executable()
        if hasattr(executable, "get_hlo_text") or not hasattr(executable, "hlo_modules"):
            kept["text"] = compiled.as_text() or ""  # printed directly (XLA:CPU)
        else:
            kept["text"] = "\n\n".join(m.to_string() for m in modules(compiled))
    return kept["text"]


def modules(compiled) -> list:
    """XLA's optimized HLO modules of a compiled program, fetched once per program."""
    kept = _optimized(compiled)
    if "modules" not in kept:
        kept["modules"] = compiled.runtime_executable().hlo_modules()
    return kept["modules"]


def xla_cost(compiled) -> dict[str, float]:
    """XLA's cost analysis of the compiled program: {"flops", "bytes accessed", ...} per
    device, a while body counted once. A program compiled without a device does not offer
    it; XLA's HloCostAnalysis is then run over its optimized module (jax's private
    `hlo_module_cost_analysis`, here alone). Raises ProgramError rather than return zeros."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - UNIMPLEMENTED on a device-less GPU program
        cost = None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if cost:
        return dict(cost)
    try:
        from jax._src import xla_bridge
        from jax._src.lib import _jax
        module = modules(compiled)[0]
        cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    except Exception as e:  # noqa: BLE001
        raise ProgramError(f"XLA's cost analysis is not available for this program and the "
                           f"private fallback failed ({type(e).__name__}: {e}); jax's "
                           f"internals moved: update "
                           f"jaxdist.program.program_reading.xla_cost") from e
    if not cost or "flops" not in cost:
        raise ProgramError("XLA's HloCostAnalysis returned no flops for this program")
    return dict(cost)


def read(compiled, target, axis_sizes: dict[str, int],
         branch_runs: dict[str, float] | None = None, step_flops: float | None = None,
         compile_s: float | None = None) -> ProgramReading:
    """What the compiled program says, per device per step.

    flops / bytes_accessed: XLA:GPU: the kernel inventory's (every loop body times its trip
    count, cuDNN attention counted); XLA:CPU: XLA's cost analysis as before (`step_flops`,
    the caller's micro-batch-corrected count, when given). `xla_cost` keeps XLA's own counts
    beside them."""
    hlo = text(compiled)
    cost = xla_cost(compiled)
    inventory = kernels.inventory(hlo, branch_runs)
    if target.gpu:
        flops, bytes_accessed = inventory.flops, inventory.bytes
        basis = ("kernel inventory of the XLA:GPU program: matmul FLOPs and each kernel's "
                 "operand + result bytes, every loop body times its trip count")
    else:
        flops = step_flops if step_flops is not None else float(cost.get("flops", 0.0))
        bytes_accessed = float(cost.get("bytes accessed", 0.0))
        basis = "XLA:CPU's cost analysis (a loop body counted once; micro-batches corrected)"
    return ProgramReading(
        compiler=target.compiler, label=target.label, flops=float(flops),
        bytes_accessed=float(bytes_accessed), basis=basis,
        xla_cost={"flops": float(cost.get("flops", 0.0)),
                  "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                  "note": "XLA's HloCostAnalysis: a while body counted once"},
        collectives=comm.collectives(hlo, dict(axis_sizes), branch_runs,
                                     hosts(compiled, target, axis_sizes)),
        memory=memory_bytes(compiled), kernels=inventory.kernels,
        kernels_upper_bound=inventory.upper_bound, compile_s=compile_s)


def hosts(compiled, target, axis_sizes: dict[str, int]):
    """The host of each of the program's devices, by logical id (the replica groups' ids:
    the device assignment, its mesh's devices in order): the process of each device of the
    mesh the program was compiled for where they span several (a run's processes, the hosts
    of a device-less XLA:GPU topology); else, for simulated devices standing for a part's
    nodes, that part's nodes as jaxdist.mesh places the mesh on them; else None (one host)."""
    import jax
    import numpy as np

    from jaxdist.mesh import host_of

    n = math.prod(axis_sizes.values())
    meshes = [s.mesh for s in jax.tree.leaves(compiled.input_shardings)
              if getattr(s, "mesh", None) is not None and s.mesh.devices.size == n]
    if meshes:
        process = np.array([d.process_index for d in meshes[0].devices.flat])
        if len(set(process.tolist())) > 1:
            return np.unique(process, return_inverse=True)[1]
    if getattr(target, "gpus_per_node", 0):
        return host_of(axis_sizes, target.gpus_per_node).ravel()
    return None


def memory_bytes(compiled) -> dict[str, int]:
    """The compiler's per-device byte figures of a compiled program ({} where it has none)."""
    memory = metrics.compiled_memory(compiled) or {}
    return {k: v for k, v in memory.items() if k.endswith("_bytes")}


def differences(gpu: ProgramReading, cpu: ProgramReading) -> list[str]:
    """How two readings of the same step differ, in words: collective dtype, op choice and
    combining, and bytes per kind (GPU / CPU)."""
    def by_kind(reading):
        out: dict = {}
        for op in reading.collectives:
            row = out.setdefault(op["kind"], {"count": 0.0, "bytes": 0.0, "dtypes": set()})
            row["count"] += op["times"]
            row["bytes"] += op["bytes"]
            row["dtypes"].update(op.get("dtypes", ()))
        return out

    g, c = by_kind(gpu), by_kind(cpu)
    lines = []
    for kind in sorted(set(g) | set(c)):
        a, b = g.get(kind), c.get(kind)
        if a and not b:
            lines.append(f"{kind}: only XLA:GPU emits it ({a['bytes']:,.0f} B in "
                         f"{a['count']:g} ops)")
        elif b and not a:
            lines.append(f"{kind}: only XLA:CPU emits it ({b['bytes']:,.0f} B in "
                         f"{b['count']:g} ops)")
        else:
            ratio = a["bytes"] / b["bytes"] if b["bytes"] else math.inf
            dt = "" if a["dtypes"] == b["dtypes"] else \
                f"; dtype {'/'.join(sorted(a['dtypes']))} vs {'/'.join(sorted(b['dtypes']))}"
            comb = "" if a["count"] == b["count"] else \
                f"; {a['count']:g} vs {b['count']:g} ops"
            lines.append(f"{kind}: {a['bytes']:,.0f} vs {b['bytes']:,.0f} B "
                         f"(GPU/CPU {ratio:.2f}){comb}{dt}")
    async_ops = sum(1 for op in gpu.collectives if op.get("async"))
    lines.append(f"async collectives: {async_ops} of {len(gpu.collectives)} on XLA:GPU, "
                 f"{sum(1 for op in cpu.collectives if op.get('async'))} of "
                 f"{len(cpu.collectives)} on XLA:CPU")
    return lines
