"""A Mixtral-style mixture-of-experts decoder: Llama blocks whose MLP is a set of SwiGLU
experts with top-2 routing, a capacity limit per expert, and the auxiliary load-balancing
loss of Switch/GShard. `mixtral-8x7b` and `mixtral-8x22b` (full size, for --dry-run) and
`moe-tiny` (runs here).

Routing is GShard's: each sequence is a routing group, every expert takes at most `capacity`
(capacity_factor x top_k x length / experts) of a group's choices, first choices before second
ones, and a choice over capacity is dropped. Three implementations of that one routing
(`--model-opts moe_impl=...`, the same loss):
- `dense`: GShard's one-hot dispatch and combine tensors, [batch, length, experts, capacity],
  and einsums over them (O(length^2) FLOPs and memory per sequence);
- `sorted` (default): each choice's row in an expert-major buffer [experts, batch, capacity]
  is computed (its expert x capacity + its slot), tokens are gathered into the buffers and
  the outputs gathered back (MaxText's permute/unpermute, by index, no one-hot tensors); the
  experts are one batched GEMM each;
- `ragged`: the same buffers, the experts as grouped GEMMs (`jax.lax.ragged_dot` over the
  local experts' groups, in a shard_map over the mesh), MaxText's sparse-matmul kernel call.
  jax 0.10.2's XLA:GPU rewrites ragged_dot to one dense GEMM over all local groups (FLOPs x
  local experts) unless cuDNN's ragged-dot fusion is on, which a device-less compile cannot
  build: `sorted` is the faster program there.
All three drop over capacity (GShard, MaxText's dense path, capacity_factor 1.25 here).
Mixtral as Mistral released it, MaxText's sparse-matmul default (capacity_factor -1) and
Megatron's default token dispatcher are dropless; a dropless path (ragged all-to-all of the
exact counts) is not built: its buffers' worst case is every token on one expert.
With experts sharded over the `expert` mesh axis (layout `ep`) and tokens over the batch axes,
the buffers are pinned expert-major, so XLA moves tokens to their experts and back by
all-to-all on `expert` only.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.errors import UsageError
from models.layers import (BLD, BLV, block_runner, check_choice, constrain, lookup,
                           rms_norm, run_blocks, tagged)
from models import context
from models import fp8
from models.llama import Attention, Llama, LlamaConfig
from models.registry import register
from sharding.axes import batch_axes


def _to_experts(x_EBCD):
    """Under an `expert` mesh axis, pin expert-major activations to it (and their batch to
    the other batch axes): the move from token-sharded to expert-sharded is then XLA's
    all-to-all, as in GShard, instead of gathering every token everywhere."""
    mesh = jax.sharding.get_abstract_mesh()
    if "expert" not in mesh.axis_names or mesh.shape["expert"] == 1:
        return x_EBCD
    # inside a pipeline's shard_map (stage and data manual) only the free axes are pinned
    batch = tuple(a for a in mesh.axis_names if a not in ("tensor", "expert")
                  and a not in mesh.manual_axes)
    return jax.lax.with_sharding_constraint(x_EBCD, P("expert", batch or None))


MOE_IMPLS = ("dense", "sorted", "ragged")


def _rows(idx_BLk, experts: int, capacity: int):
    """Each (token, choice)'s row in its group's expert-major buffer (expert x capacity +
    slot; experts x capacity where dropped): slots in GShard's order, every token's first
    choice before any second choice, so a full expert drops second choices first."""
    B, L, k = idx_BLk.shape
    choice_BkLE = jax.nn.one_hot(idx_BLk.transpose(0, 2, 1), experts, dtype=jnp.int32)
    slot_BkLE = jnp.cumsum(choice_BkLE.reshape(B, k * L, experts), axis=1).reshape(
        B, k, L, experts) - 1
    slot_BLk = jnp.sum(slot_BkLE * choice_BkLE, axis=-1).transpose(0, 2, 1)
    return jnp.where(slot_BLk < capacity, idx_BLk * capacity + slot_BLk, experts * capacity)


def _top_k(probs_BLE, k: int):
    """jax.lax.top_k over the experts as k argmaxes (the lower index first on a tie, as
    top_k): XLA:GPU partitions top_k over a flattened [tokens, experts] array and gathers
    the router's probabilities of every data device's tokens first."""
    idx, left = [], probs_BLE
    for _ in range(k):
        idx.append(jnp.argmax(left, axis=-1).astype(jnp.int32))
        left = jnp.where(jax.nn.one_hot(idx[-1], left.shape[-1], dtype=bool), -jnp.inf, left)
    idx_BLk = jnp.stack(idx, axis=-1)
    return jnp.take_along_axis(probs_BLE, idx_BLk, axis=-1), idx_BLk


def take(x_ND, rows):
    """x_ND's rows `rows`; a row index past the end (a dropped choice, an empty slot) gives
    zeros (no padding row concatenated, whose backward XLA splits across devices)."""
    return jnp.take(x_ND, rows, axis=0, mode="fill", fill_value=0)


def _dispatch(x_BLD, rows_BLk, experts: int, capacity: int):
    """in_EBCD: every expert's buffer, rows filled by index (an empty row is zeros)."""
    B, L, D = x_BLD.shape
    k = rows_BLk.shape[-1]
    tokens = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[:, None], (L, k))
    src_BR = _by_sequence(jax.vmap(lambda rows: jnp.full((experts * capacity + 1,), L,
                                                         jnp.int32)
                                   .at[rows.reshape(-1)].set(tokens.reshape(-1)))(rows_BLk))
    buf_BRD = _by_sequence(jax.vmap(take)(_by_sequence(x_BLD), src_BR[:, :-1]))
    return buf_BRD.reshape(B, experts, capacity, D).transpose(1, 0, 2, 3)


