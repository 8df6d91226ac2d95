"""Study report: `python -m experiments.report RUNS_DIR [--out DIR]`.

Reads every run below RUNS_DIR (each a directory with results.json and TensorBoard events, as
`experiments.run` and `experiments.suite` write them) and the suite's suite.json when there
is one, and writes DIR/report.md with PNG figures beside it (analysis.plots):

- step_times.png   per-step latency distribution per layout (box plots of the timed steps'
                   `train/step_time_s` TensorBoard scalars; repeats pooled)
- memory.png       per-device memory per layout, linear, values on the bars: train-state
                   shard bytes, the compiler's allocation bound, the measured peak where the
                   backend reports one
- energy.png       energy per sample, where power was measured
- accuracy.png     test accuracy against wall time, parameter-server modes and DDP
- comm.png         collective bytes per step by kind, where the run recorded `comm`

and one table over all runs, Ovi 2025's claims as ratios (analysis.claims; timing ratios from
simulated devices labelled as such), every layout against ddp, and the runs that failed or did not finish (by name: a
run directory without results.json, or one with status "interrupted"). The report is built
in a temporary directory and renamed into place, so a bad input leaves nothing half-written.
DIR must be new, empty, or an earlier report (its marker, .jaxdist-report, lists the files
it wrote: only they are replaced); a user's folder, a run directory or a file is refused
(analysis.outdir).
Contents: docs/suite.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis import claims, outdir, plots
from analysis.runs import Failure, collect, layout_rank
from analysis.text import human_bytes, md_escape, median, ms, num
from jaxdist.errors import OneLineParser, UsageError, path_arg


def variant_lines(runs) -> list[str]:
    """Each variant (remat, micro-batches, ...) against the base run of the same model,
    layout and settings: step time, peak memory and energy per sample as ratios."""
    groups: dict[tuple, dict[str, list]] = {}
    for r in runs:
        # like with like but for the variant: same layout, mesh and every setting
        key = (r.layout_mode, r.mesh, *claims.compare_key(r, without="variant"))
        groups.setdefault(key, {}).setdefault(r.variant or "base", []).append(r)
    rows = []
    for key, by in sorted(groups.items(), key=lambda kv: (str(kv[0][2]),
                                                          layout_rank(kv[0][0]),
                                                          str(kv[0][1:]))):
        if "base" not in by or len(by) < 2:
            continue
        base = by["base"]
        for variant, rs in sorted(by.items()):
            if variant == "base":
                continue
            sim = " (simulated)" if any(r.simulated for r in rs + base) else ""

            def rel(get):
                b, v = median(map(get, base)), median(map(get, rs))
                return f"{v / b:.3f}" if b and v is not None else "n/a"

            basis = "measured" if all(r.measured_peak is not None for r in rs + base) \
                else "compiler bound"
            rows.append(f"| {md_escape(base[0].model)} | {key[0]} | {key[1]} | {variant} | "
                        f"{rel(lambda r: r.step_p50)}{sim} | "
                        f"{rel(lambda r: r.samples_per_s)}{sim} | "
                        f"{rel(lambda r: r.peak)} ({basis}) | "
                        f"{rel(lambda r: r.energy_per_sample)} |")
    if not rows:
        return []
    return ["## Variants against base", "",
            "Each variant's median over repeats divided by the base run's (same layout, "
            f"mesh, {claims.key_labels(without='variant')}).", "",
            "| model | layout | mesh | variant | step p50 / base | samples/s / base | "
            "peak memory / base | energy per sample / base |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def layout_ratios(runs) -> list[dict]:
    """Every layout against ddp, runs alike in everything but the layout (claims.compare_key:
    same model, batch, devices, ...): medians over repeats, each figure / ddp's."""
    out = []
    for key, by in sorted(claims._groups(runs).items(), key=lambda kv: str(kv[0])):
        ddp = by.get("ddp")
        if not ddp:
            continue
        for side in sorted((s for s in by if s != "ddp"), key=layout_rank):
            rs = by[side]
            basis, peak = claims._memory_basis(ddp + rs)

            def rel(get):
                d, v = median(map(get, ddp)), median(map(get, rs))
                return v / d if d and v is not None else None

            out.append({"layout": side, "model": rs[0].model, "context": claims._context(rs[0]),
                        "simulated": any(r.simulated for r in ddp + rs),
                        "step": rel(lambda r: r.step_p50),
                        "throughput": rel(lambda r: r.samples_per_s),
                        "memory": rel(peak), "memory_basis": basis,
                        "state": rel(lambda r: r.state_bytes),
                        "energy": rel(lambda r: r.energy_per_sample)})
    return out


