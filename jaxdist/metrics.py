"""What a run measures besides time: latency statistics, memory, sharding, FLOPs and MFU
(against the datasheet peaks of `jaxdist.parts`)."""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import padding

from jaxdist.parts import peak_flops, peak_row


def latency_stats(seconds) -> dict:
    """Distribution of per-step latencies; ci95 is the half-width of the mean's 95% CI,
    Student's t with n-1 degrees of freedom at every n (no normal approximation)."""
    t = np.asarray(seconds, dtype=np.float64)
    n = t.size
    std = float(t.std(ddof=1)) if n > 1 else 0.0
    # Student's t quantile from scipy.special (0.2 s to import; scipy.stats, the same
    # function as stats.t.ppf, costs 0.6 s of CPU in every run's summary)
    from scipy.special import stdtrit

    crit = float(stdtrit(n - 1, 0.975)) if n > 1 else None
    return {
        "n": int(n),
        "mean": float(t.mean()),
        "std": std,
        "p50": float(np.percentile(t, 50)),
        "p90": float(np.percentile(t, 90)),
        "p99": float(np.percentile(t, 99)),
        "min": float(t.min()),
        "max": float(t.max()),
        "ci95": crit * std / math.sqrt(n) if n > 1 else None,
    }


def step_time_block(timed_s) -> dict:
    """results["step_time_s"]: the timed steps' distribution, or, for a run interrupted
    before its first timed step, null figures with the reason."""
    if len(timed_s):
        return latency_stats(timed_s)
    return dict(dict.fromkeys(("mean", "std", "p50", "p90", "p99", "min", "max", "ci95")),
                n=0, reason="interrupted before the first timed step (after warm-up)")


def scalar(x) -> float:
    """A replicated scalar as a Python float, also when other processes hold copies too."""
    return float(x.addressable_data(0)) if isinstance(x, jax.Array) else float(x)


def state_bytes_by_device(state) -> list[dict]:
    """Exact bytes of the train state's shards held by each device, gathered from every
    process (each process sees only its own devices' shards)."""
    per_device: dict = defaultdict(int)
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    rows = np.array([[d.id, d.process_index, b] for d, b in per_device.items()], np.int64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        rows = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, 3)
    return [{"device": int(i), "process": int(p), "bytes": int(b)}
            for i, p, b in sorted(rows.tolist())]


def state_bytes_by_part(state) -> dict:
    """Exact bytes of each state part (params, master, model_state, opt) on this process's
    device holding the most state, and their total."""
    per_device: dict = defaultdict(lambda: defaultdict(int))
    for part, tree in state.items():
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device][part] += shard.data.nbytes
    fullest = max(per_device.values(), key=lambda parts: sum(parts.values()))
    out = {part: int(fullest.get(part, 0)) for part in state}
    return {**out, "total": sum(out.values())}


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def sharding_summary(abstract_state, specs, logical_state=None) -> dict:
    """Global bytes of the leaves a layout shards vs replicates, per state part, as stored
    (`abstract_state`: padding included); `padding_bytes`: what the padding adds to the
    `logical_state` (sharding/padding.py)."""
    out = {"sharded_bytes": 0, "replicated_bytes": 0, "replicated_leaves": 0, "parts": {},
           "padding_bytes": (padding.padding_bytes(logical_state, abstract_state)
                             if logical_state is not None else 0)}
    for part in abstract_state:
        leaves = jax.tree.leaves(abstract_state[part])
        part_specs = jax.tree.leaves(specs[part], is_leaf=lambda x: isinstance(x, P))
        sharded = replicated = count = 0
        for leaf, spec in zip(leaves, part_specs, strict=True):
            if any(axis is not None for axis in spec):
                sharded += _nbytes(leaf)
            else:
                replicated += _nbytes(leaf)
                count += 1 if leaf.shape else 0  # scalars (step counts) are replicated by design
        out["parts"][part] = {"sharded_bytes": sharded, "replicated_bytes": replicated}
        out["sharded_bytes"] += sharded
        out["replicated_bytes"] += replicated
        out["replicated_leaves"] += count
    return out


