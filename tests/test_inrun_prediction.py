"""A real run's results.json carries the time model's prediction beside the measurement
(jaxdist.predict.inrun): with --hardware, or when the devices' device_kind is a known part
(faked here on CPU); without either, it says why there is none. TensorBoard gets the
predicted figures under `predicted/`. CPU timings here are functional only."""

import dataclasses

import jax
import pytest

from jaxdist.config import (CompilerConfig, LoopConfig, MeshConfig, ModelConfig, OutputConfig,
                            RunConfig, TrainConfig)
from jaxdist.devices import Platform
from jaxdist.mesh import parse_mesh
from jaxdist.predict.inrun import part_for_device_kind
from jaxdist.record import RunRecord, check
from tests.helpers import job_of, read_scalars, run_cli, run_loop


def test_device_kind_to_part():
    # The strings jax reports as device_kind (the ones jaxdist.parts' records
    # key on, e.g. "NVIDIA H100 80GB HBM3" on a DGX H100).
    assert part_for_device_kind("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert part_for_device_kind("NVIDIA H200") == "h200"
    assert part_for_device_kind(" nvidia a100-sxm4-80gb ") == "a100-sxm-80gb"
    assert part_for_device_kind("cpu") is None
    assert part_for_device_kind(None) is None


def test_cpu_run_says_why_there_is_no_prediction(tmp_path):
    r = run_cli("--layout", "ddp", "--mesh", "2", "--model", "mlp-tiny", "--steps", "2",
                "--warmup", "1", "--logdir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    results = RunRecord.load(tmp_path / "run").results
    p = results["prediction"]
    assert p["label"] == "predicted" and p["available"] is False
    assert p["reason"].startswith("device_kind 'cpu' (cpu) is no part of jaxdist.parts")
    assert check(results) == []
    assert RunRecord.load(tmp_path / "run").prediction is None
    assert not [t for t in read_scalars(tmp_path / "run") if t.startswith("predicted/")]


def test_hardware_on_a_real_run_carries_prediction_and_ratio(tmp_path):
    r = run_cli("--layout", "fsdp", "--mesh", "2", "--model", "gpt-tiny", "--steps", "2",
                "--warmup", "1", "--batch-size", "4", "--hardware", "h200",
                "--logdir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    results = RunRecord.load(tmp_path / "run").results
    assert check(results) == []
    p = RunRecord.load(tmp_path / "run").prediction
    assert (p["label"], p["hardware"], p["source"]) == ("predicted", "h200", "--hardware")
    measured, predicted = p["measured"], p["predicted"]
    assert measured["step_s"] == results["step_time_s"]["mean"]
    assert measured["tokens_per_s_per_gpu"] == results["throughput"]["tokens_per_s"] / 2
    ratio = p["measured_over_predicted"]
    assert ratio["step_s"] == pytest.approx(measured["step_s"] / predicted["step_s"])
    assert ratio["tokens_per_s_per_gpu"] == pytest.approx(
        measured["tokens_per_s_per_gpu"] / predicted["tokens_per_s_per_gpu"])
    assert ratio["memory"] is None            # CPU has no allocator peak
    assert predicted["memory_bytes_per_device"] >= results["memory"]["state_bytes_per_device"]
    assert "the ratios check the plumbing, not the model" in p["note"]
    # made by the loop's Prediction hook once the timed steps were done: its compile's
    # seconds are recorded, and none of them are in a timed step
    assert p["compile_s"] > 0
    assert p["started_unix_s"] >= results["window"]["end_unix_s"]
    scalars = read_scalars(tmp_path / "run")
    assert scalars["predicted/step_s"] == [(0, pytest.approx(predicted["step_s"], rel=1e-6))]
    assert scalars["predicted/measured_over_predicted_step_s"][0][1] == \
        pytest.approx(ratio["step_s"], rel=1e-6)
    assert not [t for t in scalars if t.startswith("trial/predicted")]


@dataclasses.dataclass(frozen=True)
class FakeGPU(Platform):
    kind: str = ""

    @property
    def device_kind(self) -> str:   # what an H100 SXM reports; the devices stay CPUs
        return self.kind


def run_in_process(layout, mesh, model="gpt-tiny", hardware="", **train):
    shape = parse_mesh(mesh)
    cfg = RunConfig(mesh=MeshConfig(mesh=mesh), model=ModelConfig(model=model),
                    train=TrainConfig(layout=layout, batch_size=8, **train),
                    loop=LoopConfig(warmup=1, steps=1), compiler=CompilerConfig(),
                    output=OutputConfig(hardware=hardware, progress=False))
    platform = FakeGPU("cpu", True, tuple(jax.devices()[:shape.size]), shape,
                       kind="NVIDIA H100 80GB HBM3")
    return run_loop(cfg, platform, None, log=lambda *a: None)


# The fsdp job on 2x2 with no --hardware: its prediction comes from the devices' kind, and
# the plan of the same job for that part is what it must equal. Run once (a run compiles
# the step for CPU and, for the prediction, for XLA:GPU); its two tests share an xdist
# group, so one worker runs it.
_FSDP_RUN: dict = {}
SHARES_FSDP_RUN = pytest.mark.xdist_group("inrun-fsdp-run")


def fsdp_run():
    if not _FSDP_RUN:
        _FSDP_RUN["results"] = run_in_process("fsdp", "2x2")
    return _FSDP_RUN["results"]


@SHARES_FSDP_RUN
def test_known_device_kind_is_predicted_without_flag():
    results = fsdp_run()
    p = results["prediction"]
    assert (p["available"], p["hardware"], p["source"]) == (True, "h100-sxm", "device_kind")
    assert p["measured_over_predicted"]["step_s"] == pytest.approx(
        results["step_time_s"]["mean"] / p["predicted"]["step_s"])


def test_pipeline_run_is_predicted_by_the_tick_model():
    results = run_in_process("pp", "data:1,stage:2", hardware="h200", microbatches=2,
                             pp_schedule="gpipe")
    p = results["prediction"]
    assert p["available"] is True, p.get("reason")
    assert p["predicted"]["bubble_s"] > 0        # 2 stages, 2 micro-batches: S-1 idle ticks


@SHARES_FSDP_RUN
def test_a_run_records_the_plan_of_the_same_job():
    """One prediction path: the run's prediction (its part from the devices' kind, an H100
    SXM) is the plan `--dry-run --hardware h100-sxm` makes of the same job (XLA:GPU for the
    part's topology, device-less, where it is installed)."""
    from jaxdist import plan as plans

    results = fsdp_run()
    p = results["prediction"]
    assert p["available"] is True, p.get("reason")
    cfg = RunConfig(mesh=MeshConfig(mesh="2x2"), model=ModelConfig(model="gpt-tiny"),
                    train=TrainConfig(layout="fsdp", batch_size=8),
                    output=OutputConfig(dry_run=True, hardware="h100-sxm"))
    plan = plans.plan(job_of(cfg, parse_mesh("2x2"))).to_json()
    assert p["predicted"]["step_s"] == plan["time"]["step_s"]
    assert p["predicted"]["memory_bytes_per_device"] == plan["memory"]["total_bytes"]
    assert (p["predicted"]["fits"], p["predicted"]["verdict"]) == (plan["memory"]["fits"],
                                                                  plan["verdict"])
    assert p["compiler"] == plan["compiled"]["compiler"]
