"""What a pipelined run records: the schedule's bubble (counted and analytic), throw-away
work, the bytes each stage sends (read from the compiled HLO's collective-permutes on the
`stage` axis, beside the analytic activation volume) and per-stage memory."""

from __future__ import annotations

import math
import re

import jax
import numpy as np

from jaxdist import comm, metrics
from jaxdist.pipeline.step import pattern_runs


_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def stage_sends(hlo_text: str, mesh_shape: dict[str, int],
                branch_runs: list[int] | None = None) -> dict:
    """Bytes each stage sends per step over the `stage` axis, per device (a device of
    stage s sends its own shard of each activation or gradient): the collective-permutes
    whose pairs change only the stage coordinate, each pair's source counted, times how
    often the op runs.

    The tick loop sends through a `lax.switch` over the schedule's send patterns
    (jaxdist/pipeline/step.py), one branch per pattern holding exactly its ppermutes; XLA
    cannot say how often each branch of a conditional runs, so `branch_runs` (how many
    ticks take each pattern, from the table that drives the switch) weighs the branches of
    the conditional whose branches hold the stage permutes. Sizes and pairs are the HLO's."""
    names, sizes = list(mesh_shape), [mesh_shape[a] for a in mesh_shape]
    if "stage" not in names:
        return {"by_stage": [], "total_bytes": 0, "messages": 0}
    axis = names.index("stage")
    S = sizes[axis]

    def stage_pairs(line):
        out = []
        for src, dst in comm.permute_pairs(line) or []:
            a, b = np.unravel_index(src, sizes), np.unravel_index(dst, sizes)
            # One replica of the other axes: the pairs whose source has all other coords 0.
            others_zero = all(a[i] == 0 for i in range(len(sizes)) if i != axis)
            only_stage = all(a[i] == b[i] for i in range(len(sizes)) if i != axis)
            if src != dst and others_zero and only_stage:
                out.append(int(a[axis]))
        return out

    permutes, branch_lists, current = [], [], None
    for line in comm.statements(hlo_text):
        opened = comm.header(line)
        if opened:
            current = opened.group(2)
            continue
        branches = _BRANCHES.search(line)
        if branches:
            branch_lists.append([b.strip().lstrip("%") for b in branches.group(1).split(",")])
        m = comm.INSTRUCTION.match(line)
        if m and m.group("op") in ("collective-permute", "collective-permute-start"):
            _, result = comm.payload("collective-permute", m.group("op"), m.group("shape"),
                                      m.group("rest"))
            permutes.append((current, result, stage_pairs(line)))
    runs = comm.executions(hlo_text)
    sending = {c for c, _, pairs in permutes if pairs}
    for branches in branch_lists:
        if branch_runs is not None and sending & set(branches):
            if len(branches) != len(branch_runs):
                raise ValueError(f"send switch has {len(branches)} branches in the HLO, "
                                 f"the schedule {len(branch_runs)} patterns")
            runs.update(zip(branches, branch_runs))
    by_stage = [0] * S
    messages = 0
    for computation, result, sources in permutes:
        times = runs.get(computation, 1)
        for src in sources:
            by_stage[src] += result * times
            messages += times
    return {"by_stage": by_stage, "total_bytes": sum(by_stage), "messages": messages}


def local_activation_bytes(program, batch_size: int) -> int:
    """One micro-batch's activation at a stage boundary, as one device holds it: rows split
    over the batch axes (data, fsdp), the full width (the residual stream is replicated
    over `tensor`)."""
    mesh = program.batch_sharding.mesh
    spec = program.batch_sharding.spec[0]
    axes = (spec,) if isinstance(spec, str) else (spec or ())
    shards = math.prod(mesh.shape[a] for a in axes)
    cfg_shape = program.extra["act_row_shape"]  # (L, D)
    itemsize = program.extra["act_itemsize"]
    return batch_size // program.microbatches // shards * math.prod(cfg_shape) * itemsize


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
    sends = stage_sends(compiled.as_text() or "", dict(mesh.shape), pattern_runs(sched))
    boundaries = sched.chunks - 1
    analytic = 2 * act * sched.microbatches * boundaries
    flops = metrics.compiled_flops(compiled)
    compiled_total = flops * num_devices if flops is not None else None
    mem = metrics.compiled_memory(compiled) or {}
    return {
        **sched.summary(),
        "analytic_bubble_formula": ("(S-1)/(3M+S-1)" if sched.split_backward else
                                    "(S-1)/(V*M+S-1)" if sched.virtual > 1
                                    else "(S-1)/(M+S-1)"),
        # Idle stage-ticks run nothing (a per-stage lax.switch), so the bubble costs time,
        # not FLOPs; the compiled/model ratio shows the stage-level recompute instead.
        "compiled_flops_per_step": compiled_total,
        "model_flops_per_step": model_flops_per_step,
        "compiled_over_model_flops": (compiled_total / model_flops_per_step
                                      if compiled_total and model_flops_per_step else None),
        "flops_note": "idle stage-ticks compute nothing (lax.switch per stage); compiled "
                      "FLOPs count the forward recomputed in each backward (about 4/3 of "
                      "the model's), the optimizer update, and XLA's cost of the switch "
                      "(per device: the branches as XLA's cost analysis counts them)",
        "stage_bytes": {"by_stage": sends["by_stage"], "total": sends["total_bytes"],
                        "messages": sends["messages"],
                        "analytic": analytic,
                        "analytic_basis": "2 (forward activations, backward gradients) x "
                                          "micro-batches x (S*V - 1) boundaries x one "
                                          "micro-batch's activation per device"},
        "memory": {
            "activation_bytes_per_microbatch": act,
            "activation_stash_bytes": sched.act_slots * act,
            "gradient_stash_bytes": sched.grad_slots * act,
            "live_activation_slots_by_stage": sched.act_slots_by_stage,
            "param_bytes_by_stage": stage_param_bytes(state, mesh),
            "compiled_temp_bytes": mem.get("temp_bytes"),
        },
    }
