"""Whole PS runs under attack, each on real processes on 127.0.0.1: busy tokenless HTTP/2
connections on a shard's gRPC port, a flood of raw connects on a TLS data port with
snapshots on, a shard paused past --ps-timeout-s, and a write limit (a full disk). Each test
asserts what the run did (exit status, steps, the line naming the cause) and what the peer
saw (connections closed, descriptors), never a time. (A whole run beside busy HTTP/2
connections on every shard shares its setup with tests/test_ps_resume.py's unbroken run.)"""

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxdist.record import RunRecord
from tests.helpers import ROOT, PeerThread, child_env
from tests.test_ps_hostile import RUN, _open_fds
from tests.test_ps_server import TOKEN


def _launch(logdir, *extra, env=None, preexec_fn=None, timeout=240):
    """experiments.run with RUN's job (2 workers, 2 shards, sync, 12 steps) and the test
    token, as a child process; its CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *RUN, *extra, "--logdir", str(logdir),
         "--no-progress"], cwd=ROOT, env={**child_env(), "JAXDIST_PS_TOKEN": TOKEN,
                                          **(env or {})},
        capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


def _ready(psdir, shards: int, stop_event, key: str, limit_s: float = 120.0) -> list[int]:
    """Each shard's `key` (port, data_port) from its ready file, once all are written."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not stop_event.is_set():
        try:
            return [json.loads((psdir / f"shard{k}.ready.json").read_text())[key]
                    for k in range(shards)]
        except (OSError, ValueError, KeyError):
            time.sleep(0.02)
    return []


# -- busy tokenless HTTP/2 connections on the gRPC ports ---------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes([kind, flags])
            + stream.to_bytes(4, "big") + payload)


def _literal(name: bytes, value: bytes) -> bytes:  # HPACK: literal, new name, no indexing
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


PATH = b"/jaxdist.ps.Shard/Control"


def refused_call(stream: int, authority: bytes) -> bytes:
    """One gRPC call's HEADERS (and END_STREAM): POST /jaxdist.ps.Shard/Control with no
    session ticket, so the shard refuses it."""
    block = (b"\x83\x86"                                   # :method POST, :scheme http
             + b"\x04" + bytes([len(PATH)]) + PATH              # :path (name index 4)
             + b"\x01" + bytes([len(authority)]) + authority             # :authority
             + _literal(b"content-type", b"application/grpc")
             + _literal(b"te", b"trailers"))
    return _frame(1, 0x5, stream, block)  # HEADERS, END_STREAM | END_HEADERS


class BusyPeer(PeerThread):
    """`per_shard` HTTP/2 connections to each shard's gRPC port (from its ready file), each
    sending one refused call every `every_s` and answering the shard's SETTINGS and PINGs,
    so gRPC's idle timer never fires. A connection the shard closes is counted, not
    reopened. Bounded: `limit_s`, and at most `calls` calls per connection."""

    def __init__(self, psdir, shards: int, per_shard: int, every_s: float = 0.5,
                 calls: int = 40, limit_s: float = 90.0):
        super().__init__()
        self.psdir, self.shards, self.per_shard = psdir, shards, per_shard
        self.every_s, self.calls, self.limit_s = every_s, calls, limit_s
        self.stop_event = threading.Event()
        self.opened = self.closed_by_shard = self.sent = self.refusals = 0
        self.held_max = 0

    def _run(self):
        end = time.monotonic() + self.limit_s
        ports = _ready(self.psdir, self.shards, self.stop_event, "port")
        sel = selectors.DefaultSelector()
        conns = {}
        for port in ports:
            authority = f"127.0.0.1:{port}".encode()
            for _ in range(self.per_shard):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                except OSError:
                    continue
                s.setblocking(False)
                s.sendall(PREFACE + _frame(4, 0, 0))
                conns[s] = {"authority": authority, "stream": 1, "buf": b"", "calls": 0}
                sel.register(s, selectors.EVENT_READ)
                self.opened += 1
        self.held_max = len(conns)
        next_round = time.monotonic()
        while conns and time.monotonic() < end and not self.stop_event.is_set():
            now = time.monotonic()
            if now >= next_round:
                next_round = now + self.every_s
                for s, c in list(conns.items()):
                    if c["calls"] >= self.calls:
                        continue
                    try:
                        s.send(refused_call(c["stream"], c["authority"]))
                        c["stream"] += 2
                        c["calls"] += 1
                        self.sent += 1
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        self._gone(sel, conns, s)
            for key, _ in sel.select(timeout=max(0.0, next_round - time.monotonic())):
                self._read(sel, conns, key.fileobj)
        for s in conns:
            s.close()
        sel.close()

    def _gone(self, sel, conns, s):
        sel.unregister(s)
        conns.pop(s)
        s.close()
        self.closed_by_shard += 1

    def _read(self, sel, conns, s):
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._gone(sel, conns, s)
            return
        c = conns[s]
        buf = c["buf"] + data
        out = b""
        while len(buf) >= 9:
            size = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + size:
                break
            kind, flags, payload = buf[3], buf[4], buf[9:9 + size]
            if kind == 4 and not flags & 1:      # SETTINGS: acknowledged
                out += _frame(4, 1, 0)
            elif kind == 6 and not flags & 1:    # PING: answered
                out += _frame(6, 1, 0, payload)
            elif kind == 1:
                self.refusals += flags & 1       # trailers-only response ends its stream
            buf = buf[9 + size:]
        c["buf"] = buf
        if out:
            try:
                s.send(out)
            except OSError:
                pass


