"""jaxdist.predict.pipeline: the tick model on hand-built op times (bubble counted from the
schedule table, sends by link), the extrapolation helpers, and a tiny `--hardware` dry run
of a pipeline layout end to end. Every figure here is a prediction."""

import dataclasses

import pytest

from jaxdist.config import (CompilerConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig,
                            TrainConfig)
from jaxdist.hardware import constant
from jaxdist.parts import Part
from jaxdist.mesh import parse_mesh
from jaxdist.pipeline.schedule import BACK, BWD, FWD, PAIR, WGT, build_schedule
from jaxdist.predict import pipeline as pp, ticks
from jaxdist.predict.program import ScoreBytes, StepFigures
from jaxdist.plan_words import TimeTerms
from tests.helpers import job_of

# A made-up part, so every figure below is simple arithmetic.
HW = Part("test", "NVIDIA H200", 100e9, 1e12, 400e9, 50e9, 1, 700, ())
LINK = constant("link_efficiency")
# A send is one NCCL step: the base latency plus one NVLink or one network hop.
INTRA_LAT = constant("ring_base_latency_s") + constant("nvlink_hop_latency_s")
INTER_LAT = constant("ring_base_latency_s") + constant("network_hop_latency_s")


def op(seconds, comm=0.0):
    """An op of `seconds` compute with `comm` s of intra-node collectives, all hidden."""
    return ticks.OpTime(seconds=seconds, device_s=seconds, compute_s=seconds, hbm_s=0.0,
                        intra_node_s=comm, inter_node_s=0.0, exposed_intra_node_s=0.0,
                        exposed_inter_node_s=0.0, flops=0.0, bytes_accessed=0.0,
                        collectives=[], terms=TimeTerms(seconds, 0.0, 0.0, 0.0, 0.0, 0.0,
                                                        False))


def test_sends_cross_nodes_from_the_device_order():
    mesh = {"stage": 4, "data": 1, "fsdp": 1, "tensor": 2}   # stage s: devices 2s, 2s+1
    assert not ticks.send_crosses_nodes(mesh, 0, 1, 4)           # nodes: stages 0,1 | 2,3
    assert ticks.send_crosses_nodes(mesh, 1, 2, 4)
    assert ticks.send_crosses_nodes(mesh, 3, 0, 4)
    assert not ticks.send_crosses_nodes(mesh, 2, 3, 4)
    assert ticks.send_crosses_nodes(mesh, 0, 1, 2)               # a node per stage


def unit_ops(f=1.0, b=1.0, w=1.0, comm=0.0):
    """Every chunk's F, B and W at the given seconds, BACK = B + W (the head's chunk
    alike)."""
    return {(k, last): op(t, comm) for k, t in ((FWD, f), (BACK, b + w), (BWD, b), (WGT, w))
            for last in (False, True)}


def test_chunk_reductions_issued_in_the_loop_leave_the_tail_up_to_the_ticks_left():
    """Interleaved S = 2, V = 2, M = 4: chunk 1's reduction starts when its gradients are
    final (Schedule.gradients_final) and what of it ends before the last tick leaves the
    tail's exposed network time; longer than the ticks left, the rest stays exposed."""
    sched = build_schedule("interleaved", 2, 4, 2)
    mesh = {"stage": 2, "data": 1, "fsdp": 1}
    tail = op(0.1).replace(inter_node_s=50.0, exposed_inter_node_s=50.0, seconds=50.1)
    base = ticks.tick_model(sched, unit_ops(), tail, 0.0, HW, mesh)
    r = sched.gradients_final()[1]
    assert 0 < r < sched.ticks
    left = sched.cost({FWD: 1, BACK: 2}) - sum(  # seconds of the ticks from tick r on
        max(sum({FWD: 1, BACK: 2}[o.kind] for o in ops) for ops in row)
        for row in sched.ops[:r])
    assert left > 0
    for seconds, hidden in ((left / 2, left / 2), (2 * left, left)):
        t = ticks.tick_model(sched, unit_ops(), tail, 0.0, HW, mesh,
                             early=[(r, seconds, "inter-node")])
        assert t.pipeline.tail_beside_ticks_s == pytest.approx(hidden)
        assert t.step_s == pytest.approx(base.step_s - hidden)
        assert t.exposed_inter_node_s == pytest.approx(base.exposed_inter_node_s - hidden)


