"""A real shard server process (`python -m ps.server`): token checks, a fuzz of malformed
messages, deduplicated retries, TLS, and its usage errors."""

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from jaxdist.config import MeshConfig, ModelConfig, PSConfig, RunConfig
from jaxdist.record import RunRecord
from ps import wire
from ps.client import PSClient
from ps.shard_client import PSError, ShardClient
from ps.shardmap import shard_map_for
from tests.helpers import ROOT, child_env, job_of

TOKEN = "a-test-token-of-32-characters!!!"
CFG = RunConfig(mesh=MeshConfig(mesh="2x1"), model=ModelConfig(model="mlp-tiny"),
                ps=PSConfig(ps_shards=1, ps_mode="async", ps_timeout_s=5.0))
FLAGS = ["--model", "mlp-tiny", "--mesh", "2x1", "--ps-mode", "async", "--ps-timeout-s", "5"]
ACCEPTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ABORTED}


def server_env(**extra):
    env = child_env()
    env.pop("JAXDIST_PS_TOKEN", None)
    env.update(extra)
    return env


def start_server(tmp, *extra, env=None):
    ready = tmp / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "ps.server", "--shard", "0", "--of", "1",
                             "--port", "0", "--ready-file", str(ready), *FLAGS, *extra],
                            cwd=ROOT, env=env or server_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["port"]


def stop_server(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait(10)
    proc.stdout.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    proc, port = start_server(tmp_path_factory.mktemp("srv"),
                              env=server_env(JAXDIST_PS_TOKEN=TOKEN))
    yield proc, f"127.0.0.1:{port}"
    stop_server(proc)


def shard_client(address, token=TOKEN, timeout_s=5.0, **kw):
    return ShardClient(0, address, max_message_bytes=64 << 20, timeout_s=timeout_s,
                       token=token, **kw)


def session(address, token=TOKEN) -> tuple:
    """The gRPC metadata of a session with the shard at `address`, after ps.security's
    handshake (the ticket outlives the client that made it)."""
    c = shard_client(address, token=token)
    c._ensure_session()
    md = c._session
    c.close()
    return md


@pytest.mark.parametrize("token", ["", "wrong-token-wrong-token-wrong!!!", TOKEN[:-1]])
def test_missing_or_wrong_token_is_rejected(server, token):
    client = shard_client(server[1], token=token)
    with pytest.raises(PSError, match="UNAUTHENTICATED"):
        client.control("ping")
    client.close()


def test_right_token_is_accepted(server):
    client = shard_client(server[1])
    assert client.control("ping") == {"ok": True}
    info = client.control("info")
    assert info["fingerprint"] == shard_map_for(job_of(CFG), 1).fingerprint
    client.close()


def _pull(address):
    smap = shard_map_for(job_of(CFG), 1)
    client = PSClient([address], smap, 0, "async", max_message_bytes=64 << 20, timeout_s=5,
                      token=TOKEN)
    client.connect()
    flat = np.empty(smap.total, np.float32)
    client.pull(0, flat)
    version = client.version[0]
    client.close()
    return flat, version


def _fuzz_calls(rng, smap):
    """(method, payload) pairs, every one malformed in a different way."""
    pieces = smap.shard_pieces(0)
    good_meta = {"worker": 0, "step": 10_000, "version": 0, "epoch": 0}
    src = np.ones(smap.total, np.float32)

    def stream(meta=good_meta, chunk=2048, values=src):
        return list(wire.frames("push", pieces, values, chunk, meta))

    kinds = []
    kinds.append(lambda: ("Push", [rng.randbytes(rng.randrange(0, 300))]))
    kinds.append(lambda: ("Push", stream()[:-1]))                       # truncated stream
    kinds.append(lambda: ("Push", []))                                   # empty stream

    def cut():
        frames = stream()
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]))]             # truncated chunk
        return "Push", frames
    kinds.append(cut)

    def field():
        key, value = rng.choice([
            ("name", "hidden/9/kernel[0:4]"), ("dtype", "float16"), ("dtype", 7),
            ("shape", [1]), ("shape", "x"), ("offset", 12), ("offset", -4),
            ("worker", 2), ("worker", True), ("worker", "0"), ("step", -1),
            ("version", 10 ** 6), ("epoch", 5), ("op", "param"), ("nbytes", 1)])
        frames = stream()
        i = rng.randrange(len(frames))
        header, payload = wire.decode(frames[i])
        header[key] = value
        head = json.dumps(header).encode()
        frames[i] = b"JDP1" + len(head).to_bytes(4, "little") + head + bytes(payload)
        return "Push", frames
    kinds.append(field)
    kinds.append(lambda: ("Push", stream()[::-1] if len(stream()) > 1 else [b"JDP1"]))
    kinds.append(lambda: ("Push", stream(values=np.full(smap.total, np.nan, np.float32))))
    kinds.append(lambda: ("Push", stream(meta=dict(good_meta, version=99))))  # future
    kinds.append(lambda: ("Push", stream() + stream()[:1]))                # chunk past end
    kinds.append(lambda: ("Pull", rng.randbytes(rng.randrange(0, 200))))
    kinds.append(lambda: ("Pull", wire.encode({"op": "pull", "worker": 0, "step": 0,
                                               "min_version": 0, "epoch": 9})))
    kinds.append(lambda: ("Pull", wire.encode({"op": "pull", "worker": 5, "step": 0,
                                               "min_version": 0, "epoch": 0})))
    kinds.append(lambda: ("Control", rng.randbytes(rng.randrange(0, 200))))
    kinds.append(lambda: ("Control", wire.encode({"op": "retire", "worker": 99})))
    kinds.append(lambda: ("Control", wire.encode({"op": "format-disk"})))
    # The single-message variants take bundles of frames: the same checks apply.
    kinds.append(lambda: ("PushOne", b"".join(stream()[:-1])))
    kinds.append(lambda: ("PushOne", b"".join(stream()) + rng.randbytes(rng.randrange(1, 64))))
    kinds.append(lambda: ("PushOne", rng.randbytes(rng.randrange(0, 300))))
    kinds.append(lambda: ("PullOne", rng.randbytes(rng.randrange(0, 200))))
    return kinds


