"""The run directory of `experiments.run`: made (or an existing --logdir reused: a folder
without a run, or an interrupted run's to resume it), and on failure what this run made in
it removed, never what was there before."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from jaxdist.config import RunConfig
from jaxdist.errors import UsageError
from jaxdist.files import ensure_writable_dir
from jaxdist.job import PLAN, PS, kind_of, out_of_process
from jaxdist.record import pipeline_schedule, read_results


@dataclass
class RunDir:
    """A run directory and what this run made in it, so a failed run removes exactly that:
    never a directory the user pointed --logdir at, nor what was in it before."""
    path: Path
    created: Path | None        # topmost directory this run created (None: it existed)
    before: frozenset[str] = frozenset()  # entries of an existing directory at the start

    def discard(self, keep: tuple[str, ...] = ()) -> None:
        """Remove what this run wrote; files matching the globs in `keep` (logs an error
        message points to) stay, with the folders that hold them."""
        kept = {p.absolute() for pattern in keep for p in self.path.glob(pattern)}
        if self.created is not None:
            roots = [self.created]
        elif self.path.is_dir():
            roots = [p.absolute() for p in self.path.iterdir() if p.name not in self.before]
        else:
            roots = []
        for root in roots:
            _remove_except(root, kept)


def _remove_except(path: Path, kept: set[Path]) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if not any(k == path or path in k.parents for k in kept):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    elif path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove_except(child, kept)


def check_logdir(cfg: RunConfig) -> None:
    """What an existing --logdir may be, read before any work (a plan compiles for minutes):
    a folder without a run, holding nothing this run writes (a second dry run wrote over
    the first's plan.json), or an interrupted run's, only to resume it with the same settings
    plus --resume. In a multi-process run process 0 checks it before the join, so the
    others hear why (experiments.run.main_mesh)."""
    if not cfg.output.logdir:
        return
    path = Path(cfg.output.logdir)
    status, saved = _status(path / "results.json")
    if status is None and path.is_dir():
        try:
            entries = set(os.listdir(path))
        except OSError as e:  # make_logdir lists it too (what it held before the run)
            raise UsageError(f"--logdir {path} cannot be read ({e.strerror}); choose "
                             f"another --logdir") from None
        taken = sorted(entries & _outputs(cfg))
        if cfg.checkpoint.resume and kind_of(cfg) == PS:  # a stopped PS run's own folder
            taken = []
        if taken:
            raise UsageError(f"--logdir {path} already holds {', '.join(taken)}, which this "
                             f"run would write over; choose another --logdir")
    if status is not None and status != "interrupted":
        raise UsageError(f"--logdir {path} already holds a finished run; choose another")
    if status == "interrupted":
        now, default = (json.loads(json.dumps(c.to_dict())) for c in (cfg, RunConfig()))
        if cfg.checkpoint.checkpoint_dir:  # the folder, however it is spelled
            now["checkpoint"]["checkpoint_dir"] = str(
                Path(cfg.checkpoint.checkpoint_dir).absolute())
        # The resume flag, the progress bar and this launch's process wiring may change;
        # a setting newer than the record was at its default.
        free = {"resume", "progress", "logdir", "coordinator", "init_timeout"}
        was = {(section, name): saved.get(section, {}).get(name, default[section][name])
               for section, fields in now.items() for name in fields}
        if not was["checkpoint", "checkpoint_dir"]:
            raise UsageError(f"--logdir {path} holds an interrupted run that saved no "
                             f"checkpoint, so it cannot be resumed; choose another --logdir")
        differ = [f"--{name.replace('_', '-')} was {was[section, name]!r}, now {value!r}"
                  for section, fields in now.items() for name, value in fields.items()
                  if name not in free and was[section, name] != value]
        if differ:
            raise UsageError(f"--logdir {path} holds an interrupted run with other "
                             f"settings ({'; '.join(differ)}); resume it with its own "
                             f"settings plus --resume, or choose another --logdir")
        if not cfg.checkpoint.resume:
            raise UsageError(f"--logdir {path} holds an interrupted run; resume it with "
                             f"the same command plus --resume, or choose another --logdir")


def _outputs(cfg: RunConfig) -> set[str]:
    """The entries this run writes at a fixed name in its folder (event files and profiler
    traces are named by their time; results.json is checked as a run's record)."""
    kind = kind_of(cfg)
    if kind == PLAN:  # jaxdist.plan.file_name
        return {"plan.json" if cfg.output.hardware else "dry_run.json"}
    return {"ps"} if kind == PS else {"power"}  # ps.driver, jaxdist.telemetry


def make_logdir(cfg: RunConfig, mesh_label: str) -> RunDir:
    """Create the run directory (or reuse --logdir, as check_logdir allows)."""
    if cfg.output.logdir:
        check_logdir(cfg)
        path = Path(cfg.output.logdir)
    else:
        # What the run is first (TensorBoard's Trial ID column shows a folder name's first
        # characters), then when it started, month to second: `fsdp-4x8-gpt-tiny-1207-144901`.
        stamp = time.strftime("%m%d-%H%M%S")
        layout = cfg.train.layout
        # imported here, not at the top: sharding imports jax, which bad input must not wait for
        from sharding.registry import facts
        if facts(layout).pipelined:  # a gpipe and a 1f1b run differ by name
            layout += "-" + pipeline_schedule({"schedule": cfg.train.pp_schedule,
                                               "virtual": cfg.train.pp_virtual,
                                               "combined_f_back":
                                                   cfg.train.pp_combined_1f1b})
        what = f"{layout}-{mesh_label}-{cfg.model.model}"
        path = Path("runs") / f"{what}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = path.with_name(f"{what}-{stamp}-{suffix}")
    top = path.absolute()
    while not top.parent.exists():
        top = top.parent
    created = top if not top.exists() else None
    before = frozenset(os.listdir(path)) if created is None and path.is_dir() else frozenset()
    run_dir = RunDir(path, created, before)
    try:
        ensure_writable_dir(path, "--logdir")
    except UsageError:
        run_dir.discard()
        raise
    return run_dir


def resume_folder(cfg: RunConfig) -> RunConfig:
    """--resume without --checkpoint-dir: the checkpoint folder of the interrupted run in
    --logdir, which its record names; without one, a one-line error that says what works."""
    if not cfg.checkpoint.resume or cfg.checkpoint.checkpoint_dir or \
            out_of_process(cfg.train.layout):  # the parameter server does not resume
        return cfg
    status, saved = _status(Path(cfg.output.logdir) / "results.json") if cfg.output.logdir \
        else (None, {})
    folder = (saved.get("checkpoint") or {}).get("checkpoint_dir")
    if status == "interrupted" and folder:
        return replace(cfg, checkpoint=replace(cfg.checkpoint, checkpoint_dir=folder))
    if status == "interrupted":
        raise UsageError(f"--resume: --logdir {cfg.output.logdir} holds an interrupted run "
                         f"that saved no checkpoint, so there is nothing to resume; to start "
                         f"again from step 0 drop --resume and choose another --logdir")
    raise UsageError("--resume needs --checkpoint-dir DIR (the folder the interrupted run "
                     "saved to), or --logdir of an interrupted run that saved checkpoints")


def _status(results_json: Path) -> tuple[str | None, dict]:
    """(`status`, config as run) of an existing results.json (runs from before `status`
    existed: complete); its checkpoint folder as the absolute path the run used."""
    if not results_json.exists():
        return None, {}
    try:
        results = read_results(results_json)
        saved = results.get("config") or {}
        folder = (results.get("checkpoint") or {}).get("directory")
        if folder:
            saved.setdefault("checkpoint", {})["checkpoint_dir"] = folder
        return results.get("status", "complete"), saved
    except (OSError, ValueError, AttributeError):
        return "complete", {}  # unreadable: do not write over it


def record_stamp(logdir: Path | None) -> tuple | None:
    """results.json's identity in `logdir` (inode, mtime in ns), None where there is none."""
    try:
        st = (logdir / "results.json").stat()
    except (OSError, TypeError):
        return None
    return st.st_ino, st.st_mtime_ns


def wrote_record(logdir: Path | None, before: tuple | None) -> bool:
    """Whether this run wrote results.json since `before` (record_stamp then): a file's
    mtime against time.time() lost to the kernel's coarser file clock, so a record written
    within milliseconds read as older than the run and its folder was deleted."""
    now = record_stamp(logdir)
    return now is not None and now != before
