"""Who a worker talks to: ps.security's handshake on both ports of a real shard, a process
squatting a crashed shard's ports during a run, and a TLS flood against the data port's cap.

The handshake's promises, each asserted on bytes: a shard with another token is refused
before the worker proves anything; a worker with another token is closed unanswered and
counted; a recorded transcript, or a proof sent back where it came from, does not open a
connection; the token never crosses a socket."""

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import optax
import pytest

from ps import security
from ps.admission import NONCE_KEY
from ps.shard_client import PSError
from ps.tcp import HELLO, PULL_ONE, CallError, DataChannel
from tests.helpers import ROOT, PeerThread, child_env
from tests.test_ps_hostile import RUN, Shard, _data_pull, _open_fds
from tests.test_ps_server import TOKEN, shard_client

OTHER = "another-token-of-32-characters!!"


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    s = Shard(tmp_path_factory.mktemp("auth"))
    yield s
    s.stop()


def _recv_exactly(sock, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _closed_unanswered(sock) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def _stats(shard) -> dict:
    c = shard_client(shard.address)
    try:
        return c.control("stats")
    finally:
        c.close()


# -- the proofs ---------------------------------------------------------------------------

def test_proofs_are_bound_to_their_direction_port_and_process():
    nc, ns = security.new_nonce(), security.new_nonce()
    here = security.channel_binding("data", 0, 4000)
    proof = security.shard_proof(TOKEN, nc, ns, here)
    security.check(proof, security.shard_proof(TOKEN, nc, ns, here), "x")
    for other in (security.client_proof(TOKEN, nc, ns, here),          # the other direction
                  security.shard_proof(TOKEN, nc, ns, security.channel_binding("data", 0, 4001)),
                  security.shard_proof(TOKEN, nc, ns, security.channel_binding("grpc", 0, 4000)),
                  security.shard_proof(TOKEN, nc, ns, security.channel_binding("data", 1, 4000)),
                  security.shard_proof(OTHER, nc, ns, here),
                  security.shard_proof(TOKEN, security.new_nonce(), ns, here)):
        with pytest.raises(security.HandshakeError):
            security.check(proof, other, "x")
    a, b = security.ShardNonces(), security.ShardNonces()
    nonce = a.issue()
    assert a.valid(nonce) and not b.valid(nonce)           # another process: refused
    assert not a.valid(nonce[:-1] + bytes([nonce[-1] ^ 1]))
    assert not a.valid(a.issue(now=time.time() - security.SESSION_S - 5))  # expired


def test_ready_files_are_created_readable_by_this_user_only(tmp_path, monkeypatch):
    old = os.umask(0)  # even with no umask at all
    try:
        # created with its mode: no chmod afterwards, so never wider for a moment
        monkeypatch.setattr(os, "chmod", None)
        monkeypatch.setattr(os, "fchmod", None)
        security.write_private_json(tmp_path / "shard0.ready.json", {"port": 1})
        security.write_private_json(tmp_path / "shard0.ready.json", {"port": 2})
    finally:
        os.umask(old)
    path = tmp_path / "shard0.ready.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"port": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard0.ready.json"]


# -- a shard with another token -----------------------------------------------------------

