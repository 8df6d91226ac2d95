"""A pipeline layout's memory per stage: per-device parameter, optimizer and activation bytes
of every stage, from shapes alone (a shapes-only pipeline plan shows it; a pipeline
prediction's verdict sets its worst stage against the part's HBM: jaxdist.predict.verdict).

Parameters and optimizer state: the pipeline train state (blocks stacked [S, V, K, ...], the
embeddings and head on every stage) assembled from the decoder's depth-1 shapes
(jaxdist.state_shapes), placed by the layout's specs on an abstract mesh. With
--pp-stage-blocks each stage's `params`, `opt`, `master` and `gradients` are its own blocks'
(and the shared leaves'); the slots a stage holds beyond its own blocks (K is the largest
chunk's: a sharded array has equal shards on every stage) are `padding_state` and
`padding_gradients`, counted in its `total`. The activation stash is the program's: every
stage's slots sized for K blocks.

Activations (an estimate, not a compiled figure): stage s stashes, for each micro-batch
between its forward and its backward (`res_slots_s`, counted from the schedule's table: M
for GPipe, at most 2S-1 for 1F1B), what the chunk's backward reads (jaxdist/pipeline/ops.py):
with --remat none every block's activations, at Korthikanti et al. 2022's count per block
of L*b*D*(10 + 24/t + 5*a*L/(D*t)) bytes for 2-byte activations (t: tensor-parallel size,
a: heads; 34/t for the first two terms with sequence parallel; the last term is the stored
attention scores, which cuDNN's flash attention does not keep), scaled to the compute dtype;
with --remat full each block's input (a sequence shard of it on each tensor device under
sequence parallelism: b*L*D/t, as the chunk's forward stashes it); with --remat dots its input and its matmuls' outputs
(q, k, v, the scores unless flash, attention output, projection, MLP up and down:
L*b*(10*D + a*L)); with one of MaxText's named policies its input and the named values it
keeps that a backward reads (`named_saved_bytes`; the offloading ones are refused:
jaxdist.pipeline.checks). b = batch / (M x batch shards). Under context parallelism every
L above is a device's L / CP tokens (the scores' keys stay L). Received activations and
gradients in flight (a slot each) are counted at b x L x D (L / T under sequence
parallelism: the stage message is a sequence shard); the working set of a backward is one
block's activations (the block being differentiated, recomputed under --remat; a plan
compiled for a GPU takes XLA:GPU's temporaries of that op: jaxdist.predict.verdict). Under
--dtype float8 each stage also holds its blocks' FP8 weight
copies, quantized once a step: one byte per parameter of its slots, as they are split.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxdist import metrics
from jaxdist.figures import Figures
from jaxdist.config import parse_stage_blocks
from jaxdist.pipeline.checks import check_pipeline
from jaxdist.pipeline.parts import chunk_blocks
from jaxdist.pipeline.program import message_sequence_shards
from jaxdist.pipeline.schedule import build_schedule
from jaxdist.state_shapes import pipeline_planning_state
from jaxdist.train_step import DTYPES, make_optimizer
from models.layers import REMAT_NAMES
from sharding.axes import batch_axes
from sharding.pipeline import is_stacked



def block_activation_bytes(model_cfg, rows: int, tensor: int, itemsize: int,
                           flash: bool = False, sequence_parallel: bool = False,
                           context: int = 1, fp8: bool = False) -> float:
    """Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer
    Models), Eq. 2 with tensor parallelism, Eq. 4 with sequence parallelism (the 10 bytes
    per element outside the tensor-parallel regions split over t too): bytes one block
    keeps for its backward. Flash attention keeps no L x L scores (the 5aL/(Dt) term).
    Under context parallelism a device holds L / `context` tokens, whose queries' scores
    span all L keys. With FP8 matmuls (`fp8`) the GEMMs' inputs are kept as their FP8
    copies, one byte where the count has two (models/fp8.py; Transformer Engine's too):
    the QKV and MLP-up inputs, 4 of the 10, and the output projection's and MLP-down's,
    10 of the 24."""
    L, D, a = model_cfg.seq_len, model_cfg.width, model_cfg.heads
    linear = 34 / tensor if sequence_parallel else 10 + 24 / tensor
    if fp8:
        linear -= (2 + 5) / tensor if sequence_parallel else 2 + 5 / tensor
    scores = 0.0 if flash else 5 * a * L / (D * tensor)
    return L // context * rows * D * (linear + scores) * itemsize / 2


def named_saved_bytes(model_cfg, names, rows: int, tensor: int, itemsize: int,
                      sequence_parallel: bool = False, context: int = 1) -> float:
    """Bytes of one block's values kept by name (models.layers REMAT_NAMES) per micro-batch:
    each name's width per token, split over `tensor` where tensor parallelism splits it.
    `mlpwo` counts nothing: no backward reads the MLP's output (JAX keeps only what one
    reads)."""
    D, hd = model_cfg.width, model_cfg.width // model_cfg.heads
    kv = getattr(model_cfg, "kv_heads", model_cfg.heads) * hd
    gated = hasattr(model_cfg, "mlp_hidden")  # SwiGLU: gate and up (mlpwi_0, mlpwi_1)
    F = model_cfg.mlp_hidden if gated else model_cfg.mlp_ratio * D
    width = {"query_proj": D, "key_proj": kv, "value_proj": kv, "context": D,
             "mlpwi": 0 if gated else F, "mlpwi_0": F if gated else 0,
             "mlpwi_1": F if gated else 0}
    per_token = sum(width.get(n, 0) for n in names) / tensor
    if "out_proj" in names:  # whole on every tensor device, a sequence shard under SP
        per_token += D / tensor if sequence_parallel else D
    return rows * model_cfg.seq_len // context * per_token * itemsize


def stacked_bytes_per_device(state, specs, sizes: dict[str, int]) -> dict[str, int]:
    """Per state part, one device's bytes of the stacked block leaves ([S, V, K, ...]
    parameters and their optimizer state and master copies), padded slots included."""
    out = {}
    for part in state:
        leaves = jax.tree_util.tree_flatten_with_path(state[part])[0]
        part_specs = jax.tree.leaves(specs[part], is_leaf=lambda x: isinstance(x, P))
        out[part] = sum(metrics.shard_bytes(leaf, spec, sizes)
                        for (path, leaf), spec in zip(leaves, part_specs)
                        if is_stacked(path))
    return out


def model_params(state, counts) -> int:
    """The model's parameters: the stacked leaves' less their padded slots."""
    S, V = len(counts), len(counts[0])
    K = max(max(row) for row in counts)
    blocks = sum(sum(row) for row in counts)
    stacked = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]["stages"]))
    return metrics.param_count(state) - stacked + stacked // (S * V * K) * blocks


def stage_total(s: dict) -> int:
    """A stage's peak bytes per device: its state and gradient accumulator with, during the
    tick loop, its activations and a chunk's float32 gradient copy where chunks are reduced
    there, or after it (the stash is free then) the last chunks' copy."""
    held = (s["params"] + s["gradients"] + s["opt"] + s["master"] + s["padding_state"] +
            s["padding_gradients"] + s.get("fp8_weights", 0))
    loop = s["activation_stash"] + s["activation_working"] + s["gradient_cast_loop"]
    return int(held + max(loop, s["gradient_cast_tail"]))


