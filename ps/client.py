"""Worker side of the wire: push gradients to and pull parameters from K shards in parallel
(each through a ps.shard_client.ShardClient, which retries), and handle a restarted shard:
it answers a pull with "restarted", so the client re-pushes its last gradient (the restored
shard may have lost it) and pulls again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ps.allocator import keep_freed_memory
from ps.shard_client import PSError, Restarted, ShardClient


class PSClient:
    """All K shards of one worker: parallel push and pull of a flat parameter vector."""

    def __init__(self, addresses: list[str], shard_map, worker: int, mode: str, *,
                 max_message_bytes: int, timeout_s: float, token: str = "", tls_cert: str = "",
                 transport: str = "tcp", locators=None):
        if len(addresses) != shard_map.num_shards:
            raise PSError(f"{len(addresses)} server addresses for a map of "
                          f"{shard_map.num_shards} shards")
        keep_freed_memory()  # every message would page-fault its memory in again
        self.map, self.worker, self.mode = shard_map, worker, mode
        self.shards = [ShardClient(k, a, max_message_bytes=max_message_bytes,
                                   timeout_s=timeout_s, token=token, tls_cert=tls_cert,
                                   transport=transport,
                                   locate=locators[k] if locators else None)
                       for k, a in enumerate(addresses)]
        self.pieces = [shard_map.shard_pieces(k) for k in range(shard_map.num_shards)]
        self.layouts = [{p.name: (p.length, p.offset) for p in pieces} for pieces in self.pieces]
        k = shard_map.num_shards
        self.epoch, self.version = [0] * k, [0] * k
        # a push and a pull may be in flight together (start_push): room for both per shard
        self.pool = ThreadPoolExecutor(max_workers=2 * k, thread_name_prefix="ps-client")
        self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-push")
        self.last_push = None  # (step, grad, versions, epochs): re-sent after a shard restart
        self.push_s, self.pull_s, self.waits = [], [], []
        self.push_bytes = self.pull_bytes = 0
        self.restarts_seen = 0
        self.rejected_nonfinite = 0  # pushes a shard refused because the update was not finite

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every shard (they may still be starting) and check it serves the map
        this worker computed."""
        infos = list(self.pool.map(lambda s: s.wait_ready(timeout_s), self.shards))
        for shard, info in zip(self.shards, infos):
            if info.get("fingerprint") != self.map.fingerprint or info.get("shard") != shard.shard:
                raise PSError(f"{shard.address} serves shard {info.get('shard')} of map "
                              f"{info.get('fingerprint')}, but this worker expects shard "
                              f"{shard.shard} of map {self.map.fingerprint} (same --model, "
                              f"--model-opts, --dataset and --ps-shards everywhere?)")
            self.epoch[shard.shard] = info["epoch"]

    def start_together(self, timeout_s: float) -> float:
        """Say hello to every shard, then wait until every live worker has: a worker still
        importing or compiling must not count as late (sync) or silent (ssp), and start-up
        skew must not show up as staleness. Seconds waited."""
        start = time.monotonic()
        self.control_all("hello", worker=self.worker)
        while True:
            waiting = sorted({w for info in self.control_all("info") for w in info["waiting"]})
            if not waiting:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise PSError(f"worker(s) {waiting} did not start within {timeout_s:g} s")
            time.sleep(0.05)

    def _run(self, starts: dict, t0: float | None = None) -> dict:
        """Finish started calls: small ones are in flight already, large ones stream on the
        pool's threads. {shard: (result or exception, seconds since t0, when they were
        started; now by default)}."""
        t0 = time.perf_counter() if t0 is None else t0
        out = {}

        def timed(k, finish):
            try:
                return finish(), time.perf_counter() - t0
            except (PSError, Restarted) as e:
                return e, time.perf_counter() - t0
        threaded = {k: self.pool.submit(timed, k, f) for k, f in starts.items()
                    if not self.shards[k].small(self.pieces[k])}
        for k, finish in starts.items():
            if k not in threaded:
                out[k] = timed(k, finish)
        for k, future in threaded.items():
            out[k] = future.result()
        return out

    def pull(self, step: int, dest: np.ndarray) -> float:
        """Fill `dest` (the global flat vector) for computing `step`; the longest
        server-side wait in seconds."""
        min_version = step if self.mode == "sync" else 0
        todo = list(range(len(self.shards)))
        waited = 0.0
        for _ in range(3):
            starts = {k: self.shards[k].start_pull(
                {"worker": self.worker, "step": step, "min_version": min_version,
                 "epoch": self.epoch[k]}, self.pieces[k], self.layouts[k], dest) for k in todo}
            restarted = []
            for k, (result, seconds) in self._run(starts).items():
                if isinstance(result, Restarted):
                    restarted.append(k)
                    continue
                if isinstance(result, Exception):
                    raise result
                meta, nbytes = result
                self.pull_s.append(seconds)
                self.pull_bytes += nbytes
                self.version[k], self.epoch[k] = meta["version"], meta["epoch"]
                waited = max(waited, meta["waited_us"] / 1e6)
            for k in restarted:
                self.restarts_seen += 1
                self._repush(self.shards[k])
            if not restarted:
                self.waits.append(waited)
                return waited
            todo = restarted
        raise PSError(f"shard(s) {todo} kept restarting during the pull of step {step}")

    def _repush(self, shard: ShardClient) -> None:
        """A restarted shard may have lost our last gradient: send it again (deduplicated
        if it had survived)."""
        k = shard.shard
        info = shard.wait_ready()
        if self.last_push is not None:
            step, grad, versions, epochs = self.last_push
            reply, _ = shard.push(self.pieces[k], grad, {
                "worker": self.worker, "step": step, "version": versions[k],
                "epoch": epochs[k]})
            self.epoch[k] = reply["epoch"]
        else:
            self.epoch[k] = info["epoch"]

    def push(self, step: int, grad: np.ndarray, repeat: int = 1) -> list[dict]:
        """Send `grad` (global flat vector) of `step` to every shard; `repeat` > 1 sends it
        again, as a retry after a lost reply would (the copies must be deduplicated)."""
        return self._begin_push(step, grad, repeat)()

    def _begin_push(self, step: int, grad: np.ndarray, repeat: int = 1):
        """Start `push`: small transfers are on the wire when this returns; `finish()`
        reads the replies (streaming the large ones) and returns what `push` does."""
        versions, epochs = list(self.version), list(self.epoch)
        self.last_push = (step, grad, versions, epochs)

        def start():
            return {k: s.start_push(self.pieces[k], grad, {
                "worker": self.worker, "step": step, "version": versions[k],
                "epoch": epochs[k]}) for k, s in enumerate(self.shards)}
        sent = [(time.perf_counter(), start())]

        def finish() -> list[dict]:
            first = {}
            for i in range(repeat):
                t0, starts = sent.pop() if i == 0 else (time.perf_counter(), start())
                for k, (result, seconds) in self._run(starts, t0).items():
                    if isinstance(result, Exception):
                        raise result
                    reply, nbytes = result
                    self.push_s.append(seconds)
                    self.push_bytes += nbytes
                    self.epoch[k] = max(self.epoch[k], reply["epoch"])
                    if reply.get("status") == "rejected_nonfinite":
                        self.rejected_nonfinite += 1
                    first.setdefault(k, reply)
            return [first[k] for k in range(len(self.shards))]
        return finish

    def start_push(self, step: int, grad: np.ndarray, repeat: int = 1, then_pull=None):
        """Push in the background; returns `finish()`, which waits for it. With
        `then_pull=(next_step, dest)` the pull of the next step comes with it and `finish()`
        returns the pull's wait (else None). Small transfers: one PushPullOne call per
        shard, which pulls once the push is applied (ps-lite's ZPushPull): a sync shard
        holds it until this step's barrier completes, so the parameters come back without
        another round trip. Larger ones: sync sends the pull at once (the barrier orders
        it), async/ssp after the push's reply (a pull must see the worker's own update). A
        failed push is reported before the pull it made wait."""
        small = all(s.small(p) for s, p in zip(self.shards, self.pieces))
        if then_pull is not None and repeat == 1 and then_pull[0] == step + 1 and small:
            return self._start_push_pull(step, grad, then_pull[1])
        if then_pull is None and small:
            # Sent from this thread now, the replies read in finish(): the next batch is
            # prepared meanwhile, with no hand-off to another thread (async mlp-tiny, one
            # worker, measured: the push phase 0.92 ms of a 1.83 ms step, the calls 0.61 ms).
            pushed = self._begin_push(step, grad, repeat)

            def finish_sent():
                pushed()
                return None
            return finish_sent
        pushing = self.side.submit(self.push, step, grad, repeat)
        if then_pull is None or self.mode != "sync":
            def finish_push():
                pushing.result()
                return None if then_pull is None else self.pull(*then_pull)
            return finish_push

        def finish():
            try:
                waited = self.pull(*then_pull)
            except (PSError, Restarted):
                pushing.result()  # raises the push's error: the first cause
                raise
            pushing.result()
            return waited
        return finish

    def _start_push_pull(self, step: int, grad: np.ndarray, dest: np.ndarray):
        """Small shards: one PushPullOne call per shard carries the push of `step` and
        brings back the parameters of step+1. Each call counts as one push and
        one pull of the same duration. A shard that restarted meanwhile is pulled again the
        ordinary way (which re-pushes this gradient; the shard deduplicates it)."""
        versions, epochs = list(self.version), list(self.epoch)
        self.last_push = (step, grad, versions, epochs)
        t0 = time.perf_counter()
        calls = {k: s.start_push_pull(self.pieces[k], grad, {
            "worker": self.worker, "step": step, "version": versions[k], "epoch": epochs[k]},
            self.layouts[k], dest) for k, s in enumerate(self.shards)}

        def finish():
            waited, again, error = 0.0, [], None
            for k, call in calls.items():
                try:
                    reply, sent, meta, got = call()
                except Restarted:
                    again.append(k)
                    continue
                except PSError as e:
                    error = error or e
                    continue
                seconds = time.perf_counter() - t0
                self.push_s.append(seconds)
                self.pull_s.append(seconds)
                self.push_bytes += sent
                self.pull_bytes += got
                if reply.get("status") == "rejected_nonfinite":
                    self.rejected_nonfinite += 1
                self.version[k], self.epoch[k] = meta["version"], meta["epoch"]
                waited = max(waited, meta["waited_us"] / 1e6)
            if error is not None:
                raise error
            if again:
                return max(waited, self.pull(step + 1, dest))
            self.waits.append(waited)
            return waited
        return finish

    def control_all(self, op: str, **fields) -> list[dict]:
        return list(self.pool.map(lambda s: s.control(op, **fields), self.shards))

    def close(self) -> None:
        self.side.shutdown(wait=False)
        self.pool.shutdown(wait=False)
        for shard in self.shards:
            shard.close()
