"""Communication accounting from the optimized HLO of the compiled step.

Every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
and their async -start forms) with its buffer bytes per device per step — counted as often as
it runs: inside a while loop such as the micro-batch scan, times the loop's known trip
count — its group size, and the mesh axes its replica groups span, mapped from device ids to mesh coordinates; plus an
estimate of the bytes each device sends on a ring (all-reduce 2(n-1)/n x bytes, all-gather
and reduce-scatter (n-1)/n x the full buffer, all-to-all (n-1)/n, permute 1x), which is what
the analytic volume of a layout is compared with.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
                 r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                 r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([0-9,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def _bytes(dtype: str, dims: str) -> int:
    bits = _BITS.get(dtype) or int(dtype[1:])
    return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def _iota(spec: str) -> np.ndarray:
    """`[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`: the device ids of an iota tile assignment."""
    m = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", spec.strip())
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective, in any of XLA's three notations."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}",
                  line)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        shape = [int(size) for _, size in names]
        order = [name for name, _ in names]
        if m.group(2):
            spec = m.group(2)
            spec = spec if "<=" in spec else re.sub(r"^\[([0-9,]+)\]", lambda g: (
                f"[{math.prod(int(x) for x in g.group(1).split(','))}]<=[{g.group(1)}]"), spec)
            ids = _iota(spec).reshape(shape)
        else:
            ids = np.arange(math.prod(shape)).reshape(shape)
        spanned = [order.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        kept = [i for i in range(len(shape)) if i not in spanned]
        grouped = ids.transpose(kept + spanned).reshape(-1, math.prod(shape[i] for i in spanned))
        return grouped.tolist()
    m = re.search(r"replica_groups=(\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)", line)
    if m:
        return _iota(m.group(1)).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return None


def _buffer_bytes(kind: str, start: bool, shape: str) -> int:
    arrays = [_bytes(t, d) for t, d in _ARRAY.findall(shape)]
    arrays = [b for b in arrays if b > 0] or [0]
    if start and kind in ("all-gather", "collective-permute"):
        # Async forms return (operand(s), result(s), [context]): count the result once.
        return arrays[1] if kind == "all-gather" and len(arrays) > 1 else arrays[0]
    return sum(arrays)


def _ring_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:body|to_apply|calls|condition)=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def executions(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per step: a while loop's body (e.g. the scan
    over micro-batches) runs its known trip count times, and so do the collectives in it."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            entry = current if m.group(1) else entry
            continue
        if current is None:
            continue
        trip = _TRIP.search(line)
        for callee in _CALLS.findall(line):
            repeat = int(trip.group(1)) if trip and f"body=%{callee}" in line else 1
            calls[current].append((callee, repeat))
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 50:  # a malformed or recursive graph: count what we have
            return
        runs[name] += times
        for callee, repeat in calls.get(name, ()):
            visit(callee, times * repeat, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return dict(runs)


def collectives(hlo_text: str, mesh_shape: dict[str, int]) -> list[dict]:
    """One entry per collective in the optimized HLO; `times` is how often it runs per step
    and `bytes` counts every run."""
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    runs = executions(hlo_text)
    out = []
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            continue
        m = _OP.match(line)
        if not m or "-done(" in line:
            continue
        kind, start = m.group("kind"), bool(m.group("start"))
        groups = replica_groups(line) or [list(range(math.prod(sizes)))]
        n = len(groups[0])
        buffer = _buffer_bytes(kind, start, m.group("shape"))
        if kind == "reduce-scatter":
            buffer *= n  # the operand is n times the scattered result
        coords = np.array([np.unravel_index(d, sizes) for d in groups[0]])
        axes = [a for i, a in enumerate(names) if len(set(coords[:, i])) > 1]
        times = max(runs.get(current, 1), 1)
        out.append({"kind": kind, "bytes": buffer * times, "times": times, "group_size": n,
                    "axes": axes, "ring_bytes": buffer * times * _ring_factor(kind, n)})
    return out


def summarize(ops: list[dict]) -> dict:
    """Totals per kind and per mesh-axis combination (e.g. "data+fsdp")."""
    by_kind: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "ring_bytes": 0.0})
    by_axis: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "ring_bytes": 0.0})
    for op in ops:
        for table, key in ((by_kind, op["kind"]), (by_axis, "+".join(op["axes"]) or "none")):
            table[key]["count"] += op.get("times", 1)
            table[key]["bytes"] += op["bytes"]
            table[key]["ring_bytes"] += op["ring_bytes"]
    return {"by_kind": dict(by_kind), "by_axis": dict(by_axis),
            "total_bytes": sum(op["bytes"] for op in ops),
            "total_ring_bytes": sum(op["ring_bytes"] for op in ops)}


def analytic_ring_bytes(layout: str, mesh_shape: dict[str, int], param_bytes: int) -> float | None:
    """Textbook bytes each device sends per step for a layout's parameter/gradient traffic
    (ring algorithms, activations and scalars ignored); None where no formula applies."""
    n = math.prod(mesh_shape.values())
    f = mesh_shape.get("fsdp", 1)
    d = n // f
    if layout == "ddp":  # all-reduce of the gradients
        return 2 * (n - 1) / n * param_bytes
    if layout == "zero1":  # all-reduce of the gradients, all-gather of the updated parameters
        return 3 * (n - 1) / n * param_bytes
    if layout == "fsdp":  # all-gather of parameters (forward) + reduce-scatter of gradients
        return 2 * (n - 1) / n * param_bytes
    if layout == "hsdp":  # fsdp inside a group, then all-reduce of the gradient shard across groups
        return 2 * (f - 1) / f * param_bytes + 2 * (d - 1) / d * param_bytes / f
    return None
