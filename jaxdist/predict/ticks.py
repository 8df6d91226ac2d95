"""The pipeline step's time from its schedule table (jaxdist/pipeline/schedule.py) and its
ops' times: the tick model of jaxdist's tick loop (what runs: each tick as long as its
busiest stage's operations, one after the other, then its sends), and, as a labelled what-if,
the same table run as Megatron runs it (each stage starting its next op once its input has
arrived). The ops' figures come from jaxdist.predict.pipeline, which compiles them."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdist.figures import ABSENT, Figures
from jaxdist.hardware import constant
from jaxdist.parts import Part
from jaxdist.pipeline.schedule import BACK, BWD, FWD, PAIR, Schedule
from jaxdist.pipeline.step import combined_sends, slot_pairs, overlapped_sends
from jaxdist.plan_words import TimeTerms
from jaxdist.predict.time_model import StepTime, kernel_step, ring_latency, step_time


def node_of(mesh: dict[str, int], gpus_per_node: int) -> np.ndarray:
    """Node index of every device, over the mesh axes (the mesh placed on nodes of
    `gpus_per_node` by jaxdist.mesh.placement, as jaxdist.predict.time_model.group_nodes
    places it)."""
    from jaxdist.mesh import host_of

    return host_of(mesh, gpus_per_node)


def send_crosses_nodes(mesh: dict[str, int], src: int, dst: int, gpus_per_node: int) -> bool:
    """Whether stage src's devices send to a stage dst device in another node."""
    node = node_of(mesh, gpus_per_node)
    axis = list(mesh).index("stage")
    return bool(np.any(np.take(node, src, axis=axis) != np.take(node, dst, axis=axis)))


def send_time(nbytes: float, inter: bool, hw: Part) -> float:
    bandwidth = (hw.inter_node_bandwidth if inter else hw.intra_node_bandwidth) * \
        constant("link_efficiency")
    # One point-to-point step: NCCL's base latency plus one NVLink/PCIe or network hop.
    return nbytes / bandwidth + ring_latency("collective-permute", 2, 2 if inter else 1, hw)


@dataclasses.dataclass(frozen=True)
class OpTime(Figures):
    """One pipeline op's time (seconds: device time + exposed communication) and its terms,
    exposed communication split by link, and the figures it was timed from."""
    seconds: float
    device_s: float
    compute_s: float
    hbm_s: float
    intra_node_s: float
    inter_node_s: float
    exposed_intra_node_s: float
    exposed_inter_node_s: float
    flops: float
    bytes_accessed: float
    collectives: list
    terms: TimeTerms


def op_row(fig, hw: Part, mesh: dict, dtype: str, overlap: bool,
           precision: str) -> OpTime:
    """One op's time from its figures (a StepFigures: kernel by kernel where XLA:GPU's program was read
    with the part's rates, else the roofline); exposed communication split by link."""
    if fig.kernel_time is not None:
        t = kernel_step(fig.kernel_time, fig.comm, hw, mesh, dtype, precision)
    else:
        t = step_time(fig.flops, fig.bytes_accessed, fig.comm, hw, mesh, dtype, overlap,
                      matmul_precision=precision)
    return OpTime(seconds=t.step_s, device_s=t.device_s, compute_s=t.compute_s,
                  hbm_s=t.hbm_s, intra_node_s=t.intra_node_s, inter_node_s=t.inter_node_s,
                  exposed_intra_node_s=t.exposed_intra_node_s,
                  exposed_inter_node_s=t.exposed_inter_node_s, flops=fig.flops,
                  bytes_accessed=fig.bytes_accessed, collectives=t.collectives,
                  terms=t.terms)


def op_key(sched: Schedule, kind: int, s: int, v: int) -> tuple:
    """The key of an op's figures: (kind, whether its chunk holds the head), and the
    chunk's blocks where the schedule knows them (--pp-stage-blocks: chunks differ)."""
    last = sched.chunk(s, v) == sched.chunks - 1
    return (kind, last, sched.blocks[s][v]) if sched.blocks else (kind, last)


