"""The train state's parts and the optimizer update, shared by the one-program step
(jaxdist/train_step.py), the pipeline step (jaxdist/pipeline/program.py) and the plans.

State: `params` (what the model computes with), `model_state`, `opt`, and under the
distributed optimizer with --dtype bfloat16 `master`: Megatron's layout, bfloat16 working
weights beside a float32 master copy that the optimizer updates (sharded over the data axes
with the optimizer state, sharding/optimizer.py). Without `master` the float32 parameters
are their own master.

The update: gradients are constrained to the update placement, which under the distributed
optimizer is the data-sharded one, so the partitioner reduce-scatters them there; the
optimizer updates the shard; the new parameters leave the step in the layout's placement
(replicated over data), which all-gathers them. Gradients of bfloat16 working weights are
reduced in float32 (cast up first, Megatron-LM's default under --bf16) or, with
--grad-reduce-dtype bfloat16, as they are and cast up on the shard (sharding/optimizer.py
`Layout.reduce_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from sharding import batch_spec
from sharding.optimizer import axes_of
from sharding.padding import fit, fit_tree


def train_state(params, model_state, tx, master_dtype=None) -> dict:
    """{params, model_state, opt} from float32 `params`; with `master_dtype` (bfloat16) the
    working weights are cast to it and the float32 ones kept as `master`."""
    if master_dtype is None:
        return {"params": params, "model_state": model_state, "opt": tx.init(params)}
    working = jax.tree.map(lambda x: x.astype(master_dtype), params)
    return {"params": working, "master": params, "model_state": model_state,
            "opt": tx.init(params)}


def apply_gradients(tx, state: dict, grads, update_shardings, update_shapes=None,
                    param_shapes=None, reduce_float32: bool = True) -> dict:
    """The state after one optimizer step on `grads` (model_state as it was: the caller
    replaces it), the update run in `update_shardings` on leaves stored as `update_shapes`
    (padded where the update's split does not divide them; None: as they come), the new
    parameters stored as `param_shapes`. Under master weights `reduce_float32` False: the
    gradients reach their shards in the working dtype and are cast up there."""
    master = "master" in state
    weights = state["master"] if master else state["params"]
    if update_shapes is not None:
        grads = fit_tree(grads, update_shapes)
        weights = fit_tree(weights, update_shapes)
    if master and not reduce_float32:  # reduced as they are, then cast up on the shard
        grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    if master:  # float32 (before the reduction where reduce_float32: the barrier keeps XLA
        # from reducing bf16); one barrier per leaf, so no leaf's update waits for every
        # other leaf's gradient
        grads = jax.tree.map(lambda g, w: jax.lax.optimization_barrier(g.astype(w.dtype)),
                             grads, weights)
    grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    weights = jax.lax.with_sharding_constraint(weights, update_shardings)
    updates, opt = tx.update(grads, state["opt"], weights)
    weights = optax.apply_updates(weights, updates)
    out = {**state, "opt": opt}
    if master:
        out["master"] = weights
        # cast on the shard, so the all-gather moves bfloat16 (Megatron's parameter gather)
        working = jax.tree.map(lambda w, p: w.astype(p.dtype), weights, state["params"])
        out["params"] = jax.lax.with_sharding_constraint(working, update_shardings)
    else:
        out["params"] = weights
    if param_shapes is not None:
        out["params"] = fit_tree(out["params"], param_shapes)
    return out


# Megatron's default gradient bucket (--ddp-bucket-size): max(40M, 1M x dp) parameters.
BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 40_000_000, 1_000_000


def overlap_options(data_size: int, weight_bytes: int = 4, grad_bytes: int = 4) -> dict:
    """XLA:GPU options (jit compiler_options) under which the distributed optimizer's
    gradient reduce-scatter overlaps the backward, as Megatron's --overlap-grad-reduce, and
    the parameter all-gather follows each bucket's update: XLA's heuristic combiner off (on
    a whole model of a few blocks it merges every gradient into one reduce-scatter after the
    backward), the reduce-scatter and all-gather combiners capped at one Megatron bucket
    (thresholds are on the result: the bucket's `grad_bytes` per parameter / data size
    scattered, its `weight_bytes` per parameter gathered) and up to 8 collectives in flight in the
    latency-hiding scheduler (default 1, where sequence parallel's per-block collectives
    leave no room). With the per-leaf barrier in apply_gradients each bucket's update and
    all-gather follow it inside the backward. Measured in docs/layouts.md."""
    bucket = max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * data_size)
    return {"xla_gpu_experimental_enable_heuristic_collective_combining": False,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": grad_bytes * bucket //
            max(data_size, 1),
            "xla_gpu_all_gather_combine_threshold_bytes": weight_bytes * bucket,
            "xla_gpu_experimental_parallel_collective_overlap_limit": 8}


def reduction_bytes(layout, dtype_name: str, working) -> tuple[int, int]:
    """(bytes per parameter all-gathered, reduce-scattered) under the distributed optimizer:
    the working weights' dtype (`working`, --dtype's compute dtype) and the reduction's
    (Layout.reduce_dtype), float32 where the parameters are their own master."""
    if not layout.master_weights(dtype_name):
        return 4, 4
    return jnp.dtype(working).itemsize, jnp.dtype(layout.reduce_dtype(dtype_name)).itemsize


def weight_part(state) -> str:
    """The state part holding the float32 weights the optimizer updates."""
    return "master" if "master" in state else "params"


def scattered_gradients(gradients, mesh, data_axes: tuple[str, ...], param_specs,
                        update_specs, update_shapes, float32: bool):
    """`gradients` (params, model_state, batch) -> ((loss, model_state), gradients in
    `update_specs`) for parameters split on no data axis but on others (tp): each data shard's
    partial sums leave a shard_map over the data axes stacked on a leading dimension (the
    weight gradients' bf16 dots are not reduced by the partitioner there), and a second,
    fully manual shard_map reduce-scatters them over the data axes, in float32 where
    `float32`, each to its optimizer shard. (A psum_scatter inside the first map, with tensor
    left to the partitioner, makes XLA gather its operand over tensor first.) `update_shapes`:
    the update's stored shapes (sharding/padding.py)."""
    stack = P(data_axes)

    def local(params, model_state, batch):
        params = jax.lax.with_sharding_constraint(params, param_specs)  # keep tensor's split
        (loss, ms), grads = gradients(params, model_state, batch)
        grads = jax.tree.map(lambda g: (g.astype("float32") if float32 else g)[None], grads)
        return (jax.lax.pmean(loss, data_axes), ms), grads

    partial = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), batch_spec(mesh)),
                            out_specs=((P(), P()), stack), axis_names=set(data_axes),
                            check_vma=False)

    def run(params, model_state, batch):
        (loss, ms), grads = partial(params, model_state, batch)
        return (loss, ms), scatter_partial_sums(grads, mesh, data_axes, param_specs,
                                                update_specs, update_shapes, 0)
    return run


