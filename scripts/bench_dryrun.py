"""Benchmark of `--dry-run` (plan from shapes) for the full-size models. Target: each plan
under 5 s on the 2-core machine, with the numbers of the whole-model trace.

Each model is planned by the command a user types, in a fresh process:
`python -m experiments.run --dry-run --model M --layout L --mesh S`. Printed per model:
wall time, the child's CPU time (user + sys: on a shared machine, wall time also counts
waiting for a core) and the per-device bytes. With --compare-full-trace the same plan is
also computed by tracing the whole model's constructor (what --dry-run did before the
stacked-block plan), in-process, and the two plans are checked equal.

Usage: python scripts/bench_dryrun.py [--compare-full-trace]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (("llama3-70b", "fsdp", "4x8"), ("gpt3-175b", "fsdp_tp", "1x4x8"),
         ("mixtral-8x7b", "ep", "1x1x1x8"))


def plan_by_cli(model: str, layout: str, mesh: str) -> tuple[dict, float, float]:
    """(dry_run.json, wall s, CPU s) of the user's command in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "experiments.run", "--dry-run",
                               "--model", model, "--layout", layout, "--mesh", mesh,
                               "--logdir", f"{tmp}/plan"], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"{model}: exit {proc.returncode}: {proc.stderr}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return json.loads(Path(f"{tmp}/plan/dry_run.json").read_text()), wall, cpu


def plan_by_full_trace(model: str, layout: str, mesh: str) -> tuple[dict, float]:
    from unittest import mock

    from jaxdist import state_shapes
    from jaxdist.plan import shapes as dryrun
    from experiments.validation import validate
    from jaxdist.config import MeshConfig, ModelConfig, OutputConfig, RunConfig, TrainConfig

    job = validate(RunConfig(mesh=MeshConfig(mesh=mesh), model=ModelConfig(model=model),
                             train=TrainConfig(layout=layout),
                             output=OutputConfig(dry_run=True)))
    start = time.process_time()
    with mock.patch.object(state_shapes, "_stacked_model_state", lambda *_: None):
        plan = dryrun.plan(job)
    return json.loads(json.dumps(plan.to_json())), time.process_time() - start


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from jaxdist.errors import OneLineParser  # bad input: one line, exit 2

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare-full-trace", action="store_true",
                    help="also trace each whole model (minutes) and check the plans agree")
    args = ap.parse_args()
    print(f"{'model':<14}{'layout':<9}{'mesh':<9}{'wall s':>8}{'cpu s':>8}"
          f"{'per device':>16}  target: < 5 s each")
    worst = 0.0
    for model, layout, mesh in CASES:
        plan, wall, cpu = plan_by_cli(model, layout, mesh)
        worst = max(worst, wall)
        per_device = plan["state_bytes_per_device"]["total"]
        line = (f"{model:<14}{layout:<9}{mesh:<9}{wall:>8.2f}{cpu:>8.2f}"
                f"{per_device / 2 ** 30:>12.2f} GiB")
        if args.compare_full_trace:
            full, full_cpu = plan_by_full_trace(model, layout, mesh)
            line += (f"  full trace: {full_cpu:.1f} cpu s, plans "
                     f"{'equal' if full == plan else 'DIFFER'}")
        print(line, flush=True)
    print(f"slowest plan {worst:.2f} s wall (includes starting Python and importing JAX)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
