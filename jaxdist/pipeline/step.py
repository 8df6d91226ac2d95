"""The pipelined train step: one jitted program driven by a schedule table.

`shard_map` over the `stage` axis only (data, fsdp and tensor stay with the SPMD partitioner,
so tp_pp and fsdp_pp are the tp / fsdp placement of each stage's weights). The loop runs
the table (jaxdist/pipeline/schedule.py) tick by tick; a tick is a fixed sequence of
operation slots (F then BACK; zb-h1: F, B, W), and at each slot each stage looks up its own
operation by its stage index and runs it under a `lax.switch` (idle, or one of the
schedule's kinds), so an idle slot computes nothing (unlike MaxText's circular pipeline,
which computes and discards it). Messages go out in one `ppermute` per direction whose
source-target pairs are exactly the stages that send, so the compiled step moves no byte
the schedule does not (the `comm` block counts them): under F then BACK beside the next
operation (OverlappedSends: tick t's activations during its BACK, its input gradients
during tick t+1's F), under zb-h1 after the tick's last slot.
In 1F1B's steady state every stage runs an F and a BACK in the same tick, so no tick holds
one stage's forward against its neighbour's backward: ticks cost F + BACK everywhere.
Combined tables (--pp-combined-1f1b, Schedule.combined) run a tick's F and BACK under one
switch (`operate_both`: idle, F, BACK or both), each tick's two sends in the same branch
(CombinedSends), so XLA:GPU overlaps one operation's tensor-parallel collectives with the
other's matmuls; the step is compiled with XLA's collective combiners off
(jaxdist/pipeline/program.py COMBINED_TICK_OPTIONS).

One `lax.scan` runs the ticks (F then BACK: a switch per slot, copied once per pair set
sent beside it; zb-h1: one scan step per slot, its switch and one switch of send
patterns), so compile time does not grow with S or M. Where a virtual chunk's gradients
are final on every stage before the last tick (interleaved: chunk v > 0,
`Schedule.gradients_final`), the loop is cut there into one scan per such tick and the
chunk's data-axis reduction is issued between them (`DataMean`; the distributed
optimizer's reduce-scatter: jaxdist/pipeline/program.py), so XLA:GPU's scheduler keeps it
in flight beside the remaining ticks; chunk 0 (all of V = 1) is reduced after the last.

Memory: F stashes what its backward needs (the vjp's residuals: jaxdist/pipeline/ops.py)
in one of `res_slots` slots (the schedule's count: M for GPipe, at most 2S-1 for 1F1B), and
the received activation in one of `act_slots`; BACK (or B and W) reads them and runs no
second forward, unless --remat asks for per-block recomputation.

Placement of embeddings and head: they are small next to the blocks (gpt3-175b: 0.6 B of
175 B parameters), so every stage holds them (`shared`), the first chunk's stage uses the
embeddings and the last chunk's the head; their gradients are summed over stages.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.pipeline.ops import ChunkOps
from jaxdist.pipeline.parts import Parts
from jaxdist.pipeline.schedule import BACK, BWD, FWD, IDLE, WGT, Schedule
from models.sequence_parallel import pin_sequence_shards


def _tables(sched: Schedule) -> dict[str, np.ndarray]:
    """The schedule as integer arrays [slot, stage], slot = tick * len(kinds) + the kind's
    place in the tick: which operation (0 idle, else 1 + its index in sched.kinds), on
    which micro-batch and chunk, with which slots; arrivals at a tick's first slot."""
    T, S, n = sched.ticks, sched.stages, len(sched.kinds)
    tab = {k: np.zeros((T * n, S), np.int32) for k in ("op", "mb", "v")}
    tab.update({k: np.full((T * n, S), -1, np.int32)
                for k in ("act", "grad", "res", "recv_act", "recv_grad")})
    for t in range(T):
        for s in range(S):
            tab["recv_act"][t * n, s], tab["recv_grad"][t * n, s] = sched.recv_slots[t][s]
            for op, (a, g, r) in zip(sched.ops[t][s], sched.slots[t][s]):
                k = sched.kinds.index(op.kind)
                u = t * n + k
                tab["op"][u, s], tab["mb"][u, s], tab["v"][u, s] = k + 1, op.mb, op.v
                tab["act"][u, s], tab["grad"][u, s], tab["res"][u, s] = a, g, r
    return tab


