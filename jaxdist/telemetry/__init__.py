"""Power, energy and thermal telemetry of a run: the public API the loop calls.

    monitor = create_monitor(cfg.power, devices=platform.devices)
    with monitor:                      # start(): sampling thread runs from before warm-up
        ...warm-up...
        monitor.open_window()          # right after the last warm-up step's block_until_ready
        ...timed steps...
        with monitor.paused("evaluation after step 9"):   # not training: left out
            ...evaluation or a checkpoint save...
        ...timed steps...
        monitor.close_window()         # right after the last timed step's block_until_ready
    power = monitor.result(steps, samples, tokens, first_step)  # the results.json `power` block
    monitor.write_outputs(run_dir, tb_writer)        # power/*.csv, power/window.png, scalars

Nothing here raises into the training loop: without NVML or a GPU the block is
{"available": false, "reason": ...} (never zeros), and errors during the run are recorded
in the block while sampling goes on. Fields and caveats: docs/power.md.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxdist.telemetry import energy, outputs, rapl
from jaxdist.telemetry.nvml import NVMLBackend, Unavailable, gpu_selectors
from jaxdist.telemetry.sampler import Sampler

WINDOWS = ("full", "one-step")


@dataclass(frozen=True)
class PowerConfig:
    power_sample_ms: int = field(default=50, metadata={
        "help": "GPU power/thermal sampling period in ms (Go et al. used 50)"})
    power_window: str = field(default="full", metadata={
        "help": "energy window: full (every timed step) or one-step (only the second-to-last "
                "timed step, Go et al.'s protocol; the counter is too coarse for it, so its "
                "energy comes from the samples)", "choices": WINDOWS})

    def validate(self) -> None:
        from jaxdist.errors import UsageError
        if not 1 <= self.power_sample_ms <= 60_000:
            raise UsageError(f"--power-sample-ms must be 1..60000, got {self.power_sample_ms}")
        if self.power_window not in WINDOWS:
            raise UsageError(f"--power-window must be one of {', '.join(WINDOWS)}")


def window_steps(window: str, warmup: int, steps: int) -> tuple[int, int]:
    """(open before step i, close after step j), as 0-based indices over warm-up + timed
    steps. one-step measures the second-to-last timed step (Go et al.: step 10 of 11), so a
    step is still running behind it; with one timed step it is that step."""
    if window == "full":
        return warmup, warmup + steps - 1
    i = warmup + max(steps - 2, 0)
    return i, i


class Monitor:
    def __init__(self, cfg: PowerConfig, backend, devices, reason: str | None, *,
                 clock=time.time, threaded=True, rapl_root=rapl.DEFAULT_ROOT,
                 thresholds: energy.Thresholds | None = None, note: str | None = None,
                 jax_to_nvml: dict | None = None):
        self.cfg = cfg
        self.backend = backend
        self.devices = devices
        self.reason = reason
        self.available = reason is None
        self.clock = clock
        self.threaded = threaded
        self.th = thresholds or energy.Thresholds()
        self.note = note
        self.jax_to_nvml = jax_to_nvml or {}
        zones, self.rapl_reason = rapl.discover(rapl_root)
        self.rapl = rapl.RaplMeter(zones) if zones else None
        self.sampler = Sampler(backend, devices, cfg.power_sample_ms / 1000.0, clock, self.rapl)
        self.window: dict | None = None
        self._started = self._stopped = False
        self._last_result: dict | None = None

    def _guard(self, what, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - telemetry must never stop a training run
            self.sampler.record_error(None, what, f"{type(e).__name__}: {e}")
            return None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        """Take a first sample and start the sampling thread (call before warm-up)."""
        if self._started or self._stopped:
            return
        self._started = True
        if self.devices or self.rapl:
            self.poll()
            if self.threaded:
                self._guard("start", self.sampler.start)

    def poll(self) -> None:
        """One sample now (the thread does this every power_sample_ms)."""
        self._guard("poll", self.sampler.poll)

    def _counters(self, edge: str) -> dict:
        out = {}
        for dev in self.devices:
            out[dev.index] = None
            if dev.energy_note is None:
                try:
                    out[dev.index] = self.backend.energy_mj(dev)
                except Exception as e:  # noqa: BLE001
                    self.sampler.record_error(dev.index, f"energy counter at window {edge}",
                                              str(e))
        return out

    def open_window(self) -> None:
        def go():
            self.poll()  # a sample just before the edge, to interpolate the integral from
            counters = self._counters("open")
            cpu = self.rapl.snapshot() if self.rapl else None
            self.window = {"start": self.clock(), "end": None, "c0": counters, "r0": cpu,
                           "pauses": []}
        self._guard("open_window", go)

    @contextmanager
    def paused(self, what: str, active: bool = True):
        """Leave the enclosed work (evaluation, a checkpoint save) out of the open window:
        its time, samples and energy (counter and integral) are subtracted and the block
        lists it under window.excluded. No-op when `active` is false or no window is open."""
        pause = None
        if active and self.window is not None and self.window["end"] is None:
            def begin():
                self.poll()
                return {"what": what, "start": self.clock(), "end": None,
                        "c0": self._counters("pause"),
                        "r0": self.rapl.snapshot() if self.rapl else None}
            pause = self._guard("pause", begin)
        try:
            yield
        finally:
            if pause is not None:
                def end():
                    pause["end"] = self.clock()
                    pause["c1"] = self._counters("resume")
                    pause["r1"] = self.rapl.snapshot() if self.rapl else None
                    self.window["pauses"].append(pause)
                    self.poll()
                self._guard("resume", end)

    def close_window(self) -> None:
        def go():
            if self.window is None:
                raise RuntimeError("close_window() without open_window()")
            self.window["end"] = self.clock()
            self.window["c1"] = self._counters("close")
            self.window["r1"] = self.rapl.snapshot() if self.rapl else None
            self.poll()  # a sample just after the edge
        self._guard("close_window", go)

    def stop(self) -> None:
        """Stop and join the thread, shut NVML down. Idempotent; results stay readable."""
        if self._stopped:
            return
        self._stopped = True
        self._guard("stop", self.sampler.stop)
        if self.available:
            self._guard("nvml shutdown", self.backend.close)

    # -- results -------------------------------------------------------------------------
    def _cpu(self) -> dict:
        w = self.window or {}
        r0, r1 = w.get("r0"), w.get("r1")
        if r0 is not None and r1 is not None:  # the pauses' energy left out
            r1 = dict(r1)
            for p in w["pauses"]:
                for zone in r1:
                    r1[zone] -= p["r1"][zone] - p["r0"][zone]
        return rapl.window_result(self.rapl, self.rapl_reason, r0, r1)

    def _window_arrays(self) -> dict[int, dict]:
        a, b = self.window["start"], self.window["end"]
        out = {}
        with self.sampler.lock:
            for dev in self.devices:
                s = self.sampler.series[dev.index]
                sl = energy.window_slice(np.asarray(s.t), a, b)
                out[dev.index] = s.arrays(sl.start, sl.stop)
        return out

    def result(self, steps: int, samples: int, tokens: int | None,
               first_step: int | None = None) -> dict:
        """The `power` block; steps, samples and tokens are the totals inside the window,
        `first_step` the index of its first step (window.window_steps names them)."""
        try:
            out = self._result(steps, samples, tokens, first_step)
        except Exception as e:  # noqa: BLE001
            out = {"available": False, "reason": f"power telemetry failed: "
                                                 f"{type(e).__name__}: {e}"}
        self._last_result = out
        return out

    def _result(self, steps, samples, tokens, first_step=None) -> dict:
        if not self.available:
            out = {"available": False, "reason": self.reason}
            if self._cpu()["available"]:
                out["cpu"] = self._cpu()  # CPU energy is still real without a GPU
            return out
        w = self.window
        if not w:
            return {"available": False, "reason": "the run stopped before the measurement "
                                                  "window opened"}
        if w["end"] is None:
            return {"available": False, "reason": "the measurement window was never closed"}
        a, b = w["start"], w["end"]
        pauses = [(p["start"], p["end"]) for p in w["pauses"]]
        arrays = self._window_arrays()
        metas = [{"index": d.index, "name": d.name, "uuid": d.uuid,
                  "power_source": d.power_source, "power_note": d.power_note,
                  "clock_reasons_source": d.reasons_source, "unsupported": list(d.unsupported),
                  "counter_mj": (w["c0"][d.index], w["c1"][d.index]),
                  "pause_counter_mj": [(p["c0"][d.index], p["c1"][d.index])
                                       for p in w["pauses"]],
                  "counter_note": d.energy_note} for d in self.devices]
        summary = energy.window_figures(metas, arrays, a, b, steps, samples, tokens,
                                        self.sampler.errors, self.th, pauses)
        t = next(iter(arrays.values()))["t"] if arrays else np.array([])
        paused_s = sum(p1 - p0 for p0, p1 in pauses)
        return {
            "available": True,
            "backend": self.backend.name,
            "window": {"mode": self.cfg.power_window, "start_unix_s": a, "end_unix_s": b,
                       "duration_s": b - a - paused_s, "span_s": b - a, "steps": steps,
                       "window_steps": ([first_step, first_step + steps - 1]
                                        if first_step is not None and steps else None),
                       "excluded": [{"what": p["what"], "duration_s": p["end"] - p["start"]}
                                    for p in w["pauses"]],
                       "samples": samples, "tokens": tokens},
            **summary,
            "sample_ms": self.cfg.power_sample_ms,
            "achieved_sample_ms": float(np.median(np.diff(t)) * 1e3) if t.size > 1 else None,
            "cpu": self._cpu(),
            "note": self.note,
            "sampler_cpu_s": self.sampler.cpu_s,
            "errors": list(self.sampler.errors),
            "errors_total": self.sampler.errors_total,
        }

    def write_outputs(self, run_dir: Path, tb_writer=None) -> list[Path]:
        """power/*.csv, power/window.png, scalars to tb_writer (or None); after result()."""
        def go():
            if not self.available or not self.window or self.window["end"] is None:
                return []
            arrays = self._window_arrays()
            folder = Path(run_dir) / "power"
            files = outputs.write_csvs(folder, arrays)
            files.append(outputs.write_plot(folder / "window.png", arrays,
                                            self.window["start"], self.window["end"]))
            if tb_writer is not None and self._last_result and self._last_result["available"]:
                outputs.write_tensorboard(tb_writer, arrays, self.window["start"],
                                          self._last_result)
            return files
        return self._guard("write_outputs", go) or []

    def nvml_used(self, jax_device) -> tuple[int | None, int | None, str | None]:
        """(last, peak over the run) NVML used bytes of a JAX device's GPU, or a reason."""
        if not self.available:
            return None, None, self.reason
        index = self.jax_to_nvml.get(jax_device.id)
        if index is None:
            return None, None, "device not mapped to an NVML GPU"
        used = [v for v in self.sampler.series[index].cols["used_bytes"] if v is not None]
        if not used:
            return None, None, "NVML reported no used memory"
        return int(used[-1]), int(max(used)), None


def _process_index() -> int:
    import jax
    return jax.process_index()


def create_monitor(cfg: PowerConfig, backend=None, *, devices=None, clock=None,
                   threaded: bool = True, rapl_root=rapl.DEFAULT_ROOT,
                   thresholds: energy.Thresholds | None = None,
                   process_index: int | None = None) -> Monitor:
    """A monitor for this process's GPUs among `devices` (JAX devices, or anything with
    their id, platform, process_index and local_hardware_id, as the PyTorch reference
    gives; None = every GPU NVML sees). `process_index` None asks JAX (a PyTorch rank gives
    it: asking would start a JAX backend there). backend None = real NVML; pass
    fake.fake_backend(...) in tests. Never raises: an unusable NVML gives a monitor whose
    result says why."""
    backend = backend or NVMLBackend()
    kw = dict(clock=clock or time.time, threaded=threaded, rapl_root=rapl_root,
              thresholds=thresholds)
    try:
        selectors, note, local = None, None, []
        if devices is not None:
            pidx = _process_index() if process_index is None else process_index
            local = [d for d in devices if d.platform in ("gpu", "cuda")
                     and d.process_index == pidx]
            selectors = gpu_selectors(devices, pidx)
            if selectors is None:
                note = ("JAX devices could not be mapped to NVML GPUs (CUDA_VISIBLE_DEVICES): "
                        "every GPU NVML sees is sampled")
        devs = backend.open(selectors if selectors != [] else None)
        if selectors == []:
            backend.close()
            kinds = sorted({d.platform for d in devices})
            return Monitor(cfg, backend, [], f"this run uses no GPU (its devices: "
                           f"{', '.join(kinds)}); NVML sees {len(devs)}", **kw)
    except Unavailable as e:
        return Monitor(cfg, backend, [], str(e), **kw)
    except Exception as e:  # noqa: BLE001
        return Monitor(cfg, backend, [], f"NVML setup failed: {type(e).__name__}: {e}", **kw)
    mapping = ({d.id: dev.index for d, dev in zip(local, devs)}
               if selectors and len(local) == len(devs) else {})
    return Monitor(cfg, backend, devs, None, note=note, jax_to_nvml=mapping, **kw)


def memory_snapshot(devices, monitor: Monitor | None = None) -> list[dict]:
    """Per local device, now (call at the end of the run): the JAX allocator's peak and
    current bytes (memory_stats()), and NVML's used bytes (last and peak over the run)."""
    pidx = _process_index()
    out = []
    for d in devices:
        if d.process_index != pidx:
            continue
        row = {"device": d.id, "peak_bytes_in_use": None, "bytes_in_use": None,
               "reason": None, "nvml_used_bytes": None, "nvml_used_peak_bytes": None,
               "nvml_reason": "no power monitor"}
        try:
            stats = d.memory_stats()
        except Exception as e:  # noqa: BLE001
            stats, row["reason"] = None, f"memory_stats() failed: {e}"
        if stats and "peak_bytes_in_use" in stats:
            row["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
            row["bytes_in_use"] = stats.get("bytes_in_use")
        elif row["reason"] is None:
            row["reason"] = f"{d.platform} backend reports no memory_stats()"
        if monitor is not None:
            (row["nvml_used_bytes"], row["nvml_used_peak_bytes"],
             row["nvml_reason"]) = monitor.nvml_used(d)
        out.append(row)
    return out
