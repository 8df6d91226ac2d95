"""One shard, seen from a worker or the launcher: the gRPC channel, the calls (streamed or
as single messages of frames), retries and the errors they end in. ps.client drives K of
these in parallel. With --ps-transport tcp the single-message data calls go to the shard's
data port (ps.tcp) instead; they fail with the same gRPC status codes, so everything below
holds for both.

Failure policy, so a worker never hangs:
- a data-port call refused or dropped (UNAVAILABLE from ps.tcp) is made over gRPC at once
  (`_Fallback`) and said once in the log.
- UNAVAILABLE (shard down, restarting, not up yet) is retried with backoff until
  --ps-timeout-s has passed since the first failure, then a PSError names the shard.
- A retried push carries the same (worker, step), so the shard deduplicates it if the first
  attempt had in fact arrived.
- A shard restarted from a snapshot answers a pull with "restarted": the client re-pushes
  its last gradient (the restored shard may have lost it) and pulls again.
- Every call has a gRPC deadline; a server-side wait (sync barrier, ssp bound) ends before it
  with an error that says what it waited for.

Authentication (ps.security): the token never leaves this process. Before its first gRPC
call on a channel the client asks the shard to prove it holds the token (`Auth`, over a
fresh nonce and the port dialled); only then does it send calls, each with the session
ticket that proof opened. A data-port connection does the same handshake itself (ps.tcp).
A call that finds the shard unreachable drops the session, and, given `locate` (the
shard's ready file), the client reads where the shard is now instead of dialling the port
it remembers: a restarted shard listens on a new one, and whoever took the old one gets
nothing that authenticates.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from ps import security, wire
from ps.admission import FAULT_KEY, NONCE_KEY, WORKER_KEY
from ps.tcp import CONTROL, PULL_ONE, PUSH_ONE, PUSH_PULL_ONE, CallError, DataChannel, _Method

SERVICE = "/jaxdist.ps.Shard/"
UNARY_MAX_FRAMES = 4  # see ShardClient.small
# A data-port request this small is sent on the calling thread (the socket takes it at
# once); a larger one is sent from a kept thread, so K shards receive in parallel.
INLINE_SEND_BYTES = 4 << 20


def _nbytes(request) -> int:
    parts = request if isinstance(request, list) else [request]
    return sum(memoryview(p).nbytes for p in parts)


HANDSHAKE_FAULT = "handshake"  # a CallError's fault: the peer failed ps.security's handshake


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


class _Late:
    """A gRPC method of the client's current channel (a relocated shard gets a new one),
    called once the channel has a session (ShardClient._ensure_session)."""

    def __init__(self, client: "ShardClient", name: str):
        self.client, self.name = client, name

    def __call__(self, request, timeout=None, metadata=None):
        self.client._ensure_session(timeout)
        return self.client._methods[self.name](request, timeout=timeout, metadata=metadata)


class _Metadata:
    """A call's metadata, read when the call is made (after its session is made): the
    session ticket, then `extra` (the worker's id)."""

    def __init__(self, client: "ShardClient", extra: tuple = ()):
        self.client, self.extra = client, extra

    def __iter__(self):
        return iter((*(self.client._session or ()), *self.extra))

    def __bool__(self):
        return True


class _Fallback:
    """A data-port method (ps.tcp._Method) whose call, when the data port refuses or drops
    its connection (UNAVAILABLE from ps.tcp: a full or closed port, a stale kept
    connection), is made over gRPC instead: the same handler behind another door, and a
    retried push is deduplicated. A lookup of the data port that fails is gRPC's own
    UNAVAILABLE and stays an error (the shard is down)."""

    def __init__(self, data: _Method, grpc_method, note, via):
        self.data, self.grpc, self.note, self.via = data, grpc_method, note, via

    def _over_grpc(self, error: CallError, request, timeout, metadata):
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            raise error
        self.note(error)
        joined = request if isinstance(request, bytes) else b"".join(request)
        reply = self.grpc(joined, timeout=timeout, metadata=metadata)
        self.via.name = "grpc"
        return reply

    def __call__(self, request, timeout=None, metadata=None):
        try:
            reply = self.data(request, timeout, metadata)
        except CallError as e:
            return self._over_grpc(e, request, timeout, metadata)
        self.via.name = "tcp"
        return reply

    def start(self, request, timeout=None, metadata=None):
        pending = self.data.start(request, timeout, metadata)
        return _Result(lambda: self._finish(pending, request, timeout, metadata))

    def _finish(self, pending, request, timeout, metadata):
        try:
            reply = pending.result()
        except CallError as e:
            return self._over_grpc(e, request, timeout, metadata)
        self.via.name = "tcp"
        return reply


class _Result:
    def __init__(self, fn):
        self.result = fn


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
                 token: str = "", tls_cert: str = "", transport: str = "tcp", log=None,
                 locate=None):
        self.shard, self.address, self.timeout_s = shard, address, timeout_s
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.fallbacks = 0  # data calls made over gRPC because the data port refused them
        # Push and pull bytes by the transport that carried them (results label them): a
        # call's thread notes its door in `_via` (_Fallback), read where the bytes are counted.
        self.bytes_by = {"tcp": 0, "grpc": 0}
        self._via = threading.local()
        self._count_lock = threading.Lock()
        self.transport, self.tls_cert, self.data = transport, tls_cert, None
        self.frame_bytes = wire.frame_bytes(max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self._token = token       # proves this side; never sent (ps.security)
        self.locate = locate      # () -> (address, ready-file dict) or None
        self._session = None      # this channel's session metadata, once the shard proved itself
        self._session_lock = threading.Lock()
        self._old_channels: list = []
        self._bind(address)
        self.metadata = _Metadata(self)
        self._push, self._pull = _Late(self, "Push"), _Late(self, "Pull")
        self._control = self._grpc_control = _Late(self, "Control")
        self._push_one, self._pull_one = _Late(self, "PushOne"), _Late(self, "PullOne")
        self._push_pull_one = _Late(self, "PushPullOne")
        if locate is not None:  # the data port from the ready file: no gRPC call for it
            try:
                found = locate()
            except (OSError, ValueError, KeyError):
                found = None
            if found and found[0] == address:
                self.use_data_port(found[1])
        # Started unary calls run as blocking calls on these threads (kept between calls):
        # a gRPC future on an idle channel starts a polling thread and ends it with the
        # call, ~0.4 ms of CPU per call here (0.75-0.83 against 0.29-0.46 ms measured);
        # a blocking call polls on its own thread. A push and a pull may be in flight
        # together.
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"ps-shard{shard}")

    def _bind(self, address: str) -> None:
        """Talk to the shard at `address` from now on (a new channel, no session yet). The
        channel replaced stays open until close(): a call in flight on it ends as it
        would."""
        self.address = address
        self.port = int(address.rsplit(":", 1)[1])
        if getattr(self, "channel", None) is not None:
            self._old_channels.append(self.channel)
        self.channel = make_channel(address, self.max_message_bytes, self.tls_cert)
        c = self.channel
        self._methods = {"Push": c.stream_unary(SERVICE + "Push"),
                         "Pull": c.unary_stream(SERVICE + "Pull"),
                         **{m: c.unary_unary(SERVICE + m) for m in
                            ("Control", "PushOne", "PullOne", "PushPullOne", "Auth")}}
        self._session = None

    def _ensure_session(self, timeout=None) -> None:
        """ps.security's handshake on this channel, once: the shard proves it holds the
        token over our fresh nonce and the port we dialled; only then is our proof (the
        session ticket) made, to go with the calls. Without a token there is none. A shard
        that fails is UNAVAILABLE (retried, relocated), naming it."""
        if self._session is not None:
            return
        if not self._token:
            self._session = ()
            return
        with self._session_lock:
            if self._session is not None:
                return
            nonce, port, address = security.new_nonce(), self.port, self.address
            try:
                reply = self._methods["Auth"](b"", timeout=min(timeout or security.HANDSHAKE_S,
                                                               security.HANDSHAKE_S),
                                              metadata=((NONCE_KEY, nonce.hex()),))
            except grpc.RpcError as e:  # not there, or not answering: retried, relocated
                if e.code() in (grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CallError(grpc.StatusCode.UNAVAILABLE,
                                    f"shard {self.shard} at {address} did not answer the "
                                    f"handshake ({e.code().name})") from None
                reply = b""  # any other answer is not a shard's: refused below
            try:
                answer = json.loads(reply)
                shard_nonce, proof = (bytes.fromhex(answer["nonce"]),
                                      bytes.fromhex(answer["proof"]))
                binding = security.channel_binding("grpc", self.shard, port)
                security.check(security.shard_proof(self._token, nonce, shard_nonce, binding),
                               proof, f"shard {self.shard} at {address}")
            except (ValueError, KeyError, TypeError, security.HandshakeError) as e:
                why = (str(e) if isinstance(e, security.HandshakeError) else
                       f"shard {self.shard} at {address} did not answer the handshake")
                raise CallError(grpc.StatusCode.UNAUTHENTICATED,
                                f"{why} (or this process's token is not the run's)",
                                HANDSHAKE_FAULT) from None
            ticket = security.session_ticket(nonce, shard_nonce, security.client_proof(
                self._token, nonce, shard_nonce, binding))
            self._session = ((security.SESSION_KEY, ticket),)

    def _lost(self) -> None:
        """The shard did not answer: drop the session (its next listener must prove itself
        again) and read where the shard is now, if we can."""
        self._session = None
        if self.locate is None:
            return
        try:
            found = self.locate()
        except (OSError, ValueError, KeyError):
            found = None
        if not found:
            return
        address, info = found
        if address != self.address:
            self.log(f"ps: shard {self.shard} moved from {self.address} to {address} "
                     f"(its ready file)")
            self._bind(address)
        if self.data is not None and info.get("data_port"):
            self.data.port = info["data_port"]

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        if self.data is not None:
            self.data.close()
        self.channel.close()
        for channel in self._old_channels:
            channel.close()

    def use_data_port(self, info: dict) -> None:
        """With --ps-transport tcp and a shard that has a data port (ps.tcp), one-message
        data calls and control calls go there (only authenticated connections hold its
        slots: a tokenless peer holding the gRPC port cannot cut them off)."""
        if self.transport != "tcp" or "data_port" not in info:
            return
        if self.data is None:
            host = self.address.rsplit(":", 1)[0].strip("[]")
            self.data = DataChannel(host, self._data_port, self.tls_cert,
                                    self.max_message_bytes, self._token, self.shard)
            self._push_one = _Fallback(self.data.method(PUSH_ONE), self._push_one,
                                       self._fell_back, self._via)
            self._pull_one = _Fallback(self.data.method(PULL_ONE), self._pull_one,
                                       self._fell_back, self._via)
            self._push_pull_one = _Fallback(self.data.method(PUSH_PULL_ONE),
                                            self._push_pull_one, self._fell_back, self._via)
            # not counted as data fallbacks, and its door not noted where bytes are counted
            control = self.data.method(CONTROL)
            self._control = _Fallback(lambda *args: bytes(control(*args)), self._grpc_control,
                                      lambda error: None, threading.local())
        self.data.port = info["data_port"]

    def _fell_back(self, error: CallError) -> None:
        # The data port failed: the shard may be gone, and its gRPC port someone else's by
        # now. The call over gRPC starts with a new handshake, not a ticket of the old one.
        self._session = None
        self.fallbacks += 1
        if self.fallbacks == 1:
            self.log(f"ps: shard {self.shard} at {self.address}: its data port refused a "
                     f"call ({error.details()[:120]}); that call, and any other refused, "
                     f"goes over gRPC (said once; counted in data_fallbacks)")

    def _data_port(self) -> int:
        """The shard's data port, read again (a restarted shard listens on a new one): from
        its ready file when we have it, else asked over gRPC."""
        if self.locate is not None:
            self._lost()
            if self.data is not None and self.data.port:
                return self.data.port
        info = json.loads(self._grpc_control(wire.encode({"op": "info"}), timeout=2.0,
                                             metadata=self.metadata))
        if "data_port" not in info:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the shard has no data port")
        return info["data_port"]

    def _start(self, method, request, timeout: float, metadata):
        """A unary call in flight now; `.result()` is its reply (or its grpc.RpcError)."""
        if isinstance(method, _Fallback) and _nbytes(request) <= INLINE_SEND_BYTES:
            return method.start(request, timeout, metadata)  # no thread: sent right here
        entered = threading.Event()

        def call():  # the door it took is noted on this thread: hand it to the reader's
            entered.set()
            reply = method(request, timeout=timeout, metadata=metadata)
            return reply, getattr(self._via, "name", "grpc")
        future = self._calls.submit(call)
        entered.wait()
        return _Result(lambda: self._took(*future.result()))

    def _took(self, reply, via: str):
        self._via.name = via
        return reply

    def _carried(self, nbytes: int) -> None:
        """Count bytes of the call that just ended on this thread, by its transport."""
        with self._count_lock:
            self.bytes_by[getattr(self._via, "name", "grpc")] += nbytes

    def _retry(self, what: str, fn, rpc_timeout: float):
        first_failure, stale = None, False
        delay = 0.05
        while True:
            self._via.name = "grpc"  # unless a data-port call says otherwise (_Fallback)
            try:
                return fn(rpc_timeout)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if _fault(e) == "restarted":
                    raise Restarted(e.details()) from None
                if _fault(e) == HANDSHAKE_FAULT:
                    # Whoever answered there is not the run's shard: where is it now? A
                    # shard that moved is tried again; one that did not is an error now.
                    address = self.address
                    self._lost()
                    if self.address != address:
                        continue
                if code == grpc.StatusCode.UNAUTHENTICATED and self._session and not stale:
                    stale = True  # a session the shard no longer knows (expired): once more
                    self._session = None
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._lost()
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

    def _finisher(self, what: str, call, timeout: float, malformed: str):
        """finish() of a started call: its result after retries; a reply that does not
        decode is a PSError saying the shard sent `malformed`."""
        def finish():
            try:
                return self._retry(what, call, timeout)
            except wire.WireError as e:
                raise PSError(f"shard {self.shard} at {self.address} sent {malformed}: "
                              f"{e}") from None
        return finish

    def _data_metadata(self, worker: int) -> tuple:
        """Data calls name their worker: the shard caps open calls per worker."""
        return _Metadata(self, ((WORKER_KEY, str(worker)),))

    def control(self, op: str, **fields) -> dict:
        request = wire.encode({"op": op, **fields})
        reply = self._retry(op, lambda t: self._control(request, timeout=t,
                                                        metadata=self.metadata), 10.0)
        return json.loads(reply)

    def small(self, pieces) -> bool:
        """Whether these pieces go as one message: then a push or pull is one unary call
        started on a kept thread. Over the data port (ps.tcp) that is any transfer under
        the message limit. Over gRPC it is up to UNARY_MAX_FRAMES frames (a gRPC client
        stream costs a new thread per call and ~1 ms; measured on `mlp`, 1.35 MB per shard:
        a sync step of 25 ms instead of 35), and larger transfers stream (a 15 MB unary
        push took 2-3x a stream's time)."""
        limit = self.max_message_bytes - 65536
        if self.data is None:
            limit = min(UNARY_MAX_FRAMES * self.frame_bytes, limit)
        return sum(p.length * 4 + 256 for p in pieces) <= limit

    def _one_message(self, pieces, source, meta: dict, source_offset=None):
        """(a push as one message, its bytes): the data port sends the frames' parts as
        they are; gRPC needs them joined (one copy)."""
        parts = wire.bundle_parts("push", pieces, source, self.frame_bytes, meta,
                                  source_offset)
        return (parts if self.data is not None else b"".join(parts)), _nbytes(parts)

    def start_push(self, pieces, source, meta: dict, source_offset=None):
        """Start a push; returns `finish() -> (reply, bytes sent)`. Small pushes are in
        flight on return; large ones stream inside `finish` (run it in a thread)."""
        what = f"push of step {meta['step']}"
        frames = lambda: wire.frames("push", pieces, source, self.frame_bytes, meta,  # noqa
                                     source_offset)
        timeout = self.timeout_s + 5
        md = self._data_metadata(meta["worker"])
        if self.small(pieces):
            bundle, size = self._one_message(pieces, source, meta, source_offset)
            first = [self._start(self._push_one, bundle, timeout, md)]

            def call(t):
                if first:
                    return first.pop().result()
                return self._push_one(bundle, timeout=t, metadata=md)
            return lambda: self._push_reply(self._retry(what, call, timeout), size)

        sent = [0]

        def stream_call(t):
            def stream():
                for frame in frames():
                    sent[0] += len(frame)
                    yield frame
            sent[0] = 0
            return self._push(stream(), timeout=t, metadata=md)
        return lambda: self._push_reply(self._retry(what, stream_call, timeout), sent[0])

    def _push_reply(self, reply, size: int) -> tuple[dict, int]:
        self._carried(size)
        return json.loads(bytes(reply)), size

    def start_push_pull(self, pieces, source, meta: dict, layout: dict, dest: np.ndarray):
        """Sync, a transfer small enough for one message: push step t and pull step t+1
        in one call (PushPullOne). Returns `finish() -> (push reply, bytes sent, pull meta,
        bytes received)`; raises Restarted like a pull does."""
        what = f"push and pull of step {meta['step']}"
        bundle, size = self._one_message(pieces, source, meta)
        md = self._data_metadata(meta["worker"])
        timeout = self.timeout_s + 5
        first = [self._start(self._push_pull_one, bundle, timeout, md)]

        def call(t):
            message = (first.pop().result() if first else
                       self._push_pull_one(bundle, timeout=t, metadata=md))
            head, rest = wire.split_first(message)
            if head.get("op") != "reply":
                raise wire.WireError("reply frame missing")
            asm = wire.Assembler("param", layout, dest, fixed=("version", "epoch", "waited_us"))
            asm.add(rest)
            meta = asm.finish()
            self._carried(size + asm.bytes)
            return head, size, meta, asm.bytes

        return self._finisher(what, call, timeout, "a malformed reply")

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
            meta = asm.finish()
            self._carried(asm.bytes)
            return meta, asm.bytes

        if self.small(pieces):
            first = [self._start(self._pull_one, frame, timeout, md)]

            def call(t):
                if first:
                    return assemble([first.pop().result()])
                return assemble([self._pull_one(frame, timeout=t, metadata=md)])
        else:
            def call(t):
                return assemble(self._pull(frame, timeout=t, metadata=md))

        return self._finisher(what, call, timeout, "malformed parameters")

    def pull(self, request: dict, pieces, layout: dict, dest: np.ndarray) -> tuple[dict, int]:
        return self.start_pull(request, pieces, layout, dest)()

    def wait_ready(self, timeout_s: float | None = None) -> dict:
        """Block until the shard answers (or PSError after the timeout); its info."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = json.loads(self._control(wire.encode({"op": "info"}), timeout=2.0,
                                                metadata=self.metadata))
                self.use_data_port(info)
                return info
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise PSError(f"shard {self.shard} at {self.address}: {e.code().name}: "
                                  f"{e.details()}") from None
                self._lost()
                if time.monotonic() > deadline:
                    raise PSError(f"shard {self.shard} at {self.address} did not answer "
                                  f"within {timeout_s:g} s") from None
                time.sleep(0.1)
