"""The ranking of a suite's predicted plans (`experiments.suite --plan`): every row's
plan.json, ranked per model by predicted tokens/s per GPU, with the step broken down into
stacked bars: compute (or HBM, whichever bounds the device), exposed communication by link
(intra-node, inter-node) and the pipeline bubble. Everything here is PREDICTED and is kept
apart from the measured tables of analysis.report (no plan is ever read as a run).

`python -m analysis.plan_rank DIR` rewrites DIR/ranking.{json,md,png} from DIR/*/plan.json.
Imports no jax.
"""

from __future__ import annotations

import json
import sys
from argparse import ArgumentTypeError
from pathlib import Path
from typing import TypedDict

from analysis.text import GiB, md_escape
from jaxdist.errors import UsageError, path_arg

LABEL = "PREDICTED"


def bars(plan: dict) -> dict[str, float]:
    """The step's stacked terms in seconds, jaxdist.predict.time_model's TIME_TERMS in order
    (they add up to the predicted step): plan.json's `time.terms`; a plan.json without them
    (an older one) read as the roofline reads its device time, compute- or memory-bound."""
    from jaxdist.plan_words import TIME_TERMS, TimeTerms, roofline_terms

    t = plan["time"]
    if "terms" in t:
        terms = TimeTerms(**t["terms"])
    else:
        device = t.get("device_s", max(t["compute_s"], t["hbm_s"]))
        if "exposed_intra_node_s" in t:
            exposed = {"intra-node": t["exposed_intra_node_s"],
                       "inter-node": t["exposed_inter_node_s"]}
        else:  # no split by link: share the exposed part by link
            total = t["intra_node_s"] + t["inter_node_s"]
            share = t["comm_exposed_s"] / total if total else 0.0
            exposed = {"intra-node": t["intra_node_s"] * share,
                       "inter-node": t["inter_node_s"] * share}
        terms = roofline_terms(t["compute_s"], t["hbm_s"], device, exposed,
                               t.get("bubble_s", 0.0))
    return dict(zip(TIME_TERMS, (s for _, s in terms.seconds())))


class PlanRow(TypedDict):
    """A plan.json as its readers see it (ranking.json's rows are these, as JSON)."""
    name: str                     # the suite row's folder
    model: str
    layout: str
    hardware: str | None          # the part it was predicted for
    mesh: str                     # axes over 1, `data:4,fsdp:8` ("1": one device)
    schedule: str | None          # pipeline layouts only, as are microbatches and bubble
    microbatches: int | None
    batch_size: int
    step_s: float
    tokens_per_s_per_gpu: float | None
    mfu: float
    memory_gib: float             # per device
    fits: bool | None             # None: unknown (an estimate over HBM)
    bottleneck: str
    bars: dict                    # bars(): the step's stacked terms, seconds
    label: str                    # always "predicted"
    bubble: float | None          # idle share of the schedule's ticks
    runtime: str | None           # the pipeline runtime the step was predicted under
    step_by_runtime: dict | None  # {"jaxdist": s, "megatron": s}: the sends, tail included
    link_busy: float              # share of the step the busiest link carries traffic
    power: dict | None            # plan.json's `power` block where it predicts power
    energy_per_step_j: float | None  # per GPU, from `power`


def row(name: str, plan: dict) -> PlanRow:
    """The one reader of a plan.json (the ranking and analysis.go2025 read its rows): what
    the plan says, flat, labelled predicted."""
    t, m, thr = plan["time"], plan["memory"], plan["throughput"]
    pp = plan.get("pipeline") or {}
    return PlanRow(
        name=name, model=plan["model"]["name"], layout=plan["layout"],
        hardware=(plan.get("hardware") or {}).get("name"),
        mesh=",".join(f"{k}:{v}" for k, v in plan["mesh"].items() if v > 1) or "1",
        schedule=pp.get("schedule"), microbatches=pp.get("microbatches"),
        batch_size=plan["batch_size"], step_s=t["step_s"],
        tokens_per_s_per_gpu=thr["tokens_per_s_per_gpu"], mfu=thr["mfu"],
        memory_gib=m["total_bytes"] / GiB, fits=m["fits"], bottleneck=t["bottleneck"],
        bars=bars(plan), label="predicted", bubble=pp.get("bubble_fraction_of_ticks"),
        runtime=pp.get("runtime"),
        # the step under each pipeline runtime (the sends and the tail included)
        step_by_runtime=None if "lockstep_s" not in pp else {
            "jaxdist": pp["lockstep_s"] + pp["tail_s"],
            "megatron": pp["dataflow_s"] + pp["tail_s"]},
        link_busy=max(t["intra_node_s"], t["inter_node_s"]) / t["step_s"]
        if t["step_s"] else 0.0,
        power=plan["power"] if "gpu_avg_w" in (plan.get("power") or {}) else None,
        energy_per_step_j=(plan.get("power") or {}).get("energy_per_step_j"))


