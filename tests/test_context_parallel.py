"""Context parallelism (a `context` mesh axis, models/context.py): the same losses as one
device for gpt and llama under cp with the data axes, cp x zero1, cp x fsdp and cp x tp with
sequence parallelism, with and without load balancing, and moe under cp x ep; the zig-zag
order; the XLA:GPU program's key/value exchange; bad input refused."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from jaxdist.data import TrainStream
from jaxdist.mesh import MeshShape, build_mesh, parse_mesh
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import get_model
from models.context import sequence_order
from sharding import get_layout
from tests.helpers import cli_main, job_of

STEPS = 2
_reference: dict = {}


def _train(model: str, layout: str, shape: MeshShape, balanced: bool = True,
           form: str = "allgather", **opts):
    mesh = build_mesh(shape, jax.devices()[:shape.size])
    cfg = dataclasses.replace(get_model(model, {k: str(v) for k, v in opts.items()}),
                              context_load_balance=balanced, context_attention=form)
    program = build_program(cfg, "float32", make_optimizer("adamw", 1e-2), get_layout(layout),
                            mesh, 0, 1)
    state, stream, losses = program.init(), TrainStream(cfg, None, 16, 0), []
    for _ in range(STEPS):
        state, loss = program.step(state, put_batch(stream.next(), program.batch_sharding))
        losses.append(float(loss))
    return np.array(losses)


def reference(model: str):
    if model not in _reference:
        _reference[model] = _train(model, "ddp", MeshShape(1))
    return _reference[model]


CASES = {  # name: (layout, mesh, sequence parallel)
    "cp": ("ddp", "data:2,context:2", False),
    "cp_zero1": ("zero1", "data:2,context:2", False),
    "cp_fsdp": ("fsdp", "data:1,fsdp:2,context:2", False),
    "cp_tp_sp": ("tp", "data:2,context:2,tensor:2", True),
    "cp_ep": ("ep", "data:2,context:2,expert:2", False),
}
RUNS = [(m, c, True) for m in ("gpt-tiny", "llama-tiny") for c in ("cp", "cp_fsdp", "cp_tp_sp")]
RUNS += [(m, "cp_tp_sp", False) for m in ("gpt-tiny", "llama-tiny")]
RUNS += [("llama-tiny", "cp_zero1", True), ("moe-tiny", "cp_ep", True)]


@pytest.mark.parametrize("model,case,balanced", RUNS)
def test_context_parallel_equals_single_device(model, case, balanced):
    layout, mesh, sp = CASES[case]
    opts = {"sequence_parallel": True} if sp else {}
    losses = _train(model, layout, parse_mesh(mesh), balanced, **opts)
    np.testing.assert_allclose(losses, reference(model), rtol=1e-5)


@pytest.mark.parametrize("model,mesh,balanced", [
    ("llama-tiny", "data:2,context:2", True), ("llama-tiny", "data:2,context:2", False),
    ("gpt-tiny", "data:2,context:2", True), ("gpt-tiny", "data:2,context:2", False),
    ("llama-tiny", "data:1,context:4", True)])
def test_ring_attention_equals_single_device(model, mesh, balanced):
    """--context-attention ring: the key/value blocks passed round the context ring, the
    partial outputs merged by log-sum-exp, the gradients back round it by autodiff; two
    steps of adamw equal one device's, so the loss and every gradient do."""
    losses = _train(model, "ddp", parse_mesh(mesh), balanced, "ring")
    np.testing.assert_allclose(losses, reference(model), rtol=1e-5)


@pytest.mark.parametrize("model,layout,mesh,schedule,distributed,balanced", [
    ("gpt-tiny", "pp", "data:2,stage:2,context:2", "1f1b", True, True),
    ("llama-tiny", "fsdp_pp", "fsdp:2,stage:2,context:2", "zb-h1", False, False)])
