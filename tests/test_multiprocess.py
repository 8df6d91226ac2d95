"""Multi-host on one machine: 2 processes x 4 CPU devices under jax.distributed (gloo) must
equal 1 process x 8 devices, and a peer that never starts gives a one-line error in time."""

import subprocess
import sys
import time

import pytest

from jaxdist.record import RunRecord
from tests.helpers import ROOT, child_env, cli_main, run_cli

COMMON = ["--model", "mlp-tiny", "--batch-size", "16", "--warmup", "1", "--steps", "3"]


def launch(*args, timeout=120):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "experiments.launch", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("layout, mesh, hosts", [
    ("ddp", "2x4", None), ("fsdp", "2x4", None),
    ("hsdp", "2x4", {"data": {"in_host": 1, "hosts": 2}, "fsdp": {"in_host": 4, "hosts": 1}}),
    # fsdp over both processes: 4 devices in each x 2 processes
    ("fsdp", "1x8", {"data": {"in_host": 1, "hosts": 1}, "fsdp": {"in_host": 4, "hosts": 2}})])
def test_two_processes_equal_one(tmp_path, layout, mesh, hosts):
    one = run_cli("--layout", layout, "--mesh", mesh, *COMMON, "--logdir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = launch("--processes", "2", "--", "--layout", layout, "--mesh", mesh, *COMMON,
                 "--logdir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout + two.stderr
    a = RunRecord.load(tmp_path / "one").results
    b = RunRecord.load(tmp_path / "two").results
    assert b["env"]["num_processes"] == 2 and a["env"]["num_processes"] == 1
    if hosts:
        assert b["env"]["hosts_per_axis"] == hosts
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    # Every device's shard bytes, gathered from both processes, labelled by process.
    assert [d["bytes"] for d in b["memory"]["state_bytes_by_device"]] == \
           [d["bytes"] for d in a["memory"]["state_bytes_by_device"]]
    assert sorted({d["process"] for d in b["memory"]["state_bytes_by_device"]}) == [0, 1]
    assert "[1]" in two.stdout  # output of each process is prefixed with its id


def test_missing_peer_is_named_within_the_timeout(tmp_path):
    code = (
        "import sys; from experiments.launch import launch; "
        "sys.exit(launch(2, ['--mesh', '2x4', '--model', 'mlp-tiny', '--batch-size', '16', "
        f"'--init-timeout', '4', '--logdir', {str(tmp_path / 'run')!r}], start=[0]))")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env=child_env())
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert "[0] run: error: process(es) 1 of 2 did not join within 4 s" in proc.stdout
    assert "launch: process 0 exited with status 2" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < 30
    assert not (tmp_path / "run").exists()


def test_worker_without_coordinator_names_it(tmp_path):
    proc = run_cli("--mesh", "2x4", "--model", "mlp-tiny", "--batch-size", "16",
                   "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1",
                   "--init-timeout", "2", cwd=tmp_path)
    assert proc.returncode == 2
    assert "process 0 (the coordinator" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_incomplete_distributed_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--mesh", "2x4", "--model", "mlp-tiny", "--num-processes", "2")
    assert proc.returncode == 2
    assert "needs all of --coordinator" in proc.stderr


@pytest.mark.parametrize("args, line", [
    (["--mesh", "3x1", "--batch-size", "6"],
     "launch: error: mesh 3x1 (3 devices) does not split evenly over 2 processes"),
    (["--mesh", "3x1"], "launch: error: global batch 64 is not divisible by the 3 batch "
                        "shards of mesh 3x1; use a multiple of 3, e.g. --batch-size 63 or 66"),
    (["--mesh", "2x4", "--layout", "fsdpp"], "launch: error: unknown layout 'fsdpp' (did you "
                                             "mean 'fsdp' or 'fsdp_tp'?)"),
    # the launcher's own flags: a user's --num-processes 3 was overridden in silence
    (["--mesh", "2x4", "--num-processes", "3"], "launch: error: --num-processes: the "
                                                "launcher gives each process these"),
    # one process's job: each of the N processes started the same PS job, and each failed
    (["--mesh", "2x1", "--layout", "ps"], "launch: error: --layout ps runs as one process"),
    (["--mesh", "2x4", "--dry-run"], "launch: error: --dry-run runs as one process")])
