"""A decoder-only GPT: pre-LayerNorm blocks, learned positions, untied LM head.

Attention is written with plain nnx.Linear projections and jax.nn.dot_product_attention
(models/attention.py: `attention=cudnn` for cuDNN's flash attention) so every parameter is an ordinary 2-D kernel (or 1-D bias) that the sharding rules can place.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.errors import UsageError
from models.layers import (BLD, BLF, BLH, BLNH, BLV, QKV, REMAT_POLICIES, PreNormBlock,
                           ProjectedAttention, block_runner, constrain, embed, layer_norm,
                           linear, lookup, ordered_backward, tagged)
from models import context
from models.attention import causal_attention
from models.fp8 import fp8_matmuls
from models.registry import register
from models.sequence_parallel import SequenceParallelBlock, run_stack


class CausalSelfAttention(ProjectedAttention):
    def __init__(self, width: int, heads: int, *, dtype, rngs, implementation=None,
                 balanced: bool = True, context_form: str = "allgather"):
        self.heads, self.implementation, self.balanced = heads, implementation, balanced
        self.head_dim = width // heads
        self.context_form = context_form
        # Separate q, k, v projections (not one fused qkv): splitting each one's output over
        # the `tensor` axis then gives every device whole heads (Megatron column parallel).
        self.q = linear(width, width, dtype=dtype, rngs=rngs)
        self.k = linear(width, width, dtype=dtype, rngs=rngs)
        self.v = linear(width, width, dtype=dtype, rngs=rngs)
        self.out = linear(width, width, tag="out_proj", dtype=dtype, rngs=rngs)

    def attend(self, q_BLF, k_BLF, v_BLF):
        """Attention over the whole (local) sequence (ProjectedAttention.column)."""
        B, L, _ = q_BLF.shape
        hd = self.head_dim
        # -1 heads: under sequence parallelism this runs on one device's heads only
        q_BLNH, k_BLNH, v_BLNH = (
            tagged(constrain(p.reshape(B, L, -1, hd), *BLNH), tag)
            for p, tag in zip((q_BLF, k_BLF, v_BLF), QKV))
        y_BLNH = causal_attention(q_BLNH, k_BLNH, v_BLNH, self.implementation,
                                  context.positions(L, self.balanced), self.context_form,
                                  self.balanced)
        return constrain(y_BLNH.reshape(B, L, -1), *BLH)


class MLPBlock(nnx.Module):
    def __init__(self, width: int, hidden: int, *, dtype, rngs):
        self.up = linear(width, hidden, tag="mlpwi", dtype=dtype, rngs=rngs)
        self.down = linear(hidden, width, tag="mlpwo", dtype=dtype, rngs=rngs)

    row = "down"
    per_token = True  # `column` acts on each token apart (models/sequence_parallel.py)

    def column(self, x_BLD):
        return constrain(nnx.gelu(self.up(x_BLD)), *BLF)

    def __call__(self, x_BLD):
        return self.down(self.column(x_BLD))


def gpt_block(width: int, heads: int, hidden: int, *, dtype, rngs,
              sequence_parallel: bool = False, attention: str = "default",
              weight_rules: str | None = None, balanced: bool = True,
              context_form: str = "allgather", pieces: int = 1) -> PreNormBlock:
    kw = dict(dtype=dtype, rngs=rngs)
    # Built in this order (ln1, attn, ln2, mlp) so parameter initialisation draws the same keys.
    ln1 = layer_norm(width, **kw)
    attn = CausalSelfAttention(width, heads, **kw,
                               implementation=None if attention == "default" else attention,
                               balanced=balanced, context_form=context_form)
    ln2 = layer_norm(width, **kw)
    mlp = MLPBlock(width, hidden, **kw)
    if sequence_parallel:
        return SequenceParallelBlock(ln1, attn, ln2, mlp, weight_rules, pieces)
    return PreNormBlock(ln1, attn, ln2, mlp)


class GPT(nnx.Module):
    def __init__(self, cfg: "GPTConfig", *, dtype, rngs):
        self.tok = embed(cfg.vocab, cfg.width, dtype=dtype, rngs=rngs)
        self.pos = embed(cfg.seq_len, cfg.width, dtype=dtype, rngs=rngs)
        with fp8_matmuls(cfg.fp8 or None):  # the blocks' matmuls; the LM head stays bf16
            self.blocks = nnx.List(
                gpt_block(cfg.width, cfg.heads, cfg.mlp_ratio * cfg.width, dtype=dtype,
                          rngs=rngs, sequence_parallel=cfg.sequence_parallel,
                          attention=cfg.attention, weight_rules=cfg.weight_rules,
                          balanced=cfg.context_load_balance,
                          context_form=cfg.context_attention,
                          pieces=cfg.sequence_pieces)
                for _ in range(cfg.depth))
        self.ln_f = layer_norm(cfg.width, dtype=dtype, rngs=rngs)
        self.remat = cfg.remat
        self.sequence_parallel = cfg.sequence_parallel
        self.batch_slices = cfg.batch_slices
        self.ordered = cfg.blocks_ordered
        self.head = linear(cfg.width, cfg.vocab, dtype=dtype, rngs=rngs)
        self.balanced = cfg.context_load_balance

    def __call__(self, tokens_BL):
        """Logits of `tokens_BL`, taken in the context shards' order (models/context.py)."""
        L = tokens_BL.shape[1]
        x_BLD = constrain(lookup(self.tok, tokens_BL)
                          + lookup(self.pos, context.positions(L, self.balanced), None)[None],
                          *BLD)
        run_block = block_runner(type(self.blocks[0]), self.remat)
        x_BLD = constrain(run_stack(self.blocks, run_block, x_BLD, self.sequence_parallel,
                                    self.batch_slices, self.ordered), *BLD)
        return constrain(self.head(self.ln_f(x_BLD)), *BLV).astype(jnp.float32)


