"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (SLURM's preemption / time limit).

The loop asks `should_stop(steps_done)` after every step; once it says yes, the loop saves a
checkpoint (with --checkpoint-dir), writes results with `"status": "interrupted"` and the
run exits 130 (SIGINT) or 143 (SIGTERM).

One process: Python handlers set a flag.

Several processes must stop on the same step, or one would wait forever in a collective the
others never enter. JAX's coordination service already solves this (the preemption sync
manager, `multihost_utils.reached_preemption_sync_point`): its C SIGTERM handler hears a
SIGTERM to any process, within ~1 s the service tells every process, they exchange the step
each has reached, and the call returns True on every process at the same step (the fastest
one's next). It listens only for SIGTERM, so here a SIGINT is turned into a SIGTERM to this
process. Every process must call it on every step from the same first step.

Before the first step there is no step to agree on, and the C handler would leave a signal
unheard until then (a build or an XLA compile takes minutes). So jaxdist.distributed starts
JAX's runtime with the preemption service off, the Python handlers stay through setup, and
`attach` starts the service once setup is done. A process that a signal stops in setup
posts it in the coordination service's key-value store; the others, polling it while they
wait (`run_abandonable`), stop with it.

A second SIGINT while stopping raises `HardStop` (a KeyboardInterrupt): no results are
written and the run directory is left as it is, unfinished.
"""

from __future__ import annotations

import os
import signal
import threading
import time

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
_early: list[str] = []  # signals caught by defer_signals() before a StopRequest existed


def defer_signals() -> None:
    """Record SIGINT/SIGTERM instead of acting on them, until a StopRequest is installed:
    for the seconds an entry point spends importing JAX, where a KeyboardInterrupt would be
    a traceback (or a crash at exit)."""
    def record(signum, frame):
        _early.append(signal.Signals(signum).name)
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, record)


def release_deferred() -> None:
    """Back to Python's usual handling (for entry points with no StopRequest); a signal
    recorded meanwhile is delivered now."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for signum, handler in defaults.items():
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)
    for name in _early:
        os.kill(os.getpid(), signal.Signals[name])
    _early.clear()


class HardStop(KeyboardInterrupt):
    """Ctrl-C pressed again while the run was stopping."""


