"""Causal dot-product attention for the decoders, and how the cuDNN kernel is placed.

`implementation=None` / "xla" is `jax.nn.dot_product_attention` as written: the partitioner
shards it like any other XLA op. cuDNN's fused attention (`implementation="cudnn"`) is a
custom call with its own partitioning rule, and that rule only accepts q, k and v with one
and the same sharding (batch and heads only): under the tensor layouts XLA's propagation
gives them different ones (fsdp_tp: the embed-sharded k/v weights; GQA: kv heads that the
tensor axis does not divide), and inside a pipeline stage's partly manual shard_map the rule
cannot read the shardings at all (no mesh for its custom_partitioning). So the cuDNN call
runs in a shard_map over every axis not already manual, q, k and v entering it with one spec:
batch over the batch axes, heads over `tensor` (where it divides them), sequence and head
dim whole; each device then calls cuDNN on its own rows and heads, with no partitioning rule
involved. Where kv heads do not divide over `tensor` they are repeated first, just enough
that they do (each query head keeps its own kv head; a contiguous block of query heads per
device meets the block of kv heads it uses).

Under context parallelism (a `context` axis, models/context.py) each device holds its own
part of the sequence: the attention runs in a shard_map over the free axes, q, k and v split
over `context` on the sequence, and each device all-gathers the keys and values of its
context group (the all-gather-KV form of Llama 3 and MaxText; the backward reduce-scatters
their gradients), then attends its own queries to every key under the exact causal mask of
the tokens' positions (in the load-balanced order where it is on). Every collective of the
exchange is on `context` only.

The ring form (`--context-attention ring`; torchtitan's and Megatron's P2P ring) exchanges
the same keys and values one block at a time: in CP steps each device attends its queries
to the block it holds (its own first) under the exact causal mask of the block's positions,
computing only the part of a later step's block that the mask leaves (half a block under
the zig-zag, Megatron's load-balanced ring; a whole block or none in contiguous order),
while `jax.lax.ppermute` passes that block (keys, values, positions) to the next device of
the ring, and it merges the blocks' partial outputs by their log-sum-exp (online softmax,
float32 accumulators). JAX's autodiff of it is the ring backward: each block's key and value
gradients travel the ring back to their owner (the transposed permutes); each step is
recomputed there from its inputs, so no block's scores are kept. The blocks run as
XLA's dot attention: cuDNN's fused call returns its log-sum-exp only as a residual whose
cotangent its backward drops (jax._src.cudnn.fused_attention_stablehlo), so a merge by it
would have wrong gradients, and its mask is causal or none, not a block's positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from models import context


def _free_axes(mesh) -> tuple[str, ...]:
    """The mesh axes not made manual by an enclosing shard_map, in mesh order."""
    manual = set(mesh.manual_axes)
    return tuple(a for a in mesh.axis_names if a not in manual)


def kv_repeats(heads: int, kv_heads: int, tensor: int) -> int:
    """The fewest copies of each kv head that let `tensor` divide them while each still
    serves a whole group of query heads; 1 when no repeat is needed (or possible: query
    heads that `tensor` does not divide stay whole)."""
    if heads % tensor or kv_heads % tensor == 0:
        return 1
    group = heads // kv_heads
    return next(r for r in range(1, group + 1)
                if group % r == 0 and (kv_heads * r) % tensor == 0)


def qkv_spec(mesh, batch: int, heads: int) -> P:
    """[B, L, N, H] over the free axes: batch over those but tensor, stage and context
    (where they divide it), heads over tensor (where it divides them), L over context (where
    it is free), H whole."""
    free = _free_axes(mesh)
    batch_axes = tuple(a for a in free if a not in ("tensor", "stage", context.AXIS))
    if batch % math.prod(mesh.shape[a] for a in batch_axes):
        batch_axes = ()
    tensor = "tensor" if "tensor" in free and heads % mesh.shape["tensor"] == 0 else None
    length = context.AXIS if context.AXIS in free else None
    return P(batch_axes or None, length, tensor, None)


def _cudnn(q_BLNH, k_BLKH, v_BLKH):
    return jax.nn.dot_product_attention(q_BLNH, k_BLKH, v_BLKH, is_causal=True,
                                        implementation="cudnn")


def sharded_alike(attend, q_BLNH, k_BLKH, v_BLKH, *extra):
    """attend(q, k, v, *extra) in a shard_map over the free mesh axes, q, k and v entering
    it with one spec (`qkv_spec`), kv heads repeated where `tensor` would not divide them;
    `extra`: the queries' positions [L], split over `context` as their sequence."""
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else _free_axes(mesh)
    if not free:
        return attend(q_BLNH, k_BLKH, v_BLKH, *extra)  # one device, or all axes manual
    heads, kv_heads = q_BLNH.shape[2], k_BLKH.shape[2]
    r = kv_repeats(heads, kv_heads, mesh.shape["tensor"] if "tensor" in free else 1)
    if r > 1:
        k_BLKH, v_BLKH = (jnp.repeat(x, r, axis=2) for x in (k_BLKH, v_BLKH))
    spec = qkv_spec(mesh, q_BLNH.shape[0], heads)
    extra_specs = tuple(P(spec[1]) for _ in extra)
    return jax.shard_map(attend, in_specs=(spec, spec, spec, *extra_specs), out_specs=spec,
                         axis_names=set(free), check_vma=False)(q_BLNH, k_BLKH, v_BLKH,
                                                                *extra)