@dataclasses.dataclass(frozen=True)
class StageMemory(Figures):
    """A pipelined job's memory per stage: the schedule's facts (its summary, blocks per
    chunk, batch and micro-batch rows), the exact state per device by part, and every
    stage's bytes per device by kind with their total (`stages`, one row per stage)."""
    layout: str
    mesh: dict[str, int]
    distributed_optimizer: bool
    model: dict[str, str | int]     # {name, params}
    pipeline: dict[str, object]     # Schedule.summary, blocks_per_chunk, batch, rows
    state_bytes_per_device: dict[str, int]
    stages: list[dict[str, int]]


def stage_memory(job) -> StageMemory:
    """The schedule's facts and every stage's bytes per device, of a pipelined `job`
    (jaxdist.job)."""
    model_cfg, shape = job.model, job.shape
    sizes = shape.axis_sizes
    S, M = shape.stage, job.train.microbatches
    schedule = job.train.pp_schedule
    V = job.train.pp_virtual if schedule == "interleaved" else 1
    stage_blocks = parse_stage_blocks(job.train.pp_stage_blocks)
    combined = job.train.pp_combined_1f1b
    check_pipeline(model_cfg, S, schedule, M, V, stage_blocks=stage_blocks,
                   combined=combined)
    counts = chunk_blocks(model_cfg, S, V, stage_blocks)
    tx = make_optimizer(job.train.optimizer, job.train.lr)
    layout = job.rules
    state = pipeline_planning_state(model_cfg, job.dtype, tx, S, V,
                                    layout.master_weights(job.dtype), stage_blocks)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Auto,) * len(sizes))
    specs = layout(state, mesh)
    per_device = metrics.planned_bytes_per_device(state, specs, sizes)
    stacked = stacked_bytes_per_device(state, specs, sizes)
    sched = build_schedule(schedule, S, M, V, counts, combined)
    batch_shards = math.prod(sizes[a] for a in batch_axes(sizes))
    rows = job.train.batch_size // (M * batch_shards)
    itemsize = np.dtype(DTYPES[job.dtype]).itemsize
    cp = sizes.get("context", 1)  # each device holds L / cp of every sequence
    act = rows * model_cfg.seq_len // cp * model_cfg.width * itemsize
    # a received activation or gradient: the stage message, a sequence shard over tensor
    # under sequence parallelism too (jaxdist/pipeline/program.py)
    message = rows * model_cfg.seq_len // message_sequence_shards(model_cfg, sizes) * \
        model_cfg.width * itemsize
    K = max(max(row) for row in counts)  # the program's slots per chunk
    tensor = sizes.get("tensor", 1)  # 1 but under tp_pp (the layouts' mesh axes)
    flash = (getattr(model_cfg, "attention", "default") == "cudnn" and
             job.dtype in ("bfloat16", "float8"))
    block = block_activation_bytes(model_cfg, rows, tensor, itemsize, flash,
                                   getattr(model_cfg, "sequence_parallel", False), cp,
                                   job.dtype == "float8")
    remat = getattr(model_cfg, "remat", "none")
    dots = rows * model_cfg.seq_len // cp * (10 * model_cfg.width / tensor + (
        0 if flash else model_cfg.heads * model_cfg.seq_len / tensor)) * itemsize
    # selective_op: every other matmul's output and the attention's
    selective = rows * model_cfg.seq_len // cp * 6 * model_cfg.width / tensor * itemsize
    sequence_parallel = getattr(model_cfg, "sequence_parallel", False)
    # a block's input as the chunk's forward stashes it: a sequence shard on each tensor
    # device under sequence parallelism (the program's stash output), else whole
    block_input = act / tensor if sequence_parallel else act
    if remat in REMAT_NAMES:
        stashed = K * (block_input + named_saved_bytes(model_cfg, REMAT_NAMES[remat][0], rows,
                                                       tensor, itemsize, sequence_parallel,
                                                       cp))
    else:
        stashed = K * {"none": block, "full": block_input, "dots": block_input + dots,
                       "selective_op": block_input + selective}[remat]
    working = block
    # Under master weights with float32 reductions each chunk's gradients are cast up as
    # it is reduced: chunks v > 0 of an interleaved schedule inside the tick loop, beside
    # the stash (where the data axes split: jaxdist/pipeline/step.py), chunk 0 after it
    reduce = layout.reduce_dtype(job.dtype)
    up = np.dtype(reduce).itemsize / itemsize if reduce == "float32" else 0
    early = V > 1 and math.prod(sizes.get(a, 1) for a in ("data", "context")) > 1
    fp8 = job.dtype == "float8"
    param_itemsize = np.dtype(jax.tree.leaves(state["params"]["stages"])[0].dtype).itemsize
    stages = []
    for s in range(S):
        stash = ((sched.act_slots_by_stage[s] + sched.grad_slots) * message +
                 sched.res_slots_by_stage[s] * stashed)
        own, pad = sum(counts[s]), V * K - sum(counts[s])  # slots: own blocks, padding
        mine = {part: per_device.get(part, 0) - stacked.get(part, 0) +
                stacked.get(part, 0) * own // (V * K) for part in ("params", "opt", "master")}
        padding = {part: stacked.get(part, 0) * pad // (V * K)
                   for part in ("params", "opt", "master")}
        master = mine["master"]  # float32 master shards (distributed optimizer)
        # the tick loop accumulates the stage's gradients over its micro-batches in the
        # parameters' dtype (its carry): one more copy of its parameters, as they are
        # sharded; cast up to float32 for the reduction one chunk at a time (`cast`)
        grads, pad_grads = mine["params"], padding["params"]
        cast = (grads + pad_grads) / V * up
        stage = {"stage": s, "blocks": own, "params": mine["params"], "opt": mine["opt"],
                 "master": master, "gradients": grads, "padded_slots": pad,
                 "padding_state": sum(padding.values()), "padding_gradients": pad_grads,
                 "activation_stash": stash, "activation_working": int(working),
                 # the FP8 copies of its blocks' weights, quantized once a step (one byte
                 # per parameter, as the weights are split: models/fp8.py)
                 "fp8_weights": int(stacked.get("params", 0) / param_itemsize) if fp8 else 0,
                 "gradient_cast_loop": int(cast) if early else 0,
                 "gradient_cast_tail": int(cast)}
        stages.append({**stage, "total": stage_total(stage)})
    return StageMemory(
        layout=job.layout.name, mesh=dict(sizes),
        distributed_optimizer=layout.distributed_optimizer,
        model={"name": job.model_name, "params": model_params(state, counts)},
        pipeline={**sched.summary(), "blocks_per_chunk": K, "batch_size":
                  job.train.batch_size, "microbatch_rows_per_device": rows},
        state_bytes_per_device=per_device, stages=stages)