def test_a_shard_with_another_token_is_refused_before_the_worker_proves_anything():
    """A fake data port answers the hello with a proof under another token: the worker
    sends its hello (a nonce) and nothing else, and the call fails naming the shard."""
    got = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def fake():
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(5)
                hello = _recv_exactly(conn, 36)
                nonce, mine = hello[4:], security.new_nonce()
                conn.sendall(HELLO + mine + security.shard_proof(
                    OTHER, nonce, mine, security.channel_binding("data", 0, port)))
                data = hello
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                except OSError:
                    pass
                got.append(data)
        t = threading.Thread(target=fake)
        t.start()
        channel = DataChannel("127.0.0.1", lambda: port, token=TOKEN)
        with pytest.raises(CallError) as e:
            channel.call(PULL_ONE, b"pull", 5, (("x-jaxdist-worker", "0"),))
        t.join(10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "did not prove it holds the run's token" in e.value.details()
    assert len(got[0]) == 36 and got[0].startswith(HELLO)   # the hello, nothing more


def test_a_worker_with_another_token_is_told_the_shard_did_not_prove_itself(shard):
    start = time.monotonic()
    c = shard_client(shard.address, token=OTHER)
    with pytest.raises(PSError, match=r"shard 0 at .* UNAUTHENTICATED: .*did not prove"):
        c.control("ping")
    c.close()
    assert time.monotonic() - start < 5  # at once: not retried until the call's timeout


# -- a worker with another token ----------------------------------------------------------

def test_a_worker_with_another_token_is_closed_unanswered_and_counted(shard):
    before = _stats(shard)
    # data port: a hello, the shard's proof, then a proof under another token and a request
    sock = socket.create_connection(("127.0.0.1", shard.data_port), timeout=10)
    with sock:
        nonce = security.new_nonce()
        sock.sendall(HELLO + nonce)
        reply = _recv_exactly(sock, 68)
        assert reply[:4] == HELLO
        binding = security.channel_binding("data", 0, shard.data_port)
        sock.sendall(security.client_proof(OTHER, nonce, reply[4:36], binding) + b"JDT1")
        assert _closed_unanswered(sock)
    # gRPC: a session ticket made with another token
    channel = grpc.insecure_channel(shard.address)
    nonce = security.new_nonce()
    answer = json.loads(channel.unary_unary("/jaxdist.ps.Shard/Auth")(
        b"", timeout=5, metadata=((NONCE_KEY, nonce.hex()),)))
    port = int(shard.address.rsplit(":", 1)[1])
    ns = bytes.fromhex(answer["nonce"])
    wrong = security.session_ticket(nonce, ns, security.client_proof(
        OTHER, nonce, ns, security.channel_binding("grpc", 0, port)))
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/jaxdist.ps.Shard/Control")(
            b"", timeout=5, metadata=((security.SESSION_KEY, wrong),))
    channel.close()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = _stats(shard)
    assert (after["data_port_connections"]["unauthenticated"]
            == before["data_port_connections"]["unauthenticated"] + 1)
    assert after["grpc_refused_calls"] == before["grpc_refused_calls"] + 1
    log = shard.log()
    assert "failed the handshake" in log and "gRPC port: 1 call(s) refused" in log
    assert "Traceback" not in log


# -- replays ------------------------------------------------------------------------------

def test_a_replayed_transcript_or_a_reflected_proof_opens_nothing(shard):
    port = shard.data_port
    binding = security.channel_binding("data", 0, port)
    # a good connection, recorded
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        nonce = security.new_nonce()
        sock.sendall(HELLO + nonce)
        first = _recv_exactly(sock, 68)
        proof = security.client_proof(TOKEN, nonce, first[4:36], binding)
        security.check(security.shard_proof(TOKEN, nonce, first[4:36], binding), first[36:],
                       "the shard")
    # the same hello and the same proof again: the shard's nonce is new, the proof stale
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HELLO + nonce)
        second = _recv_exactly(sock, 68)
        assert second[4:36] != first[4:36]
        sock.sendall(proof + b"JDT1")
        assert _closed_unanswered(sock)
    # the shard's own proof sent back to it as the worker's (reflection)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HELLO + nonce)
        third = _recv_exactly(sock, 68)
        sock.sendall(third[36:] + b"JDT1")
        assert _closed_unanswered(sock)
    # gRPC: a ticket carrying the shard's proof in place of the worker's
    channel = grpc.insecure_channel(shard.address)
    answer = json.loads(channel.unary_unary("/jaxdist.ps.Shard/Auth")(
        b"", timeout=5, metadata=((NONCE_KEY, nonce.hex()),)))
    reflected = security.session_ticket(nonce, bytes.fromhex(answer["nonce"]),
                                        bytes.fromhex(answer["proof"]))
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/jaxdist.ps.Shard/Control")(
            b"", timeout=5, metadata=((security.SESSION_KEY, reflected),))
    channel.close()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # and the real worker still gets in
    assert len(_data_pull(port)) > 0


