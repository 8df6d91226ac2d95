"""The gRPC face of one shard: `ShardServicer` (handlers over a ps.core.ShardCore) and
`start_grpc`; the process around them is ps.server.

The layer is thin: it authenticates (ps.security's handshake: `Auth` proves the shard holds
the run's token over the client's nonce and issues a shard nonce; every other call carries a
session ticket, the client's proof over both nonces, checked by an interceptor on the
metadata before a call's body is read, and again in the handler, which the data port
(ps.tcp) calls on connections that did the same handshake), decodes and validates frames (ps.wire)
into a scratch buffer, and hands whole gradients to the core. Anything malformed gets an
error status; the core is never called with it, so parameters cannot change and the server
stays up.

Methods (generic handlers, raw bytes; no protoc):
  Push     client stream of frames (op "push") -> JSON reply {status, version, epoch, ...}
  Pull     one frame (op "pull": worker, step, min_version, epoch) -> stream of "param" frames
  PushOne, PullOne  the same as single messages of several frames (small shards)
  PushPullOne  sync: the push of step t and the parameters of step t+1 in one call
  Control  one frame (op ping | info | hello | stats | retire | shutdown) -> JSON reply
  Auth     the handshake: metadata x-jaxdist-nonce (the client's) -> JSON {nonce, proof}
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from jaxdist.errors import UsageError
from ps import wire
from ps import security
from ps.admission import FAULT_KEY, NONCE_KEY, CallGate, Refused, pool_size
from ps.allocator import keep_freed_memory
from ps.core import PSFault, ShardCore
from ps.peer_budget import PeerBudget

_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT,
          "precondition": grpc.StatusCode.FAILED_PRECONDITION,
          "restarted": grpc.StatusCode.FAILED_PRECONDITION,
          "aborted": grpc.StatusCode.ABORTED,
          "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
          "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED}



IDLE_MS = 20_000          # a connection with no call for this long is closed
AGE_MS = 600_000          # and any connection after this long (its calls finish first)
HANDSHAKE_MS = 5_000      # TLS handshake and HTTP/2 preface, from the TCP connect
# File descriptors the shard keeps for itself (snapshots, logs, the data port's own cap)
RESERVED_FDS = 64


def connection_cap(num_workers: int, nofile: int | None = None) -> int:
    """How many connections the gRPC port holds at once: what the file-descriptor limit
    leaves after the data port's most (ps.data_slots) and the shard's own files, at most
    1,024 and at least 16. Each worker and the launcher need one; more are refused at
    accept, so a peer that opens many cannot exhaust the shard's descriptors."""
    import resource

    from ps.data_slots import MAX_WAITING

    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    left = nofile - RESERVED_FDS - (pool_size(num_workers) + MAX_WAITING)
    return max(16, min(1024, left))


def server_options(max_message_bytes: int, num_workers: int = 1,
                   call_deadline_s: float = 32.0) -> list:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # grpc sets SO_REUSEPORT by default: a second server could then share a busy
            # port silently. A port in use must be an error.
            ("grpc.so_reuseport", 0),
            # Connections are capped and none lives for ever: a peer's idle or silent
            # connections are closed (a worker's channel reconnects on its next call).
            ("grpc.max_allowed_incoming_connections", connection_cap(num_workers)),
            ("grpc.max_connection_idle_ms", IDLE_MS),
            ("grpc.max_connection_age_ms", AGE_MS),
            ("grpc.max_connection_age_grace_ms", int((call_deadline_s + 5) * 1000)),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_MS),
            ("grpc.keepalive_time_ms", IDLE_MS),
            ("grpc.keepalive_timeout_ms", 10_000)]
    # No grpc.max_concurrent_streams: a client stream the shard refused mid-way (a bad
    # push) stays counted until its connection closes, so a cap of 256 refused a
    # well-behaved client's 305th call. Calls are bounded by ps.admission instead.


AUTH_METHOD = "/jaxdist.ps.Shard/Auth"
REFUSAL_LOG_EVERY_S = 10.0


