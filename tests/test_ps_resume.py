"""`--resume` of a killed PS run, fixed ports on restart, and a run beside busy tokenless
HTTP/2 connections, on real processes: one unbroken sync run (with 1,024 busy tokenless
HTTP/2 connections on each shard's gRPC port), one run whose shard 0 is killed and restarted
on its fixed port and whose launcher is then SIGKILLed, and the resume of that run on the
same fixed ports. They share their setup (a module fixture): three runs in all. Bad resumes
are checked in-process."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxdist import procs
from jaxdist.record import RunRecord
from tests.helpers import ROOT, child_env, cli_main
from tests.test_ps_hostile import RUN, SLOW
from tests.test_ps_server import TOKEN

EVERY = ["--ps-checkpoint-every", "2"]
PEER_CONNECTIONS = 1024  # per shard: the gRPC port's connection cap


def _argv(logdir, port: int, *extra) -> list:
    return [sys.executable, "-m", "experiments.run", *RUN, *EVERY, "--ps-port", str(port),
            "--logdir", str(logdir), "--no-progress", *extra]


def _env(**extra) -> dict:
    return {**child_env(), "JAXDIST_PS_TOKEN": TOKEN, **extra}


def _latest(path) -> int:
    try:
        return int(path.read_text().strip()[len("snap-"):])
    except (OSError, ValueError):
        return -1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    port = procs.free_port_pair()
    from tests.test_ps_attacks import BusyPeer

    peer = BusyPeer(tmp / "unbroken" / "ps", 2, PEER_CONNECTIONS, every_s=0.3)
    peer.start()
    try:
        # worker 1 slowed (0.3 s a step): the peer's connections spend their budgets
        # while the run trains
        unbroken = subprocess.run(_argv(tmp / "unbroken", port), cwd=ROOT,
                                  env=_env(JAXDIST_PS_FAULT=SLOW), capture_output=True,
                                  text=True, timeout=240)
    finally:
        peer.stop_event.set()
        peer.join(20)
    # shard 0 dies at version 4 (a snapshot's) and restarts on its fixed port; once both
    # shards have snapshotted version 6 the launcher is SIGKILLed (its children follow it)
    killed = tmp / "killed"
    log = tmp / "killed.log"  # what the run said, for a run that ends before its kill
    with open(log, "w") as out:
        proc = subprocess.Popen(_argv(killed, port), cwd=ROOT,
                                env=_env(JAXDIST_PS_FAULT="slow-worker:1:0.5,kill-shard:0:4"),
                                stdout=out, stderr=subprocess.STDOUT)
    snaps = killed / "ps" / "snapshots"
    try:
        end = time.monotonic() + 180
        while min(_latest(snaps / f"shard{k}" / "LATEST") for k in range(2)) < 6:
            assert proc.poll() is None and time.monotonic() < end, \
                f"the run ended first (rc {proc.poll()}): {log.read_text()[-3000:]}"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    end = time.monotonic() + 30
    while procs.pids_mentioning(str(killed)) and time.monotonic() < end:
        time.sleep(0.1)
    left = procs.pids_mentioning(str(killed))
    copy = tmp / "killed-copy"  # for the bad resumes: the killed run as it was left
    shutil.copytree(killed, copy)
    resumed = subprocess.run(_argv(killed, port, "--resume"), cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=240)
    return {"port": port, "unbroken": unbroken, "peer": peer, "resumed": resumed, "killed": killed,
            "copy": copy, "left": left, "tmp": tmp}


def test_a_killed_ps_run_resumes_with_the_losses_of_an_unbroken_one(runs):
    """Sync mode is deterministic: the resumed run's losses, from the step its shards'
    snapshots hold, are the unbroken run's, number for number."""
    assert runs["unbroken"].returncode == 0, runs["unbroken"].stderr[-3000:]
    assert runs["left"] == []  # the killed launcher's children went with it
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full = RunRecord.load(runs["tmp"] / "unbroken").results["loss"]
    part = RunRecord.load(runs["killed"]).results["loss"]
    start = len(full) - len(part)
    assert len(full) == 12 and 6 <= start < 12, (len(full), len(part))
    assert part == full[start:]
    assert f"worker(s) start at step(s) [{start}]" in resumed.stdout
    for k in range(2):
        log = (runs["killed"] / "ps" / f"shard{k}.log").read_text()
        assert f"restored version {start}" in log and "Traceback" not in log
    print(f"killed after version >= 6 of 12; resumed from step {start}: "
          f"{len(part)} losses equal to the unbroken run's")


