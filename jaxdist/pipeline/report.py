"""What a pipelined run records: the schedule's bubble (counted and analytic), throw-away
work, the bytes each stage sends (read from the compiled HLO's collective-permutes on the
`stage` axis, beside the analytic activation volume) and per-stage memory."""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxdist import metrics
from jaxdist.program import comm, hlo, program_reading
from jaxdist.pipeline.schedule import BACK, FWD, WGT
from jaxdist.pipeline.step import (combined_sends, loop_stretches, overlapped_sends,
                                   pattern_runs)


def _stage_pairs(pairs, sizes: list[int], axis: int) -> list[int]:
    """Source stages of a collective-permute's pairs that change only the stage coordinate,
    one replica of the other axes (the pairs whose source has all other coordinates 0)."""
    out = []
    for src, dst in pairs or []:
        a, b = np.unravel_index(src, sizes), np.unravel_index(dst, sizes)
        others_zero = all(a[i] == 0 for i in range(len(sizes)) if i != axis)
        only_stage = all(a[i] == b[i] for i in range(len(sizes)) if i != axis)
        if src != dst and others_zero and only_stage:
            out.append(int(a[axis]))
    return out


def _stage_pair_sets(hlo_text: str, mesh_shape: dict[str, int], every: bool = False
                     ) -> dict[str, tuple | set]:
    """{computation: the stage pairs (source, target) of its stage collective-permute}, one
    replica of the other axes (`every`: the set of every such permute's pairs)."""
    names, sizes = list(mesh_shape), [mesh_shape[a] for a in mesh_shape]
    axis = names.index("stage")
    out = {}
    for ins in hlo.typed(hlo_text):
        if ins.collective == "collective-permute":
            pairs = []
            for src, dst in ins.permute_pairs or []:
                a, b = np.unravel_index(src, sizes), np.unravel_index(dst, sizes)
                if src != dst and all(a[i] == 0 == b[i] - a[i] for i in range(len(sizes))
                                      if i != axis):
                    pairs.append((int(a[axis]), int(b[axis])))
            if pairs and every:
                out.setdefault(ins.computation, set()).add(tuple(sorted(pairs)))
            elif pairs:
                out[ins.computation] = tuple(sorted(pairs))
    return out


def _stage_permutes(hlo_text: str, mesh_shape: dict[str, int]) -> list[tuple[str, int, list]]:
    """(computation, bytes moved per pair, source stages) of each stage collective-permute."""
    names, sizes = list(mesh_shape), [mesh_shape[a] for a in mesh_shape]
    axis = names.index("stage")
    out = []
    for ins in hlo.typed(hlo_text):
        if ins.collective == "collective-permute":
            _, result = comm.payload("collective-permute", ins)
            out.append((ins.computation, result, _stage_pairs(ins.permute_pairs, sizes, axis)))
    return out


