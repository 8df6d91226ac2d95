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

from dataclasses import dataclass

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
        counts = {p: every.count(p) for p in every if p}
        chosen = tuple(sorted(counts, key=lambda p: (-counts[p], p))[:most])
        rest = ((),) + tuple(sorted({p for p in every if p and p not in chosen}))
        for t, p in enumerate(every):
            choice[t, k] = chosen.index(p) if p in chosen else len(chosen)
            exposed_choice[t, k] = rest.index(p) if p not in chosen else 0
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
    counts = {p: every.count(p) for p in every if p != ((), ())}
    chosen = tuple(sorted(counts, key=lambda p: (-counts[p], p))[:most])
    rest = tuple(((),) + tuple(sorted({p[k] for p in every if p not in chosen and p[k]}))
                 for k in (0, 1))
    choice, exposed_choice = np.zeros(T, np.int32), np.zeros((T, 2), np.int32)
    for t, p in enumerate(every):
        choice[t] = chosen.index(p) if p in chosen else len(chosen)
        for k in (0, 1):
            exposed_choice[t, k] = 0 if p in chosen else rest[k].index(p[k])
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


def pipeline_gradients(parts: Parts, sched: Schedule, act_shape, act_dtype,
                       data_axis: str | None = None, grad_reduce=None, early: bool = True):
    """(stage params [1, V, K, ...], shared params, tokens [M, b, L+1]) -> (mean loss,
    stage grads, shared grads), to run inside shard_map over `stage`. `grad_reduce`: the
    gradients' mean over `data_axis` as the step wants them, chunk by chunk as the loop
    finishes them (`DataMean`, its default; the distributed optimizer's reduce-scatter:
    jaxdist/pipeline/program.py; `early` False: all after the loop, one scan, where the
    data axis has one device)."""
    S, V, M = sched.stages, sched.virtual, sched.microbatches
    tables = _tables(sched)
    patterns, pattern_of_slot = send_patterns(sched)
    ops = ChunkOps(parts, M)

    def sender(fwd_pairs, bwd_pairs):
        def send(y, dx):
            return (jax.lax.ppermute(y, "stage", list(fwd_pairs)) if fwd_pairs
                    else jnp.zeros_like(y),
                    jax.lax.ppermute(dx, "stage", list(bwd_pairs)) if bwd_pairs
                    else jnp.zeros_like(dx))
        return send
    senders = [sender(*p) for p in patterns]
    overlapped = overlapped_sends(sched)
    combined = combined_sends(sched) if sched.combined else None

    def run(stage_params, shared, tokens_MBL1):
        s = jax.lax.axis_index("stage")
        local = jax.tree.map(lambda a: a[0], stage_params)  # [V, K, ...]
        # the FP8 matmuls' weights quantized once per step, before the ticks: every
        # micro-batch's F and backward read these, and the stash holds none of them
        quantized = parts.fp8_weights(local)
        table = {k: jnp.asarray(a) for k, a in tables.items()}
        counts = jnp.asarray(np.array(parts.counts or [[parts.blocks_per_chunk] * V] * S,
                                      np.int32))  # [S, V]: each chunk's own blocks
        pattern = jnp.asarray(pattern_of_slot)

        def chunk_of(v):  # (parameters, FP8 weights) of chunk v (jaxdist/pipeline/ops.py)
            return jax.tree.map(lambda a: a[v], (local, quantized)) if V > 1 else \
                jax.tree.map(lambda a: a[0], (local, quantized))

        def accumulate(g_l, g_s, v, d_chunk, d_shared):
            g_l = jax.tree.map(lambda g, d: g.at[v if V > 1 else 0].add(d), g_l, d_chunk)
            return g_l, jax.tree.map(jnp.add, g_s, d_shared)

        def pinned(x, leading=0):
            """A message (`leading` 1: a buffer of them) as the blocks' sequence shards under
            sequence parallelism: kept and sent as 1/T of the sequence per tensor device."""
            return pin_sequence_shards(x, parts.sequence_parallel, leading)

        zeros_act = pinned(jnp.zeros(act_shape, act_dtype))

        def branches(state, u, arrived=None):
            """The operations slot u's row can run on this stage, as switch branches
            (accumulators) -> (kept, g_local, g_shared, loss_sum, y_out, dx_out, stash
            writes, gradient-slot write). `arrived`: the input gradient this tick receives,
            read from there, not from its slot (where it lands after the tick's operations:
            combined ticks)."""
            (acts, grads, stash, kept, g_local, g_shared, loss_sum, y_out, dx_out) = state
            row = {k: a[u, s] for k, a in table.items()}
            v, mb = row["v"], row["mb"]
            is_first = (s == 0) & (v == 0)
            is_last = (s == S - 1) & (v == V - 1)
            tokens = tokens_MBL1[mb]
            chunk, x = chunk_of(v), _read(acts, row["act"])

            def gradient():
                held = _read(grads, row["grad"])
                if arrived is None:
                    return held
                landing = table["recv_grad"][u - u % len(sched.kinds), s]
                return jnp.where((row["grad"] >= 0) & (row["grad"] == landing), arrived, held)

            # The stash and the gradient slots are written outside the switch (`keep`), and
            # only read inside it: a buffer that one branch updated in place and another
            # passed through was copied whole at every slot (XLA's copy insertion).
            def backward_inputs():
                return ([_read(b, row["res"]) for b in stash], chunk, shared, x, gradient())

            # Each stage runs only its own operation (lax.switch on its row). Collectives
            # inside a branch stay within one stage (its data / tensor group), which takes
            # that branch as a whole; the ppermutes between stages are outside.
            def nothing():  # what a branch other than F writes to the stash: nothing
                return [jnp.zeros(b.shape[1:], b.dtype) for b in stash], zeros_act

            def idle(acc):
                return (*acc, *nothing())

            def fwd(acc):  # F: the stash for the backward; the last chunk's head and its
                # backward at once, its gradient into the chunk's output
                kept, g_l, g_s, ls, y_out, dx_out = acc
                y, aux, stored = ops.forward(chunk, shared, x, tokens, is_first,
                                             counts[s, v])

                def head(a):
                    ls, g_s, dh = a
                    loss, dh, d_own = ops.head(shared, y, tokens)
                    g_s = {**g_s, **{k: jax.tree.map(jnp.add, g_s[k], d) for k, d in
                                     d_own.items()}}
                    return ls + loss, g_s, dh
                ls, g_s, dh = jax.lax.cond(is_last, head, lambda a: a,
                                           (ls + aux, g_s, zeros_act))
                return kept, g_l, g_s, ls, pinned(y), dx_out, list(stored), pinned(dh)

            def back(acc):  # BACK: weight and input gradients from the stash
                kept, g_l, g_s, ls, y_out, dx_out = acc
                d_chunk, d_shared, dx = ops.backward(*backward_inputs())
                g_l, g_s = accumulate(g_l, g_s, v, d_chunk, d_shared)
                return kept, g_l, g_s, ls, y_out, pinned(dx.astype(act_dtype)), *nothing()

            def bwd(acc):  # B (zb-h1): the input gradient; W reads what it keeps
                kept, g_l, g_s, ls, y_out, dx_out = acc
                dx, kept = ops.input_grad(*backward_inputs())
                return (tuple(kept), g_l, g_s, ls, y_out, pinned(dx.astype(act_dtype)),
                        *nothing())

            def wgt(acc):  # W: the weight gradients from the stash and B's kept values
                kept, g_l, g_s, ls, y_out, dx_out = acc
                d_chunk, d_shared = ops.weight_grad(*backward_inputs(), list(kept))
                g_l, g_s = accumulate(g_l, g_s, v, d_chunk, d_shared)
                return kept, g_l, g_s, ls, y_out, dx_out, *nothing()

            return row, {IDLE: idle, FWD: fwd, BACK: back, BWD: bwd, WGT: wgt}

        def operate(state, u, kinds, defer=False):
            """Slot u's operation on this stage (idle or one of `kinds`, the op table's
            kinds that can run at this slot), with its stash and gradient-slot writes
            (`defer`: those writes returned, for `keep` after the caller's switch)."""
            row, branch = branches(state, u)
            # the op table numbers the schedule's kinds from 1; a slot of one kind switches
            # over (idle, that kind) only
            index = row["op"] if len(kinds) == len(sched.kinds) else \
                jnp.where(row["op"] == 0, 0, 1)
            return switched(state, u, index, [branch[IDLE]] + [branch[k] for k in kinds],
                            defer, writes=FWD in kinds)

        def switched(state, u, index, options, defer=True, writes=True):
            """The switch over `options` at slot u. `writes`: one of them is F, whose stash
            and gradient-slot writes the switch returns (every branch then returns a
            micro-batch's stash, zeros where it is not F); a switch without F returns
            none, so its branches write no zeros of a stash's size."""
            (acts, grads, stash, kept, g_local, g_shared, loss_sum, y_out, dx_out) = state
            acc = (kept, g_local, g_shared, loss_sum, y_out, dx_out)
            if writes:
                *acc, stored, dh = jax.lax.switch(index, options, acc)
                written = (stored, dh)
            else:
                acc = jax.lax.switch(index, [lambda a, o=o: o(a)[:6] for o in options], acc)
                written = None
            state = (acts, grads, stash, *acc)
            return (state, written) if defer else keep(state, u, written)

        def operate_both(state, t, arrived):
            """Tick t's F and BACK on this stage as one computation (combined ticks: the
            table never has a BACK read what its tick's F writes), so XLA:GPU schedules
            one's collectives beside the other's matmuls; each alone where the stage runs
            one; F's stash and gradient-slot writes returned for `keep`."""
            row_f, f = branches(state, 2 * t)
            row_b, b = branches(state, 2 * t + 1, arrived)

            def both(acc):
                *acc, stored, dh = f[FWD](acc)
                return (*b[BACK](tuple(acc))[:6], stored, dh)
            index = jnp.where(row_f["op"] > 0, 1, 0) + jnp.where(row_b["op"] > 0, 2, 0)
            return switched(state, 2 * t, index, [f[IDLE], f[FWD], b[BACK], both])

        def keep(state, u, written):
            """F's stash into its slot; the last chunk's F also fills its gradient slot
            (`written` None: the slot's switch had no F)."""
            if written is None:
                return state
            (acts, grads, stash, *rest), (stored, dh) = state, written
            row = {k: table[k][u, s] for k in ("op", "res", "grad")}
            is_f = row["op"] == 1 + sched.kinds.index(FWD)
            stash = tuple(_store(b, jnp.where(is_f, row["res"], -1), r)
                          for b, r in zip(stash, stored))
            grads = pinned(_store(grads, jnp.where(is_f, row["grad"], -1), dh), 1)
            return (acts, grads, stash, *rest)

        def slot(carry, u):
            state, (fwd_in, bwd_in) = carry[:9], carry[9:]
            acts, grads = state[:2]
            row = {k: a[u, s] for k, a in table.items()}
            # What the neighbours sent at the tick before lands in its slot (-1: nothing).
            acts = pinned(_store(acts, row["recv_act"], fwd_in), 1)
            grads = pinned(_store(grads, row["recv_grad"], bwd_in), 1)
            state = operate((acts, grads, *state[2:]), u, sched.kinds)
            y_out, dx_out = state[7:9]
            # The tick's messages after its last slot: every stage takes the same branch
            # (the pattern is the slot's, not the stage's), which holds exactly the pairs
            # that send at this tick, so no byte moves that the schedule does not send.
            fwd_in, bwd_in = (jax.lax.switch(pattern[u], senders, y_out, dx_out)
                              if len(senders) > 1 else senders[0](y_out, dx_out))
            return (*state, pinned(fwd_in), pinned(bwd_in)), None

        def beside(k, sets, exposed, choice, exposed_choice):
            """Slot k's operation with a message on its way: one branch per overlapped
            pair set (the ppermute and the operation side by side in one computation, so
            XLA:GPU overlaps them), one for the rest; then the rest's sends, exposed."""
            def with_send(pairs):
                def run(state, u, message):  # the send first, in program order too
                    got = jax.lax.ppermute(message, "stage", list(pairs))
                    return (*operate(state, u, (sched.kinds[k],), defer=True), got)
                return run

            def alone(state, u, message):
                return (*operate(state, u, (sched.kinds[k],), defer=True),
                        jnp.zeros_like(message))

            def run(state, t, message):
                # the stash written after the switch: the branch holds only the send and
                # the operation
                state, written, got = jax.lax.switch(
                    choice[t, k], [with_send(p) for p in sets[k]] + [alone], state, t * 2 + k,
                    message)
                state = keep(state, t * 2 + k, written)
                if len(exposed[k]) > 1:
                    got = got + jax.lax.switch(exposed_choice[t, k],
                                               [exposed_send(p) for p in exposed[k]],
                                               message)
                return state, got
            return run

        def tick(carry, t):
            """Tick t of F then BACK: tick t-1's input gradients travel beside F, F's
            outputs beside BACK (OverlappedSends)."""
            state, (fwd_in, dx_prev) = carry[:9], carry[9:]
            acts = pinned(_store(state[0], table["recv_act"][t * 2, s], fwd_in), 1)
            state, bwd_in = run_f((acts, *state[1:]), t, dx_prev)
            grads = pinned(_store(state[1], table["recv_grad"][t * 2, s], pinned(bwd_in)), 1)
            state = (state[0], grads, *state[2:])
            state, fwd_in = run_back(state, t, state[7])
            return (*state, pinned(fwd_in), state[8]), None

        def exposed_send(pairs):
            return lambda m: (jax.lax.ppermute(m, "stage", list(pairs)) if pairs
                              else jnp.zeros_like(m))

        def combined_tick(carry, t):
            """Tick t of a combined table: F and BACK in one computation (`operate_both`)
            between tick t-1's input gradients and F's outputs on their way
            (CombinedSends); F's stash and the gradient received land after it."""
            state, (fwd_in, dx_prev) = carry[:9], carry[9:]
            acts = pinned(_store(state[0], table["recv_act"][t * 2, s], fwd_in), 1)
            state = (acts, *state[1:])
            early = (jax.lax.switch(c_exposed_choice[t, 0],
                                    [exposed_send(p) for p in combined.exposed[0]], dx_prev)
                     if len(combined.exposed[0]) > 1 else jnp.zeros_like(dx_prev))

            def with_sends(pairs):
                def run(state, early):
                    got = pinned(exposed_send(pairs[0])(dx_prev))
                    state, written = operate_both(state, t, got)
                    return state, written, got, exposed_send(pairs[1])(state[7])
                return run

            def plain(state, early):
                state, written = operate_both(state, t, pinned(early))
                return state, written, pinned(early), jnp.zeros_like(state[7])
            state, written, got, sent = jax.lax.switch(
                c_choice[t], [with_sends(p) for p in combined.sets] + [plain], state, early)
            state = keep(state, t * 2, written)
            grads = pinned(_store(state[1], table["recv_grad"][t * 2, s], got), 1)
            state = (state[0], grads, *state[2:])
            if len(combined.exposed[1]) > 1:
                sent = sent + jax.lax.switch(c_exposed_choice[t, 1],
                                             [exposed_send(p) for p in combined.exposed[1]],
                                             state[7])
            return (*state, pinned(sent), state[8]), None

        tok = jax.ShapeDtypeStruct(tokens_MBL1.shape[1:], tokens_MBL1.dtype)
        stashed = ops.stash_shapes(chunk_of(0), shared, zeros_act, tok)
        stash0 = tuple(jnp.zeros((sched.res_slots, *r.shape), r.dtype) for r in stashed)
        kept0 = ()
        if sched.split_backward:  # W runs in B's tick: one set of kept values
            kept0 = tuple(jnp.zeros(k.shape, k.dtype) for k in ops.kept_shapes(
                list(stashed), chunk_of(0), shared, zeros_act, zeros_act))
        carry = (pinned(jnp.zeros((sched.act_slots, *act_shape), act_dtype), 1),
                 pinned(jnp.zeros((sched.grad_slots, *act_shape), act_dtype), 1), stash0, kept0,
                 jax.tree.map(jnp.zeros_like, local), jax.tree.map(jnp.zeros_like, shared),
                 jnp.zeros((), jnp.float32), zeros_act, zeros_act, zeros_act, zeros_act)
        if sched.combined:
            c_choice = jnp.asarray(combined.choice)
            c_exposed_choice = jnp.asarray(combined.exposed_choice)
            body, per_tick = combined_tick, 1
        elif overlapped is None:
            body, per_tick = slot, len(sched.kinds)
        else:
            choice = jnp.asarray(overlapped.choice)
            exposed_choice = jnp.asarray(overlapped.exposed_choice)
            run_f, run_back = (beside(k, overlapped.sets, overlapped.exposed, choice,
                                      exposed_choice) for k in (0, 1))
            body, per_tick = tick, 1
        # One scan per stretch of ticks; after each, the chunks whose gradients are final
        # on every stage are reduced over data, beside the ticks still to run.
        reducer = None if data_axis is None else (grad_reduce or DataMean(data_axis))
        final = sched.gradients_final()
        stretches = loop_stretches(sched) if reducer and early else [(0, sched.ticks)]
        # Each reduction reads its input through an optimization barrier with the one
        # before's result (whose barrier output is the one used): XLA's collective
        # combiners merge independent collectives into one, placed after the last of
        # them, which would be after the loop.
        reduced, order = {}, []

        def after_previous(g):
            if not order:
                return g
            reduced[order[-1]], g = jax.lax.optimization_barrier((reduced[order[-1]], g))
            return g
        for start, end in stretches:
            carry, _ = jax.lax.scan(body, carry, jnp.arange(start * per_tick,
                                                            end * per_tick))
            for v in range(V) if end < sched.ticks else ():
                if v not in reduced and final[v] <= end:
                    reduced[v] = reducer.chunk(v, after_previous(
                        jax.tree.map(lambda g: g[v], carry[4])))
                    order.append(v)
        g_local, g_shared, loss_sum = carry[4:7]
        loss = jax.lax.psum(loss_sum, "stage") / M
        g_shared = stage_sum(g_shared)
        if reducer is not None:  # each data shard's mean over its rows -> global mean
            loss = jax.lax.pmean(loss, data_axis)
            g_local, g_shared = after_previous((g_local, g_shared))
            for v in range(V):
                if v not in reduced:
                    reduced[v] = reducer.chunk(v, jax.tree.map(lambda g: g[v], g_local))
            g_local = reducer.stages([reduced[v] for v in range(V)], g_local)
            g_shared = reducer.shared(g_shared)
        return loss, jax.tree.map(lambda g: g[None], g_local), g_shared

    return run
