"""Print one row per run of the GPU check, and check what a GPU run must have measured.

Usage: python scripts/gpu_table.py [--check] RUN_DIR_OR_RESULTS_JSON...
With --check, exit 1 (after printing) unless every run has power.available, a positive
power.energy_j and a non-null memory.measured_peak_bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MiB = 2 ** 20


def load(path: str) -> dict:
    p = Path(path)
    return json.loads((p / "results.json" if p.is_dir() else p).read_text())


def problems(r: dict) -> list[str]:
    out = []
    power = r.get("power", {})
    if not power.get("available"):
        out.append(f"power.available is false: {power.get('reason')}")
    elif not (power.get("energy_j") or 0) > 0:
        out.append(f"power.energy_j is {power.get('energy_j')!r}, not > 0")
    if r.get("memory", {}).get("measured_peak_bytes") is None:
        out.append(f"memory.measured_peak_bytes is null: "
                   f"{r.get('memory', {}).get('measured_peak_reason')}")
    return out


def row(r: dict) -> list[str]:
    num = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    p = r.get("power", {}) if r.get("power", {}).get("available") else {}
    mem = r["memory"]
    est = (mem.get("compiled") or {}).get("peak_bytes")
    per_sample = p.get("energy_per_sample_j")
    return [r["layout"], num(r["step_time_s"]["p50"] * 1e3, ".2f"),
            num(r["throughput"]["samples_per_s"], ".0f"), num(r["mfu"]["value"], ".1%"),
            f"{num(mem['measured_peak_bytes'] and mem['measured_peak_bytes'] / MiB, '.0f')} / "
            f"{num(est and est / MiB, '.0f')}",
            num(p.get("avg_w"), ".0f"), num(per_sample, ".4f"),
            num(p.get("samples_per_s_per_mj"), ".3g"),
            ",".join(sorted({f["code"] for f in p.get("flags", [])})) or "-"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    runs = [load(p) for p in args.runs]
    head = ["layout", "step p50 ms", "samples/s", "MFU", "mem MiB meas/est", "avg W",
            "J/sample", "samples/(s*MJ)", "flags"]
    rows = [head] + [row(r) for r in runs]
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    for x in rows:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())
    bad = [(r["layout"], m) for r in runs for m in problems(r)] if args.check else []
    for layout, message in bad:
        print(f"CHECK FAILED ({layout}): {message}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
