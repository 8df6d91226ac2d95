"""What a user sees in TensorBoard, read back from a real `tensorboard` server over its HTTP
data API: tiny runs (ddp, fsdp, two pipeline schedules and an interrupted zero1) in one
logdir, the HParams table with each run's folder as its row name, the columns and metrics
that tell the runs apart and say which finished, and one `train/loss` point per step."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import run_loop
from jaxdist.config import LoopConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig, TrainConfig
from jaxdist.devices import select_devices
from jaxdist.mesh import MeshShape, parse_mesh
from jaxdist.record import RunRecord
from jaxdist.writers import METRIC_PREFIX, memory_unit, run_hparams

try:
    import tensorboard  # noqa: F401
except ImportError:  # the check needs the server itself, not only the event writer
    pytest.skip("tensorboard is not installed (pip install -e '.[dev]')", allow_module_level=True)

STEPS, WARMUP = 3, 1
LAYOUTS = ("ddp", "fsdp")
# Two pipeline runs that differ only in the schedule: the table must tell them apart.
SCHEDULES = ("gpipe", "1f1b")
# Stopped (as by Ctrl-C) once 3 of its 1 + 10 steps are done.
INTERRUPTED = "zero1-interrupted"
RUNS = (*LAYOUTS, *(f"pp-{s}" for s in SCHEDULES), INTERRUPTED)


class _StopAt:
    """Stands in for the entry point's StopRequest: a SIGINT "arrives" after `n` steps."""
    def __init__(self, n):
        self.n, self.signal = n, None

    def attach(self, first_step):
        return self

    def should_stop(self, steps_done):
        if steps_done >= self.n:
            self.signal = "SIGINT"
        return self.signal is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, path: str, **query):
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _until_served(proc, failure: str, fetch):
    """fetch()'s first truthy answer from a TensorBoard starting in `proc` (polled for up to
    2 minutes; connection errors while it starts are retried)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            answer = fetch()
            if answer:
                return answer
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{failure}: rc {proc.poll()}, "
                                 f"{proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tb")
    for layout in LAYOUTS:
        cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                        train=TrainConfig(layout=layout, batch_size=16),
                        loop=LoopConfig(warmup=WARMUP, steps=STEPS),
                        output=OutputConfig(progress=False))
        run_loop(cfg, select_devices(MeshShape(2, 4)), logdir / layout, log=lambda *_: None)
    for schedule in SCHEDULES:
        cfg = RunConfig(mesh=MeshConfig(mesh="data:4,stage:2"),
                        model=ModelConfig(model="gpt-tiny"),
                        train=TrainConfig(layout="pp", batch_size=16, microbatches=2,
                                          pp_schedule=schedule),
                        loop=LoopConfig(warmup=WARMUP, steps=STEPS),
                        output=OutputConfig(progress=False))
        run_loop(cfg, select_devices(parse_mesh("data:4,stage:2")), logdir / f"pp-{schedule}",
                 log=lambda *_: None)
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(layout="zero1", batch_size=16),
                    loop=LoopConfig(warmup=1, steps=10), output=OutputConfig(progress=False))
    stopped = run_loop(cfg, select_devices(MeshShape(2, 4)), logdir / INTERRUPTED,
                       log=lambda *_: None, stop=_StopAt(3))
    assert stopped["status"] == "interrupted" and stopped["steps_done"] == 3
    port = _free_port()
    exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or "tensorboard"
    # --load_fast=false: the pure-Python reader (the Rust one is a separate download).
    proc = subprocess.Popen([exe, "--logdir", str(logdir), "--host", "127.0.0.1",
                             "--port", str(port), "--load_fast=false", "--reload_interval=1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=""), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def both_runs_loaded():
            tags = _get(base, "/data/plugin/scalars/tags")
            return all("train/loss" in tags.get(run, {}) for run in RUNS)

        _until_served(proc, "tensorboard did not serve both runs", both_runs_loaded)
        yield base, logdir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and nothing else
        proc.wait(timeout=30)


def test_hparams_table_has_identity_columns_and_run_metrics(server):
    base, logdir = server
    experiment = _get(base, "/data/plugin/hparams/experiment",
                      request=json.dumps({"experimentName": ""}))
    columns = {h["name"] for h in experiment["hparamInfos"]}
    assert {"layout", "mesh", "model", "dtype", "status", "steps", "devices", "batch",
            "microbatches", "remat", "overlap", "simulated"} <= columns
    assert not any(c.startswith(("checkpoint", "dist", "compiler.", "output")) for c in columns)
    # at most 25 columns in all; memory in the unit of the runs' scale, named in the title
    assert len(columns) + len(experiment["metricInfos"]) <= 25
    titles = {m["name"]["tag"]: m["displayName"] for m in experiment["metricInfos"]}
    assert titles[METRIC_PREFIX + "state_kib_per_device"] == "state KiB/device"
    assert titles[METRIC_PREFIX + "compiler_bound_kib"] == "compiler bound KiB/device"
    assert {METRIC_PREFIX + m for m in ("step_time_p50_s", "ktokens_per_s", "mfu",
                                        "measured_peak_kib", "energy_per_step_j", "accuracy",
                                        "final_loss")} <= set(titles)

    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                   "STATUS_RUNNING"],
               "colParams": [{"hparam": "layout"}]}
    groups = _get(base, "/data/plugin/hparams/session_groups", request=json.dumps(request))
    rows = {g["hparams"]["layout"]: g for g in groups["sessionGroups"]
            if g["hparams"]["layout"] in LAYOUTS}
    assert sorted(rows) == sorted(LAYOUTS)
    assert len(groups["sessionGroups"]) == len(RUNS)  # no two runs merged into one row
    for layout, group in rows.items():
        results = RunRecord.load(logdir / layout).results
        assert group["name"] == layout  # the row is named by the run's folder
        assert group["hparams"]["status"] == "complete"
        assert group["hparams"]["steps"] == str(WARMUP + STEPS)
        assert group["hparams"]["mesh"] == "2x4"
        assert group["hparams"]["model"] == "mlp-tiny"
        assert group["hparams"]["devices"] == "8"  # a string: a number reads `8.0000`
        assert group["hparams"]["dtype"] == "float32"
        assert set(group["hparams"]) == set(run_hparams(results))  # ps_mode absent
        values = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert memory_unit(results) == ("KiB", 1024.0)
        state = values[METRIC_PREFIX + "state_kib_per_device"]
        assert state == pytest.approx(results["memory"]["state_bytes_per_device"] / 1024,
                                      rel=1e-6)
        bound = values[METRIC_PREFIX + "compiler_bound_kib"]
        assert 0.1 <= state <= 9_999 and 0.1 <= bound <= 9_999
        assert values[METRIC_PREFIX + "step_time_p50_s"] == pytest.approx(
            results["step_time_s"]["p50"], rel=1e-6)
        # Not measured on CPU: no value at all rather than a zero.
        assert METRIC_PREFIX + "mfu" not in values
        assert METRIC_PREFIX + "energy_per_step_j" not in values


def test_pipeline_runs_differ_by_schedule_with_bubble_stage_bytes_and_memory_shown(server):
    base, logdir = server
    experiment = _get(base, "/data/plugin/hparams/experiment",
                      request=json.dumps({"experimentName": ""}))
    # What TensorBoard ticks by default: the first five columns after sorting (differing
    # first, then by name) and the first five metrics. Every column is at least 10 em
    # (160 px) wide: at 1600 px the table shows the Trial ID, these five and one metric.
    shown = [h["name"] for h in experiment["hparamInfos"]][:5]
    assert shown == ["dtype", "layout", "mesh", "model", "status"]
    titles = {m["name"]["tag"]: m.get("displayName", "") for m in experiment["metricInfos"]}
    first = [m["name"]["tag"] for m in experiment["metricInfos"]][:4]
    assert first == [METRIC_PREFIX + t for t in ("step_time_p50_s", "state_kib_per_device",
                                                 "compiler_bound_kib", "measured_peak_kib")]
    assert "functional only if simulated" in titles[METRIC_PREFIX + "step_time_p50_s"]
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
               "colParams": [{"hparam": "layout"}]}
    groups = _get(base, "/data/plugin/hparams/session_groups", request=json.dumps(request))
    rows = {g["hparams"].get("schedule"): g for g in groups["sessionGroups"]
            if g["hparams"]["layout"] == "pp"}
    assert sorted(rows) == sorted(SCHEDULES)
    for schedule, group in rows.items():
        results = RunRecord.load(logdir / f"pp-{schedule}").results
        assert group["hparams"]["mesh"] == "data:4,stage:2"  # pastes back into --mesh
        assert parse_mesh(group["hparams"]["mesh"]).axis_sizes == results["mesh"]
        values = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        pp = results["pipeline"]
        assert values[METRIC_PREFIX + "pp_bubble"] == pytest.approx(pp["bubble"])
        unit, size = memory_unit(results)
        assert values[METRIC_PREFIX + f"compiler_bound_{unit.lower()}"] == pytest.approx(
            results["memory"]["compiled"]["peak_bytes"] / size, rel=1e-6)


def test_loss_has_one_point_per_step_and_no_one_point_charts_but_run_metrics(server):
    base, _ = server
    tags = _get(base, "/data/plugin/scalars/tags")
    for run in LAYOUTS:
        points = _get(base, "/data/plugin/scalars/scalars", run=run, tag="train/loss")
        assert [step for _, step, _ in points] == list(range(WARMUP + STEPS))
        per_step = {t for t in tags[run] if not t.startswith(METRIC_PREFIX)}
        assert per_step == {"train/loss", "train/step_time_s", "train/warmup_step_time_s",
                            f"train/mlp-tiny/{run}/step_time_s"}  # its model's, layout's chart
    # Time Series lays tag groups out alphabetically: the one-point run figures come after
    # the training curves, so the first thing TensorBoard shows is train/.
    groups = sorted({t.split("/")[0] for run in LAYOUTS for t in tags[run]})
    assert groups == ["train", METRIC_PREFIX.rstrip("/")]


def test_summary_table_and_custom_scalars(server):
    base, _ = server
    text_tags = _get(base, "/data/plugin/text/tags")
    # tensorboardX adds "/text_summary" to a text tag.
    assert sorted(text_tags["ddp"]) == ["config/text_summary", "summary/text_summary"]
    summary = _get(base, "/data/plugin/text/text", run="ddp", tag="summary/text_summary")
    assert "state per device (shards)" in summary[0]["text"]
    # fsdp ran after ddp beside it, with the same losses: it says so (one line on the chart)
    assert "note/text_summary" in text_tags["fsdp"]
    note = _get(base, "/data/plugin/text/text", run="fsdp", tag="note/text_summary")
    assert "equal those of ddp (ddp, mesh 2x4) at every one of its 4 steps" in \
        note[0]["text"]
    assert "note/text_summary" not in text_tags[INTERRUPTED]  # 3 steps: not the same run
    layout = _get(base, "/data/plugin/custom_scalars/layout")
    charts = {(cat["title"], c["title"]): c["multiline"]["tag"] for cat in layout["category"]
              for c in cat["chart"]}
    # one category per model: resnet18's seconds and gpt-tiny's milliseconds never share an axis
    assert charts == {("train", "loss"): ["^train/loss$"],
                      ("train", "step time (s)"): ["^train/step_time_s$"],
                      **{(f"step time (s) by layout: {model}", layout):
                         [f"^train/{re.escape(model)}/{layout}/step_time_s$"]
                         for model, layout in (("mlp-tiny", "ddp"), ("mlp-tiny", "fsdp"),
                                               ("gpt-tiny", "pp"), ("mlp-tiny", "zero1"))}}


def test_each_layouts_step_time_chart_shows_every_run_of_that_layout_whole(server):
    """The overlay's outlier scaling can cut a slower layout off; its own chart holds
    every timed step of each of its runs, and no other layout's."""
    base, _ = server
    for model, layout, runs in (("gpt-tiny", "pp", [f"pp-{s}" for s in SCHEDULES]),
                                ("mlp-tiny", "ddp", ["ddp"]),
                                ("mlp-tiny", "zero1", [INTERRUPTED])):
        got = {}
        for run in RUNS:  # what the chart asks for, run by run
            payload = _get(base, "/data/plugin/custom_scalars/scalars", run=run,
                           tag=f"^train/{re.escape(model)}/{layout}/step_time_s$")[
                               "tag_to_events"]
            for points in payload.values():
                got[run] = [step for _, step, _ in points]
        timed = list(range(WARMUP, WARMUP + STEPS)) if layout != "zero1" else [1, 2]
        assert got == {run: timed for run in runs}


