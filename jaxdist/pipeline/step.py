"""The pipelined train step: one jitted program driven by a schedule table.

`shard_map` over the `stage` axis only (data, fsdp and tensor stay with the SPMD partitioner,
so tp_pp and fsdp_pp are the tp / fsdp placement of each stage's weights). The tick loop is
unrolled in Python from the table (jaxdist/pipeline/schedule.py): at each tick each stage
looks up its own action by its stage index, and the messages of that tick go out in one
`ppermute` per direction whose source-target pairs are exactly the stages that send then,
so the compiled step moves no byte the schedule does not (the `comm` block counts them).

Every stage runs the same program; at each tick a `lax.switch` on the stage's own row runs
its forward, its backward or nothing, so an idle stage-tick computes no throw-away work
(unlike MaxText's circular pipeline, which computes and discards it). A tick where no stage
runs a forward has no forward branch compiled. Runs of ticks whose pattern repeats (the
steady states) are one `lax.scan`, so compile time grows with S, not M.

Memory: a forward stores only its input activation, in a slot of a fixed buffer of
`act_slots` (the schedule's live count: M for GPipe, about S for 1F1B); the backward
recomputes the chunk from it under `jax.vjp` (stage-level rematerialisation, as torchtitan's
and Megatron's recompute options), so live activations are bounded by the schedule, not M.

Placement of embeddings and head: they are small next to the blocks (gpt3-175b: 0.6 B of
175 B parameters), so every stage holds them (`shared`), the first chunk's stage uses the
embeddings and the last chunk's the head; their gradients are summed over stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.pipeline.parts import Parts
from jaxdist.pipeline.schedule import BWD, FWD, Schedule


def _tables(sched: Schedule) -> dict[str, np.ndarray]:
    """The schedule as integer arrays [tick, stage]: what each stage does at each tick."""
    T, S = sched.ticks, sched.stages
    tab = {k: np.zeros((T, S), np.int32) for k in
           ("fwd", "bwd", "mb", "v", "act", "grad", "recv_act", "recv_grad")}
    for t in range(T):
        for s, op in enumerate(sched.ops[t]):
            tab["recv_act"][t, s], tab["recv_grad"][t, s] = sched.recv_slots[t][s]
            if op is None:
                tab["act"][t, s] = tab["grad"][t, s] = -1
                continue
            tab["fwd"][t, s], tab["bwd"][t, s] = op.kind == FWD, op.kind == BWD
            tab["mb"][t, s], tab["v"][t, s] = op.mb, op.v
            tab["act"][t, s], tab["grad"][t, s] = sched.read_slots[t][s]
    return tab


def signature(sched: Schedule, t: int) -> tuple:
    """What the compiled program of tick t depends on statically: whether any stage runs
    a forward / a backward, and the pairs of each direction's ppermute."""
    fwd_pairs, bwd_pairs = sched.sends(t)
    kinds = {op.kind for op in sched.ops[t] if op is not None}
    return (FWD in kinds, BWD in kinds, tuple(fwd_pairs), tuple(bwd_pairs))


def segments(sched: Schedule, max_period: int = 4) -> list[tuple[int, int, int]]:
    """(first tick, period p, repeats r): runs of ticks whose signatures repeat with period
    p are compiled once as a loop of r iterations over p ticks (GPipe's and 1F1B's steady
    states), the rest tick by tick, so compile time grows with S rather than M."""
    sigs = [signature(sched, t) for t in range(sched.ticks)]
    out, t = [], 0
    while t < len(sigs):
        best = (1, 1)
        for p in range(1, max_period + 1):
            r = 1
            while t + (r + 1) * p <= len(sigs) and sigs[t + r * p:t + (r + 1) * p] == \
                    sigs[t:t + p]:
                r += 1
            if r >= 2 and r * p > best[0] * best[1]:
                best = (p, r)
        out.append((t, *best))
        t += best[0] * best[1]
    return out


def _store(buffer, slot, value):
    """buffer[slot] = value where slot >= 0 (in place); unchanged otherwise."""
    i = jnp.maximum(slot, 0)
    return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))


def _read(buffer, slot):
    return jnp.where(slot >= 0, buffer[jnp.maximum(slot, 0)], jnp.zeros_like(buffer[0]))


