"""`--dry-run --hardware NAME`: the plan of a step on NAME's cluster, from the one prediction
(jaxdist.predict.prediction: the step compiled for the real mesh, its time and its memory
verdict). It reads verdict first: fits, OOM or unknown with the one figure that decides against
the part's HBM, what would make it fit where it does not, the memory breakdown, then the step
time and throughput (under "if it fit" where it does not), all labelled `predicted`."""

from __future__ import annotations

import dataclasses

from jaxdist.figures import Figures, json_of
from jaxdist.plan.base import PlanBase, model_text
from jaxdist.predict import program
from jaxdist.predict.prediction import LABEL, Prediction, predict


@dataclasses.dataclass(frozen=True)
class PlanSettings(Figures):
    """The job's settings a plan's readers compare by, plan.json's `settings`."""
    dtype: str | None = None
    remat: str | None = None
    fp8_scaling: str | None = None
    microbatches: int = 1
    attention: str | None = None
    tp_comm_chunks: int | None = None
    tp_comm_split: str | None = None
    decoder: bool = False


@dataclasses.dataclass(frozen=True)
class Advice(Figures):
    """A lever that brings a plan under HBM, checked: the flags (which the validation
    accepts for this job), the peak per device they would reach by the hand estimate, what
    that saves, and whether it fits (experiments.advice makes them)."""
    flags: str
    memory_bytes: float
    saves_bytes: float
    fits: bool

    def text(self) -> str:
        from jaxdist.summary import human_bytes
        return (f"{self.flags} ({human_bytes(self.memory_bytes)} per device, "
                f"{'fits' if self.fits else 'still over'}; hand estimate)")


@dataclasses.dataclass(frozen=True)
class PredictedPlan(PlanBase):
    """plan.json: the job (settings, layout, mesh, batch) and its Prediction; a pipeline's
    has the schedule's block (`pipeline`)."""
    settings: PlanSettings
    layout: str
    mesh: dict
    batch_size: int
    prediction: Prediction
    seq_len: int | None = None  # the header's; not in plan.json
    advice: tuple[Advice, ...] = ()  # checked levers, where it does not fit
    power: Figures | None = None  # jaxdist.predict.power.PlanPower: plan.json's `power`

    file_name = "plan.json"

    def to_json(self) -> dict:
        p = self.prediction
        return json_of({
            "label": LABEL, "dry_run": True, "settings": self.settings,
            "layout": self.layout, "distributed_optimizer": p.distributed_optimizer,
            "mesh": self.mesh, "model": p.model,
            "state_bytes_per_device": p.state_bytes_per_device,
            "batch_size": self.batch_size, "hardware": p.hardware, "links": p.links,
            "constants": p.constants, "compiled": p.compiled,
            **({"pipeline": self.pipeline} if self.pipeline is not None else {}),
            "memory": p.memory, "time": p.time, "throughput": p.throughput,
            **({"power": self.power} if self.power is not None else {}),
            "verdict": p.verdict, **({"advice": list(self.advice)} if p.fits is not True
                                     else {})})

    def text(self) -> str:
        return format_prediction(self)

    # the prediction's blocks, read by name
    model = property(lambda self: self.prediction.model)
    distributed_optimizer = property(lambda self: self.prediction.distributed_optimizer)
    hardware = property(lambda self: self.prediction.hardware)
    compiled = property(lambda self: self.prediction.compiled)
    memory = property(lambda self: self.prediction.memory)
    time = property(lambda self: self.prediction.time)
    throughput = property(lambda self: self.prediction.throughput)
    verdict = property(lambda self: self.prediction.verdict)

    @property
    def pipeline(self) -> dict[str, object] | None:
        """plan.json's `pipeline` block: the schedule, its largest chunk and its ticks."""
        p = self.prediction
        if p.schedule is None:
            return None
        return {**p.schedule, "blocks_per_chunk": p.blocks_per_chunk,
                **p.time.pipeline.to_json()}


def predict_plan(job, blocks: str = "auto", cache: dict | None = None) -> PredictedPlan:
    """The plan of `job` (jaxdist.job) on its mesh and part; `cache` (a dict, optional) keeps
    compiles for later calls whose program is the same (a suite's rows)."""
    from jaxdist.predict.power import for_plan

    plan = PredictedPlan(settings=plan_settings(job), layout=job.layout.name,
                         mesh=dict(job.shape.axis_sizes), batch_size=job.train.batch_size,
                         prediction=predict(job, blocks, cache),
                         seq_len=getattr(job.model, "seq_len", None))
    return dataclasses.replace(plan, power=for_plan(plan, job))