def test_context_parallel_inside_a_pipeline_equals_single_device(model, layout, mesh, schedule,
                                                                 distributed, balanced):
    """Inside each stage's shard_map (stage, data and context manual): 2 stages x 2
    micro-batches, load balanced or in contiguous parts; under the distributed optimizer
    the gradients are reduce-scattered over data x context, which AdamW's state is split
    over (a quarter of it on each device here)."""
    import dataclasses

    from jaxdist.pipeline.program import build_pipeline_program
    from tests import test_pipeline_matrix as pm

    S, M = 2, 2
    cfg = dataclasses.replace(pm._cfg(model, S), context_load_balance=balanced)
    shape = parse_mesh(mesh)
    program = build_pipeline_program(cfg, "float32", pm._TX, get_layout(layout, distributed),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, M,
                                     schedule, 1)
    stream, losses = TrainStream(cfg, None, pm.BATCH, 0), []
    state = pm._initial(program, cfg, S, 1)
    for _ in range(pm.STEPS):
        state, loss = program.step(state, put_batch(stream.next(), program.batch_sharding))
        losses.append(float(loss))
    np.testing.assert_allclose(losses, pm._reference(model, S), rtol=1e-5)
    if distributed:  # every stacked leaf of AdamW's mu: 1/S of it on a stage, 1/4 of that
        mu = state["opt"][0].mu["stages"]
        assert all(x.addressable_shards[0].data.size * S * 4 == x.size
                   for x in jax.tree.leaves(mu))


@pytest.mark.parametrize("schedule,V", [("1f1b", 1), ("interleaved", 2)])
def test_context_parallel_inside_tp_pp_equals_single_device(schedule, V):
    """tp_pp with sequence parallelism on stage:2,context:2,tensor:2: each stage body holds
    its own sequence shard (context manual beside stage and data, tensor left to the
    partitioner), load balanced; equal to one device, each stage's sends those of its own
    sequence shard (read from the compiled HLO)."""
    from tests import test_pipeline_matrix as pm

    S = 2
    pm._check_case("llama-tiny", "tp_pp", "stage:2,context:2,tensor:2", schedule, V, S,
                   2 * S, pm._reference("llama-tiny", S * V), sequence_parallel=True)


