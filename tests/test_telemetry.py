"""Power telemetry against the scripted fake NVML: energy math, fallbacks, errors, flags,
RAPL wrap-around, outputs, and the real backend's answer on a machine without a GPU.

A FakeClock drives both the fake driver and the monitor, and the tests call poll() instead
of running the thread, so every number is exact and nothing sleeps (one thread test aside).
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxdist.telemetry import (PowerConfig, create_monitor, energy, memory_snapshot,
                               window_steps)
from jaxdist.telemetry.fake import FakeClock, FakeError, FakeGPU, fake_backend
from jaxdist.telemetry.nvml import gpu_selectors
from jaxdist.telemetry.rapl import RaplMeter, delta_uj, discover
from tests.helpers import read_scalars

DT = 0.05  # the default 50 ms sampling period


def measure(gpus, *, before=0.5, window=2.0, after=0.0, dt=DT, steps=10, samples=640,
            tokens=None, rapl_root=None, tmp=None, **fake_kw):
    """Drive a monitor on fake GPUs: sample `before` s, open, sample `window` s, close.
    Returns (result, monitor, clock)."""
    clock = FakeClock(1000.0)
    backend = fake_backend(gpus, clock, **fake_kw)
    kw = {"rapl_root": rapl_root} if rapl_root else {"rapl_root": "/nonexistent-powercap"}
    mon = create_monitor(PowerConfig(power_sample_ms=int(dt * 1000)), backend, clock=clock,
                         threaded=False, **kw)
    mon.start()
    for _ in range(round(before / dt)):
        clock.advance(dt)
        mon.poll()
    mon.open_window()
    for _ in range(round(window / dt)):
        clock.advance(dt)
        mon.poll()
    mon.close_window()
    for _ in range(round(after / dt)):
        clock.advance(dt)
        mon.poll()
    mon.stop()
    return mon.result(steps, samples, tokens), mon, clock


def codes(result):
    return sorted(f["code"] for f in result["flags"])


def numbers(obj):
    """Every number anywhere in a result (to check 'never zeros')."""
    if isinstance(obj, dict):
        return [n for v in obj.values() for n in numbers(v)]
    if isinstance(obj, list):
        return [n for v in obj for n in numbers(v)]
    return [obj] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


# -- energy math -------------------------------------------------------------------------

def test_known_power_curve_gives_known_energy():
    # 100 -> 300 W over the first 2 s, then flat: over [0.5, 2.5] s that is exactly
    # (100*1.5 + 50*(4 - 0.25)) + 300*0.5 = 337.5 + 150 = 487.5 J.
    r, _, _ = measure([FakeGPU(power_w=[(0, 100), (2, 300)])], steps=10, samples=640,
                      tokens=640 * 128)
    assert r["available"] is True and codes(r) == []
    g = r["gpus"][0]
    assert g["energy_counter_j"] == pytest.approx(487.5, abs=1e-6)
    assert g["energy_integral_j"] == pytest.approx(487.5, rel=1e-9)
    assert g["samples"] == 41 and g["peak_w"] == pytest.approx(300)
    assert g["avg_w"] == pytest.approx(487.5 / 2)
    assert g["power_source"] == "NVML_FI_DEV_POWER_INSTANT" and g["power_note"] is None
    assert r["energy_source"] == "counter" and r["energy_j"] == pytest.approx(487.5)
    assert r["window"]["duration_s"] == pytest.approx(2.0)
    assert r["energy_per_step_j"] == pytest.approx(48.75)
    assert r["energy_per_sample_j"] == pytest.approx(487.5 / 640)
    assert r["energy_per_token_j"] == pytest.approx(487.5 / (640 * 128))
    assert r["samples_per_s"] == pytest.approx(320)
    assert r["samples_per_s_per_mj"] == pytest.approx(320 / 487.5e-6)
    assert r["achieved_sample_ms"] == pytest.approx(50)


def test_totals_sum_over_gpus():
    r, _, _ = measure([FakeGPU(power_w=200), FakeGPU(power_w=[(0, 100), (2, 300)])])
    assert [g["index"] for g in r["gpus"]] == [0, 1]
    assert r["energy_counter_j"] == pytest.approx(400 + 487.5)
    assert r["energy_integral_j"] == pytest.approx(400 + 487.5)
    assert r["avg_w"] == pytest.approx(887.5 / 2)
    assert r["peak_gpu_w"] == pytest.approx(300)


def test_average_power_of_an_integral_is_over_the_time_its_samples_span():
    """A short window's energy is the samples' integral; when the sampler missed the last
    10% of the window (starved of CPU), energy_j leaves it out (flagged) and avg_w is the
    samples' mean, 300 W, not 300 x 0.9."""
    gpus = [{"energy_counter_j": None, "energy_integral_j": 270.0 * 0.5, "avg_w": 300.0,
             "peak_w": 300.0}, {"energy_counter_j": None, "energy_integral_j": 100.0 * 0.5,
                                "avg_w": 100.0, "peak_w": 100.0}]
    r, flags = energy.totals(gpus, window_s=0.5, steps=10, samples=80, tokens=None,
                             th=energy.Thresholds())
    assert r["energy_source"] == "integral" and r["energy_j"] == pytest.approx(185.0)
    assert r["avg_w"] == pytest.approx(400.0)
    assert [f["code"] for f in flags] == ["short_window"]


