"""Per-step work the PS does not do: counted, never timed. The speed
targets themselves live in scripts/bench_ps.py."""

import threading
import time

import numpy as np

from ps.admission import WORKER_KEY, CallGate
from ps.shardmap import Leaf


class FakeContext:
    def __init__(self, worker: int):
        self.metadata = ((WORKER_KEY, str(worker)),)
        self.cancelled = threading.Event()

    def invocation_metadata(self):
        return self.metadata

    def cancel(self):
        self.cancelled.set()


def test_admitting_a_call_does_not_wake_the_deadline_thread():
    """A data call does not notify the reaper thread (that would be a thread switch per call
    on every shard); deadlines are admission + a constant, so a new one is not the earliest."""
    gate = CallGate(num_workers=2, deadline_s=30.0)
    time.sleep(0.05)                       # the reaper has started and is asleep
    gate.admit(FakeContext(0))             # the first deadline: the reaper must learn it
    time.sleep(0.05)
    before = gate.wakeups
    for i in range(200):
        _, release = gate.admit(FakeContext(i % 2))
        release()
    # it may still wake on its own 1 s tick while this runs, never once per call
    assert gate.wakeups - before <= 2


def test_a_call_past_its_deadline_is_still_cancelled():
    gate = CallGate(num_workers=1, deadline_s=0.2)
    time.sleep(0.05)
    context = FakeContext(0)
    gate.admit(context)                    # earliest deadline: the reaper is woken for it
    assert context.cancelled.wait(5.0)
    assert gate.open_calls() == [1]        # the handler releases its slot when it unwinds


def test_keep_freed_memory_is_set_once():
    from ps.allocator import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() == first
    try:
        import ctypes
        has_mallopt = hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        has_mallopt = False
    assert first == has_mallopt


def test_worker_step_takes_views_of_the_flat_vector():
    """The compiled step gets numpy views of the pulled vector, not a device_put copy of
    the tree first: no copy on the host, and the same values the device copy has."""
    from ps.worker import Program
    import jax

    program = Program.__new__(Program)
    program.leaves = [Leaf("a", (2, 3), "float32", 0, 6), Leaf("b", (4,), "float32", 6, 4)]
    program.treedef = jax.tree.structure({"a": 0, "b": 0})
    program.replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = np.arange(10, dtype=np.float32)
    views = program.views(flat)
    assert all(np.shares_memory(v, flat) for v in jax.tree.leaves(views))
    np.testing.assert_array_equal(views["a"], flat[:6].reshape(2, 3))
    on_device = program.params(flat)
    for v, d in zip(jax.tree.leaves(views), jax.tree.leaves(on_device)):
        np.testing.assert_array_equal(v, np.asarray(d))