def send_patterns(sched: Schedule) -> tuple[list[tuple], np.ndarray]:
    """(patterns, pattern index per slot): the distinct (forward pairs, backward pairs) of
    the ticks' sends, in first-use order; a tick sends after its last slot, the other slots
    take the pattern that sends nothing. The loop runs a `lax.switch` over them, one branch
    per pattern holding exactly that pattern's ppermutes."""
    n = len(sched.kinds)
    patterns, index = [], np.zeros(sched.ticks * n, np.int32)
    for u in range(sched.ticks * n):
        t, k = divmod(u, n)
        fwd_pairs, bwd_pairs = sched.sends(t) if k == n - 1 else ([], [])
        key = (tuple(fwd_pairs), tuple(bwd_pairs))
        if key not in patterns:
            patterns.append(key)
        index[u] = patterns.index(key)
    return patterns, index


def pattern_runs(sched: Schedule) -> list[int]:
    """How many slots take each send pattern's branch (the order of `send_patterns`)."""
    patterns, index = send_patterns(sched)
    return [int((index == k).sum()) for k in range(len(patterns))]


# Per direction, the stage-pair sets whose sends the tick loop issues beside the next
# operation (the most frequent non-empty ones: a 1F1B or interleaved steady state's).
OVERLAP_SETS = 2


@dataclass(frozen=True)
class OverlappedSends:
    """How a tick loop of F then BACK (gpipe, 1f1b, interleaved) moves its messages: each
    rides beside the next operation of the stage loop, as Megatron's
    --overlap-p2p-communication does. Tick t's F outputs go out during tick t's BACK slot
    (the receiver's F reads them at t+1); tick t's input gradients during tick t+1's F slot
    (the receiver's BACK reads them at t+1, after F). `sets[k]`: the pair sets sent beside
    slot k's operation (slot 0: backward pairs, slot 1: forward pairs), one branch each of
    slot k's switch, each branch holding the slot's operation switch and that one ppermute,
    so XLA:GPU schedules the permute's start before the operation and its done after it.
    `choice[t, k]`: the branch of tick t's slot k (len(sets[k]): a set not among them, or
    nothing to send, whose sends `exposed[k]` / `exposed_choice[t, k]` run after the
    operation, in a switch of their own)."""
    sets: tuple[tuple[tuple, ...], tuple[tuple, ...]]
    choice: np.ndarray
    exposed: tuple[tuple[tuple, ...], tuple[tuple, ...]]
    exposed_choice: np.ndarray


def slot_pairs(sched: Schedule, t: int, k: int) -> tuple:
    """Slot 0 of tick t carries tick t-1's backward sends, slot 1 tick t's forward sends."""
    if k == 0:
        return tuple(sched.sends(t - 1)[1]) if t > 0 else ()
    return tuple(sched.sends(t)[0])


def overlapped_sends(sched: Schedule, most: int = OVERLAP_SETS) -> OverlappedSends | None:
    """The tick loop's sends beside operations (OverlappedSends), or None where the table
    is not F then BACK (zb-h1: its sends follow the tick's last slot, exposed)."""
    if tuple(sched.kinds) != (FWD, BACK):
        return None
    T = sched.ticks
    if sched.sends(T - 1)[1]:
        raise ValueError("the last tick sends an input gradient no tick receives")
    sets, exposed = [], []
    choice, exposed_choice = np.zeros((T, 2), np.int32), np.zeros((T, 2), np.int32)
    for k in range(2):
        every = [slot_pairs(sched, t, k) for t in range(T)]
        counts = Counter(p for p in every if p)  # in one pass: tables run to 1e4 ticks
        chosen = tuple(sorted(counts, key=lambda p: (-counts[p], p))[:most])
        rest = ((),) + tuple(sorted({p for p in every if p and p not in chosen}))
        at_chosen = {p: i for i, p in enumerate(chosen)}
        at_rest = {p: i for i, p in enumerate(rest)}
        for t, p in enumerate(every):
            choice[t, k] = at_chosen.get(p, len(chosen))
            exposed_choice[t, k] = at_rest[p] if p not in at_chosen else 0
        sets.append(chosen)
        exposed.append(rest)
    return OverlappedSends(tuple(sets), choice, tuple(exposed), exposed_choice)