def test_integral_interpolates_window_edges():
    t = np.array([0.0, 1.0, 2.0, 3.0])
    w = np.array([0.0, 100.0, 100.0, 0.0])
    joules, covered = energy.integrate(t, w, 0.5, 2.5)
    assert covered == pytest.approx(2.0)
    assert joules == pytest.approx(37.5 + 100 + 37.5)
    assert energy.window_slice(t, 0.5, 2.5) == slice(0, 4)
    assert energy.window_slice(t, 1.0, 2.0) == slice(1, 3)


def test_counter_decreasing_is_an_error_not_energy():
    r, _, _ = measure([FakeGPU(counter_override=lambda s: int(1e9 - s * 1e5))])
    g = r["gpus"][0]
    assert g["energy_counter_j"] is None and "decreased" in g["energy_counter_note"]
    assert "counter_unavailable" in codes(r)
    assert r["energy_source"] == "integral" and r["energy_j"] == pytest.approx(600)


def test_counter_unsupported_falls_back_to_integral():
    r, _, _ = measure([FakeGPU(energy_counter=False)])
    assert r["energy_counter_j"] is None and r["energy_source"] == "integral"
    assert "Not Supported" in r["gpus"][0]["energy_counter_note"]


# -- fallbacks and errors ----------------------------------------------------------------

def test_missing_power_instant_falls_back_and_says_so():
    r, _, _ = measure([FakeGPU(power_instant=False, temp_mem_c=None)], before=1.5,
                      legacy_reasons=True)
    g = r["gpus"][0]
    assert g["power_source"] == "nvmlDeviceGetPowerUsage"
    assert g["power_note"] == "NVML_FI_DEV_POWER_INSTANT: Not Supported"
    assert g["clock_reasons_source"] == "nvmlDeviceGetCurrentClocksThrottleReasons"
    assert g["unsupported"] == ["temp_mem_c"] and g["temp_mem_c"] is None
    assert "power_averaged" in codes(r)
    assert g["energy_integral_j"] == pytest.approx(600, rel=1e-6)  # 1-s average of 300 W after 1 s


def test_nvml_error_mid_run_is_recorded_and_sampling_continues():
    # The power/memory-temperature call fails for 0.2 s inside the window; the clocks too.
    errors = (FakeError("nvmlDeviceGetFieldValues", 1.0, 1.2),
              FakeError("nvmlDeviceGetClockInfo", 1.0, 1.2, code=999))
    r, mon, _ = measure([FakeGPU(power_w=250)], errors=errors)
    assert r["available"] is True
    assert r["errors_total"] >= 8
    e = r["errors"][0]
    assert e["gpu"] == 0 and e["message"] == "GPU is lost" and 1000.999 < e["t"] < 1001.2
    assert {x["where"] for x in r["errors"]} == {"nvmlDeviceGetFieldValues", "sm_clock_mhz",
                                                 "mem_clock_mhz"}
    g = r["gpus"][0]
    assert g["samples"] == 41 - 4  # the failed ticks have no power value...
    assert g["energy_integral_j"] == pytest.approx(500)  # ...and the integral bridges them
    assert "sampling_errors" in codes(r)
    series = mon.sampler.series[0]
    assert series.cols["power_w"][-1] == pytest.approx(250)  # sampling went on afterwards


