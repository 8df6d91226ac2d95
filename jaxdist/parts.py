"""GPU parts as data: one record per part, every figure with its source. Adding a GPU is one
record here.

A `Part` holds what jaxdist knows of one GPU:

- `patterns` on the device_kind it reports and its dense peak FLOP/s (`peak`, by datasheet):
  the MFU of a measured run (`peak_row`, `peak_flops`);
- for a part a step can be predicted on (`--hardware NAME`, the names in `PREDICTABLE`): what
  it reports as device_kind, HBM capacity and bandwidth, per-GPU link bandwidth inside a node
  (NVLink or PCIe) and across nodes (the node's InfiniBand/Ethernet NICs shared by its GPUs),
  GPUs per node, TDP and a power cap, each with its source;
- the XLA:GPU target the real GPU compiler compiles for without a device (`target`; the
  format is `jaxdist.program.gpu_targets`);
- published achievable kernel rates (`rates`, `attention_curves`; `rate`): the inputs of the
  kernel-by-kernel time model (jaxdist.predict.kernels_time).

What a peak and a rate are, and the publications the rates cite, are
`jaxdist.part_figures`.

A part that is only measured (A10, L40S, ...) has only its patterns and peak; a predicted part
whose device_kind a sibling's pattern matches (same datasheet row) carries no peak of its own.

Link bandwidths are one direction, per GPU: a ring collective sends and receives at the same
time, so what bounds it is the one-way rate (NVLink 4: 900 GB/s bidirectional = 450 GB/s
each way). Nothing here is fitted to a training run (the time model's constants are
`jaxdist.hardware.MODEL_CONSTANTS`). Data only: no jax, no numpy (jaxdist.config reads the
part names before jax is imported).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from jaxdist.program.gpu_targets import ADDED, XLA_SPEC, GpuTarget, gpu_device_info
from jaxdist.part_figures import (A100_BANDWIDTHTEST, ANY_DTYPE, CUDNN_NORMS, CUDNN_SDPA, FA2,
                                  FLASHMLA, KINDS, LAUNCH, MAMF, MAMF_FP8, MATMUL_PRECISIONS,
                                  SAME_DIE, Peak, Rate)
from jaxdist import part_figures as pf
from jaxdist.part_figures import NodePower, PartPower

GB = 1e9


@dataclass(frozen=True)
class Part:
    name: str                   # a --hardware name where the part is predicted
    # --- prediction (None on a part that is only measured): the fields a plan records
    device_kind: str | None = None  # what the device reports (matched by a pattern below)
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None         # bytes/s
    intra_node_bandwidth: float | None = None  # bytes/s per GPU, one direction
    inter_node_bandwidth: float | None = None  # bytes/s per GPU, one direction
    gpus_per_node: int | None = None
    tdp_w: float | None = None
    sources: tuple[str, ...] = ()
    # Which calibrated compute efficiency applies (jaxdist.hardware.MODEL_CONSTANTS
    # "compute_efficiency_<x>") and what the GPUs of a node talk over (NCCL's per-hop latency
    # differs).
    efficiency: str = "hopper"
    intra_node_link: str = "nvlink"
    # A board power limit below the die's rated power (the part's published kernel rates were
    # measured at `rates_from`'s TDP), and the part whose published kernel rates this one
    # carries over: same die, compute rates scaled by its clock under the cap
    # (jaxdist.hardware.clock_factor), streaming rates by its HBM bandwidth.
    power_cap_w: float | None = None
    rates_from: str | None = None
    # --- the FLOP peak: regexes on the upper-cased device_kind (the first matching part in
    # PARTS wins) and the datasheet's dense peaks
    patterns: tuple[str, ...] = ()
    peak: Peak | None = None
    # --- the XLA:GPU target, and the published kernel rates: (kind, dtype) -> Rate, and
    # dtype -> ((seq_len, forward FLOP/s, backward FLOP/s), ...)
    target: GpuTarget | None = field(default=None, hash=False)
    rates: dict = field(default_factory=dict, hash=False)
    attention_curves: dict = field(default_factory=dict, hash=False)
    # --- what it draws and its clocks (jaxdist.part_figures.PartPower); None: no record, so
    # no power is predicted on it
    power: PartPower | None = field(default=None, hash=False)

    @property
    def predictable(self) -> bool:
        return self.hbm_bytes is not None

    def peak_flops(self, dtype: str, matmul_precision: str = "default") -> float | None:
        return peak_flops(self.device_kind, dtype, matmul_precision)

    def fp8_peak_flops(self) -> float | None:
        return fp8_peak_flops(self.device_kind)

    def prediction_fields(self) -> dict:
        """The part as a plan records it (plan.json "hardware")."""
        return {k: getattr(self, k) for k in PREDICTION_FIELDS}

    def target_text(self, usable_bytes: float | None = None) -> str:
        """The XLA:GPU target description (GpuTargetConfigProto text) of this part."""
        return self.target.text(self.device_kind, usable_bytes)


PREDICTION_FIELDS = ("name", "device_kind", "hbm_bytes", "hbm_bandwidth",
                     "intra_node_bandwidth", "inter_node_bandwidth", "gpus_per_node", "tdp_w",
                     "sources", "efficiency", "intra_node_link", "power_cap_w", "rates_from")


# --------------------------------------------------------------------- shared figures

_A100 = dict(bf16=624e12 / 2, tf32=312e12 / 2, fp32=19.5e12)
# FP8: H100 SXM and H200 SXM datasheets 3,958* TF, H100 NVL and H200 NVL 3,341* TF (* with
# sparsity); the A100 has no FP8 tensor cores
_H100_SXM = dict(bf16=1979e12 / 2, tf32=989e12 / 2, fp32=67e12, fp8=3958e12 / 2)
_NVL = dict(bf16=1671e12 / 2, tf32=835e12 / 2, fp32=60e12, fp8=3341e12 / 2)

_NVLINK4 = "NVLink 4 (Hopper): 900 GB/s bidirectional per GPU (H100/H200 datasheets) -> 450 GB/s one way"
_CX7 = ("DGX H100/H200 and HGX reference nodes: 8x ConnectX-7 400 Gb/s InfiniBand, one per "
        "GPU (NVIDIA DGX H100 user guide) -> 50 GB/s per GPU")

# Published XLA:GPU specs, field for field (gpu_targets.XLA_SPEC names the file and commit)
_H100_SXM_INFO = gpu_device_info((9, 0), 132, 128, 3352320000000, 52428800, 1.98, 84978434048,
                                 233472, 232448)
_A100_80_INFO = gpu_device_info((8, 0), 108, 64, 2039040000000, 41943040, 1.41, 85100068864,
                                167936, 166912)
_A6000_INFO = gpu_device_info((8, 6), 84, 128, 768096000000, 6291456, 1.8, 51041271808, 102400,
                              101376, 1536)
_H100_SXM_SPEC = XLA_SPEC.format("h100_sxm.txtpb", "3f745823431d34a4978362caf76cda3ef80ea8ff")


def _memory(info: dict, hbm_bytes: float, hbm_bandwidth: float) -> dict:
    """A published spec with a part's own memory (a derived target)."""
    return {**info, "memory_bandwidth": int(hbm_bandwidth),
            "device_memory_size": int(hbm_bytes)}


