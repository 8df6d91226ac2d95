"""Checkpoints with Orbax: save the train state every N steps (asynchronously), resume from
the latest complete one, under any layout or mesh.

Orbax writes each step into a temporary directory and renames it when complete, so a save
killed mid-write never replaces the last good checkpoint and `latest_step()` never sees it.
Restoring onto the new program's abstract state (shapes + shardings) reshards: a checkpoint
saved under fsdp on 2x4 restores under ddp on 8 devices or fsdp on 4x2.

A run never deletes what it did not write. Orbax's CheckpointManager garbage-collects every
numbered folder it finds in its directory (`_load_checkpoint_infos` lists them all, and the
preservation policy drops all but the latest N), so: `check_directory` refuses, before
anything is compiled, a new run pointed at a folder that holds anything, and a --resume of
checkpoints from another run line; and the manager's preservation policy only ever drops
steps whose saved identity is this run's (`KeepLatestOwn`). A marker file names the run
line that owns the folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from pathlib import Path

import jax

from jaxdist.errors import UsageError

# What must match for a checkpoint to be resumable; layout and mesh may change (reshard).
IDENTITY = ("model", "model_opts", "dataset", "optimizer", "dtype")
KEEP = 3  # latest checkpoints of this run line kept
MARKER = "jaxdist-checkpoints.json"  # {"identity": {...}}: the run line this folder holds


def identity(model, dataset: str, optimizer: str) -> dict:
    """What a checkpoint's run line is (IDENTITY): the config's model section
    (jaxdist.config.ModelConfig), the dataset and the optimizer."""
    return {"model": model.model, "model_opts": model.model_opts,
            "dataset": dataset, "optimizer": optimizer,
            # FP8: its scaling too (delayed scaling's histories are part of the state)
            "dtype": (f"float8 ({model.fp8_scaling} scaling)"
                      if model.dtype == "float8" else model.dtype)}


def mismatch(saved: dict, mine: dict) -> list[str]:
    """'field saved vs mine' for each identity field that differs."""
    return [f"{k} {saved.get(k)!r} vs {mine[k]!r}" for k in IDENTITY if saved.get(k) != mine[k]]


def step_folders(directory: Path) -> list[int]:
    """Complete checkpoints: Orbax names each step's folder by its number (a save in
    progress is `N.orbax-checkpoint-tmp-*`)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def saved_meta(directory: Path, step: int) -> dict | None:
    """The JSON meta a jaxdist checkpoint holds (step/meta/metadata), None if it has none."""
    try:
        meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def check_directory(path: str, resume: bool, mine: dict) -> None:
    """--checkpoint-dir before the run starts: a folder (or one that can be made) that this
    run may write, and empty unless --resume continues checkpoints of the same run line
    (`mine`: its identity). Fails fast where Orbax would retry for minutes. A refusal
    touches nothing (the write test puts back the folder's modification time)."""
    directory = Path(path)
    if resume and not directory.exists():  # a mistyped path would train from step 0
        raise UsageError(f"--resume: --checkpoint-dir {directory} does not exist, so there is "
                         f"nothing to resume; give the folder the interrupted run saved its "
                         f"checkpoints in, or drop --resume to start at step 0")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == directory and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir {directory} is a file, not a folder; "
                         f"choose a folder")
    if not existing.is_dir():
        raise UsageError(f"--checkpoint-dir {directory}: {existing} is a file, not a "
                         f"folder; choose a path under a folder")
    if existing == directory:
        _check_contents(directory, resume, mine)
    try:  # root ignores permission bits, so only a real write tells
        before = existing.stat()
        os.rmdir(tempfile.mkdtemp(prefix=".jaxdist-write-test-", dir=existing))
        os.utime(existing, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError as e:
        raise UsageError(f"cannot write to --checkpoint-dir {directory}: "
                         f"{e.strerror or e}") from None


def _check_contents(directory: Path, resume: bool, mine: dict) -> None:
    try:
        entries = sorted(os.listdir(directory))
    except OSError as e:
        raise UsageError(f"cannot read --checkpoint-dir {directory}: {e.strerror or e}") from None
    steps = step_folders(directory)
    if not resume:
        if steps:
            raise UsageError(f"--checkpoint-dir {directory} already holds checkpoints (steps "
                             f"{', '.join(map(str, steps))}); pass --resume to continue "
                             f"them or choose an empty folder")
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise UsageError(f"--checkpoint-dir {directory} is not empty (it holds {shown}); "
                             f"choose an empty folder")
        return
    owners = []  # (what, the identity it records)
    if (directory / MARKER).exists():
        try:
            owners.append((f"--checkpoint-dir {directory}",
                           json.loads((directory / MARKER).read_text())["identity"]))
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"--checkpoint-dir {directory}: {MARKER} is unreadable; "
                             f"choose another folder") from None
    for step in steps:
        meta = saved_meta(directory, step)
        if meta is None:
            raise UsageError(f"--checkpoint-dir {directory}: step folder {step} is not a "
                             f"jaxdist checkpoint; choose another folder")
        owners.append((f"checkpoint {step} in --checkpoint-dir {directory}", meta))
    for what, saved in owners:
        differs = mismatch(saved, mine)
        if differs:
            raise UsageError(f"{what} is from an incompatible run ({'; '.join(differs)}); "
                             f"resume with that run's settings or choose another folder")


