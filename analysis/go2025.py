"""Go et al. 2025's grid as the plan predicts it, set beside their published findings
(docs/go2025.md): the ranking per cluster and variant, 1F1B against GPipe per pipeline row
as jaxdist runs it (its tick loop) and as Megatron's dataflow runtime would (a what-if), and
for each finding what the plan predicts and whether it agrees. Everything read here is PREDICTED.

    python -m analysis.go2025 H200_DIR H100_DIR > docs/go2025-tables.md

H200_DIR, H100_DIR: outputs of `experiments.suite --preset go2025 --plan --hardware h200`
(and `h100-sxm`). Imports no jax.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from analysis.plan_rank import plan_dir, read_rows
from analysis.text import md_escape
from jaxdist.errors import UsageError

VARIANTS = ("base", "recompute", "overlap", "both")


def split_name(name: str, model: str) -> tuple[str, str, str | None]:
    """(entry, variant, schedule) of a plan row named MODEL-ENTRY-VARIANT[-SCHEDULE]."""
    rest = name[len(model) + 1:]
    parts = rest.split("-")
    sched = parts.pop() if parts[-1] in ("1f1b", "gpipe", "interleaved", "zb-h1") else None
    variant = parts.pop() if parts and parts[-1] in VARIANTS else "base"
    return "-".join(parts), variant, sched


def rows_of(directory: Path) -> list[dict]:
    out = read_rows(directory)
    for r in out:
        r["entry"], r["variant"], _ = split_name(r["name"], r["model"])
    return out


def best(rows: list[dict], model: str, variant: str | None = None) -> dict | None:
    """The fastest row of a model (and variant, None: any) that fits in HBM."""
    fit = [r for r in rows if r["model"] == model and variant in (None, r["variant"]) and
           r["fits"] is True]
    return min(fit, key=lambda r: r["step_s"]) if fit else None


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
            ["| " + " | ".join(md_escape(c) for c in b) + " |" for b in body])


def grid_table(rows: list[dict]) -> list[str]:
    body = []
    for r in sorted(rows, key=lambda r: (r["model"], r["variant"], not r["fits"],
                                         r["step_s"])):
        sched = f"{r['schedule']} M={r['microbatches']}" if r["schedule"] else "-"
        bubble = "-" if r["bubble"] is None else f"{r['bubble']:.1%}"
        body.append([r["model"], r["variant"], r["entry"], r["mesh"], sched, bubble,
                     f"{r['memory_gib']:.1f}", {True: "yes", False: "OOM"}.get(r["fits"], "?"),
                     f"{r['step_s']:.2f}", f"{r['tokens_per_s_per_gpu'] or 0:,.0f}",
                     f"{r['mfu']:.1%}", r["bottleneck"]])
    return _table(["model", "variant", "row", "mesh", "schedule", "bubble", "GiB/dev", "fits",
                   "step s", "tok/s/GPU", "MFU", "bottleneck"], body)


def schedule_pairs(rows: list[dict]) -> list[dict]:
    """Each pipeline row's 1F1B and GPipe twins: step under both runtimes, memory."""
    twins: dict[tuple, dict] = {}
    for r in rows:
        if r["schedule"] in ("1f1b", "gpipe") and r["step_by_runtime"]:
            twins.setdefault((r["model"], r["entry"], r["variant"]), {})[r["schedule"]] = r
    out = []
    for (model, entry, variant), pair in sorted(twins.items()):
        if len(pair) == 2:
            o, g = pair["1f1b"], pair["gpipe"]
            out.append({"model": model, "entry": entry, "variant": variant,
                        **{f"{s}_{rt}": pair[s]["step_by_runtime"][rt] for s in pair
                           for rt in ("jaxdist", "megatron")},
                        "1f1b_gib": o["memory_gib"], "gpipe_gib": g["memory_gib"]})
    return out


def pairs_table(pairs: list[dict]) -> list[str]:
    body = [[p["model"], p["entry"], p["variant"], f"{p['gpipe_jaxdist']:.2f}",
             f"{p['1f1b_jaxdist']:.2f}", f"{p['1f1b_jaxdist'] / p['gpipe_jaxdist']:.2f}",
             f"{p['gpipe_megatron']:.2f}", f"{p['1f1b_megatron']:.2f}",
             f"{p['1f1b_megatron'] / p['gpipe_megatron']:.2f}",
             f"{p['gpipe_gib']:.1f} / {p['1f1b_gib']:.1f}"] for p in pairs]
    # what jaxdist runs (its tick loop) first; Megatron's dataflow runtime is a what-if
    return _table(["model", "row", "variant", "GPipe s (jaxdist)", "1F1B s (jaxdist)",
                   "ratio", "GPipe s (Megatron what-if)", "1F1B s (Megatron what-if)",
                   "ratio", "GiB/dev GPipe / 1F1B"], body)


