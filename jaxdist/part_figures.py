"""What a part's figures are, and where the published ones come from: the datasheet peak
FLOP/s (`Peak`), the kernel kinds with a published achievable rate and one such rate
(`Rate`), and the publications those rates cite. The records that carry them, one per GPU
part, are `jaxdist.parts`. Data only: no jax, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass


# Peak FLOP/s per device, dense (NVIDIA datasheets quote tensor-core figures "with
# sparsity", twice the dense rate: those are written as quoted / 2).
#   bf16: BF16 tensor cores        - bfloat16 compute, any matmul precision
#   tf32: TF32 tensor cores        - float32 under precision "default" or "high": XLA:GPU lets
#         cuBLAS/cuDNN use TF32 whenever every operand precision is <= HIGH (openxla/xla,
#         xla/backends/gpu/autotuner/cudnn.cc: `allow_tf32 = ... precision <=
#         PrecisionConfig::HIGH`), and jax-ml/jax#18934: "Precision('bfloat16_3x') ... will
#         get tensorfloat32 on A100". So "high" is not bf16_3x on these GPUs.
#   fp32: plain FP32 (CUDA cores)  - float32 under precision "highest"
#   fp8:  FP8 tensor cores (e4m3 / e5m2) - the FP8 GEMMs of --dtype float8; None on parts
#         without them (before Ada and Hopper), where --dtype float8 has no rate to plan at
# A part without TF32 (before Ampere) runs float32 matmuls at the FP32 rate at any precision.
# None: the datasheet gives no figure (or none checked here): mfu is then null, not a guess.
@dataclass(frozen=True)
class Peak:
    part: str                    # the datasheet row, as results name it
    bf16: float | None
    tf32: float | None
    fp32: float | None
    tensor_float32: bool = True  # False before Ampere: float32 matmuls never use TF32
    fp8: float | None = None


MATMUL_PRECISIONS = ("default", "high", "highest")

# Kernel kinds with a published rate (`Rate`):
# - `gemm`: dense cuBLAS matmul, FLOP/s, best large shape (the maximum achievable rate; no
#   published source found gives the fall-off for small shapes, so none is tabled).
# - `attention_fwd`, `attention_bwd`: fused (cuDNN / flash) attention at head dim 128, causal,
#   FLOP/s counted as their benchmarks count them (forward 4 * s^2 * d * heads, halved when
#   causal; backward 2.5x the forward), at the longest sequence tabled; a part's
#   `attention_curves` give the rate by sequence length where one was published.
# - `hbm_copy`: bytes/s a streaming (memory-bound) kernel achieves, read + write counted.
# - `launch`: seconds of per-kernel launch overhead.
KINDS = ("gemm", "attention_fwd", "attention_bwd", "hbm_copy", "launch")
ANY_DTYPE = "any"   # hbm_copy and launch do not depend on the element type


@dataclass(frozen=True)
class Rate:
    """One published achievable rate: its source (title / repo / path / commit, or paper and
    section) and, when the figure was not measured on that part, how it was carried over."""
    value: float          # FLOP/s (gemm, attention_*), bytes/s (hbm_copy), seconds (launch)
    source: str
    derived: str = ""     # empty: measured on this part as published

    @property
    def measured_on_part(self) -> bool:
        return not self.derived


# Kernel-rate sources
MAMF = ("Stas Bekman, ml-engineering, repo stas00/ml-engineering, path "
        "compute/accelerator/README.md, commit 7bc7c3054eb93c277a4755c597ae0864d77a63f1, "
        "'Maximum Achievable Matmul FLOPS comparison table', BF16")
MAMF_FP8 = ("Stas Bekman, ml-engineering, repo stas00/ml-engineering, path "
            "compute/accelerator/README.md, commit 744d01e18b79512572f64a6bbd8b5f4a725203a7, "
            "'Maximum Achievable Matmul FLOPS comparison table', FP8 (float8_e4m3fn)")
CUDNN_SDPA = ("NVIDIA cudnn-frontend SDPA training benchmark, repo NVIDIA/cudnn-frontend, path "
              "benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/"
              "llama3.1_20260227_034703.csv, commit df73764adb98b7445b77662ce07b1ea434c8f3ee, "
              "backend cudnn, bfloat16, top_left (causal) mask, 64 q / 8 kv heads, head dim 128, "
              "batch 1, NVIDIA H200, cuDNN 9.19")
CUDNN_NORMS = ("NVIDIA cudnn-frontend norms benchmark, repo NVIDIA/cudnn-frontend, path "
               "benchmark/norms/results/h200/all_models_20260227_035147.csv, commit "
               "df73764adb98b7445b77662ce07b1ea434c8f3ee, row llama3-70b rms_norm cudnn bfloat16 "
               "N 8192 x C 8192, fwd_gbps, NVIDIA H200")
FLASHMLA = ("DeepSeek FlashMLA README, repo deepseek-ai/FlashMLA, path README.md, commit "
            "9241ae3ef9bac614dd25e45e507e089f888280e0: dense MLA decoding kernel 'up to 3000 "
            "GB/s in memory-bound configuration' on H800 SXM5, CUDA 12.8")
FA2 = ("Tri Dao, FlashAttention-2 (arXiv 2307.08691), section 1 and 4.1: 'up to 73% of the "
       "theoretical max throughput in the forward pass, and up to 63% ... in the backward "
       "pass' on A100 (312 TFLOP/s bf16 dense), head dims 64/128, with and without causal mask")
A100_BANDWIDTHTEST = ("jdh4/della-gpu-A100 README.md, commit "
                      "66ecd0d4248e26c71915b6d13c3561987489f8de: CUDA samples bandwidthTest, "
                      "device to device, NVIDIA A100-PCIE-40GB (HBM2, 1,555 GB/s like the SXM4 "
                      "40GB), 1,000,000,000-byte transfer: 1226.1 GB/s")
LAUNCH = ("pegainfer (3): From Launch Overhead to CUDA Graph (Part 1), susun-blog: a CPU kernel "
          "launch through the driver 'takes about 4-6 us' (GeForce RTX 5070 Ti, CUDA 13.0)")

SAME_DIE = ("H100 SXM and H200 are the same GH100 die at 700 W; a compute-bound kernel runs at "
            "the same rate on both")


@dataclass(frozen=True)
class PartPower:
    """What a GPU part draws and the clocks it runs at, as its datasheet (or a published
    measurement, named in `sources`) gives them: the board power limit (`limit_w`, the
    default, and the range `nvidia-smi -pl` accepts), the rated power of its die (the TDP of
    the full-power part of the same die: the power model's per-generation fractions are of
    it, so a lower-limit card of the die draws what the die draws), the power it draws idle,
    and its SM clocks: base (guaranteed at the limit; below it the voltage stays at its
    floor, jaxdist.predict.power), maximum (boost), and the clocks `nvidia-smi -lgc` accepts
    (`clock_min_mhz` to the maximum in steps of `clock_step_mhz`). `generation` names the
    fitted power constants that apply (jaxdist.hardware.POWER_CONSTANTS)."""
    limit_w: float
    limit_min_w: float
    limit_max_w: float
    die_rated_w: float
    idle_w: float | None  # None: no published idle figure
    base_clock_mhz: float
    max_clock_mhz: float
    clock_min_mhz: float
    clock_step_mhz: float
    generation: str
    sources: tuple[str, ...] = ()

    def clocks(self) -> tuple[int, ...]:
        """Every SM clock (MHz) the part can be locked to."""
        n = int(round((self.max_clock_mhz - self.clock_min_mhz) / self.clock_step_mhz))
        return tuple(int(round(self.clock_min_mhz + i * self.clock_step_mhz))
                     for i in range(n + 1))


@dataclass(frozen=True)
class NodePower:
    """A server of `gpus` GPUs of one part: what the rest of it (CPUs, memory, NICs, fans,
    power-supply losses) draws while its GPUs sit idle and while they train, and whether the
    figures are DC (after the power supplies) or AC (at the wall)."""
    name: str
    part: str
    gpus: int
    non_gpu_idle_w: float
    non_gpu_training_w: float
    metering: str          # "DC" or "AC"
    sources: tuple[str, ...] = ()


# Sources of the power records
NVIDIA_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-"
                         "nvidia-1758950-r4-web.pdf): max TDP 400 W SXM4, 300 W PCIe (80 GB)")
TPU_A100_PCIE_80 = ("TechPowerUp GPU database, NVIDIA A100 PCIe 80 GB: base clock 1065 MHz, "
                    "boost 1410 MHz, 300 W")
TPU_A100_SXM = ("TechPowerUp GPU database, NVIDIA A100 SXM4 40 GB (gpu-specs/a100-sxm4-40-gb."
                "c3506): base clock 1095 MHz, boost 1410 MHz, 400 W; the 80 GB SXM4 differs "
                "only in its memory (Glenn K. Lockwood, glennklockwood.com/garden/processors/"
                "A100: 'Everything else was the same (power, etc)')")
TPU_A40 = "TechPowerUp GPU database, NVIDIA A40 PCIe: base clock 1305 MHz, boost 1740 MHz, 300 W"
TPU_H100_SXM = "TechPowerUp GPU database, NVIDIA H100 SXM5 80 GB: base clock 1590 MHz, boost 1980 MHz"
NVIDIA_A40_DATASHEET = "NVIDIA A40 datasheet: max power consumption 300 W, GA102, PCIe Gen4"
NVIDIA_H100_DATASHEET = ("NVIDIA H100 datasheet, SXM column: max thermal design power (TDP) up "
                         "to 700 W (configurable)")
NVIDIA_H200_DATASHEET = ("NVIDIA H200 datasheet, H200 SXM column: max TDP up to 700 W "
                         "(configurable)")
POWER_ROWS = "shared notes power-rows.md, 'Hopper and node figures'"
HOPPER_IDLE = ("idle with nothing resident: H100 SXM 69-75 W, H200 SXM 73-78 W (nvidia-smi "
               "pastes in public issues, as " + POWER_ROWS + " quotes them)")
PERSEUS_HW = ("ml-energy/zeus branch kronos @38cb3f9, sosp24_data README: 4x NVIDIA A100-80G "
              "PCIe per node, 300 W board limit; the Zeus sweep (zeus_global.csv) sets "
              "175-300 W")
NVML_CLOCKS = ("nvidia-smi -q -d SUPPORTED_CLOCKS lists the SM clocks in 15 MHz steps on "
               "Ampere and Hopper (Perseus's stage profile, sosp24_data/emulation/"
               "stage_profile/gpt3-175b+a100_sxm_bf16.csv @38cb3f9, steps 1410..855 by 15)")
SMC_NODE = ("mlcommons/training_results_v4.0 @6fe9543, smc-dc-power/results/1xSMC-H100-SXM-80GB/"
            "bert/: 1.93-2.13 kW per node before training (non-GPU floor plus 8 idle GPUs), "
            "6.70-6.86 kW median while training, DC metering (immersion cooled)")
