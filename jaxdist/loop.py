"""The experiment loop, shared by every layout: build, compile, warm up, time, measure, write.

Read top to bottom: this is the whole life of a run once its devices are chosen.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

import jax

from jaxdist import comm, metrics
from jaxdist.checkpoint import Checkpointer, identity
from jaxdist.config import RunConfig
from jaxdist.errors import UsageError
from jaxdist.data import TrainStream, build_model, eval_batches
from jaxdist.devices import Platform, env_info
from jaxdist.mesh import build_mesh
from jaxdist.results import SCHEMA_VERSION
from jaxdist.timing import StepTimer, timed
from jaxdist.train_step import build_program, make_optimizer, put_batch
from jaxdist.writers import NullWriter, RunWriter
from sharding import get_layout


def run(cfg: RunConfig, platform: Platform, logdir: Path, log=print) -> dict:
    model_cfg, dataset = build_model(cfg)
    tx = make_optimizer(cfg.train.optimizer, cfg.train.lr)
    mesh = build_mesh(platform.shape, platform.devices)
    program = build_program(model_cfg, cfg.model.dtype, tx, get_layout(cfg.train.layout),
                            mesh, cfg.train.seed, cfg.train.microbatches)
    stream = TrainStream(model_cfg, dataset, cfg.train.batch_size, cfg.train.seed)
    total_steps = cfg.loop.warmup + cfg.loop.steps

    # Synthetic batches are a fixed pool: place each on the devices once, so the loop does
    # not pay a host-to-device copy per step that a bare benchmark loop would not.
    on_device: dict[int, dict] = {}

    def next_batch():
        if dataset is not None:
            return put_batch(stream.next(), program.batch_sharding)
        key = stream.position % stream.batches_per_epoch
        if key not in on_device:
            on_device[key] = put_batch(stream.batch(key), program.batch_sharding)
        stream.position += 1
        return on_device[key]

    ckpt = (Checkpointer(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.checkpoint_every,
                         dict(identity(cfg), layout=cfg.train.layout, mesh=platform.shape.label,
                              seed=cfg.train.seed, batch_size=cfg.train.batch_size))
            if cfg.checkpoint.checkpoint_dir else None)
    state, start_step = None, 0
    if cfg.checkpoint.resume:
        latest = ckpt.latest()
        if latest is None:
            log(f"--resume: no complete checkpoint in {ckpt.directory}; starting afresh")
        else:
            state, meta = ckpt.restore(latest, program.abstract_state, program.state_shardings)
            start_step, stream.position = meta["step"], meta["data_position"]
            log(f"resumed from checkpoint {latest} (saved under {meta.get('layout')} on "
                f"{meta.get('mesh')}), continuing at step {start_step}")
    if start_step >= total_steps:
        raise UsageError(f"checkpoint {start_step} already covers the {total_steps} steps asked "
                         f"for (--warmup + --steps); ask for more steps")
    if state is None:
        state = program.init()
    first = put_batch(stream.batch(0), program.batch_sharding)
    compiled, compile_s = timed(lambda: program.step.lower(state, first).compile())
    log(f"compiled the {cfg.train.layout} step in {compile_s:.2f} s")

    writer = RunWriter(logdir, cfg.to_dict()) if logdir is not None else NullWriter()
    try:
        # A resumed run warms up again (fresh compile), keeping at least one timed step.
        timer = StepTimer(min(cfg.loop.warmup, total_steps - start_step - 1))
        losses, accuracy = [], []
        started = time.perf_counter()
        bar = tqdm(range(start_step, total_steps), desc=f"{cfg.train.layout} {platform.shape.label}",
                   unit="step", file=sys.stderr, disable=not cfg.output.progress)
        for i in bar:
            timed_step = not timer.in_warmup
            (state, loss), step_s = timer.run(compiled, state, next_batch())
            losses.append(metrics.scalar(loss))
            writer.step(i, losses[-1], step_s, timed_step)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            if ckpt:
                ckpt.maybe_save(i + 1, state, stream.position)
            every = cfg.data.eval_every
            if dataset is not None and every and ((i + 1) % every == 0 or i + 1 == total_steps):
                accuracy.append({"step": i + 1, "wall_s": time.perf_counter() - started,
                                 "accuracy": evaluate(program, state, dataset, cfg)})
                writer.scalar("eval/accuracy", accuracy[-1]["accuracy"], i + 1)
        bar.close()

        results = assemble_results(cfg, platform, model_cfg, program, compiled, compile_s,
                                   timer, losses, state)
        results["accuracy"] = accuracy
        results["start_step"] = start_step
        results["checkpoint"] = ckpt.finish() if ckpt else None
        writer.summary(results)
    finally:
        writer.close()
    return results


def evaluate(program, state, dataset, cfg: RunConfig) -> float:
    """Test-split accuracy; evaluation time is outside every timed step."""
    hits = 0.0
    devices = program.batch_sharding.mesh.devices.size
    for batch in eval_batches(dataset, cfg.train.batch_size, devices):
        hits += metrics.scalar(program.correct(state, put_batch(batch, program.batch_sharding)))
    return hits / len(dataset.test_y)


def assemble_results(cfg, platform, model_cfg, program, compiled, compile_s, timer, losses,
                     state) -> dict:
    steps = metrics.latency_stats(timer.timed_s)
    batch = cfg.train.batch_size
    n = len(platform.devices)
    tokens = model_cfg.tokens_per_sample
    analytic_step_flops = model_cfg.flops_per_sample() * batch
    by_device = metrics.state_bytes_by_device(state)
    measured, measured_reason = metrics.measured_peak(platform.devices)
    return {
        "schema_version": SCHEMA_VERSION,
        "framework": "jax",
        "layout": cfg.train.layout,
        "mesh": dict(program.batch_sharding.mesh.shape),
        "model": {"name": cfg.model.model, "params": metrics.param_count(program.abstract_state),
                  "flops_per_sample": model_cfg.flops_per_sample(),
                  "tokens_per_sample": tokens},
        "config": cfg.to_dict(),
        "env": env_info(platform),
        "compile_s": compile_s,
        "step_time_s": steps,
        "warmup_step_time_s": timer.warmup_s,
        "throughput": {"samples_per_s": batch / steps["mean"],
                       "tokens_per_s": batch * tokens / steps["mean"] if tokens else None},
        "mfu": metrics.mfu(platform.device_kind, cfg.model.dtype, n, steps["mean"],
                           metrics.compiled_flops(compiled), analytic_step_flops),
        "memory": {
            "state_bytes_per_device": max(d["bytes"] for d in by_device),
            "state_bytes_by_device": by_device,
            "compiled": metrics.compiled_memory(compiled),
            "measured_peak_bytes": measured,
            "measured_peak_reason": measured_reason,
        },
        "sharding": metrics.sharding_summary(program.abstract_state, program.state_specs),
        "comm": comm_block(cfg.train.layout, compiled, program),
        "loss": losses,
        "power": {"available": False,
                  "reason": "power telemetry is not implemented yet"},
        "window": {"start_unix_s": timer.window_start, "end_unix_s": timer.window_end},
    }


def comm_block(layout: str, compiled, program) -> dict:
    """Collectives of the compiled step (bytes per device per step, by kind and mesh axis)
    beside the layout's analytic parameter/gradient traffic."""
    mesh_shape = dict(program.batch_sharding.mesh.shape)
    summary = comm.summarize(comm.collectives(compiled.as_text(), mesh_shape))
    param_bytes = sum(leaf.size * leaf.dtype.itemsize
                      for leaf in jax.tree.leaves(program.abstract_state["params"]))
    analytic = comm.analytic_ring_bytes(layout, mesh_shape, param_bytes)
    summary["analytic_ring_bytes"] = analytic
    summary["measured_over_analytic"] = (summary["total_ring_bytes"] / analytic
                                         if analytic else None)
    return summary
