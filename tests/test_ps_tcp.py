"""The shard's data port (ps.tcp): one-message pushes and pulls over plain TCP beside gRPC,
against a real `python -m ps.server`: the same results as over gRPC, the token checked
before a payload is read, the message limit, TLS, deadlines on idle and partial requests,
and the connection cap."""

import json
import shutil
import socket
import time

import grpc
import numpy as np
import pytest

from ps.security import HandshakeError
from ps.admission import pool_size
from ps.client import PSClient
from ps.shardmap import shard_map_for
from ps.tcp import (_HEAD, MAGIC, PULL_ONE, PUSH_ONE, CallError, DataChannel, _Call, _Reader,
                    client_handshake)
from tests.helpers import job_of
from tests.test_ps_server import (CFG, TOKEN, make_cert, server_env, start_server,
                                  stop_server)

SMAP = shard_map_for(job_of(CFG), 1)


def client(port, worker=0, transport="tcp", **kw):
    c = PSClient([f"127.0.0.1:{port}"], SMAP, worker, "async", max_message_bytes=64 << 20,
                 timeout_s=5, transport=transport, **kw)
    c.connect()
    return c


def reply_head(sock) -> tuple:
    """(magic, status, metadata length, size) of the reply on `sock`, read whole."""
    head = b""
    while len(head) < _HEAD.size:
        chunk = sock.recv(_HEAD.size - len(head))
        assert chunk, "closed without a reply"
        head += chunk
    return _HEAD.unpack(head)


