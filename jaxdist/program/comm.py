"""Communication accounting from the optimized HLO of the compiled step.

Every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
counted once, whichever form XLA printed it in: sync, XLA:GPU's async `-start`/`-done` pair
(the `-start` is counted), an `async-start` wrapping the collective in a `calls=`
computation (the wrapped collective is counted), or a combined op moving several arrays (the
sum of its arrays). Each gets its buffer bytes per device per step (all-gather: the gathered
result; reduce-scatter: the operand), counted as often as it runs (inside a while loop such
as the micro-batch scan, times the loop's known trip count; inside a conditional's branch,
as often as the caller says the branch runs, else marked an upper bound), its group size,
and the mesh
axes it spans: replica groups, or a collective-permute's source-target pairs, mapped from
device ids to mesh coordinates. Plus an estimate of the bytes each device sends on a ring
(all-reduce 2(n-1)/n x bytes, all-gather and reduce-scatter (n-1)/n x the full buffer,
all-to-all (n-1)/n, permute 1x; a permute's bytes are averaged over the devices, only its
pairs' sources sending), which is what the analytic volume of a layout is compared
with; `analytic_basis` says what that volume assumes, per layout.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

from jaxdist.program.hlo import execution_counts, instructions

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9, <=]*)\]")
_BITS = {"pred": 8, "token": 0}


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    small_float = re.fullmatch(r"f(\d)e\w+", dtype)  # f8e4m3fn, f4e2m1fn, ...
    if small_float:
        return int(small_float.group(1))
    return int(re.search(r"\d+", dtype).group())


def _bytes(dtype: str, dims: str) -> int:
    elements = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
    return -(-elements * _bits(dtype) // 8)


def _shape_tree(shape: str):
    """An HLO shape as bytes: an int for an array, a list (of trees) for a tuple."""
    shape = re.sub(r"/\*.*?\*/", "", shape)  # /*index=5*/ markers in long tuples
    while True:  # layouts, e.g. {1,0:T(8,128)}, hold parentheses of their own
        stripped = re.sub(r"\{[^{}]*\}", "", shape)
        if stripped == shape:
            break
        shape = stripped
    stack: list[list] = [[]]
    for token in re.finditer(r"\(|\)|" + _ARRAY.pattern, shape):
        if token.group() == "(":
            stack.append([])
        elif token.group() == ")" and len(stack) > 1:
            done = stack.pop()
            stack[-1].append(done)
        elif token.group(1):
            stack[-1].append(_bytes(token.group(1), token.group(2)))
    top = stack[0]
    return top[0] if len(top) == 1 else top


def _total(tree) -> int:
    return sum(_total(t) for t in tree) if isinstance(tree, list) else tree


def _operand_count(rest: str) -> int:
    """Operands of `op(a, b), attrs...` given the text after `op(`; shapes printed with the
    operands (`f32[2,3]{1,0} %p`) hold commas of their own."""
    depth, count, seen = 0, 0, False
    for ch in rest:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            count += 1
            continue
        seen = seen or not ch.isspace()
    return count + 1 if seen else 0


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


def payload(kind: str, op: str, shape: str, rest: str) -> tuple[int | None, int]:
    """(operand bytes or None where the text does not show them, result bytes) of one
    collective. XLA:GPU's async forms print different shapes for the same collective:

    - `all-reduce-start`: the result itself (a tuple of results when combined); before
      2023 it was (operand, result[, u32 contexts]), told apart by the operand count;
    - `all-gather-start`, `collective-permute-start`: (operand(s), result(s)[, contexts]);
    - `X-start` printed for an `async-start` wrapping X (XLA's default syntax sugar, e.g.
      reduce-scatter-start, all-to-all-start): ((operands), result[, contexts]);
    - a plain collective, also the one inside an async-start's `calls=` computation: its
      result."""
    tree = _shape_tree(shape)
    if op == kind:
        return None, _total(tree)
    if not isinstance(tree, list) or not tree:
        return None, _total(tree)  # all-reduce-start of one array
    if kind == "all-reduce" and not isinstance(tree[0], list) and \
            len(tree) == _operand_count(rest):
        return _total(tree), _total(tree)  # combined all-reduce-start: its results
    return _total(tree[0]), (_total(tree[1]) if len(tree) > 1 else _total(tree[0]))


def _ring_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


_PAIRS = re.compile(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\}")


def permute_pairs(line: str) -> list[tuple[int, int]] | None:
    m = _PAIRS.search(line)
    if not m:
        return None
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", m.group(1))]


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


def collectives(hlo_text: str, mesh_shape: dict[str, int],
                branch_runs: dict[str, float] | None = None, hosts=None) -> list[dict]:
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
    wrapped = set(re.findall(r"async-start\(.*?calls=%?([\w.\-]+)", hlo_text))
    out = []
    for current, name, m, line in instructions(hlo_text):
        op = m.group("op")
        kind = op[:-len("-start")] if op.endswith("-start") else op
        if kind not in KINDS:
            continue
        operand, result = payload(kind, op, m.group("shape"), m.group("rest"))
        if kind == "collective-permute":
            pairs = permute_pairs(line)
            moving = [p for p in pairs if p[0] != p[1]] if pairs is not None else [everyone]
            n = len({d for p in moving for d in p})
            links = moving
        else:
            groups = replica_groups(line) or [everyone]
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
                    "ring_bytes": buffer * times * _ring_factor(kind, n),
                    "upper_bound": current in guessed,
                    **(dict(zip(("nodes", "members_per_node"), spread(moving, hosts)))
                       if hosts is not None else {}),
                    "async": op.endswith("-start") or current in wrapped,
                    "dtypes": sorted(set(re.findall(r"\b(bf16|f16|f32|f64|s32|u32|s8|u8|"
                                                    r"f8e4m3fn|f8e5m2|pred)\[",
                                                    m.group("shape"))))})
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
    bounded = sorted({op["kind"] for op in ops if op.get("upper_bound")})
    return {"by_kind": dict(by_kind), "by_axis": dict(by_axis),
            "total_bytes": sum(op["bytes"] for op in ops),
            "total_ring_bytes": sum(op["ring_bytes"] for op in ops),
            "upper_bound_note": (
                f"upper bound for {', '.join(bounded)}: some run inside a conditional branch "
                "whose frequency the HLO does not hold, counted as if it ran every time"
                if bounded else None)}


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
