"""`--dry-run --hardware NAME`: the step compiled for the real mesh (XLA:GPU for NAME's
topology without a device where the GPU compiler is installed, else XLA:CPU on simulated CPU
devices: `jaxdist.program.compiled.for_part`), turned into a predicted memory verdict and step time
on NAME (jaxdist.predict.time_model)."""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from jaxdist.plan import shapes
from jaxdist.program import compiled
from jaxdist.errors import UsageError
from jaxdist.hardware import MODEL_CONSTANTS, check_nodes, get_hardware
from jaxdist.mesh import MeshShape
from jaxdist.summary import dist_opt_text
from jaxdist.predict import kernels_time, memory, program
from jaxdist.predict import time_model
from jaxdist.run_model import build_model
from sharding.pipeline import PIPELINE_LAYOUTS


def predict_plan(cfg, shape: MeshShape, blocks: str = "auto", cache: dict | None = None) -> dict:
    """The predicted plan; `cache` (a dict, optional) keeps compiles for later calls whose
    program is the same (a suite's rows: e.g. variants that change only --overlap).

    Every shape XLA can compile gets a plan: where XLA:GPU's Triton GEMM emitter finds no
    tiling for a dot, the step is compiled again with Triton GEMMs off (cuBLAS for every dot),
    and the plan says so (`compiled.fallback`). Any other compile failure, or one the fallback
    does not cure, is a CompileError: XLA's message in one line."""
    from jax.errors import JaxRuntimeError

    try:
        return verdict_first(_predict_plan(cfg, shape, blocks, cache))
    except JaxRuntimeError as e:
        rejected = compiled.xla_message(e)
        if compiled.TILING_REJECTED not in str(e) or \
                compiled.CUBLAS_GEMMS in cfg.compiler.xla_flags:
            raise compiled.CompileError(f"XLA could not compile the step: {rejected}") from None
    flags = f"{cfg.compiler.xla_flags} {compiled.CUBLAS_GEMMS}".strip()
    retry = dataclasses.replace(cfg, compiler=dataclasses.replace(cfg.compiler,
                                                                  xla_flags=flags))
    try:
        plan = verdict_first(_predict_plan(retry, shape, blocks, cache))
    except JaxRuntimeError as e:
        raise compiled.CompileError(
            f"XLA could not compile the step, with Triton GEMMs off either "
            f"({compiled.CUBLAS_GEMMS}): {compiled.xla_message(e)}") from None
    plan["compiled"]["fallback"] = {
        "xla_flags": compiled.CUBLAS_GEMMS, "rejected": rejected,
        "why": "XLA:GPU's Triton GEMM emitter found no tiling for a dot of this step; "
               "compiled again with Triton GEMMs off, every dot a cuBLAS call (timed at "
               "the part's cuBLAS rate like any GEMM)"}
    return plan


def verdict_first(plan: dict) -> dict:
    """A plan that does not fit has no throughput to act on: its throughput stays (what the
    step would give on a part with room) but is labelled as such, and `verdict` says OOM."""
    fits = plan["memory"]["fits"]
    plan["verdict"] = {True: "fits", False: "OOM"}.get(fits, "unknown")
    if fits is False:
        plan["throughput"] = {**plan["throughput"], "if_it_fit": True,
                              "label": f"{plan['throughput']['label']}, if it fit"}
    return plan


