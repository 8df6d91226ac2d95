"""The parameter server under a hostile local peer, and how a run ends: what a
peer that is not a worker sends gets an error status or a closed connection, never a
traceback in the shard's log; tokenless sockets cannot lock the workers out; a run has a
token by default; labels name the transport that carried the bytes; a long run's curves
are written in bounded time."""

import json
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

from jaxdist.record import RunRecord
from ps import wire
from ps.security import HandshakeError
from ps.shardmap import shard_map_for
from ps.tcp import _HEAD, MAGIC, PULL_ONE
from tests.helpers import ROOT, child_env, job_of
from tests.test_ps_server import CFG, FLAGS, TOKEN, server_env, session, shard_client
from tests.test_ps_tcp import connect

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class Shard:
    """A real `python -m ps.server` whose log goes to a file the test reads."""

    def __init__(self, tmp, *extra, token=TOKEN, nofile=None, env=None):
        """`nofile`: the shard's file-descriptor limit (soft and hard)."""
        import resource

        self.log_path = tmp / "shard.log"
        ready = tmp / "ready.json"
        env = {**(server_env(JAXDIST_PS_TOKEN=token) if token else server_env()), **(env or {})}
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
                 ) if nofile else None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps.server", "--shard", "0", "--of", "1", "--port", "0",
                 "--ready-file", str(ready), *FLAGS, *extra],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=limit)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        tls = {"tls_cert": extra[extra.index("--ps-tls-cert") + 1]} if (
            "--ps-tls-cert" in extra) else {}
        c = shard_client(self.address, token=token, **tls)
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


def data_call(port, method, meta_text: bytes, payload=b"", token=TOKEN):
    """One request by hand on the data port (after ps.security's handshake with `token`,
    none if empty): the reply's status, or None if the shard closed the connection without
    one."""
    with connect(port, token) as sock:
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
    nested = json.dumps([["x-jaxdist-worker", "0"], ["k", "v"]])[:-1].encode() + b"," \
        + b"[" * 5000 + b"]" * 5000 + b"]"
    assert data_call(shard.data_port, PULL_ONE, nested) == INVALID
    head = b"{\"op\":" + b"[" * 20000 + b"]" * 20000 + b"}"
    frame = b"JDP1" + len(head).to_bytes(4, "little") + head
    token_worker = [[*p] for p in session(shard.address)] + [["x-jaxdist-worker", "0"]]
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
        meta = json.dumps([["x-jaxdist-worker", worker]]).encode()
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


# -- a run while tokenless sockets hold the data ports ----------------------------------------

RUN = ["--layout", "ps", "--mesh", "2x1", "--ps-shards", "2", "--ps-mode", "sync",
       "--model", "mlp-tiny", "--batch-size", "16", "--lr", "0.01", "--warmup", "0",
       "--steps", "12", "--ps-timeout-s", "5"]
# worker 1 sleeps 0.3 s a step: the steps span several pre-auth deadlines of the attack
SLOW = "slow-worker:1:0.3"
ATTACKERS = 16  # per shard: the gRPC pool's size with 2 workers, as many as the slots