@dataclass(frozen=True)
class CombinedSends:
    """How a combined tick loop (Schedule.combined) moves its messages: a tick's F and BACK
    run as one computation with tick t-1's input gradients sent at its start (BACK reads
    the one it receives) and F's output sent once F has made it, beside BACK. `sets`: the
    (gradient pairs, activation pairs) of the most frequent ticks, one branch each holding
    both ppermutes and the operations; `choice[t]`: tick t's branch (len(sets): another
    pair set, whose gradients `exposed[0][exposed_choice[t, 0]]` are sent before the
    operations and activations `exposed[1][exposed_choice[t, 1]]` after them)."""
    sets: tuple[tuple[tuple, tuple], ...]
    choice: np.ndarray
    exposed: tuple[tuple[tuple, ...], tuple[tuple, ...]]
    exposed_choice: np.ndarray


def combined_sends(sched: Schedule, most: int = OVERLAP_SETS) -> CombinedSends:
    """The combined tick loop's sends (CombinedSends): the `most` most frequent pair sets
    beside the operations, the rest exposed."""
    T = sched.ticks
    every = [(slot_pairs(sched, t, 0), slot_pairs(sched, t, 1)) for t in range(T)]
    counts = Counter(p for p in every if p != ((), ()))
    chosen = tuple(sorted(counts, key=lambda p: (-counts[p], p))[:most])
    at_chosen = {p: i for i, p in enumerate(chosen)}
    rest = tuple(((),) + tuple(sorted({p[k] for p in every if p not in at_chosen and p[k]}))
                 for k in (0, 1))
    at_rest = [{p: i for i, p in enumerate(r)} for r in rest]
    choice, exposed_choice = np.zeros(T, np.int32), np.zeros((T, 2), np.int32)
    for t, p in enumerate(every):
        choice[t] = at_chosen.get(p, len(chosen))
        for k in (0, 1):
            exposed_choice[t, k] = 0 if p in at_chosen else at_rest[k][p[k]]
    return CombinedSends(chosen, choice, rest, exposed_choice)


def loop_stretches(sched: Schedule) -> list[tuple[int, int]]:
    """(first tick, end) of each scan of a tick loop that reduces chunks over data as soon
    as they are final: the ticks cut where some chunk's gradients become final on every
    stage before the last tick (`Schedule.gradients_final`)."""
    bounds = [0, *sorted({r for r in sched.gradients_final() if r < sched.ticks}),
              sched.ticks]
    return list(zip(bounds[:-1], bounds[1:]))


class DataMean:
    """The gradients' mean over the data axis, issued per virtual chunk as soon as the tick
    loop has finished it (`chunk`: a chunk's [K, ...] gradients, inside the map), then
    `stages` (the reduced chunks in order, and the loop's whole [V, K, ...] buffer) -> the
    stage gradients the map returns (less their stage dimension), `shared` -> the shared
    ones. This one all-reduces (pmean); the distributed optimizer's reduce-scatters
    (jaxdist/pipeline/program.py)."""

    def __init__(self, axis: str):
        self.axis = axis

    def chunk(self, v: int, g):
        return jax.lax.pmean(g, self.axis)

    def stages(self, reduced: list, g_local):
        return jax.tree.map(lambda *g: jnp.stack(g), *reduced)

    def shared(self, g):
        return jax.lax.pmean(g, self.axis)


def stage_sum(g_shared):
    """The embeddings' and head's gradients summed over the stages that use them (inside the
    map), in float32 (XLA:CPU aborts promoting a bf16 sum over stage once the distributed
    optimizer's reductions follow it: "Invalid binary instruction opcode copy")."""
    return jax.tree.map(lambda g: jax.lax.psum(g.astype(jnp.float32), "stage").astype(g.dtype),
                        g_shared)


def _store(buffer, slot, value):
    """buffer[slot] = value where slot >= 0 (in place); unchanged otherwise."""
    i = jnp.maximum(slot, 0)
    return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))


def _read(buffer, slot):
    return jnp.where(slot >= 0, buffer[jnp.maximum(slot, 0)], jnp.zeros_like(buffer[0]))


class Carry(NamedTuple):
    """What the tick loop carries on a stage, and a switch branch's state: the slots that
    received messages, F's stash, B's kept values (zb-h1), the accumulators and the tick's
    outgoing messages."""
    acts: Any          # [act_slots, ...] activations received
    grads: Any         # [grad_slots, ...] input gradients received (and the head's)
    stash: tuple       # per residual: [res_slots, ...] what F saved for the backward
    kept: tuple        # what B keeps for W (zb-h1), else ()
    g_local: Any       # the stage's chunks' gradients [V, K, ...]
    g_shared: Any      # the embeddings' and head's gradients
    loss_sum: Any      # the loss summed over the micro-batches this stage ended
    y_out: Any         # the activation this slot sends on
    dx_out: Any        # the input gradient this slot sends back

    @property
    def acc(self) -> Acc:
        return Acc(*self[3:])