def shard_bytes(leaf, spec, axis_sizes: dict[str, int]) -> int:
    """One device's bytes of `leaf` placed by `spec` (a shard of a dimension is
    ceil(size / shards))."""
    dims = list(leaf.shape)
    for i, axes in enumerate(spec):
        if axes is not None:
            n = math.prod(axis_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))
            dims[i] = -(-dims[i] // n)
    return math.prod(dims) * np.dtype(leaf.dtype).itemsize


def planned_bytes_per_device(abstract_state, specs, axis_sizes: dict[str, int]) -> dict:
    """Per-device bytes a layout would give each state part on a mesh of `axis_sizes`,
    from shapes and specs alone (a shard of a dimension is ceil(size / shards))."""
    out = {}
    for part in abstract_state:
        leaves = jax.tree.leaves(abstract_state[part])
        part_specs = jax.tree.leaves(specs[part], is_leaf=lambda x: isinstance(x, P))
        out[part] = sum(shard_bytes(leaf, spec, axis_sizes)
                        for leaf, spec in zip(leaves, part_specs))
    out["total"] = sum(out.values())
    return out


def param_count(abstract_state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state["params"]))


PEAK_BYTES_NOTE = ("allocation upper bound, not a measured peak: argument + output - alias + "
                   "temp bytes per device, as if all were live at once (the live peak can be "
                   "lower); allocations outside the program (allocator pools, library "
                   "workspaces) are not included")


def compiled_memory(compiled) -> dict | None:
    """The compiler's per-device figures for the compiled step. `peak_bytes` is an upper
    bound on what the program allocates (argument + output - alias + temp; XLA's own
    `peak_memory_in_bytes` leaves out temporaries), not a measured peak: see
    `peak_bytes_note`, which travels with it into results.json."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if m is None:
        return None
    fields = {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "generated_code_bytes": m.generated_code_size_in_bytes,
        # host memory the program holds (saved activations a remat policy offloads),
        # not device memory: not in peak_bytes
        "host_temp_bytes": getattr(m, "host_temp_size_in_bytes", 0),
    }
    fields = {k: int(v) for k, v in fields.items()}
    fields["peak_bytes"] = (fields["argument_bytes"] + fields["output_bytes"]
                            - fields["alias_bytes"] + fields["temp_bytes"])
    fields["peak_bytes_note"] = PEAK_BYTES_NOTE
    return fields


def measured_peak(devices) -> tuple[int | None, str | None]:
    """Largest `peak_bytes_in_use` over local devices, or (None, why not)."""
    peaks = []
    for d in devices:
        if d.process_index != jax.process_index():
            continue
        stats = d.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None, f"{d.platform} backend reports no memory_stats()"
        peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks), None


def compiled_flops(compiled) -> float | None:
    """Per-device FLOPs of one compiled program as XLA's cost analysis counts them (per SPMD
    partition). The analysis counts a while loop's body once, whatever its trip count:
    `jaxdist.train_step.compiled_step_flops` corrects for the micro-batch loop."""
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list):  # older JAX returned one dict per computation
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def mfu(device_kind: str, dtype: str, num_devices: int, step_s: float | None,
        compiled_flops_per_device: float | None, model_flops_per_step: float,
        matmul_precision: str = "default") -> dict:
    """Model FLOPs utilisation: the model's analytic training FLOPs per step (what
    MaxText, torchtitan and Megatron publish) over step time x peak x devices; `hfu` is the
    same with the FLOPs the compiled program executes (rises with recomputation)."""
    peak = peak_flops(device_kind, dtype, matmul_precision)
    compiled_step = (compiled_flops_per_device * num_devices
                     if compiled_flops_per_device is not None else None)
    out = {
        "value": None,
        "hfu": None,
        "peak_flops_per_device": peak,
        "model_flops_per_step": model_flops_per_step,
        "compiled_flops_per_step": compiled_step,
        "reason": None,
    }
    if dtype == "float8":  # FP8 GEMMs, MFU against the bf16 peak as NeMo and MaxText report
        out["peak_basis"] = "bfloat16"
    if peak is None:
        row = peak_row(device_kind)
        out["reason"] = (f"no peak FLOP/s for device kind {device_kind!r}: not a known GPU "
                         f"part" if row is None else
                         f"the {row.part} row has no {dtype} peak at matmul precision "
                         f"{matmul_precision!r}")
        return out
    if not step_s:  # a run interrupted before its first timed step
        out["reason"] = "no timed step: the run stopped during warm-up"
        return out
    denominator = step_s * peak * num_devices
    out["value"] = model_flops_per_step / denominator
    if compiled_step is not None:
        out["hfu"] = compiled_step / denominator
    return out
