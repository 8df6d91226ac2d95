"""A pipeline layout's plan from shapes alone (`--dry-run`): every stage's bytes per device
(jaxdist.predict.stage_memory: state exact, activations from the schedule's stash,
estimated); `--hardware PART` sets them against the part's HBM (jaxdist.plan.predicted)."""

from __future__ import annotations

import dataclasses

from jaxdist.plan.base import PlanBase
from jaxdist.predict.stage_memory import stage_memory


@dataclasses.dataclass(frozen=True)
class PipelineShapesPlan(PlanBase):
    """dry_run.json of a pipeline layout: the schedule and every stage's bytes."""
    layout: str
    mesh: dict
    distributed_optimizer: bool
    model: dict                   # {name, params}
    pipeline: dict                # the schedule's summary, blocks per chunk, rows
    state_bytes_per_device: dict  # exact, by state part
    stages: list                  # per stage: its bytes by kind, and total
    seq_len: int | None = None    # the header's; not in dry_run.json

    file_name = "dry_run.json"

    def to_json(self) -> dict:
        return {"dry_run": True, **{f.name: getattr(self, f.name)
                                    for f in dataclasses.fields(self) if f.name != "seq_len"}}

    def text(self) -> str:
        from jaxdist.plan.base import headline
        from jaxdist.summary import human_bytes

        p = self
        pp = p.pipeline
        blocks = pp.get("stage_blocks") or []
        split = (f"{pp['blocks_per_chunk']} blocks per chunk" if len(set(blocks)) < 2 else
                 f"stage blocks {','.join(map(str, blocks))} (padded to "
                 f"{pp['blocks_per_chunk']} per chunk)")
        lines = [f"{headline(p)}; {pp['schedule']} S={pp['stages']} V={pp['virtual']} "
                 f"M={pp['microbatches']}, {split}, "
                 f"{pp['microbatch_rows_per_device']} rows per micro-batch and device; bubble "
                 f"{pp['bubble']:.1%}; nothing allocated",
                 f"  {'stage':<6}{'params':>12}{'gradients':>12}{'optimizer':>12}"
                 f"{'act stash':>12}{'act working':>13}{'total':>12}"]
        for s in p.stages:
            lines.append(f"  {s['stage']:<6}{human_bytes(s['params']):>12}"
                         f"{human_bytes(s['gradients']):>12}"
                         f"{human_bytes(s['opt'] + s.get('master', 0)):>12}"
                         f"{human_bytes(s['activation_stash']):>12}"
                         f"{human_bytes(s['activation_working']):>13}"
                         f"{human_bytes(s['total']):>12}")
        lines.append("  per device; activations estimated (stash: the schedule's micro-batches "
                     "in flight x what a chunk's backward reads under --remat, working set: "
                     "one block's, by Korthikanti et al. 2022); --hardware PART sets each "
                     "stage against the part's memory")
        padded = [s for s in p.stages if s.get("padded_slots")]
        if padded:
            lines.append("  padding (in total): " + ", ".join(
                f"stage {s['stage']} {s['padded_slots']} slot(s) "
                f"{human_bytes(s['padding_state'] + s['padding_gradients'])}" for s in padded) +
                " of parameters, gradients and optimizer state the program holds beyond the "
                "stage's own blocks (equal shards on every stage)")
        return "\n".join(lines)


def plan_pipeline(job) -> PipelineShapesPlan:
    """The plan of a pipelined `job` (jaxdist.job) from shapes: each stage's memory."""
    memory = stage_memory(job)
    return PipelineShapesPlan(**{f.name: getattr(memory, f.name)
                                 for f in dataclasses.fields(memory)},
                              seq_len=job.model.seq_len)


def format_pipeline_plan(p: PipelineShapesPlan) -> str:
    return p.text()
