"""A run never deletes or overwrites what it did not write: --checkpoint-dir holding another
run's checkpoints, a --checkpoint-dir that cannot be a folder, and an interrupted run's
--logdir reused with other settings are refused up front (exit 2, one line, nothing
touched); Orbax's garbage collection only drops this run line's own steps."""

import json
import os
import time
from pathlib import Path

import pytest

from jaxdist import loop
from jaxdist.checkpoint import MARKER, Checkpointer, check_directory
from jaxdist.config import from_namespace
from jaxdist.devices import select_devices
from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape
from jaxdist.record import RunRecord
from tests.helpers import cli_main, run_loop, train
from tests.test_interrupt import StopAfter

META = {"model": "mlp-tiny", "model_opts": "", "dataset": "synthetic", "optimizer": "adamw",
        "dtype": "float32"}
RUN = ["--mesh", "2x4", "--model", "mlp-tiny", "--batch-size", "16", "--warmup", "0",
       "--steps", "1"]


def _snapshot(folder: Path) -> dict:
    """Every path under `folder` with its size and modification time: 'nothing touched'."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _refused(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="session")
def state():
    return train("mlp-tiny", "ddp", MeshShape(2), steps=0)[1]


def _save(directory: Path, steps, state, meta=META):
    ck = Checkpointer(str(directory), 1, meta)
    for step in steps:
        ck.save(step, state, data_position=step)
    ck.finish()


# ------------------------------------------------------------------- --checkpoint-dir

def test_new_run_refuses_a_folder_that_holds_checkpoints(tmp_path, state, capsys):
    ck = tmp_path / "ck"
    _save(ck, [2, 4], state, dict(META, optimizer="sgd"))  # another run's
    before = _snapshot(ck)
    line = _refused(cli_main(capsys, *RUN, "--checkpoint-every", "1", "--checkpoint-dir", str(ck),
                            "--logdir", str(tmp_path / "run")))
    assert line == (f"run: error: --checkpoint-dir {ck} already holds checkpoints (steps 2, "
                    f"4); pass --resume to continue them or choose an empty folder")
    assert _snapshot(ck) == before
    assert not (tmp_path / "run").exists()


def test_new_run_refuses_a_folder_with_anything_in_it(tmp_path, monkeypatch, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    line = _refused(cli_main(capsys, *RUN, "--checkpoint-dir", str(ck)))
    assert line == (f"run: error: --checkpoint-dir {ck} is not empty (it holds notes.txt); "
                    f"choose an empty folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no runs/ either
    assert [p.name for p in ck.iterdir()] == ["notes.txt"]


def test_garbage_collection_drops_only_this_run_lines_steps(tmp_path, state):
    """Orbax's LatestN would keep the 3 latest of every numbered folder ([4, 5, 6] here),
    deleting step 3 of another run; only this run line's steps (1, 4, 5, 6) are its to drop."""
    _save(tmp_path, [3], state, dict(META, optimizer="sgd"))
    _save(tmp_path, [1], state)
    _save(tmp_path, [4, 5, 6], state)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3, 4, 5, 6]
    assert json.loads((tmp_path / "3" / "meta" / "metadata").read_text())["optimizer"] == "sgd"


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro / "ck"
    # Root ignores permission bits; sysfs refuses new entries even to root.
    try:
        open("/sys/.jaxdist-probe", "w").close()
    except OSError:
        return Path("/sys/jaxdist-ckpt")
    os.unlink("/sys/.jaxdist-probe")
    pytest.skip("no folder here that root cannot write")


