"""Checkpoints with Orbax: save the train state every N steps (asynchronously), resume from
the latest complete one, under any layout or mesh.

Orbax writes each step into a temporary directory and renames it when complete, so a save
killed mid-write never replaces the last good checkpoint and `latest_step()` never sees it.
Restoring onto the new program's abstract state (shapes + shardings) reshards: a checkpoint
saved under fsdp on 2x4 restores under ddp on 8 devices or fsdp on 4x2.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxdist.errors import UsageError

# What must match for a checkpoint to be resumable; layout and mesh may change (reshard).
IDENTITY = ("model", "model_opts", "dataset", "optimizer", "dtype")


def identity(cfg) -> dict:
    return {"model": cfg.model.model, "model_opts": cfg.model.model_opts,
            "dataset": cfg.data.dataset, "optimizer": cfg.train.optimizer,
            "dtype": cfg.model.dtype}


class Checkpointer:
    def __init__(self, directory: str, every: int, meta: dict):
        self.directory = Path(directory).absolute()
        self.every = every
        self.meta = meta
        self.save_s = 0.0
        self.saved_steps: list[int] = []
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True,
                                                 create=True))

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
        self.manager.save(steps_done, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.save_s += time.perf_counter() - start  # the blocking part; writing goes on
        self.saved_steps.append(steps_done)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, abstract_state, shardings) -> tuple:
        """(state laid out by `shardings`, saved meta) of checkpoint `step`."""
        meta = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        mismatched = [f"{k} {meta.get(k)!r} vs {self.meta[k]!r}" for k in IDENTITY
                      if meta.get(k) != self.meta[k]]
        if mismatched:
            raise UsageError(f"checkpoint {step} in {self.directory} is from an incompatible "
                             f"run ({'; '.join(mismatched)})")
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, shardings)
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))["state"]
        except (ValueError, KeyError) as e:
            raise UsageError(f"checkpoint {step} in {self.directory} does not fit this "
                             f"model's state: {str(e).splitlines()[0]}") from None
        return state, meta

    def finish(self) -> dict:
        """Wait for pending writes; the checkpoint block of results."""
        start = time.perf_counter()
        self.manager.wait_until_finished()
        self.save_s += time.perf_counter() - start
        self.manager.close()
        size = sum(f.stat().st_size for f in self.directory.rglob("*") if f.is_file())
        return {"directory": str(self.directory), "every": self.every,
                "saved_steps": self.saved_steps, "save_s": self.save_s,
                "bytes_on_disk": size}