def connect(port, token=TOKEN):
    """A connection to a data port that did ps.security's handshake (with `token`) and sent
    its proof: the shard then reads calls on it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if token:
        sock.sendall(client_handshake(sock, _Reader(sock), token, 0, port,
                                      time.monotonic() + 10))
    return sock


def raw_call(port, method, metadata, size, payload=b"", token=TOKEN):
    """Send one request by hand; (status code, details) of the reply and whether the shard
    closed the connection after it."""
    sock = connect(port, token)
    meta = json.dumps(metadata).encode()
    with sock:
        sock.sendall(_HEAD.pack(MAGIC, method, len(meta), size) + meta + payload)
        magic, status, meta_len, _ = reply_head(sock)
        assert magic == MAGIC
        body = b""
        while len(body) < meta_len:
            body += sock.recv(meta_len - len(body))
        sock.settimeout(1.0)  # well before the shard's idle deadline (--ps-timeout-s + 2)
        try:
            closed = sock.recv(1) == b""
        except socket.timeout:
            closed = False
    return status, json.loads(body)["details"], closed


@pytest.fixture(scope="session")
def token_server(tmp_path_factory):
    """(gRPC port, data port) of a shard that requires the token."""
    proc, port = start_server(tmp_path_factory.mktemp("tcp"),
                              env=server_env(JAXDIST_PS_TOKEN=TOKEN))
    c = client(port, token=TOKEN)
    yield port, c.shards[0].data.port
    c.close()
    stop_server(proc)


def test_data_calls_go_over_the_data_port_and_match_grpc(token_server):
    tcp = client(token_server[0], token=TOKEN)
    assert tcp.shards[0].data is not None and tcp.shards[0].data.port
    flat = np.empty(SMAP.total, np.float32)
    tcp.pull(0, flat)
    grad = np.linspace(-1, 1, SMAP.total, dtype=np.float32)
    assert tcp.push(0, grad)[0]["status"] == "applied"
    stats = tcp.shards[0].control("stats")
    assert stats["bytes_in"] >= SMAP.total * 4      # the push arrived, over the data port
    over_tcp, over_grpc = np.empty_like(flat), np.empty_like(flat)
    tcp.pull(1, over_tcp)
    plain = client(token_server[0], token=TOKEN, transport="grpc")
    assert plain.shards[0].data is None
    plain.pull(0, over_grpc)
    np.testing.assert_array_equal(over_tcp, over_grpc)
    assert not np.array_equal(over_tcp, flat)       # the push moved the parameters
    # what carried the bytes is counted as such (results label it by transport)
    assert tcp.shards[0].bytes_by["grpc"] == 0
    assert tcp.shards[0].bytes_by["tcp"] > 3 * flat.nbytes
    assert plain.shards[0].bytes_by == {"tcp": 0, "grpc": plain.shards[0].bytes_by["grpc"]}
    assert plain.shards[0].bytes_by["grpc"] > flat.nbytes
    tcp.close()
    plain.close()


def test_the_handshake_comes_before_the_size_and_before_any_payload(token_server):
    data_port = token_server[1]
    worker = ["x-jaxdist-worker", "0"]
    # a wrong token: the shard's proof does not check out, so the client sends nothing more
    with pytest.raises(HandshakeError):
        connect(data_port, token="wrong" * 8)
    # no handshake at all: a request straight away is closed unanswered
    with socket.create_connection(("127.0.0.1", data_port), timeout=10) as sock:
        meta = json.dumps([worker]).encode()
        sock.sendall(_HEAD.pack(MAGIC, PUSH_ONE, len(meta), 1 << 40) + meta)
        assert sock.recv(100) == b""
    status, details, closed = raw_call(data_port, PUSH_ONE, [worker], 1 << 40)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and closed
    assert "--ps-max-message-mb" in details
    status, details, closed = raw_call(data_port, PULL_ONE, {"not": "pairs"}, 0)
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and closed
    # a malformed frame is the servicer's: refused, and the connection stays usable
    status, details, closed = raw_call(data_port, PULL_ONE, [worker], 4, b"JDP1")
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not closed


def test_bytes_sent_from_a_kept_thread_count_as_the_data_ports(token_server, monkeypatch):
    """A request over INLINE_SEND_BYTES is sent from one of the client's threads: the
    transport it took is still the one its bytes are counted under."""
    monkeypatch.setattr("ps.shard_client.INLINE_SEND_BYTES", 0)
    c = client(token_server[0], token=TOKEN)
    flat = np.empty(SMAP.total, np.float32)
    c.pull(0, flat)
    assert c.push(0, np.ones(SMAP.total, np.float32))[0]["status"] in ("applied",
                                                                        "deduplicated")
    assert c.shards[0].bytes_by["grpc"] == 0 and c.shards[0].bytes_by["tcp"] > 2 * flat.nbytes
    c.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_covers_the_data_port(tmp_path):
    cert, key = make_cert(tmp_path)
    proc, port = start_server(tmp_path, "--ps-tls-cert", str(cert), "--ps-tls-key", str(key))
    try:
        c = client(port, tls_cert=str(cert))
        assert c.shards[0].data is not None
        flat = np.empty(SMAP.total, np.float32)
        c.pull(0, flat)
        assert c.push(0, np.ones(SMAP.total, np.float32))[0]["status"] == "applied"
        data_port = c.shards[0].data.port
        c.close()
        with socket.create_connection(("127.0.0.1", data_port), timeout=10) as sock:
            sock.sendall(_HEAD.pack(MAGIC, PULL_ONE, 2, 0) + b"[]")  # in clear: no answer
            try:
                got = sock.recv(64)
            except ConnectionResetError:
                got = b""
            assert not got.startswith(MAGIC)
    finally:
        stop_server(proc)


def test_idle_and_partial_requests_end_at_their_deadlines(tmp_path):
    """Before it authenticates a connection has PRE_AUTH_S for its header and metadata;
    an authenticated request must arrive whole within the call deadline."""
    from ps.data_slots import PRE_AUTH_S

    proc, port = start_server(tmp_path, "--ps-timeout-s", "1")  # call deadline 1 + 2 s
    try:
        port = client(port).shards[0].data.port
        for blob, lo, hi in ((b"", PRE_AUTH_S - 0.5, PRE_AUTH_S + 3),
                             (_HEAD.pack(MAGIC, PUSH_ONE, 2, 100), PRE_AUTH_S - 0.5,
                              PRE_AUTH_S + 3),  # no metadata
                             (_HEAD.pack(MAGIC, PUSH_ONE, 2, 100) + b"[]" + bytes(10), 2.5, 8)):
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                sock.sendall(blob)
                t0 = time.monotonic()
                assert sock.recv(1) == b""
                assert lo < time.monotonic() - t0 < hi, blob
    finally:
        stop_server(proc)


def _held_call(port, meta):
    """A connection that made one authenticated call (a malformed pull: INVALID_ARGUMENT,
    and the connection stays open) and holds it."""
    try:
        sock = connect(port)
    except (OSError, EOFError):  # closed in its handshake: no slot (the shard's answer)
        return None, None
    text = json.dumps(meta).encode()
    try:
        sock.sendall(_HEAD.pack(MAGIC, PULL_ONE, len(text), 4) + text + b"JDP1")
    except OSError:
        sock.close()
        return None, None
    _, status, meta_len, _ = reply_head(sock)
    while meta_len:
        meta_len -= len(sock.recv(meta_len))
    return sock, status


def test_only_authenticated_connections_hold_a_slot(tmp_path):
    from ps.data_slots import MAX_WAITING

    proc, port = start_server(tmp_path, env=server_env(JAXDIST_PS_TOKEN=TOKEN))
    held = []
    try:
        c = client(port, token=TOKEN)
        said = []
        c.shards[0].log = said.append
        data_port = c.shards[0].data.port
        # plain sockets, more than the cap and than may wait: the worker still gets in
        held = [socket.create_connection(("127.0.0.1", data_port))
                for _ in range(MAX_WAITING + 8)]
        flat = np.empty(SMAP.total, np.float32)
        c.pull(0, flat)
        assert c.push(0, np.ones(SMAP.total, np.float32))[0]["status"] == "applied"
        assert c.shards[0].fallbacks == 0 and said == []
        for sock in held:
            sock.close()
        c.close()
        # authenticated connections: the cap holds; one more is UNAVAILABLE, and a worker
        # that needs a new connection then makes its call over gRPC, and says so once
        meta = [["x-jaxdist-worker", "0"]]
        deadline = time.monotonic() + 10
        held = []
        while len(held) < pool_size(2):  # the shard frees slots as it sees closes
            sock, status = _held_call(data_port, meta)
            if status == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                held.append(sock)
            else:
                sock.close()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        extra, status = _held_call(data_port, meta)
        assert status == grpc.StatusCode.UNAVAILABLE.value[0] and extra.recv(1) == b""
        extra.close()
        c = client(port, token=TOKEN)
        c.shards[0].log = said.append
        c.pull(0, flat)
        c.pull(1, flat)
        assert np.isfinite(flat).all()
        assert c.shards[0].fallbacks == 2 and len(said) == 1 and "over gRPC" in said[0]
        assert c.shards[0].bytes_by["tcp"] == 0
        assert c.shards[0].bytes_by["grpc"] > 2 * flat.nbytes   # the two pulls, headers too
        counts = c.shards[0].control("stats")["data_port_connections"]
        assert counts["dropped"] >= 8 and counts["refused"] >= 3, counts
        assert counts["unauthenticated"] == 0
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # back on the data port once the shard has seen the closes
            before = c.shards[0].fallbacks
            c.pull(1, flat)
            if c.shards[0].fallbacks == before:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        c.close()
    finally:
        for sock in held:
            sock.close()
        stop_server(proc)


def test_a_grpc_only_shard_is_used_over_grpc(tmp_path):
    proc, port = start_server(tmp_path, "--ps-transport", "grpc")
    try:
        c = client(port)
        assert "data_port" not in c.shards[0].control("info")
        assert c.shards[0].data is None
        flat = np.empty(SMAP.total, np.float32)
        c.pull(0, flat)
        assert c.push(0, np.ones(SMAP.total, np.float32))[0]["status"] == "applied"
        c.close()
    finally:
        stop_server(proc)


def test_cancel_answers_once_then_ends_the_connection():
    a, b = socket.socketpair()
    with a, b:
        call = _Call(a, (), time.monotonic() + 5)
        call.cancel()
        assert call.reply(grpc.StatusCode.OK, payload=b"late") is False
        head = b.recv(_HEAD.size)
        _, status, meta_len, size = _HEAD.unpack(head)
        assert status == grpc.StatusCode.CANCELLED.value[0] and size == 0
        assert "deadline" in json.loads(b.recv(meta_len))["details"]
        assert b.recv(1) == b""


def test_a_reply_over_the_limit_is_refused_before_it_is_allocated():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        channel = DataChannel("127.0.0.1", lambda: srv.getsockname()[1],
                              max_message_bytes=1 << 20)
        pending = channel.method(PULL_ONE).start(b"x", timeout=5)
        conn, _ = srv.accept()
        with conn:
            conn.sendall(_HEAD.pack(MAGIC, 0, 2, 1 << 50) + b"{}")
            with pytest.raises(CallError) as e:
                pending.result()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "over the message limit" in e.value.details()


def test_a_failed_port_lookup_is_an_error_of_the_call_not_of_start():
    class LookupFailed(grpc.RpcError):  # what the gRPC `info` call raises: not a CallError
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def resolve():
        raise LookupFailed()
    pending = DataChannel("127.0.0.1", resolve).method(PUSH_ONE).start(b"x", timeout=1)
    with pytest.raises(LookupFailed):
        pending.result()
