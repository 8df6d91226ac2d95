"""The train state each device holds, from shapes alone (exact bytes; nothing is allocated
and no device is needed), so the full-size models of Go et al. (gpt3-175b, llama3-70b) can be
sized for a 4x8 cluster on a laptop: the state's shapes come from jaxdist.state_shapes, which
assembles a decoder's from its depth-1 and depth-2 traces. A shapes-only plan shows it; a
prediction's memory verdict starts from it."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AbstractMesh, AxisType

from jaxdist import metrics
from jaxdist.state_shapes import planning_state
from jaxdist.train_step import make_optimizer
from sharding import padding


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of the train state, globally and on each device, by state part."""
    layout: str
    distributed_optimizer: bool
    mesh: dict                    # axis -> size
    model: dict                   # {name, params}
    state_bytes_global: dict      # part -> bytes
    state_bytes_per_device: dict  # part -> bytes, and total
    sharding: dict                # metrics.sharding_summary

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def state_bytes(job) -> StateBytes:
    """The train state of `job` (jaxdist.job) per device on its mesh, exact, from shapes."""
    layout, train = job.rules, job.train
    state = planning_state(job.model, job.dtype, make_optimizer(train.optimizer, train.lr),
                           layout.master_weights(job.dtype))
    sizes = job.shape.axis_sizes
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Auto,) * len(sizes))
    specs = layout(state, mesh)
    summary = metrics.sharding_summary(padding.storage(state, specs, sizes), specs, state)
    return StateBytes(
        layout=job.layout.name, distributed_optimizer=layout.distributed_optimizer,
        mesh=dict(sizes), model={"name": job.model_name, "params": metrics.param_count(state)},
        state_bytes_global={part: sum(leaf.size * leaf.dtype.itemsize
                                      for leaf in jax.tree.leaves(state[part]))
                            for part in state},
        state_bytes_per_device=metrics.planned_bytes_per_device(state, specs, sizes),
        sharding=summary)
