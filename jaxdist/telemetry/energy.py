"""Window math: energy two ways, averages, peaks, and the flags that say when not to trust them.

Pure functions of arrays, so tests check them against curves with known integrals.

Two energies per GPU:
- counter: difference of nvmlDeviceGetTotalEnergyConsumption read at the window's edges. The
  primary figure, but the counter moves only every ~100 ms, so below ~1 s (10 updates) its
  quantisation error reaches 10% and more: such windows prefer the integral and are flagged.
- integral: trapezoidal integral of the power samples over exactly [open, close] (values at
  the edges interpolated), as Go et al. computed it from their 50 ms traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Thresholds:
    min_counter_window_s: float = 1.0   # ~10 updates of the ~100 ms energy counter
    min_samples: int = 10               # Go et al. discarded runs with fewer samples
    max_temp_drift_c: float = 5.0       # GPU temperature change, window start to end
    min_coverage: float = 0.95          # fraction of the window spanned by power samples


# nvmlClocksEventReason* bits (same values under the older ThrottleReason names).
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
           0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
           0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
           0x100: "display_clock_setting"}


def reason_names(mask: int) -> list[str]:
    return [REASONS.get(1 << b, f"bit_{b}") for b in range(64) if mask >> b & 1]


def flag(code: str, message: str, gpu: int | None = None) -> dict:
    return {"code": code, "gpu": gpu, "message": message}


def window_slice(t: np.ndarray, a: float, b: float) -> slice:
    """Samples from the last one at or before `a` to the first one at or after `b`: the
    window plus one sample beyond each edge to interpolate from."""
    lo = max(int(np.searchsorted(t, a, "right")) - 1, 0)
    hi = min(int(np.searchsorted(t, b, "left")) + 1, len(t))
    return slice(lo, hi)


def integrate(t: np.ndarray, w: np.ndarray, a: float, b: float) -> tuple[float | None, float]:
    """(joules over [a, b] ∩ sampled span, seconds covered). Missing samples are skipped."""
    ok = np.isfinite(w)
    t, w = t[ok], w[ok]
    if t.size < 2:
        return None, 0.0
    lo, hi = max(a, t[0]), min(b, t[-1])
    if hi <= lo:
        return None, 0.0
    inner = (t > lo) & (t < hi)
    ts = np.concatenate([[lo], t[inner], [hi]])
    ws = np.concatenate([[np.interp(lo, t, w)], w[inner], [np.interp(hi, t, w)]])
    return float(np.sum((ws[1:] + ws[:-1]) / 2 * np.diff(ts))), float(hi - lo)


def counter_joules(start_mj, end_mj) -> tuple[float | None, str | None]:
    if start_mj is None or end_mj is None:
        return None, "energy counter not read at both window edges"
    if end_mj < start_mj:  # 64-bit, so not a wrap: a driver reload or a broken counter
        return None, f"energy counter decreased from {start_mj} to {end_mj} mJ"
    return (end_mj - start_mj) / 1000.0, None


def stats(x: np.ndarray) -> dict | None:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return None
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max()),
            "start": float(x[0]), "end": float(x[-1])}


def outside(t: np.ndarray, pauses) -> np.ndarray:
    """Mask of sample times outside every pause (open intervals: edge samples stay)."""
    keep = np.ones(t.shape, dtype=bool)
    for p0, p1 in pauses:
        keep &= ~((t > p0) & (t < p1))
    return keep


def integrate_active(t, w, a: float, b: float, pauses) -> tuple[float | None, float]:
    """integrate() over [a, b] less its integral over each pause inside it."""
    joules, covered = integrate(t, w, a, b)
    if joules is None:
        return None, 0.0
    for p0, p1 in pauses:
        j, c = integrate(t, w, p0, p1)
        joules -= j or 0.0
        covered -= c
    return joules, covered


def gpu_window(meta: dict, arr: dict, a: float, b: float, counter_j, counter_note,
               th: Thresholds, pauses=()) -> tuple[dict, list[dict]]:
    """One GPU's block and its flags; `arr` holds the window_slice of its series. `pauses`:
    (start, end) intervals inside [a, b] that are not part of the window (evaluation,
    checkpoint saves): their energy, time and samples are left out."""
    gpu = meta["index"]
    flags = []
    energy_j, covered = integrate_active(arr["t"], arr["power_w"], a, b, pauses)
    arr = {k: v[outside(arr["t"], pauses)] for k, v in arr.items()}
    power = arr["power_w"][np.isfinite(arr["power_w"])]
    window_s = b - a - sum(p1 - p0 for p0, p1 in pauses)
    if power.size < th.min_samples:
        flags.append(flag("few_samples", f"{power.size} power samples in the window "
                          f"(< {th.min_samples}; Go et al. discarded such runs)", gpu))
    if energy_j is not None and covered < th.min_coverage * window_s:
        flags.append(flag("integral_incomplete", f"power samples span {covered:.3f} s of "
                          f"the {window_s:.3f} s window", gpu))
    if meta["power_source"] != "NVML_FI_DEV_POWER_INSTANT" and power.size:
        flags.append(flag("power_averaged", "power samples come from nvmlDeviceGetPowerUsage, "
                          "a 1-s average on Ampere-and-newer parts except GA100: the "
                          "integral and peak are smoothed", gpu))
    reasons = {}
    masks = arr["clock_event_reasons"][np.isfinite(arr["clock_event_reasons"])].astype(np.int64)
    if masks.size:
        for bit, name in ((1 << b_, REASONS.get(1 << b_, f"bit_{b_}")) for b_ in range(1, 32)):
            frac = float(np.mean(masks & bit != 0))
            if frac > 0:
                reasons[name] = frac
                flags.append(flag(f"throttle:{name}", f"clock-event reason {name} active in "
                                  f"{frac:.0%} of the window's samples", gpu))
    temp = stats(arr["temp_gpu_c"])
    if temp and abs(temp["end"] - temp["start"]) > th.max_temp_drift_c:
        flags.append(flag("temperature_drift", f"GPU temperature moved {temp['start']:.0f} -> "
                          f"{temp['end']:.0f} °C in the window (> {th.max_temp_drift_c} °C): "
                          "not thermally steady", gpu))
    if counter_note:
        flags.append(flag("counter_unavailable", counter_note, gpu))
    block = {
        **meta,
        "samples": int(power.size),
        "energy_counter_j": counter_j,
        "energy_counter_note": counter_note,
        "energy_integral_j": energy_j,
        "integral_span_s": covered,
        "avg_w": energy_j / covered if energy_j is not None else None,
        "avg_w_counter": counter_j / window_s if counter_j is not None and window_s > 0 else None,
        "peak_w": float(power.max()) if power.size else None,
        "temp_gpu_c": temp,
        "temp_mem_c": stats(arr["temp_mem_c"]),
        "sm_clock_mhz": stats(arr["sm_clock_mhz"]),
        "mem_clock_mhz": stats(arr["mem_clock_mhz"]),
        "util_pct": stats(arr["util_pct"]),
        "nvml_used_bytes": stats(arr["used_bytes"]),
        "clock_event_reasons": reasons,
    }
    return block, flags


def _sum(values) -> float | None:
    return None if any(v is None for v in values) else float(sum(values))


def totals(gpus: list[dict], window_s: float, steps: int, samples: int, tokens: int | None,
           th: Thresholds) -> tuple[dict, list[dict]]:
    """Figures summed over GPUs, normalised per step/sample/token, and the efficiency."""
    flags = []
    counter = _sum([g["energy_counter_j"] for g in gpus])
    integral = _sum([g["energy_integral_j"] for g in gpus])
    short = window_s < th.min_counter_window_s
    if short:
        flags.append(flag("short_window", f"window {window_s:.3f} s is shorter than "
                          f"{th.min_counter_window_s} s (~10 updates of the ~100 ms energy "
                          "counter): counter energy is unreliable; energy_j is the integral"))
    if counter is not None and (not short or integral is None):
        energy, source = counter, "counter"
    elif integral is not None:
        energy, source = integral, "integral"
    else:
        energy, source = None, None
        flags.append(flag("no_energy", "neither the counter nor the samples give an energy"))
    per = (lambda n: energy / n if energy is not None and n else None)  # noqa: E731
    rate = samples / window_s if window_s > 0 else None
    peaks = [g["peak_w"] for g in gpus if g["peak_w"] is not None]
    return {
        "energy_j": energy,
        "energy_source": source,
        "energy_counter_j": counter,
        "energy_integral_j": integral,
        "energy_per_step_j": per(steps),
        "energy_per_sample_j": per(samples),
        "energy_per_token_j": per(tokens),
        # From the integral: the samples' mean over the time they span, summed over GPUs (a
        # sampler starved of CPU that misses the window's edges leaves them out of energy_j,
        # flagged integral_incomplete, but does not dilute the average with them)
        "avg_w": (_sum([g["avg_w"] for g in gpus]) if source == "integral" else
                  energy / window_s if energy is not None and window_s > 0 else None),
        "peak_gpu_w": max(peaks) if peaks else None,
        "samples_per_s": rate,
        # Go et al.'s efficiency: throughput divided by energy in megajoules.
        "samples_per_s_per_mj": rate / (energy / 1e6) if rate and energy else None,
    }, flags


def active_counter_joules(edges, pause_edges) -> tuple[float | None, str | None]:
    """Counter energy between the window's edges less that between each pause's edges."""
    total, note = counter_joules(*edges)
    for pair in pause_edges:
        if total is None:
            break
        j, note = counter_joules(*pair)
        total = total - j if j is not None else None
    if total is not None and total < 0:  # each pause adds two edges of counter quantisation
        return None, "energy counter less the pauses is negative: too coarse for them"
    return total, note if total is None else None


def window_figures(metas: list[dict], arrays: dict[int, dict], a: float, b: float, steps: int,
                   samples: int, tokens: int | None, errors: list[dict],
                   th: Thresholds, pauses=()) -> dict:
    """Totals, `flags` and `gpus` of the power block for the window [a, b] less its
    `pauses` ((start, end) pairs). Each meta holds a GPU's identity, `counter_mj` (counter
    at open, at close), `pause_counter_mj` (the same at each pause's edges) and
    `counter_note` (why it has no counter, else None)."""
    gpus, gpu_flags = [], []
    for meta in metas:
        meta = dict(meta)
        c_j, c_note = active_counter_joules(meta.pop("counter_mj"),
                                            meta.pop("pause_counter_mj", ()))
        note = meta.pop("counter_note") or c_note
        block, f = gpu_window(meta, arrays[meta["index"]], a, b, c_j, note, th, pauses)
        gpus.append(block)
        gpu_flags += f
    summary, flags = totals(gpus, b - a - sum(p1 - p0 for p0, p1 in pauses), steps, samples,
                            tokens, th)
    in_window = [e for e in errors if a <= e["t"] <= b]
    if in_window:
        flags.append(flag("sampling_errors", f"{len(in_window)} NVML errors during the "
                          "window (see errors)"))
    return {**summary, "flags": flags + gpu_flags, "gpus": gpus}