def test_chunk_reductions_are_read_on_the_axes_the_step_reduces_over():
    """Under context parallelism the tail's gradient reduce-scatter runs over data x
    context (mean_axes): the chunk reductions the loop issues early are that collective's
    share, not absent because it is not on `data` alone."""
    from jaxdist.pipeline.program import mean_axes
    from jaxdist.predict.pipeline import early_reductions

    sched = build_schedule("interleaved", 2, 4, 2)
    rs = {"kind": "reduce-scatter", "axes": ["data", "context"], "seconds": 0.4,
          "link": "inter-node"}
    tail = op(0.0).replace(collectives=[rs, {**rs, "kind": "all-gather"}])
    axes = mean_axes({"stage": 2, "data": 2, "context": 2, "tensor": 2})
    assert axes == ("data", "context")
    r = sched.gradients_final()[1]
    assert early_reductions(sched, tail, 0.25, axes) == [(r, 0.1, "inter-node")]
    assert early_reductions(sched, tail, 0.25, ("data",)) == []


@pytest.mark.parametrize("name,S,M", [("gpipe", 2, 2), ("1f1b", 4, 8), ("zb-h1", 2, 4)])
def test_ticks_last_their_busiest_stage(name, S, M):
    # The tick model and the table agree: each tick lasts its busiest stage's ops, one after
    # the other (F 1 s, B 2 s, W 3 s, BACK 5 s), ticks one after the other.
    sched = build_schedule(name, S, M)
    mesh = {"stage": S, "data": 1, "fsdp": 1}
    t = ticks.tick_model(sched, unit_ops(1.0, 2.0, 3.0, 0.25), op(0.5), 4e9, HW, mesh)
    assert t.pipeline.ticks_s == pytest.approx(sched.cost({FWD: 1, BACK: 5, BWD: 2,
                                                                 WGT: 3}))
    busy = 6.0 * M  # every stage runs M forwards and backwards
    assert t.pipeline.critical_stage_work_s == pytest.approx(busy)
    assert t.bubble_s == pytest.approx(t.pipeline.ticks_s - busy)
    send = 4e9 / (50e9 * LINK) + INTER_LAT  # 1 GPU per node: every send crosses nodes
    assert t.pipeline.messages == 2 * M * (S - 1)
    sends = sum(bool(f) + bool(b) for f, b in (sched.sends(i) for i in range(sched.ticks)))
    assert t.pipeline.send_inter_node_s == pytest.approx(sends * send)
    assert t.pipeline.send_intra_node_s == 0
    assert t.intra_node_s == pytest.approx(len(sched.kinds) * M * 0.25)  # hidden
    assert t.step_s == pytest.approx(t.pipeline.ticks_s + sends * send + 0.5)
    parts = t.device_s + t.exposed_intra_node_s + t.exposed_inter_node_s + t.bubble_s
    assert parts == pytest.approx(t.step_s)
    # The same in one node: the sends go over NVLink.
    one_node = dataclasses.replace(HW, gpus_per_node=S)
    t = ticks.tick_model(sched, unit_ops(), op(0.5), 4e9, one_node, mesh)
    assert t.pipeline.send_intra_node_s == pytest.approx(
        sends * (4e9 / (400e9 * LINK) + INTRA_LAT))


@pytest.mark.parametrize("name,S,M,V", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)])
def test_sends_beside_an_operation_are_hidden_up_to_its_length(name, S, M, V):
    # Under --overlap the tick loop sends tick t's activations beside its BACK and tick
    # t-1's input gradients beside its F (jaxdist/pipeline/step.py OverlappedSends): a send
    # of a set the loop overlaps costs only what outlasts the slot's longest op; the
    # others stay exposed. F 1 s, BACK 5 s.
    from jaxdist.pipeline.step import overlapped_sends, slot_pairs

    sched = build_schedule(name, S, M, V)
    mesh = {"stage": S, "data": 1, "fsdp": 1}
    beside = overlapped_sends(sched)
    for nbytes in (4e9, 400e9):  # a send shorter than F, one longer than BACK
        send = nbytes / (50e9 * LINK) + INTER_LAT
        alone = ticks.tick_model(sched, unit_ops(1.0, 2.0, 3.0), op(0.5), nbytes, HW, mesh)
        t = ticks.tick_model(sched, unit_ops(1.0, 2.0, 3.0), op(0.5), nbytes, HW, mesh,
                             overlap=True)
        exposed = 0.0
        for i in range(sched.ticks):
            for k, length in ((0, 1.0), (1, 5.0)):
                if not slot_pairs(sched, i, k):
                    continue
                busy = any(o.kind == sched.kinds[k] for ops in sched.ops[i] for o in ops)
                overlapped = beside.choice[i, k] < len(beside.sets[k])
                exposed += max(0.0, send - length * busy) if overlapped else send
        assert t.pipeline.send_exposed_s == pytest.approx(exposed)
        assert t.pipeline.send_inter_node_s == alone.pipeline.send_inter_node_s
        assert t.step_s == pytest.approx(t.pipeline.ticks_s + exposed + 0.5)
        assert alone.step_s - t.step_s == pytest.approx(
            alone.pipeline.send_inter_node_s - exposed)
        assert 0 < exposed < alone.pipeline.send_inter_node_s