@pytest.mark.parametrize("case", ["file", "parent is a file", "unwritable"])
def test_a_checkpoint_dir_that_cannot_be_a_folder_fails_at_once(tmp_path, monkeypatch, capsys,
                                                                 case):
    """Orbax retries such a path for ~5 minutes; the check answers before any device work."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path, message = {
        "file": (blocker, f"--checkpoint-dir {blocker} is a file, not a folder; choose a "
                          f"folder"),
        "parent is a file": (blocker / "ck", f"--checkpoint-dir {blocker / 'ck'}: {blocker} "
                                             f"is a file, not a folder; choose a path under "
                                             f"a folder"),
        "unwritable": (None, "cannot write to --checkpoint-dir {path}: ")}[case]
    if path is None:
        path = _unwritable(tmp_path)
        message = message.format(path=path)
    started = time.monotonic()
    monkeypatch.chdir(tmp_path)
    line = _refused(cli_main(capsys, *RUN, "--checkpoint-every", "1", "--checkpoint-dir",
                             str(path)))
    assert time.monotonic() - started < 60
    assert line.startswith(f"run: error: {message}"), line
    assert blocker.read_text() == "not a folder"
    assert path == blocker or not path.exists()


def test_resume_checks_who_wrote_the_folder(tmp_path, state):
    _save(tmp_path / "same", [2], state)
    check_directory(str(tmp_path / "same"), True, META)  # continues its own run line
    with pytest.raises(UsageError, match=r"--checkpoint-dir .*/new/ck does not exist"):
        check_directory(str(tmp_path / "new" / "ck"), True, META)  # nothing to resume
    assert not (tmp_path / "new").exists()
    with pytest.raises(UsageError, match=r"--checkpoint-dir .*/same is from an incompatible "
                                         r"run \(model 'mlp-tiny' vs 'gpt-tiny'\)"):
        check_directory(str(tmp_path / "same"), True, dict(META, model="gpt-tiny"))
    (tmp_path / "same" / MARKER).unlink()  # checkpoints without a marker: each one tells
    with pytest.raises(UsageError, match=r"checkpoint 2 in --checkpoint-dir .* is from an "
                                         r"incompatible run \(dtype 'float32' vs 'bfloat16'\)"):
        check_directory(str(tmp_path / "same"), True, dict(META, dtype="bfloat16"))
    (tmp_path / "odd" / "7").mkdir(parents=True)  # a numbered folder that is not ours
    with pytest.raises(UsageError, match="step folder 7 is not a jaxdist checkpoint"):
        check_directory(str(tmp_path / "odd"), True, META)


# ------------------------------------------------------------------- --logdir

ARGS = ["--mesh", "2x4", "--model", "mlp-tiny", "--batch-size", "16", "--warmup", "1",
        "--steps", "3", "--no-progress"]


def test_a_logdir_holding_what_the_run_writes_is_refused_before_any_work(tmp_path, capsys):
    """A user's folder is written beside, never over: a dry run into a folder holding
    plan.json (a user's, or another plan's) wrote over it, after minutes of compiling. A
    finished run's folder is refused before the plan too. A run writes no plan.json, so it
    may go beside one."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "plan.json").write_text("mine")
    (folder / "dry_run.json").write_text("mine too")
    before = _snapshot(folder)
    for extra, taken in ((["--hardware", "h100-sxm"], "plan.json"), ([], "dry_run.json")):
        line = _refused(cli_main(capsys, *RUN, "--dry-run", *extra, "--logdir", str(folder)))
        assert line == (f"run: error: --logdir {folder} already holds {taken}, which this run "
                        f"would write over; choose another --logdir")
        assert "compiled" not in capsys.readouterr().out  # nothing planned before it
    assert _snapshot(folder) == before
    made = cli_main(capsys, *RUN, "--logdir", str(folder))
    assert made.returncode == 0, made.stderr
    assert (folder / "plan.json").read_text() == "mine" and (folder / "results.json").exists()
    line = _refused(cli_main(capsys, *RUN, "--dry-run", "--hardware", "h100-sxm", "--logdir",
                             str(folder)))
    assert line == f"run: error: --logdir {folder} already holds a finished run; choose another"



def test_a_logdir_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    """As root every folder reads, so the refusal is staged: os.listdir's PermissionError
    (a folder of mode 000 for anyone else) was a traceback from the run's folder check."""
    from experiments import run_dirs

    folder = tmp_path / "locked"
    folder.mkdir()

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(run_dirs.os, "listdir", denied)
    line = _refused(cli_main(capsys, *RUN, "--logdir", str(folder)))
    assert line == (f"run: error: --logdir {folder} cannot be read (Permission denied); "
                    f"choose another --logdir")


def _interrupted_run(folder: Path) -> tuple[list[str], Path]:
    """A real interrupted run (stopped after 2 of 4 steps, checkpoint saved) made in this
    process; (its command line, its logdir)."""
    from experiments.run import build_parser

    logdir = folder / "run"
    args = [*ARGS, "--logdir", str(logdir), "--checkpoint-dir", str(folder / "ck")]
    cfg = from_namespace(build_parser().parse_args(args))
    stop = loop.StopRequest
    loop.StopRequest = StopAfter(2)
    try:
        results = run_loop(cfg, select_devices(MeshShape(2, 4)), logdir, log=lambda *_: None)
    finally:
        loop.StopRequest = stop
    assert results["status"] == "interrupted" and results["checkpoint"]["saved_steps"] == [2]
    return args, logdir


@pytest.fixture(scope="session")
def interrupted(tmp_path_factory):
    return _interrupted_run(tmp_path_factory.mktemp("interrupted"))


@pytest.mark.parametrize("change, named", [
    (["--layout", "ddp", "--steps", "5"], "--layout was 'fsdp', now 'ddp'; --steps was 3, "
                                           "now 5"),
    (["--mesh", "8", "--batch-size", "8"], "--mesh was '2x4', now '8'; --batch-size was 16, "
                                           "now 8"),
])
def test_interrupted_logdir_with_other_settings_is_refused(interrupted, capsys, change, named):
    """Layout, mesh and batch may change on a resume from the checkpoint folder (it
    reshards), but not in the interrupted run's own record."""
    args, logdir = interrupted
    before = _snapshot(logdir.parent)
    line = _refused(cli_main(capsys, *args, *change, "--resume"))
    assert line == (f"run: error: --logdir {logdir} holds an interrupted run with other "
                    f"settings ({named}); resume it with its own settings plus --resume, or "
                    f"choose another --logdir")
    assert _snapshot(logdir.parent) == before


