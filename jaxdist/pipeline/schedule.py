"""Pipeline schedules as tables: for every tick and stage, what that stage does.

A schedule is built by simulating its stages tick by tick. Each stage has an ordered list of
forwards and one of backwards (each on one micro-batch and one of its model chunks); at a
tick it runs its next forward if that forward's input has arrived (sent by the stage
before at an earlier tick), then its next backward if that backward's gradient has arrived
(sent by the stage after at an earlier tick, or for the last chunk made by its own forward,
at this tick or before). So a tick holds at most one forward and one backward per stage:
- F (FWD): a chunk's forward, which stashes what the backward needs (jaxdist/pipeline/ops.py);
- BACK: the whole backward (weight and input gradients) from the stash;
- B (BWD) then W (WGT), zb-h1 only: BACK split into the input gradient and the weight
  gradients, W from what B kept (no forward, no input-gradient chain run again).
The tick loop (jaxdist/pipeline/step.py) runs a tick's operations one after the other on
each stage, then the tick's sends in one ppermute per direction, so a tick lasts as long as
its busiest stage's F + BACK. In 1F1B's steady state every stage runs one F and one BACK
per tick, so 1F1B costs GPipe's (M+S-1)(F+B) whatever F and B cost (a tick holding one op
per stage lasted its slowest op: a forward on one stage and a backward on its neighbour
cost a backward).

GPipe starts its backwards only after all its forwards; 1F1B (Narayanan et al. 2021) as
soon as each is ready. With one hop per tick each way, a micro-batch is in flight on stage s
from its F to its BACK for 2(S-1-s)+1 ticks, so 1F1B stashes at most 2S-1 micro-batches
(stage 0), not M; Megatron's asynchronous 1F1B stashes S, at the price of ticks that mix a
forward and a backward. zb-h1 (Qi et al. 2023) runs W right after B in the same tick: with
lockstep ticks W cannot fill the cool-down (stage 0's backwards are its last work), so its
table costs 1F1B's and it differs in the program (B sends the input gradient, W reads B's
cotangents). Interleaved (V > 1) runs Megatron's forward and backward orders over V chunks
per stage, chunk c = v*S + s on stage s, so activations go round the ring of stages V
times. The bubble is *counted* from the table (idle work units / all), not assumed. Where
stages hold different block counts (--pp-stage-blocks), an operation costs its chunk's
blocks over the largest chunk's, so the count includes the stages with fewer blocks
waiting for the others.

Slots: a stage keeps each received activation (the input of one of its chunk forwards, read
again by the backward) and each gradient in a slot of a fixed-size buffer, and each
forward's stash (its vjp residuals) in a residual slot, from arrival (or F) until its
backward ran; the table says which slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxdist.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMBINABLE = ("1f1b", "interleaved")  # F then BACK in a tick: --pp-combined-1f1b
IDLE, FWD, BWD, WGT, BACK = 0, 1, 2, 3, 4
# Not a table's operation: a combined tick's F and BACK (of another micro-batch) as one
# computation, as the predictor compiles and times it (jaxdist/predict/pipeline.py)
PAIR = 5


# The cost of each operation in F-units (the papers' tables): a backward is 2F, B = W = F.
UNITS = {FWD: 1, BACK: 2, BWD: 1, WGT: 1}


@dataclass(frozen=True)
class Op:
    kind: int   # FWD, BACK (the whole backward), BWD (B, the input gradient) or WGT (W)
    mb: int     # micro-batch
    v: int      # virtual chunk index on this stage (chunk = v * S + stage)


@dataclass
class Schedule:
    name: str
    stages: int
    virtual: int
    microbatches: int
    # ops[t][s]: the operations stage s runs at tick t, in order (at most one of each kind)
    ops: list[list[tuple[Op, ...]]] = field(default_factory=list)
    # slots[t][s]: per operation, (activation slot, gradient slot, residual slot); -1: none
    slots: list[list[tuple[tuple[int, int, int], ...]]] = field(default_factory=list)
    # arrivals at the start of tick t on stage s: (activation slot or -1, gradient slot or -1)
    recv_slots: list[list[tuple[int, int]]] = field(default_factory=list)
    act_slots: int = 0
    grad_slots: int = 0
    res_slots: int = 0
    act_slots_by_stage: list[int] = field(default_factory=list)
    res_slots_by_stage: list[int] = field(default_factory=list)
    # blocks of chunk (s, v) as blocks[s][v] (jaxdist/pipeline/parts.py chunk_blocks), set
    # by whoever splits the model; () where not known (every chunk's figures alike)
    blocks: tuple = ()
    # combined 1F1B: a tick's F and BACK run as one computation (jaxdist/pipeline/step.py),
    # so the last chunk's backward waits a tick for its forward (`build_schedule`)
    combined: bool = False

    @property
    def split_backward(self) -> bool:
        """zb-h1: the backward runs as B (the input gradient, sent on) then W."""
        return self.name == "zb-h1"

    @property
    def kinds(self) -> tuple[int, ...]:
        """The operations of a tick, in the order a stage runs them."""
        return (FWD, BWD, WGT) if self.split_backward else (FWD, BACK)

    def stage_ops(self, t: int, s: int) -> tuple[Op, ...]:
        return self.ops[t][s]

    def share(self, s: int, v: int) -> float:
        """Chunk (s, v)'s blocks over the largest chunk's (1 where all are alike): what an
        operation on it costs in F-units, an F-unit being the largest chunk's forward."""
        if not self.blocks:
            return 1.0
        return self.blocks[s][v] / max(max(row) for row in self.blocks)

    def cost(self, units: dict[int, float] | None = None) -> float:
        """The step's length in F-units as executed: each tick as long as its busiest
        stage (the sum of its operations' costs), ticks one after the other."""
        units = UNITS if units is None else units
        return sum(max(sum(units[o.kind] * self.share(s, o.v) for o in ops)
                       for s, ops in enumerate(row)) for row in self.ops)

    def work(self, units: dict[int, float] | None = None) -> float:
        """All stages' operations in F-units."""
        units = UNITS if units is None else units
        return sum(units[o.kind] * self.share(s, o.v) for row in self.ops
                   for s, ops in enumerate(row) for o in ops)

    @property
    def ticks(self) -> int:
        return len(self.ops)

    def chunk(self, stage: int, v: int) -> int:
        return v * self.stages + stage

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def idle_units(self) -> float:
        """F-units the stages wait: each stage's share of the ticks less its own work."""
        return self.stages * self.cost() - self.work()

    def bubble(self) -> float:
        """Idle F-units over all stages' F-units of the executed table."""
        return self.idle_units() / (self.stages * self.cost())

    def analytic_bubble(self) -> float:
        """(S-1)/(M+S-1) for V = 1; (S-1)/(V*M+S-1) interleaved (Narayanan et al. 2021).
        zb-h1's (S-1)/(3M+S-1) (Qi et al. 2023) needs W to fill the cool-down, which
        lockstep ticks cannot (see the module's docstring): 1F1B's here."""
        S, V, M = self.stages, self.virtual, self.microbatches
        return (S - 1) / (V * M + S - 1)

    def sends(self, t: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(forward, backward) stage pairs (source, target) of the messages sent at tick t:
        a forward's output unless it is the last chunk's, the input gradient of a backward
        (BACK or B) unless it is the first chunk's."""
        S, fwd, bwd = self.stages, [], []
        for s, ops in enumerate(self.ops[t]):
            for op in ops:
                c = self.chunk(s, op.v)
                if op.kind == FWD and c < self.chunks - 1:
                    fwd.append((s, (s + 1) % S))
                if op.kind in (BACK, BWD) and c > 0:
                    bwd.append((s, (s - 1) % S))
        return fwd, bwd

    def gradients_final(self) -> tuple[int, ...]:
        """Per virtual chunk v: the first tick after which no stage computes a weight
        gradient of its chunk v (BACK or W), so chunk v's gradients are final on every
        stage and its data-axis reduction can start (jaxdist/pipeline/step.py). Under
        interleaved schedules chunk v > 0 is final before the last tick; chunk 0, and the
        single chunk of V = 1, at the end (`ticks`)."""
        last = [0] * self.virtual
        for t, row in enumerate(self.ops):
            for ops in row:
                for op in ops:
                    if op.kind in (BACK, WGT):
                        last[op.v] = max(last[op.v], t + 1)
        return tuple(last)

    def summary(self) -> dict:
        return {"schedule": self.name, "stages": self.stages, "virtual": self.virtual,
                "microbatches": self.microbatches, "ticks": self.ticks,
                "idle_units": self.idle_units(),
                "bubble": self.bubble(), "analytic_bubble": self.analytic_bubble(),
                "cost_f_units": self.cost(),
                "live_activation_slots": self.act_slots, "gradient_slots": self.grad_slots,
                "residual_slots": self.res_slots,
                "residual_slots_by_stage": self.res_slots_by_stage,
                "combined_f_back": self.combined,
                **({"stage_blocks": [sum(row) for row in self.blocks],
                    "chunk_blocks": [list(row) for row in self.blocks]}
                   if self.blocks else {})}


def _orders(name: str, S: int, V: int, M: int) -> list[tuple[list, list]]:
    """Each stage's (forwards, backwards) as (micro-batch, v), in the order it runs them."""
    if V == 1:
        order = [(m, 0) for m in range(M)]
        return [(order, order) for _ in range(S)]
    # Interleaved (Megatron-LM's order): micro-batches go through a stage's chunks in
    # groups of S, forwards over v = 0..V-1, backwards over v = V-1..0.
    def fwd_key(k):  # k-th forward of a stage -> (micro-batch, v)
        group, within = divmod(k, S * V)
        return group * S + within % S, within // S

    def bwd_key(k):
        mb, v = fwd_key(k)
        return mb, V - 1 - v

    return [([fwd_key(k) for k in range(M * V)], [bwd_key(k) for k in range(M * V)])
            for _ in range(S)]


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1,
                   blocks: tuple = (), combined: bool = False) -> Schedule:
    """`blocks`: each chunk's blocks, blocks[s][v] (jaxdist/pipeline/parts.py chunk_blocks),
    which weigh the operations' costs; () counts every chunk alike. `combined`: a tick's
    F and BACK run as one computation, so no tick's BACK may depend on its own F: the last
    chunk's backward (whose gradient its forward makes, with the head) runs a tick after
    that forward, not in the same tick (one more micro-batch stashed there, the backward
    wave one tick later), and every tick's F and BACK on a stage are of different
    micro-batches (Megatron-Core's combined 1F1B)."""
    S, M = stages, microbatches
    V = virtual if name == "interleaved" else 1
    check_schedule(name, S, M, V, combined)
    sched = Schedule(name, S, V, M, blocks=tuple(tuple(row) for row in blocks),
                     combined=combined)
    split = sched.split_backward
    back = BWD if split else BACK  # the op that makes (and sends) the input gradient
    orders = _orders(name, S, V, M)
    pos = [[0, 0] for _ in range(S)]  # next forward, next backward of each stage
    done: dict[tuple[int, int, int], int] = {}  # (kind, chunk, mb) -> tick it ran
    slots = {k: [{} for _ in range(S)] for k in ("act", "grad", "res")}  # (v, mb) -> slot
    free = {k: [[] for _ in range(S)] for k in slots}
    count = {k: [0] * S for k in slots}
    last = S * V - 1

    def take(kind, s, key):
        if free[kind][s]:
            slot = free[kind][s].pop(0)
        else:
            slot, count[kind][s] = count[kind][s], count[kind][s] + 1
        slots[kind][s][key] = slot
        return slot

    def sent_by(t, src, kinds):
        return next(o for o in sched.ops[t][src] if o.kind in kinds)

    t = 0
    while any(pos[s][0] < len(orders[s][0]) or pos[s][1] < len(orders[s][1])
              for s in range(S)):
        if t > 4 * (V * M + S) + 8:
            raise RuntimeError(f"schedule {name} S={S} V={V} M={M} deadlocked")
        # Arrivals: what was sent at tick t-1 is in its slot at the start of tick t.
        recv = [[-1, -1] for _ in range(S)]
        if t > 0:
            fwd_pairs, bwd_pairs = sched.sends(t - 1)
            for src, dst in fwd_pairs:
                op = sent_by(t - 1, src, (FWD,))
                recv[dst][0] = take("act", dst, (op.v + (1 if dst == 0 else 0), op.mb))
            for src, dst in bwd_pairs:
                op = sent_by(t - 1, src, (back,))
                recv[dst][1] = take("grad", dst, (op.v - (1 if src == 0 else 0), op.mb))
        row, row_slots = [], []
        for s in range(S):
            ops, op_slots = [], []
            forwards, backwards = orders[s]
            if pos[s][0] < len(forwards):
                mb, v = forwards[pos[s][0]]
                c = v * S + s
                if c == 0 or done.get((FWD, c - 1, mb), t) < t:
                    pos[s][0] += 1
                    done[(FWD, c, mb)] = t
                    key = (v, mb)
                    # the last chunk's forward also makes its gradient (the head's backward)
                    ops.append(Op(FWD, mb, v))
                    op_slots.append((slots["act"][s].get(key, -1),
                                     take("grad", s, key) if c == last else -1,
                                     take("res", s, key)))
            # GPipe: every forward of the stage before its first backward
            if pos[s][1] < len(backwards) and (name != "gpipe" or
                                               pos[s][0] == len(forwards)):
                mb, v = backwards[pos[s][1]]
                c = v * S + s
                if done.get((FWD, c, mb), t + 1) <= t - int(combined and c == last) and (
                        c == last or done.get((back, c + 1, mb), t) < t):
                    pos[s][1] += 1
                    done[(back, c, mb)] = t
                    key = (v, mb)
                    held = tuple(slots[k][s].get(key, -1) for k in ("act", "grad", "res"))
                    ops += [Op(back, mb, v)] + ([Op(WGT, mb, v)] if split else [])
                    op_slots += [held] * (2 if split else 1)
                    for kind in slots:  # the backward is their last use
                        if key in slots[kind][s]:
                            free[kind][s].append(slots[kind][s].pop(key))
            row.append(tuple(ops))
            row_slots.append(tuple(op_slots))
        sched.ops.append(row)
        sched.slots.append(row_slots)
        sched.recv_slots.append([tuple(r) for r in recv])
        t += 1
    sched.act_slots_by_stage = list(count["act"])
    sched.res_slots_by_stage = list(count["res"])
    sched.act_slots = max(max(count["act"]), 1)
    sched.grad_slots = max(max(count["grad"]), 1)
    sched.res_slots = max(max(count["res"]), 1)
    return sched


def check_schedule(name: str, stages: int, microbatches: int, virtual: int,
                   combined: bool = False) -> None:
    if name not in SCHEDULES:
        raise UsageError(f"unknown --pp-schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if combined and name not in COMBINABLE:
        raise UsageError(f"--pp-combined-1f1b runs each tick's forward and backward as one "
                         f"computation, which --pp-schedule {name} has no steady state of; "
                         f"use --pp-schedule {' or '.join(COMBINABLE)}")
    if microbatches < 1:
        raise UsageError(f"--microbatches must be a positive integer, got {microbatches}")
    if virtual < 1:
        raise UsageError(f"--pp-virtual must be a positive integer, got {virtual}")
    if name in ("1f1b", "interleaved", "zb-h1") and microbatches < stages:
        raise UsageError(f"--pp-schedule {name} needs at least as many micro-batches as "
                         f"stages: --microbatches {microbatches} < stage={stages}; use "
                         f"--microbatches {stages} or more (or --pp-schedule gpipe)")
    if name == "interleaved" and microbatches % stages:
        raise UsageError(f"--pp-schedule interleaved sends micro-batches round the stages in "
                         f"groups of stage={stages}: --microbatches {microbatches} is not a "
                         f"multiple of {stages}")
