"""The experiment loop, shared by every layout: build, compile, warm up, time, measure, write.

Read top to bottom: this is the whole life of a run once its devices are chosen.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from jaxdist import host_memory, metrics, record_builder, telemetry
from jaxdist.program import comm
from jaxdist.checkpoint import Checkpointer, identity
from jaxdist.config import RunConfig, parse_profile_steps
from jaxdist.data import NUM_SYNTHETIC_BATCHES, TrainStream, eval_batches
from jaxdist.errors import UsageError
from jaxdist.devices import Platform, env_info
from jaxdist.mesh import build_mesh
from jaxdist.stop import StopRequest, run_abandonable, set_phase
from jaxdist.timing import StepTimer
from jaxdist.program.xla_compile import compile_with
from jaxdist.program import compiled as compiled_mod, program_reading
from jaxdist.train_step import compiled_step_flops, put_batch
from jaxdist.writers import NullWriter, RunWriter
from jaxdist.pipeline.program import PipelineProgram
from jaxdist.pipeline.report import pipeline_block, switch_runs
from jaxdist.predict.inrun import safe_prediction_block
from jaxdist.run_model import build_model
from sharding import get_layout


def run(cfg: RunConfig, platform: Platform, logdir: Path | None, log=print,
        stop: StopRequest | None = None, notice: str | None = None) -> dict:
    """One run; `stop` is the entry point's StopRequest (installed early), else the loop
    installs its own for its duration. `notice` is logged once the step program is built:
    a layout the mesh cannot shard is refused there, and its one line comes alone.

    Everything before the first step (build, restore, trace, XLA compile) runs where a
    signal ends it at once (jaxdist.stop.run_abandonable: StoppedInSetup, naming the
    phase; on several processes, every one of them); after that, several processes stop
    together, after a step."""
    own = stop is None
    stop = StopRequest().install() if own else stop
    try:
        set_phase("model build", 0)
        setup = (lambda: _setup(cfg, platform, log, notice))
        ready = run_abandonable(setup, stop)
        # SIGINT/SIGTERM stop the run after the current step (jaxdist/stop.py).
        stop.attach(ready[7])  # start_step
        return _train(cfg, platform, logdir, log, *ready, stop)
    finally:
        if own:
            stop.restore()


def _setup(cfg, platform, log, notice) -> tuple:
    """What the steps need: the model, its step program, the data, the checkpointer, the
    state and first step, the compiled step and its compile seconds."""
    model_cfg, dataset = build_model(cfg)
    program = compiled_mod.step_program(cfg, model_cfg,
                                        build_mesh(platform.shape, platform.devices))
    if notice:
        log(notice)
    if platform.backend == "cpu":  # this host's RAM: refused before anything is allocated
        check_host_memory(cfg, platform, model_cfg, dataset, program)
    stream = TrainStream(model_cfg, dataset, cfg.train.batch_size, cfg.train.seed)
    next_batch = batch_feed(stream, dataset is not None, program.batch_sharding)
    total_steps = cfg.loop.warmup + cfg.loop.steps

    ckpt = (Checkpointer(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.checkpoint_every,
                         dict(identity(cfg), layout=cfg.train.layout, mesh=platform.shape.label,
                              seed=cfg.train.seed, batch_size=cfg.train.batch_size))
            if cfg.checkpoint.checkpoint_dir else None)
    set_phase("checkpoint restore" if cfg.checkpoint.resume else "state init")
    state, start_step = restore_or_init(cfg, ckpt, program, stream, total_steps, log)
    set_phase("tracing the step", start_step)
    start = time.perf_counter()
    lowered = program.step.lower(state, put_batch(stream.batch(0), program.batch_sharding))
    set_phase("the XLA compile")
    compiled = compile_with(lowered, None)
    compile_s = time.perf_counter() - start
    log(f"compiled the {cfg.train.layout} step in {compile_s:.2f} s")
    return (model_cfg, dataset, program, stream, next_batch, ckpt, state, start_step,
            total_steps, compiled, compile_s)


def _train(cfg, platform, logdir, log, model_cfg, dataset, program, stream, next_batch, ckpt,
           state, start_step, total_steps, compiled, compile_s, stop) -> dict:
    memory = metrics.compiled_memory(compiled)
    if platform.backend == "cpu" and memory:  # beyond its arguments (allocated already)
        local = sum(d.process_index == jax.process_index() for d in platform.devices)
        host_memory.check((memory["peak_bytes"] - memory["argument_bytes"]) * local,
                          "step (outputs and temporaries, the compiler's figure)", local)

    # A resumed run warms up again (fresh compile), keeping at least one timed step.
    warmup = min(cfg.loop.warmup, total_steps - start_step - 1)
    timer = StepTimer(warmup)
    window_open, window_close = (start_step + i for i in telemetry.window_steps(
        cfg.power.power_window, warmup, total_steps - start_step - warmup))
    profile = parse_profile_steps(cfg.output.profile_steps)
    monitor = telemetry.create_monitor(cfg.power, devices=platform.devices)
    writer = RunWriter(logdir, cfg.to_dict()) if logdir is not None else NullWriter()
    losses, accuracy = [], []
    steps_done = start_step
    try:
        with monitor:
            started = time.perf_counter()
            # Warm-up steps, then the timed ones the summary's n counts, each counted apart.
            label = f"{cfg.train.layout} {platform.shape.spec}"
            timed_n = total_steps - start_step - warmup
            bar = tqdm(total=warmup or timed_n, unit="step", file=sys.stderr,
                       desc=f"{label} warm-up" if warmup else f"{label} timed",
                       disable=not cfg.output.progress)
            for i in range(start_step, total_steps):
                if i == start_step and stop.signal and not stop.synced:
                    break  # a stop that came before the first step: none is run
                if profile and i == profile[0] and logdir is not None:
                    jax.profiler.start_trace(str(logdir))
                if i == window_open:
                    monitor.open_window()
                timed_step = not timer.in_warmup
                with jax.profiler.StepTraceAnnotation(cfg.train.layout, step_num=i):
                    (state, loss), step_s = timer.run(compiled, state, next_batch())
                steps_done = i + 1
                if i == window_close:
                    monitor.close_window()
                if profile and i == profile[1] and logdir is not None:
                    jax.profiler.stop_trace()
                losses.append(metrics.scalar(loss))
                writer.step(i, losses[-1], step_s, timed_step)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                bar.update()
                if warmup and steps_done == start_step + warmup and timed_n:
                    bar.refresh()  # the warm-up's last count, then the timed steps from 0
                    bar.set_description(f"{label} timed", refresh=False)
                    bar.reset(total=timed_n)
                # Asked on every process at every step (the multi-process protocol needs it).
                stopping = stop.should_stop(steps_done) and steps_done < total_steps
                # Checkpoint saves and evaluation are not training: the energy window
                # pauses around them (the window is open from window_open to window_close).
                in_window = window_open <= i < window_close
                if ckpt and (stopping or ckpt.due(steps_done)):
                    with monitor.paused(f"checkpoint after step {i}", in_window):
                        ckpt.save(steps_done, state, stream.position)
                if stopping:
                    break
                every = cfg.data.eval_every
                if dataset is not None and every and (steps_done % every == 0
                                                      or steps_done == total_steps):
                    with monitor.paused(f"evaluation after step {i}", in_window):
                        accuracy.append({"step": steps_done,
                                         "wall_s": time.perf_counter() - started,
                                         "accuracy": evaluate(program, state, dataset, cfg)})
                    writer.scalar("eval/accuracy", accuracy[-1]["accuracy"], steps_done)
            bar.close()
            interrupted = steps_done < total_steps
            if interrupted and window_open < steps_done <= window_close:
                window_close = steps_done - 1  # the window ends with the last step run
                monitor.close_window()

        # Each process measures its own GPUs, so it is credited with its share of the samples.
        share = len([d for d in platform.devices if d.process_index == jax.process_index()])
        window_n = max(min(window_close, steps_done - 1) - window_open + 1, 0)
        window_samples = window_n * cfg.train.batch_size * share // len(platform.devices)
        tokens = model_cfg.tokens_per_sample
        power = monitor.result(window_n, window_samples,
                               window_samples * tokens if tokens else None,
                               first_step=window_open)
        results = assemble_results(
            cfg, platform, model_cfg, program, compiled, compile_s, timer, losses, state,
            start_step, power, steps_done,
            interrupted=({"signal": stop.signal or "SIGTERM",
                          "received_here": stop.signal is not None,
                          "steps_planned": total_steps, "timed_steps": len(timer.timed_s)}
                         if interrupted else None))
        results["memory"]["devices"] = telemetry.memory_snapshot(platform.devices, monitor)
        measured, estimate = (results["memory"]["measured_peak_bytes"],
                              (results["memory"]["compiled"] or {}).get("peak_bytes"))
        results["memory"]["measured_over_estimate"] = (measured / estimate
                                                       if measured and estimate else None)
        # The model's prediction for the part (--hardware, or the devices' own), beside it.
        results["prediction"] = safe_prediction_block(cfg, platform, results)
        results["accuracy"] = accuracy
        results["start_step"] = start_step
        results["checkpoint"] = ckpt.finish() if ckpt else None
        results["profile"] = ({"steps": list(profile), "dir": str(Path(logdir) / "plugins")}
                              if profile and logdir is not None else None)
        if logdir is not None:
            monitor.write_outputs(Path(logdir), writer.tb)
            # Stopped in warm-up too: an HParams row that says `interrupted`, its step-time
            # figures blank, rather than no row at all.
            writer.summary(results)
    finally:
        writer.close()
    return results


def check_host_memory(cfg, platform, model_cfg, dataset, program) -> None:
    """The train state's shards on this process's CPU devices (exact, from shapes) and its
    batches: a synthetic pool of NUM_SYNTHETIC_BATCHES on the host, each placed on the
    devices once (batch_feed); a dataset's one at a time."""
    local = [d for d in platform.devices if d.process_index == jax.process_index()]
    batch = compiled_mod.batch_bytes(model_cfg, cfg.train.batch_size)
    pool = NUM_SYNTHETIC_BATCHES if dataset is None else 1
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