def test_rows_are_named_by_run_folder_and_say_whether_the_run_finished(server):
    """The Trial ID a user matches against `ls runs`; an interrupted run's row says so and
    how far it got, where its figures otherwise look like a finished run's."""
    base, logdir = server
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 20,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                   "STATUS_RUNNING"],
               "colParams": [{"hparam": "status"}, {"hparam": "steps"}]}
    groups = _get(base, "/data/plugin/hparams/session_groups", request=json.dumps(request))
    rows = {g["name"]: g["hparams"] for g in groups["sessionGroups"]}
    assert sorted(rows) == sorted(p.name for p in logdir.iterdir())
    assert {name: (hp["status"], hp["steps"]) for name, hp in rows.items()} == {
        **{run: ("complete", str(WARMUP + STEPS)) for run in RUNS if run != INTERRUPTED},
        INTERRUPTED: ("interrupted", "3 of 11")}
    record = RunRecord.load(logdir / INTERRUPTED).results
    assert record["status"] == "interrupted"


def test_the_printed_tensorboard_command_runs_as_printed(tmp_path, monkeypatch, capsys):
    """What a run prints is pasted into a shell as it is (here with a loopback --host and a
    free --port added): it starts TensorBoard on the runs folder, which serves this run."""
    from experiments.run import main

    monkeypatch.chdir(tmp_path)
    assert main(["--layout", "ddp", "--mesh", "2x4", "--model", "mlp-tiny", "--batch-size",
                 "16", "--warmup", "1", "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    (run,) = (tmp_path / "runs").iterdir()
    # the Trial ID: what the run is first (a narrow column still tells layouts apart), then
    # when it started, month to second
    assert re.fullmatch(r"ddp-2x4-mlp-tiny-\d{4}-\d{6}", run.name), run.name
    line = next(x for x in out.splitlines() if x.startswith("TensorBoard: "))
    command = line.removeprefix("TensorBoard: ")
    assert command.endswith(" --logdir runs")  # the folder of runs, not this one run
    assert f"this run alone: {command}/{run.name}" in out
    port = _free_port()
    proc = subprocess.Popen(f"{command} --host 127.0.0.1 --port {port}",
                            shell=True, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=""),
                            start_new_session=True)
    try:
        runs = _until_served(proc, f"`{command}` did not answer",
                             lambda: _get(f"http://127.0.0.1:{port}", "/data/runs"))
        assert runs == [run.name]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the shell and TensorBoard
        proc.wait(timeout=30)


def test_a_run_stopped_in_warmup_still_has_a_row_that_says_interrupted(tmp_path):
    """Stopped before any timed step: no step-time figures, but a row (status, steps, the
    exact memory figures) rather than none, so the run is not missing from the table."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(layout="fsdp", batch_size=16),
                    loop=LoopConfig(warmup=5, steps=5), output=OutputConfig(progress=False))
    results = run_loop(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None,
                       stop=_StopAt(2))
    assert results["step_time_s"]["n"] == 0
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    start = metadata.parse_session_start_info_plugin_data(
        events.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content)
    assert (start.hparams["status"].string_value, start.hparams["steps"].string_value) == \
        ("interrupted", "2 of 10")
    tags = events.Tags()["scalars"]
    assert METRIC_PREFIX + "state_kib_per_device" in tags
    assert METRIC_PREFIX + "step_time_p50_s" not in tags  # blank, never a zero
    assert RunRecord.load(tmp_path).results["status"] == "interrupted"