def test_read_raising_anything_is_recorded():
    r, mon, clock = measure([FakeGPU()])
    mon.backend.read = lambda dev: 1 / 0
    mon.poll()
    assert mon.sampler.errors[-1]["message"].startswith("ZeroDivisionError")


def test_init_errors_give_exact_reasons():
    for code, reason in ((9, "NVIDIA driver not loaded"),
                         (12, "NVML library not found (libnvidia-ml.so.1): no NVIDIA "
                              "driver on this machine")):
        mon = create_monitor(PowerConfig(), fake_backend(init_error=code))
        with mon:
            mon.open_window()
            mon.close_window()
        assert mon.result(1, 1, None) == {"available": False, "reason": reason}
    mon = create_monitor(PowerConfig(), fake_backend(gpus=[]))
    assert mon.result(1, 1, None) == {"available": False, "reason": "NVML found no GPU"}


def test_real_backend_without_gpu_is_unavailable_not_zero():
    mon = create_monitor(PowerConfig())
    if mon.available:
        pytest.skip("NVML works here: this machine has a GPU")
    with mon:
        mon.open_window()
        mon.close_window()
    r = mon.result(5, 320, None)
    assert r["available"] is False and numbers(r) == []
    assert "NVML" in r["reason"] and "not found" in r["reason"]
    assert mon.write_outputs("/nonexistent-dir") == []
    # Given the run's (CPU) devices the answer is the same kind: unavailable, with a reason.
    r = create_monitor(PowerConfig(), devices=jax.devices()).result(1, 1, None)
    assert r["available"] is False and r["reason"]


def test_result_without_a_closed_window_is_unavailable():
    mon = create_monitor(PowerConfig(), fake_backend(clock=FakeClock()), threaded=False)
    mon.start()
    mon.open_window()
    r = mon.result(1, 1, None)
    assert r == {"available": False, "reason": "the measurement window was never closed"}
    mon.stop()


# -- validity flags ----------------------------------------------------------------------

def test_short_window_prefers_integral():
    r, _, _ = measure([FakeGPU(power_w=[(0, 100), (2, 300)])], window=0.5, dt=0.025)
    assert codes(r) == ["short_window"]
    assert r["energy_source"] == "integral"
    assert r["energy_j"] == pytest.approx(r["energy_integral_j"])
    assert r["energy_integral_j"] == pytest.approx(100 * 0.5 + 50 * (1.0 - 0.25))


def test_few_samples_flag():
    r, _, _ = measure([FakeGPU()], window=1.0, dt=0.2)
    assert codes(r) == ["few_samples"] and r["gpus"][0]["samples"] == 6


def test_throttle_reasons_flag_all_but_idle():
    r, _, _ = measure([FakeGPU(reasons=[(0.0, 9.0, 0x1), (1.0, 1.5, 0x4 | 0x40)])])
    assert codes(r) == ["throttle:hw_thermal_slowdown", "throttle:sw_power_cap"]
    assert r["gpus"][0]["clock_event_reasons"] == {
        "sw_power_cap": pytest.approx(10 / 41), "hw_thermal_slowdown": pytest.approx(10 / 41)}
    r, _, _ = measure([FakeGPU(reasons=[(0.0, 9.0, 0x1)])])  # idle alone is not throttling
    assert codes(r) == [] and r["gpus"][0]["clock_event_reasons"] == {}
    assert energy.reason_names(0x45) == ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]


def test_temperature_drift_flag():
    r, _, _ = measure([FakeGPU(temp_gpu_c=[(0.5, 40), (2.5, 50)])])
    assert codes(r) == ["temperature_drift"]
    assert r["gpus"][0]["temp_gpu_c"]["start"] == 40 and r["gpus"][0]["temp_gpu_c"]["end"] == 50
    r, _, _ = measure([FakeGPU(temp_gpu_c=[(0.5, 40), (2.5, 43)])])
    assert codes(r) == []


