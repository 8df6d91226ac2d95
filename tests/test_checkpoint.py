"""Checkpoints: reshard on restore, exact resume after kill -9, interrupted saves, and
checkpoints from another model."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxdist.checkpoint import Checkpointer
from jaxdist.record import RunRecord
from jaxdist.mesh import MeshShape
from tests.helpers import ROOT, child_env, cli_main, train

META = {"model": "mlp-tiny", "model_opts": "", "dataset": "synthetic", "optimizer": "adamw",
        "dtype": "float32"}


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("layout, shape", [("ddp", MeshShape(8, 1)), ("fsdp", MeshShape(4, 2))])
def test_restore_reshards(tmp_path, layout, shape):
    _, saved, _ = train("mlp-tiny", "fsdp", MeshShape(2, 4), steps=2)
    ckpt = Checkpointer(str(tmp_path), 1, META)
    ckpt.maybe_save(2, saved, data_position=2)
    ckpt.finish()

    _, _, target = train("mlp-tiny", layout, shape, steps=0)
    restored, meta = Checkpointer(str(tmp_path), 0, META).restore(
        2, target.abstract_state, target.state_shardings)
    assert meta["step"] == 2 and meta["data_position"] == 2
    # fsdp on 8 devices stores the head's 10-wide bias padded to 16 (sharding/padding.py);
    # ddp keeps it whole: the restore cuts the padding off, and pads where the target does
    for a, b, want in zip(_host(saved), _host(restored), jax.tree.leaves(target.abstract_state),
                          strict=True):
        assert b.shape == want.shape
        common = tuple(slice(0, min(i, j)) for i, j in zip(a.shape, b.shape))
        np.testing.assert_array_equal(a[common], b[common])
        for whole in (a.copy(), b.copy()):  # beyond the common part: padding, zeros
            whole[common] = 0
            assert not whole.any()
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(target.state_shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


ARGS = ["--mesh", "2x4", "--layout", "fsdp", "--model", "mlp-tiny", "--batch-size", "16",
        "--warmup", "1", "--steps", "799"]


def _complete_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


# The runs around the process that is killed are made in this process (cli_main): only the
# victim's death needs a process of its own.
def test_resume_after_kill_9_continues_exactly(tmp_path, capsys):
    reference = cli_main(capsys, *ARGS, "--logdir", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr
    ref_loss = RunRecord.load(tmp_path / "ref").results["loss"]

    ck = tmp_path / "ck"
    env = child_env()
    victim = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *ARGS, "--checkpoint-dir", str(ck),
         "--checkpoint-every", "50", "--logdir", str(tmp_path / "victim"), "--no-progress"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck.exists() and any(s >= 100 for s in _complete_steps(ck))):
            assert victim.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.killpg(victim.pid, signal.SIGKILL)
    finally:
        victim.wait()
    assert victim.returncode == -signal.SIGKILL
    k = _complete_steps(ck)[-1]
    assert 100 <= k < 800

    resumed = cli_main(capsys, *ARGS, "--checkpoint-dir", str(ck), "--resume",
                       "--logdir", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint {k}" in resumed.stdout
    results = RunRecord.load(tmp_path / "resumed").results
    assert results["start_step"] == k
    assert results["loss"] == ref_loss[k:]  # bit for bit: same program, data position, state


def test_interrupted_save_never_replaces_the_last_good_one(tmp_path, capsys):
    ck = tmp_path / "ck"
    first = cli_main(capsys, *ARGS[:-1], "6", "--checkpoint-dir", str(ck),
                     "--checkpoint-every", "3", "--logdir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    assert _complete_steps(ck) == [3, 6]
    # A save of step 9 killed mid-write: Orbax's temporary directory, half the files.
    partial = ck / "9.orbax-checkpoint-tmp-1796000000000000"
    shutil.copytree(ck / "6", partial)
    for f in list(partial.rglob("*"))[::2]:
        if f.is_file():
            f.unlink()
    resumed = cli_main(capsys, *ARGS[:-1], "20", "--checkpoint-dir", str(ck), "--resume",
                       "--logdir", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint 6" in resumed.stdout

    # A committed step whose files were truncated afterwards (a disk filled, a copy cut
    # short): one line naming it and what to do, no run folder; it was TensorStore's
    # traceback. The folder is the user's: left as it is.
    *_, before, last = _complete_steps(ck)
    for f in (ck / str(last) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")
    args = [*ARGS[:-1], "30", "--checkpoint-dir", str(ck), "--resume"]
    broken = cli_main(capsys, *args, "--logdir", str(tmp_path / "c"))
    assert broken.returncode == 2
    assert broken.stderr.strip().splitlines() == [
        f"run: error: checkpoint {last} in {ck} cannot be restored (" +
        broken.stderr.split(" cannot be restored (", 1)[1].rsplit("); ", 1)[0] +
        f"); move {ck / str(last)} aside to resume from step {before}"]
    assert "OUT_OF_RANGE" in broken.stderr and (ck / str(last)).is_dir()
    assert not (tmp_path / "c").exists()
    (ck / str(last)).rename(tmp_path / "aside")
    again = cli_main(capsys, *args, "--logdir", str(tmp_path / "d"))
    assert again.returncode == 0, again.stderr
    assert f"resumed from checkpoint {before}" in again.stdout


def test_damaged_resume_is_one_line_every_time(tmp_path, capsys, caplog, monkeypatch):
    """A --resume of a checkpoint whose files were emptied, 20 times: each time the one line
    (no TensorStore spec), nothing else on stderr, no traceback through sys.unraisablehook
    (where TensorStore's late callbacks went, also at interpreter exit), nothing logged by
    asyncio when the failed reads are collected, no run folder."""
    ck = tmp_path / "ck"
    made = cli_main(capsys, *ARGS[:-1], "1", "--checkpoint-dir", str(ck),
                    "--checkpoint-every", "1", "--logdir", str(tmp_path / "a"))
    assert made.returncode == 0, made.stderr
    for f in (ck / "2" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")
    stray = []  # what reaches the hook: the tracebacks Python would print
    monkeypatch.setattr(sys, "unraisablehook", stray.append)
    args = [*ARGS[:-1], "30", "--checkpoint-dir", str(ck), "--resume",
            "--logdir", str(tmp_path / "c")]
    head = f"run: error: checkpoint 2 in {ck} cannot be restored (OUT_OF_RANGE: "
    tail = f"); move {ck / '2'} aside to resume from step 1"
    for _ in range(20):
        broken = cli_main(capsys, *args)
        gc.collect()  # the failed reads' futures: asyncio logs them when collected
        lines = broken.stderr.splitlines()
        assert broken.returncode == 2
        assert len(lines) == 1 and lines[0].startswith(head) and lines[0].endswith(tail), \
            broken.stderr[:3000]
        assert "tensorstore_spec" not in lines[0] and len(lines[0]) < 1000
        assert not (tmp_path / "c").exists()
    assert [str(u.exc_value) for u in stray] == []
    assert [r.getMessage()[:80] for r in caplog.records if r.name == "asyncio"] == []


def test_checkpoint_from_another_model_is_refused(tmp_path, capsys):
    ck = tmp_path / "ck"
    made = cli_main(capsys, *ARGS[:-1], "2", "--checkpoint-dir", str(ck), "--checkpoint-every",
                    "1", "--logdir", str(tmp_path / "a"))
    assert made.returncode == 0, made.stderr
    other = cli_main(capsys, "--mesh", "2x4", "--model", "gpt-tiny", "--batch-size", "16",
                     "--checkpoint-dir", str(ck), "--resume", "--logdir", str(tmp_path / "b"))
    assert other.returncode == 2
    assert "incompatible run (model 'mlp-tiny' vs 'gpt-tiny')" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert not (tmp_path / "b").exists()


def test_resume_needs_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--model", "mlp-tiny", "--mesh", "2", "--batch-size", "4",
                    "--resume")
    assert proc.returncode == 2
    # One line that says what to give: the folder, or an interrupted run's --logdir
    assert "--resume needs --checkpoint-dir DIR" in proc.stderr
    assert "or --logdir of an interrupted run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_resume_from_a_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    """--resume --checkpoint-dir NEW/sub (a mistyped path, say) has nothing to resume: one
    line, exit 2, and neither NEW/sub, NEW nor the run's folder is made."""
    new = tmp_path / "new" / "sub"
    run = cli_main(capsys, *ARGS[:-1], "1", "--checkpoint-dir", str(new), "--resume",
                   "--logdir", str(tmp_path / "a"))
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"run: error: --resume: --checkpoint-dir {new} does not exist, so there is nothing "
        f"to resume; give the folder the interrupted run saved its checkpoints in, or drop "
        f"--resume to start at step 0")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_loses_nothing(tmp_path):
    """Writes that fail as on a full disk (RLIMIT_FSIZE in a child, tests/full_disk_child.py):
    a checkpoint save, the TensorBoard events, results.json. Each is one line naming the
    path (exit 1), no traceback; the previous checkpoint stays restorable (the next
    --resume continues from it), the previous results.json stays whole, nothing partial is
    left. The events' error hung the run for good (tensorboardX's thread died, its queue
    filled); the others were tracebacks and ~200 lines of Orbax's logs."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "full_disk_child.py"),
                           str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    ck = tmp_path / "ck"
    assert out["first"][0] == 0
    assert out["checkpoint"] == [1, (
        f"run: error: checkpoint 3 could not be written in {ck} (File too large); checkpoint "
        f"2 is complete and kept: free space, then resume with the same command plus "
        f"--resume\n")]
    assert out["events"] == [1, f"run: error: cannot write the TensorBoard events in "
                                f"{tmp_path / 'e'}: File too large\n"]
    assert out["results"] == (f"cannot write {tmp_path / 'a' / 'results.json'}: File too "
                              f"large; the previous one is kept") and out["results_kept"]
    assert not list(tmp_path.rglob("*.tmp")) and not list(ck.glob("*orbax-checkpoint-tmp*"))
    assert out["resumed"][0] == 0 and not (tmp_path / "b").exists()
    assert RunRecord.load(tmp_path / "c").results["start_step"] == 2
