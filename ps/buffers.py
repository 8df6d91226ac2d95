"""Gradient buffers a shard receives pushes into, reused: a fresh array per push means
page-faulting the whole shard every time (~1 s per 400 MB here). Not locked: ps.core calls
it under its own lock."""

from __future__ import annotations

import numpy as np


class GradientBuffers:
    def __init__(self, size: int, keep: int):
        self.size, self.keep = size, keep   # keep at most one per worker plus a spare
        self._free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        """A float32 buffer of the shard's size."""
        return self._free.pop() if self._free else np.empty(self.size, np.float32)

    def give(self, buf: np.ndarray, held=()) -> None:
        """Keep `buf` for reuse unless it is in `held` (still in use) or already kept."""
        if len(self._free) <= self.keep and not any(buf is b for b in [*held, *self._free]):
            self._free.append(buf)
