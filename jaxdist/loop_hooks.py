"""What the loop does around each step, one hook per concern: the stop protocol, the power
telemetry window, the profiler, the per-step log, the progress bar, checkpoint saves and
evaluation (jaxdist.loop.run_steps calls them).

Hooks nest around a step like `with` blocks: `before(i)` in list order, `after(step)` and
`finish(steps_done)` in reverse. A run lists them outermost first (evaluation, checkpoint,
stop, progress, log, profiler, window), so the window opens last before a step and closes
first after it, the stop is asked after the step is logged, and a checkpoint and an
evaluation see whether the run is stopping.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxdist import metrics, telemetry
from jaxdist.data import eval_batches
from jaxdist.train_step import put_batch


@dataclass
class Step:
    """A step just run: its index, the state and loss it returned, whether the run stops
    after it (set by StopProtocol)."""
    i: int
    state: Any
    device_loss: Any
    stopping: bool = False

    @cached_property
    def loss(self) -> float:
        """The loss as a float, fetched from the device when a hook first asks (the log),
        so the window and the profiler close around the step itself."""
        return metrics.scalar(self.device_loss)

    @property
    def done(self) -> int:
        """Steps run so far, this one included (warm-up too)."""
        return self.i + 1


class Hook:
    def before(self, i: int) -> bool:
        """Before step `i`; True ends the loop without running it."""
        return False

    def after(self, step: Step) -> None:
        """After a step."""

    def finish(self, steps_done: int) -> None:
        """After the last step run; `steps_done` counts the run's steps, warm-up and those
        before a resume too."""


class StopProtocol(Hook):
    """jaxdist.stop's protocol: asked after every step on every process (several processes
    stop on the same step); a signal that came before the first step runs none."""

    def __init__(self, stop, first: int, total_steps: int):
        self.stop, self.first, self.total = stop, first, total_steps

    def before(self, i: int) -> bool:
        return i == self.first and self.stop.signal is not None and not self.stop.synced

    def after(self, step: Step) -> None:
        step.stopping = self.stop.should_stop(step.done) and step.done < self.total

    def interrupted(self, steps_done: int, timed_steps: int) -> dict | None:
        """results["interrupted"]: the signal, whether this process received it (else a
        peer's notice), the steps planned; None when every step ran."""
        if steps_done >= self.total:
            return None
        return {"signal": self.stop.signal or "SIGTERM",
                "received_here": self.stop.signal is not None,
                "steps_planned": self.total, "timed_steps": timed_steps}


class Window(Hook):
    """The power telemetry window: open before step `first`, closed after step `last`
    (telemetry.window_steps), or after the last step run when a stop comes inside it.
    Checkpoint saves and evaluation inside it are paused out of it (`paused`)."""

    def __init__(self, monitor, first: int, last: int):
        self.monitor, self.first, self.last = monitor, first, last

    @classmethod
    def for_run(cls, power_cfg, devices, first_step: int, warmup: int,
                total_steps: int) -> "Window":
        """The window --power-window asks for, over this run's steps; a monitor of `devices`."""
        first, last = (first_step + i for i in telemetry.window_steps(
            power_cfg.power_window, warmup, total_steps - first_step - warmup))
        return cls(telemetry.create_monitor(power_cfg, devices=devices), first, last)

    def before(self, i: int) -> bool:
        if i == self.first:
            self.monitor.open_window()
        return False

    def after(self, step: Step) -> None:
        if step.i == self.last:
            self.monitor.close_window()

    def finish(self, steps_done: int) -> None:
        if self.first < steps_done <= self.last:  # stopped inside: it ends with the last step
            self.last = steps_done - 1
            self.monitor.close_window()

    def paused(self, what: str, i: int):
        """Leave work after step `i` out of the window while it is open."""
        return self.monitor.paused(what, self.first <= i < self.last)

    def power(self, steps_done: int, batch_size: int, share: tuple[int, int],
              tokens_per_sample: int | None) -> dict:
        """The `power` block: the window's steps, the samples this process is credited with
        (`share`: its devices of all, each measuring its own GPUs) and their tokens."""
        n = max(min(self.last, steps_done - 1) - self.first + 1, 0)
        samples = n * batch_size * share[0] // share[1]
        return self.monitor.result(n, samples, samples * tokens_per_sample
                                   if tokens_per_sample else None, first_step=self.first)


class Profiler(Hook):
    """A jax.profiler trace of steps `steps[0]`..`steps[1]` into `logdir`."""

    def __init__(self, steps: tuple[int, int], logdir: Path):
        self.steps, self.logdir = steps, logdir

    def before(self, i: int) -> bool:
        if i == self.steps[0]:
            jax.profiler.start_trace(str(self.logdir))
        return False

    def after(self, step: Step) -> None:
        if step.i == self.steps[1]:
            jax.profiler.stop_trace()

    def block(self) -> dict:
        """results["profile"]."""
        return {"steps": list(self.steps), "dir": str(Path(self.logdir) / "plugins")}


class StepLog(Hook):
    """Each step's loss and time to the run's writer (TensorBoard), warm-up steps apart."""

    def __init__(self, writer, timer):
        self.writer, self.timer, self.timed = writer, timer, False

    def before(self, i: int) -> bool:
        self.timed = not self.timer.in_warmup
        return False

    def after(self, step: Step) -> None:
        self.writer.step(step.i, step.loss, self.timer.last_s, self.timed)


class Progress(Hook):
    """A progress bar on stderr: the warm-up steps, then the timed ones counted from 0."""

    def __init__(self, label: str, first: int, warmup: int, timed_n: int, enabled: bool):
        self.label, self.warmup, self.warm_end, self.timed_n = (label, warmup, first + warmup,
                                                                timed_n)
        self.bar = tqdm(total=warmup or timed_n, unit="step", file=sys.stderr,
                        desc=f"{label} warm-up" if warmup else f"{label} timed",
                        disable=not enabled)

    def after(self, step: Step) -> None:
        self.bar.set_postfix(loss=f"{step.loss:.4f}", refresh=False)
        self.bar.update()
        if self.warmup and step.done == self.warm_end and self.timed_n:
            self.bar.refresh()  # the warm-up's last count, then the timed steps from 0
            self.bar.set_description(f"{self.label} timed", refresh=False)
            self.bar.reset(total=self.timed_n)

    def finish(self, steps_done: int) -> None:
        self.bar.close()


class Checkpointing(Hook):
    """A checkpoint when one is due (--checkpoint-every) and when the run stops early."""

    def __init__(self, ckpt, stream, window: Window):
        self.ckpt, self.stream, self.window = ckpt, stream, window

    def after(self, step: Step) -> None:
        if step.stopping or self.ckpt.due(step.done):
            with self.window.paused(f"checkpoint after step {step.i}", step.i):
                self.ckpt.save(step.done, step.state, self.stream.position)


class Evaluation(Hook):
    """Test-split accuracy every `every` steps and after the last, not after a stop;
    `accuracy` lists them (step, wall seconds since the loop began, accuracy)."""

    def __init__(self, program, dataset, job, total_steps: int, window: Window, writer):
        self.program, self.dataset, self.job, self.total = program, dataset, job, total_steps
        self.window, self.writer = window, writer
        self.accuracy: list[dict] = []
        self.started = time.perf_counter()

    def after(self, step: Step) -> None:
        every = self.job.data.eval_every
        if step.stopping or not every or (step.done % every and step.done != self.total):
            return
        with self.window.paused(f"evaluation after step {step.i}", step.i):
            self.accuracy.append({"step": step.done,
                                  "wall_s": time.perf_counter() - self.started,
                                  "accuracy": evaluate(self.program, step.state,
                                                       self.dataset, self.job)})
        self.writer.scalar("eval/accuracy", self.accuracy[-1]["accuracy"], step.done)


def evaluate(program, state, dataset, job) -> float:
    """Test-split accuracy; evaluation time is outside every timed step."""
    hits = 0.0
    devices = program.batch_sharding.mesh.devices.size
    for batch in eval_batches(dataset, job.train.batch_size, devices):
        hits += metrics.scalar(program.correct(state, put_batch(batch, program.batch_sharding)))
    return hits / len(dataset.test_y)


class Prediction(Hook):
    """The run's own prediction (jaxdist.predict.inrun): the plan of its job on its part,
    made at `finish`, once the timed steps are over and the window closed, so its compile
    (seconds on XLA:GPU) is never inside a timed step; `block(results)` puts it beside
    what the run measured."""

    def __init__(self, job, platform):
        self.job, self.platform, self.made = job, platform, None

    def finish(self, steps_done: int) -> None:
        from jaxdist.predict.inrun import OwnPrediction
        self.made = OwnPrediction.of(self.job, self.platform)

    def block(self, results: dict) -> dict:
        return self.made.to_json(self.platform, results)