def stage_tick(sched: Schedule, ops: dict, s: int,
               ops_s) -> list[tuple[OpTime, dict[int, float]]]:
    """(op_row, {kind: seconds} of the operations in it) of what stage s runs in a tick,
    in order. In a combined table a stage's F and BACK are one computation
    (jaxdist/pipeline/step.py operate_both): the PAIR row at the BACK's chunk, plus the
    difference of the F's own chunk from that chunk's F (where they differ: interleaved,
    uneven stages), whose F part is the F's and BACK part the rest."""
    kinds = {op.kind: op for op in ops_s}
    if not (sched.combined and FWD in kinds and BACK in kinds):
        return [(row, {op.kind: row.seconds}) for op in ops_s
                for row in [ops[op_key(sched, op.kind, s, op.v)]]]
    f, v = ops[op_key(sched, FWD, s, kinds[FWD].v)], kinds[BACK].v
    pair, f_there = ops[op_key(sched, PAIR, s, v)], ops[op_key(sched, FWD, s, v)]
    row = pair.replace(**{k: getattr(pair, k) + getattr(f, k) - getattr(f_there, k)
                          for k in TIMES}, terms=pair.terms + f.terms - f_there.terms)
    return [(row, {FWD: f.seconds, BACK: row.seconds - f.seconds})]


ZERO_TERMS = TimeTerms(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False)
TIMES = ("seconds", "device_s", "compute_s", "hbm_s", "intra_node_s", "inter_node_s",
         "exposed_intra_node_s", "exposed_inter_node_s")


def dataflow_seconds(sched: Schedule, ops_figs: dict, act_bytes: float, hw: Part,
                     mesh: dict[str, int]) -> float:
    """The ticks' length when every stage runs its operations in the table's order, each as
    soon as the stage is free and its input has arrived (Megatron's runtime: point-to-point
    sends between otherwise independent stages), instead of in lockstep ticks. An input
    arrives one send after the op that produced it ended on the neighbouring stage."""
    S, last_chunk = sched.stages, sched.chunks - 1
    back = BWD if sched.split_backward else BACK  # the op that sends the input gradient
    free = [0.0] * S
    end: dict[tuple[int, int, int], float] = {}  # (kind, chunk, mb) -> when it ended
    sends: dict[tuple[int, int], float] = {}

    def arrival(kind: int, chunk: int, mb: int, src: int, dst: int) -> float:
        if (src, dst) not in sends:
            sends[(src, dst)] = send_time(act_bytes, send_crosses_nodes(mesh, src, dst,
                                                                        hw.gpus_per_node), hw)
        return end[(kind, chunk, mb)] + sends[(src, dst)]

    for t in range(sched.ticks):  # the table is a topological order of the dependencies
        for s, ops in enumerate(sched.ops[t]):
            for op in ops:  # a stage's ops of a tick in order; W follows its B
                c = sched.chunk(s, op.v)
                ready = free[s]
                if op.kind == FWD and c > 0:
                    ready = max(ready, arrival(FWD, c - 1, op.mb, (c - 1) % S, s))
                elif op.kind == back and c < last_chunk:
                    ready = max(ready, arrival(back, c + 1, op.mb, (c + 1) % S, s))
                free[s] = ready + ops_figs[op_key(sched, op.kind, s, op.v)].seconds
                end[(op.kind, c, op.mb)] = free[s]
    return max(free)


def hidden_reductions(tick_ends: list[float], early,
                      exposed: dict[str, float]) -> dict[str, float]:
    """Seconds of the tail's exposed gradient reduction, by link, that run beside the
    ticks: each early chunk reduction (`early`: (tick, seconds, link) in issue order,
    jaxdist.predict.pipeline.early_reductions) starts when tick `tick` - 1 ends, or when
    the one before it is done (the loop chains them; one at a time on the link), and
    what of it ends before the last tick does is hidden; at most the tail's exposed
    time on that link (`exposed`)."""
    hidden = {"intra-node": 0.0, "inter-node": 0.0}
    free, end_s = 0.0, tick_ends[-1] if tick_ends else 0.0
    for tick, seconds, link in early:
        start = max(tick_ends[tick - 1] if tick > 0 else 0.0, free)
        free = start + seconds
        hidden[link] += max(0.0, min(free, end_s) - start)
    return {k: min(v, exposed[k]) for k, v in hidden.items()}


