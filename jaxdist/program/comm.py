"""Communication accounting from the optimized HLO of the compiled step.

Every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
counted once, whichever form XLA printed it in: sync, XLA:GPU's async `-start`/`-done` pair
(the `-start` is counted), an `async-start` wrapping the collective in a `calls=`
computation (the wrapped collective is counted), or a combined op moving several arrays (the
sum of its arrays). Each gets its buffer bytes per device per step (all-gather: the gathered
result; reduce-scatter: the operand), counted as often as it runs (inside a while loop such
as the micro-batch scan, times the loop's known trip count; inside a conditional's branch,
as often as the caller says the branch runs, else marked an upper bound), its group size,
and the mesh axes it spans: replica groups, or a collective-permute's source-target pairs,
mapped from device ids to mesh coordinates. Plus an estimate of the bytes each device
sends on a ring (jaxdist.program.hlo.ring_factor: all-reduce 2(n-1)/n x bytes, all-gather
and reduce-scatter (n-1)/n x the full buffer, all-to-all (n-1)/n, permute 1x; a permute's
bytes are averaged over the devices, only its pairs' sources sending), which is what the
analytic volume of a layout is compared with; `analytic_basis` says what that volume
assumes, per layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import NotRequired, TypedDict

import numpy as np

from jaxdist.figures import ABSENT, Figures

from jaxdist.program.hlo import (COLLECTIVE_KINDS, Array, execution_counts, permute_pairs,
                                 replica_groups, ring_factor, typed)

# The collectives counted here (a ragged all-to-all's or a broadcast's bytes are data the
# text does not hold).
KINDS = COLLECTIVE_KINDS[:5]
__all__ = ["KINDS", "collectives", "payload", "permute_pairs", "replica_groups", "summarize",
           "spread", "analytic_basis", "analytic_ring_bytes"]


def _total(tree) -> int:
    return tree.bytes if isinstance(tree, Array) else sum(_total(t) for t in tree)


def payload(kind: str, ins) -> tuple[int | None, int]:
    """(operand bytes or None where the text does not show them, result bytes) of one
    collective. XLA:GPU's async forms print different shapes for the same collective:

    - `all-reduce-start`: the result itself (a tuple of results when combined); before
      2023 it was (operand, result[, u32 contexts]), told apart by the operand count;
    - `all-gather-start`, `collective-permute-start`: (operand(s), result(s)[, contexts]);
    - `X-start` printed for an `async-start` wrapping X (XLA's default syntax sugar, e.g.
      reduce-scatter-start, all-to-all-start): ((operands), result[, contexts]);
    - a plain collective, also the one inside an async-start's `calls=` computation: its
      result."""
    tree, op = ins.result, ins.op
    if op == kind:
        return None, _total(tree)
    if isinstance(tree, Array) or not tree:
        return None, _total(tree)  # all-reduce-start of one array
    if kind == "all-reduce" and isinstance(tree[0], Array) and \
            len(tree) == ins.operand_count:
        return _total(tree), _total(tree)  # combined all-reduce-start: its results
    return _total(tree[0]), (_total(tree[1]) if len(tree) > 1 else _total(tree[0]))


def _spanned_axes(names: list[str], sizes: list[int], devices_by_link) -> list[str]:
    """Mesh axes along which some link (a group, or a source-target pair) changes
    coordinate."""
    axes = set()
    for devices in devices_by_link:
        coords = np.array([np.unravel_index(d, sizes) for d in devices])
        axes |= {i for i in range(len(sizes)) if len(set(coords[:, i])) > 1}
    return [a for i, a in enumerate(names) if i in axes]


def spread(links, hosts) -> tuple[int, int]:
    """(hosts a link spans, fewest of its devices in one of them) of the worst link (a
    group, or a source-target pair): most hosts first, then fewest devices in one;
    `hosts[i]`: the host of logical device i."""
    worst = (1, max((len(link) for link in links), default=1))
    for link in links:
        _, counts = np.unique(np.asarray(hosts)[list(link)], return_counts=True)
        worst = max(worst, (len(counts), int(counts.min())), key=lambda t: (t[0], -t[1]))
    return worst


# One collective of a program (`collectives`): its kind, bytes per device per step (its
# buffer x `times` runs), ring bytes (what each device sends, ring algorithm), group size,
# instruction and computation, the mesh axes its groups span, whether its count is only an
# upper bound, whether it runs asynchronously, its dtypes, and (hosts known) the nodes its
# groups span and the fewest members one holds.
Collective = TypedDict("Collective", {
    "kind": str, "bytes": float, "times": float, "group_size": int, "name": str,
    "computation": str, "axes": list, "ring_bytes": float, "upper_bound": bool,
    "nodes": NotRequired[int], "members_per_node": NotRequired[int], "async": bool,
    "dtypes": list})


def collectives(hlo_text: str, mesh_shape: dict[str, int],
                branch_runs: dict[str, float] | None = None,
                hosts=None) -> list[Collective]:
    """One entry per collective in the optimized HLO, each counted once: a sync op, the
    `-start` of an async pair (never its `-done`), or the collective inside an async-start's
    wrapped computation (never the async-start/-done around it). `bytes` is the collective's
    buffer (all-gather: the gathered result; reduce-scatter: the operand; all-reduce,
    all-to-all, collective-permute: the array moved; a combined op: the sum of its arrays)
    times `times`, how often it runs per step (`upper_bound`: inside a conditional branch
    whose frequency `branch_runs` does not give; see execution_counts). With `hosts` (the
    host of each logical device: program_reading.hosts), `nodes` and `members_per_node`
    say which hosts its groups (or pairs) actually span (`spread`)."""
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    everyone = list(range(math.prod(sizes)))
    runs, guessed = execution_counts(hlo_text, branch_runs)
    # Computations an async-start wraps: their collectives run asynchronously (XLA:GPU).
    program = typed(hlo_text)
    wrapped = {c for ins in program if ins.op == "async-start" for c in ins.calls("calls")}
    out = []
    for ins in program:
        current, name, op, kind = ins.computation, ins.name, ins.op, ins.collective
        if kind not in KINDS:
            continue
        operand, result = payload(kind, ins)
        if kind == "collective-permute":
            pairs = ins.permute_pairs
            moving = [p for p in pairs if p[0] != p[1]] if pairs is not None else [everyone]
            n = len({d for p in moving for d in p})
            links = moving
        else:
            groups = ins.replica_groups or [everyone]
            n = len(groups[0])
            links = groups[:1]
            moving = groups
        if n <= 1:
            continue  # a group of one (XLA:CPU emits such all-reduces): nothing moves
        if kind == "reduce-scatter":
            # The operand; where the text shows only the scattered result, n times it.
            buffer = operand if operand is not None else result * n
        elif kind == "collective-permute" and pairs is not None:
            # Per device on average: only the pairs' sources send (a pipeline's permute
            # between two stages moves nothing out of the others).
            senders = len({src for src, _ in moving})
            buffer = result * senders // len(everyone) if result * senders % len(everyone) \
                == 0 else result * senders / len(everyone)
        else:
            buffer = result
        times = runs.get(current, 1)
        out.append({"kind": kind, "bytes": buffer * times, "times": times, "group_size": n,
                    "name": name,
                    "computation": current,
                    "axes": _spanned_axes(names, sizes, links),
                    "ring_bytes": buffer * times * ring_factor(kind, n),
                    "upper_bound": current in guessed,
                    **(dict(zip(("nodes", "members_per_node"), spread(moving, hosts)))
                       if hosts is not None else {}),
                    "async": op.endswith("-start") or current in wrapped,
                    "dtypes": sorted({a.dtype for a in ins.results if a.dtype != "token"})})
    return out


@dataclasses.dataclass(frozen=True)
class CommSummary(Figures):
    """A program's collectives per device per step: {count, bytes, ring_bytes} by kind and
    by mesh-axis combination (e.g. "data+fsdp"), their totals, and where counts are only an
    upper bound; a run's record adds the layout's analytic traffic beside them."""
    by_kind: dict[str, dict[str, float]]
    by_axis: dict[str, dict[str, float]]
    total_bytes: float
    total_ring_bytes: float
    upper_bound_note: str | None
    analytic_ring_bytes: float | None = ABSENT
    analytic_basis: str = ABSENT
    measured_over_analytic: float | None = ABSENT


def summarize(ops: list[Collective]) -> CommSummary:
    """Totals per kind and per mesh-axis combination (e.g. "data+fsdp")."""
    by_kind: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "ring_bytes": 0.0})
    by_axis: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "ring_bytes": 0.0})
    for op in ops:
        for table, key in ((by_kind, op["kind"]), (by_axis, "+".join(op["axes"]) or "none")):
            table[key]["count"] += op.get("times", 1)
            table[key]["bytes"] += op["bytes"]
            table[key]["ring_bytes"] += op["ring_bytes"]
    bounded = sorted({op["kind"] for op in ops if op.get("upper_bound")})
    return CommSummary(
        by_kind=dict(by_kind), by_axis=dict(by_axis),
        total_bytes=sum(op["bytes"] for op in ops),
        total_ring_bytes=sum(op["ring_bytes"] for op in ops),
        upper_bound_note=(
            f"upper bound for {', '.join(bounded)}: some run inside a conditional branch "
            "whose frequency the HLO does not hold, counted as if it ran every time"
            if bounded else None))


def _analytic(layout: str):
    """The layout's parameter and gradient traffic (sharding.registry.Analytic: each layout
    registers its own), None where it has no formula or is not a mesh layout."""
    from sharding.registry import facts, layout_names

    return facts(layout).analytic if layout in layout_names() else None


def analytic_basis(layout: str) -> str:
    """What the layout's analytic figure counts: the collectives this harness's
    implementation of it needs, on ring algorithms, for parameters and gradients only."""
    a = _analytic(layout)
    return a.basis if a else f"no analytic formula for layout {layout!r}"


def analytic_ring_bytes(layout: str, mesh_shape: dict[str, int], param_bytes: int,
                        grad_bytes: int | None = None) -> float | None:
    """Bytes each device sends per step for a layout's parameter/gradient traffic, as its
    `analytic_basis` describes (ring algorithms, activations and scalars ignored); None
    where no formula applies. `grad_bytes`: the gradients' bytes where they differ from the
    parameters' (float32 gradients of bfloat16 working weights)."""
    a = _analytic(layout)
    if a is None:
        return None
    return a.ring_bytes(mesh_shape, param_bytes, param_bytes if grad_bytes is None
                        else grad_bytes)
