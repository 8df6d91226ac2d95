"""A layout shards what it says on any device count (sharding/padding.py): every registered
layout on awkward device counts (3, 5, 6, 12) with a model whose widths they do not divide
holds at most 1.05 x what its strategy intends per device (the layout's documented
replication included), or refuses in one line; padded FSDP, ZeRO-1 and fsdp_tp train exactly
as one device does."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxdist import metrics
from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape, parse_mesh
from jaxdist.state_shapes import pipeline_planning_state, planning_state
from jaxdist.train_step import make_optimizer
from models import get_model
from sharding import get_layout, layout_names, padding
from sharding.logical import RULES, logical_axes
from sharding.registry import check_layout, facts
from tests.helpers import train

TX = make_optimizer("adamw", 1e-2)
# Widths that 3, 5, 6 and 12 do not divide (1001 = 7 x 11 x 13, 202 = 2 x 101, 808, 404),
# two heads (tensor 2 divides them); depth 60 splits into 2, 3, 5, 6 and 12 stages. Abstract
# shapes only: nothing is allocated.
DECODER = {"vocab": "1001", "seq_len": "8", "depth": "60", "width": "202", "heads": "2"}
MOE = {"vocab": "1001", "seq_len": "8", "depth": "60", "width": "202", "heads": "2",
       "kv_heads": "2", "mlp_hidden": "404", "experts": "2"}


def _mesh(n: int, layout: str) -> dict[str, int]:
    """A mesh of n devices giving the layout's own axes all the devices they can take."""
    half = n // 2 if n % 2 == 0 else None
    by_layout = {
        "ddp": {"data": n}, "zero1": {"data": n}, "ps": {"data": n},
        "fsdp": {"data": 1, "fsdp": n},
        "hsdp": {"data": 2, "fsdp": half} if half else {"data": 1, "fsdp": n},
        "tp": {"data": half, "tensor": 2} if half else {"tensor": n},
        "fsdp_tp": {"fsdp": half, "tensor": 2} if half else {"tensor": n},
        "ep": {"data": half, "expert": 2} if half else {"expert": n},
        "pp": {"data": half, "stage": 2} if half else {"stage": n},
        "tp_pp": {"stage": half, "tensor": 2} if half else {"stage": n},
        "fsdp_pp": {"fsdp": half, "stage": 2} if half else {"stage": n},
        "ep_pp": {"stage": half, "expert": 2} if half else {"stage": n},
    }
    return by_layout[layout]


def _intended(path, leaf, part: str, layout: str, sizes: dict, distributed: bool) -> int:
    """The shard count the strategy intends for one leaf, from its definition (not from the
    specs under test): fsdp splits everything over every device, zero1 the optimizer state,
    the rule layouts each logical dimension over its rule's axes, pipelines blocks over
    stages; --distributed-optimizer adds the data axes to the optimizer state."""
    n = math.prod(sizes.values())
    if not leaf.shape:
        return 1
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    f = facts(layout)
    used: set[str] = set()
    if layout == "zero1":
        used = set(sizes) if part in ("opt", "master") else set()
    elif layout == "fsdp":
        used = set(sizes)
    elif layout == "hsdp":
        used = {"fsdp"}
    elif layout not in ("ddp", "ps"):
        rule = {"tp_pp": "tp", "ep_pp": "ep"}.get(layout, layout)
        for name in (logical_axes(path) or ()) if rule in RULES else ():
            target = RULES[rule].get(name)
            used |= set((target,) if isinstance(target, str) else (target or ()))
        if "stages" in names:
            used.add("stage")
        if layout == "fsdp_pp":
            used.add("fsdp")
    if (distributed or f.distributed_optimizer) and part in ("opt", "master"):
        used |= {a for a in sizes if a not in ("tensor", "stage")}
    return min(n, math.prod(sizes.get(a, 1) for a in used))


def _state(layout: str, sizes: dict, distributed: bool):
    moe = layout in ("ep", "ep_pp")
    model = get_model("moe-tiny" if moe else "gpt-tiny", MOE if moe else DECODER)
    lay = get_layout(layout, distributed)
    master = lay.master_weights("bfloat16")
    if facts(layout).pipelined:
        return pipeline_planning_state(model, "bfloat16", TX, sizes["stage"], 1, master), lay
    return planning_state(model, "bfloat16", TX, master), lay


