"""--dtype float8 (models/fp8.py): the decoders' block matmuls in FP8 on simulated devices:
the step's dots are FP8, training tracks bfloat16, delayed scaling's histories record the
amaxes and resume exactly, and what has no FP8 path is refused."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.checkpoint import Checkpointer
from jaxdist.data import TrainStream
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import fp8, get_model
from sharding import get_layout
from jaxdist.record import RunRecord
from tests.helpers import cli_main, job_of

SHAPE = MeshShape(2, 2)
DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)")


def program_for(model: str, dtype: str, scaling: str = "delayed", layout: str = "fsdp"):
    cfg = get_model(model)
    if dtype == "float8":
        cfg = dataclasses.replace(cfg, fp8=scaling)  # as jaxdist.run_model sets it
    mesh = build_mesh(SHAPE, jax.devices()[: SHAPE.size])
    return cfg, build_program(cfg, dtype, make_optimizer("adamw", 1e-2), get_layout(layout),
                              mesh, 0)


def run(cfg, program, steps, state=None, start=0):
    stream = TrainStream(cfg, None, 16, 0)
    stream.position = start
    state = program.init() if state is None else state
    losses = []
    for _ in range(steps):
        state, loss = program.step(state, put_batch(stream.next(), program.batch_sharding))
        losses.append(float(loss))
    return np.array(losses), state


def dot_types(program, cfg) -> list[tuple[str, str]]:
    batch = put_batch(TrainStream(cfg, None, 16, 0).batch(0), program.batch_sharding)
    text = program.step.lower(program.init(), batch).as_text()
    return [(m.group(1), m.group(2)) for m in DOT.finditer(text)]


def element(t: str) -> str:
    return t.rstrip(">").rsplit("x", 1)[-1]


def e4m3_relative_error(x) -> float:
    """RMS relative error of x quantized to e4m3 with its amax scale (current scaling)."""
    x = jnp.asarray(x, jnp.float32)
    s = fp8.scale_of(fp8.amax(x), fp8.E4M3)
    back = fp8.quantize(x, s, fp8.E4M3).astype(jnp.float32) * s
    return float(jnp.sqrt(jnp.mean((back - x) ** 2) / jnp.mean(x ** 2)))


@pytest.mark.parametrize("model, linears", [("gpt-tiny", 6), ("llama-tiny", 7)])
def test_every_block_matmul_is_fp8_and_training_tracks_bfloat16(model, linears):
    cfg8, p8 = program_for(model, "float8", "current")
    types = dot_types(p8, cfg8)
    fwd = [t for t in types if element(t[0]) == element(t[1]) == "f8E4M3FN"]
    bwd = [t for t in types if "f8E5M2" in (element(t[0]), element(t[1]))]
    # forward: every block's projections (2 blocks); backward: each one's two gradients, the
    # output gradient in e5m2 against an e4m3 operand; the LM head and attention stay bf16
    assert len(fwd) == 2 * linears and len(bwd) == 2 * 2 * linears
    assert all({element(a), element(b)} == {"f8E5M2", "f8E4M3FN"} for a, b in bwd)
    rest = [t for t in types if t not in fwd and t not in bwd]
    assert rest and not any("f8" in a + b for a, b in rest)

    cfg16, p16 = program_for(model, "bfloat16")
    steps = 8
    loss8, _ = run(cfg8, p8, steps)
    loss16, _ = run(cfg16, p16, steps)
    assert not np.array_equal(loss8, loss16)  # FP8 is not bf16 under another name
    # the tolerance: e4m3's own error on this model's first activations (the embeddings a
    # block's first projections read), a relative error the loss may carry
    model_ = cfg16.build(nnx.Rngs(0), jnp.bfloat16)
    x = model_.tok.embedding[...][TrainStream(cfg16, None, 16, 0).batch(0)["tokens"]]
    tol = e4m3_relative_error(x)
    assert 0.01 < tol < 0.1  # 3 mantissa bits: about 2^-4.5 RMS
    np.testing.assert_allclose(loss8, loss16, rtol=tol)
    assert loss8[-1] < loss8[0] - 0.3  # and it learns


def test_delayed_histories_record_each_amax():
    scales = fp8.Fp8Scales("delayed", history=4)
    x = jnp.arange(1.0, 7.0, dtype=jnp.bfloat16).reshape(2, 3) / 8
    w = jnp.linspace(-2.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    g = jnp.full((2, 4), 0.25, jnp.bfloat16)

    graphdef, state = nnx.split(scales)

    def loss_fn(w, model_state, batch):
        m = nnx.merge(graphdef, model_state, copy=True)
        y = m.dot_general(batch, w, (((1,), (0,)), ((), ())))
        return jnp.sum(y.astype(jnp.float32) * g), nnx.state(m)

    step = jax.jit(fp8.value_and_grad(loss_fn))
    (_, state), dw = step(w, state, x)
    (_, state), _ = step(w * 2, state, x * 4)
    m = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(m.x_history[...], [0.75 * 4, 0.75, 0, 0])
    np.testing.assert_array_equal(m.w_history[...], [4.0, 2.0, 0, 0])
    # the output gradient's amax, from the backward: 0.25 both steps
    np.testing.assert_array_equal(m.g_history[...], [0.25, 0.25, 0, 0])
    # step 1 ran with scale 1 (empty histories): x/8 and w in e4m3 are exact here, so the
    # weight gradient is x^T g to e5m2's rounding of g (0.25: exact)
    np.testing.assert_allclose(dw, np.asarray(x, np.float32).T @ np.asarray(g, np.float32),
                               rtol=2 ** -4)


def test_delayed_scaling_resumes_exactly(tmp_path):
    cfg, program = program_for("llama-tiny", "float8", "delayed")
    _, state3 = run(cfg, program, 2)
    ms = jax.tree.leaves(state3["model_state"])
    # 2 steps: 2 amaxes in every history, newest first, the rest empty
    assert len(ms) == 2 * 7 * 3 and all(
        np.all(np.asarray(h)[:2] > 0) and not np.asarray(h)[2:].any() for h in ms)
    meta = {"model": "llama-tiny", "model_opts": "", "dataset": "synthetic",
            "optimizer": "adamw", "dtype": "float8"}
    ck = Checkpointer(str(tmp_path), 1, meta)
    ck.maybe_save(2, state3, data_position=2)
    ck.finish()
    restored, _ = Checkpointer(str(tmp_path), 0, meta).restore(
        2, program.abstract_state, program.state_shardings)
    for a, b in zip(jax.tree.leaves(state3), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    on, state_on = run(cfg, program, 2, state3, start=2)
    resumed, state_resumed = run(cfg, program, 2, restored, start=2)
    np.testing.assert_array_equal(on, resumed)
    for a, b in zip(jax.tree.leaves(state_on["model_state"]),
                    jax.tree.leaves(state_resumed["model_state"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("args, says", [
    (("--model", "mlp-tiny"), "'mlp-tiny' has no FP8 path"),
    (("--model", "resnet18", "--mesh", "1x1"), "'resnet18' has no FP8 path"),
    (("--layout", "ps", "--mesh", "2x1"), "not --layout ps"),
    (("--layout", "tp_pp", "--mesh", "data:1,stage:2,tensor:2", "--microbatches", "2"),
     "use --fp8-scaling current"),
])
def test_no_fp8_path_is_one_line(tmp_path, capsys, args, says):
    out = cli_main(capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--dtype", "float8",
                   *args, "--logdir", str(tmp_path / "r"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr
    assert not (tmp_path / "r").exists()


def test_run_records_dtype_and_scaling_and_resumes_only_its_scaling(tmp_path, capsys):
    from jaxdist.writers import run_hparams
    args = ("--model", "gpt-tiny", "--mesh", "2x4", "--dtype", "float8", "--steps", "2",
            "--warmup", "1", "--checkpoint-dir", str(tmp_path / "ck"))
    out = cli_main(capsys, *args, "--fp8-scaling", "current", "--checkpoint-every", "1",
                   "--logdir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    results = RunRecord.load(tmp_path / "r").results
    model = results["config"]["model"]
    assert (model["dtype"], model["fp8_scaling"]) == ("float8", "current")
    assert results["mfu"]["peak_basis"] == "bfloat16"
    hp = run_hparams(results)
    assert hp["dtype"] == "float8 (current)"  # one HParams column tells FP8 runs apart
    # delayed scaling's state is not current scaling's: its checkpoint is another run's
    other = cli_main(capsys, *args, "--fp8-scaling", "delayed", "--resume",
                     "--logdir", str(tmp_path / "d"))
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "'float8 (current scaling)' vs 'float8 (delayed scaling)'" in other.stderr


def test_fp8_gemms_run_at_the_parts_measured_fp8_rate_and_mfu_at_bf16s(monkeypatch):
    from jaxdist.hardware import get_hardware
    from jaxdist.parts import NAMED
    from jaxdist.predict.kernels_time import Rates
    h100 = get_hardware("h100-sxm")
    rates = Rates(h100)
    # the measured FP8 MAMF (1402.6 TFLOP/s, 70.9% of the 1979 peak) at the kernel
    # efficiency that scales the measured bf16 one (794.5, 80.3% of 989.5): FP8 GEMMs gain
    # 1.77x, not the peaks' 2x
    assert rates.gemm("float8", "default") / rates.gemm("bfloat16", "default") == \
        pytest.approx(1402.6 / 794.5)
    assert "FP8 (float8_e4m3fn)" in rates.sources["gemm_float8"]
    assert h100.peak_flops("float8") == h100.peak_flops("bfloat16") == 989.5e12
    # without a measured FP8 rate: bf16's fraction of the FP8 peak
    monkeypatch.delitem(NAMED["h100-sxm"].rates, ("gemm", "float8"))
    r = Rates(h100)
    assert r.gemm("float8", "default") == pytest.approx(r.gemm("bfloat16", "default") *
                                                        1979e12 / 989.5e12)
    assert "gemm_float8" not in r.sources
    assert get_hardware("a100-sxm-80gb").peak_flops("float8") is None


def test_fp8_plan_on_a_part_without_fp8_is_one_line(tmp_path, capsys):
    out = cli_main(capsys, "--model", "gpt-tiny", "--mesh", "8", "--dtype", "float8",
                   "--dry-run", "--hardware", "a100-sxm-80gb", "--logdir", str(tmp_path / "p"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "a100-sxm-80gb has no FP8 rate" in lines[0], out.stderr
    assert "h100-sxm" in lines[0] and not (tmp_path / "p").exists()


def test_xla_gpu_program_for_8_h100_has_an_fp8_gemm_for_every_block_matmul():
    from collections import Counter

    from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
    from jaxdist.hardware import get_hardware
    from jaxdist.mesh import parse_mesh
    from jaxdist.program import compiled, kernels
    if compiled.gpu_compiler_missing() is not None:
        pytest.skip(str(compiled.gpu_compiler_missing()))
    cfg = RunConfig(mesh=MeshConfig(mesh="8"),
                    model=ModelConfig(model="gpt-tiny", dtype="float8"),
                    train=TrainConfig(layout="fsdp", batch_size=16))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    _, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    gemms = Counter(item.dtype for items in kernels.schedule(comp.as_text()).values()
                    for item in items if item.item == "kernel" and "gemm" in item.kind)
    # q, k, v, out, up, down in 2 blocks: each one forward GEMM and two backward (input and
    # weight gradients), all FP8; the LM head's and the attention's stay bf16
    assert gemms["float8"] == 3 * 2 * 6
    assert gemms["bfloat16"] > 0


def test_moe_experts_gemms_are_fp8():
    cfg, program = program_for("moe-tiny", "float8", "delayed")
    types = dot_types(program, cfg)
    fwd = [t for t in types if element(t[0]) == element(t[1]) == "f8E4M3FN"]
    bwd = [t for t in types if "f8E5M2" in (element(t[0]), element(t[1]))]
    # 2 blocks x (q, k, v, out and the experts' gate, up, down): forward, then 2 gradients
    assert (len(fwd), len(bwd)) == (2 * 7, 2 * 2 * 7)


def test_memory_estimate_keeps_fp8_copies_and_counts_the_scaling_state():
    from jaxdist.predict.memory import saved_residuals
    from jaxdist.train_step import abstract_train_state
    cfg = dataclasses.replace(get_model("llama-tiny"), fp8="delayed")
    dtypes = {r["dtype"] for r in saved_residuals(cfg, "float8", 4)}
    # what the backward keeps of each block matmul: its e4m3 operands (Transformer Engine's
    # FP8 copies), one byte an element, beside the bf16 values of everything else
    assert "float8_e4m3fn" in dtypes and "bfloat16" in dtypes
    state = abstract_train_state(cfg, "float8", make_optimizer("adamw", 1e-3))
    histories = jax.tree.leaves(state["model_state"])
    # 2 blocks x 7 matmuls x (input, weight, output gradient) x 1024 float32 amaxes
    assert sum(h.size * h.dtype.itemsize for h in histories) == 2 * 7 * 3 * 1024 * 4


@pytest.mark.parametrize("layout, mesh, tensor", [("pp", "stage:2", 1),
                                                  ("tp_pp", "stage:2,tensor:2", 2)])
def test_pipeline_quantizes_each_weight_once_per_step(monkeypatch, layout, mesh, tensor):
    """A pipeline step quantizes its chunks' FP8 weights once, before the tick loop
    (Transformer Engine's FP8 weight cache): in the compiled step every weight-shaped e4m3
    convert runs once per step, one per FP8 matmul of the stage (each device's shard), none
    inside the loop, and the loop carries one FP8 copy of each weight, no stash slot of
    one. Under sequence parallelism (tp_pp) each tensor device quantizes its own shards by
    their own amax, as its forward did: the losses are bit-for-bit those of quantizing every
    weight at every micro-batch's forward (the same tensors), which the step runs when the
    chunks are given no FP8 weights (kept to tp_pp's case, whose copies are the subtler)."""
    from jaxdist.mesh import parse_mesh
    from jaxdist.pipeline.parts import Parts
    from jaxdist.pipeline.program import build_pipeline_program
    from jaxdist.program import hlo

    opts = {"width": "32", "heads": "4", "seq_len": "8", "vocab": "64", "depth": "2"}
    cfg = dataclasses.replace(get_model("gpt-tiny", opts), fp8="current",
                              sequence_parallel=tensor > 1)
    shape = parse_mesh(mesh)
    stream = TrainStream(cfg, None, 16, 0)
    initial = {}

    def compiled():
        program = build_pipeline_program(cfg, "float8", make_optimizer("adamw", 1e-2),
                                         get_layout(layout),
                                         build_mesh(shape, jax.devices()[:shape.size]), 0, 4,
                                         "1f1b", 1)
        state = program.abstract_state
        if tensor > 1:  # run: one initial state on the host for both programs (donated)
            initial.setdefault("state", jax.device_get(program.init()))
            state = jax.device_put(initial["state"], program.state_shardings)
        batch = put_batch(stream.batch(0), program.batch_sharding)
        return program, state, program.step.lower(state, batch).compile()

    def losses(program, state, step):
        out = []
        for i in range(2):
            state, loss = step(state, put_batch(stream.batch(i), program.batch_sharding))
            out.append(float(loss))
        return np.array(out)

    program, state, step = compiled()
    text = step.as_text()
    # the block's FP8 matmuls' weights: q, k, v, out, up, down ([S, V, K, in, out] leaves),
    # each device's shard (tensor-parallel: heads and MLP columns over tensor)
    stages = jax.tree.leaves(program.abstract_state["params"]["stages"])
    sharded = jax.tree.leaves(program.state_shardings["params"]["stages"])
    weights = sorted(sh.shard_shape(x.shape)[-2:] for x, sh in zip(stages, sharded)
                     if x.ndim == 5)
    assert len(weights) == 6
    runs = hlo.executions(text)
    quantized = [(ins.result.dims[-2:], runs.get(ins.computation, 0))
                 for ins in hlo.typed(text) if ins.op == "convert"
                 and ins.result.dtype == "f8e4m3fn" and ins.result.dims[-2:] in weights]
    assert sorted(q for q, _ in quantized) == weights and {n for _, n in quantized} == {1}
    carried = [a for ins in hlo.typed(text) if ins.op == "while"
               for a in hlo.arrays(ins.shape)
               if a.dtype == "f8e4m3fn" and a.dims[-2:] in weights]
    assert sorted(a.dims for a in carried) == sorted((1, 1, *w) for w in weights)
    if tensor == 1:
        return

    once = losses(program, state, step)
    monkeypatch.setattr(Parts, "fp8_weights", lambda self, stacked: {})
    every = losses(*compiled())
    np.testing.assert_array_equal(once, every)