def plan_settings(job) -> PlanSettings:
    """The settings of `job` a plan records (plan.json `settings`)."""
    model_cfg = job.model
    return PlanSettings(dtype=job.dtype, remat=job.train.remat,
                        fp8_scaling=job.fp8_scaling if job.dtype == "float8" else None,
                        microbatches=job.train.microbatches,
                        attention=getattr(model_cfg, "attention", None),
                        tp_comm_chunks=getattr(model_cfg, "tp_comm_chunks", None),
                        tp_comm_split=getattr(model_cfg, "tp_comm_split", None),
                        decoder=program.is_stack(model_cfg))


def verdict_line(p: PredictedPlan) -> str:
    """The verdict, the one figure that decides it and the one limit it is held to."""
    from jaxdist.summary import human_bytes

    mem, pred = p.memory, p.prediction
    if pred.memory_from == "stages":
        source = f"stage {max(mem.stages, key=lambda s: s['total'])['stage']}, the fullest"
    elif pred.memory_from == "compiled":  # XLA:GPU's figure, or the hand estimate
        source = mem.source
    else:
        source = "hand estimate"
    figure = (f"{human_bytes(mem.total_bytes)} per device ({source}) against "
              f"{human_bytes(mem.hbm_bytes)} of HBM")
    if pred.fits:
        return f"  verdict: fits: {figure}, {human_bytes(mem.headroom_bytes)} to spare"
    word = "OOM" if pred.fits is False else "unknown"
    return f"  verdict: {word}: {figure}; {mem.fits_reason}"


def memory_line(p: PredictedPlan) -> str:
    """The memory per device, term by term: XLA:GPU's buffer assignment beside the hand
    estimate for one program compiled for a GPU, the hand estimate's terms for XLA:CPU's,
    the worst stage's for a pipeline."""
    from jaxdist.summary import human_bytes

    mem, kind = p.memory, p.prediction.memory_from
    if kind == "compiled":  # XLA:GPU's buffer assignment beside the hand estimate
        c = mem.compiler
        terms = "; ".join(f"{t.term} {human_bytes(t.compiler_bytes)} vs "
                          f"{human_bytes(t.hand_bytes)}" +
                          (f" ({t.hand_over_compiler:.2f})" if t.hand_over_compiler
                           else "") for t in mem.terms)
        return (f"  memory per device, XLA:GPU's buffer assignment: arguments "
                f"{human_bytes(c['argument_bytes'])} + outputs {human_bytes(c['output_bytes'])}"
                f" - aliased {human_bytes(c['alias_bytes'])} + temporaries "
                f"{human_bytes(c['temp_bytes'])} = {human_bytes(c['peak_bytes'])}; hand "
                f"estimate {human_bytes(mem.hand_estimate_bytes)}\n"
                f"    term by term, XLA vs hand (hand / XLA): {terms}; {mem.source_note}"
                + host_line(mem, c.get("host_temp_bytes", 0)))
    if kind == "stages":
        parts = (f"gradients {human_bytes(mem.gradient_bytes)} + activations (worst stage: "
                 f"stash + one chunk's backward) {human_bytes(mem.temp_bytes)}" +
                 (f" + FP8 weight copies {human_bytes(mem.fp8_weight_bytes)}"
                  if mem.fp8_weight_bytes else "") +
                 (f" + a chunk's gradients cast up for their float32 reduction "
                  f"{human_bytes(mem.gradient_cast_bytes)}"
                  if mem.gradient_cast_bytes else ""))
        cpu = ""
    else:
        parts = (f"gradients {human_bytes(mem.gradient_bytes)} + saved activations "
                 f"{human_bytes(mem.residual_bytes)} + working set "
                 f"{human_bytes(mem.transient_bytes)}")
        cpu = (f" (XLA:CPU's temp bytes, an upper bound not used for the verdict: "
               f"{human_bytes(mem.cpu_compiler_temp_bytes)})")
    return (f"  memory per device: state {human_bytes(mem.state_bytes)} (exact) + {parts} = "
            f"{human_bytes(mem.total_bytes)}{cpu}" + host_line(mem))


