"""`python -m experiments.run --layout ps` end to end: sync == ddp, update accounting,
accuracy of async and ssp on digits, the ssp bound, dead workers, dead shards (with and
without snapshots), no orphan processes, and bad PS options.

Fault injection goes through JAXDIST_PS_FAULT (real SIGKILLs, duplicated pushes, a slow
worker); every run uses mlp-tiny and a few steps to keep the file near a minute and a half
on 2 cores."""

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from jaxdist.config import MeshConfig, ModelConfig, PSConfig, RunConfig
from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape
from jaxdist.record import RunRecord, check
from jaxdist.procs import pids_alive, pids_mentioning
from ps.series import read_worker
from tests.helpers import child_env, cli_main, job_of, read_scalars, run_cli, train

DIGITS = ["--model", "mlp-tiny", "--dataset", "digits", "--lr", "0.003", "--batch-size", "60",
          "--warmup", "2", "--steps", "78", "--eval-every", "40"]
STEPS = 80


def run_ps(logdir: Path, *args, fault: str = "", timeout=240):
    with pytest.MonkeyPatch.context() as mp:
        if fault:
            mp.setenv("JAXDIST_PS_FAULT", fault)
        else:
            mp.delenv("JAXDIST_PS_FAULT", raising=False)
        start = time.monotonic()
        proc = run_cli("--layout", "ps", *args, "--logdir", str(logdir), timeout=timeout)
        proc.seconds = time.monotonic() - start
    return proc


def results(logdir: Path) -> dict:
    return RunRecord.load(logdir).results



