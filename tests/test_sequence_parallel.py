"""Megatron sequence parallelism (--sequence-parallel, models/sequence_parallel.py) under tp,
fsdp_tp and tp_pp: the same losses as one device, the collectives of a block read from the
compiled HLO against Megatron-SP's volume, the norm regions' memory split by T, bad input."""

import collections
import functools

import jax
import numpy as np
import pytest

from jaxdist.program import comm
from jaxdist.data import TrainStream
from jaxdist.mesh import MeshShape, build_mesh, parse_mesh
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import get_model
from sharding import get_layout
from tests.helpers import reference_losses, train
from tests.test_pipeline_matrix import MESHES, _check_case, _reference

MESH = MeshShape(2, 2, 2)
ROWS, L, D = 4, 32, 64  # gpt-tiny: batch 16 over data x fsdp = 4 shards; seq 32, width 64
ACT = ROWS * L * D * 4  # one block activation per device, float32
# The tests that share a single-device reference (tests.helpers.reference_losses) or a
# compiled program (_compiled) run on one xdist worker, which makes each once.
SHARES_WORK = pytest.mark.xdist_group("sequence-parallel")


@SHARES_WORK
@pytest.mark.parametrize("model,layout", [("gpt-tiny", "tp"), ("gpt-tiny", "fsdp_tp"),
                                          ("llama-tiny", "tp")])
