"""The one place a lowered program is compiled: `compile_with` (XLA's options, and for a
device-less XLA:GPU compile the buffer live ranges read from a dump, jaxdist.program.liveness),
`compile_timed` and `compile_lowered` (several side by side), and the count of compiles a
process has run. Runs, plans, the parameter server's workers and shards, and the
micro-batch FLOPs count all compile here; jaxdist.program.compiled chooses the target and builds
the step for it."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from jaxdist.program import liveness

COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))
_COMPILES = [0]  # XLA compiles run by this process (compile_lowered's)
_COMPILES_LOCK = threading.Lock()


def compiles_run() -> int:
    """How many programs compile_lowered has handed to XLA in this process so far."""
    return _COMPILES[0]


def compile_with(lowered, options: dict | None):
    """`lowered.compile(options)`, and for a device-less XLA:GPU compile its buffer live
    ranges read from a dump into a folder made and removed here (jaxdist.program.liveness)."""
    # The program's own options (jit compiler_options, e.g. jaxdist/update.py
    # overlap_options) win over a plan's defaults, as they win over XLA_FLAGS in a run; JAX
    # itself lets the options given here win.
    if options:
        options = {**options, **dict(getattr(getattr(lowered, "_lowering", None),
                                             "_compiler_options_kvs", ()))}
    if not dumps_liveness(options):
        return lowered.compile(options) if options else lowered.compile()
    folder = tempfile.mkdtemp(prefix="jaxdist-xla-buffers-")
    try:
        compiled = lowered.compile({**options, **liveness.dump_options(folder)})
        liveness.remember(compiled, liveness.read_dump(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return compiled


def dumps_liveness(options: dict | None) -> bool:
    """Whether a compile with these options also reads XLA's buffer live ranges
    (jaxdist.program.liveness): device-less XLA:GPU compiles (the ones with the kernel cache),
    unless the user's --xla-flags already dump somewhere of their own."""
    return bool(options) and "xla_gpu_kernel_cache_file" in options and \
        "xla_dump_to" not in options


def compile_lowered(lowered: list, options: dict | None = None) -> list[tuple]:
    """[(compiled, seconds)] of lowered programs, or of callables that lower one (called here
    in order; one that returns None is skipped and gives (None, 0.0)), compiled side by side
    in threads: XLA's compile releases the GIL and is mostly single-threaded, so on two cores
    two programs take about the time of one, and a program is lowered (Python) while the one
    before it compiles. An XLA error is raised as XLA's own message."""
    from concurrent.futures import ThreadPoolExecutor

    def get(item):
        return item() if callable(item) else item

    def compile_one(low):
        if low is None:  # the caller already has this program's figures
            return None, 0.0
        with _COMPILES_LOCK:
            _COMPILES[0] += 1
        start = time.perf_counter()
        compiled = compile_with(low, options)
        return compiled, time.perf_counter() - start

    if len(lowered) <= 1:
        return [compile_one(get(item)) for item in lowered]
    with ThreadPoolExecutor(max_workers=min(len(lowered), COMPILE_THREADS)) as pool:
        first = pool.submit(compile_one, get(lowered[0]))
        if options and "xla_gpu_kernel_cache_file" in options:
            # the others (a deeper decoder, the other pipeline ops) start once the first is
            # compiled, to find most of their kernels in the cache instead of compiling them
            # twice; they are lowered meanwhile
            rest = [get(item) for item in lowered[1:]]
            first.result()
            rest = [pool.submit(compile_one, low) for low in rest]
        else:
            rest = [pool.submit(compile_one, get(item)) for item in lowered[1:]]
        return [first.result()] + [f.result() for f in rest]


def compile_timed(lowerable, *args, options: dict | None = None):
    """(compiled, seconds) of `lowerable.lower(*args).compile(options)`; an XLA error is
    re-raised as XLA's own message, never replaced by another compiler's figures."""
    start = time.perf_counter()
    compiled = compile_with(lowerable.lower(*args), options)
    return compiled, time.perf_counter() - start
