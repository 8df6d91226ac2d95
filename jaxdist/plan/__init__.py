"""Plans: what a layout costs before anything runs (`--dry-run`), one entry point and one
formatter for the three kinds.

- `shapes`: the train state each device holds, from shapes alone (exact bytes; nothing is
  allocated and no device is needed).
- `pipeline_shapes`: a pipeline layout's memory per stage (state exact, activations from the
  schedule's stash, estimated).
- `predicted` (`--hardware NAME`): the step compiled for NAME's cluster (XLA:GPU without a
  device) and what jaxdist.predict's time model makes of it: a memory verdict first, then the
  step time and throughput, labelled `predicted`.

`plan(cfg, shape)` makes the one the config asks for, `format_plan(p)` prints any of them and
`file_name(p)` is where a run writes it.
"""

from __future__ import annotations

import math


def plan(cfg, shape, cache: dict | None = None) -> dict:
    """The plan of `cfg` on the mesh `shape`: predicted with `--hardware`, else from shapes
    (per stage for a pipelined layout). `cache` keeps a predicted plan's compiles for later
    calls whose program is the same (a suite's rows)."""
    from sharding.registry import facts

    if cfg.output.hardware:
        from jaxdist.plan.predicted import predict_plan
        return predict_plan(cfg, shape, cache=cache)
    if facts(cfg.train.layout).pipelined:
        from jaxdist.plan.pipeline_shapes import plan_pipeline
        return plan_pipeline(cfg, shape)
    from jaxdist.plan import shapes
    return shapes.plan(cfg, shape)


def format_plan(p: dict) -> str:
    """Any plan in words: a predicted one leads with its memory verdict."""
    if "hardware" in p:
        from jaxdist.plan.predicted import format_prediction
        return format_prediction(p)
    if "pipeline" in p:
        from jaxdist.plan.pipeline_shapes import format_pipeline_plan
        return format_pipeline_plan(p)
    from jaxdist.plan.shapes import format_plan as format_shapes
    return format_shapes(p)


def file_name(p: dict) -> str:
    """Where a run's logdir keeps the plan: plan.json for a predicted plan (its schema in
    docs/results.md), dry_run.json for one from shapes."""
    return "plan.json" if "hardware" in p else "dry_run.json"


def headline(p: dict) -> str:
    """The first line of a plan from shapes: model, layout and mesh."""
    from jaxdist.summary import dist_opt_text

    return (f"dry run: {p['model']['name']} ({p['model']['params']:,} params), layout "
            f"{p['layout']}{dist_opt_text(p)} on "
            + " x ".join(f"{k}={v}" for k, v in p["mesh"].items())
            + f" ({math.prod(p['mesh'].values())} devices)")
