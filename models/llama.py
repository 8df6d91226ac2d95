"""A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary position embeddings (RoPE) and grouped-
query attention (GQA), untied LM head. Go et al. 2025's Llama3-70B is `llama3-70b`, for
`--dry-run` memory analysis; `llama-tiny` runs on CPU.

Module and parameter names (q, k, v, out, gate, up, down, ln1, ln2, ln_f, tok, head) are the
ones sharding/logical.py names, so the tp, fsdp_tp and fsdp layouts apply unchanged.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxdist.errors import UsageError
from models import context
from models.attention import causal_attention
from models.fp8 import fp8_matmuls
from models.gpt import GPTConfig
from models.layers import (BLD, BLF, BLH, BLKH, BLNH, BLV, PreNormBlock, ProjectedAttention,
                           block_runner, constrain, embed, linear, lookup, rms_norm, tagged)
from models.registry import register
from models.sequence_parallel import SequenceParallelBlock, run_stack


def rope(x_BLNH, theta: float, positions_L=None):
    """Rotate pairs of channels by position-dependent angles (Su et al. 2021); the tokens'
    positions `positions_L` (default 0..L-1; models/context.positions)."""
    L, H = x_BLNH.shape[1], x_BLNH.shape[3]
    positions_L = jnp.arange(L) if positions_L is None else positions_L
    freq_F = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    angle_LF = positions_L.astype(jnp.float32)[:, None] * freq_F[None]
    cos, sin = jnp.cos(angle_LF)[None, :, None], jnp.sin(angle_LF)[None, :, None]
    x1, x2 = x_BLNH[..., 0::2].astype(jnp.float32), x_BLNH[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x_BLNH.shape).astype(x_BLNH.dtype)


class Attention(ProjectedAttention):
    def __init__(self, cfg: "LlamaConfig", *, dtype, rngs):
        head_dim = self.head_dim = cfg.width // cfg.heads
        self.heads, self.kv_heads, self.theta = cfg.heads, cfg.kv_heads, cfg.rope_theta
        self.implementation = None if cfg.attention == "default" else cfg.attention
        self.balanced = cfg.context_load_balance
        self.context_form = cfg.context_attention
        kw = dict(bias=False, dtype=dtype, rngs=rngs)
        self.q = linear(cfg.width, cfg.heads * head_dim, **kw)
        self.k = linear(cfg.width, cfg.kv_heads * head_dim, **kw)
        self.v = linear(cfg.width, cfg.kv_heads * head_dim, **kw)
        self.out = linear(cfg.heads * head_dim, cfg.width, tag="out_proj", **kw)

    def attend(self, q_BLF, k_BLF, v_BLF):
        """RoPE and attention over the whole (local) sequence (ProjectedAttention.column)."""
        B, L, _ = q_BLF.shape
        hd = self.head_dim
        pos_L = context.positions(L, self.balanced)
        # -1 heads: under sequence parallelism this runs on one device's heads only
        # named as the attention reads them (MaxText's query_proj, ...: after RoPE)
        q_BLNH = tagged(rope(constrain(q_BLF.reshape(B, L, -1, hd), *BLNH),
                             self.theta, pos_L), "query_proj")
        k_BLKH = tagged(rope(constrain(k_BLF.reshape(B, L, -1, hd), *BLKH),
                             self.theta, pos_L), "key_proj")
        v_BLKH = tagged(constrain(v_BLF.reshape(B, L, -1, hd), *BLKH), "value_proj")
        # fewer key/value heads than query heads (GQA) are taken directly
        y_BLNH = causal_attention(q_BLNH, k_BLKH, v_BLKH, self.implementation, pos_L,
                                  self.context_form, self.balanced)
        return constrain(y_BLNH.reshape(B, L, -1), *BLH)


class SwiGLU(nnx.Module):
    def __init__(self, width: int, hidden: int, *, dtype, rngs):
        kw = dict(bias=False, dtype=dtype, rngs=rngs)
        self.gate = linear(width, hidden, tag="mlpwi_0", **kw)
        self.up = linear(width, hidden, tag="mlpwi_1", **kw)
        self.down = linear(hidden, width, tag="mlpwo", **kw)

    row = "down"
    per_token = True  # `column` acts on each token apart (models/sequence_parallel.py)

    def column(self, x_BLD):
        return constrain(nnx.silu(self.gate(x_BLD)) * self.up(x_BLD), *BLF)

    def __call__(self, x_BLD):
        return self.down(self.column(x_BLD))


def llama_block(cfg: "LlamaConfig", *, dtype, rngs) -> PreNormBlock:
    kw = dict(dtype=dtype, rngs=rngs)
    # Built in this order (ln1, attn, ln2, mlp) so parameter initialisation draws the same keys.
    ln1 = rms_norm(cfg.width, **kw)
    attn = Attention(cfg, **kw)
    ln2 = rms_norm(cfg.width, **kw)
    mlp = SwiGLU(cfg.width, cfg.mlp_hidden, **kw)
    if cfg.sequence_parallel:
        return SequenceParallelBlock(ln1, attn, ln2, mlp, cfg.weight_rules,
                                     cfg.sequence_pieces)
    return PreNormBlock(ln1, attn, ln2, mlp)


class Llama(nnx.Module):
    def __init__(self, cfg: "LlamaConfig", *, dtype, rngs, make_block=llama_block):
        # make_block(cfg, dtype=, rngs=) builds one block: models/moe.py passes its own.
        self.tok = embed(cfg.vocab, cfg.width, dtype=dtype, rngs=rngs)
        with fp8_matmuls(cfg.fp8 or None):  # the blocks' matmuls; the LM head stays bf16
            self.blocks = nnx.List(make_block(cfg, dtype=dtype, rngs=rngs)
                                   for _ in range(cfg.depth))
        self.ln_f = rms_norm(cfg.width, dtype=dtype, rngs=rngs)
        self.head = linear(cfg.width, cfg.vocab, bias=False, dtype=dtype, rngs=rngs)
        self.remat = cfg.remat
        self.sequence_parallel = cfg.sequence_parallel
        self.batch_slices = cfg.batch_slices
        self.ordered = cfg.blocks_ordered

    def __call__(self, tokens_BL):
        x_BLD = constrain(lookup(self.tok, tokens_BL), *BLD)
        run_block = block_runner(type(self.blocks[0]), self.remat)
        x_BLD = constrain(run_stack(self.blocks, run_block, x_BLD, self.sequence_parallel,
                                    self.batch_slices, self.ordered), *BLD)
        return constrain(self.head(self.ln_f(x_BLD)), *BLV).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(GPTConfig):
    """GPTConfig's data, loss and tokens; Llama's architecture and FLOPs."""
    kv_heads: int = 8
    mlp_hidden: int = 1024
    rope_theta: float = 500000.0
    family: str = "gpt"  # a decoder: the layouts and data of the gpt family apply

    def validate(self) -> None:
        super().validate()  # attention too (GPTConfig)
        if self.heads % self.kv_heads:
            raise UsageError(f"llama heads={self.heads} is not a multiple of "
                             f"kv_heads={self.kv_heads}")

    def build(self, rngs, dtype):
        self.validate()
        return Llama(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        """GPTConfig's count (6N + 12 * depth * seq_len * width per token) with Llama's
        weights: k and v project to kv_heads heads, the MLP has three matrices."""
        d, hd = self.width, self.width // self.heads
        attn = 2 * d * d + 2 * d * self.kv_heads * hd  # q, out; k, v (fewer heads)
        block = attn + 3 * d * self.mlp_hidden
        matmul_params = self.depth * block + d * self.vocab
        attention = 4 * self.depth * self.seq_len * d
        return 3.0 * (2 * matmul_params + attention) * self.seq_len


# Go et al. 2025's models, full size (for --dry-run; far too large to run here).
register("llama3-70b", LlamaConfig(vocab=128256, seq_len=8192, depth=80, width=8192, heads=64,
                                   kv_heads=8, mlp_hidden=28672))
# Llama-2-7B, full size: MaxText's JAX-Toolbox run on 8 H100, the predictor's Hopper
# calibration record (docs/predict.md; for --dry-run).
register("llama2-7b", LlamaConfig(vocab=32000, seq_len=4096, depth=32, width=4096, heads=32,
                                  kv_heads=32, mlp_hidden=11008, rope_theta=10000.0))
register("gpt3-175b", GPTConfig(vocab=50257, seq_len=2048, depth=96, width=12288, heads=96))
# ~1.1B parameters: the single-GPU speed check (scripts/gpu_perf.sh).
register("llama-1b", LlamaConfig(vocab=32000, seq_len=2048, depth=20, width=2048, heads=16,
                                 kv_heads=8, mlp_hidden=5632))
register("llama-tiny", LlamaConfig(vocab=256, seq_len=32, depth=2, width=64, heads=4,
                                   kv_heads=2, mlp_hidden=128))
