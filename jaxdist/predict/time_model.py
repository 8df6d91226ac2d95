"""The prediction model: pure functions from what the compiled step says (per-device FLOPs,
bytes accessed, collectives by kind/mesh axes/group size, the compiler's memory) and a part
(`jaxdist.parts.Part`) to a step time and its breakdown (the memory verdict is
jaxdist.predict.verdict's). Every output is labelled `predicted`.

Terms, per device per step:
- compute: FLOPs / (peak x the part's calibrated compute efficiency);
- HBM: bytes accessed / (HBM bandwidth x hbm_efficiency); the step's device time is the
  larger of the two (a roofline over the whole program);
- each collective, as NCCL's ring runs it: ring bytes / (bandwidth x link_efficiency) +
  NCCL's latency (a base per call, a per-step latency for the steps inside a node and a
  larger one for the steps that cross nodes, from NCCL's own tuning model). Inside a node the
  bandwidth is NVLink/PCIe per GPU. Across nodes it is the NICs of the k group members a node
  holds: NCCL runs one ring channel per NIC, so each node boundary of the ring is crossed on
  k NICs at once and only 1/k of the ring's bytes go through any one NIC (capped by the
  intra-node link). Which nodes a collective spans is read from its replica groups (or
  source-target pairs) against the host of each device of the compiled program
  (`jaxdist.program.comm.spread`); without that map, from the mesh as `jaxdist.mesh.placement`
  lays it on the part's nodes;
- overlap "none": communication adds to compute; "overlap": it hides behind compute up to
  compute's length (the exposed part is what exceeds it);
- pipeline bubble: (S-1)/M of the device time for S stages and M micro-batches (1F1B/GPipe).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NotRequired, TypedDict

import numpy as np

from jaxdist.figures import ABSENT, Figures
from jaxdist.plan_words import TimeTerms, roofline_terms
from jaxdist.hardware import clock_factor, compute_efficiency, constant
from jaxdist.parts import Part
from jaxdist.program.comm import Collective
from jaxdist.program.hlo import ring_steps

LABEL = "predicted"


@dataclasses.dataclass(frozen=True)
class StepTime(Figures):
    """The predicted step (seconds per device) and its terms, plan.json's `time` block, from
    any of the three models: the roofline (`step_time`), kernel by kernel (`kernel_step`)
    or tick by tick (jaxdist.predict.ticks.tick_model). `device_s` is the device's time,
    `exposed_*` the communication that adds to it, by link; the kernel model alone has
    launches, host copies and per-kind seconds, a pipeline alone its ticks (`pipeline`)."""
    step_s: float
    compute_s: float
    hbm_s: float
    intra_node_s: float
    inter_node_s: float
    comm_exposed_s: float
    bubble_s: float
    bottleneck: str
    device_s: float
    exposed_intra_node_s: float
    exposed_inter_node_s: float
    overlap: str = ""
    collectives: list = dataclasses.field(default_factory=list)
    peak_flops_per_device: float | None = None
    label: str = LABEL
    model: str = ABSENT                       # kernel model: what timed it
    launch_s: float = ABSENT                  # kernel model: launch overheads
    host_transfer_s: float = ABSENT           # kernel model: HBM <-> host copies (offload)
    exposed_host_transfer_s: float = ABSENT
    upper_bound: bool = ABSENT                # kernel model: a branch counted every time
    by_kind: dict[str, float] = ABSENT        # kernel model: seconds per kernel kind
    rates: dict[str, str] = ABSENT            # kernel model: where each rate comes from
    kernel_efficiency: float | None = ABSENT
    device_s_exact: float = ABSENT
    pipeline: Figures = ABSENT                # ticks: jaxdist.predict.ticks.PipelineTime
    terms: TimeTerms = ABSENT                 # the step in TIME_TERMS


@dataclasses.dataclass(frozen=True)
class LinkTime(Figures):
    """Seconds of one collective on the link it crosses, and the nodes its groups span."""
    link: str
    nodes: int
    members_per_node: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Throughput(Figures):
    """Tokens/s per GPU and MFU of a predicted step ("if it fit" where it does not)."""
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    label: str = LABEL
    if_it_fit: bool = ABSENT


def group_nodes(mesh: dict[str, int], axes, nodes) -> tuple[int, int]:
    """(nodes a group spans, fewest members it has in one of them) for a collective over
    mesh `axes`; `nodes`: the node of every mesh position (an array over the axes), or GPUs
    per node, the mesh placed on such nodes as jaxdist.mesh.placement places it; the worst
    group of the collective."""
    from jaxdist.mesh import host_of

    spanned = tuple(i for i, a in enumerate(mesh) if a in set(axes))
    if not spanned:
        return 1, 1
    shape = tuple(mesh.values())
    node = np.asarray(nodes).reshape(shape) if np.ndim(nodes) else host_of(mesh, nodes)
    others = tuple(i for i in range(len(shape)) if i not in spanned)
    groups = np.moveaxis(node, spanned + others, tuple(range(len(shape))))
    groups = groups.reshape(math.prod(shape[i] for i in spanned), -1).T
    worst = (1, math.prod(shape[i] for i in spanned))
    for g in groups:
        _, counts = np.unique(g, return_counts=True)
        worst = max(worst, (len(counts), int(counts.min())), key=lambda t: (t[0], -t[1]))
    return worst


def crosses_nodes(mesh: dict[str, int], axes, gpus_per_node: int) -> bool:
    """Whether a collective over mesh `axes` has a group spanning more than one node."""
    return group_nodes(mesh, axes, gpus_per_node)[0] > 1


@dataclasses.dataclass(frozen=True)
class AxisLinks(Figures):
    """The links one mesh axis's groups use: `in_node` members in each of `nodes` nodes."""
    in_node: int
    nodes: int
    links: str


