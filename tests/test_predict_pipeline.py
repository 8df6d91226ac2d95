"""jaxdist.predict.pipeline: the tick model on hand-built op times (bubble counted from the
schedule table, sends by link), the extrapolation helpers, and a tiny `--hardware` dry run
of a pipeline layout end to end. Every figure here is a prediction."""

import dataclasses

import pytest

from jaxdist.config import (CompilerConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig,
                            TrainConfig)
from jaxdist.hardware import Hardware, constant
from jaxdist.mesh import parse_mesh
from jaxdist.pipeline.schedule import BWD, FWD, build_schedule
from jaxdist.predict import pipeline as pp

# A made-up part, so every figure below is simple arithmetic.
HW = Hardware("test", "NVIDIA H200", 100e9, 1e12, 400e9, 50e9, 1, 700, ())
LINK = constant("link_efficiency")
# A send is one NCCL step: the base latency plus one NVLink or one network hop.
INTRA_LAT = constant("ring_base_latency_s") + constant("nvlink_hop_latency_s")
INTER_LAT = constant("ring_base_latency_s") + constant("network_hop_latency_s")


def op(seconds, comm=0.0):
    """An op of `seconds` compute with `comm` s of intra-node collectives, all hidden."""
    return {"seconds": seconds, "device_s": seconds, "compute_s": seconds, "hbm_s": 0.0,
            "intra_node_s": comm, "inter_node_s": 0.0,
            "exposed_intra_node_s": 0.0, "exposed_inter_node_s": 0.0}


def test_sends_cross_nodes_from_the_device_order():
    mesh = {"stage": 4, "data": 1, "fsdp": 1, "tensor": 2}   # stage s: devices 2s, 2s+1
    assert not pp.send_crosses_nodes(mesh, 0, 1, 4)           # nodes: stages 0,1 | 2,3
    assert pp.send_crosses_nodes(mesh, 1, 2, 4)
    assert pp.send_crosses_nodes(mesh, 3, 0, 4)
    assert not pp.send_crosses_nodes(mesh, 2, 3, 4)
    assert pp.send_crosses_nodes(mesh, 0, 1, 2)               # a node per stage


def test_gpipe_ticks_by_hand():
    # GPipe S=2 M=2 runs 6 ticks: s0 F0 | s0 F1, s1 F0 | s1 F1 | s1 B0 | s0 B0, s1 B1 | s0 B1;
    # stage 1 holds the head: its forward 1.5 s, backward 3 s; stage 0's 1 s and 2 s.
    sched = build_schedule("gpipe", 2, 2)
    ops = {(FWD, False): op(1.0), (BWD, False): op(2.0), (FWD, True): op(1.5, 0.25),
           (BWD, True): op(3.0, 0.5)}
    mesh = {"stage": 2, "data": 1, "fsdp": 1}
    t = pp.tick_model(sched, ops, op(0.5), 4e9, HW, mesh)   # 1 GPU per node: sends cross
    assert t["pipeline"]["ticks_s"] == pytest.approx(1 + 1.5 + 1.5 + 3 + 3 + 2)
    assert t["pipeline"]["critical_stage"] == 1
    assert t["pipeline"]["critical_stage_work_s"] == pytest.approx(9.0)
    assert t["bubble_s"] == pytest.approx(3.0)
    send = 4e9 / (50e9 * LINK) + INTER_LAT
    assert t["pipeline"]["messages"] == 4    # 2 directions x M x (S - 1) boundaries
    assert t["pipeline"]["send_inter_node_s"] == pytest.approx(4 * send)
    assert t["pipeline"]["send_intra_node_s"] == 0
    # Link time of the critical stage's ops (hidden: not in the step), sends, tail.
    assert t["intra_node_s"] == pytest.approx(2 * 0.25 + 2 * 0.5)
    assert t["exposed_intra_node_s"] == 0 and t["inter_node_s"] == pytest.approx(4 * send)
    assert t["step_s"] == pytest.approx(12.0 + 4 * send + 0.5)
    parts = t["device_s"] + t["exposed_intra_node_s"] + t["exposed_inter_node_s"] + t["bubble_s"]
    assert parts == pytest.approx(t["step_s"])
    assert t["device_s"] == pytest.approx(9.5)   # the critical stage's work + the tail
    assert t["bottleneck"] == "compute"
    # The same in one node: the sends go over NVLink.
    one_node = dataclasses.replace(HW, gpus_per_node=2)
    t = pp.tick_model(sched, ops, op(0.5), 4e9, one_node, mesh)
    assert t["pipeline"]["send_intra_node_s"] == pytest.approx(
        4 * (4e9 / (400e9 * LINK) + INTRA_LAT))


