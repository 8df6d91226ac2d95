"""--distributed-optimizer (Megatron's; ZeRO-1 over the data axes, sharding/optimizer.py):
the spec rule, zero1 as ddp with it, the same losses as one device (ddp, tp, ep, tp_pp),
exact state bytes per device (float32: parameters as the layout puts them + optimizer state
/ d; bfloat16: bf16 working weights + float32 master and optimizer state / d), and bad
input refused in one line."""

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxdist import metrics
from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
from jaxdist.data import TrainStream
from jaxdist.mesh import MeshShape, build_mesh, parse_mesh
from jaxdist.pipeline.program import build_pipeline_program
from jaxdist.train_step import abstract_train_state, make_optimizer, put_batch
from models import get_model
from sharding import get_layout
from sharding.optimizer import leaf_over_data
from tests.helpers import cli_main, job_of, train

TX = make_optimizer("adamw", 1e-2)


def _abstract_mesh(sizes: dict) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.values()), tuple(sizes),
                        axis_types=(AxisType.Auto,) * len(sizes))


@pytest.mark.parametrize("shape, spec, mesh, expect", [
    ((64, 256), P(None, "tensor"), {"data": 2, "tensor": 2}, P("data", "tensor")),
    # no whole dimension the data axes divide: the tensor shard is split further
    ((256,), P("tensor"), {"data": 2, "tensor": 2}, P(("tensor", "data"))),
    # an expert's leaf is already on `expert`: only data and fsdp are left for it
    ((4, 32, 64), P("expert"), {"data": 2, "fsdp": 2, "expert": 2},
     P("expert", None, ("data", "fsdp"))),
    # a non-expert leaf under ep: its gradient is averaged over expert too
    ((32, 64), P(), {"data": 2, "expert": 2}, P(None, ("data", "expert"))),
    ((10,), P(), {"data": 4}, P("data")),        # nothing divides: padded to 12
    ((6, 10), P(), {"data": 4}, P(None, "data")),  # the one that pads least (12/10)
    ((6,), P("tensor"), {"data": 4, "tensor": 2}, P("tensor")),  # no whole dim: as it was
    ((), P(), {"data": 4}, P()),                 # step counters
    ((64, 64), P(), {"data": 1, "tensor": 2}, P()),  # no data axis above 1
    ((64, 32), P(), {"data": 2, "stage": 2}, P("data")),  # never over stage
])
def test_spec_rule(shape, spec, mesh, expect):
    assert leaf_over_data(shape, spec, mesh) == expect


def test_zero1_is_ddp_with_the_distributed_optimizer():
    state = abstract_train_state(get_model("mlp-tiny"), "float32", TX)
    mesh = _abstract_mesh({"data": 2, "fsdp": 4})
    zero1, ddp_do = get_layout("zero1"), get_layout("ddp", distributed_optimizer=True)
    assert zero1.fn is ddp_do.fn and zero1.distributed_optimizer
    assert zero1(state, mesh) == ddp_do(state, mesh)
    assert get_layout("ddp")(state, mesh)["opt"] != zero1(state, mesh)["opt"]


@pytest.fixture(scope="module")
def single():
    return {model: train(model, "ddp", MeshShape(1), steps=3)[0]
            for model in ("gpt-tiny", "moe-tiny")}


def _opt_counters(abstract_state) -> int:
    return sum(leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_state["opt"])
               if not leaf.shape)