def test_peer_addresses_read_as_gRPC_writes_them():
    """gRPC's peer strings, as the budget keys its connections and finds their sockets
    (IPv4-mapped IPv6 sockets included)."""
    from ps.peer_budget import parse_peer

    assert parse_peer("ipv4:127.0.0.1:54321") == ("127.0.0.1", 54321)
    assert parse_peer("ipv6:[::1]:443") == ("::1", 443)
    assert parse_peer("ipv6:%5B::1%5D:443") == ("::1", 443)
    assert parse_peer("ipv6:[::ffff:127.0.0.1]:80") == ("127.0.0.1", 80)
    for bad in ("unix:/tmp/x", "", "ipv4:127.0.0.1:port", "garbage"):
        assert parse_peer(bad) is None, bad


def test_a_connection_past_its_budget_of_refused_calls_is_closed_by_the_shard(tmp_path):
    """256 busy HTTP/2 connections on one shard's gRPC port, each sending a refused call
    every 0.2 s for as long as it is open: gRPC's idle close never fires on a busy
    connection, so they stayed. Now the shard shuts each down past its budget of calls
    without a session, and a client with the token gets in over gRPC."""
    from ps.peer_budget import BUDGET
    from tests.test_ps_hostile import Shard
    from tests.test_ps_server import shard_client

    N = 256
    shard = Shard(tmp_path)
    try:
        (tmp_path / "shard0.ready.json").write_text((tmp_path / "ready.json").read_text())
        peer = BusyPeer(tmp_path, 1, N, every_s=0.2, calls=4 * BUDGET, limit_s=60)
        peer.start()
        peer.join(70)
        fds = _open_fds(shard.proc.pid)
        c = shard_client(shard.address)
        c.data = None  # over gRPC, not the data port
        c._control = c._grpc_control
        ping = c.control("ping")
        stats = c.control("stats")
        c.close()
    finally:
        shard.stop()
    assert peer.error is None, peer.error
    assert peer.opened == N and peer.closed_by_shard == N, (peer.opened,
                                                           peer.closed_by_shard)
    assert stats["grpc_closed_over_budget"] == N, stats["grpc_closed_over_budget"]
    # each got its budget refused, then was shut (a call in flight may still be answered)
    assert N * BUDGET <= peer.refusals <= N * (BUDGET + 3), peer.refusals
    assert ping == {"ok": True} and fds < 100, fds
    print(f"peer: {N} connections, {peer.sent} calls sent, {peer.refusals} refused, "
          f"{peer.closed_by_shard} closed by the shard; shard descriptors after: {fds}")


# -- a flood of raw connects on a TLS data port, snapshots on -----------------------------

