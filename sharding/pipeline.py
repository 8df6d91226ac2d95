"""Pipeline layouts: pp, tp_pp, fsdp_pp and ep_pp, as spec tables over the pipeline train state.

The pipeline state (jaxdist/pipeline/state.py) holds `params = {"stages": ..., "shared": ...}`:
every block parameter stacked to [S, V, K, *shape] (stage, virtual chunk, block within the
chunk), its leading dimension split over the `stage` mesh axis, so each stage holds only its
own blocks; and the embeddings, final norm and head in `shared`, which every stage holds (see
jaxdist/pipeline/step.py for why). Inside a stage:

- pp: the stage's blocks replicated over `data`; the batch over `data`.
- tp_pp: Megatron tensor parallelism inside each stage (heads, MLP hidden and vocabulary
  over `tensor`), the tp layout's rules; Go et al. 2025's TPxPP.
- fsdp_pp: each stage's parameters (and the shared ones) sharded over `fsdp`; batch over
  `data` and `fsdp`.
- ep_pp: expert parallelism inside each stage (the ep layout's rules: whole experts over
  `expert`); batch over `data` and `expert`. Not with a `tensor` axis as well: with two
  partitioner axes inside the per-stage switch, XLA 0.10.2's SPMD partitioner aborts on a
  check (spmd_partitioner_util.cc, ExpandDeviceGroupsWithIota, partitioning a gather).

Optimizer state (Adam's mu and nu) has the same path suffix and shape as its parameter and
gets the same spec.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec as P

from sharding.layouts import shard_dim
from sharding.logical import leaf_rule_spec, raise_indivisible
from sharding.registry import layouts_where, register_layout

STACKED = "stages"  # params["stages"]: leaves [S, V, K, *shape]
STACK_DIMS = 3


def _names(path) -> list[str]:
    out = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str):
            out.append(name)
    return out


def is_stacked(path) -> bool:
    """Whether a state leaf's path is a stacked block leaf ([S, V, K, *shape])."""
    return STACKED in _names(path)


def _inner(path, shape, mesh: Mesh, inner: str, bad: list) -> list:
    """The spec of one parameter (without stack dimensions) inside a stage; a dimension tp
    cannot split is appended to `bad`."""
    if inner == "tp":
        spec = leaf_rule_spec(path, tuple(shape), dict(mesh.shape), "tp", bad)
        return list(spec) + [None] * (len(shape) - len(spec))
    if inner == "ep":
        spec = leaf_rule_spec(path, tuple(shape), dict(mesh.shape), "ep", bad)
        return list(spec) + [None] * (len(shape) - len(spec))
    if inner == "fsdp":
        n = mesh.shape.get("fsdp", 1)
        dim = shard_dim(tuple(shape), n)
        return [("fsdp" if i == dim else None) for i in range(len(shape))]
    return [None] * len(shape)


def pipeline_specs(state, mesh: Mesh, inner: str):
    bad: list = []

    def spec(path, leaf):
        if not leaf.shape:
            return P()
        if is_stacked(path):
            rest = _inner(path, leaf.shape[STACK_DIMS:], mesh, inner, bad)
            return P("stage", None, None, *rest)
        return P(*_inner(path, leaf.shape, mesh, inner, bad))
    specs = jax.tree_util.tree_map_with_path(spec, state)
    if bad:
        raise_indivisible(bad, dict(mesh.shape), f"{inner}_pp")
    return specs


@register_layout("pp", "pipeline parallel: contiguous groups of blocks per device of the stage "
                 "axis (--pp-schedule, --microbatches), activations sent stage to stage; "
                 "batch over data", mesh_axes=("data", "stage", "context"),
                 families=("gpt", "moe"),
                 requires=("stage",), distributed_optimizer=False, pipelined=True)
def pp(state, mesh: Mesh):
    return pipeline_specs(state, mesh, "none")


@register_layout("tp_pp", "pipeline over the stage axis with Megatron tensor parallelism "
                 "inside each stage (Go et al.'s TPxPP); batch over data",
                 mesh_axes=("data", "stage", "tensor", "context"), families=("gpt", "moe"),
                 requires=("stage",), distributed_optimizer=False, pipelined=True,
                 sequence_parallel=True)
def tp_pp(state, mesh: Mesh):
    return pipeline_specs(state, mesh, "tp")


@register_layout("fsdp_pp", "pipeline over the stage axis with each stage's parameters and "
                 "optimizer state sharded over fsdp; batch over data and fsdp",
                 mesh_axes=("data", "fsdp", "stage", "context"), families=("gpt", "moe"),
                 requires=("stage",), pipelined=True)
def fsdp_pp(state, mesh: Mesh):
    return pipeline_specs(state, mesh, "fsdp")


@register_layout("ep_pp", "pipeline over the stage axis with expert parallelism inside each "
                 "stage: whole experts per device of the expert axis, tokens dispatched to "
                 "them (all-to-all); batch over expert (Go et al.'s and Megatron's EP x PP; "
                 "no tensor axis: XLA's SPMD partitioner fails a check with two free axes "
                 "inside a stage)",
                 mesh_axes=("data", "stage", "expert"), families=("moe",),
                 requires=("stage", "expert"), distributed_optimizer=False, pipelined=True)
def ep_pp(state, mesh: Mesh):
    return pipeline_specs(state, mesh, "ep")


PIPELINE_LAYOUTS = layouts_where(pipelined=True)  # pp, tp_pp, fsdp_pp, ep_pp
