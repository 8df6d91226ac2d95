"""The parameter server without processes or gRPC: shard map, wire frames, and the shard
state machine (modes, dedup, staleness, barriers, bounds, snapshots)."""

import random
import threading
import time

import numpy as np
import optax
import pytest

from jaxdist.errors import UsageError
from ps import wire
from ps.core import PSFault, ShardCore
from ps.shardmap import Leaf, build_shard_map
from tests.helpers import job_of


def leaves(*sizes):
    out, offset = [], 0
    for i, size in enumerate(sizes):
        out.append(Leaf(f"l{i}", (size,), "float32", offset, size))
        offset += size
    return out


# -- shard map ----------------------------------------------------------------------------

def test_shard_map_is_deterministic_balanced_and_exact():
    ls = leaves(10_000, 64, 4096, 64, 640, 10)
    a, b = build_shard_map(ls, 3), build_shard_map(ls, 3)
    assert a == b and a.fingerprint == b.fingerprint
    assert a.fingerprint != build_shard_map(ls, 2).fingerprint
    covered = np.zeros(a.total, int)
    for p in a.pieces:
        covered[p.offset:p.offset + p.length] += 1
    assert (covered == 1).all()  # every element owned by exactly one shard
    sizes = a.bytes_per_shard
    assert sum(sizes) == a.total * 4
    assert max(sizes) - min(sizes) <= a.chunk_elems * 4  # balanced within one piece
    big = {p.shard for p in a.pieces if p.leaf == "l0"}
    assert len(big) > 1  # the leaf larger than a chunk is split across shards
    for k in range(3):  # a shard's own vector is its pieces back to back
        pos = 0
        for p in a.shard_pieces(k):
            assert p.shard_offset == pos
            pos += p.length


def test_shard_map_gather_and_one_shard():
    ls = leaves(3000, 7)
    flat = np.arange(3007, dtype=np.float32)
    one = build_shard_map(ls, 1)
    np.testing.assert_array_equal(one.gather(flat, 0), flat)
    two = build_shard_map(ls, 2)
    assert sorted(np.concatenate([two.gather(flat, k) for k in range(2)])) == list(flat)


def test_too_many_shards_is_a_usage_error():
    with pytest.raises(UsageError, match="exceeds the 2 pieces"):
        build_shard_map(leaves(100, 10), 3)
    with pytest.raises(UsageError, match="must be 1 or more"):
        build_shard_map(leaves(100), 0)


def test_real_model_map_names_its_leaves():
    from jaxdist.config import ModelConfig, RunConfig
    from ps.shardmap import shard_map_for

    m = shard_map_for(job_of(RunConfig(model=ModelConfig(model="mlp-tiny"))), 2)
    assert m.total == 6922
    assert {l.name for l in m.leaves} >= {"head/kernel", "hidden/0/kernel"}


# -- wire ---------------------------------------------------------------------------------

def test_frames_round_trip_in_chunks():
    m = build_shard_map(leaves(5000, 30), 2)
    src = np.random.default_rng(0).standard_normal(m.total).astype(np.float32)
    for k in range(2):
        pieces = m.shard_pieces(k)
        dest = np.zeros(m.total, np.float32)
        asm = wire.Assembler("push", {p.name: (p.length, p.offset) for p in pieces}, dest,
                             fixed=("worker", "step"))
        frames = list(wire.frames("push", pieces, src, 1024, {"worker": 1, "step": 7}))
        assert len(frames) > len(pieces)  # chunked
        for f in frames:
            asm.add(f)
        assert asm.finish() == {"worker": 1, "step": 7}
        for p in pieces:
            np.testing.assert_array_equal(dest[p.offset:p.offset + p.length],
                                          src[p.offset:p.offset + p.length])


