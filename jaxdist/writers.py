"""Run outputs: TensorBoard events (tensorboardX), results.json and the console summary.

What a run shows in TensorBoard:
- Time Series / Scalars: the per-step curves, `train/loss` and `train/step_time_s`
  (`train/warmup_step_time_s` for warm-up steps; ps runs add `train/worker<w>/step_time_s`),
  `eval/accuracy` and the power telemetry under `power/` (jaxdist/telemetry/outputs.py).
- Custom Scalars: one chart of `train/loss` and one of `train/step_time_s` over every run,
  and per model a category `step time (s) by layout: <model>` with one chart per layout
  (custom_scalars), so runs of one model share an axis and no other's.
- HParams: one row per run, named by the run's folder (layout, mesh, model, then its start
  time: experiments.run_dirs), with the settings that define the run, its `status` and
  `steps` as columns and its run-level figures as metrics, 25 columns in all. TensorBoard
  reads metric values from scalars, so each metric (and each run-level figure that is not
  a column) is also a one-point scalar under `trial/`.
- Text: `summary` (the printed table, as markdown), `config` (the run's whole config) and,
  where the run's losses equal those of other layouts' runs beside it, `note` (their loss
  curves are drawn one over the other).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

from jaxdist.files import write_json
from jaxdist.record import RunRecord
from jaxdist.summary import format_markdown

# After "train" in the alphabetical order of Time Series' tag groups, so TensorBoard opens
# on the training curves, not on these one-point charts ("trial" as in HParams' Trial ID).
METRIC_PREFIX = "trial/"
# On simulated devices (the `simulated` column) a time is functional, not performance.
SIM = "; functional only if simulated"
# TensorBoard prints a metric as `value.toPrecision(5)`: fixed notation from 1e-6 to 1e5,
# exponent notation outside it, so 50692 bytes and 1.6e6 bytes read `50692` and `1.6000e+6`
# in one column. Each figure is written in a unit that reads 0.1-9,999: throughputs in
# thousands, memory in the binary unit of the run's scale (memory_unit), named in the
# column's title and tag (`state MiB/device`, trial/state_mib_per_device).
GIB = 2.0 ** 30
MEMORY_UNITS = (("TiB", 2.0 ** 40), ("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10))
# (tag without the prefix, column title): the run-level figures shown as HParams columns,
# in column order; `{unit}` is the run's memory unit. TensorBoard ticks the first five by
# default: step time, then memory per device (the state's exact shards even on simulated
# devices, where step times are functional only; the compiler's bound; the measured peak).
METRICS = (
    ("step_time_p50_s", f"step p50 (s{SIM})"),
    ("state_{unit}_per_device", "state {unit}/device"),
    ("compiler_bound_{unit}", "compiler bound {unit}/device"),
    ("measured_peak_{unit}", "measured peak {unit}/device"),
    ("ktokens_per_s", f"k tokens/s ({SIM[2:]})"),
    ("mfu", "MFU"),
    ("pp_bubble", "pipeline bubble (counted)"),
    ("energy_per_step_j", "energy/step (J)"),
    ("accuracy", "test accuracy"),
    ("final_loss", "final loss"),
)
# The other run-level figures: one-point scalars under `trial/` (Time Series), not columns.
FIGURES = ("step_time_p99_s", "ksamples_per_s", "hfu", "comm_ring_gib", "pp_stage_gib",
           "pp_stage_gib_analytic", "pp_bubble_analytic", "pp_activation_stash_gib",
           "energy_per_sample_j", "ps_push_p50_s", "ps_pull_p50_s", "ps_gib_per_step",
           "ps_staleness_mean", "ps_staleness_max")
# name -> type of the settings that define a run, the HParams columns (15; with METRICS,
# 25). Left out: flags that do not change what is measured (checkpointing, multi-process
# wiring, output paths, telemetry knobs) and settings a comparison rarely varies (the
# config text holds them all: lr, seed, dataset, matmul precision, ...). Counts are
# strings: TensorBoard prints every number to 5 significant digits (8 devices would read
# `8.0000`). `status` (complete / interrupted) and `steps` (steps run; `18 of 303` when
# interrupted) say whether the row's figures are those of the whole run.
HPARAMS = {
    "layout": str, "mesh": str, "model": str, "dtype": str, "status": str, "steps": str,
    "schedule": str, "devices": int, "batch": int, "microbatches": int, "remat": str,
    "overlap": bool, "framework": str, "simulated": bool, "ps_mode": str,
}
# Marked as differing so TensorBoard shows these columns first (it shows 5 by default,
# differing ones first, then by name): what a user compares runs by and whether each
# finished; the row's name (the run folder) says the same at a glance.
IDENTITY = ("layout", "mesh", "model", "dtype", "status")
CUSTOM_SCALARS = {"train": {"loss": ["Multiline", [r"^train/loss$"]],
                            "step time (s)": ["Multiline", [r"^train/step_time_s$"]]}}
BY_LAYOUT = "step time (s) by layout: {model}"


def custom_scalars(layout: str, model: str) -> dict:
    """This run's Custom Scalars layout. TensorBoard merges the runs' layouts (categories
    by title, equal charts once), so each model's `BY_LAYOUT` category gets one chart per
    layout present, titled by it, over `train/<model>/<layout>/step_time_s`, which only runs
    of that model and layout write (models' steps differ by orders of magnitude). What the layout proto cannot say is left to TensorBoard: colours are
    given per run (by its order), the legend is the Runs list (and each chart's Matches),
    and "Ignore outliers in chart scaling" (on by default) scales each chart to the 5-95%
    of its points, which in the overlay can push a slower layout's runs (a pipeline) off
    the chart; in their own layout's chart they are the points it is scaled to (single
    steps above the 95th percentile are still clipped)."""
    return {**CUSTOM_SCALARS, BY_LAYOUT.format(model=model): {
        layout: ["Multiline", [layout_step_tag(layout, model, regex=True)]]}}


def layout_step_tag(layout: str, model: str, regex: bool = False) -> str:
    """`train/<model>/<layout>/step_time_s`: the timed steps again, under the run's model
    and layout."""
    if regex:
        return f"^train/{re.escape(model)}/{re.escape(layout)}/step_time_s$"
    return f"train/{model}/{layout}/step_time_s"


class RunWriter:
    """Everything a run writes under its directory."""

    def __init__(self, logdir: Path, config: dict):
        # Imported here, and without torch (jaxdist.tbx): a --dry-run or bad input should
        # not wait for it.
        from jaxdist.tbx import tensorboardx

        SummaryWriter = tensorboardx().SummaryWriter

        self.logdir = logdir
        self.started = time.time()
        self.tb = SummaryWriter(logdir=str(logdir), flush_secs=5)
        self.failed: OSError | None = None  # the events file's write error (a full disk)
        self._guard_events()
        self.tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self.layout = (config.get("train") or {}).get("layout") or "run"
        self.model = (config.get("model") or {}).get("model") or "model"
        self.tb.add_custom_scalars(custom_scalars(self.layout, self.model))

    def _guard_events(self) -> None:
        """tensorboardX writes the events file in a thread of its own; an OSError there (a
        full disk, a file-size limit) ended that thread with a traceback, and the run then
        hung for good on its next step, with the thread's queue full. Here the error is
        kept instead, and the next step raises it as one line (WriteError)."""
        events = getattr(getattr(self.tb.file_writer, "event_writer", None), "_ev_writer",
                         None)
        if events is None:
            return
        for name in ("write_event", "flush", "close"):
            def guarded(*args, _original=getattr(events, name)):
                if self.failed is not None:
                    return None
                try:
                    return _original(*args)
                except OSError as e:
                    self.failed = e
                    return None
            setattr(events, name, guarded)

    def _check(self) -> None:
        if self.failed is not None:
            from jaxdist.errors import WriteError
            raise WriteError(f"cannot write the TensorBoard events in {self.logdir}: "
                             f"{self.failed.strerror or self.failed}")

    def step(self, index: int, loss: float, step_s: float, timed: bool) -> None:
        self._check()
        self.tb.add_scalar("train/loss", loss, index)
        self.tb.add_scalar("train/step_time_s" if timed else "train/warmup_step_time_s",
                           step_s, index)
        if timed:
            self.tb.add_scalar(layout_step_tag(self.layout, self.model), step_s, index)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._check()
        self.tb.add_scalar(tag, value, step)

    def summary(self, results: dict) -> None:
        # The record first: whatever happens writing TensorBoard's copy, the run keeps it.
        write_json(self.logdir / "results.json", results, strict=True)
        for name, value in {**summary_scalars(results), **predicted_scalars(results)}.items():
            self.tb.add_scalar(name, value, 0)
        for event in hparams_summaries(results, self.started):
            self.tb.file_writer.add_summary(event)
        self.tb.add_text("summary", format_markdown(results), 0)
        note = same_losses_note(self.logdir, results)
        if note:
            self.tb.add_text("note", note, 0)

    def close(self) -> None:
        self.tb.close()


def tensorboard_hint(run_dir: Path) -> str:
    """The lines a run prints to open TensorBoard, each a command that runs as printed: on
    the runs folder this run belongs to (its parent, where the runs a user compares are;
    the run itself when its parent is the working directory), then on this run alone."""
    exe = tensorboard_executable()
    parent = run_dir.parent
    cwd = Path.cwd()
    every = (run_dir if parent == Path(".") or parent.absolute() in (cwd, Path(parent.anchor))
             else parent)
    line = f"TensorBoard: {exe} --logdir {shlex.quote(str(every))}"
    if every != run_dir:
        line += f"\n  this run alone: {exe} --logdir {shlex.quote(str(run_dir))}"
    return line


def tensorboard_executable() -> str:
    """`tensorboard` when that name finds this Python's own (an active venv, or installed
    on PATH); else the path of the one beside this Python (a venv that is not active); else
    this Python running TensorBoard's module."""
    beside = Path(os.path.abspath(sys.executable)).parent / "tensorboard"
    on_path = shutil.which("tensorboard")
    if beside.exists():
        if on_path and os.path.samefile(on_path, beside):
            return "tensorboard"
        return shlex.quote(str(beside))
    if on_path:
        return "tensorboard"
    return f"{shlex.quote(os.path.abspath(sys.executable))} -m tensorboard.main"


