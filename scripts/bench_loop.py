"""Benchmark of the experiment loop itself (prints ratios measured in this one run).

1. Loop overhead: wall time per step of `jaxdist.loop.run` (timer, TensorBoard, progress
   bar, the other hooks) against the loop's bare core (`jaxdist.loop.run_steps` with no
   hooks) calling the same compiled step, blocking on it and fetching its loss. Blocks are
   interleaved so machine drift hits both. Target: <= 1% at steps >= 50 ms.
2. Memory: per-device train-state bytes of each layout against total/N. Target fsdp <= 1.02.

Simulated CPU devices: the times are only used as a ratio of two loops over the same step.
Usage: python scripts/bench_loop.py [--model gpt-tiny] [--mesh 2x4] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxdist.errors import OneLineParser  # noqa: E402
from jaxdist.mesh import parse_mesh  # noqa: E402


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-model", default="gpt-small")
    args = ap.parse_args()
    ap.require_at_least(args, batch_size=1, steps=1, rounds=1)

    import jax
    shape = parse_mesh(args.mesh)
    jax.config.update("jax_num_cpu_devices", shape.size)

    from jaxdist.config import (LoopConfig, MeshConfig, ModelConfig, OutputConfig,
                                RunConfig, TrainConfig)
    from experiments.validation import validate
    from jaxdist import loop, metrics
    from jaxdist.devices import select_devices
    from jaxdist.mesh import build_mesh
    from jaxdist.train_step import build_program, make_optimizer, put_batch
    from jaxdist.data import TrainStream
    from models import get_model
    from sharding import get_layout

    platform = select_devices(shape)
    cfg = RunConfig(mesh=MeshConfig(mesh=args.mesh), model=ModelConfig(model=args.model),
                    train=TrainConfig(layout="fsdp", batch_size=args.batch_size),
                    loop=LoopConfig(warmup=3, steps=args.steps),
                    output=OutputConfig(progress=True))

    # The bare loop: the loop's core with no hooks over the same program and batches,
    # nothing but call + block + loss fetch.
    model_cfg = get_model(args.model)
    program = build_program(model_cfg, "float32", make_optimizer("adamw", 1e-3),
                            get_layout("fsdp"), build_mesh(shape, platform.devices), 0)
    stream = TrainStream(model_cfg, None, args.batch_size, 0)
    batches = [put_batch(stream.batch(i), program.batch_sharding) for i in range(8)]
    state = program.init()
    compiled = program.step.lower(state, batches[0]).compile()

    def step(s, batch):
        return jax.block_until_ready(compiled(s, batch))

    def bare() -> float:
        nonlocal state
        feed = itertools.cycle(batches).__next__
        state, _ = loop.run_steps(step, state, feed, range(3))
        start = time.perf_counter()
        state, _ = loop.run_steps(step, state, feed, range(args.steps))
        return (time.perf_counter() - start) / args.steps

    def full() -> float:
        with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null:
            saved, sys.stderr = sys.stderr, null  # the bar still renders, unseen
            try:
                results = loop.run(validate(cfg).with_shape(shape), platform, Path(tmp) / "run",
                                   log=lambda *_: None)
            finally:
                sys.stderr = saved
        window = results["window"]
        # First timed step start -> last timed step end: includes everything between steps.
        wall = window["end_unix_s"] - window["start_unix_s"]
        between.append((wall - results["step_time_s"]["mean"] * args.steps) / args.steps)
        return wall / args.steps

    bare_s, loop_s, between = [], [], []
    for r in range(args.rounds):
        bare_s.append(bare())
        loop_s.append(full())
        print(f"round {r + 1}: bare {bare_s[-1] * 1e3:8.2f} ms/step   "
              f"loop {loop_s[-1] * 1e3:8.2f} ms/step")
    bare_med, loop_med = sorted(bare_s)[len(bare_s) // 2], sorted(loop_s)[len(loop_s) // 2]

    print(f"\nper-device train-state bytes, {args.memory_model} on mesh {args.mesh} "
          f"({shape.size} devices), AdamW")
    print(f"{'layout':<8}{'per device':>14}{'total':>14}{'total/N':>14}{'ratio':>9}"
          f"{'replicated':>12}")
    mem_cfg = get_model(args.memory_model)
    ratios = {}
    for layout in ("ddp", "zero1", "hsdp", "fsdp"):
        p = build_program(mem_cfg, "float32", make_optimizer("adamw", 1e-3),
                          get_layout(layout), build_mesh(shape, platform.devices), 0)
        summary = metrics.sharding_summary(p.abstract_state, p.state_specs)
        total = summary["sharded_bytes"] + summary["replicated_bytes"]
        per_device = max(d["bytes"] for d in metrics.state_bytes_by_device(p.init()))
        ratios[layout] = per_device / (total / shape.size)
        print(f"{layout:<8}{per_device:>14,}{total:>14,}{total // shape.size:>14,}"
              f"{ratios[layout]:>9.4f}{summary['replicated_bytes']:>12,}")

    print(f"\nloop step {loop_med * 1e3:.2f} ms vs bare {bare_med * 1e3:.2f} ms (medians of "
          f"{args.rounds} interleaved rounds of {args.steps} steps; simulated devices)")
    own = sorted(between)[len(between) // 2]
    print(f"time between timed steps (TensorBoard, progress bar, the other hooks; and the "
          f"loss fetch and freeing the previous step's buffers, which the bare loop also "
          f"pays): {own * 1e3:.3f} ms/step")
    print(f"loop overhead ratio, fastest rounds (min loop / min bare; least disturbed by "
          f"other load): {min(loop_s) / min(bare_s):.4f}")
    print(f"loop overhead ratio (loop/bare medians, target <= 1.01): {loop_med / bare_med:.4f}")
    print(f"fsdp per-device bytes / (total/N) (target <= 1.02): {ratios['fsdp']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
