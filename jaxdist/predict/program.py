"""What the compiled step for the real mesh says, from abstract shapes (nothing allocated):
per-device FLOPs, bytes accessed, collectives, compiler memory and kernels, read through
`jaxdist.program.compiled` from the program of the prediction's `Target`: XLA:GPU for the part's
topology where the GPU compiler is installed, else XLA:CPU on simulated devices.

Big decoders: compiling all of llama3-70b's 80 blocks on 2 cores takes too long, and a
decoder is a stack of identical blocks, so the step is compiled at depth 1 and 2 and every
figure is extrapolated linearly, F(d) = F(1) + (d - 1) (F(2) - F(1)); exact for a uniform
stack (tests/test_predict.py compares it with a full compile of a 4-block model).

Attention: with `attention=cudnn` XLA:GPU compiles `jax.nn.dot_product_attention` as cuDNN's
fused (flash) attention custom calls, which keep no L x L score matrix, and that program is
what is read. XLA:CPU cannot compile cuDNN, so on that path the step is compiled with the XLA
implementation (same shapes and FLOPs), which keeps the scores; `attention_scores` measures
that part of the temporaries and bytes accessed per block (compiles at L and at L/2 with twice
the batch) and the CPU prediction leaves it out. With `attention=default` JAX 0.10 itself
picks the XLA implementation on every platform, so a GPU keeps the scores too.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

from jaxdist.figures import Figures
from jaxdist.program import compiled as compiled_mod, liveness, program_reading
from jaxdist.mesh import MeshShape
from jaxdist.predict import kernels_time
from jaxdist.predict.kernels_time import KernelTime
from jaxdist.predict.depth import kernels, line, linear
from jaxdist.predict.time_model import AggregatedCollective, aggregate
from jaxdist.train_step import compiled_step_flops

FULL_DEPTH_MAX = 8  # "auto": compile whole up to this many blocks, else extrapolate


@dataclasses.dataclass(frozen=True)
class StepFigures(Figures):
    """What a compiled program (a whole step, or a pipeline's piece) says per device per
    step, as the time and memory models read it: FLOPs, bytes accessed, its collectives
    aggregated by kind, mesh axes and group (jaxdist.predict.time_model.aggregate), the
    compiler's byte figures (`memory`), the kernels by class and, for an XLA:GPU program
    read with a part's rates, its time kernel by kernel. Figures at a depth not compiled say
    how they were made (`method`, `memory_method`) and keep the depth-1 and -2 figures."""
    flops: float
    bytes_accessed: float
    comm: list[AggregatedCollective]
    memory: dict[str, float]
    kernels: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    kernel_time: KernelTime | None = None
    liveness: liveness.LiveRanges | None = None
    compile_s: float | None = None
    method: str = ""
    memory_method: str = ""
    depth_1: StepFigures | None = None
    depth_2: StepFigures | None = None


@dataclasses.dataclass(frozen=True)
class ScoreBytes(Figures):
    """The L x L attention scores' part of a program's temporaries and bytes accessed."""
    temp_bytes: float
    bytes_accessed: float

    def __add__(self, other: ScoreBytes) -> ScoreBytes:
        return ScoreBytes(self.temp_bytes + other.temp_bytes,
                          self.bytes_accessed + other.bytes_accessed)


def figures(job, model_cfg, shape: MeshShape, target=None, hw=None,
            memo=None) -> StepFigures:
    """One compile of the step for `model_cfg` on the mesh of `target`'s devices
    (jaxdist.program.compiled.Target): its StepFigures, with XLA:GPU and a part `hw` the
    program's step timed kernel by kernel (`kernel_time`: jaxdist.predict.kernels_time). No target: simulated CPU devices.
    `memo` (a dict, optional: a suite plan's) keeps lowerings and readings for later calls."""
    return figures_of(job, [model_cfg], shape, target, hw, memo)[0]


def figures_of(job, model_cfgs: list, shape: MeshShape, target=None, hw=None,
               memo=None) -> list[StepFigures]:
    """`figures` of several models, compiled side by side
    (jaxdist.program.compiled.compile_steps)."""
    target = target or compiled_mod.simulated_cpu(shape.size)
    if not target.gpu:
        model_cfgs = [cpu_compilable(m) for m in model_cfgs]
    out = []
    for program, compiled, seconds in compiled_mod.compile_steps(job, model_cfgs, shape,
                                                                 target, memo):
        step_flops = None if target.gpu else compiled_step_flops(program, compiled)
        runs = None
        if getattr(program, "schedule", None) is not None:  # a pipeline's switches
            from jaxdist.pipeline.report import switch_runs
            runs = switch_runs(program_reading.text(compiled), dict(shape.axis_sizes),
                              program.schedule)
        out.append(read_program(compiled, seconds, target, dict(shape.axis_sizes), job, hw,
                                runs, step_flops, memo))
    return out


def read_program(compiled, seconds: float, target, sizes: dict, job, hw=None,
                 runs: dict | None = None, step_flops: float | None = None,
                 memo: dict | None = None) -> StepFigures:
    """The figures of a compiled program through jaxdist.program.program_reading.read, and
    `kernel_time` (timed kernel by kernel) when XLA:GPU compiled it and `hw` has published
    rates. Everything but the compiler's memory
    is a function of the program's text: with `memo`, a program whose text was read before
    (e.g. a variant whose flags left the program unchanged) is not parsed again."""
    hlo = program_reading.text(compiled)
    timed = target.gpu and hw is not None and kernels_time.has_rates(hw)
    key = ("reading", hashlib.blake2b(hlo.encode(), digest_size=16).digest(), target.label,
           tuple(sizes.items()), tuple(sorted((runs or {}).items())), step_flops,
           repr(hw) if timed else None, job.matmul_precision)
    if memo is None or key not in memo:
        reading = program_reading.read(compiled, target, sizes, runs, step_flops=step_flops,
                                       compile_s=seconds)
        out = StepFigures(
            flops=reading.flops, bytes_accessed=reading.bytes_accessed,
            comm=aggregate(reading.collectives), memory={}, kernels=reading.kernels,
            kernel_time=kernels_time.step_time(hlo, reading.collectives, hw, sizes,
                                               job.matmul_precision, runs) if timed else None)
        if memo is not None:
            memo[key] = copy.deepcopy(out)
    else:  # a copy: the caller's figures never share lists with the memo's
        out = copy.deepcopy(memo[key])
    return out.replace(memory=program_reading.memory_bytes(compiled),
                       liveness=liveness.of(compiled), compile_s=seconds)


def is_stack(model_cfg) -> bool:
    return model_cfg.family in ("gpt", "moe") and isinstance(getattr(model_cfg, "depth", None),
                                                             int)


def extrapolate(one: StepFigures, two: StepFigures, depth: int,
                ordered: bool = False) -> StepFigures:
    """Figures at `depth` from the depth-1 and depth-2 figures (jaxdist.predict.depth); the
    compiler's memory as `extrapolated_memory` says."""
    memory, method = extrapolated_memory(one, two, depth, ordered)
    return linear(one, one, two, depth, by_nodes=True).replace(
        memory=memory, memory_method=method,
        kernels=kernels(one.kernels, one.kernels, two.kernels, depth - 1),
        compile_s=(one.compile_s or 0) + (two.compile_s or 0))


def extrapolated_memory(one: StepFigures, two: StepFigures, depth: int,
                        ordered: bool = False) -> tuple[dict[str, float], str]:
    """(memory, how): the compiler's figures at `depth`. State (arguments, outputs)
    is linear in depth. Temporaries, where the backward is ordered (models.layers.run_blocks:
    the working set at the peak is then one block's backward, whatever the depth) and XLA's
    live ranges of the depth-2 program say what one block holds at its peak
    (jaxdist.program.liveness): the depth-2 temporaries plus that per further block. A line would
    multiply the difference of two schedules' working sets by the depth (jaxdist.program.liveness:
    llama3-70b fsdp_tp+SP, 383 GiB at 80 by the line, 49 by the live ranges and by the slope
    of whole compiles at depth 8 and 16). Else linear, like the rest: without the order XLA
    gathers weights ahead and defers weight gradients, and what it keeps piles up with depth."""
    fields = {k for k in one.memory if k.endswith("_bytes") and k != "peak_bytes"}
    memory = {k: line(one.memory[k], one.memory[k], two.memory[k], depth - 1)
              for k in fields}
    reading = two.liveness if ordered else None
    if reading is None or not reading.profile or "temp_bytes" not in memory:
        method = "linear in depth through depth 1 and 2"
    else:
        more = liveness.peak_at_depth(reading.profile, depth - 2)
        memory["temp_bytes"] = two.memory["temp_bytes"] + more - reading.peak_live_bytes
        method = (f"temporaries: depth 2's + {(more - reading.peak_live_bytes) / 2**30:.2f} "
                  f"GiB for {depth - 2} more blocks, at the step where what each block holds "
                  f"weighs most (XLA's live ranges)")
    if "peak_bytes" in one.memory:
        memory["peak_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                                - memory["alias_bytes"] + memory["temp_bytes"])
    return memory, method


def step_figures(job, model_cfg, shape: MeshShape, blocks: str = "auto", target=None,
                 hw=None, memo: dict | None = None) -> StepFigures:
    """Figures of the full step; blocks: "full" (compile everything), "extrapolate" (depth
    1 and 2) or "auto" (extrapolate a stack deeper than FULL_DEPTH_MAX). `memo`: figures_of's."""
    depth = getattr(model_cfg, "depth", None)
    stack = is_stack(model_cfg) and depth > 2
    if blocks == "extrapolate" and not stack:
        blocks = "full"
    if blocks == "full" or (blocks == "auto" and (not stack or depth <= FULL_DEPTH_MAX)):
        return figures(job, model_cfg, shape, target, hw, memo).replace(method="full compile")
    one, two = figures_of(job, [dataclasses.replace(model_cfg, depth=d) for d in (1, 2)],
                          shape, target, hw, memo)
    figs = extrapolate(one, two, depth, getattr(model_cfg, "blocks_ordered", False))
    method = f"compiled at depth 1 and 2, extrapolated linearly to {depth}"
    if figs.memory_method.startswith("temporaries"):
        method += f" ({figs.memory_method})"
    return figs.replace(depth_1=one, depth_2=two, method=method)


def attention_scores(job, model_cfg, shape: MeshShape, target=None,
                     one: StepFigures | None = None,
                     two: StepFigures | None = None) -> ScoreBytes:
    """The L x L attention-score part, at full sequence length and depth, of temp bytes and
    bytes accessed. Per block (depth 2 - depth 1), at the same tokens per step: P(k) =
    A + S / k at sequence L / k and batch k B (activations A follow the tokens, scores S the
    tokens x L), so S = 2 (P(1) - P(2)); times the depth. `one`, `two`: the depth-1 and -2
    figures at L, where already compiled."""
    depth, seq = model_cfg.depth, model_cfg.seq_len
    one = one or figures(job, dataclasses.replace(model_cfg, depth=1), shape, target)
    two = two or figures(job, dataclasses.replace(model_cfg, depth=2), shape, target)
    wide = job.with_train(batch_size=2 * job.train.batch_size)
    half = dataclasses.replace(model_cfg, seq_len=seq // 2)
    h1 = figures(wide, dataclasses.replace(half, depth=1), shape, target)
    h2 = figures(wide, dataclasses.replace(half, depth=2), shape, target)

    def scores(get):
        return depth * 2 * ((get(two) - get(one)) - (get(h2) - get(h1)))

    return ScoreBytes(temp_bytes=scores(lambda f: f.memory["temp_bytes"]),
                      bytes_accessed=scores(lambda f: f.bytes_accessed))


def cpu_compilable(model_cfg):
    """`model_cfg` with cuDNN attention replaced by XLA's (same shapes and FLOPs): XLA:CPU
    cannot compile the cuDNN custom call."""
    if getattr(model_cfg, "attention", None) == "cudnn":
        return dataclasses.replace(model_cfg, attention="xla")
    return model_cfg


def flash_attention_applies(model_cfg, dtype: str) -> bool:
    """cuDNN flash attention: decoders asking for it (`attention=cudnn`) in bf16 on Ampere
    and newer (every predicted part in jaxdist.parts), even sequence length for the fit. Not
    `attention=default`: JAX 0.10 runs that as XLA attention on a GPU too."""
    return is_stack(model_cfg) and dtype in ("bfloat16", "float8") and model_cfg.seq_len % 2 == 0 and \
        getattr(model_cfg, "attention", "default") == "cudnn"