def _context_parallel(implementation):
    """attend(q, k, v, positions) on one context shard: its keys and values gathered over
    `context`, its queries attending to them under the causal mask of their positions."""
    def attend(q_BlNH, k_BlKH, v_BlKH, positions_l):
        k_BLKH, v_BLKH = context.gather(k_BlKH), context.gather(v_BlKH)
        positions_L = jax.lax.all_gather(positions_l, context.AXIS, tiled=True)
        return jax.nn.dot_product_attention(
            q_BlNH, k_BLKH, v_BLKH, mask=context.causal_mask(positions_l, positions_L),
            implementation=implementation)
    return attend


def _ring_block(q_BlKGH, k_BmKH, v_BmKH, positions_l, positions_m, m_BKGl, sum_BKGl,
                acc_BKGlH):
    """One ring step: the queries attend to one key/value block under the causal mask of
    the positions; the running max, sum and output (float32) updated by log-sum-exp."""
    s_BKGlm = jnp.einsum("blkgh,bmkh->bkglm", q_BlKGH, k_BmKH,
                         preferred_element_type=jnp.float32) / math.sqrt(q_BlKGH.shape[-1])
    s_BKGlm = jnp.where(context.causal_mask(positions_l, positions_m)[:, :, None],
                        s_BKGlm, -jnp.inf)
    # the max only keeps exp in range: the result does not depend on it, so no gradient
    m_new = jax.lax.stop_gradient(jnp.maximum(m_BKGl, s_BKGlm.max(-1)))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no key read yet
    p_BKGlm = jnp.exp(s_BKGlm - shift[..., None])
    alpha = jnp.exp(m_BKGl - shift)
    acc_BKGlH = alpha[..., None] * acc_BKGlH + jnp.einsum(
        "bkglm,bmkh->bkglh", p_BKGlm.astype(v_BmKH.dtype), v_BmKH,
        preferred_element_type=jnp.float32)
    return m_new, alpha * sum_BKGl + p_BKGlm.sum(-1), acc_BKGlH


def _merge(a, b):
    """Two partial (max, sum, output) of the same queries over disjoint keys -> one."""
    (m1, s1, acc1), (m2, s2, acc2) = a, b
    m = jnp.maximum(m1, m2)  # both without gradient
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - shift), jnp.exp(m2 - shift)
    return m, a1 * s1 + a2 * s2, a1[..., None] * acc1 + a2[..., None] * acc2


def _later_block(balanced: bool, earlier, q_BlKGH, k_BmKH, v_BmKH, positions_l,
                 positions_m, *state):
    """A ring step after the first (`earlier`: the block comes from a shard before this
    one). Zig-zag (shard c holds chunks c and 2CP-1-c, of h tokens): from an earlier shard
    every query reads the block's first chunk and none its second; from a later one only
    the second query chunk reads, the whole block. Both are two h x h pieces, picked by
    selecting their queries and keys (no branch): half a block. Contiguous parts: an
    earlier shard's block is read whole, a later one's not at all (computed, then
    dropped: the last shard, which reads every block, sets the step's time anyway)."""
    def where(x, y):
        return jax.tree.map(lambda a, b: jnp.where(earlier, a, b), x, y)

    if not balanced:
        return where(_ring_block(q_BlKGH, k_BmKH, v_BmKH, positions_l, positions_m,
                                 *state), tuple(state))
    h = q_BlKGH.shape[1] // 2
    B, _, K, G, H = q_BlKGH.shape
    q0, q1 = q_BlKGH[:, :h], q_BlKGH[:, h:]
    k0, k1, v0, v1 = k_BmKH[:, :h], k_BmKH[:, h:], v_BmKH[:, :h], v_BmKH[:, h:]
    pl0, pl1, pm0, pm1 = positions_l[:h], positions_l[h:], positions_m[:h], positions_m[h:]
    empty = (jnp.full((B, K, G, h), -jnp.inf, jnp.float32),
             jnp.zeros((B, K, G, h), jnp.float32), jnp.zeros((B, K, G, h, H), jnp.float32))
    # piece a: (first query chunk | second) x first key chunk; piece b: second query
    # chunk x (first key chunk | second)
    a = _ring_block(jnp.where(earlier, q0, q1), k0, v0, jnp.where(earlier, pl0, pl1),
                    pm0, *empty)
    b = _ring_block(q1, jnp.where(earlier, k0, k1), jnp.where(earlier, v0, v1), pl1,
                    jnp.where(earlier, pm0, pm1), *empty)
    first, second = where(a, empty), where(b, _merge(a, b))
    rows = tuple(jnp.concatenate([x, y], axis=-1) for x, y in zip(first[:2], second[:2]))
    block = (*rows, jnp.concatenate([first[2], second[2]], axis=-2))
    return _merge(tuple(state), block)


