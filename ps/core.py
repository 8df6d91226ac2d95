"""One shard's state machine: parameters, optimizer state, versions, modes, dedup, staleness,
barriers. Plain Python with a Condition (ps.servicer is a thin layer over it); the update is
ps.shard_optimizer's, the counters ps.accounting's, the snapshot's contents ps.snapshot's.

Vocabulary:
- version: number of optimizer applies this shard has made (its parameter version).
- step: a worker's iteration counter; (worker, step) names a gradient, so a retry is deduplicated.
- staleness of an applied gradient: version at apply time - version it was computed on.
- clock (ssp): a worker's clock is the step it is about to compute; a worker may pull for
  step c only while c - min(clock of live workers) <= s.
- epoch: the shard's life count. A shard restarted from a snapshot has a higher epoch and
  an older version than its clients remember; requests carrying an older epoch are from
  before the restart and are reconciled (see `push`), never rejected as "from the future".

Modes:
- sync (BSP): gradients of step t are held until every live worker sent one, then their mean
  (summed in worker order, so runs are reproducible) is applied once; pulls for version t+1
  wait on that barrier.
- async (ASP): each gradient is applied on arrival.
- ssp: async applies, plus the clock bound on pulls.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from ps import snapshot
from ps.accounting import ShardAccounting
from ps.buffers import GradientBuffers
from ps.shard_optimizer import ShardOptimizer, mean_in_worker_order


def _all_finite(x: np.ndarray) -> bool:
    """Whether every element is finite: a finite sum says so in one pass with no temporary
    (an inf or nan makes the sum inf or nan); only a sum that is not finite is checked
    element-wise (finite values can overflow it)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(x))) or bool(np.isfinite(x).all())


