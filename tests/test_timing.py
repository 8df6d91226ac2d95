"""StepTimer and timed with a scripted clock: exact latencies, the warm-up split, the timed
window, and the wait for outputs (block_until_ready) inside the timed interval."""

import jax.numpy as jnp
import pytest

from jaxdist import timing
from jaxdist.timing import StepTimer, timed


class ScriptedClock:
    """Stands in for the `time` module: perf_counter and time advance only when told."""

    def __init__(self):
        self.now = 100.0
        self.wall = 1_700_000_000.0

    def perf_counter(self):
        return self.now

    def time(self):
        return self.wall + self.now

    def advance(self, seconds):
        self.now += seconds


class Pending:
    """An output that is not ready until waited on: waiting takes `seconds`."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.waited = clock, seconds, False

    def block_until_ready(self):
        self.clock.advance(self.seconds)
        self.waited = True
        return self


@pytest.fixture
def clock(monkeypatch):
    c = ScriptedClock()
    monkeypatch.setattr(timing, "time", c)
    return c


def test_warmup_steps_are_recorded_apart(clock):
    timer = StepTimer(warmup=2)
    durations = [5.0, 3.0, 0.25, 0.5, 0.75]

    def step(seconds):
        clock.advance(seconds)  # dispatch work
        return jnp.zeros(())

    assert timer.in_warmup
    for i, d in enumerate(durations):
        out, elapsed = timer.run(step, d)
        assert elapsed == d and float(out) == 0.0
        assert timer.in_warmup == (i < 1)
    assert timer.warmup_s == [5.0, 3.0]
    assert timer.timed_s == [0.25, 0.5, 0.75]
    # The window runs from the start of the first timed step to the end of the last.
    assert timer.window_start == clock.wall + 100.0 + 8.0
    assert timer.window_end == clock.wall + 100.0 + 9.5


def test_no_warmup_times_every_step(clock):
    timer = StepTimer(warmup=0)
    assert not timer.in_warmup
    timer.run(lambda: clock.advance(2.0))
    assert timer.warmup_s == [] and timer.timed_s == [2.0]
    assert timer.window_start == clock.wall + 100.0


def test_waiting_for_outputs_is_inside_the_step(clock):
    """JAX dispatch returns before the work is done: the timer must include the wait."""
    timer = StepTimer(warmup=0)
    pending = Pending(clock, 1.5)

    def step():
        clock.advance(0.01)  # dispatch only
        return {"state": pending, "loss": jnp.ones(())}

    out, elapsed = timer.run(step)
    assert pending.waited and out["state"] is pending
    assert elapsed == pytest.approx(1.51)
    assert timer.timed_s == [pytest.approx(1.51)]


def test_timed_returns_result_and_seconds(clock):
    def compile_it(x):
        clock.advance(4.0)
        return x * 2

    assert timed(compile_it, 21) == (42, 4.0)