class ConnectFlood(PeerThread):
    """Once shard 0 has snapshotted its first step (training has started): worker 1 is
    stopped (SIGSTOP: the sync run waits, whatever the machine's load, so the flood falls
    inside it), `rate` raw TCP connects a second for `seconds` go to shard 0's data port,
    each held open without a ClientHello (a TLS handshake that never starts); then worker 1
    is continued and the connections stay held until the shard has written two more
    snapshots. The shard's open descriptors (/proc/<pid>/fd) are read every 20 connects and
    while the snapshots are written."""

    def __init__(self, psdir, rate: int = 1000, seconds: float = 1.5):
        super().__init__()
        self.psdir, self.rate, self.seconds = psdir, rate, seconds
        self.stop_event = threading.Event()
        self.connects = self.failed = 0
        self.base = self.most = 0
        self.versions = (-1, -1)  # the snapshot version when the flood began, and ended


    def _latest(self) -> int:
        try:
            text = (self.psdir / "snapshots" / "shard0" / "LATEST").read_text().strip()
            return int(text[len("snap-"):])
        except (OSError, ValueError):
            return -1

    def _worker1(self) -> int:
        from jaxdist.procs import pids_mentioning

        for pid in pids_mentioning(str(self.psdir)):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"ps.worker" in argv and argv[argv.index(b"--worker") + 1] == b"1":
                return pid
        raise RuntimeError("worker 1 not found")

    def _run(self):
        ports = _ready(self.psdir, 1, self.stop_event, "data_port")
        pids = _ready(self.psdir, 1, self.stop_event, "pid")
        if not ports:
            return
        port, pid = ports[0], pids[0]
        while self._latest() < 1:
            if self.stop_event.wait(0.005):
                return
        worker = self._worker1()
        os.kill(worker, signal.SIGSTOP)
        first = self._latest()
        self.base = self.most = _open_fds(pid)
        held = []
        try:
            start = time.monotonic()
            while (n := self.connects + self.failed) < self.rate * self.seconds:
                ahead = start + n / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    self.connects += 1
                except OSError:
                    self.failed += 1
                if n % 20 == 0:
                    self.most = max(self.most, _open_fds(pid))
            os.kill(worker, signal.SIGCONT)
            end = time.monotonic() + 60
            while self._latest() < first + 2 and time.monotonic() < end:
                self.most = max(self.most, _open_fds(pid))
                if self.stop_event.wait(0.02):
                    break
            self.versions = (first, self._latest())
        except OSError:  # the shard went away: what was read stands
            pass
        finally:
            try:
                os.kill(worker, signal.SIGCONT)
            except OSError:
                pass
            for s in held:
                s.close()


def test_a_tls_connect_flood_during_a_run_with_snapshots_keeps_descriptors_capped(tmp_path):
    """1,000 raw connects/s for 1.5 s on shard 0's TLS data port of a sync run that
    snapshots every version, held while the run goes on: a waiting TLS connection was
    closed on a detached socket, so the shard's descriptors rose by one per connect until
    a snapshot write failed ("Too many open files") and the run died. Now they stay within
    the waiting cap plus the slots, snapshots are written while the flood's connections
    are held, and every step is done."""
    import shutil

    from ps.admission import pool_size
    from ps.data_slots import MAX_WAITING
    from tests.test_ps_server import make_cert

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = make_cert(tmp_path)
    logdir = tmp_path / "run"
    flood = ConnectFlood(logdir / "ps")
    flood.start()
    try:  # a stopped worker for the flood's length is no stall (--ps-timeout-s 60)
        proc = _launch(logdir, "--ps-tls-cert", str(cert), "--ps-tls-key", str(key),
                       "--ps-checkpoint-every", "1", "--ps-timeout-s", "60")
    finally:
        flood.stop_event.set()
        flood.join(20)
    assert flood.error is None, flood.error
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = RunRecord.load(logdir).results
    assert len(r["loss"]) == 12 and np.isfinite(r["loss"]).all()
    assert flood.connects >= 1000, (flood.connects, flood.failed)
    first, last = flood.versions
    assert first >= 1 and last >= first + 2, flood.versions  # snapshots while held
    cap = MAX_WAITING + pool_size(2) + 16  # waiting, authenticated slots, snapshot files
    assert flood.most - flood.base <= cap, (flood.base, flood.most)
    snap = logdir / "ps" / "snapshots" / "shard0"
    assert (snap / "LATEST").read_text().strip() == f"snap-{12:012d}"
    log = (logdir / "ps" / "shard0.log").read_text()
    assert "Traceback" not in log and "Too many open files" not in log
    print(f"flood: {flood.connects} connects held ({flood.failed} refused at connect) in "
          f"1.5 s; shard 0 descriptors {flood.base} -> at most {flood.most} (cap {cap}); "
          f"snapshots {first} -> {last} written while held; run: 12 steps, exit 0")


# -- a shard paused past --ps-timeout-s ---------------------------------------------------