class Acc(NamedTuple):
    """What a switch branch updates (a slot's operation): the Carry less the slots."""
    kept: tuple
    g_local: Any
    g_shared: Any
    loss_sum: Any
    y_out: Any
    dx_out: Any


class Messages(NamedTuple):
    """The scan's carry: the stage's Carry and what its neighbours sent at the tick
    before (an activation forward, an input gradient back)."""
    state: Carry
    fwd_in: Any
    bwd_in: Any


@dataclass(frozen=True)
class Stage:
    """One stage's view of the step inside the map over `stage`: its index `s`, the
    schedule's table, its chunks' parameters (and FP8 weights), the shared parameters, the
    micro-batches' tokens; what every operation reads."""
    sched: Schedule
    ops: ChunkOps
    parts: Parts
    s: Any                  # this stage's index (traced)
    table: dict             # the op table's arrays (_tables) as jnp arrays
    counts: Any             # [S, V]: each chunk's own blocks
    local: Any              # the stage's parameters [V, K, ...]
    quantized: Any          # their FP8 weights, quantized once per step
    shared: Any
    tokens: Any             # [M, b, L+1]
    act_dtype: Any
    zeros_act: Any

    def chunk(self, v):
        """(parameters, FP8 weights) of chunk v (jaxdist/pipeline/ops.py)."""
        both = (self.local, self.quantized)
        return jax.tree.map(lambda a: a[v], both) if self.sched.virtual > 1 else \
            jax.tree.map(lambda a: a[0], both)

    def pinned(self, x, leading=0):
        """A message (`leading` 1: a buffer of them) as the blocks' sequence shards under
        sequence parallelism: kept and sent as 1/T of the sequence per tensor device."""
        return pin_sequence_shards(x, self.parts.sequence_parallel, leading)

    def row(self, u, keys=None) -> dict:
        return {k: self.table[k][u, self.s] for k in (keys or self.table)}


@dataclass(frozen=True)
class Slot:
    """Slot u's operation on a stage, as its switch branches read it: the table's row, the
    chunk and micro-batch it names and the activation it reads (read once, before the
    switch). `arrived`: the input gradient this tick receives, read from there, not from
    its slot (where it lands after the tick's operations: combined ticks)."""
    stage: Stage
    state: Carry
    u: Any
    row: dict
    v: Any
    is_first: Any
    is_last: Any
    tokens: Any
    chunk: Any
    x: Any
    arrived: Any = None

    @classmethod
    def at(cls, stage: Stage, state: Carry, u, arrived=None) -> Slot:
        sched, s = stage.sched, stage.s
        row = stage.row(u)
        v = row["v"]
        is_first = (s == 0) & (v == 0)
        is_last = (s == sched.stages - 1) & (v == sched.virtual - 1)
        tokens = stage.tokens[row["mb"]]
        chunk, x = stage.chunk(v), _read(state.acts, row["act"])
        return cls(stage, state, u, row, v, is_first, is_last, tokens, chunk, x, arrived)

    def gradient(self):
        held = _read(self.state.grads, self.row["grad"])
        if self.arrived is None:
            return held
        st = self.stage
        landing = st.table["recv_grad"][self.u - self.u % len(st.sched.kinds), st.s]
        return jnp.where((self.row["grad"] >= 0) & (self.row["grad"] == landing),
                         self.arrived, held)

    # The stash and the gradient slots are written outside the switch (`keep`), and only
    # read inside it: a buffer that one branch updated in place and another passed through
    # was copied whole at every slot (XLA's copy insertion).
    def backward_inputs(self):
        return ([_read(b, self.row["res"]) for b in self.state.stash], self.chunk,
                self.stage.shared, self.x, self.gradient())

    def nothing(self):
        """What a branch other than F writes to the stash: nothing."""
        return [jnp.zeros(b.shape[1:], b.dtype) for b in self.state.stash], \
            self.stage.zeros_act

    def accumulate(self, acc: Acc, d_chunk, d_shared) -> Acc:
        v = self.v if self.stage.sched.virtual > 1 else 0
        return acc._replace(
            g_local=jax.tree.map(lambda g, d: g.at[v].add(d), acc.g_local, d_chunk),
            g_shared=jax.tree.map(jnp.add, acc.g_shared, d_shared))


