"""A scripted NVML: the pynvml names nvml.py calls, answering from curves over time.

Tests and benchmarks pass `fake_backend(...)` to `create_monitor`; the real backend code then
runs unchanged on top of it, fallbacks included. Every curve is piecewise linear in seconds
since the fake started, so the true energy of a window is known exactly, and the energy
counter is the exact integral, advanced only every `counter_period_s` as the real one is
(about 100 ms). Time comes from an injected clock, so a test with a `FakeClock` is fully
deterministic and never sleeps.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from jaxdist.telemetry.nvml import NVMLBackend


class FakeClock:
    """Epoch seconds that move only when told to."""

    def __init__(self, start: float = 1_700_000_000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


class Curve:
    """Piecewise-linear value over time, constant outside its knots; `energy` integrates."""

    def __init__(self, spec):
        knots = [(0.0, float(spec))] if isinstance(spec, (int, float)) else list(spec)
        self.t = [float(t) for t, _ in knots]
        self.v = [float(v) for _, v in knots]
        self.cum = [0.0]
        for i in range(1, len(knots)):
            step = (self.v[i] + self.v[i - 1]) / 2 * (self.t[i] - self.t[i - 1])
            self.cum.append(self.cum[-1] + step)

    def __call__(self, t: float) -> float:
        i = bisect.bisect_right(self.t, t)
        if i == 0:
            return self.v[0]
        if i == len(self.t):
            return self.v[-1]
        f = (t - self.t[i - 1]) / (self.t[i] - self.t[i - 1])
        return self.v[i - 1] + f * (self.v[i] - self.v[i - 1])

    def energy(self, t: float) -> float:
        """Integral from the first knot to t (0 before it)."""
        if t <= self.t[0]:
            return 0.0
        i = bisect.bisect_right(self.t, t) - 1
        return self.cum[i] + (self.v[i] + self(t)) / 2 * (t - self.t[i])


@dataclass
class FakeGPU:
    """One scripted GPU. Numbers are constants; lists are (seconds, value) knots."""
    power_w: object = 300.0
    temp_gpu_c: object = 45.0
    temp_mem_c: object | None = 50.0      # None: the memory-temperature field is missing
    sm_clock_mhz: object = 1980.0
    mem_clock_mhz: object = 3201.0
    util_pct: object = 100.0
    used_bytes: object = 60 * 2 ** 30
    reasons: list = field(default_factory=list)  # (from_s, to_s, bitmask); 0 elsewhere
    power_instant: bool = True            # False: the POWER_INSTANT field is not supported
    energy_counter: bool = True           # False: nvmlDeviceGetTotalEnergyConsumption unsupported
    counter_period_s: float = 0.1
    counter_offset_mj: int = 123_456_789  # the real counter counts from driver load
    counter_override: Callable[[float], int] | None = None  # seconds -> mJ, e.g. going backwards
    name: str = "NVIDIA H200 (fake)"


@dataclass(frozen=True)
class FakeError:
    """Calls to `function` (on `gpu`, or any) in [start_s, end_s) raise NVMLError(code)."""
    function: str
    start_s: float
    end_s: float
    code: int = 15  # NVML_ERROR_GPU_IS_LOST
    gpu: int | None = None


class FakeNVMLError(Exception):
    _names = {1: "Uninitialized", 3: "Not Supported", 9: "Driver Not Loaded",
              12: "NVML Shared Library Not Found", 13: "Function Not Found",
              15: "GPU is lost", 999: "Unknown Error"}

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return self._names.get(self.value, f"NVML error {self.value}")


class FakeNVML:
    """Module-like stand-in for pynvml (same constant values, same call shapes)."""
    NVMLError = FakeNVMLError
    NVML_SUCCESS = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FI_DEV_MEMORY_TEMP = 82
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: list[FakeGPU], clock: Callable[[], float] = time.time,
                 errors: tuple[FakeError, ...] = (), init_error: int | None = None,
                 legacy_reasons: bool = False):
        self.gpus = gpus
        self.clock = clock
        self.t0 = clock()
        self.errors = errors
        self.init_error = init_error
        self.legacy_reasons = legacy_reasons  # driver without the ClocksEventReasons name
        self.curves = [{name: Curve(getattr(g, name)) for name in (
            "power_w", "temp_gpu_c", "sm_clock_mhz", "mem_clock_mhz", "util_pct", "used_bytes")}
            | ({"temp_mem_c": Curve(g.temp_mem_c)} if g.temp_mem_c is not None else {})
            for g in gpus]
        self.initialised = 0

    def _now(self, function: str, gpu: int | None) -> float:
        """Seconds since start; raises the scripted error for this call if one is due."""
        if not self.initialised:
            raise FakeNVMLError(self.NVML_ERROR_UNINITIALIZED)
        s = self.clock() - self.t0
        for e in self.errors:
            if e.function == function and e.start_s <= s < e.end_s and e.gpu in (None, gpu):
                raise FakeNVMLError(e.code)
        return s

    def nvmlInit(self):
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised = max(0, self.initialised - 1)

    def nvmlDeviceGetCount(self):
        self._now("nvmlDeviceGetCount", None)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._now("nvmlDeviceGetHandleByIndex", i)
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h].name

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-fake-{h:04d}"

    def _value(self, h, name, function):
        s = self._now(function, h)
        return self.curves[h][name](s)

    def nvmlDeviceGetFieldValues(self, h, ids):
        s = self._now("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in ids:
            ret, v = self.NVML_ERROR_NOT_SUPPORTED, 0
            if fid == self.NVML_FI_DEV_POWER_INSTANT and self.gpus[h].power_instant:
                ret, v = 0, int(round(self.curves[h]["power_w"](s) * 1000))  # mW
            elif fid == self.NVML_FI_DEV_MEMORY_TEMP and "temp_mem_c" in self.curves[h]:
                ret, v = 0, int(round(self.curves[h]["temp_mem_c"](s)))
            out.append(SimpleNamespace(fieldId=fid, scopeId=0, timestamp=int(s * 1e6),
                                       latencyUsec=0, valueType=1, nvmlReturn=ret,
                                       value=SimpleNamespace(uiVal=v)))
        return out

    def nvmlDeviceGetPowerUsage(self, h):
        # Averaged over the last second, as on Ampere-and-newer parts other than GA100.
        s = self._now("nvmlDeviceGetPowerUsage", h)
        c = self.curves[h]["power_w"]
        return int(round((c.energy(s) - c.energy(s - 1.0)) * 1000))

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        s = self._now("nvmlDeviceGetTotalEnergyConsumption", h)
        g = self.gpus[h]
        if not g.energy_counter:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if g.counter_override is not None:
            return g.counter_override(s)
        tick = math.floor(s / g.counter_period_s + 1e-9) * g.counter_period_s
        return g.counter_offset_mj + int(round(self.curves[h]["power_w"].energy(tick) * 1000))

    def nvmlDeviceGetTemperature(self, h, sensor):
        return int(round(self._value(h, "temp_gpu_c", "nvmlDeviceGetTemperature")))

    def nvmlDeviceGetClockInfo(self, h, kind):
        name = "sm_clock_mhz" if kind == self.NVML_CLOCK_SM else "mem_clock_mhz"
        return int(round(self._value(h, name, "nvmlDeviceGetClockInfo")))

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=int(round(self._value(h, "util_pct",
                                                         "nvmlDeviceGetUtilizationRates"))),
                               memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        used = int(self._value(h, "used_bytes", "nvmlDeviceGetMemoryInfo"))
        return SimpleNamespace(total=141 * 10 ** 9, used=used, free=141 * 10 ** 9 - used)

    def _reasons(self, h, function):
        s = self._now(function, h)
        mask = 0
        for a, b, m in self.gpus[h].reasons:
            if a <= s < b:
                mask |= m
        return mask

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if self.legacy_reasons:
            raise FakeNVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._reasons(h, "nvmlDeviceGetCurrentClocksEventReasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._reasons(h, "nvmlDeviceGetCurrentClocksThrottleReasons")


def fake_backend(gpus: list[FakeGPU] | None = None, clock: Callable[[], float] = time.time,
                 **kwargs) -> NVMLBackend:
    """The real backend over a FakeNVML (one default GPU unless told otherwise)."""
    backend = NVMLBackend(FakeNVML(gpus if gpus is not None else [FakeGPU()], clock, **kwargs))
    backend.name = "fake"
    return backend
