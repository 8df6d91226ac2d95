"""Megatron sequence parallelism (Korthikanti et al. 2022, Reducing Activation Recomputation
in Large Transformer Models, Sec. 4.2.2) inside a pre-norm block.

Under tensor parallelism the norms and the residual stream are computed whole on every
device of the `tensor` axis, and the row-parallel outputs of attention and the MLP are
all-reduced. With sequence parallelism those regions hold 1/T of the sequence: the
row-parallel matmul's partial sums are reduce-scattered into sequence shards, and the
norm's output is all-gathered before the next column-parallel matmul; in the backward each
becomes the other: per block and micro-batch 4 all-gathers and 4 reduce-scatters of one
activation, tp's volume (its 4 all-reduces). Both are written out (`all_gather`,
`psum_scatter`) in a `shard_map` over `tensor` and the batch axes, with the sublayer's own
heads or MLP columns on each device, because with sharding constraints alone XLA:CPU
all-reduces the partial sums and slices them where a reduce-scatter belongs. The norms'
inputs and the residual stream are then kept for the backward as sequence shards. The
gathered norm output is kept whole for the weight gradients (Megatron keeps its shard and
gathers again in the backward: less memory, one more all-gather per sublayer).

Every one of those collectives sits between two matmuls that need it, so inside one chain of
blocks nothing can hide it. `run_stack` with chunks > 1 runs the blocks on that many
independent slices of each device's batch (DeepSpeed Domino's batch split, Wang et al. 2024;
Megatron's `--tp-comm-overlap` overlaps the same collectives with userbuffers instead): the
slices are separate chains in the program, so XLA's latency-hiding scheduler runs one
slice's all-gather or reduce-scatter beside another slice's matmuls. Each row's arithmetic
is unchanged, only the matmuls are narrower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from models import context, fp8
from models.layers import PreNormBlock, counted, run_blocks, tagged



def active() -> bool:
    """Whether the ambient mesh has a tensor axis to split the sequence over."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.shape.get("tensor", 1) > 1


def _batch_axes() -> tuple[str, ...]:
    """The axes the batch is split over here (jaxdist's batch_spec: all but tensor, stage
    and context), less those an enclosing shard_map made manual (the pipeline's data)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in mesh.axis_names
                 if a not in ("tensor", "stage", context.AXIS)
                 and a not in set(mesh.manual_axes))


def _context() -> tuple[str, ...]:
    """(`context`,) where context parallelism splits the sequence here: the sequence
    shards are then the tensor shards of each context shard's part (context outer)."""
    return (context.AXIS,) if context.active() and not context.manual() else ()


def _map(fn, in_specs, out_specs):
    """fn in a shard_map over tensor, the batch axes and context (so the batch and the
    sequence stay split; with tensor alone manual the partitioner gathers them), the rest
    left to the partitioner."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                         axis_names={"tensor", *_batch_axes(), *_context()})


def _sequence():
    return P(_batch_axes() or None, (*_context(), "tensor"), None)


def _whole():
    return P(_batch_axes() or None, _context() or None)


def _local_slice(x_BLD):
    """This tensor device's part of the sequence (inside the shard_map: no communication)."""
    n = x_BLD.shape[1] // jax.sharding.get_abstract_mesh().shape["tensor"]
    return jax.lax.dynamic_slice_in_dim(x_BLD, jax.lax.axis_index("tensor") * n, n, axis=1)


def _all_gather(x_BlD):
    return jax.lax.all_gather(x_BlD, "tensor", axis=1, tiled=True)


# The entry into and the exit from the sequence-parallel blocks, each the other's transpose:
# written in shard_maps so that the partitioner never splits the tokens' sequence (their
# shifted slices would then need neighbour exchanges, which inside a pipeline stage's
# branch would wait for the other stages).
@jax.custom_vjp
def to_sequence_shards(x_BLD):
    """An activation whole on every tensor device -> its sequence shard (a slice)."""
    return _map(_local_slice, _whole(), _sequence())(x_BLD)


@jax.custom_vjp
def from_sequence_shards(x_BlD):
    """Sequence shards -> the whole activation on every tensor device (an all-gather)."""
    return _map(_all_gather, _sequence(), _whole())(x_BlD)


