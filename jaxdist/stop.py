"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (SLURM's preemption / time limit).

The loop asks `should_stop(steps_done)` after every step; once it says yes, the loop saves a
checkpoint (with --checkpoint-dir), writes results with `"status": "interrupted"` and the
run exits 130 (SIGINT) or 143 (SIGTERM).

One process: Python handlers set a flag.

Several processes must stop on the same step, or one would wait forever in a collective the
others never enter. JAX's coordination service already solves this (the preemption sync
manager, `multihost_utils.reached_preemption_sync_point`): `jax.distributed.initialize`
installs a C SIGTERM handler; within ~1 s of a SIGTERM to any process the service tells every
process, they exchange the step each has reached, and the call returns True on every process
at the same step (the fastest one's next). It listens only for SIGTERM, so here a SIGINT is
turned into a SIGTERM to this process; a Python SIGTERM handler would replace the C one, so
none is installed. Every process must call it on every step from the same first step.

A second SIGINT while stopping raises `HardStop` (a KeyboardInterrupt): no results are
written and the run directory is left as it is, unfinished.
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class HardStop(KeyboardInterrupt):
    """Ctrl-C pressed again while the run was stopping."""


class StopRequest:
    def __init__(self):
        self.signal: str | None = None  # what this process received (None: a peer's notice)
        self._sync = _preemption_sync()
        self._previous: dict[int, object] = {}

    @property
    def synced(self) -> bool:
        """Stops are agreed with the other processes (JAX's preemption sync point)."""
        return self._sync is not None

    def install(self, first_step: int) -> "StopRequest":
        """Take over SIGINT (and SIGTERM on one process). Only the main thread may; elsewhere
        (a test calling the loop from a thread) the signals keep their usual meaning."""
        if threading.current_thread() is not threading.main_thread():
            return self
        if self._sync is not None:
            self._sync(first_step)  # every process reports the same first step
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        if self._sync is None:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal == "SIGINT" and signum == signal.SIGINT:
            raise HardStop()
        self.signal = self.signal or name
        if self._sync is not None and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # the preemption notifier's signal

    def should_stop(self, steps_done: int) -> bool:
        """Whether to stop now, `steps_done` counting every step run so far (warm-up too)."""
        if self._sync is not None:
            return self._sync(steps_done)
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        # A process stopped by a peer's notice was, in effect, sent SIGTERM.
        return EXIT_CODES.get(self.signal or "SIGTERM", 143)


def _preemption_sync():
    """JAX's preemption sync point when this is a multi-process run with the preemption
    service on, else None."""
    from jax._src import distributed as jax_distributed  # where jax keeps the client

    state = jax_distributed.global_state
    if state.client is None or state.preemption_sync_manager is None:
        return None
    from jax.experimental import multihost_utils
    return multihost_utils.reached_preemption_sync_point
