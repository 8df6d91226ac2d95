"""Predicting a pipelined step (pp, tp_pp, fsdp_pp) on real GPUs, tick by tick from the
schedule table the step executes (jaxdist/pipeline/schedule.py).

What is compiled (simulated CPU devices, abstract shapes): the pipeline program's own pieces,
built from the same `Parts` and the same shard_map (over `stage`, `data` and `context`,
tensor and fsdp left to the partitioner) as jaxdist/pipeline/step.py, on one stage's devices (the mesh with
`stage` cut to 1):
- a chunk's operations (jaxdist/pipeline/ops.py) for one micro-batch: its forward F
  (stashing the vjp's residuals; the last chunk's with the head and the head's backward),
  F then BACK (the whole backward from the stash) and, for zb-h1, F then B; BACK, B and W
  are differences of these (BACK = (F+BACK) - F, B = (F+B) - F, W = (F+BACK) - (F+B)).
  Each at a chunk of 1, 2 and (for chunks of 3 or more blocks) 3 blocks, extrapolated
  linearly to K blocks from the third block's figures (`chunk_figures`; each chunk at its
  own K where --pp-stage-blocks makes chunks differ), and the last
  chunk's at 1 block: its head is K-independent, so its K-block figures are the 1-block ones
  plus (K-1) blocks. Every stage embeds (a `where`, not a cond), so first and middle chunks
  cost the same. Under FP8 the chunk ops take the blocks' FP8 weight copies as inputs, as
  the step's ops read the copies it makes once before its ticks;
- the tail on the whole mesh: the gradients averaged over `data` (and the shared ones summed
  over `stage`), then the optimizer update, at full depth, and under FP8 the quantization
  of every stage's weights (the step's once-a-step pass, timed here). The chunks'
  reductions the tick loop issues before its last tick (interleaved, distributed
  optimizer, --overlap: `early_reductions`) are timed beside the ticks
  (jaxdist.predict.ticks `hidden_reductions`).
Each op's time is `jaxdist.predict.time_model.step_time` of its figures (compute or HBM, its own
collectives by link, the overlap policy), and the step is timed from the table by
jaxdist.predict.ticks as jaxdist's tick loop runs it (each tick as long as its busiest
stage's ops plus its sends: one micro-batch's activation or gradient per device, over
NVLink within a node, else the NICs, one hop of latency), or, as a what-if, as Megatron
runs the table.
The bubble is counted, not assumed: the ticks' total minus the busiest stage's own work.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdist.figures import Figures
from jaxdist.program import compiled as compiled_mod, program_reading
from jaxdist.parts import Part
from jaxdist.predict.depth import linear, minus
from jaxdist.predict.program import (ScoreBytes, StepFigures, cpu_compilable,
                                     flash_attention_applies, read_program)
from jaxdist.predict.ticks import OpTime, op_key, op_row, tick_model
from jaxdist.predict.time_model import StepTime
from jaxdist.config import parse_stage_blocks
from jaxdist.pipeline.parts import chunk_blocks
from jaxdist.pipeline.schedule import BACK, BWD, FWD, PAIR, WGT, build_schedule
from jaxdist.train_step import DTYPES, MeshJit, jax_matmul_precision, make_optimizer
from jaxdist.update import apply_gradients
from jaxdist.program.xla_compile import compile_lowered
from sharding import padding
from sharding.axes import batch_axes


# ---- compiling the pieces -------------------------------------------------------------

# Compiles of F followed by the whole backward (FULL) or by B (F_B): the backward's halves
# are differences of them, as the backward reads what F stashed.
FULL, F_B = -1, -2


def stage_mesh(sizes: dict[str, int], target) -> Mesh:
    """One stage's devices (the first node's, as stage 0 holds them): the mesh with `stage`
    = 1 (kept as an axis for the specs)."""
    dims = {"stage": 1, **{a: n for a, n in sizes.items() if a != "stage"}}
    devices = np.array(target.devices[:math.prod(dims.values())]).reshape(
        tuple(dims.values()))
    return Mesh(devices, tuple(dims), axis_types=(AxisType.Auto,) * len(dims))


def compile_pieces(cache: dict | None, pieces: dict, target, job,
                   hw=None) -> dict[tuple, StepFigures]:
    """{key: figures} of the pieces `{key: make}` (`make()` -> (lowered, mesh sizes)): those
    not in `cache` lowered one by one (while the first compiles), compiled side by side
    (jaxdist.program.xla_compile.compile_lowered), read, and kept in `cache`. A key names the
    lowered program; the compile options (--overlap's flags) are added to it for the compile, so
    variants that differ only in them lower once."""
    cache = {} if cache is None else cache
    options = compiled_mod.compile_options(job, target)
    flags = tuple(sorted((options or {}).items()))
    todo = [k for k in pieces if (*k, flags) not in cache]
    program_of: dict = {}  # piece -> its program's key: the lowered text, compiled and read
    seen: set = set()  # programs this call compiles

    def lower(k):
        if ("lowered", *k) not in cache:
            cache[("lowered", *k)] = pieces[k]()
        low, sizes = cache[("lowered", *k)]
        # A piece whose lowered program is one compiled before (a chunk's forward under
        # --remat full: recomputation changes only backward programs) is not compiled again.
        program_of[k] = ("program", hashlib.blake2b(low.as_text().encode(), digest_size=16)
                         .digest(), flags, target.label, tuple(sizes.items()), repr(hw),
                         job.matmul_precision,
                         # the program's own compiler options (jit's), not in its text
                         tuple(sorted(getattr(getattr(low, "_lowering", None),
                                              "_compiler_options_kvs", ()))))
        first = program_of[k] not in cache and program_of[k] not in seen
        seen.add(program_of[k])
        return low if first else None

    done = compile_lowered([functools.partial(lower, k) for k in todo], options)
    for k, (compiled, seconds) in zip(todo, done):
        if compiled is None:
            continue
        sizes = cache[("lowered", *k)][1]
        fig = read_program(compiled, seconds, target, sizes, job, hw, memo=cache)
        if not target.gpu and not fig.flops:
            raise program_reading.ProgramError("XLA:CPU's cost analysis gave no FLOPs for a "
                                               "pipeline op")
        cache[program_of[k]] = fig.replace(memory={"temp_bytes": fig.memory.get("temp_bytes",
                                                                                  0)})
    for k in todo:
        cache[(*k, flags)] = cache[program_of[k]]
    return {k: cache[(*k, flags)] for k in pieces}


def op_lowered(job, model_cfg, sizes: dict, blocks: int, kind: int, last: bool,
               rows: int, target) -> tuple:
    """(lowered, mesh sizes) of one chunk of `blocks` blocks for one micro-batch of `rows`
    rows per data shard, on one stage's devices as the pipeline step runs it
    (jaxdist/pipeline/ops.py): its forward (FWD, the stash as outputs), the forward then
    the whole backward (FULL) or the forward then B (F_B); or (PAIR) one micro-batch's
    forward, then another's forward and the first's whole backward side by side (a
    combined tick's F and BACK; the first forward, before an optimization barrier, makes
    the stash). Its gradients go into the stage's and the shared accumulators, inputs it
    updates in place as a tick does (the last chunk's head's into the shared ones)."""
    from jaxdist.pipeline.ops import ChunkOps
    from jaxdist.pipeline.program import COMBINED_TICK_OPTIONS, pipeline_state, stage_axes

    mesh = stage_mesh(sizes, target)
    small = dataclasses.replace(model_cfg, depth=blocks)
    tx = make_optimizer(job.train.optimizer, job.train.lr)
    layout = job.rules
    _, logical, parts = pipeline_state(small, job.dtype, tx, job.train.seed, 1, 1,
                                       layout.master_weights(job.dtype))
    specs = layout(logical, mesh)
    abstract = padding.storage(logical, specs, dict(mesh.shape))  # as the step stores it
    sharded = jax.tree.map(lambda s: NamedSharding(mesh, s), specs["params"],
                           is_leaf=lambda x: isinstance(x, P))
    dtype = DTYPES[job.dtype]
    data = mesh.shape["data"]
    L, D = model_cfg.seq_len, model_cfg.width
    manual = stage_axes(dict(mesh.shape))
    # `context` manual as in the step: activations are each device's sequence shard
    act_spec = P("data", *manual[2:])
    act = jax.ShapeDtypeStruct((rows * data, L, D), dtype)
    tokens = jax.ShapeDtypeStruct((rows * data, L + 1), jnp.int32)
    ops = ChunkOps(parts, job.train.microbatches)
    # the FP8 weights are the step's, quantized once before the ticks (the tail's): inputs
    with jax.set_mesh(mesh):
        quantized, q_specs = parts.fp8_placement(logical["params"]["stages"],
                                                 specs["params"]["stages"])

    # The gradients go into accumulators as the step's ticks add them (jaxdist/pipeline/
    # step.py: a chunk's into its slot of the stage's, the head's and the shared ones' into
    # theirs), donated: what the op writes is what a tick writes, not a fresh gradient
    # tree (a zero embedding-table gradient written whole, where the step's add drops it).
    def head_into(shared, g_shared, y, tokens_BL1):
        loss, dh, d_own = ops.head(shared, y, tokens_BL1)
        return (loss, dh), {**g_shared, **{k: jax.tree.map(jnp.add, g_shared[k], d)
                                           for k, d in d_own.items()}}

    def into(g_stage, g_shared, d_chunk, d_shared):
        return (jax.tree.map(lambda g, d: g.at[0, 0].add(d), g_stage, d_chunk),
                jax.tree.map(jnp.add, g_shared, d_shared))

    def run(stage_params, shared, tokens_BL1, x, dy, q, g_stage, g_shared):
        chunk = jax.tree.map(lambda a: a[0, 0], (stage_params, q))
        head = None
        if kind == PAIR:  # `dy` stands for the earlier micro-batch's input
            _, _, earlier = ops.forward(chunk, shared, dy, tokens_BL1, False)
            earlier, x, dy = jax.lax.optimization_barrier((earlier, x, dy))
            y, aux, stash = ops.forward(chunk, shared, x, tokens_BL1, False)
            if last:
                head, g_shared = head_into(shared, g_shared, y, tokens_BL1)
            d_chunk, d_shared, dx = ops.backward(earlier, chunk, shared, dy, dy)
            return (*into(g_stage, g_shared, d_chunk, d_shared), dx, (y, aux, stash, head))
        y, aux, stash = ops.forward(chunk, shared, x, tokens_BL1, False)
        if last:
            head, g_shared = head_into(shared, g_shared, y, tokens_BL1)
            dy = head[1]
        if kind == FWD:
            return (y, aux, stash, head), g_shared
        if kind == F_B:
            return ops.input_grad(stash, chunk, shared, x, dy), g_shared
        d_chunk, d_shared, dx = ops.backward(stash, chunk, shared, x, dy)
        return (*into(g_stage, g_shared, d_chunk, d_shared), dx, head)

    stage_specs = jax.tree.map(lambda _: P("stage"), abstract["params"]["stages"])
    shared_specs = jax.tree.map(lambda _: P(), abstract["params"]["shared"])
    out = (P(), shared_specs) if kind not in (FULL, PAIR) else \
        (stage_specs, shared_specs, P(), P())
    q_stage = jax.tree.map(lambda _: P("stage"), quantized)
    mapped = jax.shard_map(run, mesh=mesh, in_specs=(stage_specs, shared_specs, P("data"),
                                                      act_spec, act_spec, q_stage,
                                                      stage_specs, shared_specs),
                           out_specs=out, axis_names=set(manual), check_vma=False)

    # The blocks' parameters and accumulators in their logical view, as the ticks read them.
    # The shared ones (the embedding, the head) as stored: the step fits a vocabulary
    # padded for `tensor` to the model's once, before its ticks; fitted here, every op
    # would slice (and reshard) the tables again. The op's embedding never reads the
    # padded rows, and its head computes their logits too ((stored - model) vocabulary
    # more of the head's FLOPs, under 0.1% of GPT-3's).
    def fn(stages, shared, tokens, x, dy, q, g_stages, g_shared):
        return mapped(padding.fit_tree(stages, logical["params"]["stages"]), shared, tokens,
                      x, dy, q, padding.fit_tree(g_stages, logical["params"]["stages"]),
                      g_shared)
    # the stage messages as the step holds them: sequence shards over tensor too under
    # sequence parallelism (models/sequence_parallel.py pin_sequence_shards)
    sp = getattr(model_cfg, "sequence_parallel", False) and mesh.shape.get("tensor", 1) > 1
    batch = NamedSharding(mesh, P("data"))
    acts = NamedSharding(mesh, P("data", (*manual[2:], "tensor")) if sp else act_spec)
    q_sharded = jax.tree.map(lambda s: NamedSharding(mesh, s), q_specs,
                             is_leaf=lambda x: isinstance(x, P))
    # combined ticks: the step's compiler options, which every op it runs is compiled with
    options = COMBINED_TICK_OPTIONS if job.train.pp_combined_1f1b else None
    jitted = MeshJit(jax.jit(fn, in_shardings=(sharded["stages"], sharded["shared"], batch,
                                               acts, acts, q_sharded, sharded["stages"],
                                               sharded["shared"]),
                             donate_argnums=(6, 7), compiler_options=options),
                     mesh, jax_matmul_precision(job.dtype, job.matmul_precision))
    return jitted.lower(abstract["params"]["stages"], abstract["params"]["shared"], tokens,
                        act, act, quantized, abstract["params"]["stages"],
                        abstract["params"]["shared"]), dict(mesh.shape)


def _whole_mesh_state(job, model_cfg, sizes: dict, S: int, V: int, target,
                      stage_blocks: tuple[int, ...]) -> tuple:
    """(mesh, optimizer, layout, logical state) on the whole mesh, as the step holds the
    state: what the tail's program and a chunk's share of its reduction are read from."""
    from jaxdist.state_shapes import pipeline_planning_state

    devices = np.array(target.devices[:math.prod(sizes.values())]).reshape(
        tuple(sizes.values()))
    mesh = Mesh(devices, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    tx = make_optimizer(job.train.optimizer, job.train.lr)
    layout = job.rules
    logical = pipeline_planning_state(model_cfg, job.dtype, tx, S, V,
                                      layout.master_weights(job.dtype), stage_blocks)
    return mesh, tx, layout, logical


def tail_lowered(job, model_cfg, sizes: dict, S: int, V: int, target,
                 stage_blocks: tuple[int, ...] = ()) -> tuple:
    """The step after the ticks, on the whole mesh at full depth: gradients summed over
    stages (shared) and averaged over data, then the optimizer update (of the padded
    slots too, as the program holds them), and with FP8 the weights quantized for the
    next step's ticks (which the ops read as inputs: `op_lowered`)."""
    from jaxdist.pipeline.program import (COMBINED_TICK_OPTIONS, data_reduction, mean_axes,
                                          pipeline_state, stage_axes)
    from jaxdist.pipeline.step import DataMean, stage_sum

    mesh, tx, layout, logical = _whole_mesh_state(job, model_cfg, sizes, S, V, target,
                                                  stage_blocks)
    specs = layout(logical, mesh)
    state = padding.storage(logical, specs, sizes)  # as stored: padded (sharding/padding.py)
    update_specs = layout.update_specs(logical["params"], specs["params"], mesh)
    update_shapes = padding.storage(logical["params"], update_specs, sizes)
    shardings, update = (jax.tree.map(lambda s: NamedSharding(mesh, s), tree,
                                      is_leaf=lambda x: isinstance(x, P))
                         for tree in (specs, update_specs))
    params = state["params"]
    # the distributed optimizer: partial sums stacked over data, then reduce-scattered, as
    # the step does (jaxdist/pipeline/program.py)
    reduce_dtype = layout.reduce_dtype(job.dtype)  # None: float32 parameters
    grad_out, in_map, scatter = data_reduction(specs["params"], update_specs, params,
                                                update_shapes, mesh,
                                                layout.distributed_optimizer,
                                                reduce_dtype or jnp.float32)
    in_map = in_map or DataMean(mean_axes(sizes))

    def reduce(g_stages, g_shared):  # chunk by chunk, as the tick loop issues it
        g_shared = stage_sum(g_shared)
        g_local = jax.tree.map(lambda g: g[0], g_stages)
        reduced = [in_map.chunk(v, jax.tree.map(lambda g: g[v], g_local)) for v in range(V)]
        return (jax.tree.map(lambda g: g[None], in_map.stages(reduced, g_local)),
                in_map.shared(g_shared))

    stage_specs = jax.tree.map(lambda _: P("stage"), params["stages"])
    shared_specs = jax.tree.map(lambda _: P(), params["shared"])

    def tail(state, grads):
        g_stages, g_shared = jax.shard_map(
            reduce, mesh=mesh, in_specs=(stage_specs, shared_specs),
            out_specs=grad_out or (stage_specs, shared_specs),
            axis_names=set(stage_axes(sizes)), check_vma=False)(grads["stages"],
                                                                 grads["shared"])
        if scatter is not None:
            g_stages, g_shared = scatter(g_stages, g_shared)
        new = apply_gradients(tx, state, {"stages": g_stages, "shared": g_shared}, update,
                              update_shapes, params, reduce_dtype in (None, "float32"))
        # the FP8 weights the next step's ticks read, quantized once (the step does it
        # before its ticks: the same pass, once a step)
        return new, jax.vmap(parts.fp8_weights)(
            padding.fit_tree(new["params"]["stages"], logical["params"]["stages"]))

    parts = pipeline_state(dataclasses.replace(model_cfg, depth=1), job.dtype, tx,
                           job.train.seed, 1, 1)[2]
    with jax.set_mesh(mesh):
        q_specs = parts.fp8_placement(logical["params"]["stages"],
                                      specs["params"]["stages"])[1]
    jitted = jax.jit(tail, in_shardings=(shardings, shardings["params"]),
                     out_shardings=(shardings, jax.tree.map(
                         lambda s: NamedSharding(mesh, s), q_specs,
                         is_leaf=lambda x: isinstance(x, P))), donate_argnums=0,
                     compiler_options=COMBINED_TICK_OPTIONS if job.train.pp_combined_1f1b
                     else None)
    return MeshJit(jitted, mesh).lower(state, params), sizes


def chunk_gradient_share(job, model_cfg, sizes: dict, S: int, V: int, target,
                         stage_blocks: tuple[int, ...] = ()) -> float:
    """One virtual chunk's part of the gradient bytes each device reduces over `data`
    (its stage's blocks over V, beside the shared gradients), as stored and split by the
    layout: the share of the tail's data-axis reduction the tick loop issues for a chunk
    as soon as its gradients are final (jaxdist/pipeline/step.py)."""
    from jaxdist.pipeline.program import mean_axes

    mesh, _, layout, logical = _whole_mesh_state(job, model_cfg, sizes, S, V, target,
                                                 stage_blocks)
    specs = layout(logical, mesh)["params"]
    stored = padding.storage(logical, layout(logical, mesh), sizes)["params"]
    reduced = mean_axes(sizes)  # data, and context where it splits the sequence

    def per_device(part):
        def leaf(shape, spec):
            split = math.prod(sizes[a] for e in spec for a in padding.axes_of(e)
                              if a not in reduced)  # the bytes each device reduces
            return math.prod(shape.shape) / split
        return sum(jax.tree.leaves(jax.tree.map(leaf, stored[part], specs[part],
                                                is_leaf=lambda x: isinstance(x, P))))
    stages, shared = per_device("stages"), per_device("shared")
    return stages / V / (stages + shared)


def early_reductions(sched, tail_row, share: float, axes: tuple[str, ...],
                     distributed: bool = True) -> list:
    """(tick, seconds, link) of each chunk reduction the tick loop issues before its last
    tick (Schedule.gradients_final), in issue order: `share` of the tail's gradient
    reduction over `axes` (data, and context where it splits the sequence: mean_axes;
    reduce-scatter under the distributed optimizer, else all-reduce)."""
    kind = "reduce-scatter" if distributed else "all-reduce"
    grads = [c for c in tail_row.collectives
             if c["kind"] == kind and set(c["axes"]) == set(axes)]
    if not grads:
        return []
    seconds = sum(c["seconds"] for c in grads)
    link = max(grads, key=lambda c: c["seconds"])["link"]
    return sorted((r, share * seconds, link) for r in sched.gradients_final()
                  if r < sched.ticks)


def chunk_figures(base: StepFigures, one: StepFigures, two: StepFigures,
                  three: StepFigures | None, k: int) -> StepFigures:
    """A chunk of k blocks from its base (a 1-block chunk's figures) and the 1-, 2- and
    3-block compiles: base, its second block as two - one, and every block past the second
    as three - two. Counts (FLOPs, bytes, collectives) are linear either way; what XLA's
    schedule hides is not: a block's collectives beside the first block's neighbours (the
    embedding, the stage's input) overlap differently from those between two blocks, so
    two - one is no block's own (a 70B GPT TP8 chunk's forward, sequence parallel: 0.05 ms
    exposed a block from 1 to 2 blocks, 0.41 and 0.38 ms from 2 to 3 and 3 to 4)."""
    if three is None or k < 3:
        return linear(base, one, two, k)
    return linear(linear(base, one, two, 2), two, three, k - 1)


# ---- the whole prediction ----------------------------------------------------------------

def attention_scores(one: StepFigures, two: StepFigures, h1: StepFigures, h2: StepFigures,
                     blocks: int) -> ScoreBytes:
    """The L x L attention-score part of an op's bytes accessed and temp bytes, as
    jaxdist.predict.program.attention_scores measures it for the whole step: per block
    (2 blocks - 1 block), at L and at L/2 with twice the rows (same tokens), S = 2 (P(1) -
    P(2)); times the blocks. Never negative (nothing is added back)."""
    def part(get):
        return max(0.0, blocks * 2 * ((get(two) - get(one)) - (get(h2) - get(h1))))
    return ScoreBytes(bytes_accessed=part(lambda f: f.bytes_accessed),
                      temp_bytes=part(lambda f: f.memory["temp_bytes"]))


def microbatch_rows(job, sizes: dict) -> int:
    """Rows of one micro-batch per data shard (the shard_map's manual `data`); fsdp_pp's
    rows are split further over fsdp by the partitioner."""
    return job.train.batch_size // (job.train.microbatches * sizes.get("data", 1))


def message_bytes(job, model_cfg, sizes: dict) -> float:
    """One stage-to-stage message per device: a micro-batch's activation (or its gradient)
    at the boundary, rows over the batch axes, the sequence over `context` (and `tensor`
    under sequence parallelism), the full width (jaxdist.pipeline.report)."""
    from jaxdist.pipeline.program import message_sequence_shards
    shards = math.prod(sizes[a] for a in batch_axes(sizes))
    rows = job.train.batch_size // (job.train.microbatches * shards)
    # the sequence, not the rows, is split: a micro-batch of one row still has L / CP
    tokens = model_cfg.seq_len // message_sequence_shards(model_cfg, sizes)
    return rows * tokens * model_cfg.width * np.dtype(DTYPES[job.dtype]).itemsize


def pipeline_step(job, model_cfg, sizes: dict, hw: Part, cache: dict | None = None,
                  target=None) -> "PipelineStep":
    """A pipeline layout's step on `hw`: the tick model over its ops' figures (compiled
    per op, extrapolated in depth)."""
    S = sizes["stage"]
    V = job.train.pp_virtual if job.train.pp_schedule == "interleaved" else 1
    stage_blocks = parse_stage_blocks(job.train.pp_stage_blocks)
    counts = chunk_blocks(model_cfg, S, V, stage_blocks)
    sched = build_schedule(job.train.pp_schedule, S, job.train.microbatches, V, counts,
                           job.train.pp_combined_1f1b)
    K = max(max(row) for row in counts)  # the largest chunk's blocks
    sizes_k = sorted({k for row in counts for k in row})  # each chunk's figures at its own
    rows = microbatch_rows(job, sizes)
    target = target or compiled_mod.simulated_cpu(math.prod(sizes.values()))
    # XLA:GPU compiles cuDNN attention itself; XLA:CPU's scores are measured and removed.
    flash = not target.gpu and flash_attention_applies(model_cfg, job.dtype)
    if not target.gpu:
        model_cfg = cpu_compilable(model_cfg)
    inner = tuple((a, n) for a, n in sizes.items() if a != "stage")
    common = (target.label, repr(model_cfg), job.train.layout, inner, rows, job.dtype,
              job.matmul_precision, job.train.optimizer, job.train.microbatches,
              job.train.pp_combined_1f1b)
    half = dataclasses.replace(model_cfg, seq_len=model_cfg.seq_len // 2)
    half_common = (target.label, repr(half), *common[2:4], 2 * rows, *common[5:])
    pieces = {}
    kinds = (FWD, FULL, F_B) if sched.split_backward else (FWD, FULL) + (
        (PAIR,) if sched.combined else ())
    # a chunk of 3 or more blocks: its blocks past the second at the slope of the third
    # (`chunk_figures`)
    depths = ((1, False), (2, False), (1, True)) + (((3, False),) if K >= 3 else ())
    for kind in kinds:
        for blocks, last in depths:
            pieces[("op", *common, blocks, kind, last)] = functools.partial(
                op_lowered, job, model_cfg, sizes, blocks, kind, last, rows, target)
            if flash and not last and blocks < 3 and kind != PAIR:  # the scores' part, at L/2, twice the rows
                pieces[("op", *half_common, blocks, kind, False)] = functools.partial(
                    op_lowered, job, half, sizes, blocks, kind, False, 2 * rows, target)
    tail_key = ("tail", *common, tuple(sizes.items()), model_cfg.depth, S, V, stage_blocks)
    pieces[tail_key] = functools.partial(tail_lowered, job, model_cfg, sizes, S, V, target,
                                         stage_blocks)
    got = compile_pieces(cache, pieces, target, job, hw)

    def op(blocks, kind, last):
        return got[("op", *common, blocks, kind, last)]

    def half_op(blocks, kind):
        return got[("op", *half_common, blocks, kind, False)]

    figs, removed = {}, {}
    for kind in kinds:
        one, two, last1 = op(1, kind, False), op(2, kind, False), op(1, kind, True)
        three = op(3, kind, False) if K >= 3 else None
        for k in sizes_k:  # a chunk of k blocks (all chunks alike: k = K)
            # a PAIR's scores: its two forwards' and one backward's (FULL's and FWD's)
            scores = None
            for sk in ((FULL, FWD) if kind == PAIR else (kind,)) if flash else ():
                part = attention_scores(op(1, sk, False), op(2, sk, False), half_op(1, sk),
                                        half_op(2, sk), k)
                scores = part if scores is None else scores + part
            for last, base in ((False, one), (True, last1)):
                fig = chunk_figures(base, one, two, three, k)
                if scores is not None:
                    fig = fig.replace(
                        bytes_accessed=fig.bytes_accessed - scores.bytes_accessed,
                        memory={**fig.memory,
                                "temp_bytes": fig.memory["temp_bytes"] - scores.temp_bytes})
                figs[(kind, last, k)] = fig
            if k == K:
                removed[kind] = scores
    for last in (False, True):  # the backward's figures: differences of F+... and F
        for k in sizes_k:
            if sched.split_backward:
                figs[(WGT, last, k)] = minus(figs[(FULL, last, k)], figs[(F_B, last, k)])
                figs[(BWD, last, k)] = minus(figs.pop((F_B, last, k)), figs[(FWD, last, k)])
            figs[(BACK, last, k)] = minus(figs.pop((FULL, last, k)), figs[(FWD, last, k)])
            if sched.combined:  # less the forward (no head) that made the stash
                figs[(PAIR, last, k)] = minus(figs[(PAIR, last, k)], figs[(FWD, False, k)])
    # XLA:GPU's temporaries of a K-block chunk's backward beyond its forward's (whose
    # stash the plan counts per slot): the working set the memory plan counts (XLA:CPU's
    # are an upper bound: the hand estimate stands there)
    # (combined ticks: F and BACK side by side, both working sets live)
    working = (max(figs[(kind, last, K)].memory["temp_bytes"] for last in (False, True)
                   for kind in ((BACK, PAIR) if sched.combined else (BACK,)))
               if target.gpu else None)
    tail = got[tail_key]
    args = (hw, sizes, job.dtype, job.compiler.overlap, job.matmul_precision)
    ops = {k: op_row(f, *args) for k, f in figs.items()}
    tail_row = op_row(tail, *args)
    # what XLA:GPU's schedule was read to keep in flight beside the ticks (tested): the
    # distributed optimizer's reduce-scatters under --overlap
    from jaxdist.pipeline.program import mean_axes

    early = (early_reductions(sched, tail_row, chunk_gradient_share(
        job, model_cfg, sizes, S, V, target, stage_blocks), mean_axes(sizes), True)
        if V > 1 and job.train.distributed_optimizer and job.compiler.overlap else [])
    time = tick_model(sched, ops, tail_row, message_bytes(job, model_cfg, sizes), hw, sizes,
                      job.output.pp_runtime, job.compiler.overlap, early)
    time = time.replace(
        overlap=("collectives inside an op and in the tail hidden behind its compute up to "
                 "its length; a stage send beside the op it rides with up to that op's length "
                 "(F then BACK loops), else exposed" if job.compiler.overlap else "none"),
        peak_flops_per_device=hw.peak_flops(job.dtype, job.matmul_precision),
        collectives=tail_row.collectives)
    names = {(FWD, False): "forward", (FWD, True): "forward_last",
             (BACK, False): "backward", (BACK, True): "backward_last",
             (BWD, False): "input_gradient", (BWD, True): "input_gradient_last",
             (PAIR, False): "forward_beside_backward",
             (PAIR, True): "forward_beside_backward_last",
             (WGT, False): "weight_gradient", (WGT, True): "weight_gradient_last"}
    k_last = counts[S - 1][V - 1]  # the figures named per op: the largest chunk's, and
    # the last chunk's at its own blocks
    per_op = {names[k[:2]]: r.to_json() for k, r in ops.items()
              if k[2] == (k_last if k[1] else K)}
    per_op["tail"] = tail_row.to_json()
    c = time.pipeline.critical_stage
    flops = tail.flops + sum(ops[op_key(sched, o.kind, c, o.v)].flops
                                for row in sched.ops for o in row[c])
    return PipelineStep(
        time=time, ops=per_op, schedule=sched.summary(), compiler=target.label,
        blocks_per_chunk=K, flops_per_device=flops, working_temp_bytes=working,
        flash_attention=None if not flash else {
            "removed_score_bytes_accessed": {"forward": removed[FWD].bytes_accessed,
                                             "forward_and_backward":
                                                 removed[FULL].bytes_accessed},
            "why": "a GPU runs bf16 attention as cuDNN flash attention, which keeps no L x L "
                   "scores; XLA:CPU keeps them (measured per op at L and L/2)"},
        method=f"chunk forward, forward+backward (zb-h1: and forward+B; combined ticks: and "
               f"a forward beside another micro-batch's backward) compiled at 1, "
               f"2{' and 3' if K >= 3 else ''} blocks on one stage's devices, extrapolated to "
               f"{'/'.join(map(str, sizes_k))} (each chunk's own blocks), the backward's "
               f"figures their differences; tail (gradient reduction, optimizer) compiled at "
               f"full depth; ticks from the {sched.name} table")


@dataclasses.dataclass(frozen=True)
class PipelineStep(Figures):
    """A pipeline layout's predicted step: its time tick by tick (`time`, a StepTime whose
    `pipeline` holds the ticks), each op's time and figures (`ops`, by name: the largest
    chunk's, `_last` the chunk holding the head; `tail` the gradient reduction and
    optimizer), the schedule's summary, the critical stage's FLOPs, XLA:GPU's working set of
    one chunk's backward (None on XLA:CPU) and what L x L scores were removed."""
    time: StepTime
    ops: dict[str, OpTime]
    schedule: dict
    compiler: str
    blocks_per_chunk: int
    flops_per_device: float
    working_temp_bytes: float | None
    flash_attention: dict | None
    method: str