to_sequence_shards.defvjp(lambda x: (to_sequence_shards(x), None),
                          lambda _, g: (from_sequence_shards(g),))
from_sequence_shards.defvjp(lambda x: (from_sequence_shards(x), None),
                            lambda _, g: (to_sequence_shards(g),))


def sequence_shards(x_BLD, sequence_parallel: bool):
    """Before the first sequence-parallel block: the activation's sequence shard."""
    return to_sequence_shards(x_BLD) if sequence_parallel and active() else x_BLD


def whole_sequence(x_BLD, sequence_parallel: bool):
    """After the last sequence-parallel block: the activation whole again (for the final
    norm and head, or the pipeline's next stage)."""
    return from_sequence_shards(x_BLD) if sequence_parallel and active() else x_BLD


def pin_sequence_shards(x, sequence_parallel: bool, leading: int = 0):
    """x ([*leading dims, B, L, D]: an activation between blocks, e.g. a pipeline stage's
    message or its buffer of them) laid out as the sequence shards the blocks hold, so it
    is kept and sent as 1/T of the sequence on each tensor device, as Megatron's pipeline
    sends under sequence parallelism; x itself where there are none."""
    if not (sequence_parallel and active()):
        return x
    return jax.lax.with_sharding_constraint(x, P(*([None] * leading), *_sequence()))


