"""SIGINT and SIGTERM mid-run: the run stops after the current step, saves a checkpoint,
writes results.json with status "interrupted" and exits 130 / 143 with one line; on two
processes both stop on the same step (JAX's preemption sync point)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxdist import loop
from jaxdist.config import (LoopConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig,
                            TrainConfig)
from jaxdist.devices import select_devices
from jaxdist.mesh import MeshShape
from jaxdist.record import RunRecord, check
from tests.helpers import ROOT, child_env, run_loop

# No warm-up: every step is timed, so an interrupt always lands after timed steps (the path
# that writes TensorBoard's summary; one landing in warm-up writes results.json only).
LONG = ["--model", "mlp-tiny", "--batch-size", "16", "--warmup", "0", "--steps", "1000000",
        "--no-progress"]
LINE = re.compile(r"run: interrupted by (SIG\w+) after (\d+) of 1000000 steps")


def _start(args, **kw):
    env = child_env(PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "experiments.run", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)


def _wait_for_steps(proc, timeout=180):
    """Block until the run has compiled (its log line), then let it take some steps."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("compiled the"):
            time.sleep(0.5)
            return
        assert time.monotonic() < deadline, "the run never compiled"
    pytest.fail("the run exited before compiling")


def _finish(procs, timeout=300):
    """(returncode, stderr) of each; whatever is still running is killed."""
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_one_process_stops_writes_results_and_checkpoint(tmp_path, signum, code):
    logdir, ck = tmp_path / "run", tmp_path / "ck"
    proc = _start(["--mesh", "2x4", *LONG, "--logdir", str(logdir), "--checkpoint-dir", str(ck)])
    try:
        _wait_for_steps(proc)
        proc.send_signal(signum)
    finally:
        (rc, err), = _finish([proc])
    assert rc == code, err
    assert "Traceback" not in err
    line = [ln for ln in err.splitlines() if ln.startswith("run:")]
    assert len(line) == 1 and LINE.match(line[0]), err
    assert "resume with the same command plus --resume" in line[0]
    steps = int(LINE.match(line[0]).group(2))
    results = RunRecord.load(logdir).results
    assert results["status"] == "interrupted"
    assert results["interrupted"]["signal"] == signal.Signals(signum).name
    assert results["steps_done"] == steps == len(results["loss"])
    assert results["step_time_s"]["n"] == steps == results["interrupted"]["timed_steps"] > 0
    assert results["checkpoint"]["saved_steps"] == [steps]
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [steps]
    assert list(logdir.glob("events.out.tfevents.*"))  # TensorBoard events kept


