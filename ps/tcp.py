"""A shard's data port: its one-message data calls (PushOne, PullOne, PushPullOne) and its
control calls over plain TCP, beside the gRPC port that serves them all and the streams.
gRPC Python copies each message several times and hands each call to a pool thread
(docs/ps.md, "Measured": 40 MB push+pull at 0.35-0.55 of raw loopback TCP). Here a kept
connection carries one call at a time and the connection's thread runs the servicer's own
handler: admission, validation and core are the same code as over gRPC; only
the bytes move differently.

Message, both ways: `MAGIC | u8 method or status | u32 JSON length | u64 payload length`,
the JSON (request: the call's metadata as [key, value] pairs; reply: {details, fault}),
then the payload (ps.wire frames). A reply's status is a grpc.StatusCode value, so the
client raises the errors a gRPC call would and ps.shard_client's retries apply unchanged.
The port is ephemeral, in the shard's `info` (`data_port`) and its ready file.

With a token, a connection starts with ps.security's handshake, before any call: the worker
sends `HELLO | its nonce`; the shard answers `HELLO | its nonce | its proof` (over both
nonces, this port and its shard index); the worker checks it and only then sends its own
proof, in front of its first request. A peer that fails it is closed and counted (one log
line per 10 s at most). Against a peer: nothing is read past the handshake until it holds;
an oversized message, bad magic or bad metadata closes the connection; a request must
arrive whole within the call deadline, an idle connection is closed after it; only
authenticated connections hold one of the slots, a connection still in its TLS handshake
waits as any unauthenticated one does, and the accept loop outlives a shortage of file
descriptors (ps.data_slots).
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import struct
import threading
import time

import grpc
import numpy as np

from jaxdist.errors import UsageError
from ps import security, wire
from ps.admission import FAULT_KEY, pool_size
from ps.data_slots import ConnectionSlots

MAGIC = b"JDT1"
HELLO = b"JDH1"
_CLIENT_HELLO = struct.Struct(f"<4s{security.NONCE_BYTES}s")
_SHARD_HELLO = struct.Struct(f"<4s{security.NONCE_BYTES}s{security.PROOF_BYTES}s")
_HEAD = struct.Struct("<4sB3xIQ")
MAX_META_BYTES = 64 * 1024
PUSH_ONE, PULL_ONE, PUSH_PULL_ONE, CONTROL = 1, 2, 3, 4
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallError(grpc.RpcError):
    """A failed data call, shaped like grpc's own error for ps.shard_client."""

    def __init__(self, code: grpc.StatusCode, details: str, fault: str | None = None):
        super().__init__(details)
        self._code, self._details, self._fault = code, details, fault

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ((FAULT_KEY, self._fault),) if self._fault else ()


class _Reader:
    """Reads one connection's messages. A small message arrives whole in one recv (its
    header, JSON and payload land in a kept buffer: per recv Python sets a timeout and
    polls, so three reads per message cost six more syscalls); a payload larger than the
    buffer is read straight into its own array."""

    SIZE = 1 << 16

    def __init__(self, sock):
        self.sock, self.buf = sock, memoryview(bytearray(self.SIZE))
        self.start = self.end = 0
        self.pending = b""  # bytes to send in front of the next request (ps.tcp's handshake)
        self.deadline, self.timeout_set = 0.0, False

    def begin(self, deadline: float, timeout_set: bool = False) -> None:
        """A message is due by `deadline` (the socket's timeout may already say so)."""
        self.deadline, self.timeout_set = deadline, timeout_set

    def _fill(self, view, got: int, need: int, idle: bool) -> int:
        while got < need:
            if not self.timeout_set:  # every recv after the first gets only the time left
                self.sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
            self.timeout_set = False
            k = self.sock.recv_into(view[got:])
            if not k:
                raise EOFError("connection closed" if idle and not got else
                               f"connection closed after {got} of {need} bytes")
            got += k
        return got

    def read(self, n: int, *, idle: bool = False, own: bool = False) -> memoryview:
        """n bytes (EOFError if the peer closes; socket.timeout past the deadline). The
        view is valid until the next read unless `own`: then it is the caller's."""
        have = self.end - self.start
        if n > self.SIZE or (own and n > have):
            # Not bytearray(n): zeroing 40 MB first cost as much as a copy. With
            # ps.allocator's settings the memory of the last message is reused.
            out = memoryview(np.empty(n, np.uint8))
            take = min(have, n)
            out[:take] = self.buf[self.start:self.start + take]
            self.start += take
            self._fill(out, take, n, idle and not take)
            return out
        if have < n:
            if self.start:
                self.buf[:have] = self.buf[self.start:self.end]
                self.start, self.end = 0, have
            self.end = self._fill(self.buf, self.end, n, idle and not have)
        out = self.buf[self.start:self.start + n]
        self.start += n
        return memoryview(bytes(out)) if own else out


