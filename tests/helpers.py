"""Shared test helpers: run the step for a few iterations, read TensorBoard files back,
call the CLI in this process (bad input) or as a child process (what a process is for)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from analysis.runs import read_scalars  # noqa: F401 - the tests read events as analysis does
from jaxdist.data import TrainStream
from jaxdist.loop import run_steps
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import get_model
from sharding import get_layout

ROOT = Path(__file__).resolve().parent.parent


def train(model: str, layout: str, shape: MeshShape, steps: int = 3, optimizer="adamw",
          batch_size: int = 16, seed: int = 0, dtype="float32", microbatches: int = 1,
          distributed_optimizer: bool = False, grad_reduce_dtype: str = "float32",
          **model_opts):
    """(losses, final state, program) of `steps` steps on the first shape.size devices, run
    by the loop's core (jaxdist.loop.run_steps) with no hooks."""
    devices = jax.devices()[: shape.size]
    mesh = build_mesh(shape, devices)
    cfg = get_model(model, {k: str(v) for k, v in model_opts.items()})
    program = build_program(cfg, dtype, make_optimizer(optimizer, 1e-2),
                            get_layout(layout, distributed_optimizer, grad_reduce_dtype), mesh,
                            seed, microbatches)
    stream = TrainStream(cfg, None, batch_size, seed)
    state, losses = run_steps(program.step, program.init(),
                              lambda: put_batch(stream.next(), program.batch_sharding),
                              range(steps))
    return np.array(losses), state, program


_REFERENCES: dict = {}