def test_fuzz_leaves_the_server_up_and_parameters_unchanged(server):
    proc, address = server
    before, version = _pull(address)
    smap = shard_map_for(job_of(CFG), 1)
    rng = random.Random(1234)
    kinds = _fuzz_calls(rng, smap)
    channel = grpc.insecure_channel(address)
    md = (*session(address), ("x-jaxdist-worker", "0"))
    calls = {"Push": channel.stream_unary("/jaxdist.ps.Shard/Push"),
             "Pull": channel.unary_stream("/jaxdist.ps.Shard/Pull"),
             "PushOne": channel.unary_unary("/jaxdist.ps.Shard/PushOne"),
             "PullOne": channel.unary_unary("/jaxdist.ps.Shard/PullOne"),
             "Control": channel.unary_unary("/jaxdist.ps.Shard/Control")}
    stats0 = shard_client(address).control("stats")
    codes, pushes = {}, 0
    for i in range(600):
        method, payload = kinds[i % len(kinds)]()
        with pytest.raises(grpc.RpcError) as e:
            if method == "Push":
                pushes += 1
                calls[method](iter(payload), timeout=10, metadata=md)
            elif method == "PushOne":
                pushes += 1
                calls[method](payload, timeout=10, metadata=md)
            elif method == "Pull":
                list(calls[method](payload, timeout=10, metadata=md))
            else:
                calls[method](payload, timeout=10, metadata=md)
        assert e.value.code() in ACCEPTED, (i, method, e.value.code(), e.value.details())
        codes[e.value.code().name] = codes.get(e.value.code().name, 0) + 1
    channel.close()
    assert proc.poll() is None                      # still up
    after, version_after = _pull(address)
    np.testing.assert_array_equal(after, before)     # nothing applied
    assert version_after == version
    stats = shard_client(address).control("stats")
    assert stats["applied"] == stats0["applied"]
    assert stats["rejected"] - stats0["rejected"] == pushes
    assert codes["INVALID_ARGUMENT"] > 300