def switch_runs(hlo_text: str, mesh_shape: dict[str, int], sched,
                permutes: list | None = None) -> dict[str, float]:
    """How often each branch of the tick loop's switches runs per step, per device on
    average (XLA cannot say; the schedule table that drives the switches can), by branch
    computation, for jaxdist.program.comm.collectives:
    - the send switch (the conditional whose branches hold the stage permutes): the ticks
      taking each send pattern (every stage takes the tick's pattern);
    - the action switch (idle and the schedule's kinds, jaxdist/pipeline/step.py): the
      slots at which a stage runs each operation, averaged over stages;
    - the two-way conditionals directly inside an operation's branch: F's head,
      `lax.cond(is_last, ...)` of jaxdist/pipeline/step.py, true on the last chunk only,
      F's last; and, where chunks hold different block counts (`sched.blocks[s][v]`,
      jaxdist/pipeline/parts.py), one per padded slot j (the slots some chunk lacks,
      `skippable`), true on the chunks whose count exceeds j: in F in slot order before
      the head, in a backward (BACK, B) in reverse slot order.
    Any other conditional stays unnamed, so its collectives are marked upper bounds.
    A loop of F then BACK whose sends ride beside the next operation (OverlappedSends,
    jaxdist/pipeline/step.py) is read by `_overlapped_runs`."""
    conds = hlo.conditionals(hlo_text)
    if sched.combined and "stage" in mesh_shape:
        backward = {tuple(ins.branches) for ins in hlo.typed(hlo_text)
                    if ins.op == "conditional" and "transpose(" in (ins.op_name or "")}
        return _combined_runs(conds, _stage_pair_sets(hlo_text, mesh_shape, every=True),
                              sched, combined_sends(sched), backward)
    overlapped = overlapped_sends(sched)
    if overlapped is not None and "stage" in mesh_shape:
        return _overlapped_runs(conds, _stage_pair_sets(hlo_text, mesh_shape), sched,
                                overlapped)
    S = sched.stages
    if permutes is None:  # _stage_permutes' list, when the caller has it
        permutes = _stage_permutes(hlo_text, mesh_shape) if "stage" in mesh_shape else []
    sending = {c for c, _, pairs in permutes if pairs}
    runs: dict[str, float] = {}
    send = [b for _, b in conds if sending & set(b)]
    if send:
        patterns = pattern_runs(sched)
        if len(send[0]) != len(patterns):
            raise ValueError(f"send switch has {len(send[0])} branches in the HLO, "
                             f"the schedule {len(patterns)} patterns")
        runs.update(zip(send[0], patterns))
    kinds = list(sched.kinds)
    action = [b for _, b in conds if len(b) == 1 + len(kinds) and b not in send]
    if len(action) != 1:
        return runs  # not the step's shape: leave every other branch an upper bound
    placed = [(op, s) for row in sched.ops for s, ops in enumerate(row) for op in ops]

    def per_stage(n: int) -> float:
        return n // S if n % S == 0 else n / S

    per_kind = {k: per_stage(sum(op.kind == k for op, _ in placed)) for k in kinds}
    last = {k: per_stage(sum(op.kind == k and s == S - 1 and op.v == sched.virtual - 1
                             for op, s in placed)) for k in kinds}
    runs[action[0][0]] = sched.ticks * len(kinds) - sum(per_kind.values())
    counts = sched.blocks
    low = min(min(row) for row in counts) if counts else 0
    padded = list(range(low, max(max(row) for row in counts))) if counts else []
    for i, k in enumerate(kinds):
        runs[action[0][i + 1]] = per_kind[k]
        two_way = [b for host, b in conds if host == action[0][i + 1] and len(b) == 2]
        head = two_way[-1:] if k == FWD else []
        slots = two_way[:len(two_way) - len(head)]
        order = padded if k == FWD else padded[::-1]
        for b in head:
            runs[b[0]], runs[b[1]] = per_kind[k] - last[k], last[k]
        if len(slots) != (len(order) if k != WGT else 0):
            continue  # not the step's shape: these stay upper bounds
        for j, b in zip(order, slots):
            on = per_stage(sum(op.kind == k and counts[s][op.v] > j for op, s in placed))
            runs[b[0]], runs[b[1]] = per_kind[k] - on, on
    return runs


def _kind_runs(two_way: list, sched, kind: int, placed: list) -> dict[str, float]:
    """The runs of the two-way conditionals one operation of `kind` traces (`two_way`, its
    own, in text order): F's head, the last of F's, true on the last chunk only; and,
    where chunks differ, one per padded slot (in slot order in F, reversed in a backward);
    `placed`: the (op, stage) runs of that operation."""
    S = sched.stages
    head = two_way[-1:] if kind == FWD else []
    runs: dict[str, float] = {}
    if head:
        last = sum(s == S - 1 and op.v == sched.virtual - 1 for op, s in placed) / S
        runs[head[0][0]], runs[head[0][1]] = len(placed) / S - last, last
    counts = sched.blocks
    low = min(min(row) for row in counts) if counts else 0
    padded = list(range(low, max(max(row) for row in counts))) if counts else []
    slots = two_way[:len(two_way) - len(head)]
    if len(slots) == len(padded):
        for j, b in zip(padded if kind == FWD else padded[::-1], slots):
            on = sum(counts[s][op.v] > j for op, s in placed) / S
            runs[b[0]], runs[b[1]] = len(placed) / S - on, on
    return runs


def _op_runs(conds, switch: list[str], sched, kind: int, ticks: list[int]
             ) -> dict[str, float]:
    """The runs of one copy of a slot's operation switch (idle, `kind`) over `ticks`, and of
    the two-way conditionals directly in its kind's branch (F's head; the padded slots), as
    switch_runs names them, per device on average."""
    S = sched.stages
    placed = [(op, s) for t in ticks for s, ops in enumerate(sched.ops[t]) for op in ops
              if op.kind == kind]
    runs = {switch[0]: (len(ticks) * S - len(placed)) / S, switch[1]: len(placed) / S}
    two_way = [b for host, b in conds if host == switch[1] and len(b) == 2]
    runs.update(_kind_runs(two_way, sched, kind, placed))
    return runs