# The memory of the parts whose targets are derived (written once: the part and its target)
_H200_HBM = (141 * GB, 4.8e12)
_H100_96GB_HBM = (96 * GB, 2.4e12)
_A10G_HBM = (24 * GB, 600 * GB)

_LAUNCH = Rate(5e-6, LAUNCH, "midpoint of the published 4-6 us, measured on another GPU: the "
               "cost is host and driver side, not a property of the part")

# attention by sequence length: (seq_len, forward FLOP/s, backward FLOP/s), H200 measured
_H200_ATTENTION = ((2048, 484e12, 370e12), (4096, 591e12, 474e12), (8192, 644e12, 541e12),
                   (16384, 673e12, 579e12), (32768, 688e12, 581e12))
_H200_ATTENTION_KERNELS = {
    ("attention_fwd", "bfloat16"): Rate(688e12, CUDNN_SDPA + ", q/kv seq 32768"),
    ("attention_bwd", "bfloat16"): Rate(581e12, CUDNN_SDPA + ", q/kv seq 32768"),
}
_A100_SXM_KERNELS = {
    ("gemm", "bfloat16"): Rate(271.2e12, MAMF + ", row NVIDIA A100 SXM"),
    ("attention_fwd", "bfloat16"): Rate(
        0.73 * 312e12, FA2, "73% of the 312 TFLOP/s peak, as the paper states it"),
    ("attention_bwd", "bfloat16"): Rate(
        0.63 * 312e12, FA2, "63% of the 312 TFLOP/s peak, as the paper states it"),
    ("launch", ANY_DTYPE): _LAUNCH,
}