def layout_lines(ratios: list[dict]) -> list[str]:
    if not ratios:
        return []

    def f(v):
        return "n/a" if v is None else f"{v:.3f}"

    rows = [f"| {md_escape(r['model'])} | {md_escape(r['layout'])} | {md_escape(r['context'])} "
            f"| {f(r['step'])}{' (simulated)' if r['simulated'] else ''} | "
            f"{f(r['throughput'])} | {f(r['memory'])} ({r['memory_basis'].split(' (')[0]}) | "
            f"{f(r['state'])}{PS_STATE if r['layout'].startswith('ps') else ''} | "
            f"{f(r['energy'])} |" for r in ratios]
    return ["## Every layout against DDP", "",
            "Each layout's median over repeats divided by DDP's, runs alike in everything "
            f"but the layout ({claims.key_labels()}).", "",
            "| model | layout | runs | step p50 / DDP | samples/s / DDP | memory / DDP | "
            "train state / DDP | energy per sample / DDP |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


# A ps worker holds the parameters only; beside ddp's figure (parameters and optimizer
# state) it would read as a saving the servers pay for.
PS_STATE = " (a worker's parameters; optimizer state on the servers)"


def pipeline_lines(runs) -> list[str]:
    """Pipeline runs side by side: schedule, bubble (counted from the table as executed, and
    the analytic formula) and the bytes stages send each other per step."""
    rows = []
    for r in runs:
        pp = r.results.get("pipeline")
        if not pp:
            continue
        sb = pp.get("stage_bytes") or {}
        rows.append(
            f"| {md_escape(r.name)} | {md_escape(r.bar)} | {pp['schedule']}"
            f"{' combined' * bool(pp.get('combined_f_back'))} | "
            f"{pp['stages']} | {pp.get('virtual', 1)} | {pp['microbatches']} | "
            f"{pp['bubble']:.1%} | {pp['analytic_bubble']:.1%} "
            f"{md_escape(pp.get('analytic_bubble_formula', ''))} | "
            f"{human_bytes(sb.get('total'))} | {human_bytes(sb.get('analytic'))} | "
            f"{human_bytes((pp.get('memory') or {}).get('activation_stash_bytes'))} |")
    if not rows:
        return []
    return ["## Pipeline: bubble and stage bytes", "",
            "Bubble: idle stage time over all stage time (F-units), counted from the "
            "schedule table "
            "as executed, beside the analytic formula. Stage bytes: what the stages send "
            "each other per step (activations forward, gradients backward), from the "
            "compiled HLO, a device of each stage summed, beside the analytic volume "
            "(`pipeline` in results.json).", "",
            "| run | run as | schedule | S | V | M | bubble | analytic | stage bytes/step | "
            "analytic | activation stash |", "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows, ""]


def ps_transport(results: dict) -> str:
    """What carried a PS run's bytes (ps.collect.carried_by); a record from before it was
    measured names only the transport it was set to."""
    ps = results.get("ps") or {}
    if ps.get("carried_by"):
        return ps["carried_by"]
    return "gRPC" if ps.get("transport", "grpc") == "grpc" else "TCP data ports or gRPC"


def comm_left_out(runs) -> list[str]:
    """The runs comm.png leaves out, and why (it dropped parameter-server runs silently)."""
    by: dict[str, set[str]] = {}
    for r in runs:
        why = (f"parameter server: gradients and parameters go to the shard servers over "
               f"{ps_transport(r.results)}, not XLA collectives; its bytes per step are in "
               f"the table below"
               if r.out_of_process else r.results.get("comm_reason") or "no `comm` recorded")
        by.setdefault(why, set()).add(r.group)
    return [f"Left out of the figure: {md_escape(', '.join(sorted(groups)))} ({md_escape(why)})."
            for why, groups in sorted(by.items())] + ([""] if by else [])


def energy_reasons(runs) -> list[str]:
    """Why energy is missing, one line per reason with the runs it applies to."""
    by: dict[str, list[str]] = {}
    for r in runs:
        reason = (r.results.get("power") or {}).get("reason", "not measured")
        by.setdefault(reason, []).append(r.group)
    return ["Not measured in any run:", ""] + [
        f"- {md_escape(reason)}: {len(groups)} run{'s' if len(groups) > 1 else ''} "
        f"({md_escape(', '.join(sorted(set(groups))))})" for reason, groups in sorted(by.items())
    ] + [""]


def runs_table(runs) -> list[str]:
    lines = ["| run | layout | model | mesh | batch | step p50 (ms) | step p99 (ms) | "
             "samples/s | state/device | compiler bound | measured peak | energy (J/sample) | "
             "final accuracy |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        acc = r.final_accuracy
        lines.append(
            f"| {md_escape(r.name)} | {md_escape(r.group)} | {md_escape(r.model)} | "
            f"{r.mesh} | {r.batch if r.batch is not None else 'n/a'} | {ms(r.step_p50)} | "
            f"{ms(r.step_p99)} | {num(r.samples_per_s, '{:.1f}')} | "
            f"{human_bytes(r.state_bytes)}{PS_STATE if r.out_of_process else ''} | "
            f"{human_bytes(r.compiled_bound)} | "
            f"{human_bytes(r.measured_peak)} | {num(r.energy_per_sample, '{:.4g}')} | "
            f"{'n/a' if acc is None else f'{acc:.1%}'} |")
    lines.append("")
    return lines


def comm_lines(runs) -> list[str]:
    rows = []
    for r in runs:
        comm = r.results.get("comm")
        ps_bytes = (r.results.get("ps") or {}).get("bytes_per_step")
        if not comm and ps_bytes:
            rows.append(f"| {md_escape(r.name)} | {md_escape(r.group)} | "
                        f"{md_escape(ps_transport(r.results))} push "
                        f"{human_bytes(ps_bytes.get('push'))}, pull "
                        f"{human_bytes(ps_bytes.get('pull'))} per step, all workers "
                        f"(`ps.bytes_per_step`) | host network | n/a |")
        if not comm:
            continue
        kinds = ", ".join(f"{k} {human_bytes(v.get('bytes'))} ({v.get('count', '?')})"
                          for k, v in (comm.get("by_kind") or {}).items()) or "none"
        axes = ", ".join(f"{k} {human_bytes(v.get('bytes'))}"
                         for k, v in (comm.get("by_axis") or {}).items()) or "none"
        rows.append(f"| {md_escape(r.name)} | {md_escape(r.group)} | {kinds} | {axes} | "
                    f"{human_bytes(comm.get('total_ring_bytes'))} |")
    if not rows:
        return []
    return ["| run | layout | by kind (bytes, ops) | by mesh axis | ring estimate |",
            "|---|---|---|---|---|", *rows, ""]


CAPTIONS = {
    "step_times.png": ("Step-time distribution per layout",
                       "Box plots of every timed step's latency (TensorBoard "
                       "`train/step_time_s`, warm-up excluded; repeats pooled): box = "
                       "quartiles, line = median, whiskers 1.5 IQR, points = outliers."),
    "memory.png": ("Memory per device per layout",
                   "Train-state shard bytes (`memory.state_bytes_per_device`), the compiler's "
                   "allocation bound (`memory.compiled.peak_bytes`: argument + output - alias "
                   "+ temp, an upper bound, not a measured peak) and the measured peak "
                   "(`memory.measured_peak_bytes`, where the backend reports one); linear "
                   "scale, each bar's value written on it. A parameter-server run's train "
                   "state is a worker's parameters: its optimizer state is on the servers."),
    "energy.png": ("Energy per sample", "`power.energy_per_sample_j` of runs with power "
                                        "telemetry."),
    "accuracy.png": ("Accuracy against wall time (parameter server and DDP)",
                     "Test accuracy at each evaluation against wall time since the first "
                     "step (`accuracy[].wall_s`)."),
    "comm.png": ("Collective bytes per step by kind",
                 "From the optimized HLO (`comm.by_kind`), per device per step."),
}
FIGURE_RUNS = {"step_times.png": lambda r: bool(r.step_times),
               "energy.png": lambda r: r.energy_per_sample is not None,
               "accuracy.png": lambda r: r.replicated and bool(r.accuracy),
               "comm.png": lambda r: (r.results.get("comm") or {}).get("by_kind") is not None}
ABSENT = {"accuracy.png": "No DDP or parameter-server run evaluated accuracy (use a real "
                          "dataset with `--eval-every N`).",
          "comm.png": "No run recorded collectives (`comm`).",
          "step_times.png": "No per-step data."}


def figure_lines(runs, figures) -> list[str]:
    lines = []
    for name, (title, text) in CAPTIONS.items() if runs else ():
        lines += [f"## {title}", ""]
        if name in figures:
            mixed = plots.mixed_settings([r for r in runs if FIGURE_RUNS.get(name, bool)(r)])
            if mixed:
                text += f" The runs shown differ in settings: {md_escape(mixed)}."
            lines += [text, "", f"![{title}]({name})", ""]
        elif name == "energy.png":
            lines += energy_reasons(runs)
        else:
            lines += [ABSENT[name], ""]
        if name == "comm.png":
            lines += comm_left_out([r for r in runs if not FIGURE_RUNS[name](r)])
            lines += comm_lines(runs)
    return lines


def build_markdown(root: Path, runs, failures, problems, meta, figures, rs, unlike=()) -> str:
    sim = [r for r in runs if r.simulated]
    lines = ["# Study report", "",
             f"Runs from `{root}`" + (f" (suite preset `{meta.get('preset')}`"
                                     f"{', quick' if meta.get('quick') else ''})"
                                     if meta.get("preset") else "") +
             f"; {len(runs)} finished, {sum(f.status == 'failed' for f in failures)} failed, "
             f"{sum(f.status != 'failed' for f in failures)} not finished. "
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    if sim:
        lines += [f"**{len(sim)} of {len(runs)} runs ran on simulated devices** (`env.simulated`:"
                  f" the mesh on host CPU devices sharing the host's cores): their step times, "
                  f"throughput, accuracy-vs-time and every timing ratio are functional only, "
                  f"not performance figures. Memory figures (shard bytes, compiler bound) "
                  f"are exact.", ""]
    lines += ["## Ovi 2025 comparisons as ratios", "",
              "Published figures are the abstracts' claims (arXiv 2505.12832 v1 May 2025, v2 "
              "Jan 2026; A100 and A10G clusters, CNNs on CIFAR-10/MNIST, batch sizes not "
              "published; records " + claims.claim_sources() + "): a shape check, not a "
              "like-for-like number. v1's \">60%\" and v2's \"4-6x\" memory claims disagree "
              "and are kept apart. A ratio pairs runs alike in everything but the layout: "
              f"{claims.key_labels()}. Repeats: median. \"within\"/\"outside\": whether "
              "this study's ratio falls in the claim's range.", "", *claims.ratio_lines(rs, unlike)]
    lines += ["## All runs", "", *runs_table(runs)]
    lines += layout_lines(layout_ratios(runs))
    lines += variant_lines(runs)
    lines += pipeline_lines(runs)
    lines += figure_lines(runs, figures)
    missing = [r.name for r in runs if not r.step_times]
    if missing:
        lines += [f"Runs without per-step TensorBoard times (left out of the box plots): "
                  f"{', '.join(missing)}.", ""]
    lines += ["## Failed and unfinished runs", ""]
    if failures:
        lines += ["| run | status | reason |", "|---|---|---|"]
        lines += [f"| {md_escape(f.name)} | {f.status} | {md_escape(f.reason)} |"
                  for f in failures]
        lines.append("")
        for f in failures:
            if f.stderr_tail:
                tail = "\n".join(f.stderr_tail.splitlines()[-8:])
                lines += [f"`{f.name}` stderr (tail):", "", "```", tail, "```", ""]
    else:
        lines += ["None.", ""]
    if problems:
        lines += ["## Unreadable files", "", *[f"- {md_escape(p)}" for p in problems], ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.report",
                      description="Markdown report with figures from a directory of runs "
                                  "(an experiments.suite --out directory, or any folder of "
                                  "run directories).")
    p.add_argument("runs", metavar="RUNS_DIR", type=path_arg,
                   help="directory holding run directories")
    p.add_argument("--out", default=None, type=path_arg,
                   help="report directory: new, empty, or an earlier report, whose files "
                        "alone are replaced (default: RUNS_DIR/report)")
    return p


REPORT = outdir.Tool("report", ".jaxdist-report", legacy_index="report.md",
                     legacy_first_line="# Study report",
                     legacy_names=frozenset(["report.md", *(n for n, _ in plots.REPORT_FIGURES)]))


def write_report(root: Path, out: Path) -> tuple[Path, list, list, list[Failure], list]:
    """Write the report into `out`: a new path, an empty folder, or an earlier report (its
    marker lists what it wrote, and only that is replaced); anything else is refused before
    anything is read or written (analysis.outdir)."""
    outdir.check(out, REPORT)
    runs, failures, problems, meta = collect(root, skip=out)
    with outdir.staged(out, REPORT) as tmp:
        import matplotlib
        matplotlib.use("Agg")
        figures = {name for name, plot in plots.REPORT_FIGURES
                   if runs and plot(runs, tmp / name)}
        rs = claims.ratios(runs)
        unlike = claims.unpaired(runs)
        (tmp / "report.md").write_text(build_markdown(root, runs, failures, problems, meta,
                                                      figures, rs, unlike))
    return out / "report.md", rs, runs, failures, unlike


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.runs)
    out = Path(args.out) if args.out else root / "report"
    try:
        report, rs, runs, failures, unlike = write_report(root, out)
    except UsageError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs, {sum(f.status == 'failed' for f in failures)} failed, "
          f"{sum(f.status != 'failed' for f in failures)} not finished")
    for r in rs:
        sim = " [simulated devices: functional only]" if r.timing and r.simulated else ""
        print(f"  {r.what:<30} {r.model:<14} {r.shown}{sim}   "
              f"(Ovi v1: {claims.shown(r.kind, 'v1')[0]}; v2: {claims.shown(r.kind, 'v2')[0]})")
    for u in unlike:
        print(f"  {u.what:<30} {u.model:<14} {u.text}")
    for r in layout_ratios(runs):
        sim = " [simulated devices: functional only]" if r["simulated"] else ""
        figures = "; ".join(f"{what} {r[k]:.3f}" for what, k in (
            ("step p50", "step"), ("samples/s", "throughput"), ("memory", "memory"))
            if r[k] is not None)
        print(f"  {r['layout'] + '/ddp':<30} {r['model']:<14} {figures}{sim}")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