def test_a_retried_push_is_deduplicated(server):
    _, address = server
    smap = shard_map_for(job_of(CFG), 1)
    client = PSClient([address], smap, 1, "async", max_message_bytes=64 << 20, timeout_s=5,
                      token=TOKEN)
    client.connect()
    before = client.control_all("stats")[0]
    flat = np.empty(smap.total, np.float32)
    client.pull(0, flat)
    replies = client.push(0, np.zeros(smap.total, np.float32), repeat=3)
    after = client.control_all("stats")[0]
    client.close()
    assert replies[0]["status"] == "applied"
    assert after["applied"] - before["applied"] == 1
    assert after["deduplicated"] - before["deduplicated"] == 2


def test_unreachable_shard_fails_within_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = shard_client(f"127.0.0.1:{port}", timeout_s=1.0)
    smap = shard_map_for(job_of(CFG), 1)
    start = time.monotonic()
    with pytest.raises(PSError, match=rf"shard 0 at 127.0.0.1:{port} unreachable for 1 s"):
        client.push(smap.pieces, np.zeros(smap.total, np.float32),
                    {"worker": 0, "step": 0, "version": 0, "epoch": 0})
    assert time.monotonic() - start < 4
    client.close()


def _server_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ps.server", "--shard", "0", "--of", "1",
                           *FLAGS, *args], cwd=ROOT, env=env or server_env(),
                          capture_output=True, text=True, timeout=60)


def test_port_in_use_is_a_usage_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        proc = _server_cli("--port", str(s.getsockname()[1]))
    assert proc.returncode == 2
    assert "is in use" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    for args, message in ((("--port", "99999"), "--port must be within 0..65535"),  # bind()'s
                          (("--of", "0"), "--of must be 1 or more")):  # OverflowError
        proc = _server_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"ps.server: error: {message}")


def test_binding_beyond_loopback_needs_a_token():
    proc = _server_cli("--ps-bind", "0.0.0.0")
    assert proc.returncode == 2
    assert "JAXDIST_PS_TOKEN" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _server_cli("--ps-bind", "0.0.0.0", env=server_env(JAXDIST_PS_TOKEN="short"))
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr


def make_cert(tmp_path):
    """(certificate, key) naming 127.0.0.1, made by the openssl command."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path):
    cert, key = make_cert(tmp_path)
    proc, port = start_server(tmp_path, "--ps-tls-cert", str(cert), "--ps-tls-key", str(key))
    try:
        secure = shard_client(f"127.0.0.1:{port}", token="", tls_cert=str(cert))
        assert secure.control("ping") == {"ok": True}
        secure.close()
        plain = shard_client(f"127.0.0.1:{port}", token="", timeout_s=1.0)
        with pytest.raises(PSError):
            plain.control("ping")
        plain.close()
    finally:
        stop_server(proc)


# -- wire edge cases, future steps, slow clients -------------------------------------------

def _raw(address):
    channel = grpc.insecure_channel(address)
    return channel, {m: getattr(channel, kind)(f"/jaxdist.ps.Shard/{m}") for m, kind in
                     (("Push", "stream_unary"), ("Pull", "unary_stream"),
                      ("PushOne", "unary_unary"), ("PushPullOne", "unary_unary"),
                      ("Control", "unary_unary"))}


def _huge_int_frame(header: dict, key: str) -> bytes:
    """A header whose `key` is an integer past Python's 4300-digit conversion limit."""
    head = json.dumps(header, separators=(",", ":")).replace(
        f'"{key}":0', f'"{key}":' + "1" * 5000).encode()
    return b"JDP1" + len(head).to_bytes(4, "little") + head


EDGE = {
    "push: huge integer": ("Push", [_huge_int_frame({"op": "push", "worker": 0, "step": 0,
                                                      "nbytes": 0}, "step")]),
    "pull: huge integer": ("Pull", _huge_int_frame({"op": "pull", "worker": 0, "step": 0,
                                                     "min_version": 0, "epoch": 0,
                                                     "nbytes": 0}, "step")),
    "control: huge integer": ("Control", _huge_int_frame({"op": "hello", "worker": 0,
                                                           "nbytes": 0}, "worker")),
    "push: empty trailing message": ("Push", [wire.encode({"op": "push"}), b""]),
    "push: empty trailing frame": ("PushOne", wire.encode({"op": "push"}) + b"JDP1" + bytes(4)),
    "push+pull: an empty push": ("PushPullOne", wire.encode({"op": "push"})),
}