class StopRequest:
    """Install it as early as possible (a KeyboardInterrupt raised inside JAX's C++ setup
    can leave the process to crash at exit); `attach(first_step)` once the run knows its
    first step and jax.distributed is up."""

    def __init__(self):
        self.signal: str | None = None  # what this process received (None: a peer's notice)
        self._sync = None
        self._previous: dict[int, object] = {}

    @property
    def synced(self) -> bool:
        """Stops are agreed with the other processes (JAX's preemption sync point)."""
        return self._sync is not None

    def install(self) -> "StopRequest":
        """Take over SIGINT and SIGTERM. Only the main thread may; elsewhere (a test calling
        the loop from a thread) the signals keep their usual meaning."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGINT, signal.SIGTERM):
            # An ignored signal stays ignored (a shell starts background jobs so, nohup-like).
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        if _early:
            self.signal = _early[0]
        return self

    def attach(self, first_step: int) -> "StopRequest":
        """On several processes, switch to JAX's preemption sync point: start JAX's
        preemption service, whose C SIGTERM handler replaces the Python one and must stay
        (SIGTERM is no longer restored). A signal that came before is passed on to it."""
        self._sync = _preemption_sync()
        if self._sync is None:
            return self
        self._previous.pop(signal.SIGTERM, None)
        self._sync(first_step)  # every process reports the same first step
        if self.signal is not None:
            os.kill(os.getpid(), signal.SIGTERM)
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


def _preemption_sync():
    """JAX's preemption sync point when this is a multi-process run (its service started
    here, once: jaxdist.distributed starts the runtime without it), else None."""
    from jax._src import distributed as jax_distributed  # where jax keeps the client

    state = jax_distributed.global_state
    if state.client is None:
        return None
    if state.preemption_sync_manager is None:
        with jax_distributed._ENABLE_PREEMPTION_SERVICE(True):
            state.initialize_preemption_sync_manager()
    from jax.experimental import multihost_utils
    return multihost_utils.reached_preemption_sync_point


# Where a process stopped in setup posts its signal for the others (the coordination
# service's key-value store), and where each acknowledges it.
SETUP_STOP_KEY = "jaxdist/setup_stop"


class _Peers:
    """The other processes of a multi-process run, as seen through JAX's coordination
    service during setup: None where this process runs alone."""

    def __init__(self, client, process_id: int, num_processes: int):
        self.client, self.pid, self.n = client, process_id, num_processes

    @classmethod
    def of_this_run(cls) -> "_Peers | None":
        from jax._src import distributed as jax_distributed

        state = jax_distributed.global_state
        if state.client is None or state.num_processes <= 1:
            return None
        return cls(state.client, state.process_id, state.num_processes)

    def posted(self) -> str | None:
        """The signal another process posted, or None."""
        try:
            return self.client.key_value_try_get(SETUP_STOP_KEY) or None
        except Exception:  # noqa: BLE001 - NOT_FOUND is the usual answer
            return None

    def post(self, signal_name: str, wait_s: float = 3.0) -> None:
        """Tell the others, and acknowledge; process 0, which hosts the service, waits
        (at most `wait_s`) until every process has read it before it may exit."""
        try:
            try:
                self.client.key_value_set(SETUP_STOP_KEY, signal_name)
            except Exception:  # noqa: BLE001 - another process posted first
                pass
            self.client.key_value_set(f"{SETUP_STOP_KEY}/seen/{self.pid}", "1")
            if self.pid == 0:
                deadline = time.monotonic() + wait_s
                for other in range(1, self.n):
                    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                    self.client.blocking_key_value_get(f"{SETUP_STOP_KEY}/seen/{other}",
                                                       left_ms)
        except Exception:  # noqa: BLE001 - a peer already gone: nothing more to tell
            pass


# What a run is doing before its first step (jaxdist.loop sets it): named by a stop then.
PHASE = {"phase": "starting", "steps_done": 0}


def set_phase(phase: str, steps_done: int | None = None) -> None:
    PHASE["phase"] = phase
    if steps_done is not None:
        PHASE["steps_done"] = steps_done


class StoppedInSetup(Exception):
    """A signal came while a run was still building, tracing or compiling (`phase`): the
    work was left running in its thread, so the caller must end the process (os._exit)
    rather than wait for it."""

    def __init__(self, signal_name: str, phase: str, steps_done: int):
        super().__init__(f"{signal_name} during {phase}")
        self.signal, self.phase, self.steps_done = signal_name, phase, steps_done


def run_abandonable(work, stop: "StopRequest", poll_s: float = 0.05, peer_poll_s: float = 0.25):
    """`work()`'s result, computed in a daemon thread while this (the main) thread waits in
    Python, where a signal handler runs at once: XLA's compile and Flax's build hold it in
    C++ or in a long trace for minutes. Once `stop` has a signal, or another process of
    the run posted one (_Peers), StoppedInSetup is raised here and the thread is left to
    the process's end. Runs `work()` in this thread where this is not the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    peers = _Peers.of_this_run()
    box: dict = {}

    def target():
        try:
            box["result"] = work()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            box["error"] = e

    thread = threading.Thread(target=target, name="jaxdist-setup", daemon=True)
    thread.start()
    asked = time.monotonic()
    while thread.is_alive():
        thread.join(poll_s)
        if not thread.is_alive():
            break
        name = stop.signal
        if name is None and peers is not None and time.monotonic() - asked >= peer_poll_s:
            asked = time.monotonic()
            name = peers.posted()
        if name is not None:
            if peers is not None:
                peers.post(name)
            raise StoppedInSetup(name, PHASE["phase"], PHASE["steps_done"])
    if "error" in box:
        raise box["error"]
    return box["result"]
