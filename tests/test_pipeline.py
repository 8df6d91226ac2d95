"""Pipeline parallelism (jaxdist/pipeline, sharding/pipeline.py): schedules counted from
their tables, pipelined losses equal to one device's, 1F1B's bounded activation memory,
stage-to-stage bytes read from the compiled HLO, and bad input."""

import re

import jax
import pytest

from jaxdist.program import hlo, kernels
from jaxdist.data import TrainStream
from jaxdist.errors import UsageError
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.pipeline.program import build_pipeline_program
from jaxdist.pipeline.report import local_activation_bytes, switch_runs
from jaxdist.pipeline.schedule import BACK, BWD, FWD, WGT, build_schedule
from jaxdist.pipeline.step import send_patterns
from jaxdist.train_step import make_optimizer, put_batch
from models import get_model
from sharding import get_layout
from tests.helpers import job_of

BATCH = 8


# ------------------------------------------------------------------ schedules (no devices)

def _when(sched):
    """(stage, kind, micro-batch) -> the tick it runs at, every op of the table once."""
    when = {}
    for t, row in enumerate(sched.ops):
        for s, ops in enumerate(row):
            assert len({op.kind for op in ops}) == len(ops) <= len(sched.kinds)
            for op in ops:
                assert (s, op.kind, op.mb) not in when
                when[(s, op.kind, op.mb)] = t
    return when


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_bubble_counted_equals_analytic(name, S, M):
    sched = build_schedule(name, S, M)
    assert sched.bubble() == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    # a tick holds at most one F and one BACK (the whole backward) per stage: 1F1B's
    # M + 2(S-1) ticks; GPipe's backwards start after its forwards
    assert sched.ticks == (M + 2 * S - 2 if name == "1f1b" else 2 * M + 2 * S - 3)
    when = _when(sched)
    assert sorted(when) == sorted((s, k, m) for s in range(S) for k in (FWD, BACK)
                                  for m in range(M))
    # F on stage s at tick m + s; the last stage's BACK in its F's tick; one hop back a tick
    for s in range(S):
        for m in range(M):
            assert when[(s, FWD, m)] == m + s
            assert when[(s, BACK, m)] == when[(S - 1, BACK, m)] + S - 1 - s
    if name == "1f1b":
        assert all(when[(S - 1, BACK, m)] == when[(S - 1, FWD, m)] for m in range(M))


# F-units of each op as the papers count them: F = 1, a whole backward BACK = 2 (zb-h1's
# halves B = W = 1); a tick lasts its busiest stage's ops, run one after the other.
@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_1f1b_costs_no_more_than_gpipe(S, M):
    """At equal M the executed table of 1F1B costs GPipe's (M+S-1)(F+B) whatever F and the
    backward cost: its steady-state ticks run one F and one BACK on every stage, so no tick
    holds a forward on one stage against a backward on its neighbour (a tick of one op per
    stage would last its slowest: predicted 1F1B/GPipe 1.30 for gpt-small on H200). 1F1B
    stashes at most 2(S-1-s)+1 micro-batches on stage s, GPipe M."""
    gpipe, ofob = build_schedule("gpipe", S, M), build_schedule("1f1b", S, M)
    assert gpipe.cost() == ofob.cost() == 3 * (M + S - 1)
    for units in ({FWD: 1, BACK: 3.7}, {FWD: 2.5, BACK: 1}):
        assert ofob.cost(units) == pytest.approx(gpipe.cost(units))
        assert gpipe.cost(units) == pytest.approx((M + S - 1) * sum(units.values()))
    assert gpipe.res_slots_by_stage == [M] * S
    assert ofob.res_slots_by_stage == [min(M, 2 * (S - 1 - s) + 1) for s in range(S)]
    # the cost is the table's: every tick as long as its busiest stage
    for sched in (gpipe, ofob):
        assert sched.cost() == sum(max(sum(2 if o.kind == BACK else 1 for o in
                                           sched.stage_ops(t, s)) for s in range(S))
                                   for t in range(sched.ticks))
    interleaved = build_schedule("interleaved", S, M, virtual=2)
    assert interleaved.cost() == 3 * M * 2 + 3 * (S - 1)  # V*M(F+B) + the (S-1)(F+B) bubble


@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_interleaved_bubble(S, M):
    sched = build_schedule("interleaved", S, M, virtual=2)
    assert sched.bubble() == pytest.approx((S - 1) / (2 * M + S - 1), abs=1e-12)


