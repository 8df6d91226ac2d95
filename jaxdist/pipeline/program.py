"""Build the pipelined Program: the same interface as jaxdist.train_step.Program (init, step,
shardings), so the loop, metrics and writers treat it like any other layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.errors import UsageError
from jaxdist.pipeline.checks import check_moe_data
from jaxdist.pipeline.parts import split_pipeline_model
from jaxdist.pipeline.schedule import Schedule, build_schedule
from jaxdist.pipeline.step import pipeline_gradients
from jaxdist.train_step import DTYPES, MeshJit, Program, jax_matmul_precision
from jaxdist.update import apply_gradients, scatter_partial_sums, train_state
from models import context
from sharding import batch_spec, padding
from sharding.padding import fit


@dataclass
class PipelineProgram(Program):
    schedule: Schedule | None = None
    parts: object = None
    extra: dict = field(default_factory=dict)


def pipeline_state(model_cfg, dtype_name: str, tx, seed: int, stages: int, virtual: int,
                   master: bool = False, stage_blocks: tuple[int, ...] = ()):
    """(init_fn, abstract state, parts) of the pipeline train state; `master`: bfloat16
    working weights beside the float32 master (jaxdist/update.py); `stage_blocks`:
    --pp-stage-blocks (jaxdist/pipeline/parts.py)."""
    holder = {}

    def init_fn():
        parts, params = split_pipeline_model(model_cfg, dtype_name, seed, stages, virtual,
                                             stage_blocks)
        holder["parts"] = parts
        return train_state(params, {}, tx, DTYPES[dtype_name] if master else None)

    abstract = jax.eval_shape(init_fn)
    return init_fn, abstract, holder["parts"]


def stage_axes(mesh_shape) -> tuple[str, ...]:
    """The axes the stage shard_map makes manual: `stage`, `data` and, where it splits the
    sequence, `context` (each stage body then holds its own sequence shard:
    models/context.py). With `tensor` and `context` both left to the partitioner, XLA 0.10.2
    aborts on a check in spmd_partitioner_util.cc (partition_group_list) inside the stage
    switch."""
    return ("stage", "data", *((context.AXIS,) if mesh_shape.get(context.AXIS, 1) > 1 else ()))


def mean_axes(mesh_shape) -> tuple[str, ...]:
    """The manual axes a stage's loss and weight gradients are averaged over: `data`, and
    `context` where it splits the sequence (each shard's mean over its own tokens)."""
    return tuple(a for a in stage_axes(mesh_shape) if a != "stage")


def data_reduction(param_specs, update_specs, param_shapes, update_shapes, mesh: Mesh,
                   distributed: bool):
    """Under the distributed optimizer: (out_specs of the stage and shared gradients, what
    each data shard returns from the shard_map over stage and data, and the reduction after
    it). Each data shard's partial sums leave stacked on a dimension over `data` (float32),
    stored as `param_shapes` (padded, sharding/padding.py), and one fully manual shard_map
    reduce-scatters them to the optimizer's shards, stored as `update_shapes`
    (jaxdist/update.py; a psum_scatter inside this map would gather over tensor first).
    Under context parallelism they are stacked and reduced over data x context
    (`mean_axes`), which the optimizer's shards span (sharding/optimizer.py). Else (None,
    None, None): pmean inside, as before."""
    if not distributed:
        return None, None, None
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    axes = mean_axes(dict(mesh.shape))
    out = (jax.tree.map(lambda _: P("stage", axes), param_specs["stages"], is_leaf=is_p),
           jax.tree.map(lambda _: P(axes), param_specs["shared"], is_leaf=is_p))

    def stack(g_local, g_shared):  # [V, K, ...] -> [1 (data), V, K, ...]; stage added after
        return jax.tree.map(lambda g: g.astype(jnp.float32)[None], (g_local, g_shared))

    def stored(stacked, shapes, data_dim):
        return jax.tree.map(
            lambda g, s: fit(g, (*s.shape[:data_dim], g.shape[data_dim], *s.shape[data_dim:])),
            stacked, shapes)

    def reduce(g_stages, g_shared):
        stages = scatter_partial_sums(stored(g_stages, param_shapes["stages"], 1), mesh,
                                      axes, param_specs["stages"],
                                      update_specs["stages"], update_shapes["stages"], 1)
        shared = scatter_partial_sums(stored(g_shared, param_shapes["shared"], 0), mesh,
                                      axes, param_specs["shared"],
                                      update_specs["shared"], update_shapes["shared"], 0)
        return stages, shared
    return out, stack, reduce


def build_pipeline_program(model_cfg, dtype_name: str, tx, layout, mesh: Mesh, seed: int,
                           microbatches: int, schedule: str, virtual: int = 1,
                           matmul_precision: str = "default",
                           stage_blocks: tuple[int, ...] = ()) -> PipelineProgram:
    S = mesh.shape.get("stage", 1)
    if S < 2:
        raise UsageError("pipeline layouts need a mesh with a stage axis, e.g. "
                         "--mesh data:2,stage:4")
    check_moe_data(model_cfg, mesh.shape.get("data", 1), mesh.shape.get(context.AXIS, 1))
    V = virtual if schedule == "interleaved" else 1
    precision = jax_matmul_precision(dtype_name, matmul_precision)
    logical_init, logical, parts = pipeline_state(model_cfg, dtype_name, tx, seed, S, V,
                                                  layout.master_weights(dtype_name),
                                                  stage_blocks)
    sched = build_schedule(schedule, S, microbatches, V, parts.counts)
    specs = layout(logical, mesh)
    # The state as stored: padded where a split dimension is not divisible (sharding/padding.py)
    abstract = padding.storage(logical, specs, dict(mesh.shape))

    def init_fn():
        return padding.fit_tree(logical_init(), abstract)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    update_specs = layout.update_specs(logical["params"], specs["params"], mesh)
    update_shapes = padding.storage(logical["params"], update_specs, dict(mesh.shape))
    update_shardings = jax.tree.map(  # the data-sharded shards under the distributed optimizer
        lambda s: NamedSharding(mesh, s), update_specs, is_leaf=lambda x: isinstance(x, P))
    grad_out, grad_stack, grad_reduce = data_reduction(
        specs["params"], update_specs, abstract["params"], update_shapes, mesh,
        layout.distributed_optimizer)
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    replicated = NamedSharding(mesh, P())
    M = microbatches
    dtype = DTYPES[dtype_name]

    def step_fn(state, batch):
        tokens = batch["tokens"]
        B, L1 = tokens.shape
        # Micro-batch m takes rows m, m+M, ...: every device keeps its own rows.
        tokens_M = tokens.reshape(B // M, M, L1).swapaxes(0, 1)
        # `data` is manual too: each data shard accumulates its own gradients over the
        # micro-batches and they are averaged once at the end (one all-reduce per step,
        # not one per backward tick), and XLA's SPMD partitioner is left with at most one
        # axis (tensor or fsdp) inside the branches of the per-stage switch (with two it
        # fails a check in spmd_partitioner_util.cc on XLA:CPU, jax 0.10).
        data = mesh.shape["data"]
        # `context` is manual too (`stage_axes`): each stage body holds its own part of
        # the sequence, attention gathers keys and values over it, and the loss and weight
        # gradients are averaged over it with `data`.
        cp = mesh.shape.get(context.AXIS, 1)
        act_shape = (B // M // data, (L1 - 1) // cp, model_cfg.width)
        run = pipeline_gradients(parts, sched, act_shape, dtype,
                                 data_axis=mean_axes(dict(mesh.shape)), grad_reduce=grad_stack)
        params = padding.fit_tree(state["params"], logical["params"])  # the logical view
        stage_specs = jax.tree.map(lambda _: P("stage"), params["stages"])
        shared_specs = jax.tree.map(lambda _: P(), params["shared"])
        loss, g_stages, g_shared = jax.shard_map(
            run, mesh=mesh, in_specs=(stage_specs, shared_specs, P(None, "data")),
            out_specs=(P(), *(grad_out or (stage_specs, shared_specs))),
            axis_names=set(stage_axes(dict(mesh.shape))),
            check_vma=False)(params["stages"], params["shared"], tokens_M)
        if grad_reduce is not None:
            g_stages, g_shared = grad_reduce(g_stages, g_shared)
        grads = {"stages": g_stages, "shared": g_shared}
        return apply_gradients(tx, state, grads, update_shardings, update_shapes,
                               abstract["params"]), loss

    def correct_fn(state, batch):
        raise UsageError("--eval-every measures accuracy on an image dataset, which the "
                         "pipeline layouts' decoders cannot read")

    step = MeshJit(jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                           out_shardings=(shardings, replicated), donate_argnums=0), mesh,
                   precision)
    init = jax.jit(init_fn, out_shardings=shardings)
    extra = {"act_row_shape": (model_cfg.seq_len, model_cfg.width),
             "act_itemsize": jnp.dtype(dtype).itemsize}
    return PipelineProgram(None, abstract, specs, shardings, batch_sharding, init, step,
                           correct_fn, microbatches, None, logical, schedule=sched,
                           parts=parts, extra=extra)

