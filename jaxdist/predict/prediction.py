"""The one prediction pipeline: program figures -> time model -> memory verdict ->
`Prediction`. `predict(job)` is what a `--hardware` plan shows (jaxdist.plan.predicted)
and what a run records beside its measurement (jaxdist.predict.inrun): the same function, so a
run's measured / predicted ratio checks the predictor plans use.

The step is compiled for the real mesh on the job's part (`job.part`): by XLA:GPU for
the part's topology without a device where the GPU compiler is installed, else by XLA:CPU on
simulated CPU devices (`jaxdist.program.compiled.for_part`).

- One program (every layout but a pipeline): figures from `jaxdist.predict.program` (a deep
  decoder compiled at depth 1 and 2, extrapolated: `jaxdist.predict.depth`); time kernel by
  kernel (`jaxdist.predict.kernels_time`) where XLA:GPU compiled it and the part has published
  rates, else the roofline (`jaxdist.predict.time_model`); memory from XLA:GPU's buffer
  assignment beside the hand estimate (`jaxdist.predict.memory`), or the hand estimate alone.
- A pipeline: the step tick by tick from the executed schedule table
  (`jaxdist.predict.pipeline`); memory per stage (`jaxdist.predict.stage_memory`).
- Either way the verdict is `jaxdist.predict.verdict`'s, and a step that does not fit keeps
  its throughput labelled "if it fit".
"""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from jaxdist.errors import UsageError
from jaxdist.figures import ABSENT, Figures
from jaxdist.hardware import MODEL_CONSTANTS, check_nodes
from jaxdist.mesh import MeshShape
from jaxdist.predict import kernels_time, memory, program, time_model, verdict
from jaxdist.predict.state import state_bytes
from jaxdist.predict.time_model import AxisLinks, StepTime, Throughput
from jaxdist.predict.verdict import MemoryVerdict
from jaxdist.program import compiled

LABEL = time_model.LABEL


@dataclasses.dataclass(frozen=True)
class CompiledProgram(Figures):
    """What the compiled program says, plan.json's `compiled` block: the compiler, how the
    figures were found (`method`), FLOPs per device and the L x L scores removed for flash
    attention; one program adds its bytes, kernels, compiler memory and compile seconds, a
    pipeline each op's time (`ops`); `fallback` where Triton GEMMs were turned off."""
    compiler: str
    gpu: bool
    xla_flags: str
    method: str
    flops_per_device: float
    flash_attention: dict | None
    kernels: dict[str, dict] = ABSENT
    compile_s: float | None = ABSENT
    bytes_accessed_per_device: float = ABSENT
    memory: dict[str, float] = ABSENT
    ops: dict = ABSENT
    fallback: dict[str, str] = ABSENT


@dataclasses.dataclass(frozen=True)
class Prediction(Figures):
    """One step of one job on one part, predicted. The blocks are plan.json's (its schema:
    docs/results.md); `timing` and `memory_from` say which model made the time and which
    figure decided the memory verdict."""
    compiled: CompiledProgram
    memory: MemoryVerdict
    time: StepTime
    model: dict                # {name, params}
    distributed_optimizer: bool
    state_bytes_per_device: dict[str, int]  # exact, by state part
    timing: str = "roofline"   # "kernels" (XLA:GPU program), "roofline" or "ticks" (pipeline)
    memory_from: str = "hand"  # "compiled" (XLA:GPU's buffer assignment), "hand" or "stages"
    schedule: dict | None = None        # a pipeline's schedule (Schedule.summary)
    blocks_per_chunk: int | None = None  # a pipeline's largest chunk
    hardware: dict | None = None        # the part's figures and its node count
    links: dict[str, AxisLinks] | None = None  # per mesh axis: the links its groups use
    constants: dict[str, dict] | None = None   # the time model's, each with its why
    throughput: Throughput | None = None  # ("if it fit" where it does not)

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def fits(self) -> bool | None:
        return self.memory.fits

    @property
    def verdict(self) -> str:
        """fits, OOM or unknown."""
        return verdict.word(self.fits)

    @property
    def compiler(self) -> str:
        return self.compiled.compiler

    @property
    def pipeline(self) -> dict | None:
        """plan.json's `pipeline` block: the schedule, its largest chunk and its ticks."""
        if self.schedule is None:
            return None
        return {**self.schedule, "blocks_per_chunk": self.blocks_per_chunk,
                **self.time.pipeline.to_json()}