# The operations a slot can run, as switch branches: (Slot, Acc) -> (Acc, stash writes,
# gradient-slot write). Each stage runs only its own operation (lax.switch on its row).
# Collectives inside a branch stay within one stage (its data / tensor group), which takes
# that branch as a whole; the ppermutes between stages are outside.

def idle(slot: Slot, acc: Acc):
    return (acc, *slot.nothing())


def forward(slot: Slot, acc: Acc):
    """F: the stash for the backward; the last chunk's head and its backward at once, its
    gradient into the chunk's output."""
    st = slot.stage
    y, aux, stored = st.ops.forward(slot.chunk, st.shared, slot.x, slot.tokens, slot.is_first,
                                    st.counts[st.s, slot.v])

    def head(a):
        ls, g_s, dh = a
        loss, dh, d_own = st.ops.head(st.shared, y, slot.tokens)
        g_s = {**g_s, **{k: jax.tree.map(jnp.add, g_s[k], d) for k, d in d_own.items()}}
        return ls + loss, g_s, dh
    ls, g_s, dh = jax.lax.cond(slot.is_last, head, lambda a: a,
                               (acc.loss_sum + aux, acc.g_shared, st.zeros_act))
    acc = acc._replace(g_shared=g_s, loss_sum=ls, y_out=st.pinned(y))
    return acc, list(stored), st.pinned(dh)


def backward(slot: Slot, acc: Acc):
    """BACK: weight and input gradients from the stash."""
    d_chunk, d_shared, dx = slot.stage.ops.backward(*slot.backward_inputs())
    acc = slot.accumulate(acc, d_chunk, d_shared)
    return (acc._replace(dx_out=slot.stage.pinned(dx.astype(slot.stage.act_dtype))),
            *slot.nothing())


def input_grad(slot: Slot, acc: Acc):
    """B (zb-h1): the input gradient; W reads what it keeps."""
    dx, kept = slot.stage.ops.input_grad(*slot.backward_inputs())
    return (acc._replace(kept=tuple(kept),
                         dx_out=slot.stage.pinned(dx.astype(slot.stage.act_dtype))),
            *slot.nothing())


def weight_grad(slot: Slot, acc: Acc):
    """W: the weight gradients from the stash and B's kept values."""
    d_chunk, d_shared = slot.stage.ops.weight_grad(*slot.backward_inputs(), list(acc.kept))
    return (slot.accumulate(acc, d_chunk, d_shared), *slot.nothing())


BRANCHES = {IDLE: idle, FWD: forward, BACK: backward, BWD: input_grad, WGT: weight_grad}


def branches(stage: Stage, state: Carry, u, arrived=None) -> tuple[dict, dict]:
    """(slot u's row, its operations on this stage as switch branches Acc -> ...)."""
    slot = Slot.at(stage, state, u, arrived)
    return slot.row, {kind: functools.partial(fn, slot) for kind, fn in BRANCHES.items()}


def switched(stage: Stage, state: Carry, u, index, options, defer=True, writes=True):
    """The switch over `options` at slot u. `writes`: one of them is F, whose stash and
    gradient-slot writes the switch returns (every branch then returns a micro-batch's
    stash, zeros where it is not F); a switch without F returns none, so its branches
    write no zeros of a stash's size. (state, the writes) with `defer`, else the state
    with them kept."""
    if writes:
        acc, stored, dh = jax.lax.switch(index, options, state.acc)
        written = (stored, dh)
    else:
        acc = jax.lax.switch(index, [lambda a, o=o: o(a)[0] for o in options], state.acc)
        written = None
    state = Carry(state.acts, state.grads, state.stash, *acc)
    return (state, written) if defer else keep(stage, state, u, written)


def operate(stage: Stage, state: Carry, u, kinds, defer=False):
    """Slot u's operation on this stage (idle or one of `kinds`, the op table's kinds that
    can run at this slot), with its stash and gradient-slot writes (`defer`: those writes
    returned, for `keep` after the caller's switch)."""
    row, branch = branches(stage, state, u)
    # the op table numbers the schedule's kinds from 1; a slot of one kind switches over
    # (idle, that kind) only
    index = row["op"] if len(kinds) == len(stage.sched.kinds) else \
        jnp.where(row["op"] == 0, 0, 1)
    return switched(stage, state, u, index, [branch[IDLE]] + [branch[k] for k in kinds],
                    defer, writes=FWD in kinds)


