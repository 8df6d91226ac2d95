"""The power block of a run whose processes each measure their own GPUs: a PS run's workers,
the PyTorch reference's ranks. Each samples with this module's monitor (the sampler,
windows and block of a mesh run) and writes its block; the run's block adds them up: the
GPUs side by side, energies and samples summed, the window from the first process's open
to the last one's close. (PS shards hold no GPU: they add nothing.)

Any process without a measurement makes the run's block unavailable, with its reason: a sum
over some of the GPUs would read as the run's energy.
"""

from __future__ import annotations

from jaxdist.telemetry import energy


def combine(blocks: dict[int, dict], who: str = "worker") -> dict:
    """The run's power block from {process index: its power block}; `who` names the
    processes in reasons and per-process fields (worker, rank)."""
    if not blocks:
        return {"available": False, "reason": f"no {who} reported a power block"}
    missing = {w: b.get("reason", "not measured") for w, b in sorted(blocks.items())
               if not b.get("available")}
    if missing:
        reasons = sorted(set(missing.values()))
        if len(missing) == len(blocks) and len(reasons) == 1:
            return {"available": False, "reason": reasons[0]}
        return {"available": False, "reason": "; ".join(
            f"{who}(s) {[w for w in missing if missing[w] == r]}: {r}" for r in reasons)}
    order = sorted(blocks)
    gpus = [dict(g, **{who: w}) for w in order for g in blocks[w]["gpus"]]
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
                   f"per_{who}": [dict(win, **{who: w}) for w, win in zip(order, windows)]},
        **totals,
        "flags": flags + [dict(f, **{who: w}) for w in order for f in blocks[w]["flags"]],
        "gpus": gpus,
        "sample_ms": first["sample_ms"],
        "note": f"the sum of each {who}'s own GPUs over its own window "
                f"(jaxdist.telemetry.combine); the longest window divides the energy into watts",
        "errors_total": sum(blocks[w].get("errors_total", 0) for w in order),
    }
