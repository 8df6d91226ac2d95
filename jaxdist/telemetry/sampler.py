"""The background sampling thread and the time series it fills.

One thread polls every GPU of this process every `interval_s` (Go et al. used 50 ms). The
training loop also calls `poll()` itself at window boundaries, so a window always has a
sample at each edge; a lock keeps the two callers from interleaving. The thread never dies of
an error: NVML errors (and anything else a read raises) go to `errors` with the time, and the
next tick samples again.

pynvml calls go through ctypes, which releases the GIL during the driver call, so the
thread costs the training loop little beyond its own Python work (~tens of µs a tick).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from jaxdist.telemetry.nvml import METRICS

MAX_ERRORS = 200       # kept verbatim; the rest are only counted
RAPL_EVERY_S = 1.0     # far below the fastest RAPL wrap (~20 min), far above its cost
STOP_POLL_S = 0.1      # longest single sleep, so stop() is noticed within 100 ms


class Series:
    """Column store for one GPU: timestamps plus one list per metric (None = not read)."""

    def __init__(self):
        self.t: list[float] = []
        self.cols: dict[str, list] = {m: [] for m in METRICS}

    def append(self, t: float, values: dict) -> None:
        self.t.append(t)
        for m, col in self.cols.items():
            col.append(values.get(m))

    def arrays(self, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        out = {"t": np.asarray(self.t[lo:hi], dtype=np.float64)}
        for m, col in self.cols.items():
            out[m] = np.array([np.nan if v is None else v for v in col[lo:hi]],
                              dtype=np.float64)
        return out


class Sampler:
    def __init__(self, backend, devices, interval_s: float, clock: Callable[[], float],
                 rapl=None):
        self.backend = backend
        self.devices = devices
        self.interval_s = interval_s
        self.clock = clock
        self.rapl = rapl
        self.series = {d.index: Series() for d in devices}
        self.errors: list[dict] = []
        self.errors_total = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rapl_due = 0.0
        self.cpu_s: float | None = None  # thread CPU time, set while the thread runs

    def record_error(self, gpu: int | None, where: str, message: str) -> None:
        self.errors_total += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"t": self.clock(), "gpu": gpu, "where": where,
                                "message": message})

    def poll(self) -> None:
        """One sample of every GPU, stamped at the middle of its reads."""
        with self.lock:
            for dev in self.devices:
                t0 = self.clock()
                try:
                    values, errors = self.backend.read(dev)
                except Exception as e:  # noqa: BLE001 - a sampler must outlive any error
                    self.record_error(dev.index, "read", f"{type(e).__name__}: {e}")
                    continue
                self.series[dev.index].append((t0 + self.clock()) / 2, values)
                for where, message in errors:
                    self.record_error(dev.index, where, message)
            if self.rapl is not None and time.monotonic() >= self._rapl_due:
                self._rapl_due = time.monotonic() + RAPL_EVERY_S
                self.rapl.update()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="power-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Ticks on the monotonic clock; a late tick is not made up (no bursts after a stall).
        # time.sleep is one syscall per tick, Event.wait(timeout) about twice the CPU; the
        # price is that stop() waits up to STOP_POLL_S for the thread to notice.
        due = time.monotonic()
        while not self._stop.is_set():
            due += self.interval_s
            now = time.monotonic()
            if due < now:
                due = now
            while now < due and not self._stop.is_set():
                time.sleep(min(due - now, STOP_POLL_S))
                now = time.monotonic()
            if self._stop.is_set():
                break
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001
                self.record_error(None, "poll", f"{type(e).__name__}: {e}")
            # CPU seconds this thread has used: the telemetry's own cost, free of the noise
            # that makes a 1% step-time difference hard to see.
            self.cpu_s = time.thread_time()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # a driver call hung; the daemon thread is abandoned
                self.record_error(None, "stop", f"sampler did not stop within {timeout_s} s")
