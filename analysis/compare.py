"""Side-by-side tables: `python -m experiments.compare RUNS... [--published] [--out DIR]`.

RUNS are run directories (holding results.json) or folders containing them, from
`experiments.run` (JAX) and `experiments.torch_run` (PyTorch). Three tables, never a silent
line-up of mismatched numbers:

1. JAX vs live PyTorch: runs matched on (model, layout/strategy, devices, global batch,
   dtype, matmul precision, optimizer, backend); step p50/p99, samples/s, peak memory and
   train state per device, energy per sample where measured, and JAX/PyTorch ratios. Runs with no
   counterpart are listed with the closest candidate and every field that differs.
2. Ovi 2025's claims as ratios (analysis.claims: the report's table), when the runs needed
   are present.
3. With --published: for each JAX run, the published records of its model
   (analysis/baselines) with each mismatch named, or "no comparable record"
   (analysis.published). A run on CPU devices (simulated or not) is never set against a
   GPU figure.

Writes compare.md, compare.csv and (with a matched pair) compare.png under --out: a new or
empty folder, or one compare wrote before (its marker, .jaxdist-compare, lists its files:
only they are replaced); any other existing path is refused (analysis.outdir).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from analysis import claims, outdir, plots
from analysis.match import closest, group
from analysis.published import published_section
from analysis.runs import find_runs
from analysis.text import fmt_ratio, human_bytes, median, ms, num, ratio
from jaxdist.errors import OneLineParser, UsageError, path_arg
from jaxdist.record import RunRecord

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.compare",
                      description="Compare JAX runs with live PyTorch runs (experiments."
                                  "torch_run) and, with --published, with published figures.")
    p.add_argument("runs", nargs="+", metavar="RUNS", type=path_arg,
                   help="run directories (with results.json) or folders containing them")
    p.add_argument("--published", action="store_true",
                   help="also compare JAX runs with published records (analysis/baselines)")
    p.add_argument("--baselines", action="append", default=[], metavar="PATH",
                   type=path_arg,
                   help="extra baseline records: a .json/.toml file or a folder of them "
                        "(repeatable); implies --published")
    p.add_argument("--top", type=int, default=3,
                   help="published records shown per JAX run, closest first (default: 3)")
    p.add_argument("--out", default="", type=path_arg,
                   help="folder for compare.md, compare.csv and "
                   "compare.png: new, empty, or an earlier compare output (default: "
                   "runs/compare-<time>)")
    return p


def where(run: RunRecord) -> str:
    env = run.results["env"]
    if run.framework == "pytorch":
        t = run.results.get("torch", {})
        threads = t.get("threads_per_process", env.get("threads_per_process"))
        how = f"{env['num_processes']} processes ({t.get('backend', '?')}"
        return how + (f", {threads} thread(s) each)" if run.backend == "cpu" else ")")
    if run.simulated:
        return f"{env['num_devices']} simulated CPU devices in {env['num_processes']} " \
               f"process(es)"
    return f"{env['num_devices']} x {env['device_kind']}"


def protocol(run: RunRecord) -> str:
    return f"{run.cfg('loop', 'warmup')} warm-up + {run.cfg('loop', 'steps')} timed"


METRICS = {"p50": lambda r: r.step_p50, "p99": lambda r: r.step_p99,
           "samples_per_s": lambda r: r.samples_per_s, "peak": lambda r: r.peak,
           "state": lambda r: r.state_bytes, "energy": lambda r: r.energy_per_sample,
           "loss0": lambda r: r.loss[0] if r.loss else None}


@dataclass
class Side:
    """One framework's runs of one key, summarised (median over repeated runs)."""
    runs: list[RunRecord]

    @property
    def n(self):
        return len(self.runs)

    def value(self, metric: str):
        return median(map(METRICS[metric], self.runs))

    def peak_kind(self) -> str:
        kinds = {r.peak_basis for r in self.runs}
        return kinds.pop() if len(kinds) == 1 else "mixed"


