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