def test_sigterm_after_10000_steps_leaves_the_record(tmp_path):
    """Mesh runs: SLURM sends SIGKILL 30 s after SIGTERM, so what a stop
    has left to write must not grow with the run. TensorBoard's events are written as the
    steps go (RunWriter.step); at the stop come the statistics and results.json. One device,
    mlp-tiny (the cheapest step, ~0.8 ms here); the step count is read off the progress bar.
    10,000 steps, not the PS test's 50,000: what is left at the stop is the same code at
    any count (measured at 50,054 and 50,146 steps: 2.8 and 1.8 s to exit), and the suite
    has 10 minutes. SIGTERM-to-exit seconds are printed, not asserted."""
    import threading

    reached, total = 10_000, 1_000_000
    logdir = tmp_path / "run"
    proc = _start(["--mesh", "1", "--layout", "ddp", *LONG[:-1], "--logdir", str(logdir)])
    err = []  # stderr as it comes (the bar is rewritten in place, without newlines)
    fd = proc.stderr.fileno()
    reader = threading.Thread(target=lambda: err.extend(
        b.decode(errors="ignore") for b in iter(lambda: os.read(fd, 4096), b"")), daemon=True)
    reader.start()
    bar = re.compile(rf"(\d+)/{total} ")
    try:
        deadline = time.monotonic() + 600
        while max(map(int, bar.findall("".join(err)[-400:])), default=0) < reached:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)[-2000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
        exit_s = time.monotonic() - t0
        reader.join(10)
    finally:
        _finish([proc])
    text = "".join(err)
    assert proc.returncode == 143, text[-2000:]
    assert "Traceback" not in text
    line = re.findall(r"^run: interrupted by SIGTERM after (\d+) of 1000000 steps", text, re.M)
    assert len(line) == 1, text[-2000:]
    results = RunRecord.load(logdir).results
    assert results["status"] == "interrupted" and results["interrupted"]["signal"] == "SIGTERM"
    assert reached <= results["steps_done"] == int(line[0]) == len(results["loss"])
    print(f"{results['steps_done']} steps; SIGTERM to exit {exit_s:.2f} s")


def test_two_processes_stop_on_the_same_step(tmp_path):
    """Ctrl-C on process 0 only: it becomes the SIGTERM that JAX's preemption notifier
    listens for (the same path as a SIGTERM), and process 1 learns of it from the
    coordination service. (One case only: each two-process run costs ~25 s here.)"""
    from jaxdist.procs import free_port_pair

    target, signum = 0, signal.SIGINT
    port = free_port_pair()
    logdir = tmp_path / "run"
    procs = [_start(["--mesh", "2x4", *LONG, "--logdir", str(logdir), "--platform", "cpu",
                     "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                     "--process-id", str(i), "--init-timeout", "30"]) for i in range(2)]
    try:
        for p in procs:
            _wait_for_steps(p)
        procs[target].send_signal(signum)
    finally:
        done = _finish(procs)
    name = signal.Signals(signum).name
    lines = []
    for i, (rc, err) in enumerate(done):
        assert "Traceback" not in err, err[-3000:]
        # The process signalled exits by its signal; the other was told through JAX's
        # coordination service (a SIGTERM preemption notice).
        assert rc == (130 if i == target and signum == signal.SIGINT else 143), err
        lines.append(next(LINE.match(ln) for ln in err.splitlines() if LINE.match(ln)))
    assert lines[target].group(1) == name
    assert lines[0].group(2) == lines[1].group(2)  # the same step on both
    results = RunRecord.load(logdir).results
    assert results["status"] == "interrupted"
    assert results["steps_done"] == int(lines[0].group(2)) == len(results["loss"])
    assert results["interrupted"]["timed_steps"] == results["steps_done"]


def _tiny_run(logdir, warmup: int, steps: int) -> dict:
    """mlp-tiny on 2x4 in this process (loop.run), its outputs in `logdir`."""
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(batch_size=16), loop=LoopConfig(warmup=warmup, steps=steps),
                    output=OutputConfig(progress=False))
    return run_loop(cfg, select_devices(MeshShape(2, 4)), logdir, log=lambda *_: None)


class StopAfter:
    """Stands in for jaxdist.stop.StopRequest: a SIGINT "arrives" once `n` steps are done."""
    def __init__(self, n):
        self.n, self.signal = n, None

    def __call__(self):
        return self

    def install(self):
        return self

    def attach(self, first_step):
        return self

    def restore(self):
        pass

    def should_stop(self, steps_done):
        if steps_done >= self.n:
            self.signal = "SIGINT"
        return self.signal is not None


def test_stopped_in_warmup_has_no_step_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "StopRequest", StopAfter(2))
    results = _tiny_run(tmp_path, warmup=5, steps=5)
    assert results["status"] == "interrupted" and results["steps_done"] == 2
    steps = results["step_time_s"]
    assert steps["n"] == 0 and steps["mean"] is None and steps["p50"] is None
    assert steps["reason"] == "interrupted before the first timed step (after warm-up)"
    assert results["throughput"] == {"samples_per_s": None, "tokens_per_s": None}
    assert len(results["warmup_step_time_s"]) == 2
    assert results["power"]["available"] is False
    on_disk = RunRecord.load(tmp_path).results
    assert on_disk["status"] == "interrupted" and on_disk["step_time_s"]["mean"] is None


def test_stopped_after_timed_steps_keeps_its_record_and_tensorboard_summary(tmp_path,
                                                                           monkeypatch):
    """The hparams plugin has no ABORTED status: asking for one crashed every run
    interrupted after warm-up, and the crash deleted the run's folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata

    monkeypatch.setattr(loop, "StopRequest", StopAfter(4))
    results = _tiny_run(tmp_path, warmup=1, steps=10)
    assert results["status"] == "interrupted" and results["steps_done"] == 4
    assert results["step_time_s"]["n"] == 3 == results["interrupted"]["timed_steps"]
    assert RunRecord.load(tmp_path).results["steps_done"] == 4
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    end = metadata.parse_session_end_info_plugin_data(
        events.SummaryMetadata(metadata.SESSION_END_INFO_TAG).plugin_data.content)
    assert end.status == api_pb2.STATUS_UNKNOWN
    assert events.Scalars("train/step_time_s")[-1].step == 3


def test_a_complete_run_says_so(tmp_path):
    results = _tiny_run(tmp_path, warmup=1, steps=2)
    on_disk = RunRecord.load(tmp_path).results
    assert on_disk["status"] == "complete" and on_disk["interrupted"] is None
    assert on_disk["steps_done"] == 3 == len(results["loss"])


def test_ctrl_c_while_starting_is_one_line_and_keeps_the_users_folder(tmp_path):
    """Ctrl-C during the imports and setup (before any step): no traceback, exit 130,
    nothing left that the run made, the existing --logdir folder and its files kept."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    proc = _start(["--mesh", "2x4", *LONG, "--logdir", str(folder)])
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    finally:
        (rc, err), = _finish([proc])
    assert rc == 130, err
    assert err.strip() == "run: interrupted by SIGINT before the first step; nothing was kept"
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_failure_after_the_record_is_written_keeps_the_folder(tmp_path, monkeypatch, capsys):
    """A run that wrote results.json and then failed (writing TensorBoard's copy, say)
    keeps its folder: what it measured is not deleted with the failure."""
    from experiments.run import main

    def record_then_fail(cfg, platform, logdir, stop=None, notice=None):
        (logdir / "results.json").write_text('{"status": "complete"}')
        raise RuntimeError("failed after the record")

    monkeypatch.setattr(loop, "run", record_then_fail)
    logdir = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="failed after the record"):
        main(["--mesh", "2x4", "--model", "mlp-tiny", "--logdir", str(logdir)])
    assert (logdir / "results.json").read_text() == '{"status": "complete"}'
    assert f"run: failed after writing {logdir / 'results.json'}" in capsys.readouterr().err


def test_a_failure_before_the_record_removes_only_what_the_run_made(tmp_path, monkeypatch):
    from experiments.run import main

    def fail(cfg, platform, logdir, stop=None, notice=None):
        (logdir / "partial.txt").write_text("half")
        raise RuntimeError("failed early")

    monkeypatch.setattr(loop, "run", fail)
    (tmp_path / "mine.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        main(["--mesh", "2x4", "--model", "mlp-tiny", "--logdir", str(tmp_path / "run")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_sigterm_during_a_long_compile_stops_within_10_s(tmp_path):
    """SIGTERM once the step program is built (a depth-16 gpt-tiny then compiles its init
    and its step for ~25 s on a loaded 2-core host): the process ends within 10 s with the
    one line naming the phase and the steps done, exit 143, and the interrupted record:
    status interrupted, the phase, no step. It waited for XLA (45-48 s), then ran the step
    and exited 0 as "complete"."""
    env = {k: v for k, v in child_env(PYTHONUNBUFFERED="1").items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--model", "gpt-tiny", "--model-opts",
         "depth=16", "--mesh", "2", "--batch-size", "2", "--warmup", "0", "--steps", "1",
         "--no-progress", "--logdir", str(tmp_path / "run")], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # logged once the program is built, before its compiles
            if line.startswith("No accelerator in use"):
                break
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert took < 10, took
    record = tmp_path / "run" / "results.json"
    phase = re.fullmatch(r"run: interrupted by SIGTERM during (state init|tracing the step|the "
                         r"XLA compile), before step 1 \(0 of 1 steps done\); "
                         + re.escape(str(record)) + r" records it\n", err)
    assert phase, err
    results = RunRecord.load(record).results
    assert check(results) == []
    assert (results["status"], results["steps_done"], results["loss"]) == ("interrupted", 0, [])
    assert results["interrupted"]["phase"] == phase.group(1)
    assert results["interrupted"]["signal"] == "SIGTERM"
    assert RunRecord.load(record).status == "interrupted"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["results.json"]


def test_sigterm_to_one_of_two_processes_during_setup_stops_both_within_10_s(tmp_path):
    """SIGTERM to process 1 only, while both build and compile a depth-16 gpt-tiny: it
    stops at once and posts the signal through JAX's coordination service; process 0, which
    was not signalled, stops with it and writes the interrupted record naming the phase.
    (JAX's preemption notifier, which used to hold the signal until the first step, starts
    only once setup is done.)"""
    from jaxdist.procs import free_port_pair

    port = free_port_pair()
    logdir = tmp_path / "run"
    env = {k: v for k, v in child_env(PYTHONUNBUFFERED="1").items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--model", "gpt-tiny", "--model-opts",
         "depth=16", "--mesh", "2", "--batch-size", "2", "--warmup", "0", "--steps", "1",
         "--no-progress", "--logdir", str(logdir), "--platform", "cpu", "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--init-timeout", "60"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True) for i in range(2)]
    try:
        for line in procs[1].stdout:  # logged once the program is built, before compiling
            if line.startswith("No accelerator in use"):
                break
        time.sleep(0.5)
        sent = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        done = _finish(procs, timeout=60)
        took = time.monotonic() - sent
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [rc for rc, _ in done] == [143, 143], done
    assert took < 10, took
    phases = []
    for _, err in done:
        line = re.fullmatch(r"run: interrupted by SIGTERM during (state init|tracing the "
                            r"step|the XLA compile), before step 1 \(0 of 1 steps done\)"
                            r"(; .*results\.json records it)?\n", err)
        assert line, err
        phases.append(line.group(2) is not None)
    assert phases == [True, False]  # process 0 speaks for both
    record = RunRecord.load(logdir / "results.json")
    assert record.status == "interrupted"
    assert (record.results["steps_done"], record.results["loss"]) == (0, [])
    assert record.results["interrupted"]["signal"] == "SIGTERM"
