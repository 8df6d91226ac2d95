"""Chaos test of the parameter server: real shard servers and workers on 127.0.0.1, real
signals, real malformed bytes. Prints one row per fault or input:

    fault or input | expected | observed | parameters intact | seconds to detect | orphans

and exits 0 only when every row holds.

    python scripts/chaos_ps.py            # every mode x {kill -9, SIGSTOP} x {shard, worker}
    python scripts/chaos_ps.py --quick    # one of each kind of fault (tests: under 60 s)

Server rows start `python -m ps.server` processes and talk to them directly (the malformed
corpus, pushes from the future, overflowing gradients, idle streams, wire edge cases). Run
rows start `python -m experiments.run --layout ps` (the launcher with its shards and
workers), wait until every worker is training, send the signal to one child, and check how
the launcher ends: the exit status, the line that names the culprit, the seconds from the
signal to the exit, and that no process of the run is left (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist import procs  # noqa: E402
from ps import wire  # noqa: E402
from ps.client import PSClient  # noqa: E402
from ps.shard_client import PSError, ShardClient  # noqa: E402

FAST_XLA = "--xla_backend_optimization_level=0"
TIMEOUT_S = 3.0          # --ps-timeout-s of every chaos run: the detection deadline
ACCEPTED = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "ABORTED"}
LAUNCHERS: list[subprocess.Popen] = []  # killed (with their groups) however the script ends


def kill_launchers() -> None:
    for proc in LAUNCHERS:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@dataclass
class Row:
    what: str
    expected: str
    observed: str = ""
    intact: str = "n/a"
    detect_s: float | None = None
    orphans: str = "0"
    held: bool = False


def env() -> dict:
    out = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=FAST_XLA, JAX_PLATFORMS="cpu")
    for key in ("JAXDIST_PS_TOKEN", "JAXDIST_PS_FAULT"):
        out.pop(key, None)
    return out


def model_flags(mode: str) -> list[str]:
    """mode: sync, async, ssp, or sync+drop (sync with --ps-drop-dead-workers)."""
    drop = ["--ps-drop-dead-workers"] if mode == "sync+drop" else []
    return ["--model", "mlp-tiny", "--mesh", "2x1", "--ps-mode", mode.split("+")[0],
            "--ps-timeout-s", str(TIMEOUT_S), "--batch-size", "16", "--warmup", "0", *drop]


# -- server rows --------------------------------------------------------------------------

class Server:
    """One `python -m ps.server` (1 shard, 2 workers) and what talks to it."""

    def __init__(self, tmp: Path, mode: str):
        from jaxdist.config import MeshConfig, ModelConfig, PSConfig, RunConfig
        from ps.shardmap import shard_map_for

        self.mode = mode
        self.ready = tmp / f"{mode}.ready.json"
        self.child = procs.start(f"{mode} server", procs.python_argv(
            "ps.server", "--shard", "0", "--of", "1", "--port", "0", "--ready-file",
            str(self.ready), *model_flags(mode)), env(), tmp / f"{mode}.log")
        cfg = RunConfig(mesh=MeshConfig(mesh="2x1"), model=ModelConfig(model="mlp-tiny"),
                        ps=PSConfig(ps_shards=1, ps_mode=mode))
        self.map = shard_map_for(cfg, 1)

    def wait(self) -> None:
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode} server did not start: {self.child.log_tail()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(self.ready.read_text())['port']}"

    def params(self, worker: int = 0, step: int = 0) -> np.ndarray:
        flat = np.empty(self.map.total, np.float32)
        client = self.client(worker)
        try:
            client.pull(step, flat)
        finally:
            client.close()
        return flat

    def client(self, worker: int) -> PSClient:
        return PSClient([self.address], self.map, worker, self.mode,
                        max_message_bytes=64 << 20, timeout_s=TIMEOUT_S)

    def control(self, op: str, **fields) -> dict:
        client = ShardClient(0, self.address, max_message_bytes=64 << 20, timeout_s=TIMEOUT_S)
        try:
            return client.control(op, **fields)
        finally:
            client.close()

    def raw(self):
        channel = grpc.insecure_channel(self.address)
        calls = {m: getattr(channel, kind)(f"/jaxdist.ps.Shard/{m}") for m, kind in
                 (("Push", "stream_unary"), ("Pull", "unary_stream"),
                  ("PushOne", "unary_unary"), ("PullOne", "unary_unary"),
                  ("Control", "unary_unary"))}
        return channel, calls


def code_of(fn) -> str:
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def call(calls, method: str, payload, worker: str = "0") -> str:
    md = (("x-jaxdist-worker", worker),)
    if method == "Push":
        return code_of(lambda: calls[method](iter(payload), timeout=10, metadata=md))
    if method == "Pull":
        return code_of(lambda: list(calls[method](payload, timeout=10, metadata=md)))
    return code_of(lambda: calls[method](payload, timeout=10, metadata=md))


def corpus(smap, rng: random.Random) -> list:
    """(method, payload): malformed pushes, pulls and control calls, each differently."""
    pieces = smap.shard_pieces(0)
    meta = {"worker": 0, "step": 0, "version": 0, "epoch": 0}
    ones = np.ones(smap.total, np.float32)

    def stream(values=ones, **changes):
        return list(wire.frames("push", pieces, values, 2048, dict(meta, **changes)))

    def with_field(key, value):
        frames = stream()
        header, payload = wire.decode(frames[0])
        head = json.dumps(dict(header, **{key: value})).encode()
        frames[0] = b"JDP1" + len(head).to_bytes(4, "little") + head + bytes(payload)
        return frames

    out = [("Push", [rng.randbytes(rng.randrange(0, 300))]), ("Push", stream()[:-1]),
           ("Push", []), ("Push", stream()[::-1]), ("Push", stream() + stream()[:1]),
           ("Push", stream(values=np.full(smap.total, np.nan, np.float32))),
           ("Push", stream(version=99)), ("Push", stream(epoch=5)), ("Push", stream(worker=1)),
           ("Push", [stream()[0][:-3]]), ("Push", stream() + [b""]),
           ("PushOne", b"".join(stream()[:-1])), ("PushOne", rng.randbytes(200)),
           ("Pull", rng.randbytes(100)), ("Pull", wire.encode({"op": "pull", "worker": 0,
                                                               "step": 0, "min_version": 0,
                                                               "epoch": 9})),
           ("PullOne", b""), ("Control", rng.randbytes(50)),
           ("Control", wire.encode({"op": "retire", "worker": 99})),
           ("Control", wire.encode({"op": "format-disk"}))]
    for key, value in (("name", "nope[0:4]"), ("dtype", "float16"), ("shape", [1]),
                       ("offset", 12), ("worker", True), ("step", -1), ("nbytes", 1),
                       ("op", "param")):
        out.append(("Push", with_field(key, value)))
    return out


def huge_int(header: dict, key: str) -> bytes:
    head = json.dumps(header, separators=(",", ":")).replace(
        f'"{key}":0', f'"{key}":' + "1" * 5000).encode()
    return b"JDP1" + len(head).to_bytes(4, "little") + head


def intact(before: np.ndarray, after: np.ndarray) -> str:
    ok = np.array_equal(before, after) and np.isfinite(after).all()
    return "yes" if ok else "NO"


def server_rows(tmp: Path, quick: bool) -> list[Row]:
    servers = {m: Server(tmp, m) for m in ("async", "sync")}
    rows = []
    try:
        for s in servers.values():
            s.wait()
        a, sy = servers["async"], servers["sync"]

        # 1. the malformed corpus
        row = Row("malformed-push corpus", "every message refused (INVALID_ARGUMENT, "
                                           "FAILED_PRECONDITION, ABORTED), server up")
        before = a.params()
        channel, calls = a.raw()
        rng = random.Random(7)
        kinds = corpus(a.map, rng)
        codes = {}
        t0 = time.monotonic()
        for i in range(len(kinds) * (1 if quick else 8)):
            method, payload = kinds[i % len(kinds)]
            code = call(calls, method, payload)
            codes[code] = codes.get(code, 0) + 1
        row.detect_s = (time.monotonic() - t0) / sum(codes.values())
        channel.close()
        row.observed = ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))
        row.intact = intact(before, a.params())
        row.held = set(codes) <= ACCEPTED and a.child.poll() is None and row.intact == "yes"
        rows.append(row)

        # 2. wire edge cases
        row = Row("wire edge cases (5000-digit ints, empty trailing frames)",
                  "INVALID_ARGUMENT each")
        channel, calls = a.raw()
        edge = [("Push", [huge_int({"op": "push", "worker": 0, "step": 0, "nbytes": 0},
                                   "step")]),
                ("Pull", huge_int({"op": "pull", "worker": 0, "step": 0, "min_version": 0,
                                   "epoch": 0, "nbytes": 0}, "step")),
                ("Control", huge_int({"op": "hello", "worker": 0, "nbytes": 0}, "worker")),
                ("Push", [wire.encode({"op": "push"}), b""]),
                ("PushOne", wire.encode({"op": "push"}) + b"JDP1" + bytes(4))]
        before = a.params()
        t0 = time.monotonic()
        got = [call(calls, m, p) for m, p in edge]
        row.detect_s = (time.monotonic() - t0) / len(edge)
        channel.close()
        row.observed = ", ".join(sorted(set(got)))
        row.intact = intact(before, a.params())
        row.held = set(got) == {"INVALID_ARGUMENT"} and row.intact == "yes"
        rows.append(row)

        # 3. a push from the future
        row = Row("push step 10**9 (async)", "FAILED_PRECONDITION; real pushes still apply")
        before = a.params(worker=1)
        shard = ShardClient(0, a.address, max_message_bytes=64 << 20, timeout_s=TIMEOUT_S)
        t0 = time.monotonic()
        try:
            shard.push(a.map.pieces, np.ones(a.map.total, np.float32),
                       {"worker": 1, "step": 10 ** 9, "version": 0, "epoch": 0})
            refused = "accepted"
        except PSError as e:
            refused = "FAILED_PRECONDITION" if "FAILED_PRECONDITION" in str(e) else str(e)
        row.detect_s = time.monotonic() - t0
        shard.close()
        row.intact = intact(before, a.params(worker=1))
        client = a.client(1)
        flat = np.empty(a.map.total, np.float32)
        client.pull(0, flat)
        status = client.push(0, np.full(a.map.total, 0.01, np.float32))[0]["status"]
        client.close()
        row.observed = f"{refused}; next real push {status}"
        row.held = refused == "FAILED_PRECONDITION" and status == "applied" and \
            row.intact == "yes"
        rows.append(row)

        # 4. overflow: sync sum of two finite 3e38 gradients; async 3e38 under adamw
        row = Row("2 x 3e38 gradient (sync)", "step rejected whole, counted; barrier moves on")
        before = sy.params(0, 0)
        huge = np.full(sy.map.total, 3e38, np.float32)
        clients = [sy.client(w) for w in (0, 1)]
        t0 = time.monotonic()
        replies = [None, None]
        pushers = [threading.Thread(target=lambda w=w: replies.__setitem__(
            w, clients[w].push(0, huge)[0]["status"])) for w in (0, 1)]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join(30)
        row.detect_s = time.monotonic() - t0
        stats = sy.control("stats")
        after = np.empty(sy.map.total, np.float32)
        clients[0].pull(1, after)                       # the barrier moved on
        for c in clients:
            c.close()
        row.intact = intact(before, after)
        row.observed = (f"replies {sorted(replies)}, rejected_nonfinite "
                        f"{stats['rejected_nonfinite']}, version {stats['version']}")
        row.held = ("rejected_nonfinite" in replies and stats["rejected_nonfinite"] == 1
                    and stats["version"] == 1 and row.intact == "yes")
        rows.append(row)

        row = Row("3e38 gradient (async, adamw)", "rejected; the next push still trains")
        before = a.params(worker=0)
        client = a.client(0)
        flat = np.empty(a.map.total, np.float32)
        client.pull(0, flat)
        t0 = time.monotonic()
        first = client.push(0, np.full(a.map.total, 3e38, np.float32))[0]["status"]
        row.detect_s = time.monotonic() - t0
        mid = np.empty(a.map.total, np.float32)
        client.pull(1, mid)
        second = client.push(1, np.full(a.map.total, 0.01, np.float32))[0]["status"]
        client.pull(2, flat)
        client.close()
        row.intact = intact(before, mid)
        moved = bool(np.isfinite(flat).all() and not np.array_equal(flat, mid))
        row.observed = f"{first}; then {second}, parameters {'moved' if moved else 'frozen'}"
        row.held = first == "rejected_nonfinite" and second == "applied" and moved and \
            row.intact == "yes"
        rows.append(row)

        # 5. idle streams and parked pulls against a ping
        row = Row("20 idle streams + 20 parked pulls (sync)",
                  "ping < 0.5 s; extra calls RESOURCE_EXHAUSTED; idle ones cancelled")
        channel, calls = sy.raw()
        release = threading.Event()

        def idle():
            release.wait(30)
            yield b""
        streams = [calls["Push"].future(idle(), timeout=30,
                                        metadata=(("x-jaxdist-worker", "0"),))
                   for _ in range(20)]
        nxt = sy.control("stats")["version"] + 1       # parks on the barrier of that step
        pull = wire.encode({"op": "pull", "worker": 1, "step": nxt, "min_version": nxt,
                            "epoch": 0})
        pull_codes = []
        threads = [threading.Thread(target=lambda: pull_codes.append(
            call(calls, "Pull", pull, worker="1"))) for _ in range(20)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 15  # until the 16 extra streams have been refused
        while sum(f.done() for f in streams) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        ping = sy.control("ping")
        row.detect_s = time.monotonic() - t0
        exhausted = sum(1 for f in streams if f.done() and f.exception() is not None and
                        f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        for t in threads:
            t.join(30)
        cancelled = sum(1 for f in streams if f.exception() is not None and
                        f.exception().code() == grpc.StatusCode.CANCELLED)
        release.set()
        channel.close()
        row.observed = (f"ping {row.detect_s * 1e3:.0f} ms; streams refused {exhausted}, "
                        f"cancelled {cancelled}; pulls {sorted(set(pull_codes))}")
        row.intact = "n/a"
        row.held = (ping == {"ok": True} and row.detect_s < 0.5 and exhausted == 16 and
                    cancelled == 4 and "RESOURCE_EXHAUSTED" in pull_codes)
        rows.append(row)
    finally:
        procs.stop_all([s.child for s in servers.values()], grace_s=1.0)
    for row in rows:
        row.orphans = str(len(procs.pids_alive([s.child.pid for s in servers.values()])))
        row.held = row.held and row.orphans == "0"
    return rows


# -- run rows: the launcher, its children, and a signal -----------------------------------

def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return procs.pids_alive(found)


def training(psdir: Path, workers: int = 2, min_step: int = 3) -> bool:
    """Every worker has pushed at least `min_step` (asked of shard 0)."""
    ready = psdir / "shard0.ready.json"
    if not ready.exists():
        return False
    try:
        port = json.loads(ready.read_text())["port"]
    except (OSError, ValueError, KeyError):
        return False
    client = ShardClient(0, f"127.0.0.1:{port}", max_message_bytes=1 << 20, timeout_s=1.0)
    try:
        reply = json.loads(client._control(wire.encode({"op": "progress"}), timeout=1.0))
        return min(reply["seen_step"][:workers]) >= min_step
    except grpc.RpcError:
        return False
    finally:
        client.close()


def run_row(tmp: Path, mode: str, target: str, sig: signal.Signals) -> Row:
    """Start a run, signal `target` ("worker 1" or "shard 0") once training, watch the end."""
    tolerated = target.startswith("worker") and (
        (sig == signal.SIGKILL and mode != "sync") or mode == "sync+drop")
    name = target.replace(" ", "")
    if target == "launcher":
        expected = "launcher exits, every child stopped"
    elif tolerated:
        expected = "exit 0, worker 1 retired"
    else:
        expected = f"exit 1 naming {target}" + (" (stopped)" if sig == signal.SIGSTOP else "")
    verb = {signal.SIGKILL: "kill -9", signal.SIGSTOP: "SIGSTOP"}.get(sig, sig.name)
    row = Row(f"{verb} {target} ({mode})", expected)
    logdir = tmp / f"{mode}-{name}-{sig.name}"
    steps = "300" if tolerated else "100000"
    argv = [sys.executable, "-m", "experiments.run", "--layout", "ps", *model_flags(mode),
            "--ps-shards", "1", "--steps", steps, "--logdir", str(logdir), "--no-progress"]
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    LAUNCHERS.append(launcher)
    pids, victim = [], None
    try:
        deadline = time.monotonic() + 150
        while not training(logdir / "ps"):
            if launcher.poll() is not None or time.monotonic() > deadline:
                out, err = launcher.communicate(timeout=30)
                row.observed = f"run ended before the fault: {err.strip()[-200:]}"
                return row
            time.sleep(0.1)
        pids = json.loads((logdir / "ps" / "pids.json").read_text())
        victim = {"shard 0": pids[0], "worker 1": pids[2],  # pids: shard 0, workers 0, 1
                  "launcher": launcher.pid}[target]
        t0 = time.monotonic()
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            row.observed = f"{target} had already exited: no fault injected"
            return row
        try:
            out, err = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            row.observed = "launcher still running 60 s after the fault"
            return row
        row.detect_s = time.monotonic() - t0
        rc = launcher.returncode
        line = (err.strip().splitlines() or [""])[-1]
        if target == "launcher":
            row.observed = f"exit {rc}"
            row.held = rc != 0
        elif tolerated:
            results = logdir / "results.json"
            r = json.loads(results.read_text()) if results.exists() else {}
            dead = [d["worker"] for d in r.get("ps", {}).get("dead_workers", [])]
            finite = bool(r) and all(np.isfinite(r["loss"]))
            row.observed = f"exit {rc}, dead workers {dead}, {len(r.get('loss', []))} losses"
            row.intact = "yes" if finite else "NO"
            row.held = rc == 0 and dead == [1] and finite
        else:
            row.observed = f"exit {rc}: {line[:110]}"
            row.intact = "n/a (run stopped)"
            named = target in line and (sig != signal.SIGSTOP or "stopped" in line)
            row.held = rc == 1 and named and len(err.strip().splitlines()) >= 1
        return row
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while (procs.pids_alive(pids) or processes_mentioning(str(logdir))) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted(set(procs.pids_alive(pids)) | set(processes_mentioning(str(logdir))))
        for pid in left:  # leave nothing behind, but report it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        row.orphans = str(len(left))
        row.held = row.held and not left


FULL = [(mode, target, sig) for mode in ("sync", "async", "ssp")
        for target in ("worker 1", "shard 0") for sig in (signal.SIGKILL, signal.SIGSTOP)] + [
    ("sync+drop", "worker 1", signal.SIGSTOP), ("sync", "launcher", signal.SIGTERM),
    ("async", "launcher", signal.SIGINT)]
QUICK = [("ssp", "worker 1", signal.SIGSTOP), ("sync", "worker 1", signal.SIGSTOP),
         ("async", "worker 1", signal.SIGKILL), ("sync", "shard 0", signal.SIGSTOP)]


def print_table(rows: list[Row]) -> None:
    head = ("fault or input", "expected", "observed", "params intact", "detect s", "orphans",
            "held")
    cells = [head] + [(r.what, r.expected, r.observed, r.intact,
                       "-" if r.detect_s is None else f"{r.detect_s:.2f}", r.orphans,
                       "yes" if r.held else "NO") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for i, c in enumerate(cells):
        print(" | ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fault of each kind")
    parser.add_argument("--only", choices=("servers", "runs"), default=None)
    parser.add_argument("--jobs", type=int, default=0, help="rows run at once (default: 5 "
                        "with --quick, else 2); each row's own timing does not depend on it")
    args = parser.parse_args(argv)
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()
    jobs = args.jobs or (5 if args.quick else 2)
    with tempfile.TemporaryDirectory(prefix="chaos_ps_") as tmp, procs.TerminationHandlers():
        tasks = []
        if args.only != "runs":
            tasks.append(lambda: server_rows(Path(tmp), args.quick))
        if args.only != "servers":
            for mode, target, sig in (QUICK if args.quick else FULL):
                tasks.append(lambda m=mode, t=target, s=sig: [run_row(Path(tmp), m, t, s)])
        # Faults are waits (deadlines, grace periods), so rows overlap well even on 2 cores.
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            try:
                rows = [row for part in pool.map(lambda task: task(), tasks) for row in part]
            finally:
                kill_launchers()
                procs.stop_all(grace_s=1.0)
    print_table(rows)
    held = sum(r.held for r in rows)
    print(f"\n{held}/{len(rows)} rows held in {time.monotonic() - start:.1f} s")
    return 0 if held == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