def mean_to_shard(g, spec: P, axes: tuple[str, ...], n: int):
    """Inside a shard_map manual over `axes` (n devices): the mean over them of each
    device's `g`, left as the shard `spec` gives it (its dimension split over some of
    `axes`: reduce-scattered there, summed over the rest), or whole (all-reduced)."""
    over = [(i, tuple(a for a in axes_of(e) if a in axes)) for i, e in enumerate(spec)]
    over = [(i, split) for i, split in over if split]
    if not over:
        return jax.lax.psum(g, axes) / n
    (dim, split), = over
    rest = tuple(a for a in axes if a not in split)
    g = jax.lax.psum(g, rest) if rest else g
    return jax.lax.psum_scatter(g, split, scatter_dimension=dim, tiled=True) / n


def scatter_partial_sums(stacked, mesh, data_axes: tuple[str, ...], param_specs, update_specs,
                         update_shapes, data_dim: int):
    """Partial sums of gradients, each data shard's at index `data_dim` of a dimension added
    to every leaf of `param_specs`' tree (split over `data_axes` there) -> their mean,
    reduce-scattered over the data axes to `update_specs` in one fully manual shard_map, on
    leaves stored as `update_shapes` (the update splits a dimension the parameter keeps
    whole, so that dimension is padded at its end on every device alike)."""
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    n = 1
    for a in data_axes:
        n *= mesh.shape[a]

    def stacked_spec(s):
        entries = list(s) + [None] * max(0, data_dim - len(s))
        return P(*entries[:data_dim], data_axes, *entries[data_dim:])

    def local(spec, g, param_spec, shape):
        g = g.squeeze(data_dim)
        whole = list(param_spec) + [None] * (g.ndim - len(param_spec))
        target = tuple(full if e is None else size
                       for size, full, e in zip(g.shape, shape.shape, whole))
        return mean_to_shard(fit(g, target), spec, data_axes, n)

    specs_in = jax.tree.map(stacked_spec, param_specs, is_leaf=is_p)
    return jax.shard_map(
        lambda gs: jax.tree.map(local, update_specs, gs, param_specs, update_shapes,
                                is_leaf=is_p),
        mesh=mesh, in_specs=(specs_in,), out_specs=update_specs, check_vma=False)(stacked)