@pytest.mark.parametrize("name,S,M", [("gpipe", 2, 2), ("gpipe", 4, 8), ("1f1b", 4, 4),
                                      ("1f1b", 4, 16), ("1f1b", 3, 6)])
def test_equal_op_times_give_the_schedule_bubble(name, S, M):
    # Every op 1 s, no head difference: the counted bubble is the table's idle fraction,
    # which equals (S-1)/(M+S-1) (tests/test_pipeline.py).
    sched = build_schedule(name, S, M)
    ops = {(k, last): op(1.0) for k in (FWD, BWD) for last in (False, True)}
    t = pp.tick_model(sched, ops, op(0.0), 0.0, HW, {"stage": S, "data": 1, "fsdp": 1})
    assert t["pipeline"]["ticks_s"] == sched.ticks
    assert t["pipeline"]["bubble_fraction_of_ticks"] == pytest.approx((S - 1) / (M + S - 1))
    assert t["bubble_s"] == pytest.approx(2 * (S - 1))


def test_lockstep_1f1b_ticks_last_a_backward():
    # 1F1B mixes forwards and backwards in a tick: with backward = 2 x forward, its ticks
    # cost more than GPipe's, whose ticks are all-forward or all-backward.
    ops = {(FWD, last): op(1.0) for last in (False, True)}
    ops.update({(BWD, last): op(2.0) for last in (False, True)})
    mesh = {"stage": 4, "data": 1, "fsdp": 1}
    gpipe = pp.tick_model(build_schedule("gpipe", 4, 8), ops, op(0.0), 0.0, HW, mesh)
    ofob = pp.tick_model(build_schedule("1f1b", 4, 8), ops, op(0.0), 0.0, HW, mesh)
    assert gpipe["pipeline"]["ticks_s"] == pytest.approx(3 * (8 + 3))   # (M+S-1)(F+B)
    assert ofob["pipeline"]["ticks_s"] > gpipe["pipeline"]["ticks_s"]
    assert ofob["bottleneck"] == "compute"


def test_bubble_can_be_the_bottleneck():
    ops = {(k, last): op(1.0) for k in (FWD, BWD) for last in (False, True)}
    t = pp.tick_model(build_schedule("gpipe", 8, 2), ops, op(0.0), 0.0, HW,
                      {"stage": 8, "data": 1, "fsdp": 1})
    assert t["bubble_s"] == pytest.approx(14.0) and t["device_s"] == pytest.approx(4.0)
    assert t["bottleneck"] == "pipeline bubble"


def figs(flops, temp, comm_count):
    return {"flops": flops, "bytes_accessed": 10 * flops, "memory": {"temp_bytes": temp},
            "comm": [{"kind": "all-reduce", "axes": ["tensor"], "group_size": 2,
                      "count": comm_count, "bytes": 8 * comm_count,
                      "ring_bytes": 8.0 * comm_count}] if comm_count else []}


def test_linear_in_blocks():
    one, two, last = figs(100, 7, 2), figs(160, 9, 4), figs(150, 8, 2)
    at5 = pp.linear(one, one, two, 5)
    assert (at5["flops"], at5["bytes_accessed"], at5["memory"]["temp_bytes"]) == (340, 3400, 15)
    assert at5["comm"][0]["count"] == 10 and at5["comm"][0]["ring_bytes"] == 80.0
    assert pp.linear(last, one, two, 5)["flops"] == 150 + 4 * 60
    assert pp.linear(one, one, two, 2)["flops"] == 160   # at the compiled depth: exact
    assert pp.linear(figs(1, 0, 0), figs(1, 0, 0), figs(2, 0, 3), 3)["comm"][0]["count"] == 6


