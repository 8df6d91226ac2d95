"""Which connections a shard's data port (ps.tcp) keeps, and what it tells about the rest.

A slot of the cap (the gRPC pool's size) is only for a connection that authenticated, so
plain sockets that reconnect when closed cannot hold every slot and lock the workers out:

- a new connection has PRE_AUTH_S for its TLS handshake and ps.security's handshake (or,
  in a run without a token, its first header); past it, it is closed (`timed_out`); one
  that fails the handshake is closed (`unauthenticated`);
- at most MAX_WAITING connections wait to authenticate, those in their TLS handshake
  included; one more drops the oldest of them (`dropped`: shut down on its live
  descriptor), so a peer without the token cannot keep a worker from getting in; so does
  an accept that fails for want of file descriptors (`accept_forever`);
- a connection that authenticates when every slot is held is answered UNAVAILABLE and
  closed (`refused`); the worker makes that call over gRPC.

Refusals are counted and logged at most once per LOG_EVERY_S (and in `summary` at the end),
never once per connection: a flood must not flood the log too.
"""

from __future__ import annotations

import collections
import socket
import threading
import time

PRE_AUTH_S = 2.0
MAX_WAITING = 64
LOG_EVERY_S = 10.0
ACCEPT_LOG_EVERY_S = 1.0  # an accept that keeps failing
KINDS = {"timed_out": f"timed out before authenticating ({PRE_AUTH_S:g} s)",
         "dropped": f"dropped unauthenticated (over {MAX_WAITING} waiting, or out of file "
                    "descriptors)",
         "refused": "refused authenticated (every slot held)",
         "unauthenticated": "failed the handshake (no proof of the run's token)"}


class Slot:
    """One accepted connection: its socket (replaced by the TLS one when wrapped, before its
    TLS handshake) and the pre-auth deadline."""

    def __init__(self, sock):
        self.sock, self.authed = sock, False
        self.deadline = time.monotonic() + PRE_AUTH_S


class ConnectionSlots:
    def __init__(self, cap: int, log):
        self.cap, self.log = cap, log
        self.counts = dict.fromkeys(KINDS, 0)
        self.authed = 0
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._logged_at = -LOG_EVERY_S
        self._logged: dict = {}

    def accept(self, sock) -> Slot:
        slot = Slot(sock)
        with self._lock:
            if len(self._waiting) >= MAX_WAITING:
                self._drop_oldest()
            self._waiting[id(slot)] = slot
        return slot

    def _drop_oldest(self) -> None:  # under the lock
        _, oldest = self._waiting.popitem(last=False)
        self._count("dropped")
        try:  # its thread's read ends at once and closes it
            oldest.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def accept_forever(self, listener, serve) -> None:
        """Accept on `listener` and `serve(slot)` each connection, for as long as the
        listener is open. Out of file descriptors (a peer holds many connections, here or
        on the gRPC port), the oldest connection waiting to authenticate is dropped and the
        loop backs off (10-500 ms) and tries again, logging one line a second at most; the
        pending connections wait in the listen backlog meanwhile."""
        pause, failed, logged_at = 0.0, 0, -1.0
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                if listener.fileno() < 0:
                    return  # closed
                failed += 1
                with self._lock:
                    if self._waiting:
                        self._drop_oldest()
                pause = min(0.5, max(0.01, pause * 2))
                if time.monotonic() - logged_at >= ACCEPT_LOG_EVERY_S:
                    logged_at = time.monotonic()
                    self.log(f"data port: accept failed {failed} time(s) "
                             f"({e.strerror or e}); retrying")
                time.sleep(pause)
                continue
            pause = 0.0
            slot = self.accept(conn)
            try:
                serve(slot)
            except RuntimeError:  # no thread to be had: the peer tries again
                conn.close()
                self.release(slot, "dropped")
                time.sleep(0.01)

    def authenticate(self, slot: Slot) -> bool:
        """Move a connection that authenticated into a slot; False: dropped meanwhile,
        or every slot held (counted)."""
        with self._lock:
            if self._waiting.pop(id(slot), None) is None:
                return False
            if self.authed >= self.cap:
                self._count("refused")
                return False
            self.authed += 1
            slot.authed = True
            return True

    def release(self, slot: Slot, why: str | None = None) -> None:
        """The connection ended; `why` (a KINDS key) if it ended unauthenticated for it."""
        with self._lock:
            if slot.authed:
                self.authed -= 1
                slot.authed = False
            elif self._waiting.pop(id(slot), None) is not None and why:
                self._count(why)

    def count(self, kind: str) -> None:
        with self._lock:
            self._count(kind)

    def _count(self, kind: str) -> None:  # under the lock
        self.counts[kind] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            self._logged = dict(self.counts)
            self.log(f"data port: {self.summary()}")

    def summary(self) -> str:
        return "connections " + ", ".join(f"{KINDS[k]}: {v}" for k, v in self.counts.items())

    def unlogged(self) -> bool:
        """Counts the log has not shown yet (none at all: nothing to say)."""
        return any(self.counts.values()) and self.counts != self._logged