@pytest.mark.parametrize("name,S,M", [("gpipe", 2, 2), ("gpipe", 4, 8), ("1f1b", 4, 4),
                                      ("1f1b", 4, 16), ("1f1b", 3, 6)])
def test_equal_op_times_give_the_schedule_bubble(name, S, M):
    # F, B and W 1 s each, no head difference: the counted bubble is the table's idle
    # fraction, which equals (S-1)/(M+S-1) (tests/test_pipeline.py).
    sched = build_schedule(name, S, M)
    t = ticks.tick_model(sched, unit_ops(), op(0.0), 0.0, HW, {"stage": S, "data": 1, "fsdp": 1})
    assert t.pipeline.ticks_s == sched.cost() == 3 * (M + S - 1)
    assert t.pipeline.bubble_fraction_of_ticks == pytest.approx((S - 1) / (M + S - 1))
    assert t.bubble_s == pytest.approx(3 * (S - 1))


@pytest.mark.parametrize("S", [2, 4])
def test_1f1b_costs_gpipe_whatever_the_ops_cost(S):
    """At equal M, 1F1B's predicted step equals GPipe's (M+S-1)(F+B) in what jaxdist runs,
    whatever F and the backward cost, sends included: its steady-state ticks run one F and
    one BACK on every stage (a tick of one op per stage would last the longer of F and B)."""
    mesh = {"stage": S, "data": 1, "fsdp": 1}
    for M in (S, 2 * S, 3 * S):
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 2.0), (3.0, 1.0, 0.5)):
            t = {name: ticks.tick_model(build_schedule(name, S, M), unit_ops(f, b, w),
                                        op(0.0), 4e9, HW, mesh) for name in ("gpipe", "1f1b")}
            assert t["gpipe"].pipeline.ticks_s == pytest.approx((M + S - 1) *
                                                                      (f + b + w))
            assert t["1f1b"].pipeline.ticks_s == pytest.approx(
                t["gpipe"].pipeline.ticks_s)
            assert t["1f1b"].step_s == pytest.approx(t["gpipe"].step_s)


@pytest.mark.parametrize("name,S,M,V", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                         ("interleaved", 2, 4, 2)])
def test_combined_ticks_cost_the_pair_where_a_stage_runs_f_and_back(name, S, M, V):
    """--pp-combined-1f1b: a tick in which a stage runs F and BACK costs that stage the
    compiled pair (PAIR: F beside another micro-batch's BACK), not F + BACK; a tick of one
    of them costs it alone. With F = 1, BACK = 2 and the pair 2.5, the ticks add up to the
    table's: each tick's busiest stage."""
    sched = build_schedule(name, S, M, V, combined=True)
    ops = {**unit_ops(1.0, 1.0, 1.0), **{(PAIR, last): op(2.5) for last in (False, True)}}
    t = ticks.tick_model(sched, ops, op(0.0), 0.0, HW, {"stage": S, "data": 1, "fsdp": 1})
    expected = sum(max(2.5 if len(sched.stage_ops(u, s)) == 2 else
                       sum(1.0 if o.kind == FWD else 2.0 for o in sched.stage_ops(u, s))
                       for s in range(S)) for u in range(sched.ticks))
    assert t.pipeline.ticks_s == pytest.approx(expected)
    # one tick more than without combining, each paired tick 0.5 s shorter
    plain = ticks.tick_model(build_schedule(name, S, M, V), ops, op(0.0), 0.0, HW,
                             {"stage": S, "data": 1, "fsdp": 1})
    assert t.pipeline.ticks_s < plain.pipeline.ticks_s == sched.cost()


