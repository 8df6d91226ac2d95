"""A real run's own prediction, beside its measurement (results.json `prediction`), so the
time model is checked every time a cluster run happens.

Which part: `--hardware PART` when given, else the part whose `device_kind` the devices
report (jaxdist.parts: "NVIDIA H200" -> h200, ...). None of them (e.g. a CPU run without
--hardware): the block says why there is no prediction.

From what: the run's own compiled step, for the devices it ran on (on a GPU, XLA:GPU's
program: its FLOPs, bytes accessed, collectives and temporaries), through the same model
as `--dry-run --hardware` (jaxdist.predict.time_model). Pipeline layouts: the tick model
(jaxdist.predict.pipeline), its op pieces compiled on the run's devices (one process only).
The ratios are measured / predicted.
"""

from __future__ import annotations

import jax

from jaxdist.program import compiled as compiled_mod, program_reading
from jaxdist.errors import UsageError
from jaxdist.hardware import check_nodes, get_hardware
from jaxdist.parts import NAMED, PREDICTABLE
from jaxdist.predict import time_model
from jaxdist.predict.program import flash_attention_applies
from sharding.pipeline import PIPELINE_LAYOUTS


def part_for_device_kind(device_kind: str | None) -> str | None:
    """The predicted part (jaxdist.parts) whose device_kind string the device reports, exactly
    (case and surrounding spaces aside); None when none does."""
    kind = (device_kind or "").strip().lower()
    for name in PREDICTABLE:
        if NAMED[name].device_kind.lower() == kind:
            return name
    return None


def absent(reason: str) -> dict:
    return {"label": time_model.LABEL, "available": False, "reason": reason}


def _ratio(measured, predicted):
    return measured / predicted if measured and predicted else None


def run_memory(cfg, model_cfg, shape, mesh: dict, hw, cpu_temp_bytes: int) -> dict:
    """The predicted memory of this run's layout on the part, as the dry-run plan predicts
    it (the run's own compiled temporaries ride along as XLA's figure)."""
    from jaxdist.plan import shapes
    from jaxdist.plan.predicted import memory_estimate, pipeline_memory

    if cfg.train.layout in PIPELINE_LAYOUTS:
        from jaxdist.plan.pipeline_shapes import plan_pipeline
        return pipeline_memory(plan_pipeline(cfg, shape), hw)
    return memory_estimate(cfg, model_cfg, shapes.plan(cfg, shape),
                           flash_attention_applies(model_cfg, cfg.model.dtype), mesh, hw,
                           cpu_temp_bytes)


def prediction_target(cfg, platform, hw):
    """Where the prediction's program comes from: a GPU run's own devices; for a simulated
    run, XLA:GPU for `hw`'s topology when the GPU compiler is here (--compiler auto/gpu),
    else the run's own simulated devices (XLA:CPU)."""
    if platform.backend == "gpu" or cfg.compiler.compiler == "cpu" or \
            compiled_mod.gpu_compiler_missing() or hw.target is None:
        return compiled_mod.run_devices(platform)
    return compiled_mod.gpu_topology(hw, len(platform.devices))


def safe_prediction_block(cfg, platform, model_cfg, program, compiled, results: dict) -> dict:
    """prediction_block, never failing the run it is added to: an error becomes the reason."""
    flops = (results.get("mfu") or {}).get("compiled_flops_per_step")
    try:
        return prediction_block(cfg, platform, model_cfg, program, compiled, results,
                                flops / len(platform.devices) if flops else None)
    except Exception as e:  # the run's measurement stands; say why there is no prediction
        return absent(f"the prediction failed: {type(e).__name__}: {e}")