def test_zig_zag_gives_every_shard_equal_causal_work():
    """Shard c holds chunks c and 2CP-1-c: the keys its queries read under the causal mask
    (the sum of their positions + 1) are equal on every shard; contiguous parts are not."""
    L, cp = 64, 4
    order = sequence_order(L, cp, balanced=True)
    assert sorted(order.tolist()) == list(range(L))
    work = [(order[s * L // cp:(s + 1) * L // cp] + 1).sum() for s in range(cp)]
    assert len(set(work)) == 1
    # 8 chunks of 8: shard 0 holds chunks 0 and 7, shard 1 chunks 1 and 6
    assert order[:16].tolist() == [*range(0, 8), *range(56, 64)]
    assert order[16:32].tolist() == [*range(8, 16), *range(48, 56)]
    contiguous = [sum(range(s * L // cp + 1, (s + 1) * L // cp + 1)) for s in range(cp)]
    assert len(set(contiguous)) == cp
    assert sequence_order(L, cp, balanced=False) is None


@pytest.mark.parametrize("args,line", [
    (("--model", "gpt-tiny", "--mesh", "data:1,context:3"),
     "--mesh data:1,context:3: sequence length 32 is not divisible by 2 x context = 6 chunks "
     "(load balancing; --no-context-load-balance needs a multiple of 3); use --model-opts "
     "seq_len=<a multiple of 6>"),
    (("--model", "gpt-tiny", "--mesh", "data:1,context:3", "--no-context-load-balance"),
     "--mesh data:1,context:3: sequence length 32 is not divisible by context = 3 parts; use "
     "--model-opts seq_len=<a multiple of 3>"),
    (("--model", "resnet-tiny", "--mesh", "data:1,context:2"),
     "context=2 splits each sequence over the context axis; model 'resnet-tiny' has no "
     "sequence dimension (use a gpt, llama or moe model, or drop context from --mesh)"),
    (("--model", "mlp-tiny", "--mesh", "data:1,context:2"),
     "context=2 splits each sequence over the context axis; model 'mlp-tiny' has no "
     "sequence dimension (use a gpt, llama or moe model, or drop context from --mesh)"),
    (("--model", "gpt-tiny", "--mesh", "data:2,context:2", "--layout", "ps"),
     "layout 'ps' uses mesh axes data, fsdp; the mesh has context=2 (layouts for this mesh: "
     "ddp, fsdp, zero1)"),
    (("--model", "moe-tiny", "--mesh", "stage:2,context:2", "--layout", "pp",
      "--microbatches", "2"),
     "moe under the pipeline layouts needs context=1 (got context=2): its balance loss "
     "would be averaged per sequence shard; run moe's context parallelism under --layout "
     "ep"),
    (("--model", "gpt-tiny", "--mesh", "data:2,context:2,tensor:2", "--layout", "tp",
      "--distributed-optimizer"),
     "--distributed-optimizer with context=2 runs where the parameters are replicated "
     "(--layout zero1); this mesh splits them over tensor=2 (drop the flag, or the context "
     "axis)"),
    (("--model", "gpt-tiny", "--mesh", "data:2,stage:2,context:2", "--layout", "pp",
      "--context-attention", "ring"),
     "--context-attention ring passes key/value blocks between every stage's devices at "
     "once, which a pipeline's per-stage branches cannot; use --context-attention allgather "
     "with layout 'pp'"),
    (("--model", "llama-tiny", "--mesh", "data:1,context:2", "--context-attention", "ring",
      "--model-opts", "attention=cudnn"),
     "--context-attention ring attends each block with XLA's dot attention (cuDNN's "
     "log-sum-exp has no gradient); use attention=default with it, or --context-attention "
     "allgather"),
])
def test_bad_context_parallel_input_is_refused(args, line, tmp_path, monkeypatch, capsys):
    """One line naming the problem and what works, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_force_host_platform_device_count=8")
    proc = cli_main(capsys, "--platform", "cpu", "--steps", "1", "--batch-size", "8", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"run: error: {line}"]
    assert list(tmp_path.iterdir()) == []


def test_xla_gpu_moves_keys_and_values_on_context_only():
    """llama-tiny under tp on data:2,context:2,tensor:2, compiled by XLA:GPU for 8 H100 (no
    GPU present): the key/value exchange is an all-gather on `context` alone (forward) and
    a reduce-scatter of their gradients on it (backward), each of exactly every layer's k
    and v of the whole sequence (and the positions, int32, once); on the data axes only
    the gradients' all-reduce moves (over data and context), no activation."""
    from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
    from jaxdist.hardware import get_hardware
    from jaxdist.program import compiled, program_reading

    if compiled.gpu_compiler_missing() is not None:
        pytest.skip(str(compiled.gpu_compiler_missing()))
    mesh, batch = "data:2,context:2,tensor:2", 16
    cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                    model=ModelConfig(model="llama-tiny", dtype="bfloat16"),
                    train=TrainConfig(layout="tp", batch_size=batch))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(mesh)
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    _, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    reading = program_reading.read(comp, target, shape.axis_sizes, None, compile_s=seconds)
    moved: dict = {}
    for op in reading.collectives:
        key = (op["kind"], "+".join(op["axes"]))
        moved[key] = moved.get(key, 0) + op["bytes"]
    rows = batch // shape.data
    head_dim = model_cfg.width // model_cfg.heads
    kv = 2 * model_cfg.depth * rows * model_cfg.seq_len * (
        model_cfg.kv_heads // shape.tensor) * head_dim * 2  # k and v, bf16, gathered
    assert moved[("all-gather", "context")] == kv + 4 * model_cfg.seq_len
    assert moved[("reduce-scatter", "context")] == kv
    on_data = {k for k in moved if "data" in k[1].split("+")}
    assert on_data == {("all-reduce", "data+context")}
    assert not any(kind == "all-to-all" for kind, _ in moved)


def test_context_axis_is_named_in_the_mesh_and_the_record():
    """`context` sits between fsdp and tensor, is named in the spec a record gives back (the
    report's and HParams' mesh column) and in run folder names, and splits no batch rows."""
    from jaxdist.record import mesh_spec
    from sharding.axes import batch_axes

    shape = parse_mesh("data:2,context:2,tensor:2")
    assert shape.axis_sizes == {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}
    assert shape.spec == mesh_spec(shape.axis_sizes) == "data:2,context:2,tensor:2"
    assert parse_mesh(shape.spec) == shape
    assert shape.label == "data2-context2-tensor2"
    assert batch_axes(shape.axis_sizes) == ("data", "fsdp")


def test_memory_estimate_splits_activations_over_context():
    """The plan's hand estimate: a context axis of 2 in place of half the batch shards
    holds the same activations per device (each device keeps half of twice the rows'
    sequences), the state and gradients as the layout stores them."""
    from jaxdist.config import ModelConfig, RunConfig, TrainConfig
    from jaxdist.plan import shapes
    from jaxdist.predict import memory

    def estimate(mesh):
        cfg = RunConfig(model=ModelConfig(model="llama-tiny", dtype="float32"),
                        train=TrainConfig(layout="ddp", batch_size=16, remat="dots"))
        state = shapes.plan(job_of(cfg, parse_mesh(mesh))).to_json()
        return memory.predict_memory(job_of(cfg).model, "float32", 16, 1,
                                     dict(parse_mesh(mesh).axis_sizes),
                                     state["state_bytes_per_device"],
                                     state["state_bytes_global"]["params"], False, True)
    batch, split = estimate("4"), estimate("data:2,context:2")
    assert split.residual_bytes == pytest.approx(batch.residual_bytes, rel=1e-3)
    assert split.residual_bytes == pytest.approx(estimate("2").residual_bytes / 2, rel=1e-3)


def test_pipeline_plan_splits_the_stash_over_context():
    """The pipeline plan's hand estimate (shapes only): a context axis of 2 in place of half
    the data shards holds the same activations per stage device (twice the rows, each half
    its sequence; the scores' queries halved, their keys whole), and one micro-batch's
    stage message is L / (2 x 8) long (under sequence parallelism a sequence shard over
    tensor too), also where a data shard's micro-batch is one row."""
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.plan.pipeline_shapes import plan_pipeline
    from jaxdist.predict.pipeline import message_bytes

    def plan(mesh, microbatches=4):
        cfg = from_namespace(build_parser().parse_args([
            "--dry-run", "--model", "llama3-70b", "--model-opts", "depth=8", "--layout",
            "tp_pp", "--mesh", mesh, "--microbatches", str(microbatches), "--batch-size", "16",
            "--dtype", "bfloat16", "--sequence-parallel"]))
        sizes = dict(parse_mesh(mesh).axis_sizes)
        job = job_of(cfg, parse_mesh(mesh))
        return plan_pipeline(job).to_json()["stages"], message_bytes(job, job.model, sizes)
    (whole, msg_whole), (split, msg_split) = (
        plan("data:4,stage:2,tensor:8"), plan("data:2,stage:2,context:2,tensor:8"))
    for a, b in zip(whole, split):
        assert b["activation_stash"] == a["activation_stash"] > 0
        assert b["activation_working"] == a["activation_working"] > 0
    assert msg_split == msg_whole == 16 // (4 * 4) * 8192 // 8 * 8192 * 2
    _, msg_one_row = plan("data:2,stage:2,context:2,tensor:8", microbatches=8)
    assert msg_one_row == 1 * 8192 // (2 * 8) * 8192 * 2


def test_xla_gpu_ring_passes_keys_and_values_round_context():
    """llama-tiny (one block) under zero1 on data:4,context:2 with --context-attention
    ring, compiled by XLA:GPU for 8 H100 (no GPU present): the key/value exchange is
    async collective-permutes on `context` alone, of exactly one block each (forward: the
    block's k and v and the positions, int32; backward: its k and v gradients back round
    the ring), and no other collective runs inside the block."""
    import re

    from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
    from jaxdist.hardware import get_hardware
    from jaxdist.program import compiled, program_reading

    if compiled.gpu_compiler_missing() is not None:
        pytest.skip(str(compiled.gpu_compiler_missing()))
    mesh, batch = "data:4,context:2", 16
    cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                    model=ModelConfig(model="llama-tiny", dtype="bfloat16",
                                      model_opts="depth=1"),
                    train=TrainConfig(layout="zero1", batch_size=batch,
                                      context_attention="ring"))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(mesh)
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    _, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    reading = program_reading.read(comp, target, shape.axis_sizes, None, compile_s=seconds)
    permutes = [op for op in reading.collectives if op["kind"] == "collective-permute"]
    assert {"+".join(op["axes"]) for op in permutes} == {"context"}
    rows, block = batch // shape.data, model_cfg.seq_len // shape.context
    kv = 2 * rows * block * model_cfg.kv_heads * (model_cfg.width // model_cfg.heads) * 2
    assert sum(op["bytes"] for op in permutes) == 2 * model_cfg.depth * kv + 4 * block
    text = comp.as_text()
    starts = [line for line in text.splitlines() if "collective-permute-start(" in line]
    assert len(starts) == len(permutes) and all('"is_sync":false' in s for s in starts)
    in_blocks = re.findall(r'= .* ([a-z-]+)-start\(.*op_name="[^"]*\(block_\d', text)
    assert in_blocks == ["collective-permute"] * len(permutes)