def operate_both(stage: Stage, state: Carry, t, arrived):
    """Tick t's F and BACK on this stage as one computation (combined ticks: the table never
    has a BACK read what its tick's F writes), so XLA:GPU schedules one's collectives beside
    the other's matmuls; each alone where the stage runs one; F's stash and gradient-slot
    writes returned for `keep`."""
    row_f, f = branches(stage, state, 2 * t)
    row_b, b = branches(stage, state, 2 * t + 1, arrived)

    def both(acc):
        acc, stored, dh = f[FWD](acc)
        return b[BACK](acc)[0], stored, dh
    index = jnp.where(row_f["op"] > 0, 1, 0) + jnp.where(row_b["op"] > 0, 2, 0)
    return switched(stage, state, 2 * t, index, [f[IDLE], f[FWD], b[BACK], both])


def keep(stage: Stage, state: Carry, u, written) -> Carry:
    """F's stash into its slot; the last chunk's F also fills its gradient slot (`written`
    None: the slot's switch had no F)."""
    if written is None:
        return state
    stored, dh = written
    row = stage.row(u, ("op", "res", "grad"))
    is_f = row["op"] == 1 + stage.sched.kinds.index(FWD)
    stash = tuple(_store(b, jnp.where(is_f, row["res"], -1), r)
                  for b, r in zip(state.stash, stored))
    grads = stage.pinned(_store(state.grads, jnp.where(is_f, row["grad"], -1), dh), 1)
    return state._replace(grads=grads, stash=stash)


def landed(stage: Stage, state: Carry, act_slot=None, fwd_in=None, grad_slot=None,
           bwd_in=None) -> Carry:
    """What the neighbours sent at the tick before, in its slots (-1: nothing; None: nothing
    of that direction lands here)."""
    if act_slot is not None:
        state = state._replace(acts=stage.pinned(_store(state.acts, act_slot, fwd_in), 1))
    if grad_slot is not None:
        state = state._replace(grads=stage.pinned(_store(state.grads, grad_slot, bwd_in), 1))
    return state


def exposed_send(pairs):
    return lambda m: (jax.lax.ppermute(m, "stage", list(pairs)) if pairs
                      else jnp.zeros_like(m))


def sender(fwd_pairs, bwd_pairs):
    """A tick's messages in both directions over exactly `fwd_pairs` and `bwd_pairs`."""
    def send(y, dx):
        return exposed_send(fwd_pairs)(y), exposed_send(bwd_pairs)(dx)
    return send


def slot_step(stage: Stage, senders: list, pattern, carry: Messages, u):
    """Scan body, one slot (zb-h1, and F then BACK without overlapped sends): what landed,
    the slot's operation, then after the tick's last slot its messages. Every stage takes
    the same send branch (the pattern is the slot's, not the stage's), which holds exactly
    the pairs that send at this tick, so no byte moves that the schedule does not send."""
    row = stage.row(u)
    state = landed(stage, carry.state, row["recv_act"], carry.fwd_in, row["recv_grad"],
                   carry.bwd_in)
    state = operate(stage, state, u, stage.sched.kinds)
    fwd_in, bwd_in = (jax.lax.switch(pattern[u], senders, state.y_out, state.dx_out)
                      if len(senders) > 1 else senders[0](state.y_out, state.dx_out))
    return Messages(state, stage.pinned(fwd_in), stage.pinned(bwd_in)), None


def beside(stage: Stage, k: int, sends: OverlappedSends, choice, exposed_choice):
    """Slot k's operation with a message on its way: one branch per overlapped pair set
    (the ppermute and the operation side by side in one computation, so XLA:GPU overlaps
    them), one for the rest; then the rest's sends, exposed. (state, t, message) ->
    (state, what arrived)."""
    kind = (stage.sched.kinds[k],)

    def with_send(pairs):
        def run(state, u, message):  # the send first, in program order too
            got = jax.lax.ppermute(message, "stage", list(pairs))
            return (*operate(stage, state, u, kind, defer=True), got)
        return run

    def alone(state, u, message):
        return (*operate(stage, state, u, kind, defer=True), jnp.zeros_like(message))

    def run(state, t, message):
        # the stash written after the switch: the branch holds only the send and the
        # operation
        state, written, got = jax.lax.switch(
            choice[t, k], [with_send(p) for p in sends.sets[k]] + [alone], state, t * 2 + k,
            message)
        state = keep(stage, state, t * 2 + k, written)
        if len(sends.exposed[k]) > 1:
            got = got + jax.lax.switch(exposed_choice[t, k],
                                       [exposed_send(p) for p in sends.exposed[k]], message)
        return state, got
    return run


