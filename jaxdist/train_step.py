"""The train state, created directly sharded, and the one jitted step every layout uses.

Functional NNX: the model is split into (graphdef, params, model_state) once; the step
merges it back inside the trace. The layout only decides shardings, so the step is the same
code for ddp, zero1, fsdp and hsdp, and XLA inserts the collectives each layout implies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist import metrics
from jaxdist.program import hlo, program_reading
from jaxdist.program.xla_compile import compile_timed
from jaxdist.errors import UsageError
from models import fp8
from jaxdist.update import (apply_gradients, mean_to_shard, overlap_options,
                            reduction_bytes, scattered_gradients, train_state)
from sharding import batch_spec, padding
from sharding.axes import batch_axes
from sharding.optimizer import axes_of

# float8: bfloat16 but for the decoders' block matmuls (models/fp8.py)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float8": jnp.bfloat16}


def jax_matmul_precision(dtype_name: str, name: str) -> str | None:
    """`--matmul-precision` as a `jax_default_matmul_precision` value (None: XLA's default).
    Only float32 compute takes it: on bfloat16 operands a non-default precision makes XLA:GPU
    upcast the dot to float32 (DotPrecisionEliminator), whereas PyTorch's setting governs
    float32 matmuls only."""
    if name not in ("default", "high", "highest"):
        raise UsageError(f"unknown --matmul-precision {name!r}; choose from default, high, "
                         f"highest")
    return None if name == "default" or dtype_name != "float32" else name


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if lr <= 0:
        raise UsageError(f"--lr must be positive, got {lr}")
    if name == "adamw":
        return optax.adamw(lr)
    if name == "sgd":
        return optax.sgd(lr, momentum=0.9)
    raise UsageError(f"unknown optimizer {name!r}; choose from adamw, sgd")


@dataclass
class Program:
    """Everything compiled for one (model, optimizer, layout, mesh)."""
    graphdef: Any
    abstract_state: Any       # ShapeDtypeStruct tree of the train state as stored (padded)
    state_specs: Any          # PartitionSpec tree, the layout's output
    state_shardings: Any      # NamedSharding tree
    batch_sharding: NamedSharding
    init: Callable[[], Any]   # -> sharded train state
    step: Callable            # jitted (state, batch) -> (state, loss)
    correct: Callable         # jitted (state, batch with mask) -> number of correct rows
    microbatches: int = 1
    # (global batch shapes) -> per-device FLOPs of one micro-batch iteration as compiled
    # alone; None without micro-batches. See compiled_step_flops.
    loop_body_flops: Callable | None = None
    # The state's logical shapes (what the model computes with); abstract_state is this
    # tree padded where a layout splits a dimension its shards do not divide.
    logical_state: Any = None


def split_model(model_cfg, dtype, seed):
    model = model_cfg.build(nnx.Rngs(seed), dtype)
    model.train()  # BatchNorm uses batch statistics; the mode is static, kept in graphdef
    return nnx.split(model, nnx.Param, ...)


def _init_fn(model_cfg, dtype, tx, seed, master: bool = False):
    """The train state's init; `master`: bfloat16 working weights beside the float32
    master (the distributed optimizer with --dtype bfloat16, jaxdist/update.py)."""
    def init_fn():
        _, params, model_state = split_model(model_cfg, dtype, seed)
        return train_state(params, model_state, tx, dtype if master else None)
    return init_fn


def abstract_train_state(model_cfg, dtype_name: str, tx, seed: int = 0, master: bool = False):
    """Shapes and dtypes of the whole train state, without allocating it (any model size)."""
    return jax.eval_shape(_init_fn(model_cfg, DTYPES[dtype_name], tx, seed, master))


def loss_and_grad(model_cfg, graphdef, logical=None, stored_model_state=None):
    """The one gradient of the training loss, every step's (the mesh layouts' step, the
    parameter-server worker's): `(params, model_state, batch) -> ((loss, model_state),
    grads)`, jax.value_and_grad with FP8 gradient amaxes (models.fp8). With `logical` (the
    state as the model sees it) the padded storage is cut to it first, so padding never
    enters the math and its gradient is zero, and the model state goes back padded as
    `stored_model_state`."""
    def loss_fn(params, model_state, batch):
        if logical is not None:
            params = padding.fit_tree(params, logical["params"])
            model_state = padding.fit_tree(model_state, logical["model_state"])
        model = nnx.merge(graphdef, params, model_state, copy=True)
        loss = model_cfg.loss(model, batch)
        new_state = nnx.split(model, nnx.Param, ...)[2]
        if stored_model_state is not None:
            new_state = padding.fit_tree(new_state, stored_model_state)
        return loss, new_state

    return fp8.value_and_grad(loss_fn)


def build_program(model_cfg, dtype_name: str, tx, layout, mesh: Mesh, seed: int,
                  microbatches: int = 1, matmul_precision: str = "default") -> Program:
    dtype = DTYPES[dtype_name]
    precision = jax_matmul_precision(dtype_name, matmul_precision)
    logical_init = _init_fn(model_cfg, dtype, tx, seed, layout.master_weights(dtype_name))
    graphdef = nnx.eval_shape(lambda: split_model(model_cfg, dtype, seed))[0]
    logical = jax.eval_shape(logical_init)
    specs = layout(logical, mesh)
    # The state as stored: padded where a split dimension is not divisible (sharding/padding.py)
    abstract_state = padding.storage(logical, specs, dict(mesh.shape))

    def init_fn():
        return padding.fit_tree(logical_init(), abstract_state)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    # Where gradients are reduced to and the optimizer runs: the parameters' placement, or
    # under the distributed optimizer their shards over the data axes (sharding/optimizer.py)
    update_specs = layout.update_specs(logical["params"], specs["params"], mesh)
    update_shapes = padding.storage(logical["params"], update_specs, dict(mesh.shape))
    update_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), update_specs,
                                    is_leaf=lambda x: isinstance(x, P))
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    replicated = NamedSharding(mesh, P())

    grad_fn = loss_and_grad(model_cfg, graphdef, logical, abstract_state["model_state"])

    def micro_step(params, carry, mb):
        """One iteration of the micro-batch loop: add one slice's loss and gradients."""
        loss_sum, grad_sum, ms = carry
        (loss, ms), grads = grad_fn(params, ms, mb)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), ms)

    def accumulate(params, model_state, batch):
        """Mean loss and gradients over `microbatches` slices of the batch, one at a time
        (scan), so activations of only one slice are live."""
        def split(x):
            # Micro-batch m takes rows m, m+M, ...: every device keeps feeding only its own
            # rows, so no data moves between devices.
            return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads, model_state), _ = jax.lax.scan(
            lambda carry, mb: (micro_step(params, carry, mb), None),
            (jnp.zeros((), jnp.float32), zeros, model_state), jax.tree.map(split, batch))
        return (loss / microbatches, model_state), jax.tree.map(lambda g: g / microbatches, grads)

    gradients = accumulate if microbatches > 1 else grad_fn
    # bfloat16 working weights' gradients cast up before their reduction (Layout.reduce_dtype)
    reduce_float32 = layout.reduce_dtype(dtype_name) == "float32"
    stateless = not jax.tree.leaves(abstract_state["model_state"])
    explicit = _replicated_params(specs) and stateless
    # Under the distributed optimizer with parameters on no batch axis (ddp, tp): the data
    # axes manual, so each leaf is reduce-scattered in float32 where the step says, not where
    # the partitioner meets the weight gradient's bf16 dot (XLA:GPU would reduce bf16 there).
    if explicit:
        gradients = _explicit_reduce(gradients, mesh, update_specs, update_shapes,
                                     reduce_float32)
    elif (stateless and layout.distributed_optimizer
          and not _params_on(specs, batch_axes(mesh.axis_names))):
        gradients = scattered_gradients(gradients, mesh, batch_axes(mesh.axis_names), specs["params"],
                                        update_specs, update_shapes, reduce_float32)

    def step_fn(state, batch):
        (loss, model_state), grads = gradients(state["params"], state["model_state"], batch)
        # Gradients take the update's placement: reduce-scattered under fsdp and under the
        # distributed optimizer (zero1), all-reduced under ddp and tp.
        new = apply_gradients(tx, state, grads, update_shardings, update_shapes,
                              abstract_state["params"], reduce_float32)
        return {**new, "model_state": model_state}, loss

    def correct_fn(state, batch):
        model = nnx.merge(graphdef, padding.fit_tree(state["params"], logical["params"]),
                          padding.fit_tree(state["model_state"], logical["model_state"]),
                          copy=True)
        model.eval()  # BatchNorm: running statistics, not the test batch's
        hit_B = jnp.argmax(model(batch["x"]), axis=-1) == batch["y"]
        return jnp.sum(hit_B * batch["mask"])

    # Under the distributed optimizer the gradient reduce-scatter overlaps the backward
    # (jaxdist/update.py overlap_options), in what runs and in what is predicted alike.
    options = (overlap_options(math.prod(mesh.shape[a] for a in batch_axes(mesh.axis_names)),
                               *reduction_bytes(layout, dtype_name, dtype))
               if layout.distributed_optimizer else None)
    step = MeshJit(jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                           out_shardings=(shardings, replicated), donate_argnums=0,
                           compiler_options=options), mesh, precision)
    init = jax.jit(init_fn, out_shardings=shardings)
    correct = MeshJit(jax.jit(correct_fn, in_shardings=(shardings, batch_sharding),
                              out_shardings=replicated), mesh, precision)
    loop_body_flops = (_loop_body_counter(micro_step, abstract_state, shardings, batch_sharding,
                                          mesh, microbatches, explicit, precision)
                       if microbatches > 1 else None)
    return Program(graphdef, abstract_state, specs, shardings, batch_sharding, init, step,
                   correct, microbatches, loop_body_flops, logical)


def _loop_body_counter(micro_step, abstract_state, shardings, batch_sharding, mesh: Mesh,
                       microbatches: int, explicit: bool, precision: str | None):
    """A function compiling one micro-batch iteration on its own, placed as in the step
    (inside the same shard_map for replicated parameters, else with the state's shardings),
    and returning its per-device FLOPs."""
    replicated = NamedSharding(mesh, P())
    if explicit:
        spec = batch_spec(mesh)
        body = jax.shard_map(micro_step, mesh=mesh, in_specs=(P(), (P(), P(), P()), spec),
                             out_specs=(P(), P(), P()), check_vma=False)
        in_shardings = (replicated, (replicated, replicated, replicated), batch_sharding)
    else:
        body = micro_step
        in_shardings = (shardings["params"],
                        (replicated, shardings["params"], shardings["model_state"]),
                        batch_sharding)
    body = MeshJit(jax.jit(body, in_shardings=in_shardings), mesh, precision)

    def flops(batch_shapes) -> float | None:
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] // microbatches, *x.shape[1:]), x.dtype), batch_shapes)
        carry = (jax.ShapeDtypeStruct((), jnp.float32), abstract_state["params"],
                 abstract_state["model_state"])
        compiled, _ = compile_timed(body, abstract_state["params"], carry, mb)
        return metrics.compiled_flops(compiled)
    return flops


def compiled_step_flops(program: Program, compiled) -> float | None:
    """Per-device FLOPs of one step as compiled, every micro-batch counted.

    XLA's cost analysis counts a while loop's body once, whatever its trip count, so with
    M micro-batches it sees 1/M of the gradient work (M/T bodies if XLA unrolled the loop to
    T iterations; all M if it unrolled it fully). The missing iterations are added at the
    FLOPs of one iteration compiled on its own with the same placement. (Loops nested inside
    the model, e.g. the ones XLA:CPU emits for some gathers, are counted once at any M, so
    they cancel out of a comparison across M.)"""
    flops = metrics.compiled_flops(compiled)
    M = program.microbatches
    if flops is None or M == 1 or program.loop_body_flops is None:
        return flops  # no micro-batch loop (a pipeline's tick loop is unrolled: all counted)
    counted = _bodies_counted(hlo.while_trip_counts(program_reading.text(compiled)), M)
    if counted == M:
        return flops
    batch_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                compiled.args_info[0][1])
    body = program.loop_body_flops(batch_shapes)
    return None if body is None else flops + (M - counted) * body


def _replicated_params(specs) -> bool:
    return all(spec == P() for spec in
               jax.tree.leaves(specs["params"], is_leaf=lambda x: isinstance(x, P)))


def _params_on(specs, axes) -> bool:
    """Whether any parameter is split over one of `axes`."""
    return any(set(axes_of(e)) & set(axes) for spec in jax.tree.leaves(
        specs["params"], is_leaf=lambda x: isinstance(x, P)) for e in spec)


def _explicit_reduce(gradients, mesh: Mesh, grad_specs, grad_shapes, float32: bool = False):
    """Replicated parameters (ddp, zero1): each device computes its local gradients and one
    explicit all-reduce (pmean) averages them, in a shard_map; under the distributed
    optimizer (zero1) a reduce-scatter (psum_scatter) to the optimizer's shard of each leaf
    instead, each gradient first padded to `grad_shapes` (the shard's stored shape).
    `float32`: bfloat16 gradients are cast up first (reduced in float32).

    Left to the SPMD partitioner, XLA:CPU puts the gradient all-reduce between each weight
    gradient's matmul and its transpose, so the transpose cannot be folded and every device
    runs it inside the update (mlp-10m: 8 transposes of up to 2048x2048; 281-295 ms -> 165-181
    ms per step with this, losses equal to 2e-7). Models with batch statistics keep the
    partitioner's global-batch semantics, so they do not come here. A `context` axis stays
    with the partitioner (each device's sequence shard: models/context.py), which sums the
    gradients over it."""
    axes = tuple(a for a in mesh.axis_names if a != "context")
    n = math.prod(mesh.shape[a] for a in axes)

    def local(params, model_state, batch):
        (loss, ms), grads = gradients(params, model_state, batch)
        grads = jax.tree.map(
            lambda spec, g, shape: mean_to_shard(
                padding.fit(g.astype(jnp.float32) if float32 else g, shape.shape), spec,
                axes, n), grad_specs, grads, grad_shapes, is_leaf=lambda x: isinstance(x, P))
        return (jax.lax.pmean(loss, axes), ms), grads

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), batch_spec(mesh)),
                         out_specs=((P(), P()), grad_specs), axis_names=set(axes),
                         check_vma=False)


class MeshJit:
    """A jitted function traced with `mesh` as the ambient mesh, so model code can pin
    intermediate shardings by axis name (the MoE dispatch does), and under the run's default
    matmul precision (None: XLA's), which jit reads when it traces, so it must hold at every
    call and lowering."""

    def __init__(self, fn, mesh: Mesh, matmul_precision: str | None = None):
        self.fn, self.mesh, self.matmul_precision = fn, mesh, matmul_precision

    def __call__(self, *args):
        with jax.set_mesh(self.mesh), jax.default_matmul_precision(self.matmul_precision):
            return self.fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self.mesh), jax.default_matmul_precision(self.matmul_precision):
            return self.fn.lower(*args)


def _bodies_counted(trips: dict[str, list[int]], microbatches: int) -> int:
    """How many micro-batch iterations the cost analysis saw: M / (the micro-batch loop's
    trip count). That loop is the step's top-level while loop whose trip count divides M
    (M itself unless XLA partly unrolled it); none there means fully unrolled, all counted."""
    for loops in (trips["entry"], [t for t in trips["nested"] if t == microbatches]):
        dividing = [t for t in loops if t > 1 and microbatches % t == 0]
        if dividing:
            return microbatches // max(dividing)
    return microbatches


def put_batch(batch_np: dict, sharding: NamedSharding) -> dict:
    """Global numpy batch -> sharded arrays; each process contributes only its rows."""
    out = {}
    for key, value in batch_np.items():
        rows = sharding.addressable_devices_indices_map(value.shape)
        local = _process_rows(value, rows)
        out[key] = jax.make_array_from_process_local_data(sharding, local, value.shape)
    return out


def _process_rows(value, index_map):
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else value.shape[0]
                    for idx in index_map.values()})
    return value[starts[0]:stops[-1]]
