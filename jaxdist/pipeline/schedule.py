"""Pipeline schedules as tables: for every tick and stage, what that stage does.

A schedule is built by simulating its stages tick by tick: each stage has an ordered list of
operations on one micro-batch and one of its model chunks, and runs the next one as soon as
its input has arrived (an activation sent by the stage before at an earlier tick, or a
gradient sent by the stage after). A tick is one forward's worth of work (one F-unit) and
holds at most one operation per stage:
- F (FWD): a chunk's forward;
- B (BWD): the input gradient, the forward recomputed from the stored input under `jax.vjp`,
  whose residuals are kept for W;
- W (WGT): the weight gradient, from the residuals B kept (no forward run again).
A backward is B then W (B = 2F, as in the papers' cost tables), so every tick costs the same
on every stage and the ticks need not run in lockstep phases of different lengths: with
one-op ticks of a backward each, a 1F1B tick that held a forward on one stage and a backward
on its neighbour lasted a backward (S=4, M=8: 40 F-units against GPipe's 33); split into
units, 1F1B's table has GPipe's (M+S-1)(F+B) units and keeps about S activations, not M.
gpipe, 1f1b and interleaved run W right after B and send the input gradient after W (their
backward is one 2-unit operation, as Megatron's); zb-h1 (Qi et al. 2023) sends it right
after B and runs W later, where the stage would otherwise idle. The bubble is *counted*
from the table (idle stage-ticks / all stage-ticks), not assumed.

Chunks: with V virtual stages per device (interleaved), the model is cut into S*V
contiguous chunks and chunk c = v*S + s lives on stage s, so activations go round the ring
of stages V times (Narayanan et al. 2021). V = 1 for gpipe and 1f1b.

Slots: a stage keeps each received activation (the input of one of its chunk forwards, needed
again by the backward, which recomputes from it) and each received gradient in a slot of a
fixed-size buffer from arrival until its W ran, and B's residuals from B until W; the table
says which slot. The number of activation slots is the schedule's live activation count: M
for GPipe, about S for 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxdist.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
IDLE, FWD, BWD, WGT = 0, 1, 2, 3


# The cost of each operation in F-units (one tick each): a backward is B + W = 2F.
UNITS = {FWD: 1, BWD: 1, WGT: 1}


@dataclass(frozen=True)
class Op:
    kind: int   # FWD, BWD (the input gradient, "B") or WGT (the weight gradient, "W")
    mb: int     # micro-batch
    v: int      # virtual chunk index on this stage (chunk = v * S + stage)


@dataclass
class Schedule:
    name: str
    stages: int
    virtual: int
    microbatches: int
    # ops[t][s]: the Op stage s runs at tick t, or None (idle)
    ops: list[list[Op | None]] = field(default_factory=list)
    # slot[t][s] per op: (activation slot read, gradient slot read); -1 where none
    read_slots: list[list[tuple[int, int]]] = field(default_factory=list)
    # arrivals at the start of tick t on stage s: (activation slot or -1, gradient slot or -1)
    recv_slots: list[list[tuple[int, int]]] = field(default_factory=list)
    act_slots: int = 0
    grad_slots: int = 0
    act_slots_by_stage: list[int] = field(default_factory=list)
    # read_res[t][s]: the residual slot B writes or W reads at tick t (-1: none)
    read_res: list[list[int]] = field(default_factory=list)
    res_slots: int = 0

    @property
    def split_backward(self) -> bool:
        """ZB-H1: the input gradient is sent on as soon as B ran, and W runs later to fill
        the bubble. The other schedules run W right after B and send after W."""
        return self.name == "zb-h1"

    def stage_ops(self, t: int, s: int) -> tuple[Op, ...]:
        """The operations stage s runs at tick t (at most one; each costs UNITS[kind])."""
        op = self.ops[t][s]
        return () if op is None else (op,)

    def cost(self, units: dict[int, float] | None = None) -> float:
        """The step's length in F-units as executed: each tick lasts as long as its busiest
        stage (the sum of the costs of its operations), ticks one after the other."""
        units = UNITS if units is None else units
        return sum(max((sum(units[o.kind] for o in self.stage_ops(t, s))
                        for s in range(self.stages)), default=0)
                   for t in range(self.ticks))

    @property
    def ticks(self) -> int:
        return len(self.ops)

    def chunk(self, stage: int, v: int) -> int:
        return v * self.stages + stage

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def idle_stage_ticks(self) -> int:
        return sum(op is None for row in self.ops for op in row)

    def bubble(self) -> float:
        """Idle stage-ticks over all stage-ticks, as executed (each tick = one F-unit op)."""
        return self.idle_stage_ticks() / (self.ticks * self.stages)

    def analytic_bubble(self) -> float:
        """(S-1)/(M+S-1) for V = 1; (S-1)/(V*M+S-1) interleaved (Narayanan et al. 2021);
        ZB-H1 (Qi et al. 2023, Zero Bubble Pipeline Parallelism, Sec. 2: with F, B and W
        of equal length the bubble is (S-1) of the 3M + S - 1 units): (S-1)/(3M+S-1).
        With B = W = F every tick is one unit, so these are also the counted fractions."""
        S, V, M = self.stages, self.virtual, self.microbatches
        if self.split_backward:
            return (S - 1) / (3 * M + S - 1)
        return (S - 1) / (V * M + S - 1)

    def sends(self, t: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(forward, backward) stage pairs (source, target) of the messages sent at tick t."""
        S, fwd, bwd = self.stages, [], []
        # The input gradient leaves with the op that ends the backward: B for zb-h1, W else.
        ends_backward = BWD if self.split_backward else WGT
        for s, op in enumerate(self.ops[t]):
            if op is None:
                continue
            c = self.chunk(s, op.v)
            if op.kind == FWD and c < self.chunks - 1:
                fwd.append((s, (s + 1) % S))
            if op.kind == ends_backward and c > 0:
                bwd.append((s, (s - 1) % S))
        return fwd, bwd

    def summary(self) -> dict:
        return {"schedule": self.name, "stages": self.stages, "virtual": self.virtual,
                "microbatches": self.microbatches, "ticks": self.ticks,
                "idle_stage_ticks": self.idle_stage_ticks(),
                "bubble": self.bubble(), "analytic_bubble": self.analytic_bubble(),
                "cost_f_units": self.cost(),
                "live_activation_slots": self.act_slots, "gradient_slots": self.grad_slots,
                "residual_slots": self.res_slots}


