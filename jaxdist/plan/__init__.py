"""Plans: what a layout costs before anything runs (`--dry-run`), one entry point and one
formatter for the three kinds, each a frozen dataclass with `to_json()` (the file
`file_name` names; its blocks: docs/predict.md) and `text()`:

- `shapes.ShapesPlan`: the train state each device holds, from shapes alone (exact bytes;
  nothing is allocated and no device is needed).
- `pipeline_shapes.PipelineShapesPlan`: a pipeline layout's memory per stage (state exact,
  activations from the schedule's stash, estimated).
- `predicted.PredictedPlan` (`--hardware NAME`): the job and its `Prediction`
  (jaxdist.predict.prediction: the step compiled for NAME's cluster, its time and memory
  verdict), read verdict first, labelled `predicted`.

`plan(job)` makes the one the job asks for, `format_plan(p)` prints any of them and
`file_name(p)` is where a run writes it. Plans use jaxdist.predict; nothing there imports a
plan.
"""

from __future__ import annotations

from jaxdist.plan.base import PlanBase


def plan(job, cache: dict | None = None) -> PlanBase:
    """The plan of `job` (jaxdist.job) on its mesh: predicted on its part (`--hardware`),
    else from shapes (per stage for a pipelined layout). `cache` keeps a predicted plan's
    compiles for later calls whose program is the same (a suite's rows)."""
    if job.part is not None:
        from jaxdist.plan.predicted import predict_plan
        return predict_plan(job, cache=cache)
    if job.layout.pipelined:
        from jaxdist.plan.pipeline_shapes import plan_pipeline
        return plan_pipeline(job)
    from jaxdist.plan import shapes
    return shapes.plan(job)


def format_plan(p: PlanBase) -> str:
    """Any plan in words: a predicted one leads with its verdict."""
    return p.text()


def file_name(p: PlanBase) -> str:
    """Where a run's logdir keeps the plan: plan.json for a predicted plan (its blocks in
    docs/predict.md), dry_run.json for one from shapes."""
    return p.file_name