def restore_or_init(cfg: RunConfig, ckpt, program, stream, total_steps: int, log):
    """(train state, first step): from the latest checkpoint with --resume, else fresh."""
    if cfg.checkpoint.resume:
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


def evaluate(program, state, dataset, cfg: RunConfig) -> float:
    """Test-split accuracy; evaluation time is outside every timed step."""
    hits = 0.0
    devices = program.batch_sharding.mesh.devices.size
    for batch in eval_batches(dataset, cfg.train.batch_size, devices):
        hits += metrics.scalar(program.correct(state, put_batch(batch, program.batch_sharding)))
    return hits / len(dataset.test_y)


def assemble_results(cfg, platform, model_cfg, program, compiled, compile_s, timer, losses,
                     state, start_step: int, power: dict, steps_done: int,
                     interrupted: dict | None) -> dict:
    steps = metrics.step_time_block(timer.timed_s)
    profile = parse_profile_steps(cfg.output.profile_steps)
    if profile and steps["n"]:  # the timed steps are the last n this process ran
        last = start_step + len(losses) - 1
        traced = [i for i in range(profile[0], profile[1] + 1)
                  if last - steps["n"] < i <= last]
        if traced:
            steps["profiled_note"] = (f"includes {len(traced)} step(s) run under the "
                                      f"profiler (steps {profile[0]}-{profile[1]})")
    mean_s = steps["mean"] if steps["n"] else None
    batch = cfg.train.batch_size
    layout = get_layout(cfg.train.layout, cfg.train.distributed_optimizer)
    results = record_builder.build(
        "jax", cfg.train.layout, dict(program.batch_sharding.mesh.shape), cfg, model_cfg,
        metrics.param_count(program.logical_state),
        env=env_info(platform), compile_s=compile_s, step_time_s=steps,
        warmup_step_time_s=timer.warmup_s,
        throughput=record_builder.throughput_block(batch, model_cfg.tokens_per_sample, mean_s),
        mfu=mfu_block(cfg, model_cfg, program, compiled, platform.device_kind,
                      len(platform.devices), mean_s),
        memory=record_builder.memory_block(metrics.state_bytes_by_device(state),
                                   metrics.compiled_memory(compiled),
                                   *metrics.measured_peak(platform.devices)),
        sharding=metrics.sharding_summary(program.abstract_state, program.state_specs,
                                          program.logical_state),
        loss=losses, comm=comm_block(layout.name, compiled, program), power=power,
        window={"start_unix_s": timer.window_start, "end_unix_s": timer.window_end},
        steps_done=steps_done, interrupted=interrupted,
        distributed_optimizer=layout.distributed_optimizer,
        program=program_block(cfg, platform, program, compiled),
        pipeline=(pipeline_block(program, compiled, state, batch,
                                 model_cfg.flops_per_sample() * batch, len(platform.devices))
                  if isinstance(program, PipelineProgram) else None))
    results["memory"]["state_bytes_by_part"] = metrics.state_bytes_by_part(state)
    if results["pipeline"]:  # bytes each stage sends, beside the analytic activation volume
        results["comm"]["stage"] = results["pipeline"]["stage_bytes"]
    return results


def program_block(cfg, platform, program, compiled) -> dict:
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
    return {"compiler": reading["label"], "kernels": reading["kernels"],
            "kernels_upper_bound": reading["kernels_upper_bound"],
            "xla_cost": reading["xla_cost"]}


def mfu_block(cfg, model_cfg, program, compiled, device_kind: str, num_devices: int,
              step_s: float | None) -> dict:
    """results["mfu"]: the model's analytic FLOPs (mfu) and the compiled step's, every
    micro-batch counted (hfu), over the part's peak."""
    return metrics.mfu(device_kind, cfg.model.dtype, num_devices, step_s,
                       compiled_step_flops(program, compiled),
                       model_cfg.flops_per_sample() * cfg.train.batch_size,
                       cfg.model.matmul_precision)


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