def _orders(name: str, S: int, V: int, M: int) -> list[list[Op]]:
    """Each stage's operations in the order it runs them."""
    if name == "gpipe":
        return [[Op(FWD, i, 0) for i in range(M)] + [Op(BWD, i, 0) for i in range(M)]
                for _ in range(S)]
    if name in ("1f1b", "zb-h1"):  # zb-h1: the same F and B order; W added as it runs
        orders = []
        for s in range(S):
            warm = min(S - 1 - s, M)
            order = [Op(FWD, i, 0) for i in range(warm)]
            for i in range(M - warm):
                order += [Op(FWD, warm + i, 0), Op(BWD, i, 0)]
            order += [Op(BWD, i, 0) for i in range(M - warm, M)]
            orders.append(order)
        return orders
    # Interleaved 1F1B (Megatron-LM's order): micro-batches go through the chunks of a
    # stage in groups of S; warm-up of (S - s - 1) * 2 + (V - 1) * S forwards.
    def fwd_key(k):  # k-th forward of a stage -> (micro-batch, v)
        group, within = divmod(k, S * V)
        return group * S + within % S, within // S

    def bwd_key(k):
        mb, v = fwd_key(k)
        return mb, V - 1 - v

    total = M * V
    orders = []
    for s in range(S):
        warm = min((S - s - 1) * 2 + (V - 1) * S, total)
        order = [Op(FWD, *fwd_key(k)) for k in range(warm)]
        for k in range(total - warm):
            order += [Op(FWD, *fwd_key(warm + k)), Op(BWD, *bwd_key(k))]
        order += [Op(BWD, *bwd_key(k)) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    S, M = stages, microbatches
    V = virtual if name == "interleaved" else 1
    check_schedule(name, S, M, V)
    sched = Schedule(name, S, V, M)
    split = sched.split_backward
    orders = _orders(name, S, V, M)
    if not split:  # W right after its B: the two halves of one backward
        orders = [[o for op in order for o in ((op, Op(WGT, op.mb, op.v)) if op.kind == BWD
                                                else (op,))] for order in orders]
    ends_backward = BWD if split else WGT  # the op after which the input gradient is sent
    pos = [0] * S
    done: dict[tuple[int, int, int], int] = {}  # (kind, chunk, mb) -> tick finished
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

    def release(kind, s, key):
        if key in slots[kind][s]:
            free[kind][s].append(slots[kind][s].pop(key))

    in_flight, pending_w = [0] * S, [[] for _ in range(S)]
    t = 0
    while any(pos[s] < len(orders[s]) or pending_w[s] for s in range(S)):
        if t > 9 * (V * M + S) + 8:
            raise RuntimeError(f"schedule {name} S={S} V={V} M={M} deadlocked")
        # Arrivals: what was sent at tick t-1 is in its slot at the start of tick t.
        recv = [[-1, -1] for _ in range(S)]
        if t > 0:
            fwd_pairs, bwd_pairs = sched.sends(t - 1)
            prev = sched.ops[t - 1]
            for src, dst in fwd_pairs:
                op = prev[src]
                recv[dst][0] = take("act", dst, (op.v + (1 if dst == 0 else 0), op.mb))
            for src, dst in bwd_pairs:
                op = prev[src]
                recv[dst][1] = take("grad", dst, (op.v - (1 if src == 0 else 0), op.mb))
        row, reads, res = [], [], []
        for s in range(S):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if op is not None:
                c = op.v * S + s
                if op.kind == FWD:
                    ready = c == 0 or done.get((FWD, c - 1, op.mb), t) < t
                    # ZB-H1 keeps 1F1B's peak memory: at most S micro-batches between
                    # their F and their W on any stage, so a W goes first when full.
                    if split and in_flight[s] >= S and pending_w[s]:
                        ready = False
                elif op.kind == BWD:
                    ready = done.get((FWD, c, op.mb), t) < t and (
                        c == last or done.get((ends_backward, c + 1, op.mb), t) < t)
                else:
                    ready = done.get((BWD, c, op.mb), t) < t
                if not ready:
                    op = None
                else:
                    pos[s] += 1
            if op is None and split and pending_w[s]:  # a W fills what would be a bubble
                op = Op(WGT, *pending_w[s].pop(0))
            row.append(op)
            if op is None:
                reads.append((-1, -1))
                res.append(-1)
                continue
            key = (op.v, op.mb)
            a = slots["act"][s].get(key, -1)
            g = slots["grad"][s].get(key, -1) if op.kind != FWD else -1
            reads.append((a, g))
            res.append(take("res", s, key) if op.kind == BWD else
                       slots["res"][s].get(key, -1))
            if split:
                in_flight[s] += {FWD: 1, BWD: 0, WGT: -1}[op.kind]
                if op.kind == BWD:
                    pending_w[s].append((op.mb, op.v))
            if op.kind == WGT:  # the last use of the input, the gradient and the residuals
                for kind in slots:
                    release(kind, s, key)
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.v * S + s, op.mb)] = t
        sched.ops.append(row)
        sched.read_slots.append(reads)
        sched.read_res.append(res)
        sched.recv_slots.append([tuple(r) for r in recv])
        t += 1
    sched.act_slots_by_stage = list(count["act"])
    sched.act_slots = max(max(count["act"]), 1)
    sched.grad_slots = max(max(count["grad"]), 1)
    sched.res_slots = max(max(count["res"]), 1)
    return sched


def check_schedule(name: str, stages: int, microbatches: int, virtual: int) -> None:
    if name not in SCHEDULES:
        raise UsageError(f"unknown --pp-schedule {name!r}; choose from {', '.join(SCHEDULES)}")
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
