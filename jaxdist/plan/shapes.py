"""`--dry-run`: what a layout would put on each device, from shapes alone.

No parameter is allocated and no device is needed, so the full-size models of Go et al.
(gpt3-175b, llama3-70b) can be planned for a 4x8 cluster on a laptop: the state's shapes come
from jaxdist.state_shapes, which assembles a decoder's from its depth-1 and depth-2 traces.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, AxisType

from jaxdist import metrics
from jaxdist.mesh import MeshShape
from jaxdist.run_model import build_model
from jaxdist.state_shapes import planning_state
from jaxdist.train_step import make_optimizer
from sharding import get_layout, padding


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
    summary = metrics.sharding_summary(padding.storage(state, specs, sizes), specs, state)
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


def format_plan(p: dict) -> str:
    from jaxdist.plan import headline
    from jaxdist.summary import human_bytes, replicated_text

    lines = [f"{headline(p)}; nothing allocated",
             f"  {'state part':<12}{'global':>14}{'per device':>14}"]
    for part, total in p["state_bytes_global"].items():
        lines.append(f"  {part:<12}{human_bytes(total):>14}"
                     f"{human_bytes(p['state_bytes_per_device'][part]):>14}")
    lines.append(f"  {'total':<12}{human_bytes(sum(p['state_bytes_global'].values())):>14}"
                 f"{human_bytes(p['state_bytes_per_device']['total']):>14}")
    lines.append(f"  replicated: {replicated_text(p['sharding'])} (activations and "
                 f"temporaries not included)")
    return "\n".join(lines)
