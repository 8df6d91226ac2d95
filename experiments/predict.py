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


GO2025_MODELS = {"gpt": ("gpt3-175b", "llama3-70b"), "ep": ("mixtral-8x7b",)}


def go2025_grid(hardware: str, remat: str) -> list[tuple[str, object]]:
    """(name, RunConfig) for Go et al.'s full-size models under every non-pipeline layout of
    the go2025 preset (pipeline layouts are not predicted yet), at the preset's settings."""
    import tomllib

    from jaxdist.config import (CompilerConfig, MeshConfig, ModelConfig, OutputConfig,
                                RunConfig, TrainConfig)
    from sharding.pipeline import PIPELINE_LAYOUTS

    preset = tomllib.loads((Path(__file__).parent / "presets" / "go2025.toml").read_text())
    settings = preset["settings"]
    out = []
    for entry in preset["layouts"]:
        if entry["layout"] in PIPELINE_LAYOUTS or entry.get("variant"):
            continue
        models = GO2025_MODELS["ep" if entry["layout"] == "ep" else "gpt"]
        for model in models:
            out.append((f"{model} {entry['name']}", RunConfig(
                mesh=MeshConfig(mesh=entry["mesh"]),
                model=ModelConfig(model=model, dtype=settings.get("dtype", "bfloat16")),
                train=TrainConfig(layout=entry["layout"], batch_size=settings["batch_size"],
                                  remat=remat),
                compiler=CompilerConfig(overlap=True),
                output=OutputConfig(dry_run=True, hardware=hardware))))
    return out


def format_grid(rows: list[tuple[str, dict]]) -> str:
    lines = ["PREDICTED (not measured), ranked by step time",
             f"{'run':<28}{'mesh':<18}{'GiB/dev':>9}{'fits':>6}{'step s':>9}{'tok/s/GPU':>11}"
             f"{'MFU':>7}  {'compute':>8}{'HBM':>8}{'intra':>8}{'inter':>8}  bottleneck"]
    for name, p in sorted(rows, key=lambda r: r[1]["time"]["step_s"]):
        t, m, thr = p["time"], p["memory"], p["throughput"]
        mesh = ",".join(f"{k}:{v}" for k, v in p["mesh"].items() if v > 1)
        lines.append(f"{name:<28}{mesh:<18}{m['total_bytes'] / GIB:>9.1f}"
                     f"{({True: 'yes', False: 'OOM'}.get(m['fits'], '?')):>6}{t['step_s']:>9.2f}"
                     f"{thr['tokens_per_s_per_gpu'] or 0:>11,.0f}{thr['mfu']:>7.1%}  "
                     f"{t['compute_s']:>8.2f}{t['hbm_s']:>8.2f}{t['intra_node_s']:>8.2f}"
                     f"{t['inter_node_s']:>8.2f}  {t['bottleneck']}")
    return "\n".join(lines)


def plot_grid(rows: list[tuple[str, dict]], path: Path) -> None:
    """Stacked bars of each run's predicted step: compute or HBM, exposed communication."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r[1]["time"]["step_s"])
    names = [n for n, _ in rows]
    device = [max(p["time"]["compute_s"], p["time"]["hbm_s"]) for _, p in rows]
    exposed = [p["time"]["comm_exposed_s"] for _, p in rows]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    ax.barh(names, device, label="compute / HBM")
    ax.barh(names, exposed, left=device, label="exposed communication")
    ax.set_xlabel("predicted step time (s)")
    ax.set_title("PREDICTED, not measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.predict")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--validate", action="store_true",
                      help="predict each published record jaxdist can express")
    what.add_argument("--go2025", action="store_true",
                      help="predict Go et al.'s full-size models on every non-pipeline layout "
                           "of the go2025 preset, ranked")
    parser.add_argument("--hardware", default="h200", help="with --go2025 (default h200)")
    parser.add_argument("--remat", default="full", choices=("none", "full", "dots"),
                        help="with --go2025 (default full, as Go et al.)")
    parser.add_argument("--quick", action="store_true", help="--validate: only the small records")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--plot", default="", help="--go2025: also plot the ranking here (png)")
    args = parser.parse_args(argv)
    import jax
    jax.config.update("jax_platforms", "cpu")
    if args.go2025:
        from jaxdist.errors import UsageError
        from jaxdist.hardware import get_hardware
        from jaxdist.mesh import parse_mesh
        from jaxdist.predict.plan import predict_plan
        try:
            get_hardware(args.hardware)
        except UsageError as e:
            print(f"predict: error: {e}", file=sys.stderr)
            return 2
        grid = go2025_grid(args.hardware, args.remat)
        jax.config.update("jax_num_cpu_devices", 32)
        rows = [(name, predict_plan(cfg, parse_mesh(cfg.mesh.mesh))) for name, cfg in grid]
        print(format_grid(rows))
        if args.plot:
            plot_grid(rows, Path(args.plot))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(rows), indent=1))
        return 0
    cases = [c for c in CASES if c.small or not args.quick]
    jax.config.update("jax_num_cpu_devices", max(int(c.mesh.split("x")[1]) for c in cases))
    rows = validate(cases)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
