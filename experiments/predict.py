"""`python -m experiments.predict --validate`: jaxdist's predictions (jaxdist.predict) beside
the published measurements in analysis/baselines/published.json, with the ratio.

Each case is a record jaxdist can express: the model as a `llama3-70b` with size overrides
and cuDNN flash attention (torchtitan runs SDPA's flash kernel), the batch, sequence, GPUs
and layout of the record. Throughput: the compute efficiency of each GPU generation is
calibrated on one record (CALIBRATION: one Hopper, one Ampere); the other rows are
out-of-sample. Memory has no calibrated constant: every memory row is out-of-sample.
Everything printed is `predicted` beside `published` (torchtitan's memory figure is the
CUDA caching allocator's peak reserved bytes, `max_reserved_gib` in its train loop's log).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

PUBLISHED = Path(__file__).resolve().parents[1] / "analysis" / "baselines" / "published.json"
GIB = 2 ** 30

LLAMA31_8B = ("vocab=128256,seq_len=8192,depth=32,width=4096,heads=32,kv_heads=8,"
              "mlp_hidden=14336,attention=cudnn")
LLAMA2_13B = ("vocab=32000,seq_len=4096,depth=40,width=5120,heads=40,kv_heads=40,"
              "mlp_hidden=13824,attention=cudnn")
LLAMA3_70B = "seq_len=8192,attention=cudnn"


@dataclass(frozen=True)
class Case:
    name: str
    throughput_id: str | None     # published record ids
    memory_id: str | None
    hardware: str
    model_opts: str
    mesh: str
    batch: int
    remat: str                    # torchtitan's selective (op) AC ~ "dots", full AC ~ "full"
    small: bool = False           # part of the quick form run by the test suite


# compute_efficiency_hopper and _ampere (jaxdist.hardware) were set from these records'
# throughput, one per GPU generation; nothing else is calibrated.
CALIBRATION = ("tt24-t1-fsdp", "tt-a100-l3-8b-sac-op")
CASES = (
    Case("tt24-t1-fsdp", "tt24-t1-fsdp-tps", "tt24-t1-fsdp-mem", "h100-sxm", LLAMA31_8B,
         "1x8", 16, "dots", small=True),
    # The same run under torch.compile: XLA fuses the step jaxdist would run, so this is the
    # closer analogue, kept out of sample.
    Case("tt24-t1-fsdp-compile", "tt24-t1-fsdp-compile-tps", "tt24-t1-fsdp-compile-mem",
         "h100-sxm", LLAMA31_8B, "1x8", 16, "dots", small=True),
    Case("tt24-t3-fsdp", "tt24-t3-fsdp-tps", "tt24-t3-fsdp-mem", "h100-sxm", LLAMA31_8B,
         "1x128", 256, "dots"),
    Case("tt-a100-l3-8b-sac-op", "tt-a100-l3-8b-sac-op-wps", None, "a100-sxm-80gb", LLAMA31_8B,
         "1x64", 64, "dots"),
    Case("tt-a100-l2-13b-noac", "tt-a100-l2-13b-noac-wps", None, "a100-sxm-80gb", LLAMA2_13B,
         "1x64", 128, "none"),
    Case("tt-a100-l3-70b-full", "tt-a100-l3-70b-full-wps", None, "a100-sxm-80gb", LLAMA3_70B,
         "1x64", 64, "full"),
)


def published() -> dict:
    return {r["id"]: r for r in json.loads(PUBLISHED.read_text())["records"]}


def case_config(case: Case):
    from jaxdist.config import (CompilerConfig, MeshConfig, ModelConfig, OutputConfig,
                                RunConfig, TrainConfig)
    return RunConfig(mesh=MeshConfig(mesh=case.mesh),
                     model=ModelConfig(model="llama3-70b", model_opts=case.model_opts,
                                       dtype="bfloat16"),
                     train=TrainConfig(layout="fsdp", batch_size=case.batch, remat=case.remat),
                     compiler=CompilerConfig(overlap=True),
                     output=OutputConfig(dry_run=True, hardware=case.hardware))


def validate(cases) -> list[dict]:
    """One row per case: predicted and published tokens/s/GPU and memory, and the ratios.
    JAX must have enough CPU devices for the largest mesh (see main)."""
    from jaxdist.mesh import parse_mesh
    from jaxdist.predict.plan import predict_plan

    records = published()
    rows = []
    for case in cases:
        plan = predict_plan(case_config(case), parse_mesh(case.mesh))
        tps = plan["throughput"]["tokens_per_s_per_gpu"]
        mem = plan["memory"]["total_bytes"] / GIB
        row = {"case": case.name, "role": "calibration" if case.name in CALIBRATION else
               "out-of-sample", "hardware": case.hardware, "mesh": case.mesh,
               "predicted_tokens_per_s_per_gpu": tps, "predicted_memory_gib": mem,
               "bottleneck": plan["time"]["bottleneck"]}
        for what, rid, value in (("tokens_per_s_per_gpu", case.throughput_id, tps),
                                 ("memory_gib", case.memory_id, mem)):
            pub = records[rid]["value"] if rid else None
            row[f"published_{what}"] = pub
            row[f"ratio_{what}"] = value / pub if pub else None
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    def num(x, fmt):
        return format(x, fmt) if x is not None else "-"
    head = (f"{'record':<22}{'role':<15}{'tok/s/GPU pub':>14}{'predicted':>11}{'ratio':>7}"
            f"{'GiB pub':>9}{'predicted':>11}{'ratio':>7}  bottleneck")
    lines = ["predicted vs published (predicted / published)", head]
    for r in rows:
        lines.append(f"{r['case']:<22}{r['role']:<15}"
                     f"{num(r['published_tokens_per_s_per_gpu'], ',.0f'):>14}"
                     f"{num(r['predicted_tokens_per_s_per_gpu'], ',.0f'):>11}"
                     f"{num(r['ratio_tokens_per_s_per_gpu'], '.2f'):>7}"
                     f"{num(r['published_memory_gib'], '.1f'):>9}"
                     f"{num(r['predicted_memory_gib'], '.1f'):>11}"
                     f"{num(r['ratio_memory_gib'], '.2f'):>7}  {r['bottleneck']}")
    lines.append("calibration: throughput only (one compute efficiency per GPU generation); "
                 "memory has no calibrated constant, every memory row is out of sample; "
                 "published memory is torchtitan's peak reserved (max_reserved_gib)")
    return "\n".join(lines)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.predict")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--validate", action="store_true",
                      help="predict each published record jaxdist can express")
    what.add_argument("--go2025", action="store_true",
                      help="an alias of: python -m experiments.suite --preset go2025 --plan "
                           "--hardware H (Go et al.'s grid at full size, predicted, ranked)")
    parser.add_argument("--hardware", default="h200", help="with --go2025 (default h200)")
    parser.add_argument("--quick", action="store_true", help="--validate: only the small records")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--plot", default="", help="--go2025: also copy the ranking's "
                        "stacked bars here (png)")
    parser.add_argument("--out", default="", help="--go2025: the plan directory (default "
                        "runs/plan-go2025)")
    args = parser.parse_args(argv)
    if args.go2025:
        return go2025_alias(args)
    import jax
    jax.config.update("jax_platforms", "cpu")
    cases = [c for c in CASES if c.small or not args.quick]
    jax.config.update("jax_num_cpu_devices", max(int(c.mesh.split("x")[1]) for c in cases))
    rows = validate(cases)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