def assert_no_orphans(logdir: Path, pids=()):
    deadline = time.monotonic() + 5
    while (pids_alive(pids) or pids_mentioning(str(logdir))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_alive(pids) == []
    assert pids_mentioning(str(logdir)) == []


# -- sync: ddp's arithmetic, exact accounting ---------------------------------------------

@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("ps") / "sync"
    proc = run_ps(logdir, "--mesh", "2x2", "--ps-shards", "3", "--ps-mode", "sync",
                  "--model", "mlp-tiny", "--batch-size", "16", "--lr", "0.01",
                  "--warmup", "0", "--steps", "4", fault="dup-push:1:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, logdir, results(logdir)


def test_sync_reproduces_ddp(sync_run):
    _, _, r = sync_run
    ddp = train("mlp-tiny", "ddp", MeshShape(1, 1), steps=4)[0]  # lr 1e-2, batch 16, seed 0
    assert np.ptp(ddp) > 1e-2
    np.testing.assert_allclose(r["loss"], ddp, rtol=1e-5)


def test_sync_applies_every_gradient_once(sync_run):
    _, _, r = sync_run
    for shard in r["ps"]["updates"]["per_shard"]:
        assert shard["applied"] == 4 * 2            # steps x workers
        assert shard["applies"] == 4 and shard["version"] == 4
        assert shard["deduplicated"] == 1           # worker 1 sent step 2 twice
        assert shard["rejected"] == 0
    assert r["ps"]["staleness"]["histogram"] == {"0": 4 * 2 * 3}


def test_sync_results_and_tensorboard(sync_run):
    proc, logdir, r = sync_run
    assert check(r) == []
    assert r["layout"] == "ps" and r["mesh"] == {"workers": 2, "devices_per_worker": 2}
    assert r["env"]["simulated"] is True and r["env"]["num_devices"] == 4
    assert r["step_time_s"]["n"] == 4 and len(r["loss"]) == 4
    ps = r["ps"]
    assert ps["transport"] == "tcp"                 # the default: data calls on ps.tcp
    assert "data port" in (logdir / "ps" / "shard0.log").read_text()
    assert sum(ps["shard_map"]["bytes_per_shard"]) == 6922 * 4
    assert [s["params_bytes"] for s in ps["server_bytes_per_shard"]] == \
        ps["shard_map"]["bytes_per_shard"]
    assert all(s["opt_bytes"] > s["params_bytes"] for s in ps["server_bytes_per_shard"])
    assert r["memory"]["state_bytes_per_device"] == 6922 * 4
    assert len(r["memory"]["state_bytes_by_device"]) == 2      # worker 0's two devices
    workers = [read_worker(logdir / "ps" / f"worker{w}.json") for w in (0, 1)]
    calls = {"push_latency_s": 4 * 2 * 3 + 3,     # steps x workers x shards + the dup push
             "pull_latency_s": 4 * 2 * 3}
    for key, n in calls.items():
        recorded = np.concatenate([w[key.split("_")[0] + "_s"] for w in workers])
        assert ps[key]["n"] == n == recorded.size
        assert ps[key]["p50"] == pytest.approx(np.percentile(recorded, 50), rel=1e-12)
        assert ps[key]["p99"] == pytest.approx(np.percentile(recorded, 99), rel=1e-12)
        assert ps[key]["max"] == pytest.approx(recorded.max(), rel=1e-12)
    step_s = workers[0]["step_s"]
    assert r["step_time_s"]["p50"] == pytest.approx(np.percentile(step_s, 50), rel=1e-12)
    assert ps["bytes_per_step"]["push"] * 4 == _push_bytes(r, logdir)  # exact, headers too
    payload = 4 * 2 * 6922 * 4                                # steps x workers x params
    frames = 4 * 2 * ps["shards"]                             # one frame (a run) per shard
    pull_min = payload + _header_bytes(r, logdir, "param", {"version": 0, "epoch": 0,
                                                             "waited_us": 0}) * 4 * 2
    # each version and waited_us field adds at most 7 digits to a header
    assert pull_min <= ps["bytes_per_step"]["pull"] * 4 <= pull_min + frames * 14
    assert len(ps["step_time_s_per_worker"]) == 2
    assert (logdir / "ps" / "shard_map.json").exists()
    scalars = read_scalars(logdir)
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(r["loss"], rel=1e-6)
    assert len(scalars["train/step_time_s"]) == 4
    assert "train/worker1/step_time_s" in scalars
    assert "shard map" in proc.stdout and "tensorboard --logdir" in proc.stdout


def _header_bytes(r, logdir, op, meta) -> int:
    """Bytes of every frame header of one full transfer (all shards) with these fields:
    a shard's pieces (mlp-tiny: 6,922 parameters) fit in one frame, so they travel as one
    run, its header naming the first piece and their count."""
    smap = json.loads((logdir / "ps" / "shard_map.json").read_text())
    total = 0
    for k in range(smap["num_shards"]):
        pieces = [p for p in smap["pieces"] if p["shard"] == k]
        elements = sum(p["length"] for p in pieces)
        assert len(pieces) > 1 and elements * 4 <= 1 << 20
        header = {"op": op, "name": pieces[0]["name"], "dtype": "float32", "shape": [elements],
                  "offset": 0, **meta, "nbytes": elements * 4, "count": len(pieces)}
        total += 8 + len(json.dumps(header, separators=(",", ":")))
    return total


def _push_bytes(r, logdir) -> int:
    """Exact push bytes of sync_run: step t of worker w carries version t, epoch 0."""
    total = 0
    for w in (0, 1):
        for t in range(4):
            meta = {"worker": w, "step": t, "version": t, "epoch": 0}
            one = _header_bytes(r, logdir, "push", meta) + 6922 * 4
            total += one * (2 if (w, t) == (1, 2) else 1)    # dup-push:1:2 sent it twice
    return total


def test_no_orphans_after_a_run(sync_run):
    _, logdir, r = sync_run
    assert len(r["ps"]["pids"]) == 3 + 2
    assert_no_orphans(logdir, r["ps"]["pids"])


# -- async and ssp: accuracy, staleness, a worker that dies -------------------------------

@pytest.fixture(scope="session")
def async_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("ps") / "async"
    proc = run_ps(logdir, "--mesh", "3x1", "--ps-shards", "2", "--ps-mode", "async", *DIGITS,
                  fault="kill-worker:2:20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logdir, results(logdir)


@pytest.fixture(scope="session")
def ssp_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("ps") / "ssp"
    proc = run_ps(logdir, "--mesh", "3x1", "--ps-shards", "1", "--ps-mode", "ssp",
                  "--staleness", "1", "--ps-staleness-lr", *DIGITS,
                  fault="slow-worker:1:0.01,kill-worker:2:30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return logdir, results(logdir)


@pytest.mark.parametrize("which", ["async_run", "ssp_run"])
def test_async_and_ssp_learn_digits_and_survive_a_dead_worker(which, request):
    logdir, r = request.getfixturevalue(which)
    assert check(r) == []
    assert [a["step"] for a in r["accuracy"]] == [40, 80]
    assert r["accuracy"][-1]["accuracy"] > 0.8
    assert [d["worker"] for d in r["ps"]["dead_workers"]] == [2]
    assert len(r["loss"]) == STEPS and all(math.isfinite(x) for x in r["loss"])
    died_at = 20 if which == "async_run" else 30
    for shard in r["ps"]["updates"]["per_shard"]:
        assert shard["applied"] == 2 * STEPS + died_at + 1
        assert shard["rejected"] == 0
        assert "2" in shard["retired_workers"]
    shards = len(r["ps"]["updates"]["per_shard"])
    assert r["ps"]["staleness"]["count"] == shards * (2 * STEPS + died_at + 1)
    scalars = read_scalars(logdir)
    assert len(scalars["eval/accuracy"]) == 2
    assert_no_orphans(logdir, r["ps"]["pids"])
    # Every pull after the first came with the previous step's push, answered once the
    # push was applied (one PushPullOne call per shard): no time of its own on the worker,
    # and each shard's pull took the seconds of the push it rode with.
    worker = read_worker(logdir / "ps" / "worker0.json")
    assert worker["phases_s"]["pull_s"][0] > 0 and not any(worker["phases_s"]["pull_s"][1:])
    pulls = worker["pull_s"][shards:]
    assert len(pulls) >= shards * (STEPS - 1) and pulls == worker["push_s"][:len(pulls)]


def test_ssp_never_exceeds_its_bound(ssp_run):
    _, r = ssp_run
    ps = r["ps"]
    assert ps["staleness_bound"] == 1
    assert ps["step_staleness"]["max"] <= 1            # how far ahead a gradient's worker ran
    assert ps["staleness"]["max"] <= (3 - 1) * (2 * 1 + 1)  # what that allows in versions
    assert ps["wait_s"]["bound"] > 0                   # the slow worker held the others
    assert ps["lr_scale"]["min"] < 1.0                 # --ps-staleness-lr scaled stale updates


def test_async_records_staleness(async_run):
    _, r = async_run
    hist = r["ps"]["staleness"]["histogram"]
    assert sum(hist.values()) == r["ps"]["staleness"]["count"]
    assert r["ps"]["staleness"]["max"] >= 1
    assert r["ps"]["wait_s"]["bound"] == 0 and r["ps"]["wait_s"]["barrier"] == 0


# -- sync and a dead worker ---------------------------------------------------------------

SYNC_SMALL = ["--mesh", "2x1", "--ps-shards", "1", "--ps-mode", "sync", "--model", "mlp-tiny",
              "--batch-size", "16", "--warmup", "0", "--steps", "8"]


def test_sync_stops_naming_a_dead_worker(tmp_path):
    logdir = tmp_path / "run"
    proc = run_ps(logdir, *SYNC_SMALL, "--ps-checkpoint-every", "1", fault="kill-worker:1:2")
    assert proc.returncode != 0
    assert "worker 1" in proc.stderr and "sync mode cannot continue" in proc.stderr
    # The failed run keeps only the logs it points the user to, the shard's snapshots and
    # what a --resume reads beside them: no results, no events.
    left = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*") if p.is_file())
    logs = [p for p in left if not p.startswith("ps/snapshots/")
            and p not in ("ps/shard_map.json", "ps/config.json")]
    assert logs and all(p.startswith("ps/") and p.endswith(".log") for p in logs), left
    from ps import snapshot
    arrays, meta = snapshot.load(logdir / "ps" / "snapshots" / "shard0")
    assert meta["version"] >= 2 and arrays, left
    assert not (logdir / "results.json").exists()
    assert_no_orphans(logdir)


def test_sync_drop_dead_workers_goes_on(tmp_path):
    logdir = tmp_path / "run"
    proc = run_ps(logdir, *SYNC_SMALL, "--ps-drop-dead-workers", "--ps-timeout-s", "10",
                  fault="kill-worker:1:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = results(logdir)
    assert [d["worker"] for d in r["ps"]["dead_workers"]] == [1]
    for shard in r["ps"]["updates"]["per_shard"]:
        assert shard["applied"] == 3 * 2 + 5 * 1     # steps 0-2 by both, 3-7 by worker 0
        assert shard["version"] == 8
    assert_no_orphans(logdir, r["ps"]["pids"])


# -- a dead shard -------------------------------------------------------------------------

def test_dead_shard_without_snapshots_stops_quickly(tmp_path):
    logdir = tmp_path / "run"
    proc = run_ps(logdir, *SYNC_SMALL, "--ps-timeout-s", "20", fault="kill-shard:0:3")
    assert proc.returncode != 0
    assert "shard 0" in proc.stderr and "--ps-checkpoint-every" in proc.stderr
    assert proc.seconds < 60                            # not a hang, not the timeout
    assert_no_orphans(logdir)


def test_dead_shard_restarts_from_its_snapshot(tmp_path):
    logdir = tmp_path / "run"
    proc = run_ps(logdir, "--mesh", "2x1", "--ps-shards", "2", "--ps-mode", "sync",
                  "--model", "mlp-tiny", "--batch-size", "16", "--warmup", "0",
                  "--steps", "12", "--ps-checkpoint-every", "2", "--ps-timeout-s", "30",
                  fault="kill-shard:1:5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = results(logdir)
    assert check(r) == []
    assert [x["shard"] for x in r["ps"]["shard_restarts"]] == [1]
    shards = r["ps"]["updates"]["per_shard"]
    assert shards[1]["epoch"] == 1 and shards[0]["epoch"] == 0
    assert shards[0]["version"] == 12 and shards[1]["version"] == 12  # training went on
    assert any("restored version 4" in e for e in shards[1]["events"])
    assert len(r["loss"]) == 12 and all(math.isfinite(x) for x in r["loss"])
    assert_no_orphans(logdir, r["ps"]["pids"])


def test_workers_read_the_data_dir(tmp_path):
    """--data-dir reaches the workers: they load the CIFAR files written here (before the
    fix a worker called load_dataset without it and exited with the usage error)."""
    from tests.test_dataset_files import write_cifar

    write_cifar(tmp_path / "data", sizes=(16, 16, 16, 16, 16, 16))
    logdir = tmp_path / "run"
    proc = run_ps(logdir, "--mesh", "2x1", "--ps-shards", "1", "--ps-mode", "sync",
                  "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                  "--model", "mlp-tiny", "--batch-size", "8", "--warmup", "0", "--steps", "3",
                  "--eval-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = results(logdir)
    assert r["config"]["data"]["dataset"] == "cifar10" and len(r["loss"]) == 3
    assert [a["step"] for a in r["accuracy"]] == [3]


# -- bad options --------------------------------------------------------------------------

BAD_CLI = [
    (["--ps-shards", "64"], "exceeds the 10 pieces"),
    (["--ps-bind", "0.0.0.0"], "JAXDIST_PS_TOKEN"),
]


@pytest.mark.parametrize("args, message", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_ps_options_exit_2_with_one_line(tmp_path, args, message, monkeypatch, capsys):
    monkeypatch.delenv("JAXDIST_PS_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--layout", "ps", "--mesh", "2x1", "--model", "mlp-tiny",
                    "--batch-size", "16", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


BAD = [
    ({"ps_shards": 0}, "--ps-shards must be 1 or more"),
    ({"ps_shards": 11}, "exceeds the 10 pieces"),
    ({"staleness": -1}, "--staleness must be 0 or more"),
    ({"ps_timeout_s": 0.0}, "--ps-timeout-s must be a positive finite number"),
    ({"ps_timeout_s": float("inf")}, "--ps-timeout-s must be a positive finite number"),
    ({"ps_clip_norm": -1.0}, "--ps-clip-norm must be 0 \\(off\\) or a positive finite"),
    ({"ps_clip_norm": float("nan")}, "--ps-clip-norm must be 0"),
    ({"ps_port": 70000}, "--ps-port 70000 with 2 shard\\(s\\) needs ports 70000..70001"),
    ({"ps_port": 80}, "give a base within 1024..65534"),  # was bind()'s traceback
    ({"ps_checkpoint_every": -2}, "--ps-checkpoint-every must be 0 or more"),
    ({"ps_max_message_mb": 0}, "--ps-max-message-mb must be within"),
    ({"ps_staleness_lr": True}, "--ps-staleness-lr applies to"),
    ({"ps_tls_cert": "/nonexistent.pem"}, "go together"),
    ({"ps_tls_cert": "/nonexistent.pem", "ps_tls_key": "/k.pem"}, "no such file"),
    ({"ps_bind": "203.0.113.9"}, "JAXDIST_PS_TOKEN"),
    ({"ps_bind": "999.1.1.1"}, "--ps-bind '999.1.1.1' is not a valid address"),  # not the
    ({"ps_bind": "host name"}, "is not a valid address"),                         # token's
]


@pytest.mark.parametrize("fields, message", BAD, ids=[str(f) for f, _ in BAD])
def test_validate_ps(fields, message, monkeypatch):
    from experiments.validation import check_ps

    monkeypatch.delenv("JAXDIST_PS_TOKEN", raising=False)
    cfg = RunConfig(mesh=MeshConfig(mesh="2x1"), model=ModelConfig(model="mlp-tiny"),
                    ps=PSConfig(**fields))
    with pytest.raises(UsageError, match=message):
        check_ps(job_of(cfg))


def test_validate_ps_address_not_local(monkeypatch):
    from experiments.validation import check_ps

    monkeypatch.setenv("JAXDIST_PS_TOKEN", "x" * 20)
    cfg = RunConfig(mesh=MeshConfig(mesh="2x1"), model=ModelConfig(model="mlp-tiny"),
                    ps=PSConfig(ps_bind="203.0.113.9"))
    with pytest.raises(UsageError, match="not an address of this host"):
        check_ps(job_of(cfg))


def test_killing_the_launcher_leaves_no_orphans(tmp_path):
    """kill -9 of the launcher runs no cleanup at all: the children's parent-death watchdogs
    must take them down."""
    import signal
    import subprocess
    import sys

    from tests.helpers import ROOT

    logdir = tmp_path / "run"
    env = child_env()
    env.pop("JAXDIST_PS_FAULT", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--layout", "ps", *SYNC_SMALL[:-1],
         "100000", "--logdir", str(logdir), "--no-progress"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids_file = logdir / "ps" / "pids.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if pids_file.exists() and len(json.loads(pids_file.read_text() or "[]")) == 3:
            break
        time.sleep(0.1)
    pids = json.loads(pids_file.read_text())
    assert len(pids) == 3 and pids_alive(pids)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    assert_no_orphans(logdir, pids)


def test_ctrl_c_keeps_a_ps_runs_results_marked_interrupted(tmp_path):
    """SIGINT keeps a PS run's results: every worker stops after its current step and writes what it measured, sync's barrier
    lets the others finish theirs, and the record says `interrupted`; per-worker step-time
    curves hold timed steps only."""
    import signal
    import subprocess
    import sys

    from tests.helpers import ROOT

    logdir = tmp_path / "run"
    env = child_env()
    env.pop("JAXDIST_PS_FAULT", None)
    args = [*SYNC_SMALL[:-3], "2", "--steps", "100000"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--layout", "ps", *args,
         "--logdir", str(logdir), "--no-progress"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        logs = [logdir / "ps" / f"worker{w}.log" for w in (0, 1)]
        while not all(p.exists() and "all workers ready" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        time.sleep(2.0)  # some timed steps
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("run:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    r = results(logdir)
    assert check(r) == []
    assert r["status"] == "interrupted" and r["interrupted"]["signal"] == "SIGINT"
    assert 2 < r["steps_done"] < 100002 and len(r["loss"]) == r["steps_done"]
    assert lines[0].startswith(f"run: interrupted by SIGINT after {r['steps_done']} of "
                               f"100002 steps; results (status interrupted) in ")
    assert lines[0].endswith("a parameter-server run does not resume; to start again from "
                             "step 0 run the same command with another --logdir")
    for w in (0, 1):
        worker = read_worker(logdir / "ps" / f"worker{w}.json")
        assert worker["interrupted"] == "SIGINT" and worker["steps_done"] > 2
    # Step times are worker 0's (step_time_definition); at sync's barrier another worker may
    # have finished one step more when the signal came, and steps_done is the furthest.
    per_worker = r["interrupted"]["steps_done_per_worker"]
    assert r["steps_done"] == max(per_worker) and max(per_worker) - min(per_worker) <= 1
    assert r["step_time_s"]["n"] == r["interrupted"]["timed_steps"] == per_worker[0] - 2
    scalars = read_scalars(logdir)
    for w in (0, 1):  # warm-up steps 0 and 1 are not on the per-worker curves
        assert scalars[f"train/worker{w}/step_time_s"][0][0] == 2
    assert_no_orphans(logdir, json.loads((logdir / "ps" / "pids.json").read_text()))
