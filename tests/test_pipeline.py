"""Pipeline parallelism (jaxdist/pipeline, sharding/pipeline.py): schedules counted from
their tables, pipelined losses equal to one device's, 1F1B's bounded activation memory,
stage-to-stage bytes read from the compiled HLO, and bad input."""

import re

import jax
import pytest

from jaxdist import hlo
from jaxdist.data import TrainStream
from jaxdist.errors import UsageError
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.pipeline.program import build_pipeline_program
from jaxdist.pipeline.report import local_activation_bytes
from jaxdist.pipeline.schedule import build_schedule
from jaxdist.pipeline.step import send_patterns
from jaxdist.train_step import make_optimizer, put_batch
from models import get_model
from sharding import get_layout

BATCH = 8


# ------------------------------------------------------------------ schedules (no devices)

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_bubble_counted_equals_analytic(name, S, M):
    sched = build_schedule(name, S, M)
    assert sched.bubble() == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    assert sched.ticks == 3 * (M + S - 1)  # one F-unit per tick, a backward B + W = 2
    # every forward, B and W of every micro-batch on every stage, once, W right after B
    when = {(s, op.kind, op.mb): t for t, row in enumerate(sched.ops)
            for s, op in enumerate(row) if op}
    assert sorted(when) == sorted((s, k, m) for s in range(S) for k in (1, 2, 3)
                                  for m in range(M))
    assert all(when[(s, 3, m)] == when[(s, 2, m)] + 1 for s in range(S) for m in range(M))


# F-units of each op as the issue counts them: F = 1, a whole backward B = 2, and zb-h1's
# halves B = W = 1. Every tick holds one op per stage, so here a backward is B + W.
@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_1f1b_costs_no_more_than_gpipe(S, M):
    """At equal M the executed table of 1F1B is no longer than GPipe's (x 1.02), both
    (M+S-1)(F+B) F-units, while 1F1B keeps S activations to GPipe's M. Before, each tick
    held one F or one whole B and lasted its slowest stage's op: 1F1B's ticks that mixed a
    forward and a backward lasted a backward (S=4, M=8: 40 F-units against GPipe's 33)."""
    gpipe, ofob = build_schedule("gpipe", S, M), build_schedule("1f1b", S, M)
    assert gpipe.cost() == 3 * (M + S - 1)
    assert ofob.cost() <= 1.02 * gpipe.cost()
    assert ofob.act_slots * M == gpipe.act_slots * S
    # the cost is the table's: every tick as long as its busiest stage
    for sched in (gpipe, ofob):
        assert sched.cost() == sum(max(len(sched.stage_ops(t, s)) for s in range(S))
                                   for t in range(sched.ticks))
    interleaved = build_schedule("interleaved", S, M, virtual=2)
    assert interleaved.cost() == 3 * M * 2 + 3 * (S - 1)  # V*M(F+B) + the (S-1)(F+B) bubble


@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_interleaved_bubble(S, M):
    sched = build_schedule("interleaved", S, M, virtual=2)
    assert sched.bubble() == pytest.approx((S - 1) / (2 * M + S - 1), abs=1e-12)


@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_zb_h1_bubble_and_memory(S, M):
    """ZB-H1 (Qi et al. 2023): with F, B and W one tick each, W fills the cool-down, so each
    stage idles S - 1 of 3M + S - 1 ticks (1F1B with the same three ops: 3(S - 1)), and no
    stage holds more than S micro-batches between F and W (1F1B's peak)."""
    sched = build_schedule("zb-h1", S, M)
    assert sched.ticks == 3 * M + S - 1
    assert sched.bubble() == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
    assert sched.analytic_bubble() == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
    assert sched.act_slots == build_schedule("1f1b", S, M).act_slots == S
    assert sched.cost() == sched.ticks < build_schedule("1f1b", S, M).cost()
    when = {(s, op.kind, op.mb): t for t, row in enumerate(sched.ops)
            for s, op in enumerate(row) if op}
    assert sorted(when) == sorted((s, k, m) for s in range(S) for k in (1, 2, 3)
                                  for m in range(M))
    assert all(when[(s, 2, m)] < when[(s, 3, m)] for s in range(S) for m in range(M))
    # W sends nothing: the messages are 1F1B's, M per boundary each way
    sent = [sched.sends(t) for t in range(sched.ticks)]
    assert sum(len(f) + len(b) for f, b in sent) == 2 * M * (S - 1)


