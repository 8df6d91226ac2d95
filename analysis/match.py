"""Which JAX run and which PyTorch run are the same configuration (compare's live table),
and what differs when they are not."""

from __future__ import annotations

from jaxdist.record import RunRecord

# What a JAX run and a PyTorch run must share to be compared: (label, value of a run).
MATCH_FIELDS = (
    ("model", lambda r: r.model), ("layout", lambda r: r.layout),
    ("devices", lambda r: r.devices), ("global batch", lambda r: r.batch),
    ("dtype", lambda r: r.dtype), ("matmul precision", lambda r: r.matmul_precision),
    ("optimizer", lambda r: r.optimizer), ("backend", lambda r: r.backend),
    # on CPU the JAX and PyTorch names differ and say nothing: match "cpu" to "cpu"
    ("device", lambda r: "cpu" if r.backend == "cpu" else r.device_kind),
    # PyTorch runs have neither: a JAX run with accumulation or remat has no twin
    ("step options", lambda r: f"microbatches {r.cfg('train', 'microbatches', 1)}, "
                               f"remat {r.cfg('train', 'remat', 'none')}"))


def key(run: RunRecord) -> tuple:
    return tuple(get(run) for _, get in MATCH_FIELDS)


def group(runs: list[RunRecord]) -> dict[tuple, dict[str, list[RunRecord]]]:
    groups: dict[tuple, dict[str, list[RunRecord]]] = {}
    for r in runs:
        groups.setdefault(key(r), {"jax": [], "pytorch": []})[r.framework].append(r)
    return groups


def mismatches(a: RunRecord, b: RunRecord) -> list[str]:
    out = []
    for label, get in MATCH_FIELDS:
        x, y = get(a), get(b)
        if x != y and not (label == "device" and a.backend != b.backend):
            out.append(f"{label} {x} vs {y}")
    return out


def closest(run: RunRecord, others: list[RunRecord]) -> tuple[RunRecord | None, list[str]]:
    if not others:
        return None, []
    best = min(others, key=lambda o: (len(mismatches(run, o)), str(o.path)))
    return best, mismatches(run, best)