@pytest.mark.parametrize("S", [2, 4])
def test_megatron_runtime_is_a_what_if(S):
    """--pp-runtime megatron times the same table as Megatron would run it (each stage
    starts its next op once its input arrived, no tick): never longer than jaxdist's ticks,
    and labelled as such."""
    mesh = {"stage": S, "data": 1, "fsdp": 1}
    heavy = unit_ops(1.0, 2.0, 1.5)
    for M in (S, 2 * S, 8):
        for name in ("gpipe", "1f1b"):
            t = {rt: ticks.tick_model(build_schedule(name, S, M), heavy, op(0.25), 0.0, HW,
                                      mesh, rt) for rt in ("jaxdist", "megatron")}
            assert t["megatron"].step_s <= t["jaxdist"].step_s + 1e-9
            assert t["megatron"].pipeline.runtime == "megatron"
            assert t["jaxdist"].pipeline.ticks_s == pytest.approx((M + S - 1) * 4.5)
    # With sends, each arrival waits one message: (S-1) hops forward and back in the fill.
    msg = 4e9
    send = msg / (50e9 * LINK) + INTER_LAT
    g = ticks.tick_model(build_schedule("gpipe", S, 4), unit_ops(), op(0.0), msg, HW, mesh,
                         "megatron")
    assert g.pipeline.ticks_s == pytest.approx(3 * (4 + S - 1) + 2 * (S - 1) * send)


def test_bubble_can_be_the_bottleneck():
    t = ticks.tick_model(build_schedule("gpipe", 8, 2), unit_ops(), op(0.0), 0.0, HW,
                      {"stage": 8, "data": 1, "fsdp": 1})
    assert t.bubble_s == pytest.approx(21.0) and t.device_s == pytest.approx(6.0)
    assert t.bottleneck == "bubble"


def figs(flops, temp, comm_count, bytes_accessed=None):
    return StepFigures(flops=flops, memory={"temp_bytes": temp},
                       bytes_accessed=10 * flops if bytes_accessed is None else bytes_accessed,
                       comm=[{"kind": "all-reduce", "axes": ["tensor"], "group_size": 2,
                              "count": comm_count, "bytes": 8 * comm_count,
                              "ring_bytes": 8.0 * comm_count}] if comm_count else [])


def test_linear_in_blocks():
    one, two, last = figs(100, 7, 2), figs(160, 9, 4), figs(150, 8, 2)
    at5 = pp.linear(one, one, two, 5)
    assert (at5.flops, at5.bytes_accessed, at5.memory["temp_bytes"]) == (340, 3400, 15)
    assert at5.comm[0]["count"] == 10 and at5.comm[0]["ring_bytes"] == 80.0
    assert pp.linear(last, one, two, 5).flops == 150 + 4 * 60
    assert pp.linear(one, one, two, 2).flops == 160   # at the compiled depth: exact
    assert pp.linear(figs(1, 0, 0), figs(1, 0, 0), figs(2, 0, 3), 3).comm[0]["count"] == 6


def test_chunks_past_two_blocks_grow_by_the_third_blocks_figures():
    """A chunk of k >= 3 blocks: the base, the second block as two - one, every further one
    as three - two (the first block's neighbours change what a schedule hides); up to 2
    blocks, or without a 3-block compile, the plain line."""
    one, two, three, last = figs(100, 7, 2), figs(160, 9, 4), figs(230, 12, 7), figs(150, 8, 2)
    at5 = pp.chunk_figures(one, one, two, three, 5)
    assert (at5.flops, at5.memory["temp_bytes"]) == (160 + 3 * 70, 9 + 3 * 3)
    assert at5.comm[0]["count"] == 4 + 3 * 3  # the plain line from 1 and 2: 2 + 4 x 2
    assert pp.chunk_figures(last, one, two, three, 5).flops == 150 + 60 + 3 * 70
    assert pp.chunk_figures(one, one, two, three, 2) == pp.linear(one, one, two, 2)
    assert pp.chunk_figures(one, one, two, None, 5) == pp.linear(one, one, two, 5)


