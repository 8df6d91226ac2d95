"""Input checks of a pipelined run that need no device (experiments/run.py calls them)."""

from __future__ import annotations

from jaxdist.errors import UsageError
from jaxdist.pipeline.parts import check_depth
from jaxdist.pipeline.schedule import check_schedule


def check_pipeline(model_cfg, stages: int, schedule: str, microbatches: int, virtual: int,
                   eval_every: int = 0) -> None:
    V = virtual if schedule == "interleaved" else 1
    check_schedule(schedule, stages, microbatches, V)
    check_depth(model_cfg, stages, V)
    if eval_every:
        raise UsageError("--eval-every is not implemented for the pipeline layouts (pp, "
                         "tp_pp, fsdp_pp); drop it or use another layout")