@dataclasses.dataclass
class KeepLatestOwn:
    """Orbax's LatestN over this run line's steps only: any other numbered folder in the
    directory (not written with this identity) is always preserved."""
    n: int
    own: set[int]

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        keep = set(sorted(c.step for c in checkpoints if c.step in self.own)[-self.n:])
        return [c.step not in self.own or c.step in keep for c in checkpoints]


def _orbax():
    """orbax.checkpoint, imported by the runs that checkpoint only (about 0.2 s of a run's
    start-up otherwise)."""
    import orbax.checkpoint as ocp

    return ocp


class Checkpointer:
    def __init__(self, directory: str, every: int, meta: dict):
        self.directory = Path(directory).absolute()
        self.every = every
        self.meta = meta
        self.save_s = 0.0
        self.saved_steps: list[int] = []
        # Steps already here that this run line wrote (a --resume continues them).
        own = {s for s in step_folders(self.directory)
               if not mismatch(saved_meta(self.directory, s) or {}, meta)}
        self.policy = KeepLatestOwn(KEEP, own)
        # The folders Orbax makes for this run (create=True): removed again if nothing is
        # saved in them (a --resume pointed at a new folder, with no save due)
        self.made = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        _quiet_failed_saves()
        ocp = _orbax()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(preservation_policy=self.policy,
                                                 enable_async_checkpointing=True, create=True))

    def due(self, steps_done: int) -> bool:
        """A save is scheduled after this step (--checkpoint-every)."""
        return bool(self.every) and steps_done % self.every == 0

    def maybe_save(self, steps_done: int, state, data_position: int) -> None:
        if self.due(steps_done):
            self.save(steps_done, state, data_position)

    def save(self, steps_done: int, state, data_position: int) -> None:
        """Save now (also off schedule: an interrupted run saves the step it stopped at)."""
        if steps_done in self.saved_steps:
            return
        start = time.perf_counter()
        meta = dict(self.meta, step=steps_done, data_position=data_position)
        marker = self.directory / MARKER
        if jax.process_index() == 0 and not marker.exists():
            marker.write_text(json.dumps({"identity": {k: self.meta[k] for k in IDENTITY}}))
        self.policy.own.add(steps_done)
        ocp = _orbax()
        try:  # also where the previous save's error (written in the background) comes out
            self.manager.save(steps_done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - TensorStore's ValueError, an OSError
            raise self._unwritable(steps_done, e) from None
        self.save_s += time.perf_counter() - start  # the blocking part; writing goes on
        self.saved_steps.append(steps_done)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, abstract_state, shardings) -> tuple:
        """(state laid out by `shardings`, saved meta) of checkpoint `step`."""
        ocp = _orbax()
        meta = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        mismatched = mismatch(meta, self.meta)
        if mismatched:
            raise UsageError(f"checkpoint {step} in {self.directory} is from an incompatible "
                             f"run ({'; '.join(mismatched)})")
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, shardings)
        _drop_closed_loop_callbacks()
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                # strict=False: a leaf stored padded under another layout's split (or none)
                # is cut or zero-padded to this one's (sharding/padding.py); the identity
                # check above has ruled out a different model
                state=ocp.args.StandardRestore(target, strict=False)))["state"]
        except Exception as e:  # noqa: BLE001 - Orbax's ValueError, TensorStore's Exception
            _drain_closed_loop_callbacks()
            self.manager.close()
            raise UsageError(self._unrestorable(step, e)) from None
        return state, meta

    def _unrestorable(self, step: int, error: BaseException) -> str:
        """One line for a checkpoint that cannot be restored into this run's state (a tree
        that does not fit it, or files truncated or lost after Orbax committed the step; both
        were tracebacks): the first line of the root cause, and what the user can do. The
        folder is the user's: never deleted here."""
        while error.__cause__ is not None:
            error = error.__cause__
        earlier = [s for s in step_folders(self.directory) if s < step]
        todo = (f"move {self.directory / str(step)} aside to resume from step {earlier[-1]}"
                if earlier else "give --checkpoint-dir a new folder to start afresh")
        return (f"checkpoint {step} in {self.directory} cannot be restored "
                f"({short_cause(error)}); {todo}")

    def _unwritable(self, step: int, error: BaseException):
        """WriteError for a save that failed (a full disk, a file-size limit): the step
        whose write failed (Orbax's unfinished folder names it), the OS's reason, the step
        a --resume restores. The unfinished folder is removed (it never counts as a
        checkpoint: Orbax renames a save's folder only when it is complete)."""
        import contextlib
        import shutil

        from jaxdist.errors import WriteError

        # Orbax's other writers of the failed save (TensorStore's, the metadata's) may still
        # be running: stopped first, else one recreates the folder removed below
        with contextlib.suppress(Exception):
            self.manager.close()
        unfinished = sorted(self.directory.glob("*.orbax-checkpoint-tmp*"))
        failed = min((int(p.name.split(".")[0]) for p in unfinished
                      if p.name.split(".")[0].isdigit()), default=step)
        for folder in unfinished:
            shutil.rmtree(folder, ignore_errors=True)
        code = re.search(r"os_error_code='(\d+)'", str(error))
        why = os.strerror(int(code.group(1))) if code else short_cause(error)
        complete = step_folders(self.directory)
        kept = (f"checkpoint {complete[-1]} is complete and kept: free space, then resume "
                f"with the same command plus --resume" if complete else
                "no complete checkpoint is there")
        return WriteError(f"checkpoint {failed} could not be written in {self.directory} "
                          f"({why}); {kept}")

    def close(self) -> None:
        """Stop Orbax's background threads without waiting for anything (a run that ends
        before its first save)."""
        self.manager.close()

    def finish(self) -> dict:
        """Wait for pending writes; the checkpoint block of results."""
        start = time.perf_counter()
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - as in save
            raise self._unwritable(self.saved_steps[-1], e) from None
        self.save_s += time.perf_counter() - start
        self.manager.close()
        for folder in self.made:  # deepest first; one that holds anything stays
            try:
                folder.rmdir()
            except OSError:
                break
        size = sum(f.stat().st_size for f in self.directory.rglob("*") if f.is_file())
        return {"directory": str(self.directory), "every": self.every,
                "saved_steps": self.saved_steps, "save_s": self.save_s,
                "bytes_on_disk": size}


