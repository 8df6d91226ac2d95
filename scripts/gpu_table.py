"""Print one row per run of the GPU check, the goals of the check, and what is missing.

Usage: python scripts/gpu_table.py [--check] [--expect-torch] RUN_DIR_OR_RESULTS_JSON...
With --check, exit 1 (after printing) when a figure a GPU run must have is missing: a run
without results.json, power not measured, no measured peak, or mfu/hfu null. Goals (memory
within 10% of the compiler's bound, llama-1b mfu >= 50%) are printed as met or missed; a
missed goal is a finding, not a missing figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

MiB = 2 ** 20


def load(path: str) -> dict | None:
    from jaxdist.record import read_results

    p = Path(path)
    f = p / "results.json" if p.is_dir() or not p.suffix else p
    return read_results(f) if f.exists() else None


def precision(r: dict) -> str:
    model = r.get("config", {}).get("model", {})
    return model.get("matmul_precision") or r.get("matmul_precision") or "?"


def problems(r: dict) -> list[str]:
    out = []
    power = r.get("power") or {}
    if not power.get("available"):
        out.append(f"power.available is false: {power.get('reason')}")
    elif not (power.get("energy_j") or 0) > 0:
        out.append(f"power.energy_j is {power.get('energy_j')!r}, not > 0")
    mem = r.get("memory", {})
    if mem.get("measured_peak_bytes") is None:
        out.append(f"memory.measured_peak_bytes is null: {mem.get('measured_peak_reason')}")
    mfu = r.get("mfu") or {}
    if mfu.get("value") is None:
        out.append(f"mfu is null: {mfu.get('reason')}")
    if r.get("framework", "jax") == "jax" and mfu.get("hfu") is None:
        out.append(f"hfu is null: {mfu.get('reason')}")
    return out


def num(v, f: str) -> str:
    return "n/a" if v is None else format(v, f)


def mem_ratio(r: dict) -> float | None:
    mem = r.get("memory", {})
    measured, bound = mem.get("measured_peak_bytes"), (mem.get("compiled") or {}).get("peak_bytes")
    return measured / bound if measured and bound else None


def row(name: str, r: dict) -> list[str]:
    p = r.get("power", {}) if r.get("power", {}).get("available") else {}
    mem = r["memory"]
    bound = (mem.get("compiled") or {}).get("peak_bytes")
    measured = mem.get("measured_peak_bytes")
    mfu = r.get("mfu") or {}
    counter, integral = p.get("energy_counter_j"), p.get("energy_integral_j")
    return [name, r.get("framework", "jax"), r["layout"], r["model"]["name"],
            r["config"]["model"]["dtype"] if "config" in r and "model" in r["config"] else "?",
            precision(r), num(r["step_time_s"]["p50"] * 1e3, ".2f"),
            num(r["throughput"]["samples_per_s"], ".0f"),
            num(mfu.get("value"), ".1%"), num(mfu.get("hfu"), ".1%"),
            f"{num(measured and measured / MiB, '.0f')} / {num(bound and bound / MiB, '.0f')}",
            num(mem_ratio(r), ".3f"), num(p.get("avg_w"), ".0f"),
            num(p.get("energy_per_sample_j"), ".4f"),
            num(integral / counter - 1 if counter and integral else None, "+.1%")]


def goals(named: dict[str, dict]) -> list[str]:
    lines = []
    for name in ("mem-ddp", "mem-fsdp"):
        if name in named and mem_ratio(named[name]) is not None:
            ratio = mem_ratio(named[name])
            ok = abs(ratio - 1) <= 0.10
            lines.append(f"{name}: measured/compiler bound {ratio:.3f} "
                         f"({'met' if ok else 'MISSED'}: goal within 10%)")
    if "llama-1b" in named and (named["llama-1b"].get("mfu") or {}).get("value") is not None:
        m = named["llama-1b"]["mfu"]
        lines.append(f"llama-1b bf16: mfu {m['value']:.1%}, hfu {num(m.get('hfu'), '.1%')} "
                     f"({'met' if m['value'] >= 0.5 else 'MISSED'}: goal mfu >= 50%)")
    if {"prec-default", "prec-highest"} <= named.keys():
        d, h = named["prec-default"], named["prec-highest"]
        lines.append(f"matmul precision: highest/default step time "
                     f"{h['step_time_s']['p50'] / d['step_time_s']['p50']:.2f}x")
    torch_runs = [r for r in named.values() if r.get("framework") == "pytorch"]
    if "jax-mlp" in named and torch_runs:
        j, t = named["jax-mlp"], torch_runs[0]
        lines.append(f"JAX/PyTorch samples/s, mlp-10m FP32: "
                     f"{j['throughput']['samples_per_s'] / t['throughput']['samples_per_s']:.2f}")
    return lines


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from jaxdist.errors import OneLineParser  # bad input: one line, exit 2

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--expect-torch", action="store_true",
                    help="with --check: a missing PyTorch run is a missing figure")
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    named, bad = {}, []
    for path in args.runs:
        r = load(path)
        if r is None:
            bad.append((Path(path).name, "no results.json (the run failed; see its .log)"))
        else:
            named[Path(path).name] = r
    head = ["run", "framework", "layout", "model", "dtype", "matmul", "step p50 ms",
            "samples/s", "mfu", "hfu", "mem MiB meas/bound", "meas/bound", "avg W",
            "J/sample", "integral vs counter"]
    rows = [head] + [row(n, r) for n, r in named.items()]
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    for x in rows:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())
    print()
    for line in goals(named):
        print(line)
    if args.check:
        bad += [(n, m) for n, r in named.items() for m in problems(r)]
        if args.expect_torch and not any(r.get("framework") == "pytorch"
                                         for r in named.values()):
            bad.append(("torch", "no PyTorch run: the JAX vs PyTorch figure is missing"))
    for name, message in bad:
        print(f"CHECK FAILED ({name}): {message}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