def test_interrupted_logdir_is_reused_only_to_resume(interrupted, tmp_path, capsys):
    from experiments.run import build_parser
    from experiments.run_dirs import make_logdir

    args, logdir = interrupted
    before = _snapshot(logdir.parent)
    # The same command without --resume: its checkpoint folder answers first.
    line = _refused(cli_main(capsys, *args))
    assert line == (f"run: error: --checkpoint-dir {logdir.parent / 'ck'} already holds "
                    f"checkpoints (steps 2); pass --resume to continue them or choose an "
                    f"empty folder")
    # Another model is another run line in both folders; the checkpoints answer first.
    line = _refused(cli_main(capsys, *args, "--model-opts", "width=32", "--resume"))
    assert line == (f"run: error: --checkpoint-dir {logdir.parent / 'ck'} is from an "
                    f"incompatible run (model_opts '' vs 'width=32'); resume with that run's "
                    f"settings or choose another folder")
    assert _snapshot(logdir.parent) == before
    cfg = from_namespace(build_parser().parse_args(args))
    with pytest.raises(UsageError) as refused:
        make_logdir(cfg, "2x4")
    assert str(refused.value) == (f"--logdir {logdir} holds an interrupted run; resume it "
                                  f"with the same command plus --resume, or choose another "
                                  f"--logdir")
    # A run without --checkpoint-dir saved nothing to resume from.
    (tmp_path / "results.json").write_text(json.dumps(
        {"status": "interrupted", "config": cfg.to_dict() | {"checkpoint": {}}}))
    cfg = from_namespace(build_parser().parse_args([*ARGS, "--logdir", str(tmp_path)]))
    with pytest.raises(UsageError, match="holds an interrupted run that saved no checkpoint, "
                                         "so it cannot be resumed; choose another --logdir"):
        make_logdir(cfg, "2x4")
    assert _snapshot(logdir.parent) == before


def test_interrupted_run_resumes_in_its_logdir(tmp_path, capsys):
    args, logdir = _interrupted_run(tmp_path)
    proc = cli_main(capsys, *args, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from checkpoint 2" in proc.stdout
    results = RunRecord.load(logdir).results
    assert results["status"] == "complete"
    assert results["start_step"] == 2 and results["steps_done"] == 4
    assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == [2]


def test_resume_without_checkpoint_dir_continues_the_logdirs_checkpoints(tmp_path, capsys):
    """`--resume` on an interrupted run's --logdir finds its checkpoint folder in the record
    (it asked for --checkpoint-dir before: a dead end after the advice to add --resume)."""
    args, logdir = _interrupted_run(tmp_path)
    i = args.index("--checkpoint-dir")
    proc = cli_main(capsys, *args[:i], *args[i + 2:], "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from checkpoint 2" in proc.stdout
    results = RunRecord.load(logdir).results
    assert results["status"] == "complete" and results["start_step"] == 2


def test_resume_of_a_run_without_checkpoints_says_what_works(tmp_path):
    from experiments.run import build_parser
    from experiments.run_dirs import resume_folder

    cfg = from_namespace(build_parser().parse_args([*ARGS, "--logdir", str(tmp_path)]))
    (tmp_path / "results.json").write_text(json.dumps(
        {"status": "interrupted", "config": cfg.to_dict() | {"checkpoint": {}}}))
    resumed = from_namespace(build_parser().parse_args([*ARGS, "--logdir", str(tmp_path),
                                                        "--resume"]))
    with pytest.raises(UsageError) as refused:
        resume_folder(resumed)
    assert str(refused.value) == (f"--resume: --logdir {tmp_path} holds an interrupted run "
                                  f"that saved no checkpoint, so there is nothing to resume; "
                                  f"to start again from step 0 drop --resume and choose "
                                  f"another --logdir")
    # The advice holds: the same command with another --logdir is a new run.
    from experiments.run_dirs import make_logdir
    other = from_namespace(build_parser().parse_args([*ARGS, "--logdir", str(tmp_path / "b")]))
    assert make_logdir(other, "2x4").path == tmp_path / "b"
    with pytest.raises(UsageError, match="--resume needs --checkpoint-dir DIR"):
        resume_folder(from_namespace(build_parser().parse_args([*ARGS, "--resume"])))


@pytest.mark.parametrize("chosen, advice", [
    (True, "to start again from step 0 run the same command with another --logdir"),
    (False, "the same command starts again from step 0 in a new folder")])
def test_interrupt_line_without_checkpoint_gives_a_command_that_works(tmp_path, capsys,
                                                                      chosen, advice):
    """It said "a rerun starts from step 0", and the rerun was refused (the folder keeps
    the interrupted record)."""
    from experiments.run import report_interrupt

    results = {"interrupted": {"signal": "SIGINT", "steps_planned": 10}, "steps_done": 3,
               "checkpoint": None}
    assert report_interrupt(results, tmp_path, chosen) == 130
    line = capsys.readouterr().err.strip()
    assert line.endswith(advice) and "a rerun starts from step 0" not in line
