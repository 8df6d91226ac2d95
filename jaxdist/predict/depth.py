"""Figures across depth, the one extrapolation: a decoder is a stack of identical blocks, so
every figure read from its program (FLOPs, bytes, collectives, temporaries, kernels, the
kernel model's seconds) is linear in the number of blocks. Compiled at 1 and 2 blocks, a
K-block figure is base + (K - 1) (two - one), where base is the 1-block figure of the piece
itself (a whole step: its depth-1 program; a pipeline chunk: e.g. the last one, with the
head). What is not linear is bounded here (exposed communication, `linear_times`) or read
from XLA's live ranges (temporaries of an ordered backward: jaxdist.predict.program)."""

from __future__ import annotations


def line(base: float, one: float, two: float, k: int) -> float:
    """One figure k blocks past the base: base + k (two - one)."""
    return base + k * (two - one)


def linear(base, one, two, blocks: int, by_nodes: bool = False):
    """base + (blocks - 1) x (two - one), figure by figure and collective by collective;
    `by_nodes`: collectives kept apart by the nodes their groups span, where the reading
    knew the hosts (a whole step's program), else summed over them (a pipeline's pieces).
    Figures are jaxdist.predict.program.StepFigures; the result has FLOPs, bytes,
    temporaries, collectives and the kernel model's seconds."""
    k = blocks - 1

    def key(r):
        spans = (r.get("nodes"), r.get("members_per_node")) if by_nodes else ()
        return (r["kind"], tuple(r["axes"]), r["group_size"], *spans)

    sums: dict = {}
    for i, figs in enumerate((base, one, two)):
        for r in figs.comm:
            row = sums.setdefault(key(r), {"first": r, "flags": set(),
                                           **{f: [0, 0, 0] for f in COMM_FIGURES}})
            for f in COMM_FIGURES:
                row[f][i] += r[f]
            row["flags"] |= {f for f in ("upper_bound", "async") if r.get(f)}
    rows = []
    for row in sums.values():
        r = row["first"]
        spans = {f: r[f] for f in ("nodes", "members_per_node") if by_nodes and
                 r.get("nodes") is not None}
        out = {"kind": r["kind"], "axes": list(r["axes"]), "group_size": r["group_size"],
               **spans, **{f: line(*row[f], k) for f in COMM_FIGURES},
               **{f: f in row["flags"] for f in ("upper_bound", "async")}}
        if out["count"] > 0 or out["ring_bytes"] > 0:
            rows.append(out)
    return type(base)(
        flops=line(base.flops, one.flops, two.flops, k),
        bytes_accessed=line(base.bytes_accessed, one.bytes_accessed, two.bytes_accessed, k),
        memory={"temp_bytes": line(*(f.memory.get("temp_bytes", 0) for f in (base, one, two)),
                                   k)},
        comm=rows,
        kernel_time=(linear_times(base.kernel_time, one.kernel_time, two.kernel_time, k)
                     if base.kernel_time is not None else None))


COMM_FIGURES = ("count", "bytes", "ring_bytes")


def kernels(base: dict[str, dict[str, float]], one: dict[str, dict[str, float]],
            two: dict[str, dict[str, float]], k: int) -> dict[str, dict[str, float]]:
    """The kernel inventory (launches, FLOPs, bytes per kind), base + k (two - one)."""
    zero = {"launches": 0, "flops": 0.0, "bytes": 0.0}
    out = {}
    for kind in set(base) | set(one) | set(two):
        a, b, c = (figs.get(kind, zero) for figs in (base, one, two))
        out[kind] = {f: line(a[f], b[f], c[f], k) for f in ("launches", "flops", "bytes")}
    return dict(sorted(out.items()))


def linear_times(base, one, two, k: int):
    """The kernel model's seconds (jaxdist.predict.kernels_time.KernelTime), base + k (two -
    one), term by term (sums over kernels)."""
    out = {f: line(getattr(base, f), getattr(one, f), getattr(two, f), k)
           for f in base.SECONDS}
    kinds = set(base.by_kind) | set(one.by_kind) | set(two.by_kind)
    by_kind = {n: base.by_kind.get(n, 0.0) + k * (two.by_kind.get(n, 0.0) -
                                                   one.by_kind.get(n, 0.0))
               for n in kinds}
    # Exposure is read from each program's schedule, and how much of a collective a block's
    # compute hides is not linear in depth: what is exposed before the step's first matmul
    # (the gathers of the first blocks' weights, fetched ahead) is exposed once a step, and
    # grows by what the second block adds there, not per block; the rest (between the
    # matmuls, and the reductions after the last, which carry every block's gradients) is
    # per block. The line can still cross zero or pass the link's own time. Bounded:
    # 0 <= exposed <= that link's seconds.
    for link in ("intra_node_s", "inter_node_s"):
        head = f"head_exposed_{link}"
        heads = [getattr(figs, head) for figs in (base, one, two)]
        rest = [getattr(figs, f"exposed_{link}") - h for figs, h in zip((base, one, two), heads)]
        out[head] = heads[0] + max(0.0, heads[2] - heads[1])
        out[f"exposed_{link}"] = min(out[head] + max(0.0, line(*rest, k)),
                                     max(0.0, out[link]))
    out["comm_exposed_s"] = out["exposed_intra_node_s"] + out["exposed_inter_node_s"]
    out["step_s"] = out["device_s"] + out["comm_exposed_s"]
    return base.replace(**out, by_kind=by_kind,
                        upper_bound=base.upper_bound or one.upper_bound or two.upper_bound)


def minus(a, b):
    """a - b, figure by figure, never below zero: the part of program a that program b
    (a prefix of its work) does not do, e.g. a whole backward less its input gradient."""
    rows = {(r["kind"], tuple(r["axes"]), r["group_size"]): dict(r) for r in a.comm}
    for r in b.comm:
        row = rows.get((r["kind"], tuple(r["axes"]), r["group_size"]))
        if row is not None:
            for f in ("count", "bytes", "ring_bytes"):
                row[f] = max(0, row[f] - r[f])
    kernel_time = None
    if a.kernel_time is not None and b.kernel_time is not None:
        ka, kb = a.kernel_time, b.kernel_time
        kt = {f: max(0.0, getattr(ka, f) - getattr(kb, f)) for f in ka.SECONDS}
        # the device time is what the kernel terms add up to
        kt["device_s"] = kt["compute_s"] + kt["hbm_s"] + kt["launch_s"]
        kt["step_s"] = kt["device_s"] + kt["comm_exposed_s"]
        kernel_time = ka.replace(
            **kt, by_kind={k: max(0.0, v - kb.by_kind.get(k, 0.0))
                           for k, v in ka.by_kind.items()},
            upper_bound=ka.upper_bound or kb.upper_bound)
    return type(a)(flops=max(0.0, a.flops - b.flops),
                   bytes_accessed=max(0.0, a.bytes_accessed - b.bytes_accessed),
                   memory={"temp_bytes": max(0, a.memory["temp_bytes"] -
                                             b.memory["temp_bytes"])},
                   comm=[r for r in rows.values() if r["count"] > 0], kernel_time=kernel_time)
