"""`python -m experiments.predict --validate`: jaxdist's predictions (jaxdist.predict) beside
the published measurements in analysis/baselines/published.json, with the ratio; then the
power table (experiments.power_validation: the power model against
experiments/power_rows.json), which `--power` prints alone.

Each case is a published run jaxdist can express: the model as a `llama3-70b` with size
overrides and cuDNN flash attention (MaxText ran cudnn_flash_te, torchtitan SDPA's flash
kernel), the batch, sequence, GPUs, layout and remat policy of the run. Throughput: at most
one record per GPU generation calibrates (CALIBRATION: one Hopper, one Ampere); every other row
is out of sample. Memory has no calibrated constant: every memory row is out of sample. A row
whose configuration repeats another's (`same_as`) is printed but counted once. Everything
printed is `predicted` beside `published` (torchtitan's memory figure is the CUDA caching
allocator's peak reserved bytes, `max_reserved_gib` in its train loop's log).

Published figures become tokens/s per GPU as their source defines them: torchtitan logs
tokens/s per GPU; JAX-Toolbox gives the step time (batch x sequence / GPUs / step); MaxText
gives TFLOP/s per chip in its own analytic count, converted back with that count
(`maxtext_flops_per_token`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jaxdist.errors import OneLineParser, UsageError, path_arg

PUBLISHED = Path(__file__).resolve().parents[1] / "analysis" / "baselines" / "published.json"
GIB = 2 ** 30

_ATTN = "attention=cudnn"
LLAMA31_8B = ("vocab=128256,seq_len=8192,depth=32,width=4096,heads=32,kv_heads=8,"
              "mlp_hidden=14336," + _ATTN)
LLAMA2_7B = ("vocab=32000,seq_len=4096,depth=32,width=4096,heads=32,kv_heads=32,"
             "mlp_hidden=11008," + _ATTN)
LLAMA2_13B = ("vocab=32000,seq_len=4096,depth=40,width=5120,heads=40,kv_heads=40,"
              "mlp_hidden=13824," + _ATTN)
LLAMA2_70B = "vocab=32000,seq_len=4096," + _ATTN        # llama3-70b's shape, Llama 2's vocab
LLAMA3_70B = "seq_len=8192," + _ATTN
# Paxml's GPT-5B (paxml/contrib/gpu/scripts_gpu/configs.py GPT5B: 24 x 4096, 32 heads, MLP
# 16384, learned positions, GELU, biases; vocabulary 51,200 as NVIDIA's recipe counts it)
GPT_5B = "vocab=51200,seq_len=2048,depth=24,width=4096,heads=32," + _ATTN
LLAMA31_405B = ("vocab=128256,seq_len=8192,depth=126,width=16384,heads=128,kv_heads=8,"
                "mlp_hidden=53248," + _ATTN)


@dataclass(frozen=True)
class Case:
    name: str
    throughput_id: str | None     # published record ids
    memory_id: str | None
    hardware: str
    model_opts: str
    mesh: str
    batch: int
    remat: str                    # torchtitan's selective op AC "selective_op", MaxText's
    layout: str = "fsdp"          # policies by their names, full AC "full"
    small: bool = False           # part of the quick form run by the test suite
    same_as: str = ""             # the case whose configuration this one repeats
    sequence_parallel: bool = False  # torchtitan's TP: SequenceParallel on the norms
    tp_comm_chunks: int = 0          # --tp-comm-chunks; 1: torchtitan's TP without async TP
    model: str = "llama3-70b"        # the registered model model_opts resize
    dtype: str = "bfloat16"          # float8: FP8 GEMMs, delayed scaling (TE's, flax's default)
    fp8_scaling: str = "delayed"     # current: the pipeline layouts' (they carry no FP8 state)
    microbatches: int = 1            # the pipeline layouts' M (GBS / (DP x MBS))
    pp_virtual: int = 1              # > 1: Megatron's interleaved schedule over V chunks
    distributed_optimizer: bool = False  # Megatron's (NeMo's default)
    pp_combined_1f1b: bool = False   # --pp-combined-1f1b: jaxdist's TP overlap in pipelines
    pp_stage_blocks: str = ""        # --pp-stage-blocks: uneven stages
    grad_reduce_dtype: str = "float32"  # --grad-reduce-dtype (Megatron-Bridge's recipes: bf16)


# kernel_efficiency_hopper and _ampere (jaxdist.hardware), the kernel model's one fitted number
# per GPU generation, were set from these records' throughput; nothing else in that model is
# fitted. (The roofline fallback, used without XLA:GPU, has its own two: compute_efficiency_*,
# on tt24-t1-fsdp and tt-a100-l3-8b-sac-op.)
CALIBRATION = ("jaxtoolbox-7b", "tt-a100-l3-8b-sac-op")


def _maxtext_a3(vms: int) -> Case:
    # MaxText configs/a3/llama_2_7b/{N}vm.sh: ici_fsdp 8 x dcn_data N, 4 per device
    return Case(f"maxtext-a3-7b-{vms}vm", f"maxtext-a3-llama2-7b-{vms}vm", None,
                "h100-sxm-a3-high",
                LLAMA2_7B, f"data:{vms},fsdp:8", 32 * vms, "minimal_flash", "hsdp",
                small=vms == 1)


# torchtitan's H100 runs were on Meta's Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W
# default limit; analysis/baselines/published.json `hardware`): that part, cap included.
TT_H100 = "h100-sxm-96gb-500w"

CASES = (
    Case("tt24-t1-fsdp", "tt24-t1-fsdp-tps", "tt24-t1-fsdp-mem", TT_H100, LLAMA31_8B,
         "1x8", 16, "selective_op"),
    # The same run under torch.compile: the same configuration for jaxdist, so it counts once;
    # its memory is out of sample (nothing in the memory model is fitted).
    Case("tt24-t1-fsdp-compile", "tt24-t1-fsdp-compile-tps", "tt24-t1-fsdp-compile-mem",
         TT_H100, LLAMA31_8B, "1x8", 16, "selective_op", small=True, same_as="tt24-t1-fsdp"),
    Case("tt24-t3-fsdp", "tt24-t3-fsdp-tps", "tt24-t3-fsdp-mem", TT_H100, LLAMA31_8B,
         "16x8", 256, "selective_op"),
    Case("jaxtoolbox-7b", "jaxtoolbox-maxtext-llama2-7b-step", None, "h100-sxm", LLAMA2_7B,
         "1x8", 16, "minimal_flash", small=True),
    *(_maxtext_a3(n) for n in (1, 2, 4, 8, 16)),
    Case("tt25-8b-fsdp8-tp8", "tt25-asynctp-8b-bf16-vanilla", None, TT_H100, LLAMA31_8B,
         "data:8,tensor:8", 96, "selective_op", "fsdp_tp",
         sequence_parallel=True, tp_comm_chunks=1),
    Case("tt25-70b-fsdp32-tp8", "tt25-asynctp-70b-bf16-vanilla", None, TT_H100, LLAMA3_70B,
         "data:32,tensor:8", 512, "full", "fsdp_tp",
         sequence_parallel=True, tp_comm_chunks=1),
    # the same lower-TDP HBM2e H100 (94/95 GB); this older page states no cap: the SKU's
    # default limit, 500 W per the 2024-12 page, is assumed
    Case("tt-405b-fsdp16-tp8", "tt-h100-405b-2d-none-wps", None, TT_H100, LLAMA31_405B,
         "data:16,tensor:8", 32, "full", "fsdp_tp",
         sequence_parallel=True, tp_comm_chunks=1),
    Case("tt-a100-l3-8b-sac-op", "tt-a100-l3-8b-sac-op-wps", None, "a100-sxm-80gb", LLAMA31_8B,
         "8x8", 64, "selective_op"),
    Case("tt-a100-l2-13b-noac", "tt-a100-l2-13b-noac-wps", None, "a100-sxm-80gb", LLAMA2_13B,
         "8x8", 128, "none"),
    Case("tt-a100-l2-13b-sac-op", "tt-a100-l2-13b-sac-op-wps", None, "a100-sxm-80gb",
         LLAMA2_13B, "8x8", 128, "selective_op"),
    Case("tt-a100-l3-70b-full", "tt-a100-l3-70b-full-wps", None, "a100-sxm-80gb", LLAMA3_70B,
         "8x8", 64, "full"),
    Case("tt-a100-l2-70b-full", "tt-a100-l2-70b-full-wps", None, "a100-sxm-80gb", LLAMA2_70B,
         "8x8", 128, "full"),
    Case("tt-a100-l2-70b-sac-op", "tt-a100-l2-70b-sac-op-wps", None, "a100-sxm-80gb",
         LLAMA2_70B, "8x8", 64, "selective_op"),
    # NVIDIA's DGX Cloud MaxText recipe: Llama2-70B, 2 sequences per GPU, FSDP across nodes
    # (ICI FSDP 8 x DCN FSDP), DCN data parallel above 256 GPUs
    *(Case(f"dgxc-maxtext-70b-{n}", f"dgxc-maxtext-llama2-70b-bf16-{n}", None, "h100-sxm",
           LLAMA2_70B, mesh, 2 * n, "save_dot_except_mlpwi", layout)
      for n, mesh, layout in ((64, "1x64", "fsdp"), (128, "1x128", "fsdp"),
                              (256, "1x256", "fsdp"), (512, "data:4,fsdp:128", "hsdp"),
                              (1024, "data:8,fsdp:128", "hsdp"),
                              (2048, "data:16,fsdp:128", "hsdp"))),
    # NVIDIA's DGX Cloud Paxml recipe: GPT-5B, 4 sequences per GPU, FSDP across nodes,
    # remat SAVE_DOT_ONLY (dots)
    *(Case(f"dgxc-paxml-5b-{n}", f"dgxc-paxml-gpt5b-bf16-{n}", None, "h100-sxm", GPT_5B,
           f"1x{n}", 4 * n, "dots", model="gpt") for n in (16, 32, 64, 128)),
    # The same two recipes in FP8 (their FP8 tables): MaxText's FP8 keeps the attention's
    # projections only (save_dot_except_mlp)
    *(Case(f"dgxc-maxtext-70b-fp8-{n}", f"dgxc-maxtext-llama2-70b-fp8-{n}", None, "h100-sxm",
           LLAMA2_70B, mesh, 2 * n, "save_dot_except_mlp", layout, dtype="float8")
      for n, mesh, layout in ((64, "1x64", "fsdp"), (128, "1x128", "fsdp"),
                              (256, "1x256", "fsdp"), (512, "data:4,fsdp:128", "hsdp"),
                              (1024, "data:8,fsdp:128", "hsdp"),
                              (2048, "data:16,fsdp:128", "hsdp"))),
    *(Case(f"dgxc-paxml-5b-fp8-{n}", f"dgxc-paxml-gpt5b-fp8-{n}", None, "h100-sxm", GPT_5B,
           f"1x{n}", 4 * n, "dots", model="gpt", dtype="float8") for n in (16, 32, 64, 128)),
    # NeMo 24.07's FP8 pre-training table (Megatron-Core, Transformer Engine): TP x PP with
    # Megatron's interleaved schedule, sequence parallel under TP, the distributed optimizer,
    # no recomputation, TP communication overlapped (NeMo's tp_comm_overlap: here each
    # tick's F and BACK as one computation, --pp-combined-1f1b); TE's delayed scaling,
    # planned with current scaling (the same FP8 GEMMs; jaxdist's pipelines carry no
    # scaling state)
    *(Case(f"nemo-{name}", f"nemo2407-{name}-fp8", None, "h100-sxm", opts, mesh, gbs, "none",
           "tp_pp", model=model, dtype="float8", fp8_scaling="current", sequence_parallel=True,
           microbatches=m, pp_virtual=v, distributed_optimizer=True, pp_combined_1f1b=True)
      for name, model, opts, mesh, gbs, m, v in (
          ("gpt3-175b-128", "gpt3-175b", _ATTN, "data:4,stage:8,tensor:4", 256, 64, 6),
          ("gpt3-175b-512", "gpt3-175b", _ATTN, "data:16,stage:8,tensor:4", 2048, 64, 6),
          ("llama2-70b-64", "llama3-70b", LLAMA2_70B, "data:4,stage:4,tensor:4", 128, 32,
           20))),
    # NeMo 24.07's Llama3-8B with context parallelism (CP2: the all-gather form), its
    # optimizer state sharded over data (the distributed optimizer, zero1 here), one row
    # per device and step (32 micro-batches), TE's delayed scaling
    Case("nemo-llama3-8b-8", "nemo2407-llama3-8b-8-fp8", None, "h100-sxm", LLAMA31_8B,
         "data:4,context:2", 128, "none", "zero1", dtype="float8", microbatches=32),
    # Megatron-Bridge's FP8 current-scaling rows (its performance summary archive): NeMo's
    # recipe as above, the gradients reduced in bf16 (grad_reduce_in_fp32=False); the 405B
    # with CP2 and its first and last stages one block short (126 blocks on 8 x 8 chunks)
    *(Case(f"mbridge-{name}", f"mbridge{release}-{name}-fp8cs", None, "h100-sxm", opts, mesh,
           gbs, "none", "tp_pp", dtype="float8", fp8_scaling="current",
           sequence_parallel=True, microbatches=m, pp_virtual=v, distributed_optimizer=True,
           pp_combined_1f1b=True, pp_stage_blocks=blocks, grad_reduce_dtype="bfloat16")
      for name, release, opts, mesh, gbs, m, v, blocks in (
          ("llama3-70b-64", "2511", LLAMA3_70B, "data:2,stage:8,tensor:4", 128, 64, 5, ""),
          ("llama3-70b-64-gbs256", "260401", LLAMA3_70B, "data:2,stage:8,tensor:4", 256,
           128, 5, ""),
          ("llama31-405b-1024", "2511", LLAMA31_405B, "data:8,stage:8,context:2,tensor:8",
           512, 64, 8, "15,16x6,15"))),
    # torchtitan's Float8 (tensorwise: current scaling) beside its bf16 rows above
    Case("tt25-8b-fsdp8-tp8-fp8", "tt25-asynctp-8b-float8-tensorwise-vanilla", None, TT_H100,
         LLAMA31_8B, "data:8,tensor:8", 96, "selective_op", "fsdp_tp",
         sequence_parallel=True, tp_comm_chunks=1, dtype="float8", fp8_scaling="current"),
    Case("tt25-70b-fsdp32-tp8-fp8", "tt25-asynctp-70b-float8-tensorwise-vanilla", None,
         TT_H100, LLAMA3_70B, "data:32,tensor:8", 512, "full", "fsdp_tp",
         sequence_parallel=True, tp_comm_chunks=1, dtype="float8", fp8_scaling="current"),
    # Google Cloud's gpu-recipes: MaxText Llama2-7B on 32 A3 Mega VMs (GPUDirect-TCPXO)
    Case("gcp-a3mega-7b-256", "gcp-a3mega-maxtext-llama2-7b-256", None, "h100-sxm-a3-mega",
         LLAMA2_7B, "data:32,fsdp:8", 1024, "minimal_flash", "hsdp"),
)
# Published runs not expressible (not cases): context-parallel rows (torchtitan Tables 2,
# 4-6, the H200 Trainy runs), rowwise Float8 (per-row scales), torchtitan's selective *layer*
# AC (every other block recomputed; jaxdist's remat is one policy for every block), AsyncTP,
# FSDP1 blog rows (no per-run config).


def published() -> dict:
    return {r["id"]: r for r in json.loads(PUBLISHED.read_text())["records"]}


def model_dims(case: Case) -> dict:
    """The case's model fields: llama3-70b's, with its --model-opts overrides (the fields a
    published figure's conversion reads: seq_len for a step time, the rest for MaxText's
    FLOP count)."""
    dims = {"vocab": 128256, "seq_len": 8192, "depth": 80, "width": 8192, "heads": 64,
            "kv_heads": 8, "mlp_hidden": 28672}
    for item in case.model_opts.split(","):
        key, value = item.split("=")
        if key in dims:
            dims[key] = int(value)
    return dims


def maxtext_flops_per_token(dims: dict) -> float:
    """MaxText's count behind its TFLOP/s/chip at commit efb6d9e4 (the A3 README's), maxtext
    MaxText/maxtext_utils.py calculate_tflops_training_per_device: 6 x all parameters
    (embedding and head included) + causal attention 12 x heads x layers x head_dim x seq / 2,
    per token."""
    w, hd = dims["width"], dims["width"] // dims["heads"]
    block = (w * hd * (2 * dims["heads"] + 2 * dims["kv_heads"]) + 3 * w * dims["mlp_hidden"]
             + 2 * w)
    params = 2 * dims["vocab"] * w + dims["depth"] * block + w
    return 6 * params + 6 * dims["heads"] * dims["depth"] * hd * dims["seq_len"]


@functools.lru_cache(maxsize=None)
def case_job(case: Case):
    """The resolved job of a case (jaxdist.job), through the one validation pass; a case
    the validation refuses raises its UsageError."""
    from experiments.validation import validate as resolve_job

    return resolve_job(case_config(case))


def gpus(case: Case) -> int | None:
    """The GPUs the case's mesh spans (None where its job does not resolve)."""
    try:
        return case_job(case).shape.size
    except UsageError:
        return None


