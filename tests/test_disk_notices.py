"""Folders on the command line that change what a run does: --resume with nothing to
resume and a --logdir that already holds files are named on stderr, and the run goes on."""

from __future__ import annotations

import json

from jaxdist.config import CheckpointConfig, OutputConfig, RunConfig
from experiments.notices import disk_notices
from jaxdist.record import RunRecord


def test_resume_with_nothing_to_resume_says_the_run_starts_at_step_0(tmp_path):
    new = tmp_path / "new"
    new.mkdir()
    cfg = RunConfig(checkpoint=CheckpointConfig(checkpoint_dir=str(new), resume=True))
    assert disk_notices(cfg) == [
        f"notice: --resume: --checkpoint-dir {new} holds no checkpoint, so there is nothing "
        f"to resume: this run starts at step 0; it saves one there only if interrupted (add "
        f"--checkpoint-every N to save every N steps)"]
    cfg = RunConfig(checkpoint=CheckpointConfig(checkpoint_dir=str(new), resume=True,
                                                checkpoint_every=5))
    assert disk_notices(cfg) == [
        f"notice: --resume: --checkpoint-dir {new} holds no checkpoint, so there is nothing "
        f"to resume: this run starts at step 0"]
    (new / "12").mkdir()  # a checkpoint: the loop resumes it, or says why not
    assert disk_notices(cfg) == []


def test_a_logdir_holding_other_files_is_named_with_them(tmp_path):
    folder = tmp_path / "mine"
    cfg = RunConfig(output=OutputConfig(logdir=str(folder)))
    assert disk_notices(cfg) == []  # made by the run
    folder.mkdir()
    assert disk_notices(cfg) == []  # empty
    for name in ("notes.txt", "a.csv", "b.csv", "c.csv"):
        (folder / name).write_text("x")
    assert disk_notices(cfg) == [
        f"notice: --logdir {folder} already holds other files (a.csv, b.csv, c.csv, ...); "
        f"this run writes its own beside them"]
    (folder / "events.out.tfevents.1.host").write_bytes(b"")  # a killed run's events
    assert disk_notices(cfg)[0].endswith(
        "; TensorBoard will show the event files there as part of this run")
    (folder / "results.json").write_text(json.dumps({"status": "interrupted"}))
    assert disk_notices(cfg) == []  # the interrupted run a --resume continues


def test_both_notices_through_the_cli(tmp_path, capsys):
    from experiments.run import main

    logdir, ckpt = tmp_path / "run", tmp_path / "ck-empty"
    logdir.mkdir()
    ckpt.mkdir()
    (logdir / "notes.txt").write_text("mine")
    code = main(["--model", "mlp-tiny", "--mesh", "2x4", "--batch-size", "8", "--warmup", "0",
                 "--steps", "1", "--no-progress", "--resume", "--checkpoint-dir", str(ckpt),
                 "--logdir", str(logdir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [x for x in err.splitlines() if x.startswith("notice:")] == [
        f"notice: --resume: --checkpoint-dir {ckpt} holds no checkpoint, so there is nothing "
        f"to resume: this run starts at step 0; it saves one there only if interrupted (add "
        f"--checkpoint-every N to save every N steps)",
        f"notice: --logdir {logdir} already holds other files (notes.txt); this run writes "
        f"its own beside them"]
    assert "starting afresh" not in out  # said once, before the compile
    assert RunRecord.load(logdir).results["start_step"] == 0
    assert (logdir / "notes.txt").read_text() == "mine"