def test_whole_small_pieces_travel_as_runs_and_land_where_their_layout_says():
    """Consecutive whole pieces that fit in one frame go as one frame (one header): 10
    pieces of 1,024 elements and two of 30 over 2 shards, frames of 16 KiB. Shard pieces are
    not contiguous in the global vector (the greedy deal interleaves them), so each piece of
    a run lands at its own offset; a piece larger than a frame still goes in chunks."""
    m = build_shard_map(leaves(*[1024] * 10, 30, 9000, 30), 2, chunk_elems=1024)
    src = np.random.default_rng(1).standard_normal(m.total).astype(np.float32)
    for k in range(2):
        pieces = m.shard_pieces(k)
        frames = list(wire.frames("push", pieces, src, 16 << 10, {"worker": 1, "step": 7}))
        headers = [wire.decode(f)[0] for f in frames]
        assert sum(h.get("count", 1) for h in headers) == len(pieces)
        assert len(frames) < len(pieces)
        assert all(h["nbytes"] <= 16 << 10 for h in headers)
        assert all(h["shape"] == [h["nbytes"] // 4] for h in headers if "count" in h)
        dest = np.zeros(m.total, np.float32)
        for message in (frames, [wire.bundle("push", pieces, src, 16 << 10,
                                             {"worker": 1, "step": 7})]):
            dest[:] = 0
            asm = wire.Assembler("push", {p.name: (p.length, p.offset) for p in pieces},
                                 dest, fixed=("worker", "step"))
            for f in message:
                asm.add(f)
            assert asm.finish() == {"worker": 1, "step": 7}
            mine = np.zeros(m.total, bool)
            for p in pieces:
                mine[p.offset:p.offset + p.length] = True
            np.testing.assert_array_equal(dest[mine], src[mine])
            assert not dest[~mine].any()


def _run_frames():
    m = build_shard_map(leaves(100, 200, 300), 1)
    src = np.ones(m.total, np.float32)
    frame, = wire.frames("push", m.pieces, src, 1 << 20, {"worker": 0, "step": 0})
    return m, frame, {p.name: (p.length, p.offset) for p in m.pieces}


@pytest.mark.parametrize("edit, message", [
    (lambda h: {**h, "count": 4}, "outside"),                    # more pieces than the map
    (lambda h: {**h, "count": 0}, "outside"),
    (lambda h: {**h, "count": True}, "must be an integer"),
    (lambda h: {**h, "name": "l1[0:200]"}, "past the last piece"),  # 3 from the second
    (lambda h: {**h, "shape": [599]}, "shape"),
    (lambda h: {**h, "offset": 4}, "chunk at byte 4"),
    (lambda h: {**h, "count": 2, "shape": [300]}, "does not fit"),  # 600 elements sent
])
def test_malformed_runs(edit, message):
    m, frame, layout = _run_frames()
    header, payload = wire.decode(frame)
    assert header["count"] == 3 and header["shape"] == [600]
    asm = wire.Assembler("push", layout, np.zeros(m.total, np.float32), fixed=("worker",))
    with pytest.raises(wire.WireError, match=message):
        asm.add(wire.encode(edit(header), payload))


def test_a_run_over_a_piece_already_received_is_refused():
    m, frame, layout = _run_frames()
    first, = wire.frames("push", m.pieces[:1], np.ones(m.total, np.float32), 1 << 20,
                         {"worker": 0, "step": 0})
    asm = wire.Assembler("push", layout, np.zeros(m.total, np.float32), fixed=("worker",))
    asm.add(first)
    with pytest.raises(wire.WireError, match="chunk at byte 0, expected 400"):
        asm.add(frame)


def _one_piece_frames():
    m = build_shard_map(leaves(2048), 1)
    src = np.ones(m.total, np.float32)
    frames = list(wire.frames("push", m.pieces, src, 2048, {"worker": 0, "step": 0}))
    layout = {p.name: (p.length, p.offset) for p in m.pieces}
    return frames, layout, m.pieces[0]


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f[:3], "shorter than its prefix"),
    (lambda f: b"XXXX" + f[4:], "bad magic"),
    (lambda f: f[:4] + (10 ** 6).to_bytes(4, "little") + f[8:], "header length"),
    (lambda f: f[:-1], "payload is"),
    (lambda f: f + b"\0", "shorter than its prefix"),  # a second, broken frame
    (lambda f: f[:8] + b"\xff" + f[9:], "not JSON"),
])
def test_malformed_frames(mutate, message):
    frames, layout, _ = _one_piece_frames()
    asm = wire.Assembler("push", layout, np.zeros(2048, np.float32), fixed=("worker",))
    with pytest.raises(wire.WireError, match=message):
        asm.add(mutate(frames[0]))


