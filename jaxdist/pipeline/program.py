"""Build the pipelined Program: the same interface as jaxdist.train_step.Program (init, step,
shardings), so the loop, metrics and writers treat it like any other layout."""

from __future__ import annotations

import math
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
from jaxdist.update import (apply_gradients, mean_to_shard, overlap_options,
                            reduction_bytes, scatter_partial_sums, train_state)
from models import context
from sharding import batch_spec, padding
from sharding.optimizer import axes_of
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


def message_sequence_shards(model_cfg, mesh_shape) -> int:
    """The shards a stage message's sequence is split into on each device group: `context`
    (the stage body holds its own part), times `tensor` under sequence parallelism (the
    blocks' sequence shards, sent as they are: models/sequence_parallel.py)."""
    sp = getattr(model_cfg, "sequence_parallel", False)
    return mesh_shape.get(context.AXIS, 1) * (mesh_shape.get("tensor", 1) if sp else 1)


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


class ScatterOverData:
    """The distributed optimizer's gradient reduction inside the tick loop's map (manual
    over `stage` and `data`; `pipeline_gradients`' `grad_reduce`): each virtual chunk's
    gradients, as soon as the loop has finished them, are reduce-scattered over `data` to
    the optimizer's shards in a map manual over the remaining axes too (a psum_scatter
    with `tensor` left to the partitioner would gather over tensor first), in
    `reduce_dtype` (Layout.reduce_dtype), padded to the stored shapes (sharding/padding.py). The map returns each device's
    shard stacked over stage and data; `relabel` (after it, no communication) places them
    as the optimizer's shards. Under context parallelism `data` stands for data x context
    (`mean_axes`), which the stage body is manual over and the optimizer's shards span. A leaf whose optimizer shard splits its stage or chunk
    dimension is reduced whole after the loop. The shared gradients leave as partial sums
    stacked over data and are reduce-scattered after the map (`shared_after`)."""

    def __init__(self, param_specs, update_specs, param_shapes, update_shapes, mesh: Mesh,
                 reduce_dtype=jnp.float32):
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        self.mesh, self.param_specs, self.update_specs = mesh, param_specs, update_specs
        self.reduce_dtype = reduce_dtype
        self.param_shapes, self.update_shapes = param_shapes, update_shapes
        self.axes = mean_axes(dict(mesh.shape))  # data, and context where it splits
        self.n = math.prod(mesh.shape[a] for a in self.axes)
        self.inner = tuple(a for a in mesh.axis_names if a not in ("stage", *self.axes))
        self.tree = jax.tree.structure(param_specs["stages"], is_leaf=is_p)
        flat = lambda t: jax.tree.leaves(t, is_leaf=is_p)  # noqa: E731
        self.leaves = list(zip(flat(param_specs["stages"]), flat(update_specs["stages"]),
                               flat(param_shapes["stages"]), flat(update_shapes["stages"])))
        # per chunk where the optimizer's data split is below the chunk dimension
        self.early = [next((i for i, e in enumerate(_entries(u, len(ps.shape)))
                            if set(self.axes) & set(axes_of(e))), len(ps.shape)) >= 2
                      for _, u, ps, _ in self.leaves]
        self.out_specs = (
            jax.tree.map(lambda _: P("stage", self.axes), param_specs["stages"], is_leaf=is_p),
            jax.tree.map(lambda _: P(self.axes), param_specs["shared"], is_leaf=is_p))

    def _reduce(self, g, leaf: int, first: int):
        """Leaf `leaf`'s gradient `g` (dimensions `first`.. of the stored leaf; the map's
        view) -> this device's optimizer shard of it (tensor-split dimensions whole)."""
        pspec, uspec, pshape, ushape = self.leaves[leaf]
        nd = len(pshape.shape)
        pe, ue = _entries(pspec, nd)[first:], _entries(uspec, nd)[first:]
        g = fit(g.astype(self.reduce_dtype), pshape.shape[first:])
        outer = ("stage", *self.axes)

        def local(x):  # fully manual: this device's part, reduce-scattered over data
            target = tuple(full if e is None else size for size, full, e in
                           zip(x.shape, ushape.shape[first:], pe))
            return mean_to_shard(fit(x, target), P(*ue), self.axes, self.n)
        if not self.inner:
            return local(g)
        keep = lambda e: _only(e, lambda a: a not in outer)  # noqa: E731
        return jax.shard_map(local, in_specs=P(*map(keep, pe)), out_specs=P(*map(keep, ue)),
                             axis_names=set(self.inner), check_vma=False)(g)

    def chunk(self, v: int, g):
        leaves = jax.tree.leaves(g)
        return [self._reduce(x, i, 2) if self.early[i] else None
                for i, x in enumerate(leaves)]

    def stages(self, reduced: list, g_local):
        whole = jax.tree.leaves(g_local)
        out = [jnp.stack([r[i] for r in reduced]) if self.early[i] else
               self._reduce(whole[i], i, 1) for i in range(len(whole))]
        return jax.tree.unflatten(self.tree, [g[None] for g in out])  # [1 (data), V, ...]

    def shared(self, g):
        return jax.tree.map(lambda x: x.astype(self.reduce_dtype)[None], g)

    def relabel(self, g_stages):
        """[S, data, V, ...] of shards, as the map returned them -> the optimizer's
        shards (`update_specs`): each device's own block, no communication."""
        leaves = jax.tree.leaves(g_stages)

        def spec_in(i):
            _, uspec, pshape, _ = self.leaves[i]
            ue = _entries(uspec, len(pshape.shape))
            return P("stage", self.axes,
                     *(_only(e, lambda a: a not in self.axes) for e in ue[1:]))
        specs_in = [spec_in(i) for i in range(len(leaves))]
        specs_out = [u for _, u, _, _ in self.leaves]
        out = jax.shard_map(lambda gs: [g.squeeze(1) for g in gs], mesh=self.mesh,
                            in_specs=(specs_in,), out_specs=specs_out,
                            check_vma=False)(leaves)
        return jax.tree.unflatten(self.tree, out)

    def shared_after(self, g_shared):
        stacked = jax.tree.map(lambda g, s: fit(g, (g.shape[0], *s.shape)), g_shared,
                               self.param_shapes["shared"])
        return scatter_partial_sums(stacked, self.mesh, self.axes, self.param_specs["shared"],
                                    self.update_specs["shared"], self.update_shapes["shared"],
                                    0)