def test_one_step_window():
    assert window_steps("full", 3, 10) == (3, 12)
    assert window_steps("one-step", 3, 10) == (11, 11)  # second-to-last timed step
    assert window_steps("one-step", 0, 11) == (9, 9)    # Go et al.: step 10 of 11
    assert window_steps("one-step", 2, 1) == (2, 2)
    # One 200 ms step sampled every 10 ms: the math is the same, the counter is not trusted.
    r, _, _ = measure([FakeGPU(power_w=400)], window=0.2, dt=0.01, steps=1, samples=64)
    assert codes(r) == ["short_window"] and r["energy_source"] == "integral"
    assert r["energy_j"] == pytest.approx(80) and r["energy_per_step_j"] == pytest.approx(80)
    assert r["gpus"][0]["samples"] == 21


# -- RAPL ----------------------------------------------------------------------------------

def make_rapl(root, zones):
    for zone, name, value, max_range in zones:
        d = root / zone
        d.mkdir(parents=True)
        (d / "name").write_text(name + "\n")
        (d / "energy_uj").write_text(f"{value}\n")
        (d / "max_energy_range_uj").write_text(f"{max_range}\n")


def test_rapl_wrap_around(tmp_path):
    make_rapl(tmp_path, [("intel-rapl:0", "package-0", 900_000, 1_000_000),
                         ("intel-rapl:0:0", "core", 5, 1_000_000),
                         ("intel-rapl:0:2", "dram", 10, 1_000_000)])
    zones, reason = discover(tmp_path)
    assert reason is None and [z.name for z in zones] == ["package-0", "dram"]
    meter = RaplMeter(zones)
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("50000\n")      # wrapped
    (tmp_path / "intel-rapl:0:2" / "energy_uj").write_text("20010\n")
    assert meter.snapshot() == {"intel-rapl:0": 150_000, "intel-rapl:0:2": 20_000}
    assert delta_uj(10, 30, 100) == 20 and delta_uj(90, 5, 100) == 15


def test_rapl_through_the_monitor(tmp_path):
    make_rapl(tmp_path, [("intel-rapl:0", "package-0", 999_000_000, 1_000_000_000)])
    clock = FakeClock(1000.0)
    mon = create_monitor(PowerConfig(), fake_backend(clock=clock), clock=clock,
                         threaded=False, rapl_root=tmp_path)
    mon.start()
    mon.open_window()
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("4000000\n")  # +5 J across a wrap
    clock.advance(2.0)
    mon.close_window()
    cpu = mon.result(1, 1, None)["cpu"]
    assert cpu["available"] and cpu["package_j"] == pytest.approx(5.0)
    assert cpu["dram_j"] is None and cpu["energy_j"] == pytest.approx(5.0)


def test_rapl_unavailable_reasons(tmp_path):
    assert "does not exist" in discover(tmp_path / "missing")[1]
    assert "no intel-rapl zones" in discover(tmp_path)[1]


# -- outputs -------------------------------------------------------------------------------

def test_csv_plot_and_tensorboard(tmp_path):
    import matplotlib.image
    from tensorboardX import SummaryWriter

    r, mon, _ = measure([FakeGPU(power_w=[(0, 100), (2, 300)]), FakeGPU(temp_mem_c=None)])
    tb = SummaryWriter(logdir=str(tmp_path / "tb"))
    files = mon.write_outputs(tmp_path, tb)
    tb.close()
    names = {f.name for f in files}
    assert {"gpu_power_0.csv", "gpu_thermal_0.csv", "sm_clock_1.csv", "mem_thermal_0.csv",
            "window.png"} <= names
    assert "mem_thermal_1.csv" not in names  # unsupported: no file
    rows = [line.split(",") for line in (tmp_path / "power/gpu_power_0.csv").read_text()
            .splitlines()]
    t = np.array([float(a) for a, _ in rows])
    w = np.array([float(b) for _, b in rows])
    assert len(rows) == 41 and np.all(np.diff(t) > 0)
    assert t[0] == pytest.approx(r["window"]["start_unix_s"])
    assert np.trapezoid(w, t) == pytest.approx(r["gpus"][0]["energy_integral_j"])
    image = matplotlib.image.imread(tmp_path / "power/window.png")
    assert image.ndim == 3 and image.shape[0] > 100
    scalars = read_scalars(tmp_path / "tb")
    power = scalars["power/gpu0/power_w"]
    assert power[0] == (0, pytest.approx(150)) and power[-1][0] == 2000
    assert scalars["power/energy_per_step_j"][0][1] == pytest.approx(r["energy_per_step_j"])
    assert {"power/gpu1/temperature_c", "power/gpu1/sm_clock_mhz"} <= scalars.keys()