def host_line(mem, compiler_host_bytes: float | None = None) -> str:
    """The saved activations an offloading remat policy keeps in host memory (not HBM), or
    '' where nothing is offloaded."""
    from jaxdist.summary import human_bytes

    hand = mem.host_residual_bytes or 0
    if not hand and not compiler_host_bytes:
        return ""
    xla = ("" if compiler_host_bytes is None else
           f"XLA:GPU's host buffers {human_bytes(compiler_host_bytes)}, ")
    return (f"\n    offloaded to host memory (remat policy), not in HBM: {xla}hand estimate "
            f"{human_bytes(hand)} per device")


def next_steps(memory, advice=()) -> list[str]:
    """What would bring a plan that does not fit (OOM or unknown) under HBM: more devices
    where the exact state alone is over, else the checked levers (`advice`, Advice records:
    experiments.advice), those that fit first."""
    if memory.fits is True:
        return []
    if (memory.fits_reason or "").startswith("the train state alone"):
        more = "more devices on fsdp or a layout that shards the state further (fsdp, fsdp_tp)"
        return [f"the state alone is over HBM: {more}"]
    return [a.text() for a in advice]


def how_timed(p: PredictedPlan) -> str:
    """What timed the step: the kernel model, the roofline, or a pipeline's ticks (whose
    ops are timed by one of the two)."""
    t = p.time
    if p.prediction.timing == "kernels":
        return (f"kernel by kernel from XLA:GPU's program (published rates x the fitted kernel "
                f"efficiency {t.kernel_efficiency or 0:.3f})")
    ops = "kernel by kernel" if t.terms.launches_modelled else "by the roofline"
    if p.prediction.timing == "ticks":
        return (f"tick by tick from the schedule table (the critical stage's ops, each timed "
                f"{ops}; its sends; the gradient reduction and optimizer)")
    return (f"by the roofline of the compiled program (the device time is the larger of "
            f"compute {t.compute_s * 1e3:.1f} ms and memory traffic {t.hbm_s * 1e3:.1f} ms; "
            f"no launches modelled)")


def terms_line(t) -> str:
    """The step as the sum of jaxdist.predict.time_model.TIME_TERMS, in their order: the one
    way every plan's time reads."""
    ms, terms = 1e3, t.terms
    c = dict(terms.seconds())
    launches = (f"{c['launches'] * ms:.1f} ms" if terms.launches_modelled else
                "not modelled")
    return (f"compute {c['compute'] * ms:.1f} ms + memory-bound kernels "
            f"{c['memory-bound kernels'] * ms:.1f} ms + launches {launches} + exposed "
            f"communication intra-node {c['intra-node'] * ms:.1f} ms (of "
            f"{t.intra_node_s * ms:.1f}), inter-node {c['inter-node'] * ms:.1f} ms (of "
            f"{t.inter_node_s * ms:.1f}) + bubble {c['bubble'] * ms:.1f} ms = "
            f"{t.step_s * ms:.1f} ms")


def time_lines(p: PredictedPlan, indent: str) -> list[str]:
    """The step time as its terms, the pipeline's ticks and the kernels."""
    t, ms = p.time, 1e3
    hidden = (f" (--overlap, XLA's latency-hiding scheduler, may hide part of the "
              f"{t.comm_exposed_s * ms:.1f} ms exposed: plan with it to see)"
              if t.overlap == "none" and t.comm_exposed_s > 0 else "")
    lines = [f"time per step, {how_timed(p)}:", f"  {terms_line(t)}",
             f"  overlap of communication: {t.overlap}{hidden}" + (
                 f"; host memory copies (remat offload, PCIe) {t.host_transfer_s * ms:.1f} "
                 f"ms, {t.exposed_host_transfer_s * ms:.1f} ms of it uncovered (counted in "
                 f"memory-bound kernels)" if t.has("host_transfer_s") and t.host_transfer_s
                 else "")]
    sched, ticks = p.prediction.schedule, t.pipeline
    if sched is not None:  # the schedule's summary (Schedule.summary) and its ticks
        combined = " combined (F and BACK of a tick as one computation)" if sched.get(
            "combined_f_back") else ""
        lines.append(f"pipeline {sched['schedule']}{combined} S={sched['stages']} "
                     f"V={sched['virtual']} M={sched['microbatches']}: {ticks.ticks} ticks, "
                     f"{ticks.ticks_s * ms:.1f} ms (stage {ticks.critical_stage} busy "
                     f"{ticks.critical_stage_work_s * ms:.1f} ms); stage sends "
                     f"{ticks.send_intra_node_s * ms:.1f} ms intra-node, "
                     f"{ticks.send_inter_node_s * ms:.1f} ms inter-node; timed as "
                     f"{ticks.runtime} runs it (jaxdist's ticks "
                     f"{ticks.lockstep_s * ms:.1f} ms; what-if, Megatron's dataflow "
                     f"{ticks.dataflow_s * ms:.1f} ms; --pp-runtime)")
        lines.append(f"bubble, two ways: {ticks.schedule_bubble:.1%} of stage time idle "
                     f"(counted from the schedule table: " + (
                         "the formula's figure" if len(set(sched.get("stage_blocks") or ()))
                         < 2 else "with the stages of fewer blocks waiting") + "); "
                     f"{ticks.bubble_fraction_of_ticks:.1%} of the predicted tick time "
                     f"(each tick weighted by its predicted duration)")
    lines.append(f"predicted step {t.step_s * ms:.1f} ms; bottleneck: {t.bottleneck}")
    out = [indent + line for line in lines]
    if p.compiled.kernels:
        from jaxdist.program.kernels import format_inventory
        out.append(f"{indent}kernels per step per device (the compiled program):")
        out += [indent[2:] + line for line in format_inventory(p.compiled.kernels)]
    return out