def _predict_plan(cfg, shape: MeshShape, blocks: str, cache: dict | None) -> dict:
    hw = get_hardware(cfg.output.hardware, cfg.output.gpus_per_node)
    check_nodes(hw, shape.size)
    if hw.peak_flops(cfg.model.dtype, cfg.model.matmul_precision) is None:
        raise UsageError(f"{hw.name} has no {cfg.model.dtype} peak in jaxdist.parts")
    if cfg.train.layout in PIPELINE_LAYOUTS:
        return predict_pipeline_plan(cfg, shape, hw, cache)
    model_cfg, _ = build_model(cfg)
    settings = (repr(cfg.model), repr(cfg.train), tuple(shape.axis_sizes.items()))
    state = memo(cache, ("shapes plan", *settings), lambda: shapes.plan(cfg, shape))
    target = compiled.for_part(hw, shape.size, cfg.compiler.compiler)
    mesh = dict(shape.axis_sizes)
    # The hand estimate traces the loss (Python) while XLA compiles (threads without the
    # GIL): the two overlap on two cores.
    with ThreadPoolExecutor(max_workers=1) as pool:
        hand = pool.submit(memo, cache, ("hand memory", *settings),
                           lambda: hand_memory(cfg, model_cfg, state, mesh))
        figures, quadratic = compiled_figures(cfg, model_cfg, shape, target, blocks, cache, hw)
        peak = hand.result()
    temp, bytes_accessed = figures["memory"].get("temp_bytes", 0), figures["bytes_accessed"]
    if quadratic is not None:
        temp -= max(0.0, quadratic["temp_bytes"])
        bytes_accessed -= max(0.0, quadratic["bytes_accessed"])
    mesh = dict(shape.axis_sizes)
    n = shape.size
    if "kernel_time" in figures:  # XLA:GPU's program, kernel by kernel
        step = time_model.kernel_step(figures["kernel_time"], figures["comm"], hw, mesh,
                                 cfg.model.dtype, cfg.model.matmul_precision)
    else:
        step = time_model.step_time(figures["flops"], bytes_accessed, figures["comm"], hw,
                               mesh, cfg.model.dtype, cfg.compiler.overlap, shape.stage,
                               cfg.train.microbatches, cfg.model.matmul_precision)
    step = exposed_by_link(step)
    tokens = model_cfg.tokens_per_sample
    batch = cfg.train.batch_size
    return {
        "label": time_model.LABEL,
        "dry_run": True,
        "settings": plan_settings(cfg, model_cfg),
        "layout": cfg.train.layout,
        "distributed_optimizer": state["distributed_optimizer"],
        "mesh": mesh,
        "model": state["model"],
        "state_bytes_per_device": state["state_bytes_per_device"],  # exact, by part
        "batch_size": batch,
        "hardware": {**hw.prediction_fields(), "nodes": -(-n // hw.gpus_per_node)},
        "links": time_model.axis_links(mesh, hw, compiled.mesh_hosts(shape, target)),
        "constants": {k: {"value": c.value, "why": c.why} for k, c in MODEL_CONSTANTS.items()},
        "compiled": {"compiler": target.label, "gpu": target.gpu,
                     "xla_flags": cfg.compiler.xla_flags, "method": figures["method"], "flops_per_device": figures["flops"],
                     "kernels": figures.get("kernels", {}),
                     "compile_s": figures.get("compile_s"),
                     "bytes_accessed_per_device": figures["bytes_accessed"],
                     "memory": figures["memory"],
                     "flash_attention": None if quadratic is None else {
                         "removed_score_temp_bytes": max(0.0, quadratic["temp_bytes"]),
                         "removed_score_bytes_accessed": max(0.0, quadratic["bytes_accessed"]),
                         "why": "a GPU runs bf16 attention as cuDNN flash attention, which "
                                "keeps no L x L scores; XLA:CPU keeps them"}},
        "memory": memory_estimate(cfg, model_cfg, state, quadratic is not None or (
            target.gpu and program.flash_attention_applies(model_cfg, cfg.model.dtype)),
            mesh, hw, int(max(0.0, temp)), figures["memory"] if target.gpu else None, peak),
        "time": step,
        "throughput": time_model.throughput(step, tokens * batch if tokens else None,
                                       model_cfg.flops_per_sample() * batch, n),
    }


def plan_settings(cfg, model_cfg) -> dict:
    """The settings a plan's hints read (next_steps)."""
    return {"dtype": cfg.model.dtype, "remat": cfg.train.remat,
            "fp8_scaling": cfg.model.fp8_scaling if cfg.model.dtype == "float8" else None,
            "microbatches": cfg.train.microbatches,
            "attention": getattr(model_cfg, "attention", None),
            "tp_comm_chunks": getattr(model_cfg, "tp_comm_chunks", None),
            "decoder": program.is_stack(model_cfg)}


def memo(cache: dict | None, key: tuple, make):
    """make()'s value, kept in `cache` (a suite plan's) under `key` for later rows whose
    settings are the same (a variant that changes only --overlap): a copy each time."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return copy.deepcopy(cache[key])


def compiled_figures(cfg, model_cfg, shape: MeshShape, target, blocks: str,
                     cache: dict | None, hw=None):
    """(step figures, attention-score part or None), compiled once per distinct program.
    The score part is measured only on XLA:CPU, which cannot compile cuDNN's attention;
    XLA:GPU's program holds the cuDNN calls themselves."""
    key = ("step", target.label, repr(model_cfg), cfg.train.layout,
           tuple(shape.axis_sizes.items()), cfg.train.batch_size, cfg.model.dtype,
           cfg.model.matmul_precision, cfg.train.optimizer, cfg.train.microbatches, blocks,
           hw.name if hw else None, cfg.compiler.overlap, cfg.compiler.xla_flags)
    if cache is not None and key in cache:
        return cache[key]
    figures = program.step_figures(cfg, model_cfg, shape, blocks, target,
                                   hw if target.gpu and kernels_time.has_rates(hw) else None,
                                   cache)
    quadratic = None
    if not target.gpu and program.flash_attention_applies(model_cfg, cfg.model.dtype):
        quadratic = program.attention_scores(cfg, model_cfg, shape, target,
                                             figures.get("depth_1"), figures.get("depth_2"))
    if cache is not None:
        cache[key] = (figures, quadratic)
    return figures, quadratic


def exposed_by_link(step: dict) -> dict:
    """The step's device time and its exposed communication split by link (intra-node,
    inter-node): all of it without overlap; with overlap, the exposed part shared in
    proportion to each link's time (the ranking's stacked bars)."""
    if "device_s_exact" in step:  # the kernel model knows both, from the program's schedule
        return {**step, "device_s": step["device_s_exact"]}
    comm_total = step["intra_node_s"] + step["inter_node_s"]
    share = step["comm_exposed_s"] / comm_total if comm_total else 0.0
    return {**step, "device_s": max(step["compute_s"], step["hbm_s"]),
            "exposed_intra_node_s": step["intra_node_s"] * share,
            "exposed_inter_node_s": step["inter_node_s"] * share}


def hand_memory(cfg, model_cfg, state: dict, mesh: dict[str, int]) -> dict:
    """jaxdist.predict.memory's peak estimate (exact state from `state`, shapes.plan's)."""
    return memory.predict_memory(
        model_cfg, cfg.model.dtype, cfg.train.batch_size, cfg.train.microbatches, mesh,
        state["state_bytes_per_device"], state["state_bytes_global"]["params"],
        program.flash_attention_applies(model_cfg, cfg.model.dtype),
        program.is_stack(model_cfg))


def memory_estimate(cfg, model_cfg, state: dict, flash: bool, mesh: dict[str, int], hw,
                    cpu_temp_bytes: int, gpu_memory: dict | None = None,
                    peak: dict | None = None) -> dict:
    """The memory verdict of a one-program layout: the hand estimate (`peak`, else
    hand_memory's) against the part's HBM; with the XLA:GPU program's buffer assignment
    (`gpu_memory`), that decides the verdict and the hand estimate stands beside it with the
    ratio."""
    peak = peak or hand_memory(cfg, model_cfg, state, mesh)
    if gpu_memory:
        return time_model.gpu_memory_verdict(peak, gpu_memory, hw)
    return time_model.memory_verdict(peak, cpu_temp_bytes, hw)


def pipeline_memory(memory_plan: dict, hw, compiled_working: float | None = None) -> dict:
    """The memory verdict of a pipeline: the pipeline memory plan's worst stage (exact state,
    activations stashed per the schedule table) against the part's HBM. The working set of
    one chunk's backward: XLA:GPU's temporaries of that op (`compiled_working`, extrapolated
    to the chunk's blocks) where compiled for a GPU, else the hand estimate."""
    stages = memory_plan["stages"]
    if compiled_working is not None:
        stages = [{**s, "activation_working_hand": s["activation_working"],
                   "activation_working": int(compiled_working),
                   "total": s["total"] - s["activation_working"] + int(compiled_working)}
                  for s in stages]
    worst = max(stages, key=lambda s: s["total"])
    # padded slots (--pp-stage-blocks): state and gradients the stage holds
    state_bytes = (worst["params"] + worst["opt"] + worst.get("master", 0) +
                   worst.get("padding_state", 0))
    need = worst["total"]
    fits = need <= hw.hbm_bytes
    working = ("one chunk's backward from XLA:GPU's buffer assignment of that op"
               if compiled_working is not None else
               "one chunk's backward by Korthikanti et al. 2022")
    return {"label": time_model.LABEL, "state_bytes": state_bytes,
            "gradient_bytes": worst["gradients"] + worst.get("padding_gradients", 0),
            "temp_bytes": worst["activation_stash"] + worst["activation_working"],
            "temp_note": f"activations per stage: stash counted from the schedule table, "
                         f"working set of {working} (jaxdist.plan.pipeline_shapes)",
            "total_bytes": need, "hbm_bytes": hw.hbm_bytes, "fits": fits,
            "fits_reason": None if fits else "state + gradients + activations of stage "
                                             f"{worst['stage']} exceed HBM",
            "over_by_bytes": max(0, need - hw.hbm_bytes),
            "headroom_bytes": max(0, hw.hbm_bytes - need), "stages": stages}


def predict_pipeline_plan(cfg, shape: MeshShape, hw, cache: dict | None = None) -> dict:
    """pp, tp_pp, fsdp_pp: the step tick by tick from the executed schedule table
    (jaxdist.predict.pipeline); memory from the pipeline memory plan (exact state per stage,
    activations estimated), against the part's HBM."""
    from jaxdist.plan.pipeline_shapes import plan_pipeline
    from jaxdist.predict.pipeline import pipeline_step

    model_cfg, _ = build_model(cfg)
    memory_plan = memo(cache, ("pipeline plan", repr(cfg.model), repr(cfg.train),
                               tuple(shape.axis_sizes.items())),
                       lambda: plan_pipeline(cfg, shape))
    mesh = dict(shape.axis_sizes)
    n = shape.size
    target = compiled.for_part(hw, n, cfg.compiler.compiler)
    pred = pipeline_step(cfg, model_cfg, mesh, hw, cache, target)
    tokens = model_cfg.tokens_per_sample
    batch = cfg.train.batch_size
    return {
        "label": time_model.LABEL, "dry_run": True, "settings": plan_settings(cfg, model_cfg),
        "layout": cfg.train.layout, "mesh": mesh,
        "distributed_optimizer": memory_plan["distributed_optimizer"],
        "state_bytes_per_device": memory_plan["state_bytes_per_device"],  # exact, by part
        "model": memory_plan["model"], "batch_size": batch,
        "hardware": {**hw.prediction_fields(), "nodes": -(-n // hw.gpus_per_node)},
        "links": time_model.axis_links(mesh, hw, compiled.mesh_hosts(shape, target)),
        "constants": {k: {"value": c.value, "why": c.why} for k, c in MODEL_CONSTANTS.items()},
        "compiled": {"compiler": target.label, "gpu": target.gpu,
                     "xla_flags": cfg.compiler.xla_flags, "method": pred["method"], "flops_per_device": pred["flops_per_device"],
                     "ops": pred["ops"], "flash_attention": pred["ops"]["flash_attention"]},
        "pipeline": {**pred["schedule"], "blocks_per_chunk": pred["blocks_per_chunk"],
                     **pred["time"]["pipeline"]},
        "memory": pipeline_memory(memory_plan, hw, pred.get("working_temp_bytes")),
        "time": pred["time"],
        "throughput": time_model.throughput(pred["time"], tokens * batch if tokens else None,
                                       model_cfg.flops_per_sample() * batch, n),
    }


def memory_line(p: dict) -> str:
    """The memory verdict in words: jaxdist.predict.memory's estimate for one program, the
    pipeline memory plan's worst stage for a pipeline."""
    from jaxdist.summary import human_bytes

    mem = p["memory"]
    verdict = {True: "fits", False: f"OOM: {mem['fits_reason']}"}.get(
        mem["fits"], f"unknown: {mem['fits_reason']}")
    if "terms" in mem:  # XLA:GPU's buffer assignment beside the hand estimate
        c = mem["compiler"]
        terms = "; ".join(f"{t['term']} {human_bytes(t['compiler_bytes'])} vs "
                          f"{human_bytes(t['hand_bytes'])}" +
                          (f" ({t['hand_over_compiler']:.2f})" if t["hand_over_compiler"]
                           else "") for t in mem["terms"])
        return (f"  memory per device ({mem['source']}): {human_bytes(mem['total_bytes'])} of "
                f"{human_bytes(mem['hbm_bytes'])} HBM -> {verdict}\n"
                f"    XLA:GPU buffer assignment: arguments {human_bytes(c['argument_bytes'])} + "
                f"outputs {human_bytes(c['output_bytes'])} - aliased "
                f"{human_bytes(c['alias_bytes'])} + temporaries {human_bytes(c['temp_bytes'])}"
                f" = {human_bytes(c['peak_bytes'])} (planned for {human_bytes(mem['hbm_bytes'])}"
                f"); hand estimate {human_bytes(mem['hand_estimate_bytes'])}\n"
                f"    term by term, XLA vs hand (hand / XLA): {terms}; {mem['source_note']}"
                + host_line(mem, c.get("host_temp_bytes", 0)))
    if "pipeline" in p:
        parts = (f"gradients {human_bytes(mem['gradient_bytes'])} + activations (worst stage: "
                 f"stash + one chunk's backward) {human_bytes(mem['temp_bytes'])}")
        cpu = ""
    else:
        parts = (f"gradients {human_bytes(mem['gradient_bytes'])} + saved activations "
                 f"{human_bytes(mem['residual_bytes'])} + working set "
                 f"{human_bytes(mem['transient_bytes'])}")
        cpu = (f" (XLA:CPU's temp bytes, an upper bound: "
               f"{human_bytes(mem['cpu_compiler_temp_bytes'])})")
    return (f"  memory per device: state {human_bytes(mem['state_bytes'])} (exact) + {parts} = "
            f"{human_bytes(mem['total_bytes'])} of {human_bytes(mem['hbm_bytes'])} HBM -> "
            f"{verdict}{cpu}" + host_line(mem))


def host_line(mem: dict, compiler_host_bytes: float | None = None) -> str:
    """The saved activations an offloading remat policy keeps in host memory (not HBM), or
    '' where nothing is offloaded."""
    from jaxdist.summary import human_bytes

    hand = mem.get("host_residual_bytes", 0)
    if not hand and not compiler_host_bytes:
        return ""
    xla = ("" if compiler_host_bytes is None else
           f"XLA:GPU's host buffers {human_bytes(compiler_host_bytes)}, ")
    return (f"\n    offloaded to host memory (remat policy), not in HBM: {xla}hand estimate "
            f"{human_bytes(hand)} per device")


def next_steps(p: dict) -> list[str]:
    """What would bring a plan that does not fit (OOM or unknown) under HBM, from its own
    settings: the levers a user has, cheapest first."""
    if p["memory"]["fits"] is True:
        return []
    cfg = p.get("settings", {})
    if p["memory"].get("fits_reason", "").startswith("the train state alone"):
        more = "more devices on fsdp or a layout that shards the state further (fsdp, fsdp_tp)"
        return [f"the state alone is over HBM: {more}"]
    hints = []
    if cfg.get("dtype") == "float32":
        hints.append("--dtype bfloat16 (half the activations)")
    if cfg.get("remat") == "none" and cfg.get("decoder"):
        hints.append("--remat full (keeps only block inputs)")
    if cfg.get("attention") == "default" and cfg.get("decoder"):
        hints.append("--model-opts attention=cudnn (flash attention: no L x L scores)")
    if "pipeline" in p:
        hints.append(f"more micro-batches (--microbatches {2 * cfg.get('microbatches', 1)}: "
                     f"smaller activations per slot) or more stages")
    else:
        hints.append(f"--microbatches {2 * cfg.get('microbatches', 1)} (activations of one "
                     f"slice at a time)")
    return hints


def format_prediction(p: dict) -> str:
    hw, t, thr = p["hardware"], p["time"], p["throughput"]
    mesh = " x ".join(f"{k}={v}" for k, v in p["mesh"].items())
    ms = 1e3
    lines = [
        f"PREDICTED (not measured): {p['model']['name']} ({p['model']['params']:,} params), "
        f"layout {p['layout']}{dist_opt_text(p)}, mesh {mesh} on {hw['name']} ({hw['nodes']} node(s) of "
        f"{hw['gpus_per_node']}), global batch {p['batch_size']}",
        f"  compiler: {p['compiled'].get('compiler', 'XLA:CPU on simulated CPU devices')}; "
        f"{p['compiled']['method']}" +
        ("; L x L attention scores removed (flash attention on the GPU)"
         if p["compiled"]["flash_attention"] else "") +
        (f"; Triton GEMMs off ({p['compiled']['fallback']['xla_flags']}): XLA:GPU found no "
         f"Triton tiling for a dot" if p["compiled"].get("fallback") else ""),
        *(["  links per axis: " + "; ".join(f"{a}: {v['links']}" for a, v in
                                             p["links"].items())] if p.get("links") else []),
        memory_line(p),
        f"  time per step, kernel by kernel from the program (published rates x the "
        f"fitted kernel efficiency {t.get('kernel_efficiency', 0):.3f}): compute-bound kernels "
        f"{t['compute_s'] * ms:.1f} ms, memory-bound {t['hbm_s'] * ms:.1f} ms, launches "
        f"{t['launch_s'] * ms:.1f} ms; intra-node comm {t['intra_node_s'] * ms:.1f} ms, "
        f"inter-node {t['inter_node_s'] * ms:.1f} ms, exposed {t['comm_exposed_s'] * ms:.1f} ms "
        f"(where XLA's schedule leaves it uncovered)" + (
            f"; host memory copies (remat offload, PCIe) {t['host_transfer_s'] * ms:.1f} ms, "
            f"{t['exposed_host_transfer_s'] * ms:.1f} ms of it uncovered (in the step)"
            if t.get("host_transfer_s") else "") if "launch_s" in t else
        f"  time per step: compute {t['compute_s'] * ms:.1f} ms, HBM {t['hbm_s'] * ms:.1f} ms, "
        f"intra-node comm {t['intra_node_s'] * ms:.1f} ms, inter-node comm "
        f"{t['inter_node_s'] * ms:.1f} ms (exposed {t['comm_exposed_s'] * ms:.1f} ms; "
        f"overlap: {t['overlap']}), bubble {t['bubble_s'] * ms:.1f} ms",
        f"  predicted step {t['step_s'] * ms:.1f} ms; bottleneck: {t['bottleneck']}",
    ]
    if "pipeline" in p:
        pp = p["pipeline"]
        lines.insert(-1, f"  pipeline {pp['schedule']} S={pp['stages']} V={pp['virtual']} "
                         f"M={pp['microbatches']}: {pp['ticks']} ticks, {pp['ticks_s'] * ms:.1f} "
                         f"ms (stage {pp['critical_stage']} busy "
                         f"{pp['critical_stage_work_s'] * ms:.1f} ms); stage sends "
                         f"{pp['send_intra_node_s'] * ms:.1f} ms intra-node, "
                         f"{pp['send_inter_node_s'] * ms:.1f} ms inter-node; timed as "
                         f"{pp['runtime']} runs it (jaxdist's ticks "
                         f"{pp['lockstep_s'] * ms:.1f} ms; what-if, Megatron's dataflow "
                         f"{pp['dataflow_s'] * ms:.1f} ms; --pp-runtime)")
        lines.insert(-1, f"  bubble, two ways: {pp['schedule_bubble']:.1%} of stage time idle "
                         f"(counted from the schedule table: " + (
                             "the formula's figure" if len(set(pp.get("stage_blocks", ()))) < 2
                             else "with the stages of fewer blocks waiting") + "); "
                         f"{pp['bubble_fraction_of_ticks']:.1%} of the predicted tick time "
                         f"(each tick weighted by its predicted duration)")
    if p["compiled"].get("kernels"):
        from jaxdist.program.kernels import format_inventory
        lines.append("  kernels per step per device (the compiled program):")
        lines += format_inventory({"kernels": p["compiled"]["kernels"]})
    # an FP8 plan's MFU is against the bf16 peak, as NeMo and MaxText report it
    basis = " (against the bf16 peak)" if p.get("settings", {}).get("dtype") == "float8" else ""
    speed = (f"{thr['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {thr['mfu']:.1%}{basis}"
             if thr["tokens_per_s_per_gpu"] is not None else f"MFU {thr['mfu']:.1%}{basis}")
    hints = next_steps(p)
    if thr.get("if_it_fit"):  # the verdict is the result; the speed only a what-if
        lines.append(f"  if it fit: {speed} (it does not: memory above)")
        mem = p["memory"]
        lines.append(f"  predicted: does not fit ({mem['fits_reason']}); to fit: "
                     f"{'; '.join(hints) or 'a larger part or more devices'}")
        return "\n".join(lines)
    if hints:
        lines.append(f"  to fit: {'; '.join(hints)}")
    lines.append(f"  predicted {speed}")
    return "\n".join(lines)