def test_attention_scores_per_op():
    # P(k) = A + S/k per block: A = 40, S = 60 at L -> per block 100 at L, 70 at L/2.
    one, two = figs(0, 1, 0, 10.0), figs(0, 101, 0, 110.0)
    h1, h2 = figs(0, 1, 0, 10.0), figs(0, 71, 0, 80.0)
    s = pp.attention_scores(one, two, h1, h2, 4)
    assert s == ScoreBytes(bytes_accessed=4 * 60.0, temp_bytes=4 * 60.0)
    assert pp.attention_scores(one, one, h1, h2, 4).bytes_accessed == 0.0   # never < 0


def tiny_cfg(schedule="1f1b", depth=4):
    return RunConfig(mesh=MeshConfig(mesh="stage:2,tensor:2"),
                     model=ModelConfig(model="gpt-tiny", model_opts=f"depth={depth}"),
                     train=TrainConfig(layout="tp_pp", batch_size=8, microbatches=4,
                                       pp_schedule=schedule),
                     compiler=CompilerConfig(),
                     output=OutputConfig(dry_run=True, hardware="h200", gpus_per_node=2))


def test_tiny_pipeline_prediction_end_to_end():
    from jaxdist.program.xla_compile import compiles_run
    from jaxdist.plan.predicted import predict_plan

    cache, compiles = {}, compiles_run()
    cfg = tiny_cfg()
    plan = predict_plan(job_of(cfg, parse_mesh("stage:2,tensor:2")), cache=cache).to_json()
    t, p = plan["time"], plan["pipeline"]
    assert plan["label"] == t["label"] == "predicted"
    assert (p["stages"], p["microbatches"], p["blocks_per_chunk"]) == (2, 4, 2)
    # Every message: one micro-batch's activation, 2 rows x L x D float32; 2 x M x 1 boundary.
    model_cfg = job_of(cfg).model
    assert p["message_bytes"] == 2 * model_cfg.seq_len * model_cfg.width * 4
    assert p["messages"] == 2 * 4 * 1
    # Stage s sends to s+1 across nodes (2 GPUs per node, a stage = its 2 tensor devices).
    assert p["send_intra_node_s"] == 0 and p["send_inter_node_s"] > 0
    assert t["step_s"] == pytest.approx(p["ticks_s"] + p["send_inter_node_s"] + p["tail_s"])
    assert t["step_s"] == pytest.approx(t["device_s"] + t["exposed_intra_node_s"] +
                                        t["exposed_inter_node_s"] + t["bubble_s"])
    # 7 compiles: F and F + BACK (BACK = (F + BACK) - F) at 1 and 2 blocks and the head's
    # at 1; the tail.
    assert compiles_run() - compiles == 7
    ops = plan["compiled"]["ops"]
    two_blocks = [v for k, v in cache.items() if k[0] == "op" and k[-4:-1] == (2, FWD, False)]
    assert ops["forward"]["flops"] == two_blocks[0].flops   # K = 2: the compile itself
    vocab_matmul = 2 * 2 * model_cfg.seq_len * model_cfg.width * model_cfg.vocab / 2
    assert ops["forward_last"]["flops"] - ops["forward"]["flops"] >= vocab_matmul
    # GPipe reuses every compile: only the tick model is new.
    gpipe = predict_plan(job_of(tiny_cfg("gpipe"), parse_mesh("stage:2,tensor:2")),
                         cache=cache).to_json()
    assert compiles_run() - compiles == 7
    assert gpipe["compiled"]["ops"]["forward"] == ops["forward"]
    assert gpipe["pipeline"]["ticks"] == build_schedule("gpipe", 2, 4).ticks


def test_combined_plan_times_the_pair_it_compiles():
    """--pp-combined-1f1b in a plan: the pair (a forward beside another micro-batch's
    backward, one program) is compiled beside F and F + BACK, its FLOPs exactly theirs
    (the first forward that makes its stash taken off), and the table has the combined
    schedule's extra tick."""
    from jaxdist.plan.predicted import predict_plan

    cfg = tiny_cfg()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pp_combined_1f1b=True))
    plan = predict_plan(job_of(cfg, parse_mesh("stage:2,tensor:2"))).to_json()
    ops, p = plan["compiled"]["ops"], plan["pipeline"]
    assert p["combined_f_back"] and p["ticks"] == build_schedule("1f1b", 2, 4).ticks + 1
    for last in ("", "_last"):
        assert ops[f"forward_beside_backward{last}"]["flops"] == pytest.approx(
            ops[f"forward{last}"]["flops"] + ops["backward"]["flops"], rel=1e-9)