def live_section(groups) -> tuple[list[str], list[dict], list[dict]]:
    """(markdown lines, csv rows, chart rows)."""
    lines = ["## JAX vs PyTorch (live, same machine)", "",
             "Matched on model, layout, devices, global batch, dtype, matmul precision, "
             "optimizer and backend. "
             "Times are medians over the runs of each side; ratios are JAX / PyTorch "
             "(throughput > 1: JAX faster; time and memory < 1: JAX smaller).", "",
             "| model | layout | devices | batch | dtype | framework | runs | step p50 (ms) | "
             "step p99 (ms) | samples/s | peak mem / device | state / device | "
             "energy / sample |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows, chart, notes = [], [], []
    for k in sorted(groups, key=str):
        sides = groups[k]
        if not (sides["jax"] and sides["pytorch"]):
            continue
        model, layout, devices, batch, dtype = k[:5]
        jax_s, pt_s = Side(sides["jax"]), Side(sides["pytorch"])
        head = f"| {model} | {layout} | {devices} | {batch} | {dtype} "
        base = {"section": "live", "model": model, "layout": layout, "devices": devices,
                "batch": batch, "dtype": dtype}
        for name, side in (("JAX", jax_s), ("PyTorch", pt_s)):
            peak, energy = side.value("peak"), side.value("energy")
            peak_text = human_bytes(peak) + (f" ({side.peak_kind()})" if peak is not None
                                             else f" ({_short(side.peak_kind())})")
            lines.append(head + f"| {name} | {side.n} | {ms(side.value('p50'), 1)} | "
                         f"{ms(side.value('p99'), 1)} | "
                         f"{num(side.value('samples_per_s'), '{:,.1f}')} | {peak_text} | "
                         f"{human_bytes(side.value('state'))} | "
                         f"{f'{energy:.3g} J' if energy is not None else 'not measured'} |")
            rows.append({**base, "framework": name, "runs": side.n,
                         "step_p50_s": side.value("p50"), "step_p99_s": side.value("p99"),
                         "samples_per_s": side.value("samples_per_s"),
                         "peak_bytes_per_device": peak, "peak_kind": side.peak_kind(),
                         "state_bytes_per_device": side.value("state"),
                         "energy_per_sample_j": energy})
        r = {m: ratio(jax_s.value(m), pt_s.value(m))
             for m in ("p50", "p99", "samples_per_s", "peak", "state", "energy")}
        peak_note = "" if jax_s.peak_kind() == pt_s.peak_kind() or r["peak"] is None \
            else " (different definitions)"
        # timing ratios of simulated devices are no performance figure: labelled, not bold
        sim = any(on_simulated_cpu(x) for x in jax_s.runs + pt_s.runs)
        bold, label = (("", f"JAX/PyTorch {SIMULATED_LABEL}") if sim
                       else ("**", "**JAX/PyTorch**"))
        lines.append(head + f"| {label} | | {bold}{fmt_ratio(r['p50'])}{bold} | "
                     f"{fmt_ratio(r['p99'])} | {bold}{fmt_ratio(r['samples_per_s'])}{bold} | "
                     f"{fmt_ratio(r['peak'])}{peak_note} | {fmt_ratio(r['state'])} | "
                     f"{fmt_ratio(r['energy'])} |")
        rows.append({**base, "framework": "JAX/PyTorch", "basis": SIMULATED_LABEL[1:-1]
                     if sim else "", "step_p50_s": r["p50"],
                     "step_p99_s": r["p99"], "samples_per_s": r["samples_per_s"],
                     "peak_bytes_per_device": r["peak"], "state_bytes_per_device": r["state"],
                     "energy_per_sample_j": r["energy"]})
        chart.append({"label": f"{model}\n{layout} x{devices}, b{batch}",
                      "jax": jax_s.value("samples_per_s"),
                      "pytorch": pt_s.value("samples_per_s"), "ratio": r["samples_per_s"],
                      "runs": jax_s.runs + pt_s.runs})
        j, p = jax_s.runs[0], pt_s.runs[0]
        extra = []
        if protocol(j) != protocol(p):
            extra.append(f"protocol differs: JAX {protocol(j)}, PyTorch {protocol(p)}")
        l0j, l0p = jax_s.value("loss0"), pt_s.value("loss0")
        if l0j is not None and l0p is not None:
            extra.append(f"first loss JAX {l0j:.4f}, PyTorch {l0p:.4f}")
        notes.append(f"- {model} {layout} x{devices}, matmul precision "
                     f"{j.matmul_precision}: JAX on {where(j)}; PyTorch on "
                     f"{where(p)}" + ("; " + "; ".join(extra) if extra else "") + ".")
    if not chart:
        lines.append("| (no JAX run matches a PyTorch run) | | | | | | | | | | | | |")
    return lines + [""] + notes, rows, chart


SIMULATED_LABEL = "(simulated CPU devices: functional, not a performance figure)"


def on_simulated_cpu(run: RunRecord) -> bool:
    """A JAX run whose mesh lived on host CPU devices (`env.simulated`; a record without the
    flag: backend cpu or --platform cpu)."""
    return run.simulated or (run.framework == "jax" and (
        run.backend == "cpu" or run.cfg("mesh", "platform") == "cpu"))


def _short(reason: str) -> str:
    return "n/a on CPU" if "CPU" in reason or "cpu" in reason else reason[:40]


def chart_where(chart: list[dict]) -> str:
    """The chart's note on where its runs ran, when not (only) on GPUs."""
    runs = [r for c in chart for r in c["runs"]]
    if any(r.simulated for r in runs):
        return "CPU, simulated devices: functional only, not a performance figure"
    return "CPU" if any(r.backend == "cpu" for r in runs) else ""


def unmatched_section(runs: list[RunRecord], groups) -> list[str]:
    lines = []
    for k in sorted(groups, key=str):
        sides = groups[k]
        if sides["jax"] and sides["pytorch"]:
            continue
        for fw, other_fw in (("jax", "pytorch"), ("pytorch", "jax")):
            for run in sides[fw]:
                best, diff = closest(run, [r for r in runs if r.framework == other_fw])
                name, other_name = ("JAX", "PyTorch") if fw == "jax" else ("PyTorch", "JAX")
                what = (f"{name} {run.model} {run.layout} x{run.devices} batch {run.batch} "
                        f"{run.dtype} ({run.path})")
                if best is None:
                    lines.append(f"- {what}: not comparable: no {other_name} run was given")
                else:
                    lines.append(f"- {what}: not comparable: the closest {other_name} run "
                                 f"({best.path}) differs: {'; '.join(diff)}")
    if lines:
        lines = ["## Runs without a counterpart (not compared)", ""] + lines + [""]
    return lines


def ovi_section(runs: list[RunRecord]) -> tuple[list[str], list[dict]]:
    """The report's table of Ovi 2025's claims (analysis.claims), over these runs."""
    rs, unlike = claims.ratios(runs), claims.unpaired(runs)
    if not rs and not unlike:
        return [], []
    rows = [{"section": "ovi", "model": r.model, "comparison": r.what, "settings": r.context,
             "ratio": r.value, "basis": r.basis, "verdict_v1": r.verdict("v1"),
             "verdict_v2": r.verdict("v2")} for r in rs]
    rows += [{"section": "ovi", "model": u.model, "comparison": u.what, "basis": u.text,
              "verdict_v1": "no ratio", "verdict_v2": "no ratio"} for u in unlike]
    return ["## Ovi 2025 claims as ratios", "",
            "Published on A100/A10G GPU clusters for CNNs at batch sizes not stated "
            f"(records {claims.claim_sources()}): shape checks, not like-for-like numbers. "
            "Every ratio is in the claim's direction (FSDP/DDP, async/sync).", "",
            *claims.ratio_lines(rs, unlike)], rows


CSV_FIELDS = ["section", "model", "layout", "devices", "batch", "dtype", "framework", "runs",
              "step_p50_s", "step_p99_s", "samples_per_s", "peak_bytes_per_device",
              "peak_kind", "state_bytes_per_device", "energy_per_sample_j", "record",
              "metric", "published", "unit", "ours", "verdict", "mismatches",
              "comparison", "settings", "ratio", "basis", "verdict_v1", "verdict_v2"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.top < 1:
            raise UsageError(f"--top must be at least 1, got {args.top}")
        from analysis import baselines
        records = baselines.load(args.baselines)  # bad records fail before any run is read
        runs = find_runs(args.runs)
        published = args.published or bool(args.baselines)
        groups = group(runs)
        live, rows, chart = live_section(groups)
        unmatched = unmatched_section(runs, groups)
        ovi, ovi_rows = ovi_section(runs)
        pub, pub_rows, pub_shown = (published_section(runs, records, args.top)
                                    if published else ([], [], 0))
        if not chart and not ovi and not pub_shown:
            raise UsageError(_nothing_to_compare(runs, published))
        out = Path(args.out) if args.out else Path("runs") / time.strftime(
            "compare-%Y%m%d-%H%M%S")
        outdir.check(out, COMPARE)  # refused before anything is printed or written
        title = ["# Cross-framework comparison", "",
                 f"{len(runs)} run(s): " + ", ".join(sorted(str(r.path) for r in runs)), ""]
        doc = title + (live if chart else []) + [""] + unmatched + ovi + pub
        text = "\n".join(doc).replace("\n\n\n", "\n\n").rstrip() + "\n"
        with outdir.staged(out, COMPARE) as tmp:
            (tmp / "compare.md").write_text(text)
            write_csv(tmp / "compare.csv", rows + ovi_rows + pub_rows)
            if chart:  # a plot of JAX / PyTorch pairs, only where there is one
                plots.throughput_chart(tmp / "compare.png", chart, chart_where(chart))
    except UsageError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(text)
    written = ["compare.md", "compare.csv"] + (["compare.png"] if chart else [])
    print("written: " + ", ".join(str(out / name) for name in written) +
          ("" if chart else " (no compare.png: no matched JAX / PyTorch pair to plot)"))
    return 0


# What compare writes under --out; the marker lists it, so only that is ever replaced.
COMPARE = outdir.Tool("compare", ".jaxdist-compare", legacy_index="compare.md",
                      legacy_first_line="# Cross-framework comparison",
                      legacy_names=frozenset(["compare.md", "compare.csv", "compare.png"]))


def _nothing_to_compare(runs, published) -> str:
    jax = [r for r in runs if r.framework == "jax"]
    torch = [r for r in runs if r.framework == "pytorch"]
    if not torch and not published:
        return ("no PyTorch run among RUNS to compare with (make one with "
                "python -m experiments.torch_run, or add --published)")
    if not jax:
        return "no JAX run among RUNS (make one with python -m experiments.run)"
    if published:
        return ("no JAX run matches a PyTorch run, and no comparable published record: none "
                "of the JAX runs' models" if torch else "no comparable published record: "
                "none of the JAX runs' models (published records of other models are never "
                "lined up)")
    run = jax[0]
    best, diff = closest(run, torch)
    return (f"no JAX run matches a PyTorch run: e.g. {run.path} vs the closest, {best.path}: "
            f"{'; '.join(diff)}")


if __name__ == "__main__":
    sys.exit(main())