@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_zb_h1_table(S, M):
    """zb-h1 runs 1F1B's table with each backward as B (the input gradient, sent on) then
    W (the weight gradients from what B kept) in the same tick: in lockstep ticks W cannot
    fill the cool-down (stage 0's backwards are its last work), so it costs 1F1B's and
    stashes as much; what differs is the program (B and W, tests below)."""
    sched, ofob = build_schedule("zb-h1", S, M), build_schedule("1f1b", S, M)
    assert sched.kinds == (FWD, BWD, WGT)
    assert sched.cost() == ofob.cost() and sched.ticks == ofob.ticks
    assert sched.bubble() == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    assert sched.res_slots_by_stage == ofob.res_slots_by_stage
    when, once = _when(sched), _when(ofob)
    assert sorted(when) == sorted((s, k, m) for s in range(S) for k in (FWD, BWD, WGT)
                                  for m in range(M))
    for s in range(S):
        for m in range(M):
            assert when[(s, BWD, m)] == when[(s, WGT, m)] == once[(s, BACK, m)]
    # W sends nothing: the messages are 1F1B's, M per boundary each way
    sent = [sched.sends(t) for t in range(sched.ticks)]
    assert sent == [ofob.sends(t) for t in range(ofob.ticks)]
    assert sum(len(f) + len(b) for f, b in sent) == 2 * M * (S - 1)


@pytest.mark.parametrize("name,S,M,V", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                         ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)])
def test_combined_table_pairs_each_forward_with_another_micro_batches_backward(name, S, M, V):
    """--pp-combined-1f1b: a tick's F and BACK are one computation, so no stage's BACK may
    read what its own tick's F makes. Only the last chunk's backward moves: a tick after its
    forward (the same tick without combining), so every stage stashes one micro-batch more,
    the step takes one tick more and the same F-units (the extra tick holds the tail of
    the backward wave that the first tick's lone F no longer shares)."""
    plain, comb = build_schedule(name, S, M, V), build_schedule(name, S, M, V, combined=True)
    assert comb.combined and comb.summary()["combined_f_back"]
    assert comb.ticks == plain.ticks + 1 and comb.cost() == plain.cost()
    assert comb.res_slots_by_stage == [n + 1 for n in plain.res_slots_by_stage]
    last = S * V - 1
    for t in range(comb.ticks):
        for s in range(S):
            ops = {op.kind: op for op in comb.stage_ops(t, s)}
            if FWD in ops and BACK in ops:
                assert (ops[FWD].mb, ops[FWD].v) != (ops[BACK].mb, ops[BACK].v)
    when = {(comb.chunk(s, op.v), op.kind, op.mb): t for t, row in enumerate(comb.ops)
            for s, ops in enumerate(row) for op in ops}
    assert all(when[(last, BACK, m)] == when[(last, FWD, m)] + 1 for m in range(M))


@pytest.mark.parametrize("name", ["gpipe", "zb-h1"])
def test_combined_ticks_are_refused_without_a_1f1b_steady_state(name):
    with pytest.raises(UsageError, match=r"^--pp-combined-1f1b runs each tick's forward "
                       r"and backward as one computation, which --pp-schedule " + name +
                       r" has no steady state of; use --pp-schedule 1f1b or interleaved$"):
        build_schedule(name, 2, 4, combined=True)


def test_live_activations_gpipe_m_1f1b_bounded():
    """GPipe keeps every micro-batch's stash until its backward; 1F1B at most 2S-1."""
    for S, M in ((2, 8), (4, 16), (4, 32)):
        assert build_schedule("gpipe", S, M).res_slots == M
        assert build_schedule("1f1b", S, M).res_slots == 2 * S - 1
        # stage 0 embeds (receives nothing); stage s keeps its in-flight inputs
        assert build_schedule("1f1b", S, M).act_slots_by_stage == [0] + [
            2 * (S - 1 - s) + 1 for s in range(1, S)]
    # the program's one send switch has as many branches at M = 32 as at M = 16
    assert len(send_patterns(build_schedule("1f1b", 4, 32))[0]) == len(
        send_patterns(build_schedule("1f1b", 4, 16))[0])


# ------------------------------------------------------------------ compiled programs

def _pipeline(model, layout, mesh, schedule, M, virtual=1, stage_blocks=(), combined=False,
              **opts):
    shape = parse_mesh(mesh)
    cfg = get_model(model, {k: str(v) for k, v in opts.items()})
    program = build_pipeline_program(cfg, "float32", make_optimizer("adamw", 1e-2),
                                     get_layout(layout),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, M,
                                     schedule, virtual, stage_blocks=stage_blocks,
                                     combined=combined)
    return cfg, program