def _send(sock, parts, deadline: float) -> None:
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS sockets
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:  # sendmsg may send part of the list: go on from where it stopped
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def _message(first: int, meta: dict | list, payload) -> list:
    """The parts of one message; `payload` is bytes or a list of parts (sent as they are,
    with no copy to join them)."""
    parts = payload if isinstance(payload, list) else [payload]
    size = sum(memoryview(p).nbytes for p in parts)
    text = json.dumps(meta, separators=(",", ":")).encode()
    return [_HEAD.pack(MAGIC, first, len(text), size), text, *parts]


class _Aborted(Exception):
    def __init__(self, code, details, fault):
        super().__init__(details)
        self.code, self.details, self.fault = code, details, fault


class _Call:
    """What the servicer's handlers and ps.admission ask of a gRPC context, for one call
    on a connection; `reply` sends at most once (a cancelled call has answered already)."""

    ps_authenticated = True  # the connection did the handshake (or the run has no token)

    def __init__(self, conn, metadata: tuple, deadline: float):
        self.conn, self.metadata, self.deadline = conn, metadata, deadline
        self.trailing: tuple = ()
        self._lock = threading.Lock()
        self._replied = False

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, metadata):
        self.trailing = tuple(metadata)

    def abort(self, code, details):
        raise _Aborted(code, details, dict(self.trailing).get(FAULT_KEY))

    def reply(self, code, details: str = "", fault=None, payload=b"") -> bool:
        with self._lock:
            if self._replied:
                return False
            self._replied = True
            meta = {"details": details, "fault": fault} if code != grpc.StatusCode.OK else {}
            _send(self.conn, _message(code.value[0], meta, payload), self.deadline)
            return True

    def cancel(self):
        """The shard's call deadline passed: say so, then end the connection."""
        try:
            self.reply(grpc.StatusCode.CANCELLED, "the shard's call deadline passed")
        except OSError:
            pass
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class DataServer:
    """Accepts data connections for one ShardServicer; one thread per connection."""

    def __init__(self, servicer, bind: str, max_message_bytes: int, num_workers: int,
                 tls_cert: str = "", tls_key: str = "", log=print):
        self.servicer, self.max_bytes, self.log = servicer, max_message_bytes, log
        self.deadline_s, self.slots = servicer.gate.deadline_s, ConnectionSlots(
            pool_size(num_workers), log)
        self.handlers = {PUSH_ONE: lambda r, c: servicer.push(iter((r,)), c),
                         PULL_ONE: lambda r, c: servicer.pull_one(r, c, join=False),
                         PUSH_PULL_ONE: lambda r, c: servicer.push_pull_one(r, c, join=False),
                         CONTROL: servicer.control}
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER) if tls_cert else None
        if tls_cert:
            self.tls.load_cert_chain(tls_cert, tls_key)
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        try:
            self.sock = socket.create_server((bind, 0), family=family)
        except OSError as e:
            raise UsageError(f"cannot open a data port on {bind}: {e.strerror or e}") from None
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name="ps-data-accept", daemon=True).start()

    def _accept(self) -> None:
        self.slots.accept_forever(self.sock, lambda slot: threading.Thread(
            target=self._serve, args=(slot,), name="ps-data", daemon=True).start())

    def _serve(self, slot) -> None:
        conn, why = slot.sock, None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:  # the handshake is part of the pre-auth time
                conn.settimeout(max(1e-3, slot.deadline - time.monotonic()))
                # Not handshaken on wrapping: the slot holds the live TLS socket while it
                # waits, so dropping it (ps.data_slots) shuts its descriptor down. wrap_socket
                # detaches the accepted socket, whose shutdown() would then hit nothing.
                conn = self.tls.wrap_socket(conn, server_side=True,
                                            do_handshake_on_connect=False)
                slot.sock = conn
                conn.do_handshake()
            reader = _Reader(conn)
            if self.servicer.token and not self._handshake(conn, reader, slot):
                why = "unauthenticated"
                return
            while self._one_call(conn, reader, slot):
                pass
        except (OSError, EOFError) as e:  # peer gone, timed out or cancelled (ssl.SSLError
            why = "timed_out" if isinstance(e, socket.timeout) else None  # is an OSError)
        except Exception as e:  # a bug, not the peer's doing: one line, never a traceback
            self.log(f"data port: a connection ended by {type(e).__name__}: {str(e)[:200]}")
        finally:
            # out of the waiting list first: its descriptor number is then free to reuse
            self.slots.release(slot, why)
            conn.close()

    def _take_slot(self, conn, slot) -> bool:
        """An authenticated connection into a slot; with every slot held it is answered
        UNAVAILABLE (the worker makes that call over gRPC) and ends."""
        if self.slots.authenticate(slot):
            return True
        try:
            _send(conn, _message(grpc.StatusCode.UNAVAILABLE.value[0], {
                "details": "the data port has no free slot", "fault": None}, b""),
                time.monotonic() + 1.0)
        except OSError:
            pass
        return False

    def _handshake(self, conn, reader: _Reader, slot) -> bool:
        """ps.security's handshake, shard side, within the pre-auth deadline: False when
        the peer failed it (the caller counts it: ps.data_slots logs counts rate-limited)."""
        reader.begin(slot.deadline)
        magic, client_nonce = _CLIENT_HELLO.unpack(reader.read(_CLIENT_HELLO.size, idle=True))
        if magic != HELLO:
            return False
        shard_nonce = security.new_nonce()
        binding = security.channel_binding("data", self.servicer.shard, self.port)
        proof = security.shard_proof(self.servicer.token, client_nonce, shard_nonce, binding)
        _send(conn, [_SHARD_HELLO.pack(HELLO, shard_nonce, proof)], slot.deadline)
        reader.begin(slot.deadline)
        answer = bytes(reader.read(security.PROOF_BYTES))
        try:
            security.check(security.client_proof(self.servicer.token, client_nonce,
                                                 shard_nonce, binding), answer, "the client")
        except security.HandshakeError:
            return False
        return True

    def _one_call(self, conn, reader: _Reader, slot) -> bool:
        """Serve one request; False when the connection must end."""
        # A connection takes its slot with its first call (after the handshake, if any),
        # whose header it has until slot.deadline to send; then it idles to the call's.
        reader.begin(time.monotonic() + self.deadline_s if slot.authed else slot.deadline)
        head = reader.read(_HEAD.size, idle=True)
        deadline = time.monotonic() + self.deadline_s  # the whole request, once it starts
        reader.begin(deadline, timeout_set=slot.authed)
        magic, method, meta_len, size = _HEAD.unpack(head)
        if magic != MAGIC or method not in self.handlers or meta_len > MAX_META_BYTES:
            return False
        call = _Call(conn, (), deadline)
        try:
            pairs = wire.loads(reader.read(meta_len), "call metadata", MAX_META_BYTES)
            if not (isinstance(pairs, list) and all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                    for p in pairs)):
                raise wire.WireError("metadata must be [key, value] string pairs")
        except wire.WireError as e:
            call.reply(grpc.StatusCode.INVALID_ARGUMENT, f"bad call metadata: {str(e)[:120]}")
            return False
        call.metadata = tuple(tuple(p) for p in pairs)
        if not slot.authed and not self._take_slot(conn, slot):
            return False
        if size > self.max_bytes:
            call.reply(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message of {size} bytes exceeds "
                       f"the limit of {self.max_bytes} (--ps-max-message-mb)")
            return False
        request = reader.read(size)  # the handler is done with it before the next read
        try:
            result = self.handlers[method](request, call)
        except _Aborted as e:
            return call.reply(e.code, e.details, e.fault)
        except Exception as e:  # a bug must not kill the shard; the caller sees INTERNAL
            call.reply(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {str(e)[:200]}")
            return False
        call.deadline = time.monotonic() + self.deadline_s
        return call.reply(grpc.StatusCode.OK, payload=result)


def client_handshake(sock, reader: _Reader, token: str, shard: int, port: int,
                     deadline: float) -> bytes:
    """ps.security's handshake on a data connection, client side: the shard proves itself
    first; returns this side's proof, for the caller to send only now that the shard has
    (HandshakeError if it has not, socket.timeout or EOFError if it did not answer)."""
    client_nonce = security.new_nonce()
    _send(sock, [_CLIENT_HELLO.pack(HELLO, client_nonce)], deadline)
    reader.begin(deadline)
    magic, shard_nonce, proof = _SHARD_HELLO.unpack(reader.read(_SHARD_HELLO.size))
    if magic != HELLO:
        raise security.HandshakeError(f"the data port of shard {shard} did not answer the "
                                      f"handshake")
    binding = security.channel_binding("data", shard, port)
    security.check(security.shard_proof(token, client_nonce, shard_nonce, binding), proof,
                   f"the data port of shard {shard}")
    return security.client_proof(token, client_nonce, shard_nonce, binding)


class DataChannel:
    """A worker's connections to one shard's data port. `method(id)` is called like a gRPC
    unary multi-callable: (request, timeout, metadata) -> reply bytes, or CallError."""

    def __init__(self, host: str, resolve, tls_cert: str = "",
                 max_message_bytes: int = 64 << 20, token: str = "", shard: int = 0):
        self.host, self.resolve, self.port = host, resolve, None
        self.token, self.shard = token, shard  # for the handshake (never sent)
        # a reply is the parameters of a request under the limit, plus a reply frame
        self.max_reply = max_message_bytes + MAX_META_BYTES
        self.tls = ssl.create_default_context(cafile=tls_cert) if tls_cert else None
        self._idle: list = []
        self._lock = threading.Lock()

    def method(self, method: int) -> "_Method":
        return _Method(self, method)

    def _connection(self, deadline: float):
        with self._lock:
            while self._idle:
                sock, reader = self._idle.pop()
                # An idle connection the shard closed (its idle deadline, a restart) reads
                # as ready: drop it rather than send a request into it.
                if not select.select([sock], [], [], 0)[0]:
                    return sock, reader
                sock.close()
        if self.port is None:
            self.port = self.resolve()  # a grpc.RpcError (UNAVAILABLE) while the shard is down
        try:
            sock = socket.create_connection((self.host, self.port),
                                            timeout=max(1e-3, deadline - time.monotonic()))
        except OSError as e:
            self.port = None  # a restarted shard listens on another port: ask again
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"data port: {e}") from None
        port = self.port
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:  # the handshake: a wrong certificate is an ssl.SSLError (OSError)
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            reader = _Reader(sock)
            proof = (client_handshake(sock, reader, self.token, self.shard, port,
                                      min(deadline, time.monotonic() + security.HANDSHAKE_S))
                     if self.token else b"")
        except (OSError, EOFError, security.HandshakeError) as e:
            sock.close()
            self.port = None  # a shard that does not prove itself: ask where it is again
            if isinstance(e, socket.timeout):
                e = "the shard did not answer the handshake"
            raise CallError(grpc.StatusCode.UNAVAILABLE,
                            f"data port {self.host}:{port}: {e}") from None
        reader.pending = proof  # the client's proof goes out in front of the first request
        return sock, reader

    def send(self, method: int, request, timeout, metadata):
        """Send a request now; (connection, its reader) to read the reply from."""
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        sock, reader = self._connection(deadline)
        first, reader.pending = reader.pending, b""
        try:
            _send(sock, [first] + _message(method, [list(p) for p in metadata or ()
                                                    if p[0] != security.SESSION_KEY],
                                           request), deadline)
        except socket.timeout:
            sock.close()
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as e:
            sock.close()
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"data port: {e}") from None
        reader.begin(deadline, timeout_set=True)  # _send set the socket's timeout
        return sock, reader

    def reply(self, sock, reader: _Reader) -> memoryview:
        """The reply to the request sent on `sock`, or CallError."""
        try:
            head = reader.read(_HEAD.size)
            magic, status, meta_len, size = _HEAD.unpack(head)
            if magic != MAGIC or meta_len > MAX_META_BYTES or status not in _CODES:
                raise EOFError("a reply that is not a jaxdist data frame")
            if size > self.max_reply:
                raise EOFError(f"a reply of {size} bytes, over the message limit")
            meta = wire.loads(reader.read(meta_len), "reply metadata", MAX_META_BYTES)
            payload = reader.read(size, own=True)  # read by the caller after we reuse sock
        except socket.timeout:
            sock.close()
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, EOFError, ValueError) as e:
            sock.close()
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"data port: {e}") from None
        with self._lock:
            self._idle.append((sock, reader))
        if status:
            raise CallError(_CODES[status], str(meta.get("details", "")), meta.get("fault"))
        return payload

    def call(self, method: int, request, timeout, metadata) -> memoryview:
        return self.reply(*self.send(method, request, timeout, metadata))

    def close(self) -> None:
        with self._lock:
            for sock, _ in self._idle:
                sock.close()
            self._idle.clear()


class _Method:
    """One method of a DataChannel, called like a gRPC unary multi-callable; `start` sends
    on the caller's thread and returns what `.result()` reads the reply from."""

    def __init__(self, channel: DataChannel, method: int):
        self.channel, self.method = channel, method

    def __call__(self, request, timeout=None, metadata=None) -> memoryview:
        return self.channel.call(self.method, request, timeout, metadata)

    def start(self, request, timeout=None, metadata=None) -> "_Pending":
        try:
            return _Pending(self.channel, self.channel.send(self.method, request, timeout,
                                                            metadata))
        except grpc.RpcError as e:  # CallError, or the gRPC lookup of a new data port
            return _Pending(self.channel, error=e)


class _Pending:
    """A request on the wire: `.result()` is its reply or raises its error (a
    grpc.RpcError, as the retries in ps.shard_client expect)."""

    def __init__(self, channel: DataChannel, sent=None, error: grpc.RpcError | None = None):
        self.channel, self.sent, self.error = channel, sent, error

    def result(self) -> memoryview:
        if self.error is not None:
            raise self.error
        return self.channel.reply(*self.sent)
