"""The pipelined train step: one jitted program driven by a schedule table.

`shard_map` over the `stage` axis only (data, fsdp and tensor stay with the SPMD partitioner,
so tp_pp and fsdp_pp are the tp / fsdp placement of each stage's weights). The tick loop is
unrolled in Python from the table (jaxdist/pipeline/schedule.py): at each tick each stage
looks up its own action by its stage index, and the messages of that tick go out in one
`ppermute` per direction whose source-target pairs are exactly the stages that send then,
so the compiled step moves no byte the schedule does not (the `comm` block counts them).

Every stage runs the same program; at each tick a `lax.switch` on the stage's own row runs
its forward (F), the input gradient (B), the weight gradient (W) or nothing (one F-unit of
the table each, jaxdist/pipeline/schedule.py), so an idle stage-tick computes no throw-away work
(unlike MaxText's circular pipeline, which computes and discards it). A tick where no stage
runs a forward has no forward branch compiled. Runs of ticks whose pattern repeats (the
steady states) are one `lax.scan`, so compile time grows with S, not M.

Memory: a forward stores only its input activation, in a slot of a fixed buffer of
`act_slots` (the schedule's live count: M for GPipe, about S for 1F1B); B recomputes the
chunk from it under `jax.vjp` (stage-level rematerialisation, as torchtitan's and Megatron's
recompute options), so live activations are bounded by the schedule, not M. B keeps the
vjp's residuals (less the inputs they forward: weights, the stored activation) in
`res_slots` buffers until W, which rebuilds the vjp from them and so runs no forward.

Placement of embeddings and head: they are small next to the blocks (gpt3-175b: 0.6 B of
175 B parameters), so every stage holds them (`shared`), the first chunk's stage uses the
embeddings and the last chunk's the head; their gradients are summed over stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.pipeline.parts import Parts
from jaxdist.pipeline.schedule import BWD, FWD, WGT, Schedule


def _tables(sched: Schedule) -> dict[str, np.ndarray]:
    """The schedule as integer arrays [tick, stage]: what each stage does at each tick."""
    T, S = sched.ticks, sched.stages
    tab = {k: np.zeros((T, S), np.int32) for k in
           ("fwd", "bwd", "wgt", "mb", "v", "act", "grad", "res", "recv_act", "recv_grad")}
    for t in range(T):
        for s, op in enumerate(sched.ops[t]):
            tab["recv_act"][t, s], tab["recv_grad"][t, s] = sched.recv_slots[t][s]
            tab["res"][t, s] = sched.read_res[t][s]
            if op is None:
                tab["act"][t, s] = tab["grad"][t, s] = -1
                continue
            tab["fwd"][t, s], tab["bwd"][t, s] = op.kind == FWD, op.kind == BWD
            tab["wgt"][t, s] = op.kind == WGT
            tab["mb"][t, s], tab["v"][t, s] = op.mb, op.v
            tab["act"][t, s], tab["grad"][t, s] = sched.read_slots[t][s]
    return tab


def send_patterns(sched: Schedule) -> tuple[list[tuple], np.ndarray]:
    """(patterns, pattern index per tick): the distinct (forward pairs, backward pairs) of
    the ticks' sends, in first-use order. The tick loop runs a `lax.switch` over them, one
    branch per pattern holding exactly that pattern's ppermutes."""
    patterns, index = [], np.zeros(sched.ticks, np.int32)
    for t in range(sched.ticks):
        fwd_pairs, bwd_pairs = sched.sends(t)
        key = (tuple(fwd_pairs), tuple(bwd_pairs))
        if key not in patterns:
            patterns.append(key)
        index[t] = patterns.index(key)
    return patterns, index


def pattern_runs(sched: Schedule) -> list[int]:
    """How many ticks take each send pattern's branch (the order of `send_patterns`)."""
    patterns, index = send_patterns(sched)
    return [int((index == k).sum()) for k in range(len(patterns))]


def _store(buffer, slot, value):
    """buffer[slot] = value where slot >= 0 (in place); unchanged otherwise."""
    i = jnp.maximum(slot, 0)
    return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))