def test_busy_tokenless_http2_connections_do_not_stop_a_run_from_starting(runs):
    """1,024 HTTP/2 connections on each shard's gRPC port (its connection cap), each
    sending a refused call every 0.3 s from the moment the shard serves, so gRPC's idle
    close never fires on them: the run trains every step, with the losses it has alone
    (the resumed run's test compares them), since its calls go over the data ports; the
    shards shut the held connections past their budget of calls without a session."""
    import re

    from ps.peer_budget import BUDGET

    peer, unbroken = runs["peer"], runs["unbroken"]
    assert peer.error is None, peer.error
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    r = RunRecord.load(runs["tmp"] / "unbroken").results
    assert len(r["loss"]) == 12
    assert peer.opened == 2 * PEER_CONNECTIONS, peer.opened
    closed = []
    for k in range(2):
        log = (runs["tmp"] / "unbroken" / "ps" / f"shard{k}.log").read_text()
        assert "Traceback" not in log
        counts = re.findall(r"(\d+) connection\(s\) closed over their budget of (\d+)", log)
        assert counts and int(counts[-1][1]) == BUDGET, log[-2000:]
        closed.append(int(counts[-1][0]))
    print(f"peer: {peer.opened} connections, {peer.sent} calls sent, {peer.refusals} refused, "
          f"{peer.closed_by_shard} closed by the shards (over budget, per shard: {closed}); "
          f"run: 12 steps, exit 0")


def test_a_fixed_ps_port_is_bound_again_by_a_restarted_shard_and_a_resumed_run(runs):
    """--ps-port P: shard k listens on P + k. A shard killed mid-run is restarted on its
    own port, and the run resumed after its launcher was killed binds the same ports
    again (gRPC binds with SO_REUSEADDR; TIME_WAIT connections of the dead shards do not
    hold them)."""
    port = runs["port"]
    assert runs["resumed"].returncode == 0, runs["resumed"].stderr[-3000:]
    log0 = (runs["killed"] / "ps" / "shard0.log").read_text()
    log1 = (runs["killed"] / "ps" / "shard1.log").read_text()
    # shard 0: its first life, its restart in the killed run, the resumed run
    assert log0.count(f"serving on 127.0.0.1:{port},") == 3, log0[-3000:]
    assert log1.count(f"serving on 127.0.0.1:{port + 1},") == 2, log1[-3000:]


BAD_RESUMES = [
    # (flags changed from the killed run's, the start of the one line)
    (["--model", "mlp"], "--resume: the snapshots in {ps} are of another job"),
    (["--ps-shards", "1"], "--resume: the snapshots in {ps} are of another job"),
    (["--mesh", "4x1", "--batch-size", "16"], "--resume: shard 0's snapshot of version"),
    (["--ps-mode", "async"], "--resume: shard 0's snapshot of version"),
    (["--lr", "0.02"], "--resume: {ps} is a run with other settings (--lr was 0.01, now "
                       "0.02); resume it with its own flags"),
]


@pytest.mark.parametrize("changed, line", BAD_RESUMES, ids=[" ".join(c) for c, _ in BAD_RESUMES])
def test_a_resume_whose_snapshots_do_not_match_the_job_is_one_line_exit_2(
        runs, changed, line, capsys, monkeypatch):
    monkeypatch.setenv("JAXDIST_PS_TOKEN", TOKEN)
    copy = runs["copy"]
    before = sorted(str(p) for p in copy.rglob("*"))
    args = list(RUN)
    for i in range(0, len(changed), 2):
        args[args.index(changed[i]) + 1] = changed[i + 1]
    r = cli_main(capsys, *args, *EVERY, "--logdir", str(copy), "--resume")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("run: error: " + line.format(ps=copy / "ps")), lines[0]
    assert sorted(str(p) for p in copy.rglob("*")) == before  # nothing written


def test_a_resume_with_nothing_to_resume_is_one_line_exit_2(runs, tmp_path, capsys,
                                                            monkeypatch):
    monkeypatch.setenv("JAXDIST_PS_TOKEN", TOKEN)
    cases = [
        (tmp_path / "empty", "holds no parameter-server run"),
        (runs["tmp"] / "unbroken", "holds a run that ended"),
    ]
    (tmp_path / "empty").mkdir()
    for logdir, says in cases:
        r = cli_main(capsys, *RUN, *EVERY, "--logdir", str(logdir), "--resume")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert says in r.stderr, r.stderr
    r = cli_main(capsys, *RUN, *EVERY, "--resume")
    assert r.returncode == 2 and "needs --logdir" in r.stderr, r.stderr


def test_a_worker_start_step_outside_the_run_is_one_line_exit_2(tmp_path, capsys):
    """ps.worker --start-step (the launcher's, for a resume) is a step of the run."""
    import signal as signals

    from ps import worker
    from tests.test_ps_server import FLAGS

    sigint = signals.getsignal(signals.SIGINT)  # the worker's main takes SIGINT over
    try:
        for step in ("-1", "999"):
            argv = ["--worker", "0", "--ready-dir", str(tmp_path), "--steps", "12",
                    "--warmup", "0", "--start-step", step, *FLAGS]
            assert worker.main(argv) == 2
            assert capsys.readouterr().err.strip().splitlines() == [
                f"ps.worker: error: --start-step {step} is outside the run's steps 0..11"]
    finally:
        signals.signal(signals.SIGINT, sigint)
