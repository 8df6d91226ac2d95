"""Communication accounting: replica-group notations, and what each layout's compiled step
actually sends."""

import jax
import pytest

from jaxdist import comm
from jaxdist.data import TrainStream
from jaxdist.loop import comm_block
from jaxdist.mesh import MeshShape
from jaxdist.train_step import put_batch
from models import get_model
from tests.helpers import train


@pytest.mark.parametrize("line, groups", [
    ("x = f32[4] all-reduce(y), replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("x = f32[4] all-gather(y), replica_groups=[2,4]<=[8], dimensions={0}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("x = f32[4] all-gather(y), replica_groups=[4,2]<=[2,4]T(1,0)",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("x = f32[4] all-reduce(y), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("x = f32[4] all-reduce(y), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("x = f32[4] all-gather(y), replica_groups=mesh['axis_0'=4,'axis_1'=2], "
     "device_ids=([2,4]T(1,0)) {'axis_0'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_replica_group_notations(line, groups):
    assert comm.replica_groups(line) == groups


def test_collective_bytes_and_axes():
    hlo = ("%a = (f32[10]{0}, f32[10,64]{1,0}, bf16[8]{0}) all-reduce(%p, %q, %r), "
           "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add\n"
           "%b = f32[2,8]{1,0} reduce-scatter(%s), replica_groups=[2,4]<=[8], dimensions={0}\n"
           "%c = f32[8]{0} all-gather-done(%d)\n")
    ops = comm.collectives(hlo, {"data": 2, "fsdp": 4})
    assert [(o["kind"], o["bytes"], o["axes"]) for o in ops] == [
        ("all-reduce", 40 + 2560 + 16, ["data"]),
        ("reduce-scatter", 64 * 4, ["fsdp"]),  # the operand: 4x the scattered result
    ]
    assert ops[0]["ring_bytes"] == pytest.approx(2616 * 2 * 1 / 2)


def _comm(layout, model="mlp-tiny", shape=MeshShape(2, 4)):
    _, state, program = train(model, layout, shape, steps=1)
    batch = put_batch(TrainStream(get_model(model), None, 16, 0).batch(0),
                      program.batch_sharding)
    compiled = program.step.lower(state, batch).compile()
    return comm_block(layout, compiled, program), program


def test_ddp_is_one_gradient_all_reduce_over_every_device():
    block, program = _comm("ddp")
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(program.abstract_state["params"]))
    assert set(block["by_kind"]) == {"all-reduce"}
    assert block["by_kind"]["all-reduce"]["bytes"] == pytest.approx(grad_bytes, rel=0.01)
    assert set(block["by_axis"]) == {"data+fsdp"}
    assert block["measured_over_analytic"] == pytest.approx(1.0, rel=0.01)


def test_hsdp_talks_within_fsdp_groups_and_across_data():
    block, _ = _comm("hsdp")
    assert "fsdp" in block["by_axis"] and "data" in block["by_axis"]
    assert block["by_axis"]["fsdp"]["bytes"] > 0


def test_collectives_in_the_microbatch_loop_count_every_iteration():
    def tp_block(microbatches):
        _, state, program = train("gpt-tiny", "tp", MeshShape(2, 1, 2), steps=1, batch_size=32,
                                  microbatches=microbatches)
        batch = put_batch(TrainStream(get_model("gpt-tiny"), None, 32, 0).batch(0),
                          program.batch_sharding)
        return comm_block("tp", program.step.lower(state, batch).compile(), program)

    whole, split = tp_block(1), tp_block(4)
    # The tensor-axis all-reduces move activations: 4 slices of a quarter of the rows each
    # send the same bytes in all as one full batch, in 4 times as many collectives.
    assert split["by_axis"]["tensor"]["bytes"] == pytest.approx(
        whole["by_axis"]["tensor"]["bytes"], rel=0.01)
    assert split["by_axis"]["tensor"]["count"] == 4 * whole["by_axis"]["tensor"]["count"]


def test_executions_follow_while_trip_counts():
    hlo = ("%body (p: f32[]) -> f32[] {\n"
           "  %a = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add\n}\n"
           "%add (x: f32[], y: f32[]) -> f32[] {\n}\n"
           "ENTRY %main (p: f32[]) -> f32[] {\n"
           '  %w = (s32[]) while(%t), condition=%cond, body=%body, '
           'backend_config={"known_trip_count":{"n":"3"}}\n'
           "  %b = f32[4]{0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add\n}\n")
    ops = comm.collectives(hlo, {"data": 2})
    assert [(o["bytes"], o["times"]) for o in ops] == [(32 * 3, 3), (16, 1)]