CASES = [(layout, n, dist) for layout in layout_names() for n in (3, 5, 6, 12)
         for dist in ((False, True) if facts(layout).distributed_optimizer is False
                      else (False,))]


@pytest.mark.parametrize("layout, n, distributed", CASES)
def test_state_per_device_is_what_the_layout_says(layout, n, distributed):
    sizes = _mesh(n, layout)
    family = "moe" if layout in ("ep", "ep_pp") else "gpt"
    try:
        check_layout(layout, sizes, family, distributed)
        state, lay = _state(layout, sizes, distributed)
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes),
                            axis_types=(AxisType.Auto,) * len(sizes))
        specs = lay(state, mesh)
    except UsageError as e:  # a refusal: one line naming the problem
        assert "\n" not in str(e) and str(e)
        return
    stored = padding.storage(state, specs, sizes)
    per_device = metrics.planned_bytes_per_device(stored, specs, sizes)["total"]
    ideal = 0.0
    for part in state:
        for path, leaf in jax.tree_util.tree_flatten_with_path(state[part])[0]:
            nbytes = leaf.size * leaf.dtype.itemsize
            ideal += max(nbytes / _intended(path, leaf, part, layout, sizes, distributed),
                         leaf.dtype.itemsize)
    assert per_device <= 1.05 * ideal, (layout, sizes, per_device, ideal)
    # the stored shapes are what jax.sharding can place: every split dimension divides
    for leaf, spec in zip(jax.tree.leaves(stored),
                          jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        for size, entry in zip(leaf.shape, spec):
            assert size % padding.entry_shards(entry, sizes) == 0


@pytest.fixture(scope="module")
def one_device():
    return train("gpt-tiny", "ddp", MeshShape(1, 1), steps=4, batch_size=12)[0]


def _bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("layout, shape", [
    ("fsdp", MeshShape(1, 6)),    # padded FSDP: gpt-tiny's widths (64, 256) on 6 devices
    ("zero1", MeshShape(6, 1)),   # padded ZeRO-1 (the explicit reduce-scatter)
])
def test_padded_layouts_equal_one_device(layout, shape, one_device):
    losses, state, program = train("gpt-tiny", layout, shape, steps=4, batch_size=12)
    assert np.ptp(one_device) > 1e-2
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    logical, stored = program.logical_state, program.abstract_state
    summary = metrics.sharding_summary(stored, program.state_specs, logical)
    assert summary["padding_bytes"] == _bytes(stored) - _bytes(logical) > 0
    # exact shard bytes, padding included: what the layout intends, within 5%
    intended = (_bytes(logical) / 6 if layout == "fsdp"
                else _bytes(logical["params"]) + _bytes(logical["opt"]) / 6)
    held = metrics.state_bytes_by_device(state)
    assert {d["bytes"] for d in held} == {metrics.planned_bytes_per_device(
        stored, program.state_specs, dict(program.batch_sharding.mesh.shape))["total"]}
    assert held[0]["bytes"] <= 1.05 * intended
    # the padding stays zero through the updates
    for s, a in zip(jax.tree.leaves(state), jax.tree.leaves(logical)):
        if s.shape != a.shape:
            pad = np.array(s)
            pad[tuple(slice(0, k) for k in a.shape)] = 0
            assert not pad.any()


def test_padded_tensor_parallel_with_distributed_optimizer_equals_one_device():
    """tp with the distributed optimizer over data 3: the vocabulary (257) padded over
    tensor, the optimizer state over data (the scattered-gradient path)."""
    ref = train("gpt-tiny", "ddp", MeshShape(1, 1), steps=3, batch_size=12, vocab=257)[0]
    losses, _, program = train("gpt-tiny", "tp", parse_mesh("data:3,tensor:2"), steps=3,
                               batch_size=12, distributed_optimizer=True, vocab=257)
    assert padding.is_padded(program.logical_state, program.abstract_state)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_heads_the_tensor_axis_does_not_divide_are_refused():
    state = planning_state(get_model("gpt-tiny"), "float32", TX)
    mesh = AbstractMesh((3,), ("tensor",), axis_types=(AxisType.Auto,))
    with pytest.raises(UsageError, match=r"splits the heads dimension .* over tensor=3, which "
                                         r"does not divide it"):
        get_layout("tp")(state, mesh)
