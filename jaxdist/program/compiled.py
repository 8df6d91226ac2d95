"""One home for compiled programs: where a step is compiled for (a `Target`: simulated CPU
devices, a run's own devices, or a GPU cluster's topology with no GPU present, compiled by
the real XLA:GPU here) and what the compiled program says (`read`: FLOPs, bytes, collectives,
memory, kernels: `jaxdist.program.program_reading`). The loop, the dry-run prediction, the pipeline
predictor and the in-run prediction all build their step through it, so every figure names
its compiler; the compile call itself is `jaxdist.program.xla_compile`'s.

XLA:GPU without a device (docs/predict.md, Which compiler): jax-cuda12's PJRT plugin builds a
compile-only topology from a part's target description (`jaxdist.parts`); `jit(...).lower(
abstract args).compile()` then runs XLA:GPU's whole pipeline. Two gaps it leaves are closed
here and in jaxdist.program.program_reading only: `cost_analysis()` is not offered for such a
program (`program_reading.xla_cost` runs XLA's HloCostAnalysis over the optimized module through
jax's private binding, and fails loudly if that binding moves), and no autotuning runs (GEMM
tilings are XLA's heuristics).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.parts import NAMED, PARTS
from jaxdist.program.xla_compile import compile_lowered, compile_timed

INSTALL_HINT = "install it with `make gpu-compiler` (pip install 'jax[cuda12]==0.10.2')"
COMPILERS = ("auto", "gpu", "cpu")


@dataclass(frozen=True)
class Target:
    """Where a program is compiled for, and the words every figure from it carries."""
    compiler: str          # "XLA:GPU" or "XLA:CPU"
    devices: tuple
    label: str
    device_less: bool = False
    part: str | None = None
    gpus_per_node: int = 0  # simulated devices standing for a part's nodes (0: one host)

    @property
    def gpu(self) -> bool:
        return self.compiler == "XLA:GPU"


@functools.lru_cache(maxsize=1)
def gpu_compiler_missing() -> str | None:
    """None when XLA:GPU can compile here without a device; else why not, in one line."""
    from jaxdist.devices import cuda_plugin_installed

    if not cuda_plugin_installed():
        return f"the GPU compiler (jax-cuda12 plugin) is not installed; {INSTALL_HINT}"
    try:
        _topology("probe", NAMED["h100-sxm"].target_text(), "1x1x1")
    except Exception as e:  # noqa: BLE001 - any failure means: not usable, and why
        return (f"the GPU compiler failed to load ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}); reinstall it with `make gpu-compiler`")
    return None


def _topology(name: str, target_text: str, topology: str):
    from jax.experimental import topologies
    return topologies.get_topology_desc(name, "cuda", target_config=target_text,
                                        topology=topology)


def gpu_topology(hw, num_devices: int) -> Target:
    """`num_devices` GPUs of part `hw` as a cluster would hold them: hosts of
    `hw.gpus_per_node` (process index = host), host-major, compiled without a device."""
    spec = hw.target
    if spec is None:
        have = ", ".join(p.name for p in PARTS if p.target)
        raise UsageError(f"{hw.name} has no XLA:GPU target description (parts with one: "
                         f"{have}); plan it with XLA:CPU's program: --compiler cpu")
    per_host = min(num_devices, hw.gpus_per_node)
    hosts = -(-num_devices // per_host)
    if per_host * hosts != num_devices:
        raise UsageError(f"the mesh's {num_devices} devices do not fill hosts of "
                         f"{hw.gpus_per_node} GPUs; give --gpus-per-node a divisor of "
                         f"{num_devices}")
    missing = gpu_compiler_missing()
    if missing:
        raise UsageError(f"--compiler gpu: {missing}")
    try:
        # XLA plans its memory (scheduler, rematerialization) for the part's usable HBM, the
        # figure the memory verdict holds the program to
        # (jaxdist.program.gpu_targets XLA_BASE_FRACTION)
        devices = tuple(_topology(hw.name, hw.target_text(hw.hbm_bytes),
                                  f"1x{hosts}x{per_host}").devices)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"the GPU compiler rejected the {hw.name} target "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); reinstall "
                         f"it with `make gpu-compiler`") from None
    derived = f" ({spec.derived})" if spec.derived else ""
    return Target("XLA:GPU", devices,
                  f"XLA:GPU {spec.sm}, compiled without a device, {hosts} host(s) x "
                  f"{per_host} {hw.name}{derived}", device_less=True, part=hw.name,
                  gpus_per_node=per_host)


def simulated_cpu(num_devices: int, why: str = "", gpus_per_node: int = 0) -> Target:
    """`num_devices` simulated CPU devices of one process; `gpus_per_node`: the nodes of a
    part they stand for (the hosts a collective's groups span, `program_reading.hosts`)."""
    import jax

    devices = tuple(jax.devices("cpu")[:num_devices])
    if len(devices) < num_devices:
        raise UsageError(f"{num_devices} simulated CPU devices are needed, {len(devices)} "
                         f"exist (the CPU device count is fixed once JAX has started)")
    return Target("XLA:CPU", devices, f"XLA:CPU on {num_devices} simulated CPU devices" +
                  (f" ({why})" if why else ""), gpus_per_node=gpus_per_node)


def run_devices(platform) -> Target:
    """A run's own devices: XLA:GPU on GPUs, XLA:CPU on (simulated) CPU devices."""
    if platform.backend == "gpu":
        return Target("XLA:GPU", tuple(platform.devices),
                      f"XLA:GPU on {len(platform.devices)} x {platform.device_kind}")
    return simulated_cpu(len(platform.devices)) if platform.simulated else \
        Target("XLA:CPU", tuple(platform.devices), f"XLA:CPU on {len(platform.devices)} "
                                                    f"{platform.backend} devices")


def for_part(hw, num_devices: int, choice: str = "auto") -> Target:
    """Where a prediction for part `hw` compiles: XLA:GPU for its topology when the GPU
    compiler is here (auto, gpu), else XLA:CPU on simulated devices, saying why (auto, cpu).
    A part without a target description under auto is refused: its figures would silently
    come from the other compiler."""
    if choice not in COMPILERS:
        raise UsageError(f"unknown --compiler {choice!r}; choose from {', '.join(COMPILERS)}")
    check_cpu_limit(hw.name, num_devices, choice)
    if choice == "cpu":
        return simulated_cpu(num_devices, "--compiler cpu", hw.gpus_per_node)
    missing = gpu_compiler_missing()
    if missing and choice == "auto":
        return simulated_cpu(num_devices, "GPU compiler not installed", hw.gpus_per_node)
    return gpu_topology(hw, num_devices)


def plan_cpu_devices(num_devices: int, choice: str = "auto") -> int:
    """The simulated CPU devices a `--hardware` plan of `num_devices` needs, decided before
    JAX's backend starts (jaxdist.devices.configure_host_devices): the mesh's count where
    the plan compiles with XLA:CPU (--compiler cpu, or auto without the GPU compiler), else
    one. An XLA:GPU plan compiles for a device-less topology and runs nothing on the host's
    devices, and XLA's CPU client holds a thread per device it is given: 16,384 of them
    kept a 16,384-GPU plan's process from exiting after its plan was written."""
    if choice == "cpu" or (choice == "auto" and gpu_compiler_missing()):
        return num_devices
    return 1


def mesh_hosts(shape, target: Target):
    """The host of every position of `shape`'s mesh (an array over its axes) as a compile
    for `target` builds it: the process of each device where its devices span several (a
    run's processes, a device-less topology's hosts), else the part's nodes the simulated
    devices stand for (jaxdist.mesh.placement), else one host."""
    import numpy as np

    from jaxdist.mesh import build_mesh, host_of

    devices = build_mesh(shape, target.devices[:shape.size]).devices
    process = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
    if len(np.unique(process)) > 1:
        return np.unique(process, return_inverse=True)[1].reshape(devices.shape)
    return host_of(shape.axis_sizes, target.gpus_per_node or shape.size)


def check_cpu_limit(part: str, num_devices: int, choice: str) -> None:
    """A plan for part `part` on `num_devices` that would compile with XLA:CPU (--compiler
    cpu, or auto without the GPU compiler) and has more devices than it compiles for,
    refused in one line with what to do (called by the validation pass, before JAX's
    backend starts, and by for_part)."""
    limit = _cpu_limit()
    if num_devices is None or num_devices <= limit or choice == "gpu":
        return
    if choice == "cpu":
        raise UsageError(f"--compiler cpu plans on XLA:CPU, which compiles for at most "
                         f"{limit} devices in one process, and the mesh has {num_devices}; "
                         f"use --compiler gpu (or auto) with the GPU compiler installed "
                         f"(`make gpu-compiler`)")
    missing = gpu_compiler_missing()
    if missing:
        raise UsageError(f"--hardware {part} on {num_devices} devices needs XLA:GPU "
                         f"(XLA:CPU, planned on without it, compiles for at most {limit} "
                         f"devices in one process), and {missing}; or plan a mesh of at "
                         f"most {limit} devices")


def _cpu_limit() -> int:
    """jaxdist.devices.CPU_DEVICES_PER_PROCESS: beyond it, XLA:CPU fails a compile with
    "Multiprocess computations aren't implemented on the CPU backend" (after the minutes
    of lowering a plan that size takes), so a plan for more is refused before."""
    from jaxdist.devices import CPU_DEVICES_PER_PROCESS
    return CPU_DEVICES_PER_PROCESS


def step_program(job, mesh, model_cfg=None):
    """The one builder of `job`'s train step program (jaxdist.job) for `mesh`, exactly as a
    run builds it: the job's sharding rules over the mesh, a pipeline's program where the
    layout is pipelined. `model_cfg`: another depth of the job's model (a plan's depth-1
    and -2 programs). The devices under the mesh decide the compiler."""
    from jaxdist.config import parse_stage_blocks
    from jaxdist.pipeline.program import build_pipeline_program
    from jaxdist.train_step import build_program, make_optimizer

    model_cfg = job.model if model_cfg is None else model_cfg
    train = job.train
    tx = make_optimizer(train.optimizer, train.lr)
    if job.layout.pipelined:
        return build_pipeline_program(
            model_cfg, job.dtype, tx, job.rules, mesh, train.seed, train.microbatches,
            train.pp_schedule, train.pp_virtual, matmul_precision=job.matmul_precision,
            stage_blocks=parse_stage_blocks(train.pp_stage_blocks),
            combined=train.pp_combined_1f1b)
    return build_program(model_cfg, job.dtype, tx, job.rules, mesh, train.seed,
                         train.microbatches, matmul_precision=job.matmul_precision)


def batch_bytes(model_cfg, batch_size: int) -> int:
    """The global batch's bytes, from shapes (the host-memory checks of runs, PS jobs and
    the PyTorch reference's batch pool)."""
    import jax

    return sum(x.size * x.dtype.itemsize
               for x in jax.tree.leaves(abstract_batch(model_cfg, batch_size)))


def abstract_batch(model_cfg, batch_size: int) -> dict[str, "jax.ShapeDtypeStruct"]:
    """The global batch as shapes (nothing allocated)."""
    import jax
    import numpy as np

    one = model_cfg.synthetic_batch(np.random.default_rng(0), 1)
    return {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype)
            for k, v in one.items()}