def axis_links(mesh: dict[str, int], hw: Part, nodes=None) -> dict[str, AxisLinks]:
    """Per mesh axis, the links its groups use: {axis: {in_node, nodes, links}}: `in_node`
    members of a group in each of `nodes` nodes, and in words, e.g. "8 in-node (NVLink) x 16
    across nodes (network)". `nodes`: the node of each mesh position (the devices a program
    was compiled for: jaxdist.program.compiled.mesh_hosts), else the mesh placed on `hw`'s
    nodes (jaxdist.mesh.placement)."""
    from jaxdist.mesh import axis_spread, host_of

    intra = {"nvlink": "NVLink", "pcie": "PCIe"}.get(hw.intra_node_link, hw.intra_node_link)
    network = f"network, {hw.inter_node_bandwidth / 1e9:g} GB/s per GPU"
    spread = axis_spread(mesh, host_of(mesh, hw.gpus_per_node) if nodes is None else nodes)
    out = {}
    for axis, s in spread.items():
        words = ([f"{s['in_host']} in-node ({intra})"] if s["in_host"] > 1 else []) + \
            ([f"{s['hosts']} across nodes ({network})"] if s["hosts"] > 1 else [])
        out[axis] = AxisLinks(in_node=s["in_host"], nodes=s["hosts"],
                              links=" x ".join(words) or "1 (no communication)")
    return out


# Latency-bound steps of a ring collective over n devices (or n nodes: the steps that cross
# nodes), as NCCL counts them: the ring rule that also gives the bytes each device sends.
ring_hops = ring_steps


def ring_latency(kind: str, n: int, nodes: int, hw: Part) -> float:
    """Seconds of latency of one ring collective call (NCCL's model, tuning.cc): base +
    (steps - inter-node steps) x intra-node hop + inter-node steps x network hop."""
    steps = ring_hops(kind, n)
    if not steps:
        return 0.0
    inter = ring_hops(kind, nodes) if kind != "collective-permute" else int(nodes > 1)
    intra_hop = constant(f"{hw.intra_node_link}_hop_latency_s")
    return constant("ring_base_latency_s") + (steps - inter) * intra_hop + \
        inter * constant("network_hop_latency_s")