def read_rows(directory: Path) -> list[PlanRow]:
    """The rows of DIR/*/plan.json (the folder names them); a file that is not a plan
    jaxdist wrote is one UsageError naming it (it was a KeyError traceback)."""
    rows = []
    for path in sorted(Path(directory).glob("*/plan.json")):
        try:
            rows.append(row(path.parent.name, json.loads(path.read_text())))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError,
                AttributeError) as e:
            why = f"no {e.args[0]!r} field" if isinstance(e, KeyError) else \
                str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(f"{path} is not a plan jaxdist wrote ({why})") from None
    return rows


def plan_dir(text: str) -> Path:
    """A suite --plan output folder given on the command line: one holding */plan.json."""
    try:
        directory = Path(path_arg(text))
    except ArgumentTypeError as e:  # a name too long, a symlink loop
        raise UsageError(str(e)) from None
    if not directory.is_dir():
        raise UsageError(f"{text} is not a directory (give a suite --plan output folder)")
    if not any(directory.glob("*/plan.json")):
        raise UsageError(f"no */plan.json in {text}: not a suite --plan output folder "
                         f"(experiments.suite --plan --out DIR)")
    return directory


def rank(rows: list[PlanRow]) -> dict[str, list[PlanRow]]:
    """Rows grouped by model, each group best first: rows that do not fit (OOM) last, then
    predicted tokens/s per GPU (step time where a model has no tokens)."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["model"], []).append(r)
    for group in out.values():
        group.sort(key=lambda r: (r["fits"] is False, -(r["tokens_per_s_per_gpu"] or 0),
                                  r["step_s"]))
    return out


def energy_ranks(rows: list[PlanRow]) -> dict[str, int]:
    """Each row's rank by predicted energy per step (least first) among the rows of its
    model that fit and predict power."""
    ranked = sorted((r for r in rows if r["energy_per_step_j"] is not None and
                     r["fits"] is not False), key=lambda r: r["energy_per_step_j"])
    return {r["name"]: i for i, r in enumerate(ranked, 1)}


def parts_of(ranked: dict[str, list[PlanRow]]) -> str | None:
    """The part(s) the rows were predicted for, as every plan.json records it."""
    parts = sorted({r["hardware"] for rows in ranked.values() for r in rows if r["hardware"]})
    return ", ".join(parts) or None


def write_ranking(directory: Path, meta: dict | None = None) -> dict:
    """ranking.json, ranking.md and ranking.png in `directory` from its */plan.json."""
    directory = Path(directory)
    ranked = rank(read_rows(directory))
    hardware = (meta or {}).get("hardware") or parts_of(ranked)
    ranking = {"label": "predicted", "meta": meta or {}, "models": ranked}
    (directory / "ranking.json").write_text(json.dumps(ranking, indent=1))
    (directory / "ranking.md").write_text(format_ranking(ranking, markdown=True) + "\n")
    if ranked:
        plot_ranking(ranked, directory / "ranking.png", hardware)
    return ranking


def _fits(f) -> str:
    return {True: "yes", False: "OOM"}.get(f, "?")


def format_ranking(ranking: dict, markdown: bool = False) -> str:
    """One table per model, best first; every figure predicted."""
    from jaxdist.plan_words import MEMORY_RULE

    meta = ranking.get("meta", {})
    hardware = meta.get("hardware") or parts_of(ranking["models"]) or "?"
    lines = [f"{LABEL} (not measured) on {hardware}: ranked by predicted "
             f"tokens/s per GPU; the step split into compute, memory-bound kernels, launches, "
             f"exposed communication by link (intra, inter) and the bubble (seconds); "
             f"predicted power per GPU, energy per step per GPU and the rank by energy. "
             f"GiB/dev and fits: {MEMORY_RULE}"]
    head = ["rank", "run", "mesh", "schedule", "GiB/dev", "fits", "step s", "tok/s/GPU",
            "MFU", "compute", "mem-bound", "launch", "intra", "inter", "bubble", "bottleneck",
            "W/GPU", "kJ/step", "energy rank"]
    for model, rows in ranking["models"].items():
        lines.append("")
        lines.append(f"{'### ' if markdown else ''}{model} ({LABEL})")
        table = []
        energy = energy_ranks(rows)
        for i, r in enumerate(rows, 1):
            b, power = r["bars"], r["power"] or {}
            sched = f"{r['schedule']} M={r['microbatches']}" if r["schedule"] else "-"
            table.append([str(i), r["name"], r["mesh"], sched, f"{r['memory_gib']:.1f}",
                          _fits(r["fits"]), f"{r['step_s']:.2f}",
                          f"{r['tokens_per_s_per_gpu'] or 0:,.0f}", f"{r['mfu']:.1%}",
                          *(f"{s:.2f}" for s in b.values()), r["bottleneck"],
                          f"{power['gpu_avg_w']:.0f}" if power else "-",
                          f"{power['energy_per_step_j'] / 1e3:,.1f}" if power else "-",
                          str(energy.get(r["name"], "-"))])
        if markdown:
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            lines += ["| " + " | ".join(md_escape(c) for c in t) + " |" for t in table]
        else:
            widths = [max(len(x) for x in col) for col in zip(head, *table)]
            for t in [head] + table:
                lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    if meta.get("compilers"):
        lines += ["", f"programs compiled by: {'; '.join(meta['compilers'])}"]
    if meta.get("wall_s") is not None:
        lines += ["", f"predicted {meta.get('rows')} rows in {meta['wall_s']:.0f} s of wall "
                      f"time here ({meta.get('compiles')} XLA compiles)"]
    return "\n".join(lines)


def plot_ranking(ranked: dict[str, list[dict]], path: Path, hardware: str | None) -> None:
    """Stacked horizontal bars, one panel per model (their steps differ by orders of
    magnitude), best at the top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = sum(len(v) for v in ranked.values())
    fig, axes = plt.subplots(len(ranked), 1, figsize=(9, 0.42 * n + 1.6 * len(ranked)),
                             squeeze=False, gridspec_kw={"height_ratios": [
                                 len(v) + 2 for v in ranked.values()]})
    from jaxdist.plan_words import TIME_TERMS

    colours = dict(zip(TIME_TERMS, ("#4c72b0", "#55a868", "#937860", "#dd8452", "#c44e52",
                                    "#8c8c8c")))
    for ax, (model, rows) in zip(axes[:, 0], ranked.items()):
        names = [f"{r['name']} ({_fits(r['fits'])})" for r in rows][::-1]
        left = [0.0] * len(rows)
        for term in TIME_TERMS:
            widths = [r["bars"][term] for r in rows][::-1]
            label = f"exposed comm, {term}" if term.endswith("-node") else term
            ax.barh(names, widths, left=left, color=colours[term], label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_title(f"{model}: {LABEL} step time on {hardware or '?'} (not measured)",
                     fontsize=9)
        ax.set_xlabel("predicted seconds per step")
        ax.tick_params(axis="y", labelsize=7)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m analysis.plan_rank DIR (a suite --plan output directory)",
              file=sys.stderr)
        return 2
    try:
        directory = plan_dir(args[0])
        read_rows(directory)  # every plan readable before anything is written
        old = directory / "ranking.json"
        meta = _earlier_meta(old) if old.exists() else None
    except UsageError as e:
        print(f"plan_rank: error: {e}", file=sys.stderr)
        return 2
    print(format_ranking(write_ranking(directory, meta)))
    return 0


def _earlier_meta(path: Path) -> dict:
    """The meta block of the ranking.json a suite wrote, kept on a rewrite; any other file
    of that name is not replaced."""
    try:
        meta = json.loads(path.read_text())["meta"]
        if isinstance(meta, dict):
            return meta
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        pass
    raise UsageError(f"{path} is not a ranking plan_rank wrote; move it aside to write one")


if __name__ == "__main__":
    sys.exit(main())