# --overlap for a device-less XLA:GPU compile: the flags a run sets in XLA_FLAGS
# (jaxdist.devices.OVERLAP_FLAGS, and PIPELINE_OVERLAP_FLAGS for a pipeline), given per
# compile since that process's XLA is already up.
OVERLAP_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                   "xla_gpu_enable_highest_priority_async_stream": True}
PIPELINE_OVERLAP_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


# A per-compile XLA option's value (DebugOptions: a flag, a number or a path)
XlaOption = bool | int | float | str

_KERNEL_CACHE: list[dict[str, XlaOption]] = []
_KERNEL_CACHE_LOCK = threading.Lock()  # a suite plan compiles from two threads
KERNEL_CACHE_ENV = "JAXDIST_XLA_KERNEL_CACHE"


def kernel_cache_options() -> dict[str, XlaOption]:
    """XLA:GPU's kernel cache, one file per process: a kernel already compiled to a cubin
    (the same fusion in the depth-1 and depth-2 programs, in a variant that changes only
    --overlap, in F, B and the whole backward of a pipeline chunk) is not handed to ptxas
    again. ptxas dominates a device-less compile here (llama3-70b fsdp_tp depth 1: 12 of
    17 s), and the cache changes no HLO, schedule or buffer: only the cubins are reused.
    The file lives in a temporary directory this process creates and removes, unless
    JAXDIST_XLA_KERNEL_CACHE names one (XLA rewrites it unlocked: one writer at a time)."""
    import atexit
    import shutil
    import tempfile

    with _KERNEL_CACHE_LOCK:
        if not _KERNEL_CACHE:
            path = os.environ.get(KERNEL_CACHE_ENV)
            if not path:
                folder = tempfile.mkdtemp(prefix="jaxdist-xla-kernels-")
                atexit.register(shutil.rmtree, folder, ignore_errors=True)
                path = os.path.join(folder, "kernels.bin")
            _KERNEL_CACHE.append({
                "xla_gpu_kernel_cache_file": path,
                "xla_gpu_enable_llvm_module_compilation_parallelism": True})
        return dict(_KERNEL_CACHE[0])


