"""`--layout ps` in one command: start K shard servers and W workers on 127.0.0.1, watch
them, tear everything down, and write the same results.json and TensorBoard events as the
other layouts, plus a `ps` block.

This process only launches and collects: it never starts a JAX backend (it reads shapes
through eval_shape), so it holds no device. Servers and workers are separate entry points
(`python -m ps.server`, `python -m ps.worker`) so a scheduler can place them instead; then
`python -m ps.driver --collect-only ...` assembles the results (see docs/ps.md).

Failure policy:
- a worker dies: async and ssp go on without it (it is retired on every shard so the ssp
  bound stops waiting for it) and results report it; sync stops with an error naming it,
  unless --ps-drop-dead-workers, where the shards drop it and go on.
- a shard dies: with --ps-checkpoint-every N it is restarted on the same port from its last
  snapshot and the workers carry on (their calls retry for --ps-timeout-s); without, the run
  stops at once with an error naming the shard.
- whatever happens, every child process is stopped (ps.procs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from jaxdist.errors import UsageError
from ps import procs
from ps.client import PSError, ShardClient
from ps.cli import config_argv
from jaxdist.results import write_json

ROOT = Path(__file__).resolve().parent.parent
MAX_RESTARTS = 3
READY_TIMEOUT_S = 120.0


# -- validation ---------------------------------------------------------------------------

def validate_ps(cfg, shape) -> None:
    """Every PS option check that needs no process; UsageError before any run dir exists."""
    from ps.server import TOKEN_ENV, security_problems
    from ps.shardmap import shard_map_for

    ps = cfg.ps
    if ps.ps_shards < 1:
        raise UsageError(f"--ps-shards must be 1 or more, got {ps.ps_shards}")
    if ps.staleness < 0:
        raise UsageError(f"--staleness must be 0 or more, got {ps.staleness}")
    if not ps.ps_timeout_s > 0:
        raise UsageError(f"--ps-timeout-s must be positive, got {ps.ps_timeout_s}")
    if ps.ps_checkpoint_every < 0:
        raise UsageError(f"--ps-checkpoint-every must be 0 or more, got "
                         f"{ps.ps_checkpoint_every}")
    if not 1 <= ps.ps_max_message_mb <= 2047:
        raise UsageError(f"--ps-max-message-mb must be within 1..2047 (gRPC's limit is a "
                         f"32-bit size), got {ps.ps_max_message_mb}")
    unsupported = [(cfg.train.microbatches > 1, "--microbatches"),
                   (bool(cfg.checkpoint.checkpoint_dir), "--checkpoint-dir (use "
                                                         "--ps-checkpoint-every)"),
                   (cfg.dist.num_processes > 1, "--num-processes (the launcher starts "
                                                "one process per worker and shard)"),
                   (bool(cfg.output.profile_steps), "--profile-steps")]
    for bad, flag in unsupported:
        if bad:
            raise UsageError(f"--layout ps does not support {flag}")
    if ps.ps_staleness_lr and ps.ps_mode == "sync":
        raise UsageError("--ps-staleness-lr applies to --ps-mode async or ssp; in sync mode "
                         "every update has staleness 0")
    problem = security_problems(ps.ps_bind, os.environ.get(TOKEN_ENV), ps.ps_tls_cert,
                                ps.ps_tls_key)
    if problem:
        raise UsageError(problem)
    if not procs.port_free(ps.ps_bind, 0):
        raise UsageError(f"--ps-bind {ps.ps_bind} is not an address of this host")
    base = getattr(ps, "ps_port", 0)  # optional field: fixed ports base, base+1, ...
    if base:
        busy = [base + k for k in range(ps.ps_shards) if not procs.port_free(ps.ps_bind,
                                                                              base + k)]
        if busy:
            raise UsageError(f"port(s) {', '.join(map(str, busy))} on {ps.ps_bind} are in "
                             f"use; choose another --ps-port or 0 for free ports")
    shard_map_for(cfg)  # too many shards, non-float32 parameters


# -- launching ----------------------------------------------------------------------------

def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # A worker sets its own CPU device count; an inherited forced count would override it.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _worker_env(cfg, worker: int, devices: int, num_workers: int) -> dict:
    """On a GPU node, worker w sees GPUs [w*D, (w+1)*D); otherwise it simulates D CPU
    devices (never all of a GPU node's GPUs at once)."""
    gpus = _gpu_count()
    if cfg.mesh.platform == "auto" and gpus >= devices * num_workers:
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


def _connect_host(bind: str) -> str:
    if bind in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind == "::":
        return "[::1]"
    return f"[{bind}]" if ":" in bind else bind


class Launch:
    """The children of one run and what happened to them."""

    def __init__(self, cfg, shape, psdir: Path, log):
        self.cfg, self.shape, self.psdir, self.log = cfg, shape, psdir, log
        self.argv = config_argv(cfg)
        self.servers: list[procs.Child] = []
        self.workers: list[procs.Child] = []
        self.ports: list[int] = []
        self.restarts: list[dict] = []
        self.dead_workers: list[dict] = []
        self.all_pids: list[int] = []

    @property
    def children(self):
        return self.servers + self.workers

    @property
    def addresses(self) -> list[str]:
        host = _connect_host(self.cfg.ps.ps_bind)
        return [f"{host}:{p}" for p in self.ports]

    def _record_pid(self, child):
        self.all_pids.append(child.pid)
        write_json(self.psdir / "pids.json", self.all_pids)

    def start_server(self, k: int, port: int = 0, restore: bool = False) -> procs.Child:
        ready = self.psdir / f"shard{k}.ready.json"
        ready.unlink(missing_ok=True)
        snapshots = (["--snapshot-dir", str(self.psdir / "snapshots" / f"shard{k}")]
                     if self.cfg.ps.ps_checkpoint_every else [])
        args = ["--shard", str(k), "--of", str(self.cfg.ps.ps_shards), "--port", str(port),
                "--ready-file", str(ready), *snapshots, *(["--restore"] if restore else []),
                *self.argv]
        child = procs.start(f"shard {k}", procs.python_argv("ps.server", *args),
                            _child_env({"JAX_PLATFORMS": "cpu"}), self.psdir / f"shard{k}.log")
        child.extra["ready"] = ready
        self._record_pid(child)
        return child

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
        """Start the shards on ports chosen now, so workers can start (import JAX, compile)
        at the same time instead of after the shards are ready."""
        base = getattr(self.cfg.ps, "ps_port", 0)
        k_count = self.cfg.ps.ps_shards
        self.ports = ([base + k for k in range(k_count)] if base else
                      procs.free_ports(self.cfg.ps.ps_bind, k_count))
        self.servers = [self.start_server(k, self.ports[k]) for k in range(k_count)]

    def wait_servers(self) -> None:
        for child in self.servers:
            self.wait_ready(child)
        self.log(f"ps: {len(self.servers)} shard servers up at {', '.join(self.addresses)} "
                 f"(logs in {self.psdir})")

    def start_workers(self) -> None:
        w_count, devices = self.shape.data, self.shape.fsdp
        servers = ",".join(self.addresses)
        for w in range(w_count):
            args = ["--worker", str(w), "--servers", servers, "--out", str(self.psdir),
                    *self.argv]
            child = procs.start(f"worker {w}", procs.python_argv("ps.worker", *args),
                                _child_env(_worker_env(self.cfg, w, devices, w_count)),
                                self.psdir / f"worker{w}.log")
            self.workers.append(child)
            self._record_pid(child)
        self.log(f"ps: {w_count} workers x {devices} device(s) started, mode "
                 f"{self.cfg.ps.ps_mode}")

    def client(self, k: int) -> ShardClient:
        return ShardClient(k, self.addresses[k],
                           max_message_bytes=self.cfg.ps.ps_max_message_mb << 20,
                           timeout_s=min(10.0, self.cfg.ps.ps_timeout_s),
                           token=os.environ.get("JAXDIST_PS_TOKEN", ""),
                           tls_cert=self.cfg.ps.ps_tls_cert)

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

        timeout = self.cfg.ps.ps_timeout_s
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
                self.progress.probe()
                stalled = self.progress.stalled(done)
                if stalled:
                    what, index, line = stalled
                    if (what == "worker" and self.cfg.ps.ps_mode == "sync"
                            and self.cfg.ps.ps_drop_dead_workers):
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

    def _worker_died(self, w: int, child, rc: int, done: set[int] = frozenset()) -> None:
        tail = child.log_tail(3)
        error = tail.splitlines()[-1] if tail else ""
        what = f"worker {w} (pid {child.pid}) exited with {_describe_exit(rc)}"
        self.dead_workers.append({"worker": w, "exit": _describe_exit(rc), "error": error,
                                  "at_unix_s": time.time()})
        mode, drop = self.cfg.ps.ps_mode, self.cfg.ps.ps_drop_dead_workers
        if rc == 2:  # a usage error: every worker will hit it
            raise PSError(f"{what}: {error}")
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
        every = self.cfg.ps.ps_checkpoint_every
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
        fresh = self.start_server(k, self.ports[k], restore=True)
        self.servers[k] = fresh
        info = self.wait_ready(fresh)
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


def run_ps(cfg, shape, logdir: Path, log=print) -> dict:
    from ps.shardmap import shard_map_for

    psdir = Path(logdir) / "ps"
    psdir.mkdir(parents=True, exist_ok=True)
    shard_map = shard_map_for(cfg)
    (psdir / "shard_map.json").write_text(json.dumps(shard_map.to_dict(), indent=1))
    log(f"ps: {shard_map.describe()}")
    if cfg.mesh.platform == "cpu" or _gpu_count() < shape.size:
        log(f"No accelerator in use: each of the {shape.data} workers simulates "
            f"{shape.fsdp} host CPU device(s). Step times are functional, not performance "
            f"figures.")
    launch = Launch(cfg, shape, psdir, log)
    with procs.TerminationHandlers():
        try:
            launch.start_servers()
            launch.start_workers()
            launch.wait_servers()
            launch.watch()
            stats = launch.stats()
        finally:
            procs.stop_all(launch.children)
    results = collect(cfg, shape, logdir, stats, shard_map, launch)
    log(format_ps(results))
    return results


def format_ps(results: dict) -> str:
    """The PS lines printed before the common summary table."""
    ps = results["ps"]
    ms = lambda block: f"{block['p50'] * 1e3:.2f} / {block['p99'] * 1e3:.2f} ms" if block \
        else "n/a"  # noqa: E731
    up = ps["updates"]
    rows = [
        ("ps mode", f"{ps['mode']}" + (f" (bound {ps['staleness_bound']})"
                                       if ps["staleness_bound"] is not None else "")
         + f", {ps['workers']} workers x {ps['devices_per_worker']} device(s), "
           f"{ps['shards']} shards"),
        ("push / pull p50 / p99", f"{ms(ps['push_latency_s'])}; {ms(ps['pull_latency_s'])}"),
        ("bytes per step", f"push {ps['bytes_per_step']['push'] / 2**20:.2f} MiB, "
                           f"pull {ps['bytes_per_step']['pull'] / 2**20:.2f} MiB"),
        ("waits", f"barrier {ps['wait_s']['barrier']:.2f} s, bound "
                  f"{ps['wait_s']['bound']:.2f} s (all shards)"),
        ("staleness max / mean", f"{ps['staleness']['max']} / "
                                 f"{(ps['staleness']['mean'] or 0):.2f} versions"),
        ("updates", f"{up['applied']} applied, {up['rejected']} rejected, "
                    f"{up['deduplicated']} deduplicated (over all shards)"),
    ]
    if ps["dead_workers"]:
        rows.append(("dead workers", ", ".join(str(d["worker"]) for d in ps["dead_workers"])))
    if ps["shard_restarts"]:
        rows.append(("shard restarts", ", ".join(str(r["shard"]) for r in ps["shard_restarts"])))
    width = max(len(name) for name, _ in rows)
    return "\n" + "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


# -- results ------------------------------------------------------------------------------

def _brief(values) -> dict | None:
    import numpy as np

    if not len(values):
        return None
    a = np.asarray(values, np.float64)
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def _hist_summary(hist: dict) -> dict:
    total = sum(hist.values())
    return {"histogram": hist, "count": total,
            "max": max((int(k) for k in hist), default=None),
            "mean": (sum(int(k) * v for k, v in hist.items()) / total) if total else None}


def _breakdown(ref: dict, stats: list[dict], warmup: int, steps: int, workers: int) -> dict:
    """Where a step's time goes. `worker`: means over the timed steps of the reference
    worker's phases (pull = until its parameters were in; in sync that pull overlaps the
    previous push, so it is ~0; push = push, plus in sync the next pull, including the
    barrier). `server`: per step, the slowest shard's CPU time decoding pushes, optimizer
    apply, and encoding pulls (all workers), and the mean barrier/bound wait of one pull."""
    import numpy as np

    def mean(values):
        values = values[warmup:]
        return float(np.mean(values)) if len(values) else None

    phases = ref.get("phases_s", {})
    pulls = max(1, steps * workers * len(stats))
    return {
        "worker": {"step": mean(ref["step_s"]), "pull": mean(phases.get("pull_s", [])),
                   "compute": mean(ref["compute_s"]),
                   "push": mean(phases.get("push_s", [])),
                   "batch_overlapped": mean(phases.get("batch_s", []))},
        "server": {"decode": max(s.get("decode_s", 0.0) for s in stats) / max(1, steps),
                   "apply": max(s.get("apply_s", 0.0) for s in stats) / max(1, steps),
                   "encode": max(s.get("encode_s", 0.0) for s in stats) / max(1, steps),
                   "wait_per_pull": sum(s["wait_s"]["barrier"] + s["wait_s"]["bound"]
                                        for s in stats) / pulls},
    }


def collect(cfg, shape, logdir: Path, stats: list[dict], shard_map, launch=None) -> dict:
    """Worker files + shard stats -> results.json and TensorBoard events (RunWriter)."""
    from jax.sharding import PartitionSpec as P
    import jax

    from jaxdist import metrics
    from jaxdist.results import SCHEMA_VERSION
    from jaxdist.writers import RunWriter
    from ps.shardmap import abstract_model

    psdir = Path(logdir) / "ps"
    num_workers, devices = shape.data, shape.fsdp
    workers = {}
    for w in range(num_workers):
        path = psdir / f"worker{w}.json"
        if path.exists():
            workers[w] = json.loads(path.read_text())
    if not workers:
        raise PSError(f"no worker wrote results into {psdir}")
    dead = list(launch.dead_workers) if launch else [
        {"worker": w, "exit": "unknown", "error": f"no {psdir / f'worker{w}.json'}",
         "at_unix_s": None} for w in range(num_workers) if w not in workers]
    ref_w = min(workers)  # worker 0 unless it died
    ref = workers[ref_w]
    warmup, total = cfg.loop.warmup, cfg.loop.warmup + cfg.loop.steps
    losses = []
    for t in range(total):
        values = [r["losses"][t] for r in workers.values() if len(r["losses"]) > t]
        losses.append(sum(values) / len(values))
    timed = ref["step_s"][warmup:]
    steps = metrics.latency_stats(timed)
    model_cfg, _, abstract_params, abstract_ms = abstract_model(cfg)
    batch = cfg.train.batch_size
    tokens = model_cfg.tokens_per_sample
    env = dict(ref["env"], num_devices=num_workers * devices, num_processes=num_workers)
    abstract = {"params": abstract_params, "model_state": abstract_ms}
    specs = jax.tree.map(lambda _: P(), abstract)
    push_s = [s for r in workers.values() for s in r["push_s"]]
    pull_s = [s for r in workers.values() for s in r["pull_s"]]
    steps_done = max(1, max(r["steps_done"] for r in workers.values()))
    staleness = {}
    step_staleness = {}
    for s in stats:
        for key, hist in (("staleness_hist", staleness), ("step_staleness_hist",
                                                           step_staleness)):
            for k, v in s[key].items():
                hist[k] = hist.get(k, 0) + v
    order = lambda h: dict(sorted(h.items(), key=lambda kv: int(kv[0])))  # noqa: E731
    per_shard = [{"shard": s["shard"], "applied": s["applied"], "rejected": s["rejected"],
                  "deduplicated": s["deduplicated"], "applies": s["applies"],
                  "rejected_nonfinite": s.get("rejected_nonfinite", 0),
                  "clipped": s.get("clipped", 0),
                  "version": s["version"], "epoch": s["epoch"], "snapshots": s["snapshots"],
                  "retired_workers": s["retired"], "events": s["events"]} for s in stats]
    scales = [s["lr_scale_mean"] for s in stats if s["lr_scale_mean"] is not None]
    ps_block = {
        "mode": cfg.ps.ps_mode, "workers": num_workers, "devices_per_worker": devices,
        "shards": cfg.ps.ps_shards,
        "staleness_bound": cfg.ps.staleness if cfg.ps.ps_mode == "ssp" else None,
        "staleness_lr": cfg.ps.ps_staleness_lr,
        "step_time_definition": f"wall time of one loop iteration (pull + gradient + push) "
                                f"of worker {ref_w}; other workers in step_time_s_per_worker",
        "step_time_s_per_worker": [metrics.latency_stats(workers[w]["step_s"][warmup:])
                                   if w in workers and len(workers[w]["step_s"]) > warmup
                                   else None for w in range(num_workers)],
        "compute_s_per_worker": [_brief(workers[w]["compute_s"][warmup:]) if w in workers
                                 else None for w in range(num_workers)],
        "shard_map": {"fingerprint": shard_map.fingerprint, "chunk_elems": shard_map.chunk_elems,
                      "pieces": len(shard_map.pieces),
                      "bytes_per_shard": shard_map.bytes_per_shard,
                      "file": str(psdir / "shard_map.json")},
        "push_latency_s": _brief(push_s),
        "pull_latency_s": _brief(pull_s),
        "bytes_per_step": {
            "push": sum(r["push_bytes"] for r in workers.values()) / steps_done,
            "pull": sum(r["pull_bytes"] for r in workers.values()) / steps_done},
        "wait_s": {"barrier": sum(s["wait_s"]["barrier"] for s in stats),
                   "bound": sum(s["wait_s"]["bound"] for s in stats),
                   "per_worker": [sum(workers[w]["pull_wait_s"]) if w in workers else None
                                  for w in range(num_workers)]},
        "staleness": dict(_hist_summary(order(staleness)),
                          per_shard=[s["staleness_hist"] for s in stats]),
        "step_staleness": _hist_summary(order(step_staleness)),
        "lr_scale": {"mean": sum(scales) / len(scales) if scales else None,
                     "min": min((s["lr_scale_min"] for s in stats), default=None)},
        "updates": {"applied": sum(s["applied"] for s in stats),
                    "rejected": sum(s["rejected"] for s in stats),
                    "deduplicated": sum(s["deduplicated"] for s in stats),
                    "rejected_nonfinite": sum(s.get("rejected_nonfinite", 0) for s in stats),
                    "per_shard": per_shard},
        "server_bytes_per_shard": [{"shard": s["shard"], "params_bytes": s["params_bytes"],
                                    "opt_bytes": s["opt_bytes"],
                                    "total_bytes": s["params_bytes"] + s["opt_bytes"]}
                                   for s in stats],
        "time_breakdown_s": _breakdown(ref, stats, warmup, steps_done, num_workers),
        "dead_workers": dead,
        "shard_restarts": launch.restarts if launch else [],
        "restarts_seen_by_workers": sum(r["restarts_seen"] for r in workers.values()),
        "pids": launch.all_pids if launch else [],
    }
    memory = dict(ref["memory"])
    memory["servers_note"] = ("state_bytes_per_device counts a worker's replicated parameters "
                              "(+ model state); parameters and optimizer state live on the "
                              "shard servers: ps.server_bytes_per_shard")
    results = {
        "schema_version": SCHEMA_VERSION,
        "framework": "jax",
        "layout": "ps",
        "mesh": {"workers": num_workers, "devices_per_worker": devices},
        "model": {"name": cfg.model.model, "params": shard_map.total,
                  "flops_per_sample": model_cfg.flops_per_sample(),
                  "tokens_per_sample": tokens},
        "config": cfg.to_dict(),
        "env": env,
        "compile_s": ref["compile_s"],
        "step_time_s": steps,
        "warmup_step_time_s": ref["step_s"][:warmup],
        "throughput": {"samples_per_s": batch / steps["mean"],
                       "tokens_per_s": batch * tokens / steps["mean"] if tokens else None},
        "mfu": metrics.mfu(env["device_kind"], cfg.model.dtype, num_workers * devices,
                           steps["mean"], ref["compiled_flops"],
                           model_cfg.flops_per_sample() * batch),
        "memory": memory,
        "sharding": metrics.sharding_summary(abstract, specs),
        "loss": losses,
        "power": {"available": False, "reason": "power telemetry is not implemented yet"},
        "window": ref["window"],
        "accuracy": ref["accuracy"],
        "ps": ps_block,
    }
    writer = RunWriter(Path(logdir), cfg.to_dict())
    try:
        for t, loss in enumerate(losses):
            step_s = ref["step_s"][t] if t < len(ref["step_s"]) else 0.0
            writer.step(t, loss, step_s, t >= warmup)
            for w, r in workers.items():
                if t < len(r["step_s"]):
                    writer.scalar(f"ps/worker{w}/step_time_s", r["step_s"][t], t)
        for point in ref["accuracy"]:
            writer.scalar("eval/accuracy", point["accuracy"], point["step"])
        for name, block in (("push_latency", ps_block["push_latency_s"]),
                            ("pull_latency", ps_block["pull_latency_s"])):
            if block:
                writer.scalar(f"ps/{name}_p50_s", block["p50"], 0)
                writer.scalar(f"ps/{name}_p99_s", block["p99"], 0)
        for k, v in ps_block["staleness"]["histogram"].items():
            writer.scalar("ps/staleness_count", v, int(k))
        writer.scalar("ps/bytes_per_step", ps_block["bytes_per_step"]["push"]
                      + ps_block["bytes_per_step"]["pull"], 0)
        writer.summary(results)
    finally:
        writer.close()
    return results


# -- cluster use: collect results after scheduler-launched servers and workers ------------

def main(argv=None) -> int:
    """`python -m ps.driver --collect-only --servers H:P,... --logdir RUN <run flags>`:
    after workers started by a scheduler have written RUN/ps/worker<w>.json, fetch the
    shards' statistics, shut the shards down and write results.json + TensorBoard."""
    from jaxdist.config import add_arguments, from_namespace
    from jaxdist.mesh import parse_mesh
    from ps.cli import OneLineParser
    from ps.shardmap import shard_map_for

    parser = OneLineParser(prog="python -m ps.driver")
    parser.add_argument("--collect-only", action="store_true", required=True)
    parser.add_argument("--servers", required=True)
    parser.add_argument("--keep-servers", action="store_true",
                        help="do not shut the shard servers down")
    add_arguments(parser)
    args = parser.parse_args(argv)
    cfg = from_namespace(args)
    try:
        if not cfg.output.logdir:
            raise UsageError("--collect-only needs --logdir (where the workers wrote ps/)")
        shape = parse_mesh(cfg.mesh.mesh)
        shard_map = shard_map_for(cfg)
    except UsageError as e:
        print(f"ps.driver: error: {e}", file=sys.stderr)
        return 2
    stats = []
    for k, address in enumerate(args.servers.split(",")):
        client = ShardClient(k, address.strip(),
                             max_message_bytes=cfg.ps.ps_max_message_mb << 20,
                             timeout_s=cfg.ps.ps_timeout_s,
                             token=os.environ.get("JAXDIST_PS_TOKEN", ""),
                             tls_cert=cfg.ps.ps_tls_cert)
        stats.append(client.control("stats"))
        if not args.keep_servers:
            client.control("shutdown")
        client.close()
    collect(cfg, shape, Path(cfg.output.logdir), stats, shard_map)
    print(f"results: {Path(cfg.output.logdir) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
