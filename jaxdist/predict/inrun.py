"""A real run's own prediction, beside its measurement (results.json `prediction`), so the
time model is checked every time a cluster run happens.

Which part: `--hardware PART` when given, else the part whose `device_kind` the devices
report (jaxdist.parts: "NVIDIA H200" -> h200, ...). None of them (e.g. a CPU run without
--hardware): the block says why there is no prediction.

From what: the prediction of the same job on that part (jaxdist.predict.prediction.predict),
the one `--dry-run --hardware PART` prints: its step time, throughput and memory verdict, so
a run's measured / predicted ratio checks the predictor plans use. The ratios are measured /
predicted.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxdist.errors import UsageError
from jaxdist.hardware import check_nodes, get_hardware
from jaxdist.parts import PREDICTABLE, part_for_device_kind
from jaxdist.predict import time_model
from jaxdist.predict.prediction import predict
from jaxdist.program import compiled as compiled_mod


def absent(reason: str) -> dict:
    return {"label": time_model.LABEL, "available": False, "reason": reason}


def _ratio(measured, predicted):
    return measured / predicted if measured and predicted else None


def safe_prediction_block(cfg, platform, results: dict) -> dict:
    """prediction_block, never failing the run it is added to: an error becomes the reason."""
    try:
        return prediction_block(cfg, platform, results)
    except Exception as e:  # the run's measurement stands; say why there is no prediction
        return absent(f"the prediction failed: {type(e).__name__}: {e}")


def prediction_block(cfg, platform, results: dict) -> dict:
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
    n = len(platform.devices)
    mem = results["memory"]
    if jax.process_count() > 1 and compiled_mod.gpu_compiler_missing():
        return absent("without the GPU compiler the plan compiles on this process's "
                      "simulated devices, and this run has several processes (use "
                      "experiments.run --dry-run --hardware on one host)")
    # The same job on the part, through the one prediction plans print
    job = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dry_run=True,
                                                              hardware=name))
    pred = predict(job, platform.shape)
    step, memory, thr = pred.time, pred.memory, pred.throughput
    measured_step = (results.get("step_time_s") or {}).get("mean")
    measured_tps = (results.get("throughput") or {}).get("tokens_per_s")
    measured_tps_gpu = measured_tps / n if measured_tps else None
    peak = mem.get("measured_peak_bytes")
    simulated = platform.simulated or platform.backend == "cpu"
    return {
        "label": time_model.LABEL, "available": True, "hardware": hw.name, "source": source,
        "compiler": pred.compiler,
        "basis": f"the plan of this job on {hw.name} (experiments.run --dry-run --hardware "
                 f"{name}): its step compiled by {pred.compiler}, through "
                 f"jaxdist.predict",
        "predicted": {"step_s": pred.step_s,
                      "tokens_per_s_per_gpu": thr["tokens_per_s_per_gpu"], "mfu": thr["mfu"],
                      "memory_bytes_per_device": memory["total_bytes"],
                      "fits": pred.fits, "verdict": pred.verdict,
                      "bottleneck": step["bottleneck"],
                      "compute_s": step["compute_s"], "hbm_s": step["hbm_s"],
                      "intra_node_s": step["intra_node_s"],
                      "inter_node_s": step["inter_node_s"],
                      "comm_exposed_s": step["comm_exposed_s"], "bubble_s": step["bubble_s"]},
        "measured": {"step_s": measured_step, "tokens_per_s_per_gpu": measured_tps_gpu,
                     "peak_bytes_per_device": peak},
        "measured_over_predicted": {
            "step_s": _ratio(measured_step, pred.step_s),
            "tokens_per_s_per_gpu": _ratio(measured_tps_gpu, thr["tokens_per_s_per_gpu"]),
            "memory": _ratio(peak, memory["total_bytes"])},
        "note": (f"measured on {platform.backend} "
                 f"({'simulated devices' if platform.simulated else platform.device_kind}), "
                 f"predicted for {hw.name}: the ratios check the plumbing, not the model"
                 if simulated else None),
    }