def published_tokens_per_s_per_gpu(case: Case, rec: dict) -> float:
    """The record's throughput as tokens/s per GPU (see the module docstring)."""
    metric, unit, value = rec["metric"], rec["unit"], rec["value"]
    if metric == "step_latency" and unit == "s":
        return case.batch * model_dims(case)["seq_len"] / gpus(case) / value
    if metric == "achieved_TFLOPS_per_GPU" and "MaxText" in rec["framework"]:
        return value * 1e12 / maxtext_flops_per_token(model_dims(case))
    if metric == "throughput_per_gpu" and unit.startswith("tokens/s"):
        return value
    raise ValueError(f"{rec['id']}: no tokens/s/GPU reading of {metric} in {unit}")


def case_config(case: Case):
    from jaxdist.config import (CompilerConfig, MeshConfig, ModelConfig, OutputConfig,
                                RunConfig, TrainConfig)
    return RunConfig(mesh=MeshConfig(mesh=case.mesh),
                     model=ModelConfig(model=case.model, model_opts=case.model_opts,
                                       dtype=case.dtype, fp8_scaling=case.fp8_scaling),
                     train=TrainConfig(layout=case.layout, batch_size=case.batch,
                                       remat=case.remat, microbatches=case.microbatches,
                                       pp_virtual=case.pp_virtual,
                                       pp_schedule="interleaved" if case.pp_virtual > 1
                                       else "1f1b",
                                       sequence_parallel=case.sequence_parallel,
                                       tp_comm_chunks=case.tp_comm_chunks,
                                       pp_combined_1f1b=case.pp_combined_1f1b,
                                       pp_stage_blocks=case.pp_stage_blocks,
                                       grad_reduce_dtype=case.grad_reduce_dtype,
                                       distributed_optimizer=case.distributed_optimizer),
                     compiler=CompilerConfig(overlap=True),
                     output=OutputConfig(dry_run=True, hardware=case.hardware))


