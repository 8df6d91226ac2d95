"""The common loop with telemetry: a scripted fake NVML (the real backend code over a fake
library) stands in for a GPU, since none exists here; scripts/gpu_check.sh runs the real one."""

import csv
import json

import jax
import pytest

from jaxdist import loop, telemetry
from jaxdist.config import (LoopConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig,
                            TrainConfig)
from jaxdist.devices import select_devices
from jaxdist.mesh import MeshShape
from jaxdist.telemetry import fake
from tests.helpers import read_scalars


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
    results = loop.run(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None)
    power = results["power"]
    assert power["available"] is True
    assert [g["avg_w"] for g in power["gpus"]] == pytest.approx([300.0, 250.0], rel=0.05)
    assert power["avg_w"] == pytest.approx(550.0, rel=0.05)
    window_s = power["window"]["duration_s"]
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
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["power"]["available"] is True


def test_profile_steps_write_a_trace(tmp_path):
    cfg = RunConfig(mesh=MeshConfig(mesh="2x4"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(batch_size=16), loop=LoopConfig(warmup=1, steps=3),
                    output=OutputConfig(progress=False, profile_steps="2:3"))
    results = loop.run(cfg, select_devices(MeshShape(2, 4)), tmp_path, log=lambda *_: None)
    assert results["profile"]["steps"] == [2, 3]
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    assert jax.devices()  # the backend is still usable after the trace