# -- thread, config, mapping, memory --------------------------------------------------------

def test_thread_samples_and_stop_joins():
    with create_monitor(PowerConfig(power_sample_ms=10), fake_backend()) as mon:
        time.sleep(0.05)
        mon.open_window()
        time.sleep(0.25)
        mon.close_window()
    assert not mon.sampler._thread.is_alive()
    mon.stop()  # idempotent
    r = mon.result(1, 64, None)
    assert r["gpus"][0]["samples"] >= 10
    assert r["energy_integral_j"] == pytest.approx(300 * r["window"]["duration_s"], rel=1e-3)
    assert 9 < r["achieved_sample_ms"] < 30


def test_power_config_fields_become_flags():
    fields = {f.name: f for f in dataclasses.fields(PowerConfig)}
    assert list(fields) == ["power_sample_ms", "power_window"]
    assert fields["power_sample_ms"].type == "int" and fields["power_sample_ms"].default == 50
    assert fields["power_window"].metadata["choices"] == ("full", "one-step")
    assert all(f.metadata["help"] for f in fields.values())
    with pytest.raises(Exception, match="power-sample-ms"):
        PowerConfig(power_sample_ms=0).validate()


def test_gpu_selectors_follow_cuda_visible_devices():
    def gpu(i, hw, p=0):
        return SimpleNamespace(platform="gpu", id=i, local_hardware_id=hw, process_index=p)

    devs = [gpu(0, 0), gpu(1, 1), gpu(8, 0, p=1)]
    assert gpu_selectors(devs, 0, environ={}) == [0, 1]
    assert gpu_selectors(devs, 0, environ={"CUDA_VISIBLE_DEVICES": "4,6"}) == [4, 6]
    assert gpu_selectors(devs, 0, environ={"CUDA_VISIBLE_DEVICES": "GPU-ab,GPU-cd"}) == [
        "GPU-ab", "GPU-cd"]
    assert gpu_selectors(devs, 0, environ={"CUDA_VISIBLE_DEVICES": "MIG-x,MIG-y"}) is None
    assert gpu_selectors(jax.devices(), 0, environ={}) == []


def test_memory_snapshot_without_gpu_says_why():
    rows = memory_snapshot(jax.devices()[:2])
    assert [r["device"] for r in rows] == [0, 1]
    for r in rows:
        if r["peak_bytes_in_use"] is None:
            assert r["reason"] and r["bytes_in_use"] is None
        assert r["nvml_used_bytes"] is None and r["nvml_reason"]


def test_memory_snapshot_with_gpu_devices_and_nvml():
    dev = SimpleNamespace(platform="gpu", id=0, local_hardware_id=0, process_index=0,
                          memory_stats=lambda: {"peak_bytes_in_use": 7 * 2 ** 30,
                                                "bytes_in_use": 5 * 2 ** 30})
    clock = FakeClock()
    used = [(0, 10 * 2 ** 30), (1, 30 * 2 ** 30), (2, 20 * 2 ** 30)]
    mon = create_monitor(PowerConfig(), fake_backend([FakeGPU(used_bytes=used)], clock),
                         devices=[dev], clock=clock, threaded=False)
    mon.start()
    for _ in range(3):
        clock.advance(1.0)
        mon.poll()
    mon.stop()
    (row,) = memory_snapshot([dev], mon)
    assert row == {"device": 0, "peak_bytes_in_use": 7 * 2 ** 30, "bytes_in_use": 5 * 2 ** 30,
                   "reason": None, "nvml_used_bytes": 20 * 2 ** 30,
                   "nvml_used_peak_bytes": 30 * 2 ** 30, "nvml_reason": None}


def test_no_gpu_but_rapl_still_reports_cpu_energy(tmp_path):
    make_rapl(tmp_path, [("intel-rapl:0", "package-0", 1_000_000, 10 ** 12)])
    mon = create_monitor(PowerConfig(), fake_backend(init_error=12), threaded=False,
                         rapl_root=tmp_path)
    mon.start()
    mon.open_window()
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("3500000\n")
    mon.close_window()
    mon.stop()
    r = mon.result(1, 1, None)
    assert r["available"] is False and "NVML library not found" in r["reason"]
    assert r["cpu"]["available"] and r["cpu"]["energy_j"] == pytest.approx(2.5)
