"""Mesh specs (`4x8`, `data:4,fsdp:8`, `2x2x2`, `data:1,fsdp:4,tensor:8`, `32`, `-1`) and the
device mesh built from them.

Axes, outer to inner: `stage` (pipeline, named form only: `data:2,stage:4,tensor:4`) when
given, `data`, `fsdp`, then `tensor` and `expert` when given. `stage` is outermost, as in
Megatron-LM: consecutive stages are the farthest apart, so on several hosts the stages cross
hosts first (then `data`) while `tensor` stays inside a node. Otherwise only `data` may cross
hosts; the inner axes stay inside a host, where the links are fast
(NVLink vs InfiniBand): devices are grouped by process first (hybrid device mesh), so hsdp
shards within a node and replicates across nodes, and tensor parallelism never leaves a node.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.record import mesh_spec

AXES = ("data", "fsdp", "tensor", "expert", "stage")
_FORMS = ("DATAxFSDP[xTENSOR[xEXPERT[xSTAGE]]] (4x8, 2x2x2; stage is fifth: 2x1x4x1x4), "
          "axis:size pairs (data:1,fsdp:4,tensor:8; data:2,stage:4,tensor:4), N, or -1")


@dataclass(frozen=True)
class MeshShape:
    data: int  # -1: every device on `data`, resolved once devices are known
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    stage: int = 1  # pipeline stages; last so that the positional forms keep their meaning

    @property
    def axis_sizes(self) -> dict[str, int]:
        """The mesh's axes: stage first when larger than 1, data and fsdp always, tensor and
        expert when larger than 1."""
        sizes = {"stage": self.stage} if self.stage > 1 else {}
        sizes.update({"data": self.data, "fsdp": self.fsdp})
        if self.tensor > 1 or self.expert > 1:
            sizes["tensor"] = self.tensor
        if self.expert > 1:
            sizes["expert"] = self.expert
        return sizes

    @property
    def size(self) -> int | None:
        return None if self.data == -1 else math.prod(self.axis_sizes.values())

    @property
    def spec(self) -> str:
        """The mesh as `--mesh` takes it back (`4x8`, `data:2,stage:4`)."""
        return mesh_spec(self.axis_sizes)

    @property
    def label(self) -> str:
        """For folder names (no `:` or `,`); what a user reads is `spec`."""
        if self.stage > 1:  # the positional form has no place for stage: name every axis
            return "-".join(f"{a}{n}" for a, n in self.axis_sizes.items()
                            if n > 1 or a == "data")
        return "x".join(str(v) for v in self.axis_sizes.values())

    def resolve(self, num_devices: int) -> "MeshShape":
        return MeshShape(num_devices) if self.data == -1 else self


def parse_mesh(text: str) -> MeshShape:
    spec = text.strip()
    if spec == "-1":
        return MeshShape(-1)
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
        return MeshShape(**sizes) if "data" in sizes else MeshShape(1, **sizes)
    parts = spec.lower().split("x")
    if len(parts) > len(AXES):
        raise UsageError(f"mesh {text!r} has {len(parts)} axes; at most {len(AXES)} are "
                         f"supported ({', '.join(AXES)}); forms: {_FORMS}")
    return MeshShape(*[_size(p, text) for p in parts])


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
    names = tuple(shape.axis_sizes)
    return Mesh(hybrid_device_array(shape, devices), names,
                axis_types=(AxisType.Auto,) * len(names))


def hybrid_device_array(shape: MeshShape, devices):
    """Devices as an array over the mesh axes whose inner axes never cross a process (host)."""
    import numpy as np
    from jax.experimental import mesh_utils

    dims = list(shape.axis_sizes.values())
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        return np.array(sorted(devices, key=lambda d: d.id)).reshape(dims)
    if shape.stage > 1:
        return _stage_major(shape, dims, devices, len(processes))
    per_process = len(devices) // len(processes)
    inner = math.prod(dims[1:])
    if per_process % inner or shape.data % len(processes):
        raise UsageError(
            f"mesh {shape.label}: the inner axes ({inner} devices) must divide the devices "
            f"of one host ({per_process}) and data ({shape.data}) must be a multiple of the "
            f"hosts ({len(processes)}), so that only data crosses hosts")
    return mesh_utils.create_hybrid_device_mesh(
        [shape.data // len(processes), *dims[1:]], [len(processes)] + [1] * (len(dims) - 1),
        devices, process_is_granule=True)


def _stage_major(shape: MeshShape, dims: list[int], devices, hosts: int):
    """Several hosts with a pipeline: hosts are spread over `stage` first, then `data`, so a
    stage's tensor group never leaves a node (Megatron-LM's placement)."""
    from jax.experimental import mesh_utils

    across_stage = math.gcd(shape.stage, hosts)
    across_data = hosts // across_stage
    per_host = len(devices) // hosts
    inner = math.prod(dims[2:])
    if shape.data % across_data or per_host % inner:
        raise UsageError(
            f"mesh {shape.label}: {hosts} hosts must split over stage ({shape.stage}) and then "
            f"data ({shape.data}), with the inner axes ({inner} devices) inside one host "
            f"({per_host} devices)")
    ici = [shape.stage // across_stage, shape.data // across_data, *dims[2:]]
    dcn = [across_stage, across_data] + [1] * (len(dims) - 2)
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