def _entries(spec: P, ndim: int) -> list:
    return list(spec) + [None] * (ndim - len(spec))


def _only(entry, keep):
    """A spec entry with the axes `keep` rejects left out (None when none is left)."""
    axes = tuple(a for a in axes_of(entry) if keep(a))
    return None if not axes else axes[0] if len(axes) == 1 else axes


def data_reduction(param_specs, update_specs, param_shapes, update_shapes, mesh: Mesh,
                   distributed: bool, reduce_dtype=jnp.float32):
    """Under the distributed optimizer: (out_specs of the stage and shared gradients, the
    reduction inside the map (ScatterOverData, `pipeline_gradients`' grad_reduce) and the
    step after the map: (map's stage, shared gradients) -> the optimizer's shards). Else
    (None, None, None): the mean over data inside (`DataMean`)."""
    if not distributed:
        return None, None, None
    red = ScatterOverData(param_specs, update_specs, param_shapes, update_shapes, mesh,
                          reduce_dtype)

    def after(g_stages, g_shared):
        return red.relabel(g_stages), red.shared_after(g_shared)
    return red.out_specs, red, after


# Combined ticks (--pp-combined-1f1b): XLA's collective combiners off. They merge a tick's
# forward and backward collectives that happen to be independent into one, which then waits
# for both and runs beside neither's matmuls (read from XLA:GPU's schedule of a 70B TP8
# chunk: with them, F beside BACK exposed 1.33 of 2.70 ms of tensor-axis collectives at 3
# blocks; without, none).
COMBINED_TICK_OPTIONS = {"xla_gpu_experimental_enable_heuristic_collective_combining": False,
                         "xla_gpu_all_gather_combine_threshold_bytes": 0,
                         "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
                         "xla_gpu_all_reduce_combine_threshold_bytes": 0}


def build_pipeline_program(model_cfg, dtype_name: str, tx, layout, mesh: Mesh, seed: int,
                           microbatches: int, schedule: str, virtual: int = 1,
                           matmul_precision: str = "default",
                           stage_blocks: tuple[int, ...] = (),
                           combined: bool = False) -> PipelineProgram:
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
    sched = build_schedule(schedule, S, microbatches, V, parts.counts, combined)
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
    reduce_dtype = layout.reduce_dtype(dtype_name)  # None: float32 parameters
    grad_out, in_map, after_map = data_reduction(
        specs["params"], update_specs, abstract["params"], update_shapes, mesh,
        layout.distributed_optimizer, reduce_dtype or jnp.float32)
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
                                 data_axis=mean_axes(dict(mesh.shape)), grad_reduce=in_map,
                                 early=data * cp > 1)
        params = padding.fit_tree(state["params"], logical["params"])  # the logical view
        stage_specs = jax.tree.map(lambda _: P("stage"), params["stages"])
        shared_specs = jax.tree.map(lambda _: P(), params["shared"])
        loss, g_stages, g_shared = jax.shard_map(
            run, mesh=mesh, in_specs=(stage_specs, shared_specs, P(None, "data")),
            out_specs=(P(), *(grad_out or (stage_specs, shared_specs))),
            axis_names=set(stage_axes(dict(mesh.shape))),
            check_vma=False)(params["stages"], params["shared"], tokens_M)
        if after_map is not None:
            g_stages, g_shared = after_map(g_stages, g_shared)
        grads = {"stages": g_stages, "shared": g_shared}
        return apply_gradients(tx, state, grads, update_shardings, update_shapes,
                               abstract["params"], reduce_dtype in (None, "float32")), loss

    def correct_fn(state, batch):
        raise UsageError("--eval-every measures accuracy on an image dataset, which the "
                         "pipeline layouts' decoders cannot read")

    # Under the distributed optimizer the chunks' reduce-scatters run beside the ticks
    # still to run (jaxdist/update.py overlap_options: no combiner merging them after the
    # loop, room in the scheduler for them beside a tick's own collectives).
    options = (overlap_options(mesh.shape["data"], *reduction_bytes(layout, dtype_name, dtype))
               if layout.distributed_optimizer else None)
    if combined:
        options = {**(options or {}), **COMBINED_TICK_OPTIONS}
    step = MeshJit(jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                           out_shardings=(shardings, replicated), donate_argnums=0,
                           compiler_options=options), mesh, precision)
    init = jax.jit(init_fn, out_shardings=shardings)
    extra = {"act_row_shape": (model_cfg.seq_len, model_cfg.width),
             "act_itemsize": jnp.dtype(dtype).itemsize,
             "act_sequence_shards": message_sequence_shards(model_cfg, dict(mesh.shape))}
    return PipelineProgram(None, abstract, specs, shardings, batch_sharding, init, step,
                           correct_fn, microbatches, None, logical, schedule=sched,
                           parts=parts, extra=extra)

