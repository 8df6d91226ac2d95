"""`--dry-run --hardware NAME`: the step compiled for the real mesh on simulated CPU devices,
turned into a predicted memory verdict and step time on NAME (jaxdist.predict.model)."""

from __future__ import annotations

from jaxdist import dryrun
from jaxdist.errors import UsageError
from jaxdist.hardware import MODEL_CONSTANTS, get_hardware
from jaxdist.mesh import MeshShape
from jaxdist.predict import memory, model, program
from models.build import build_model
from sharding.pipeline import PIPELINE_LAYOUTS


def predict_plan(cfg, shape: MeshShape, blocks: str = "auto") -> dict:
    hw = get_hardware(cfg.output.hardware, cfg.output.gpus_per_node)
    if cfg.train.layout in PIPELINE_LAYOUTS:
        raise UsageError(f"--hardware does not predict pipeline layouts yet "
                         f"({', '.join(PIPELINE_LAYOUTS)}); use --dry-run without it for "
                         f"their memory plan")
    if hw.peak_flops(cfg.model.dtype, cfg.model.matmul_precision) is None:
        raise UsageError(f"{hw.name} has no {cfg.model.dtype} peak in jaxdist.metrics.PEAKS")
    model_cfg, _ = build_model(cfg)
    state = dryrun.plan(cfg, shape)
    figures = program.step_figures(cfg, model_cfg, shape, blocks)
    temp, bytes_accessed = figures["memory"].get("temp_bytes", 0), figures["bytes_accessed"]
    quadratic = None
    if program.flash_attention_applies(model_cfg, cfg.model.dtype):
        quadratic = program.attention_scores(cfg, model_cfg, shape, figures.get("depth_1"),
                                             figures.get("depth_2"))
        temp -= max(0.0, quadratic["temp_bytes"])
        bytes_accessed -= max(0.0, quadratic["bytes_accessed"])
    mesh = dict(shape.axis_sizes)
    n = shape.size
    # --- memory: jaxdist.predict.memory's peak estimate decides fits/OOM (predacc) ---
    peak = memory.predict_memory(
        model_cfg, cfg.model.dtype, cfg.train.batch_size, cfg.train.microbatches, mesh,
        state["state_bytes_per_device"], state["state_bytes_global"]["params"],
        quadratic is not None, program.is_stack(model_cfg))
    # --- end memory ---
    step = model.step_time(figures["flops"], bytes_accessed, figures["comm"], hw,
                           mesh, cfg.model.dtype, cfg.compiler.overlap, shape.stage,
                           cfg.train.microbatches, cfg.model.matmul_precision)
    tokens = model_cfg.tokens_per_sample
    batch = cfg.train.batch_size
    return {
        "label": model.LABEL,
        "dry_run": True,
        "layout": cfg.train.layout,
        "mesh": mesh,
        "model": state["model"],
        "batch_size": batch,
        "hardware": {**{k: v for k, v in vars(hw).items()}, "nodes": -(-n // hw.gpus_per_node)},
        "constants": {k: {"value": c.value, "why": c.why} for k, c in MODEL_CONSTANTS.items()},
        "compiled": {"method": figures["method"], "flops_per_device": figures["flops"],
                     "bytes_accessed_per_device": figures["bytes_accessed"],
                     "memory": figures["memory"],
                     "flash_attention": None if quadratic is None else {
                         "removed_score_temp_bytes": max(0.0, quadratic["temp_bytes"]),
                         "removed_score_bytes_accessed": max(0.0, quadratic["bytes_accessed"]),
                         "why": "a GPU runs bf16 attention as cuDNN flash attention, which "
                                "keeps no L x L scores; XLA:CPU keeps them"}},
        "memory": model.memory_verdict(peak, int(max(0.0, temp)), hw),  # predacc
        "time": step,
        "throughput": model.throughput(step, tokens * batch if tokens else None,
                                       model_cfg.flops_per_sample() * batch, n),
    }


def format_prediction(p: dict) -> str:
    from jaxdist.writers import human_bytes

    hw, mem, t, thr = p["hardware"], p["memory"], p["time"], p["throughput"]
    mesh = " x ".join(f"{k}={v}" for k, v in p["mesh"].items())
    ms = 1e3
    lines = [
        f"PREDICTED (not measured): {p['model']['name']} ({p['model']['params']:,} params), "
        f"layout {p['layout']}, mesh {mesh} on {hw['name']} ({hw['nodes']} node(s) of "
        f"{hw['gpus_per_node']}), global batch {p['batch_size']}",
        f"  step compiled on simulated CPU devices: {p['compiled']['method']}" +
        ("; L x L attention scores removed (flash attention on the GPU)"
         if p["compiled"]["flash_attention"] else ""),
        # predacc: the memory line is jaxdist.predict.memory's estimate
        f"  memory per device: state {human_bytes(mem['state_bytes'])} (exact) + gradients "
        f"{human_bytes(mem['gradient_bytes'])} + saved activations "
        f"{human_bytes(mem['residual_bytes'])} + working set "
        f"{human_bytes(mem['transient_bytes'])} = {human_bytes(mem['total_bytes'])} of "
        f"{human_bytes(mem['hbm_bytes'])} HBM -> " +
        {True: "fits", False: f"OOM: {mem['fits_reason']}"}.get(
            mem["fits"], f"unknown: {mem['fits_reason']}") +
        f" (XLA:CPU's temp bytes, an upper bound: {human_bytes(mem['cpu_compiler_temp_bytes'])})",
        f"  time per step: compute {t['compute_s'] * ms:.1f} ms, HBM {t['hbm_s'] * ms:.1f} ms, "
        f"intra-node comm {t['intra_node_s'] * ms:.1f} ms, inter-node comm "
        f"{t['inter_node_s'] * ms:.1f} ms (exposed {t['comm_exposed_s'] * ms:.1f} ms; "
        f"overlap: {t['overlap']}), bubble {t['bubble_s'] * ms:.1f} ms",
        f"  predicted step {t['step_s'] * ms:.1f} ms; bottleneck: {t['bottleneck']}",
    ]
    if thr["tokens_per_s_per_gpu"] is not None:
        lines.append(f"  predicted {thr['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                     f"MFU {thr['mfu']:.1%}")
    else:
        lines.append(f"  predicted MFU {thr['mfu']:.1%}")
    return "\n".join(lines)
