"""A mesh run's results.json, from what its loop measured (`Measured`) and what its setup
built (run_setup.Ready), through the one builder (jaxdist.record_builder.build), once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxdist import metrics, record_builder, telemetry
from jaxdist.devices import env_info
from jaxdist.pipeline.program import PipelineProgram
from jaxdist.pipeline.report import pipeline_block, switch_runs
from jaxdist.program import comm
from jaxdist.program import compiled as compiled_mod, program_reading
from jaxdist.train_step import compiled_step_flops


@dataclass
class Measured:
    """What the loop and its hooks measured: the step timer, each step's loss, the final
    state, the power window's block, the evaluations, the checkpoints' block, the profiled
    steps' block, and how the run was stopped (None: it ran every step)."""
    timer: Any
    losses: list[float]
    state: Any
    power: dict
    accuracy: list[dict]
    checkpoint: dict | None
    profile: dict | None
    interrupted: dict | None
    profile_steps: tuple[int, int] | None = None


def build(job, platform, ready, measured: Measured, monitor, prediction) -> dict:
    """results.json of a mesh run: every block, the run's own prediction (the loop's
    Prediction hook) beside the measured blocks it compares with, built once."""
    m, program, compiled, model_cfg = measured, ready.program, ready.compiled, job.model
    steps = step_time_block(m.timer, m.profile_steps, ready.start_step + len(m.losses) - 1)
    mean_s = steps["mean"] if steps["n"] else None
    batch = job.train.batch_size
    layout = job.rules
    pipeline = (pipeline_block(program, compiled, m.state, batch,
                               model_cfg.flops_per_sample() * batch, len(platform.devices))
                if isinstance(program, PipelineProgram) else None)
    blocks = dict(
        env=env_info(platform), compile_s=ready.compile_s, step_time_s=steps,
        warmup_step_time_s=m.timer.warmup_s,
        throughput=record_builder.throughput_block(batch, model_cfg.tokens_per_sample, mean_s),
        mfu=mfu_block(job, program, compiled, platform.device_kind,
                      len(platform.devices), mean_s),
        memory=memory_block(platform, compiled, m.state, monitor),
        sharding=metrics.sharding_summary(program.abstract_state, program.state_specs,
                                          program.logical_state),
        loss=m.losses,
        comm={**comm_block(layout.name, compiled, program),  # bytes each stage sends too
              **({"stage": pipeline["stage_bytes"]} if pipeline else {})},
        power=m.power,
        window={"start_unix_s": m.timer.window_start, "end_unix_s": m.timer.window_end},
        steps_done=ready.start_step + len(m.losses), interrupted=m.interrupted,
        distributed_optimizer=layout.distributed_optimizer,
        program=program_block(platform, program, compiled), pipeline=pipeline)
    return record_builder.build(
        "jax", job.layout.name, dict(program.batch_sharding.mesh.shape), job.to_dict(),
        model_cfg,
        metrics.param_count(program.logical_state), **blocks,
        # The model's prediction for the part (--hardware, or the devices' own), beside it.
        prediction=prediction.block(blocks), accuracy=m.accuracy,
        start_step=ready.start_step, checkpoint=m.checkpoint, profile=m.profile)


def step_time_block(timer, profile_steps, last_step: int) -> dict:
    """results["step_time_s"]: the timed steps' statistics, and which of them ran under the
    profiler (the timed steps are the last n this process ran, up to `last_step`)."""
    steps = metrics.step_time_block(timer.timed_s)
    if profile_steps and steps["n"]:
        first, last = profile_steps
        traced = [i for i in range(first, last + 1) if last_step - steps["n"] < i <= last_step]
        if traced:
            steps["profiled_note"] = (f"includes {len(traced)} step(s) run under the "
                                      f"profiler (steps {first}-{last})")
    return steps


def memory_block(platform, compiled, state, monitor) -> dict:
    """results["memory"]: the state's bytes by device and by part, XLA's bound, the
    allocator's peak (and each device's figures now) and the peak over XLA's bound."""
    compiled_memory = metrics.compiled_memory(compiled)
    peak, reason = metrics.measured_peak(platform.devices)
    estimate = (compiled_memory or {}).get("peak_bytes")
    return record_builder.memory_block(
        metrics.state_bytes_by_device(state), compiled_memory, peak, reason,
        state_bytes_by_part=metrics.state_bytes_by_part(state),
        devices=telemetry.memory_snapshot(platform.devices, monitor),
        measured_over_estimate=peak / estimate if peak and estimate else None)


def program_block(platform, program, compiled) -> dict:
    """results["program"]: which compiler built the step, its kernels per step per device
    (jaxdist.program.kernels) and XLA's own cost counts; never fails the run it describes."""
    try:
        mesh_shape = dict(program.batch_sharding.mesh.shape)
        runs = (switch_runs(program_reading.text(compiled), mesh_shape, program.schedule)
                if isinstance(program, PipelineProgram) else None)
        reading = program_reading.read(compiled, compiled_mod.run_devices(platform), mesh_shape,
                                       runs)
    except Exception as e:  # noqa: BLE001 - the run's measurement stands
        return {"compiler": None, "reason": f"{type(e).__name__}: {e}"}
    return {"compiler": reading.label, "kernels": reading.kernels,
            "kernels_upper_bound": reading.kernels_upper_bound, "xla_cost": reading.xla_cost}


def mfu_block(job, program, compiled, device_kind: str, num_devices: int,
              step_s: float | None) -> dict:
    """results["mfu"]: the model's analytic FLOPs (mfu) and the compiled step's, every
    micro-batch counted (hfu), over the part's peak."""
    return metrics.mfu(device_kind, job.dtype, num_devices, step_s,
                       compiled_step_flops(program, compiled),
                       job.model.flops_per_sample() * job.train.batch_size,
                       job.matmul_precision)


def comm_block(layout: str, compiled, program) -> dict:
    """Collectives of the compiled step (bytes per device per step, by kind and mesh axis)
    beside the layout's analytic parameter/gradient traffic."""
    mesh_shape = dict(program.batch_sharding.mesh.shape)
    hlo_text = program_reading.text(compiled)
    # A pipeline's tick loop switches on its schedule table: how often each branch runs
    # comes from that table, not the HLO.
    runs = (switch_runs(hlo_text, mesh_shape, program.schedule)
            if isinstance(program, PipelineProgram) else None)
    summary = comm.summarize(comm.collectives(hlo_text, mesh_shape, runs))
    param_bytes, grad_bytes = (sum(leaf.size * leaf.dtype.itemsize for leaf in
                                   jax.tree.leaves(program.logical_state.get(part, {})))
                               for part in ("params", "master"))
    analytic = comm.analytic_ring_bytes(layout, mesh_shape, param_bytes, grad_bytes or None)
    summary["analytic_ring_bytes"] = analytic
    summary["analytic_basis"] = comm.analytic_basis(layout)
    summary["measured_over_analytic"] = (summary["total_ring_bytes"] / analytic
                                         if analytic else None)
    return summary
