"""Study report: `python -m experiments.report RUNS_DIR [--out DIR]`.

Reads every run below RUNS_DIR (each a directory with results.json and TensorBoard events, as
`experiments.run` and `experiments.suite` write them) and the suite's suite.json when there
is one, and writes DIR/report.md with PNG figures beside it:

- step_times.png   per-step latency distribution per layout (box plots of the timed steps'
                   `train/step_time_s` TensorBoard scalars; repeats pooled)
- memory.png       per-device memory per layout: train-state shard bytes, the compiler's
                   peak estimate, the measured peak where the backend reports one
- energy.png       energy per sample, where power was measured
- accuracy.png     test accuracy against wall time, parameter-server modes and DDP
- comm.png         collective bytes per step by kind, where the run recorded `comm`

and one table over all runs, Ovi 2025's comparisons as ratios beside the published figures
(labelled by paper version; timing ratios from simulated devices labelled as such), and the
runs that failed or did not finish (by name: a run directory without results.json, or one
with status "interrupted"). The report is built in a temporary directory and renamed into
place, so a bad input leaves nothing half-written. Contents: docs/suite.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from jaxdist.errors import OneLineParser, UsageError

LAYOUT_ORDER = ("ddp", "zero1", "fsdp", "hsdp", "tp", "fsdp_tp", "ep", "ps-sync", "ps-async",
                "ps-ssp")
SIMULATED_NOTE = "simulated devices: functional only, not a performance figure"


# ---------------------------------------------------------------------------- reading

def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from every event file under logdir, read through the TFRecord
    framing (u64 length, u32 crc, payload, u32 crc) without the tensorboard package. A record
    cut short (a run killed while writing) ends that file."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            if pos + 12 + length + 4 > len(data):
                break
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            try:
                event = event_pb2.Event.FromString(payload)
            except Exception:  # noqa: BLE001 - a corrupt record: skip the rest of the file
                break
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@dataclass
class Run:
    path: Path
    name: str
    results: dict
    step_times: list[float] = field(default_factory=list)   # per timed step, seconds
    step_times_source: str = "tensorboard"

    def cfg(self, section: str, key: str, default=None):
        return (self.results.get("config") or {}).get(section, {}).get(key, default)

    @property
    def layout(self) -> str:
        """ddp, fsdp, ..., or ps-sync / ps-async / ps-ssp (+slr: staleness-scaled lr)."""
        layout = self.results.get("layout", "?")
        if layout != "ps":
            return layout
        ps = self.results.get("ps") or {}
        mode = ps.get("mode") or self.cfg("ps", "ps_mode", "sync")
        slr = ps.get("staleness_lr", self.cfg("ps", "ps_staleness_lr", False))
        return f"ps-{mode}" + ("+slr" if slr and mode != "sync" else "")

    @property
    def variant(self) -> str:
        parts = []
        remat = self.cfg("train", "remat", "none")
        if remat and remat != "none":
            parts.append(f"remat-{remat}")
        mb = self.cfg("train", "microbatches", 1) or 1
        if mb > 1:
            parts.append(f"mb{mb}")
        for key in ("overlap",):  # later flags, when present and on
            if self.cfg("train", key):
                parts.append(key)
        return "+".join(parts)

    @property
    def group(self) -> str:
        return self.layout + (f" {self.variant}" if self.variant else "")

    @property
    def model(self) -> str:
        opts = self.cfg("model", "model_opts", "")
        return self.results.get("model", {}).get("name", "?") + (f"[{opts}]" if opts else "")

    @property
    def mesh(self) -> str:
        mesh = self.results.get("mesh") or {}
        return "x".join(str(v) for v in mesh.values()) or "?"

    @property
    def bar(self) -> str:
        """A figure's label for the run: `layout @ mesh` (variant included)."""
        return f"{self.group} @ {self.mesh}"

    @property
    def devices(self):
        n = (self.results.get("env") or {}).get("num_devices")
        if n is None and self.results.get("mesh"):
            n = math.prod(self.results["mesh"].values())
        return n

    @property
    def framework(self) -> str:
        return self.results.get("framework", "jax")

    @property
    def matmul_precision(self) -> str:
        return self.cfg("model", "matmul_precision") or "default"

    @property
    def simulated(self) -> bool:
        return bool((self.results.get("env") or {}).get("simulated"))

    @property
    def batch(self):
        return self.cfg("train", "batch_size")

    @property
    def dtype(self):
        return self.cfg("model", "dtype", "float32")

    def compare_key(self) -> tuple:
        """Runs compared in a ratio share these: like with like, on as many devices (an FSDP
        run over 32 devices against a DDP run over 8 measures the device count, not the
        layout)."""
        return (self.model, self.variant, self.batch, self.dtype,
                self.cfg("data", "dataset"), self.cfg("train", "optimizer"), self.devices,
                self.framework, self.matmul_precision)

    # -- figures of a run
    def step_p(self, q: str):
        return (self.results.get("step_time_s") or {}).get(q)

    @property
    def samples_per_s(self):
        return (self.results.get("throughput") or {}).get("samples_per_s")

    @property
    def state_bytes(self):
        return (self.results.get("memory") or {}).get("state_bytes_per_device")

    @property
    def compiled_peak(self):
        return ((self.results.get("memory") or {}).get("compiled") or {}).get("peak_bytes")

    @property
    def measured_peak(self):
        return (self.results.get("memory") or {}).get("measured_peak_bytes")

    @property
    def energy_per_sample(self):
        power = self.results.get("power") or {}
        return power.get("energy_per_sample_j") if power.get("available") else None

    @property
    def final_accuracy(self):
        acc = self.results.get("accuracy") or []
        return acc[-1]["accuracy"] if acc else None

    @property
    def train_time(self):
        """Wall time of the timed steps: the window span, else mean x n."""
        w = self.results.get("window") or {}
        if w.get("start_unix_s") and w.get("end_unix_s"):
            return w["end_unix_s"] - w["start_unix_s"]
        t = self.results.get("step_time_s") or {}
        return t["mean"] * t["n"] if t.get("mean") is not None and t.get("n") else None


