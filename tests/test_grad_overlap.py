"""The distributed optimizer's gradient reduce-scatter overlaps the backward in the XLA:GPU
program itself (jaxdist/update.py overlap_options, Megatron's --overlap-grad-reduce): read
from the compiled schedule of a tiny model, with the bucket shrunk to a few leaves so that
gpt-tiny has several. Skipped where the GPU compiler is not installed."""

import pytest

from jaxdist import metrics, update
from jaxdist.program import compiled, kernels, program_reading
from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
from jaxdist.hardware import get_hardware
from jaxdist.program.hlo import entry_computation
from jaxdist.mesh import parse_mesh
from tests.helpers import job_of

pytestmark = pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                                reason=str(compiled.gpu_compiler_missing()))

GEMMS = ("gemm fusion (Triton)", "gemm (cuBLAS)", "unfused dot")


def test_gradient_reduce_scatters_are_issued_inside_the_backward(monkeypatch):
    """tp on data:4,tensor:8, bf16, --distributed-optimizer, buckets of 1000 parameters: the
    data-axis float32 reduce-scatters are several, most start while matmuls of the backward
    are still to run (not all after it, as one combined reduce-scatter would), and together
    they still move exactly each device's float32 gradient shard."""
    monkeypatch.setattr(update, "BUCKET_PARAMS", 1000)
    monkeypatch.setattr(update, "BUCKET_PARAMS_PER_RANK", 0)
    cfg = RunConfig(mesh=MeshConfig(mesh="data:4,tensor:8"),
                    model=ModelConfig(model="gpt-tiny", dtype="bfloat16"),
                    train=TrainConfig(layout="tp", batch_size=64, distributed_optimizer=True))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(get_hardware("h200"), shape.size)
    program, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    hlo = program_reading.text(comp)
    reading = program_reading.read(comp, target, shape.axis_sizes, None, compile_s=seconds)
    scatters = {op["name"]: op for op in reading.collectives
                if op["kind"] == "reduce-scatter" and op["axes"] == ["data"]}
    planned = metrics.planned_bytes_per_device(program.abstract_state, program.state_specs,
                                               dict(shape.axis_sizes))
    assert sum(op["bytes"] for op in scatters.values()) == 4 * (planned["params"] // 2)
    assert {d for op in scatters.values() for d in op["dtypes"]} == {"f32"}
    order = [("rs" if item["name"] in scatters else None) if item["item"] == "start" else
             ("gemm" if item["item"] == "kernel" and item["kind"] in GEMMS else None)
             for item in kernels.schedule(hlo)[entry_computation(hlo)]]
    order = [o for o in order if o]
    last_gemm = max(i for i, o in enumerate(order) if o == "gemm")
    early = sum(1 for i, o in enumerate(order) if o == "rs" and i < last_gemm)
    assert len(scatters) >= 4
    assert early >= len(scatters) // 2, order


def _tensor_collectives_hidden(chunks: int, split: str = "batch") -> tuple[int, int]:
    """(tensor-axis all-gathers and reduce-scatters with a matmul scheduled between their
    start and done, all of them) in the XLA:GPU program of one block of the Megatron-style
    GPT (width 5120, 40 heads, 4,096 tokens, cuDNN attention), tp on
    data:32,tensor:4, bf16, --distributed-optimizer --sequence-parallel with `chunks`
    slices or pieces (`split`). Full-size shapes: with tiny ones XLA's scheduler sees nothing worth hiding."""
    cfg = RunConfig(mesh=MeshConfig(mesh="data:32,tensor:4"),
                    model=ModelConfig(model="gpt-tiny", dtype="bfloat16", model_opts=(
                        "seq_len=4096,width=5120,depth=1,heads=40,attention=cudnn")),
                    train=TrainConfig(layout="tp", batch_size=128, sequence_parallel=True,
                                      distributed_optimizer=True, tp_comm_chunks=chunks,
                                      tp_comm_split=split))
    model_cfg = job_of(cfg).model
    assert model_cfg.tp_comm_chunks == chunks
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    _, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    return _hidden(comp, target, shape.axis_sizes)


def _hidden(comp, target, sizes) -> tuple[int, int]:
    """(tensor-axis all-gathers and reduce-scatters with a matmul scheduled between their
    start and done, all of them) in a compiled program's entry computation."""
    hlo = program_reading.text(comp)
    reading = program_reading.read(comp, target, sizes, None, compile_s=0.0)
    names = {op["name"] for op in reading.collectives if op["axes"] == ["tensor"]
             and op["kind"] in ("all-gather", "reduce-scatter")}
    in_flight, hidden = set(), set()
    for item in kernels.schedule(hlo)[entry_computation(hlo)]:
        if item["item"] == "start" and item["name"] in names:
            in_flight.add(item["name"])
        elif item["item"] == "done":
            in_flight.discard(item["name"])
        elif item["item"] == "kernel" and item["kind"] in GEMMS:
            hidden |= in_flight
    return len(hidden), len(names)


def test_tp_comm_chunks_put_matmuls_under_the_sequence_parallel_collectives():
    """--tp-comm-chunks 2 (Domino's batch split, models/sequence_parallel.run_stack): the
    block's 8 sequence-parallel collectives become 16, and most have another slice's matmul
    scheduled while in flight; as one chain most sit between the matmuls that
    need it. (Plus the entry into and exit from the sequence shards, not split: 2.)"""
    hidden1, total1 = _tensor_collectives_hidden(1)
    hidden2, total2 = _tensor_collectives_hidden(2)
    assert (total1, total2) == (8 + 2, 16 + 2)
    assert hidden1 <= total1 // 3 and hidden2 >= total2 // 2, (hidden1, hidden2)  # 3, 11


def test_sequence_pieces_put_matmuls_under_the_sequence_parallel_collectives():
    """--tp-comm-split sequence, 2 pieces (models/sequence_parallel._run_pieces): each
    sublayer's collectives in two, and a piece's matmul in flight under most of them, where
    XLA's dot merger fused the pieces' matmuls back into one without the barriers."""
    hidden, total = _tensor_collectives_hidden(2, "sequence")
    assert total == 16 + 2
    assert hidden >= total // 2, hidden


def _pipeline_op_collectives_hidden(kind: int) -> tuple[int, int]:
    """(tensor-axis all-gathers and reduce-scatters with a matmul scheduled between their
    start and done, all of them) in the XLA:GPU program of one pipeline chunk op
    (jaxdist/predict/pipeline.py op_lowered) of one full-size block (width 5120, 40 heads,
    4,096 tokens, cuDNN attention), tp_pp on data:2,stage:2,tensor:4, bf16, sequence
    parallel, --pp-combined-1f1b's compiler options."""
    from jaxdist.predict import pipeline as pl
    from jaxdist.program.xla_compile import compile_lowered

    cfg = RunConfig(mesh=MeshConfig(mesh="data:2,stage:2,tensor:4"),
                    model=ModelConfig(model="gpt-tiny", dtype="bfloat16", model_opts=(
                        "seq_len=4096,width=5120,depth=1,heads=40,attention=cudnn")),
                    train=TrainConfig(layout="tp_pp", batch_size=8, microbatches=4,
                                      sequence_parallel=True, pp_combined_1f1b=True))
    job = job_of(cfg)
    shape = job.shape
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    sizes = dict(shape.axis_sizes)
    low, _ = pl.op_lowered(job, job.model, sizes, 1, kind, False, 1, target)
    (comp, _), = compile_lowered([low], compiled.compile_options(job, target))
    return _hidden(comp, target, sizes)


def test_a_combined_ticks_forward_and_backward_hide_each_others_collectives():
    """--pp-combined-1f1b (jaxdist/pipeline/step.py operate_both): one micro-batch's forward
    beside another's backward in one computation. In the forward then its own backward
    (FULL: a plain 1F1B tick's F and BACK) most of the forward's collectives sit between
    the matmuls that need them; beside an independent backward (PAIR: a first forward
    that makes the stash, then the pair) XLA:GPU puts a matmul of the other under them."""
    from jaxdist.predict import pipeline as pl

    hidden_f, total_f = _pipeline_op_collectives_hidden(pl.FWD)
    hidden_full, total_full = _pipeline_op_collectives_hidden(pl.FULL)
    hidden_pair, total_pair = _pipeline_op_collectives_hidden(pl.PAIR)
    assert total_pair == total_full + total_f
    # the pair's own collectives (those past the first forward's)
    pair, pair_total = hidden_pair - hidden_f, total_pair - total_f
    assert 2 * pair > pair_total and pair > hidden_full, (hidden_f, hidden_full, hidden_pair)
