"""A decoder cut into pipeline parts, from its public structure: `tok` (and `pos`) embed,
the list `blocks`, `ln_f` and `head`; the loss is the models' own (cross-entropy on shifted
tokens, plus MoE's weighted balance loss averaged over layers).

The pipeline train state: `params = {"stages": every block parameter stacked to
[S, V, K, *shape], "shared": tok, pos, ln_f, head}`. Chunk c = v*S + s (stage s, virtual
chunk v) holds the next blocks in model order after chunk c-1's. By default every chunk
holds K = depth / (S*V) blocks; `--pp-stage-blocks` gives each stage its own count, split
over its V chunks as evenly as possible (the first chunks one more), and K is then the
largest chunk's: a shorter chunk's last slots are padding (zero parameters, zero
gradients) that its forward and backward skip under a `lax.cond` (`skippable`), so a
stage computes its own blocks only. The padding is held (a sharded array has equal shards
on every stage): the plan counts it (jaxdist/predict/stage_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.errors import UsageError
from jaxdist.train_step import DTYPES
from models import context, fp8
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
    sequence_parallel: bool = False  # stage messages as sequence shards over tensor
    counts: tuple = ()        # blocks of chunk (s, v): counts[s][v] (`chunk_blocks`)
    balanced: bool = True     # context parallelism's zig-zag order (models/context.py)

    @property
    def min_blocks(self) -> int:
        """Blocks every chunk holds: slots below it always run, the others only where the
        chunk's count reaches them."""
        return min(min(row) for row in self.counts) if self.counts else \
            self.blocks_per_chunk

    def embed(self, shared, tokens_BL):
        """The inputs' embeddings, `tokens_BL` in the context shards' order (`inputs`)."""
        tok = nnx.merge(self.shared_graphdefs["tok"], shared["tok"])
        x_BLD = tok(tokens_BL)
        if "pos" in shared:  # gpt: learned positions; llama/moe: RoPE inside attention
            pos = nnx.merge(self.shared_graphdefs["pos"], shared["pos"])
            x_BLD = x_BLD + pos(context.positions(tokens_BL.shape[1], self.balanced))[None]
        return x_BLD

    def inputs(self, tokens_BL1):
        """The model's inputs, in the context shards' order (models/context.py)."""
        return context.permute(tokens_BL1, self.balanced)[0]

    def targets(self, tokens_BL1):
        """The loss's targets, in the same order as `inputs`."""
        return context.permute(tokens_BL1, self.balanced)[1]

    def block_params(self, chunk) -> list:
        """A chunk's stacked parameters (leaves [K, *shape]) as K per-block trees. The
        chunk's vjp is taken with respect to these, so residuals that are weights are its
        own inputs, which the stash does not hold again (jaxdist/pipeline/ops.py)."""
        return [jax.tree.map(lambda a: a[j], chunk) for j in range(self.blocks_per_chunk)]

    def fp8_weights(self, stacked):
        """The blocks' FP8 matmul weights quantized (models.fp8.quantize_weights) for
        stacked parameters [V, K, ...] (`stacked`), leaves [V, K, ...]; {} without FP8
        matmuls. The step computes them once, before its tick loop, and every chunk
        forward reads them (`blocks`), so no micro-batch quantizes a weight again and the
        stash keeps no FP8 copy of one: they are the chunk's inputs
        (jaxdist/pipeline/ops.py)."""
        def one(params):
            return fp8.quantize_weights(nnx.merge(self.block_graphdef, params))
        return jax.vmap(jax.vmap(one))(stacked)

    def fp8_placement(self, stages, stage_specs) -> tuple[dict, dict]:
        """(shapes, specs) of `fp8_weights` of the stage parameters `stages` (leaves [S, V,
        K, ...], abstract or not) placed by `stage_specs`: each FP8 copy as its weight,
        its scale over the leading [S, V, K] as the weight's, and where sequence
        parallelism scales each tensor device's shard apart (models/sequence_parallel.py)
        their [tensor] scales over `tensor`; ({}, {}) without FP8. Read under the step's
        mesh (jax.set_mesh), where the blocks see its tensor axis."""
        shapes = jax.eval_shape(jax.vmap(self.fp8_weights), stages)
        block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[3:], a.dtype), stages)
        paths = fp8.weight_paths(nnx.merge(self.block_graphdef, block))

        def spec_of(key):
            spec = stage_specs
            for name in paths[key]:
                spec = spec[name]
            per_shard = ("tensor",) * (shapes[key][1].ndim - 3)
            return spec, P(*tuple(spec)[:3], *per_shard)
        return shapes, {key: spec_of(key) for key in shapes}

    def chunk_fp8(self, quantized) -> list:
        """A chunk's FP8 weights (leaves [K, ...]) as K per-block dicts (`block_params`)."""
        return [jax.tree.map(lambda a: a[j], quantized)
                for j in range(self.blocks_per_chunk)]

    def blocks(self, blocks: list, x_BLD, count=None, quantized=None):
        """A chunk's K blocks (`block_params`), of which the first `count` run (a traced
        integer; only read where chunks differ), their FP8 matmuls reading `quantized` (K
        per-block `chunk_fp8` dicts; None: each quantizes its weight); returns (x, summed
        aux loss)."""
        aux = jnp.zeros((), jnp.float32)

        def run_block(w, x):
            params, q = w
            with counted_matmuls():  # a block's matmuls by their place (selective_op)
                block = nnx.merge(self.block_graphdef, params)
                with fp8.quantized_weights(block, q):
                    return block(x)
        if self.remat != "none":  # what a block keeps: models.layers.REMAT_POLICIES
            run_block = jax.checkpoint(run_block, policy=REMAT_POLICIES[self.remat])
        quantized = quantized or [{}] * self.blocks_per_chunk
        for j in range(self.blocks_per_chunk):
            w = (blocks[j], quantized[j])
            if j < self.min_blocks:
                out = run_block(w, x_BLD)
            else:  # a padded slot on the chunks with fewer blocks: skipped there
                out = skippable(run_block)(w, x_BLD, j < count)
            if self.aux_weight is None:
                x_BLD = out
            else:
                x_BLD, a = out
                aux = aux + a
        return x_BLD, aux

    def head_loss(self, shared, x_BLD, targets_BL):
        x_BLD = whole_sequence(x_BLD, self.sequence_parallel)
        ln_f = nnx.merge(self.shared_graphdefs["ln_f"], shared["ln_f"])
        head = nnx.merge(self.shared_graphdefs["head"], shared["head"])
        logits_BLV = head(ln_f(x_BLD)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

    def chunk(self, blocks: list, shared, x_BLD, tokens_BL1, is_first, count=None,
              quantized=None):
        """One chunk's blocks for one micro-batch: (output activation, its weighted MoE
        balance loss, 0 for dense decoders). The first chunk embeds the tokens instead of
        reading `x` (every stage runs one program; the lookup is cheap, selected by
        `where`). The head is not here: the last chunk's forward runs it and its backward
        at once (jaxdist/pipeline/ops.py), so no stage stashes the logits. Under sequence
        parallelism `x` and the output are the blocks' sequence shards (the stage message
        is 1/T of the sequence per tensor device); the head gathers the whole. `quantized`:
        the blocks' FP8 weights (`blocks`)."""
        h_BLD = jnp.where(is_first, sequence_shards(self.embed(shared, self.inputs(tokens_BL1)),
                                                    self.sequence_parallel), x_BLD)
        h_BLD, aux = self.blocks(blocks, h_BLD, count, quantized)
        if self.aux_weight is None:
            return h_BLD, jnp.zeros((), jnp.float32)
        return h_BLD, self.aux_weight * aux / self.depth


def skippable(fn):
    """`fn(w, x)` (a block: x or (x, aux)) as `run(w, x, on)`: fn where `on`, else x
    passed through (aux 0). Both directions run under `lax.cond`, so a skipped block
    computes nothing. A custom vjp whose residuals are w and x themselves (so the chunk's
    vjp forwards them and the stash does not hold the weights again: jaxdist/pipeline/
    ops.py) and fn's other residuals (zeros where skipped); a vjp taken through a plain
    `lax.cond` returns the weights as residuals of their own."""
    seen: dict = {}

    def skip(w, x, out):
        return x if not isinstance(out, tuple) else \
            (x, *(jnp.zeros(o.shape, o.dtype) for o in out[1:]))

    @jax.custom_vjp
    def run(w, x, on):
        out = jax.eval_shape(fn, w, x)
        return jax.lax.cond(on, fn, lambda w_, x_: skip(w_, x_, out), w, x)

    def fwd(w, x, on):
        def go(w_, x_):
            out, vjp = jax.vjp(fn, w_, x_)
            leaves, seen["tree"] = jax.tree.flatten(vjp)
            inputs = jax.tree.leaves(w_) + [x_]
            seen["forwarded"] = [next((i for i, a in enumerate(inputs) if a is leaf), None)
                                 for leaf in leaves]
            return out, [leaf for leaf, i in zip(leaves, seen["forwarded"]) if i is None]
        out, res = jax.eval_shape(go, w, x)

        def skipped(w_, x_):
            return skip(w_, x_, out), [jnp.zeros(r.shape, r.dtype) for r in res]
        out, res = jax.lax.cond(on, go, skipped, w, x)
        # x only where fn's vjp reads it as it is (else its residuals hold what it needs)
        keep_x = len(jax.tree.leaves(w)) in seen["forwarded"]
        return out, (w, x if keep_x else None, on, res)

    def bwd(residuals, g):
        w, x, on, res = residuals

        def go(w_, x_, res_, g_):
            inputs, it = jax.tree.leaves(w_) + [x_], iter(res_)  # x_: None if not read
            leaves = [next(it) if i is None else inputs[i] for i in seen["forwarded"]]
            return jax.tree.unflatten(seen["tree"], leaves)(g_)

        def skipped(w_, x_, res_, g_):
            return jax.tree.map(jnp.zeros_like, w_), g_[0] if isinstance(g_, tuple) else g_
        dw, dx = jax.lax.cond(on, go, skipped, w, x, res, g)
        return dw, dx, None
    run.defvjp(fwd, bwd)
    return run


def check_depth(model_cfg, stages: int, virtual: int) -> None:
    depth = getattr(model_cfg, "depth", None)
    chunks = stages * virtual
    if not isinstance(depth, int) or depth % chunks:
        what = f"stage={stages}" + (f" x --pp-virtual {virtual}" if virtual > 1 else "")
        good = [d for d in range(chunks, 4 * chunks + 1, chunks)]
        raise UsageError(f"depth {depth} is not divisible by {what} = {chunks} chunks; use "
                         f"--model-opts depth=N with N a multiple of {chunks} "
                         f"(e.g. {', '.join(map(str, good[:3]))}), or give each stage its "
                         f"blocks with --pp-stage-blocks")


def chunk_blocks(model_cfg, stages: int, virtual: int,
                 stage_blocks: tuple[int, ...] = ()) -> tuple[tuple[int, ...], ...]:
    """Blocks of chunk (s, v) as counts[s][v]: depth / (S*V) each by default; with
    `stage_blocks` (one count per stage) each stage's count split over its V chunks as
    evenly as possible, the first chunks one more."""
    if not stage_blocks:
        check_depth(model_cfg, stages, virtual)
        return ((model_cfg.depth // (stages * virtual),) * virtual,) * stages
    depth = getattr(model_cfg, "depth", None)
    given = ",".join(map(str, stage_blocks))
    if len(stage_blocks) != stages:
        raise UsageError(f"--pp-stage-blocks {given} has {len(stage_blocks)} counts for "
                         f"stage={stages}; give one block count per stage")
    if sum(stage_blocks) != depth:
        raise UsageError(f"--pp-stage-blocks {given} sums to {sum(stage_blocks)} blocks; "
                         f"the model has depth {depth}")
    if min(stage_blocks) < virtual:
        raise UsageError(f"--pp-stage-blocks {given}: a stage of {min(stage_blocks)} "
                         f"blocks cannot fill --pp-virtual {virtual} chunks; give every "
                         f"stage at least {virtual} blocks")
    return tuple(tuple(n // virtual + (v < n % virtual) for v in range(virtual))
                 for n in stage_blocks)


def split_pipeline_model(model_cfg, dtype_name: str, seed: int, stages: int, virtual: int,
                         stage_blocks: tuple[int, ...] = ()):
    """(Parts, params, model_state) of a freshly initialised model: the same parameters the
    unpipelined program starts from, restacked by chunk (padded slots: zeros)."""
    counts = chunk_blocks(model_cfg, stages, virtual, stage_blocks)
    dtype = DTYPES[dtype_name]
    model = model_cfg.build(nnx.Rngs(seed), dtype)
    model.train()
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(model_state):
        raise UsageError("pipeline layouts need a model without non-trainable state")
    pure = params.to_pure_dict()
    depth = model_cfg.depth
    K = max(max(row) for row in counts)
    blocks = [pure["blocks"][i] for i in range(depth)]
    pad = jax.tree.map(jnp.zeros_like, blocks[0])
    start, slots = 0, {}
    for c in range(stages * virtual):  # chunk c = v * S + s, in model order
        s, v = c % stages, c // stages
        n = counts[s][v]
        slots[(s, v)] = blocks[start:start + n] + [pad] * (K - n)
        start += n
    order = [slots[(s, v)][j] for s in range(stages) for v in range(virtual)
             for j in range(K)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a).reshape(stages, virtual, K,
                                                           *a[0].shape), *order)
    shared = {name: pure[name] for name in SHARED if name in pure}
    block_gd = nnx.split(model.blocks[0], nnx.Param, ...)[0]
    shared_gds = {name: nnx.split(getattr(model, name), nnx.Param, ...)[0]
                  for name in shared}
    parts = Parts(block_gd, shared_gds, depth, K,
                  getattr(model_cfg, "aux_weight", None) if model_cfg.family == "moe"
                  else None, getattr(model_cfg, "remat", "none"),
                  getattr(model_cfg, "sequence_parallel", False), counts,
                  getattr(model_cfg, "context_load_balance", True))
    return parts, {"stages": stacked, "shared": shared}


def unstack_blocks(stacked, counts) -> list:
    """Inverse of the stacking, for tests: the per-block parameter dicts in model order
    (`counts`: `chunk_blocks`; padded slots left out)."""
    S, V = len(counts), len(counts[0])
    host = jax.tree.map(np.asarray, stacked)
    return [jax.tree.map(lambda a: a[c % S, c // S, j], host)
            for c in range(S * V) for j in range(counts[c % S][c // S])]