@dataclass
class Failure:
    name: str
    status: str
    reason: str
    stderr_tail: str
    command: str


def _layout_rank(group: str) -> tuple:
    base = group.split(" ")[0].split("+")[0]
    return (LAYOUT_ORDER.index(base) if base in LAYOUT_ORDER else len(LAYOUT_ORDER), group)


def collect(root: Path, skip: Path | None) -> tuple[list[Run], list[Failure], list[str], dict]:
    """(finished runs, failed or unfinished runs, problems, suite meta). Unfinished: the
    suite's records, results.json with status "interrupted" (a missing status is a complete
    run), and run directories without a results.json (a run killed with SIGKILL)."""
    if not root.exists():
        raise UsageError(f"runs directory {root} does not exist")
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    try:
        found = sorted(p for p in root.rglob("results.json")
                       if skip is None or skip.resolve() not in p.resolve().parents)
    except OSError as e:
        raise UsageError(f"cannot read runs directory {root}: {e.strerror or e}") from None
    if not os.access(root, os.R_OK | os.X_OK):
        raise UsageError(f"cannot read runs directory {root}: permission denied")
    runs, problems, unfinished = [], [], []
    for path in found:
        run_dir = path.parent
        name = _name(root, run_dir)
        try:
            results = json.loads(path.read_text())
            if isinstance(results, dict) and results.get("status") == "interrupted":
                steps = len(results.get("loss") or [])
                unfinished.append(Failure(name, "interrupted", "results.json has status "
                                          f"\"interrupted\" ({steps} steps recorded)", "", ""))
                continue
            if not isinstance(results, dict) or "step_time_s" not in results:
                raise ValueError("not a run's results.json")
        except (OSError, ValueError) as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        run = Run(run_dir, name, results)
        timed = read_scalars(run_dir).get("train/step_time_s", [])
        if timed:
            by_step = dict(timed)  # the last value written for a step wins
            run.step_times = [by_step[s] for s in sorted(by_step)]
        else:
            run.step_times_source = "none"
        runs.append(run)

    failures, meta = [], {}
    suite_json = root / "suite.json"
    if suite_json.exists():
        try:
            meta = json.loads(suite_json.read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{suite_json}: unreadable ({e})")
            meta = {}
        finished = {r.path.resolve() for r in runs}
        for rec in meta.get("runs", []) if isinstance(meta, dict) else []:
            if not isinstance(rec, dict) or "name" not in rec:
                continue
            if (root / rec["name"]).resolve() in finished:
                continue
            status = rec.get("status", "pending")
            failures.append(Failure(rec["name"], status,
                                    rec.get("reason") or ("not run yet" if status == "pending"
                                                          else status),
                                    rec.get("stderr_tail") or "", rec.get("command", "")))
    named = {f.name for f in failures}
    unfinished += [Failure(name, "unfinished", "no results.json: the run was killed, or is "
                           "still running", "", "")
                   for name in _dirs_without_results(root, skip, found)]
    failures += sorted((f for f in unfinished if f.name not in named), key=lambda f: f.name)
    if not runs and not failures:
        raise UsageError(f"no runs in {root}: no results.json below it and no suite.json "
                         f"(run python -m experiments.suite or experiments.run first)")
    runs.sort(key=lambda r: (r.model, _layout_rank(r.group), r.name))
    return runs, failures, problems, meta


def _name(root: Path, run_dir: Path) -> str:
    return str(run_dir.relative_to(root)) if run_dir != root else run_dir.name


def _dirs_without_results(root: Path, skip: Path | None, found: list[Path]) -> list[str]:
    """Run directories that never got a results.json: those holding TensorBoard event files
    (a run writes them from its first step) and empty ones (a run killed while compiling),
    unless they sit inside a run that has a results.json. Hidden directories and the
    report's own output are not runs."""
    finished = {p.parent.resolve() for p in found}
    names = []
    try:
        dirs = sorted([root, *(p for p in root.rglob("*") if p.is_dir())])
    except OSError:
        return []
    for d in dirs:
        rel = d.relative_to(root).parts
        if any(part.startswith(".") for part in rel) or (
                skip is not None and (d.resolve() == skip.resolve() or
                                      skip.resolve() in d.resolve().parents)):
            continue
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        has_events = any(e.name.startswith("events.out.tfevents.") for e in entries)
        if not has_events and (entries or d == root):
            continue
        resolved = d.resolve()
        if resolved in finished or finished & set(resolved.parents):
            continue
        names.append(_name(root, d))
    return names


# ---------------------------------------------------------------------------- formatting

def human_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _tick_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _num(x, fmt="{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------- ratios

# Ovi 2025 (arXiv 2505.12832), abstract-level claims, by version (shared notes: seeds.md).
PUBLISHED = {
    "mem": {"v1": ("< 0.40", "FSDP reduces GPU memory by over 60%", (None, 0.40)),
            "v2": ("0.17-0.25", "FSDP 4-6x lower peak memory", (1 / 6, 1 / 4))},
    "thr": {"v1": (">= 0.17", "FSDP training time up to 6x DDP's", (1 / 6, None)),
            "v2": ("0.33-0.50", "DDP 2-3x training throughput (baseline unstated)",
                   (1 / 3, 1 / 2))},
    "time": {"v1": ("< 1", "async PS improves throughput (no number)", (None, 1.0)),
             "v2": (">= 0.72", "async PS up to 28% less training time", (0.72, 1.0))},
    "acc": {"v1": ("< 0", "async PS degrades accuracy (no number)", (None, 0.0)),
            "v2": ("-17 to -4", "4% to 17% accuracy penalty (points vs relative not stated)",
                   (-17.0, -4.0))},
    "ssp_time": {"v1": ("-", "not in v1", None),
                 "v2": ("~1", "staleness-mitigating protocol: synchronization overhead "
                        "negated the throughput gain (no number)", None)},
    "ssp_acc": {"v1": ("-", "not in v1", None), "v2": ("-", "no accuracy figure", None)},
}


@dataclass
class Ratio:
    what: str
    kind: str              # key of PUBLISHED
    model: str
    context: str           # variant / batch when they are not the defaults
    value: float | None
    shown: str
    basis: str
    timing: bool
    simulated: bool

    def verdict(self, version: str) -> str:
        claim = PUBLISHED[self.kind][version]
        if self.value is None or claim[2] is None:
            return "-"
        if self.timing and self.simulated:
            return "n/a (simulated)"
        lo, hi = claim[2]
        ok = (lo is None or self.value >= lo - 1e-9) and (hi is None or self.value <= hi + 1e-9)
        return "within" if ok else "outside"


def _context(key: tuple) -> str:
    _, variant, batch, dtype, dataset, _, devices, framework, precision = key
    bits = [b for b in (variant, f"{devices} devices" if devices else "",
                        f"batch {batch}" if batch else "", dtype,
                        f"matmul precision {precision}" if precision != "default" else "",
                        dataset, "PyTorch" if framework == "pytorch" else "") if b]
    return ", ".join(bits)


def ratios(runs: list[Run]) -> list[Ratio]:
    groups: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        groups.setdefault(r.compare_key(), {}).setdefault(r.layout.split("+")[0], []).append(r)
    out = []
    for key, by in sorted(groups.items(), key=lambda kv: str(kv[0])):
        model, ctx = key[0], _context(key)
        if "ddp" in by and "fsdp" in by:
            ddp, fsdp = by["ddp"], by["fsdp"]
            sim = any(r.simulated for r in ddp + fsdp)
            measured = all(r.measured_peak is not None for r in ddp + fsdp)
            if measured:
                basis, get = "measured peak per device", (lambda r: r.measured_peak)
            elif all(r.compiled_peak is not None for r in ddp + fsdp):
                basis, get = "compiler peak estimate per device (exact for this compilation)", \
                    (lambda r: r.compiled_peak)
            else:
                basis, get = "train-state bytes per device (exact)", (lambda r: r.state_bytes)
            d, f = _median(map(get, ddp)), _median(map(get, fsdp))
            if d and f is not None:
                v = f / d
                out.append(Ratio("FSDP/DDP peak memory", "mem", model, ctx, v,
                                 f"{v:.3f} ({(1 - v) * 100:.0f}% less; DDP/FSDP {d / f:.2f}x)"
                                 if f else f"{v:.3f}", basis, False, sim))
            d = _median(r.state_bytes for r in ddp)
            f = _median(r.state_bytes for r in fsdp)
            if d and f is not None and basis != "train-state bytes per device (exact)":
                v = f / d
                out.append(Ratio("FSDP/DDP train-state bytes", "mem", model, ctx, v,
                                 f"{v:.3f} ({(1 - v) * 100:.0f}% less)",
                                 "train-state shard bytes per device (exact)", False, sim))
            d = _median(r.samples_per_s for r in ddp)
            f = _median(r.samples_per_s for r in fsdp)
            if d and f is not None:
                v = f / d
                out.append(Ratio("FSDP/DDP throughput", "thr", model, ctx, v,
                                 f"{v:.3f} (FSDP time {d / f:.2f}x DDP's)" if f else f"{v:.3f}",
                                 "samples/s, mean step time" + (f"; {SIMULATED_NOTE}"
                                                                if sim else ""), True, sim))
        sync = by.get("ps-sync")
        for mode, kind_t in (("ps-async", "time"), ("ps-ssp", "ssp_time")):
            other = by.get(mode)
            if not sync or not other:
                continue
            sim = any(r.simulated for r in sync + other)
            label = "async" if mode == "ps-async" else "ssp"
            s, a = _median(r.train_time for r in sync), _median(r.train_time for r in other)
            if s and a is not None:
                v = a / s
                out.append(Ratio(f"{label}/sync PS training time", kind_t, model, ctx, v,
                                 f"{v:.3f} ({abs(1 - v) * 100:.0f}% "
                                 f"{'less' if v <= 1 else 'more'} time)",
                                 "wall time of the timed steps" + (f"; {SIMULATED_NOTE}"
                                                                    if sim else ""), True, sim))
            s = _median(r.final_accuracy for r in sync)
            a = _median(r.final_accuracy for r in other)
            if s is not None and a is not None and label == "async":
                v = (a - s) * 100
                rel = f", {a / s:.3f}x" if s else ""
                out.append(Ratio("async-sync PS final accuracy", "acc", model, ctx, v,
                                 f"{v:+.1f} points ({a:.1%} vs {s:.1%}{rel})",
                                 "final test accuracy, same steps", False, sim))
            elif s is not None and a is not None:
                out.append(Ratio("ssp-sync PS final accuracy", "ssp_acc", model, ctx, None,
                                 f"{(a - s) * 100:+.1f} points ({a:.1%} vs {s:.1%})",
                                 "final test accuracy, same steps", False, sim))
    return out


def ratio_lines(rs: list[Ratio]) -> list[str]:
    if not rs:
        return ["No comparison could be formed: it needs ddp and fsdp runs of the same model, "
                "settings and device count, or ps-sync with ps-async / ps-ssp.", ""]
    lines = ["| comparison | model | settings | this study | basis | Ovi v1 (May 2025) | "
             "v1 | Ovi v2 (Jan 2026) | v2 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        v1, v2 = PUBLISHED[r.kind]["v1"], PUBLISHED[r.kind]["v2"]
        lines.append(f"| {r.what} | {_md_escape(r.model)} | {_md_escape(r.context)} | "
                     f"{r.shown} | {r.basis} | {v1[0]}: {v1[1]} | {r.verdict('v1')} | "
                     f"{v2[0]}: {v2[1]} | {r.verdict('v2')} |")
    lines.append("")
    return lines


def _peak(r: Run):
    return r.measured_peak if r.measured_peak is not None else r.compiled_peak


def variant_lines(runs: list[Run]) -> list[str]:
    """Each variant (remat, micro-batches, ...) against the base run of the same model,
    layout and settings: step time, peak memory and energy per sample as ratios."""
    groups: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        key = (r.model, r.layout, r.mesh, r.batch, r.dtype, r.cfg("data", "dataset"))
        groups.setdefault(key, {}).setdefault(r.variant or "base", []).append(r)
    rows = []
    for key, by in sorted(groups.items(), key=lambda kv: (kv[0][0], _layout_rank(kv[0][1]),
                                                          str(kv[0][2:]))):
        if "base" not in by or len(by) < 2:
            continue
        base = by["base"]
        for variant, rs in sorted(by.items()):
            if variant == "base":
                continue
            sim = " (simulated)" if any(r.simulated for r in rs + base) else ""

            def rel(get):
                b, v = _median(map(get, base)), _median(map(get, rs))
                return f"{v / b:.3f}" if b and v is not None else "n/a"

            basis = "measured" if all(r.measured_peak is not None for r in rs + base) \
                else "compiler"
            rows.append(f"| {_md_escape(key[0])} | {key[1]} | {key[2]} | {variant} | "
                        f"{rel(lambda r: r.step_p('p50'))}{sim} | "
                        f"{rel(lambda r: r.samples_per_s)}{sim} | {rel(_peak)} ({basis}) | "
                        f"{rel(lambda r: r.energy_per_sample)} |")
    if not rows:
        return []
    return ["## Variants against base", "",
            "Each variant's median over repeats divided by the base run's (same model, "
            "layout, mesh, batch, dtype, dataset).", "",
            "| model | layout | mesh | variant | step p50 / base | samples/s / base | "
            "peak memory / base | energy per sample / base |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


# ---------------------------------------------------------------------------- figures

def _grid(n: int):
    cols = min(3, n)
    return cols, math.ceil(n / cols)


def _by_model(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(r.model, []).append(r)
    return out


def _figure(n_panels: int, n_groups: int = 6, height=3.6):
    import matplotlib.pyplot as plt

    width_per = max(5.0, 0.55 * n_groups)
    cols, rows = _grid(n_panels)
    fig, axes = plt.subplots(rows, cols, figsize=(width_per * cols, height * rows),
                             squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _groups(runs: list[Run]) -> list[str]:
    """The bar labels (`layout @ mesh`) of these runs: by layout, then device count."""
    order = {r.bar: (_layout_rank(r.group), r.devices or 0) for r in runs}
    return sorted(order, key=lambda bar: (order[bar], bar))


def plot_step_times(runs: list[Run], path: Path) -> bool:
    models = {m: [r for r in rs if r.step_times] for m, rs in _by_model(runs).items()}
    models = {m: rs for m, rs in models.items() if rs}
    if not models:
        return False
    fig, axes = _figure(len(models), max(len(_groups(rs)) for rs in models.values()))
    for ax, (model, rs) in zip(axes, models.items()):
        groups = _groups(rs)
        data = [[t * 1e3 for r in rs if r.bar == g for t in r.step_times] for g in groups]
        ax.boxplot(data, showfliers=True, widths=0.6)
        ax.set_xticks(range(1, len(groups) + 1), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("step time (ms)")
        sim = " (simulated)" if any(r.simulated for r in rs) else ""
        ax.set_title(f"{model}: per-step latency{sim}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


def plot_memory(runs: list[Run], path: Path) -> bool:
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    models = _by_model(runs)
    fig, axes = _figure(len(models), max(len(_groups(rs)) for rs in models.values()))
    for ax, (model, rs) in zip(axes, models.items()):
        groups = _groups(rs)
        series = [("train state (shards)", lambda r: r.state_bytes),
                  ("compiler peak", lambda r: r.compiled_peak),
                  ("measured peak", lambda r: r.measured_peak)]
        series = [(label, get) for label, get in series if any(get(r) is not None for r in rs)]
        x = np.arange(len(groups))
        w = 0.8 / max(1, len(series))
        for i, (label, get) in enumerate(series):
            vals = [_median(get(r) for r in rs if r.bar == g) for g in groups]
            ax.bar(x + (i - (len(series) - 1) / 2) * w, [v or 0 for v in vals], w,
                   label=label)
        ax.set_xticks(x, groups, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick_bytes(v)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_ylabel("bytes per device (log)")
        ax.set_title(f"{model}: memory per device", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


def plot_energy(runs: list[Run], path: Path) -> bool:
    measured = [r for r in runs if r.energy_per_sample is not None]
    if not measured:
        return False
    models = _by_model(measured)
    fig, axes = _figure(len(models), max(len(_groups(rs)) for rs in models.values()))
    for ax, (model, rs) in zip(axes, models.items()):
        groups = _groups(rs)
        vals = [_median(r.energy_per_sample for r in rs if r.bar == g) for g in groups]
        ax.bar(range(len(groups)), vals)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("J per sample")
        ax.set_title(f"{model}: energy per sample", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


def plot_accuracy(runs: list[Run], path: Path) -> bool:
    chosen = [r for r in runs if (r.layout.startswith("ps-") or r.layout == "ddp")
              and r.results.get("accuracy")]
    if not chosen:
        return False
    models = _by_model(chosen)
    fig, axes = _figure(len(models), max(len(_groups(rs)) for rs in models.values()))
    for ax, (model, rs) in zip(axes, models.items()):
        for r in sorted(rs, key=lambda r: (_layout_rank(r.group), r.name)):
            pts = r.results["accuracy"]
            ax.plot([p["wall_s"] for p in pts], [p["accuracy"] * 100 for p in pts],
                    marker="o", ms=3, label=f"{r.bar} ({r.name})" if len(rs) > 6 else r.bar)
        ax.set_xlabel("wall time since the first step (s)")
        ax.set_ylabel("test accuracy (%)")
        sim = " (simulated)" if any(r.simulated for r in rs) else ""
        ax.set_title(f"{model}: accuracy vs time{sim}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def plot_comm(runs: list[Run], path: Path) -> bool:
    import numpy as np

    with_comm = [r for r in runs if (r.results.get("comm") or {}).get("by_kind") is not None]
    if not with_comm:
        return False
    models = _by_model(with_comm)
    fig, axes = _figure(len(models), max(len(_groups(rs)) for rs in models.values()))
    for ax, (model, rs) in zip(axes, models.items()):
        groups = _groups(rs)
        kinds = sorted({k for r in rs for k in r.results["comm"]["by_kind"]})
        bottom = np.zeros(len(groups))
        for kind in kinds:
            vals = np.array([_median(r.results["comm"]["by_kind"].get(kind, {}).get("bytes", 0)
                                     for r in rs if r.bar == g) or 0
                             for g in groups], dtype=float) / 2 ** 20
            ax.bar(range(len(groups)), vals, bottom=bottom, label=kind)
            bottom += vals
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MiB per step (per device)")
        ax.set_title(f"{model}: collectives by kind", fontsize=9)
        if kinds:
            ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


# ---------------------------------------------------------------------------- markdown

def runs_table(runs: list[Run]) -> list[str]:
    lines = ["| run | layout | model | mesh | batch | step p50 (ms) | step p99 (ms) | "
             "samples/s | state/device | compiler peak | measured peak | energy (J/sample) | "
             "final accuracy |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        acc = r.final_accuracy
        lines.append(
            f"| {_md_escape(r.name)} | {_md_escape(r.group)} | {_md_escape(r.model)} | "
            f"{r.mesh} | {r.batch if r.batch is not None else 'n/a'} | {_ms(r.step_p('p50'))} | "
            f"{_ms(r.step_p('p99'))} | {_num(r.samples_per_s, '{:.1f}')} | "
            f"{human_bytes(r.state_bytes)} | {human_bytes(r.compiled_peak)} | "
            f"{human_bytes(r.measured_peak)} | {_num(r.energy_per_sample, '{:.4g}')} | "
            f"{'n/a' if acc is None else f'{acc:.1%}'} |")
    lines.append("")
    return lines


def comm_lines(runs: list[Run]) -> list[str]:
    rows = []
    for r in runs:
        comm = r.results.get("comm")
        ps_bytes = (r.results.get("ps") or {}).get("bytes_per_step")
        if not comm and ps_bytes:
            rows.append(f"| {_md_escape(r.name)} | {_md_escape(r.group)} | gRPC push "
                        f"{human_bytes(ps_bytes.get('push'))}, pull "
                        f"{human_bytes(ps_bytes.get('pull'))} per step, all workers "
                        f"(`ps.bytes_per_step`) | host network | n/a |")
        if not comm:
            continue
        kinds = ", ".join(f"{k} {human_bytes(v.get('bytes'))} ({v.get('count', '?')})"
                          for k, v in (comm.get("by_kind") or {}).items()) or "none"
        axes = ", ".join(f"{k} {human_bytes(v.get('bytes'))}"
                         for k, v in (comm.get("by_axis") or {}).items()) or "none"
        rows.append(f"| {_md_escape(r.name)} | {_md_escape(r.group)} | {kinds} | {axes} | "
                    f"{human_bytes(comm.get('total_ring_bytes'))} |")
    if not rows:
        return []
    return ["| run | layout | by kind (bytes, ops) | by mesh axis | ring estimate |",
            "|---|---|---|---|---|", *rows, ""]


def build_markdown(root: Path, runs, failures, problems, meta, figures, rs) -> str:
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
                  f"not performance figures. Memory figures (shard bytes, compiler estimate) "
                  f"are exact.", ""]
    lines += ["## Ovi 2025 comparisons as ratios", "",
              "Published figures are the abstracts' claims (arXiv 2505.12832 v1 May 2025, v2 "
              "Jan 2026; A100 and A10G clusters, CNNs on CIFAR-10/MNIST, batch sizes not "
              "published): a shape check, not a like-for-like number. v1's \">60%\" and v2's "
              "\"4-6x\" memory claims disagree and are kept apart. A ratio pairs runs of "
              "the same model, batch, dtype, dataset, optimizer, framework, matmul precision "
              "and device count. Repeats: median. "
              "\"within\"/\"outside\": whether this study's ratio falls in the claim's range.",
              "", *ratio_lines(rs)]
    lines += ["## All runs", "", *runs_table(runs)]
    lines += variant_lines(runs)
    captions = {
        "step_times.png": ("Step-time distribution per layout",
                           "Box plots of every timed step's latency (TensorBoard "
                           "`train/step_time_s`, warm-up excluded; repeats pooled): box = "
                           "quartiles, line = median, whiskers 1.5 IQR, points = outliers."),
        "memory.png": ("Memory per device per layout",
                       "Train-state shard bytes (`memory.state_bytes_per_device`), the "
                       "compiler's peak estimate (`memory.compiled.peak_bytes`) and the measured "
                       "peak (`memory.measured_peak_bytes`, where the backend reports one); "
                       "log scale."),
        "energy.png": ("Energy per sample", "`power.energy_per_sample_j` of runs with power "
                                            "telemetry."),
        "accuracy.png": ("Accuracy against wall time (parameter server and DDP)",
                         "Test accuracy at each evaluation against wall time since the first "
                         "step (`accuracy[].wall_s`)."),
        "comm.png": ("Collective bytes per step by kind",
                     "From the optimized HLO (`comm.by_kind`), per device per step."),
    }
    for name, (title, text) in captions.items() if runs else ():
        lines += [f"## {title}", ""]
        if name in figures:
            lines += [text, "", f"![{title}]({name})", ""]
        elif name == "energy.png":
            reasons = sorted({(r.results.get("power") or {}).get("reason", "not measured")
                              for r in runs})
            lines += ["Not measured in any run: " + "; ".join(map(_md_escape, reasons[:3])), ""]
        elif name == "accuracy.png":
            lines += ["No DDP or parameter-server run evaluated accuracy (use a real dataset "
                      "with `--eval-every N`).", ""]
        elif name == "comm.png":
            lines += ["No run recorded collectives (`comm`).", ""]
        else:
            lines += ["No per-step data.", ""]
        if name == "comm.png":
            lines += comm_lines(runs)
    missing = [r.name for r in runs if not r.step_times]
    if missing:
        lines += [f"Runs without per-step TensorBoard times (left out of the box plots): "
                  f"{', '.join(missing)}.", ""]
    lines += ["## Failed and unfinished runs", ""]
    if failures:
        lines += ["| run | status | reason |", "|---|---|---|"]
        lines += [f"| {_md_escape(f.name)} | {f.status} | {_md_escape(f.reason)} |"
                  for f in failures]
        lines.append("")
        for f in failures:
            if f.stderr_tail:
                tail = "\n".join(f.stderr_tail.splitlines()[-8:])
                lines += [f"`{f.name}` stderr (tail):", "", "```", tail, "```", ""]
    else:
        lines += ["None.", ""]
    if problems:
        lines += ["## Unreadable files", "", *[f"- {_md_escape(p)}" for p in problems], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.report",
                      description="Markdown report with figures from a directory of runs "
                                  "(an experiments.suite --out directory, or any folder of "
                                  "run directories).")
    p.add_argument("runs", metavar="RUNS_DIR", help="directory holding run directories")
    p.add_argument("--out", default=None,
                   help="report directory (default: RUNS_DIR/report); replaced as a whole")
    return p


def write_report(root: Path, out: Path) -> tuple[Path, list[Ratio], list[Run], list[Failure]]:
    runs, failures, problems, meta = collect(root, skip=out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror or e}") from None
    try:
        import matplotlib
        matplotlib.use("Agg")
        figures = set()
        for name, fn in (("step_times.png", plot_step_times), ("memory.png", plot_memory),
                         ("energy.png", plot_energy), ("accuracy.png", plot_accuracy),
                         ("comm.png", plot_comm)):
            if runs and fn(runs, tmp / name):
                figures.add(name)
        rs = ratios(runs)
        (tmp / "report.md").write_text(build_markdown(root, runs, failures, problems, meta,
                                                      figures, rs))
        old = None
        if out.exists():
            old = parent / f".{out.name}-old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "report.md", rs, runs, failures


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.runs)
    out = Path(args.out) if args.out else root / "report"
    try:
        report, rs, runs, failures = write_report(root, out)
    except UsageError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs, {sum(f.status == 'failed' for f in failures)} failed, "
          f"{sum(f.status != 'failed' for f in failures)} not finished")
    for r in rs:
        sim = " [simulated devices: functional only]" if r.timing and r.simulated else ""
        print(f"  {r.what:<30} {r.model:<14} {r.shown}{sim}   "
              f"(Ovi v1: {PUBLISHED[r.kind]['v1'][0]}; v2: {PUBLISHED[r.kind]['v2'][0]})")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
