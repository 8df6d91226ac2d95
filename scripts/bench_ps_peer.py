"""A sync PS run beside a hostile local peer: step time with and without it.

The peer has no token. From the moment each shard's log names its ports it opens idle
connections to both (the gRPC port's get the HTTP/2 preface, then silence), as many as it
can up to --conns per port, and opens a new one whenever the shard closes one (at most
--max-opens in all, never past the run). Both runs get the same file-descriptor limit
(--nofile, inherited by the launcher's shards and workers), low enough that the peer would
exhaust a shard's descriptors if nothing capped its connections. Prints each run's p50
step time, the calls the data ports refused (they went over gRPC) and the ratio.

    python scripts/bench_ps_peer.py                    # 2 workers, 2 shards, 200 steps
    python scripts/bench_ps_peer.py --steps 60 --nofile 256

Target: attacked / quiet p50 step time <= 1.5, with no data call over gRPC.
"""

from __future__ import annotations

import argparse
import json
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
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
PORTS = re.compile(r"serving on [^ ]+:(\d+), data port (\d+)")


class Peer(threading.Thread):
    def __init__(self, psdir: Path, shards: int, conns: int, max_opens: int):
        super().__init__(daemon=True)
        self.psdir, self.shards, self.conns, self.left = psdir, shards, conns, max_opens
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
        while not self.stop_event.is_set() and self.left > 0:
            for port, h2 in ports:  # top each port up to --conns
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
    cmd = [sys.executable, "-m", "experiments.run", "--layout", "ps", "--mesh", "2x1",
           "--ps-shards", "2", "--ps-mode", "sync", "--model", "mlp-tiny", "--batch-size", "16",
           "--warmup", "5", "--steps", str(args.steps), "--ps-timeout-s", "20",
           "--logdir", str(logdir), "--no-progress"]

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    peer = Peer(logdir / "ps", 2, args.conns, args.max_opens) if attack else None
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
    r = json.loads((logdir / "results.json").read_text())
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
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        quiet = run(Path(tmp) / "quiet", args, attack=False)
        attacked = run(Path(tmp) / "attacked", args, attack=True)
    for name, r in (("quiet", quiet), ("attacked", attacked)):
        print(f"{name:9s} p50 step {r['p50_s'] * 1e3:7.2f} ms, data calls over gRPC "
              f"{r['fallbacks']} ({r['grpc_bytes']} bytes), peer connects {r['peer_opens']} "
              f"(held at most {r['peer_held_max']})")
    ratio = attacked["p50_s"] / quiet["p50_s"]
    print(f"attacked / quiet p50 step time: {ratio:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