# The power records (jaxdist.part_figures.PartPower): limits, idle and SM clocks
_A100_SXM_80_POWER = PartPower(
    limit_w=400, limit_min_w=100, limit_max_w=400, die_rated_w=400, idle_w=None,
    base_clock_mhz=1095, max_clock_mhz=1410, clock_min_mhz=210, clock_step_mhz=15,
    generation="ampere", sources=(pf.NVIDIA_A100_DATASHEET, pf.TPU_A100_SXM, pf.NVML_CLOCKS,
                                  "limit range 100-400 W: nvidia-smi -q -d POWER on A100 SXM4"))
_HOPPER_CLOCKS = dict(base_clock_mhz=1590, max_clock_mhz=1980, clock_min_mhz=345,
                      clock_step_mhz=15, generation="hopper")
_H100_SXM_POWER = PartPower(
    limit_w=700, limit_min_w=200, limit_max_w=700, die_rated_w=700, idle_w=72,
    sources=(pf.NVIDIA_H100_DATASHEET, pf.TPU_H100_SXM, pf.HOPPER_IDLE,
             "limit range 200-700 W: nvidia-smi -q -d POWER on H100 SXM (" + pf.POWER_ROWS
             + ": settable 200-700 W on the H200, the same board power design)"),
    **_HOPPER_CLOCKS)
_H200_POWER = PartPower(
    limit_w=700, limit_min_w=200, limit_max_w=700, die_rated_w=700, idle_w=75,
    sources=(pf.NVIDIA_H200_DATASHEET, pf.HOPPER_IDLE, pf.POWER_ROWS + ": settable 200-700 W "
             "on H200", "clocks: the GH100 die's (" + pf.TPU_H100_SXM + ")"),
    **_HOPPER_CLOCKS)


# --------------------------------------------------------------------- the parts