class PSFault(Exception):
    """A request the shard refuses. `kind` maps to a gRPC status in the servicer: invalid
    (INVALID_ARGUMENT), precondition and restarted (FAILED_PRECONDITION; on restarted the
    client re-pushes and retries), aborted (ABORTED), deadline (DEADLINE_EXCEEDED)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ShardCore:
    def __init__(self, params: np.ndarray, tx, *, mode: str, num_workers: int,
                 staleness: int = 0, staleness_lr: bool = False, drop_dead: bool = False,
                 timeout_s: float = 30.0, checkpoint_every: int = 0,
                 snapshot_dir: Path | None = None, epoch: int = 0, clip_norm: float = 0.0,
                 log=None):
        if mode not in ("sync", "async", "ssp"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode, self.num_workers = mode, num_workers
        self.bound, self.staleness_lr = staleness, staleness_lr
        self.drop_dead, self.timeout_s = drop_dead, timeout_s
        self.checkpoint_every, self.snapshot_dir = checkpoint_every, snapshot_dir
        self.log = log or (lambda msg: None)
        self.size = int(params.size)
        self.optimizer = ShardOptimizer(params, tx, clip_norm)
        self.cond = threading.Condition()
        self.epoch, self.version, self.last_outcome = epoch, 0, "applied"
        self.resync = False             # restored: adopt the workers' step at the next push
        self.alive = set(range(num_workers))
        self.retired: dict[int, str] = {}
        self.last_step = {w: -1 for w in range(num_workers)}
        self.unapplied: dict[int, int] = {}  # async/ssp: a step rejected non-finite (`_push`)
        self.skipped: int | None = None  # sync: the last barrier's step rejected non-finite
        self.seen_step = {w: -1 for w in range(num_workers)}  # progress, for the launcher
        self.clock = {w: 0 for w in range(num_workers)}
        self.started: set[int] = set()  # workers that said hello (see `hello`)
        self.last_seen: dict[int, float] = {}
        self.pending: dict[int, np.ndarray] = {}  # sync: the open barrier's gradients
        self.barrier_opened, self.failure = 0.0, None
        self.pull_clock: dict[int, tuple[int, int]] = {}
        self.accounting = ShardAccounting(num_workers)
        self.buffers = GradientBuffers(self.size, keep=num_workers)

    # -- requests -------------------------------------------------------------------------

    def push(self, worker: int, step: int, version: int, epoch: int, grad: np.ndarray) -> dict:
        with self.cond:
            try:
                return self._push(worker, step, version, epoch, grad)
            except PSFault:
                self.accounting.counts["rejected"] += 1
                raise

    def _push(self, worker, step, version, epoch, grad) -> dict:
        self._check_worker(worker)
        if grad.shape != (self.size,) or grad.dtype != np.float32:
            raise PSFault("invalid", f"gradient of shape {grad.shape} {grad.dtype}, "
                                     f"expected ({self.size},) float32")
        if epoch > self.epoch:
            raise PSFault("invalid", f"epoch {epoch} is from the future (shard is in "
                                     f"epoch {self.epoch})")
        self.last_seen[worker] = time.monotonic()
        if step <= self.last_step[worker] and self.unapplied.get(worker) != step:
            if self.mode == "sync" and step == self.skipped:  # its retry learns the outcome
                return self._reply("rejected_nonfinite")
            self.accounting.counts["deduplicated"] += 1
            return self._reply("deduplicated")
        if epoch == self.epoch and version > self.version:
            raise PSFault("invalid", f"version {version} is from the future (shard is at "
                                     f"version {self.version})")
        if not _all_finite(grad):
            raise PSFault("invalid", "gradient has non-finite values")
        if self.mode == "sync":
            return self._push_sync(worker, step, grad)
        # A step the worker cannot have reached: applying it would also make every later
        # real push of this worker look like a duplicate. A push from before a restart
        # (older epoch) is exempt: the restored shard's clocks are behind on purpose.
        reach = self.last_step[worker] + 1 + (self.bound if self.mode == "ssp" else 0)
        if epoch == self.epoch and not self.resync and step > reach:
            raise PSFault("precondition", f"worker {worker} pushed step {step}, beyond the "
                                          f"step {reach} it can have reached (last applied "
                                          f"step {self.last_step[worker]})")
        if epoch < self.epoch and version > self.version:
            # A gradient from before this shard's restart: its version counts the lost life.
            # Move the counter forward so versions keep increasing for every client.
            self._event(f"epoch {self.epoch}: version {self.version} -> {version} "
                        f"(resumed from a snapshot)")
            self.version = version
        self.resync = False
        stale = self.version - version
        scale = 1.0 / (1.0 + stale) if self.staleness_lr else 1.0
        self.last_step[worker] = max(self.last_step[worker], step)
        self.seen_step[worker] = max(self.seen_step[worker], step)
        self.clock[worker] = max(self.clock[worker], step + 1)
        # Rejected as non-finite: reached (the worker goes on), not done (a retry applies).
        if not self._apply_update(grad, scale, f"push of worker {worker} step {step}"):
            self.unapplied[worker] = step
            self._after_apply()
            return self._reply("rejected_nonfinite")
        if self.unapplied.get(worker) == step:
            del self.unapplied[worker]
        self.accounting.applied(stale, scale)
        pulled = self.pull_clock.get(worker)
        if pulled and pulled[0] == step:
            self.accounting.step_staleness_hist[pulled[1]] += 1
        self._after_apply()
        return self._reply("applied", staleness=stale)

    def _push_sync(self, worker, step, grad) -> dict:
        if self.failure:
            # The barrier failed: a late gradient must not complete (and apply) it now.
            raise PSFault("precondition", self.failure)
        if self.resync and not self.pending:
            if step > self.version:
                self._event(f"epoch {self.epoch}: version {self.version} -> {step} "
                            f"(resumed from a snapshot)")
                self.version = step
            self.resync = False
        if step != self.version:
            raise PSFault("precondition", f"worker {worker} pushed step {step} but the sync "
                                          f"barrier is at step {self.version}")
        if worker in self.pending:
            self.accounting.counts["deduplicated"] += 1
            return self._reply("deduplicated")
        if not self.pending:
            self.barrier_opened = time.monotonic()
        self.pending[worker] = grad
        self.seen_step[worker] = max(self.seen_step[worker], step)
        self._maybe_complete_barrier()
        if worker in self.pending:
            return self._reply("pending")
        return self._reply(self.last_outcome)

    def pull(self, worker: int, step: int, min_version: int, epoch: int,
             timeout_s: float | None = None):
        """(version, epoch, params, waited seconds, what was waited on or None). Blocks on the
        sync barrier or the ssp bound, never past the deadline."""
        limit = self.timeout_s + 1.0 if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + limit
        kind = None
        with self.cond:
            self._check_worker(worker)
            if epoch < self.epoch:
                raise PSFault("restarted", f"shard restarted (epoch {self.epoch}); re-push "
                                           f"your last gradient")
            if epoch > self.epoch:
                raise PSFault("invalid", f"epoch {epoch} is from the future")
            if self.mode == "sync" and min_version > self.version + 1:
                raise PSFault("invalid", f"version {min_version} is from the future (shard "
                                         f"is at version {self.version})")
            self.last_seen[worker] = time.monotonic()
            if self.mode != "sync":
                if epoch == self.epoch and step > self.last_step[worker] + 1:
                    raise PSFault("invalid", f"step {step} is from the future (worker {worker} "
                                             f"last pushed step {self.last_step[worker]})")
                self.clock[worker] = max(self.clock[worker], step)
            while True:
                if self.failure:
                    raise PSFault("aborted", self.failure)
                self._check_worker(worker)
                now = time.monotonic()
                if self.mode == "sync":
                    if self.version >= min_version:
                        break
                    kind = "barrier"
                    self._check_barrier(now)
                    if self.version >= min_version or self.failure:
                        continue
                    waiting_on = (f"the sync barrier of step {self.version} (missing workers "
                                  f"{sorted(self.alive - set(self.pending))})")
                elif self.mode == "ssp":
                    if step - self._min_clock() <= self.bound:
                        break
                    kind = "bound"
                    self._retire_silent(now)
                    if step - self._min_clock() <= self.bound:
                        continue
                    slow = min(self.alive, key=lambda w: (self.clock[w], w))
                    waiting_on = (f"the ssp bound: worker {worker} at step {step} is more than "
                                  f"{self.bound} ahead of worker {slow} at step "
                                  f"{self.clock[slow]}")
                else:
                    break
                if now >= deadline:
                    raise PSFault("deadline", f"waited {limit:g} s for {waiting_on}")
                self.cond.wait(min(0.2, deadline - now))
            waited = time.monotonic() - start
            if kind:
                self.accounting.waited(kind, worker, waited)
            if self.mode != "sync":
                self.pull_clock[worker] = (step, step - self._min_clock())
            return self.version, self.epoch, self.optimizer.serve, waited, kind

    def hello(self, worker: int) -> dict:
        """A worker is ready to train. Workers start together (each waits until `waiting`
        is empty): a worker still compiling is neither silent (ssp) nor late (sync)."""
        with self.cond:
            self._check_worker(worker)
            self.started.add(worker)
            self.last_seen[worker] = time.monotonic()
            self.cond.notify_all()
            return {"waiting": sorted(self.alive - self.started)}

    def progress(self) -> dict:
        """What the launcher watches: the newest step each worker has pushed (-1: none),
        who said hello, who is retired, the version, and why a sync barrier failed."""
        with self.cond:
            return {"version": self.version, "epoch": self.epoch,
                    "seen_step": [self.seen_step[w] for w in range(self.num_workers)],
                    "started": sorted(self.started), "retired": sorted(self.retired),
                    "missing": sorted(self.alive - set(self.pending)) if self.pending else [],
                    "failure": self.failure}

    def waiting(self) -> list[int]:
        with self.cond:
            return sorted(self.alive - self.started)

    def retire(self, worker: int, reason: str) -> None:
        """Stop waiting for `worker` (it died or finished): barriers and bounds go on
        without it."""
        with self.cond:
            if 0 <= worker < self.num_workers and worker not in self.retired:
                self._retire(worker, reason)
                self._maybe_complete_barrier()
                self.cond.notify_all()

    def take_buffer(self) -> np.ndarray:
        """A float32 buffer of the shard's size to receive a gradient into."""
        with self.cond:
            return self.buffers.take()

    def give_buffer(self, buf: np.ndarray) -> None:
        """Return a buffer the core does not hold (anything but a pending sync gradient)."""
        with self.cond:
            self.buffers.give(buf, held=self.pending.values())

    def count_rejected(self) -> None:
        """A push refused before it reached the core (malformed on the wire)."""
        with self.cond:
            self.accounting.counts["rejected"] += 1

    def params(self) -> tuple[int, np.ndarray]:
        with self.cond:
            return self.version, self.optimizer.serve

    # -- internals ------------------------------------------------------------------------

    def _check_worker(self, worker: int) -> None:
        if type(worker) is not int or not 0 <= worker < self.num_workers:
            raise PSFault("invalid", f"worker {worker!r} is outside 0..{self.num_workers - 1}")
        if worker in self.retired:
            raise PSFault("aborted", f"worker {worker} was retired: {self.retired[worker]}")

    def _event(self, message: str) -> None:
        self.accounting.events.append(message)

    def _reply(self, status: str, staleness: int = 0) -> dict:
        return {"status": status, "version": self.version, "epoch": self.epoch,
                "staleness": staleness}

    def _apply_update(self, grad: np.ndarray, scale: float, what: str) -> bool:
        """Apply one (aggregated) gradient; False, and nothing changed, if the result would
        not be finite. The version moves on either way in sync (the barrier's step is done)
        and only on success in async/ssp."""
        finite, clipped = self.optimizer.update(grad, scale)
        if not finite:
            self.accounting.counts["rejected_nonfinite"] += 1
            self.last_outcome = "rejected_nonfinite"
            message = (f"version {self.version}: {what} rejected: the update is not finite; "
                       f"parameters and optimizer state unchanged")
            self._event(message)
            self.log(message)
            if self.mode == "sync":  # the barrier's step is skipped whole (`_push`)
                self.skipped, self.version = self.version, self.version + 1
            return False
        if clipped:
            self.accounting.counts["clipped"] += 1
        self.version += 1
        self.accounting.counts["applies"] += 1
        self.last_outcome = "applied"
        return True

    def _after_apply(self) -> None:
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self._periodic_snapshot()
        self.cond.notify_all()

    def snapshot_now(self) -> None:
        """A snapshot now (the shard's version 0 at start), failing as a periodic one."""
        self._periodic_snapshot()

    def _periodic_snapshot(self) -> None:
        """A snapshot after an update: one that fails (a full disk, no descriptors) does not
        fail the push it follows, which is applied already. It is counted, its path and
        cause are logged (the first time, then every 100th), and the previous snapshot
        stays the one a restart uses (ps.snapshot writes atomically)."""
        try:
            self.save_snapshot()
        except OSError as e:
            counts = self.accounting.counts  # a Counter
            counts["snapshot_failures"] += 1
            if counts["snapshot_failures"] % 100 == 1:
                message = (f"snapshot of version {self.version} failed "
                           f"({counts['snapshot_failures']} so far): "
                           f"{e.filename or self.snapshot_dir}: {e.strerror or e}; the last "
                           f"good snapshot is kept; free space under {self.snapshot_dir} (a "
                           f"restart uses the last good one)")
                self._event(message)
                self.log(message)

    def _maybe_complete_barrier(self) -> None:
        if self.mode != "sync" or not self.pending or not self.alive <= set(self.pending):
            return
        workers = sorted(self.pending)
        step = self.version
        mean = mean_in_worker_order(self.pending, out=self.buffers.take())
        if self._apply_update(mean, 1.0, f"sync step {step} of workers {workers}"):
            self.accounting.applied(0, 1.0, len(workers))
        for w in workers:
            self.last_step[w] = step
        held = [*self.pending.values(), mean]  # the update is done with the mean
        self.pending.clear()
        for buf in held:
            self.buffers.give(buf)
        self._after_apply()

    def _check_barrier(self, now: float) -> None:
        if not self.pending or now - self.barrier_opened < self.timeout_s:
            return
        missing = sorted(self.alive - set(self.pending))
        if self.drop_dead:
            for w in missing:
                self._retire(w, f"no gradient for step {self.version} within "
                                f"{self.timeout_s:g} s")
            self._maybe_complete_barrier()
        else:
            self.failure = (f"sync barrier of step {self.version}: no gradient from worker(s) "
                            f"{missing} within {self.timeout_s:g} s (--ps-timeout-s); sync "
                            f"mode stops (--ps-drop-dead-workers continues without them)")
        self.cond.notify_all()

    def _min_clock(self) -> int:
        return min((self.clock[w] for w in self.alive), default=0)

    def _retire_silent(self, now: float) -> None:
        lo = self._min_clock()
        for w in sorted(self.alive):
            seen = self.last_seen.get(w)
            if self.clock[w] == lo and seen is not None and now - seen >= self.timeout_s:
                self._retire(w, f"silent for {now - seen:.1f} s at step "
                                f"{self.clock[w]} (ssp bound)")

    def _retire(self, worker: int, reason: str) -> None:
        self.alive.discard(worker)
        self.retired[worker] = reason
        self.pending.pop(worker, None)
        self._event(f"worker {worker} retired: {reason}")
        self.log(f"worker {worker} retired: {reason}")

    # -- snapshots ------------------------------------------------------------------------

    def save_snapshot(self) -> None:
        if self.snapshot_dir is None:
            return
        snapshot.save(self.snapshot_dir, self.optimizer.arrays(), snapshot.shard_meta(self))
        self.accounting.counts["snapshots"] += 1

    def restore(self, arrays: dict, meta: dict) -> None:
        """Continue from a snapshot (this object's epoch is already the new one)."""
        with self.cond:
            snapshot.restore_shard(self, arrays, meta)

    def stats(self) -> dict:
        with self.cond:
            return {"version": self.version, "epoch": self.epoch, "mode": self.mode,
                    **self.accounting.stats(), "apply_s": self.optimizer.apply_s,
                    "retired": {str(w): r for w, r in sorted(self.retired.items())},
                    "params_bytes": self.size * 4, "opt_bytes": self.optimizer.opt_bytes()}
