"""Joining a multi-process run (one process per host) on JAX's multi-controller runtime.

`jax.distributed.initialize` aborts the whole process (SIGABRT, no Python exception) when a
peer never arrives. So before it, the processes meet at a small TCP join point on the
coordinator's PORT+1: process 0 learns exactly which processes are missing and every process
gets a one-line error within --init-timeout instead of an unexplained abort.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from jaxdist.errors import UsageError
from jaxdist.procs import host_port

ENV = ("JAXDIST_COORDINATOR", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID")


@dataclass(frozen=True)
class Topology:
    coordinator: str | None  # None: single process, or left to JAX's cluster auto-detection
    num_processes: int
    process_id: int
    auto: bool = False       # a cluster environment (SLURM, Open MPI, k8s) was detected

    @property
    def multi(self) -> bool:
        return self.num_processes > 1


def resolve(coordinator: str, num_processes: int, process_id: int) -> Topology:
    """Flags first, then JAXDIST_* environment variables, then cluster detection."""
    coordinator = coordinator or os.environ.get(ENV[0], "")
    num = num_processes or int(os.environ.get(ENV[1], "0") or 0)
    pid = process_id if process_id >= 0 else int(os.environ.get(ENV[2], "-1") or -1)
    if coordinator or num > 1:
        if not coordinator or num < 1 or pid < 0:
            raise UsageError("a multi-process run needs all of --coordinator HOST:PORT, "
                             "--num-processes N and --process-id I (or JAXDIST_COORDINATOR, "
                             "JAXDIST_NUM_PROCESSES, JAXDIST_PROCESS_ID)")
        if pid >= num:
            raise UsageError(f"--process-id {pid} is out of range for {num} processes (0..{num - 1})")
        host_port(coordinator, "--coordinator", 65534, " (PORT+1 is used for the join check)")
        return Topology(coordinator, num, pid)
    detected = _detect_cluster()
    if detected:
        return Topology(None, detected[0], detected[1], auto=True)
    return Topology(None, 1, 0)


def _detect_cluster() -> tuple[int, int] | None:
    """(processes, this index) when launched by SLURM or Open MPI with several tasks."""
    for size, rank in (("SLURM_NTASKS", "SLURM_PROCID"),
                       ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        if int(os.environ.get(size, "1")) > 1:
            return int(os.environ[size]), int(os.environ.get(rank, "0"))
    return None


# Settings each process may give its own way: the others must be equal, or the processes
# compile different programs and their collectives do not match (gloo aborts the job:
# "Received data size doesn't match expected size", with a C++ stack from each process).
PER_PROCESS = {"process_id", "coordinator", "init_timeout", "logdir", "progress",
               "data_dir"}  # a local path holding the same files


def shared_settings(config: dict) -> dict:
    """The settings of a run config's to_dict() that every process must give alike, as flat
    {name: value}."""
    flat = {name: value for section in config.values() for name, value in section.items()
            if name not in PER_PROCESS}
    return json.loads(json.dumps(flat, default=str))  # as the other processes' arrive


def initialize(topo: Topology, timeout_s: int, settings: dict | None = None) -> None:
    """Join every process, then start jax.distributed. Single process: nothing to do.
    `settings` (shared_settings): process 0 refuses a process whose settings differ."""
    if not topo.multi:
        return
    import jax
    from jax._src import distributed as jax_distributed

    if not topo.auto:
        join(topo, timeout_s, settings=settings)
    # Without the preemption service: its C SIGTERM handler would leave a signal unheard
    # until the first step; jaxdist.stop starts it once setup is done.
    with jax_distributed._ENABLE_PREEMPTION_SERVICE(False):
        if topo.auto:
            jax.distributed.initialize(initialization_timeout=timeout_s)
        else:
            jax.distributed.initialize(topo.coordinator, topo.num_processes,
                                       topo.process_id, initialization_timeout=timeout_s)


def join(topo: Topology, timeout_s: float, refusal: str | None = None,
         settings: dict | None = None) -> None:
    """Meet every process at the join point. `refusal` (process 0 only): process 0 will not
    start (its --logdir, say); each process that arrives is told at once why, and the same
    one-line error ends every process within seconds, not at its --init-timeout. Each
    process brings its `settings`; one whose settings differ from process 0's is refused the
    same way, the differences named."""
    host, _, port = topo.coordinator.rpartition(":")
    address = (host, int(port) + 1)
    deadline = time.monotonic() + timeout_s
    if topo.process_id == 0:
        _host_join(address, topo.num_processes, deadline, timeout_s, refusal, settings or {})
    else:
        _reach_join(address, topo.process_id, deadline, timeout_s, settings or {})


def differences(mine: dict, theirs: dict, process: int) -> str | None:
    """One line naming the settings of `process` that differ from process 0's, or None."""
    names = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if not names:
        return None
    shown = "; ".join(f"--{k.replace('_', '-')} {theirs.get(k)!r} (process 0: {mine.get(k)!r})"
                      for k in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (f"process {process} was started with other settings than process 0: {shown}"
            f"{more}; start every process with the same flags")


def refuse(topo: Topology, timeout_s: float, reason: str) -> None:
    """Process 0 refused to start: tell the others (auto-detected clusters have no join
    point; their launcher ends the job)."""
    if topo.multi and not topo.auto and topo.process_id == 0:
        try:
            join(topo, timeout_s, refusal=reason)
        except UsageError:
            pass


def _host_join(address, num_processes: int, deadline: float, timeout_s: float,
               refusal: str | None = None, settings: dict | None = None) -> None:
    joined: dict[int, socket.socket] = {}
    with socket.create_server(address, reuse_port=False) as server:
        while len(joined) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(joined))
                _tell(joined, {"ok": False, "missing": missing})
                if refusal:
                    raise UsageError(refusal)
                raise UsageError(f"process(es) {', '.join(map(str, missing))} of "
                                 f"{num_processes} did not join within {timeout_s:g} s "
                                 f"(--init-timeout); is every process started?")
            server.settimeout(min(left, 1.0))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.settimeout(5)
            try:
                hello = json.loads(conn.makefile("rb").readline(1 << 20))
                process = hello["process"]
            except (OSError, ValueError, KeyError, TypeError):
                conn.close()
                continue
            joined[process] = conn
            mismatch = differences(settings or {}, hello.get("settings") or {}, process)
            if mismatch and not refusal:  # every process is told; process 0 stops too
                refusal = mismatch
                _tell({p: c for p, c in joined.items() if p != process},
                      {"ok": False, "error": refusal})
            if refusal:  # told now: it need not wait for the slowest peer
                _tell({process: conn}, {"ok": False, "error": refusal})
        if refusal:
            raise UsageError(refusal)
        _tell(joined, {"ok": True})