# -- a squatter on a crashed shard's ports ------------------------------------------------

H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


class Squatter(PeerThread):
    """Takes shard 0's two ports the moment they are free (SO_REUSEADDR, spinning on
    bind, as the hostile peer did), then keeps every byte each connection sends. It plays
    along: HTTP/2 SETTINGS on the gRPC port (so a client sends its call's headers), and on
    the data port a hello with a proof it cannot make right (so a worker that did not check
    would send its own)."""

    def __init__(self, ready_file, limit_s: float = 120.0):
        super().__init__()
        self.ready_file, self.limit_s = ready_file, limit_s
        self.ports: dict = {}
        self.captured: dict = {"grpc": [], "data": []}
        self.stop_event = threading.Event()

    def _run(self):
        end = time.monotonic() + self.limit_s
        while not self.ready_file.exists():
            if self.stop_event.wait(0.02) or time.monotonic() > end:
                return
        info = json.loads(self.ready_file.read_text())
        wanted = {"grpc": info["port"], "data": info["data_port"]}
        listeners = {}
        while len(listeners) < 2 and time.monotonic() < end and not self.stop_event.is_set():
            for kind, port in wanted.items():
                if kind in listeners:
                    continue
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                    s.listen(64)
                    listeners[kind] = s
                except OSError:
                    s.close()
            time.sleep(0.005)
        self.ports = {k: s.getsockname()[1] for k, s in listeners.items()}
        for kind, s in listeners.items():
            threading.Thread(target=self._accept, args=(kind, s), daemon=True).start()
        self.stop_event.wait(end - time.monotonic())
        for s in listeners.values():
            s.close()

    def _accept(self, kind, listener):
        while not self.stop_event.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._keep, args=(kind, conn), daemon=True).start()

    def _keep(self, kind, conn):
        data = bytearray()
        self.captured[kind].append(data)
        with conn:
            conn.settimeout(0.5)
            try:
                if kind == "grpc":
                    conn.sendall(H2_SETTINGS)
                else:
                    data += _recv_exactly(conn, 36)
                    conn.sendall(HELLO + os.urandom(64))
                while not self.stop_event.is_set():
                    try:
                        chunk = conn.recv(65536)
                    except socket.timeout:
                        continue
                    if not chunk:
                        return
                    data += chunk
            except OSError:
                return


