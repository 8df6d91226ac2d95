"""A budget per gRPC connection for calls that carry no session, so a busy tokenless peer
cannot hold a shard's gRPC connections for as long as it keeps them busy.

gRPC closes a connection with no call for 20 s (ps.servicer.IDLE_MS) and any connection
after 10 minutes; a peer sending one refused call every few seconds on each of its
connections keeps every one of them open up to the cap (ps.servicer.connection_cap). Here
each connection (gRPC's peer address: host and port) may make `BUDGET` calls that open
nothing (a call refused for want of a session, or an `Auth` handshake); one call with a
valid session gives it back its whole budget, so a worker that re-authenticates after a
lost session never runs out. A connection past its budget is closed by the shard: gRPC
Python has no call that closes a connection, so the closer finds the connection's socket
among the process's descriptors (/proc/self/fd: the one on the gRPC port whose peer is that
address) and shuts it down; gRPC's poller then sees it end and frees it.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from urllib.parse import unquote

BUDGET = 8             # calls without a session per connection, refunded by one with one
TRACKED = 8192         # connections remembered at once (the oldest forgotten first)
CLOSE_EVERY_S = 0.2    # how often the closer looks for connections to shut


def parse_peer(peer: str) -> tuple[str, int] | None:
    """("127.0.0.1", 54321) of gRPC's peer string ("ipv4:127.0.0.1:54321",
    "ipv6:[::1]:54321", percent-encoded in some versions); None for anything else."""
    text = unquote(peer or "")
    kind, _, rest = text.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]").removeprefix("::ffff:"), int(port)


class PeerBudget:
    def __init__(self, local_port, budget: int = BUDGET):
        """`local_port()`: the gRPC port (set once bound); only its sockets are closed."""
        self.local_port, self.budget = local_port, budget
        self._spent: collections.OrderedDict = collections.OrderedDict()
        self._due: set = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.closed = 0                   # connections shut over their budget
        self._thread = None

    def spend(self, peer: str) -> None:
        """One call without a session on connection `peer`."""
        with self._lock:
            n = self._spent.pop(peer, 0) + 1
            self._spent[peer] = n
            while len(self._spent) > TRACKED:
                self._spent.popitem(last=False)
            if n <= self.budget:
                return
            self._due.add(peer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._closer, name="ps-peer-budget",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def refund(self, peer: str) -> None:
        """A call with a valid session on `peer`: its budget is whole again."""
        if self._spent:
            with self._lock:
                self._spent.pop(peer, None)

    def _closer(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                due, self._due = self._due, set()
            wanted = {}
            for peer in due:
                parsed = parse_peer(peer)
                if parsed is not None:
                    wanted[parsed] = peer
            shut = close_connections(self.local_port(), wanted)
            with self._lock:
                self.closed += len(shut)
                for peer in shut:
                    self._spent.pop(peer, None)
            time.sleep(CLOSE_EVERY_S)  # a flood is handled in batches


def close_connections(port: int | None, wanted: dict) -> list:
    """Shut down this process's sockets on local `port` whose peer is a key of `wanted`
    ((host, port) -> label); the labels of those shut. The descriptors stay gRPC's: a
    shutdown ends the connection, gRPC closes it."""
    if not port or not wanted:
        return []
    shut = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                    continue
                host, peer_port = sock.getpeername()[:2]
            except (OSError, IndexError, TypeError, ValueError):
                continue
            # gRPC's sockets are often IPv6 ones holding IPv4-mapped addresses
            label = wanted.get((host.removeprefix("::ffff:"), peer_port))
            if label is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                shut.append(label)
            except OSError:
                pass
    return shut
