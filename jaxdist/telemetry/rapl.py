"""CPU energy from Intel RAPL (also AMD on Linux >= 5.8) under /sys/class/powercap.

Each zone's `energy_uj` counts microjoules and wraps at `max_energy_range_uj` (about 262 kJ
on many parts: every ~20 min for a 200 W package). The meter reads every zone at least once
a second from the sampler thread and adds up the wrap-corrected differences, so a window of
any length is right as long as no zone wraps twice between two reads. Package zones and
DRAM zones are reported; core/uncore zones are parts of the package and would double count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/sys/class/powercap")


@dataclass(frozen=True)
class Zone:
    zone: str           # directory name, e.g. "intel-rapl:0" or "intel-rapl:0:2"
    name: str           # its `name` file: "package-0", "dram", ...
    path: Path          # the energy_uj file
    max_range_uj: int


def discover(root: Path = DEFAULT_ROOT) -> tuple[list[Zone], str | None]:
    """The readable package and DRAM zones, or ([], why there are none)."""
    root = Path(root)
    if not root.is_dir():
        return [], f"{root} does not exist (no powercap driver, or not Linux)"
    dirs = sorted(root.glob("intel-rapl:*"))
    if not dirs:
        return [], f"no intel-rapl zones under {root}"
    zones = []
    for d in dirs:
        try:
            name = (d / "name").read_text().strip()
            if not (name.startswith("package") or name == "dram"):
                continue
            max_range = int((d / "max_energy_range_uj").read_text())
            int((d / "energy_uj").read_text())
        except PermissionError:
            # Kernels since 5.10 make energy_uj root-only (CVE-2020-8694, "Platypus").
            return [], (f"permission denied reading {d / 'energy_uj'} (root-only since "
                        f"Linux 5.10, CVE-2020-8694)")
        except (OSError, ValueError) as e:
            return [], f"cannot read RAPL zone {d}: {e}"
        zones.append(Zone(d.name, name, d / "energy_uj", max_range))
    if not zones:
        return [], f"no package or dram zones under {root}"
    return zones, None


def delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Counter difference, assuming at most one wrap between the two reads."""
    return after - before if after >= before else after + max_range_uj - before


class RaplMeter:
    """Wrap-corrected running totals per zone; `update()` is cheap (one small read each)."""

    def __init__(self, zones: list[Zone]):
        self.zones = zones
        self.total_uj = {z.zone: 0 for z in zones}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._last = {z.zone: self._read(z) for z in zones}

    def _read(self, z: Zone) -> int | None:
        try:
            return int(z.path.read_text())
        except (OSError, ValueError) as e:
            self.errors.append(f"{z.path}: {e}")
            return None

    def update(self) -> None:
        with self._lock:  # the sampler thread and the window edges both update
            for z in self.zones:
                now = self._read(z)
                last = self._last[z.zone]
                if now is not None and last is not None:
                    self.total_uj[z.zone] += delta_uj(last, now, z.max_range_uj)
                if now is not None:
                    self._last[z.zone] = now

    def snapshot(self) -> dict[str, int]:
        self.update()
        with self._lock:
            return dict(self.total_uj)


def window_result(meter: RaplMeter | None, reason: str | None, start: dict | None,
                  end: dict | None) -> dict:
    """The `cpu` block: joules per zone between two snapshots, package and DRAM totals."""
    if meter is None:
        return {"available": False, "reason": reason}
    if start is None or end is None:
        return {"available": False, "reason": "the window was not opened and closed"}
    rows = [{"zone": z.zone, "name": z.name,
             "energy_j": (end[z.zone] - start[z.zone]) / 1e6} for z in meter.zones]
    package = [r["energy_j"] for r in rows if r["name"].startswith("package")]
    dram = [r["energy_j"] for r in rows if r["name"] == "dram"]
    return {"available": True, "source": "RAPL /sys/class/powercap",
            "energy_j": sum(package) + sum(dram),
            "package_j": sum(package) if package else None,
            "dram_j": sum(dram) if dram else None,
            "zones": rows, "errors": meter.errors[:20]}