def reference_losses(model: str, steps: int = 3, **opts) -> np.ndarray:
    """The losses of train(model, "ddp", one device, steps, **opts): the single-device
    reference of the equivalence tests, trained once per process for each (model, steps,
    options) (the tests that share one sit in one xdist group)."""
    key = (model, steps, tuple(sorted(opts.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = train(model, "ddp", MeshShape(1), steps=steps, **opts)[0]
    return _REFERENCES[key].copy()


# The persistent compilation cache of the session's child processes (conftest says why not
# the xdist workers'): at -O0 most compiles take under a second, so every one is kept.
CHILD_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(os.environ["JAXDIST_TEST_SESSION_DIR"], "jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30),  # > 0: entries are file-locked
}


def child_env(xla_flags: str = "", **extra: str) -> dict:
    """The environment of a process a test starts: the session's (conftest: fast XLA flags,
    CPU only, the kernel cache), the children's compilation cache, this checkout on
    PYTHONPATH, `xla_flags` appended to XLA_FLAGS, and `extra` variables."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **CHILD_CACHE_ENV, **extra)
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300, xla_flags: str = ""):
    """`python -m experiments.run ARGS --no-progress` in a child process (the real binary:
    for what a process is the point of; bad input is checked in-process, cli_main)."""
    return subprocess.run([sys.executable, "-m", "experiments.run", *args, "--no-progress"],
                          cwd=cwd or ROOT, env=child_env(xla_flags), capture_output=True,
                          text=True, timeout=timeout)


HEAVY_MODULES = ("flax", "jax")


def run_refusing_script(script: Path, argv: list, timeout: int = 120):
    """`python SCRIPT ARGV` (run as __main__ in a child) for bad input, which is refused before
    the heavy imports: the child then prints on stdout which of HEAVY_MODULES it had imported
    (`[]` when none), after whatever the script printed."""
    code = (f"import runpy, sys\nsys.argv = [{str(script)!r}, *{list(argv)!r}]\ntry:\n"
            f"    runpy.run_path({str(script)!r}, run_name='__main__')\nfinally:\n"
            f"    print([m for m in {HEAVY_MODULES!r} if m in sys.modules])")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class Exit:
    """What an in-process `main(argv)` returned and printed, shaped like a finished process."""
    returncode: int
    stdout: str
    stderr: str


def cli_main(capsys, *args: str) -> Exit:
    """`experiments.run.main([*args, "--no-progress"])` in this process, with what it printed
    (argparse's exit 2 included). For bad input and CLI behaviour: no process start, no
    second import of jax."""
    from experiments.run import main

    capsys.readouterr()
    try:
        code = main([*args, "--no-progress"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return Exit(code, out, err)


@dataclass(frozen=True)
class FakeGPU:
    """A device of a multi-host GPU cluster as jax lists it (id, host), for device-order tests."""
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"


def avg_power_tolerance(power: dict) -> float:
    """The relative tolerance of a power block's total `avg_w` against a steady fake GPU: a
    window of 1 s or more takes its energy from the counter, which advances every 100 ms
    (fake.FakeGPU.counter_period_s, as NVML's), so it is good to one update over the window
    (docs/power.md: 6.7% of a 1.5-s window, which a loaded host's 30-40 steps can last);
    a shorter window's energy is the samples' integral, good to 5%."""
    if power["energy_source"] == "counter":
        return 0.1 / power["window"]["duration_s"] + 0.01
    return 0.05


def job_of(cfg, shape: MeshShape | None = None):
    """The resolved job (jaxdist.job) of a config the test built by hand, on `shape` (its
    own --mesh by default): what experiments.validation.validate returns, without the
    run-level checks (a test's config is valid by construction)."""
    from jaxdist import job
    from jaxdist.hardware import get_hardware
    from jaxdist.mesh import parse_mesh

    part = (get_hardware(cfg.output.hardware, cfg.output.gpus_per_node)
            if cfg.output.hardware else None)
    return job.resolve(cfg, job.kind_of(cfg), shape or parse_mesh(cfg.mesh.mesh), part)


def run_loop(cfg, platform, logdir, **kwargs) -> dict:
    """jaxdist.loop.run of a hand-built config on `platform`'s devices."""
    from jaxdist import loop

    return loop.run(job_of(cfg, platform.shape), platform, logdir, **kwargs)


class PeerThread(threading.Thread):
    """A hostile peer a test runs beside a real run: `_run` does the attack; an exception it
    raises is kept in `error` for the test to report, not lost in the thread."""

    def __init__(self):
        super().__init__(daemon=True)
        self.error = None

    def run(self):
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _run(self):
        raise NotImplementedError


def time_terms_read(stdout: str, plan: dict) -> dict[str, float]:
    """The plan's time line parsed: jaxdist.predict.time_model.TIME_TERMS in their order, in
    ms, checked to add up to the printed step and to agree with plan.json's `time.terms`
    (every plan kind reads its time in this one vocabulary)."""
    import re

    from jaxdist.plan_words import TIME_TERMS

    pattern = (r"\n\s+compute ([\d.]+) ms \+ memory-bound kernels ([\d.]+) ms \+ launches "
               r"([\d.]+ ms|not modelled) \+ exposed communication intra-node ([\d.]+) ms "
               r"\(of [\d.]+\), inter-node ([\d.]+) ms \(of [\d.]+\) \+ bubble ([\d.]+) ms = "
               r"([\d.]+) ms\n")
    found = re.findall(pattern, stdout)
    assert len(found) == 1, stdout
    *values, step = found[0]
    read = {term: 0.0 if v == "not modelled" else float(v.removesuffix(" ms"))
            for term, v in zip(TIME_TERMS, values)}
    assert abs(sum(read.values()) - float(step)) <= 0.05 * len(read) + 1e-9
    terms = plan["time"]["terms"]
    json_ms = dict(zip(TIME_TERMS, (terms[k] * 1e3 for k in (
        "compute_s", "memory_bound_s", "launch_s", "exposed_intra_node_s",
        "exposed_inter_node_s", "bubble_s"))))
    assert all(abs(read[k] - json_ms[k]) <= 0.05 for k in TIME_TERMS), (read, json_ms)
    assert abs(sum(json_ms.values()) - plan["time"]["step_s"] * 1e3) <= 1e-6
    assert f"bottleneck: {plan['time']['bottleneck']}\n" in stdout
    assert plan["time"]["bottleneck"] == max(json_ms, key=json_ms.get)
    return read
