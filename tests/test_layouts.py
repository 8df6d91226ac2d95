"""Golden PartitionSpecs, and the memory each layout leaves on a device."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist import metrics
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.train_step import build_program, make_optimizer
from models import get_model
from sharding import get_layout, layout_names
from sharding.layouts import shard_dim

ALL = ("data", "fsdp")


def program(layout, shape=MeshShape(2, 4), model="mlp-tiny"):
    mesh = build_mesh(shape, jax.devices()[: shape.size])
    return build_program(get_model(model), "float32", make_optimizer("adamw", 1e-3),
                         get_layout(layout), mesh, seed=0)


def mlp_specs(layout):
    """{path: spec} for the MLP's parameters and Adam's first moment."""
    specs = program(layout).state_specs
    flat = lambda tree: {jax.tree_util.keystr(k): v for k, v in  # noqa: E731
                         jax.tree_util.tree_flatten_with_path(
                             tree, is_leaf=lambda x: isinstance(x, P))[0]}
    adam = specs["opt"][0]  # (ScaleByAdamState, AddDecayedWeights, ScaleByLearningRate)
    return flat(specs["params"]), flat(adam.mu), adam.count


def test_registered_layouts():
    assert layout_names() == ["ddp", "ep", "ep_pp", "fsdp", "fsdp_pp", "fsdp_tp", "hsdp", "pp",
                              "ps", "tp", "tp_pp", "zero1"]


def test_shard_dim_rule():
    assert shard_dim((32, 64), 8) == 1      # largest divisible
    assert shard_dim((64, 10), 8) == 0      # 10 is not divisible
    assert shard_dim((64, 64), 8) == 0      # ties: first
    assert shard_dim((10,), 8) == 0         # padded to 16: 2 a device, not 10
    assert shard_dim((10, 100), 8) == 1     # none divides: the one that pads least (104)
    assert shard_dim((1, 3), 8) == 1
    assert shard_dim((1, 1), 8) is None     # nothing would shrink: replicated
    assert shard_dim((), 8) is None
    assert shard_dim((64,), 1) is None      # one shard: nothing to split


# mlp-tiny: Linear 32->64, 64->64, head 64->10; 8 shards for fsdp, 4 for hsdp.
GOLDEN_FSDP = {
    "['hidden'][0]['kernel']": P(None, ALL), "['hidden'][0]['bias']": P(ALL),
    "['hidden'][1]['kernel']": P(ALL), "['hidden'][1]['bias']": P(ALL),
    "['head']['kernel']": P(ALL), "['head']['bias']": P(ALL),  # 10: stored padded to 16
}
GOLDEN_HSDP = {k: P(*[None if a is None else "fsdp" for a in v]) for k, v in GOLDEN_FSDP.items()}


def _strip(flat):
    """Drop the NNX Variable suffix from key paths: "['head']['bias'].value" -> "['head']['bias']"."""
    return {k.removesuffix(".value"): v for k, v in flat.items()}


@pytest.mark.parametrize("layout, params, mu", [
    ("ddp", {k: P() for k in GOLDEN_FSDP}, {k: P() for k in GOLDEN_FSDP}),
    ("zero1", {k: P() for k in GOLDEN_FSDP}, GOLDEN_FSDP),
    ("fsdp", GOLDEN_FSDP, GOLDEN_FSDP),
    ("hsdp", GOLDEN_HSDP, GOLDEN_HSDP),
])
def test_golden_specs(layout, params, mu):
    got_params, got_mu, count = mlp_specs(layout)
    assert _strip(got_params) == params
    assert _strip(got_mu) == mu
    assert count == P()  # Adam's step count is a scalar: always replicated


def _total_and_replicated(p):
    summary = metrics.sharding_summary(p.abstract_state, p.state_specs)
    return summary["sharded_bytes"] + summary["replicated_bytes"], summary["replicated_bytes"]


@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny"])
def test_state_bytes_per_device(model):
    per_device = {}
    for layout in ("ddp", "fsdp", "hsdp", "zero1"):
        p = program(layout, model=model)
        state = p.init()
        by_device = metrics.state_bytes_by_device(state)
        assert len(by_device) == 8
        per_device[layout] = max(d["bytes"] for d in by_device)
        total, replicated = _total_and_replicated(p)
        if layout == "ddp":
            assert per_device[layout] == total
            assert replicated == total
        if layout == "fsdp":
            assert per_device[layout] <= total / 8 * 1.02 + replicated
            assert per_device[layout] >= total / 8
        if layout == "hsdp":  # 2x4: sharded 4 ways, replicated twice
            assert per_device[layout] <= total / 4 * 1.02 + replicated
            assert per_device[layout] >= total / 4
    # zero1 keeps whole parameters, shards only the optimizer state
    assert per_device["fsdp"] < per_device["hsdp"] < per_device["zero1"] < per_device["ddp"]


# Layouts that would run as another on these meshes: refused, one line, naming a mesh that
# works (the same rule as tp without a tensor axis).
@pytest.mark.parametrize("layout, mesh, says, works", [
    ("hsdp", "8", "layout 'hsdp' splits over the fsdp axis, which this mesh does not have "
                  "(fsdp=1: it would run as plain replication); add one, e.g. --mesh 4x2",
     "4x2"),
    ("hsdp", "2x1", "e.g. --mesh 1x2", "1x2"),
    ("fsdp", "1", "layout 'fsdp' shards over every device, and this mesh has one (it would "
                  "run as a single device with nothing sharded); give it 2 or more, e.g. "
                  "--mesh 2", "2"),
    ("zero1", "1x1", "layout 'zero1' shards over every device, and this mesh has one", "2"),
])
def test_degenerate_layouts_are_refused_naming_a_mesh_that_works(layout, mesh, says, works,
                                                                 capsys, tmp_path):
    from experiments.run import main
    from jaxdist.errors import UsageError
    from jaxdist.mesh import parse_mesh
    from sharding import check_layout

    code = main(["--layout", layout, "--mesh", mesh, "--model", "mlp-tiny",
                 "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "run").exists()
    check_layout(layout, parse_mesh(works).axis_sizes, "mlp")  # the named mesh passes
    with pytest.raises(UsageError):
        check_layout(layout, parse_mesh(mesh).axis_sizes, "mlp")


def test_degenerate_layouts_are_not_listed_as_fitting_and_one_device_ddp_still_runs():
    from jaxdist.errors import UsageError
    from sharding import check_layout

    check_layout("ddp", {"data": 1, "fsdp": 1}, "mlp")  # the single-device baseline
    check_layout("fsdp", {"data": 2, "fsdp": 1}, "mlp")  # shards over data as well
    check_layout("hsdp", {"data": -1, "fsdp": 2}, "mlp")  # -1: counted once devices are
    check_layout("zero1", {"data": -1, "fsdp": 1}, "mlp")
    with pytest.raises(UsageError) as e:  # what the "layouts that fit" list leaves out
        check_layout("tp", {"data": 8, "fsdp": 1}, "mlp")
    assert e.value.args[0].endswith("(layouts for 'mlp' on this mesh: ddp, fsdp, ps, zero1)")
    with pytest.raises(UsageError) as e:
        check_layout("tp", {"data": 1, "fsdp": 1}, "mlp")
    assert e.value.args[0].endswith("(layouts for 'mlp' on this mesh: ddp, ps)")


def test_layout_facts_are_the_registrys():
    """What the rest of jaxdist asks of a layout, answered by its registration alone
    (sharding.registry.LayoutFacts); the names come back in registration order."""
    from sharding.registry import facts, layouts_where

    assert layouts_where(pipelined=True) == ("pp", "tp_pp", "fsdp_pp", "ep_pp")
    assert layouts_where(sequence_parallel=True) == ("tp", "fsdp_tp", "tp_pp")
    assert layouts_where(gathers_weights=True) == ("fsdp", "hsdp", "fsdp_tp")
    assert [n for n in layout_names() if facts(n).tp_comm_chunks != 1] == ["fsdp_tp", "tp"]
    assert sorted(n for n in layout_names() if facts(n).analytic) == [
        "ddp", "fsdp", "hsdp", "zero1"]
    # the hsdp formula on F = 4, D = 2, by hand: 2(F-1)/F x P + 2(D-1)/D x P / F
    assert facts("hsdp").analytic.ring_bytes({"data": 2, "fsdp": 4}, 4096, 4096) == \
        2 * 3 / 4 * 4096 + 2 * 1 / 2 * 4096 / 4
    assert facts("tp").mesh_axes == ("data", "fsdp", "context", "tensor")