class TokenInterceptor(grpc.ServerInterceptor):
    """The session ticket is checked on a call's metadata before its handler runs, so the
    body of an unauthenticated call is never read into a message: the call is answered
    UNAUTHENTICATED by a handler that does not take its request (a stream handler reads
    lazily). `Auth`, the handshake, needs none and reads no body either."""

    def __init__(self, servicer: "ShardServicer"):
        self.servicer = servicer

        def refuse(request_iterator, context):
            servicer.refused(context.peer())  # counted, and against its connection's budget
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid session: the client "
                          "has not proved it holds the run's token")
        self._refuse = grpc.stream_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method == AUTH_METHOD or self.servicer.session_ok(
                handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        return self._refuse


class ShardServicer:
    def __init__(self, core: ShardCore, shard_map, shard: int, *, token: str = "",
                 frame_bytes: int = wire.DEFAULT_FRAME_BYTES, on_push=None,
                 call_deadline_s: float | None = None):
        self.core, self.map, self.shard = core, shard_map, shard
        # Longer than the core's own waits (timeout + 1 s), so a parked pull ends with the
        # core's message, not a bare cancellation.
        self.gate = CallGate(core.num_workers, call_deadline_s or
                             getattr(core, "timeout_s", 30.0) + 2.0)
        self.token = token or ""
        self.nonces = security.ShardNonces()
        self.grpc_port: int | None = None    # set once bound: the gRPC proofs name it
        self._sessions: dict = {}            # tickets checked already -> until when (bounded)
        self.refused_calls = 0               # gRPC calls without a valid session
        self.budget = PeerBudget(lambda: self.grpc_port)  # per connection (ps.peer_budget)
        self._refusals_logged_at = -REFUSAL_LOG_EVERY_S
        self._refusals_logged = (0, 0)
        self.log = print
        self.frame_bytes = frame_bytes
        self.pieces = shard_map.shard_pieces(shard)
        self.layout = {p.name: (p.length, p.shard_offset) for p in self.pieces}
        self.stop_event = threading.Event()
        self.on_push = on_push or (lambda: None)
        self.bytes_in = self.bytes_out = 0
        self.decode_s = self.encode_s = 0.0  # CPU time validating/copying frames in, making out
        self.data_port: int | None = None    # ps.tcp's port for one-message data calls
        self.data_slots = None               # and its ps.data_slots (refusal counts)

    def handler(self):
        return grpc.method_handlers_generic_handler("jaxdist.ps.Shard", {
            "Push": grpc.stream_unary_rpc_method_handler(self.push),
            "Pull": grpc.unary_stream_rpc_method_handler(self.pull),
            "Control": grpc.unary_unary_rpc_method_handler(self.control),
            # The same, as single messages of several frames: small transfers skip streams.
            "PushOne": grpc.unary_unary_rpc_method_handler(
                lambda request, context: self.push(iter((request,)), context)),
            "PullOne": grpc.unary_unary_rpc_method_handler(self.pull_one),
            "PushPullOne": grpc.unary_unary_rpc_method_handler(self.push_pull_one),
            # a stream handler that never reads its request: a peer's body is not taken
            "Auth": grpc.stream_unary_rpc_method_handler(self.auth),
        })

    # -- authentication (ps.security) -----------------------------------------------------

    def auth(self, request_iterator, context):
        """The shard's half of the gRPC handshake: its proof over the client's nonce and a
        fresh shard nonce. Gives nothing away: the proof is good for that nonce alone."""
        if not self.token:
            return b'{"token": false}'
        self.budget.spend(context.peer())  # a handshake opens nothing by itself
        got = dict(context.invocation_metadata() or ()).get(NONCE_KEY, "")
        try:
            client_nonce = bytes.fromhex(got if isinstance(got, str) else "")
        except ValueError:
            client_nonce = b""
        if len(client_nonce) != security.NONCE_BYTES:
            self.refused(context.peer())
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Auth needs a client nonce")
        shard_nonce = self.nonces.issue()
        proof = security.shard_proof(self.token, client_nonce, shard_nonce,
                                     security.channel_binding("grpc", self.shard,
                                                              self.grpc_port or 0))
        return json.dumps({"nonce": shard_nonce.hex(), "proof": proof.hex()}).encode()

    def session_ok(self, metadata) -> bool:
        """Whether a gRPC call's metadata carries a session ticket of this process (see
        ps.security.ShardNonces); always true without a token."""
        if not self.token:
            return True
        value = None
        for key, v in metadata or ():
            if key == security.SESSION_KEY:
                value = v
        if value is None:
            return False
        now = time.monotonic()
        until = self._sessions.get(value)
        if until is not None and now < until:
            return True
        parsed = security.parse_ticket(value)
        if parsed is None:
            return False
        client_nonce, shard_nonce, proof = parsed
        if not self.nonces.valid(shard_nonce):
            return False
        expected = security.client_proof(self.token, client_nonce, shard_nonce,
                                         security.channel_binding("grpc", self.shard,
                                                                  self.grpc_port or 0))
        try:
            security.check(expected, proof, "the client")
        except security.HandshakeError:
            return False
        if len(self._sessions) >= 256:  # only proven tickets get here; keep a few
            self._sessions.clear()
        self._sessions[value] = now + 60.0
        return True

    def refused(self, peer: str = "") -> None:
        """A gRPC call came without a valid session (or a bad handshake): counted, spent
        from its connection's budget (ps.peer_budget), and logged at most once per
        REFUSAL_LOG_EVERY_S (a flood must not flood the log; the data port counts its own,
        ps.data_slots)."""
        self.refused_calls += 1
        if peer:
            self.budget.spend(peer)
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_EVERY_S:
            self._refusals_logged_at = now
            self._refusals_logged = (self.refused_calls, self.budget.closed)
            self.log(self.refusal_summary() + f" (logged at most every "
                     f"{REFUSAL_LOG_EVERY_S:g} s)")

    def refusal_summary(self) -> str:
        return (f"gRPC port: {self.refused_calls} call(s) refused so far: no proof of the "
                f"run's token; {self.budget.closed} connection(s) closed over their budget "
                f"of {self.budget.budget} calls without a session")

    def refusals_unlogged(self) -> bool:
        return bool(self.refused_calls or self.budget.closed) and (
            self.refused_calls, self.budget.closed) != self._refusals_logged

    # Every handler starts here: a call without a session never reaches parsing. A data-
    # port call (ps.tcp) comes on a connection that did the handshake.
    def _auth(self, context) -> None:
        if getattr(context, "ps_authenticated", False):
            return
        if self.session_ok(context.invocation_metadata()):
            self.budget.refund(context.peer())
            return
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid session: the client has "
                      "not proved it holds the run's token")

    @staticmethod
    def _abort(context, kind: str, message: str):
        context.set_trailing_metadata(((FAULT_KEY, kind),))
        context.abort(_CODES[kind], message)

    def _admit(self, context):
        """(worker named in the metadata, release()) or abort: see ps.admission."""
        try:
            return self.gate.admit(context)
        except Refused as e:
            if e.kind == "invalid":
                self.core.count_rejected()
            self._abort(context, e.kind, str(e))

    def push(self, request_iterator, context):
        return json.dumps(self._push(request_iterator, context)[0]).encode()

    def push_pull_one(self, request, context, join: bool = True):
        """The push of step t and, once it is applied, the pull of step t+1 in one call (one
        message each way, no second call to hand the parameters over); the pull waits as
        the mode says (sync: step t's barrier, ssp: the bound). Reply: a frame `op=reply`
        with the push's JSON fields, then the parameter frames."""
        reply, meta = self._push(iter((request,)), context)
        step = meta["step"] + 1
        pull = wire.encode({"op": "pull", "worker": meta["worker"], "step": step,
                            "min_version": step if self.core.mode == "sync" else 0,
                            "epoch": meta["epoch"]})
        return self.pull_one(pull, context, first=wire.encode({"op": "reply", **reply}),
                             join=join)

    def _push(self, request_iterator, context):
        self._auth(context)
        worker, release = self._admit(context)
        scratch = self.core.take_buffer()
        try:
            asm = wire.Assembler("push", self.layout, scratch,
                                 fixed=("worker", "step", "version", "epoch"))
            try:
                for message in request_iterator:
                    d0 = time.perf_counter()
                    asm.add(message)
                    self.decode_s += time.perf_counter() - d0
                meta = asm.finish()
                if not meta:
                    raise wire.WireError("empty push")
                if meta["worker"] != worker:
                    raise wire.WireError(f"frames of worker {meta['worker']} on a call of "
                                         f"worker {worker}")
            except wire.WireError as e:
                self.core.count_rejected()
                self._abort(context, "invalid", str(e))
            self.bytes_in += asm.bytes
            try:
                reply = self.core.push(meta["worker"], meta["step"], meta["version"],
                                       meta["epoch"], scratch)
            except PSFault as e:
                self._abort(context, e.kind, str(e))
        finally:
            self.core.give_buffer(scratch)  # kept by the core while a sync barrier holds it
            release()
        self.on_push()
        return reply, meta

    def _pull_source(self, request, context, worker: int):
        """Validate a pull, wait as the mode says (core.pull), and return
        `produce(wire.frames or wire.bundle)` over the parameters it got."""
        try:
            header, _ = wire.decode(request)
            if header.get("op") != "pull":
                raise wire.WireError(f"expected op 'pull', got {str(header.get('op'))[:20]!r}")
            fields = {k: wire.get_int(header, k)
                      for k in ("worker", "step", "min_version", "epoch")}
            if fields["worker"] != worker:
                raise wire.WireError(f"pull of worker {fields['worker']} on a call of worker "
                                     f"{worker}")
        except wire.WireError as e:
            self._abort(context, "invalid", str(e))
        try:
            version, epoch, params, waited, _ = self.core.pull(**fields)
        except PSFault as e:
            self._abort(context, e.kind, str(e))
        meta = {"version": version, "epoch": epoch, "waited_us": int(waited * 1e6)}
        return lambda make: make("param", self.pieces, params, self.frame_bytes, meta,
                                 source_offset=lambda p: p.shard_offset)

    def pull(self, request, context):
        self._auth(context)
        worker, release = self._admit(context)
        try:
            frames = self._pull_source(request, context, worker)(wire.frames)
            while True:
                e0 = time.perf_counter()
                frame = next(frames, None)
                self.encode_s += time.perf_counter() - e0
                if frame is None:
                    break
                self.bytes_out += len(frame)
                yield frame
        finally:
            release()

    def pull_one(self, request, context, first: bytes = b"", join: bool = True):
        """The parameters as one message; `first` (a frame) goes in front of them in the
        same join, not by concatenating a second copy of the whole message. `join=False`
        returns the message's parts unjoined (views of the parameters), for a socket that
        sends them as they are (ps.tcp)."""
        self._auth(context)
        worker, release = self._admit(context)
        make = wire.bundle if join else wire.bundle_parts
        try:
            produce = self._pull_source(request, context, worker)
            e0 = time.perf_counter()
            message = produce(lambda *args, **kw: make(*args, first=first, **kw))
            self.encode_s += time.perf_counter() - e0
        finally:
            release()
        size = len(message) if join else sum(memoryview(p).nbytes for p in message)
        self.bytes_out += size - len(first)  # parameter frames, as counted before
        return message

    def control(self, request, context):
        self._auth(context)
        try:
            header, _ = wire.decode(request)
            op = header.get("op")
            if op == "ping":
                return b'{"ok": true}'
            if op == "progress":
                return json.dumps(self.core.progress()).encode()
            if op == "info":
                return json.dumps(self.info()).encode()
            if op == "stats":
                stats = self.core.stats()
                stats.update(self.info(), bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                             decode_s=self.decode_s, encode_s=self.encode_s)
                if self.data_slots is not None:
                    stats["data_port_connections"] = dict(self.data_slots.counts)
                stats["grpc_refused_calls"] = self.refused_calls
                stats["grpc_closed_over_budget"] = self.budget.closed
                return json.dumps(stats).encode()
            if op == "hello":
                worker = wire.get_int(header, "worker", 0, self.core.num_workers - 1)
                try:
                    return json.dumps(self.core.hello(worker)).encode()
                except PSFault as e:
                    self._abort(context, e.kind, str(e))
            if op == "retire":
                worker = wire.get_int(header, "worker", 0, self.core.num_workers - 1)
                reason = str(header.get("reason", "retired by the launcher"))[:200]
                self.core.retire(worker, reason)
                return b'{"ok": true}'
            if op == "shutdown":
                self.stop_event.set()
                return b'{"ok": true}'
            raise wire.WireError(f"unknown control op {str(op)[:20]!r}")
        except wire.WireError as e:
            self._abort(context, "invalid", str(e))

    def info(self) -> dict:
        return {"shard": self.shard, "of": self.map.num_shards,
                "fingerprint": self.map.fingerprint, "epoch": self.core.epoch,
                "version": self.core.version, "mode": self.core.mode,
                "workers": self.core.num_workers, "size": self.core.size,
                "pieces": len(self.pieces), "pid": os.getpid(),
                "waiting": self.core.waiting(),
                **({"data_port": self.data_port} if self.data_port else {})}


def start_grpc(servicer: ShardServicer, bind: str, port: int, max_message_bytes: int,
               num_workers: int, tls_cert: str = "", tls_key: str = "") -> tuple:
    """(grpc server, bound port). Raises UsageError if the address cannot be bound."""
    keep_freed_memory()  # every message would page-fault its memory in again
    # Data calls are capped per worker (ps.admission); the rest of the pool is for control.
    pool = ThreadPoolExecutor(max_workers=pool_size(num_workers),
                              thread_name_prefix="ps-shard")
    server = grpc.server(pool, handlers=[servicer.handler()],
                         interceptors=[TokenInterceptor(servicer)] if servicer.token
                         else None,
                         options=server_options(max_message_bytes, num_workers,
                                                servicer.gate.deadline_s))
    host = f"[{bind}]" if ":" in bind else bind
    try:
        if tls_cert:
            with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            bound = server.add_secure_port(f"{host}:{port}", creds)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise UsageError(f"cannot bind {bind}:{port} (port in use or address not local)")
    servicer.grpc_port = bound  # before the first call: the handshake's proofs name it
    server.start()
    return server, bound
