"""Main job: `python -m experiments.run --layout fsdp --mesh 4x8`.

Everything the user typed is checked before a run directory exists, so bad input leaves
nothing behind: a one-line error and exit status 2.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while JAX is imported: noted, then handled like any other
    from jaxdist.stop import defer_signals
    defer_signals()

import argparse  # noqa: E402
import sys
import time
from pathlib import Path

from jaxdist import distributed
from jaxdist.config import RunConfig, add_arguments, from_namespace, parse_profile_steps
from jaxdist.devices import configure_host_devices, configure_xla_flags, select_devices
from jaxdist.errors import OneLineParser, UsageError
from jaxdist.mesh import MeshShape, parse_mesh
from jaxdist.notices import notices
from experiments.run_dirs import make_logdir, resume_folder, wrote_record
from jaxdist.stop import EXIT_CODES, HardStop, StopRequest, release_deferred


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m experiments.run",
        description="Train one model under one layout on a device mesh and measure step "
                    "latency, throughput, MFU and memory. Without an accelerator the mesh is "
                    "simulated on host CPU devices.")
    add_arguments(parser)  # --model and --layout list the registries' names
    return parser


def validate(cfg: RunConfig) -> MeshShape:
    """Every check that needs no device. Returns the parsed mesh. The layout first, before
    the models (flax) are imported: a misspelled --layout is refused in about a second."""
    from sharding import check_layout, get_layout
    get_layout(cfg.train.layout, cfg.train.distributed_optimizer)
    from jaxdist.pipeline.checks import check_pipeline
    from jaxdist.run_model import build_model
    from sharding.pipeline import PIPELINE_LAYOUTS

    model_cfg, _ = build_model(cfg)
    shape = parse_mesh(cfg.mesh.mesh)
    if (cfg.train.layout in PIPELINE_LAYOUTS and shape.stage == 1 and shape.size
            and model_cfg.family in ("gpt", "moe")):  # other families: check_layout says so
        raise UsageError(f"layout {cfg.train.layout!r} splits over the stage axis, which "
                         f"this mesh does not have (the short form puts stage fifth: "
                         f"DATAxFSDPxTENSORxEXPERTxSTAGE); e.g. --mesh "
                         f"{stage_example(cfg.train.layout, shape)}")
    check_layout(cfg.train.layout, shape.axis_sizes, model_cfg.family,
                 cfg.train.distributed_optimizer)
    if cfg.train.layout in PIPELINE_LAYOUTS:  # depth vs stages x chunks, schedule vs M
        check_pipeline(model_cfg, shape.stage, cfg.train.pp_schedule, cfg.train.microbatches,
                       cfg.train.pp_virtual, cfg.data.eval_every, shape.data)
    if cfg.data.eval_every < 0:
        raise UsageError(f"--eval-every must be 0 or more, got {cfg.data.eval_every}")
    if cfg.data.eval_every and cfg.data.dataset == "synthetic":
        raise UsageError("--eval-every needs a real dataset: add --dataset digits")
    for name, value in (("--steps", cfg.loop.steps), ("--batch-size", cfg.train.batch_size)):
        if value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")
    if cfg.loop.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {cfg.loop.warmup}")
    ck = cfg.checkpoint
    if ck.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 or more, got {ck.checkpoint_every}")
    if (ck.resume or ck.checkpoint_every) and not ck.checkpoint_dir:
        raise UsageError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    cfg.power.validate()
    profile = parse_profile_steps(cfg.output.profile_steps)
    if profile and profile[1] >= cfg.loop.warmup + cfg.loop.steps:
        raise UsageError(f"--profile-steps {cfg.output.profile_steps}: the run has steps 0.."
                         f"{cfg.loop.warmup + cfg.loop.steps - 1}")
    if not cfg.train.lr > 0:
        raise UsageError(f"--lr must be positive, got {cfg.train.lr}")
    check_checkpoint_dir(cfg)
    return shape


def stage_example(layout: str, shape: MeshShape) -> str:
    """A mesh with a stage axis on the same devices for a pipeline layout: the layout's own
    inner axis (tp_pp: tensor, fsdp_pp: fsdp) kept, 2 stages (or all) from the rest."""
    inner = {"tp_pp": "tensor", "fsdp_pp": "fsdp"}.get(layout)
    kept = getattr(shape, inner) if inner else 1
    rest = shape.size // kept
    if rest == 1 and kept % 2 == 0:  # every device on the inner axis: give half to stage
        kept, rest = kept // 2, 2
    stages = 2 if rest % 2 == 0 or rest == 1 else rest
    rest = max(rest, stages)
    sizes = {"data": rest // stages, "stage": stages, **({inner: kept} if kept > 1 else {})}
    return ",".join(f"{a}:{n}" for a, n in sizes.items())


def check_checkpoint_dir(cfg: RunConfig) -> None:
    """--checkpoint-dir: a writable folder, empty unless --resume continues its checkpoints
    (jaxdist/checkpoint.py). A dry run writes none, and --layout ps refuses the flag."""
    if cfg.checkpoint.checkpoint_dir and not cfg.output.dry_run and cfg.train.layout != "ps":
        from jaxdist.checkpoint import check_directory, identity
        check_directory(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.resume, identity(cfg))


def check_batch(cfg: RunConfig, shape: MeshShape) -> None:
    """The batch is split over every device but the tensor axis, then into micro-batches."""
    b, m = cfg.train.batch_size, cfg.train.microbatches
    num_devices, mesh_label = shape.size // shape.tensor // shape.stage, shape.label
    if m < 1:
        raise UsageError(f"--microbatches must be a positive integer, got {m}")
    unit = num_devices * m
    if b % unit:
        below, above = b // unit * unit, (b // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        what = (f"the {num_devices} batch shards of mesh {mesh_label}" if m == 1 else
                f"{num_devices} batch shards x {m} micro-batches")
        raise UsageError(f"global batch {b} is not divisible by {what}; use a multiple of "
                         f"{unit}, e.g. --batch-size {nearest}")


def print_notices(cfg: RunConfig) -> None:
    """Flags given that do nothing here, one line each (jaxdist/notices.py), once the input
    is known to be valid: bad input stays a single error line."""
    from jaxdist.notices import disk_notices
    for line in notices(cfg) + disk_notices(cfg):
        print(line, file=sys.stderr)


def report_interrupt(results: dict, logdir: Path | None, chosen: bool) -> int:
    """The one line an interrupted run prints, saying which command works next (`chosen`:
    the user named --logdir, which now holds this record); its exit status (130 SIGINT,
    143 SIGTERM)."""
    info = results["interrupted"]
    ck = results.get("checkpoint")
    if ck and ck["saved_steps"]:
        resume = (f"checkpoint at step {ck['saved_steps'][-1]} in {ck['directory']}; resume "
                  f"with the same command plus --resume")
    else:
        why = ("a parameter-server run does not resume" if results.get("layout") == "ps" else
               "no checkpoint (give --checkpoint-dir DIR to make a run resumable)")
        # A chosen --logdir keeps the record and takes no other run.
        resume = why + ("; to start again from step 0 run the same command with another "
                        "--logdir" if chosen else "; the same command starts again from "
                        "step 0 in a new folder")
    where = f"results (status interrupted) in {logdir / 'results.json'}; " if logdir else ""
    print(f"run: interrupted by {info['signal']} after {results['steps_done']} of "
          f"{info['steps_planned']} steps; {where}{resume}", file=sys.stderr)
    return EXIT_CODES.get(info["signal"], 143)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = from_namespace(args)
    try:
        cfg = resume_folder(cfg)
    except UsageError as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    if cfg.output.hardware:  # a named part, checked before any heavy import (plans and runs)
        from jaxdist.hardware import get_hardware
        try:
            get_hardware(cfg.output.hardware, cfg.output.gpus_per_node)
        except UsageError as e:
            print(f"run: error: {e}", file=sys.stderr)
            return 2
    if cfg.output.dry_run or cfg.train.layout == "ps":
        release_deferred()
        return main_dry_run(cfg) if cfg.output.dry_run else main_ps(cfg)
    # From here on SIGINT/SIGTERM ask the run to stop; they never raise inside JAX's setup
    # (a KeyboardInterrupt there can crash the process at exit).
    stop = StopRequest().install()
    try:
        return main_mesh(cfg, stop)
    finally:
        stop.restore()


def main_mesh(cfg: RunConfig, stop: StopRequest) -> int:
    run_dir = None
    try:
        shape = validate(cfg)
        if shape.size is not None:  # known before any process or device starts
            check_batch(cfg, shape)
        topo = distributed.resolve(cfg.dist.coordinator, cfg.dist.num_processes,
                                   cfg.dist.process_id)
        configure_xla_flags(cfg.compiler.xla_flags, cfg.compiler.overlap)
        configure_host_devices(shape, cfg.mesh.platform, topo.num_processes)
        # Process 0 writes the outputs; the others only compute. A --logdir it refuses is
        # known before the join, so the others hear why and stop with it.
        if topo.process_id == 0 and cfg.output.logdir:
            try:
                run_dir = make_logdir(cfg, shape.label)
            except UsageError as e:
                distributed.refuse(topo, cfg.dist.init_timeout, str(e))
                raise
        distributed.initialize(topo, cfg.dist.init_timeout)
        platform = select_devices(shape)
        check_batch(cfg, platform.shape)
        if topo.process_id == 0 and run_dir is None:  # its name needs the resolved mesh
            run_dir = make_logdir(cfg, platform.shape.label)
    except UsageError as e:
        if run_dir is not None:
            run_dir.discard()
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C twice
        if run_dir is not None:
            run_dir.discard()
        print("run: interrupted before the first step; nothing was written", file=sys.stderr)
        return 130
    logdir = run_dir.path if run_dir else None
    if stop.signal and not topo.multi:  # several processes stop together, in the loop
        if run_dir is not None:
            run_dir.discard()
        print(f"run: interrupted by {stop.signal} before the first step; nothing was kept",
              file=sys.stderr)
        return EXIT_CODES[stop.signal]
    if run_dir is not None:  # process 0 speaks for all
        print_notices(cfg)

    # Imported only now: the loop's writers and XLA plumbing, which bad input should not
    # wait for.
    from jaxdist import loop
    from jaxdist.summary import format_summary, mesh_text

    if cfg.compiler.overlap and platform.backend != "gpu":
        print(f"notice: --overlap has no effect on {platform.backend} (its flags are for "
              f"XLA:GPU); ignored", file=sys.stderr)
    simulated = (f"No accelerator in use: simulating mesh "
                 f"{mesh_text(platform.shape.axis_sizes)} on "
                 f"{len(platform.devices)} host CPU devices. Step times are functional, not "
                 f"performance figures; memory figures (shard bytes, compiler) are exact."
                 if platform.simulated else None)
    loop_started = time.time()
    try:
        results = loop.run(cfg, platform, logdir, stop=stop, notice=simulated)
    except HardStop:  # Ctrl-C twice: what exists stays, without results (unfinished)
        where = f"; {logdir} is left unfinished (no results.json)" if logdir else ""
        print(f"run: interrupted again while stopping: stopped at once{where}",
              file=sys.stderr)
        return 130
    except BaseException as e:
        if wrote_record(logdir, loop_started):  # what it measured stays
            print(f"run: failed after writing {logdir / 'results.json'}; {logdir} is kept",
                  file=sys.stderr)
        elif run_dir is not None:
            run_dir.discard()
        if isinstance(e, UsageError):
            print(f"run: error: {e}", file=sys.stderr)
            return 2
        raise
    if results["status"] == "interrupted":
        return report_interrupt(results, logdir, bool(cfg.output.logdir))
    if logdir is None:
        return 0
    print()
    print(format_summary(results))
    if platform.simulated:
        print("  (simulated devices: times above are not performance figures)")
    from jaxdist.writers import tensorboard_hint
    print(f"\nresults:     {logdir / 'results.json'}")
    print(tensorboard_hint(logdir))
    return 0


def main_dry_run(cfg: RunConfig) -> int:
    """--dry-run: the layout's plan (jaxdist.plan: from shapes, or with --hardware predicted
    from the step compiled for that cluster); only the CPU backend is touched (no
    accelerator memory is claimed), and -1 is not a mesh one can plan for."""
    from jaxdist import plan as plans
    from jaxdist.record import write_json

    noticed = False
    try:
        shape = validate(cfg)
        if shape.size is None:
            raise UsageError("--dry-run needs an explicit mesh (e.g. --mesh 4x8), not -1")
        if cfg.output.hardware:  # predicted GPU memory and time, from the compiled step
            from jaxdist.hardware import check_nodes, get_hardware
            from jaxdist.program.compiled import xla_options
            from jaxdist.program.xla_log import explained_xla_warnings
            check_batch(cfg, shape)
            check_nodes(get_hardware(cfg.output.hardware, cfg.output.gpus_per_node), shape.size)
            xla_options(cfg.compiler.xla_flags)  # --name=value each, before any compile
            configure_host_devices(shape, "cpu")
            # What the flags do here is said before the compile (a minute for a big model),
            # not only after a plan that succeeded
            print_notices(cfg)
            noticed = True
            with explained_xla_warnings():  # XLA:GPU's C++ warnings, said in one line
                plan = plans.plan(cfg, shape)
        else:  # from shapes: one host device, nothing allocated
            configure_host_devices(MeshShape(1), "cpu")
            plan = plans.plan(cfg, shape)
        logdir = make_logdir(cfg, shape.label).path if cfg.output.logdir else None
    except UsageError as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    if not noticed:
        print_notices(cfg)
    compiler = (plan.get("compiled") or {}).get("compiler", "")
    fallback = (plan.get("compiled") or {}).get("fallback")
    if fallback:
        print(f"notice: XLA:GPU rejected a GEMM tiling ({fallback['rejected'][:160]}); "
              f"planned with Triton GEMMs off ({fallback['xla_flags']}: cuBLAS for every "
              f"dot)", file=sys.stderr)
    if cfg.output.hardware and "not installed" in compiler:
        from jaxdist.program.compiled import gpu_compiler_missing
        print(f"notice: {gpu_compiler_missing()}; these figures come from XLA:CPU's program "
              f"(about 2x the bytes of XLA:GPU's for a bf16 step)", file=sys.stderr)
    print(plans.format_plan(plan))
    if logdir is not None:
        write_json(logdir / plans.file_name(plan), plan)
        print(f"\nplan: {logdir / plans.file_name(plan)}")
    return 0


# Set by main_ps once its run is over (children stopped, files closed): the process may
# skip the interpreter's teardown (see __main__).
DONE_BUT_TEARDOWN: list[bool] = []


def main_ps(cfg: RunConfig) -> int:
    """--layout ps: this process only launches; shard servers and workers (which own the
    devices) are processes of their own, so no JAX backend is started here."""
    from jaxdist.summary import format_summary
    from ps.shard_client import PSError
    from ps.driver import run_ps, validate_ps

    try:
        shape = validate(cfg)
        if shape.size is None:
            raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
        validate_ps(cfg, shape)
        check_batch(cfg, shape)
        run_dir = make_logdir(cfg, shape.label)
        logdir = run_dir.path
    except UsageError as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    print_notices(cfg)
    try:
        results = run_ps(cfg, shape, logdir)
        DONE_BUT_TEARDOWN.append(True)
    except BaseException as e:
        # The error names ps/*.log for the details: those stay.
        run_dir.discard(keep=("ps/*.log",))
        if isinstance(e, UsageError):
            print(f"run: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, PSError):  # a dead worker or shard: named, not a traceback
            print(f"run: error: {e}", file=sys.stderr)
            return 1
        if isinstance(e, KeyboardInterrupt):
            print(f"run: interrupted; the parameter-server run stopped without results "
                  f"(logs in {logdir / 'ps'})", file=sys.stderr)
            return 130
        raise
    if results["status"] == "interrupted":
        return report_interrupt(results, logdir, bool(cfg.output.logdir))
    print()
    print(format_summary(results))
    from jaxdist.writers import tensorboard_hint
    print(f"\nresults:     {logdir / 'results.json'}")
    print(tensorboard_hint(logdir))
    return 0


if __name__ == "__main__":
    code = main()
    if DONE_BUT_TEARDOWN:
        # A PS launcher with its record written and every child stopped: the interpreter's
        # teardown of what it imported (jax, grpc, tensorboardX) took 1-4 s on the loaded
        # 2-core machine, a share of the seconds SLURM gives a preempted run (issue 35).
        sys.stdout.flush()
        sys.stderr.flush()
        import os
        os._exit(code)
    sys.exit(code)
