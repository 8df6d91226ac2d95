"""The launcher's deadline: every worker and shard must make progress, in every mode.

The launcher asks each shard for `progress` (a control call, served apart from data calls,
with a short deadline) about twice a second. A worker's progress is the newest step any
shard has seen it push; a shard's is answering at all. A worker that has not moved for
`--ps-timeout-s` (after training started; before that it gets the start-up allowance), or a
shard that has not answered for that long, ends the run: the launcher names it in one line
and stops everything (jaxdist.procs: SIGTERM, SIGCONT, SIGKILL after a grace period).
Training starts when every live worker has said hello (workers start together), so a
worker that said hello and waits for a late one is not late: the late one is named.

When several things stall at once (a frozen worker holds a sync barrier, so every worker
stalls), the one named is the first cause: a stopped process, then a shard that does not
answer or did not while the workers stalled (a shard paused for about --ps-timeout-s
answers again just as the workers' deadline passes: it is named, not a worker that waited
for it), then the worker the others wait for (the one that moved longest ago, i.e. the one
furthest behind), never a bystander that merely waited for it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc

from ps import wire

PROBE_EVERY_S = 0.5


def process_state(pid: int) -> str:
    """One-letter state from /proc (R, S, T stopped, Z zombie...), "" if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _state_note(pid: int) -> str:
    state = process_state(pid)
    if state in ("T", "t"):
        return "; the process is stopped (SIGSTOP)"
    return ""


