"""Achievable kernel rates per GPU part, from published microbenchmarks: the inputs of a time
model that costs each kernel of the XLA:GPU program by its kind (issue 22, item 1).

Data only (no jax). Parts are `jaxdist.hardware` names. Kinds:

- `gemm`: dense cuBLAS matmul, FLOP/s, best large shape (the maximum achievable rate; no
  published source found gives the fall-off for small shapes, so none is tabled).
- `attention_fwd`, `attention_bwd`: fused (cuDNN / flash) attention at head dim 128, causal,
  FLOP/s counted as their benchmarks count them (forward 4 * s^2 * d * heads, halved when
  causal; backward 2.5x the forward), at the longest sequence tabled; `attention_curve`
  gives the rate by sequence length where one was published.
- `hbm_copy`: bytes/s a streaming (memory-bound) kernel achieves, read + write counted.
- `launch`: seconds of per-kernel launch overhead.

Each `Rate` carries its source (title / repo / path / commit, or paper and section) and, when
the figure was not measured on that part, `derived` says how it was carried over. Nothing
here is fitted to a training run.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("gemm", "attention_fwd", "attention_bwd", "hbm_copy", "launch")
ANY_DTYPE = "any"   # hbm_copy and launch do not depend on the element type


@dataclass(frozen=True)
class Rate:
    value: float          # FLOP/s (gemm, attention_*), bytes/s (hbm_copy), seconds (launch)
    source: str
    derived: str = ""     # empty: measured on this part as published

    @property
    def measured_on_part(self) -> bool:
        return not self.derived


MAMF = ("Stas Bekman, ml-engineering, repo stas00/ml-engineering, path "
        "compute/accelerator/README.md, commit 7bc7c3054eb93c277a4755c597ae0864d77a63f1, "
        "'Maximum Achievable Matmul FLOPS comparison table', BF16")
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
_LAUNCH = Rate(5e-6, LAUNCH, "midpoint of the published 4-6 us, measured on another GPU: the "
               "cost is host and driver side, not a property of the part")

# attention by sequence length: (seq_len, forward FLOP/s, backward FLOP/s), H200 measured
_H200_ATTENTION = ((2048, 484e12, 370e12), (4096, 591e12, 474e12), (8192, 644e12, 541e12),
                   (16384, 673e12, 579e12), (32768, 688e12, 581e12))

RATES: dict[tuple[str, str, str], Rate] = {
    ("h100-sxm", "gemm", "bfloat16"): Rate(794.5e12, MAMF + ", row NVIDIA H100 SXM"),
    ("h200", "gemm", "bfloat16"): Rate(
        794.5e12, MAMF + ", row NVIDIA H100 SXM, note 'H200 is the same'",
        "the table states H200 equals H100 SXM"),
    ("a100-sxm-80gb", "gemm", "bfloat16"): Rate(271.2e12, MAMF + ", row NVIDIA A100 SXM"),
    ("a100-sxm-40gb", "gemm", "bfloat16"): Rate(
        271.2e12, MAMF + ", row NVIDIA A100 SXM",
        "the row does not name the memory size; the 40 GB and 80 GB SXM4 parts share the "
        "GA100 die and its 312 TFLOP/s bf16 peak"),
    ("h200", "attention_fwd", "bfloat16"): Rate(688e12, CUDNN_SDPA + ", q/kv seq 32768"),
    ("h200", "attention_bwd", "bfloat16"): Rate(581e12, CUDNN_SDPA + ", q/kv seq 32768"),
    ("h100-sxm", "attention_fwd", "bfloat16"): Rate(
        688e12, CUDNN_SDPA + ", q/kv seq 32768", SAME_DIE + " (taken from the H200 figure)"),
    ("h100-sxm", "attention_bwd", "bfloat16"): Rate(
        581e12, CUDNN_SDPA + ", q/kv seq 32768", SAME_DIE + " (taken from the H200 figure)"),
    ("a100-sxm-80gb", "attention_fwd", "bfloat16"): Rate(
        0.73 * 312e12, FA2, "73% of the 312 TFLOP/s peak, as the paper states it"),
    ("a100-sxm-80gb", "attention_bwd", "bfloat16"): Rate(
        0.63 * 312e12, FA2, "63% of the 312 TFLOP/s peak, as the paper states it"),
    ("a100-sxm-40gb", "attention_fwd", "bfloat16"): Rate(
        0.73 * 312e12, FA2, "73% of the 312 TFLOP/s peak, as the paper states it"),
    ("a100-sxm-40gb", "attention_bwd", "bfloat16"): Rate(
        0.63 * 312e12, FA2, "63% of the 312 TFLOP/s peak, as the paper states it"),
    ("h200", "hbm_copy", ANY_DTYPE): Rate(3770.9e9, CUDNN_NORMS),
    ("h100-sxm", "hbm_copy", ANY_DTYPE): Rate(
        3000e9, FLASHMLA, "H800 SXM5 has the H100 SXM's HBM3 (3.35 TB/s); only NVLink differs"),
    ("a100-sxm-40gb", "hbm_copy", ANY_DTYPE): Rate(
        1226.1e9, A100_BANDWIDTHTEST, "measured on the PCIe card, whose HBM2 matches the SXM4 "
        "40GB's (1,555 GB/s)"),
    ("a100-sxm-80gb", "hbm_copy", ANY_DTYPE): Rate(
        1226.1e9 * 2039 / 1555, A100_BANDWIDTHTEST,
        "the A100 40GB's measured fraction of its datasheet bandwidth (1226.1 / 1555) applied "
        "to the 80GB's 2,039 GB/s HBM2e"),
    **{(part, "launch", ANY_DTYPE): _LAUNCH
       for part in ("h100-sxm", "h200", "a100-sxm-80gb", "a100-sxm-40gb")},
}

ATTENTION_CURVES: dict[tuple[str, str], tuple[tuple[int, float, float], ...]] = {
    ("h200", "bfloat16"): _H200_ATTENTION,
    ("h100-sxm", "bfloat16"): _H200_ATTENTION,   # SAME_DIE
}


def rate(part: str, kind: str, dtype: str) -> Rate:
    """The achievable rate of `kind` kernels in `dtype` on `part`. KeyError, naming what is
    tabled, where no published figure exists (never a guess)."""
    if kind not in KINDS:
        raise KeyError(f"unknown kernel kind {kind!r}: choose from {', '.join(KINDS)}")
    key = (part, kind, ANY_DTYPE if kind in ("hbm_copy", "launch") else dtype)
    if key not in RATES:
        have = sorted(f"{k[1]}/{k[2]}" for k in RATES if k[0] == part)
        raise KeyError(f"no published {kind} rate for {part} in {dtype}" +
                       (f"; {part} has: {', '.join(have)}" if have else
                        f"; parts with rates: {', '.join(parts())}"))
    return RATES[key]


def parts() -> list[str]:
    return sorted({k[0] for k in RATES})


def attention_curve(part: str, dtype: str) -> tuple[tuple[int, float, float], ...]:
    """(seq_len, forward FLOP/s, backward FLOP/s) points, causal, head dim 128, where
    published for the part (see CUDNN_SDPA), else (): shorter sequences run slower."""
    return ATTENTION_CURVES.get((part, dtype), ())
