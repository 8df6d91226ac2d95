"""Mesh specs (`4x8`, `data:4,fsdp:8`, `32`, `-1`) and the device mesh built from them.

Axis `data` is outer and `fsdp` inner. On several hosts the inner axis must stay inside a
host, where the links are fast (NVLink vs InfiniBand): devices are grouped by process first
(hybrid device mesh), so hsdp shards within a node and replicates across nodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxdist.errors import UsageError

AXES = ("data", "fsdp")
_FORMS = "DATAxFSDP (4x8), data:4,fsdp:8, N, or -1"


@dataclass(frozen=True)
class MeshShape:
    data: int  # -1: every device on `data`, resolved once devices are known
    fsdp: int = 1

    @property
    def size(self) -> int | None:
        return None if self.data == -1 else self.data * self.fsdp

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp}

    @property
    def label(self) -> str:
        return f"{self.data}x{self.fsdp}"

    def resolve(self, num_devices: int) -> "MeshShape":
        return MeshShape(num_devices, 1) if self.data == -1 else self


def parse_mesh(text: str) -> MeshShape:
    spec = text.strip()
    if spec == "-1":
        return MeshShape(-1, 1)
    if ":" in spec:
        sizes = {}
        for item in spec.split(","):
            name, _, value = item.partition(":")
            name = name.strip()
            if name not in AXES:
                raise UsageError(f"mesh {text!r}: unknown axis {name!r}; axes are "
                                 f"{', '.join(AXES)} (forms: {_FORMS})")
            if name in sizes:
                raise UsageError(f"mesh {text!r}: axis {name!r} given twice")
            sizes[name] = _size(value, text)
        return MeshShape(sizes.get("data", 1), sizes.get("fsdp", 1))
    parts = spec.lower().split("x")
    if len(parts) > len(AXES):
        raise UsageError(f"mesh {text!r} has {len(parts)} axes; at most {len(AXES)} are "
                         f"supported ({', '.join(AXES)}); forms: {_FORMS}")
    sizes = [_size(p, text) for p in parts]
    return MeshShape(*sizes)


def _size(value: str, text: str) -> int:
    value = value.strip()
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise UsageError(f"mesh {text!r}: axis size {value!r} is not a positive integer; "
                         f"forms: {_FORMS}")
    return int(value)


def build_mesh(shape: MeshShape, devices=None):
    """A `jax.sharding.Mesh` with Auto axes (jit-sharded layouts need them; the default
    Explicit axes reject an FSDP matmul) and host-major device order."""
    import jax
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = shape.resolve(len(devices))
    if shape.size != len(devices):
        raise UsageError(f"mesh {shape.label} needs {shape.size} devices but "
                         f"{len(devices)} are present")
    device_array = hybrid_device_array(shape, devices)
    return Mesh(device_array, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def hybrid_device_array(shape: MeshShape, devices):
    """Devices as a (data, fsdp) array whose fsdp rows never cross a process (host)."""
    from jax.experimental import mesh_utils

    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        import numpy as np
        return np.array(sorted(devices, key=lambda d: d.id)).reshape(shape.data, shape.fsdp)
    per_process = len(devices) // len(processes)
    if per_process % shape.fsdp or shape.data % len(processes):
        raise UsageError(
            f"mesh {shape.label}: the fsdp axis ({shape.fsdp}) must divide the devices of one "
            f"host ({per_process}) and data ({shape.data}) must be a multiple of the hosts "
            f"({len(processes)}), so that fsdp stays inside a host")
    return mesh_utils.create_hybrid_device_mesh(
        (shape.data // len(processes), shape.fsdp), (len(processes), 1), devices,
        process_is_granule=True)
