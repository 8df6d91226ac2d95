"""Which devices a run gets: real accelerators, or a mesh simulated on host CPU devices.

`configure_host_devices` must run before anything touches a JAX backend: the CPU device
count cannot change once a backend exists.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape

_FORCE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclass(frozen=True)
class Platform:
    backend: str          # "gpu", "tpu" or "cpu"
    simulated: bool       # True: the mesh lives on host CPU devices, timings are not performance
    devices: tuple        # every device of the run, all processes
    shape: MeshShape      # the mesh with -1 resolved

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind


# XLA GPU flags for compute/communication overlap (the "overlap" runs of Go et al.): the
# latency-hiding scheduler and the high-priority collective stream, as MaxText's and
# JAX-Toolbox's GPU recipes set them. A pipeline adds one: two collectives in flight at once,
# so a stage send rides beside an operation that holds tensor-parallel collectives (XLA's
# default of one schedules the send after it).
OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
                 "--xla_gpu_enable_highest_priority_async_stream=true")
PIPELINE_OVERLAP_FLAGS = "--xla_gpu_experimental_parallel_collective_overlap_limit=2"


_NVIDIA_DRIVER = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def cuda_plugin_installed() -> bool:
    """jax's CUDA plugin (jax[cuda12]: XLA:GPU, with or without a GPU) is installed. Its
    namespace package is looked up first: find_spec of a submodule imports its parent, and
    raises where there is none (a venv of `make run`, without the GPU compiler)."""
    import importlib.util

    return importlib.util.find_spec("jax_plugins") is not None and \
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def decide_platform() -> str | None:
    """The one place that decides whether JAX may start its GPU backend. With the jax-cuda12
    plugin installed (for XLA:GPU compiles without a device) but no NVIDIA driver, the plugin
    would fail at start-up and print a traceback before falling back to CPU: JAX_PLATFORMS is
    then set to cpu (the CUDA topology for device-less compiles works beside it). A
    JAX_PLATFORMS the user set, or a machine with a driver, is left alone. Returns what it
    set, or None."""
    if os.environ.get("JAX_PLATFORMS") or any(os.path.exists(p) for p in _NVIDIA_DRIVER):
        return None
    if not cuda_plugin_installed():
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"


def configure_xla_flags(extra: str, overlap: bool, pipelined: bool = False) -> str:
    """Append the user's flags (and the overlap set, a pipeline's included) to XLA_FLAGS
    before any backend starts (checked by check_xla_flags in the validation pass,
    experiments/validation.py). Returns the flags added."""
    overlap_flags = (f"{OVERLAP_FLAGS} {PIPELINE_OVERLAP_FLAGS}" if pipelined else
                     OVERLAP_FLAGS) if overlap else ""
    added = " ".join(f for f in (extra.strip(), overlap_flags) if f)
    if added:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {added}".strip()
    return added


def check_xla_flags(flags: str) -> None:
    """XLA aborts the whole process on an unknown flag; try the flags in a child first so a
    typo is a one-line error instead."""
    import subprocess
    import sys

    # A small compile too: some values pass the flag parser and abort XLA's codegen
    # (--xla_cpu_parallel_codegen_split_count=-5: std::length_error, an empty run folder).
    probe = subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; "
                            "jax.jit(lambda x: jnp.tanh(x @ x) + 1)(jnp.ones((8, 8)))"
                            ".block_until_ready()"],
                           env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        raise UsageError(f"--xla-flags rejected by XLA: {xla_flag_problem(probe.stderr)}")


def xla_flag_problem(stderr: str) -> str:
    """What XLA said of its flags as it aborted, in one line: the unknown flags, a value it
    could not read with the type the flag takes (the tail of its stderr was a line of XLA's
    flag listing), a C++ exception it aborted on, else its first logged error."""
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", stderr)
    if unknown:
        return unknown.group(1).strip()
    value = re.search(r"Couldn't interpret value (.*) for flag (\w+)\.", stderr)
    if value:
        text, flag = value.groups()
        kind = re.search(rf"^\s*--{flag}=\S*\s+(\w+)", stderr, re.M)
        return f"--{flag} takes {kind.group(1) + ' values' if kind else 'another value'}, " \
               f"not {text!r}"
    aborted = re.search(r"terminate called after throwing an instance of '([^']+)'\s+what\(\):"
                        r"\s*(.*)", stderr)
    if aborted:
        return f"XLA aborted compiling a small program with them ({aborted.group(1)}: " \
               f"{aborted.group(2).strip()})"
    logged = re.search(r"^[EF]\d{4} [\d:.]+\s+\d+ \S+\] (.+)$", stderr, re.M)
    lines = stderr.strip().splitlines()
    return logged.group(1).strip() if logged else (lines[-1][:200] if lines else "no message")


def configure_host_devices(shape: MeshShape, platform: str, num_processes: int = 1) -> None:
    """Before backend init: force CPU if asked, and give the CPU backend one device per mesh
    slot (split evenly over the processes) so that, without an accelerator, the mesh can be
    simulated."""
    import jax

    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    if _FORCE_FLAG.search(os.environ.get("XLA_FLAGS", "")):
        return  # the user chose a count explicitly; a mismatch is reported by select_devices
    if shape.size is not None:
        check_split(shape, num_processes)
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return  # chosen already by an in-process caller; select_devices checks the count
        jax.config.update("jax_num_cpu_devices", shape.size // num_processes)


# XLA's CPU client (jax 0.10.2) runs a program over at most this many devices of one
# process: over 2,049 simulated devices the first program failed with "Multiprocess
# computations aren't implemented on the CPU backend" (measured; 2,048 runs).
CPU_DEVICES_PER_PROCESS = 2048


def check_simulated_count(shape: MeshShape, num_processes: int) -> None:
    """A run's mesh has at most CPU_DEVICES_PER_PROCESS devices in each process (a plan for
    more compiles with XLA:GPU, which needs no device: jaxdist.program.compiled.for_part)."""
    if shape.size is not None and shape.size // num_processes > CPU_DEVICES_PER_PROCESS:
        raise UsageError(
            f"mesh {shape.label} puts {shape.size // num_processes} devices in one process; "
            f"XLA's CPU backend runs at most {CPU_DEVICES_PER_PROCESS} there: plan it with "
            f"--dry-run --hardware PART, which runs nothing")


def check_split(shape: MeshShape, num_processes: int) -> None:
    """The mesh's devices split evenly over the processes (each holds the same count)."""
    if shape.size is not None and shape.size % num_processes:
        raise UsageError(f"mesh {shape.label} ({shape.size} devices) does not split evenly "
                         f"over {num_processes} processes")


