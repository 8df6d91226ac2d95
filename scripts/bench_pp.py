"""Pipeline schedules side by side: S = 4 stages, M = 4..32 micro-batches.

For each schedule (gpipe, 1f1b, interleaved with V = 2, zb-h1) and M, compiles the pipelined step
of gpt-tiny (depth 8, batch 64) on 4 simulated CPU devices (mesh stage:4) and prints the
bubble counted from the schedule beside the analytic formula, the compiler's temp bytes per
device, the stage-to-stage bytes per step read from the compiled HLO (beside the analytic
activation volume), and last the 1F1B / GPipe ratio of the activation memory (temp bytes).

Then the step length: the table's cost in F-units (each tick as long as its busiest stage's
F then BACK, F = 1, BACK = 2) and the measured wall time of the step (median of --runs after
one warm-up, on the same 4 simulated devices), as 1F1B / GPipe at equal M. Both run the
same F and BACK bodies, so the work is equal and only the table differs. Simulated CPU
devices share the host's cores, so the measured ratio is functional, not a performance
figure.

Usage: python scripts/bench_pp.py [--ms 4,8,16,32] [--runs 5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

S, BATCH = 4, 64
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def step_seconds(program, compiled, batch, runs: int) -> float:
    """Median wall time of the compiled step over `runs` runs after one warm-up."""
    state = program.init()
    state, loss = compiled(state, batch)
    loss.block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        state, loss = compiled(state, batch)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def start_jax():
    """jax on S simulated CPU devices at XLA's -O0: after the flags are checked, so that bad
    input is refused before jax is imported."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=0").strip()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", S)


def measure(cfg, schedule: str, virtual: int, M: int, runs: int = 0) -> dict:
    import jax

    from jaxdist.data import TrainStream
    from jaxdist.mesh import build_mesh, parse_mesh
    from jaxdist.pipeline.program import build_pipeline_program
    from jaxdist.pipeline.report import local_activation_bytes, stage_sends
    from jaxdist.train_step import make_optimizer, put_batch
    from sharding import get_layout

    shape = parse_mesh(f"stage:{S}")
    program = build_pipeline_program(cfg, "float32", make_optimizer("adamw", 1e-3),
                                     get_layout("pp"), build_mesh(shape, jax.devices()[:S]),
                                     0, M, schedule, virtual)
    batch = put_batch(TrainStream(cfg, None, BATCH, 0).batch(0), program.batch_sharding)
    compiled = program.step.lower(program.abstract_state, batch).compile()
    sched = program.schedule
    act = local_activation_bytes(program, BATCH)
    sends = stage_sends(compiled.as_text(), dict(program.batch_sharding.mesh.shape),
                        sched)
    return {"bubble": sched.bubble(), "analytic": sched.analytic_bubble(),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "stash": sched.res_slots, "stage_bytes": sends["total_bytes"],
            "stage_analytic": 2 * act * M * (sched.chunks - 1), "cost": sched.cost(),
            "seconds": step_seconds(program, compiled, batch, runs) if runs else None}


def main() -> int:
    from jaxdist.errors import OneLineParser

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="4,8,16,32", help="micro-batch counts")
    parser.add_argument("--runs", type=int, default=5, help="timed steps of gpipe and 1f1b")
    args = parser.parse_args()
    try:
        ms = [int(m) for m in args.ms.split(",")]
    except ValueError:
        parser.error(f"--ms {args.ms!r} is not comma-separated integers (e.g. 4,8,16)")
    if args.runs < 1 or any(m < S for m in ms):
        parser.error(f"--runs must be 1 or more and every --ms at least S={S} (1f1b needs "
                     f"M >= S); got --runs {args.runs}, --ms {args.ms}")
    start_jax()
    from models import get_model

    cfg = get_model("gpt-tiny", {"depth": "8"})
    rows = {}
    print(f"gpt-tiny depth 8, batch {BATCH}, S={S}; bytes per device")
    print(f"{'schedule':<16}{'M':>4}{'bubble':>9}{'analytic':>10}{'temp bytes':>13}"
          f"{'stashed mbs':>13}{'stage bytes':>13}{'analytic':>11}")
    for M in ms:
        for name, V in SCHEDULES:
            r = measure(cfg, name, V, M, args.runs if name in ("gpipe", "1f1b") else 0)
            rows[(name, M)] = r
            label = name + (f" V={V}" if V > 1 else "")
            print(f"{label:<16}{M:>4}{r['bubble']:>9.4f}{r['analytic']:>10.4f}"
                  f"{r['temp']:>13,}{r['stash']:>13,}{r['stage_bytes']:>13,}"
                  f"{r['stage_analytic']:>11,}", flush=True)
    print("\n1F1B / GPipe activation memory (compiler temp bytes; micro-batches stashed)")
    for M in sorted({m for _, m in rows}):
        g, o = rows[("gpipe", M)], rows[("1f1b", M)]
        z = rows[("zb-h1", M)]
        print(f"  M={M:<3} temp {o['temp'] / g['temp']:.3f}   stash "
              f"{o['stash'] / g['stash']:.3f}   (zb-h1 / 1f1b temp {z['temp'] / o['temp']:.3f})")
    print("\n1F1B / GPipe step at equal M: table cost (F-units) and measured wall time "
          "(functional: simulated devices share the host's cores)")
    for M in sorted({m for _, m in rows}):
        g, o = rows[("gpipe", M)], rows[("1f1b", M)]
        print(f"  M={M:<3} table {o['cost']}/{g['cost']} = {o['cost'] / g['cost']:.3f}   "
              f"measured {o['seconds'] * 1e3:.1f}/{g['seconds'] * 1e3:.1f} ms = "
              f"{o['seconds'] / g['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
