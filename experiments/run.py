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
from dataclasses import replace
from pathlib import Path

from jaxdist import distributed, job
from jaxdist.config import add_arguments, from_namespace
from jaxdist.devices import (check_simulated_count, configure_host_devices,
                             configure_xla_flags, select_devices)
from jaxdist.errors import OneLineParser, UsageError, WriteError
from jaxdist.job import Job
from jaxdist.mesh import MeshShape
from experiments.run_dirs import (check_logdir, make_logdir, record_stamp, resume_folder,
                                  wrote_record)
from experiments.validation import check_batch, check_ps_host, validate
from jaxdist.stop import (EXIT_CODES, HardStop, StopRequest, StoppedInSetup,
                          release_deferred)


RUN = ("run", "Train one model under one layout on a device mesh and measure step latency, "
              "throughput, MFU and memory. Without an accelerator the mesh is simulated on "
              "host CPU devices. --dry-run plans instead, as python -m experiments.plan does.")


def build_parser(entry: tuple[str, str] = RUN) -> argparse.ArgumentParser:
    """The command line of an entry point (`entry`: its name under experiments and what it
    does); experiments.run and experiments.plan take the same flags."""
    name, description = entry
    parser = OneLineParser(prog=f"python -m experiments.{name}", description=description)
    add_arguments(parser)  # --model and --layout list the registries' names
    return parser


def print_notices(checked: Job) -> None:
    """Flags given that do nothing here, one line each (experiments/notices.py), once the input
    is known to be valid: bad input stays a single error line."""
    for line in checked.notices:
        print(line, file=sys.stderr)


def report_interrupt(results: dict, logdir: Path | None, chosen: bool,
                     out_of_process: bool = False) -> int:
    """The one line an interrupted run prints, saying which command works next (`chosen`:
    the user named --logdir, which now holds this record; `out_of_process`: the layout's
    fact, the parameter server); its exit status (130 SIGINT, 143 SIGTERM)."""
    info = results["interrupted"]
    ck = results.get("checkpoint")
    if ck and ck["saved_steps"]:
        resume = (f"checkpoint at step {ck['saved_steps'][-1]} in {ck['directory']}; resume "
                  f"with the same command plus --resume")
    else:
        why = ("a parameter-server run does not resume" if out_of_process else
               "no checkpoint (give --checkpoint-dir DIR to make a run resumable)")
        # A chosen --logdir keeps the record and takes no other run.
        resume = why + ("; to start again from step 0 run the same command with another "
                        "--logdir" if chosen else "; the same command starts again from "
                        "step 0 in a new folder")
    where = f"results (status interrupted) in {logdir / 'results.json'}; " if logdir else ""
    print(f"run: interrupted by {info['signal']} after {results['steps_done']} of "
          f"{info['steps_planned']} steps; {where}{resume}", file=sys.stderr)
    return EXIT_CODES.get(info["signal"], 143)


def main(argv=None, entry: tuple[str, str] = RUN) -> int:
    """experiments.run's (and, with experiments.plan's `entry`, a plan's): parse, the one
    validation pass, then what the resolved job's kind runs."""
    name = entry[0]
    cfg = from_namespace(build_parser(entry).parse_args(argv))
    if name == "plan":  # the plan's entry point: --dry-run without the flag
        cfg = replace(cfg, output=replace(cfg.output, dry_run=True))
    # From here on SIGINT/SIGTERM ask a mesh run or a plan to stop; they never raise inside
    # JAX's setup (a KeyboardInterrupt there can crash the process at exit). The parameter
    # server gives them back once its job is known (its launcher stops on Ctrl-C).
    stop = StopRequest().install()
    try:
        try:  # the one validation pass (experiments/validation.py), before anything is made
            cfg = resume_folder(cfg)
            checked = validate(cfg)
        except UsageError as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C twice while the checks import JAX
            print(f"{name}: interrupted before the first step; nothing was written",
                  file=sys.stderr)
            return 130
        if checked.kind == job.PLAN:
            return main_dry_run(checked, stop, name)
        if checked.kind == job.PS:
            stop.restore()
            signal, stop = stop.signal, None
            if signal:  # came while the checks ran: nothing was started
                print(f"run: interrupted by {signal} before the first step; nothing was "
                      f"written", file=sys.stderr)
                return EXIT_CODES[signal]
            release_deferred()
            return main_ps(checked)
        return main_mesh(checked, stop)
    finally:
        if stop is not None:
            stop.restore()