def findings(h200: list[dict], h100: list[dict]) -> list[dict]:
    """Go et al.'s published findings, each with what the plan predicts and whether the
    two agree (decided from the figures, never typed in)."""
    out = []
    # 1. Fewer, larger-memory GPUs can beat more GPUs when communication-bound, if tuned:
    # each cluster's best row that fits, per batch (step) and per GPU (tokens/s/GPU).
    lines, verdicts = [], []
    for model in sorted({r["model"] for r in h200} & {r["model"] for r in h100}):
        a, b = best(h200, model), best(h100, model)
        if a and b:
            per_gpu = (a["tokens_per_s_per_gpu"] or 0) >= (b["tokens_per_s_per_gpu"] or 0)
            verdicts.append("yes" if per_gpu and a["step_s"] <= b["step_s"] else
                            "per GPU" if per_gpu else "no")
            lines.append(f"{model}: best 32 H200 {a['entry']} ({a['variant']}) "
                         f"{a['step_s']:.1f} s, {a['tokens_per_s_per_gpu']:,.0f} tok/s/GPU vs "
                         f"best 64 H100 {b['entry']} ({b['variant']}) {b['step_s']:.1f} s, "
                         f"{b['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (bottleneck "
                         f"{a['bottleneck']} / {b['bottleneck']})")
    agree = None
    if verdicts:
        agree = ("yes" if set(verdicts) == {"yes"} else "no" if set(verdicts) == {"no"} else
                 "partly: faster per GPU, not per batch")
    out.append({"finding": "Fewer, larger-memory GPUs (32 H200) can match or beat more GPUs "
                           "(64 H100) when training is communication-bound, if tuned",
                "predicted": "; ".join(lines) or "no model in both grids fits",
                "agrees": agree})
    # 2. TP combined with PP underuses the links.
    fit = [r for r in h200 + h100 if r["fits"] is True]
    # a pipeline's rows have a schedule; TPxPP's also a tensor axis
    tp_pp = [r["link_busy"] for r in fit if r["schedule"] and "tensor:" in r["mesh"]]
    other = [r["link_busy"] for r in fit if not r["schedule"]]
    if tp_pp and other:
        a, b = statistics.median(tp_pp), statistics.median(other)
        out.append({"finding": "TP combined with PP underuses the available bandwidth",
                    "predicted": f"busiest link busy {a:.0%} of the step (median of the TPxPP "
                                 f"rows that fit) vs {b:.0%} (fsdp_tp and ep rows)",
                    "agrees": "yes" if a < b else "no"})
    # 3. and 4. need power bursts and temperature: the plan predicts average power only.
    for text in ("Micro-batch sizes past a threshold make power bursty and throttle more",
                 "Thermal imbalance across GPUs causes clock throttling"):
        out.append({"finding": text, "predicted": "not predicted: the plan predicts each "
                    "stage's average power over the step, not its bursts or temperature; runs "
                    "measure them (NVML every 50 ms, the go2025 suite's mb2..mb8 variants)",
                    "agrees": None})
    return out


PYTHON = ".venv/bin/python"


def plan_command(hardware: str, settings: dict) -> str:
    """The command that plans one row alone: experiments.plan with the row's settings,
    each `--flag=value` (`--flag` / `--no-flag` for a bool), as jaxdist.config.to_argv
    writes them (not imported: analysis reads runs without the runtime)."""
    import shlex

    def arg(name: str, value) -> str:
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            return flag if value else "--no-" + flag[2:]
        return f"{flag}={value}"

    return shlex.join([PYTHON, "-m", "experiments.plan", "--hardware", hardware,
                       *(arg(k, v) for k, v in settings.items())])


def example(rows: list[dict], pipeline: bool) -> dict | None:
    """The row a table's commands take as their example: a Mixtral 8x7B row where there is
    one, else another Mixtral's (a pipeline row with its schedule for the 1F1B/GPipe
    table), base variant first."""
    pick = [r for r in rows if bool(r["schedule"]) == pipeline] or rows
    pick = sorted(pick, key=lambda r: (r["model"] != "mixtral-8x7b",
                                       not r["model"].startswith("mixtral"), r["model"],
                                       r["variant"] != "base", r["name"]))
    return pick[0] if pick else None