@pytest.mark.parametrize("field, value, message", [
    ("name", "nope[0:1]", "unknown tensor"),
    ("dtype", "float64", "dtype"),
    ("shape", [3], "shape"),
    ("offset", 4, "chunk at byte 4"),
    ("worker", True, "must be an integer"),
    ("worker", -1, "outside"),
    ("op", "pull", "expected op"),
])
def test_bad_header_fields(field, value, message):
    _, layout, piece = _one_piece_frames()
    header = {"op": "push", "name": piece.name, "dtype": "float32", "shape": [piece.length],
              "offset": 0, "worker": 0, field: value}
    asm = wire.Assembler("push", layout, np.zeros(2048, np.float32), fixed=("worker",))
    with pytest.raises(wire.WireError, match=message):
        asm.add(wire.encode(header, np.ones(8, np.float32)))


def test_truncated_stream_and_changed_fields():
    frames, layout, _ = _one_piece_frames()
    asm = wire.Assembler("push", layout, np.zeros(2048, np.float32), fixed=("worker", "step"))
    asm.add(frames[0])
    with pytest.raises(wire.WireError, match="truncated"):
        asm.finish()
    m = build_shard_map(leaves(2048), 1)
    a, b = (list(wire.frames("push", m.pieces, np.ones(2048, np.float32), 4096,
                             {"worker": 0, "step": s})) for s in (0, 1))
    asm = wire.Assembler("push", layout, np.zeros(2048, np.float32), fixed=("worker", "step"))
    asm.add(a[0])
    with pytest.raises(wire.WireError, match="differ"):
        asm.add(b[1])


# -- core ---------------------------------------------------------------------------------

def core(mode, workers=2, size=8, **kw):
    return ShardCore(np.ones(size, np.float32), optax.sgd(0.1), mode=mode, num_workers=workers,
                     **kw)


def g(value, size=8):
    return np.full(size, value, np.float32)


def test_sync_applies_the_mean_once_and_dedups_retries():
    c = core("sync")
    assert c.push(0, 0, 0, 0, g(1.0))["status"] == "pending"
    assert c.push(0, 0, 0, 0, g(1.0))["status"] == "deduplicated"   # retry inside barrier
    assert c.version == 0
    assert c.push(1, 0, 0, 0, g(3.0))["status"] == "applied"
    assert c.version == 1
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 * 2.0)           # mean of 1 and 3
    assert c.push(1, 0, 0, 0, g(3.0))["status"] == "deduplicated"   # retry after apply
    s = c.stats()
    assert (s["applied"], s["deduplicated"], s["rejected"], s["applies"]) == (2, 2, 0, 1)
    assert s["staleness_hist"] == {"0": 2}


def test_future_versions_and_bad_input_never_change_parameters():
    c = core("async")
    before = c.params()[1].copy()
    for args in [(0, 0, 5, 0, g(1.0)),          # version from the future
                 (0, 0, 0, 3, g(1.0)),          # epoch from the future
                 (7, 0, 0, 0, g(1.0)),          # unknown worker
                 (0, 0, 0, 0, g(np.nan)),       # non-finite
                 (0, 0, 0, 0, g(1.0, size=4))]:  # wrong size
        with pytest.raises(PSFault):
            c.push(*args)
    np.testing.assert_array_equal(c.params()[1], before)
    assert c.version == 0 and c.stats()["rejected"] == 5
    with pytest.raises(PSFault, match="future"):
        core("sync").pull(0, 5, 5, 0)