def validate(cases) -> list[dict]:
    """One row per case: predicted and published tokens/s/GPU and memory, and the ratios.
    JAX must have enough CPU devices for the largest mesh (see main). Cases of the same
    configuration share one compile."""
    from jaxdist import plan as plans

    records, cache, rows = published(), {}, []
    for case in cases:
        try:
            plan = plans.plan(case_job(case), cache=cache)
        except Exception as e:  # noqa: BLE001 - a row the compiler rejects is a row, named
            first = str(e).strip().splitlines()
            reason = next((ln for ln in first if "Error" in ln), first[0] if first else "")
            rows.append(failed_row(case, records, f"{type(e).__name__}: {reason[:200]}"))
            continue
        pred = plan.prediction
        tps = pred.throughput.tokens_per_s_per_gpu
        # The plan's memory verdict by jaxdist.predict.verdict.MEMORY_RULE; both figures are
        # kept, with the one that decided.
        memory = pred.memory
        mem = memory.total_bytes / GIB
        compiled_memory = pred.memory_from == "compiled"
        xla_mem = memory.compiler["peak_bytes"] / GIB if compiled_memory else None
        rid = case.throughput_id or case.memory_id
        row = {"case": case.name, "role": "calibration" if case.name in CALIBRATION else
               "out-of-sample", "same_as": case.same_as,
               "framework": records[rid]["framework"], "hardware": case.hardware,
               "gpus": gpus(case), "layout": case.layout, "mesh": case.mesh,
               "predicted_tokens_per_s_per_gpu": tps, "predicted_memory_gib": mem,
               "memory_source": memory.source if compiled_memory else "hand estimate",
               "hand_memory_gib": (memory.hand_estimate_bytes if compiled_memory else
                                   memory.total_bytes) / GIB,
               "xla_gpu_memory_gib": xla_mem, "fits": pred.fits,
               "hbm_gib": memory.hbm_bytes / GIB,
               "compiler": pred.compiler,
               "time_model": pred.time.model if pred.timing == "kernels" else
               "roofline (FLOPs / calibrated peak)",
               "bottleneck": pred.time.bottleneck,
               # where the predicted step goes: seconds by term, and by kernel kind
               "predicted_time_s": {k: v for k, v in pred.time.to_json().items()
                                    if k.endswith("_s") and isinstance(v, float)},
               "predicted_kernel_kind_s": pred.time.by_kind or None}
        tput = case.throughput_id and published_tokens_per_s_per_gpu(
            case, records[case.throughput_id])
        for what, pub, value in (("tokens_per_s_per_gpu", tput, tps),
                                 ("memory_gib", case.memory_id and
                                  records[case.memory_id]["value"], mem)):
            row[f"published_{what}"] = pub or None
            row[f"ratio_{what}"] = value / pub if pub else None
        rows.append(row)
    return rows