# Equal losses to one device, stage bytes and per-stage parameters of every layout x model
# x schedule x S x M: tests/test_pipeline_matrix.py.


def test_1f1b_temp_memory_below_gpipe():
    """At M = 4S GPipe stashes M micro-batches per stage, 1F1B 2S-1: the compiler's temp
    bytes differ by at least the (M - 2S + 1) stage inputs 1F1B does not keep (a stash
    holds more than its input: every activation the backward reads)."""
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
    assert temps["1f1b"] < temps["gpipe"]
    assert temps["gpipe"] - temps["1f1b"] >= (M - 2 * S + 1) * act


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


def _one_device_dot_flops(cfg) -> float:
    """Dot FLOPs of the unpipelined train step on one device, from its compiled HLO."""
    from jaxdist.train_step import build_program

    mesh = build_mesh(parse_mesh("1"), jax.devices()[:1])
    program = build_program(cfg, "float32", make_optimizer("adamw", 1e-2), get_layout("ddp"),
                            mesh, 0, 1)
    batch = put_batch(TrainStream(cfg, None, BATCH, 0).batch(0), program.batch_sharding)
    return kernels.inventory(program.step.lower(program.abstract_state, batch).compile()
                             .as_text()).flops


@pytest.mark.parametrize("schedule,remat,blocks", [
    ("1f1b", "none", ()), ("zb-h1", "none", ()), ("1f1b", "full", ()),
    ("1f1b", "selective_op", ()), ("1f1b", "none", (1, 2)), ("zb-h1", "full", (2, 1)),
    ("interleaved", "none", (3, 2)), ("interleaved-combined", "none", (3, 2))])
