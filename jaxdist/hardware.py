"""Predicting a step on hardware that is not here (`--hardware h200`): the part a run names
(`get_hardware`; the parts and their figures are `jaxdist.parts`), and the time model's
constants, the same for every part.

The efficiencies and latencies of the time model are in `MODEL_CONSTANTS`, each with its
justification; none is fitted per run. `clock_factor` and `rates_part` say how a part under a
power cap carries over its sibling's published kernel rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.parts import NAMED, PREDICTABLE, Part


@dataclass(frozen=True)
class Constant:
    value: float
    why: str


# The time models' constants: the same for every run (nothing fitted per run). Calibrated,
# each on one named record: the kernel model's kernel efficiency per generation
# (experiments/predict.py CALIBRATION), and the roofline's compute efficiency per generation
# (the model used where XLA:GPU's program or a part's kernel rates are not available); every
# other constant comes from a cited source.
_NCCL = ("NCCL src/graph/tuning.cc (NVIDIA/nccl @01afd20), Ring/Simple, the protocol NCCL "
         "picks for the 10-100 MB buffers of a training step")
MODEL_CONSTANTS: dict[str, Constant] = {
    "compute_efficiency_hopper": Constant(
        0.400, "fraction of dense peak at which the compiled step's FLOPs run on Hopper "
        "(H100/H200) at the rated clock, calibrated on tt24-t1-fsdp (torchtitan Llama3.1-8B "
        "FSDP, 8xH100 capped at 500 W): its 2.843 s step (16,384 tokens per GPU / 5,762 "
        "tok/s) over the 1.005e15 compiled FLOPs per device (remat recomputation and full, "
        "not causally halved, attention included; torchtitan's op-level selective AC, "
        "selective_op, recomputes 1.054x the 9.536e14 of the dots policy that stood in for "
        "it: XLA:GPU 9.445e14 / 8.961e14) at 989.5 TF/s is 0.357, at that part's clock under "
        "its cap (x 0.894, power_cap_clock_exponent); per compiled FLOP, so lower than an "
        "MFU"),
    "compute_efficiency_ampere": Constant(
        0.585, "the same on Ampere (A100; also used for A10G and L4, which have no record), "
        "calibrated on tt-a100-l3-8b-sac-op (torchtitan Llama3.1-8B FSDP, 64xA100 80GB): its "
        "2.755 s step (8,192 tokens per GPU / 2,973 tok/s) over the 5.026e14 compiled FLOPs "
        "per device (selective_op: 1.054x the dots policy's 4.768e14, as on Hopper) at 312 "
        "TF/s. Higher than Hopper's: the Hopper record ran 500 W-capped, and Hopper's peak is "
        "harder to reach with the same kernels"),
    # The kernel model's (jaxdist.predict.kernels_time) one fitted number per generation: the
    # fraction of the published best-case kernel rates (MAMF GEMM, cuDNN attention, HBM copy)
    # a training step's kernels reach (GEMM shapes off the sweet spot, SMs shared with the
    # overlapped NCCL kernels, tails). Unfitted, the model is 1.30x too fast on its record
    # (experiments.predict --validate).
    "kernel_efficiency_hopper": Constant(
        0.7615, "fitted on jaxtoolbox-7b (JAX-Toolbox MaxText Llama2-7B, FSDP over one DGX "
        "H100 node's 8 GPUs, 2 sequences per GPU, remat minimal_flash, 0.721 s a step "
        "published, planned with --overlap): the efficiency that gives 11,363 tokens/s/GPU "
        "(1.0001), found by bisection. A run on one node, whose NVLink collectives hide behind "
        "its kernels, so the fitted number carries no network's error; every other Hopper row "
        "is out of sample"),
    "kernel_efficiency_ampere": Constant(
        0.763, "fitted on tt-a100-l3-8b-sac-op (torchtitan Llama3.1-8B FSDP, 64 A100 80GB, "
        "2,973 tokens/s/GPU published), run under torchtitan's own op-level selective AC "
        "(remat selective_op): the efficiency that gives 2,973 (1.0000), found by "
        "bisection; every other Ampere row is out of sample"),
    "hbm_efficiency": Constant(
        0.8, "achievable fraction of HBM bandwidth for streaming kernels (STREAM-like "
        "copies reach ~80-90% of the datasheet figure on H100)"),
    "link_efficiency": Constant(
        0.8, "NCCL ring bus bandwidth over link rate: nccl-tests all-reduce busbw on DGX "
        "H100 reaches ~360-370 of 450 GB/s NVLink; across nodes the same fraction of the "
        "NICs' rate"),
    "ring_base_latency_s": Constant(
        8.4e-6, "fixed cost of one ring collective call: baseLat[Ring][Simple] = 8.4 us in "
        + _NCCL),
    "nvlink_hop_latency_s": Constant(
        3.4e-6, "per ring step between two GPUs of a node over NVLink: hwLat[NVLINK][Ring]"
        "[Simple] = 3.4 us in " + _NCCL),
    "pcie_hop_latency_s": Constant(
        5.7e-6, "per ring step between two GPUs of a node over PCIe: hwLat[PCI][Ring][Simple]"
        " = 5.7 us in " + _NCCL),
    "network_hop_latency_s": Constant(
        9.6e-6, "per ring step that crosses nodes (NCCL counts nNodes - 1 of them for an "
        "all-gather, 2 (nNodes - 1) for an all-reduce): hwLat[NET][Ring][Simple] = 9.6 us in "
        + _NCCL),
    "host_link_bandwidth_hopper": Constant(
        64e9, "bytes/s one way between a GPU and its host's pinned memory (remat offload's "
        "copies): PCIe Gen5 x16, 128 GB/s both ways on the H100 and H200 SXM datasheets; "
        "timed at link_efficiency of it"),
    "host_link_bandwidth_ampere": Constant(
        32e9, "bytes/s one way between a GPU and its host's pinned memory: PCIe Gen4 x16, "
        "64 GB/s both ways on the A100 datasheet; timed at link_efficiency of it"),
    # NCCL's tree algorithm with its LL protocol, which its tuner picks for the small
    # all-reduces of a step (a loss, a gradient norm) over many nodes, where a ring's
    # latency grows with every rank: base + 2 ((ranks per node - 1) x intra-node hop x 1.8
    # + log2(nodes) x network hop), at 0.9 / 3.8 of the ring's bus bandwidth
    "tree_ll_base_latency_s": Constant(
        4.4e-6, "baseLat[Tree][LL] = 4.4 us in NCCL src/graph/tuning.cc (NVIDIA/nccl @01afd20)"),
    "tree_ll_intra_hop_latency_s": Constant(
        0.52e-6 * 1.8, "hwLat[NVLINK][Tree][LL] = 0.52 us, x 1.8 across nodes (intraLat *= 1.8 "
        "for LL when nNodes > 1), in NCCL src/graph/tuning.cc (NVIDIA/nccl @01afd20)"),
    "tree_ll_network_hop_latency_s": Constant(
        5.0e-6, "hwLat[NET][Tree][LL] = 5.0 us in NCCL src/graph/tuning.cc (NVIDIA/nccl "
        "@01afd20), one per tree level (log2 of the nodes), both ways"),
    "tree_ll_bandwidth_factor": Constant(
        0.9 / 3.8, "a tree's LL bus bandwidth over the ring's: busBw x 0.9 (tree) x 1/3.8 (LL) "
        "in NCCL src/graph/tuning.cc (NVIDIA/nccl @01afd20)"),
    "power_cap_clock_exponent": Constant(
        1 / 3, "a power-limited GPU runs its compute at the clock where its dynamic power meets "
        "the cap; CMOS dynamic power is C V^2 f and, along the DVFS curve, V rises in proportion "
        "to f, so P ~ f^3 and the sustained clock under a cap P is f_rated (P / P_rated)^(1/3) "
        "(not fitted). Against published figures of one die at two power limits: NVIDIA's "
        "datasheets rate the GH100's dense BF16 at 989.5 TFLOP/s at 700 W (H100 SXM) and 835.5 at "
        "400 W (H100 NVL): 0.844, the law 0.830; ml-engineering's MAMF table (stas00/"
        "ml-engineering compute/accelerator/README.md @744d01e) measures the GA100 at 271.2 "
        "TFLOP/s in the 400 W SXM and 252.9 in the 250-300 W PCIe card: 0.933, the law 0.86-0.91. "
        "HBM runs on its own clock: streaming kernels keep their rate"),
}


def constant(name: str) -> float:
    return MODEL_CONSTANTS[name].value


def clock_factor(hw: Part) -> float:
    """The compute clock of `hw` under its power cap over the clock at which its published
    kernel rates were measured (the TDP of `rates_from`, else its own): 1.0 without a cap
    below that power (MODEL_CONSTANTS power_cap_clock_exponent)."""
    rated = NAMED[hw.rates_from].tdp_w if hw.rates_from else hw.tdp_w
    if not hw.power_cap_w or hw.power_cap_w >= rated:
        return 1.0
    return (hw.power_cap_w / rated) ** constant("power_cap_clock_exponent")


def rates_part(hw: Part) -> tuple[str, float, float]:
    """(the part whose published kernel rates apply, the factor on its compute rates, the
    factor on its streaming HBM rate) for `hw`: its own rates as published, or a sibling's
    scaled by the clock under the cap and by the HBM bandwidth."""
    if not hw.rates_from:
        return hw.name, clock_factor(hw), 1.0
    return (hw.rates_from, clock_factor(hw),
            hw.hbm_bandwidth / NAMED[hw.rates_from].hbm_bandwidth)


def compute_efficiency(hw: Part) -> float:
    return constant(f"compute_efficiency_{hw.efficiency}")


def kernel_efficiency(hw: Part) -> float:
    return constant(f"kernel_efficiency_{hw.efficiency}")


def get_hardware(name: str, gpus_per_node: int = 0) -> Part:
    """The predicted part named `name` (case-insensitive); `gpus_per_node` > 0 overrides its
    node size. Unknown, or a part that is only measured -> UsageError naming the known
    parts."""
    key = name.strip().lower()
    if key not in PREDICTABLE:
        from jaxdist.errors import did_you_mean
        raise UsageError(f"unknown --hardware {name!r}{did_you_mean(key, PREDICTABLE)}; "
                         f"known: {', '.join(PREDICTABLE)}")
    hw = NAMED[key]
    if gpus_per_node < 0:
        raise UsageError(f"--gpus-per-node {gpus_per_node} is negative; 0 keeps {hw.name}'s "
                         f"{hw.gpus_per_node}")
    if gpus_per_node:
        from dataclasses import replace
        hw = replace(hw, gpus_per_node=gpus_per_node)
    return hw


def check_nodes(hw: Part, devices: int) -> None:
    """A mesh over several nodes fills each node: its device count is a multiple of the
    node size (the placement model numbers devices node by node)."""
    if devices > hw.gpus_per_node and devices % hw.gpus_per_node:
        raise UsageError(f"the mesh's {devices} devices do not fill nodes of "
                         f"{hw.gpus_per_node} GPUs ({hw.name}); give --gpus-per-node a "
                         f"divisor of {devices}, or a mesh of a multiple of "
                         f"{hw.gpus_per_node} devices")


# The power model's constants (jaxdist.predict.power): at most three per GPU generation,
# each a fraction of the die's rated power (PartPower.die_rated_w), fitted on the rows they
# name (experiments/power_validation.py `fit`; the rows: experiments/power_rows.json),
# by a grid search of the three together (steps 0.02, 0.04, 0.01; memory-bound at most
# compute-bound) that keeps every per-rank power within 8% and the sweep's 250 and 200 W
# changes within 5 points, then has the most clock-row points within 8%, then the least
# worst clock-row error; the clock law between them is not fitted
# (power_cap_clock_exponent, and the part's base clock as the voltage floor's knee).
_AMPERE_ROWS = ("Perseus's GPT-3 XL and Bloom-3B PP4 ranks on A100 PCIe at 300 W, Zeus's "
                "power-limit sweep of the same jobs at 250 and 200 W, and Perseus's A100 SXM "
                "GPT-3 175B stage at six SM clocks")
POWER_CONSTANTS: dict[str, Constant] = {
    "compute_ampere": Constant(
        1.34, "what a compute-bound kernel draws at the maximum SM clock, as a fraction of "
        "the die's rated power (GA100: 536 W of 400 W, so a 300 W PCIe card or a 400 W SXM "
        "part running compute-bound kernels is held at its limit), fitted on " + _AMPERE_ROWS),
    "memory_ampere": Constant(
        1.34, "what a memory-bound kernel (and a collective's copy kernels) draws at the "
        "maximum SM clock, over the die's rated power, fitted on the same rows with the "
        "bound that it draw no more than a compute-bound kernel, which it reaches; only the "
        "A100 SXM stage, whose 19% of time that does not stretch with the clock it is (its "
        "TP8 all-reduces among it), constrains it"),
    "waiting_ampere": Constant(
        0.10, "what a GPU draws while it waits (exposed communication, pipeline bubble, "
        "launch gaps), over the die's rated power (GA100: 40 W; Perseus models 83.64 W "
        "blocking power on A100), fitted on the same rows"),
    # No development row measures a Hopper GPU's own power in training: Ampere's fractions,
    # of the GH100's 700 W, stand until one does.
    "compute_hopper": Constant(1.34, "compute_ampere's fraction, carried over (no Hopper row)"),
    "memory_hopper": Constant(1.34, "memory_ampere's fraction, carried over (no Hopper row)"),
    "waiting_hopper": Constant(0.10, "waiting_ampere's fraction, carried over (no Hopper row): "
                               "70 W of 700 W, the 69-78 W published for an idle Hopper GPU"),
}


def power_constant(phase: str, generation: str) -> float:
    return POWER_CONSTANTS[f"{phase}_{generation}"].value