def short_cause(error: BaseException) -> str:
    """The first line of `error` without what TensorStore appends for its own debugging:
    the JSON spec of every store it opened (`[tensorstore_spec='{...}']`, about 1.7 KB) and
    the driver chain (`Error opening "zarr" driver: `) that leads to the file at fault."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = re.sub(r" ?\[tensorstore_spec(\[\d+\])?='.*?'\]", "", text)
    return re.sub(r'Error opening "\w+" driver: ', "", text).strip()


# TensorStore reads still in flight when a restore fails call back into the event loop
# Orbax ran them on, which Orbax has closed by then: each such callback was a "RuntimeError:
# Event loop is closed" traceback on stderr (through sys.unraisablehook), 1 to 18 per failed
# restore, some printed after the run's one error line and some at interpreter exit; and
# the reads that failed too were each logged, with TensorStore's 2 KB spec, as "Future (or
# Task) exception was never retrieved" when their futures were collected.
_closed_loop_callbacks = [0]


class _UnretrievedReads:
    """A filter for asyncio's logger that drops "Future (or Task) exception was never
    retrieved" for a TensorStore read (its exception names a tensorstore_spec); every other record passes."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith(("Future exception was never retrieved",
                                                    "Task exception was never retrieved"))
                    and "tensorstore_spec" in str(exc))


def _is_closed_loop_callback(unraisable) -> bool:
    exc = unraisable.exc_value
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _drop_closed_loop_callbacks() -> None:
    """From now on, drop those callbacks' tracebacks (only those: any other unraisable
    exception goes to the hook that was there)."""
    import logging
    import sys

    import warnings

    # Orbax's metadata read that the failed restore left unawaited, said when collected
    warnings.filterwarnings("ignore", message=r"coroutine 'Store\._get_array_metadatas' was "
                            r"never awaited", category=RuntimeWarning)
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedReads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_UnretrievedReads())
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False) is False:
        def hook(unraisable):
            if _is_closed_loop_callback(unraisable):
                _closed_loop_callbacks[0] += 1
            else:
                previous(unraisable)
        hook.drops_closed_loop_callbacks = True
        sys.unraisablehook = hook


def _drain_closed_loop_callbacks(quiet_s: float = 0.05, limit_s: float = 2.0) -> None:
    """Wait until no such callback has come for `quiet_s` (at most `limit_s`): the reads
    are over before the error is said."""
    deadline = time.monotonic() + limit_s
    seen, quiet_since = _closed_loop_callbacks[0], time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet_s:
        time.sleep(0.02)
        if _closed_loop_callbacks[0] != seen:
            seen, quiet_since = _closed_loop_callbacks[0], time.monotonic()


class _FailedSaveLogs:
    """A filter for absl's logger that drops Orbax's error records of a save that failed
    (each background thread's, with its traceback: ~200 lines for one full disk); the run
    says it in one line (Checkpointer._unwritable). Every other record passes."""
    NOISE = ("_SignalingThread.run() raised", "in background save thread",
             "Save Finalize thread")

    def filter(self, record) -> bool:
        return not (record.levelno >= 40 and any(n in record.getMessage() for n in self.NOISE))


def _quiet_failed_saves() -> None:
    import logging

    log = logging.getLogger("absl")
    if not any(isinstance(f, _FailedSaveLogs) for f in log.filters):
        log.addFilter(_FailedSaveLogs())
