"""A sync PS run beside a hostile local peer: step time with and without it.

The peer has no token. From the moment each shard's log names its ports it opens idle
connections to both (the gRPC port's get the HTTP/2 preface, then silence), as many as it
can up to --conns per port, and tops each port up again every --reopen-every-s (at most
--max-opens connects in all, never past the run): a peer that holds connections, not a
connect flood (on 2 cores a flood is a CPU contest whatever the shard does). Both runs get
the same file-descriptor limit (--nofile, inherited by the launcher's shards and workers),
low enough that the peer would exhaust a shard's descriptors if nothing capped its
connections. Quiet and attacked runs
alternate --repeats times; prints each run's p50 step time, the calls the data ports refused
(they went over gRPC) and the median of the per-pair ratios.

    python scripts/bench_ps_peer.py                    # 2 workers, 2 shards, 200 steps, x3
    python scripts/bench_ps_peer.py --steps 60 --repeats 1 --reopen-every-s 0

Target: attacked / quiet p50 step time <= 1.5, with no data call over gRPC.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
PORTS = re.compile(r"serving on [^ ]+:(\d+), data port (\d+)")


class Peer(threading.Thread):
    def __init__(self, psdir: Path, shards: int, conns: int, max_opens: int,
                 reopen_every_s: float = 0.0):
        super().__init__(daemon=True)
        self.psdir, self.shards, self.conns, self.left = psdir, shards, conns, max_opens
        self.reopen_every_s = reopen_every_s
        self.stop_event = threading.Event()
        self.opens = self.held_max = 0

    def _ports(self) -> list[tuple[int, bool]]:
        found = []
        for k in range(self.shards):
            path = self.psdir / f"shard{k}.log"
            m = PORTS.search(path.read_text()) if path.exists() else None
            if m:
                found += [(int(m.group(1)), True), (int(m.group(2)), False)]
        return found

    def _open(self, port: int, h2: bool):
        if self.left <= 0:
            return None
        self.left -= 1
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            if h2:
                sock.sendall(H2_PREFACE)
            self.opens += 1
            return sock
        except OSError:
            return None

    def run(self) -> None:
        while len(ports := self._ports()) < 2 * self.shards:
            if self.stop_event.wait(0.02):
                return
        socks: dict = {}
        top_up_at = 0.0
        while not self.stop_event.is_set() and self.left > 0:
            now = time.monotonic()
            for port, h2 in ports if now >= top_up_at else ():  # each port up to --conns
                top_up_at = now + self.reopen_every_s
                for _ in range(self.conns - sum(1 for p in socks.values() if p[0] == port)):
                    sock = self._open(port, h2)
                    if sock is None:
                        break
                    socks[sock] = (port, h2)
            self.held_max = max(self.held_max, len(socks))
            poller = select.poll()  # not select(): the peer's descriptors pass 1,024
            by_fd = {sock.fileno(): sock for sock in socks}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(200):
                sock = by_fd[fd]
                try:
                    gone = sock.recv(65536) == b""
                except OSError:
                    gone = True
                if gone:
                    socks.pop(sock)
                    sock.close()
        for sock in socks:
            sock.close()


def run(logdir: Path, args, attack: bool) -> dict:
    from jaxdist.record import RunRecord

    cmd = [sys.executable, "-m", "experiments.run", "--layout", "ps", "--mesh", "2x1",
           "--ps-shards", "2", "--ps-mode", "sync", "--model", "mlp-tiny", "--batch-size", "16",
           "--warmup", "5", "--steps", str(args.steps), "--ps-timeout-s", "20",
           "--logdir", str(logdir), "--no-progress"]

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    peer = Peer(logdir / "ps", 2, args.conns, args.max_opens,
                args.reopen_every_s) if attack else None
    if peer:
        peer.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              preexec_fn=limit)
    finally:
        if peer:
            peer.stop_event.set()
            peer.join(10)
    if proc.returncode != 0:
        sys.exit(f"bench_ps_peer: the {'attacked' if attack else 'quiet'} run exited "
                 f"{proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    r = RunRecord.load(logdir).results
    return {"p50_s": r["step_time_s"]["p50"], "fallbacks": r["ps"].get("data_fallbacks", 0),
            "grpc_bytes": r["ps"]["bytes_by_transport"].get("grpc", 0),
            "peer_opens": peer.opens if peer else 0, "peer_held_max": peer.held_max if peer
            else 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nofile", type=int, default=256, help="file-descriptor limit of the run")
    p.add_argument("--conns", type=int, default=400, help="peer connections per port")
    p.add_argument("--max-opens", type=int, default=20_000, help="peer connects in all")
    p.add_argument("--reopen-every-s", type=float, default=1.0,
                   help="how often the peer tops its connections up (0: at once)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            quiet = run(Path(tmp) / f"quiet{i}", args, attack=False)
            attacked = run(Path(tmp) / f"attacked{i}", args, attack=True)
            for name, r in (("quiet", quiet), ("attacked", attacked)):
                print(f"{name:9s} p50 step {r['p50_s'] * 1e3:7.2f} ms, data calls over gRPC "
                      f"{r['fallbacks']} ({r['grpc_bytes']} bytes), peer connects "
                      f"{r['peer_opens']} (held at most {r['peer_held_max']})", flush=True)
            ratios.append(attacked["p50_s"] / quiet["p50_s"])
    ratios.sort()
    print(f"attacked / quiet p50 step time: median {ratios[len(ratios) // 2]:.2f} of "
          f"{', '.join(f'{r:.2f}' for r in ratios)} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
