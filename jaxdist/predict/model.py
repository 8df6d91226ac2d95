"""The prediction model: pure functions from what the compiled step says (per-device FLOPs,
bytes accessed, collectives by kind/mesh axes/group size, the compiler's memory) and a
`Hardware` to a step time, its breakdown and the memory verdict. Every output is labelled
`predicted`.

Terms, per device per step:
- compute: FLOPs / (peak x compute_efficiency);
- HBM: bytes accessed / (HBM bandwidth x hbm_efficiency); the step's device time is the
  larger of the two (a roofline over the whole program);
- each collective: ring bytes / (link bandwidth x link_efficiency) + hops x latency, the link
  being NVLink/PCIe when every group of the collective stays in one node, else the node's
  NICs (the device order is host-major, as `jaxdist.mesh.hybrid_device_array` builds it);
- overlap "none": communication adds to compute; "overlap": it hides behind compute up to
  compute's length (the exposed part is what exceeds it);
- pipeline bubble: (S-1)/M of the device time for S stages and M micro-batches (1F1B/GPipe).
"""

from __future__ import annotations

import math

import numpy as np

from jaxdist.hardware import Hardware, constant

LABEL = "predicted"


def crosses_nodes(mesh: dict[str, int], axes, gpus_per_node: int) -> bool:
    """Whether a collective over mesh `axes` has a group spanning more than one node, with
    devices numbered row-major over the mesh (host-major: node = device id // per node)."""
    spanned = tuple(i for i, a in enumerate(mesh) if a in set(axes))
    if not spanned:
        return False
    node = np.arange(math.prod(mesh.values())).reshape(tuple(mesh.values())) // gpus_per_node
    return bool(np.any(node.max(axis=spanned) != node.min(axis=spanned)))


def ring_hops(kind: str, n: int) -> int:
    """Latency-bound steps of a ring collective over n devices."""
    if n <= 1:
        return 0
    return {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)


def collective_time(op: dict, hw: Hardware, mesh: dict[str, int]) -> dict:
    """Seconds of one (aggregated) collective: `op` has kind, axes, group_size, ring_bytes
    and count (how many times it runs per step)."""
    inter = crosses_nodes(mesh, op["axes"], hw.gpus_per_node)
    bandwidth = (hw.inter_node_bandwidth if inter else hw.intra_node_bandwidth) * \
        constant("link_efficiency")
    latency = constant("inter_node_latency_s" if inter else "intra_node_latency_s")
    seconds = op["ring_bytes"] / bandwidth + \
        op.get("count", 1) * ring_hops(op["kind"], op["group_size"]) * latency
    return {"link": "inter-node" if inter else "intra-node", "seconds": seconds}


def aggregate(ops: list[dict]) -> list[dict]:
    """Collectives (jaxdist.comm.collectives entries) summed by (kind, axes, group size)."""
    out: dict = {}
    for op in ops:
        key = (op["kind"], tuple(op["axes"]), op["group_size"])
        row = out.setdefault(key, {"kind": key[0], "axes": list(key[1]), "group_size": key[2],
                                   "count": 0, "bytes": 0, "ring_bytes": 0.0})
        row["count"] += op.get("times", 1)
        row["bytes"] += op["bytes"]
        row["ring_bytes"] += op["ring_bytes"]
    return list(out.values())


def step_time(flops: float, bytes_accessed: float, comm: list[dict], hw: Hardware,
              mesh: dict[str, int], dtype: str, overlap: bool = False, stages: int = 1,
              microbatches: int = 1, matmul_precision: str = "default") -> dict:
    """The predicted step and its breakdown (seconds); `comm` is `aggregate`'s output."""
    peak = hw.peak_flops(dtype, matmul_precision)
    if not peak:
        raise ValueError(f"{hw.name} has no {dtype} peak in jaxdist.metrics.PEAKS")
    compute = flops / (peak * constant("compute_efficiency"))
    hbm = bytes_accessed / (hw.hbm_bandwidth * constant("hbm_efficiency"))
    device = max(compute, hbm)
    links = {"intra-node": 0.0, "inter-node": 0.0}
    rows = []
    for op in comm:
        t = collective_time(op, hw, mesh)
        links[t["link"]] += t["seconds"]
        rows.append({**op, **t})
    comm_total = links["intra-node"] + links["inter-node"]
    exposed = max(0.0, comm_total - device) if overlap else comm_total
    bubble = device * (stages - 1) / microbatches if stages > 1 else 0.0
    total = device + exposed + bubble
    # What dominates: the largest term; with overlap, communication longer than the device
    # time bounds the step, so then the device time is not the bottleneck.
    bounded = overlap and comm_total > device
    terms = {"compute": compute if compute >= hbm and not bounded else 0.0,
             "HBM": hbm if hbm > compute and not bounded else 0.0,
             "intra-node": links["intra-node"], "inter-node": links["inter-node"],
             "pipeline bubble": bubble}
    return {"label": LABEL, "step_s": total, "compute_s": compute, "hbm_s": hbm,
            "intra_node_s": links["intra-node"], "inter_node_s": links["inter-node"],
            "comm_exposed_s": exposed, "bubble_s": bubble,
            "overlap": "hidden behind compute up to its length" if overlap else "none",
            "bottleneck": max(terms, key=terms.get), "collectives": rows,
            "peak_flops_per_device": peak}


def throughput(step: dict, tokens_per_step: int | None, model_flops_per_step: float,
               num_devices: int) -> dict:
    seconds, peak = step["step_s"], step["peak_flops_per_device"]
    return {"label": LABEL,
            "tokens_per_s_per_gpu": (tokens_per_step / seconds / num_devices
                                     if tokens_per_step and seconds else None),
            "mfu": model_flops_per_step / (seconds * peak * num_devices) if seconds else None}


def memory_verdict(state_bytes: int, temp_bytes: int, hw: Hardware) -> dict:
    """Per-device bytes against HBM capacity. The train state is exact; the compiler's
    temporaries come from XLA:CPU and are an upper bound (6-7x the published peaks in
    --validate), so `fits` is decided only where the bound decides it: True when state +
    temporaries fit, False when the state alone does not, else None (unknown) with why."""
    need = state_bytes + temp_bytes
    if need <= hw.hbm_bytes:
        fits, reason = True, None
    elif state_bytes > hw.hbm_bytes:
        fits, reason = False, "the train state alone exceeds HBM (exact)"
    else:
        fits, reason = None, ("the state fits; with XLA:CPU's temporaries, an upper bound "
                              "that --validate shows 6-7x above measured peaks, it would not")
    return {"label": LABEL, "state_bytes": state_bytes, "temp_bytes": temp_bytes,
            "temp_note": "XLA:CPU temporaries (L x L attention scores removed for flash "
                         "attention decoders): an upper bound for the GPU",
            "total_bytes": need, "hbm_bytes": hw.hbm_bytes, "fits": fits,
            "fits_reason": reason,
            "over_by_bytes": max(0, need - hw.hbm_bytes),
            "headroom_bytes": max(0, hw.hbm_bytes - need)}