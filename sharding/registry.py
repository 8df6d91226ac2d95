"""Layouts by name. A layout is a pure function (abstract train state, mesh) -> a tree of
PartitionSpecs with the state's structure; it holds no training code.

The train state is a dict with three parts, so a layout can treat them differently:
`params` (trainable), `model_state` (non-trainable model variables, e.g. BatchNorm
statistics) and `opt` (optimizer state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from jax.sharding import Mesh, PartitionSpec as P

from jaxdist.errors import UsageError, choices, unknown
from sharding.axes import batch_axes
from sharding.optimizer import Layout, data_axes

SpecFn = Callable[[Any, Mesh], Any]
# ring_bytes(mesh axis sizes, parameter bytes, gradient bytes) -> bytes each device sends
RingBytes = Callable[[dict, int, int], float]


@dataclass(frozen=True)
class Analytic:
    """The parameter and gradient traffic a layout's implementation needs, on ring
    algorithms (activations and scalars ignored): what it assumes, and the bytes."""
    basis: str
    ring_bytes: RingBytes


@dataclass(frozen=True)
class LayoutFacts:
    """One layout: its spec function and what the rest of jaxdist may ask of it, so that
    nothing else branches on its name (register_layout says what each field means)."""
    name: str
    description: str
    spec_fn: SpecFn
    mesh_axes: tuple[str, ...]
    families: tuple[str, ...] | None
    requires: tuple[str, ...]
    min_devices: int
    distributed_optimizer: bool | None
    gathers_weights: bool
    pipelined: bool
    sequence_parallel: bool
    tp_comm_chunks: int
    analytic: Analytic | None
    out_of_process: bool
    replicated: bool


_FACTS: dict[str, LayoutFacts] = {}
# Mesh spec positions (DATAxFSDPxTENSORxEXPERT), to suggest a mesh with a missing axis.
_ORDER = ("data", "fsdp", "tensor", "expert")


def register_layout(name: str, description: str, mesh_axes=("data", "fsdp", "context"),
                    families=None,
                    requires=(), min_devices=1, distributed_optimizer=None,
                    gathers_weights=False, pipelined=False, sequence_parallel=False,
                    tp_comm_chunks=1, analytic: Analytic | None = None,
                    out_of_process=False, replicated=False):
    """`mesh_axes`: the axes the layout gives meaning to (others must have size 1; `context`
    where the layout runs context parallelism: the sequence split over it, weights not);
    `families`: the model families it applies to (None: all); `requires`: axes that must be
    larger than 1, without which the layout would silently be plain replication;
    `min_devices`: the devices it needs to shard anything (fsdp and zero1 shard over every
    device: on one they are a single-device run); `distributed_optimizer`: None where the
    layout already shards optimizer state as it sees fit (refused), False where it may be
    composed on top (--distributed-optimizer), True where it always is (zero1);
    `gathers_weights`: each block's weights are all-gathered for its forward and its
    gradients reduce-scattered after its backward (FSDP's per-block traffic), so a decoder's
    blocks run in order (gathers_block_weights); `pipelined`: the model runs as stages over
    the stage axis (jaxdist.pipeline); `sequence_parallel`: --sequence-parallel applies
    (Megatron's, over the tensor axis); `tp_comm_chunks`: the slices --tp-comm-chunks 0
    (auto) splits each device's batch into under sequence parallelism, where the micro-batch
    divides (jaxdist.run_model); `analytic`: its parameter and gradient traffic
    (jaxdist.program.comm sets it beside what the compiled program moves);
    `out_of_process`: its training runs in processes of its own (the parameter server's
    shard servers and workers, ps.driver), not as one mesh program in this one;
    `replicated`: every device (every worker) holds the whole train state, data parallelism
    at its plainest (the synchronous baseline a parameter server is compared with)."""
    def wrap(fn: SpecFn) -> SpecFn:
        if name in _FACTS:
            raise ValueError(f"layout {name!r} registered twice")
        _FACTS[name] = LayoutFacts(
            name, description, fn, tuple(mesh_axes), tuple(families) if families else None,
            tuple(requires), min_devices, distributed_optimizer, gathers_weights, pipelined,
            sequence_parallel, tp_comm_chunks, analytic, out_of_process, replicated)
        return fn
    return wrap


def facts(name: str) -> LayoutFacts:
    if name not in _FACTS:
        raise UsageError(unknown("layout", name, _FACTS))
    return _FACTS[name]


def recorded_facts(name: str) -> dict | None:
    """The facts a run's record keeps beside its layout's name (results.json
    `layout_facts`, docs/results.md), so that its readers, which import no jax, ask the
    facts instead of the name; None for a name that is no layout here (a PyTorch strategy
    of its own)."""
    f = _FACTS.get(name)
    return None if f is None else {
        "out_of_process": f.out_of_process, "pipelined": f.pipelined,
        "replicated": f.replicated, "distributed_optimizer": f.distributed_optimizer is True}


def layouts_where(**fields) -> tuple[str, ...]:
    """The layout names whose facts have these values, in the order they were registered
    (sharding/layouts.py, then pipeline.py), e.g. layouts_where(pipelined=True)."""
    return tuple(n for n, f in _FACTS.items()
                 if all(getattr(f, k) == v for k, v in fields.items()))


def _fits(name: str, axis_sizes: dict[str, int], family: str | None = None) -> bool:
    used = {a for a, n in axis_sizes.items() if n != 1}
    f = _FACTS[name]
    families = f.families
    return (used <= set(f.mesh_axes) and set(f.requires) <= used
            and not _too_few_devices(name, axis_sizes)
            and (family is None or not families or family in families))


def _too_few_devices(name: str, axis_sizes: dict[str, int]) -> bool:
    """Known to have fewer devices than the layout shards over (-1: known only later)."""
    sizes = list(axis_sizes.values())
    return all(n > 0 for n in sizes) and math.prod(sizes) < _FACTS[name].min_devices


def check_layout(name: str, axis_sizes: dict[str, int], family: str,
                 distributed_optimizer: bool = False) -> None:
    """A one-line error when the layout cannot use this mesh or model, or would not do on
    it what its name says (tp without a tensor axis is plain replication)."""
    if distributed_optimizer:
        check_distributed_optimizer(name, axis_sizes)
    f = facts(name)
    extra = [f"{a}={n}" for a, n in axis_sizes.items() if n > 1 and a not in f.mesh_axes]
    if extra:
        fits = [other for other in layout_names() if _fits(other, axis_sizes)]
        raise UsageError(f"layout {name!r} uses mesh axes {', '.join(f.mesh_axes)}; the "
                         f"mesh has {', '.join(extra)} (layouts for this mesh: "
                         f"{choices(fits) or 'none'})")
    families = f.families
    if families and family not in families:
        fits = [other for other in layout_names() if _fits(other, axis_sizes, family)]
        raise UsageError(f"layout {name!r} applies to {', '.join(families)} models, not "
                         f"{family!r} (layouts for {family!r} on this mesh: "
                         f"{choices(fits) or 'none'})")
    missing = [a for a in f.requires if axis_sizes.get(a, 1) == 1]
    if missing:
        axis = missing[0]
        raise UsageError(f"layout {name!r} splits over the {axis} axis, which this mesh does "
                         f"not have ({axis}=1: it would run as plain replication); add one, "
                         f"e.g. --mesh {suggest_mesh(axis_sizes, axis)}")
    if _too_few_devices(name, axis_sizes):
        n = f.min_devices
        raise UsageError(f"layout {name!r} shards over every device, and this mesh has one "
                         f"(it would run as a single device with nothing sharded); give it "
                         f"{n} or more, e.g. --mesh {n}")


def gathers_block_weights(name: str) -> bool:
    """Whether `name` gathers each block's weights and reduces its gradients block by block:
    there a decoder's blocks are ordered whatever the remat (models.layers.run_blocks), as
    PyTorch FSDP prefetches one block and frees it after its backward. XLA:GPU plans
    (experiments.predict --validate): Llama2-13B without remat, fsdp on 64 A100, ordered
    72.7 GiB (the whole 40-block program compiled: 70.3) and 2,347 tokens/s/GPU against
    81.6 GiB and 2,147 unordered; the `dots` rows within 4% in time. Not where gradients are
    reduced after the backward (ddp, zero1, tp with the distributed optimizer: the
    Megatron-style plan holds 48.5 GiB and takes 889 ms a step ordered, 41.0 GiB and 861 ms
    unordered)."""
    return name in _FACTS and _FACTS[name].gathers_weights


def distributed_optimizer_layouts() -> list[str]:
    return [n for n in layout_names() if _FACTS[n].distributed_optimizer is not None]


def check_distributed_optimizer(name: str, axis_sizes: dict[str, int]) -> None:
    """--distributed-optimizer: a layout that replicates parameters over the data axes, on a
    mesh that has one (else it would shard nothing)."""
    if name in _FACTS and _FACTS[name].distributed_optimizer is None:
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
    return sorted(_FACTS)


def describe_layouts() -> str:
    return "; ".join(f"{name}: {_FACTS[name].description}" for name in layout_names())


def get_layout(name: str, distributed_optimizer: bool = False,
               grad_reduce_dtype: str = "float32") -> Layout:
    """The layout as data: its spec function, with the distributed optimizer composed on
    top where asked for (or where the layout is defined by it: zero1), and the dtype its
    gradients are reduced in under master weights (Layout.reduce_dtype)."""
    f = facts(name)
    if distributed_optimizer:
        check_distributed_optimizer(name, {})
    fn, dist = f.spec_fn, bool(distributed_optimizer or f.distributed_optimizer)
    # the name of what it is: ddp with the distributed optimizer is zero1
    same = [n for n in layout_names() if _FACTS[n].spec_fn is fn
            and bool(_FACTS[n].distributed_optimizer) == dist]
    return Layout(same[0] if len(same) == 1 else name, fn, dist, f.pipelined,
                  grad_reduce_dtype)


def batch_spec(mesh: Mesh) -> P:
    """The batch's leading dimension is sharded over every axis but `tensor` (a tensor-
    parallel group works on the same rows) and `stage` (every pipeline stage sees the same
    micro-batches): over all devices when there is neither."""
    return P(batch_axes(mesh.axis_names))