def prediction_block(cfg, platform, model_cfg, program, compiled, results: dict,
                     step_flops: float | None) -> dict:
    """results["prediction"]: the predicted step, tokens/s per GPU and memory per device on
    the part, the measured ones, and measured / predicted."""
    name, source = cfg.output.hardware, "--hardware"
    if not name:
        name, source = part_for_device_kind(platform.device_kind), "device_kind"
    if not name:
        return absent(f"device_kind {platform.device_kind!r} ({platform.backend}) is no part "
                      f"of jaxdist.parts ({', '.join(PREDICTABLE)}); give --hardware PART "
                      f"to predict it anyway")
    try:
        hw = get_hardware(name, cfg.output.gpus_per_node)
        check_nodes(hw, len(platform.devices))
    except UsageError as e:
        return absent(str(e))
    if hw.peak_flops(cfg.model.dtype, cfg.model.matmul_precision) is None:
        return absent(f"{hw.name} has no {cfg.model.dtype} peak in jaxdist.parts")
    mesh = dict(program.batch_sharding.mesh.shape)
    n = len(platform.devices)
    mem = results["memory"]
    temp = (mem.get("compiled") or {}).get("temp_bytes") or 0
    target = prediction_target(cfg, platform, hw)
    if cfg.train.layout in PIPELINE_LAYOUTS:
        if jax.process_count() > 1:
            return absent("pipeline layouts are predicted from op pieces compiled on one "
                          "process's devices; this run has several processes (use --dry-run "
                          "--hardware)")
        from jaxdist.predict.pipeline import pipeline_step
        step = pipeline_step(cfg, model_cfg, mesh, hw, target=target)["time"]
    else:
        if target.device_less:  # a simulated run predicted from XLA:GPU's program for hw
            from jaxdist.predict.program import figures
            fig = figures(cfg, model_cfg, platform.shape, target)
            flops, bytes_accessed, ops = fig["flops"], fig["bytes_accessed"], fig["comm"]
        else:  # the run's own compiled step
            reading = program_reading.read(compiled, target, mesh, step_flops=step_flops)
            flops, bytes_accessed = reading["flops"], reading["bytes_accessed"]
            ops = time_model.aggregate(reading["collectives"])
        if not flops:
            return absent(f"{target.compiler}'s program gave no FLOPs for this step, so no "
                          f"compute time can be predicted")
        step = time_model.step_time(flops, bytes_accessed, ops, hw, mesh, cfg.model.dtype,
                               cfg.compiler.overlap,
                               matmul_precision=cfg.model.matmul_precision)
    batch = cfg.train.batch_size
    tokens = model_cfg.tokens_per_sample
    thr = time_model.throughput(step, tokens * batch if tokens else None,
                           model_cfg.flops_per_sample() * batch, n)
    memory = run_memory(cfg, model_cfg, platform.shape, mesh, hw, int(temp))
    measured_step = (results.get("step_time_s") or {}).get("mean")
    measured_tps = (results.get("throughput") or {}).get("tokens_per_s")
    measured_tps_gpu = measured_tps / n if measured_tps else None
    peak = mem.get("measured_peak_bytes")
    simulated = platform.simulated or platform.backend == "cpu"
    return {
        "label": time_model.LABEL, "available": True, "hardware": hw.name, "source": source,
        "compiler": target.label,
        "basis": f"this run's step compiled by {target.label}, through "
                 f"jaxdist.predict.time_model" + (" (pipeline: the tick model, its op pieces "
                                             "compiled there)"
                                             if "pipeline" in step else ""),
        "predicted": {"step_s": step["step_s"],
                      "tokens_per_s_per_gpu": thr["tokens_per_s_per_gpu"], "mfu": thr["mfu"],
                      "memory_bytes_per_device": memory["total_bytes"],
                      "fits": memory["fits"], "bottleneck": step["bottleneck"],
                      "compute_s": step["compute_s"], "hbm_s": step["hbm_s"],
                      "intra_node_s": step["intra_node_s"],
                      "inter_node_s": step["inter_node_s"],
                      "comm_exposed_s": step["comm_exposed_s"], "bubble_s": step["bubble_s"]},
        "measured": {"step_s": measured_step, "tokens_per_s_per_gpu": measured_tps_gpu,
                     "peak_bytes_per_device": peak},
        "measured_over_predicted": {
            "step_s": _ratio(measured_step, step["step_s"]),
            "tokens_per_s_per_gpu": _ratio(measured_tps_gpu, thr["tokens_per_s_per_gpu"]),
            "memory": _ratio(peak, memory["total_bytes"])},
        "note": (f"measured on {platform.backend} "
                 f"({'simulated devices' if platform.simulated else platform.device_kind}), "
                 f"predicted for {hw.name}: the ratios check the plumbing, not the model"
                 if simulated else None),
    }