# The order is the device_kind match order (first match wins: GH200 before H200, NVL and
# PCIe before the plain H100 and H200 (the SXM part reports "NVIDIA H100 80GB HBM3"), A100
# PCIe before A100, L40S before L40 before L4, A10G before A10) and, for the predicted parts,
# the --hardware listing. h100-sxm's pattern leaves the PCIe card to h100-pcie below it.
PARTS: tuple[Part, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (A100 40GB/80GB PCIe and SXM share these rates):
    # FP32 19.5 TF, TF32 156 | 312* TF, BF16 312 | 624* TF (* with sparsity).
    # The power record is the 80 GB card's (300 W); the 40 GB card (250 W) has none.
    Part("a100-pcie", patterns=(r"A100.*PCIE",), peak=Peak("A100 PCIe (40/80 GB)", **_A100),
         power=PartPower(limit_w=300, limit_min_w=150, limit_max_w=300, die_rated_w=400,
                         idle_w=None, base_clock_mhz=1065, max_clock_mhz=1410,
                         clock_min_mhz=210, clock_step_mhz=15, generation="ampere",
                         sources=(pf.NVIDIA_A100_DATASHEET, pf.TPU_A100_PCIE_80,
                                  pf.NVML_CLOCKS, pf.PERSEUS_HW,
                                  "limit range 150-300 W: nvidia-smi -q -d POWER on A100 "
                                  "PCIe 80 GB; die_rated_w: the GA100's SXM4 TDP"))),
    # NVIDIA A40 datasheet: FP32 37.4 TF, TF32 74.8 | 149.6* TF, BF16 149.7 | 299.4* TF.
    Part("a40", patterns=(r"\bA40\b",),
         peak=Peak("A40", bf16=299.4e12 / 2, tf32=149.6e12 / 2, fp32=37.4e12),
         power=PartPower(limit_w=300, limit_min_w=100, limit_max_w=300, die_rated_w=300,
                         idle_w=None, base_clock_mhz=1305, max_clock_mhz=1740,
                         clock_min_mhz=210, clock_step_mhz=15, generation="ampere",
                         sources=(pf.NVIDIA_A40_DATASHEET, pf.TPU_A40, pf.NVML_CLOCKS,
                                  "limit range 100-300 W: nvidia-smi -q -d POWER on A40"))),
    # NVIDIA Grace Hopper Superchip (GH200) datasheet: the H100-class GPU's rates, FP32 67 TF,
    # TF32 494 | 989* TF, BF16 990 | 1,979* TF.
    Part("gh200", patterns=(r"GH200",), peak=Peak("GH200 (Hopper GPU)", **_H100_SXM)),
    # NVIDIA H200 datasheet, H200 NVL column: FP32 60 TF, TF32 835* TF, BF16 1,671* TF. The
    # NVL card is also named "H200 PCIe" in NVIDIA's driver tables (allenai/OLMo-core#810).
    Part("h200-nvl", patterns=(r"H200.*(NVL|PCIE)",), peak=Peak("H200 NVL", **_NVL)),
    # NVIDIA H100 datasheet, H100 NVL column (per GPU): FP32 60 TF, TF32 835* TF, BF16
    # 1,671* TF.
    Part("h100-nvl", patterns=(r"H100.*NVL",), peak=Peak("H100 NVL", **_NVL)),
    Part("h100-sxm", "NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 450 * GB, 50 * GB, 8, 700,
         ("NVIDIA H100 datasheet, SXM column: 80 GB HBM3, 3.35 TB/s, TDP up to 700 W",
          _NVLINK4, _CX7),
         # NVIDIA H100 datasheet, H100 SXM column: FP32 67 TF, TF32 989* TF, BF16 1,979* TF.
         patterns=(r"^(?!.*H100.*PCIE).*H100",), peak=Peak("H100 SXM", **_H100_SXM),
         target=GpuTarget(_H100_SXM_INFO, (_H100_SXM_SPEC, ADDED)),
         rates={
             ("gemm", "bfloat16"): Rate(794.5e12, MAMF + ", row NVIDIA H100 SXM"),
             ("gemm", "float8"): Rate(1402.6e12, MAMF_FP8 + ", row NVIDIA H100 SXM"),
             **{k: Rate(r.value, r.source, SAME_DIE + " (taken from the H200 figure)")
                for k, r in _H200_ATTENTION_KERNELS.items()},
             ("hbm_copy", ANY_DTYPE): Rate(
                 3000e9, FLASHMLA,
                 "H800 SXM5 has the H100 SXM's HBM3 (3.35 TB/s); only NVLink differs"),
             ("launch", ANY_DTYPE): _LAUNCH},
         attention_curves={"bfloat16": _H200_ATTENTION}, power=_H100_SXM_POWER),  # SAME_DIE
    # Google Cloud's A3 VMs: 8 H100 SXM 80 GB over NVLink 4, and GPU-to-GPU traffic between VMs
    # over GPUDirect-TCPX(O) NICs, not InfiniBand (Google Cloud, "Networking and GPU machines",
    # compute/docs/gpus/gpu-network-bandwidth): A3 High 4 NICs x 200 Gbps for the GPUs
    # (1,000 Gbps in all with the general-purpose gVNIC), A3 Mega 8 x 200 Gbps (1,800 Gbps in
    # all). The die, HBM and kernel rates are h100-sxm's.
    *(Part(name, "NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 450 * GB, gbps / 8 / 8 * GB, 8, 700,
           ("NVIDIA H100 datasheet, SXM column: 80 GB HBM3, 3.35 TB/s, TDP up to 700 W",
            _NVLINK4, f"Google Cloud {vm}: {nics} x 200 Gbps GPUDirect-{tcpx} NICs for "
            f"GPU-to-GPU traffic -> {gbps:,} Gbps per VM, {gbps / 8 / 8:g} GB/s per GPU"),
           rates_from="h100-sxm", target=GpuTarget(_H100_SXM_INFO, (_H100_SXM_SPEC, ADDED)),
           power=_H100_SXM_POWER)
      for name, vm, nics, tcpx, gbps in (("h100-sxm-a3-high", "A3 High", 4, "TCPX", 800),
                                         ("h100-sxm-a3-mega", "A3 Mega", 8, "TCPXO", 1600))),
    Part("h100-pcie", "NVIDIA H100 PCIe", 80 * GB, 2.0e12, 64 * GB, 50 * GB, 8, 350,
         ("NVIDIA H100 datasheet, PCIe column: 80 GB HBM2e, 2 TB/s, TDP 300-350 W",
          "PCIe Gen5 x16: 128 GB/s bidirectional -> 64 GB/s one way (no NVLink bridge "
          "assumed)",
          "assumed: one 400 Gb/s NIC per GPU, as in the SXM nodes (50 GB/s)"),
         intra_node_link="pcie",
         # NVIDIA H100 datasheet, H100 PCIe column: FP32 51 TF, TF32 756* TF, BF16 1,513* TF.
         patterns=(r"H100.*PCIE",),
         peak=Peak("H100 PCIe", bf16=1513e12 / 2, tf32=756e12 / 2, fp32=51e12,
                   fp8=3026e12 / 2),  # H100 PCIe datasheet: FP8 3,026* TF
         target=GpuTarget(
             gpu_device_info((9, 0), 114, 128, 2039040000000, 52428800, 1.755, 84942979072,
                             233472, 232448),
             (XLA_SPEC.format("h100_pcie.txtpb", "e7e3ef56a71e3a169ad74c19f15966491073fc68"),
              ADDED))),
    Part("h200", "NVIDIA H200", *_H200_HBM, 450 * GB, 50 * GB, 8, 700,
         ("NVIDIA H200 datasheet, H200 SXM column: 141 GB HBM3e, 4.8 TB/s, TDP up to 700 W",
          _NVLINK4, _CX7.replace("DGX H100/H200", "DGX H200")),
         # NVIDIA H200 datasheet, H200 SXM column: FP32 67 TF, TF32 989* TF, BF16 1,979* TF.
         patterns=(r"H200",), peak=Peak("H200 SXM", **_H100_SXM),
         target=GpuTarget(
             _memory(_H100_SXM_INFO, *_H200_HBM), (_H100_SXM_SPEC, ADDED),
             derived="XLA publishes no H200 spec: the H100 SXM one (same GH100 die, 132 SMs, "
                     "50 MB L2, 1.98 GHz boost) with the H200's memory",
             changed={"memory_bandwidth": "4.8 TB/s HBM3e (NVIDIA H200 datasheet, H200 SXM "
                                          "column)",
                      "device_memory_size": "141 GB (NVIDIA H200 datasheet, H200 SXM column)",
                      "device_description_str": "'NVIDIA H200', the device_kind an H200 "
                                                "reports"}),
         rates={
             ("gemm", "bfloat16"): Rate(
                 794.5e12, MAMF + ", row NVIDIA H100 SXM, note 'H200 is the same'",
                 "the table states H200 equals H100 SXM"),
             ("gemm", "float8"): Rate(1453.4e12, MAMF_FP8 + ", row NVIDIA H200 SXM"),
             **_H200_ATTENTION_KERNELS,
             ("hbm_copy", ANY_DTYPE): Rate(3770.9e9, CUDNN_NORMS),
             ("launch", ANY_DTYPE): _LAUNCH},
         attention_curves={"bfloat16": _H200_ATTENTION}, power=_H200_POWER),
    # The H100 that torchtitan's Llama 3.1 runs used (benchmarks/llama3_h100_202412_torchtitan.md:
    # "Meta Grand Teton, 96 GB HBM2e, 2.4 TB/s, lower-TDP SXM H100, default 500 W power
    # limit"): the GH100 die of h100-sxm, its HBM2e and its 500 W limit. Its peak is the
    # H100 SXM row (h100-sxm's pattern matches its device_kind); its kernel rates are
    # h100-sxm's, scaled (rates_from).
    Part("h100-sxm-96gb-500w", "NVIDIA H100 96GB HBM2e", *_H100_96GB_HBM, 450 * GB, 50 * GB, 8,
         500,
         ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @31a17bf: Meta "
          "Grand Teton, 8 H100 per host (NVLink), 96 GB HBM2e, 2.4 TB/s, lower-TDP SXM "
          "H100, default 500 W power limit, 400 Gb/s RDMA per GPU", _NVLINK4,
          "400 Gb/s RDMA per GPU (the same torchtitan page) -> 50 GB/s per GPU"),
         power_cap_w=500, rates_from="h100-sxm",
         power=dataclasses.replace(_H100_SXM_POWER, limit_w=500, idle_w=None),
         target=GpuTarget(
             _memory(_H100_SXM_INFO, *_H100_96GB_HBM), (_H100_SXM_SPEC, ADDED),
             derived="XLA publishes no spec for the 96 GB HBM2e H100 (torchtitan's Grand Teton "
                     "part): the H100 SXM one (same GH100 die, 132 SMs, 50 MB L2) with its "
                     "memory; its 500 W limit is in its power_cap_w, not here",
             changed={"memory_bandwidth": "2.4 TB/s HBM2e (pytorch/torchtitan benchmarks/"
                                          "llama3_h100_202412_torchtitan.md)",
                      "device_memory_size": "96 GB (the same page)",
                      "device_description_str": "'NVIDIA H100 96GB HBM2e', named here (the "
                                                "page does not give the device_kind)"})),
    # The A100 SXM4 row: the 40 GB part's pattern matches the 80 GB part's device_kind too.
    Part("a100-sxm-40gb", "NVIDIA A100-SXM4-40GB", 40 * GB, 1.555e12, 300 * GB, 25 * GB, 8, 400,
         ("NVIDIA A100 datasheet, 40GB SXM column: 40 GB HBM2, 1,555 GB/s, TDP 400 W",
          "NVLink 3: 600 GB/s bidirectional per GPU -> 300 GB/s one way",
          "DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU -> "
          "25 GB/s per GPU (NVIDIA DGX A100 user guide)"), efficiency="ampere",
         patterns=(r"A100",), peak=Peak("A100 SXM4 (40/80 GB)", **_A100),
         target=GpuTarget(
             {**_A100_80_INFO, "memory_bandwidth": 1555200000000,
              "device_memory_size": 42331013120},
             (XLA_SPEC.format("a100_sxm_40.txtpb", "b1fb6997953ff50b59faf79af9183f94475cf762"),
              ADDED)),
         rates={
             **_A100_SXM_KERNELS,
             ("gemm", "bfloat16"): Rate(
                 271.2e12, MAMF + ", row NVIDIA A100 SXM",
                 "the row does not name the memory size; the 40 GB and 80 GB SXM4 parts share "
                 "the GA100 die and its 312 TFLOP/s bf16 peak"),
             ("hbm_copy", ANY_DTYPE): Rate(
                 1226.1e9, A100_BANDWIDTHTEST, "measured on the PCIe card, whose HBM2 matches "
                 "the SXM4 40GB's (1,555 GB/s)")}),
    Part("a100-sxm-80gb", "NVIDIA A100-SXM4-80GB", 80 * GB, 2.039e12, 300 * GB, 25 * GB, 8, 400,
         ("NVIDIA A100 datasheet, 80GB SXM column: 80 GB HBM2e, 2,039 GB/s, TDP 400 W",
          "NVLink 3: 600 GB/s bidirectional per GPU -> 300 GB/s one way",
          "DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s"),
         efficiency="ampere",
         target=GpuTarget(
             _A100_80_INFO,
             (XLA_SPEC.format("a100_sxm_80.txtpb", "97dfeadf71bd425fa1acbb170126afcb670c33e6"),
              ADDED)),
         rates={
             **_A100_SXM_KERNELS,
             ("hbm_copy", ANY_DTYPE): Rate(
                 1226.1e9 * 2039 / 1555, A100_BANDWIDTHTEST,
                 "the A100 40GB's measured fraction of its datasheet bandwidth (1226.1 / 1555) "
                 "applied to the 80GB's 2,039 GB/s HBM2e")},
         power=_A100_SXM_80_POWER),
    # NVIDIA publishes no A10G figures (AWS's variant of the A10, clocked a little lower):
    # the A10 datasheet's FP32 31.2 TF, TF32 62.5 | 125* TF, BF16 125 | 250* TF stand in,
    # so an A10G's MFU is against an A10 proxy peak (slightly optimistic peak, low MFU).
    Part("a10g", "NVIDIA A10G", *_A10G_HBM, 32 * GB, 100 / 8 * GB / 8, 8, 150,
         ("NVIDIA A10 datasheet (A10G: AWS's variant): 24 GB GDDR6, 600 GB/s, TDP 150 W",
          "PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s one way",
          "AWS g5.48xlarge: 8 A10G, 100 Gb/s network per instance -> 12.5 GB/s / 8 GPUs"),
         efficiency="ampere", intra_node_link="pcie",
         patterns=(r"A10G",), peak=Peak("A10G (A10 datasheet as proxy)", bf16=250e12 / 2,
                                        tf32=125e12 / 2, fp32=31.2e12),
         target=GpuTarget(
             {**_memory(_A6000_INFO, *_A10G_HBM), "core_count": 80, "clock_rate_ghz": 1.71},
             (XLA_SPEC.format("a6000.txtpb", "dd0b533d53850a75d1d7270312088f23326e38d5"),
              ADDED),
             derived="XLA publishes no A10G spec: the RTX A6000 one (same GA102 die, sm_86, "
                     "6 MB L2) with the A10G's SM count, clock and memory",
             changed={"core_count": "80 SMs (AWS G5 / NVIDIA A10G: 80 RT cores, one per SM)",
                      "clock_rate_ghz": "1.71 GHz boost (NVIDIA A10 datasheet)",
                      "memory_bandwidth": "600 GB/s GDDR6 (NVIDIA A10 datasheet)",
                      "device_memory_size": "24 GB (NVIDIA A10 datasheet)",
                      "device_description_str": "'NVIDIA A10G', the device_kind an A10G "
                                                "reports"})),
    Part("a10", patterns=(r"\bA10\b",),
         peak=Peak("A10", bf16=250e12 / 2, tf32=125e12 / 2, fp32=31.2e12)),
    # NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183 | 366* TF, BF16 362.05 | 733* TF, FP8
    # 733 | 1,466* TF.
    Part("l40s", patterns=(r"L40S",), peak=Peak("L40S", bf16=362.05e12, tf32=183e12,
                                                fp32=91.6e12, fp8=733e12)),
    Part("l4", "NVIDIA L4", 24 * GB, 300 * GB, 32 * GB, 100 / 8 * GB / 8, 8, 72,
         ("NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, TDP 72 W, PCIe Gen4 x16",
          "PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s one way",
          "AWS g6.48xlarge: 8 L4, 100 Gb/s network per instance -> 12.5 GB/s / 8 GPUs"),
         efficiency="ampere", intra_node_link="pcie",
         # NVIDIA L4 datasheet: FP32 30.3 TF, TF32 120* TF, BF16 242* TF, FP8 485* TF.
         patterns=(r"\bL4\b",), peak=Peak("L4", bf16=242e12 / 2, tf32=120e12 / 2,
                                         fp32=30.3e12, fp8=485e12 / 2)),
    # torchtitan's table (pytorch/torchtitan, torchtitan/tools/utils.py), from NVIDIA's
    # Blackwell datasheet: BF16 2.25 PF dense; FP8 4.5 PF dense (NVIDIA HGX B200: 72 PF
    # FP8 with sparsity over 8 GPUs). TF32/FP32 not checked here: null.
    Part("b200", patterns=(r"B200",), peak=Peak("B200", bf16=2.25e15, tf32=None, fp32=None,
                                                fp8=4.5e15)),
    # NVIDIA V100 datasheet: FP32 15.7 TF (SXM2), 14 TF (PCIe); no BF16 or TF32 tensor cores.
    Part("v100-pcie", patterns=(r"V100.*PCIE",),
         peak=Peak("V100 PCIe", bf16=None, tf32=None, fp32=14e12, tensor_float32=False)),
    Part("v100-sxm2", patterns=(r"V100",),
         peak=Peak("V100 SXM2", bf16=None, tf32=None, fp32=15.7e12, tensor_float32=False)),
    # NVIDIA T4 datasheet: FP32 8.1 TF; no BF16 or TF32 tensor cores (Turing).
    Part("t4", patterns=(r"\bT4\b",),
         peak=Peak("T4", bf16=None, tf32=None, fp32=8.1e12, tensor_float32=False)),
)

