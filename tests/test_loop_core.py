"""The loop's core (jaxdist.loop.run_steps): the hooks nest around each step, a hook can end
the loop before a step, the stop protocol ends it after one; on plain Python steps."""

from __future__ import annotations

from jaxdist.loop import run_steps
from jaxdist.loop_hooks import Hook, StopProtocol


class Recorder(Hook):
    def __init__(self, name: str, events: list, end_before: int | None = None):
        self.name, self.events, self.end_before = name, events, end_before

    def before(self, i: int) -> bool:
        self.events.append(f"{self.name}.before({i})")
        return i == self.end_before

    def after(self, step) -> None:
        self.events.append(f"{self.name}.after({step.i}, loss={step.loss})")

    def finish(self, steps_done: int) -> None:
        self.events.append(f"{self.name}.finish({steps_done})")


def counting_step(state, batch):
    """state + batch, its loss the new state."""
    return state + batch, float(state + batch)


def test_hooks_nest_around_each_step():
    events: list[str] = []
    state, losses = run_steps(counting_step, 10, lambda: 1, range(2, 4),
                              [Recorder("outer", events), Recorder("inner", events)])
    assert (state, losses) == (12, [11.0, 12.0])
    assert events == ["outer.before(2)", "inner.before(2)",
                      "inner.after(2, loss=11.0)", "outer.after(2, loss=11.0)",
                      "outer.before(3)", "inner.before(3)",
                      "inner.after(3, loss=12.0)", "outer.after(3, loss=12.0)",
                      "inner.finish(4)", "outer.finish(4)"]


def test_a_hook_ends_the_loop_before_a_step_and_later_hooks_are_not_asked():
    events: list[str] = []
    state, losses = run_steps(counting_step, 0, lambda: 1, range(5),
                              [Recorder("outer", events, end_before=1),
                               Recorder("inner", events)])
    assert (state, losses) == (1, [1.0])
    assert events[-3:] == ["outer.before(1)", "inner.finish(1)", "outer.finish(1)"]


class FakeStop:
    """A StopRequest whose signal arrives once `at` steps are done (and before any with 0)."""
    synced = False

    def __init__(self, at: int):
        self.at, self.signal = at, "SIGINT" if at == 0 else None

    def should_stop(self, steps_done: int) -> bool:
        if steps_done >= self.at:
            self.signal = "SIGINT"
        return self.signal is not None


def test_the_stop_protocol_ends_after_the_step_it_came_in_and_records_it():
    events: list[str] = []
    stopper = StopProtocol(FakeStop(3), 1, 6)
    # Steps 1..5 of 6 planned; the signal comes once 3 are done (after step 2).
    _, losses = run_steps(counting_step, 0, lambda: 1, range(1, 6),
                          [Recorder("saving", events), stopper])
    assert losses == [1.0, 2.0]
    assert events[-2:] == ["saving.after(2, loss=2.0)", "saving.finish(3)"]
    assert stopper.interrupted(3, timed_steps=1) == {
        "signal": "SIGINT", "received_here": True, "steps_planned": 6, "timed_steps": 1}
    # A signal before the first step: none runs; one on the last step is no interruption.
    assert run_steps(counting_step, 0, lambda: 1, range(1, 6),
                     [StopProtocol(FakeStop(0), 1, 6)]) == (0, [])
    last = StopProtocol(FakeStop(6), 0, 6)
    assert run_steps(counting_step, 0, lambda: 1, range(6), [last])[1][-1] == 6.0
    assert last.interrupted(6, timed_steps=6) is None