def _read(buffer, slot):
    return jnp.where(slot >= 0, buffer[jnp.maximum(slot, 0)], jnp.zeros_like(buffer[0]))


def pipeline_gradients(parts: Parts, sched: Schedule, act_shape, act_dtype,
                       data_axis: str | None = None, grad_reduce=None):
    """(stage params [1, V, K, ...], shared params, tokens [M, b, L+1]) -> (mean loss,
    stage grads, shared grads), to run inside shard_map over `stage`. `grad_reduce`:
    (stage grads [V, K, ...], shared grads) -> their mean over `data_axis` as the step wants
    them (the distributed optimizer: reduce-scattered); default pmean."""
    S, V, M = sched.stages, sched.virtual, sched.microbatches
    tables = _tables(sched)
    patterns, pattern_of_tick = send_patterns(sched)

    # Traced once, called from the one tick body.
    forward = jax.jit(parts.stage)
    split = sched.split_backward
    pullback = {}  # the vjp's tree structure and which residuals are its own inputs

    def linearize(chunk, shared, x, tokens, is_first, is_last):
        """(the chunk's vjp, its residual leaves to store): the chunk's forward recomputed
        under `jax.vjp`. A residual that is one of the inputs (a weight, the stored
        activation) is not stored again: W passes it anew."""
        _, vjp = jax.vjp(lambda c, sh, x_: forward(c, sh, x_, tokens, is_first, is_last),
                         chunk, shared, x)
        leaves, tree = jax.tree.flatten(vjp)
        inputs = jax.tree.leaves((chunk, shared)) + [x]
        forwarded = tuple(next((i for i, a in enumerate(inputs) if a is leaf), None)
                          for leaf in leaves)
        pullback.setdefault("tree", tree)
        pullback.setdefault("forwarded", forwarded)
        if forwarded != pullback["forwarded"]:
            raise RuntimeError("the chunk's vjp residuals differ between traces")
        return vjp, [leaf for leaf, i in zip(leaves, forwarded) if i is None]

    def restore(stored, chunk, shared, x):
        """The vjp rebuilt from B's stored residuals and the inputs it forwarded."""
        inputs = jax.tree.leaves((chunk, shared)) + [x]
        it = iter(stored)
        leaves = [next(it) if i is None else inputs[i] for i in pullback["forwarded"]]
        return jax.tree.unflatten(pullback["tree"], leaves)

    def sender(fwd_pairs, bwd_pairs):
        def send(y, dx):
            return (jax.lax.ppermute(y, "stage", list(fwd_pairs)) if fwd_pairs
                    else jnp.zeros_like(y),
                    jax.lax.ppermute(dx, "stage", list(bwd_pairs)) if bwd_pairs
                    else jnp.zeros_like(dx))
        return send
    senders = [sender(*p) for p in patterns]

    def run(stage_params, shared, tokens_MBL1):
        s = jax.lax.axis_index("stage")
        local = jax.tree.map(lambda a: a[0], stage_params)  # [V, K, ...]
        table = {k: jnp.asarray(a) for k, a in tables.items()}
        pattern = jnp.asarray(pattern_of_tick)

        def chunk_of(v):
            return jax.tree.map(lambda a: a[v], local) if V > 1 else \
                jax.tree.map(lambda a: a[0], local)

        def tick(carry, t):
            (acts, grads_in, res, held, g_local, g_shared, loss_sum, fwd_msg,
             bwd_msg) = carry
            row = {k: a[t, s] for k, a in table.items()}
            # What the neighbours sent at the tick before lands in its slot (-1: nothing).
            acts = _store(acts, row["recv_act"], fwd_msg)
            grads_in = _store(grads_in, row["recv_grad"], bwd_msg)
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
                return (*acc, jnp.zeros_like(fwd_msg), jnp.zeros_like(bwd_msg))

            def fwd(acc):
                g_l, g_s, ls, res, held = acc
                y, loss = forward(chunk, shared, x, tokens, is_first, is_last)
                return g_l, g_s, ls + loss, res, held, y, jnp.zeros_like(bwd_msg)

            dy = jnp.where(is_last, 0, _read(grads_in, row["grad"])).astype(act_dtype)
            cotangent = (dy, jnp.float32(1.0 / M))

            def bwd(acc):  # B: the input gradient; the residuals are kept for W
                g_l, g_s, ls, res, held = acc
                vjp, stored = linearize(chunk, shared, x, tokens, is_first, is_last)
                dx = vjp(cotangent)[2]  # the weight gradients are not computed (unused)
                res = tuple(_store(b, row["res"], r) for b, r in zip(res, stored))
                # zb-h1 sends dx now; the others hold it until their W ends the backward.
                return g_l, g_s, ls, res, dx, jnp.zeros_like(fwd_msg), (
                    dx if split else jnp.zeros_like(bwd_msg))

            def wgt(acc):  # W: the weight gradients from B's residuals, no forward rerun
                g_l, g_s, ls, res, held = acc
                vjp = restore([_read(b, row["res"]) for b in res], chunk, shared, x)
                d_chunk, d_shared, _ = vjp(cotangent)
                g_l = jax.tree.map(lambda g, d: g.at[v if V > 1 else 0].add(d), g_l, d_chunk)
                g_s = jax.tree.map(jnp.add, g_s, d_shared)
                return g_l, g_s, ls, res, held, jnp.zeros_like(fwd_msg), (
                    jnp.zeros_like(bwd_msg) if split else held)

            g_local, g_shared, loss_sum, res, held, y, dx = jax.lax.switch(
                row["fwd"] + 2 * row["bwd"] + 3 * row["wgt"], [idle, fwd, bwd, wgt],
                (g_local, g_shared, loss_sum, res, held))
            # The tick's messages: every stage takes the same branch (the pattern is the
            # tick's, not the stage's), which holds exactly the pairs that send at this
            # tick, so no byte moves that the schedule does not send.
            fwd_msg, bwd_msg = (jax.lax.switch(pattern[t], senders, y, dx)
                                if len(senders) > 1 else senders[0](y, dx))
            return (acts, grads_in, res, held, g_local, g_shared, loss_sum, fwd_msg,
                    bwd_msg), None

        zeros_act = jnp.zeros(act_shape, act_dtype)
        # B's residuals (the chunk's activations its vjp keeps, less its own inputs), one
        # buffer per leaf with sched.res_slots slots: one for a W right after its B,
        # more while zb-h1 defers its W.
        tok = jax.ShapeDtypeStruct(tokens_MBL1.shape[1:], tokens_MBL1.dtype)
        flag = jax.ShapeDtypeStruct((), jnp.bool_)
        stored = jax.eval_shape(lambda *a: linearize(*a)[1], chunk_of(0), shared,
                                zeros_act, tok, flag, flag)
        res0 = tuple(jnp.zeros((sched.res_slots, *r.shape), r.dtype) for r in stored)
        carry = (jnp.zeros((sched.act_slots, *act_shape), act_dtype),
                 jnp.zeros((sched.grad_slots, *act_shape), act_dtype), res0, zeros_act,
                 jax.tree.map(jnp.zeros_like, local), jax.tree.map(jnp.zeros_like, shared),
                 jnp.zeros((), jnp.float32), zeros_act, zeros_act)
        # One loop over every tick: the program holds one tick (one forward, one backward,
        # one switch of send patterns), so compile time does not grow with S or M.
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(sched.ticks))
        g_local, g_shared, loss_sum = carry[4:7]
        loss = jax.lax.psum(loss_sum, "stage") / M
        g_shared = jax.lax.psum(g_shared, "stage")
        if data_axis is not None:  # each data shard's mean over its rows -> global mean
            loss = jax.lax.pmean(loss, data_axis)
            g_local, g_shared = (grad_reduce or (lambda *g: jax.lax.pmean(g, data_axis)))(
                g_local, g_shared)
        return loss, jax.tree.map(lambda g: g[None], g_local), g_shared

    return run