def test_live_activations_gpipe_m_1f1b_s():
    """GPipe keeps every micro-batch's input until the backward; 1F1B at most S."""
    for S, M in ((2, 8), (4, 16), (4, 32)):
        assert build_schedule("gpipe", S, M).act_slots == M
        assert build_schedule("1f1b", S, M).act_slots == S
        # stage 0 embeds (stores nothing); stage s keeps S - s in flight plus one arrival
        assert build_schedule("1f1b", S, M).act_slots_by_stage == [0] + [
            S - s + 1 for s in range(1, S)]
    # the program's one send switch has as many branches at M = 32 as at M = 16
    assert len(send_patterns(build_schedule("1f1b", 4, 32))[0]) == len(
        send_patterns(build_schedule("1f1b", 4, 16))[0])


# ------------------------------------------------------------------ compiled programs

def _pipeline(model, layout, mesh, schedule, M, virtual=1, **opts):
    shape = parse_mesh(mesh)
    cfg = get_model(model, {k: str(v) for k, v in opts.items()})
    program = build_pipeline_program(cfg, "float32", make_optimizer("adamw", 1e-2),
                                     get_layout(layout),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, M,
                                     schedule, virtual)
    return cfg, program


# Equal losses to one device, stage bytes and per-stage parameters of every layout x model
# x schedule x S x M: tests/test_pipeline_matrix.py.


def test_1f1b_temp_memory_below_gpipe():
    """At M = 4S GPipe stores M micro-batch inputs per stage, 1F1B about S: the compiler's
    temp bytes differ by at least the (M - S) activations 1F1B does not keep."""
    S, M = 2, 8
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        cfg, program = _pipeline("gpt-tiny", "pp", "stage:2", schedule, M, depth=2)
        stream = TrainStream(cfg, None, 64, 0)
        compiled = program.step.lower(
            program.abstract_state, put_batch(stream.batch(0), program.batch_sharding)
        ).compile()
        temps[schedule] = compiled.memory_analysis().temp_size_in_bytes
        act = local_activation_bytes(program, 64)
    # measured: 3,852,280 vs 3,462,528 bytes, a gap of 0.99 x the 6 activations
    assert temps["1f1b"] < temps["gpipe"]
    assert temps["gpipe"] - temps["1f1b"] >= 0.9 * (M - S) * act


_CALLS = re.compile(r"(?:body|to_apply|calls|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")