def failed_row(case, records: dict, reason: str) -> dict:
    """A case whose prediction failed (e.g. XLA:GPU rejected the program): kept in the table
    with the reason, with no ratio."""
    rid = case.throughput_id or case.memory_id
    return {"case": case.name, "role": "calibration" if case.name in CALIBRATION else
            "out-of-sample", "same_as": case.same_as, "framework": records[rid]["framework"],
            "hardware": case.hardware, "gpus": gpus(case), "layout": case.layout,
            "mesh": case.mesh, "predicted_tokens_per_s_per_gpu": None,
            "predicted_memory_gib": None, "memory_source": None, "hand_memory_gib": None,
            "xla_gpu_memory_gib": None, "fits": None, "hbm_gib": None, "compiler": None,
            "time_model": None, "bottleneck": f"failed: {reason}",
            "predicted_time_s": None, "predicted_kernel_kind_s": None,
            "published_tokens_per_s_per_gpu": None, "ratio_tokens_per_s_per_gpu": None,
            "published_memory_gib": None, "ratio_memory_gib": None}


def independent(rows: list[dict], what: str) -> list[dict]:
    """The out-of-sample rows with a published figure, each configuration once. Throughput:
    not the calibration records nor their repeats. Memory has nothing fitted: every row,
    a repeat counted only when its first configuration has no figure."""
    rated = [r for r in rows if r[f"ratio_{what}"]]
    calibration = {r["case"] for r in rated if r["role"] == "calibration"}
    if what == "tokens_per_s_per_gpu":
        return [r for r in rated if r["case"] not in calibration and not r["same_as"]]
    names = {r["case"] for r in rated}
    return [r for r in rated if r["same_as"] not in names]


