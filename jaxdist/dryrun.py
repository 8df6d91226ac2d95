"""`--dry-run`: what a layout would put on each device, from shapes alone.

No parameter is allocated and no device is needed, so the full-size models of Go et al.
(gpt3-175b, llama3-70b) can be planned for a 4x8 cluster on a laptop.

Why not simply `jax.eval_shape` of the whole model's constructor: inside one trace, every
Flax RNG draw updates a counter Variable whose setter asks the tracer for `.sharding`, and
the AttributeError JAX raises builds a message by scanning every equation traced so far.
That is quadratic in the number of parameters: 18-35 s for llama3-70b, 139 s for gpt3-175b,
none of it in the plan. A decoder is a stack of `depth` identical blocks, so its abstract
state is traced at depth 1 and 2 (checked to differ by exactly one identical block) and
the stack is assembled to full depth from those shapes; the optimizer state is then
`eval_shape` of the optimizer's init on the assembled parameters. The tree (paths, shapes,
dtypes) is the one the full trace gives, so the layouts see the same input
(tests/test_dry_run.py compares both ways leaf by leaf).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from jaxdist import metrics
from jaxdist.mesh import MeshShape
from jaxdist.train_step import DTYPES, split_model, abstract_train_state, make_optimizer
from jaxdist.update import train_state
from jaxdist.run_model import build_model
from sharding import get_layout

STACK = "blocks"  # the decoders' nnx.List of identical blocks


def plan(cfg, shape: MeshShape) -> dict:
    model_cfg, _ = build_model(cfg)
    layout = get_layout(cfg.train.layout, cfg.train.distributed_optimizer)
    state = planning_state(model_cfg, cfg.model.dtype,
                           make_optimizer(cfg.train.optimizer, cfg.train.lr),
                           layout.master_weights(cfg.model.dtype))
    sizes = shape.axis_sizes
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Auto,) * len(sizes))
    specs = layout(state, mesh)
    summary = metrics.sharding_summary(state, specs)
    return {
        "dry_run": True,
        "layout": cfg.train.layout,
        "distributed_optimizer": layout.distributed_optimizer,
        "mesh": dict(sizes),
        "model": {"name": cfg.model.model, "params": metrics.param_count(state)},
        "state_bytes_global": {part: sum(leaf.size * leaf.dtype.itemsize
                                         for leaf in jax.tree.leaves(state[part]))
                               for part in state},
        "state_bytes_per_device": metrics.planned_bytes_per_device(state, specs, sizes),
        "sharding": summary,
    }


def planning_state(model_cfg, dtype_name: str, tx, master: bool = False) -> dict:
    """The abstract train state {params, model_state, opt} (and `master`, jaxdist/update.py):
    assembled from a stack of blocks where the model is one, else `abstract_train_state`
    (a full trace)."""
    stacked = _stacked_model_state(model_cfg, dtype_name)
    if stacked is None:
        return abstract_train_state(model_cfg, dtype_name, tx, master=master)
    params, model_state = stacked
    dtype = DTYPES[dtype_name] if master else None
    return jax.eval_shape(lambda p, m: train_state(p, m, tx, dtype), params, model_state)


def planning_params(model_cfg, dtype_name: str):
    """(params, model_state) as planning_state assembles them, without the optimizer state
    (a pipeline stacks the blocks first and initialises the optimizer on that)."""
    stacked = _stacked_model_state(model_cfg, dtype_name)
    return stacked if stacked is not None else _abstract_split(model_cfg, dtype_name)


def _abstract_split(model_cfg, dtype_name: str):
    _, params, model_state = nnx.eval_shape(
        lambda: split_model(model_cfg, DTYPES[dtype_name], 0))
    return params, model_state


def _stacked_model_state(model_cfg, dtype_name: str):
    """(params, model_state) of a full-depth decoder from its depth-1 and depth-2 shapes,
    or None where the model is not a stack this function can verify."""
    depth = getattr(model_cfg, "depth", None)
    if model_cfg.family not in ("gpt", "moe") or not isinstance(depth, int) or depth <= 2:
        return None
    one = _abstract_split(dataclasses.replace(model_cfg, depth=1), dtype_name)
    two = _abstract_split(dataclasses.replace(model_cfg, depth=2), dtype_name)
    if not all(_same(_stack(a, 2), b) for a, b in zip(one, two)):
        return None  # depth changes more than the number of blocks: trace it whole
    return tuple(_stack(part, depth) for part in one)


def _stack(state: nnx.State, depth: int) -> nnx.State:
    """A depth-1 state with its one block repeated `depth` times (the same abstract leaves:
    only shapes and dtypes are read)."""
    mapping = state.raw_mapping  # nested plain dicts: State wraps only the top level
    if STACK not in mapping or list(mapping[STACK]) != [0]:
        return state
    block = mapping[STACK][0]
    return nnx.State({**mapping, STACK: {i: block for i in range(depth)}})


def _same(a, b) -> bool:
    """Equal tree structure (paths, Variable types and metadata) and leaf shapes/dtypes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def format_plan(p: dict) -> str:
    from jaxdist.summary import dist_opt_text, human_bytes, replicated_text

    devices = 1
    for n in p["mesh"].values():
        devices *= n
    lines = [f"dry run: {p['model']['name']} ({p['model']['params']:,} params), layout "
             f"{p['layout']}{dist_opt_text(p)} on " +
             " x ".join(f"{k}={v}" for k, v in p["mesh"].items()) +
             f" ({devices} devices); nothing allocated",
             f"  {'state part':<12}{'global':>14}{'per device':>14}"]
    for part, total in p["state_bytes_global"].items():
        lines.append(f"  {part:<12}{human_bytes(total):>14}"
                     f"{human_bytes(p['state_bytes_per_device'][part]):>14}")
    lines.append(f"  {'total':<12}{human_bytes(sum(p['state_bytes_global'].values())):>14}"
                 f"{human_bytes(p['state_bytes_per_device']['total']):>14}")
    lines.append(f"  replicated: {replicated_text(p['sharding'])} (activations and "
                 f"temporaries not included)")
    return "\n".join(lines)