def _ring(balanced: bool):
    """attend(q, k, v, positions) on one context shard, the ring form: CP steps, each
    attending the queries to the key/value block held (its own at step 0; later ones only
    where the causal mask leaves anything, `_later_block`) while the block moves to the
    next shard. Each step is rematerialized in the backward (it keeps its inputs, not its
    scores), as a flash kernel would."""
    def attend(q_BlNH, k_BlKH, v_BlKH, positions_l):
        shards = context.size()
        B, l, N, H = q_BlNH.shape
        K = k_BlKH.shape[2]
        q_BlKGH = q_BlNH.reshape(B, l, K, N // K, H)
        ring = [(i, (i + 1) % shards) for i in range(shards)]
        me = jax.lax.axis_index(context.AXIS)
        state = (jnp.full((B, K, N // K, l), -jnp.inf, jnp.float32),
                 jnp.zeros((B, K, N // K, l), jnp.float32),
                 jnp.zeros((B, K, N // K, l, H), jnp.float32))
        block = (k_BlKH, v_BlKH, positions_l)
        for step in range(shards):
            k_BmKH, v_BmKH, positions_m = block
            if step + 1 < shards:  # the next block moves while this one is attended
                block = tuple(jax.lax.ppermute(x, context.AXIS, ring) for x in block)
            if step == 0:
                state = jax.checkpoint(_ring_block)(q_BlKGH, k_BmKH, v_BmKH, positions_l,
                                                    positions_m, *state)
            else:  # the block of shard me - step
                state = jax.checkpoint(_later_block, static_argnums=0)(
                    balanced, (me - step) % shards < me, q_BlKGH, k_BmKH, v_BmKH,
                    positions_l, positions_m, *state)
        _, sum_BKGl, acc_BKGlH = state
        y_BKGlH = acc_BKGlH / sum_BKGl[..., None]  # every query reads its own key: sum > 0
        return jnp.einsum("bkglh->blkgh", y_BKGlH).reshape(B, l, N, H).astype(q_BlNH.dtype)
    return attend


def causal_attention(q_BLNH, k_BLKH, v_BLKH, implementation=None, positions_L=None,
                     context_form: str = "allgather", balanced: bool = False):
    """softmax(q k^T / sqrt(H), causal) v, with fewer kv heads than query heads (GQA)
    taken directly; cuDNN's kernel with q, k and v sharded alike; under context parallelism
    the keys and values gathered over `context` (`context_form` "allgather") or passed
    round it ("ring"), the mask that of `positions_L` (the tokens' positions in the order
    held: models/context.positions, zig-zag where `balanced`; see the module doc)."""
    if context.active():
        if positions_L is None:
            positions_L = context.positions(q_BLNH.shape[1], balanced=False)
        attend = _ring(balanced) if context_form == "ring" else \
            _context_parallel(implementation)
        y_BLNH = sharded_alike(attend, q_BLNH, k_BLKH, v_BLKH, positions_L)
        return y_BLNH if implementation == "cudnn" else checkpoint_name(y_BLNH, "context")
    if implementation == "cudnn":
        # its outputs are kept by the remat policies that keep `context` as the kernel's
        # own (models.layers), so no name here: a named copy would count twice
        return sharded_alike(_cudnn, q_BLNH, k_BLKH, v_BLKH)
    return checkpoint_name(jax.nn.dot_product_attention(
        q_BLNH, k_BLKH, v_BLKH, is_causal=True, implementation=implementation), "context")
