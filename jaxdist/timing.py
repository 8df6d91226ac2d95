"""The one object that decides what "step time" means.

A step is timed from dispatch until every output is ready on the local devices
(`block_until_ready`); JAX dispatch is asynchronous, so without that block the clock would
stop before the work is done. The first `warmup` steps are recorded apart and excluded from
the statistics; compilation is timed separately, before any step.
"""

from __future__ import annotations

import time

import jax


class StepTimer:
    def __init__(self, warmup: int):
        self.warmup = warmup
        self.warmup_s: list[float] = []
        self.timed_s: list[float] = []
        self.window_start: float | None = None  # wall clock when the first timed step began
        self.window_end: float | None = None    # wall clock when the last timed step ended
        self.last_s: float | None = None        # the latest step's seconds

    @property
    def in_warmup(self) -> bool:
        return len(self.warmup_s) < self.warmup

    def run(self, fn, *args):
        """Call `fn(*args)`, wait for its outputs, record the latency; returns the outputs."""
        warm = self.in_warmup
        if not warm and self.window_start is None:
            self.window_start = time.time()
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        elapsed = time.perf_counter() - start
        (self.warmup_s if warm else self.timed_s).append(elapsed)
        self.last_s = elapsed
        if not warm:
            self.window_end = time.time()
        return out, elapsed


def timed(fn, *args):
    """(result, seconds) of a blocking call, e.g. compilation."""
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start