def test_remat_variant_compiles_only_the_programs_recomputation_changes():
    """A suite's --remat full variant beside its base row (one cache): the tail (gradient
    reduction, optimizer) is the same lowered program under recomputation, so only the
    chunk's F (its stash changes) and F + BACK, at 1 and 2 blocks and the head's, are
    compiled again (6 of 7), and the prediction equals one made with no cache."""
    from jaxdist.program.xla_compile import compiles_run
    from jaxdist.plan.predicted import predict_plan

    mesh, cache = parse_mesh("stage:2,tensor:2"), {}
    predict_plan(job_of(tiny_cfg(), mesh), cache=cache)
    full = dataclasses.replace(tiny_cfg(), train=dataclasses.replace(tiny_cfg().train,
                                                                     remat="full"))
    before = compiles_run()
    shared = predict_plan(job_of(full, mesh), cache=cache).to_json()
    assert compiles_run() - before == 6
    alone = predict_plan(job_of(full, mesh)).to_json()
    assert shared["time"] == alone["time"]
    assert shared["compiled"]["ops"] == alone["compiled"]["ops"]


def test_cli_dry_run_of_a_pipeline_layout_writes_plan(tmp_path):
    from tests.helpers import run_cli, time_terms_read
    import json

    r = run_cli("--dry-run", "--hardware", "h200", "--gpus-per-node", "2", "--model",
                "gpt-tiny", "--layout", "pp", "--mesh", "stage:2", "--microbatches", "2",
                "--pp-schedule", "gpipe", "--batch-size", "4", "--logdir", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PREDICTED (not measured): gpt-tiny")
    # GPipe: a tick holds an F and a BACK per stage, 2M + 2S - 3 ticks
    assert "pipeline gpipe S=2 V=1 M=2: 5 ticks" in r.stdout
    assert "bubble, two ways: 33.3% of stage time idle" in r.stdout
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["label"] == "predicted" and plan["pipeline"]["ticks"] == 5
    assert plan["pipeline"]["schedule_bubble"] == pytest.approx(1 / 3)
    # the same time terms as every plan kind; the bubble is the ticks' idle time
    read = time_terms_read(r.stdout, plan)
    assert read["bubble"] > 0 and \
        read["bubble"] == pytest.approx(plan["time"]["bubble_s"] * 1e3, abs=0.05)


def test_uneven_stages_time_each_chunk_at_its_own_blocks():
    """--pp-stage-blocks 1,2 (depth 3) beside the even 2,2 (depth 4): the ops are the same
    1- and 2-block programs and the tail holds the same padded [2, 1, 2] stack, so nothing
    is compiled again; stage 1's ops (2 blocks, the head) are the even split's, stage 0's
    forward is a 1-block chunk's, so the ticks are shorter than the even split's and stage
    1 is the critical one; the plan records the split."""
    from jaxdist.program.xla_compile import compiles_run
    from jaxdist.plan.predicted import predict_plan

    mesh, cache = parse_mesh("stage:2,tensor:2"), {}
    even = predict_plan(job_of(tiny_cfg(depth=4), mesh), cache=cache).to_json()
    base = tiny_cfg(depth=3)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train,
                                                              pp_stage_blocks="1,2"))
    before = compiles_run()
    plan = predict_plan(job_of(cfg, mesh), cache=cache).to_json()
    assert compiles_run() == before
    p = plan["pipeline"]
    assert (p["stage_blocks"], p["chunk_blocks"], p["blocks_per_chunk"]) == \
        ([1, 2], [[1], [2]], 2)
    assert p["critical_stage"] == 1
    assert plan["compiled"]["ops"] == even["compiled"]["ops"]  # the 2-block chunk's figures
    assert p["critical_stage_work_s"] == pytest.approx(
        even["pipeline"]["critical_stage_work_s"])
    assert p["ticks_s"] < even["pipeline"]["ticks_s"]
    assert p["bubble"] > p["analytic_bubble"] == even["pipeline"]["bubble"]


