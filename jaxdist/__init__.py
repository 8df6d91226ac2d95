"""jaxdist runtime: config, devices and mesh, train step, loop, metrics, writers."""

import gc as _gc

from jaxdist.devices import decide_platform as _decide_platform

# Before anything imports jax: on a machine without an NVIDIA driver the GPU plugin (installed
# for its compiler) must not try to start, or every process prints its cuInit traceback.
_decide_platform()

# A jaxdist process (a run, a PS shard or worker, a plan) makes most of its objects once and
# keeps them: jax and flax imported, the step traced, lowered and compiled. At CPython's
# default thresholds (700, 10, 10) the cyclic collector walks that growing heap again every
# few thousand allocations: 8.4-9.4 s of a pytest worker's 107 s of tracing and compiling,
# and 0.3 s of the 3.3 s of CPU importing jax, flax, optax and tensorboardX; at 10,000
# for the youngest generation, 3.8-4.1 s of the 107 (2 of them pytest's own collections at
# its end).
# Garbage that is not a cycle is freed at once by reference counting either way.
if 0 < _gc.get_threshold()[0] < 10_000:  # kept: a threshold raised, or 0 (disabled)
    _gc.set_threshold(10_000, *_gc.get_threshold()[1:])