def run_stack(blocks, run_block, x_BLD, sequence_parallel: bool, chunks: int = 1,
              ordered: bool = False):
    """The decoder's blocks, on sequence shards under sequence parallelism (entered before the
    first block, left after the last), and with chunks > 1 on that many independent slices of
    each device's batch: rows c, c + chunks, ... form slice c, which keeps every slice's rows
    on the device that holds them (the batch is split over the data axes in contiguous runs,
    each a multiple of chunks: jaxdist.run_model.tp_comm_chunks). `ordered`: run_blocks'."""
    x_BLD = sequence_shards(x_BLD, sequence_parallel)
    if chunks > 1 and sequence_parallel and active():
        B, rest = x_BLD.shape[0], x_BLD.shape[1:]
        slices = tuple(x_BLD.reshape(B // chunks, chunks, *rest)[:, c] for c in range(chunks))
        # SequenceParallelBlock takes the tuple: each slice its chain
        slices = run_blocks(blocks, run_block, slices, ordered)
        x_BLD = jnp.stack(slices, axis=1).reshape(x_BLD.shape)
    else:
        x_BLD = run_blocks(blocks, run_block, x_BLD, ordered)
    return whole_sequence(x_BLD, sequence_parallel)


def _param_specs(state):
    """Megatron's split of a sublayer's parameters over tensor, by their logical axes
    (sharding/logical.py, the tp layout's rule): heads and MLP hidden over tensor."""
    from sharding.logical import logical_axes

    def spec(path, leaf):
        axes = logical_axes(path) or (None,) * leaf.ndim
        return P(*("tensor" if a in ("heads", "mlp") else None for a in axes))
    return jax.tree_util.tree_map_with_path(spec, state)


def sublayer(module, hs_BlD: tuple, weight_rules: str | None = None, pieces: int = 1):
    """module (attention or MLP: `column`, then its row-parallel projection `row`) on each
    all-gathered norm output h of `hs` (the batch's slices, run_stack), its output
    reduce-scattered back to sequence shards: inside one shard_map over tensor (and the batch
    axes), on each device's own heads or MLP columns, so the backward's partial input
    gradients go straight into the transposed all-gather (a reduce-scatter). With pieces > 1
    each sequence shard is split into that many pieces, gathered, projected and scattered
    piece by piece (`_run_pieces`). All slices in
    one shard_map: their weight gradients are summed inside it and leave it as one sum over
    the batch axes (a shard_map per slice would reduce each slice's apart). The parameters
    enter it in the compute dtype: cast inside, XLA gathered fsdp_tp's weight shards over
    `data` and reduced their gradients in float32. With `weight_rules` (the layout's logical
    rules, sharding/logical.RULES) the cast is pinned where the layout stores each parameter,
    so fsdp_tp's weight shards are cast and then gathered in the compute dtype (torchtitan's
    FSDP2 under its mixed-precision policy); unpinned, XLA gathered the float32 shards and
    cast the whole weights (llama-tiny on data:4,fsdp:2,tensor:4: 98,944 bytes gathered
    where 57,984 are bf16)."""
    graphdef, state = nnx.split(module)
    dtype = getattr(module, module.row).dtype
    if dtype is not None:
        state = jax.tree.map(lambda p: p.astype(dtype)
                             if jnp.issubdtype(p.dtype, jnp.floating) else p, state)
        if weight_rules is not None:
            from sharding.logical import rule_specs
            specs = rule_specs(state, jax.sharding.get_abstract_mesh(), weight_rules)
            state = jax.tree.map(jax.lax.with_sharding_constraint, state, specs,
                                 is_leaf=lambda x: isinstance(x, P))

    # FP8 weights quantized before (the pipeline's once a step: models/fp8.py), each
    # tensor device's shard with its own scale (`quantize_sublayer`), handed in beside them
    quantized = fp8.copies(module)

    def local(hs, state, quantized):
        m = nnx.merge(graphdef, state)
        own = {k: (qw, sw[0]) for k, (qw, sw) in quantized.items()}  # this device's scale
        with fp8.quantized_weights(m, own):
            return run(m, hs)

    def run(m, hs):
        if pieces > 1:
            return tuple(_run_pieces(m, h, pieces) for h in hs)
        row = getattr(m, m.row)
        outs, gathered, scattered = [], None, None
        for h in hs:
            # Each slice's all-gather waits for the previous slice's, and its reduce-scatter
            # for the previous one's: left independent, XLA's collective combiners would
            # merge the slices' collectives into one (whenever they fit under the combine
            # threshold), and the slices would wait for each other at every sublayer.
            if gathered is not None:
                h, _ = jax.lax.optimization_barrier((h, gathered))
            gathered = _all_gather(h)
            _, scattered, bias = _row_projection(row, m.column(gathered), scattered)
            outs.append(scattered if bias is None else scattered + bias)
        return tuple(outs)

    specs = (_sequence(),) * len(hs_BlD)
    return _map(local, (specs, _param_specs(state), _fp8_specs(module, state, quantized)),
                specs)(tuple(hs_BlD), state, quantized)


def _row_projection(row, y, previous=None):
    """(partial sums, their reduce-scatter into sequence shards, bias) of the row-parallel
    projection `row` of y; the reduce-scatter after `previous` (the slice's or piece's
    before), if any."""
    y, kernel, bias = row.promote_dtype(
        (y, row.kernel[...], row.bias[...] if row.bias is not None else None), dtype=row.dtype)
    part = counted(row.matmul(y, kernel, (((2,), (0,)), ((), ()))))
    summed = part if previous is None else jax.lax.optimization_barrier((part, previous))[0]
    # the row projection's name (out_proj, mlpwo) on its sequence shard
    return part, tagged(checkpoint_name(jax.lax.psum_scatter(
        summed, "tensor", scatter_dimension=1, tiled=True), "reduce_scatter"), row.tag), bias


def _run_pieces(m, h_BlD, pieces: int):
    """One slice through a sublayer with its sequence shard in `pieces` pieces (Megatron's
    pipelined --tp-comm-overlap split along the tokens): piece c of every tensor device's
    shard is all-gathered while piece c - 1 is projected, and the row projection's output of
    piece c is reduce-scattered while piece c + 1's is computed, so each collective but the
    first all-gather and the last reduce-scatter has a matmul beside it. Reduce-scattering
    piece c returns each device its own piece c, so the output is its sequence shard as
    without pieces. A token-wise `column` (an MLP: `per_token`) runs piece by piece;
    attention projects its q, k and v piece by piece, then attends over the whole sequence
    reassembled in order (a local transpose), and its output is split into the same pieces
    for the row projection. Each token's arithmetic is unchanged; the matmuls are narrower."""
    T = jax.sharding.get_abstract_mesh().shape["tensor"]
    row = getattr(m, m.row)

    def after(x, earlier):
        """x, made to wait for `earlier` (the previous piece's): XLA would otherwise merge
        the pieces' matmuls of one weight into one (its dot merger, slices of one dot) or
        their collectives into one (its combiners), and nothing would be left to overlap."""
        return x if earlier is None else jax.lax.optimization_barrier((x, earlier))[0]

    gathered = []
    for p in jnp.split(h_BlD, pieces, axis=1):
        gathered.append(_all_gather(after(p, gathered[-1] if gathered else None)))
    ys = []
    if getattr(m, "per_token", False):
        for g in gathered:
            ys.append(m.column(after(g, ys[-1] if ys else None)))
    else:  # gathered piece c: [B, T x l, ...], device t's piece c at t; in order: [B, T, C, l]
        projected = []
        for g in gathered:
            projected.append(m.project(after(g, projected[-1] if projected else None)))

        def whole(ps):
            B, n = ps[0].shape[:2]
            stacked = jnp.stack([p.reshape(B, T, n // T, *p.shape[2:]) for p in ps], axis=2)
            return stacked.reshape(B, n * pieces, *ps[0].shape[2:])
        y = m.attend(*(whole(list(ps)) for ps in zip(*projected)))
        (B, L), rest = y.shape[:2], y.shape[2:]
        y = y.reshape(B, T, pieces, L // (T * pieces), *rest)
        ys = [y[:, :, c].reshape(B, L // pieces, *rest) for c in range(pieces)]
    outs, part = [], None
    for y in ys:
        part, scattered, bias = _row_projection(row, after(y, part),
                                                outs[-1] if outs else None)
        outs.append(scattered)
    out = jnp.concatenate(outs, axis=1)
    return out if bias is None else out + bias


def _fp8_specs(module, state, keys) -> dict:
    """The specs of `keys`' FP8 weight copies (models.fp8.quantize_weights) of a sublayer:
    each copy split as its weight (`_param_specs`), its scales one per tensor device."""
    specs, paths = _param_specs(state), fp8.weight_paths(module)

    def spec_of(path):
        spec = specs
        for name in path:
            spec = spec[name]
        return getattr(spec, "value", spec)
    return {k: (spec_of(paths[k]), P("tensor")) for k in keys}


def quantize_sublayer(module) -> dict:
    """`module`'s (a sublayer's) FP8 weights quantized as `sublayer` runs them: on each
    tensor device its shard, scaled by the shard's own amax (scales [tensor])."""
    graphdef, state = nnx.split(module)
    keys = fp8.weight_paths(module)

    def local(state):
        q = fp8.quantize_each(nnx.merge(graphdef, state))
        return {k: (qw, sw[None]) for k, (qw, sw) in q.items()}
    return _map(local, (_param_specs(state),), _fp8_specs(module, state, keys))(state)


class SequenceParallelBlock(PreNormBlock):
    """PreNormBlock with its norms and residual stream on sequence shards: its input and
    output are sequence shards (`sequence_shards` before the first block, `whole_sequence`
    after the last), or a tuple of them, the slices of run_stack, each its own chain. Without
    a tensor axis it is PreNormBlock. `weight_rules`: the layout's logical rules, where its
    sublayers' parameters are stored (sublayer)."""

    def __init__(self, ln1, attn, ln2, mlp, weight_rules: str | None = None,
                 pieces: int = 1):
        super().__init__(ln1, attn, ln2, mlp)
        self.weight_rules = weight_rules
        self.pieces = pieces  # each sublayer's sequence shard in pieces (`sublayer`)

    def fp8_weights(self) -> dict:
        """The block's FP8 weight copies (models.fp8.quantize_weights) as its forward runs
        its matmuls: under sequence parallelism each sublayer's per tensor device."""
        if not active():
            return fp8.quantize_each(self)
        return {f"{name}/{k}": q for name in ("attn", "mlp")
                for k, q in quantize_sublayer(getattr(self, name)).items()}

    def __call__(self, x_BLD):
        if not active():
            return super().__call__(x_BLD)
        xs = x_BLD if isinstance(x_BLD, tuple) else (x_BLD,)
        rules, n = self.weight_rules, self.pieces
        xs = tuple(x + h for x, h in zip(xs, sublayer(self.attn, [self.ln1(x) for x in xs],
                                                       rules, n)))
        xs = tuple(x + h for x, h in zip(xs, sublayer(self.mlp, [self.ln2(x) for x in xs],
                                                       rules, n)))
        return xs if isinstance(x_BLD, tuple) else xs[0]
