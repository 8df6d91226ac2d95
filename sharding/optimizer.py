"""Megatron's distributed optimizer (ZeRO-1 over the data-parallel axes) as a spec transform.

A layout says where parameters live; the distributed optimizer is a property composed on top
of any layout that keeps parameters replicated over the axes the batch is split on (ddp, tp,
ep, pp, tp_pp): each optimizer-state leaf, and the float32 master copy of each parameter
(train state part `master`, present with bfloat16 working weights), is split further over
those data axes that its parameter is replicated on. The step reduce-scatters gradients to
that placement, updates the shard and all-gathers the new parameters (jaxdist/update.py).

Data axes: the batch's mesh axes (every axis but `tensor` and `stage`: data, fsdp and, under
ep, expert, whose non-expert gradients are averaged over it too) of size > 1, and under the
pipelines `context` (as Megatron's distributed optimizer shards over data x context). A leaf is split
on its largest dimension not yet sharded that the data axes' product divides, else on its
largest sharded one whose shard they divide, else on the dimension not yet sharded that pads
least, stored padded (sharding/padding.py: Megatron pads its flat buffer so that any
data-parallel size works). A leaf with every dimension already sharded and none dividing (a
bias split over tensor) stays as the layout put it: `unsplit_leaves` names such leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from sharding.axes import batch_axes
from sharding.padding import axes_of, choose_dim

# The state parts the distributed optimizer shards (params stay as the layout puts them).
SHARDED_PARTS = ("opt", "master")


def data_axes(mesh_shape: dict[str, int], context: bool = False) -> tuple[str, ...]:
    """The mesh axes the batch is split on, of size > 1, outer to inner; with `context`,
    the `context` axis among them (the pipelines average gradients over data x context,
    and Megatron's distributed optimizer shards over that group)."""
    axes = set(batch_axes(mesh_shape)) | ({"context"} if context else set())
    return tuple(a for a in mesh_shape if a in axes and mesh_shape[a] > 1)


def leaf_over_data(shape: tuple[int, ...], spec: P, mesh_shape: dict[str, int],
                   context: bool = False) -> P:
    """`spec` split further over the data axes the leaf is replicated on (see module doc)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in axes_of(e)}
    free = tuple(a for a in data_axes(mesh_shape, context) if a not in used)
    n = math.prod(mesh_shape[a] for a in free)
    if n == 1:
        return spec

    def shards(e):
        return math.prod(mesh_shape[a] for a in axes_of(e))

    fits = [i for i, size in enumerate(shape) if size % (shards(entries[i]) * n) == 0]
    whole = [i for i in fits if entries[i] is None]
    pool = whole or fits
    if pool:
        dim = max(pool, key=lambda i: (shape[i] // shards(entries[i]), -i))
    else:  # padded: only a whole dimension, whose padding sits at its end on every device
        dim = choose_dim(shape, n, [i for i, e in enumerate(entries) if e is None])
        if dim is None:
            return spec
    axes = axes_of(entries[dim]) + free
    entries[dim] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def over_data(tree, specs, mesh_shape: dict[str, int], context: bool = False):
    """Specs of `tree` (abstract leaves) split further over the data axes (and `context`)."""
    return jax.tree.map(lambda leaf, spec: leaf_over_data(tuple(leaf.shape), spec, mesh_shape,
                                                          context),
                        tree, specs, is_leaf=lambda x: isinstance(x, P))


@dataclass(frozen=True)
class Layout:
    """A registered layout as data: its spec function and whether the distributed optimizer
    is composed on top. Called as the spec function is: (abstract state, mesh) -> specs.
    `over_context`: its optimizer shards span `context` too (the pipelines, whose stage
    bodies average gradients over data x context). `grad_reduce_dtype`: the dtype the
    gradients of bfloat16 working weights are reduced over the data axes in
    (`reduce_dtype`)."""
    name: str
    fn: Callable[[Any, Any], Any]
    distributed_optimizer: bool = False
    over_context: bool = False
    grad_reduce_dtype: str = "float32"

    def __call__(self, state, mesh):
        specs = self.fn(state, mesh)
        if not self.distributed_optimizer:
            return specs
        shape = dict(mesh.shape)
        return {part: over_data(state[part], s, shape, self.over_context)
                if part in SHARDED_PARTS else s for part, s in specs.items()}

    def update_specs(self, params, param_specs, mesh):
        """Where gradients are reduced to and the update runs: the master's placement under
        the distributed optimizer, else the parameters' own."""
        if not self.distributed_optimizer:
            return param_specs
        return over_data(params, param_specs, dict(mesh.shape), self.over_context)

    def master_weights(self, dtype_name: str) -> bool:
        """bfloat16 working weights beside a sharded float32 master copy (Megatron's
        distributed optimizer with --dtype bfloat16); otherwise the parameters are float32
        and are their own master."""
        return self.distributed_optimizer and dtype_name != "float32"

    def reduce_dtype(self, dtype_name: str) -> str | None:
        """The dtype of the gradients' data-axis reduction under master weights: float32
        (cast up first; Megatron-LM's default under --bf16) or bfloat16 (the working
        weights' gradients as they are, cast up on the optimizer's shard: Megatron-LM's
        --grad-reduce-in-bf16, Megatron-Bridge's performance recipes). The micro-batches'
        gradients are summed in the working dtype either way. None without master weights:
        the gradients are of float32 parameters and are reduced as they are."""
        return self.grad_reduce_dtype if self.master_weights(dtype_name) else None
