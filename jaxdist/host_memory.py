"""Host memory for runs on CPU devices. Their buffers are this host's RAM, so a train state
or a step larger than what the host has free is refused in one line before it is allocated:
otherwise the kernel's OOM killer SIGKILLs the run (nothing said, an empty run folder left:
gpt-tiny with vocab=100000000 on 8 simulated devices) or XLA raises RESOURCE_EXHAUSTED from
inside the loop with a traceback (a batch of 8,000,000 sequences: 532 GiB asked of 22).
GPU runs are not checked here: their memory is the device's, and a plan (`--dry-run
--hardware`) says whether a step fits it. Launchers that start processes on this host check
their count the same way (check_processes): each process holds at least the interpreter with
jax, so a count beyond the host's memory is refused before the first one starts."""

from __future__ import annotations

import math

from jaxdist.errors import UsageError

GIB = 2 ** 30


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), or None
    where there is no such file."""
    return _proc_kib("/proc/meminfo", "MemAvailable:")


def _proc_kib(path: str, field: str) -> int | None:
    """The `field` line of a /proc file (a figure in kB) in bytes, or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def state_bytes(abstract_state, shardings, devices) -> int:
    """Exact bytes the train state's shards take on `devices`, from shapes alone."""
    import jax

    local = set(devices)
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings),
                              strict=True):
        shard = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        total += shard * sum(d in local for d in sharding.device_set)
    return total


def check(need: int, what: str, devices: int | None = None,
          available: int | None = None) -> None:
    """UsageError when `need` bytes (of `what`, over `devices` CPU devices of this process;
    None: over the processes a job starts here) exceed what the host has available."""
    available = available_bytes() if available is None else available
    need = int(need)
    if available is not None and need > available:
        where, advice = ((f" on the {devices} CPU device(s) of this process",
                          "use a smaller model, batch or mesh (--microbatches), or plan it "
                          "with --dry-run --hardware PART, which allocates nothing")
                         if devices else ("", "use a smaller model or batch, or fewer "
                                              "processes"))
        raise UsageError(f"the {what} needs {need / GIB:.1f} GiB of host memory{where}, and "
                         f"{available / GIB:.1f} GiB is available: {advice}")


# Host memory per leaf of the state that a plan's shapes or a build's trace hold (abstract
# arrays of the parameters and optimizer state, their specs and shardings, the modules):
# a gpt-tiny shapes plan grew by 162 KB per block of 16 leaves (558 MB at depth 2,000,
# 1.53 GB at 8,000, measured as peak RSS). A floor: a build holds more.
TRACE_BYTES_PER_LEAF = 8 << 10


def check_model_size(model: str, dtype: str, model_cfg, dry_run: bool, cpu_run: bool,
                     available: int | None = None) -> None:
    """A decoder whose depth alone makes it larger than this host can hold, refused before
    it is built or traced (at depth 1,000,000,000 the kernel's OOM killer ended a plan at
    24 GB, with no message): its leaves' shapes for a plan, and for a run on CPU devices
    (`cpu_run`) its parameters' bytes too, from the depth-1 and depth-2 traces
    (jaxdist.state_shapes.stack_size). Other models are as large as their full build, and
    are checked after it (jaxdist.run_setup.check_host_memory)."""
    from jaxdist.state_shapes import stack_size

    size = stack_size(model_cfg, dtype)
    if size is None:
        return
    state_bytes, leaves = size
    need = leaves * TRACE_BYTES_PER_LEAF + (state_bytes if cpu_run and not dry_run else 0)
    available = available_bytes() if available is None else available
    if available is not None and need > available:
        what = ("its plan (the shapes of " if dry_run else
                "its build (the parameters and the shapes of " if cpu_run else
                "its build (the shapes of ")
        raise UsageError(
            f"--model {model} at depth {model_cfg.depth:,} needs about "
            f"{need / GIB:,.1f} GiB of host memory for {what}{leaves:,} arrays), and "
            f"{available / GIB:.1f} GiB is available: give a smaller depth in --model-opts")


# The least each process a launcher starts holds privately (not shared with other processes),
# read as RssAnon here: `import numpy, jax` alone 63 MiB, experiments.run 84 MiB once its
# input is validated, `import torch` 145 MiB. A floor, so a count refused here cannot run.
PROCESS_FLOOR_BYTES = 60 << 20


def private_bytes() -> int | None:
    """This process's private resident memory (RssAnon of /proc/self/status: the pages no
    other process shares, unlike the libraries' mapped files), or None."""
    return _proc_kib("/proc/self/status", "RssAnon:")


def check_processes(count: int, what: str, available: int | None = None,
                    each: int = PROCESS_FLOOR_BYTES) -> None:
    """UsageError when `count` processes (`what`: the flag that asks for them and what they
    run) cannot each hold `each` bytes in what the host has available. Not this process's
    own memory: a launcher called in a long-lived process (a test session, a notebook)
    holds far more than the processes it starts."""
    available = available_bytes() if available is None else available
    if available is not None and count * each > available:
        raise UsageError(
            f"{what}: {count} processes, each holding at least {each / 2 ** 20:.0f} MiB "
            f"(Python with jax or torch imported), {count * each / GIB:.1f} GiB in all, and "
            f"this host has {available / GIB:.1f} GiB available; start fewer")