@pytest.mark.parametrize("timeout_s", [3.0, 30.0], ids=["3s", "30s"])
def test_a_shard_paused_past_the_step_timeout_is_named_not_a_worker(tmp_path, timeout_s):
    """Shard 0 of a sync run is SIGSTOPped once the workers train, for --ps-timeout-s + 0.5
    s, then continued: at 3 s, and at the default 30 s (a real 30.5 s pause, where the run
    ended naming worker 0, "made no progress"). It names the shard, and no process is
    left."""
    from jaxdist.procs import pids_alive, pids_mentioning
    from tests.test_ps_hostile import SLOW

    logdir = tmp_path / "run"
    psdir = logdir / "ps"
    paused = {}

    def pause():
        end = time.monotonic() + 120
        while time.monotonic() < end:
            log = psdir / "worker0.log"
            if log.exists() and "all workers ready" in log.read_text():
                break
            time.sleep(0.02)
        else:
            return
        time.sleep(0.5)  # a few steps in
        pid = json.loads((psdir / "shard0.ready.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        paused["pid"] = pid
        time.sleep(timeout_s + 0.5)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # the launcher ended it already
            pass

    t = threading.Thread(target=pause, daemon=True)
    t.start()
    run = [a if a != "5" or RUN[i - 1] != "--ps-timeout-s" else str(timeout_s)
           for i, a in enumerate(RUN)]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", *run, "--steps", "400", "--logdir",
         str(logdir), "--no-progress"], cwd=ROOT,
        env={**child_env(), "JAXDIST_PS_TOKEN": TOKEN, "JAXDIST_PS_FAULT": SLOW},
        capture_output=True, text=True, timeout=240)
    t.join(30)
    assert "pid" in paused, proc.stderr[-2000:]
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if "stopping every process" in ln
            or "failed waiting for it" in ln]
    assert line, proc.stderr[-3000:]
    assert f"shard 0 (pid {paused['pid']}" in line[0], line[0]
    assert "worker 0 (pid" not in line[0].split(";")[0], line[0]
    assert pids_alive([paused["pid"]]) == [] and pids_mentioning(str(logdir)) == []
    print(f"paused shard 0 for {timeout_s + 0.5:g} s (--ps-timeout-s {timeout_s:g}): exit "
          f"{proc.returncode}; {line[0][:220]}")


# -- a full disk (a file-size limit) ------------------------------------------------------

def _fsize_limit(limit: int):
    import resource

    def apply():  # EFBIG instead of SIGXFSZ's kill, as a full disk's ENOSPC would be
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_snapshot_write_that_fails_names_its_file_and_leaves_nothing_half_written(tmp_path):
    """numpy's short write under a full disk says only "3712 requested and 2016 written":
    the shard's version-0 snapshot raised it, with a traceback, and the shard never served.
    Now the error names the file, and the unfinished snapshot is removed."""
    code = ("import sys, numpy as np\n"
            "from pathlib import Path\n"
            "from ps import snapshot\n"
            "d = Path(sys.argv[1])\n"
            "try:\n"
            "    snapshot.save(d, {'params': np.ones(4096, np.float32)}, {'version': 0})\n"
            "except OSError as e:\n"
            "    print(e.filename); print(e.strerror)\n"
            "print(sorted(p.name for p in d.iterdir()))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "shard0")], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60,
                          preexec_fn=_fsize_limit(8192))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[0] == str(tmp_path / "shard0" / f"snap-{0:012d}.tmp" / "params.npy"), lines
    assert lines[1] in ("File too large", "short write (a full disk or a file-size limit)")
    assert lines[2] == "[]", lines  # no unfinished snapshot left


def test_a_full_disk_under_the_launcher_names_it_the_path_and_keeps_snapshots(tmp_path):
    """Every process of a 300-step run under a 16 KiB file-size limit: the shards' snapshots
    (15 KiB files) fit, results.json (~30 KiB) does not. The run ended "cannot write
    results.json" with exit 2, as bad input does, naming no process. Now one line names the
    launcher, the file and what to do (exit 1), and the shards' snapshots of the last step
    are kept, with no process left."""
    from jaxdist.procs import pids_mentioning

    logdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *RUN, "--steps", "300",
         "--ps-checkpoint-every", "100", "--logdir", str(logdir), "--no-progress"], cwd=ROOT,
        env={**child_env(), "JAXDIST_PS_TOKEN": TOKEN}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=_fsize_limit(16384))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"run: error: the launcher (pid {proc.pid}) could not write the "
                           f"record: cannot write {logdir / 'results.json'}: File too large;")
    assert "free space there" in line and "Traceback" not in err
    for k in range(2):
        snap = logdir / "ps" / "snapshots" / f"shard{k}"
        assert (snap / "LATEST").read_text().strip() == f"snap-{300:012d}"
        assert (snap / f"snap-{300:012d}" / "params.npy").stat().st_size > 8192
    assert not (logdir / "results.json").exists() and pids_mentioning(str(logdir)) == []
    print(line)