def _combine(out_EBCD, rows_BLk, gates_BLk):
    """y_BLD: each token's kept choices' expert outputs, weighted by their gates."""
    E, B, C, D = out_EBCD.shape
    _, L, k = rows_BLk.shape
    out_BRD = _by_sequence(out_EBCD.transpose(1, 0, 2, 3).reshape(B, E * C, D))
    y_BLkD = _by_sequence(jax.vmap(take)(out_BRD, _by_sequence(rows_BLk.reshape(B, L * k))))
    return jnp.einsum("blk,blkd->bld", gates_BLk, y_BLkD.reshape(B, L, k, D))


def _ragged_experts(in_EBCD, gate, up, down):
    """The SwiGLU experts as grouped GEMMs: per device, its local experts' buffer rows in
    one [rows, width] array and jax.lax.ragged_dot over one group per local expert (the
    hidden split over `tensor`, the down projection's partial sums added there)."""
    mesh = jax.sharding.get_abstract_mesh()
    free = [] if mesh.empty else [a for a in mesh.axis_names
                                  if a not in mesh.manual_axes and mesh.shape[a] > 1]
    tensor = "tensor" in free

    def local(x_EBCD, g_EDH, u_EDH, d_EHD):
        E, B, C, D = x_EBCD.shape
        sizes = jnp.full((E,), B * C, jnp.int32)
        x_MD = x_EBCD.reshape(E * B * C, D)
        h_MH = (nnx.silu(tagged(jax.lax.ragged_dot(x_MD, g_EDH, sizes), "mlpwi_0"))
                * tagged(jax.lax.ragged_dot(x_MD, u_EDH, sizes), "mlpwi_1"))
        out_MD = tagged(jax.lax.ragged_dot(h_MH, d_EHD, sizes), "mlpwo")
        if tensor:
            out_MD = jax.lax.psum(out_MD, "tensor")
        return out_MD.reshape(E, B, C, D)

    if not free:
        return local(in_EBCD, gate, up, down)
    experts = "expert" if "expert" in free else None
    batch = tuple(a for a in free if a not in ("tensor", "expert")) or None
    hidden = "tensor" if tensor else None
    x_spec = P(experts, batch)
    return jax.shard_map(local, mesh=mesh, axis_names=set(free),
                         in_specs=(x_spec, P(experts, None, hidden), P(experts, None, hidden),
                                   P(experts, hidden, None)),
                         out_specs=x_spec, check_vma=False)(in_EBCD, gate, up, down)


