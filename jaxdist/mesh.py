"""Mesh specs (`4x8`, `data:4,fsdp:8`, `2x2x2`, `data:1,fsdp:4,tensor:8`, `32`, `-1`) and the
device mesh built from them.

Axes, outer to inner: `stage` (pipeline, named form only: `data:2,stage:4,tensor:4`) when
given, `data`, `fsdp`, `context` (context parallelism: the sequence split, named form only:
`data:2,context:2`) when given, then `tensor` and `expert` when given. `stage` is outermost, as in
Megatron-LM: consecutive stages are the farthest apart.

Across hosts (processes of a run; nodes of `--gpus-per-node` GPUs in a plan) the device array
is a hybrid mesh, as MaxText's ICI x DCN split (`mesh_utils.create_hybrid_device_mesh`): each
axis is an in-host part times an across-host part. The innermost axes fill a host first, each
taking the largest part of its size that the devices left in the host divide; the rest of
every axis spans hosts. `data:2,fsdp:128` on 32 hosts of 8 is fsdp 8 in-host x 16 across and
data 2 across (ICI FSDP 8 x DCN FSDP 16 x DCN DP 2); `data:4,fsdp:8` on hosts of 8 keeps each
fsdp group in a host and replicates across hosts; tensor parallelism leaves a host only when
`tensor` is larger than one host. Any mesh whose devices fill its hosts evenly has such a
split.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.record import mesh_spec

AXES = ("data", "fsdp", "tensor", "expert", "stage", "context")
_FORMS = ("DATAxFSDP[xTENSOR[xEXPERT[xSTAGE]]] (4x8, 2x2x2; stage is fifth: 2x1x4x1x4), "
          "axis:size pairs (data:1,fsdp:4,tensor:8; data:2,stage:4,tensor:4; "
          "data:2,context:2), N, or -1")


@dataclass(frozen=True)
class MeshShape:
    data: int  # -1: every device on `data`, resolved once devices are known
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    stage: int = 1  # pipeline stages; last so that the positional forms keep their meaning
    context: int = 1  # context parallelism (the sequence split); named form only

    @property
    def axis_sizes(self) -> dict[str, int]:
        """The mesh's axes: stage first when larger than 1, data and fsdp always, context,
        tensor and expert when larger than 1."""
        sizes = {"stage": self.stage} if self.stage > 1 else {}
        sizes.update({"data": self.data, "fsdp": self.fsdp})
        if self.context > 1:
            sizes["context"] = self.context
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
        if self.stage > 1 or self.context > 1:  # no place in the positional form: named
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
    positional = AXES[:5]  # context is named only
    if len(parts) > len(positional):
        raise UsageError(f"mesh {text!r} has {len(parts)} axes; the short form takes at most "
                         f"{len(positional)} ({', '.join(positional)}; context by name: "
                         f"data:2,context:2); forms: {_FORMS}")
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


def host_split(dims: list[int], per_host: int) -> list[int]:
    """The in-host part of each axis of `dims` on hosts of `per_host` devices: innermost
    axes first, each the largest divisor of its size that the devices left in the host
    divide (gcd); an axis's size / its part spans hosts."""
    parts, left = [], per_host
    for n in reversed(dims):
        parts.append(math.gcd(n, left))
        left //= parts[-1]
    if left != 1:  # per_host does not divide the mesh's devices
        raise UsageError(f"mesh {'x'.join(map(str, dims))} ({math.prod(dims)} devices) cannot "
                         f"fill hosts of {per_host} devices: use a mesh whose device count is "
                         f"a multiple of {per_host}")
    return parts[::-1]


def placement(dims: list[int], per_host: int):
    """(host, slot) of every mesh position, arrays of shape `dims`: hosts numbered row-major
    over the across-host parts of the axes, slots row-major over the in-host parts
    (`host_split`); a mesh of at most one host is host 0 throughout."""
    import numpy as np

    per_host = min(per_host, math.prod(dims))
    inner = host_split(dims, per_host)
    outer = [n // k for n, k in zip(dims, inner)]
    index = np.indices(dims)
    host = np.ravel_multi_index([index[i] // inner[i] for i in range(len(dims))], outer)
    slot = np.ravel_multi_index([index[i] % inner[i] for i in range(len(dims))], inner)
    return host, slot


def host_of(sizes: dict[str, int], per_host: int):
    """The host of every position of a mesh of `sizes` on hosts of `per_host` devices (its
    placement by `placement`), an array over the mesh axes."""
    return placement(list(sizes.values()), per_host)[0]


def axis_spread(sizes: dict[str, int], hosts) -> dict:
    """Per mesh axis, how its groups lie over hosts: {axis: {"in_host": fewest members of a
    group in one host, "hosts": most hosts a group spans}}; `hosts`: the host of every mesh
    position (an array over the axes)."""
    import numpy as np

    hosts = np.asarray(hosts).reshape(tuple(sizes.values()))
    out = {}
    for i, (axis, size) in enumerate(sizes.items()):
        worst = (1, size)
        for group in np.moveaxis(hosts, i, -1).reshape(-1, size):
            _, counts = np.unique(group, return_counts=True)
            worst = max(worst, (len(counts), int(counts.min())), key=lambda t: (t[0], -t[1]))
        out[axis] = {"in_host": worst[1], "hosts": worst[0]}
    return out


def hybrid_device_array(shape: MeshShape, devices):
    """Devices as an array over the mesh axes, placed over the hosts (processes) by
    `placement`: a host's devices in id order fill its slots. One process: id order."""
    import numpy as np

    dims = list(shape.axis_sizes.values())
    hosts: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        hosts.setdefault(d.process_index, []).append(d)
    by_host = list(hosts.values())
    if len(by_host) == 1:
        return np.array(by_host[0]).reshape(dims)
    if len({len(h) for h in by_host}) > 1:
        raise UsageError(f"mesh {shape.label}: its hosts hold different device counts "
                         f"({', '.join(str(len(h)) for h in by_host)})")
    host, slot = placement(dims, len(by_host[0]))
    array = np.empty(dims, dtype=object)
    for index in np.ndindex(*dims):
        array[index] = by_host[host[index]][slot[index]]
    return array