class NullWriter:
    """What processes other than 0 write: nothing."""

    def step(self, *args) -> None: ...
    def scalar(self, *args) -> None: ...
    def summary(self, *args) -> None: ...
    def close(self) -> None: ...


# ---------------------------------------------------------------------- HParams

def run_hparams(results: dict) -> dict:
    """The settings that define a run (HPARAMS), from results.json through RunRecord (one
    reading, one default per field); absent ones left out."""
    rec = RunRecord(Path(""), results)
    hp = {
        # an FP8 run's scaling with its dtype: two FP8 runs differ by it
        "layout": rec.layout, "mesh": rec.mesh, "model": rec.model_name,
        "dtype": (f"{rec.dtype} ({rec.fp8_scaling})" if rec.dtype == "float8" and
                  rec.fp8_scaling else rec.dtype),
        "status": rec.status, "steps": rec.steps, "schedule": rec.schedule,
        "devices": rec.devices, "batch": rec.batch, "microbatches": rec.microbatches,
        "remat": rec.remat, "overlap": rec.overlap, "framework": results.get("framework"),
        "simulated": results.get("env", {}).get("simulated"),
        "ps_mode": rec.ps_mode if rec.out_of_process else None,
    }
    return {k: v for k, v in hp.items() if v is not None}


def memory_unit(results: dict) -> tuple[str, float]:
    """(name, bytes) of the binary unit this run's memory columns are in: the smallest in
    which its largest memory figure reads at most 9,999 (its smallest then reads at least
    0.1 unless the two are 100,000x apart), so runs of one scale share it: a toy model's
    in KiB up to 9.8 MiB, MiB up to 9.8 GiB, then GiB; GiB where it has none."""
    rec = RunRecord(Path(""), results)
    figures = [b for b in (rec.state_bytes, rec.compiled_bound, rec.measured_peak) if b]
    if not figures:
        return "GiB", GIB
    return next(((name, size) for name, size in reversed(MEMORY_UNITS)
                 if max(figures) / size <= 9_999), MEMORY_UNITS[0])


