"""JAX vs PyTorch on this machine, same model, batch, optimizer and protocol, runs interleaved.

    .venv/bin/python scripts/bench_vs_torch.py [--models mlp-10m,gpt-small] [--repeats 2]

For every repeat, model and layout (ddp, fsdp): one JAX run (`experiments.run`, a 2-device
mesh simulated on the host CPU) and one PyTorch run (`experiments.torch_run`, 2 gloo
processes), back to back, the order alternating between repeats so that drift in machine
load (other jobs) hits both sides alike. Then `experiments.compare` over all runs, and a
summary of JAX/PyTorch throughput ratios per (model, layout): median over repeats, and
the spread. Goal: >= 1.0 for every layout.

Every run directory is kept under --out (default runs/bench-vs-torch-<time>), so the table
can be rebuilt with `python -m experiments.compare <out>`.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.errors import OneLineParser
from jaxdist.record import RunRecord

ROOT = Path(__file__).resolve().parent.parent
# Per-model protocol: warm-up and timed steps. gpt-small at batch 256 is ~1e12 FLOPs a step:
# ~20 CPU-seconds, 10+ s a step on two cores, so it gets few.
PROTOCOL = {"mlp-10m": (3, 20), "gpt-small": (1, 3)}


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp-10m,gpt-small")
    p.add_argument("--layouts", default="ddp,fsdp")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--devices", type=int, default=2, help="JAX mesh size = PyTorch processes")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--steps", type=int, default=0, help="timed steps (0: per-model default)")
    p.add_argument("--warmup", type=int, default=-1, help="warm-up steps (-1: per-model)")
    p.add_argument("--jax-xla-flags", default=os.environ.get("XLA_FLAGS", ""),
                   help="XLA_FLAGS for the JAX runs (default: this environment's)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="threads per PyTorch process (0: cores / processes)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    p.require_at_least(args, repeats=1, batch_size=1, devices=1, steps=0, warmup=-1,
                       torch_threads=0)
    return args


def run(cmd: list[str], env_extra: dict) -> tuple[int, float, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - start, proc.stderr[-2000:]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or ROOT / "runs" / time.strftime("bench-vs-torch-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    layouts = [x for x in args.layouts.split(",") if x]
    py = sys.executable
    print(f"JAX XLA_FLAGS={args.jax_xla_flags!r}; PyTorch threads/process="
          f"{args.torch_threads or 'auto'}; out={out}", flush=True)
    loads = []
    for rep in range(args.repeats):
        for model in models:
            warmup, steps = PROTOCOL.get(model, (3, 10))
            warmup = warmup if args.warmup < 0 else args.warmup
            steps = args.steps or steps
            common = ["--model", model, "--batch-size", str(args.batch_size),
                      "--optimizer", args.optimizer, "--warmup", str(warmup),
                      "--steps", str(steps), "--no-progress"]
            for layout in layouts:
                tag = f"{model}-{layout}-r{rep}"
                jax_cmd = [py, "-m", "experiments.run", "--layout", layout, "--mesh",
                           str(args.devices), "--platform", "cpu", *common,
                           "--logdir", str(out / f"jax-{tag}")]
                torch_cmd = [py, "-m", "experiments.torch_run", "--strategy", layout,
                             "--nproc", str(args.devices), "--threads",
                             str(args.torch_threads), *common,
                             "--logdir", str(out / f"torch-{tag}")]
                order = [("jax", jax_cmd, {"XLA_FLAGS": args.jax_xla_flags}),
                         ("torch", torch_cmd, {})]
                if rep % 2:
                    order.reverse()
                for side, cmd, env in order:
                    load = os.getloadavg()[0]
                    code, wall, err = run(cmd, env)
                    loads.append(load)
                    status = "ok" if code == 0 else f"FAILED ({code}): {err}"
                    print(f"  {side:5s} {tag:24s} {wall:6.1f} s wall, load {load:.1f}: "
                          f"{status}", flush=True)
                    if code:
                        return 1
    print()
    subprocess.run([py, "-m", "experiments.compare", str(out), "--out", str(out / "compare")],
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    print(summary(out, models, layouts))
    print(f"\nload average during the runs: {min(loads):.1f} .. {max(loads):.1f} "
          f"(2 cores; > 2 means other jobs shared them)")
    return 0


def summary(out: Path, models, layouts) -> str:
    def sps(path):
        return RunRecord.load(path).samples_per_s

    lines = ["## JAX/PyTorch throughput ratio per repeat (>= 1.0: JAX at least as fast)", "",
             "| model | layout | JAX samples/s | PyTorch samples/s | ratio (median) | "
             "per repeat | goal >= 1.0 |", "|---|---|---|---|---|---|---|"]
    for model in models:
        for layout in layouts:
            reps = sorted(out.glob(f"jax-{model}-{layout}-r*"))
            pairs = [(sps(j), sps(out / j.name.replace("jax-", "torch-", 1))) for j in reps]
            if not pairs:
                continue
            ratios = [a / b for a, b in pairs]
            med = statistics.median(ratios)
            lines.append(f"| {model} | {layout} | {statistics.median(a for a, _ in pairs):.1f} "
                         f"| {statistics.median(b for _, b in pairs):.1f} | {med:.2f} | "
                         f"{', '.join(f'{r:.2f}' for r in ratios)} | "
                         f"{'met' if med >= 1.0 else 'NOT met'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