def _combined_runs(conds, pair_sets: dict[str, set], sched, combined,
                   backward: set[tuple]) -> dict[str, float]:
    """switch_runs of a combined tick loop (CombinedSends, jaxdist/pipeline/step.py): per
    scan, the tick switch over the pair sets (branch j: both ppermutes and a copy of the
    operation switch; the last: the operations alone), each copy's operation switch (idle,
    F, BACK, F and BACK at once) weighed by the stage-ticks that take each branch, and the
    switches of the rest's exposed sends. In the branch running both, a conditional is
    BACK's where its op_name is under a transpose (`backward`: their branch lists), else
    F's: XLA's schedule interleaves the two operations' conditionals."""
    S, T = sched.stages, sched.ticks
    runs: dict[str, float] = {}
    want = [{tuple(sorted(p)) for p in pair if p} for pair in combined.sets]
    ticks_switches = [b for _, b in conds if len(b) == len(combined.sets) + 1 and
                      [pair_sets.get(x, set()) for x in b] == want + [set()]]
    stretches = loop_stretches(sched)
    spans = (stretches if len(ticks_switches) == len(stretches) and len(stretches) > 1
             else [(0, T)] * len(ticks_switches))
    for branches, (start, end) in zip(ticks_switches, spans):
        for j, b in enumerate(branches):
            ticks = [t for t in range(start, end) if combined.choice[t] == j]
            runs[b] = len(ticks)
            inner = [x for host, x in conds if host == b and len(x) == 4]
            if len(inner) != 1:
                continue
            taken: dict[int, list] = {1: [], 2: [], 3: []}
            idle = 0
            for t in ticks:
                for s, ops in enumerate(sched.ops[t]):
                    kinds = {op.kind: (op, s) for op in ops}
                    index = (FWD in kinds) + 2 * (BACK in kinds)
                    if index:
                        taken[index].append(kinds)
                    else:
                        idle += 1
            runs[inner[0][0]] = idle / S
            for index, kinds in ((1, (FWD,)), (2, (BACK,)), (3, (FWD, BACK))):
                branch = inner[0][index]
                runs[branch] = len(taken[index]) / S
                two_way = [x for host, x in conds if host == branch and len(x) == 2]
                for kind in kinds:
                    mine = [x for x in two_way if len(kinds) == 1 or
                            (tuple(x) in backward) == (kind == BACK)]
                    runs.update(_kind_runs(mine, sched, kind,
                                           [k[kind] for k in taken[index]]))
    for k in (0, 1):
        rest = combined.exposed[k]
        found = [b for _, b in conds if len(rest) > 1 and len(b) == len(rest) and
                 [pair_sets.get(x, set()) for x in b] ==
                 [set()] + [{tuple(sorted(p))} for p in rest[1:]]]
        spans = (stretches if len(found) == len(stretches) and len(found) > 1
                 else [(0, T)] * len(found))
        for branches, (start, end) in zip(found, spans):
            for j, b in enumerate(branches):
                runs[b] = int((combined.exposed_choice[start:end, k] == j).sum())
    return runs


def _overlapped_runs(conds, pair_sets: dict[str, tuple], sched, overlapped
                     ) -> dict[str, float]:
    """switch_runs of a tick loop of F then BACK with OverlappedSends: per slot k, the
    switch over the pair sets sent beside the operation (branch j: its ppermute and a copy
    of the operation switch; the last: the operation alone), each copy's branches weighed
    by the ticks that take it, and the switch of the rest's exposed sends. A loop cut into
    scans (`loop_stretches`: chunks reduced as soon as final) holds a copy of each switch
    per scan, in the text in scan order; each copy is weighed by its scan's ticks."""
    runs: dict[str, float] = {}
    T = sched.ticks
    for k, kind in enumerate(sched.kinds):
        sets, rest = overlapped.sets[k], overlapped.exposed[k]
        inner = {host: b for host, b in conds if len(b) == 2}
        beside = [branches for _, branches in conds
                  if len(branches) == len(sets) + 1 and [pair_sets.get(b) for b in branches]
                  == [tuple(sorted(p)) for p in sets] + [None]
                  and all(b in inner for b in branches)]
        exposed = [branches for _, branches in conds
                   if len(rest) > 1 and len(branches) == len(rest) and
                   [pair_sets.get(b) for b in branches] == [None] + [tuple(sorted(p))
                                                               for p in rest[1:]]]
        stretches = loop_stretches(sched)
        for found in (beside, exposed):
            spans = (stretches if len(found) == len(stretches) and len(found) > 1
                     else [(0, T)] * len(found))
            for branches, (start, end) in zip(found, spans):
                for j, b in enumerate(branches):
                    if found is exposed:
                        runs[b] = int((overlapped.exposed_choice[start:end, k] == j).sum())
                        continue
                    ticks = [t for t in range(start, end) if overlapped.choice[t, k] == j]
                    runs[b] = len(ticks)
                    runs.update(_op_runs(conds, inner[b], sched, kind, ticks))
    return runs