def predict(job, blocks: str = "auto", cache: dict | None = None) -> Prediction:
    """The prediction of `job`'s step (jaxdist.job) on its mesh and part (`job.part`);
    `cache` (a dict, optional) keeps compiles for later calls whose program is the same (a
    suite's rows: e.g. variants that change only --overlap).

    Every shape XLA can compile gets a prediction: where XLA:GPU's Triton GEMM emitter finds
    no tiling for a dot, the step is compiled again with Triton GEMMs off (cuBLAS for every
    dot), and `compiled.fallback` says so. Any other compile failure, or one the fallback does
    not cure, is a CompileError: XLA's message in one line."""
    from jax.errors import JaxRuntimeError

    try:
        return _predict(job, blocks, cache)
    except JaxRuntimeError as e:
        rejected = compiled.xla_message(e)
        if compiled.TILING_REJECTED not in str(e) or \
                compiled.CUBLAS_GEMMS in job.compiler.xla_flags:
            raise compiled.CompileError(f"XLA could not compile the step: {rejected}") from None
    try:
        pred = _predict(job.with_xla_flags(
            f"{job.compiler.xla_flags} {compiled.CUBLAS_GEMMS}".strip()), blocks, cache)
    except JaxRuntimeError as e:
        raise compiled.CompileError(
            f"XLA could not compile the step, with Triton GEMMs off either "
            f"({compiled.CUBLAS_GEMMS}): {compiled.xla_message(e)}") from None
    return pred.replace(compiled=pred.compiled.replace(fallback={
        "xla_flags": compiled.CUBLAS_GEMMS, "rejected": rejected,
        "why": "XLA:GPU's Triton GEMM emitter found no tiling for a dot of this step; "
               "compiled again with Triton GEMMs off, every dot a cuBLAS call (timed at "
               "the part's cuBLAS rate like any GEMM)"}))