def tree_latency(n: int, nodes: int) -> float:
    """Seconds of latency of one all-reduce over NCCL's tree, LL protocol, across `nodes`
    nodes of n / nodes ranks each (tuning.cc): base + 2 ((n / nodes - 1) x intra-node hop +
    log2(nodes) x network hop)."""
    return constant("tree_ll_base_latency_s") + 2 * (
        (n // nodes - 1) * constant("tree_ll_intra_hop_latency_s") +
        int(math.log2(nodes)) * constant("tree_ll_network_hop_latency_s"))


def collective_time(op: dict, hw: Part, mesh: dict[str, int]) -> LinkTime:
    """Seconds of one (aggregated) collective: `op` has kind, axes, group_size, ring_bytes
    and count (how many times it runs per step)."""
    nodes, per_node = (op["nodes"], op["members_per_node"]) if "nodes" in op else \
        group_nodes(mesh, op["axes"], hw.gpus_per_node)
    inter = nodes > 1
    rate = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth) if inter else \
        hw.intra_node_bandwidth
    bandwidth = rate * constant("link_efficiency")
    count = op.get("count", 1)
    seconds = op["ring_bytes"] / bandwidth + \
        count * ring_latency(op["kind"], op["group_size"], nodes, hw)
    if op["kind"] == "all-reduce" and inter:  # or a tree, where NCCL's tuner would pick it
        seconds = min(seconds, op["ring_bytes"] / (bandwidth * constant(
            "tree_ll_bandwidth_factor")) + count * tree_latency(op["group_size"], nodes))
    return LinkTime(link="inter-node" if inter else "intra-node", nodes=nodes,
                    members_per_node=per_node, seconds=seconds)


# Collectives summed by kind, mesh axes, group size and (where known) the nodes they span
# (`aggregate`): how many run per step (`count`), their bytes and ring bytes, and whether any
# is an upper bound or asynchronous.
AggregatedCollective = TypedDict("AggregatedCollective", {
    "kind": str, "axes": list, "group_size": int, "nodes": NotRequired[int],
    "members_per_node": NotRequired[int], "count": float, "bytes": float,
    "ring_bytes": float, "upper_bound": bool, "async": bool})


def aggregate(ops: list[Collective]) -> list[AggregatedCollective]:
    """Collectives (jaxdist.program.comm.collectives entries) summed by (kind, axes, group
    size, and the nodes they span where known)."""
    out: dict = {}
    for op in ops:
        spans = {k: op[k] for k in ("nodes", "members_per_node") if k in op}
        key = (op["kind"], tuple(op["axes"]), op["group_size"], *spans.values())
        row = out.setdefault(key, {"kind": key[0], "axes": list(key[1]), "group_size": key[2],
                                   **spans, "count": 0, "bytes": 0, "ring_bytes": 0.0,
                                   "upper_bound": False, "async": False})
        row["count"] += op.get("times", 1)
        row["bytes"] += op["bytes"]
        row["ring_bytes"] += op["ring_bytes"]
        # A count from a branch the caller gave no frequency for stays flagged (upper bound).
        row["upper_bound"] |= bool(op.get("upper_bound"))
        row["async"] |= bool(op.get("async"))
    return list(out.values())