def tick_model(sched: Schedule, ops: dict, tail: dict, act_bytes: float, hw: Part,
               mesh: dict[str, int], runtime: str = "jaxdist", overlap: bool = False,
               early=()) -> StepTime:
    """The step from the schedule table. `ops[op_key(...)]`: op_row of a chunk's forward
    (FWD), whole backward (BACK) or its halves (BWD, WGT), `last` for the chunk holding the
    head (and the chunk's blocks where the schedule has them: a stage of fewer blocks runs
    shorter ops, a tick lasts its busiest stage's); `tail`: op_row of the gradient reduction and optimizer; `act_bytes`: one message
    per device. `runtime`: jaxdist (its tick loop: a tick lasts its busiest stage's ops, then
    its sends) or megatron (a what-if: the same table, each stage driven by its own inputs,
    `dataflow_seconds`). `overlap`: the step compiled with XLA's latency-hiding scheduler
    (--overlap), which puts a send beside the operation the loop issues it with. `early`:
    the chunk reductions the loop issues before its last tick (`hidden_reductions`),
    whose time beside the ticks leaves the tail."""
    S = sched.stages
    busy = [dict.fromkeys(TIMES, 0.0) for _ in range(S)]
    busy_terms = [ZERO_TERMS] * S
    ticks_s = 0.0
    sends = {"intra-node": 0.0, "inter-node": 0.0}
    exposed = {"intra-node": 0.0, "inter-node": 0.0}  # the sends' time the ticks do not hide
    messages = 0
    tick_ends = []  # when each tick's operations end (the ticks' own time, sends apart)
    slotted = overlapped_sends(sched)  # once: the table's sends by slot (None: zb-h1's)
    beside = slotted if overlap else None
    combined = combined_sends(sched) if overlap and sched.combined else None
    for t in range(sched.ticks):
        longest, longest_op = 0.0, dict.fromkeys(sched.kinds, 0.0)
        for s, ops_s in enumerate(sched.ops[t]):
            stage_s = 0.0  # a stage runs its ops of the tick one after the other
            for row, parts in stage_tick(sched, ops, s, ops_s):
                for k in busy[s]:
                    busy[s][k] += getattr(row, k)
                busy_terms[s] = busy_terms[s] + row.terms
                stage_s += row.seconds
                for k, seconds in parts.items():
                    longest_op[k] = max(longest_op[k], seconds)
            longest = max(longest, stage_s)
        ticks_s += longest
        tick_ends.append(ticks_s)
        # jaxdist's tick loop (jaxdist/pipeline/step.py): one ppermute per direction. Under
        # OverlappedSends slot k's pairs go out beside its operation (the ppermute's start
        # before it, its done after: XLA:GPU's schedule), so only what outlasts the slot's
        # longest operation is exposed; the other sets, and zb-h1's, follow the tick's ops.
        for k, pairs in enumerate((slot_pairs(sched, t, 0), slot_pairs(sched, t, 1))
                                  if slotted else sched.sends(t)):
            if not pairs:
                continue
            times = [(send_time(act_bytes, inter, hw), inter) for inter in
                     (send_crosses_nodes(mesh, a, b, hw.gpus_per_node) for a, b in pairs)]
            seconds, inter = max(times)
            link = "inter-node" if inter else "intra-node"
            sends[link] += seconds
            if combined is not None:  # both sends inside the tick's one computation: the
                # input gradients beside F (BACK reads them), F's outputs beside the rest
                hidden = (longest_op[sched.kinds[k]]
                          if combined.choice[t] < len(combined.sets) else 0.0)
            else:
                hidden = (longest_op[sched.kinds[k]]
                          if beside and beside.choice[t, k] < len(beside.sets[k]) else 0.0)
            exposed[link] += max(0.0, seconds - hidden)
            messages += len(pairs)
    lockstep_s, dataflow_s = ticks_s + exposed["intra-node"] + exposed["inter-node"], \
        dataflow_seconds(sched, ops, act_bytes, hw, mesh)
    if runtime == "megatron":  # a send delays only the op waiting for it (in dataflow_s)
        ticks_s, exposed = dataflow_s, {"intra-node": 0.0, "inter-node": 0.0}
    tail_exposed = {"intra-node": tail.exposed_intra_node_s,
                    "inter-node": tail.exposed_inter_node_s}
    hidden = hidden_reductions(tick_ends, early, tail_exposed)
    tail = tail.replace(seconds=tail.seconds - sum(hidden.values()),
                        exposed_intra_node_s=tail_exposed["intra-node"] - hidden["intra-node"],
                        exposed_inter_node_s=tail_exposed["inter-node"] - hidden["inter-node"],
                        terms=tail.terms.replace(
                            exposed_intra_node_s=tail.terms.exposed_intra_node_s -
                            hidden["intra-node"],
                            exposed_inter_node_s=tail.terms.exposed_inter_node_s -
                            hidden["inter-node"]))
    critical = max(range(S), key=lambda s: busy[s]["seconds"])
    work = busy[critical]
    bubble = ticks_s - work["seconds"]
    terms = busy_terms[critical] + tail.terms + TimeTerms(
        0.0, 0.0, 0.0, exposed["intra-node"], exposed["inter-node"], bubble, False)
    step = ticks_s + exposed["intra-node"] + exposed["inter-node"] + tail.seconds
    # intra/inter_node_s: all the link time of the critical stage's ops, the sends and the
    # tail (as jaxdist.predict.time_model reports it); exposed_*: what adds to the step.
    return StepTime(
        step_s=step, compute_s=work["compute_s"] + tail.compute_s,
        hbm_s=work["hbm_s"] + tail.hbm_s, device_s=work["device_s"] + tail.device_s,
        intra_node_s=work["intra_node_s"] + sends["intra-node"] + tail.intra_node_s,
        inter_node_s=work["inter_node_s"] + sends["inter-node"] + tail.inter_node_s,
        exposed_intra_node_s=terms.exposed_intra_node_s,
        exposed_inter_node_s=terms.exposed_inter_node_s,
        comm_exposed_s=terms.exposed_intra_node_s + terms.exposed_inter_node_s,
        bubble_s=bubble, bottleneck=terms.bottleneck(), terms=terms,
        pipeline=PipelineTime(
            ticks=sched.ticks, ticks_s=ticks_s, critical_stage=critical,
            critical_stage_work_s=work["seconds"],
            bubble_fraction_of_ticks=bubble / ticks_s if ticks_s else 0.0,
            schedule_bubble=sched.bubble(), send_intra_node_s=sends["intra-node"],
            send_inter_node_s=sends["inter-node"], messages=messages,
            send_exposed_s=exposed["intra-node"] + exposed["inter-node"],
            message_bytes=act_bytes, tail_s=tail.seconds,
            tail_beside_ticks_s=sum(hidden.values()), early_reductions=len(early),
            runtime=runtime, lockstep_s=lockstep_s, dataflow_s=dataflow_s,
            stage_busy=[{"compute_s": b["compute_s"] + tail.compute_s,
                         "hbm_s": b["hbm_s"] + tail.hbm_s,
                         "device_s": b["device_s"] + tail.device_s} for b in busy]))