def test_a_squatter_on_a_crashed_shards_ports_gets_nothing_that_authenticates(tmp_path):
    """Shard 0 of a sync run is SIGKILLed at version 5; a process takes both its ports at
    once. The run's workers and launcher reach the restarted shard on its new ports (its
    ready file) and finish every step; what the squatter got is hellos and nonces: never
    the token, no session ticket, no data call, no worker proof."""
    from jaxdist.record import RunRecord

    logdir = tmp_path / "run"
    squatter = Squatter(logdir / "ps" / "shard0.ready.json")
    squatter.start()
    env = {**child_env(), "JAXDIST_PS_TOKEN": TOKEN, "JAXDIST_PS_FAULT": "kill-shard:0:5"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *RUN[:-2],
             "--ps-checkpoint-every", "2", "--logdir", str(logdir), "--no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        time.sleep(0.5)  # the squatter's last reads
    finally:
        squatter.stop_event.set()
        squatter.join(10)
    assert squatter.error is None, squatter.error
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = RunRecord.load(logdir).results
    assert [x["shard"] for x in r["ps"]["shard_restarts"]] == [0]
    assert len(r["loss"]) == 12 and np.isfinite(r["loss"]).all()
    assert set(squatter.ports) == {"grpc", "data"}, "the squatter never got the ports"
    now = json.loads((logdir / "ps" / "shard0.ready.json").read_text())
    assert {now["port"], now["data_port"]}.isdisjoint(squatter.ports.values())
    grpc_bytes = [bytes(b) for b in squatter.captured["grpc"]]
    data_bytes = [bytes(b) for b in squatter.captured["data"]]
    everything = b"".join(grpc_bytes + data_bytes)
    # the clients did come to it (retrying the ports they knew, until the ready file moved)
    assert everything.count(b"/jaxdist.ps.Shard/Auth") + len(data_bytes) >= 1
    assert TOKEN.encode() not in everything
    assert b"x-jaxdist-session" not in everything            # no session ticket
    for method in (b"Push", b"Pull", b"Control", b"PushOne", b"PullOne", b"PushPullOne"):
        assert b"/jaxdist.ps.Shard/" + method + b"\x40" not in everything  # :path, then
        assert b"/jaxdist.ps.Shard/" + method not in everything.replace(  # the next header
            b"/jaxdist.ps.Shard/Auth", b"")
    # the data port: one hello per connection (magic and a nonce), then nothing
    for data in data_bytes:
        assert len(data) in (0, 36) and data[:4] in (b"", HELLO), data[:80]
    print(f"squatter: {len(grpc_bytes)} gRPC connection(s), {sum(map(len, grpc_bytes))} "
          f"bytes (Auth calls: {everything.count(b'/jaxdist.ps.Shard/Auth')}); "
          f"{len(data_bytes)} data connection(s), {sum(map(len, data_bytes))} bytes")


# -- a TLS flood against the data port's cap ----------------------------------------------

def test_a_tls_flood_keeps_the_shards_descriptors_under_its_cap(tmp_path):
    """400 raw connects to a TLS shard's data port, held open without a ClientHello: each
    waits in its TLS handshake. The cap closed the detached plain socket, not the TLS one,
    so every connection stayed (descriptors rose by one per connect). Now the oldest waiting
    connection is shut down on its live descriptor: the shard's descriptors stay within
    MAX_WAITING of where they were, and a worker still gets in."""
    import shutil

    from ps.data_slots import MAX_WAITING
    from tests.test_ps_server import make_cert

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = make_cert(tmp_path)
    shard = Shard(tmp_path, "--ps-tls-cert", str(cert), "--ps-tls-key", str(key))
    socks, most = [], 0
    try:
        pid = shard.proc.pid
        base = _open_fds(pid)
        end = time.monotonic() + 10
        for i in range(400):
            if time.monotonic() > end:
                break
            try:
                socks.append(socket.create_connection(("127.0.0.1", shard.data_port),
                                                      timeout=2))
            except OSError:
                pass
            if i % 20 == 19:
                most = max(most, _open_fds(pid))
        time.sleep(0.3)
        most = max(most, _open_fds(pid))
        channel = DataChannel("127.0.0.1", lambda: shard.data_port, str(cert), token=TOKEN)
        try:
            pull = b"".join(bytes(p) for p in [channel.call(PULL_ONE, _pull_frame(), 10,
                                                            (("x-jaxdist-worker", "0"),))])
        finally:
            channel.close()
    finally:
        for s in socks:
            s.close()
        shard.stop()
    assert len(socks) >= 300
    assert most - base <= MAX_WAITING + 8, (base, most)
    assert len(pull) > 0
    print(f"{len(socks)} held connects: shard descriptors {base} -> at most {most} "
          f"(cap: {MAX_WAITING} waiting)")


def _pull_frame() -> bytes:
    from ps import wire

    return wire.encode({"op": "pull", "worker": 0, "step": 0, "min_version": 0, "epoch": 0})


# -- a snapshot that cannot be written ----------------------------------------------------

def test_a_failed_snapshot_does_not_fail_the_push_it_follows(tmp_path):
    from ps.core import ShardCore

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    said = []
    c = ShardCore(np.ones(8, np.float32), optax.sgd(0.1), mode="async", num_workers=1,
                  checkpoint_every=1, snapshot_dir=blocker / "shard0", log=said.append)
    for step in range(3):
        assert c.push(0, step, c.version, 0, np.ones(8, np.float32))["status"] == "applied"
    assert c.version == 3
    assert c.accounting.counts["snapshot_failures"] == 3
    assert len(said) == 1 and str(blocker / "shard0") in said[0], said  # the path, once