class Progress:
    def __init__(self, launch, timeout_s: float, startup_s: float):
        self.launch, self.timeout_s, self.startup_s = launch, timeout_s, startup_s
        now = time.monotonic()
        self.began = now
        k, w = len(launch.servers), len(launch.workers)
        self.clients = [launch.client(i) for i in range(k)]
        self.shard_seen = [now] * k           # last time shard i answered
        self.failing = [False] * k            # its last probe went unanswered
        self.answered = [False] * k           # answered once (a slow start is no outage)
        self.outage: dict = {}                # shard -> (from, to) of its last long silence
        self.outage_s = max(2.0, timeout_s / 2)  # a silence this long is one
        self.step = [-1] * w                  # newest step seen pushed, over all shards
        self.moved = [now] * w                # when that last changed
        self.hello = [False] * w              # said hello to every shard
        self.started = [False] * w            # training started: every live worker said hello
        self.missing: set[int] = set()        # sync: workers a barrier waits for
        self.next_probe = 0.0

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def probe(self, now: float | None = None) -> None:
        given = now is not None
        now = time.monotonic() if now is None else now
        if now < self.next_probe:
            return
        self.next_probe = now + PROBE_EVERY_S
        request = wire.encode({"op": "progress"})
        steps, started, missing, retired = None, None, set(), set()
        for k, client in enumerate(self.clients):
            try:
                reply = json.loads(client._control(request, timeout=min(2.0, self.timeout_s),
                                                   metadata=client.metadata))
            except grpc.RpcError:
                self.failing[k] = True
                continue  # not answering (stopped, dead, restarting): shard_seen stays
            answered = now if given else time.monotonic()
            if (self.answered[k] and self.failing[k]
                    and answered - self.shard_seen[k] >= self.outage_s):
                self.outage[k] = (self.shard_seen[k], answered)  # probes failed meanwhile
            self.failing[k], self.answered[k] = False, True
            self.shard_seen[k] = answered
            seen = reply["seen_step"]
            steps = seen if steps is None else [max(a, b) for a, b in zip(steps, seen)]
            here = set(reply["started"])
            started = here if started is None else started & here
            missing |= set(reply["missing"])
            retired |= set(reply["retired"])
        self.missing = missing
        if steps is None:
            return
        together = started is not None and all(
            w in started or w in retired for w in range(len(steps)))
        for w, s in enumerate(steps):
            if s != self.step[w]:
                self.step[w], self.moved[w] = s, now
            if started is not None and w in started:
                self.hello[w] = True
            if together and self.hello[w] and not self.started[w]:
                self.started[w] = True
                self.moved[w] = now  # training starts now: compile time is not a stall

    def _worker_line(self, w: int, now: float) -> str:
        child = self.launch.workers[w]
        at = f"at step {self.step[w]}" if self.step[w] >= 0 else "before its first push"
        return (f"worker {w} (pid {child.pid}) made no progress for {now - self.moved[w]:.1f} s "
                f"({at}){_state_note(child.pid)}")

    def stalled(self, done: set[int], now: float | None = None):
        """(what, index, one-line reason) of the first thing that stopped moving ("shard"
        or "worker"), or None while everything moves."""
        now = time.monotonic() if now is None else now
        for k, child in enumerate(self.launch.servers):
            if child.poll() is None and now - self.shard_seen[k] > self.timeout_s:
                return "shard", k, (
                    f"shard {k} (pid {child.pid}, {self.launch.addresses[k]}) made no "
                    f"progress: no answer for {now - self.shard_seen[k]:.1f} s "
                    f"(--ps-timeout-s {self.timeout_s:g}){_state_note(child.pid)}")
        late = []
        for w, child in enumerate(self.launch.workers):
            if w in done or child.poll() is not None:
                continue
            limit = self.timeout_s if self.started[w] else self.startup_s
            silent = self._silent_while(w) if now - self.moved[w] > limit else None
            if silent is not None:
                return "shard", silent, (self._outage_line(silent, now) + f", and worker {w} "
                                         f"made no progress for {now - self.moved[w]:.1f} s "
                                         f"(--ps-timeout-s {self.timeout_s:g})")
            # Evidence must be fresh: every live shard answered after the worker was already
            # late. (A stopped shard also stops every worker's progress; it is the one to
            # name, at its own deadline above.)
            fresh = all(self.shard_seen[k] >= self.moved[w] + limit
                        for k, c in enumerate(self.launch.servers) if c.poll() is None)
            if now - self.moved[w] > limit and fresh:
                late.append(w)
        if not late:
            return None
        # before training starts, one that has not said hello is late, not those waiting for it
        first = min(late, key=lambda w: (self.hello[w] and not self.started[w],
                                          self.moved[w], self.step[w], w))
        if not self.started[first]:
            child = self.launch.workers[first]
            return "worker", first, (
                f"worker {first} (pid {child.pid}) did not start training within "
                f"{self.startup_s:g} s{_state_note(child.pid)}")
        return "worker", first, (self._worker_line(first, now)
                                 + f" (--ps-timeout-s {self.timeout_s:g})")

    def _silent_while(self, w: int) -> int | None:
        """A live shard whose last long silence ended after worker w last moved: what the
        worker waited for, or None."""
        for k, (start, end) in sorted(self.outage.items()):
            if end > self.moved[w] and self.launch.servers[k].poll() is None:
                return k
        return None

    def _outage_line(self, k: int, now: float) -> str:
        start, end = self.outage[k]
        child = self.launch.servers[k]
        return (f"shard {k} (pid {child.pid}, {self.launch.addresses[k]}) made no progress: "
                f"no answer for {end - start:.1f} s, until {max(0.0, now - end):.1f} s ago "
                f"(paused or stopped){_state_note(child.pid)}")

    def first_cause(self, failed: int, done: set[int]) -> str | None:
        """Why worker `failed` probably failed, if another process is to blame: a stopped
        process, a shard that does not answer, or a worker a sync barrier waits for."""
        now = time.monotonic()
        self.next_probe = 0.0
        self.probe(now)
        for k, child in enumerate(self.launch.servers):
            if child.poll() is None and process_state(child.pid) in ("T", "t"):
                return f"shard {k} (pid {child.pid}) is stopped (SIGSTOP)"
        for w, child in enumerate(self.launch.workers):
            if w != failed and w not in done and process_state(child.pid) in ("T", "t"):
                return self._worker_line(w, now)
        for k, child in enumerate(self.launch.servers):
            if child.poll() is None and self.shard_seen[k] < now - 1.0:
                return f"shard {k} (pid {child.pid}) does not answer"
        silent = self._silent_while(failed)
        if silent is not None:
            return self._outage_line(silent, now)
        if self.hello[failed] and not self.started[failed]:  # it waited for the others
            late = [w for w, child in enumerate(self.launch.workers) if not self.hello[w]
                    and w not in done and child.poll() is None]
            if late:
                child = self.launch.workers[late[0]]
                return (f"worker {late[0]} (pid {child.pid}) did not say hello within "
                        f"{now - self.began:.1f} s of the start{_state_note(child.pid)}")
        behind = [w for w in self.missing if w != failed and w not in done]
        if behind:
            return self._worker_line(min(behind, key=lambda w: (self.step[w], w)), now)
        return None
