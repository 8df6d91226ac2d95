"""The experiment loop, shared by every layout: set up, run the steps, build the record.

Read top to bottom: `run` is the whole life of a run once its devices are chosen, `train`
its steps and what they measured, `run_steps` the loop itself (tests and benchmarks call it
too). Around each step: jaxdist.loop_hooks; what the steps need: jaxdist.run_setup; the
record: jaxdist.run_record.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxdist import loop_hooks as hooks, run_record, run_setup
from jaxdist.config import parse_profile_steps
from jaxdist.devices import Platform
from jaxdist.job import Job
from jaxdist.stop import StopRequest, run_abandonable, set_phase
from jaxdist.timing import StepTimer
from jaxdist.writers import NullWriter, RunWriter


def run(job: Job, platform: Platform, logdir: Path | None, log=print,
        stop: StopRequest | None = None, notice: str | None = None) -> dict:
    """One run of `job` (jaxdist.job, resolved by experiments.validation); `stop` is the entry point's StopRequest (installed early), else the loop
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
        setup = (lambda: run_setup.setup(job, platform, log, notice))
        ready = run_abandonable(setup, stop)
        # SIGINT/SIGTERM stop the run after the current step (jaxdist/stop.py).
        stop.attach(ready.start_step)
        run_setup.check_step_memory(platform, ready.compiled)
        return train(job, platform, logdir, ready, stop)
    finally:
        if own:
            stop.restore()


def train(job: Job, platform: Platform, logdir: Path | None, ready: run_setup.Ready,
          stop: StopRequest) -> dict:
    """The steps of a run set up, with its hooks; then its own prediction (after the timed
    window, so its compile is not timed) and its record, built once and written."""
    first, total = ready.start_step, ready.total_steps
    # A resumed run warms up again (fresh compile), keeping at least one timed step.
    warmup = min(job.loop.warmup, total - first - 1)
    timer = StepTimer(warmup)
    window = hooks.Window.for_run(job.power, platform.devices, first, warmup, total)
    profile = parse_profile_steps(job.output.profile_steps)
    profiler = hooks.Profiler(profile, logdir) if profile and logdir is not None else None
    stopper = hooks.StopProtocol(stop, first, total)
    writer = RunWriter(logdir, job.to_dict()) if logdir is not None else NullWriter()
    try:
        with window.monitor:
            progress = hooks.Progress(f"{job.layout.name} {platform.shape.spec}", first,
                                      warmup, total - first - warmup, job.output.progress)
            evaluation = (hooks.Evaluation(ready.program, ready.dataset, job, total, window,
                                           writer) if ready.dataset is not None else None)
            saving = (hooks.Checkpointing(ready.ckpt, ready.stream, window)
                      if ready.ckpt else None)
            # Outermost first (loop_hooks says why): the window hugs the step; the run's own
            # prediction finishes last, its compile after the window has closed.
            prediction = hooks.Prediction(job, platform)
            around = [h for h in (prediction, evaluation, saving, stopper, progress,
                                  hooks.StepLog(writer, timer), profiler, window) if h]
            state, losses = run_steps(lambda s, b: timer.run(ready.compiled, s, b)[0],
                                      ready.state, ready.next_batch, range(first, total),
                                      around, job.layout.name)
        done = first + len(losses)
        # Each process measures its own GPUs, so it is credited with its share of the samples.
        share = (sum(d.process_index == jax.process_index() for d in platform.devices),
                 len(platform.devices))
        measured = run_record.Measured(
            timer, losses, state,
            power=window.power(done, job.train.batch_size, share,
                               ready.model_cfg.tokens_per_sample),
            accuracy=evaluation.accuracy if evaluation else [],
            checkpoint=ready.ckpt.finish() if ready.ckpt else None,
            profile=profiler.block() if profiler else None,
            interrupted=stopper.interrupted(done, len(timer.timed_s)), profile_steps=profile)
        results = run_record.build(job, platform, ready, measured, window.monitor, prediction)
        if logdir is not None:
            window.monitor.write_outputs(Path(logdir), writer.tb)
            # Stopped in warm-up too: an HParams row that says `interrupted`, its step-time
            # figures blank, rather than no row at all.
            writer.summary(results)
    finally:
        writer.close()
    return results


def run_steps(step, state, next_batch, steps: range, around=(), name: str = "step"):
    """(final state, each step's loss as a float) of `step(state, batch) -> (state, loss)`
    over `steps`, each traced as `name` for the profiler, with the hooks `around` it
    (jaxdist.loop_hooks: `before` in order, `after` and `finish` in reverse)."""
    losses = []
    for i in steps:
        if any(h.before(i) for h in around):
            break
        with jax.profiler.StepTraceAnnotation(name, step_num=i):
            state, loss = step(state, next_batch())
        done = hooks.Step(i, state, loss)
        for h in reversed(around):
            h.after(done)
        losses.append(done.loss)
        if done.stopping:
            break
    for h in reversed(around):
        h.finish(steps.start + len(losses))
    return state, losses