def _predict(job, blocks: str, cache: dict | None) -> Prediction:
    shape, hw, model_cfg = job.shape, job.part, job.model
    check_nodes(hw, shape.size)
    if hw.peak_flops(job.dtype, job.matmul_precision) is None:
        raise UsageError(f"{hw.name} has no {job.dtype} peak figure: give a dtype it "
                         f"has (--dtype bfloat16)")
    target = compiled.for_part(hw, shape.size, job.compiler.compiler)
    mesh = dict(shape.axis_sizes)
    if job.layout.pipelined:
        pred = _pipeline(job, hw, target, cache)
    else:
        pred = _one_program(job, hw, target, blocks, cache)
    tokens, batch = model_cfg.tokens_per_sample, job.train.batch_size
    thr = time_model.throughput(pred.time, tokens * batch if tokens else None,
                                model_cfg.flops_per_sample() * batch, shape.size)
    return pred.replace(
        hardware={**hw.prediction_fields(), "nodes": -(-shape.size // hw.gpus_per_node)},
        links=time_model.axis_links(mesh, hw, compiled.mesh_hosts(shape, target)),
        constants={k: {"value": c.value, "why": c.why} for k, c in MODEL_CONSTANTS.items()},
        throughput=verdict.if_it_fit(thr, pred.fits))


def memo(cache: dict | None, key: tuple, make):
    """make()'s value, kept in `cache` (a suite plan's) under `key` for later rows whose
    settings are the same (a variant that changes only --overlap): a copy each time."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return copy.deepcopy(cache[key])


def _one_program(job, hw, target, blocks: str, cache: dict | None) -> Prediction:
    shape = job.shape
    settings = (repr(job.settings), repr(job.train), tuple(shape.axis_sizes.items()))
    state = memo(cache, ("state bytes", *settings), lambda: state_bytes(job))
    mesh = dict(shape.axis_sizes)
    # The hand estimate traces the loss (Python) while XLA compiles (threads without the
    # GIL): the two overlap on two cores.
    with ThreadPoolExecutor(max_workers=1) as pool:
        hand = pool.submit(memo, cache, ("hand memory", *settings),
                           lambda: hand_memory(job, state, mesh))
        figures, quadratic = compiled_figures(job, shape, target, blocks, cache, hw)
        peak = hand.result()
    temp, bytes_accessed = figures.memory.get("temp_bytes", 0), figures.bytes_accessed
    if quadratic is not None:
        temp -= max(0.0, quadratic.temp_bytes)
        bytes_accessed -= max(0.0, quadratic.bytes_accessed)
    timed = target.gpu and kernels_time.has_rates(hw)
    if timed:  # XLA:GPU's program, kernel by kernel
        step = time_model.kernel_step(figures.kernel_time, figures.comm, hw, mesh,
                                      job.dtype, job.matmul_precision)
    else:
        step = time_model.step_time(figures.flops, bytes_accessed, figures.comm, hw,
                                    mesh, job.dtype, job.compiler.overlap, shape.stage,
                                    job.train.microbatches, job.matmul_precision)
    if target.gpu:
        mem = verdict.gpu_memory_verdict(peak, figures.memory, hw)
    else:
        mem = verdict.memory_verdict(peak, int(max(0.0, temp)), hw)
    return Prediction(
        model=state.model, distributed_optimizer=state.distributed_optimizer,
        state_bytes_per_device=state.state_bytes_per_device,
        compiled=CompiledProgram(
            compiler=target.label, gpu=target.gpu, xla_flags=job.compiler.xla_flags,
            method=figures.method, flops_per_device=figures.flops, kernels=figures.kernels,
            compile_s=figures.compile_s, bytes_accessed_per_device=figures.bytes_accessed,
            memory=figures.memory, flash_attention=None if quadratic is None else {
                "removed_score_temp_bytes": max(0.0, quadratic.temp_bytes),
                "removed_score_bytes_accessed": max(0.0, quadratic.bytes_accessed),
                "why": "a GPU runs bf16 attention as cuDNN flash attention, which keeps no "
                       "L x L scores; XLA:CPU keeps them"}),
        memory=mem, time=step, timing="kernels" if timed else "roofline",
        memory_from="compiled" if target.gpu else "hand")


def _pipeline(job, hw, target, cache: dict | None) -> Prediction:
    """pp, tp_pp, fsdp_pp: the step tick by tick from the executed schedule table
    (jaxdist.predict.pipeline); memory from the stages' (exact state per stage, activations
    estimated), against the part's HBM."""
    from jaxdist.predict.pipeline import pipeline_step
    from jaxdist.predict.stage_memory import stage_memory

    model_cfg, shape = job.model, job.shape
    stages = memo(cache, ("stage memory", repr(job.settings), repr(job.train),
                          tuple(shape.axis_sizes.items())),
                  lambda: stage_memory(job))
    pred = pipeline_step(job, model_cfg, dict(shape.axis_sizes), hw, cache, target)
    return Prediction(
        model=stages["model"], distributed_optimizer=stages["distributed_optimizer"],
        state_bytes_per_device=stages["state_bytes_per_device"],
        compiled=CompiledProgram(
            compiler=target.label, gpu=target.gpu, xla_flags=job.compiler.xla_flags,
            method=pred.method, flops_per_device=pred.flops_per_device,
            ops={**pred.ops, "flash_attention": pred.flash_attention},
            flash_attention=pred.flash_attention),
        schedule=pred.schedule, blocks_per_chunk=pred.blocks_per_chunk,
        memory=verdict.pipeline_verdict(stages, hw, pred.working_temp_bytes),
        time=pred.time, timing="ticks", memory_from="stages")


def compiled_figures(job, shape: MeshShape, target, blocks: str, cache: dict | None,
                     hw=None) -> tuple[program.StepFigures, program.ScoreBytes | None]:
    """(step figures, attention-score part or None), compiled once per distinct program.
    The score part is measured only on XLA:CPU, which cannot compile cuDNN's attention;
    XLA:GPU's program holds the cuDNN calls themselves."""
    model_cfg = job.model
    key = ("step", target.label, repr(model_cfg), job.layout.name,
           tuple(shape.axis_sizes.items()), job.train.batch_size, job.dtype,
           job.matmul_precision, job.train.optimizer, job.train.microbatches, blocks,
           hw.name if hw else None, job.compiler.overlap, job.compiler.xla_flags)
    if cache is not None and key in cache:
        return cache[key]
    figures = program.step_figures(job, model_cfg, shape, blocks, target,
                                   hw if target.gpu and kernels_time.has_rates(hw) else None,
                                   cache)
    quadratic = None
    if not target.gpu and program.flash_attention_applies(model_cfg, job.dtype):
        quadratic = program.attention_scores(job, model_cfg, shape, target,
                                             figures.depth_1, figures.depth_2)
    if cache is not None:
        cache[key] = (figures, quadratic)
    return figures, quadratic


def hand_memory(job, state, mesh: dict[str, int]) -> memory.MemoryEstimate:
    """jaxdist.predict.memory's peak estimate of `job`'s step (exact state from `state`, a
    StateBytes)."""
    model_cfg = job.model
    return memory.predict_memory(
        model_cfg, job.dtype, job.train.batch_size, job.train.microbatches, mesh,
        state.state_bytes_per_device, state.state_bytes_global["params"],
        program.flash_attention_applies(model_cfg, job.dtype),
        program.is_stack(model_cfg))