def main_mesh(checked: Job, stop: StopRequest) -> int:
    run_dir, shape, cfg = None, checked.shape, checked.cfg
    try:
        topo = distributed.resolve(cfg.dist.coordinator, cfg.dist.num_processes,
                                   cfg.dist.process_id)
        configure_xla_flags(cfg.compiler.xla_flags, cfg.compiler.overlap,
                            checked.layout.pipelined)
        check_simulated_count(shape, topo.num_processes)
        configure_host_devices(shape, cfg.mesh.platform, topo.num_processes)
        # Process 0 writes the outputs; the others only compute. A --logdir it refuses is
        # known before the join, so the others hear why and stop with it.
        if topo.process_id == 0 and cfg.output.logdir:
            try:
                run_dir = make_logdir(cfg, shape.label)
            except UsageError as e:
                distributed.refuse(topo, cfg.dist.init_timeout, str(e))
                raise
        distributed.initialize(topo, cfg.dist.init_timeout,
                               distributed.shared_settings(cfg.to_dict()))
        platform = select_devices(shape)
        check_batch(cfg, platform.shape)  # a mesh of -1 is sized only now, by the devices
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
        print_notices(checked)

    # Imported only now: the loop's writers and XLA plumbing, which bad input should not
    # wait for.
    from jaxdist import loop, record_builder
    from jaxdist.files import write_json
    from jaxdist.summary import format_summary, mesh_text

    if cfg.compiler.overlap and platform.backend != "gpu":
        print(f"notice: --overlap has no effect on {platform.backend} (its flags are for "
              f"XLA:GPU); ignored", file=sys.stderr)
    simulated = (f"No accelerator in use: simulating mesh "
                 f"{mesh_text(platform.shape.axis_sizes)} on "
                 f"{len(platform.devices)} host CPU devices. Step times are functional, not "
                 f"performance figures; memory figures (shard bytes, compiler) are exact."
                 if platform.simulated else None)
    record_before = record_stamp(logdir)
    try:
        results = loop.run(checked.with_shape(platform.shape), platform, logdir, stop=stop,
                           notice=simulated)
    except StoppedInSetup as e:  # its build or compile is left running: the caller exits
        STOPPED_IN_SETUP.append(True)
        total = cfg.loop.warmup + cfg.loop.steps
        kept = ""
        if run_dir is not None:  # the record: what the run was, the phase, the steps done
            write_json(run_dir.path / "results.json", record_builder.stopped_in_setup(
                cfg.train.layout, dict(platform.shape.axis_sizes), cfg.to_dict(), e.signal,
                e.phase, e.steps_done, total))
            kept = f"; {run_dir.path / 'results.json'} records it"
        ck = cfg.checkpoint
        if ck.checkpoint_dir and (e.steps_done or ck.resume):
            kept += (f"; the checkpoints in {ck.checkpoint_dir} are kept (resume with the "
                     f"same command plus --resume)")
        print(f"run: interrupted by {e.signal} during {e.phase}, before step "
              f"{e.steps_done + 1} ({e.steps_done} of {total} steps done){kept}",
              file=sys.stderr)
        return EXIT_CODES[e.signal]
    except HardStop:  # Ctrl-C twice: what exists stays, without results (unfinished)
        where = f"; {logdir} is left unfinished (no results.json)" if logdir else ""
        print(f"run: interrupted again while stopping: stopped at once{where}",
              file=sys.stderr)
        return 130
    except BaseException as e:
        if wrote_record(logdir, record_before):  # what it measured stays
            print(f"run: failed after writing {logdir / 'results.json'}; {logdir} is kept",
                  file=sys.stderr)
        elif run_dir is not None:
            run_dir.discard()
        if isinstance(e, UsageError):
            print(f"run: error: {e}", file=sys.stderr)
            return 1 if isinstance(e, WriteError) else 2
        raise
    if results["status"] == "interrupted":
        return report_interrupt(results, logdir, bool(cfg.output.logdir),
                                checked.layout.out_of_process)
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