class Attack:
    """From the moment each shard's log names its data port, hold ATTACKERS plain sockets
    on it that send nothing and reconnect as soon as the shard closes them (until `stop`,
    and never past `limit_s`). `reconnects` counts the closes. Every 0.1 s or so, each port
    also gets a handshake answered with a proof under another token (`failed`)."""

    def __init__(self, psdir, shards: int, limit_s: float = 120.0):
        import re
        import threading

        self.psdir, self.shards, self.limit = psdir, shards, time.monotonic() + limit_s
        self.pattern = re.compile(r"data port (\d+)")
        self.started_unix = None
        self.reconnects = self.failed = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _ports(self) -> list[int]:
        ports = []
        for k in range(self.shards):
            path = self.psdir / f"shard{k}.log"
            found = self.pattern.search(path.read_text()) if path.exists() else None
            if found:
                ports.append(int(found.group(1)))
        return ports

    def _run(self) -> None:
        import select

        while len(ports := self._ports()) < self.shards:
            if self.stop_event.wait(0.02) or time.monotonic() > self.limit:
                return
        socks = {}

        def connect(port):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                socks[sock] = port
            except OSError:
                pass
        for port in ports:
            for _ in range(ATTACKERS):
                connect(port)
        self.started_unix = time.time()
        while not self.stop_event.is_set() and time.monotonic() < self.limit:
            for port in ports:
                self._wrong_proof(port)
            ready = select.select(list(socks), [], [], 0.05)[0]
            for sock in ready:
                try:
                    gone = sock.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    port = socks.pop(sock)
                    sock.close()
                    self.reconnects += 1
                    connect(port)
            for port in ports:  # a connect refused above is tried again
                while sum(p == port for p in socks.values()) < ATTACKERS:
                    before = len(socks)
                    connect(port)
                    if len(socks) == before:
                        break
        for sock in socks:
            sock.close()

    def _wrong_proof(self, port: int) -> None:
        from ps import security
        from ps.tcp import HELLO

        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                nonce = security.new_nonce()
                sock.sendall(HELLO + nonce)
                reply = b""
                while len(reply) < 68 and (chunk := sock.recv(68 - len(reply))):
                    reply += chunk
                sock.sendall(security.client_proof(
                    "not-the-run-token-32-characters!", nonce, reply[4:36],
                    security.channel_binding("data", 0, port)))
                if sock.recv(1) == b"":
                    self.failed += 1
        except OSError:
            pass

    def stop(self):
        self.stop_event.set()
        self.thread.join(10)


def _run(logdir, attack: bool):
    from tests.helpers import run_cli

    attacker = Attack(logdir / "ps", 2) if attack else None
    t0 = time.monotonic()
    try:
        proc = run_cli(*RUN, "--logdir", str(logdir), timeout=240)
    finally:
        if attacker:
            attacker.stop()
    return proc, time.monotonic() - t0, attacker


def test_a_sync_run_trains_the_same_while_tokenless_sockets_hold_the_data_ports(
        tmp_path, monkeypatch):
    import re

    monkeypatch.setenv("JAXDIST_PS_TOKEN", TOKEN)
    monkeypatch.setenv("JAXDIST_PS_FAULT", SLOW)
    quiet, quiet_s, _ = _run(tmp_path / "quiet", attack=False)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    attacked, attacked_s, attack = _run(tmp_path / "attacked", attack=True)
    assert attacked.returncode == 0, attacked.stderr[-3000:]
    assert attack.started_unix is not None and attack.reconnects >= 2 * ATTACKERS
    first = [json.loads((tmp_path / "attacked" / "ps" / f"worker{w}.json").read_text())
             for w in range(2)]
    assert all(attack.started_unix < w["window"]["start_unix_s"] for w in first)
    losses = [RunRecord.load(tmp_path / d).results["loss"]
              for d in ("quiet", "attacked")]
    assert len(losses[0]) == 12 and losses[0] == losses[1]
    assert sum(w["data_fallbacks"] for w in first) == 0
    # item 7: every push and pull fit one message, so the data ports carried all of it
    for d in ("quiet", "attacked"):
        r = RunRecord.load(tmp_path / d).results
        ps = r["ps"]
        moved = sum(json.loads((tmp_path / d / "ps" / f"worker{w}.json").read_text())[k]
                    for w in range(2) for k in ("push_bytes", "pull_bytes"))
        assert ps["bytes_by_transport"] == {"tcp": moved, "grpc": 0} and moved > 0
        assert ps["carried_by"] == "TCP (the shards' data ports)"
        assert "over TCP" in r["comm_reason"] and "gRPC" not in r["comm_reason"]
        assert "over TCP (the shards' data ports)" in (quiet if d == "quiet" else
                                                       attacked).stdout
    timed_out, failed = [], []
    for k in range(2):
        log = (tmp_path / "attacked" / "ps" / f"shard{k}.log").read_text()
        assert "Traceback" not in log
        lines = re.findall(r"timed out before authenticating \([^)]*\): (\d+)", log)
        assert lines, log[-2000:]
        timed_out.append(int(lines[-1]))
        # every failed handshake closed and counted; the log says so in a few lines
        proofs = re.findall(r"failed the handshake \(no proof of the run's token\): (\d+)", log)
        assert proofs and len(proofs) <= attacked_s / 10 + 2, log[-2000:]
        failed.append(int(proofs[-1]))
    assert min(timed_out) >= ATTACKERS, timed_out
    # (the last tries may end as the shards stop, after their final count)
    assert attack.failed >= 20 and sum(failed) >= attack.failed - 2, (attack.failed, failed)
    print(f"quiet {quiet_s:.1f} s, attacked {attacked_s:.1f} s, attack reconnects "
          f"{attack.reconnects}, timed out per shard {timed_out}, wrong proofs "
          f"{attack.failed} (counted per shard {failed})")


