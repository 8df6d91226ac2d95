"""Tensor-parallel layouts of the decoder: golden specs from the logical-axis rules, the same
losses as one device, and collectives on the tensor axis."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist.data import TrainStream
from jaxdist.errors import UsageError
from jaxdist.run_record import comm_block
from jaxdist.mesh import MeshShape
from jaxdist.train_step import put_batch
from models import get_model
from sharding import check_layout
from tests.helpers import cli_main, train

MESH = MeshShape(2, 2, 2)
DF = ("data", "fsdp")


def _param_specs(program):
    flat = jax.tree_util.tree_flatten_with_path(program.state_specs["params"],
                                                is_leaf=lambda x: isinstance(x, P))[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path
                     if getattr(k, "key", None) != "value" and not str(k).endswith(".value")): s
            for path, s in flat}


def test_golden_decoder_specs():
    _, _, tp = train("gpt-tiny", "tp", MESH, steps=0)
    _, _, fsdp_tp = train("gpt-tiny", "fsdp_tp", MESH, steps=0)
    got_tp, got_2d = _param_specs(tp), _param_specs(fsdp_tp)
    expect = {  # gpt-tiny: vocab 256, seq 32, width 64, heads 4, mlp 256
        "tok/embedding": (P("tensor", None), P("tensor", DF)),
        "pos/embedding": (P(None, None), P(None, DF)),
        "blocks/0/attn/q/kernel": (P(None, "tensor"), P(DF, "tensor")),
        "blocks/0/attn/q/bias": (P("tensor"), P("tensor")),
        "blocks/0/attn/out/kernel": (P("tensor", None), P("tensor", DF)),
        "blocks/0/attn/out/bias": (P(None), P(DF)),
        "blocks/0/mlp/up/kernel": (P(None, "tensor"), P(DF, "tensor")),
        "blocks/0/mlp/down/kernel": (P("tensor", None), P("tensor", DF)),
        "blocks/1/ln1/scale": (P(None), P(DF)),
        "head/kernel": (P(None, "tensor"), P(DF, "tensor")),
        "head/bias": (P("tensor"), P("tensor")),
    }
    for path, (spec_tp, spec_2d) in expect.items():
        assert got_tp[path] == spec_tp, path
        assert got_2d[path] == spec_2d, path


@pytest.fixture(scope="session")
def single():
    return train("gpt-tiny", "ddp", MeshShape(1), steps=3)[0]


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_tensor_parallel_matches_single_device(layout, single):
    losses = train("gpt-tiny", layout, MESH, steps=3)[0]
    np.testing.assert_allclose(losses, single, rtol=1e-5)


def test_tp_collectives_run_on_the_tensor_axis():
    _, state, program = train("gpt-tiny", "tp", MESH, steps=1)
    batch = put_batch(TrainStream(get_model("gpt-tiny"), None, 16, 0).batch(0),
                      program.batch_sharding)
    block = comm_block("tp", program.step.lower(state, batch).compile(), program)
    on_tensor = block["by_axis"].get("tensor")
    assert on_tensor and on_tensor["count"] >= 4  # >= one all-reduce per attention and MLP
    assert block["by_kind"]["all-reduce"]["count"] >= 4
    # The data-parallel gradient reduction runs over data and fsdp, never mixing in tensor.
    assert "data+fsdp" in block["by_axis"]


def test_bad_combinations():
    with pytest.raises(UsageError, match="applies to gpt, moe models, not 'resnet'"):
        check_layout("tp", {"data": 2, "fsdp": 2, "tensor": 2}, "resnet")
    with pytest.raises(UsageError, match="the mesh has tensor=2"):
        check_layout("hsdp", {"data": 2, "fsdp": 2, "tensor": 2}, "gpt")
    check_layout("tp", {"data": 2, "fsdp": 2, "tensor": 2}, "gpt")  # fine


@pytest.mark.parametrize("layout, sizes, family, suggestion", [
    ("tp", {"data": 4, "fsdp": 8}, "gpt", "--mesh 4x4x2"),
    ("tp", {"data": 1, "fsdp": 1, "tensor": 1}, "gpt", "--mesh 1x1x2"),
    ("fsdp_tp", {"data": 3, "fsdp": 1}, "gpt", "--mesh 3x1x2"),
    ("ep", {"data": 2, "fsdp": 2, "tensor": 2}, "moe", "--mesh 2x1x2x2"),
])
def test_a_layout_without_its_axis_is_an_error(layout, sizes, family, suggestion):
    """tp without a tensor axis and ep without an expert axis would be plain replication
    under the layout's name; the error names the axis and a mesh that has it."""
    axis = "expert" if layout == "ep" else "tensor"
    with pytest.raises(UsageError, match=f"splits over the {axis} axis, which this mesh does "
                                         f"not have .*e.g. {suggestion}$"):
        check_layout(layout, sizes, family)