def _by_sequence(x_B):
    """x pinned with its batch (first) dimension over the batch axes (every free axis but
    tensor) and the rest whole: the index gathers and scatters of dispatch and combine stay
    within each device's sequences instead of XLA gathering every sequence everywhere."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_B
    batch = tuple(a for a in batch_axes(mesh.axis_names)
                  if a not in mesh.manual_axes and mesh.shape[a] > 1)
    if not batch or x_B.shape[0] % math.prod(mesh.shape[a] for a in batch):
        return x_B
    return jax.lax.with_sharding_constraint(x_B, P(batch))


class MoE(nnx.Module):
    def __init__(self, cfg: "MoEConfig", *, dtype, rngs):
        E, D, H = cfg.experts, cfg.width, cfg.mlp_hidden
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(D, E, use_bias=False, param_dtype=jnp.float32, rngs=rngs)
        self.gate = nnx.Param(init(rngs.params(), (E, D, H), jnp.float32))
        self.up = nnx.Param(init(rngs.params(), (E, D, H), jnp.float32))
        self.down = nnx.Param(init(rngs.params(), (E, H, D), jnp.float32))
        self.top_k, self.capacity_factor, self.dtype = cfg.top_k, cfg.capacity_factor, dtype
        self.impl = cfg.moe_impl
        # the experts' GEMMs in FP8 where built inside models.fp8.fp8_matmuls (sorted and
        # dense; ragged's grouped GEMMs and the router stay as they are)
        self.fp8_gate, self.fp8_up, self.fp8_down = (fp8.scales(w, dtype)
                                                     for w in ("gate", "up", "down"))

    def __call__(self, x_BLD):
        B, L, D = x_BLD.shape
        E, k = self.gate.shape[0], self.top_k
        capacity = max(1, math.ceil(self.capacity_factor * k * L / E))
        probs_BLE = jax.nn.softmax(self.router(x_BLD.astype(jnp.float32)), axis=-1)
        top_BLk, idx_BLk = _top_k(probs_BLE, k)
        gates_BLk = top_BLk / jnp.sum(top_BLk, axis=-1, keepdims=True)  # Mixtral renormalises
        cast = lambda t: t.astype(self.dtype)  # noqa: E731
        if self.impl == "dense":
            y_BLD = self._dense(x_BLD, idx_BLk, gates_BLk, capacity)
        else:
            rows_BLk = _by_sequence(_rows(_by_sequence(idx_BLk), E, capacity))
            in_EBCD = _to_experts(_dispatch(cast(x_BLD), rows_BLk, E, capacity))
            if self.impl == "ragged":
                out_EBCD = _ragged_experts(in_EBCD, cast(self.gate[...]), cast(self.up[...]),
                                           cast(self.down[...]))
            else:
                out_EBCD = self._experts(in_EBCD)
            y_BLD = _combine(_to_experts(out_EBCD), rows_BLk, cast(gates_BLk))
        # Switch Transformer's balance loss: E * sum_e (fraction of tokens whose first choice
        # is e) x (mean router probability of e); 1 when perfectly balanced.
        first_BLE = jax.nn.one_hot(idx_BLk[..., 0], E, dtype=jnp.float32)
        aux = E * jnp.sum(first_BLE.mean(axis=(0, 1)) * probs_BLE.mean(axis=(0, 1)))
        return y_BLD.astype(x_BLD.dtype), aux

    def _experts(self, in_EBCD):
        """The SwiGLU experts as batched GEMMs over [experts, batch x capacity] buffers."""
        def gemm(x_EBCI, name):  # [E, B, C, in] x [E, in, out] per expert
            w_EIO = getattr(self, name)[...].astype(self.dtype)
            scales = getattr(self, "fp8_" + name)
            if scales is None:
                return jnp.einsum("ebci,eio->ebco", x_EBCI, w_EIO)
            return scales.dot_general(x_EBCI, w_EIO, (((3,), (1,)), ((0,), (0,))))
        h_EBCH = (nnx.silu(tagged(gemm(in_EBCD, "gate"), "mlpwi_0"))
                  * tagged(gemm(in_EBCD, "up"), "mlpwi_1"))
        return _to_experts(tagged(gemm(h_EBCH, "down"), "mlpwo"))

    def _dense(self, x_BLD, idx_BLk, gates_BLk, capacity):
        """GShard's dispatch and combine einsums over one-hot [B, L, E, C] tensors."""
        B, L, D = x_BLD.shape
        E, k = self.gate.shape[0], self.top_k
        choice_BkLE = jax.nn.one_hot(idx_BLk, E, dtype=jnp.float32).transpose(0, 2, 1, 3)
        slot_BkLE = (jnp.cumsum(choice_BkLE.reshape(B, k * L, E), axis=1).reshape(B, k, L, E)
                     - 1) * choice_BkLE
        kept_BkLE = choice_BkLE * (slot_BkLE < capacity)
        slot_onehot_BkLEC = jax.nn.one_hot(slot_BkLE.astype(jnp.int32), capacity)
        dispatch_BkLEC = kept_BkLE[..., None] * slot_onehot_BkLEC
        dispatch_BLEC = dispatch_BkLEC.sum(axis=1)
        combine_BLEC = jnp.einsum("bkl,bklec->blec", gates_BLk.transpose(0, 2, 1),
                                  dispatch_BkLEC)
        cast = lambda t: t.astype(self.dtype)  # noqa: E731
        in_EBCD = _to_experts(jnp.einsum("blec,bld->ebcd", cast(dispatch_BLEC), cast(x_BLD)))
        return jnp.einsum("blec,ebcd->bld", cast(combine_BLEC), self._experts(in_EBCD))


