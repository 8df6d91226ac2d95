"""A shard under a hostile local peer (issue 35): what a peer that is not a worker sends
gets an error status or a closed connection, never a traceback in the shard's log."""

import json
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

from ps import wire
from ps.tcp import _HEAD, MAGIC, PULL_ONE
from tests.helpers import ROOT
from tests.test_ps_server import FLAGS, TOKEN, server_env, shard_client

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class Shard:
    """A real `python -m ps.server` whose log goes to a file the test reads."""

    def __init__(self, tmp, *extra, token=TOKEN):
        self.log_path = tmp / "shard.log"
        ready = tmp / "ready.json"
        env = server_env(JAXDIST_PS_TOKEN=token) if token else server_env()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps.server", "--shard", "0", "--of", "1", "--port", "0",
                 "--ready-file", str(ready), *FLAGS, *extra],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        c = shard_client(self.address, token=token)
        self.data_port = c.control("info")["data_port"]
        c.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(10)


@pytest.fixture
def shard(tmp_path):
    s = Shard(tmp_path)
    yield s
    s.stop()


def data_call(port, method, meta_text: bytes, payload=b""):
    """One request by hand on the data port: the reply's status, or None if the shard
    closed the connection without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_HEAD.pack(MAGIC, method, len(meta_text), len(payload)) + meta_text
                     + payload)
        head = b""
        while len(head) < _HEAD.size:
            chunk = sock.recv(_HEAD.size - len(head))
            if not chunk:
                return None
            head += chunk
        return _HEAD.unpack(head)[1]


def test_deep_metadata_and_unicode_digits_are_invalid_argument_without_a_traceback(shard):
    deep = b"[" * 20000 + b"]" * 20000
    for _ in range(20):
        assert data_call(shard.data_port, PULL_ONE, deep) == INVALID
    # deep inside a well-formed pair, and as a frame header on both ports
    nested = json.dumps([["x-jaxdist-token", TOKEN], ["k", "v"]])[:-1].encode() + b"," \
        + b"[" * 5000 + b"]" * 5000 + b"]"
    assert data_call(shard.data_port, PULL_ONE, nested) == INVALID
    head = b"{\"op\":" + b"[" * 20000 + b"]" * 20000 + b"}"
    frame = b"JDP1" + len(head).to_bytes(4, "little") + head
    token_worker = [["x-jaxdist-token", TOKEN], ["x-jaxdist-worker", "0"]]
    assert data_call(shard.data_port, PULL_ONE, json.dumps(token_worker).encode(),
                     frame) == INVALID
    channel = grpc.insecure_channel(shard.address)
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/jaxdist.ps.Shard/PullOne")(
            frame, timeout=10, metadata=tuple(map(tuple, token_worker)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    pull = wire.encode({"op": "pull", "worker": 0, "step": 0, "min_version": 0, "epoch": 0})
    for worker in ("\u00b2", "\u0661", "\uff10", "+1", " 1", "", "1" * 12):
        meta = json.dumps([["x-jaxdist-token", TOKEN], ["x-jaxdist-worker", worker]]).encode()
        assert data_call(shard.data_port, PULL_ONE, meta, pull) == INVALID, worker
    c = shard_client(shard.address)
    assert c.control("ping") == {"ok": True}           # still up
    c.close()
    log = shard.log()
    assert "Traceback" not in log and "RecursionError" not in log, log[-2000:]


def test_worker_ids_are_ascii_digits():
    from ps.admission import CallGate, Refused

    class Ctx:
        def __init__(self, value):
            self.value = value

        def invocation_metadata(self):
            return (("x-jaxdist-worker", self.value),)

    gate = CallGate(3, 5.0)
    assert gate.worker_of(Ctx("2")) == 2
    for bad in ("\u00b2", "\u0662", "3", "-1", "", b"\xb2"):
        with pytest.raises(Refused) as e:
            gate.worker_of(Ctx(bad))
        assert e.value.kind == "invalid"