def test_async_staleness_and_staleness_lr():
    c = core("async", staleness_lr=True)
    c.push(0, 0, 0, 0, g(1.0))                   # computed on version 0, applied at 0
    r = c.push(1, 0, 0, 0, g(1.0))               # computed on 0, applied at 1: stale by 1
    assert r["staleness"] == 1
    # sgd(momentum 0): first update 0.1, second scaled by 1/(1+1)
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 - 0.05, rtol=1e-6)
    s = c.stats()
    assert s["staleness_hist"] == {"0": 1, "1": 1}
    assert s["lr_scale_min"] == pytest.approx(0.5)


def test_sync_barrier_failure_names_the_missing_worker():
    c = core("sync", workers=3, timeout_s=0.3)
    c.push(0, 0, 0, 0, g(1.0))
    c.push(2, 0, 0, 0, g(1.0))
    with pytest.raises(PSFault, match=r"no gradient from worker\(s\) \[1\]"):
        c.pull(0, 1, 1, 0)


def test_sync_drop_dead_workers_goes_on_without_them():
    c = core("sync", workers=3, timeout_s=0.3, drop_dead=True)
    c.push(0, 0, 0, 0, g(1.0))
    c.push(2, 0, 0, 0, g(3.0))
    version, *_ = c.pull(0, 1, 1, 0)
    assert version == 1
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 * 2.0)
    assert "1" in c.stats()["retired"]
    with pytest.raises(PSFault, match="retired"):
        c.push(1, 0, 0, 0, g(1.0))


def test_ssp_bound_holds_under_random_delays():
    workers, bound, steps = 3, 1, 25
    c = core("ssp", workers=workers, staleness=bound, timeout_s=10)
    rng = random.Random(0)
    delays = [[rng.uniform(0, 0.004) * (3 if w == 2 else 1) for _ in range(steps)]
              for w in range(workers)]
    ahead = []

    def work(w):
        for t in range(steps):
            version, epoch, _, _, _ = c.pull(w, t, 0, 0)
            ahead.append(t - min(c.clock.values()))
            time.sleep(delays[w][t])
            c.push(w, t, version, epoch, g(0.01))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    s = c.stats()
    assert s["applied"] == workers * steps
    step_stale = {int(k) for k in s["step_staleness_hist"]}
    assert max(step_stale) <= bound                       # the ssp guarantee
    assert max(int(k) for k in s["staleness_hist"]) <= (workers - 1) * (2 * bound + 1)
    assert s["wait_s"]["bound"] > 0                       # the slow worker made others wait


def test_ssp_retire_unblocks_a_waiting_worker():
    c = core("ssp", workers=2, staleness=0, timeout_s=5)
    c.push(0, 0, 0, 0, g(0.0))
    done = []
    t = threading.Thread(target=lambda: done.append(c.pull(0, 1, 0, 0)))
    t.start()
    time.sleep(0.3)
    assert not done                                       # worker 1 is at step 0
    c.retire(1, "died")
    t.join(2)
    assert done


def test_snapshot_restore_and_epoch_reconciliation(tmp_path):
    c = core("async", checkpoint_every=2, snapshot_dir=tmp_path)
    for step in range(3):
        c.push(0, step, c.version, 0, g(1.0))
    from ps import snapshot
    arrays, meta = snapshot.load(tmp_path)
    assert meta["version"] == 2
    fresh = ShardCore(np.zeros(8, np.float32), optax.sgd(0.1, momentum=0.9), mode="async",
                      num_workers=2, epoch=1)
    with pytest.raises(ValueError, match="optimizer"):
        fresh.restore(arrays, meta)                       # momentum adds state: mismatch
    restored = core("async", epoch=1)
    restored.restore(arrays, meta)
    assert restored.version == 2
    np.testing.assert_allclose(restored.params()[1], 1 - 0.2, rtol=1e-6)
    with pytest.raises(PSFault) as e:                     # a pull from the old life
        restored.pull(0, 3, 0, 0)
    assert e.value.kind == "restarted"
    # A push from epoch 0 computed on version 3 moves the counter forward, not "future".
    assert restored.push(0, 3, 3, 0, g(1.0))["status"] == "applied"
    assert restored.version == 4
    assert restored.push(0, 1, 0, 0, g(1.0))["status"] == "deduplicated"