def stage_sends(hlo_text: str, mesh_shape: dict[str, int], sched) -> dict:
    """Bytes each stage sends per step over the `stage` axis, per device (a device of
    stage s sends its own shard of each activation or gradient): the collective-permutes
    whose pairs change only the stage coordinate, each pair's source counted, times how
    often the op runs (the send switch's branches weighed by switch_runs). Sizes and pairs
    are the HLO's."""
    if "stage" not in mesh_shape:
        return {"by_stage": [], "total_bytes": 0, "messages": 0}
    permutes = _stage_permutes(hlo_text, mesh_shape)
    runs = hlo.executions(hlo_text, switch_runs(hlo_text, mesh_shape, sched, permutes))
    by_stage = [0] * mesh_shape["stage"]
    messages = 0
    for computation, result, sources in permutes:
        times = runs.get(computation, 1)
        for src in sources:
            by_stage[src] += result * times
            messages += times
    return {"by_stage": by_stage, "total_bytes": sum(by_stage), "messages": messages}


def local_activation_bytes(program, batch_size: int) -> int:
    """One micro-batch's activation at a stage boundary, as one device holds it: rows split
    over the batch axes (data, fsdp), the sequence over `context` and, under sequence
    parallelism, `tensor` (else the residual stream is whole on every tensor device), the
    full width."""
    mesh = program.batch_sharding.mesh
    spec = program.batch_sharding.spec[0]
    axes = (spec,) if isinstance(spec, str) else (spec or ())
    shards = math.prod(mesh.shape[a] for a in axes)
    L, D = program.extra["act_row_shape"]
    itemsize = program.extra["act_itemsize"]
    # the sequence, not the rows, is split: a micro-batch of one row still has L / CP
    return (batch_size // program.microbatches // shards *
            (L // program.extra["act_sequence_shards"]) * D * itemsize)


def stage_param_bytes(state, mesh) -> list[int]:
    """Parameter bytes held by one device of each stage (the largest over its devices)."""
    axis = list(mesh.axis_names).index("stage")
    stage_of = {d.id: int(np.argwhere(mesh.devices == d)[0][axis])
                for d in mesh.devices.flat}
    per_device: dict[int, int] = {}
    for leaf in jax.tree.leaves(state["params"]):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    out = [0] * mesh.shape["stage"]
    for dev, nbytes in per_device.items():
        s = stage_of[dev]
        out[s] = max(out[s], nbytes)
    return out


def pipeline_block(program, compiled, state, batch_size: int, model_flops_per_step: float,
                   num_devices: int) -> dict:
    sched = program.schedule
    mesh = program.batch_sharding.mesh
    act = local_activation_bytes(program, batch_size)
    sends = stage_sends(program_reading.text(compiled), dict(mesh.shape), sched)
    boundaries = sched.chunks - 1
    analytic = 2 * act * sched.microbatches * boundaries
    flops = metrics.compiled_flops(compiled)
    compiled_total = flops * num_devices if flops is not None else None
    mem = metrics.compiled_memory(compiled) or {}
    return {
        **sched.summary(),
        "analytic_bubble_formula": ("(S-1)/(V*M+S-1)" if sched.virtual > 1
                                    else "(S-1)/(M+S-1)"),
        # Idle slots run nothing (a per-stage lax.switch), so the bubble costs time, not
        # FLOPs; the compiled/model ratio shows --remat's recomputation instead.
        "compiled_flops_per_step": compiled_total,
        "model_flops_per_step": model_flops_per_step,
        "compiled_over_model_flops": (compiled_total / model_flops_per_step
                                      if compiled_total and model_flops_per_step else None),
        "flops_note": "idle slots compute nothing (lax.switch per stage); compiled "
                      "FLOPs count the forward recomputed under --remat full / dots (none: "
                      "no second forward), the optimizer update, and XLA's cost of the "
                      "switch (per device: the branches as XLA's cost analysis counts them)",
        "stage_bytes": {"by_stage": sends["by_stage"], "total": sends["total_bytes"],
                        "messages": sends["messages"],
                        "analytic": analytic,
                        "analytic_basis": "2 (forward activations, backward gradients) x "
                                          "micro-batches x (S*V - 1) boundaries x one "
                                          "micro-batch's activation per device"},
        "memory": {
            "activation_bytes_per_microbatch": act,
            "activation_stash_bytes": sched.act_slots * act,
            "residual_slots_by_stage": sched.res_slots_by_stage,
            "gradient_stash_bytes": sched.grad_slots * act,
            "live_activation_slots_by_stage": sched.act_slots_by_stage,
            "param_bytes_by_stage": stage_param_bytes(state, mesh),
            "compiled_temp_bytes": mem.get("temp_bytes"),
        },
    }