def metric_columns(results: dict) -> list[tuple[str, str]]:
    """METRICS as this run's (tag without the prefix, title), in its memory unit."""
    unit = memory_unit(results)[0]
    return [(tag.format(unit=unit.lower()), title.format(unit=unit)) for tag, title in METRICS]


def hparams_summaries(results: dict, started: float) -> list:
    """The hparams plugin's three summaries: the experiment (the same in every run, so
    whichever run TensorBoard reads it from lists every column), this session's start
    (its values) and its end. The session has no group name, so TensorBoard names the row
    by the session's run: the run folder's path under the folder it was given, `runs` for
    the runs `experiments.run` makes (one folder per row, never two runs merged)."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    from jaxdist.tbx import tensorboardx
    tensorboardx()  # its proto modules, imported without torch
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    types = {str: api_pb2.DATA_TYPE_STRING, int: api_pb2.DATA_TYPE_STRING,
             float: api_pb2.DATA_TYPE_FLOAT64, bool: api_pb2.DATA_TYPE_BOOL}
    experiment = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=k, type=types[t], differs=k in IDENTITY)
                      for k, t in HPARAMS.items()],
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=METRIC_PREFIX + tag),
                                         display_name=title)
                      for tag, title in metric_columns(results)])
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=started)
    for key, value in run_hparams(results).items():
        kind = HPARAMS[key]
        if kind is str:
            start.hparams[key].string_value = str(value)
        elif kind is int:
            start.hparams[key].string_value = str(int(value))
        elif kind is bool:
            start.hparams[key].bool_value = bool(value)
        else:
            start.hparams[key].number_value = float(value)
    # No "interrupted" status in the plugin (SUCCESS, FAILURE, RUNNING, UNKNOWN): UNKNOWN;
    # the `status` column says which.
    status = (api_pb2.STATUS_SUCCESS if results.get("status", "complete") == "complete"
              else api_pb2.STATUS_UNKNOWN)
    end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())

    def summary(tag, **data):
        content = plugin_data_pb2.HParamsPluginData(version=0, **data).SerializeToString()
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=content))
        return Summary(value=[Summary.Value(tag=tag, metadata=meta)])

    return [summary(metadata.EXPERIMENT_TAG, experiment=experiment),
            summary(metadata.SESSION_START_INFO_TAG, session_start_info=start),
            summary(metadata.SESSION_END_INFO_TAG, session_end_info=end)]


def run_metrics(results: dict) -> dict[str, float]:
    """METRICS and FIGURES of a run by tag (no prefix; memory columns in the run's unit),
    read through RunRecord; a figure the run does not have is absent."""
    rec = RunRecord(Path(""), results)
    unit, size = memory_unit(results)
    unit = unit.lower()
    out = {
        "step_time_p50_s": rec.step_p50, "step_time_p99_s": rec.step_p99,
        "ksamples_per_s": _per(rec.samples_per_s, 1e3),
        "ktokens_per_s": _per(rec.tokens_per_s, 1e3),
        "mfu": rec.mfu, "hfu": rec.hfu,
        f"state_{unit}_per_device": _per(rec.state_bytes, size),
        f"compiler_bound_{unit}": _per(rec.compiled_bound, size),
        f"measured_peak_{unit}": _per(rec.measured_peak, size),
        "comm_ring_gib": _per(rec.comm_ring_bytes, GIB),
        "energy_per_step_j": rec.energy_per_step, "energy_per_sample_j": rec.energy_per_sample,
        "accuracy": rec.final_accuracy,
        "final_loss": results["loss"][-1] if results.get("loss") else None,
    }
    pp = results.get("pipeline")
    if pp:  # the schedule's bubble (counted, analytic), stage bytes, activation stash
        out.update({"pp_bubble": pp["bubble"], "pp_bubble_analytic": pp["analytic_bubble"],
                    "pp_stage_gib": pp["stage_bytes"]["total"] / GIB,
                    "pp_stage_gib_analytic": pp["stage_bytes"]["analytic"] / GIB,
                    "pp_activation_stash_gib": pp["memory"]["activation_stash_bytes"] / GIB})
    ps = results.get("ps")
    if ps:
        out["ps_push_p50_s"] = (ps.get("push_latency_s") or {}).get("p50")
        out["ps_pull_p50_s"] = (ps.get("pull_latency_s") or {}).get("p50")
        moved = ps.get("bytes_per_step") or {}
        if moved:
            out["ps_gib_per_step"] = (moved.get("push", 0) + moved.get("pull", 0)) / GIB
        out["ps_staleness_mean"] = (ps.get("staleness") or {}).get("mean")
        out["ps_staleness_max"] = (ps.get("staleness") or {}).get("max")
    return {k: float(v) for k, v in out.items() if v is not None}


def _per(value, unit: float) -> float | None:
    return None if value is None else value / unit


def summary_scalars(results: dict) -> dict[str, float]:
    """The run-level scalars written at the end: the HParams metrics' values, and two
    figures in the record's own units (not columns), which readers of the event files
    (tests/test_run_cli.py) compare with results.json."""
    record = {"samples_per_s": (results.get("throughput") or {}).get("samples_per_s"),
              "state_bytes_per_device": (results.get("memory") or {}).get(
                  "state_bytes_per_device")}
    return {**{METRIC_PREFIX + k: v for k, v in run_metrics(results).items()},
            **{METRIC_PREFIX + k: float(v) for k, v in record.items() if v is not None}}


def predicted_scalars(results: dict) -> dict[str, float]:
    """The time model's figures for this run (results["prediction"]) under `predicted/`,
    apart from the measured trial/ metrics and HParams columns."""
    p = results.get("prediction") or {}
    if not p.get("available"):
        return {}
    values = {**{k: v for k, v in p["predicted"].items()
                 if k.endswith(("_s", "_gpu", "mfu", "_w", "_device"))},
              **{f"measured_over_predicted_{k}": v
                 for k, v in p["measured_over_predicted"].items()}}
    return {f"predicted/{k}": float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def same_losses_note(logdir: Path, results: dict) -> str | None:
    """A note where this run's losses equal (to 1e-6, relative) those of other runs beside
    it (the other run folders of its parent) of another layout, mesh or pipeline schedule
    on the same model,
    batch, seed and dataset: TensorBoard then draws their loss curves one over the other, a
    single line. Layouts change where the math runs, not the math, so equal losses are the
    expected result; the note says so where the chart cannot."""
    import numpy as np

    mine = RunRecord(logdir, results)
    losses = np.asarray(results.get("loss") or [], dtype=float)
    if not losses.size or not logdir.parent.is_dir():
        return None
    key = (mine.model, mine.batch, mine.seed, mine.dataset, mine.dtype)
    same = []
    for other in sorted(logdir.parent.iterdir()):
        if other == logdir or not (other / "results.json").is_file():
            continue
        try:
            rec = RunRecord.load(other)
        except (OSError, ValueError):  # RecordError is a ValueError
            continue
        theirs = np.asarray(rec.results.get("loss") or [], dtype=float)
        if ((rec.model, rec.batch, rec.seed, rec.dataset, rec.dtype) == key and
                (rec.layout, rec.mesh, rec.schedule) != (mine.layout, mine.mesh,
                                                         mine.schedule) and
                theirs.shape == losses.shape and np.allclose(theirs, losses, rtol=1e-6,
                                                             atol=0)):
            same.append(f"{other.name} ({rec.layout}, mesh {rec.mesh})")
    if not same:
        return None
    return (f"The losses of this run ({mine.layout}, mesh {mine.mesh}) equal those of "
            f"{', '.join(same)} at every one of its {losses.size} steps (to 1e-6): the loss "
            f"chart draws them as one line. A layout changes where the math runs, not the "
            f"math, so equal losses are what a correct layout gives.")