NAMED: dict[str, Part] = {p.name: p for p in PARTS}

# The servers the power model's node figures are for: one record per system kind. The
# non-GPU overhead is the one figure per node record (jaxdist.predict.power); None where no
# published figure separates it.
NODES: dict[str, NodePower] = {n.name: n for n in (
    # 8x H100 SXM HGX: before training, 1.93-2.13 kW = the non-GPU floor + 8 idle GPUs at
    # 69-75 W: 2.03 - 8 x 0.072 = 1.45 kW (derived). While training the non-GPU share is
    # not published apart from the GPUs; the idle floor stands for it.
    NodePower("hgx-h100", "h100-sxm", 8, non_gpu_idle_w=1454, non_gpu_training_w=1454,
              metering="DC", sources=(pf.SMC_NODE, pf.HOPPER_IDLE)),
    # 8x H200 SXM HGX: the same baseboard, CPUs and NICs as the H100's (NVIDIA rates both
    # DGX systems at 10.2 kW max); no published figure of its own: hgx-h100's non-GPU power
    NodePower("hgx-h200", "h200", 8, non_gpu_idle_w=1454, non_gpu_training_w=1454,
              metering="DC", sources=(pf.SMC_NODE, "carried over from hgx-h100: the same "
                                      "HGX baseboard, CPUs and NICs; DGX H100 and DGX H200 "
                                      "are both rated about 10.2 kW max")),
)}
NODE_OF_PART = {n.part: n.name for n in NODES.values()}
# The parts a step can be predicted on, in --hardware order (jaxdist.config's help)
PREDICTABLE: tuple[str, ...] = tuple(p.name for p in PARTS if p.predictable)