def test_attention_scores_per_op():
    # P(k) = A + S/k per block: A = 40, S = 60 at L -> per block 100 at L, 70 at L/2.
    one, two = {"bytes_accessed": 10.0, "memory": {"temp_bytes": 1}}, \
        {"bytes_accessed": 110.0, "memory": {"temp_bytes": 101}}
    h1, h2 = {"bytes_accessed": 10.0, "memory": {"temp_bytes": 1}}, \
        {"bytes_accessed": 80.0, "memory": {"temp_bytes": 71}}
    s = pp.attention_scores(one, two, h1, h2, 4)
    assert s == {"bytes_accessed": 4 * 60.0, "temp_bytes": 4 * 60.0}
    assert pp.attention_scores(one, one, h1, h2, 4)["bytes_accessed"] == 0.0   # never < 0


def tiny_cfg(schedule="1f1b", depth=4):
    return RunConfig(mesh=MeshConfig(mesh="stage:2,tensor:2"),
                     model=ModelConfig(model="gpt-tiny", model_opts=f"depth={depth}"),
                     train=TrainConfig(layout="tp_pp", batch_size=8, microbatches=4,
                                       pp_schedule=schedule),
                     compiler=CompilerConfig(),
                     output=OutputConfig(dry_run=True, hardware="h200", gpus_per_node=2))


def test_tiny_pipeline_prediction_end_to_end():
    from jaxdist.predict.plan import predict_plan
    from models.build import build_model

    cache = {}
    cfg = tiny_cfg()
    plan = predict_plan(cfg, parse_mesh("stage:2,tensor:2"), cache=cache)
    t, p = plan["time"], plan["pipeline"]
    assert plan["label"] == t["label"] == "predicted"
    assert (p["stages"], p["microbatches"], p["blocks_per_chunk"]) == (2, 4, 2)
    # Every message: one micro-batch's activation, 2 rows x L x D float32; 2 x M x 1 boundary.
    model_cfg, _ = build_model(cfg)
    assert p["message_bytes"] == 2 * model_cfg.seq_len * model_cfg.width * 4
    assert p["messages"] == 2 * 4 * 1
    # Stage s sends to s+1 across nodes (2 GPUs per node, a stage = its 2 tensor devices).
    assert p["send_intra_node_s"] == 0 and p["send_inter_node_s"] > 0
    assert t["step_s"] == pytest.approx(p["ticks_s"] + p["send_inter_node_s"] + p["tail_s"])
    assert t["step_s"] == pytest.approx(t["device_s"] + t["exposed_intra_node_s"] +
                                        t["exposed_inter_node_s"] + t["bubble_s"])
    # 7 compiles: forward and backward at 1 and 2 blocks and the head's at 1; the tail.
    assert len(cache) == 7
    ops = plan["compiled"]["ops"]
    two_blocks = [v for k, v in cache.items() if k[0] == "op" and k[-3:] == (2, FWD, False)]
    assert ops["forward"]["flops"] == two_blocks[0]["flops"]   # K = 2: the compile itself
    vocab_matmul = 2 * 2 * model_cfg.seq_len * model_cfg.width * model_cfg.vocab / 2
    assert ops["forward_last"]["flops"] - ops["forward"]["flops"] >= vocab_matmul
    # GPipe reuses every compile: only the tick model is new.
    gpipe = predict_plan(tiny_cfg("gpipe"), parse_mesh("stage:2,tensor:2"), cache=cache)
    assert len(cache) == 7
    assert gpipe["compiled"]["ops"]["forward"] == ops["forward"]
    assert gpipe["pipeline"]["ticks"] == build_schedule("gpipe", 2, 4).ticks


def test_cli_dry_run_of_a_pipeline_layout_writes_plan(tmp_path):
    from tests.helpers import run_cli
    import json

    r = run_cli("--dry-run", "--hardware", "h200", "--gpus-per-node", "2", "--model",
                "gpt-tiny", "--layout", "pp", "--mesh", "stage:2", "--microbatches", "2",
                "--pp-schedule", "gpipe", "--batch-size", "4", "--logdir", str(tmp_path / "p"),
                xla_flags="--xla_backend_optimization_level=0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PREDICTED (not measured): gpt-tiny")
    assert "pipeline gpipe S=2 V=1 M=2: 6 ticks" in r.stdout
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["label"] == "predicted" and plan["pipeline"]["ticks"] == 6
    assert plan["pipeline"]["schedule_bubble"] == pytest.approx(1 / 3)
