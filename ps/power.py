"""A PS run's `power` block. Each worker measures its own GPUs with the telemetry module
mesh runs use (jaxdist.telemetry: the same sampler, windows and block, in its worker file);
the run's block adds them up: the GPUs side by side, energies and samples summed, the
window from the first worker's open to the last one's close. Shards hold no GPU (they run
on CPU), so they add nothing.

Any worker without a measurement makes the run's block unavailable, with its reason: a sum
over some of the GPUs would read as the run's energy.
"""

from __future__ import annotations

from jaxdist.telemetry import energy


def combine(blocks: dict[int, dict]) -> dict:
    """The run's power block from {worker: its power block}."""
    if not blocks:
        return {"available": False, "reason": "no worker reported a power block"}
    missing = {w: b.get("reason", "not measured") for w, b in sorted(blocks.items())
               if not b.get("available")}
    if missing:
        reasons = sorted(set(missing.values()))
        if len(missing) == len(blocks) and len(reasons) == 1:
            return {"available": False, "reason": reasons[0]}
        return {"available": False, "reason": "; ".join(
            f"worker(s) {[w for w in missing if missing[w] == r]}: {r}" for r in reasons)}
    order = sorted(blocks)
    gpus = [dict(g, worker=w) for w in order for g in blocks[w]["gpus"]]
    windows = [blocks[w]["window"] for w in order]
    duration = max(win["duration_s"] for win in windows)
    steps = max(win["steps"] for win in windows)
    samples = sum(win["samples"] for win in windows)
    tokens = (None if any(win["tokens"] is None for win in windows)
              else sum(win["tokens"] for win in windows))
    totals, flags = energy.totals(gpus, duration, steps, samples, tokens, energy.Thresholds())
    first = blocks[order[0]]
    return {
        "available": True,
        "backend": first["backend"],
        "window": {"mode": first["window"]["mode"],
                   "start_unix_s": min(win["start_unix_s"] for win in windows),
                   "end_unix_s": max(win["end_unix_s"] for win in windows),
                   "duration_s": duration, "steps": steps, "samples": samples,
                   "tokens": tokens, "window_steps": first["window"].get("window_steps"),
                   "per_worker": [dict(win, worker=w) for w, win in zip(order, windows)]},
        **totals,
        "flags": flags + [dict(f, worker=w) for w in order for f in blocks[w]["flags"]],
        "gpus": gpus,
        "sample_ms": first["sample_ms"],
        "note": "the sum of each worker's own GPUs over its own window (ps.power); the "
                "longest window divides the energy into watts",
        "errors_total": sum(blocks[w].get("errors_total", 0) for w in order),
    }
