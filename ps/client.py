"""Worker side of the wire: push gradients to and pull parameters from K shards in parallel.

Failure policy, so a worker never hangs:
- UNAVAILABLE (shard down, restarting, not up yet) is retried with backoff until
  --ps-timeout-s has passed since the first failure, then a PSError names the shard.
- A retried push carries the same (worker, step), so the shard deduplicates it if the first
  attempt had in fact arrived.
- A shard restarted from a snapshot answers a pull with "restarted": the client re-pushes
  its last gradient (the restored shard may have lost it) and pulls again.
- Every call has a gRPC deadline; a server-side wait (sync barrier, ssp bound) ends before it
  with an error that says what it waited for.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from ps import wire
from ps.admission import WORKER_KEY

SERVICE = "/jaxdist.ps.Shard/"
TOKEN_KEY = "x-jaxdist-token"
FAULT_KEY = "x-jaxdist-fault"
UNARY_MAX_FRAMES = 4  # see ShardClient.small


class PSError(RuntimeError):
    """A PS call failed for good; the message names the shard and the reason."""


class Restarted(Exception):
    pass


def channel_options(max_message_bytes: int) -> list:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_http_proxy", 0),       # never route 127.0.0.1 through a proxy
            ("grpc.initial_reconnect_backoff_ms", 100),  # a restarted shard is found fast
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]


def make_channel(address: str, max_message_bytes: int, tls_cert: str = ""):
    options = channel_options(max_message_bytes)
    if tls_cert:
        with open(tls_cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(address, creds, options)
    return grpc.insecure_channel(address, options)


def _fault(error: grpc.RpcError) -> str | None:
    try:
        for key, value in error.trailing_metadata() or ():
            if key == FAULT_KEY:
                return value
    except Exception:  # a transport failure may carry no metadata at all
        pass
    return None


class ShardClient:
    """One shard: raw calls with retry on UNAVAILABLE."""

    def __init__(self, shard: int, address: str, *, max_message_bytes: int, timeout_s: float,
                 token: str = "", tls_cert: str = ""):
        self.shard, self.address, self.timeout_s = shard, address, timeout_s
        self.channel = make_channel(address, max_message_bytes, tls_cert)
        self.frame_bytes = wire.frame_bytes(max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self.metadata = ((TOKEN_KEY, token),) if token else None
        self._push = self.channel.stream_unary(SERVICE + "Push")
        self._pull = self.channel.unary_stream(SERVICE + "Pull")
        self._control = self.channel.unary_unary(SERVICE + "Control")
        self._push_one = self.channel.unary_unary(SERVICE + "PushOne")
        self._pull_one = self.channel.unary_unary(SERVICE + "PullOne")
        self._push_pull_one = self.channel.unary_unary(SERVICE + "PushPullOne")

    def close(self) -> None:
        self.channel.close()

    def _retry(self, what: str, fn, rpc_timeout: float):
        first_failure = None
        delay = 0.05
        while True:
            try:
                return fn(rpc_timeout)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if _fault(e) == "restarted":
                    raise Restarted(e.details()) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    now = time.monotonic()
                    first_failure = first_failure or now
                    if now - first_failure < self.timeout_s:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.5)
                        continue
                    raise PSError(f"shard {self.shard} at {self.address} unreachable for "
                                  f"{self.timeout_s:g} s during {what}: {e.details()}") from None
                name = code.name if code else "ERROR"
                raise PSError(f"shard {self.shard} at {self.address}: {what} failed: "
                              f"{name}: {e.details()}") from None

    def _data_metadata(self, worker: int) -> tuple:
        """Data calls name their worker: the shard caps open calls per worker."""
        return (*(self.metadata or ()), (WORKER_KEY, str(worker)))

    def control(self, op: str, **fields) -> dict:
        request = wire.encode({"op": op, **fields})
        reply = self._retry(op, lambda t: self._control(request, timeout=t,
                                                        metadata=self.metadata), 10.0)
        return json.loads(reply)

    def small(self, pieces) -> bool:
        """Whether these pieces go as one message of up to UNARY_MAX_FRAMES frames: then a
        push or pull is one unary call started without a thread (a gRPC client stream
        costs a thread per call and ~1 ms; measured on `mlp`, 1.35 MB per shard: a sync
        step of 25 ms instead of 35). Larger transfers stream (a 15 MB unary push took
        2-3x a stream's time)."""
        limit = min(UNARY_MAX_FRAMES * self.frame_bytes, self.max_message_bytes - 65536)
        return sum(p.length * 4 + 256 for p in pieces) <= limit

    def start_push(self, pieces, source, meta: dict, source_offset=None):
        """Start a push; returns `finish() -> (reply, bytes sent)`. Small pushes are in
        flight on return; large ones stream inside `finish` (run it in a thread)."""
        what = f"push of step {meta['step']}"
        frames = lambda: wire.frames("push", pieces, source, self.frame_bytes, meta,  # noqa
                                     source_offset)
        timeout = self.timeout_s + 5
        md = self._data_metadata(meta["worker"])
        if self.small(pieces):
            bundle = wire.bundle("push", pieces, source, self.frame_bytes, meta, source_offset)
            first = [self._push_one.future(bundle, timeout=timeout, metadata=md)]

            def call(t):
                if first:
                    return first.pop().result()
                return self._push_one(bundle, timeout=t, metadata=md)
            return lambda: (json.loads(self._retry(what, call, timeout)), len(bundle))

        sent = [0]

        def stream_call(t):
            def stream():
                for frame in frames():
                    sent[0] += len(frame)
                    yield frame
            sent[0] = 0
            return self._push(stream(), timeout=t, metadata=md)
        return lambda: (json.loads(self._retry(what, stream_call, timeout)), sent[0])

    def start_push_pull(self, pieces, source, meta: dict, layout: dict, dest: np.ndarray):
        """Sync, a transfer small enough for one message: push step t and pull step t+1
        in one call (PushPullOne). Returns `finish() -> (push reply, bytes sent, pull meta,
        bytes received)`; raises Restarted like a pull does."""
        what = f"push and pull of step {meta['step']}"
        bundle = wire.bundle("push", pieces, source, self.frame_bytes, meta)
        md = self._data_metadata(meta["worker"])
        timeout = self.timeout_s + 5
        first = [self._push_pull_one.future(bundle, timeout=timeout, metadata=md)]

        def call(t):
            message = (first.pop().result() if first else
                       self._push_pull_one(bundle, timeout=t, metadata=md))
            head, rest = wire.split_first(message)
            if head.get("op") != "reply":
                raise wire.WireError("reply frame missing")
            asm = wire.Assembler("param", layout, dest, fixed=("version", "epoch", "waited_us"))
            asm.add(rest)
            return head, len(bundle), asm.finish(), asm.bytes

        def finish():
            try:
                return self._retry(what, call, timeout)
            except wire.WireError as e:
                raise PSError(f"shard {self.shard} at {self.address} sent a malformed "
                              f"reply: {e}") from None
        return finish

    def push(self, pieces, source, meta: dict, source_offset=None) -> tuple[dict, int]:
        """(reply, bytes sent). `meta` holds worker, step, version, epoch."""
        return self.start_push(pieces, source, meta, source_offset)()

    def start_pull(self, request: dict, pieces, layout: dict, dest: np.ndarray):
        """Start a pull into `dest` at the layout's offsets; returns `finish() -> (stream meta
        with version/epoch/waited_us, bytes received)`."""
        frame = wire.encode({"op": "pull", **request})
        what = f"pull of step {request['step']}"
        timeout = self.timeout_s + 5
        md = self._data_metadata(request["worker"])

        def assemble(messages):
            asm = wire.Assembler("param", layout, dest, fixed=("version", "epoch", "waited_us"))
            for message in messages:
                asm.add(message)
            return asm.finish(), asm.bytes

        if self.small(pieces):
            first = [self._pull_one.future(frame, timeout=timeout, metadata=md)]

            def call(t):
                if first:
                    return assemble([first.pop().result()])
                return assemble([self._pull_one(frame, timeout=t, metadata=md)])
        else:
            def call(t):
                return assemble(self._pull(frame, timeout=t, metadata=md))

        def finish():
            try:
                return self._retry(what, call, timeout)
            except wire.WireError as e:
                raise PSError(f"shard {self.shard} at {self.address} sent malformed "
                              f"parameters: {e}") from None
        return finish

    def pull(self, request: dict, pieces, layout: dict, dest: np.ndarray) -> tuple[dict, int]:
        return self.start_pull(request, pieces, layout, dest)()

    def wait_ready(self, timeout_s: float | None = None) -> dict:
        """Block until the shard answers (or PSError after the timeout); its info."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return json.loads(self._control(wire.encode({"op": "info"}), timeout=2.0,
                                                metadata=self.metadata))
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise PSError(f"shard {self.shard} at {self.address}: {e.code().name}: "
                                  f"{e.details()}") from None
                if time.monotonic() > deadline:
                    raise PSError(f"shard {self.shard} at {self.address} did not answer "
                                  f"within {timeout_s:g} s") from None
                time.sleep(0.1)


class PSClient:
    """All K shards of one worker: parallel push and pull of a flat parameter vector."""

    def __init__(self, addresses: list[str], shard_map, worker: int, mode: str, *,
                 max_message_bytes: int, timeout_s: float, token: str = "", tls_cert: str = ""):
        if len(addresses) != shard_map.num_shards:
            raise PSError(f"{len(addresses)} server addresses for a map of "
                          f"{shard_map.num_shards} shards")
        self.map, self.worker, self.mode = shard_map, worker, mode
        self.shards = [ShardClient(k, a, max_message_bytes=max_message_bytes,
                                   timeout_s=timeout_s, token=token, tls_cert=tls_cert)
                       for k, a in enumerate(addresses)]
        self.pieces = [shard_map.shard_pieces(k) for k in range(shard_map.num_shards)]
        self.layouts = [{p.name: (p.length, p.offset) for p in pieces} for pieces in self.pieces]
        k = shard_map.num_shards
        self.epoch, self.version = [0] * k, [0] * k
        # a push and a pull may be in flight together (start_push): room for both per shard
        self.pool = ThreadPoolExecutor(max_workers=2 * k, thread_name_prefix="ps-client")
        self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-push")
        self.last_push = None  # (step, grad, versions, epochs): re-sent after a shard restart
        self.push_s, self.pull_s, self.waits = [], [], []
        self.push_bytes = self.pull_bytes = 0
        self.restarts_seen = 0
        self.rejected_nonfinite = 0  # pushes a shard refused because the update was not finite

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every shard (they may still be starting) and check it serves the map
        this worker computed."""
        infos = list(self.pool.map(lambda s: s.wait_ready(timeout_s), self.shards))
        for shard, info in zip(self.shards, infos):
            if info.get("fingerprint") != self.map.fingerprint or info.get("shard") != shard.shard:
                raise PSError(f"{shard.address} serves shard {info.get('shard')} of map "
                              f"{info.get('fingerprint')}, but this worker expects shard "
                              f"{shard.shard} of map {self.map.fingerprint} (same --model, "
                              f"--model-opts, --dataset and --ps-shards everywhere?)")
            self.epoch[shard.shard] = info["epoch"]

    def start_together(self, timeout_s: float) -> float:
        """Say hello to every shard, then wait until every live worker has: a worker still
        importing or compiling must not count as late (sync) or silent (ssp), and start-up
        skew must not show up as staleness. Seconds waited."""
        start = time.monotonic()
        self.control_all("hello", worker=self.worker)
        while True:
            waiting = sorted({w for info in self.control_all("info") for w in info["waiting"]})
            if not waiting:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise PSError(f"worker(s) {waiting} did not start within {timeout_s:g} s")
            time.sleep(0.05)

    def _run(self, starts: dict) -> dict:
        """Finish started calls: small ones are in flight already, large ones stream on the
        pool's threads. {shard: (result or exception, seconds)}."""
        t0 = time.perf_counter()
        out = {}

        def timed(k, finish):
            try:
                return finish(), time.perf_counter() - t0
            except (PSError, Restarted) as e:
                return e, time.perf_counter() - t0
        threaded = {k: self.pool.submit(timed, k, f) for k, f in starts.items()
                    if not self.shards[k].small(self.pieces[k])}
        for k, finish in starts.items():
            if k not in threaded:
                out[k] = timed(k, finish)
        for k, future in threaded.items():
            out[k] = future.result()
        return out

    def pull(self, step: int, dest: np.ndarray) -> float:
        """Fill `dest` (the global flat vector) for computing `step`; the longest
        server-side wait in seconds."""
        min_version = step if self.mode == "sync" else 0
        todo = list(range(len(self.shards)))
        waited = 0.0
        for _ in range(3):
            starts = {k: self.shards[k].start_pull(
                {"worker": self.worker, "step": step, "min_version": min_version,
                 "epoch": self.epoch[k]}, self.pieces[k], self.layouts[k], dest) for k in todo}
            restarted = []
            for k, (result, seconds) in self._run(starts).items():
                if isinstance(result, Restarted):
                    restarted.append(k)
                    continue
                if isinstance(result, Exception):
                    raise result
                meta, nbytes = result
                self.pull_s.append(seconds)
                self.pull_bytes += nbytes
                self.version[k], self.epoch[k] = meta["version"], meta["epoch"]
                waited = max(waited, meta["waited_us"] / 1e6)
            for k in restarted:
                self.restarts_seen += 1
                self._repush(self.shards[k])
            if not restarted:
                self.waits.append(waited)
                return waited
            todo = restarted
        raise PSError(f"shard(s) {todo} kept restarting during the pull of step {step}")

    def _repush(self, shard: ShardClient) -> None:
        """A restarted shard may have lost our last gradient: send it again (deduplicated
        if it had survived)."""
        k = shard.shard
        info = shard.wait_ready()
        if self.last_push is not None:
            step, grad, versions, epochs = self.last_push
            reply, _ = shard.push(self.pieces[k], grad, {
                "worker": self.worker, "step": step, "version": versions[k],
                "epoch": epochs[k]})
            self.epoch[k] = reply["epoch"]
        else:
            self.epoch[k] = info["epoch"]

    def push(self, step: int, grad: np.ndarray, repeat: int = 1) -> list[dict]:
        """Send `grad` (global flat vector) of `step` to every shard; `repeat` > 1 sends it
        again, as a retry after a lost reply would (the copies must be deduplicated)."""
        versions, epochs = list(self.version), list(self.epoch)
        self.last_push = (step, grad, versions, epochs)
        first = {}
        for _ in range(repeat):
            starts = {k: s.start_push(self.pieces[k], grad, {
                "worker": self.worker, "step": step, "version": versions[k],
                "epoch": epochs[k]}) for k, s in enumerate(self.shards)}
            for k, (result, seconds) in self._run(starts).items():
                if isinstance(result, Exception):
                    raise result
                reply, nbytes = result
                self.push_s.append(seconds)
                self.push_bytes += nbytes
                self.epoch[k] = max(self.epoch[k], reply["epoch"])
                if reply.get("status") == "rejected_nonfinite":
                    self.rejected_nonfinite += 1
                first.setdefault(k, reply)
        return [first[k] for k in range(len(self.shards))]

    def start_push(self, step: int, grad: np.ndarray, repeat: int = 1, then_pull=None):
        """Push in the background; returns `finish()`, which waits for it. With
        `then_pull=(next_step, dest)` (sync mode) the pull of the next step is sent at once
        too: the shard holds it until this step's barrier completes, so the parameters come
        back without another round trip; `finish()` then returns the pull's wait (else
        None). A failed push is reported before the pull it made wait."""
        if (then_pull is not None and self.mode == "sync" and repeat == 1
                and then_pull[0] == step + 1
                and all(s.small(p) for s, p in zip(self.shards, self.pieces))):
            return self._start_push_pull(step, grad, then_pull[1])
        pushing = self.side.submit(self.push, step, grad, repeat)
        if then_pull is None:
            def finish_push():
                pushing.result()
                return None
            return finish_push

        def finish():
            try:
                waited = self.pull(*then_pull)
            except (PSError, Restarted):
                pushing.result()  # raises the push's error: the first cause
                raise
            pushing.result()
            return waited
        return finish

    def _start_push_pull(self, step: int, grad: np.ndarray, dest: np.ndarray):
        """Sync with small shards: one PushPullOne call per shard carries the push of
        `step` and brings back the parameters of step+1. Each call counts as one push and
        one pull of the same duration. A shard that restarted meanwhile is pulled again the
        ordinary way (which re-pushes this gradient; the shard deduplicates it)."""
        versions, epochs = list(self.version), list(self.epoch)
        self.last_push = (step, grad, versions, epochs)
        t0 = time.perf_counter()
        calls = {k: s.start_push_pull(self.pieces[k], grad, {
            "worker": self.worker, "step": step, "version": versions[k], "epoch": epochs[k]},
            self.layouts[k], dest) for k, s in enumerate(self.shards)}

        def finish():
            waited, again, error = 0.0, [], None
            for k, call in calls.items():
                try:
                    reply, sent, meta, got = call()
                except Restarted:
                    again.append(k)
                    continue
                except PSError as e:
                    error = error or e
                    continue
                seconds = time.perf_counter() - t0
                self.push_s.append(seconds)
                self.pull_s.append(seconds)
                self.push_bytes += sent
                self.pull_bytes += got
                if reply.get("status") == "rejected_nonfinite":
                    self.rejected_nonfinite += 1
                self.version[k], self.epoch[k] = meta["version"], meta["epoch"]
                waited = max(waited, meta["waited_us"] / 1e6)
            if error is not None:
                raise error
            if again:
                return max(waited, self.pull(step + 1, dest))
            self.waits.append(waited)
            return waited
        return finish

    def control_all(self, op: str, **fields) -> list[dict]:
        return list(self.pool.map(lambda s: s.control(op, **fields), self.shards))

    def close(self) -> None:
        self.side.shutdown(wait=False)
        self.pool.shutdown(wait=False)
        for shard in self.shards:
            shard.close()
