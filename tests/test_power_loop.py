"""The common loop with telemetry: a scripted fake NVML (the real backend code over a fake
library) stands in for a GPU, since none exists here; scripts/gpu_check.sh runs the real one."""

import csv
import time

import jax
import pytest

from jaxdist import loop_hooks, telemetry
from jaxdist.record import RunRecord
from jaxdist.summary import format_summary
from jaxdist.config import (CheckpointConfig, DataConfig, LoopConfig, MeshConfig, ModelConfig,
                            OutputConfig, RunConfig, TrainConfig)
from jaxdist.devices import select_devices
from jaxdist.mesh import MeshShape
from jaxdist.telemetry import fake
from tests.helpers import avg_power_tolerance, read_scalars, run_loop


@pytest.fixture
def fake_gpu(monkeypatch):
    real = telemetry.create_monitor

    def with_fake(cfg, backend=None, *, devices=None, **kw):
        # 2 fake GPUs at a steady 300 W and 250 W, sampled for real by the sampler thread.
        gpus = [fake.FakeGPU(power_w=300.0), fake.FakeGPU(power_w=250.0)]
        return real(cfg, fake.fake_backend(gpus), devices=None, **kw)
    monkeypatch.setattr(telemetry, "create_monitor", with_fake)


def test_loop_fills_the_power_block(tmp_path, fake_gpu):
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(batch_size=16), loop=LoopConfig(warmup=1, steps=40),
                    output=OutputConfig(progress=False))
    results = run_loop(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None)
    power = results["power"]
    assert power["available"] is True
    assert [g["avg_w"] for g in power["gpus"]] == pytest.approx([300.0, 250.0], rel=0.05)
    window_s = power["window"]["duration_s"]
    assert power["avg_w"] == pytest.approx(550.0, rel=avg_power_tolerance(power))
    assert power["energy_integral_j"] == pytest.approx(550.0 * window_s, rel=0.1)
    assert power["window"]["steps"] == 40
    assert power["energy_per_sample_j"] == pytest.approx(power["energy_j"] / (40 * 16))
    # Go et al.'s artifact format: one CSV per metric per GPU, rows epoch_seconds,value.
    rows = list(csv.reader(open(tmp_path / "power" / "gpu_power_0.csv")))
    assert rows and all(len(r) == 2 for r in rows)
    assert float(rows[0][1]) == pytest.approx(300.0)
    assert (tmp_path / "power" / "window.png").stat().st_size > 0
    scalars = read_scalars(tmp_path)
    assert "power/gpu0/power_w" in scalars
    on_disk = RunRecord.load(tmp_path).results
    assert on_disk["power"]["available"] is True


def test_profile_steps_write_a_trace(tmp_path):
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(batch_size=16), loop=LoopConfig(warmup=1, steps=3),
                    output=OutputConfig(progress=False, profile_steps="2:3"))
    results = run_loop(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None)
    assert results["profile"]["steps"] == [2, 3]
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    # Steps 1-3 are timed; 2 and 3 ran under the profiler, and the figures say so.
    assert results["step_time_s"]["n"] == 3
    assert results["step_time_s"]["profiled_note"] == (
        "includes 2 step(s) run under the profiler (steps 2-3)")
    assert "(n=3; includes 2 step(s) run under the profiler" in format_summary(results)
    # The backend still computes after the trace.
    assert jax.jit(lambda x: x * 2)(jax.numpy.arange(3)).tolist() == [0, 2, 4]


def test_energy_window_leaves_out_evaluation_and_checkpoint_saves(tmp_path, fake_gpu,
                                                                  monkeypatch):
    # Evaluation made slow (0.3 s) so that counting it would be plain in the figures.
    real_evaluate = loop_hooks.evaluate

    def slow_evaluate(*args):
        time.sleep(0.3)
        return real_evaluate(*args)
    monkeypatch.setattr(loop_hooks, "evaluate", slow_evaluate)
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    data=DataConfig(dataset="digits", eval_every=4),
                    checkpoint=CheckpointConfig(checkpoint_dir=str(tmp_path / "ck"),
                                                checkpoint_every=5),
                    train=TrainConfig(batch_size=16), loop=LoopConfig(warmup=2, steps=12),
                    output=OutputConfig(progress=False))
    results = run_loop(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None)
    window = results["power"]["window"]
    assert window["window_steps"] == [2, 13] and window["steps"] == 12
    # Steps 0..13 (steps_done 1..14): evaluation after 4, 8, 12 (14 is past the window's
    # last step), checkpoint saves after 5 and 10 (steps_done); all inside the window.
    assert [e["what"] for e in window["excluded"]] == [
        "evaluation after step 3", "checkpoint after step 4", "evaluation after step 7",
        "checkpoint after step 9", "evaluation after step 11"]
    paused = sum(e["duration_s"] for e in window["excluded"])
    assert paused >= 0.9
    assert window["duration_s"] == pytest.approx(window["span_s"] - paused)
    power = results["power"]
    # Steady 550 W: the energy is that of the training time alone, not of the pauses.
    assert power["energy_integral_j"] == pytest.approx(550.0 * window["duration_s"], rel=0.1)
    assert power["energy_integral_j"] < 550.0 * 0.9
    assert [a["step"] for a in results["accuracy"]] == [4, 8, 12, 14]