def test_sync_restore_adopts_the_workers_step(tmp_path):
    c = core("sync", workers=1, checkpoint_every=1, snapshot_dir=tmp_path)
    c.push(0, 0, 0, 0, g(1.0))
    from ps import snapshot
    restored = core("sync", workers=1, epoch=1)
    restored.restore(*snapshot.load(tmp_path))
    restored.push(0, 5, 5, 0, g(1.0))                     # workers were at step 5
    assert restored.version == 6
    assert restored.pull(0, 6, 6, 1)[0] == 6


def test_hello_and_steps_from_the_future():
    c = core("ssp", workers=2, staleness=1)
    assert c.hello(0) == {"waiting": [1]}
    assert c.hello(1) == {"waiting": []}
    c.push(0, 0, 0, 0, g(0.0))
    with pytest.raises(PSFault, match="step 5 is from the future"):
        c.pull(0, 5, 0, 0)                                 # would fake a clock far ahead
    assert c.pull(0, 1, 0, 0)[0] == 1
    c.retire(1, "gone")
    assert c.waiting() == []


def test_gradient_buffers_are_reused_but_never_shared():
    c = core("sync", workers=2)
    a, b = c.take_buffer(), c.take_buffer()
    a[:], b[:] = 1.0, 3.0
    c.push(0, 0, 0, 0, a)
    c.give_buffer(a)                      # still pending in the barrier: not taken back
    assert c.take_buffer() is not a
    c.push(1, 0, 0, 0, b)                 # completes the barrier: both come back once
    c.give_buffer(b)
    c.give_buffer(a)
    got = [c.take_buffer() for _ in range(3)]
    assert len({id(x) for x in got}) == 3
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 * 2.0)


def test_frames_stay_under_the_message_limit():
    limit = 1 << 20                                         # --ps-max-message-mb 1
    m = build_shard_map(leaves(1_000_000), 1, chunk_elems=1_000_000)
    src = np.zeros(m.total, np.float32)
    frames = list(wire.frames("push", m.pieces, src, wire.frame_bytes(limit),
                              {"worker": 0, "step": 0}))
    assert len(frames) == 4 and max(len(f) for f in frames) < limit


# -- finite aggregates, pushes from the future ---------------------------------------------

def test_sync_overflowing_aggregate_is_rejected_whole():
    """Two finite 3e38 gradients sum to inf: the step is skipped, counted, parameters and
    optimizer state unchanged, and the barrier still moves on (pulls of step 1 proceed)."""
    c = ShardCore(np.ones(8, np.float32), optax.adamw(0.1), mode="sync", num_workers=2)
    before = c.params()[1].copy()
    assert c.push(0, 0, 0, 0, g(3e38))["status"] == "pending"
    assert c.push(1, 0, 0, 0, g(3e38))["status"] == "rejected_nonfinite"
    assert c.version == 1 and c.pull(0, 1, 1, 0)[0] == 1
    np.testing.assert_array_equal(c.params()[1], before)
    s = c.stats()
    assert (s["rejected_nonfinite"], s["applied"], s["applies"]) == (1, 0, 0)
    assert any("not finite" in e for e in s["events"])
    c.push(0, 1, 1, 0, g(1.0))
    assert c.push(1, 1, 1, 0, g(1.0))["status"] == "applied"      # the next step trains
    assert np.isfinite(c.params()[1]).all() and not np.array_equal(c.params()[1], before)


def test_async_huge_gradient_cannot_freeze_adamw():
    """3e38 is finite, but adam's second moment 3e38**2 is inf and every later update would
    be 0: the push is rejected and the next normal push still moves the parameters."""
    c = ShardCore(np.ones(8, np.float32), optax.adamw(0.1), mode="async", num_workers=1)
    before = c.params()[1].copy()
    assert c.push(0, 0, 0, 0, g(3e38))["status"] == "rejected_nonfinite"
    np.testing.assert_array_equal(c.params()[1], before)
    assert c.version == 0 and c.stats()["rejected_nonfinite"] == 1
    assert c.push(0, 1, 0, 0, g(1.0))["status"] == "applied"
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 * (1 + 1e-4), rtol=1e-5)  # sign(g)*lr


