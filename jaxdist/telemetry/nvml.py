"""The NVML backend: every pynvml call the telemetry makes, and nothing else.

`lib` is the pynvml module on a real machine and `fake.FakeNVML` in tests and benchmarks, so
the fallbacks below (instant-power field -> averaged power, clock-event reasons -> the older
throttle-reasons name) run the same code either way. Each device is probed once at open: a
query the driver does not support is dropped from sampling instead of failing every 50 ms,
and the probe says in results.json which source each figure came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# Columns of a sample. power_w and temp_mem_c come from nvmlDeviceGetFieldValues when the
# driver has the fields; the rest from one plain getter each.
METRICS = ("power_w", "temp_gpu_c", "temp_mem_c", "sm_clock_mhz", "mem_clock_mhz",
           "util_pct", "used_bytes", "clock_event_reasons")

POWER_FIELD = "NVML_FI_DEV_POWER_INSTANT"
POWER_USAGE = "nvmlDeviceGetPowerUsage"
_REASON_FNS = ("nvmlDeviceGetCurrentClocksEventReasons",      # driver 535+ name
               "nvmlDeviceGetCurrentClocksThrottleReasons")   # older name, same bitmask

# c_nvmlValue_t union member for each NVML_VALUE_TYPE_* code.
_VALUE_ATTR = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
               6: "usVal"}


class Unavailable(Exception):
    """NVML cannot be used here; str() is the reason written to results.json."""


@dataclass
class Device:
    index: int                      # NVML index (PCI order), not the CUDA ordinal
    handle: object
    name: str
    uuid: str
    power_source: str               # POWER_FIELD or POWER_USAGE
    power_note: str | None = None   # why the instant-power field is not used
    reasons_source: str | None = None
    energy_note: str | None = None  # why the energy counter is unavailable
    unsupported: list[str] = field(default_factory=list)
    field_metrics: list[str] = field(default_factory=list)  # read via nvmlDeviceGetFieldValues
    field_ids: list[int] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVMLBackend:
    name = "nvml"

    def __init__(self, lib=None):
        self.lib = lib
        self.devices: list[Device] = []
        self._initialised = False

    # -- lifecycle ---------------------------------------------------------------------
    def open(self, selectors=None) -> list[Device]:
        """Init NVML and probe the devices. `selectors`: NVML indices or UUID prefixes of
        the GPUs this process uses; None = every GPU NVML sees. Raises Unavailable."""
        if self.lib is None:
            try:
                import pynvml
            except ImportError as e:
                raise Unavailable(f"pynvml (nvidia-ml-py) is not installed: {e}") from None
            self.lib = pynvml
        lib = self.lib
        try:
            lib.nvmlInit()
        except lib.NVMLError as e:
            raise Unavailable(self._init_reason(e)) from None
        except OSError as e:  # a broken libnvidia-ml.so raises from the dynamic loader
            raise Unavailable(f"NVML library could not be loaded: {e}") from None
        self._initialised = True
        try:
            count = lib.nvmlDeviceGetCount()
            if count == 0:
                raise Unavailable("NVML found no GPU")
            self.devices = [self._probe(i) for i in self._resolve(selectors, count)]
        except lib.NVMLError as e:
            self.close()
            raise Unavailable(f"NVML device query failed: {e}") from None
        except Unavailable:
            self.close()
            raise
        return self.devices

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError:
                pass  # shutting down is best effort; the process is ending the telemetry

    def _init_reason(self, e) -> str:
        code = getattr(e, "value", None)
        lib = self.lib
        if code == getattr(lib, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
            return ("NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this "
                    "machine")
        if code == getattr(lib, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
            return "NVIDIA driver not loaded"
        if code == getattr(lib, "NVML_ERROR_NO_PERMISSION", 4):
            return "no permission to use NVML"
        return f"nvmlInit failed: {e}"

    def _resolve(self, selectors, count) -> list[int]:
        if selectors is None:
            return list(range(count))
        uuids = None
        out = []
        for s in selectors:
            if isinstance(s, int):
                if not 0 <= s < count:
                    raise Unavailable(f"GPU {s} is not among the {count} GPUs NVML sees")
                out.append(s)
                continue
            if uuids is None:
                uuids = [_text(self.lib.nvmlDeviceGetUUID(self.lib.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(count)]
            match = [i for i, u in enumerate(uuids) if u.startswith(s)]
            if len(match) != 1:
                raise Unavailable(f"CUDA_VISIBLE_DEVICES entry {s!r} matches {len(match)} of "
                                  f"the GPUs NVML sees")
            out.append(match[0])
        return out

    # -- probing -----------------------------------------------------------------------
    def _probe(self, index: int) -> Device:
        lib = self.lib
        h = lib.nvmlDeviceGetHandleByIndex(index)
        dev = Device(index, h, _text(lib.nvmlDeviceGetName(h)),
                     _text(lib.nvmlDeviceGetUUID(h)), POWER_USAGE)
        # Instant power is what Go et al. sampled; nvmlDeviceGetPowerUsage is a 1-s average
        # on Ampere-and-newer parts other than GA100, too smooth for one-step windows.
        for metric, const in (("power_w", POWER_FIELD), ("temp_mem_c", "NVML_FI_DEV_MEMORY_TEMP")):
            fid = getattr(lib, const, None)
            note = f"pynvml has no {const}" if fid is None else self._probe_field(h, fid)
            if note is None:
                dev.field_metrics.append(metric)
                dev.field_ids.append(fid)
            elif metric == "power_w":
                dev.power_note = f"{const}: {note}"
            else:
                dev.unsupported.append(metric)
        if "power_w" in dev.field_metrics:
            dev.power_source = POWER_FIELD
        elif not self._supported(lambda: lib.nvmlDeviceGetPowerUsage(h)):
            dev.unsupported.append("power_w")
        for fn in _REASON_FNS:
            if hasattr(lib, fn) and self._supported(lambda: getattr(lib, fn)(h)):
                dev.reasons_source = fn
                break
        else:
            dev.unsupported.append("clock_event_reasons")
        for metric in ("temp_gpu_c", "sm_clock_mhz", "mem_clock_mhz", "util_pct", "used_bytes"):
            if not self._supported(lambda: self._getter(metric, h)):
                dev.unsupported.append(metric)
        try:
            lib.nvmlDeviceGetTotalEnergyConsumption(h)
        except lib.NVMLError as e:  # pre-Volta parts and some vGPU/MIG setups
            if getattr(e, "value", None) in self._permanent():
                dev.energy_note = f"nvmlDeviceGetTotalEnergyConsumption: {e}"
        return dev

    def _permanent(self) -> tuple:
        # Only "not supported"-type answers are permanent; any other error at the probe
        # (a transient one) keeps the query, and is recorded when it recurs.
        return (self.lib.NVML_ERROR_NOT_SUPPORTED, self.lib.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _probe_field(self, h, fid) -> str | None:
        lib = self.lib
        try:
            (value,) = lib.nvmlDeviceGetFieldValues(h, [fid])
        except lib.NVMLError as e:
            return str(e)
        if value.nvmlReturn != lib.NVML_SUCCESS:
            return str(lib.NVMLError(value.nvmlReturn))
        return None

    def _supported(self, call) -> bool:
        lib = self.lib
        try:
            call()
        except lib.NVMLError as e:
            return getattr(e, "value", None) not in self._permanent()
        return True

    def _getter(self, metric, h):
        lib = self.lib
        if metric == "temp_gpu_c":
            return lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)
        if metric == "sm_clock_mhz":
            return lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)
        if metric == "mem_clock_mhz":
            return lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_MEM)
        if metric == "util_pct":
            return lib.nvmlDeviceGetUtilizationRates(h).gpu
        if metric == "used_bytes":
            return lib.nvmlDeviceGetMemoryInfo(h).used
        if metric == "power_w":
            return lib.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW
        raise KeyError(metric)

    # -- sampling ----------------------------------------------------------------------
    def read(self, dev: Device) -> tuple[dict, list[tuple[str, str]]]:
        """One sample of every supported metric: (values, [(query, error message)]).
        A failed query leaves its value None; the others are still read."""
        lib = self.lib
        out: dict = {}
        errors: list[tuple[str, str]] = []
        if dev.field_ids:
            try:
                values = lib.nvmlDeviceGetFieldValues(dev.handle, dev.field_ids)
                for metric, v in zip(dev.field_metrics, values):
                    if v.nvmlReturn != lib.NVML_SUCCESS:
                        errors.append((metric, str(lib.NVMLError(v.nvmlReturn))))
                        continue
                    raw = getattr(v.value, _VALUE_ATTR.get(v.valueType, "uiVal"))
                    out[metric] = raw / 1000.0 if metric == "power_w" else raw  # mW -> W
            except lib.NVMLError as e:
                errors.append(("nvmlDeviceGetFieldValues", str(e)))
        skip = set(dev.unsupported) | set(dev.field_metrics)
        for metric in METRICS:
            if metric in skip:
                continue
            try:
                if metric == "clock_event_reasons":
                    out[metric] = getattr(lib, dev.reasons_source)(dev.handle)
                else:
                    out[metric] = self._getter(metric, dev.handle)
            except lib.NVMLError as e:
                errors.append((metric, str(e)))
        return out, errors

    def energy_mj(self, dev: Device) -> int:
        """The total-energy counter (mJ since driver load; 64-bit, so it does not wrap)."""
        return self.lib.nvmlDeviceGetTotalEnergyConsumption(dev.handle)


def gpu_selectors(devices, process_index: int = 0,
                  environ=None) -> list[int | str] | None:
    """NVML selectors of this process's JAX GPU devices: [] if it uses none, None if the
    mapping is unknown (then every GPU is sampled and the result says so).

    JAX numbers GPUs by CUDA ordinal within CUDA_VISIBLE_DEVICES; NVML numbers every GPU
    in PCI order. The two agree when CUDA_VISIBLE_DEVICES is unset and CUDA_DEVICE_ORDER
    is PCI_BUS_ID, or on nodes of identical GPUs (CUDA's fastest-first order is then PCI
    order), which is every machine this project targets."""
    environ = os.environ if environ is None else environ
    local = [d for d in devices if getattr(d, "platform", "") in ("gpu", "cuda")
             and getattr(d, "process_index", 0) == process_index]
    if not local:
        return []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else None
    out: list[int | str] = []
    for d in local:
        hw = d.local_hardware_id
        if entries is None:
            out.append(hw)
        elif hw is None or hw >= len(entries) or entries[hw].startswith("MIG-"):
            return None
        else:
            e = entries[hw]
            out.append(int(e) if e.isdigit() else e)
    return list(dict.fromkeys(out))
