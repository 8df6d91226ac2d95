"""Predicted peak memory per device, from the program rather than from XLA:CPU's buffer
assignment (whose temp bytes keep float32 copies around bf16 dots and every L x L attention
score: 6-7x the published peaks).

peak = train state (exact, from the layout) + gradients (the parameters' bytes per device:
the step constrains gradients to the parameters' layout) + the residuals the backward pass
saves (exact, from the jaxpr of jax.vjp of the real loss under the model's remat policy) +
a transient working set. Residuals are traced once at batch B and once at 2B: a residual
that doubles is an activation and is divided over the devices the batch is sharded on, one
that does not (e.g. a bf16 copy of a weight) is counted whole. The transient is the larger
of (a) the largest single residual's cotangent (the loss's float32 logits gradient, live at
the start of the backward beside every residual) and (b) one block's residuals without
remat (what the backward of a rematerialised block recomputes and holds), plus two blocks'
parameters gathered in float32 when the layout shards them (the block in use and the next
one, which XLA's scheduler prefetches). Counting the gradients in full beside every
residual over-counts by at most the gradients: they fill as the residuals are freed.
Activations are split over the batch's devices and the context axis (every mesh axis but
tensor and stage): under tensor parallelism the parts a tensor group shards are counted whole, an
upper bound for those layouts (`upper_bound` says so).

Without remat (policy "none") the residual set is an upper bound, not validated: the jaxpr
then also saves the float32 intermediates of RMSNorm and RoPE and the bf16 casts of every
weight, which XLA can fuse or recompute from the values it keeps (torchtitan's Llama2-13B
without activation checkpointing ran in 80 GB on 64 A100s where this estimate says 139
GiB); `upper_bound` says so and the verdict then calls nothing an OOM on it alone.

A remat policy that offloads (`minimal_offloaded`, `qkv_proj_offloaded`: models.layers
REMAT_NAMES) saves those residuals in host memory (JAX's trace says so: their memory space is
Host): they are counted apart, as host bytes, not against HBM.

On a GPU with flash attention (cuDNN), residuals with two sequence-length dimensions (the
L x L scores, their softmax and mask) are not kept; their per-row statistics (float32, one
per head and row) are, and are negligible beside the block's activations.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jex_core
import numpy as np
from flax import nnx

from jaxdist.figures import ABSENT, Figures
from jaxdist.predict.program import cpu_compilable
from jaxdist.train_step import DTYPES, split_model
from models.layers import barriers_off
from sharding.axes import batch_axes

LABEL = "predicted"


def batch_shards(mesh: dict[str, int]) -> int:
    """Devices the batch's rows are split over: every axis but tensor and stage (as
    sharding.axes)."""
    return math.prod(mesh[a] for a in batch_axes(mesh))


def saved_residuals(model_cfg, dtype_name: str, batch_size: int) -> list[dict]:
    """The values jax.vjp of the model's loss (with respect to the parameters) saves for
    the backward pass, at a global batch of `batch_size`, without allocating: [{shape,
    dtype, bytes, host}] (host: offloaded to host memory by the remat policy). Parameters
    and the batch themselves are left out (they are the state and the input)."""
    graphdef, params, model_state = nnx.eval_shape(
        lambda: split_model(model_cfg, DTYPES[dtype_name], 0))
    one = model_cfg.synthetic_batch(np.random.default_rng(0), 1)
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype)
             for k, v in one.items()}
    leaves, tree = jax.tree.flatten((params, model_state, batch))

    def pullback_leaves(*flat):
        p, ms, b = jax.tree.unflatten(tree, flat)

        def loss(p_):
            return model_cfg.loss(nnx.merge(graphdef, p_, ms, copy=True), b)
        return jax.tree.leaves(jax.vjp(loss, p)[1])

    with barriers_off():
        jaxpr = jax.make_jaxpr(pullback_leaves)(*leaves).jaxpr
    inputs, seen, out = set(jaxpr.invars), set(), []
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Literal) or v in inputs or v in seen:
            continue
        seen.add(v)
        aval = v.aval
        out.append({"shape": tuple(aval.shape), "dtype": str(aval.dtype),
                    "bytes": int(aval.size) * np.dtype(aval.dtype).itemsize,
                    "host": getattr(aval, "memory_space", None) == jax.memory.Space.Host})
    return out


def is_attention_scores(shape, seq_len: int) -> bool:
    """An L x L attention tensor (scores, softmax, mask): two dimensions of the sequence
    length, beside batch and heads (4 or more dimensions: a [batch, L, width] activation
    whose width equals L, llama3-70b's 8192 and 8192, is not one)."""
    return seq_len > 1 and len(shape) >= 4 and sum(d == seq_len for d in shape) >= 2


@dataclasses.dataclass(frozen=True)
class ResidualKinds(Figures):
    """A trace's saved residuals by kind (`classify`): per-batch (activations), constant
    (weight-derived), L x L scores, offloaded to host; the largest kept of each kind."""
    batch_bytes: float = 0
    constant_bytes: float = 0
    scores_bytes: float = 0
    host_bytes: float = 0
    largest_batch_bytes: float = 0
    largest_constant_bytes: float = 0


@dataclasses.dataclass(frozen=True)
class Residuals(Figures):
    """Saved residuals per device of one micro-batch's backward: kept in HBM, offloaded to
    host, the largest single one; with `residual_figures`, one block's residuals and its
    recompute without remat, and how they were found."""
    residual_bytes: float
    host_residual_bytes: float
    largest_bytes: float
    block_residual_bytes: float = ABSENT
    block_recompute_bytes: float = ABSENT
    method: str = ABSENT


@dataclasses.dataclass(frozen=True)
class MemoryEstimate(Figures):
    """The hand estimate of the peak per device (`peak`; `predict_memory` adds the batch
    shards, flash attention and why the estimate is only an upper bound, if it is)."""
    state_bytes: float
    gradient_bytes: float
    residual_bytes: float
    transient_bytes: float
    gathered_param_bytes: float
    host_residual_bytes: float
    total_bytes: float
    method: str
    label: str = LABEL
    batch_shards: int = ABSENT
    flash_attention: bool = ABSENT
    upper_bound: bool = ABSENT
    upper_bound_why: str | None = ABSENT


def classify(at_b: list[dict], at_2b: list[dict], seq_len: int | None,
             flash: bool) -> ResidualKinds:
    """Residual bytes by kind from the same trace at batch B and 2B (same order): per-batch
    (activations), constant (weight-derived), L x L scores, offloaded to host (activations);
    and the largest single one of each kind that is kept in device memory."""
    if len(at_b) != len(at_2b):
        raise ValueError("the residuals at batch B and 2B differ in number")
    out = ResidualKinds().to_json()
    for a, b in zip(at_b, at_2b):
        if a.get("host"):
            out["host_bytes"] += a["bytes"]
            continue
        if flash and seq_len and is_attention_scores(a["shape"], seq_len):
            out["scores_bytes"] += a["bytes"]
            continue
        kind = "batch" if b["bytes"] == 2 * a["bytes"] else "constant"
        out[f"{kind}_bytes"] += a["bytes"]
        out[f"largest_{kind}_bytes"] = max(out[f"largest_{kind}_bytes"], a["bytes"])
    return ResidualKinds(**out)


def per_device(c: ResidualKinds, shards: int) -> Residuals:
    """Bytes per device: activations split over the batch's shards, the rest whole."""
    return Residuals(residual_bytes=c.batch_bytes / shards + c.constant_bytes,
                     host_residual_bytes=c.host_bytes / shards,
                     largest_bytes=max(c.largest_batch_bytes / shards,
                                       c.largest_constant_bytes))


_SUMMARIES: dict = {}  # traced once per process: a suite's variants share most traces


def _summary(model_cfg, dtype_name, batch, flash) -> ResidualKinds:
    key = (repr(model_cfg), dtype_name, batch, flash)
    if key not in _SUMMARIES:
        seq = getattr(model_cfg, "seq_len", None)
        _SUMMARIES[key] = classify(saved_residuals(model_cfg, dtype_name, batch),
                                   saved_residuals(model_cfg, dtype_name, 2 * batch), seq,
                                   flash)
    return _SUMMARIES[key]


def residual_figures(model_cfg, dtype_name: str, micro_batch: int, shards: int,
                     flash: bool, stack: bool) -> Residuals:
    """Per-device residual bytes of one micro-batch's backward, the largest single residual,
    and one block's residuals without remat (the recompute of one block). A stack of
    `depth` identical blocks is traced at depth 1 and 2 and extrapolated linearly (exact
    for identical blocks)."""
    if not stack:
        mine = per_device(_summary(model_cfg, dtype_name, micro_batch, flash), shards)
        return mine.replace(block_recompute_bytes=0.0, method="full trace")
    depth = model_cfg.depth
    at = {d: per_device(_summary(dataclasses.replace(model_cfg, depth=d), dtype_name,
                                 micro_batch, flash), shards) for d in (1, 2)}
    block = at[2].residual_bytes - at[1].residual_bytes
    host_block = at[2].host_residual_bytes - at[1].host_residual_bytes
    recompute = 0.0
    if getattr(model_cfg, "remat", "none") != "none":
        plain = {d: per_device(_summary(dataclasses.replace(model_cfg, depth=d, remat="none"),
                                        dtype_name, micro_batch, flash), shards)
                 for d in (1, 2)}
        recompute = plain[2].residual_bytes - plain[1].residual_bytes
    return Residuals(residual_bytes=at[1].residual_bytes + (depth - 1) * block,
                     host_residual_bytes=at[1].host_residual_bytes + (depth - 1) * host_block,
                     largest_bytes=at[2].largest_bytes, block_residual_bytes=block,
                     block_recompute_bytes=recompute,
                     method=f"traced at depth 1 and 2, extrapolated linearly to {depth}")


def peak(state_bytes: float, grad_bytes: float, residuals: Residuals,
         gathered_param_bytes: float = 0.0) -> MemoryEstimate:
    """The predicted peak per device and its parts (see the module docstring)."""
    transient = max(residuals.largest_bytes, residuals.block_recompute_bytes) + \
        gathered_param_bytes
    total = state_bytes + grad_bytes + residuals.residual_bytes + transient
    return MemoryEstimate(state_bytes=state_bytes, gradient_bytes=grad_bytes,
                          residual_bytes=residuals.residual_bytes, transient_bytes=transient,
                          gathered_param_bytes=gathered_param_bytes,
                          host_residual_bytes=residuals.host_residual_bytes,
                          total_bytes=total, method=residuals.method)


def param_bytes(model_cfg, dtype_name: str) -> int:
    """Bytes of the model's parameters (float32), from shapes alone."""
    params = nnx.eval_shape(lambda: split_model(model_cfg, DTYPES[dtype_name], 0))[1]
    return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def block_param_bytes(model_cfg, dtype_name: str) -> int:
    """One block's parameter bytes: the depth-2 model's minus the depth-1 model's."""
    return param_bytes(dataclasses.replace(model_cfg, depth=2), dtype_name) - \
        param_bytes(dataclasses.replace(model_cfg, depth=1), dtype_name)


def predict_memory(model_cfg, dtype_name: str, batch_size: int, microbatches: int,
                   mesh: dict[str, int], state_per_device: dict, params_global_bytes: int,
                   flash: bool, stack: bool) -> MemoryEstimate:
    """The peak estimate of one run: `state_per_device` is dryrun.plan's
    state_bytes_per_device (params, model_state, opt, total)."""
    model_cfg = cpu_compilable(model_cfg)  # traced here: cuDNN attention as XLA's
    # context parallelism splits every activation's sequence (models/context.py) as the
    # batch axes split its rows
    shards = batch_shards(mesh) * mesh.get("context", 1)
    residuals = residual_figures(model_cfg, dtype_name, batch_size // max(1, microbatches),
                                 shards, flash, stack)
    sharded = state_per_device["params"] < params_global_bytes
    gathered = 2 * block_param_bytes(model_cfg, dtype_name) if sharded and stack else 0
    # With micro-batches the step carries a gradient accumulator beside the current
    # micro-batch's gradients (jaxdist.train_step.accumulate): twice the gradient bytes.
    # bfloat16 working weights beside a float32 master (distributed optimizer): gradients
    # are cast to float32 before they are reduce-scattered, twice the working bytes.
    grads = (state_per_device["params"] * (2 if microbatches > 1 else 1)
             * (2 if state_per_device.get("master") else 1))
    why = upper_bound_why(model_cfg, mesh)
    return peak(state_per_device["total"], grads, residuals, gathered).replace(
        batch_shards=shards, flash_attention=flash, upper_bound=bool(why), upper_bound_why=why)


def upper_bound_why(model_cfg, mesh: dict[str, int]) -> str | None:
    """Why the estimate is only an upper bound (see the module docstring), or None."""
    why = []
    if getattr(model_cfg, "remat", "none") == "none":
        why.append("without remat it keeps float32 norm/RoPE intermediates and bf16 weight "
                   "copies XLA can fuse")
    if mesh.get("tensor", 1) > 1:
        why.append("under tensor parallelism the activations a tensor group shards are "
                   "counted whole")
    return "; ".join(why) or None
