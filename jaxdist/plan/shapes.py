"""A plan from shapes alone (`--dry-run`): what a layout puts on each device, exact bytes of
the train state by part (jaxdist.predict.state), nothing allocated and no device needed."""

from __future__ import annotations

import dataclasses

from jaxdist.plan.base import PlanBase
from jaxdist.predict.state import StateBytes, state_bytes


@dataclasses.dataclass(frozen=True)
class ShapesPlan(PlanBase):
    """dry_run.json: the train state's bytes, globally and per device."""
    state: StateBytes
    seq_len: int | None = None  # the header's; not in dry_run.json

    file_name = "dry_run.json"

    def to_json(self) -> dict:
        return {"dry_run": True, **self.state.to_json()}

    def text(self) -> str:
        from jaxdist.plan.base import headline
        from jaxdist.summary import human_bytes, replicated_text

        s = self.state
        lines = [f"{headline(self)}; nothing allocated",
                 f"  {'state part':<12}{'global':>14}{'per device':>14}"]
        for part, total in s.state_bytes_global.items():
            lines.append(f"  {part:<12}{human_bytes(total):>14}"
                         f"{human_bytes(s.state_bytes_per_device[part]):>14}")
        lines.append(f"  {'total':<12}{human_bytes(sum(s.state_bytes_global.values())):>14}"
                     f"{human_bytes(s.state_bytes_per_device['total']):>14}")
        lines.append(f"  replicated: {replicated_text(s.sharding)} (activations and "
                     f"temporaries not included)")
        return "\n".join(lines)

    # the facts headline() reads
    @property
    def layout(self) -> str:
        return self.state.layout

    @property
    def mesh(self) -> dict[str, int]:
        return self.state.mesh

    @property
    def model(self) -> dict[str, str | int]:
        return self.state.model

    @property
    def distributed_optimizer(self) -> bool:
        return self.state.distributed_optimizer


def plan(job) -> ShapesPlan:
    """The plan of `job` (jaxdist.job) from shapes: its train state per device."""
    return ShapesPlan(state_bytes(job), getattr(job.model, "seq_len", None))


def format_plan(p: ShapesPlan) -> str:
    return p.text()
