"""Local multi-process launcher: `python -m experiments.launch --processes 2 -- --layout fsdp
--mesh 2x4 ...` runs N copies of experiments.run on this host as one jax.distributed job.

Each process gets a free coordinator port, its process id and an even share of the simulated
CPU devices; its output lines are prefixed with `[i]`. If one process fails the others are
stopped, and the launcher exits with the failing status. This is how tests and laptops
exercise multi-host runs; on a cluster use SLURM (scripts/slurm/).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from experiments.run import OneLineParser


def free_port() -> int:
    """A port with its neighbour also free (the run uses PORT and PORT+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no pair of free ports found")


def _pump(index: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{index}] {line}")
        out.flush()


def launch(processes: int, run_args: list[str], extra_env: dict | None = None,
           start: list[int] | None = None) -> int:
    """Start the processes listed in `start` (default: all) and supervise them."""
    port = free_port()
    procs: dict[int, subprocess.Popen] = {}
    threads = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    for i in (range(processes) if start is None else start):
        cmd = [sys.executable, "-m", "experiments.run", *run_args, "--platform", "cpu",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
               "--process-id", str(i)]
        if i != 0:
            cmd.append("--no-progress")
        procs[i] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        t = threading.Thread(target=_pump, args=(i, procs[i].stdout, sys.stdout), daemon=True)
        t.start()
        threads.append(t)

    def stop_all(*_):
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs.values():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    signal.signal(signal.SIGTERM, lambda *a: (stop_all(), sys.exit(143)))
    status = 0
    try:
        pending = dict(procs)
        while pending:
            for i, p in list(pending.items()):
                code = p.poll()
                if code is None:
                    continue
                del pending[i]
                if code in (130, 143) and status == 0:
                    # Interrupted: every process stops on the same step by itself (JAX's
                    # preemption sync point); process 0 may still be writing its results.
                    status = code
                elif code not in (0, 130, 143) and status in (0, 130, 143):
                    status = code if code > 0 else 1
                    sys.stderr.write(f"launch: process {i} exited with status {code}; "
                                     f"stopping the others\n")
                    stop_all()
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop_all()
        status = 130
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
    return launch(args.processes, run_args)


if __name__ == "__main__":
    sys.exit(main())