# -- a token by default -----------------------------------------------------------------

def test_run_token_rules():
    from jaxdist.errors import UsageError
    from ps.security import MIN_TOKEN_CHARS, TOKEN_ENV, run_token

    made = [run_token({}, False) for _ in range(2)]
    assert all(notice is None and len(t) >= MIN_TOKEN_CHARS for t, notice in made)
    assert made[0][0] != made[1][0]                       # one per run
    assert run_token({TOKEN_ENV: TOKEN}, False) == (TOKEN, None)
    for environ, insecure in (({TOKEN_ENV: ""}, False), ({}, True), ({TOKEN_ENV: ""}, True)):
        token, notice = run_token(environ, insecure)
        assert token == "" and "no token" in notice
    with pytest.raises(UsageError, match="--ps-insecure"):
        run_token({TOKEN_ENV: TOKEN}, True)


def test_insecure_with_a_token_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from tests.helpers import cli_main

    monkeypatch.setenv("JAXDIST_PS_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--layout", "ps", "--mesh", "2x1", "--model", "mlp-tiny",
                    "--batch-size", "16", "--ps-insecure")
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--ps-insecure" in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_the_validation_of_a_run_does_not_import_the_shard_server():
    """ps.server forces JAX_PLATFORMS=cpu on import; the launcher imported it to validate a
    run, so on a GPU node its workers inherited JAX_PLATFORMS=cpu. The checks live in
    ps.security now, called from the validation pass."""
    code = ("import sys; from experiments.validation import check_ps; "
            "from tests.helpers import job_of; from tests.test_ps_server import CFG; "
            "check_ps(job_of(CFG)); print('ps.server' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=server_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]


def test_a_run_without_a_configured_token_uses_one(tmp_path, monkeypatch):
    import re

    monkeypatch.delenv("JAXDIST_PS_TOKEN", raising=False)
    # the probes below take well under a second after the shard serves; the workers' own
    # start (importing jax) and 12 slowed steps keep the run alive past them
    monkeypatch.setenv("JAXDIST_PS_FAULT", SLOW)
    logdir = tmp_path / "run"
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.run", *RUN[:-2],
                             "--logdir", str(logdir), "--no-progress"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log = logdir / "ps" / "shard0.log"
        deadline = time.monotonic() + 90
        while not (found := re.search(r"serving on 127\.0\.0\.1:(\d+), data port (\d+)",
                                      log.read_text() if log.exists() else "")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert "token required" in log.read_text()
        grpc_port, data_port = map(int, found.groups())
        pull = wire.encode({"op": "pull", "worker": 0, "step": 0, "min_version": 0,
                            "epoch": 0})
        meta = json.dumps([["x-jaxdist-worker", "0"]]).encode()
        # without the handshake: closed unanswered; with another token: the shard's proof
        # is refused, and this side sends nothing more
        assert data_call(data_port, PULL_ONE, meta, pull, token="") is None
        with pytest.raises(HandshakeError):
            data_call(data_port, PULL_ONE, meta, pull)
        c = shard_client(f"127.0.0.1:{grpc_port}", token="")
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            c.control("ping")
        c.close()
        out = proc.communicate(timeout=180)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    assert len(RunRecord.load(logdir).results["loss"]) == 12
    assert "no token" not in out


def test_labels_name_one_transport_or_both_with_their_shares():
    from ps.collect import carried_by

    assert carried_by({"tcp": 0, "grpc": 5}) == "gRPC"
    assert carried_by({"tcp": 5, "grpc": 0}) == "TCP (the shards' data ports)"
    assert carried_by({"tcp": 3, "grpc": 1}) == (
        "TCP (the shards' data ports, 75% of the bytes) and gRPC (25%)")


# -- a long run's curves in bounded time --------------------------------------------------

def test_curves_of_a_long_run_are_bounded_and_keep_their_ends():
    from ps.collect import CURVE_POINTS, curve_steps

    assert curve_steps(6, 2) == [0, 1, 2, 3, 4, 5]                  # short: every step
    assert curve_steps(CURVE_POINTS + 2, 2) == list(range(CURVE_POINTS + 2))
    steps = curve_steps(70_888, 2)
    assert CURVE_POINTS // 2 <= len(steps) <= CURVE_POINTS + 3
    assert steps[:3] == [0, 1, 2] and steps[-1] == 70_887       # warm-up, first timed, last
    gaps = {b - a for a, b in zip(steps[2:-1], steps[3:-1])}
    assert len(gaps) == 1                                           # evenly spaced


def test_sigterm_after_10000_steps_of_a_ps_run_leaves_its_record(tmp_path):
    """SLURM sends SIGKILL 30 s after SIGTERM, so a PS run's workers cannot write 14 MB JSON
    files at the stop (a run of 70,886 steps would take ~90 s to exit). The worker's per-step
    figures are on disk in chunks before the signal (ps.series), so what a
    stop has left to write is bounded: exit 143 with the interrupted record. One worker, one
    shard, mlp-tiny: the cheapest PS step there is (~1.5 ms here); SIGTERM-to-exit seconds
    are printed (2 shared cores make them noisy), not asserted."""
    import re
    import signal

    from ps.series import CHUNK_STEPS, read_worker

    # 10 of ps.series' chunks on disk before the signal; worker 0 logs every total // 10 steps
    reached, total = 10_000, 20_000
    logdir = tmp_path / "run"
    t_start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--layout", "ps", "--mesh", "1x1",
         "--ps-shards", "1", "--ps-mode", "async", "--model", "mlp-tiny", "--batch-size", "8",
         "--warmup", "0", "--steps", str(total), "--logdir", str(logdir), "--no-progress"],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # SIGTERM: never ignored; the workers set their own SIGINT
    log, losses = logdir / "ps" / "worker0.log", logdir / "ps" / "worker0.series" / "losses.f64"
    try:
        deadline = time.monotonic() + 600
        while not re.search(rf"step {reached}/{total} ", log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        on_disk = losses.stat().st_size // 8  # before the signal: all but the last chunk
        ran_s = time.monotonic() - t_start
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 143, err[-3000:]
    assert on_disk >= reached - CHUNK_STEPS
    lines = [ln for ln in err.splitlines() if ln.startswith("run:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    r = RunRecord.load(logdir).results
    assert r["status"] == "interrupted" and r["interrupted"]["signal"] == "SIGTERM"
    assert reached <= r["steps_done"] < total and len(r["loss"]) == r["steps_done"]
    assert r["step_time_s"]["n"] == r["steps_done"]
    worker = read_worker(logdir / "ps" / "worker0.json")
    assert worker["interrupted"] == "SIGINT" and len(worker["losses"]) == r["steps_done"]
    assert (logdir / "ps" / "worker0.json").stat().st_size < 64 << 10  # no per-step lists
    print(f"{r['steps_done']} steps in {ran_s:.1f} s; SIGTERM to exit {exit_s:.2f} s")


# -- a late worker is named as itself, not the worker that waits for it -----------------------

class _Child:
    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None


class _ProgressClient:
    """A shard's `progress` replies, as the launcher's watchdog reads them."""

    metadata = ()

    def __init__(self, reply):
        self.reply = reply

    def _control(self, request, timeout, metadata):
        return json.dumps(self.reply).encode()

    def close(self):
        pass


def test_a_worker_later_than_the_step_timeout_is_named_not_the_one_waiting():
    """Sync, --ps-timeout-s 5: worker 0 said hello and waits in start_together; worker 1 is
    still starting (importing, compiling) 20 s later, within the start-up allowance. The
    watchdog counted worker 0 as training from its hello, so after 5 s it ended the run
    naming worker 0, which was ready and waiting."""
    from ps.watchdog import Progress

    reply = {"seen_step": [-1, -1], "started": [0], "retired": [], "missing": [],
             "version": 0, "epoch": 0, "failure": None}

    class Launch:
        servers = [_Child(999_999_991)]
        workers = [_Child(999_999_992), _Child(999_999_993)]
        addresses = ["127.0.0.1:1"]

        def client(self, k):
            return _ProgressClient(reply)

    progress = Progress(Launch(), 5.0, 125.0)
    t0 = progress.began
    for t in (1.0, 10.0, 20.0):
        progress.probe(t0 + t)
        progress.shard_seen = [t0 + t]  # the shard answered just now
        assert progress.stalled(set(), t0 + t) is None, t
    # worker 0 gave up waiting (its own start-up deadline): the late one is the cause
    assert progress.first_cause(0, set()).startswith("worker 1 (pid 999999993) did not say "
                                                     "hello within")
    t = 130.0  # past the start-up allowance: worker 1 is the one named
    progress.next_probe = 0.0
    progress.probe(t0 + t)
    progress.shard_seen = [t0 + t]
    what, index, line = progress.stalled(set(), t0 + t)
    assert (what, index) == ("worker", 1) and line.startswith(
        "worker 1 (pid 999999993) did not start training within 125 s")
    # once both said hello, training starts and the step timeout applies to each
    reply["started"] = [0, 1]
    progress.next_probe = 0.0
    progress.probe(t0 + 131.0)
    progress.shard_seen = [t0 + 137.0]
    assert progress.started == [True, True]
    what, index, line = progress.stalled(set(), t0 + 137.0)
    assert (what, index) == ("worker", 0)  # neither pushed for 6 s: the lowest named


def test_a_shard_paused_about_the_step_timeout_is_named_not_the_workers_waiting_for_it():
    """Sync, --ps-timeout-s 30: shard 0 is SIGSTOPped for 30.5 s, then continued. It
    answers the launcher again just as the workers pass their deadline, so the fresh
    evidence pointed at worker 0 ("made no progress"); at 35 s the shard was named. Now its
    silence, which covered the workers' stall, names it at any length."""
    from ps.watchdog import Progress

    reply = {"seen_step": [3, 3], "started": [0, 1], "retired": [], "missing": [],
             "version": 3, "epoch": 0, "failure": None}

    class Paused(_ProgressClient):
        down = False

        def _control(self, request, timeout, metadata):
            if self.down:
                raise grpc.RpcError()
            return super()._control(request, timeout, metadata)

    shard0 = Paused(reply)

    class Launch:
        servers = [_Child(999_999_991), _Child(999_999_994)]
        workers = [_Child(999_999_992), _Child(999_999_993)]
        addresses = ["127.0.0.1:1", "127.0.0.1:2"]

        def client(self, k):
            return shard0 if k == 0 else _ProgressClient(reply)

    progress = Progress(Launch(), 30.0, 150.0)
    t0 = progress.began
    for t in (0.5, 1.0):  # both shards answer; the workers started and pushed step 3
        progress.next_probe = 0.0
        progress.probe(t0 + t)
    assert progress.started == [True, True] and progress.stalled(set(), t0 + 1.0) is None
    shard0.down = True
    for t in range(2, 32):  # paused: shard 1 answers, shard 0 does not, nobody moves
        progress.next_probe = 0.0
        progress.probe(t0 + t)
        assert progress.stalled(set(), t0 + t) is None, t
    shard0.down = False
    progress.next_probe = 0.0
    progress.probe(t0 + 31.5)  # continued: it answers again, the workers are 30.5 s late
    what, index, line = progress.stalled(set(), t0 + 31.5)
    assert (what, index) == ("shard", 0), line
    assert line.startswith("shard 0 (pid 999999991, 127.0.0.1:1) made no progress: no "
                           "answer for 30.5 s"), line
    assert progress.first_cause(0, set()).startswith("shard 0 (pid 999999991"), line


# -- a peer that exhausts a shard's file descriptors ------------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _data_pull(port: int, timeout: float = 10.0) -> bytes:
    """One authenticated PullOne on the data port: the parameters' bytes in it (CallError
    if no reply)."""
    from ps.tcp import DataChannel

    channel = DataChannel("127.0.0.1", lambda: port, token=TOKEN)
    pull = wire.encode({"op": "pull", "worker": 0, "step": 0, "min_version": 0, "epoch": 0})
    try:
        reply = channel.call(PULL_ONE, pull, timeout, (("x-jaxdist-worker", "0"),))
        return b"".join(bytes(p) for h, p in wire.split(reply) if h["op"] == "param")
    finally:
        channel.close()


def test_a_shard_out_of_file_descriptors_serves_its_data_port_once_the_peer_goes(tmp_path):
    """A tokenless peer opens idle connections on both ports of a shard limited to 64 file
    descriptors (cheap to exhaust; a real shard has ~1,024) until its accepts fail. The data
    port's accept loop took that `OSError` as "closed" and ended for good (its listener then
    collected: connection refused); every data call of the run fell back to gRPC. Now the
    gRPC port caps its connections, the data port's accept backs off and drops the oldest
    tokenless connection, and once the peer goes the data port serves. Bounded: 150 + 100
    connections on 127.0.0.1, held ~2 s."""
    shard = Shard(tmp_path, nofile=64)
    socks = []
    try:
        before = _data_pull(shard.data_port)
        grpc_port = int(shard.address.rsplit(":", 1)[1])
        deadline = time.monotonic() + 20
        for _ in range(150):
            sock = socket.create_connection(("127.0.0.1", grpc_port), timeout=5)
            sock.sendall(H2_PREFACE)
            socks.append(sock)
        for _ in range(100):
            socks.append(socket.create_connection(("127.0.0.1", shard.data_port), timeout=5))
        full = _open_fds(shard.proc.pid)
        while time.monotonic() < deadline and "accept failed" not in shard.log():
            time.sleep(0.05)
        time.sleep(1.0)  # a second of failing accepts: logged once, not once per try
    finally:
        for sock in socks:
            sock.close()
    try:
        assert shard.proc.poll() is None
        after = None
        while after is None and time.monotonic() < deadline + 10:
            try:
                after = _data_pull(shard.data_port, timeout=5)
            except grpc.RpcError:
                time.sleep(0.2)
        assert after == before, shard.log()[-2000:]
        assert len(before) == shard_map_for(job_of(CFG), 1).bytes_per_shard[0]
        c = shard_client(shard.address)
        assert c.control("ping") == {"ok": True}
        c.close()
        log = shard.log()
        assert "Traceback" not in log
        accepts = [ln for ln in log.splitlines() if "data port: accept failed" in ln]
        assert 1 <= len(accepts) <= 4, log[-2000:]  # at most one a second
        print(f"open fds at most {full} of 64; accept-failed lines {len(accepts)}")
    finally:
        shard.stop()


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def test_tokenless_63_mib_calls_are_refused_before_their_body_is_read(shard):
    """32 tokenless 63 MiB PushOne calls (4 at a time) on the gRPC port: each message was
    read whole before the handler checked the token (the shard's peak memory rose by ~580
    MB, ~380 MB kept). The token is now checked on the metadata first and the body is never
    read into a message: the peak rises by less than 3 such messages (measured: ~66 MB)."""
    import threading

    pid = shard.proc.pid
    rss0 = _status_kb(pid, "VmRSS")
    payload = b"\0" * (63 << 20)
    channel = grpc.insecure_channel(shard.address,
                                    options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary("/jaxdist.ps.Shard/PushOne")
    codes = []

    def one():
        try:
            call(payload, timeout=30, metadata=(("x-jaxdist-worker", "0"),))
        except grpc.RpcError as e:
            codes.append(e.code())
    for _ in range(8):
        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    channel.close()
    peak_mb = (_status_kb(pid, "VmHWM") - rss0) / 1024
    # refused unread; a connection past its budget of calls without a session is shut
    # (ps.peer_budget): the calls on it then end UNAVAILABLE, and the channel reconnects
    from ps.peer_budget import BUDGET

    assert len(codes) == 32 and set(codes) <= {grpc.StatusCode.UNAUTHENTICATED,
                                               grpc.StatusCode.UNAVAILABLE}, codes
    assert codes.count(grpc.StatusCode.UNAUTHENTICATED) >= BUDGET, codes
    assert peak_mb < 3 * 63, peak_mb
    print(f"shard's peak memory +{peak_mb:.0f} MB for 32 tokenless 63 MiB calls")


def test_failed_tls_handshakes_do_not_flood_the_shard_log(tmp_path):
    """One thread sends garbage to a TLS shard's gRPC port for 2 s: gRPC logged a line per
    failed handshake (8 MB in 10 s, ~200 bytes each). Now the shard's log stays as it was."""
    import shutil

    from tests.test_ps_server import make_cert

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = make_cert(tmp_path)
    shard = Shard(tmp_path, "--ps-tls-cert", str(cert), "--ps-tls-key", str(key))
    try:
        port = int(shard.address.rsplit(":", 1)[1])
        size0 = shard.log_path.stat().st_size
        tries, end = 0, time.monotonic() + 2.0
        while time.monotonic() < end and tries < 20_000:
            tries += 1
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(b"\x16\x03\x01\x00\x05hello" * 4)
                try:
                    sock.recv(100)
                except OSError:
                    pass
        time.sleep(0.5)
        grown = shard.log_path.stat().st_size - size0
        c = shard_client(shard.address, tls_cert=str(cert))
        assert c.control("ping") == {"ok": True}
        c.close()
    finally:
        shard.stop()
    assert tries >= 100 and grown == 0, (tries, grown, shard.log()[-600:])
    print(f"{tries} failed handshakes in 2 s, {grown} bytes logged")


def test_a_sync_run_beside_a_peer_that_would_exhaust_the_shards_descriptors(tmp_path):
    """The run (shards and workers) limited to 256 file descriptors; a tokenless peer
    (scripts/bench_ps_peer.py's) holds up to 400 idle connections on each port of each
    shard and reopens those closed (at most 4,000 connects). The shards ran out of
    descriptors, the workers could not say hello, and the run ended (exit 1: 'worker 1 made
    no progress for 20.3 s (before its first push)'). Now every step is done and every data
    call is carried by the data ports. The step-time ratio is the script's to print."""
    import importlib.util
    import resource

    spec = importlib.util.spec_from_file_location("bench_ps_peer",
                                                  ROOT / "scripts" / "bench_ps_peer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    nofile = 256
    peer = bench.Peer(tmp_path / "ps", 2, conns=400, max_opens=4000)
    peer.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *RUN, "--logdir", str(tmp_path),
             "--no-progress"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
            timeout=240, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (nofile, nofile)))
    finally:
        peer.stop_event.set()
        peer.join(10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert peer.held_max > nofile  # more than a shard could have had descriptors for
    r = RunRecord.load(tmp_path).results
    assert len(r["loss"]) == 12
    assert r["ps"]["data_fallbacks"] == 0 and r["ps"]["bytes_by_transport"]["grpc"] == 0
    for k in range(2):
        assert "Traceback" not in (tmp_path / "ps" / f"shard{k}.log").read_text()
    print(f"peer connects {peer.opens}, held at most {peer.held_max}")


# -- a full disk --------------------------------------------------------------------------

def test_a_worker_that_cannot_write_names_the_path_not_a_worker_to_drop(tmp_path):
    """A worker's per-step series written under a file-size limit (RLIMIT_FSIZE, SIGXFSZ
    ignored: EFBIG, as on a full disk). The launcher named the worker and advised
    --ps-drop-dead-workers; now the worker's one line names the file, it exits 4, and the
    launcher passes the path on with what to do."""
    from types import SimpleNamespace

    from ps.launch import Launch
    from ps.shard_client import PSError
    from ps.worker import WRITE_FAILED

    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
            "from pathlib import Path\n"
            "from jaxdist.errors import WriteError\n"
            "from ps.series import SeriesWriter\n"
            "w = SeriesWriter(Path(sys.argv[1]), {'loss': [0.5] * 4096})\n"
            "try:\n"
            "    w.flush()\n"
            "except WriteError as e:\n"
            "    print(f'ps.worker 1: error: {e}'); sys.exit(4)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "worker1.series")],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    line = proc.stdout.strip()
    assert proc.returncode == WRITE_FAILED == 4, proc.stderr[-2000:]
    assert line == (f"ps.worker 1: error: cannot write {tmp_path / 'worker1.series' / 'loss.f64'}"
                    f": File too large"), line

    launch = Launch.__new__(Launch)
    launch.job = SimpleNamespace(ps=SimpleNamespace(ps_mode="sync", ps_drop_dead_workers=False))
    launch.workers, launch.dead_workers = [None, None], []

    class Died:
        pid = 4242

        def log_tail(self, n=3):
            return "compiled\n" + line

    with pytest.raises(PSError) as e:
        launch._worker_died(1, Died(), WRITE_FAILED)
    message = str(e.value)
    assert message.startswith(f"worker 1 (pid 4242) could not write its output: cannot write "
                              f"{tmp_path / 'worker1.series' / 'loss.f64'}: File too large;")
    assert "free space" in message and "--ps-drop-dead-workers" not in message