def test_clip_norm_bounds_the_applied_gradient():
    c = core("async", workers=1, clip_norm=1.0)
    c.push(0, 0, 0, 0, g(3.0))                         # norm sqrt(8)*3 -> scaled to 1
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 / np.sqrt(8), rtol=1e-6)
    assert c.stats()["clipped"] == 1
    c.push(0, 1, 1, 0, g(0.01))                        # below the norm: untouched
    np.testing.assert_allclose(c.params()[1], 1 - 0.1 / np.sqrt(8) - 0.001, rtol=1e-6)
    assert c.stats()["clipped"] == 1


@pytest.mark.parametrize("mode, bound", [("async", 0), ("ssp", 2)])
def test_push_from_the_future_is_refused(mode, bound):
    """step=10**9 gets FAILED_PRECONDITION, nothing applied, and the worker's real pushes go
    on (applied, it would make every real push of that worker 'deduplicated')."""
    c = core(mode, workers=2, staleness=bound)
    before = c.params()[1].copy()
    with pytest.raises(PSFault, match="beyond the step") as e:
        c.push(0, 10 ** 9, 0, 0, g(1.0))
    assert e.value.kind == "precondition"
    with pytest.raises(PSFault, match="beyond the step"):
        c.push(0, bound + 1, 0, 0, g(1.0))              # one past what it can have reached
    np.testing.assert_array_equal(c.params()[1], before)
    assert c.push(0, bound, 0, 0, g(1.0))["status"] == "applied"
    assert c.push(0, bound + 1, 1, 0, g(1.0))["status"] == "applied"
    assert c.stats()["rejected"] == 2


def test_late_push_after_a_failed_barrier_is_refused():
    c = core("sync", workers=2, timeout_s=0.2)
    before = c.params()[1].copy()
    c.push(0, 0, 0, 0, g(1.0))
    with pytest.raises(PSFault, match=r"no gradient from worker\(s\) \[1\]"):
        c.pull(0, 1, 1, 0)
    with pytest.raises(PSFault, match="sync barrier of step 0") as e:
        c.push(1, 0, 0, 0, g(1.0))                      # would complete the failed barrier
    assert e.value.kind == "precondition"
    np.testing.assert_array_equal(c.params()[1], before)
    assert c.version == 0


def test_progress_reports_newest_steps_and_missing_workers():
    c = core("sync", workers=3)
    c.push(0, 0, 0, 0, g(1.0))
    c.push(2, 0, 0, 0, g(1.0))
    p = c.progress()
    assert p["seen_step"] == [0, -1, 0] and p["missing"] == [1] and p["version"] == 0


def test_sync_mean_reuses_a_buffer_and_keeps_the_bits():
    """The barrier's mean goes into a pooled buffer: a fresh zeros array and a fresh quotient
    per step were page-faulted in every time (~3 ms a step on `mlp`). Same bits as before,
    and no numpy array of the shard's size is allocated to complete the barrier."""
    import tracemalloc

    from ps.shard_optimizer import mean_in_worker_order

    rng = np.random.default_rng(0)
    grads = {w: rng.standard_normal(1000).astype(np.float32) for w in (2, 0, 1)}
    fresh = (grads[0] + grads[1] + grads[2]) / np.float32(3)      # worker order, from 0
    out = np.full(1000, np.nan, np.float32)
    assert mean_in_worker_order(grads, out=out) is out
    np.testing.assert_array_equal(out, fresh)
    np.testing.assert_array_equal(mean_in_worker_order(grads), fresh)

    size = 1 << 18
    c = core("sync", size=size)
    peaks = []
    for step in range(3):
        a, b = c.take_buffer(), c.take_buffer()
        a[:], b[:] = 1.0, 3.0
        c.push(0, step, step, 0, a)
        tracemalloc.start()
        assert c.push(1, step, step, 0, b)["status"] == "applied"   # completes the barrier
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        c.give_buffer(a)
        c.give_buffer(b)
    # After the first step fills the pool: the finite check's booleans (size bytes) only;
    # before, two float32 arrays of the shard's size.
    assert max(peaks[1:]) < 2 * size, peaks
    np.testing.assert_allclose(c.params()[1], 1 - 3 * 0.1 * 2.0)