def test_sequence_parallel_equals_single_device(model, layout):
    reference = reference_losses(model)
    losses = train(model, layout, MESH, steps=3, sequence_parallel=True)[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.parametrize("model,schedule,pieces", [
    pytest.param(model, schedule, pieces, marks=pytest.mark.xdist_group(f"pp-matrix-{model}"))
    for model, schedule, pieces in (("gpt-tiny", "1f1b", 1), ("llama-tiny", "zb-h1", 1),
                                    ("llama-tiny", "1f1b", 4))])
def test_tp_pp_sequence_parallel_equals_single_device(model, schedule, pieces):
    """Inside each stage's shard_map (stage and data manual), with its stage sends and
    collectives checked as in the pipeline matrix; with each sublayer's sequence shard in
    pieces (--tp-comm-split sequence) too. In the matrix's xdist groups: its references
    (depth 2) are theirs."""
    _check_case(model, "tp_pp", MESHES["tp_pp"].format(S=2), schedule, 1, 2, 4,
                _reference(model, 2), sequence_parallel=True, tp_comm_chunks=pieces,
                tp_comm_split="sequence")


@functools.cache
def _compiled(layout, shape, depth, sp, chunks=1):
    """(collectives, temp bytes) of the step compiled from abstract state: nothing is
    initialised or run, only the program is read. Once per process for each argument set
    (read only by the callers)."""
    cfg = get_model("gpt-tiny", {"depth": str(depth), "sequence_parallel": str(sp),
                                 "tp_comm_chunks": str(chunks)})
    program = build_program(cfg, "float32", make_optimizer("adamw", 1e-2), get_layout(layout),
                            build_mesh(shape, jax.devices()[:shape.size]), 0, 1)
    batch = put_batch(TrainStream(cfg, None, 16, 0).batch(0), program.batch_sharding)
    compiled = program.step.lower(program.abstract_state, batch).compile()
    ops = comm.collectives(compiled.as_text(), dict(program.batch_sharding.mesh.shape))
    return ops, compiled.memory_analysis().temp_size_in_bytes


def _per_block(layout, shape, sp):
    """The tensor-axis collectives of one block's activations (whole multiples of ACT
    bytes: activations moved, by kind) and their ring bytes, as depth 2 minus depth 1
    (embedding, head and loss cancel), and the temp bytes."""
    (one, t1), (two, t2) = (_compiled(layout, shape, d, sp, 1) for d in (1, 2))

    def tally(ops):
        kinds, ring = collections.Counter(), 0.0
        for o in ops:
            if o["axes"] == ["tensor"] and o["bytes"] % ACT == 0:
                kinds[o["kind"]] += o["bytes"] // ACT
                ring += o["ring_bytes"]
        return kinds, ring
    (k1, r1), (k2, r2) = tally(one), tally(two)
    return {k: k2[k] - k1[k] for k in set(k1) | set(k2)}, r2 - r1, t2 - t1


@SHARES_WORK
@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_block_collectives_are_megatron_sp(layout):
    """Per block and micro-batch Megatron-SP moves 2 all-gathers (the norms' outputs) and 2
    reduce-scatters (attention's and the MLP's row-parallel partial sums) forward, and their
    transposes backward: 4 + 4 of one activation, ring 8 (T-1)/T x ACT, tp's 4 all-reduces'
    volume; no all-reduce of an activation is left."""
    T = MESH.tensor
    kinds, ring, _ = _per_block(layout, MESH, sp=True)
    assert {k: n for k, n in kinds.items() if n} == {"all-gather": 4, "reduce-scatter": 4}
    assert ring == pytest.approx(8 * (T - 1) / T * ACT)
    kinds_tp, ring_tp, _ = _per_block(layout, MESH, sp=False)
    assert kinds_tp.get("all-gather", 0) == kinds_tp.get("reduce-scatter", 0) == 0
    # tp: 4 all-reduces of an activation by the same count (XLA:CPU all-reduces q, k and
    # v's partial input gradients apart: 6 measured), ring 2 (T-1)/T each
    assert ring_tp == pytest.approx(2 * (T - 1) / T * ACT * kinds_tp["all-reduce"])
    assert kinds_tp["all-reduce"] >= 4 and ring_tp >= ring


def test_norm_region_memory_falls_by_t():
    """The compiler's temp bytes of one block (depth 2 minus depth 1) drop by R (1 - 1/T):
    the norm/residual regions, R bytes whole on each device under tp, hold R/T under
    sequence parallelism. Measured at T = 2 and 4 with the same rows per device, R agrees
    (measured: 6.1 activations at both) and holds at least the two norms' inputs."""
    regions = {}
    for T in (2, 4):
        shape = MeshShape(2, 1, T)  # batch 16 over data 2: 8 rows per device either way
        tp, sp = (_per_block("tp", shape, flag)[2] for flag in (False, True))
        regions[T] = (tp - sp) / (1 - 1 / T)
    act = 8 * L * D * 4
    assert regions[2] == pytest.approx(regions[4], rel=0.05)
    assert regions[2] >= 2 * act


@SHARES_WORK
@pytest.mark.parametrize("model,layout", [("gpt-tiny", "tp"), ("llama-tiny", "fsdp_tp")])
def test_tp_comm_chunks_equal_single_device(model, layout):
    """--tp-comm-chunks 2: the blocks run on two slices of each device's 4 rows, the same
    losses as one device."""
    reference = reference_losses(model)
    losses = train(model, layout, MESH, steps=3, sequence_parallel=True, tp_comm_chunks=2)[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


@SHARES_WORK
@pytest.mark.parametrize("model,layout", [("gpt-tiny", "tp"), ("llama-tiny", "fsdp_tp")])
def test_sequence_pieces_equal_single_device(model, layout):
    """--tp-comm-split sequence: each sublayer's 16-token sequence shard in 4 pieces, each
    gathered, projected and scattered on its own (attention reassembles the whole sequence
    between its projections), the same losses as one device."""
    reference = reference_losses(model)
    losses = train(model, layout, MESH, steps=3, sequence_parallel=True, tp_comm_chunks=4,
                   tp_comm_split="sequence")[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


@SHARES_WORK
def test_tp_comm_chunks_split_each_collective_in_two_and_move_nothing_more():
    """Two slices: each block's 4 all-gathers and 4 reduce-scatters on tensor become 8 + 8 of
    half an activation (the same ring bytes), and what moves on the batch axes (gradients,
    fsdp's weight gathers) is what one chain moves: the slices' weight gradients leave each
    sublayer's shard_map as one sum, no activation crosses those axes. Measured extra: the
    norms' scales and biases and the row biases, gathered and reduced once per slice, 10
    vectors of `width` floats per block and extra slice (per block: 5,120 of 250,368 bytes)."""
    def tally(chunks):
        (one, _), (two, _) = (_compiled("fsdp_tp", MESH, d, True, chunks) for d in (1, 2))

        def count(ops):
            c = collections.Counter()
            for o in ops:
                if o["axes"] == ["tensor"] and o["bytes"] % (ACT // 2) == 0:  # activations
                    c[(o["kind"], o["bytes"])] += 1
            return c
        tensor = count(two)
        tensor.subtract(count(one))
        batch_axes = collections.Counter()
        for o in two:
            if "tensor" not in o["axes"]:
                batch_axes[o["kind"]] += o["bytes"]
        largest = max(o["bytes"] for o in two if o["axes"] == ["data", "fsdp"]
                      and o["kind"] == "all-gather")
        return {k: n for k, n in tensor.items() if n}, batch_axes, largest
    (whole, rest1, big1), (halves, rest2, big2) = tally(1), tally(2)
    assert whole == {("all-gather", ACT): 4, ("reduce-scatter", ACT): 4}
    assert halves == {("all-gather", ACT // 2): 8, ("reduce-scatter", ACT // 2): 8}
    assert big2 == big1 and set(rest2) == set(rest1) == {"all-gather", "all-reduce"}
    vector, depth = D * 4, 2
    extra = {k: rest2[k] - rest1[k] for k in rest1}
    assert all(v >= 0 and v % vector == 0 for v in extra.values())
    assert sum(extra.values()) == 10 * vector * depth


def test_tp_comm_chunks_resolved_from_each_devices_micro_batch():
    """Auto: under tp and fsdp_tp 2 where each device's micro-batch is even, else 1; 1 under
    a pipeline layout (a stage's blocks are one chain); an explicit count must divide the
    micro-batch."""
    from experiments.run import build_parser
    from jaxdist.config import from_namespace
    from jaxdist.errors import UsageError
    from jaxdist.run_model import tp_comm_chunks

    def chunks(*argv, split=False):
        cfg = from_namespace(build_parser().parse_args(
            ["--model", "gpt-tiny", "--sequence-parallel", *argv]))
        got = tp_comm_chunks(cfg.train, parse_mesh(cfg.mesh.mesh), get_model("gpt-tiny"))
        return got if split else got[0]
    assert chunks("--layout", "tp", "--mesh", "data:2,tensor:2", "--batch-size", "8") == 2
    assert chunks("--layout", "tp", "--mesh", "data:2,tensor:2", "--batch-size", "6") == 1
    assert chunks("--layout", "tp", "--mesh", "data:4,tensor:2", "--batch-size", "16",
                  "--microbatches", "4") == 1
    assert chunks("--layout", "fsdp_tp", "--mesh", "2x2x2", "--batch-size", "8") == 2
    assert chunks("--layout", "fsdp_tp", "--mesh", "2x2x2", "--batch-size", "12") == 1
    assert chunks("--layout", "fsdp_tp", "--mesh", "2x2x2", "--batch-size", "8",
                  "--tp-comm-chunks", "1") == 1
    assert chunks("--layout", "tp", "--mesh", "1x1x2", "--batch-size", "16",
                  "--tp-comm-chunks", "4") == 4
    assert chunks("--layout", "tp_pp", "--mesh", "stage:2,tensor:2", "--batch-size",
                  "16") == 1
    # pipelines split each sublayer's sequence shard (gpt-tiny: 16 tokens a tensor device)
    assert chunks("--layout", "tp_pp", "--mesh", "stage:2,tensor:2", "--batch-size", "16",
                  "--tp-comm-chunks", "4", split=True) == (4, "sequence")
    assert chunks("--layout", "tp", "--mesh", "data:4,tensor:2", "--batch-size", "16",
                  "--microbatches", "4", "--tp-comm-chunks", "2", "--tp-comm-split",
                  "sequence", split=True) == (2, "sequence")
    with pytest.raises(UsageError, match="each device's sequence shard of 16 tokens"):
        chunks("--layout", "tp_pp", "--mesh", "stage:2,tensor:2", "--tp-comm-chunks", "3")
    with pytest.raises(UsageError, match="does not divide each device's micro-batch of 4"):
        chunks("--layout", "tp", "--mesh", "data:4,tensor:2", "--batch-size", "16",
               "--tp-comm-chunks", "3")


@pytest.mark.parametrize("argv,message", [
    (["--layout", "tp", "--mesh", "data:4,tensor:2", "--tp-comm-chunks", "3"],
     "--tp-comm-chunks 3 does not divide each device's micro-batch of 16 (--batch-size 64 "
     "over 4 batch shards, --microbatches 1); use a divisor of 16, --tp-comm-split "
     "sequence, or 0 for auto"),
    (["--layout", "tp_pp", "--mesh", "stage:2,tensor:2", "--tp-comm-split", "batch"],
     "--tp-comm-split batch: the pipeline layouts run each stage's blocks as one chain; use "
     "--tp-comm-split sequence"),
    (["--layout", "fsdp", "--mesh", "2x2"],
     "--sequence-parallel splits activations over the tensor axis of a tensor-parallel "
     "layout; layout 'fsdp' has none (use tp, fsdp_tp, tp_pp)"),
    (["--layout", "tp", "--mesh", "4x1"], "--sequence-parallel needs a tensor axis of size "
     "2 or more; mesh '4' has tensor=1 (e.g. --mesh data:2,tensor:2)"),
    (["--layout", "tp", "--mesh", "1x1x4", "--model-opts", "seq_len=30"],
     "--sequence-parallel splits the sequence, heads and MLP over tensor=4: seq_len=30 not "
     "divisible by 4; use --model-opts with multiples of 4"),
    (["--layout", "tp", "--mesh", "1x1x2", "--model", "moe-tiny"],
     "--sequence-parallel applies to the dense decoders (gpt, llama models), not 'moe-tiny'"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys, tmp_path):
    from experiments.run import main

    code = main(["--sequence-parallel", *argv, "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"run: error: {message}"
    assert not (tmp_path / "run").exists()