@dataclasses.dataclass(frozen=True)
class PipelineTime(Figures):
    """A pipeline step's ticks: their time and the critical stage's work, the bubble two
    ways, the stage sends (time by link, what of it the ticks do not hide), the tail
    (gradient reduction, optimizer; what of it runs beside the ticks), and the runtime the
    ticks are timed as beside the other's what-if."""
    ticks: int
    ticks_s: float
    critical_stage: int
    critical_stage_work_s: float
    bubble_fraction_of_ticks: float
    schedule_bubble: float
    send_intra_node_s: float
    send_inter_node_s: float
    messages: int
    send_exposed_s: float
    message_bytes: float
    tail_s: float
    tail_beside_ticks_s: float
    early_reductions: int
    runtime: str
    lockstep_s: float
    dataflow_s: float
    lockstep: str = ("jaxdist: each tick lasts as long as its busiest stage's ops (F then "
                     "BACK); a send rides beside the next op where the loop issues it there, "
                     "else follows the tick's ops")
    dataflow: str = ("megatron (what-if, not what jaxdist runs): each stage runs its next op "
                     "as soon as it is free and the op's input has arrived")
    # each stage's compute-bound, memory-bound and device seconds (its ops and the tail),
    # what the power model reads per stage (jaxdist.predict.power)
    stage_busy: list = ABSENT