class Block(nnx.Module):
    def __init__(self, cfg: "MoEConfig", *, dtype, rngs):
        self.ln1 = rms_norm(cfg.width, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.ln2 = rms_norm(cfg.width, dtype=dtype, rngs=rngs)
        self.moe = MoE(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x_BLD):
        x_BLD = constrain(x_BLD + constrain(self.attn(self.ln1(x_BLD)), *BLD), *BLD)
        y_BLD, aux = self.moe(self.ln2(x_BLD))
        return constrain(x_BLD + constrain(y_BLD, *BLD), *BLD), aux


class MoEDecoder(Llama):
    """Llama's embedding, final norm and head around MoE blocks."""

    def __init__(self, cfg: "MoEConfig", *, dtype, rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs, make_block=Block)

    def __call__(self, tokens_BL):
        """(logits, mean auxiliary balance loss over layers)."""
        x_BLD = constrain(lookup(self.tok, tokens_BL), *BLD)
        run_block = block_runner(Block, self.remat)

        def step(block, carry):
            x_BLD, aux = run_block(block, carry[0])
            return x_BLD, carry[1] + aux

        x_BLD, aux_total = run_blocks(self.blocks, step, (x_BLD, jnp.zeros((), jnp.float32)),
                                      self.ordered)
        logits_BLV = constrain(self.head(self.ln_f(x_BLD)), *BLV).astype(jnp.float32)
        return logits_BLV, aux_total / len(self.blocks)


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_weight: float = 0.01
    moe_impl: str = "sorted"  # dense | sorted | ragged (module docstring): one routing
    family: str = "moe"

    def validate(self) -> None:
        super().validate()
        check_choice("moe", "moe_impl", self.moe_impl, MOE_IMPLS)
        if not 1 <= self.top_k <= self.experts:
            raise UsageError(f"moe top_k={self.top_k} must be 1..experts={self.experts}")

    def build(self, rngs, dtype):
        self.validate()
        return MoEDecoder(self, dtype=dtype, rngs=rngs)

    def loss(self, model, batch):
        # in the context shards' order (models/context.py): a mean over every token
        inputs_BL, targets_BL = context.permute(batch["tokens"], self.context_load_balance)
        logits_BLV, aux = model(inputs_BL)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
        return ce.mean() + self.aux_weight * aux

    def flops_per_sample(self) -> float:
        """Active FLOPs: each token runs top_k experts (dispatch einsums not counted)."""
        d, hd = self.width, self.width // self.heads
        attn = 2 * d * d + 2 * d * self.kv_heads * hd
        block = attn + self.top_k * 3 * d * self.mlp_hidden + d * self.experts
        matmul_params = self.depth * block + d * self.vocab
        return 3.0 * (2 * matmul_params + 4 * self.depth * self.seq_len * d) * self.seq_len


register("mixtral-8x7b", MoEConfig(vocab=32000, seq_len=4096, depth=32, width=4096, heads=32,
                                   kv_heads=8, mlp_hidden=14336, rope_theta=1e6))
# Mixtral-8x22B (Mistral AI's config.json: 56 layers, hidden 6144, 48 heads over 8 KV heads,
# FFN 16384, vocabulary 32768, 8 experts top-2); Go et al. 2025 ran it at sequence 4096.
register("mixtral-8x22b", MoEConfig(vocab=32768, seq_len=4096, depth=56, width=6144, heads=48,
                                    kv_heads=8, mlp_hidden=16384, rope_theta=1e6))
register("moe-small", MoEConfig(vocab=8192, seq_len=128, depth=4, width=256, heads=8,
                                kv_heads=4, mlp_hidden=512, experts=8))
register("moe-tiny", MoEConfig(vocab=256, seq_len=32, depth=2, width=64, heads=4, kv_heads=2,
                               mlp_hidden=64, experts=4, capacity_factor=2.0))
