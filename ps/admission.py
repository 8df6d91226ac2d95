"""Which data calls a shard serves at once, and for how long.

gRPC's Python server runs every call on one thread pool. A client that opens streams and
sends nothing, or many pulls parked on a sync barrier, could hold every thread, so a ping
would wait seconds (20 idle streams: 11 s). Three rules keep the shard responsive:

- every data call (Push, Pull, PushOne, PullOne) names its worker in the metadata
  `x-jaxdist-worker`; a worker may have at most `per_worker` calls open on a shard, further
  ones are refused at once with RESOURCE_EXHAUSTED, so one client can only hold its own slots;
- the pool has `per_worker * workers` threads for data calls plus `CONTROL_THREADS` that data
  calls can never take: control calls (ping, info, retire, stats) always find a thread;
- every data call has a server-side deadline: past it the call is cancelled (its thread and
  slot freed) whatever the client's deadline is.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

# Call metadata: who calls (data calls), the client's handshake nonce (ps.security), and
# why a call failed.
WORKER_KEY = "x-jaxdist-worker"
NONCE_KEY = "x-jaxdist-nonce"
FAULT_KEY = "x-jaxdist-fault"
PER_WORKER = 4      # a worker has one push and one pull per shard in flight; room for retries
CONTROL_THREADS = 8


def pool_size(num_workers: int, per_worker: int = PER_WORKER) -> int:
    return num_workers * per_worker + CONTROL_THREADS


class Refused(Exception):
    """A call the gate does not admit; `kind` is "invalid" or "exhausted"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class CallGate:
    def __init__(self, num_workers: int, deadline_s: float, per_worker: int = PER_WORKER):
        self.num_workers, self.deadline_s, self.per_worker = num_workers, deadline_s, per_worker
        self._open = [0] * num_workers
        self._lock = threading.Lock()
        self._heap: list = []           # (deadline, seq, context, done flag)
        self._seq = itertools.count()
        self._wake = threading.Condition(self._lock)
        self.wakeups = 0                # reaper loop turns, for tests
        threading.Thread(target=self._reap, name="ps-deadlines", daemon=True).start()

    def worker_of(self, context) -> int:
        for key, value in context.invocation_metadata() or ():
            if key == WORKER_KEY:
                text = value if isinstance(value, str) else bytes(value).decode("latin-1")
                # ASCII digits only: "²".isdigit() is True and int("²") raises
                if (0 < len(text) < 10 and text.isascii() and text.isdigit()
                        and int(text) < self.num_workers):
                    return int(text)
                raise Refused("invalid", f"metadata {WORKER_KEY}={text[:20]!r} is not a "
                                         f"worker in 0..{self.num_workers - 1}")
        raise Refused("invalid", f"a data call must name its worker in metadata {WORKER_KEY}")

    def admit(self, context):
        """(worker, release()). Raises Refused."""
        worker = self.worker_of(context)
        with self._lock:
            if self._open[worker] >= self.per_worker:
                raise Refused("exhausted", f"worker {worker} already has {self.per_worker} "
                                           f"calls open on this shard")
            self._open[worker] += 1
            done = [False]
            seq = next(self._seq)
            heapq.heappush(self._heap, (time.monotonic() + self.deadline_s, seq, context, done))
            # Deadlines are admission time + a constant, so a new one is almost never the
            # earliest: waking the reaper for every call cost each shard a thread switch per
            # call. Only a deadline earlier than the one it sleeps towards needs it.
            if self._heap[0][1] == seq:
                self._wake.notify()

        def release():
            with self._lock:
                if not done[0]:
                    done[0] = True
                    self._open[worker] -= 1
        return worker, release

    def open_calls(self) -> list[int]:
        with self._lock:
            return list(self._open)

    def _reap(self) -> None:
        while True:
            expired = []
            with self._lock:
                self.wakeups += 1
                now = time.monotonic()
                while self._heap and (self._heap[0][3][0] or self._heap[0][0] <= now):
                    _, _, context, done = heapq.heappop(self._heap)
                    if not done[0]:
                        expired.append(context)
                wait = (self._heap[0][0] - now) if self._heap else 1.0
                if not expired:
                    self._wake.wait(min(1.0, max(0.01, wait)))
            for context in expired:  # cancelling frees the handler's thread (its call ends)
                context.cancel()