def xla_options(flags: str) -> dict[str, XlaOption]:
    """`--xla-flags` as per-compile options: "--xla_a=false --xla_b=4" -> {"xla_a": False,
    "xla_b": 4}. A plan compiles in a process whose XLA is already up (XLA_FLAGS is read once,
    at start-up), so the flags are handed to each compile instead; XLA itself rejects a name
    it does not know (`No such compile option`). A bare --name is true, as in XLA_FLAGS; a
    token that is neither --name nor --name=value is refused here."""
    out: dict[str, XlaOption] = {}
    for token in flags.split():
        name, eq, value = token[2:].partition("=")
        if not token.startswith("--") or not name or (eq and not value):
            raise UsageError(f"--xla-flags {token!r}: give each flag as --name=value, e.g. "
                             f"{CUBLAS_GEMMS}")
        low = value.lower() if eq else "true"
        if low in ("true", "false"):
            out[name] = low == "true"
        else:
            try:
                out[name] = int(value)
            except ValueError:
                try:
                    out[name] = float(value)
                except ValueError:
                    out[name] = value
    return out


def compile_options(job, target: Target) -> dict[str, XlaOption] | None:
    """The per-compile XLA options of a plan's compile: on a device-less XLA:GPU target the
    kernel cache, --overlap's scheduler flags and --xla-flags; on simulated CPU devices under
    --dry-run, --xla-flags. None for a compile on the run's own devices (the run's XLA_FLAGS
    already hold the user's flags: jaxdist.devices.configure_xla_flags)."""
    user = xla_options(job.compiler.xla_flags) if job.output.dry_run else {}
    if not target.device_less:
        return user or None
    overlap = {}
    if job.compiler.overlap:
        overlap = {**OVERLAP_OPTIONS, **(PIPELINE_OVERLAP_OPTIONS if
                                         job.layout.pipelined else {})}
    return {**kernel_cache_options(), **overlap, **user}