def tick_step(stage: Stage, run_f, run_back, carry: Messages, t):
    """Scan body, tick t of F then BACK with overlapped sends: tick t-1's input gradients
    travel beside F, F's outputs beside BACK (OverlappedSends)."""
    state = landed(stage, carry.state, stage.table["recv_act"][t * 2, stage.s], carry.fwd_in)
    state, bwd_in = run_f(state, t, carry.bwd_in)
    state = landed(stage, state, grad_slot=stage.table["recv_grad"][t * 2, stage.s],
                   bwd_in=stage.pinned(bwd_in))
    state, fwd_in = run_back(state, t, state.y_out)
    return Messages(state, stage.pinned(fwd_in), state.dx_out), None


def combined_step(stage: Stage, sends: CombinedSends, choice, exposed_choice,
                  carry: Messages, t):
    """Scan body, tick t of a combined table: F and BACK in one computation
    (`operate_both`) between tick t-1's input gradients and F's outputs on their way
    (CombinedSends); F's stash and the gradient received land after it."""
    dx_prev = carry.bwd_in
    state = landed(stage, carry.state, stage.table["recv_act"][t * 2, stage.s], carry.fwd_in)
    early = (jax.lax.switch(exposed_choice[t, 0], [exposed_send(p) for p in sends.exposed[0]],
                            dx_prev)
             if len(sends.exposed[0]) > 1 else jnp.zeros_like(dx_prev))

    def with_sends(pairs):
        def run(state, early):
            got = stage.pinned(exposed_send(pairs[0])(dx_prev))
            state, written = operate_both(stage, state, t, got)
            return state, written, got, exposed_send(pairs[1])(state.y_out)
        return run

    def plain(state, early):
        state, written = operate_both(stage, state, t, stage.pinned(early))
        return state, written, stage.pinned(early), jnp.zeros_like(state.y_out)
    state, written, got, sent = jax.lax.switch(
        choice[t], [with_sends(p) for p in sends.sets] + [plain], state, early)
    state = keep(stage, state, t * 2, written)
    state = landed(stage, state, grad_slot=stage.table["recv_grad"][t * 2, stage.s], bwd_in=got)
    if len(sends.exposed[1]) > 1:
        sent = sent + jax.lax.switch(exposed_choice[t, 1],
                                     [exposed_send(p) for p in sends.exposed[1]], state.y_out)
    return Messages(state, stage.pinned(sent), state.dx_out), None


def tick_body(stage: Stage, sched: Schedule) -> tuple:
    """(scan body, scan steps per tick) of the schedule's loop: combined ticks, ticks with
    overlapped sends, or one step per slot."""
    if sched.combined:
        sends = combined_sends(sched)
        return functools.partial(combined_step, stage, sends, jnp.asarray(sends.choice),
                                 jnp.asarray(sends.exposed_choice)), 1
    overlapped = overlapped_sends(sched)
    if overlapped is None:
        patterns, pattern_of_slot = send_patterns(sched)
        return functools.partial(slot_step, stage, [sender(*p) for p in patterns],
                                 jnp.asarray(pattern_of_slot)), len(sched.kinds)
    choice = jnp.asarray(overlapped.choice)
    exposed_choice = jnp.asarray(overlapped.exposed_choice)
    run_f, run_back = (beside(stage, k, overlapped, choice, exposed_choice) for k in (0, 1))
    return functools.partial(tick_step, stage, run_f, run_back), 1


def initial_carry(stage: Stage, act_shape) -> Messages:
    """Empty slots, stash and accumulators, no message in flight."""
    sched, ops, zeros_act = stage.sched, stage.ops, stage.zeros_act
    tok = jax.ShapeDtypeStruct(stage.tokens.shape[1:], stage.tokens.dtype)
    stashed = ops.stash_shapes(stage.chunk(0), stage.shared, zeros_act, tok)
    stash = tuple(jnp.zeros((sched.res_slots, *r.shape), r.dtype) for r in stashed)
    kept = ()
    if sched.split_backward:  # W runs in B's tick: one set of kept values
        kept = tuple(jnp.zeros(k.shape, k.dtype) for k in ops.kept_shapes(
            list(stashed), stage.chunk(0), stage.shared, zeros_act, zeros_act))
    slots = (stage.pinned(jnp.zeros((sched.act_slots, *act_shape), stage.act_dtype), 1),
             stage.pinned(jnp.zeros((sched.grad_slots, *act_shape), stage.act_dtype), 1))
    state = Carry(*slots, stash, kept, g_local=jax.tree.map(jnp.zeros_like, stage.local),
                  g_shared=jax.tree.map(jnp.zeros_like, stage.shared),
                  loss_sum=jnp.zeros((), jnp.float32), y_out=zeros_act, dx_out=zeros_act)
    return Messages(state, zeros_act, zeros_act)