# --------------------------------------------------------------------- views

def part_for_device_kind(device_kind: str | None) -> str | None:
    """The predicted part whose device_kind string the device reports, exactly (case and
    surrounding spaces aside); None when none does."""
    kind = (device_kind or "").strip().lower()
    for name in PREDICTABLE:
        if NAMED[name].device_kind.lower() == kind:
            return name
    return None


def peak_row(device_kind: str) -> Peak | None:
    """The datasheet peak row of the part whose pattern matches `device_kind` first."""
    kind = device_kind.upper()
    for part in PARTS:
        for pattern in part.patterns:
            if re.search(pattern, kind):
                return part.peak
    return None


def peak_flops(device_kind: str, dtype: str, matmul_precision: str = "default") -> float | None:
    """Dense peak FLOP/s of one device for matmuls in `dtype` at JAX's
    `jax_default_matmul_precision`, or None where the table has no figure (unknown part,
    or a rate the part lacks)."""
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision {matmul_precision!r}: choose from "
                         f"{', '.join(MATMUL_PRECISIONS)}")
    row = peak_row(device_kind)
    if row is None:
        return None
    if dtype == "bfloat16":  # precision settings only change 32-bit matmuls
        return row.bf16
    if dtype == "float8":  # MFU of an FP8 run is against the bf16 peak, as NeMo and MaxText
        # report it (fp8_peak_flops: its FP8 GEMMs' own); None where the part has no FP8
        return row.bf16 if row.fp8 else None
    if dtype == "float32":
        if matmul_precision == "highest" or not row.tensor_float32:
            return row.fp32
        return row.tf32
    raise ValueError(f"dtype {dtype!r}: choose from bfloat16, float32, float8")