def test_layout_for_another_family_lists_the_ones_that_fit():
    with pytest.raises(UsageError, match=r"layout 'ep' applies to moe models, not 'gpt' "
                                         r"\(layouts for 'gpt' on this mesh: fsdp_tp, tp\)$"):
        check_layout("ep", {"data": 2, "fsdp": 2, "tensor": 2}, "gpt")


EP_MESH = MeshShape(2, 1, 1, 4)  # data 2 x expert 4


def test_expert_parallel_matches_single_device_and_uses_all_to_all():
    reference = train("moe-tiny", "ddp", MeshShape(1), steps=3)[0]
    losses, state, program = train("moe-tiny", "ep", EP_MESH, steps=3)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # same routing, same loss
    specs = _param_specs(program)
    assert specs["blocks/0/moe/up"] == P("expert", None, None)
    assert specs["blocks/0/moe/down"] == P("expert", None, None)
    assert specs["blocks/0/attn/q/kernel"] == P(None, None)
    batch = put_batch(TrainStream(get_model("moe-tiny"), None, 16, 0).batch(0),
                      program.batch_sharding)
    block = comm_block("ep", program.step.lower(state, batch).compile(), program)
    assert block["by_kind"]["all-to-all"]["count"] >= 2  # tokens to experts and back
    assert "expert" in block["by_axis"]


@pytest.mark.parametrize("impl", ["sorted", "ragged", "dense"])
def test_expert_parallel_with_tensor_is_ep_x_tp(impl):
    """ep on a mesh with `tensor`: Megatron's EP x TP (heads and every expert's hidden over
    tensor), not a replica per tensor device; the same losses as one device, with each MoE
    implementation (models/moe.py: one routing)."""
    reference = train("moe-tiny", "ddp", MeshShape(1), steps=3, moe_impl="dense")[0]
    losses, _, program = train("moe-tiny", "ep", MeshShape(1, 1, 2, 2), steps=3,
                               moe_impl=impl)
    np.testing.assert_allclose(losses[:2], reference[:2], rtol=1e-5)
    # Step 3: TP's partial sums change the last bits of the router's logits, and a near-tie
    # in moe-tiny's top-2 routing can flip (3e-4 here under the suite's XLA flags).
    np.testing.assert_allclose(losses[2], reference[2], rtol=1e-3)
    specs = _param_specs(program)
    assert specs["blocks/0/moe/up"] == P("expert", None, "tensor")
    assert specs["blocks/0/moe/down"] == P("expert", "tensor", None)
    assert specs["blocks/0/attn/q/kernel"] == P(None, "tensor")


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_llama_under_tensor_layouts_matches_single_device(layout):
    """llama (GQA, RoPE, SwiGLU) with its activations pinned by logical axis (fsdp_tp: the
    weights' embed shards gathered, the activations never split over data)."""
    reference = train("llama-tiny", "ddp", MeshShape(1), steps=3)[0]
    np.testing.assert_allclose(train("llama-tiny", layout, MESH, steps=3)[0], reference,
                               rtol=1e-5)


@pytest.mark.parametrize("args, line", [
    (["--mesh", "data:2,tensor:3", "--dry-run"],
     "heads dimension (blocks/attn/k/bias: 64) over tensor=3, which does not divide it; "
     "e.g. --mesh data:2,tensor:2"),
    (["--mesh", "data:2,tensor:4", "--model-opts", "width=42,heads=2", "--steps", "1",
      "--batch-size", "8"],
     "heads dimension (blocks/attn/k/bias: 42) over tensor=4, which does not divide it; "
     "e.g. --mesh data:2,tensor:3"),
])
def test_a_dimension_the_mesh_cannot_split_is_refused(args, line, tmp_path, monkeypatch,
                                                      capsys):
    """fsdp_tp whose tensor axis does not divide the heads dimension (the model's structure,
    never padded; the embed dimension over data is padded instead): in a plan and in a run,
    one line naming the dimension, its size, the axes' product and a mesh that works, exit 2."""
    monkeypatch.chdir(tmp_path)
    # the session's 8 CPU devices stand (no backend re-configuration in this process)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_force_host_platform_device_count=8")
    proc = cli_main(capsys, "--model", "gpt-tiny", "--layout", "fsdp_tp", "--platform", "cpu",
                    *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"run: error: layout 'fsdp_tp' splits the {line}"]
    assert "simulating mesh" not in proc.stdout  # the refusal comes alone, before notices
    assert list(tmp_path.iterdir()) == []