def _tell(conns: dict, message: dict) -> None:
    for conn in conns.values():
        try:
            conn.sendall(json.dumps(message).encode())
        except OSError:
            pass
        conn.close()


def _reach_join(address, process_id: int, deadline: float, timeout_s: float,
                settings: dict | None = None) -> None:
    while True:
        try:
            conn = socket.create_connection(address, timeout=1.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise UsageError(f"process 0 (the coordinator, join point {address[0]}:"
                                 f"{address[1]}) did not answer within {timeout_s:g} s "
                                 f"(--init-timeout)") from None
            time.sleep(0.2)
    with conn:
        conn.sendall(json.dumps({"process": process_id, "settings": settings or {}},
                                default=str).encode() + b"\n")
        conn.settimeout(max(deadline - time.monotonic(), 0) + 2)
        try:
            reply = json.loads(conn.recv(4096) or b"{}")
        except (OSError, ValueError):
            reply = {}
    if reply.get("error"):
        raise UsageError(f"process 0: {reply['error']}")
    if not reply.get("ok"):
        missing = reply.get("missing")
        what = (f"process(es) {', '.join(map(str, missing))} did not join" if missing else
                "process 0 gave up or stopped")
        raise UsageError(f"{what} within {timeout_s:g} s (--init-timeout)")
