"""The mesh layouts registered here, as spec tables: DDP, ZeRO-1 (DDP +
sharding/optimizer.py), FSDP (ZeRO-3), HSDP, PS (replicated inside a worker; the shard
servers hold the rest), and TP, FSDP x TP and EP (rules over logical axes,
sharding/logical.py). The pipeline layouts (pp, tp_pp, fsdp_pp) are in sharding/pipeline.py.

A sharded leaf is split on its largest dimension divisible by the shard count (ties: the
first such dimension); where none divides, on the dimension that pads least, stored padded
(sharding/padding.py), so a layout shards what it says on any device count. Only scalars and
leaves whose every dimension is 1 stay replicated.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from sharding.logical import rule_specs
from sharding.padding import choose_dim
from sharding.registry import Analytic, register_layout


def shard_dim(shape: tuple[int, ...], shards: int) -> int | None:
    """Index of the dimension to split `shards` ways (padded where they do not divide it),
    or None to replicate."""
    return choose_dim(shape, shards)


def sharded(tree, mesh: Mesh, axes: tuple[str, ...]):
    """Specs splitting every leaf of `tree` over the mesh axes `axes` taken together."""
    shards = math.prod(mesh.shape[a] for a in axes)
    axis = axes if len(axes) > 1 else axes[0]

    def spec(leaf):
        dim = shard_dim(tuple(leaf.shape), shards)
        if dim is None:
            return P()
        return P(*([None] * dim + [axis]))
    return jax.tree.map(spec, tree)


def replicated(tree):
    return jax.tree.map(lambda _: P(), tree)


# What each data-parallel layout's gradient and parameter traffic is, on rings (n devices;
# hsdp: f per fsdp group, d = n / f groups), for jaxdist.program.comm to set beside the program's.
def _ring(n: int) -> float:
    return (n - 1) / n


def _devices(sizes: dict) -> int:
    return math.prod(sizes.values())


DDP_TRAFFIC = Analytic("ring all-reduce of the gradients: 2(N-1)/N x parameter bytes",
                       lambda sizes, p, g: 2 * _ring(_devices(sizes)) * p)
ZERO1_TRAFFIC = Analytic(
    "ddp with the distributed optimizer (ZeRO-1): gradients reduce-scattered to each "
    "device's optimizer shard, updated parameters all-gathered: (N-1)/N x gradient bytes + "
    "(N-1)/N x parameter bytes, the ZeRO paper's 2(N-1)/N x parameter bytes; with --dtype "
    "bfloat16 the gradients are float32 (reduced as Megatron's) and the gathered working "
    "weights bfloat16",
    lambda sizes, p, g: _ring(_devices(sizes)) * (g + p))
FSDP_TRAFFIC = Analytic("all-gather of the parameters + reduce-scatter of the gradients, "
                        "each once: 2(N-1)/N x parameter bytes",
                        lambda sizes, p, g: 2 * _ring(_devices(sizes)) * p)


def _hsdp_bytes(sizes: dict, p: int, g: int) -> float:
    f = sizes.get("fsdp", 1)
    d = _devices(sizes) // f
    return 2 * _ring(f) * p + 2 * _ring(d) * p / f


HSDP_TRAFFIC = Analytic("inside an fsdp group of F: all-gather + reduce-scatter, 2(F-1)/F x "
                        "parameter bytes; across the D = N/F groups: all-reduce of the "
                        "gradient shard, 2(D-1)/D x parameter bytes / F", _hsdp_bytes)


@register_layout("ddp", "parameters and optimizer state replicated; gradients all-reduced "
                 "(--distributed-optimizer: zero1)", distributed_optimizer=False,
                 analytic=DDP_TRAFFIC, replicated=True)
def ddp(state, mesh: Mesh):
    return replicated(state)


# ZeRO-1 is ddp with the distributed optimizer (sharding/optimizer.py): one implementation.
register_layout("zero1", "ddp with the distributed optimizer: parameters replicated; "
                "optimizer state (and the float32 master with --dtype bfloat16) sharded over "
                "all devices; gradients reduce-scattered, parameters all-gathered",
                min_devices=2, distributed_optimizer=True, analytic=ZERO1_TRAFFIC)(ddp)


@register_layout("fsdp", "parameters, gradients and optimizer state sharded over all devices",
                 min_devices=2, gathers_weights=True, analytic=FSDP_TRAFFIC)
def fsdp(state, mesh: Mesh):
    return sharded(state, mesh, tuple(mesh.axis_names))


@register_layout("hsdp", "sharded over the fsdp axis, replicated over the data axis",
                 requires=("fsdp",), gathers_weights=True, analytic=HSDP_TRAFFIC)
def hsdp(state, mesh: Mesh):
    return sharded(state, mesh, ("fsdp",))


@register_layout("ps", "parameter server: gRPC shard servers hold parameters and optimizer "
                 "state; inside each worker the state is replicated", mesh_axes=("data", "fsdp"),
                 out_of_process=True, replicated=True)
def ps(state, mesh: Mesh):
    return replicated(state)


@register_layout("tp", "Megatron tensor parallel: attention heads, MLP hidden and vocabulary "
                 "split over the tensor axis; batch over data and fsdp",
                 mesh_axes=("data", "fsdp", "context", "tensor"), families=("gpt", "moe"),
                 requires=("tensor",), distributed_optimizer=False, sequence_parallel=True,
                 tp_comm_chunks=2)
def tp(state, mesh: Mesh):
    return rule_specs(state, mesh, "tp")


@register_layout("fsdp_tp", "2-D: tp over the tensor axis plus every parameter's embedding "
                 "dimension sharded over data and fsdp",
                 mesh_axes=("data", "fsdp", "context", "tensor"), families=("gpt", "moe"),
                 requires=("tensor",), gathers_weights=True, sequence_parallel=True,
                 tp_comm_chunks=2)
def fsdp_tp(state, mesh: Mesh):
    return rule_specs(state, mesh, "fsdp_tp")


@register_layout("ep", "expert parallel: whole experts per device of the expert axis, tokens "
                 "dispatched to them (all-to-all); heads, expert hidden and vocabulary over "
                 "tensor (EP x TP); batch over the other axes",
                 mesh_axes=("data", "fsdp", "context", "tensor", "expert"), families=("moe",),
                 requires=("expert",), distributed_optimizer=False)
def ep(state, mesh: Mesh):
    return rule_specs(state, mesh, "ep")
