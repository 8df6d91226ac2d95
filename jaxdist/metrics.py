"""What a run measures besides time: latency statistics, memory, sharding, FLOPs and MFU."""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

# Two-sided 95% Student-t critical values by degrees of freedom; 1.96 beyond 30.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def latency_stats(seconds) -> dict:
    """Distribution of per-step latencies; ci95 is the half-width of the mean's 95% CI."""
    t = np.asarray(seconds, dtype=np.float64)
    n = t.size
    std = float(t.std(ddof=1)) if n > 1 else 0.0
    crit = _T95[n - 2] if 2 <= n <= 31 else 1.96
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


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def sharding_summary(abstract_state, specs) -> dict:
    """Global (logical) bytes of the leaves a layout shards vs replicates, per state part."""
    out = {"sharded_bytes": 0, "replicated_bytes": 0, "replicated_leaves": 0, "parts": {}}
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


def planned_bytes_per_device(abstract_state, specs, axis_sizes: dict[str, int]) -> dict:
    """Per-device bytes a layout would give each state part on a mesh of `axis_sizes`,
    from shapes and specs alone (a shard of a dimension is ceil(size / shards))."""
    def shard_bytes(leaf, spec) -> int:
        dims = list(leaf.shape)
        for i, axes in enumerate(spec):
            if axes is not None:
                n = math.prod(axis_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))
                dims[i] = -(-dims[i] // n)
        return math.prod(dims) * np.dtype(leaf.dtype).itemsize

    out = {}
    for part in abstract_state:
        leaves = jax.tree.leaves(abstract_state[part])
        part_specs = jax.tree.leaves(specs[part], is_leaf=lambda x: isinstance(x, P))
        out[part] = sum(shard_bytes(leaf, spec) for leaf, spec in zip(leaves, part_specs))
    out["total"] = sum(out.values())
    return out


def param_count(abstract_state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state["params"]))


def compiled_memory(compiled) -> dict | None:
    """The compiler's per-device figures for the compiled step. Its `peak_memory_in_bytes`
    leaves out temporaries, so the peak here is argument + output - alias + temp."""
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
    }
    fields = {k: int(v) for k, v in fields.items()}
    fields["peak_bytes"] = (fields["argument_bytes"] + fields["output_bytes"]
                            - fields["alias_bytes"] + fields["temp_bytes"])
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
    """Per-device FLOPs of one compiled step (cost analysis is per SPMD partition)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list):  # older JAX returned one dict per computation
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


# Dense peak FLOP/s per device (NVIDIA datasheets). float32 matmuls run as TF32 on these
# parts under XLA's default precision, so the float32 column is the TF32 tensor-core peak.
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float32": 494e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12},   # SXM; PCIe parts are ~25% lower
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    # A10 datasheet (A10G, AWS's variant, publishes no figure and clocks a little lower).
    "A10G": {"bfloat16": 125e12, "float32": 62.5e12},
}


def peak_flops(device_kind: str, dtype: str) -> float | None:
    kind = device_kind.upper()
    for name in ("H200", "H100", "A100", "A10G"):  # longest-match order: A100 before A10G
        if name in kind:
            return PEAK_FLOPS[name][dtype]
    return None


def mfu(device_kind: str, dtype: str, num_devices: int, step_s: float,
        compiled_flops_per_device: float | None, analytic_flops_per_step: float) -> dict:
    peak = peak_flops(device_kind, dtype)
    compiled_step = (compiled_flops_per_device * num_devices
                     if compiled_flops_per_device is not None else None)
    out = {
        "value": None,
        "analytic_value": None,
        "peak_flops_per_device": peak,
        "compiled_flops_per_step": compiled_step,
        "analytic_flops_per_step": analytic_flops_per_step,
        "reason": None,
    }
    if peak is None:
        out["reason"] = f"peak FLOP/s unknown for device kind {device_kind!r}"
        return out
    denominator = step_s * peak * num_devices
    if compiled_step is not None:
        out["value"] = compiled_step / denominator
    out["analytic_value"] = analytic_flops_per_step / denominator
    return out