def main_dry_run(checked: Job, stop: StopRequest, name: str = "run") -> int:
    """experiments.plan (and --dry-run): the layout's plan (jaxdist.plan: from shapes, or
    with --hardware predicted from the step compiled for that cluster); only the CPU backend
    is touched (no accelerator memory is claimed), and -1 is not a mesh one can plan for. A
    signal while it traces or compiles ends it at once, before anything is written."""
    from jaxdist import plan as plans
    from jaxdist.files import write_json
    from jaxdist.stop import run_abandonable, set_phase

    noticed, shape, cfg = False, checked.shape, checked.cfg
    try:
        check_logdir(cfg)  # before a plan's minutes of compiling, not after
        set_phase("the plan")
        if checked.part is not None:  # predicted GPU memory and time, from the compiled step
            from jaxdist.program.xla_log import explained_xla_warnings
            from jaxdist.program.compiled import plan_cpu_devices
            configure_host_devices(MeshShape(plan_cpu_devices(shape.size,
                                                              cfg.compiler.compiler)), "cpu")
            # What the flags do here is said before the compile (a minute for a big model),
            # not only after a plan that succeeded
            print_notices(checked)
            noticed = True
            with explained_xla_warnings():  # XLA:GPU's C++ warnings, said in one line
                plan = run_abandonable(lambda: plans.plan(checked), stop)
            if not stop.signal:  # what would fit, each lever checked (no compile)
                from experiments.advice import with_advice
                plan = with_advice(plan, checked)
        else:  # from shapes: one host device, nothing allocated
            configure_host_devices(MeshShape(1), "cpu")
            plan = run_abandonable(lambda: plans.plan(checked), stop)
        if stop.signal:  # came before the plan started, or as it ended
            raise StoppedInSetup(stop.signal, "the plan", 0)
        logdir = make_logdir(cfg, shape.label).path if cfg.output.logdir else None
    except UsageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except StoppedInSetup as e:  # its trace or compile is left running: the caller exits
        STOPPED_IN_SETUP.append(True)
        print(f"{name}: interrupted by {e.signal} during {e.phase}; nothing was written",
              file=sys.stderr)
        return EXIT_CODES[e.signal]
    if not noticed:
        print_notices(checked)
    compiler = (plan.get("compiled") or {}).get("compiler", "")
    fallback = (plan.get("compiled") or {}).get("fallback")
    if fallback:
        print(f"notice: XLA:GPU rejected a GEMM tiling ({fallback['rejected'][:160]}); "
              f"planned with Triton GEMMs off ({fallback['xla_flags']}: cuBLAS for every "
              f"dot)", file=sys.stderr)
    if checked.part is not None and "not installed" in compiler:
        from jaxdist.program.compiled import gpu_compiler_missing
        print(f"notice: {gpu_compiler_missing()}; these figures come from XLA:CPU's program "
              f"(about 2x the bytes of XLA:GPU's for a bf16 step)", file=sys.stderr)
    print(plans.format_plan(plan))
    if logdir is not None:
        write_json(logdir / plans.file_name(plan), plan)
        print(f"\nplan: {logdir / plans.file_name(plan)}")
    return 0


# Set by main_mesh when a stop left the build or compile running in its thread: the process
# ends without waiting for it (see __main__).
STOPPED_IN_SETUP: list[bool] = []

# Set by main_ps once its run is over (children stopped, files closed): the process may
# skip the interpreter's teardown (see __main__).
DONE_BUT_TEARDOWN: list[bool] = []


def main_ps(checked: Job) -> int:
    """--layout ps: this process only launches; shard servers and workers (which own the
    devices) are processes of their own, so no JAX backend is started here."""
    from jaxdist.summary import format_summary
    from ps.shard_client import PSError
    from ps.driver import run_ps

    shape, cfg = checked.shape, checked.cfg
    try:
        check_ps_host(checked)
        run_dir = make_logdir(cfg, shape.label)
        logdir = run_dir.path
    except UsageError as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    print_notices(checked)
    try:
        results = run_ps(checked, logdir)
        DONE_BUT_TEARDOWN.append(True)
    except BaseException as e:
        # The error names ps/*.log for the details: those stay, and so do the shards'
        # snapshots with what a --resume of the run reads beside them (ps.resume).
        run_dir.discard(keep=("ps/*.log", "ps/snapshots/**/*", "ps/shard_map.json",
                              "ps/config.json"))
        if isinstance(e, WriteError):  # the launcher's own record (a full disk)
            import os

            print(f"run: error: the launcher (pid {os.getpid()}) could not write the "
                  f"record: {e}; free space there (or give another --logdir) and run again; "
                  f"kept: the shards' logs and snapshots in {logdir / 'ps'}", file=sys.stderr)
            return 1
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
        return report_interrupt(results, logdir, bool(cfg.output.logdir),
                                checked.layout.out_of_process)
    print()
    print(format_summary(results))
    from jaxdist.writers import tensorboard_hint
    print(f"\nresults:     {logdir / 'results.json'}")
    print(tensorboard_hint(logdir))
    return 0


def exit_process(code: int) -> None:
    """The end of experiments.run's (and experiments.plan's) process."""
    if DONE_BUT_TEARDOWN or STOPPED_IN_SETUP:
        # A run stopped during its build or compile, which still runs in its thread; or
        # a PS launcher with its record written and every child stopped: the interpreter's
        # teardown of what it imported (jax, grpc, tensorboardX) takes 1-4 s on the loaded
        # 2-core machine, a share of the seconds SLURM gives a preempted run.
        sys.stdout.flush()
        sys.stderr.flush()
        import os
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
