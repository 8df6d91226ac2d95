"""The server rows of scripts/chaos_ps.py: one `python -m ps.server` (1 shard, 2 workers)
driven directly with the malformed-push corpus, pushes from the future, overflowing
gradients, idle streams and wire edge cases; each row says what was expected, what was
observed and whether the shard's parameters stayed intact. Also the row type and the run
flags the run rows share."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from jaxdist import procs
from ps import wire
from ps.client import PSClient
from ps.shard_client import PSError, ShardClient

ROOT = Path(__file__).resolve().parent.parent
FAST_XLA = "--xla_backend_optimization_level=0"
TIMEOUT_S = 3.0          # --ps-timeout-s of every chaos run: the detection deadline
ACCEPTED = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "ABORTED"}


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
        from jaxdist.job import for_process
        from ps.shardmap import shard_map_for

        self.mode = mode
        self.ready = tmp / f"{mode}.ready.json"
        self.child = procs.start(f"{mode} server", procs.python_argv(
            "ps.server", "--shard", "0", "--of", "1", "--port", "0", "--ready-file",
            str(self.ready), *model_flags(mode)), env(), tmp / f"{mode}.log")
        cfg = RunConfig(mesh=MeshConfig(mesh="2x1"), model=ModelConfig(model="mlp-tiny"),
                        ps=PSConfig(ps_shards=1, ps_mode=mode))
        self.map = shard_map_for(for_process(cfg), 1)

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


def closes(port: int, blob: bytes) -> bool:
    """Whether the data port ends a connection that sent `blob` (after at most a reply)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(blob)
        sock.shutdown(socket.SHUT_WR)  # a message cut short: the peer stops sending
        try:
            while sock.recv(65536):
                pass
        except socket.timeout:
            return False
    return True


def data_port_row(a) -> Row:
    """The corpus as one-message calls over the data port (ps.tcp), and bytes that are not
    its messages: a wrong magic, a payload past the limit, metadata that is not JSON, a
    request cut off midway."""
    from ps.tcp import _HEAD, MAGIC, PULL_ONE, PUSH_ONE, DataChannel
    row = Row("data port (TCP): corpus + raw bytes", "corpus refused as over gRPC; bad "
                                                     "bytes end the connection; server up")
    before = a.params()
    port = a.control("info")["data_port"]
    channel = DataChannel("127.0.0.1", lambda: port)
    md = (("x-jaxdist-worker", "0"),)
    codes, t0, n = {}, time.monotonic(), 0
    for method, payload in corpus(a.map, random.Random(7)):
        if method == "Control" or (isinstance(payload, list) and b"" in payload):
            continue  # joined, an empty trailing frame vanishes: that push would be valid
        fn = channel.method(PULL_ONE if method.startswith("Pull") else PUSH_ONE)
        message = b"".join(payload) if isinstance(payload, list) else payload
        code = code_of(lambda: fn(message, timeout=10, metadata=md))
        codes[code] = codes.get(code, 0) + 1
        n += 1
    channel.close()
    blobs = [b"GET / HTTP/1.1\r\n\r\n", _HEAD.pack(MAGIC, PUSH_ONE, 2, 1 << 60) + b"[]",
             _HEAD.pack(MAGIC, PUSH_ONE, 5, 10) + b"nope!",
             _HEAD.pack(MAGIC, PUSH_ONE, 2, 1 << 20) + b"[]" + bytes(1000)]
    closed = sum(closes(port, blob) for blob in blobs)
    row.detect_s = (time.monotonic() - t0) / (n + len(blobs))
    row.observed = (", ".join(f"{k} {v}" for k, v in sorted(codes.items())) +
                    f"; {closed} of {len(blobs)} raw connections ended")
    row.intact = intact(before, a.params())
    row.held = (set(codes) <= ACCEPTED and closed == len(blobs) and a.child.poll() is None
                and row.intact == "yes")
    return row


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

        rows.append(data_port_row(a))

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
