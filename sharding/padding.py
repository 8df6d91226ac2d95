"""Padded storage: how a leaf is split over a shard count that does not divide it.

A layout may split a dimension its shards do not divide (FSDP on 48 devices of an 8192-wide
model). jax.sharding cannot place such an array, so the leaf is *stored* padded at the end of
every split dimension to the next multiple of its shard count, with zeros, as PyTorch FSDP2
pads dim 0 and Megatron pads its distributed optimizer's flat buffer. The model computes on
the leaf's logical view (the first `size` entries of each dimension, `fit`), so padding never
enters the math: the view's gradient is zero there, and so are Adam's moments and SGD's
momentum, so the padding stays zero through every update.

`choose_dim` picks the dimension to split: the largest one the shards divide (no padding),
else the one whose padded shard is the smallest fraction of the leaf.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def entry_shards(entry, mesh_shape: dict[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in axes_of(entry))


def choose_dim(shape: tuple[int, ...], shards: int, candidates=None) -> int | None:
    """The dimension of `shape` (among `candidates`, default all) to split `shards` ways: the
    largest the shards divide (ties: the first), else the one with the smallest padded shard
    relative to its size (ties: the largest); None where nothing would shrink (one shard,
    a scalar, dimensions of size 1)."""
    dims = list(range(len(shape)) if candidates is None else candidates)
    dims = [i for i in dims if shape[i] > 1]
    if shards == 1 or not dims:
        return None
    exact = [i for i in dims if shape[i] % shards == 0]
    if exact:
        return max(exact, key=lambda i: (shape[i], -i))
    return min(dims, key=lambda i: (-(-shape[i] // shards) / shape[i], -shape[i], i))


def padded_shape(shape: tuple[int, ...], spec: P, mesh_shape: dict[str, int]) -> tuple:
    """`shape` with every dimension `spec` splits rounded up to a multiple of its shards."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(-(-size // n) * n for size, n in
                 ((size, entry_shards(e, mesh_shape)) for size, e in zip(shape, entries)))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def storage(abstract, specs, mesh_shape: dict[str, int]):
    """The stored (padded) shapes of `abstract` under `specs`, as ShapeDtypeStructs."""
    return jax.tree.map(
        lambda leaf, spec: jax.ShapeDtypeStruct(
            padded_shape(tuple(leaf.shape), spec, mesh_shape), leaf.dtype),
        abstract, specs, is_leaf=_is_spec)


def fit(x, shape: tuple[int, ...]):
    """`x` cut or zero-padded at the end of each dimension to `shape` (the logical view of a
    stored leaf, or a logical leaf stored); `x` itself where the shapes agree."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    common = tuple(min(a, b) for a, b in zip(x.shape, shape))
    if common != tuple(x.shape):
        x = jax.lax.slice(x, (0,) * x.ndim, common)
    if common != shape:
        x = jnp.pad(x, [(0, b - a) for a, b in zip(common, shape)])
    return x


def fit_tree(tree, shapes):
    """Every leaf of `tree` fitted to the shape of the matching leaf of `shapes`."""
    return jax.tree.map(lambda x, s: fit(x, s.shape), tree, shapes)


def is_padded(abstract, stored) -> bool:
    return any(a.shape != s.shape for a, s in
               zip(jax.tree.leaves(abstract), jax.tree.leaves(stored)))


def padding_bytes(abstract, stored) -> int:
    """Bytes the padding adds to the whole (global) state."""
    return sum((math.prod(s.shape) - math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(stored)))