@pytest.mark.parametrize("layout, model, mesh, d, opts", [
    ("ddp", "gpt-tiny", "4x2", 8, {}),                # zero1: explicit reduce-scatter
    ("tp", "gpt-tiny", "data:2,tensor:2", 2, {"sequence_parallel": True}),
    ("ep", "moe-tiny", "data:2,expert:2", 4, {}),     # non-expert state also over expert
])
def test_same_losses_as_one_device_and_exact_state_bytes(layout, model, mesh, d, opts, single):
    shape = parse_mesh(mesh)
    losses, state, program = train(model, layout, shape, steps=3, distributed_optimizer=True,
                                   **opts)
    np.testing.assert_allclose(losses, single[model], rtol=1e-5)
    sizes = dict(shape.axis_sizes)
    planned = metrics.planned_bytes_per_device(program.abstract_state, program.state_specs,
                                               sizes)
    # parameters as the layout alone puts them (replicated over data) ...
    plain = get_layout(layout)(program.abstract_state, _abstract_mesh(sizes))
    assert planned["params"] == metrics.planned_bytes_per_device(
        program.abstract_state, plain, sizes)["params"]
    # ... and AdamW's two float32 moments at 1/d of the parameters' bytes under the layout
    # (every moe-tiny and gpt-tiny leaf divides), plus the step counter
    expert = "expert" in sizes and layout == "ep"
    if not expert:
        assert planned["opt"] == 2 * planned["params"] // d + _opt_counters(program.abstract_state)
    else:  # expert leaves are split over expert already: over data only
        whole = sum(leaf.size * 4 for leaf in jax.tree.leaves(program.abstract_state["params"]))
        assert planned["opt"] == 2 * whole // d + _opt_counters(program.abstract_state)
    measured = metrics.state_bytes_by_device(state)
    assert {row["bytes"] for row in measured} == {planned["total"]}
    assert metrics.state_bytes_by_part(state) == planned


def test_bfloat16_working_weights_beside_a_sharded_float32_master(single):
    """Megatron with bf16: 2 bytes of working weights replicated over data, 4 of master and
    8 of AdamW over d; the float32 losses to bf16 compute's rounding (1.3e-4 at step 3)."""
    shape = parse_mesh("data:2,tensor:2")
    losses, state, program = train("gpt-tiny", "tp", shape, steps=3, dtype="bfloat16",
                                   distributed_optimizer=True)
    np.testing.assert_allclose(losses, single["gpt-tiny"], rtol=1e-3)
    assert {leaf.dtype.name for leaf in jax.tree.leaves(state["params"])} == {"bfloat16"}
    assert {leaf.dtype.name for leaf in jax.tree.leaves(state["master"])} == {"float32"}
    parts = metrics.state_bytes_by_part(state)
    # master: float32 (2x bf16) over data 2; moments: 2 x float32 over data 2
    assert parts["master"] == parts["params"]
    assert parts["opt"] == 2 * parts["params"] + _opt_counters(program.abstract_state)


def test_tp_pp_same_losses_as_one_device():
    """Interleaved V = 2: chunk 1's gradients are reduce-scattered inside the tick loop
    (between its two scans), chunk 0's after it (jaxdist/pipeline/program.py
    ScatterOverData); the losses are one device's."""
    opts = {"width": 32, "heads": 4, "seq_len": 8, "vocab": 64, "depth": 4}
    reference = train("gpt-tiny", "ddp", MeshShape(1), steps=3, **opts)[0]
    cfg = get_model("gpt-tiny", {k: str(v) for k, v in opts.items()})
    shape = parse_mesh("data:2,stage:2,tensor:2")
    program = build_pipeline_program(cfg, "float32", TX, get_layout("tp_pp", True),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, 2,
                                     "interleaved", virtual=2)
    final = program.schedule.gradients_final()
    assert final[0] == program.schedule.ticks > final[1]  # chunk 1 reduced in the loop
    state, stream, losses = program.init(), TrainStream(cfg, None, 16, 0), []
    for _ in range(3):
        state, loss = program.step(state, put_batch(stream.next(), program.batch_sharding))
        losses.append(float(loss))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    flat = jax.tree_util.tree_flatten_with_path(program.state_specs["opt"][0].mu["stages"],
                                                is_leaf=lambda x: isinstance(x, P))[0]
    q = [s for path, s in flat if "'q'" in jax.tree_util.keystr(path)
         and "kernel" in jax.tree_util.keystr(path)]
    assert q == [P("stage", None, None, "data", "tensor")]  # [S, V, K, embed, heads]


