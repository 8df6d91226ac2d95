"""A decoder cut into pipeline parts, from its public structure: `tok` (and `pos`) embed,
the list `blocks`, `ln_f` and `head`; the loss is the models' own (cross-entropy on shifted
tokens, plus MoE's weighted balance loss averaged over layers).

The pipeline train state: `params = {"stages": every block parameter stacked to
[S, V, K, *shape], "shared": tok, pos, ln_f, head}`. Chunk c = v*S + s (stage s, virtual
chunk v) holds blocks c*K .. c*K+K-1, so the model order is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.errors import UsageError
from jaxdist.train_step import DTYPES
from models.layers import REMAT_POLICIES, counted_matmuls
from models.sequence_parallel import sequence_shards, whole_sequence

SHARED = ("tok", "pos", "ln_f", "head")


@dataclass
class Parts:
    block_graphdef: Any
    shared_graphdefs: dict
    depth: int
    blocks_per_chunk: int
    aux_weight: float | None  # MoE: weight of the balance loss; None for dense decoders
    remat: str = "none"       # --remat: per-block recompute inside a chunk's backward
    sequence_parallel: bool = False  # the blocks' output whole again (the stage message)

    def embed(self, shared, tokens_BL):
        tok = nnx.merge(self.shared_graphdefs["tok"], shared["tok"])
        x_BLD = tok(tokens_BL)
        if "pos" in shared:  # gpt: learned positions; llama/moe: RoPE inside attention
            pos = nnx.merge(self.shared_graphdefs["pos"], shared["pos"])
            x_BLD = x_BLD + pos(jnp.arange(tokens_BL.shape[1]))[None]
        return x_BLD

    def block_params(self, chunk) -> list:
        """A chunk's stacked parameters (leaves [K, *shape]) as K per-block trees. The
        chunk's vjp is taken with respect to these, so residuals that are weights are its
        own inputs, which the stash does not hold again (jaxdist/pipeline/ops.py)."""
        return [jax.tree.map(lambda a: a[j], chunk) for j in range(self.blocks_per_chunk)]

    def blocks(self, blocks: list, x_BLD):
        """A chunk's K blocks (`block_params`); returns (x, summed aux loss)."""
        aux = jnp.zeros((), jnp.float32)

        def run_block(params, x):
            with counted_matmuls():  # a block's matmuls by their place (selective_op)
                return nnx.merge(self.block_graphdef, params)(x)
        if self.remat != "none":  # what a block keeps: models.layers.REMAT_POLICIES
            run_block = jax.checkpoint(run_block, policy=REMAT_POLICIES[self.remat])
        x_BLD = sequence_shards(x_BLD, self.sequence_parallel)
        for j in range(self.blocks_per_chunk):
            out = run_block(blocks[j], x_BLD)
            if self.aux_weight is None:
                x_BLD = out
            else:
                x_BLD, a = out
                aux = aux + a
        return whole_sequence(x_BLD, self.sequence_parallel), aux

    def head_loss(self, shared, x_BLD, targets_BL):
        ln_f = nnx.merge(self.shared_graphdefs["ln_f"], shared["ln_f"])
        head = nnx.merge(self.shared_graphdefs["head"], shared["head"])
        logits_BLV = head(ln_f(x_BLD)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

    def chunk(self, blocks: list, shared, x_BLD, tokens_BL1, is_first):
        """One chunk's blocks for one micro-batch: (output activation, its weighted MoE
        balance loss, 0 for dense decoders). The first chunk embeds the tokens instead of
        reading `x` (every stage runs one program; the lookup is cheap, selected by
        `where`). The head is not here: the last chunk's forward runs it and its backward
        at once (jaxdist/pipeline/ops.py), so no stage stashes the logits."""
        h_BLD = jnp.where(is_first, self.embed(shared, tokens_BL1[:, :-1]), x_BLD)
        h_BLD, aux = self.blocks(blocks, h_BLD)
        if self.aux_weight is None:
            return h_BLD, jnp.zeros((), jnp.float32)
        return h_BLD, self.aux_weight * aux / self.depth


def check_depth(model_cfg, stages: int, virtual: int) -> None:
    depth = getattr(model_cfg, "depth", None)
    chunks = stages * virtual
    if not isinstance(depth, int) or depth % chunks:
        what = f"stage={stages}" + (f" x --pp-virtual {virtual}" if virtual > 1 else "")
        good = [d for d in range(chunks, 4 * chunks + 1, chunks)]
        raise UsageError(f"depth {depth} is not divisible by {what} = {chunks} chunks; use "
                         f"--model-opts depth=N with N a multiple of {chunks} "
                         f"(e.g. {', '.join(map(str, good[:3]))})")


def split_pipeline_model(model_cfg, dtype_name: str, seed: int, stages: int, virtual: int):
    """(Parts, params, model_state) of a freshly initialised model: the same parameters the
    unpipelined program starts from, restacked by chunk."""
    check_depth(model_cfg, stages, virtual)
    dtype = DTYPES[dtype_name]
    model = model_cfg.build(nnx.Rngs(seed), dtype)
    model.train()
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(model_state):
        raise UsageError("pipeline layouts need a model without non-trainable state")
    pure = params.to_pure_dict()
    depth = model_cfg.depth
    K = depth // (stages * virtual)
    blocks = [pure["blocks"][i] for i in range(depth)]

    def stack(*leaves):
        a = jnp.stack(leaves)  # [depth, ...] in model order, chunk c = blocks c*K..c*K+K-1
        a = a.reshape(virtual, stages, K, *a.shape[1:])  # chunk c = v * S + s
        return jnp.swapaxes(a, 0, 1)  # [S, V, K, ...]

    stacked = jax.tree.map(stack, *blocks)
    shared = {name: pure[name] for name in SHARED if name in pure}
    block_gd = nnx.split(model.blocks[0], nnx.Param, ...)[0]
    shared_gds = {name: nnx.split(getattr(model, name), nnx.Param, ...)[0]
                  for name in shared}
    parts = Parts(block_gd, shared_gds, depth, K,
                  getattr(model_cfg, "aux_weight", None) if model_cfg.family == "moe"
                  else None, getattr(model_cfg, "remat", "none"),
                  getattr(model_cfg, "sequence_parallel", False))
    return parts, {"stages": stacked, "shared": shared}


def unstack_blocks(stacked, stages: int, virtual: int) -> list:
    """Inverse of the stacking, for tests: the per-block parameter dicts in model order."""
    def flat(a):
        a = np.asarray(a).swapaxes(0, 1)  # [V, S, K, ...]
        return a.reshape(-1, *a.shape[3:])
    flat_tree = jax.tree.map(flat, stacked)
    depth = jax.tree.leaves(flat_tree)[0].shape[0]
    return [jax.tree.map(lambda a: a[i], flat_tree) for i in range(depth)]
