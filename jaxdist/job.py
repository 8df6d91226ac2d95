"""A resolved job: what the one validation pass (experiments/validation.py `validate`) read
from a run's config, so that the entry points dispatch on it and later layers read it
instead of deriving the model, the layout's facts or the mesh from the flags again.

Imports nothing heavy: `validate` builds a Job only once its cheap checks have passed (the
layout's facts need the layout registry, which imports jax; the model config needs flax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxdist.config import RunConfig
    from jaxdist.mesh import MeshShape
    from jaxdist.parts import Part
    from sharding.registry import LayoutFacts

# What the entry point runs for a job: a training run on a device mesh (experiments.run),
# a plan of one (experiments.plan, or experiments.run --dry-run), or the parameter server's
# processes (a layout that runs out of process, ps.driver).
MESH, PLAN, PS = "mesh", "plan", "ps"
KINDS = (MESH, PLAN, PS)


@dataclass(frozen=True)
class Job:
    cfg: RunConfig                # the config as validated (--resume's folder resolved)
    kind: str                     # one of KINDS
    layout: LayoutFacts           # the layout registry's facts (sharding.registry)
    model: Any                    # the model config (jaxdist.run_model.build_model)
    shape: MeshShape              # the parsed --mesh (size None for -1: known with devices)
    optimizer: str                # --optimizer
    part: Part | None             # --hardware's part (jaxdist.parts), None without
    notices: tuple[str, ...]      # "notice: ..." lines, in jaxdist.notices' order

    @property
    def hosts(self) -> int:
        """The hosts the mesh spans: a plan for a part, its nodes (the mesh's devices over
        the part's node size); a mesh run, its processes (--num-processes, 1 without); a
        plan from shapes and the parameter server, this host (the parameter server starts
        its processes here)."""
        if self.kind == PLAN and self.part is not None:
            return math.ceil(self.shape.size / self.part.gpus_per_node)
        if self.kind == MESH:
            return max(self.cfg.dist.num_processes, 1)
        return 1


def kind_of(cfg: RunConfig) -> str:
    """The job's kind from its flags and its layout's facts (imports the layout registry,
    hence jax; an unknown layout is refused here, one line)."""
    if cfg.output.dry_run:
        return PLAN
    from sharding.registry import facts
    return PS if facts(cfg.train.layout).out_of_process else MESH


def out_of_process(layout: str) -> bool:
    """Whether `layout` runs in processes of its own (the parameter server), from the layout
    registry (imports jax; an unknown layout is refused, one line)."""
    from sharding.registry import facts
    return facts(layout).out_of_process