@pytest.mark.parametrize("name", list(EDGE))
def test_wire_edge_cases_are_invalid_argument(server, name):
    method, payload = EDGE[name]
    channel, calls = _raw(server[1])
    md = (*session(server[1]), ("x-jaxdist-worker", "0"))
    with pytest.raises(grpc.RpcError) as e:
        if method == "Push":
            calls[method](iter(payload), timeout=10, metadata=md)
        elif method == "Pull":
            list(calls[method](payload, timeout=10, metadata=md))
        else:
            calls[method](payload, timeout=10, metadata=md)
    channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_whitespace_token_is_refused_like_a_short_one():
    from ps.security import security_problems

    assert "at least 16 characters" in security_problems("0.0.0.0", " " * 20, "", "")
    assert security_problems("0.0.0.0", "x" * 16, "", "") is None


def test_push_from_the_future_is_refused_and_real_pushes_still_apply(server):
    _, address = server
    smap = shard_map_for(job_of(CFG), 1)
    client = shard_client(address)
    with pytest.raises(PSError, match="FAILED_PRECONDITION.*beyond the step"):
        client.push(smap.pieces, np.zeros(smap.total, np.float32),
                    {"worker": 0, "step": 10 ** 9, "version": 0, "epoch": 0})
    client.close()
    workers = PSClient([address], smap, 0, "async", max_message_bytes=64 << 20, timeout_s=5,
                       token=TOKEN)
    flat = np.empty(smap.total, np.float32)
    workers.pull(0, flat)
    assert workers.push(0, np.zeros(smap.total, np.float32))[0]["status"] == "applied"
    workers.close()


@pytest.fixture(scope="session")
def sync_server(tmp_path_factory):
    proc, port = start_server(tmp_path_factory.mktemp("sync"), "--ps-mode", "sync",
                              "--ps-timeout-s", "4")
    yield proc, f"127.0.0.1:{port}"
    stop_server(proc)


