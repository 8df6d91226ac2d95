"""The same train step under two compilers, side by side: per layout, collective bytes per
kind, memory, FLOPs and compile time, and how the programs differ (jaxdist.program.compiled).

    python scripts/compare_compilers.py                       # gpt-tiny, every layout, 4x8 H200
    python scripts/compare_compilers.py --layouts fsdp --model llama3-70b --model-opts "" \\
        --batch-size 64                                       # one big row (depth 1 and 2)
    python scripts/compare_compilers.py --with-device         # on a GPU: the device's XLA:GPU
                                                              # program vs device-less XLA:GPU

Without a device the two compilers are XLA:GPU for the part's topology (no GPU needed) and
XLA:CPU on simulated devices. Compile times are this machine's wall seconds: functional.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxdist.errors import OneLineParser  # noqa: E402

CASES = {  # layout: (mesh, model options, micro-batches); gpt-tiny (depth 4 for pipelines)
    "ddp": ("4x8", "", 1), "zero1": ("4x8", "", 1), "fsdp": ("4x8", "", 1),
    "hsdp": ("4x8", "", 1), "tp": ("data:4,tensor:8", "", 1),
    "fsdp_tp": ("data:4,tensor:8", "", 1), "ep": ("data:4,expert:8", "", 1),
    "pp": ("data:8,stage:4", "depth=4", 4), "tp_pp": ("data:1,stage:4,tensor:8", "depth=4", 4),
    "fsdp_pp": ("fsdp:8,stage:4", "depth=4", 4),
}


def reading_of(cfg, target, blocks: str):
    """Figures of the whole step on `target` (depth 1/2 extrapolated for big decoders)."""
    from experiments.validation import validate
    from jaxdist.predict import program

    job = validate(cfg)
    return program.step_figures(job, job.model, job.shape, blocks, target)


def by_kind(comm_rows) -> dict:
    out: dict = {}
    for r in comm_rows:
        row = out.setdefault(r["kind"], [0.0, 0.0])
        row[0] += r["count"]
        row[1] += r["bytes"]
    return out


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(CASES))
    parser.add_argument("--model", default="")
    parser.add_argument("--model-opts", default=None)
    parser.add_argument("--mesh", default="")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--with-device", action="store_true",
                        help="on a GPU machine: this GPU's program vs the device-less one")
    args = parser.parse_args(argv)
    parser.require_at_least(args, batch_size=1)

    import jax
    if not args.with_device:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 32)
    from jaxdist.program import compiled
    from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
    from jaxdist.hardware import get_hardware
    from jaxdist.mesh import parse_mesh
    from jaxdist.summary import human_bytes
    from sharding.registry import facts

    hw = get_hardware(args.hardware)
    for layout in args.layouts.split(","):
        mesh, opts, mb = CASES[layout]
        mesh = args.mesh or ("1" if args.with_device else mesh)
        families = facts(layout).families or ("gpt",)  # the layout registry's
        model = args.model or ("gpt-tiny" if "gpt" in families else f"{families[0]}-tiny")
        cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                        model=ModelConfig(model=model, dtype="bfloat16",
                                          model_opts=opts if args.model_opts is None
                                          else args.model_opts),
                        train=TrainConfig(layout=layout, batch_size=args.batch_size,
                                          microbatches=mb))
        n = parse_mesh(mesh).size
        if args.with_device:
            real = compiled.Target("XLA:GPU", tuple(jax.devices("gpu")[:n]),
                                   f"XLA:GPU on {n} x {jax.devices()[0].device_kind}")
            targets = [real, compiled.gpu_topology(dataclasses.replace(hw, gpus_per_node=n),
                                                   n)]
        else:
            targets = [compiled.gpu_topology(hw, n), compiled.simulated_cpu(n)]
        try:
            figs = [reading_of(cfg, t, "auto") for t in targets]
        except Exception as e:  # noqa: BLE001 - one row's failure is printed, the rest run
            print(f"\n{layout} {mesh} {model}: FAILED {type(e).__name__}: {e}")
            continue
        print(f"\n{layout} on {mesh}, {model} bf16, batch {args.batch_size}")
        for t, f in zip(targets, figs):
            mem = f.memory
            kinds = ", ".join(f"{k} {b:,.0f} B ({c:g})" for k, (c, b) in
                              sorted(by_kind(f.comm).items()))
            print(f"  {t.label}")
            print(f"    compile {f.compile_s:.1f} s; temp {human_bytes(mem['temp_bytes'])}, "
                  f"peak {human_bytes(mem['peak_bytes'])}; FLOPs {f.flops:.4g}; {kinds}")
        a, b = (by_kind(f.comm) for f in figs)
        total = [sum(v[1] for v in x.values()) for x in (a, b)]
        print(f"  bytes first/second: {total[0] / total[1]:.2f}" if total[1] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