def family(framework: str) -> str:
    """The program family a published row ran: "JAX" (MaxText, Paxml: XLA's program, the
    family jaxdist's plans predict, so its rows measure the predictor's own error) or
    "PyTorch" (torchtitan, NeMo, Megatron: another framework's kernels, so a row's ratio
    is a cross-framework gap, never a target)."""
    return "JAX" if framework.startswith("JAX") else "PyTorch"


def summary(rows: list[dict], what: str) -> dict | None:
    """Median |log ratio| and the worst row over `independent` rows, and the same with the
    sign balance (rows predicted below, at or above the published figure) per family."""
    rated = independent(rows, what)
    if not rated:
        return None

    def stats(some: list[dict]) -> dict:
        ratios = [r[f"ratio_{what}"] for r in some]
        worst = max(some, key=lambda r: abs(math.log(r[f"ratio_{what}"])))
        return {"rows": len(some),
                "median_abs_log_ratio": statistics.median(abs(math.log(x)) for x in ratios),
                "worst": worst["case"], "worst_ratio": worst[f"ratio_{what}"],
                "below": sum(x < 0.995 for x in ratios), "above": sum(x > 1.005 for x in ratios)}

    families = sorted({family(r["framework"]) for r in rated})
    return {**stats(rated), "by_family": {f: stats([r for r in rated
                                                     if family(r["framework"]) == f])
                                          for f in families}}


