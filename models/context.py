"""Context parallelism (CP): the sequence split over the `context` mesh axis, as Megatron-LM,
torchtitan and MaxText run it. Each device of a context group holds its own part of every
sequence (its tokens, their activations, their logits and loss terms); weights are whole
on it (their gradients are reduced over `context` like over a batch axis), and attention
gathers the keys and values of the whole sequence over `context` (models/attention.py).

Under a causal mask a shard late in the sequence attends to more keys than an early one.
With load balancing (`--context-load-balance`, on by default; MaxText's and Megatron's
2-chunk zig-zag) the sequence is cut into 2 x CP chunks and shard c holds chunks c and
2CP-1-c, so every shard does the same attention work. The tokens and the targets are then
taken in that order before the model (`sequence_order`, `permute`), and every position the
model computes (learned position embeddings, RoPE, the causal mask) is the token's own
(`positions`): the loss, a mean over every token, equals one device's.

Nothing here runs without a `context` axis of size > 1 in the ambient mesh: one device, or a
mesh without it, sees the sequence in its natural order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

AXIS = "context"


def size() -> int:
    """The size of the ambient mesh's `context` axis (1 without a mesh or the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(AXIS, 1)


def manual() -> bool:
    """Whether an enclosing shard_map made `context` manual (each device sees its shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and AXIS in set(mesh.manual_axes)


def active() -> bool:
    return size() > 1


def sequence_order(length: int, shards: int, balanced: bool) -> np.ndarray | None:
    """The positions in the order the context shards hold them, shard 0's first; None for
    the natural order (one shard, or no load balancing: shard c holds the c-th of `shards`
    contiguous parts). Balanced: 2 x shards chunks, shard c holds chunks c and
    2 x shards - 1 - c."""
    if shards == 1 or not balanced:
        return None
    chunk = length // (2 * shards)
    idx = [np.arange(c * chunk, (c + 1) * chunk) for s in range(shards)
           for c in (s, 2 * shards - 1 - s)]
    return np.concatenate(idx)


def positions(length: int, balanced: bool):
    """The positions of the `length` tokens held here, int32: the whole sequence's (in the
    shards' order) where `context` is free, this shard's own where an enclosing shard_map
    made it manual."""
    shards = size()
    if shards == 1:
        return jnp.arange(length, dtype=jnp.int32)
    if not manual():
        order = sequence_order(length, shards, balanced)
        return jnp.asarray(np.arange(length) if order is None else order, dtype=jnp.int32)
    whole = sequence_order(length * shards, shards, balanced)
    whole = np.arange(length * shards) if whole is None else whole
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(whole, dtype=jnp.int32),
                                        jax.lax.axis_index(AXIS) * length, length)


def permute(tokens_BL1, balanced: bool):
    """(inputs, targets) of a batch of sequences of L + 1 tokens, each [B, L], taken in the
    order the context shards hold them (the natural order without load balancing); where an
    enclosing shard_map made `context` manual (a pipeline stage), this shard's own L / CP
    of them, each [B, L / CP]."""
    inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
    order = sequence_order(inputs_BL.shape[1], size(), balanced)
    if order is not None:
        inputs_BL, targets_BL = inputs_BL[:, order], targets_BL[:, order]
    if not (active() and manual()):
        return inputs_BL, targets_BL
    part = inputs_BL.shape[1] // size()
    start = jax.lax.axis_index(AXIS) * part
    return tuple(jax.lax.dynamic_slice_in_dim(x, start, part, axis=1)
                 for x in (inputs_BL, targets_BL))


def gather(x_BlKH):
    """This shard's keys or values -> the whole sequence's, in the shards' order (inside a
    shard_map with `context` manual); the gradient is reduce-scattered back."""
    return jax.lax.all_gather(x_BlKH, AXIS, axis=1, tiled=True)


def causal_mask(q_positions_l, k_positions_L):
    """[1, 1, l, L] True where the query at that position may read the key: its own and the
    earlier positions."""
    return (q_positions_l[:, None] >= k_positions_L[None, :])[None, None]


def check_sequence(seq_len: int, shards: int, balanced: bool) -> str | None:
    """Why a sequence of `seq_len` tokens cannot be split over `shards` context shards
    (None when it can): CP contiguous parts, or 2 x CP chunks under load balancing."""
    parts = 2 * shards if balanced else shards
    if seq_len % parts == 0:
        return None
    what = (f"2 x context = {parts} chunks (load balancing; --no-context-load-balance "
            f"needs a multiple of {shards})" if balanced else f"context = {shards} parts")
    return (f"sequence length {seq_len} is not divisible by {what}; use --model-opts "
            f"seq_len=<a multiple of {parts}>")