def test_fp8_plan_holds_weight_copies_and_one_byte_gemm_inputs():
    """--dtype float8 under tp_pp + sequence parallelism (shapes only), against the same
    plan in bfloat16: each stage also holds one byte per parameter of its blocks (the FP8
    weight copies, as the weights are split), and a block's stash keeps its GEMMs' inputs
    at one byte: 27 of Korthikanti's 34 bytes per element over t."""
    import jax
    from jax.sharding import PartitionSpec as P

    from experiments.run import build_parser
    from jaxdist import metrics
    from jaxdist.config import from_namespace
    from jaxdist.plan.pipeline_shapes import plan_pipeline
    from jaxdist.predict.stage_memory import block_activation_bytes
    from jaxdist.state_shapes import pipeline_planning_state
    from jaxdist.train_step import make_optimizer
    from sharding import get_layout
    from sharding.pipeline import is_stacked

    mesh = "data:2,stage:2,tensor:4"

    def plan(dtype):
        cfg = from_namespace(build_parser().parse_args([
            "--dry-run", "--model", "llama3-70b", "--model-opts", "depth=4", "--layout",
            "tp_pp", "--mesh", mesh, "--microbatches", "4", "--batch-size", "8", "--dtype",
            dtype, "--fp8-scaling", "current", "--sequence-parallel",
            "--distributed-optimizer"]))
        return cfg, plan_pipeline(job_of(cfg, parse_mesh(mesh))).to_json()
    (cfg, f8), (_, bf) = plan("float8"), plan("bfloat16")
    model_cfg = job_of(cfg).model
    sizes = dict(parse_mesh(mesh).axis_sizes)
    layout = get_layout("tp_pp", True)
    state = pipeline_planning_state(model_cfg, "float8", make_optimizer("adamw", 1e-3), 2, 1,
                                    True)
    specs = layout(state, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))
    flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
    leaf_specs = jax.tree.leaves(specs["params"], is_leaf=lambda x: isinstance(x, P))
    elements = sum(metrics.shard_bytes(leaf, spec, sizes) // leaf.dtype.itemsize
                   for (path, leaf), spec in zip(flat, leaf_specs) if is_stacked(path))
    rows, K = f8["pipeline"]["microbatch_rows_per_device"], f8["pipeline"]["blocks_per_chunk"]
    block = block_activation_bytes(model_cfg, rows, 4, 2, True, True)
    for s8, sb, slots in zip(f8["stages"], bf["stages"],
                             f8["pipeline"]["residual_slots_by_stage"]):
        assert (s8["fp8_weights"], sb["fp8_weights"]) == (elements, 0)
        assert sb["activation_stash"] - s8["activation_stash"] == pytest.approx(
            slots * K * block * 7 / 34)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_stash_per_block_is_the_programs(sequence_parallel):
    """The pipeline memory plan's stash per micro-batch and block under --remat full is
    what the chunk's forward outputs as its stash (its compiled program, on simulated CPU
    devices): the block's input, a sequence shard of it on each tensor device under sequence
    parallelism (a quarter at tensor 4), whole without."""
    import jax
    import numpy as np

    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.plan.pipeline_shapes import plan_pipeline
    from jaxdist.program import compiled

    argv = ["--dry-run", "--model", "llama-tiny", "--model-opts", "kv_heads=4", "--layout",
            "tp_pp", "--mesh",
            "stage:2,tensor:4", "--batch-size", "4", "--microbatches", "2", "--dtype",
            "bfloat16", "--remat", "full"] + (["--sequence-parallel"] if sequence_parallel
                                              else [])
    job = job_of(from_namespace(build_parser().parse_args(argv)))
    model_cfg = job.model
    sizes = {"stage": 2, "data": 1, "tensor": 4}
    target = compiled.simulated_cpu(8)

    def stash_bytes(blocks):  # one device's bytes of the stash output (F's third)
        low, _ = pp.op_lowered(job, model_cfg, sizes, blocks, pp.FWD, False, 2, target)
        program = low.compile()
        leaves = jax.tree.leaves(low.out_info[0][2])
        shards = jax.tree.leaves(program.output_shardings[0][2])
        return sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(leaves, shards))

    per_block = stash_bytes(2) - stash_bytes(1)
    whole = 2 * model_cfg.seq_len * model_cfg.width * 2  # 2 rows x L x D, bf16
    assert per_block == (whole // 4 if sequence_parallel else whole)
    plan = plan_pipeline(job).to_json()
    s0 = plan["stages"][0]
    slots = plan["pipeline"]["residual_slots_by_stage"][0]
    K = plan["pipeline"]["blocks_per_chunk"]
    in_flight = s0["activation_stash"] - slots * K * per_block
    # received activations and gradients: the stage message, a sequence shard under SP
    message = whole // 4 if sequence_parallel else whole
    assert in_flight % message == 0 and in_flight > 0
