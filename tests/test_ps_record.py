"""What a PS run records and prints: the whole job's throughput (every worker's samples over
the shared wall window, not worker 0's), `status` and `steps_done` like every mesh run, and
summaries (PS and PyTorch) where every "n/a" says why.

One real 2-worker async PS run (shard and workers in their own processes on 127.0.0.1) and
one 2-rank PyTorch run, both mlp-tiny with a few steps."""

import copy
import re
import subprocess
import sys

import pytest

from jaxdist.record import RunRecord, check
from jaxdist.summary import format_summary
from ps import collect
from ps.series import read_worker
from tests.helpers import HEAVY_MODULES, ROOT, child_env, run_cli, run_refusing_script

WORKERS, BATCH, WARMUP, STEPS = 2, 8, 1, 3
BARE_NA = re.compile(r"n/a(?! \()")  # an n/a not followed by its reason in parentheses


@pytest.fixture(scope="session")
def ps_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("psrec") / "async"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAXDIST_PS_FAULT", raising=False)
        proc = run_cli("--layout", "ps", "--mesh", f"{WORKERS}x1", "--ps-shards", "1",
                       "--ps-mode", "async", "--model", "mlp-tiny", "--batch-size", str(BATCH),
                       "--warmup", str(WARMUP), "--steps", str(STEPS), "--logdir", str(logdir),
                       timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = RunRecord.load(logdir).results
    workers = [read_worker(logdir / "ps" / f"worker{w}.json") for w in range(WORKERS)]
    return proc, logdir, results, workers


def test_throughput_is_every_workers_samples_over_the_shared_window(ps_run):
    _, _, r, workers = ps_run
    rows = BATCH // WORKERS
    samples = [rows * (len(w["step_s"]) - WARMUP) for w in workers]
    assert samples == [rows * STEPS] * WORKERS
    start = min(w["window"]["start_unix_s"] for w in workers)
    end = max(w["window"]["end_unix_s"] for w in workers)
    tp = r["throughput"]
    assert tp["samples"] == sum(samples) == 24
    assert tp["window"] == r["window"] == {"start_unix_s": start, "end_unix_s": end}
    assert tp["samples_per_s"] == sum(samples) / (end - start)   # exactly as recorded
    assert "shared wall window" in tp["definition"]
    for w, (mine, n) in enumerate(zip(tp["per_worker"], samples)):
        own = workers[w]["window"]
        assert mine["worker"] == w and mine["samples"] == n and mine["timed_steps"] == STEPS
        span = own["end_unix_s"] - own["start_unix_s"]
        assert mine["samples_per_s"] == n / span
        assert mine["outside_steps_s"] == span - sum(workers[w]["step_s"][WARMUP:])
    # MFU divides by the same rate: the job's time per global batch.
    assert r["ps"]["mfu_time_per_batch_s"] == BATCH / tp["samples_per_s"]
    assert RunRecord.load(ps_run[1]).samples_per_s == tp["samples_per_s"]


def test_status_and_steps_done_like_a_mesh_run(ps_run):
    _, logdir, r, _ = ps_run
    assert check(r) == []
    assert r["status"] == "complete" and r["interrupted"] is None
    assert r["steps_done"] == WARMUP + STEPS
    assert r["ps"]["steps_done_per_worker"] == [WARMUP + STEPS] * WORKERS
    assert RunRecord.load(logdir, require_valid=True).status == "complete"


def test_ps_summary_says_why_every_figure_is_missing(ps_run):
    proc, _, r, _ = ps_run
    tp = r["throughput"]
    assert BARE_NA.findall(proc.stdout) == [], proc.stdout
    assert re.search(r"\n  collectives per device/step +n/a \(not XLA collectives: workers exchange "
                     r"gradients and parameters with the shards over TCP \(the shards' data "
                     r"ports\)", proc.stdout)
    assert re.search(r"\n  bytes per step +push [0-9.]+ MiB, pull [0-9.]+ MiB, over TCP "
                     r"\(the shards' data ports\)\n", proc.stdout)
    assert (f"  job throughput         {tp['samples_per_s']:.1f} samples/s = 24 samples (by "
            f"worker: w0 12, w1 12) / {tp['window_s']:.3f} s shared window") in proc.stdout
    assert re.search(rf"\n  throughput +{tp['samples_per_s']:.1f} samples/s\n", proc.stdout)


def test_ps_summary_without_pushes_or_updates(ps_run):
    """Figures a run did not produce read n/a with the reason, never 'None' or a made-up 0."""
    r = copy.deepcopy(ps_run[2])
    r["ps"]["push_latency_s"] = r["ps"]["pull_latency_s"] = None
    r["ps"]["staleness"].update(histogram={}, count=0, max=None, mean=None)
    text = collect.format_ps(r)
    assert "  push / pull p50 / p99  n/a (no push call was timed); n/a (no pull call was " \
           "timed)" in text
    assert "  staleness max / mean   n/a (no gradient was applied on any shard)" in text
    assert "None" not in text and BARE_NA.findall(text) == []


def test_no_timed_step_gives_no_throughput_and_says_why(ps_run):
    workers = {w: data for w, data in enumerate(ps_run[3])}
    # every step counted as warm-up: nothing timed
    tp = collect.job_throughput(workers, BATCH // WORKERS, WARMUP + STEPS, None)
    assert tp["samples"] == 0 and tp["samples_per_s"] is None
    assert tp["reason"] == "no timed step on any worker"
    r = dict(ps_run[2], throughput=tp)
    assert "  job throughput         n/a (no timed step on any worker)" in collect.format_ps(r)
    assert re.search(r"\n  throughput +n/a \(no timed step on any worker\)\n",
                     format_summary(r) + "\n")


def test_torch_summary_says_why_every_figure_is_missing(tmp_path):
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "experiments.torch_run", "--strategy", "ddp",
                           "--nproc", "2", "--model", "mlp-tiny", "--batch-size", "8",
                           "--warmup", "1", "--steps", "1", "--logdir", str(tmp_path / "t"),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert BARE_NA.findall(proc.stdout) == [], proc.stdout
    assert re.search(r"\n  compiler bound per device +n/a \(eager PyTorch: no compiled "
                     r"program, so no compiler bound\)\n", proc.stdout)
    assert re.search(r"\n  collectives per device/step +n/a \(not read for PyTorch: its collectives "
                     r"\(gloo/NCCL, eager\) are not analysed", proc.stdout)
    r = RunRecord.load(tmp_path / "t").results
    assert check(r) == [] and r["comm"] is None
    assert r["memory"]["compiled_reason"].startswith("eager PyTorch")


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "4,x"], "--sizes takes positive integers"),
    (["--shards", "0"], "--shards takes positive integers"),
    (["--model", "mlp,nope"], "unknown model 'nope'"),
    (["--transports", "tcp,udp"], "unknown transport 'udp'"),
    (["--batch-size", "63"], "not divisible by --workers 2"),
    (["--steps", "0"], "--steps must be at least 1")])
def test_bench_ps_bad_input_is_one_line_and_exit_2(argv, message):
    """Only a --model check imports the models (flax, jax: a second); the rest is refused
    before them."""
    proc = run_refusing_script(ROOT / "scripts" / "bench_ps.py", argv)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout == f"{list(HEAVY_MODULES) if argv[0] == '--model' else []}\n"