def fp8_peak_flops(device_kind: str) -> float | None:
    """Dense FP8 tensor-core peak FLOP/s of one device, or None (no FP8, or not tabled)."""
    row = peak_row(device_kind)
    return None if row is None else row.fp8


def rate(part: str, kind: str, dtype: str) -> Rate:
    """The achievable rate of `kind` kernels in `dtype` on the part named `part`. KeyError,
    naming what is tabled, where no published figure exists (never a guess)."""
    if kind not in KINDS:
        raise KeyError(f"unknown kernel kind {kind!r}: choose from {', '.join(KINDS)}")
    key = (kind, ANY_DTYPE if kind in ("hbm_copy", "launch") else dtype)
    tabled = NAMED[part].rates if part in NAMED else {}
    if key not in tabled:
        have = sorted(f"{k[0]}/{k[1]}" for k in tabled)
        raise KeyError(f"no published {kind} rate for {part} in {dtype}" +
                       (f"; {part} has: {', '.join(have)}" if have else
                        f"; parts with rates: {', '.join(rate_parts())}"))
    return tabled[key]


def rate_parts() -> list[str]:
    return sorted(p.name for p in PARTS if p.rates)


def attention_curve(part: str, dtype: str) -> tuple[tuple[int, float, float], ...]:
    """(seq_len, forward FLOP/s, backward FLOP/s) points, causal, head dim 128, where
    published for the part (see CUDNN_SDPA), else (): shorter sequences run slower."""
    return NAMED[part].attention_curves.get(dtype, ()) if part in NAMED else ()