def test_step_dot_flops_are_the_models(schedule, remat, blocks):
    """The backward reads what F stashed: under --remat none a pipelined step's dot FLOPs
    (each branch of its switches weighed by the schedule table) are the one-device step's,
    with no second forward; --remat full and selective_op recompute as the one-device step
    does. zb-h1's W is the weight gradients only: per block its 6 kernels' dots, no forward
    dot and none of B's input-gradient chain (6 kernels' and 4 attention dots), and B + W =
    1F1B's BACK.
    F: 8 dots a block (q, k, v, out, up, down, QK^T, PV) and, under the last chunk's cond,
    the head's forward and backward (3). B reruns no forward and W no input-gradient
    chain (with them the step would be 4/3 and 5/3 of the model's FLOPs).
    Uneven stages (`blocks`, --pp-stage-blocks): a chunk's padded slots are skipped under
    a cond, so the step's dot FLOPs are still the model's, each slot's cond weighed by the
    chunks that hold the block. Combined ticks (--pp-combined-1f1b): the switch of idle,
    F, BACK and both, in each branch of the tick's sends, weighed by the stages' ticks."""
    S, M = 2, 2
    V = 2 if schedule == "interleaved" else 1
    schedule, combined = schedule.removesuffix("-combined"), schedule.endswith("-combined")
    cfg, program = _pipeline("gpt-tiny", "pp", "stage:2", schedule, M, V, blocks, combined,
                             depth=sum(blocks) or S, remat=remat)
    batch = put_batch(TrainStream(cfg, None, BATCH, 0).batch(0), program.batch_sharding)
    text = program.step.lower(program.abstract_state, batch).compile().as_text()
    mesh = dict(program.batch_sharding.mesh.shape)
    runs = switch_runs(text, mesh, program.schedule)
    assert kernels.inventory(text, runs).flops * S == pytest.approx(
        _one_device_dot_flops(cfg), rel=1e-9)
    if remat != "none" or blocks:
        return
    dots = _dots_by_computation(text)
    if schedule == "zb-h1":
        # the action switch (idle and the kinds); the send switch's branches run no dot
        action = [b for _, b in hlo.conditionals(text) if len(b) == 4
                  and any(dots(name) for name in b)]
        assert len(action) == 1
        assert [dots(name) for name in action[0]] == [0, 8 + 3, 10, 6]
    else:
        # F then BACK: each slot's switch (idle, its kind), one copy per branch of the
        # sends beside it (jaxdist/pipeline/step.py OverlappedSends)
        action = {tuple(dots(name) for name in b) for _, b in hlo.conditionals(text)
                  if len(b) == 2 and dots(b[0]) == 0 and dots(b[1]) > 3}
        assert action == {(0, 8 + 3), (0, 16)}


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
     "mnist), which the decoders of the pipeline layouts (pp, tp_pp, fsdp_pp, ep_pp) cannot "
     "read; drop --eval-every"),
    (["--mesh", "stage:2", "--microbatches", "2", "--eval-every", "1", "--dataset",
      "digits"], "dataset 'digits' is images; model family 'gpt' cannot read it"),
    # --pp-stage-blocks: one count per stage, summing to the depth, none zero, integers,
    # at least one block per virtual chunk, and only on a pipeline layout
    (["--mesh", "stage:2", "--microbatches", "2", "--model-opts", "depth=4",
      "--pp-stage-blocks", "1,1,2"], "--pp-stage-blocks 1,1,2 has 3 counts for stage=2; "
     "give one block count per stage"),
    (["--mesh", "stage:2", "--microbatches", "2", "--model-opts", "depth=4",
      "--pp-stage-blocks", "1,2"], "--pp-stage-blocks 1,2 sums to 3 blocks; the model has "
     "depth 4"),
    (["--mesh", "stage:2", "--microbatches", "2", "--model-opts", "depth=4",
      "--pp-stage-blocks", "0,4"], "--pp-stage-blocks '0,4': '0' is not a positive block "
     "count; give one per stage (NxR: N repeated R times), e.g. 7,8x14,7"),
    (["--mesh", "stage:2", "--microbatches", "2", "--model-opts", "depth=4",
      "--pp-stage-blocks", "1.5,2.5"], "'1.5' is not a positive block count"),
    (["--mesh", "stage:2", "--microbatches", "2", "--model-opts", "depth=4",
      "--pp-schedule", "interleaved", "--pp-virtual", "2", "--pp-stage-blocks", "1,3"],
     "--pp-stage-blocks 1,3: a stage of 1 blocks cannot fill --pp-virtual 2 chunks; give "
     "every stage at least 2 blocks"),
    (["--layout", "fsdp", "--mesh", "2", "--pp-stage-blocks", "1,1"],
     "--pp-stage-blocks splits the blocks over pipeline stages; layout 'fsdp' has none "
     "(use one of pp, tp_pp, fsdp_pp, ep_pp)"),
    # ep_pp: whole experts per device of the expert axis, which must divide them; no tensor
    (["--layout", "ep_pp", "--model", "moe-tiny", "--model-opts", "experts=6", "--mesh",
      "stage:2,expert:4", "--microbatches", "2", "--batch-size", "8"],
     "layout 'ep_pp' splits the experts dimension (stages/moe/down: 6) over expert=4, which "
     "does not divide it"),
    (["--layout", "ep_pp", "--model", "moe-tiny", "--mesh", "stage:2,tensor:2,expert:2",
      "--microbatches", "2"], "layout 'ep_pp' uses mesh axes data, stage, expert; the mesh "
     "has tensor=2"),
    (["--layout", "ep_pp", "--model", "gpt-tiny", "--mesh", "stage:2,expert:2",
      "--microbatches", "2"], "layout 'ep_pp' applies to moe models"),
    (["--mesh", "stage:2", "--microbatches", "2", "--pp-schedule", "zb-h1",
      "--pp-combined-1f1b"], "--pp-combined-1f1b runs each tick's forward and backward as "
     "one computation, which --pp-schedule zb-h1 has no steady state of; use --pp-schedule "
     "1f1b or interleaved"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys, tmp_path):
    from experiments.run import main

    code = main(["--layout", "pp", *argv, "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_data_x_microbatches():
    from experiments.run import build_parser
    from experiments.validation import check_batch
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
    from jaxdist.plan.pipeline_shapes import plan_pipeline

    cfg = from_namespace(build_parser().parse_args(["--dry-run", *argv]))
    return plan_pipeline(job_of(cfg, parse_mesh(cfg.mesh.mesh))).to_json()


def test_dry_run_go2025_grid_gpt3_tp_pp():
    """gpt3-175b on 32 GPUs as TPxPP 2x16 and 8x4: every stage holds 1/S of the blocks
    split t ways, plus the embeddings and head split t ways over the vocabulary (50257, which
    t does not divide: stored padded to a multiple of t, as Megatron pads it); AdamW's mu and
    nu are twice the parameters.
    --remat full: without it 1F1B's stash (up to 2S-1 = 31 micro-batches of 6 blocks'
    activations on stage 0 at 2x16) does not fit; with it each holds the block inputs."""
    for t, s in ((2, 16), (8, 4)):
        p = _plan("--model", "gpt3-175b", "--layout", "tp_pp", "--mesh",
                  f"stage:{s},tensor:{t}", "--microbatches", "32", "--batch-size", "64",
                  "--dtype", "bfloat16", "--remat", "full")
        d, v, L = 12288, 50257, 2048
        block = 12 * d * d + 13 * d   # q,k,v,out,up,down kernels and biases, two LayerNorms
        # per stage device: q,k,v,up kernels+biases and out,down kernels split t ways; the
        # out and down biases and the LayerNorms (6d) whole
        stage = 96 // s * ((12 * d * d + 7 * d) // t + 6 * d)
        shared = 2 * v * d + v + L * d + 2 * d  # tok, head (+bias), pos, ln_f
        assert p["model"]["params"] == 96 * block + shared
        vt = -(-v // t)  # the vocabulary's padded shard
        shared = 2 * vt * d + vt + L * d + 2 * d
        assert p["state_bytes_per_device"]["params"] == 4 * (stage + shared)
        # AdamW: mu and nu like the parameters, plus Adam's int32 step count
        assert p["state_bytes_per_device"]["opt"] == 2 * 4 * (stage + shared) + 4
        assert len(p["stages"]) == s
        assert all(st["total"] <= 141e9 for st in p["stages"])  # an H200 holds every stage
        act, K = 64 // 32 * L * d * 2, 96 // s  # one micro-batch's block input, bf16
        assert p["stages"][0]["activation_stash"] == (1 + min(32, 2 * s - 1) * K) * act
        assert p["pipeline"]["bubble"] == pytest.approx((s - 1) / (32 + s - 1))


def test_dry_run_uneven_stages_count_each_stages_blocks():
    """Llama 3 405B's 126 blocks over 16 stages as Meta ran it (7, fourteen 8s, 7) under
    tp_pp: each stage's parameters and optimizer state are its own blocks' (the 8-block
    stages' those of an even 128-block split), the 7-block stages hold one padded slot
    (counted in their total, named as padding), the model's parameters are the 126 blocks',
    and results/plans record the split."""
    model = ["--model", "llama3-70b", "--layout", "tp_pp", "--microbatches", "16",
             "--batch-size", "16", "--dtype", "bfloat16", "--remat", "full"]
    opts = "width=16384,heads=128,kv_heads=8,mlp_hidden=53248"
    p = _plan(*model, "--mesh", "stage:16,tensor:8", "--model-opts", f"depth=126,{opts}",
              "--pp-stage-blocks", "7,8x14,7")
    even = _plan(*model, "--mesh", "stage:16,tensor:8", "--model-opts", f"depth=128,{opts}")
    nine = _plan(*model, "--mesh", "stage:14,tensor:8", "--model-opts", f"depth=126,{opts}")
    assert p["pipeline"]["stage_blocks"] == [7] + [8] * 14 + [7]
    assert p["pipeline"]["chunk_blocks"] == [[7]] + [[8]] * 14 + [[7]]
    assert p["model"]["params"] == nine["model"]["params"] < even["model"]["params"]
    block = {k: even["stages"][1][k] - p["stages"][0][k] for k in ("params", "opt")}
    for s in p["stages"]:
        short = s["blocks"] == 7
        assert s["blocks"] == (7 if s["stage"] in (0, 15) else 8)
        for k in ("params", "opt", "gradients"):
            assert s[k] == even["stages"][s["stage"]][k] - short * (
                block["params"] if k == "gradients" else block[k])
        assert s["padded_slots"] == short
        assert s["padding_state"] == short * (block["params"] + block["opt"])
        assert s["padding_gradients"] == short * block["params"]
        assert s["total"] == even["stages"][s["stage"]]["total"]  # the same program memory
    # the 7-block stages wait for the 8-block ones: counted, above the formula's bubble
    assert p["pipeline"]["bubble"] > p["pipeline"]["analytic_bubble"] == \
        even["pipeline"]["bubble"]


def test_notices_for_pp_flags():
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from experiments.notices import notices

    cfg = from_namespace(build_parser().parse_args(["--layout", "fsdp", "--pp-schedule",
                                                    "gpipe"]))
    assert notices(cfg) == ["notice: --pp-schedule applies only to the pipeline layouts "
                            "(pp, tp_pp, fsdp_pp); ignored"]


def test_cli_run_records_pipeline(tmp_path):
    """A pp run end to end: results.json's pipeline block, the comm block's stage bytes and
    the TensorBoard scalars."""
    from jaxdist.record import RunRecord, check
    from tests.helpers import read_scalars, run_cli

    logdir = tmp_path / "pp"
    proc = run_cli("--layout", "pp", "--mesh", "data:2,stage:2", "--microbatches", "2",
                   "--batch-size", "8", "--warmup", "0", "--steps", "2",
                   "--logdir", str(logdir))
    assert proc.returncode == 0, proc.stderr
    results = RunRecord.load(logdir).results
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
    from experiments.notices import notices

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
    # a tensor group larger than a host: 4 in each of 2 hosts, stage across the other 2
    array = hybrid_device_array(MeshShape(1, stage=2, tensor=8), hosts(4, 4))
    assert [[d.process_index for d in array[s, 0, 0]] for s in range(2)] == \
        [[0] * 4 + [1] * 4, [2] * 4 + [3] * 4]


@pytest.mark.parametrize("remat,widths", [
    ("save_qkv_proj", 8192 + 2 * 1024),                         # q, k, v (8 kv heads of 128)
    ("minimal", 8192 + 2 * 1024 + 8192 + 2 * 28672)])          # + out_proj, gate, up
def test_pipeline_plan_stashes_what_a_named_policy_keeps(remat, widths):
    """MaxText's named policies in a pipeline plan: each micro-batch in flight keeps, per
    block of a chunk, its input and the named values the policy keeps, at their widths per
    token (mlpwo none: no backward reads it). The offloading ones are refused (the stash
    is device buffers: jaxdist.pipeline.checks.check_remat, test_run_cli)."""
    p = _plan("--model", "llama3-70b", "--model-opts", "depth=8", "--layout", "pp", "--mesh",
              "stage:4", "--microbatches", "8", "--batch-size", "8", "--dtype", "bfloat16",
              "--remat", remat)
    L, D, K, slots = 8192, 8192, 2, min(8, 2 * 4 - 1)  # one row per micro-batch, bf16
    act = L * D * 2
    assert p["stages"][0]["activation_stash"] == act + slots * K * (act + L * widths * 2)


def test_run_records_uneven_stages(tmp_path):
    """An uneven pp run in this process: results.json's pipeline block records the split;
    both stages hold two block slots (stage 0 one of them padding: equal shards)."""
    from experiments.run import main
    from jaxdist.record import RunRecord, check

    logdir = tmp_path / "pp"
    # 8 devices: the count this process's backend started with (tests/conftest.py)
    assert main(["--layout", "pp", "--mesh", "data:4,stage:2", "--model-opts", "depth=3",
                 "--pp-stage-blocks", "1,2", "--pp-schedule", "gpipe", "--microbatches", "2",
                 "--batch-size", "8", "--warmup", "0", "--steps", "1", "--no-progress",
                 "--logdir", str(logdir)]) == 0
    results = RunRecord.load(logdir).results
    assert check(results) == []
    pp = results["pipeline"]
    assert (pp["stage_blocks"], pp["chunk_blocks"]) == ([1, 2], [[1], [2]])
    by_stage = pp["memory"]["param_bytes_by_stage"]
    assert len(by_stage) == 2 and by_stage[0] == by_stage[1]


def test_skipped_slot_stashes_no_weights():
    """A padded slot's block runs under `skippable` (a cond inside a custom vjp): the stash
    of a chunk with such a slot holds what the even split's holds plus one flag per slot,
    no copy of the slot's weights (a vjp through a plain `lax.cond` would return them as
    residuals)."""
    import math

    import jax.numpy as jnp

    from jaxdist.pipeline.ops import ChunkOps
    from jaxdist.pipeline.parts import split_pipeline_model

    def stash_bytes(depth, blocks):
        cfg = get_model("gpt-tiny", {"depth": str(depth)})
        parts, params = split_pipeline_model(cfg, "float32", 0, 2, 1, blocks)
        chunk = jax.tree.map(lambda a: a[0, 0], params["stages"])
        x = jax.ShapeDtypeStruct((2, cfg.seq_len, cfg.width), jnp.float32)
        tokens = jax.ShapeDtypeStruct((2, cfg.seq_len + 1), jnp.int32)
        stash = ChunkOps(parts, 2).stash_shapes((chunk, {}), params["shared"], x, tokens)
        return sum(math.prod(r.shape) * r.dtype.itemsize for r in stash), len(stash)

    (even, n_even), (uneven, n_uneven) = stash_bytes(4, ()), stash_bytes(3, (1, 2))
    assert n_uneven > n_even and uneven - even == 1  # one bool: slot 1's `on`