def format_rows(rows: list[dict]) -> str:
    def num(x, fmt):
        return format(x, fmt) if x is not None else "-"
    head = (f"{'record':<22}{'framework':<22}{'GPUs':>5} {'layout':<8}{'sample':<14}"
            f"{'tok/s/GPU pub':>14}{'predicted':>11}{'ratio':>7}"
            f"{'GiB pub':>9}{'predicted':>11}{'ratio':>7}  bottleneck")
    lines = ["predicted vs published (predicted / published)", head]
    for r in rows:
        sample = "calibration" if r["role"] == "calibration" else (
            "out, repeat" if r["same_as"] else "out")
        lines.append(f"{r['case']:<22}{r['framework'][:21]:<22}{r['gpus']:>5} "
                     f"{r['layout']:<8}{sample:<14}"
                     f"{num(r['published_tokens_per_s_per_gpu'], ',.0f'):>14}"
                     f"{num(r['predicted_tokens_per_s_per_gpu'], ',.0f'):>11}"
                     f"{num(r['ratio_tokens_per_s_per_gpu'], '.2f'):>7}"
                     f"{num(r['published_memory_gib'], '.1f'):>9}"
                     f"{num(r['predicted_memory_gib'], '.1f'):>11}"
                     f"{num(r['ratio_memory_gib'], '.2f'):>7}  {r['bottleneck']}")
    lines += ["", "memory per device, predicted (the figure that decides the verdict and its "
              "source) against the part's HBM; published where the run's report gives it",
              f"{'record':<22}{'part':<20}{'HBM GiB':>8}{'GiB pub':>9}{'predicted':>11}"
              f"{'ratio':>7}  {'verdict':<8}{'hand':>7}{'XLA:GPU':>9}  source"]
    for r in rows:
        verdict = {True: "fits", False: "OOM"}.get(r["fits"], "unknown")
        lines.append(f"{r['case']:<22}{r['hardware']:<20}{num(r['hbm_gib'], '.1f'):>8}"
                     f"{num(r['published_memory_gib'], '.1f'):>9}"
                     f"{num(r['predicted_memory_gib'], '.1f'):>11}"
                     f"{num(r['ratio_memory_gib'], '.2f'):>7}  {verdict:<8}"
                     f"{num(r['hand_memory_gib'], '.1f'):>7}{num(r['xla_gpu_memory_gib'], '.1f'):>9}"
                     f"  {r['memory_source'] or '-'}")
    fit = sum(1 for r in rows if r["fits"] is True)
    lines.append(f"predicted to fit on the GPUs they ran on: {fit} of {len(rows)}")
    for what, label in (("tokens_per_s_per_gpu", "throughput"), ("memory_gib", "memory")):
        s = summary(rows, what)
        if s:
            lines.append(f"{label}: {s['rows']} independent out-of-sample rows, median |log "
                         f"ratio| {s['median_abs_log_ratio']:.3f}, worst {s['worst']} "
                         f"({s['worst_ratio']:.2f})")
            for name, f in s["by_family"].items():
                what_it_is = ("the predictor's own error: the program family jaxdist plans"
                              if name == "JAX" else "a cross-framework gap, not a target")
                lines.append(f"  {name} rows ({what_it_is}): {f['rows']}, median |log ratio| "
                             f"{f['median_abs_log_ratio']:.3f}, {f['below']} below 1.0 and "
                             f"{f['above']} above (within 0.5%: the rest), worst "
                             f"{f['worst']} ({f['worst_ratio']:.2f})")
    models = sorted({r["time_model"] for r in rows if r.get("time_model")})
    lines.append(f"time model: {'; '.join(models) or '-'}; fitted: {len(CALIBRATION)} numbers "
                 f"(one kernel efficiency per GPU generation) on {', '.join(CALIBRATION)}; "
                 "memory has none (the sample column is throughput's): the predicted figure "
                 "is set beside torchtitan's peak reserved (max_reserved_gib)")
    return "\n".join(lines)


