"""Local multi-process launcher: `python -m experiments.launch --processes 2 -- --layout fsdp
--mesh 2x4 ...` runs N copies of experiments.run on this host as one jax.distributed job.

Each process gets a free coordinator port, its process id and an even share of the simulated
CPU devices; its output lines are prefixed with `[i]`. If one process fails the others are
stopped, and the launcher exits with the failing status. This is how tests and laptops
exercise multi-host runs; on a cluster use SLURM (scripts/slurm/).
"""

from __future__ import annotations

import sys
import threading

from jaxdist import procs
from jaxdist.errors import OneLineParser

# Exit statuses of a process that stopped because it was interrupted (SIGINT, SIGTERM): every
# process stops on the same step by itself (JAX's preemption sync point), so these are not
# failures that should bring the others down.
INTERRUPTED = (130, 143)


def _pump(index: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{index}] {line}")
        out.flush()


def launch(processes: int, run_args: list[str], extra_env: dict | None = None,
           start: list[int] | None = None) -> int:
    """Start the processes listed in `start` (default: all) and supervise them."""
    port = procs.free_port_pair()
    env = procs.python_env(extra_env)
    children, threads = [], []
    for i in (range(processes) if start is None else start):
        args = [*run_args, "--platform", "cpu", "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", str(processes), "--process-id", str(i)]
        if i != 0:
            args.append("--no-progress")
        child = procs.start(f"process {i}", procs.python_argv("experiments.run", *args), env,
                            procs.PIPE)
        child.extra["index"] = i
        children.append(child)
        threads.append(threading.Thread(target=_pump, args=(i, child.proc.stdout, sys.stdout),
                                        daemon=True))
        threads[-1].start()

    # SIGTERM (a scheduler) and SIGHUP exit 128+signal through `finally`, which stops all.
    with procs.TerminationHandlers():
        try:
            watched = procs.watch(children, failed=lambda code: code not in (0, *INTERRUPTED))
            if watched.failure:
                child, code = watched.failure
                sys.stderr.write(f"launch: process {child.extra['index']} exited with status "
                                 f"{code}; stopping the others\n")
                status = code if code > 0 else 1
            else:  # the first interrupted status seen (process 0 may still write results)
                status = next((code for _, code in watched.exits if code in INTERRUPTED), 0)
        except KeyboardInterrupt:
            status = 130
        finally:  # after a failure or Ctrl-C: the others; else what is left in their groups
            procs.stop_all(children, grace_s=10)
    for t in threads:
        t.join(timeout=5)
    return status


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, run_args = argv[:cut], argv[cut + 1:]
    else:
        ours, run_args = argv, []
    parser = OneLineParser(prog="python -m experiments.launch",
                           description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, required=True,
                        help="number of local processes (simulated hosts)")
    args = parser.parse_args(ours)
    if args.processes < 1:
        print("launch: error: --processes must be at least 1", file=sys.stderr)
        return 2
    status = preflight(args.processes, run_args)
    return status if status is not None else launch(args.processes, run_args)


def preflight(processes: int, run_args: list[str]) -> int | None:
    """The checks a run makes before it touches a device, made once here: a mistake is one
    line and exit 2 before N processes start (each would import jax and print the same line).
    None when the run may start. Dry runs and PS runs are refused: they start no
    jax.distributed job, so N processes would each make the same plan or PS job."""
    from experiments.run import build_parser
    from experiments.validation import validate
    from jaxdist.config import from_namespace
    from jaxdist.devices import check_simulated_count, check_split
    from jaxdist.errors import UsageError
    from jaxdist.host_memory import check_processes
    from jaxdist.job import MESH, PLAN, kind_of

    cfg = from_namespace(build_parser().parse_args(run_args))  # argparse: one line, exit 2
    try:
        given = [f for f, v in (("--coordinator", cfg.dist.coordinator),
                                ("--num-processes", cfg.dist.num_processes),
                                ("--process-id", cfg.dist.process_id >= 0)) if v]
        if given:  # the launcher's own, appended to each process's (the last one wins)
            raise UsageError(f"{', '.join(given)}: the launcher gives each process these; "
                             f"leave them out")
        kind = kind_of(cfg)  # the layout registry: an unknown --layout is refused here
        if kind != MESH:  # no jax.distributed job
            raise UsageError(f"{'--dry-run' if kind == PLAN else '--layout ps'} runs as "
                             f"one process (a plan; the parameter server starts its own "
                             f"workers and shards): python -m experiments.run "
                             f"{' '.join(run_args)}")
        shape = validate(cfg).shape  # the run's own pass (the batch split included)
        if shape.size is not None:
            check_split(shape, processes)
            check_simulated_count(shape, processes)
        check_processes(processes, f"--processes {processes} (experiments.run each)")
    except UsageError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