@pytest.mark.parametrize("values", [[1, 2], [np.inf, 1], [np.nan], [-np.inf, np.inf],
                                    [3e38, 3e38], [3e38, 3e38, np.nan], [-3e38, -3e38]])
def test_finite_check_of_a_push_is_exact_when_the_sum_overflows(values):
    """The push check sums first (one pass, no temporary); finite values whose sum overflows
    are still finite gradients and are accepted."""
    grad = np.array(values, np.float32)
    c = core("async", workers=1, size=len(values))
    if np.isfinite(grad).all():
        assert c.push(0, 0, 0, 0, grad)["status"] in ("applied", "rejected_nonfinite")
    else:
        with pytest.raises(PSFault, match="non-finite values"):
            c.push(0, 0, 0, 0, grad)


def test_a_rejected_push_does_not_consume_its_step():
    """async/ssp: a push rejected as non-finite leaves its step undone, so its retry is
    applied, not deduplicated; the worker may also go on to its next step first, and a
    second retry of the applied step is a duplicate again."""
    for mode in ("async", "ssp"):
        c = ShardCore(np.ones(8, np.float32), optax.adamw(0.1), mode=mode, num_workers=1)
        assert c.push(0, 0, 0, 0, g(3e38))["status"] == "rejected_nonfinite"
        before = c.params()[1].copy()
        assert c.push(0, 0, 0, 0, g(1.0))["status"] == "applied"       # the retry counts
        assert c.version == 1 and not np.array_equal(c.params()[1], before)
        assert c.push(0, 0, 0, 0, g(1.0))["status"] == "deduplicated"
        assert c.push(0, 1, 1, 0, g(3e38))["status"] == "rejected_nonfinite"
        assert c.push(0, 2, 1, 0, g(1.0))["status"] == "applied"       # moved on: fine
        assert c.push(0, 1, 1, 0, g(1.0))["status"] == "applied"       # late retry applied
        assert c.push(0, 1, 1, 0, g(1.0))["status"] == "deduplicated"
        s = c.stats()
        assert (s["applies"], s["rejected_nonfinite"], s["deduplicated"]) == (3, 2, 2)
        assert c.version == 3 and c.last_step[0] == 2


def test_a_retry_of_a_skipped_sync_step_is_told_so_not_deduplicated():
    """sync: a barrier whose update is not finite is skipped whole (the version moves on:
    every worker goes to the next step). A retry of that step (its reply was lost) gets the
    step's outcome and counts nothing, not `deduplicated` as if applied. A retry of an applied step is still a duplicate."""
    c = ShardCore(np.ones(8, np.float32), optax.adamw(0.1), mode="sync", num_workers=2)
    assert c.push(0, 0, 0, 0, g(3e38))["status"] == "pending"
    assert c.push(1, 0, 0, 0, g(3e38))["status"] == "rejected_nonfinite"
    for w in (0, 1):
        assert c.push(w, 0, 0, 0, g(1.0))["status"] == "rejected_nonfinite"
    s = c.stats()
    assert c.version == 1
    assert (s["deduplicated"], s["rejected_nonfinite"], s["applies"]) == (0, 1, 0)
    assert c.push(0, 1, 1, 0, g(1.0))["status"] == "pending"
    assert c.push(1, 1, 1, 0, g(1.0))["status"] == "applied"
    assert c.push(1, 1, 1, 0, g(1.0))["status"] == "deduplicated"
    assert c.push(0, 0, 0, 0, g(1.0))["status"] == "rejected_nonfinite"  # still step 0's
    assert c.version == 2 and c.stats()["deduplicated"] == 1