# XLA:GPU's Triton GEMM emitter can find no output tiling for some shapes on some parts (sm_80:
# bf16[32768,2304] from a GPT of width 2304 and head dim 144), and then the whole compile
# fails. With Triton GEMMs off every dot goes to cuBLAS, which takes any shape; XLA's debug
# option in this jaxlib (xla/debug_options_flags.cc: xla_gpu_enable_triton_gemm).
TILING_REJECTED = "Couldn't find output tile sizes that satisfy"
CUBLAS_GEMMS = "--xla_gpu_enable_triton_gemm=false"


class CompileError(UsageError):
    """XLA rejected the program a plan asked for: its message, in one line."""


def xla_message(error: BaseException) -> str:
    """XLA's error in one line: its first line, without the op's metadata and backend config
    (source positions and tiling hints that run to hundreds of characters)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    first = lines[0] if lines else type(error).__name__
    for cut in (", metadata={", ", backend_config="):
        first = first.split(cut)[0]
    return first[:400]


def compile_step(job, model_cfg, shape, target: Target):
    """(program, compiled, seconds): `job`'s step (jaxdist.job) with the model `model_cfg`
    (the job's, or another depth of it) for mesh `shape` on `target`'s devices, compiled
    from abstract shapes."""
    from jaxdist.mesh import build_mesh

    program = step_program(job, build_mesh(shape, target.devices[:shape.size]), model_cfg)
    compiled, seconds = compile_timed(program.step, program.abstract_state,
                                      abstract_batch(model_cfg, job.train.batch_size),
                                      options=compile_options(job, target))
    return program, compiled, seconds


def compile_steps(job, model_cfgs: list, shape, target: Target,
                  memo: dict | None = None) -> list[tuple]:
    """compile_step for several models (a decoder at depth 1 and 2) at once: traced and
    lowered one after the other (Python), compiled side by side (compile_lowered). With
    `memo` (a suite plan's), a lowering is kept for later calls that differ only in compile
    options (--overlap's flags): the lowered program does not depend on them."""
    from jaxdist.mesh import build_mesh

    memo = {} if memo is None else memo
    keys = [("lowered step", target.label, repr(m), repr(job.settings), repr(job.train),
             tuple(shape.axis_sizes.items())) for m in model_cfgs]

    def lower(key, model_cfg):
        if key not in memo:
            program = step_program(job, build_mesh(shape, target.devices[:shape.size]),
                                   model_cfg)
            memo[key] = (program, program.step.lower(
                program.abstract_state, abstract_batch(model_cfg, job.train.batch_size)))
        return memo[key][1]

    done = compile_lowered([functools.partial(lower, k, m) for k, m in zip(keys, model_cfgs)],
                           compile_options(job, target))
    return [(memo[k][0], compiled, seconds) for k, (compiled, seconds) in zip(keys, done)]

