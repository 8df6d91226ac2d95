"""Layouts by name. A layout is a pure function (abstract train state, mesh) -> a tree of
PartitionSpecs with the state's structure; it holds no training code.

The train state is a dict with three parts, so a layout can treat them differently:
`params` (trainable), `model_state` (non-trainable model variables, e.g. BatchNorm
statistics) and `opt` (optimizer state).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jax.sharding import Mesh, PartitionSpec as P

from jaxdist.errors import UsageError, choices, unknown
from sharding.axes import batch_axes
from sharding.optimizer import Layout, data_axes

SpecFn = Callable[[Any, Mesh], Any]
_LAYOUTS: dict[str, SpecFn] = {}
_DESCRIPTIONS: dict[str, str] = {}
_MESH_AXES: dict[str, tuple[str, ...]] = {}
_FAMILIES: dict[str, tuple[str, ...] | None] = {}
_REQUIRES: dict[str, tuple[str, ...]] = {}
_MIN_DEVICES: dict[str, int] = {}
_DIST_OPT: dict[str, bool | None] = {}
_GATHERS: dict[str, bool] = {}
# Mesh spec positions (DATAxFSDPxTENSORxEXPERT), to suggest a mesh with a missing axis.
_ORDER = ("data", "fsdp", "tensor", "expert")


def register_layout(name: str, description: str, mesh_axes=("data", "fsdp"), families=None,
                    requires=(), min_devices=1, distributed_optimizer=None,
                    gathers_weights=False):
    """`mesh_axes`: the axes the layout gives meaning to (others must have size 1);
    `families`: the model families it applies to (None: all); `requires`: axes that must be
    larger than 1, without which the layout would silently be plain replication;
    `min_devices`: the devices it needs to shard anything (fsdp and zero1 shard over every
    device: on one they are a single-device run); `distributed_optimizer`: None where the
    layout already shards optimizer state as it sees fit (refused), False where it may be
    composed on top (--distributed-optimizer), True where it always is (zero1);
    `gathers_weights`: each block's weights are all-gathered for its forward and its
    gradients reduce-scattered after its backward (FSDP's per-block traffic), so a decoder's
    blocks run in order (gathers_block_weights)."""
    def wrap(fn: SpecFn) -> SpecFn:
        if name in _LAYOUTS:
            raise ValueError(f"layout {name!r} registered twice")
        _LAYOUTS[name] = fn
        _DESCRIPTIONS[name] = description
        _MESH_AXES[name] = tuple(mesh_axes)
        _FAMILIES[name] = tuple(families) if families else None
        _REQUIRES[name] = tuple(requires)
        _MIN_DEVICES[name] = min_devices
        _DIST_OPT[name] = distributed_optimizer
        _GATHERS[name] = gathers_weights
        return fn
    return wrap


def _fits(name: str, axis_sizes: dict[str, int], family: str | None = None) -> bool:
    used = {a for a, n in axis_sizes.items() if n != 1}
    families = _FAMILIES[name]
    return (used <= set(_MESH_AXES[name]) and set(_REQUIRES[name]) <= used
            and not _too_few_devices(name, axis_sizes)
            and (family is None or not families or family in families))


def _too_few_devices(name: str, axis_sizes: dict[str, int]) -> bool:
    """Known to have fewer devices than the layout shards over (-1: known only later)."""
    sizes = list(axis_sizes.values())
    return all(n > 0 for n in sizes) and math.prod(sizes) < _MIN_DEVICES[name]


def check_layout(name: str, axis_sizes: dict[str, int], family: str,
                 distributed_optimizer: bool = False) -> None:
    """A one-line error when the layout cannot use this mesh or model, or would not do on
    it what its name says (tp without a tensor axis is plain replication)."""
    if distributed_optimizer:
        check_distributed_optimizer(name, axis_sizes)
    extra = [f"{a}={n}" for a, n in axis_sizes.items() if n > 1 and a not in _MESH_AXES[name]]
    if extra:
        fits = [other for other in layout_names() if _fits(other, axis_sizes)]
        raise UsageError(f"layout {name!r} uses mesh axes {', '.join(_MESH_AXES[name])}; the "
                         f"mesh has {', '.join(extra)} (layouts for this mesh: "
                         f"{choices(fits) or 'none'})")
    families = _FAMILIES[name]
    if families and family not in families:
        fits = [other for other in layout_names() if _fits(other, axis_sizes, family)]
        raise UsageError(f"layout {name!r} applies to {', '.join(families)} models, not "
                         f"{family!r} (layouts for {family!r} on this mesh: "
                         f"{choices(fits) or 'none'})")
    missing = [a for a in _REQUIRES[name] if axis_sizes.get(a, 1) == 1]
    if missing:
        axis = missing[0]
        raise UsageError(f"layout {name!r} splits over the {axis} axis, which this mesh does "
                         f"not have ({axis}=1: it would run as plain replication); add one, "
                         f"e.g. --mesh {suggest_mesh(axis_sizes, axis)}")
    if _too_few_devices(name, axis_sizes):
        n = _MIN_DEVICES[name]
        raise UsageError(f"layout {name!r} shards over every device, and this mesh has one "
                         f"(it would run as a single device with nothing sharded); give it "
                         f"{n} or more, e.g. --mesh {n}")


def gathers_block_weights(name: str) -> bool:
    """Whether `name` gathers each block's weights and reduces its gradients block by block:
    there a decoder's blocks are ordered whatever the remat (models.layers.run_blocks), as
    PyTorch FSDP prefetches one block and frees it after its backward. XLA:GPU plans
    (experiments.predict --validate): Llama2-13B without remat, fsdp on 64 A100, 81.6 ->
    72.7 GiB (the whole 40-block program compiled: 70.3) and 2,147 -> 2,347 tokens/s/GPU;
    the `dots` rows within 4% in time. Not where gradients are reduced after the backward
    (ddp, zero1, tp with the distributed optimizer: the Megatron-style plan went 41.0 ->
    48.5 GiB and 861 -> 889 ms a step ordered)."""
    return _GATHERS.get(name, False)


def distributed_optimizer_layouts() -> list[str]:
    return [n for n in layout_names() if _DIST_OPT[n] is not None]


def check_distributed_optimizer(name: str, axis_sizes: dict[str, int]) -> None:
    """--distributed-optimizer: a layout that replicates parameters over the data axes, on a
    mesh that has one (else it would shard nothing)."""
    if _DIST_OPT.get(name, False) is None:
        raise UsageError(f"--distributed-optimizer shards optimizer state over the data axes "
                         f"of a layout that replicates parameters there; layout {name!r} "
                         f"shards its own (choose from "
                         f"{choices(distributed_optimizer_layouts())}, or drop the flag)")
    if axis_sizes and all(n > 0 for n in axis_sizes.values()) and not data_axes(axis_sizes):
        raise UsageError(f"--distributed-optimizer shards over the data axes (data, fsdp"
                         f"{', expert' if 'expert' in axis_sizes else ''}), all of size 1 on "
                         f"this mesh: it would shard nothing; give data 2 or more, e.g. "
                         f"--mesh {_with_data(axis_sizes)}")


def _with_data(axis_sizes: dict[str, int]) -> str:
    sizes = {"data": 2, **{a: n for a, n in axis_sizes.items() if n > 1 and a != "data"}}
    return ",".join(f"{a}:{n}" for a, n in sizes.items())


def suggest_mesh(axis_sizes: dict[str, int], axis: str) -> str:
    """A mesh spec like the given one with `axis` of size 2, on the same number of devices
    where a factor of 2 can move over from fsdp or data."""
    if axis == "stage" or axis_sizes.get("stage", 1) > 1:  # named form: stage has no short one
        sizes = {a: n for a, n in axis_sizes.items() if n > 1 or a == "data"}
        if sizes.get("data", 1) < 1:
            sizes["data"] = 1
        donor = next((a for a in ("data", "fsdp") if sizes.get(a, 1) % 2 == 0), None)
        if donor:
            sizes[donor] //= 2
        sizes[axis] = 2
        return ",".join(f"{a}:{n}" for a, n in sizes.items())
    sizes = {a: axis_sizes.get(a, 1) for a in _ORDER}
    if sizes["data"] < 1:  # -1: size known only once devices are; a generic example
        sizes = {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}
    for donor in ("fsdp", "data"):
        if sizes[donor] % 2 == 0:
            sizes[donor] //= 2
            break
    sizes[axis] = 2
    last = max(i for i, a in enumerate(_ORDER) if sizes[a] > 1 or a in ("fsdp", axis))
    return "x".join(str(sizes[a]) for a in _ORDER[:last + 1])


def layout_names() -> list[str]:
    return sorted(_LAYOUTS)


def describe_layouts() -> str:
    return "; ".join(f"{name}: {_DESCRIPTIONS[name]}" for name in layout_names())


def get_layout(name: str, distributed_optimizer: bool = False) -> Layout:
    """The layout as data: its spec function, with the distributed optimizer composed on
    top where asked for (or where the layout is defined by it: zero1)."""
    if name not in _LAYOUTS:
        raise UsageError(unknown("layout", name, _LAYOUTS))
    if distributed_optimizer:
        check_distributed_optimizer(name, {})
    fn, dist = _LAYOUTS[name], bool(distributed_optimizer or _DIST_OPT[name])
    # the name of what it is: ddp with the distributed optimizer is zero1
    same = [n for n in layout_names() if _LAYOUTS[n] is fn and bool(_DIST_OPT[n]) == dist]
    return Layout(same[0] if len(same) == 1 else name, fn, dist)


def batch_spec(mesh: Mesh) -> P:
    """The batch's leading dimension is sharded over every axis but `tensor` (a tensor-
    parallel group works on the same rows) and `stage` (every pipeline stage sees the same
    micro-batches): over all devices when there is neither."""
    return P(batch_axes(mesh.axis_names))