def check_output_file(flag: str, path: Path) -> None:
    """Before minutes of predictions: a file the flag can write (its folder exists), not a
    folder."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    try:  # root passes permission bits: only a write tells (a probe file, removed)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {path.parent}: "
                         f"{e.strerror or e}") from None


def go2025_alias(args) -> int:
    """--go2025: the suite's plan form of the go2025 preset (experiments.suite.plan)."""
    import shutil

    from experiments.suite.cli import main as suite_main

    out = Path(args.out or "runs/plan-go2025")
    code = suite_main(["--preset", "go2025", "--plan", "--hardware", args.hardware,
                       "--out", str(out)])
    if code == 0 and args.plot:
        shutil.copyfile(out / "ranking.png", args.plot)
    if code == 0 and args.json:
        shutil.copyfile(out / "ranking.json", args.json)
    return code


def set_devices(cases) -> None:
    """JAX on CPU with as many devices as the largest case's compile needs."""
    import jax
    from jaxdist.program.compiled import plan_cpu_devices

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", plan_cpu_devices(max(gpus(c) or 1 for c in cases)))


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m experiments.predict")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--validate", action="store_true",
                      help="predict each published record jaxdist can express")
    what.add_argument("--power", action="store_true",
                      help="only the power table: the power model against the published "
                           "power rows (seconds, no compiles; also the end of --validate)")
    what.add_argument("--go2025", action="store_true",
                      help="an alias of: python -m experiments.suite --preset go2025 --plan "
                           "--hardware H (Go et al.'s grid at full size, predicted, ranked)")
    parser.add_argument("--hardware", default=None, help="with --go2025 (default h200)")
    parser.add_argument("--quick", action="store_true", help="--validate: only the small records")
    parser.add_argument("--json", default="", type=path_arg,
                        help="also write the rows to this file")
    parser.add_argument("--plot", default="", type=path_arg,
                        help="--go2025: also copy the ranking's stacked bars here (png)")
    parser.add_argument("--out", default="", type=path_arg,
                        help="--go2025: the plan directory (default runs/plan-go2025)")
    args = parser.parse_args(argv)
    try:
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                check_output_file(flag, Path(path))
        other = ([f for f, given in (("--hardware", args.hardware is not None),
                                     ("--plot", args.plot), ("--out", args.out)) if given]
                 if not args.go2025 else ["--quick"] if args.quick else [])
        if args.power and args.quick:
            other = ["--quick", *other]
        if other:
            raise UsageError(f"{other[0]} applies only to "
                             f"--{'validate' if other[0] == '--quick' else 'go2025'}; drop it")
    except UsageError as e:
        print(f"predict: error: {e}", file=sys.stderr)
        return 2
    if args.go2025:
        args.hardware = args.hardware or "h200"
        return go2025_alias(args)
    from experiments import power_validation
    if args.power:
        power = power_validation.validate()
        print(power_validation.format_table(power))
        if args.json:
            Path(args.json).write_text(json.dumps(power, indent=1))
        return 0
    cases = [c for c in CASES if c.small or not args.quick]
    set_devices(cases)
    rows = validate(cases)
    print(format_rows(rows))
    print("\n" + power_validation.format_table(power_validation.validate()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
