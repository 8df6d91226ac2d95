"""The processes of one `--layout ps` run on this host: start the K shard servers and W
workers, watch them (progress deadline, a dead worker retired, a dead shard restarted from its
snapshot), and fetch the shards' statistics at the end. ps.driver decides what to do with
them; every child is stopped by jaxdist.procs whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from jaxdist import procs
from jaxdist.config import to_argv
from jaxdist.files import write_json
from ps.security import TOKEN_ENV, connect_host, ready_file_locator
from ps.shard_client import PSError, ShardClient

MAX_RESTARTS = 3
READY_TIMEOUT_S = 120.0


def _child_env(extra: dict | None = None) -> dict:
    env = procs.python_env()
    # A worker sets its own CPU device count; an inherited forced count would override it.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _worker_env(job, worker: int, devices: int, num_workers: int) -> dict:
    """On a GPU node, worker w sees GPUs [w*D, (w+1)*D); otherwise it simulates D CPU
    devices (never all of a GPU node's GPUs at once)."""
    gpus = gpu_count()
    if job.platform == "auto" and gpus >= devices * num_workers:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[worker * devices:(worker + 1) * devices])}
    return {"JAX_PLATFORMS": "cpu"}


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


class Launch:
    """The children of one run and what happened to them."""

    def __init__(self, job, psdir: Path, log, token: str = ""):
        self.job, self.shape, self.psdir, self.log = job, job.shape, psdir, log
        self.token = token  # ps.security.run_token: every child gets it in its environment
        self.argv = to_argv(job.cfg)
        self.servers: list[procs.Child] = []
        self.workers: list[procs.Child] = []
        self.ports: list[int] = []
        self.restarts: list[dict] = []
        self.dead_workers: list[dict] = []
        self.all_pids: list[int] = []
        self.resume = None  # ps.resume.plan of a --resume: each shard's version, worker's step

    @property
    def children(self):
        return self.servers + self.workers

    @property
    def addresses(self) -> list[str]:
        host = connect_host(self.job.ps.ps_bind)
        return [f"{host}:{p}" for p in self.ports]

    def _record_pid(self, child):
        self.all_pids.append(child.pid)
        write_json(self.psdir / "pids.json", self.all_pids)

    def start_server(self, k: int, port: int = 0, restore: bool = False,
                     version: int = -1) -> procs.Child:
        """Shard k; `restore`: from its latest snapshot, or the one of `version`."""
        ready = self.ready_file(k)
        ready.unlink(missing_ok=True)
        snapshots = (["--snapshot-dir", str(self.psdir / "snapshots" / f"shard{k}")]
                     if self.job.ps.ps_checkpoint_every or restore else [])
        args = ["--shard", str(k), "--of", str(self.job.ps.ps_shards), "--port", str(port),
                "--ready-file", str(ready), *snapshots, *(["--restore"] if restore else []),
                *(["--restore-version", str(version)] if version >= 0 else []), *self.argv]
        child = procs.start(f"shard {k}", procs.python_argv("ps.server", *args),
                            _child_env({"JAX_PLATFORMS": "cpu", TOKEN_ENV: self.token}),
                            self.psdir / f"shard{k}.log")
        child.extra["ready"] = ready
        self._record_pid(child)
        return child

    def ready_file(self, k: int) -> Path:
        return self.psdir / f"shard{k}.ready.json"

    def wait_ready(self, child: procs.Child) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = child.extra["ready"]
        while not ready.exists():
            rc = child.poll()
            if rc is not None:
                raise PSError(f"{child.name} exited with {_describe_exit(rc)} while starting; "
                              f"log {child.log_path}:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise PSError(f"{child.name} did not start within {READY_TIMEOUT_S:g} s; log "
                              f"{child.log_path}:\n{child.log_tail()}")
            time.sleep(0.05)
        return json.loads(ready.read_text())

    def start_servers(self) -> None:
        """Start the shards, each on a port its system gives it (port 0), published in its
        ready file: no port is chosen ahead for another process to take first. The workers
        start at the same time (import JAX, compile) and read the ready files."""
        base = getattr(self.job.ps, "ps_port", 0)
        k_count = self.job.ps.ps_shards
        self.ports = [base + k if base else 0 for k in range(k_count)]
        versions = self.resume["versions"] if self.resume else [-1] * k_count
        self.servers = [self.start_server(k, self.ports[k], restore=bool(self.resume),
                                          version=versions[k]) for k in range(k_count)]

    def wait_servers(self) -> None:
        for k, child in enumerate(self.servers):
            self.ports[k] = self.wait_ready(child)["port"]
        self.log(f"ps: {len(self.servers)} shard servers up at {', '.join(self.addresses)} "
                 f"(logs in {self.psdir})")

    def start_workers(self) -> None:
        w_count, devices = self.shape.data, self.shape.fsdp
        for w in range(w_count):  # where the shards are: their ready files, then and later
            first = ["--start-step", str(self.resume["start"][w])] if self.resume else []
            args = ["--worker", str(w), "--ready-dir", str(self.psdir), "--out",
                    str(self.psdir), *first, *self.argv]
            child = procs.start(f"worker {w}", procs.python_argv("ps.worker", *args),
                                _child_env({**_worker_env(self.job, w, devices, w_count),
                                            TOKEN_ENV: self.token}),
                                self.psdir / f"worker{w}.log")
            self.workers.append(child)
            self._record_pid(child)
        self.log(f"ps: {w_count} workers x {devices} device(s) started, mode "
                 f"{self.job.ps.ps_mode}")

    def client(self, k: int) -> ShardClient:
        client = ShardClient(k, self.addresses[k],
                             max_message_bytes=self.job.ps.ps_max_message_mb << 20,
                             timeout_s=min(10.0, self.job.ps.ps_timeout_s),
                             token=self.token,
                             tls_cert=self.job.ps.ps_tls_cert,
                             locate=ready_file_locator(self.ready_file(k),
                                                       connect_host(self.job.ps.ps_bind)))
        # the shard's data port from its ready file: control calls go there from the first
        try:
            client.use_data_port(json.loads(self.servers[k].extra["ready"].read_text()))
        except (IndexError, KeyError, OSError, ValueError):
            pass
        return client

    def retire_everywhere(self, worker: int, reason: str) -> None:
        for k in range(len(self.servers)):
            client = self.client(k)
            try:
                client.control("retire", worker=worker, reason=reason)
            except PSError as e:
                self.log(f"ps: could not retire worker {worker} on shard {k}: {e}")
            finally:
                client.close()

    def watch(self) -> None:
        """Until every worker has finished or died; handles deaths as the policy says, and
        ends the run when a worker or shard makes no progress (ps.watchdog)."""
        from ps.watchdog import Progress
        from ps.worker import CONNECT_TIMEOUT_S

        timeout = self.job.ps.ps_timeout_s
        # workers import JAX, compile, then wait up to CONNECT_TIMEOUT_S for each other
        self.progress = Progress(self, timeout, max(timeout, CONNECT_TIMEOUT_S) + timeout)
        done: set[int] = set()
        try:
            while len(done) < len(self.workers):
                for w, child in enumerate(self.workers):
                    if w in done:
                        continue
                    rc = child.poll()
                    if rc is None:
                        continue
                    done.add(w)
                    if rc != 0:
                        self._worker_died(w, child, rc, done)
                for k, child in enumerate(self.servers):
                    rc = child.poll()
                    if rc is not None and len(done) < len(self.workers):
                        self._shard_died(k, child, rc)
                        self.progress.shard_seen[k] = time.monotonic()
                        self.progress.failing[k] = False  # its silence while dead is no pause
                self.progress.probe()
                stalled = self.progress.stalled(done)
                if stalled:
                    what, index, line = stalled
                    if (what == "worker" and self.job.ps.ps_mode == "sync"
                            and self.job.ps.ps_drop_dead_workers):
                        # The run goes on without it: kill it, and the next poll sees a
                        # dead worker, which --ps-drop-dead-workers retires.
                        self.log(f"ps: {line}; killing it (--ps-drop-dead-workers)")
                        procs.stop(self.workers[index], grace_s=0.0)
                        continue
                    raise PSError(f"{line}; stopping every process")
                time.sleep(0.05)
        finally:
            self.progress.close()
        if len(self.dead_workers) == len(self.workers):
            first = self.dead_workers[0]
            raise PSError(f"every worker failed; worker {first['worker']}: {first['error']}")

    def stop_workers(self) -> None:
        """The run was interrupted: each worker stops after its current step and writes what
        it measured (SIGINT, ps.worker.STOP). One that has stopped is retired on every shard,
        so a sync barrier does not wait for it and the others finish their step; one still
        running after --ps-timeout-s is killed (its figures are lost)."""
        running = {w for w, child in enumerate(self.workers) if child.poll() is None}
        for w in running:
            os.kill(self.workers[w].pid, signal.SIGINT)
        deadline = time.monotonic() + self.job.ps.ps_timeout_s
        while running and time.monotonic() < deadline:
            for w in sorted(running):
                if self.workers[w].poll() is not None:
                    running.discard(w)
                    self.retire_everywhere(w, "stopped: the run was interrupted")
            time.sleep(0.05)
        for w in running:
            self.log(f"ps: worker {w} did not stop within {self.job.ps.ps_timeout_s:g} s "
                     f"(--ps-timeout-s); killed, without its figures")
            procs.stop(self.workers[w], grace_s=0.0)

    def _worker_died(self, w: int, child, rc: int, done: set[int] = frozenset()) -> None:
        tail = child.log_tail(3)
        error = tail.splitlines()[-1] if tail else ""
        what = f"worker {w} (pid {child.pid}) exited with {_describe_exit(rc)}"
        self.dead_workers.append({"worker": w, "exit": _describe_exit(rc), "error": error,
                                  "at_unix_s": time.time()})
        mode, drop = self.job.ps.ps_mode, self.job.ps.ps_drop_dead_workers
        from ps.worker import WRITE_FAILED

        if rc == 2:  # a usage error: every worker will hit it
            raise PSError(f"{what}: {error}")
        if rc == WRITE_FAILED:  # its output (a full disk): the path; dropping it would not help
            raise PSError(f"worker {w} (pid {child.pid}) could not write its output: "
                          f"{error.split('error: ', 1)[-1]}; free space there (or give "
                          f"another --logdir) and run again")
        if rc == 3 and getattr(self, "progress", None) is not None:
            # A PS error in a worker is often another process's fault (a frozen worker
            # holding the barrier, a stopped shard): name that one first.
            cause = self.progress.first_cause(w, done)
            if cause:
                raise PSError(f"{cause}; worker {w} failed waiting for it ({error[-200:]})")
        if mode == "sync" and not drop:
            raise PSError(f"{what}; sync mode cannot continue without it "
                          f"(--ps-drop-dead-workers continues with the others). Last log "
                          f"line: {error}")
        self.log(f"ps: {what}; continuing with {len(self.workers) - len(self.dead_workers)} "
                 f"workers ({mode} mode)")
        self.retire_everywhere(w, f"process exited with {_describe_exit(rc)}")

    def _shard_died(self, k: int, child, rc: int) -> None:
        every = self.job.ps.ps_checkpoint_every
        what = (f"shard {k} (pid {child.pid}, {self.addresses[k]}) exited with "
                f"{_describe_exit(rc)}")
        if not every:
            tail = " / ".join(child.log_tail(2).splitlines())
            raise PSError(f"{what}; it cannot be restarted without snapshots "
                          f"(--ps-checkpoint-every N). Log tail: {tail}")
        count = sum(1 for r in self.restarts if r["shard"] == k)
        if count >= MAX_RESTARTS:
            raise PSError(f"{what} after {count} restarts; giving up")
        self.log(f"ps: {what}; restarting it from its last snapshot")
        # On a new port (0: the system's choice, in its ready file, where the workers read
        # it): the old one may be taken by another process by now.
        base = getattr(self.job.ps, "ps_port", 0)
        fresh = self.start_server(k, base + k if base else 0, restore=True)
        self.servers[k] = fresh
        info = self.wait_ready(fresh)
        self.ports[k] = info["port"]
        progress = getattr(self, "progress", None)
        if progress is not None:  # its client of the old shard: one of the new
            old, progress.clients[k] = progress.clients[k], self.client(k)
            old.close()
        self.restarts.append({"shard": k, "exit": _describe_exit(rc), "at_unix_s": time.time(),
                              "epoch": info["epoch"]})

    def stats(self) -> list[dict]:
        out = []
        for k in range(len(self.servers)):
            client = self.client(k)
            try:
                out.append(client.control("stats"))
                client.control("shutdown")
            finally:
                client.close()
        return out