def test_idle_streams_and_parked_pulls_do_not_delay_control(sync_server):
    """20 push streams that send nothing and 20 pulls parked on a sync barrier cannot take
    every server thread (a ping would wait 5-11 s): a worker gets 4 data calls at a time
    (the rest: RESOURCE_EXHAUSTED at once), control calls have threads of their own, and a
    call past the server's deadline is cancelled."""
    import threading

    from ps.admission import PER_WORKER

    _, address = sync_server
    channel, calls = _raw(address)
    release = threading.Event()

    def idle():
        release.wait(30)
        yield b""

    pull = wire.encode({"op": "pull", "worker": 1, "step": 1, "min_version": 1, "epoch": 0})
    streams = [calls["Push"].future(idle(), timeout=30, metadata=(("x-jaxdist-worker", "0"),))
               for _ in range(20)]
    pulls = [calls["Pull"](pull, timeout=30, metadata=(("x-jaxdist-worker", "1"),))
             for _ in range(20)]
    pull_codes = []
    threads = [threading.Thread(target=lambda p=p: pull_codes.append(_code(lambda: list(p))))
               for p in pulls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 15                   # every call has reached the server
    while sum(f.done() for f in streams) < 20 - PER_WORKER and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    control = shard_client(address, token="")
    start = time.monotonic()
    assert control.control("ping") == {"ok": True}
    ping_s = time.monotonic() - start
    refused = [f for f in streams if f.done()]
    assert ping_s < 0.5, ping_s
    assert len(refused) == 20 - PER_WORKER
    assert {f.exception().code() for f in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    for t in threads:
        t.join(20)
    # 16 refused at once; the 4 admitted end with the barrier's deadline (4 s + 1)
    assert sorted(pull_codes).count("RESOURCE_EXHAUSTED") == 20 - PER_WORKER
    assert set(pull_codes) == {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
    start = time.monotonic()                           # idle streams: cancelled by the server
    codes = {f.exception().code() for f in streams}
    assert time.monotonic() - start < 8
    assert grpc.StatusCode.CANCELLED in codes
    release.set()
    channel.close()
    control.close()


def _code(fn) -> str:
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def test_data_calls_must_name_their_worker(sync_server):
    channel, calls = _raw(sync_server[1])
    pull = wire.encode({"op": "pull", "worker": 0, "step": 0, "min_version": 0, "epoch": 0})
    assert _code(lambda: list(calls["Pull"](pull, timeout=5))) == "INVALID_ARGUMENT"
    assert _code(lambda: list(calls["Pull"](pull, timeout=5, metadata=(
        ("x-jaxdist-worker", "1"),)))) == "INVALID_ARGUMENT"   # frames of another worker
    channel.close()


def test_sync_steps_start_no_grpc_thread_per_call(sync_server, monkeypatch):
    """Two workers take three sync steps (the push of t and the pull of t+1 in one
    PushPullOne call per shard) and agree on the parameters. A gRPC future on an idle
    channel starts a polling thread for each call and ends it after (~0.4 ms of CPU per
    call here): the calls now run as blocking calls on threads the client keeps, so no
    such thread starts during the steps."""
    import threading

    import grpc._channel

    spins = []
    real_spin = grpc._channel._run_channel_spin_thread
    monkeypatch.setattr(grpc._channel, "_run_channel_spin_thread",
                        lambda state: (spins.append(1), real_spin(state))[1])
    _, address = sync_server
    smap = shard_map_for(job_of(CFG), 1)
    clients = [PSClient([address], smap, w, "sync", max_message_bytes=64 << 20, timeout_s=10)
               for w in range(2)]
    for c in clients:
        c.connect()
    first = clients[0].shards[0].control("info")["version"]
    before = clients[0].shards[0].control("stats")
    flats = [np.zeros(smap.total, np.float32) for _ in clients]
    errors = []

    def steps(w):
        try:
            for t in range(first, first + 3):
                grad = np.full(smap.total, 0.01 * (w + 1), np.float32)
                assert clients[w].start_push(t, grad, then_pull=(t + 1, flats[w]))() >= 0
        except Exception as e:  # reported below, with the thread's own message
            errors.append(e)
    threads = [threading.Thread(target=steps, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert spins == []
    np.testing.assert_array_equal(flats[0], flats[1])
    after = clients[0].shards[0].control("stats")
    assert after["version"] == first + 3
    # bytes counted alike on both sides; the push's reply frame is not parameters
    assert after["bytes_in"] - before["bytes_in"] == sum(c.push_bytes for c in clients)
    assert after["bytes_out"] - before["bytes_out"] == sum(c.pull_bytes for c in clients)
    for c in clients:
        assert c.pull_bytes > 3 * smap.total * 4
        c.close()


def test_a_ps_worker_measures_power_like_a_mesh_run(tmp_path, monkeypatch):
    """A worker samples its GPUs with jaxdist.telemetry (a scripted fake NVML here: no GPU
    on this machine) over the same window as a mesh run, jaxdist.telemetry.combine sums the
    workers' blocks into the run's, and the collector's record, summary and TensorBoard
    show it."""
    from jaxdist import telemetry
    from jaxdist.config import LoopConfig, TrainConfig
    from jaxdist.devices import select_devices
    from jaxdist.mesh import MeshShape
    from jaxdist.telemetry import fake
    from jaxdist.summary import format_summary
    from jaxdist.telemetry.combine import combine
    from ps.collect import collect
    from ps.worker import run_worker
    from tests.helpers import read_scalars

    real = telemetry.create_monitor

    def with_fake(cfg, backend=None, *, devices=None, **kw):
        return real(cfg, fake.fake_backend([fake.FakeGPU(power_w=300.0)]), devices=None, **kw)
    monkeypatch.setattr(telemetry, "create_monitor", with_fake)
    proc, port = start_server(tmp_path, "--mesh", "1x8")  # the 8 CPU devices tests have
    try:
        cfg = RunConfig(mesh=MeshConfig(mesh="1x8"), model=ModelConfig(model="mlp-tiny"),
                        train=TrainConfig(batch_size=8), loop=LoopConfig(warmup=1, steps=40),
                        ps=PSConfig(ps_shards=1, ps_mode="async", ps_timeout_s=5.0))
        out = run_worker(job_of(cfg), 0, [f"127.0.0.1:{port}"], tmp_path / "ps",
                         select_devices(MeshShape(8, 1)), log=lambda *_: None)
        c = shard_client(f"127.0.0.1:{port}", token="")  # the shard has none
        stats = [c.control("stats")]
        c.close()
    finally:
        stop_server(proc)
    mine = out["power"]
    assert mine["available"] is True, mine.get("reason")
    assert mine["window"]["steps"] == 40 and mine["window"]["samples"] == 40 * 8
    assert mine["avg_w"] == pytest.approx(300.0, rel=0.05)
    assert mine["energy_per_sample_j"] == pytest.approx(mine["energy_j"] / (40 * 8))
    assert (tmp_path / "ps" / "worker0" / "power" / "gpu_power_0.csv").stat().st_size > 0
    results = collect(job_of(cfg), tmp_path, stats, shard_map_for(job_of(cfg)))
    assert results["power"]["available"] and results["power"]["energy_j"] == mine["energy_j"]
    assert re.search(r"\n  power / energy +avg \d+ W, [0-9.]+ J/step", format_summary(results))
    assert RunRecord.load(tmp_path).results["power"]["available"]
    assert "power/energy_per_step_j" in read_scalars(tmp_path)
    both = combine({0: mine, 1: mine})
    assert both["available"] is True and len(both["gpus"]) == 2
    assert both["energy_j"] == pytest.approx(2 * mine["energy_j"])
    assert both["window"]["samples"] == 2 * 40 * 8
    assert both["energy_per_sample_j"] == pytest.approx(mine["energy_per_sample_j"])
    assert both["avg_w"] == pytest.approx(600.0, rel=0.05)
    half = combine({0: mine, 1: {"available": False, "reason": "NVML library not found"}})
    assert half == {"available": False, "reason": "worker(s) [1]: NVML library not found"}
    assert combine({0: {"available": False, "reason": "r"}}) == {
        "available": False, "reason": "r"}


def test_addresses_and_the_ready_file_are_checked_before_anything_starts(tmp_path, capsys):
    """A worker given an address no shard can have (`host:notaport`, port 99999) waited out
    its 120 s connect deadline and exited 3; a shard whose --ready-file lay under a file
    started up, then raised NotADirectoryError. Both are bad input: one line, exit 2."""
    import signal

    from ps import server, worker

    (tmp_path / "afile").write_text("")
    for ready, message in ((tmp_path / "afile" / "r", f"{tmp_path / 'afile'} is not a folder"),
                           (tmp_path, "is a folder, not a file")):
        assert server.main(["--shard", "0", "--of", "1", *FLAGS, "--ready-file", str(ready)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ps.server: error: --ready-file {ready}: ")
        assert message in lines[0]
    # a bad address is named as one, not as an address beyond loopback without a token
    assert server.main(["--shard", "0", "--of", "1", *FLAGS, "--ps-bind", "999.1.1.1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ps.server: error: --ps-bind '999.1.1.1' is not a valid address: give an IPv4 or IPv6 "
        "address of this host (127.0.0.1 by default) or a host name"]
    sigint = signal.getsignal(signal.SIGINT)  # the worker's main takes SIGINT over
    try:
        for servers, message in (("host:notaport", "'host:notaport' is not HOST:PORT"),
                                 ("127.0.0.1:99999", "'127.0.0.1:99999': PORT must be within "
                                                     "1..65535"),
                                 ("a,b,,c", "'a' is not HOST:PORT"),
                                 (":::", "':::' is not HOST:PORT")):
            assert worker.main(["--worker", "0", "--servers", servers, *FLAGS]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert lines == [f"ps.worker: error: --servers {message}"]
        # where the shards are: --servers, or a folder of their ready files
        for argv, line in (([], "--servers needs at least one HOST:PORT (or give "
                                "--ready-dir)"),
                           (["--ready-dir", str(tmp_path / "none")],
                            f"--ready-dir {tmp_path / 'none'}: no such folder")):
            assert worker.main(["--worker", "0", *argv, *FLAGS]) == 2
            assert capsys.readouterr().err.strip().splitlines() == [
                f"ps.worker: error: {line}"]
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