def format_prediction(p: PredictedPlan) -> str:
    """Verdict first: the verdict line, what would fit (where it does not), the memory
    breakdown, the compiler and links, then the time (subordinate, "if it fit", where it
    does not fit) and the throughput."""
    from jaxdist.summary import dist_opt_text

    hw, thr, comp = p.hardware, p.throughput, p.compiled
    mesh = " x ".join(f"{k}={v}" for k, v in p.mesh.items())
    hints = next_steps(p.memory, p.advice)
    dist_opt = dist_opt_text({"distributed_optimizer": p.distributed_optimizer,
                              "layout": p.layout})
    lines = [
        f"PREDICTED (not measured): {model_text(p)}, layout {p.layout}{dist_opt}, mesh {mesh} "
        f"on {hw['name']} ({hw['nodes']} node(s) of {hw['gpus_per_node']}), global batch "
        f"{p.batch_size}" + ("" if comp.gpu else
                             f"; compiled by {comp.compiler}, not XLA:GPU: its time is not a "
                             f"GPU prediction (`make gpu-compiler` for one)"),
        verdict_line(p),
        *([f"  to fit: {'; '.join(hints) or 'a larger part or more devices'}"]
          if p.prediction.fits is not True else []),
        # predicted power and energy (jaxdist.predict.power), the third figure of a step
        *([("  if it fit, " if thr.if_it_fit else "  ") + line for line in p.power.lines()]
          if p.power is not None else []),
        memory_line(p),
        f"  memory rule: {p.memory.rule}",
        f"  compiler: {comp.compiler}; {comp.method}" +
        ("; L x L attention scores removed (flash attention on the GPU)"
         if comp.flash_attention else "") +
        (f"; Triton GEMMs off ({comp.fallback['xla_flags']}): XLA:GPU found no "
         f"Triton tiling for a dot" if comp.fallback else ""),
        *(["  links per axis (the link its collectives are timed on): " + "; ".join(
            f"{a}: {v.links} -> {'inter-node' if v.nodes > 1 else 'intra-node'}"
            for a, v in p.prediction.links.items() if v.in_node * v.nodes > 1)]
          if p.prediction.links else []),
    ]
    # an FP8 plan's MFU is against the bf16 peak, as NeMo and MaxText report it
    basis = " (against the bf16 peak)" if p.settings.dtype == "float8" else ""
    speed = (f"{thr.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {thr.mfu:.1%}{basis}"
             if thr.tokens_per_s_per_gpu is not None else f"MFU {thr.mfu:.1%}{basis}")
    if thr.if_it_fit:  # the verdict is the result; the time only a what-if
        lines.append("  if it fit (it does not: the step would take, on a part with room):")
        lines += time_lines(p, "    ")
        lines.append(f"  if it fit: {speed} (it does not: memory above)")
        lines.append(f"  predicted: does not fit ({p.memory.fits_reason}); to fit: "
                     f"{'; '.join(hints) or 'a larger part or more devices'}")
        return "\n".join(lines)
    lines += time_lines(p, "  ")
    lines.append(f"  predicted {speed}")
    return "\n".join(lines)
