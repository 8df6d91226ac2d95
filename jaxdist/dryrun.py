"""`--dry-run`: what a layout would put on each device, from shapes alone.

No parameter is allocated and no device is needed, so the full-size models of Go et al.
(gpt3-175b, llama3-70b) can be planned for a 4x8 cluster on a laptop.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, AxisType

from jaxdist import metrics
from jaxdist.data import build_model
from jaxdist.mesh import MeshShape
from jaxdist.train_step import abstract_train_state, make_optimizer
from sharding import get_layout


def plan(cfg, shape: MeshShape) -> dict:
    model_cfg, _ = build_model(cfg)
    state = abstract_train_state(model_cfg, cfg.model.dtype,
                                 make_optimizer(cfg.train.optimizer, cfg.train.lr))
    sizes = shape.axis_sizes
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Auto,) * len(sizes))
    specs = get_layout(cfg.train.layout)(state, mesh)
    summary = metrics.sharding_summary(state, specs)
    return {
        "dry_run": True,
        "layout": cfg.train.layout,
        "mesh": dict(sizes),
        "model": {"name": cfg.model.model, "params": metrics.param_count(state)},
        "state_bytes_global": {part: sum(leaf.size * leaf.dtype.itemsize
                                         for leaf in jax.tree.leaves(state[part]))
                               for part in state},
        "state_bytes_per_device": metrics.planned_bytes_per_device(state, specs, sizes),
        "sharding": summary,
    }


def format_plan(p: dict) -> str:
    from jaxdist.writers import human_bytes

    devices = 1
    for n in p["mesh"].values():
        devices *= n
    lines = [f"dry run: {p['model']['name']} ({p['model']['params']:,} params), layout "
             f"{p['layout']} on " + " x ".join(f"{k}={v}" for k, v in p["mesh"].items()) +
             f" ({devices} devices); nothing allocated",
             f"  {'state part':<12}{'global':>14}{'per device':>14}"]
    for part, total in p["state_bytes_global"].items():
        lines.append(f"  {part:<12}{human_bytes(total):>14}"
                     f"{human_bytes(p['state_bytes_per_device'][part]):>14}")
    lines.append(f"  {'total':<12}{human_bytes(sum(p['state_bytes_global'].values())):>14}"
                 f"{human_bytes(p['state_bytes_per_device']['total']):>14}")
    lines.append(f"  replicated: {human_bytes(p['sharding']['replicated_bytes'])} in "
                 f"{p['sharding']['replicated_leaves']} leaves (activations and temporaries "
                 f"not included)")
    return "\n".join(lines)