TP_COMM_SPLITS = ("batch", "sequence")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    seq_len: int = 128
    depth: int = 4
    width: int = 256
    heads: int = 8
    mlp_ratio: int = 4
    remat: str = "none"
    # Megatron sequence parallelism inside each block (--sequence-parallel; layers.py)
    sequence_parallel: bool = False
    # under sequence parallelism, the pieces the tensor-axis collectives are split into so
    # that one piece's collectives overlap another's matmuls: independent slices of each
    # device's batch the blocks run on (tp_comm_split "batch": sequence_parallel.run_stack),
    # or pieces of each sublayer's sequence shard ("sequence": sequence_parallel.sublayer)
    tp_comm_chunks: int = 1
    tp_comm_split: str = "batch"
    # the layout's logical rules (sharding/logical.RULES) under sequence parallelism: its
    # sublayers cast each parameter to the compute dtype where the layout stores it, so
    # fsdp_tp gathers bf16 weight shards (sequence_parallel.sublayer); set by jaxdist.run_model
    # from --layout, so not a --model-opts option
    weight_rules: str | None = dataclasses.field(default=None,
                                                 metadata={"set_by_the_layout": True})
    # blocks run in order (models/layers.run_blocks) whatever the remat: where the layout
    # gathers each block's weights (sharding.registry.gathers_block_weights; set by
    # jaxdist.run_model). Full remat orders them anyway (layers.ordered_backward).
    ordered_blocks: bool = False
    # jax.nn.dot_product_attention's implementation: "default" lets XLA choose; "cudnn" is
    # cuDNN's fused flash attention on NVIDIA GPUs (bf16/fp16; models/attention.py)
    attention: str = "default"
    # context parallelism's 2-chunk zig-zag (models/context.py; --context-load-balance, set
    # by jaxdist.run_model): the order of the sequence over the context shards
    context_load_balance: bool = dataclasses.field(default=True,
                                                   metadata={"set_by_the_layout": True})
    # how attention reads the other context shards' keys and values (models/attention.py;
    # --context-attention, set by jaxdist.run_model): allgather or ring
    context_attention: str = dataclasses.field(default="allgather",
                                               metadata={"set_by_the_layout": True})
    # the blocks' matmuls in FP8 with this scaling (models/fp8.py: delayed, current), the LM
    # head in the compute dtype as Transformer Engine keeps it; "": none. Set by
    # jaxdist.run_model from --dtype float8 and --fp8-scaling, so not a --model-opts option
    fp8: str = dataclasses.field(default="", metadata={"set_by_the_layout": True})
    family: str = "gpt"
    input_kind: ClassVar[str] = "tokens"  # no image dataset fits (jaxdist.run_model.adapt_model)

    @property
    def batch_slices(self) -> int:
        """The batch slices run_stack runs the blocks on (1: one chain)."""
        return self.tp_comm_chunks if self.tp_comm_split == "batch" else 1

    @property
    def sequence_pieces(self) -> int:
        """The pieces each sequence-parallel sublayer splits its sequence shard into."""
        return self.tp_comm_chunks if self.tp_comm_split == "sequence" else 1

    @property
    def blocks_ordered(self) -> bool:
        """Whether the decoder runs its blocks ordered (models/layers.run_blocks)."""
        return self.ordered_blocks or ordered_backward(self.remat)

    def validate(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise UsageError(f"remat {self.remat!r}: choose from {', '.join(REMAT_POLICIES)}")
        if self.attention not in ("default", "xla", "cudnn"):
            raise UsageError(f"attention={self.attention!r}: choose from default, xla, cudnn")
        if self.tp_comm_chunks < 1:
            raise UsageError(f"tp_comm_chunks={self.tp_comm_chunks}: give 1 or more")
        if self.tp_comm_split not in TP_COMM_SPLITS:
            raise UsageError(f"tp_comm_split={self.tp_comm_split!r}: choose from "
                             f"{', '.join(TP_COMM_SPLITS)}")
        if self.width % self.heads:
            raise UsageError(f"gpt width={self.width} is not divisible by heads={self.heads}")

    def build(self, rngs, dtype):
        self.validate()
        return GPT(self, dtype=dtype, rngs=rngs)

    def synthetic_batch(self, rng: np.random.Generator, batch_size: int):
        # Each sequence counts from a random start by a random stride (mod vocab): random,
        # yet learnable from context, so the loss falls. One extra token so inputs and
        # shifted targets are both seq_len long.
        start_B1 = rng.integers(0, self.vocab, (batch_size, 1))
        stride_B1 = rng.integers(1, 8, (batch_size, 1))
        steps_L = np.arange(self.seq_len + 1)
        return {"tokens": ((start_B1 + stride_B1 * steps_L) % self.vocab).astype(np.int32)}

    def loss(self, model, batch):
        # in the context shards' order (models/context.py): a mean over every token
        inputs_BL, targets_BL = context.permute(batch["tokens"], self.context_load_balance)
        logits_BLV = model(inputs_BL)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

    def flops_per_sample(self) -> float:
        """Model (not hardware) training FLOPs, the PaLM / Megatron-LM count torchtitan
        also uses: per token 6N + 12 * depth * seq_len * width, where N is the matmul
        weights (every block's projections and the LM head; the embedding lookups are not
        matmuls) and the second term is QK^T and attention x V, forward and backward, with
        no discount for the causal mask. Biases, norms, softmax and the loss are ignored."""
        d = self.width
        # Weight matrices only: q, k, v (3d^2) + out (d^2) + MLP up/down (2 * ratio * d^2).
        block = (4 + 2 * self.mlp_ratio) * d * d
        matmul_params = self.depth * block + d * self.vocab
        # QK^T and attention-weighted V, each 2*L*d per token per layer, no causal discount.
        attention = 4 * self.depth * self.seq_len * d
        return 3.0 * (2 * matmul_params + attention) * self.seq_len

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len


register("gpt-tiny", GPTConfig(vocab=256, seq_len=32, depth=2, width=64, heads=4))
register("gpt-small", GPTConfig(vocab=8192, seq_len=128, depth=4, width=256, heads=8))
register("gpt", GPTConfig(vocab=8192, seq_len=128, depth=4, width=256, heads=8))