def pipeline_gradients(parts: Parts, sched: Schedule, act_shape, act_dtype,
                       data_axis: str | None = None):
    """(stage params [1, V, K, ...], shared params, tokens [M, b, L+1]) -> (mean loss,
    stage grads, shared grads), to run inside shard_map over `stage`."""
    S, V, M = sched.stages, sched.virtual, sched.microbatches
    tables = _tables(sched)
    sigs = [signature(sched, t) for t in range(sched.ticks)]

    # Traced once and called at every tick (nested jit: the model is not re-traced per tick).
    forward = jax.jit(parts.stage)

    @jax.jit
    def backward(chunk, shared, x, tokens, is_first, is_last, dy, dloss):
        _, vjp = jax.vjp(lambda c, sh, x_: parts.stage(c, sh, x_, tokens, is_first, is_last),
                         chunk, shared, x)
        return vjp((dy, dloss))

    def run(stage_params, shared, tokens_MBL1):
        s = jax.lax.axis_index("stage")
        local = jax.tree.map(lambda a: a[0], stage_params)  # [V, K, ...]
        table = {k: jnp.asarray(a) for k, a in tables.items()}

        def chunk_of(v):
            return jax.tree.map(lambda a: a[v], local) if V > 1 else \
                jax.tree.map(lambda a: a[0], local)

        def tick(carry, t, sig):
            acts, grads_in, g_local, g_shared, loss_sum, fwd_msg, bwd_msg = carry
            any_fwd, any_bwd, fwd_pairs, bwd_pairs = sig
            row = {k: a[t, s] for k, a in table.items()}
            # What the neighbours sent at the tick before lands in its slot (-1: nothing).
            acts = _store(acts, row["recv_act"], fwd_msg)
            grads_in = _store(grads_in, row["recv_grad"], bwd_msg)
            fwd_msg, bwd_msg = jnp.zeros_like(fwd_msg), jnp.zeros_like(bwd_msg)
            v, mb = row["v"], row["mb"]
            is_first = (s == 0) & (v == 0)
            is_last = (s == S - 1) & (v == V - 1)
            tokens = tokens_MBL1[mb]
            chunk, x = chunk_of(v), _read(acts, row["act"])

            # Each stage runs only its own action (lax.switch on its row): an idle stage
            # computes nothing and a 1F1B tick never holds a forward's and a backward's
            # temporaries at once. Collectives inside a branch stay within one stage (its
            # data / tensor group), which takes that branch as a whole; the ppermutes
            # between stages are outside.
            def idle(acc):
                g_l, g_s, ls = acc
                return g_l, g_s, ls, jnp.zeros_like(fwd_msg), jnp.zeros_like(bwd_msg)

            def fwd(acc):
                g_l, g_s, ls = acc
                y, loss = forward(chunk, shared, x, tokens, is_first, is_last)
                return g_l, g_s, ls + loss, y, jnp.zeros_like(bwd_msg)

            def bwd(acc):
                g_l, g_s, ls = acc
                dy = jnp.where(is_last, 0, _read(grads_in, row["grad"])).astype(act_dtype)
                d_chunk, d_shared, dx = backward(chunk, shared, x, tokens, is_first, is_last,
                                                 dy, jnp.float32(1.0 / M))
                g_l = jax.tree.map(lambda g, d: g.at[v if V > 1 else 0].add(d), g_l, d_chunk)
                return (g_l, jax.tree.map(jnp.add, g_s, d_shared), ls,
                        jnp.zeros_like(fwd_msg), dx)

            branches = [idle] + ([fwd] if any_fwd else []) + ([bwd] if any_bwd else [])
            index = (row["fwd"] * int(any_fwd) + row["bwd"] * (1 + int(any_fwd))
                     if any_bwd else row["fwd"])
            g_local, g_shared, loss_sum, y, dx = jax.lax.switch(
                index, branches, (g_local, g_shared, loss_sum))
            if fwd_pairs:
                fwd_msg = jax.lax.ppermute(y, "stage", list(fwd_pairs))
            if bwd_pairs:
                bwd_msg = jax.lax.ppermute(dx, "stage", list(bwd_pairs))
            return acts, grads_in, g_local, g_shared, loss_sum, fwd_msg, bwd_msg

        zeros_act = jnp.zeros(act_shape, act_dtype)
        carry = (jnp.zeros((sched.act_slots, *act_shape), act_dtype),
                 jnp.zeros((sched.grad_slots, *act_shape), act_dtype),
                 jax.tree.map(jnp.zeros_like, local), jax.tree.map(jnp.zeros_like, shared),
                 jnp.zeros((), jnp.float32), zeros_act, zeros_act)
        for first, period, repeats in segments(sched):
            if repeats == 1:
                for j in range(period):
                    carry = tick(carry, first + j, sigs[first + j])
                continue

            def body(c, i, first=first, period=period):
                for j in range(period):
                    c = tick(c, first + i * period + j, sigs[first + j])
                return c, None
            carry, _ = jax.lax.scan(body, carry, jnp.arange(repeats))
        _, _, g_local, g_shared, loss_sum, _, _ = carry
        loss = jax.lax.psum(loss_sum, "stage") / M
        g_shared = jax.lax.psum(g_shared, "stage")
        if data_axis is not None:  # each data shard's mean over its rows -> global mean
            loss, g_local, g_shared = jax.lax.pmean((loss, g_local, g_shared), data_axis)
        return loss, jax.tree.map(lambda g: g[None], g_local), g_shared

    return run