def _dots_by_computation(hlo_text: str):
    """computation name -> the dot ops it runs, those of the computations it calls included
    (fusions, conditionals' branches, loops' bodies), each counted once."""
    own, calls, current = {}, {}, None
    for line in hlo.statements(hlo_text):
        opened = hlo.header(line)
        if opened:
            current = opened.group(2)
            own[current], calls[current] = 0, []
            continue
        m = hlo.INSTRUCTION.match(line)
        if m and current is not None:
            own[current] += m.group("op") == "dot"
            calls[current] += _CALLS.findall(line) + hlo.branches(line)

    def total(name):
        return own.get(name, 0) + sum(total(c) for c in calls.get(name, []))
    return total


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
@pytest.mark.parametrize("blocks", [1, 2])
def test_w_runs_no_forward(schedule, blocks):
    """W computes the weight gradients from the residuals B kept: its branch of the compiled
    step holds B's input-gradient dots (B's own minus the forward it recomputes) and one
    weight-gradient dot per kernel, and no forward dot. A gpt chunk's forward has 8 dots a
    block (q, k, v, out, up, down, QK^T, PV) and the head's under its cond. (Before, zb-h1's
    W ran jax.vjp of the forward again: 27 dots at one block, not 18.)"""
    S, M = 2, 2
    cfg, program = _pipeline("gpt-tiny", "pp", "stage:2", schedule, M, depth=S * blocks)
    batch = put_batch(TrainStream(cfg, None, BATCH, 0).batch(0), program.batch_sharding)
    text = program.step.lower(program.abstract_state, batch).compile().as_text()
    dots = _dots_by_computation(text)
    action = [b for _, b in hlo.conditionals(text) if len(b) == 4]
    assert len(action) == 1  # idle, F, B, W
    idle, f, b, w = (dots(name) for name in action[0])
    kernels = 6 * blocks + 1  # + the head
    assert (idle, f) == (0, 8 * blocks + 1)
    assert w == (b - f) + kernels
    assert b - f == 10 * blocks + 1  # 6 kernels' and 4 attention input-gradient dots, head


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("argv,message", [
    (["--mesh", "stage:4", "--model-opts", "depth=6", "--microbatches", "4"],
     "depth 6 is not divisible by stage=4"),
    (["--mesh", "stage:4", "--model-opts", "depth=4", "--microbatches", "2"],
     "needs at least as many micro-batches as stages"),
    (["--mesh", "stage:4", "--model-opts", "depth=4", "--microbatches", "2",
      "--pp-schedule", "zb-h1"], "--pp-schedule zb-h1 needs at least as many micro-batches"),
    (["--mesh", "stage:2", "--model", "resnet18", "--microbatches", "2"],
     "applies to gpt, moe models"),
    (["--mesh", "4", "--model-opts", "depth=4", "--microbatches", "4"],
     "which this mesh does not have"),
    (["--mesh", "stage:2", "--microbatches", "3", "--pp-schedule", "interleaved",
      "--pp-virtual", "2", "--model-opts", "depth=4"], "not a multiple of 2"),
    (["--mesh", "data:2,stage:2", "--model", "moe-tiny", "--microbatches", "2"],
     "moe under the pipeline layouts needs data=1 (got data=2): its balance loss would be "
     "averaged per data shard; put the batch on fsdp instead (fsdp_pp, e.g. --mesh "
     "fsdp:2,stage:2)"),
    (["--mesh", "stage:2", "--microbatches", "2", "--eval-every", "1"],
     "--eval-every measures test-split accuracy on an image dataset (digits, cifar10, "
     "mnist), which the decoders of the pipeline layouts (pp, tp_pp, fsdp_pp) cannot read; "
     "drop --eval-every"),
    (["--mesh", "stage:2", "--microbatches", "2", "--eval-every", "1", "--dataset",
      "digits"], "dataset 'digits' is images; model family 'gpt' cannot read it"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys, tmp_path):
    from experiments.run import main

    code = main(["--layout", "pp", *argv, "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_data_x_microbatches():
    from experiments.run import build_parser, check_batch
    from jaxdist.config import from_namespace

    cfg = from_namespace(build_parser().parse_args(
        ["--layout", "pp", "--mesh", "data:2,stage:2", "--microbatches", "4",
         "--batch-size", "12"]))
    with pytest.raises(UsageError, match="global batch 12 is not divisible by 2 batch "
                                         "shards x 4 micro-batches; use a multiple of 8"):
        check_batch(cfg, parse_mesh(cfg.mesh.mesh))


def test_depth_check_raises_usage_error():
    with pytest.raises(UsageError, match="multiple of 4"):
        _pipeline("gpt-tiny", "pp", "stage:2", "interleaved", 2, 2, depth=2)


# ------------------------------------------------------------------ mesh, plan, notices

def test_stage_axis_forms():
    named = parse_mesh("data:2,stage:4,tensor:4")
    assert named.axis_sizes == {"stage": 4, "data": 2, "fsdp": 1, "tensor": 4}
    assert named.size == 32 and named.label == "stage4-data2-tensor4"
    assert parse_mesh("2x1x4x1x4") == named  # DATAxFSDPxTENSORxEXPERTxSTAGE
    assert parse_mesh("4x8").axis_sizes == {"data": 4, "fsdp": 8}  # unchanged without stage


def _plan(*argv):
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.pipeline.plan import plan_pipeline

    cfg = from_namespace(build_parser().parse_args(["--dry-run", *argv]))
    return plan_pipeline(cfg, parse_mesh(cfg.mesh.mesh))


def test_dry_run_go2025_grid_gpt3_tp_pp():
    """gpt3-175b on 32 GPUs as TPxPP 2x16 and 8x4: every stage holds 1/S of the blocks
    split t ways, plus the embeddings and head (vocab 50257 does not divide over tensor, so
    they stay whole, as the tp layout does); AdamW's mu and nu are twice the parameters."""
    for t, s in ((2, 16), (8, 4)):
        p = _plan("--model", "gpt3-175b", "--layout", "tp_pp", "--mesh",
                  f"stage:{s},tensor:{t}", "--microbatches", "32", "--batch-size", "64",
                  "--dtype", "bfloat16")
        d, v, L = 12288, 50257, 2048
        block = 12 * d * d + 13 * d   # q,k,v,out,up,down kernels and biases, two LayerNorms
        # per stage device: q,k,v,up kernels+biases and out,down kernels split t ways; the
        # out and down biases and the LayerNorms (6d) whole
        stage = 96 // s * ((12 * d * d + 7 * d) // t + 6 * d)
        shared = 2 * v * d + v + L * d + 2 * d  # tok, head (+bias), pos, ln_f
        assert p["model"]["params"] == 96 * block + shared
        assert p["state_bytes_per_device"]["params"] == 4 * (stage + shared)
        # AdamW: mu and nu like the parameters, plus Adam's int32 step count
        assert p["state_bytes_per_device"]["opt"] == 2 * 4 * (stage + shared) + 4
        assert len(p["stages"]) == s and p["fits_h200"]
        assert p["pipeline"]["bubble"] == pytest.approx((s - 1) / (32 + s - 1))


def test_notices_for_pp_flags():
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.notices import notices

    cfg = from_namespace(build_parser().parse_args(["--layout", "fsdp", "--pp-schedule",
                                                    "gpipe"]))
    assert notices(cfg) == ["notice: --pp-schedule applies only to the pipeline layouts "
                            "(pp, tp_pp, fsdp_pp); ignored"]


def test_cli_run_records_pipeline(tmp_path):
    """A pp run end to end: results.json's pipeline block, the comm block's stage bytes and
    the TensorBoard scalars."""
    import json

    from jaxdist.record import check
    from tests.helpers import read_scalars, run_cli

    logdir = tmp_path / "pp"
    proc = run_cli("--layout", "pp", "--mesh", "data:2,stage:2", "--microbatches", "2",
                   "--batch-size", "8", "--warmup", "0", "--steps", "2",
                   "--logdir", str(logdir))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((logdir / "results.json").read_text())
    assert check(results) == []
    pp = results["pipeline"]
    assert (pp["schedule"], pp["stages"], pp["virtual"], pp["microbatches"]) == \
        ("1f1b", 2, 1, 2)
    assert pp["bubble"] == pp["analytic_bubble"] == pytest.approx(1 / 3)
    act = 8 // 2 // 2 * 32 * 64 * 4  # rows per micro-batch and data shard x L x D x f32
    assert pp["memory"]["activation_bytes_per_microbatch"] == act
    assert results["comm"]["stage"]["total"] == results["comm"]["stage"]["analytic"] == \
        2 * act * 2 * 1
    assert results["comm"]["stage"]["by_stage"] == [2 * act, 2 * act]
    assert "pipeline stage bytes" in proc.stdout
    scalars = read_scalars(logdir)
    assert scalars["trial/pp_bubble"][0][1] == pytest.approx(1 / 3)
    assert scalars["trial/pp_stage_gib"][0][1] == pytest.approx(4 * act / 2 ** 30, rel=1e-6)


def test_pipeline_dry_run_reads_batch_and_microbatches():
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.notices import notices

    cfg = from_namespace(build_parser().parse_args(
        ["--dry-run", "--layout", "pp", "--mesh", "stage:2", "--batch-size", "32",
         "--microbatches", "4", "--steps", "3"]))
    assert notices(cfg) == ["notice: --steps applies only to a training run, not --dry-run "
                            "(which plans memory from shapes only); ignored"]


def test_multi_host_stage_placement_keeps_tensor_in_a_host():
    """Megatron's placement on several hosts: a stage's tensor group is inside one host (the
    NVLink domain) and the stage-to-stage sends cross hosts. Devices carry their host as
    process_index and are listed in a scrambled order, as a cluster may report them."""
    from jaxdist.mesh import MeshShape, hybrid_device_array
    from tests.helpers import FakeGPU

    def hosts(n_hosts, per_host):
        return [FakeGPU(h * per_host + i, h) for i in range(per_host)
                for h in reversed(range(n_hosts))]

    # 2 hosts x 4 GPUs, data:1,stage:2,tensor:4: axes (stage, data, fsdp, tensor)
    array = hybrid_device_array(MeshShape(1, stage=2, tensor=4), hosts(2, 4))
    assert array.shape == (2, 1, 1, 4)
    assert [[d.process_index for d in array[s, 0, 0]] for s in range(2)] == [[0] * 4, [1] * 4]
    # the data:2,stage:4,tensor:4 on 4 hosts x 8: one stage (both data rows) per host
    array = hybrid_device_array(MeshShape(2, stage=4, tensor=4), hosts(4, 8))
    assert array.shape == (4, 2, 1, 4)
    for s in range(4):
        assert {d.process_index for d in array[s].flat} == {s}
    # more stages than hosts (2 hosts, stage:4, tensor:2): tensor groups still inside a host,
    # and the stages span both hosts
    array = hybrid_device_array(MeshShape(1, stage=4, tensor=2), hosts(2, 4))
    for s in range(4):
        assert len({d.process_index for d in array[s, 0, 0]}) == 1
    assert {array[s, 0, 0, 0].process_index for s in range(4)} == {0, 1}
    # a tensor group that cannot fit in a host is refused
    with pytest.raises(UsageError, match="inside one host"):
        hybrid_device_array(MeshShape(1, stage=2, tensor=8), hosts(4, 4))
