"""A real run's own prediction, beside its measurement (results.json `prediction`), so the
time model is checked every time a cluster run happens.

Which part: `--hardware PART` when given, else the part whose `device_kind` the devices
report (jaxdist.parts: "NVIDIA H200" -> h200, ...). None of them (e.g. a CPU run without
--hardware): the block says why there is no prediction.

From what: the prediction of the same job on that part (`job.on_part`, through
jaxdist.predict.prediction.predict), the one `--dry-run --hardware PART` prints: its step
time, throughput and memory verdict, so a run's measured / predicted ratio checks the
predictor plans use. The ratios are measured / predicted.

When: the loop makes it once its timed steps are done (jaxdist.loop_hooks.Prediction), so
its compile is never timed; results.json records that compile's seconds (`compile_s`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from jaxdist.errors import UsageError
from jaxdist.hardware import check_nodes
from jaxdist.parts import PREDICTABLE, part_for_device_kind
from jaxdist.predict import time_model
from jaxdist.predict.prediction import predict
from jaxdist.program import compiled as compiled_mod


def _ratio(measured, predicted):
    return measured / predicted if measured and predicted else None


def power_beside(step, part, gpus: int, measured: dict) -> dict[str, float | None]:
    """{"predicted", "measured"}: the predicted average W per GPU of the step on `part`
    (jaxdist.predict.power; None on a part without a power record) and the run's measured
    one (its power block's total draw over its GPUs; None where it measured none)."""
    from jaxdist.predict.power import plan_power
    predicted = plan_power(step, part, gpus, None, None)
    gpus_measured = len(measured.get("gpus") or ())
    return {"predicted": predicted.gpu_avg_w if predicted else None,
            "measured": (measured["avg_w"] / gpus_measured
                         if measured.get("available") and measured.get("avg_w") and
                         gpus_measured else None)}


@dataclasses.dataclass(frozen=True)
class OwnPrediction:
    """A run's prediction of itself: the plan of its job on its part (`prediction`), or why
    there is none (`reason`); `compile_s` is the seconds the plan took (its XLA:GPU compile
    for the part's cluster), spent after the run's timed steps."""
    prediction: Any = None
    reason: str | None = None
    part: Any = None
    source: str = ""
    name: str = ""
    compile_s: float = 0.0
    started_unix_s: float = 0.0

    @classmethod
    def of(cls, job, platform) -> "OwnPrediction":
        """The prediction of `job`'s step on its part: --hardware's, else the one the devices
        report (device_kind); never failing the run it is made for."""
        started, start = time.time(), time.perf_counter()
        try:
            made = cls._make(job, platform)
        except Exception as e:  # the run's measurement stands; say why there is no prediction
            made = cls(reason=f"the prediction failed: {type(e).__name__}: {e}")
        return dataclasses.replace(made, compile_s=time.perf_counter() - start,
                                   started_unix_s=started)

    @classmethod
    def _make(cls, job, platform) -> "OwnPrediction":
        name, source = job.output.hardware, "--hardware"
        if not name:
            name, source = part_for_device_kind(platform.device_kind), "device_kind"
        if not name:
            return cls(reason=f"device_kind {platform.device_kind!r} ({platform.backend}) is "
                              f"no part of jaxdist.parts ({', '.join(PREDICTABLE)}); give "
                              f"--hardware PART to predict it anyway")
        try:
            planned = job.with_shape(platform.shape).on_part(name)
            check_nodes(planned.part, len(platform.devices))
        except UsageError as e:
            return cls(reason=str(e))
        hw = planned.part
        if hw.peak_flops(job.dtype, job.matmul_precision) is None:
            return cls(reason=f"{hw.name} has no {job.dtype} peak in jaxdist.parts")
        if jax.process_count() > 1 and compiled_mod.gpu_compiler_missing():
            return cls(reason="without the GPU compiler the plan compiles on this process's "
                              "simulated devices, and this run has several processes (use "
                              "experiments.run --dry-run --hardware on one host)")
        # The same job on the part, through the one prediction plans print
        return cls(predict(planned), part=hw, source=source, name=name)

    def to_json(self, platform, results: dict) -> dict:
        """results["prediction"]: the predicted step, tokens/s per GPU and memory per device
        on the part, the measured ones (from `results`' blocks), and measured / predicted;
        or why there is none."""
        if self.prediction is None:
            return {"label": time_model.LABEL, "available": False, "reason": self.reason}
        pred, hw, name = self.prediction, self.part, self.name
        n = len(platform.devices)
        step, memory, thr = pred.time, pred.memory, pred.throughput
        measured_step = (results.get("step_time_s") or {}).get("mean")
        measured_tps = (results.get("throughput") or {}).get("tokens_per_s")
        measured_tps_gpu = measured_tps / n if measured_tps else None
        peak = results["memory"].get("measured_peak_bytes")
        simulated = platform.simulated or platform.backend == "cpu"
        power = power_beside(step, hw, n, results.get("power") or {})
        return {
            "label": time_model.LABEL, "available": True, "hardware": hw.name,
            "source": self.source, "compiler": pred.compiler,
            "basis": f"the plan of this job on {hw.name} (experiments.run --dry-run --hardware "
                     f"{name}): its step compiled by {pred.compiler}, through "
                     f"jaxdist.predict",
            "predicted": {"step_s": pred.step_s,
                          "tokens_per_s_per_gpu": thr.tokens_per_s_per_gpu, "mfu": thr.mfu,
                          "memory_bytes_per_device": memory.total_bytes,
                          "fits": pred.fits, "verdict": pred.verdict,
                          "bottleneck": step.bottleneck,
                          "compute_s": step.compute_s, "hbm_s": step.hbm_s,
                          "intra_node_s": step.intra_node_s,
                          "inter_node_s": step.inter_node_s,
                          "comm_exposed_s": step.comm_exposed_s, "bubble_s": step.bubble_s,
                          "gpu_avg_w": power["predicted"]},
            "measured": {"step_s": measured_step, "tokens_per_s_per_gpu": measured_tps_gpu,
                         "peak_bytes_per_device": peak, "gpu_avg_w": power["measured"]},
            "measured_over_predicted": {
                "step_s": _ratio(measured_step, pred.step_s),
                "tokens_per_s_per_gpu": _ratio(measured_tps_gpu, thr.tokens_per_s_per_gpu),
                "memory": _ratio(peak, memory.total_bytes),
                "gpu_avg_w": _ratio(power["measured"], power["predicted"])},
            "note": (f"measured on {platform.backend} "
                     f"({'simulated devices' if platform.simulated else platform.device_kind}"
                     f"), predicted for {hw.name}: the ratios check the plumbing, not the "
                     f"model" if simulated else None),
            "compile_s": self.compile_s, "started_unix_s": self.started_unix_s}