def run_ticks(stage: Stage, carry: Messages, reducer, early: bool) -> tuple:
    """(the loop's last Carry, the chunks reduced over data during it, in order): one scan
    per stretch of ticks; after each, the chunks whose gradients are final on every stage
    are reduced over data, beside the ticks still to run. Each reduction reads its input
    through an optimization barrier with the one before's result (whose barrier output is
    the one used): XLA's collective combiners merge independent collectives into one,
    placed after the last of them, which would be after the loop."""
    sched = stage.sched
    body, per_tick = tick_body(stage, sched)
    final = sched.gradients_final()
    stretches = loop_stretches(sched) if reducer and early else [(0, sched.ticks)]
    reduced = Reduced()
    for start, end in stretches:
        carry, _ = jax.lax.scan(body, carry, jnp.arange(start * per_tick, end * per_tick))
        for v in range(sched.virtual) if end < sched.ticks else ():
            if v not in reduced.chunks and final[v] <= end:
                reduced.add(v, reducer.chunk(v, reduced.after_previous(
                    jax.tree.map(lambda g: g[v], carry.state.g_local))))
    return carry.state, reduced


class Reduced:
    """The chunks reduced over data so far, in order, each after the one before."""

    def __init__(self):
        self.chunks, self.order = {}, []

    def add(self, v, value):
        self.chunks[v] = value
        self.order.append(v)

    def after_previous(self, g):
        """`g` through an optimization barrier with the last reduction's result."""
        if not self.order:
            return g
        last = self.order[-1]
        self.chunks[last], g = jax.lax.optimization_barrier((self.chunks[last], g))
        return g


def pipeline_gradients(parts: Parts, sched: Schedule, act_shape, act_dtype,
                       data_axis: str | None = None, grad_reduce=None, early: bool = True):
    """(stage params [1, V, K, ...], shared params, tokens [M, b, L+1]) -> (mean loss,
    stage grads, shared grads), to run inside shard_map over `stage`. `grad_reduce`: the
    gradients' mean over `data_axis` as the step wants them, chunk by chunk as the loop
    finishes them (`DataMean`, its default; the distributed optimizer's reduce-scatter:
    jaxdist/pipeline/program.py; `early` False: all after the loop, one scan, where the
    data axis has one device)."""
    V, M = sched.virtual, sched.microbatches
    tables = _tables(sched)
    ops = ChunkOps(parts, M)
    reducer = None if data_axis is None else (grad_reduce or DataMean(data_axis))

    def run(stage_params, shared, tokens_MBL1):
        s = jax.lax.axis_index("stage")
        local = jax.tree.map(lambda a: a[0], stage_params)  # [V, K, ...]
        # the FP8 matmuls' weights quantized once per step, before the ticks: every
        # micro-batch's F and backward read these, and the stash holds none of them
        quantized = parts.fp8_weights(local)
        table = {k: jnp.asarray(a) for k, a in tables.items()}
        counts = jnp.asarray(np.array(parts.counts or [[parts.blocks_per_chunk] * V] *
                                      sched.stages, np.int32))  # [S, V]: each chunk's blocks
        zeros_act = pin_sequence_shards(jnp.zeros(act_shape, act_dtype),
                                        parts.sequence_parallel)
        stage = Stage(sched, ops, parts, s, table, counts, local, quantized, shared,
                      tokens_MBL1, act_dtype, zeros_act)
        state, reduced = run_ticks(stage, initial_carry(stage, act_shape), reducer, early)
        loss = jax.lax.psum(state.loss_sum, "stage") / M
        g_local, g_shared = state.g_local, stage_sum(state.g_shared)
        if reducer is not None:  # each data shard's mean over its rows -> global mean
            loss = jax.lax.pmean(loss, data_axis)
            g_local, g_shared = reduced.after_previous((g_local, g_shared))
            for v in range(V):
                if v not in reduced.chunks:
                    reduced.chunks[v] = reducer.chunk(v, jax.tree.map(lambda g: g[v],
                                                                      g_local))
            g_local = reducer.stages([reduced.chunks[v] for v in range(V)], g_local)
            g_shared = reducer.shared(g_shared)
        return loss, jax.tree.map(lambda g: g[None], g_local), g_shared

    return run