def step_time(flops: float, bytes_accessed: float, comm: list[dict], hw: Part,
              mesh: dict[str, int], dtype: str, overlap: bool = False, stages: int = 1,
              microbatches: int = 1, matmul_precision: str = "default") -> StepTime:
    """The predicted step and its terms (seconds), by the roofline; `comm` is `aggregate`'s
    output. Without overlap all communication is exposed; with it, what outlasts the device
    time is, shared between the links in proportion to each link's time."""
    peak = hw.peak_flops(dtype, matmul_precision)
    if not peak:
        raise ValueError(f"{hw.name} has no {dtype} peak in jaxdist.parts")
    compute = flops / (peak * compute_efficiency(hw) * clock_factor(hw))  # under a power cap
    hbm = bytes_accessed / (hw.hbm_bandwidth * constant("hbm_efficiency"))
    device = max(compute, hbm)
    links = {"intra-node": 0.0, "inter-node": 0.0}
    rows = []
    for op in comm:
        t = collective_time(op, hw, mesh)
        links[t.link] += t.seconds
        rows.append({**op, **t.to_json()})
    comm_total = links["intra-node"] + links["inter-node"]
    exposed = max(0.0, comm_total - device) if overlap else comm_total
    share = exposed / comm_total if comm_total else 0.0
    bubble = device * (stages - 1) / microbatches if stages > 1 else 0.0
    terms = roofline_terms(compute, hbm, device, {k: v * share for k, v in links.items()},
                           bubble)
    # What dominates: the largest term; with overlap, communication longer than the device
    # time bounds the step (the device time hides under it): then the link with the most.
    bounded = overlap and comm_total > device
    return StepTime(
        step_s=device + exposed + bubble, compute_s=compute, hbm_s=hbm,
        intra_node_s=links["intra-node"], inter_node_s=links["inter-node"],
        comm_exposed_s=exposed, bubble_s=bubble,
        overlap="hidden behind compute up to its length" if overlap else "none",
        bottleneck=max(links, key=links.get) if bounded else terms.bottleneck(),
        collectives=rows, peak_flops_per_device=peak,
        device_s=device, exposed_intra_node_s=links["intra-node"] * share,
        exposed_inter_node_s=links["inter-node"] * share, terms=terms)


def kernel_step(kt, comm: list[dict], hw: Part, mesh: dict[str, int],
                dtype: str, matmul_precision: str = "default") -> StepTime:
    """`step_time`'s record from the kernel-by-kernel model (jaxdist.predict.kernels_time's
    `KernelTime`) of an XLA:GPU program: device time is the sum of its kernels,
    communication is exposed where the program's schedule leaves it uncovered."""
    terms = TimeTerms(compute_s=kt.compute_s,
                      memory_bound_s=kt.device_s - kt.compute_s - kt.launch_s,
                      launch_s=kt.launch_s, exposed_intra_node_s=kt.exposed_intra_node_s,
                      exposed_inter_node_s=kt.exposed_inter_node_s, bubble_s=0.0,
                      launches_modelled=True)
    return StepTime(
        model="kernel by kernel (XLA:GPU program, published rates)",
        step_s=kt.device_s + kt.comm_exposed_s, compute_s=kt.compute_s, hbm_s=kt.hbm_s,
        launch_s=kt.launch_s, intra_node_s=kt.intra_node_s, inter_node_s=kt.inter_node_s,
        comm_exposed_s=kt.comm_exposed_s, bubble_s=0.0,
        exposed_intra_node_s=kt.exposed_intra_node_s,
        exposed_inter_node_s=kt.exposed_inter_node_s,
        host_transfer_s=kt.host_transfer_s,
        exposed_host_transfer_s=kt.exposed_host_transfer_s,
        overlap="as XLA:GPU's schedule places each collective between its start and done",
        bottleneck=terms.bottleneck(), upper_bound=kt.upper_bound,
        by_kind=kt.by_kind, rates=kt.rates, kernel_efficiency=kt.kernel_efficiency,
        collectives=[{**op, **collective_time(op, hw, mesh).to_json()} for op in comm],
        peak_flops_per_device=hw.peak_flops(dtype, matmul_precision),
        device_s_exact=kt.device_s, device_s=kt.device_s, terms=terms)


def throughput(step: StepTime, tokens_per_step: int | None, model_flops_per_step: float,
               num_devices: int) -> Throughput:
    seconds, peak = step.step_s, step.peak_flops_per_device
    return Throughput(
        tokens_per_s_per_gpu=(tokens_per_step / seconds / num_devices
                              if tokens_per_step and seconds else None),
        mfu=model_flops_per_step / (seconds * peak * num_devices) if seconds else None)