def test_launcher_refuses_before_starting_processes(args, line, monkeypatch, capsys):
    """A mistake the run would refuse is refused once by the launcher, one line, exit 2,
    and no process is started (before, each of the N processes imported jax and printed
    the same error, prefixed)."""
    from experiments import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process started"))
    code = launch.main(["--processes", "2", "--", "--model", "mlp-tiny", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(line) and len(err.strip().splitlines()) == 1, err


def _two_processes(tmp_path, args_of) -> tuple[list[int], list[tuple[str, str]]]:
    """Processes 0 and 1 of one job started by hand (COMMON on a 2x4 mesh, `args_of(i)`
    added): (exit codes, (stdout, stderr) of each)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *COMMON, "--mesh", "2x4", "--no-progress",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         *args_of(i)], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        out = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], out


def test_a_logdir_process_0_refuses_stops_every_process_at_once_with_its_reason(tmp_path):
    """Process 1 stops at once, not after its --init-timeout, when process 0 refuses --logdir."""
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "results.json").write_text('{"status": "complete"}')
    start = time.monotonic()
    codes, out = _two_processes(tmp_path, lambda i: ["--init-timeout", "120",
                                                     "--logdir", str(finished)])
    elapsed = time.monotonic() - start
    reason = f"--logdir {finished} already holds a finished run; choose another"
    assert codes == [2, 2], out
    assert out[0][1].strip() == f"run: error: {reason}"
    assert out[1][1].strip() == f"run: error: process 0: {reason}"
    assert elapsed < 60  # seconds of start-up, not the 120 s --init-timeout
    assert (finished / "results.json").read_text() == '{"status": "complete"}'


def test_processes_started_with_other_settings_are_refused_by_name(tmp_path):
    """Each process compiles its own program: started with another --model, they met in
    gloo with collectives of other sizes and every process aborted ("Received data size
    doesn't match expected size", a C++ stack each). Process 0 compares every process's
    settings at the join point: one line each, exit 2, the difference named; a per-process
    setting (--logdir, --init-timeout) may differ."""
    codes, out = _two_processes(tmp_path, lambda i: [
        "--init-timeout", str(60 + i), "--logdir", str(tmp_path / f"run{i}"),
        "--lr", ("0.001", "0.002")[i]])
    reason = ("process 1 was started with other settings than process 0: --lr 0.002 (process "
              "0: 0.001); start every process with the same flags")
    assert codes == [2, 2], out
    assert out[0][1].strip() == f"run: error: {reason}"
    assert out[1][1].strip() == f"run: error: process 0: {reason}"
    assert list(tmp_path.iterdir()) == []


def test_shared_settings_leave_out_what_each_process_gives_its_own_way():
    from jaxdist.config import RunConfig
    from jaxdist.distributed import differences, shared_settings

    mine = shared_settings(RunConfig().to_dict())
    assert {"model", "mesh", "lr", "batch_size", "xla_flags"} <= set(mine)
    assert not {"process_id", "logdir", "init_timeout", "data_dir"} & set(mine)
    theirs = dict(mine, model="mlp-tiny", seed=1, steps=9, warmup=4)
    assert differences(mine, mine, 1) is None
    assert differences(mine, theirs, 3) == (
        "process 3 was started with other settings than process 0: --model 'mlp-tiny' "
        "(process 0: 'gpt-tiny'); --seed 1 (process 0: 0); --steps 9 (process 0: 20) and 1 "
        "more; start every process with the same flags")
