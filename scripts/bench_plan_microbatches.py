"""How a pipeline plan's own work grows with the micro-batch count: the schedule table, its
sends by slot (both loop forms) and the tick-by-tick time model, for an interleaved,
combined 1F1B table of S stages and V chunks per stage at M = 72 ... 576, with every op
timed 1 s (no compile: the compiles a plan makes do not depend on M). Prints seconds per M
and the ratio to the previous M; linear growth reads about 2.0 per doubling.

    .venv/bin/python scripts/bench_plan_microbatches.py [--stages 8] [--virtual 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from jaxdist.parts import Part
    from jaxdist.pipeline.schedule import BACK, BWD, FWD, PAIR, WGT, build_schedule
    from jaxdist.plan_words import TimeTerms
    from jaxdist.predict import ticks

    parser = argparse.ArgumentParser(prog="bench_plan_microbatches",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=8)
    parser.add_argument("--ms", default="72,144,288,576")
    args = parser.parse_args(argv)
    hw = Part("bench", "NVIDIA H100", 100e9, 1e12, 400e9, 50e9, 8, 700, ())
    op = ticks.OpTime(seconds=1.0, device_s=1.0, compute_s=1.0, hbm_s=0.0, intra_node_s=0.0,
                      inter_node_s=0.0, exposed_intra_node_s=0.0, exposed_inter_node_s=0.0,
                      flops=0.0, bytes_accessed=0.0, collectives=[],
                      terms=TimeTerms(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, False))
    ops = {(k, last): op for k in (FWD, BACK, BWD, WGT, PAIR) for last in (False, True)}
    mesh = {"stage": args.stages, "data": 1, "fsdp": 1}
    print(f"S={args.stages} V={args.virtual}, interleaved, combined 1F1B, --overlap")
    print(f"{'M':>6}{'ticks':>8}{'seconds':>10}{'ratio':>8}")
    previous = None
    for m in (int(x) for x in args.ms.split(",")):
        start = time.perf_counter()
        sched = build_schedule("interleaved", args.stages, m, args.virtual, combined=True)
        ticks.tick_model(sched, ops, op, 1e6, hw, mesh, overlap=True)
        seconds = time.perf_counter() - start
        ratio = f"{seconds / previous:.2f}" if previous else "-"
        print(f"{m:>6}{sched.ticks:>8}{seconds:>10.2f}{ratio:>8}")
        previous = seconds
    return 0


if __name__ == "__main__":
    sys.exit(main())
