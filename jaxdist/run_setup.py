"""What a run's steps need, built before the first one: the model, its step program, the
data feed, the checkpointer, the state (fresh or restored) and the compiled step
(`setup` -> `Ready`), with this host's memory checked before anything is allocated."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxdist import host_memory, metrics
from jaxdist.checkpoint import Checkpointer, identity
from jaxdist.data import NUM_SYNTHETIC_BATCHES, TrainStream
from jaxdist.errors import UsageError
from jaxdist.mesh import build_mesh
from jaxdist.program import compiled as compiled_mod
from jaxdist.program.xla_compile import compile_with
from jaxdist.stop import set_phase
from jaxdist.train_step import put_batch


@dataclass
class Ready:
    """A run set up: steps `start_step`..`total_steps - 1` remain (warm-up included)."""
    model_cfg: Any
    dataset: Any  # None: synthetic batches
    program: Any  # the step program (train_step.StepProgram or pipeline's)
    stream: TrainStream
    next_batch: Callable[[], dict]
    ckpt: Checkpointer | None
    state: Any
    start_step: int
    total_steps: int
    compiled: Any
    compile_s: float


def setup(job, platform, log, notice: str | None) -> Ready:
    """Build, restore or init, trace and compile `job`'s step (jaxdist.job); each phase
    named for a stop (set_phase)."""
    model_cfg, dataset, train = job.model, job.dataset, job.train
    program = compiled_mod.step_program(job, build_mesh(platform.shape, platform.devices))
    if notice:
        log(notice)
    if platform.backend == "cpu":  # this host's RAM: refused before anything is allocated
        check_host_memory(job, platform, program)
    stream = TrainStream(model_cfg, dataset, train.batch_size, train.seed)
    next_batch = batch_feed(stream, dataset is not None, program.batch_sharding)
    total_steps = job.loop.warmup + job.loop.steps

    ck = job.checkpoint
    ckpt = (Checkpointer(ck.checkpoint_dir, ck.checkpoint_every,
                         dict(identity(job.settings, job.data.dataset, job.optimizer),
                              layout=job.layout.name,
                              mesh=platform.shape.label, seed=train.seed,
                              batch_size=train.batch_size))
            if ck.checkpoint_dir else None)
    set_phase("checkpoint restore" if ck.resume else "state init")
    state, start_step = restore_or_init(ck.resume, ckpt, program, stream, total_steps, log)
    set_phase("tracing the step", start_step)
    start = time.perf_counter()
    lowered = program.step.lower(state, put_batch(stream.batch(0), program.batch_sharding))
    set_phase("the XLA compile")
    compiled = compile_with(lowered, None)
    compile_s = time.perf_counter() - start
    log(f"compiled the {job.layout.name} step in {compile_s:.2f} s")
    return Ready(model_cfg, dataset, program, stream, next_batch, ckpt, state, start_step,
                 total_steps, compiled, compile_s)


def check_step_memory(platform, compiled) -> None:
    """On CPU devices, the compiled step's outputs and temporaries beyond its arguments
    (allocated already) in this host's RAM, the compiler's figure."""
    memory = metrics.compiled_memory(compiled)
    if platform.backend == "cpu" and memory:
        local = sum(d.process_index == jax.process_index() for d in platform.devices)
        host_memory.check((memory["peak_bytes"] - memory["argument_bytes"]) * local,
                          "step (outputs and temporaries, the compiler's figure)", local)


def check_host_memory(job, platform, program) -> None:
    """The train state's shards on this process's CPU devices (exact, from shapes) and its
    batches: a synthetic pool of NUM_SYNTHETIC_BATCHES on the host, each placed on the
    devices once (batch_feed); a dataset's one at a time."""
    local = [d for d in platform.devices if d.process_index == jax.process_index()]
    batch = compiled_mod.batch_bytes(job.model, job.train.batch_size)
    pool = NUM_SYNTHETIC_BATCHES if job.dataset is None else 1
    host_memory.check(host_memory.state_bytes(program.abstract_state, program.state_shardings,
                                              local)
                      + pool * batch * (1 + len(local) / len(platform.devices)),
                      f"train state and {pool} batch(es)", len(local))


def batch_feed(stream: TrainStream, real_data: bool, sharding):
    """A function returning the next global batch on the devices. Synthetic batches are a
    fixed pool, each placed on the devices once, so the loop does not pay a host-to-device
    copy per step that a bare benchmark loop would not."""
    on_device: dict[int, dict] = {}

    def next_batch():
        if real_data:
            return put_batch(stream.next(), sharding)
        key = stream.position % stream.batches_per_epoch
        if key not in on_device:
            on_device[key] = put_batch(stream.batch(key), sharding)
        stream.position += 1
        return on_device[key]
    return next_batch


def restore_or_init(resume: bool, ckpt, program, stream, total_steps: int, log):
    """(train state, first step): from the latest checkpoint with --resume, else fresh."""
    if resume:
        latest = ckpt.latest()
        if latest is None:  # nothing there at all: said before the compile (disk_notices)
            if any(p.name.split(".")[0].isdigit() for p in ckpt.directory.iterdir()):
                log(f"--resume: no complete checkpoint in {ckpt.directory} (only unfinished "
                    f"saves); starting afresh at step 0")
        else:
            state, meta = ckpt.restore(latest, program.abstract_state, program.state_shardings)
            if meta["step"] >= total_steps:
                raise UsageError(f"checkpoint {meta['step']} already covers the {total_steps} "
                                 f"steps asked for (--warmup + --steps); ask for more steps")
            stream.position = meta["data_position"]
            log(f"resumed from checkpoint {latest} (saved under {meta.get('layout')} on "
                f"{meta.get('mesh')}), continuing at step {meta['step']}")
            return state, meta["step"]
    return program.init(), 0