def select_devices(shape: MeshShape) -> Platform:
    import jax

    devices = tuple(jax.devices())
    backend = jax.default_backend()
    resolved = shape.resolve(len(devices))
    if resolved.size != len(devices):
        where = (f"{len(devices)} {backend} devices are present" if backend != "cpu" else
                 f"{len(devices)} simulated CPU devices are present (XLA_FLAGS sets "
                 f"--xla_force_host_platform_device_count)")
        raise UsageError(f"mesh {shape.label} needs {resolved.size} devices but {where}; "
                         f"use a mesh of {len(devices)} devices (e.g. --mesh {len(devices)} "
                         f"or --mesh -1)")
    return Platform(backend=backend, simulated=backend == "cpu", devices=devices,
                    shape=resolved)


def env_info(platform: Platform) -> dict:
    """The run's environment; `hosts_per_axis`: how each mesh axis lies over the processes
    (jaxdist.mesh.axis_spread: members of a group in one process x processes it spans)."""
    import jax
    import numpy as np

    from jaxdist.mesh import axis_spread, hybrid_device_array

    return {
        "jax_version": jax.__version__,
        "backend": platform.backend,
        "device_kind": platform.device_kind,
        "num_devices": len(platform.devices),
        "num_processes": jax.process_count(),
        "simulated": platform.simulated,
        "hosts_per_axis": axis_spread(platform.shape.axis_sizes, np.vectorize(
            lambda d: d.process_index, otypes=[int])(hybrid_device_array(platform.shape,
                                                                         platform.devices))),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