def commands(rows: list[dict], settings_of, pipeline: bool = False) -> list[str]:
    """What goes under a table: the command that plans one of its rows alone, and the
    suite's --models/--layouts filters that plan a subset (--dry-run lists the rows with
    their commands, planning nothing). `settings_of(name)`: a row's settings (None: not
    recorded, and no single-row command is given)."""
    r = example(rows, pipeline)
    if r is None:
        return []
    hw = r["hardware"] or "h200"
    entries = [r["entry"]] + sorted({x["entry"] for x in rows if x["model"] == r["model"] and
                                     x["entry"] != r["entry"]})[:1]
    settings = settings_of(r["name"])
    suite = f"{PYTHON} -m experiments.suite --preset go2025 --plan --hardware {hw}"
    lines = [""]
    if settings is not None:
        lines += [f"Plan one row alone ({r['model']} {r['entry']}, {r['variant']}"
                  f"{', ' + r['schedule'] if r['schedule'] else ''}); every row's command is "
                  f"listed by the suite's `--dry-run` (below):", "", "```",
                  plan_command(hw, settings), "```", ""]
    lines += [f"Plan a subset: one model's rows (`--models`), or rows by the names in the "
              f"row column (`--layouts`), each in every variant"
              f"{' and schedule' if pipeline else ''}; `--dry-run` lists them with their "
              f"commands and plans nothing:", "", "```",
              f"{suite} --models {r['model']} --out runs/plan-{hw}-{r['model']}",
              f"{suite} --models {r['model']} --layouts {','.join(entries)} --dry-run",
              "```"]
    return lines


def recorded_settings(directory: Path):
    """settings_of for `commands`: a row's settings as its plan.json records them."""
    import json

    def settings_of(name: str) -> dict | None:
        try:
            return json.loads((directory / name / "plan.json").read_text())["row"]["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return settings_of


def power_rows(directory: Path) -> list[dict]:
    """Each plan's predicted power (its plan.json `power` block, jaxdist.predict.power), with
    its row name and verdict, model by model, least energy per step first; rows without a
    block are left out."""
    out = []
    for row in read_rows(Path(directory)):
        power = row["power"]
        if power is None:
            continue
        out.append({"name": row["name"], "model": row["model"], "fits": row["fits"],
                    "step_s": power["step_s"], "gpu_avg_w": power["gpu_avg_w"],
                    "top_stage_w": max(power.get("gpu_avg_w_by_stage") or
                                       [power["gpu_avg_w"]]),
                    "energy_per_step_j": power["energy_per_step_j"],
                    "samples_per_s_per_mj": power["samples_per_s_per_mj"],
                    "tokens_per_j": power["tokens_per_j"], "node_avg_w": power["node_avg_w"]})
    return sorted(out, key=lambda r: (r["model"], r["energy_per_step_j"]))


def power_table(rows: list[dict]) -> list[str]:
    """The rows' predicted power, ranked by energy per step."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)
    return _table(["row", "fits", "step s", "W/GPU", "busiest stage W", "kJ/step",
                   "samples/(s*MJ)", "tokens/J", "node kW"],
                  [[r["name"], {True: "yes", False: "no"}.get(r["fits"], "?"),
                    f"{r['step_s']:.2f}", f"{r['gpu_avg_w']:.0f}", f"{r['top_stage_w']:.0f}",
                    f"{r['energy_per_step_j'] / 1e3:,.0f}",
                    num(r["samples_per_s_per_mj"], ".2f"), num(r["tokens_per_j"], ".3f"),
                    num(r["node_avg_w"] and r["node_avg_w"] / 1e3, ".2f")] for r in rows])


def report(h200_dir: Path, h100_dir: Path) -> str:
    h200, h100 = rows_of(h200_dir), rows_of(h100_dir)
    lines = ["PREDICTED (not measured). Generated by `python -m analysis.go2025` from the "
             "plans of `experiments.suite --preset go2025 --plan`.", "",
             "## Findings", ""]
    lines += _table(["Go et al. 2025", "the plan predicts", "agrees"],
                    [[f["finding"], f["predicted"], f["agrees"] or "n/a"]
                     for f in findings(h200, h100)])
    for title, rows, folder in (("32 H200 (4 nodes x 8)", h200, h200_dir),
                                ("64 H100 (8 nodes x 8)", h100, h100_dir)):
        settings_of = recorded_settings(Path(folder))
        lines += ["", f"## {title}", ""] + grid_table(rows) + commands(rows, settings_of)
        power = power_rows(Path(folder))
        if power:
            lines += ["", f"### Power, predicted, ranked by energy per step, {title}", ""] + \
                power_table(power)
        pairs = schedule_pairs(rows)
        if pairs:
            lines += (["", f"### 1F1B against GPipe, {title}", ""] + pairs_table(pairs) +
                      commands(rows, settings_of, pipeline=True))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m analysis.go2025 H200_PLAN_DIR H100_PLAN_DIR (outputs of "
              "experiments.suite --preset go2025 --plan)", file=sys.stderr)
        return 2
    try:
        text = report(*(plan_dir(a) for a in args))
    except UsageError as e:
        print(f"go2025: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