@pytest.mark.parametrize("reduce_dtype, element", [("float32", "f32"), ("bfloat16", "bf16")])
def test_pipeline_reduces_gradients_in_the_reduce_dtype(reduce_dtype, element):
    """tp_pp interleaved with bf16 working weights: every data-axis reduce-scatter of the
    step (ScatterOverData, in the tick loop and after it) takes its operand in the
    --grad-reduce-dtype, read from the lowered program (XLA:CPU would promote bf16
    collectives to float32 when compiling); and the bf16 step compiles and runs on XLA:CPU
    (which aborted on the shared gradients' bf16 sum over stage)."""
    import re

    cfg = get_model("gpt-tiny", {"depth": "4"})
    shape = parse_mesh("data:2,stage:2,tensor:2")
    program = build_pipeline_program(cfg, "bfloat16", TX,
                                     get_layout("tp_pp", True, reduce_dtype),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, 2,
                                     "interleaved", virtual=2)
    batch = put_batch(TrainStream(cfg, None, 16, 0).next(), program.batch_sharding)
    text = program.step.lower(program.abstract_state, batch).as_text()
    operands = re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \(tensor<[\dx]*x(\w+)>\)',
                          text, re.S)
    assert len(operands) >= 2 and set(operands) == {element}
    if reduce_dtype == "bfloat16":  # the smallest such step: pp, one block per stage
        shape = parse_mesh("data:2,stage:2")
        small = build_pipeline_program(get_model("gpt-tiny", {"depth": "2"}), "bfloat16", TX,
                                       get_layout("pp", True, reduce_dtype),
                                       build_mesh(shape, jax.devices()[:shape.size]), 0, 2,
                                       "1f1b")
        _, loss = small.step(small.init(), put_batch(
            TrainStream(cfg, None, 8, 0).next(), small.batch_sharding))
        assert np.isfinite(float(loss))


def test_plan_has_the_master_and_matches_megatrons_bytes_per_parameter():
    """--dry-run: gpt-tiny under tp on data:4,tensor:2 with bf16: per device, params (bf16,
    over tensor) + master (f32, over tensor x data) + opt (2 x f32, likewise)."""
    from jaxdist.plan import shapes

    cfg = RunConfig(mesh=MeshConfig(mesh="data:4,tensor:2"),
                    model=ModelConfig(model="gpt-tiny", dtype="bfloat16"),
                    train=TrainConfig(layout="tp", distributed_optimizer=True))
    typed = shapes.plan(job_of(cfg, parse_mesh("data:4,tensor:2")))
    plan = typed.to_json()
    per = plan["state_bytes_per_device"]
    assert plan["distributed_optimizer"] is True
    assert per["master"] == 2 * per["params"] // 4
    assert per["opt"] - 2 * per["master"] in (4, 8)  # the step counter
    assert "layout tp + distributed optimizer on" in shapes.format_plan(typed)


@pytest.mark.parametrize("args, says", [
    (("--layout", "fsdp", "--mesh", "2x2"), "layout 'fsdp' shards its own"),
    (("--layout", "hsdp", "--mesh", "2x2"), "layout 'hsdp' shards its own"),
    (("--layout", "fsdp_tp", "--mesh", "2x1x2"), "layout 'fsdp_tp' shards its own"),
    (("--layout", "ps", "--mesh", "2x1"), "layout 'ps' shards its own"),
    (("--layout", "tp", "--mesh", "data:1,tensor:2"),
     "all of size 1 on this mesh: it would shard nothing; give data 2 or more, e.g. "
     "--mesh data:2,tensor:2"),
    (("--layout", "tp", "--mesh", "data:2,tensor:2", "--grad-reduce-dtype", "bfloat16"),
     "--grad-reduce-dtype bfloat16 reduces the gradients of bfloat16 working weights beside "
     "a float32 master: it needs --distributed-optimizer and --dtype bfloat16 or float8"),
])
def test_bad_input_is_one_line_exit_2(args, says, capsys, tmp_path):
    done = cli_main(capsys, *args, "--model", "gpt-tiny", "--distributed-optimizer",
                    "--logdir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    if "shards its own" in says:
        assert "(choose from ddp, ep, ep_pp, pp, tp, tp_pp, zero1, or drop the flag)" in done.stderr
    assert not (tmp_path / "run").exists()
