"""Communication accounting: replica-group notations, XLA:GPU's async and combined
collective forms (real HLO text in tests/fixtures/hlo_gpu), the analytic volumes, and what
each layout's compiled step actually sends."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxdist.program import comm, hlo
from jaxdist.data import TrainStream
from jaxdist.run_record import comm_block
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
    block, program = _comm("hsdp")
    # the model's parameter bytes (the head's 10-wide bias is stored padded to 12)
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(program.logical_state["params"]))
    # Gradient shards cross the 2 groups on 'data'; activations and the gradients of the
    # leaves too small to shard move inside a group ('fsdp') or across all devices.
    assert set(block["by_axis"]) == {"fsdp", "data", "data+fsdp"}
    # F = 4, D = 2, worked by hand: 2(F-1)/F x P inside a group + 2(D-1)/D x P/F across.
    assert block["analytic_ring_bytes"] == 2 * 3 / 4 * param_bytes + 2 * 1 / 2 * param_bytes / 4
    assert block["analytic_basis"] == comm.analytic_basis("hsdp") and "inside an fsdp group" in block["analytic_basis"]


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



def test_a_programs_text_is_parsed_once_by_all_its_readers(monkeypatch):
    """Collectives, kernels, conditionals, executions and while trip counts of one program
    share one parse (hlo.reading); a new text is parsed anew."""
    from jaxdist.program import kernels
    text = ("%body (p: f32[]) -> f32[] {\n"
            "  %a = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add\n}\n"
            "%add (x: f32[], y: f32[]) -> f32[] {\n}\n"
            "ENTRY %main (p: f32[]) -> f32[] {\n"
            '  %w = (s32[]) while(%t), condition=%cond, body=%body, '
            'backend_config={"known_trip_count":{"n":"5"}}\n}\n')
    parses = []
    real = hlo._statements
    monkeypatch.setattr(hlo, "_statements", lambda t: parses.append(t) or real(t))
    hlo.reading.cache_clear()
    ops = comm.collectives(text, {"data": 2})
    kernels.inventory(text)
    assert hlo.conditionals(text) == [] and hlo.entry_computation(text) == "main"
    assert hlo.executions(text)["body"] == 5 and [o["times"] for o in ops] == [5]
    assert hlo.while_trip_counts(text) == {"entry": [5], "nested": []}
    assert len(parses) == 1
    comm.collectives(text.replace('"5"', '"6"'), {"data": 2})
    assert len(parses) == 2

@pytest.mark.parametrize("layout, mesh, expected", [
    # P = 4096 parameter bytes; N devices; F = the fsdp axis, D = N / F. Worked by hand.
    ("ddp", {"data": 2, "fsdp": 4}, 2 * 7 / 8 * 4096),                      # 7168
    ("zero1", {"data": 2, "fsdp": 4}, 7 / 8 * 4096 + 7 / 8 * 4096),        # 7168
    ("fsdp", {"data": 2, "fsdp": 4}, 7 / 8 * 4096 + 7 / 8 * 4096),         # 7168
    ("hsdp", {"data": 2, "fsdp": 4}, 2 * 3 / 4 * 4096 + 2 * 1 / 2 * 1024),  # 6144 + 1024
    ("hsdp", {"data": 8, "fsdp": 1}, 0 + 2 * 7 / 8 * 4096),                # no fsdp group
    ("ddp", {"data": 1, "fsdp": 1}, 0.0),
    ("tp", {"data": 2, "tensor": 4}, None),
])
def test_analytic_ring_bytes_per_layout(layout, mesh, expected):
    assert comm.analytic_ring_bytes(layout, mesh, 4096) == expected


def test_analytic_basis_says_zero1_is_the_papers_reduce_scatter_and_all_gather():
    assert "the ZeRO paper's 2(N-1)/N" in comm.analytic_basis("zero1")
    # bf16 working weights: float32 gradients scattered, bf16 parameters gathered
    assert comm.analytic_ring_bytes("zero1", {"data": 8}, 2048, grad_bytes=4096) == \
        7 / 8 * (4096 + 2048)
    assert comm.analytic_basis("tp") == "no analytic formula for layout 'tp'"


FIXTURES = Path(__file__).parent / "fixtures" / "hlo_gpu"


def _gpu_hlo(name: str) -> str:
    """A fixture's HLO text without its `#` provenance header."""
    text = (FIXTURES / f"{name}.hlo").read_text()
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


# Real XLA:GPU HLO, one async/combined form per fixture (sources in each file's header):
# (kind, bytes per step, times, group size, mesh axes) for every collective.
@pytest.mark.parametrize("fixture, mesh, expected", [
    ("all_reduce_start", {"data": 2, "fsdp": 4},
     [("all-reduce", 32768 * 4, 1, 8, ["data", "fsdp"])]),
    ("all_reduce_start_combined", {"data": 2, "fsdp": 2},
     [("all-reduce", 2 * 2 * 3 * 4, 1, 4, ["data", "fsdp"])]),
    # The gathered results, both arrays (not the second operand only, 2048).
    ("all_gather_start_combined", {"fsdp": 4},
     [("all-gather", (4096 + 2048) * 4, 1, 4, ["fsdp"])]),
    # async-start ((operands), result) + calls=: the wrapped tuple reduce-scatter, once.
    ("reduce_scatter_async_start", {"fsdp": 4},
     [("reduce-scatter", (4096 + 2048) * 4, 1, 4, ["fsdp"])]),
    # async-done naming the wrapped computation too (not counted twice, 64).
    ("reduce_scatter_async_done_calls", {"data": 2},
     [("reduce-scatter", 8 * 4, 1, 2, ["data"])]),
    # reduce-scatter-start ((operand), result): the operand (not (n+1)x, 48).
    ("reduce_scatter_start", {"fsdp": 2},
     [("reduce-scatter", 4 * 4, 1, 2, ["fsdp"])]),
    ("all_to_all_async_start", {"data": 2, "fsdp": 4},
     [("all-to-all", 4 * 8 * 128 * 4, 1, 8, ["data", "fsdp"])]),
    # all-to-all-start ((operand), result) from a JAX GPU dump (not twice the bytes).
    ("all_to_all_start", {"z": 2, "y": 4},
     [("all-to-all", 128 * 64 * 256 * 8, 1, 2, ["z"]),
      ("all-to-all", 64 * 128 * 256 * 8, 1, 4, ["y"])]),
    # Pairs {i, i+8} cross only 'data' (not every axis); 8 of the 16 devices send, so a
    # device sends half the array on average.
    ("collective_permute_start", {"data": 2, "fsdp": 8},
     [("collective-permute", 262144 * 1024 * 4 * 8 // 16, 1, 16, ["data"])]),
    # Four arrays; pairs 0->2->4, 1->3->5 step along 'data' (not one array on every axis);
    # 4 of the 8 devices send.
    ("collective_permute_start_combined", {"data": 4, "tensor": 2},
     [("collective-permute", 4 * 2 * 128 * 4 * 4 // 8, 1, 6, ["data"])]),
])
def test_xla_gpu_async_and_combined_collectives_count_once(fixture, mesh, expected):
    ops = comm.collectives(_gpu_hlo(fixture), mesh)
    assert [(o["kind"], o["bytes"], o["times"], o["group_size"], o["axes"])
            for o in ops] == expected
    summary = comm.summarize(ops)
    assert summary.total_bytes == sum(e[1] for e in expected)
    assert sum(k["count"] for k in summary.by_kind.values()) == len(expected)


def test_async_start_in_a_loop_counts_each_iteration_once():
    # reduce_scatter_async_start's module with its async pair moved into a while body that
    # runs 3 times: the wrapped reduce-scatter runs 3 times, not 3 per async op.
    hlo = _gpu_hlo("reduce_scatter_async_done_calls").replace(
        "ENTRY main (data: u32[8]) -> u32[4] {", "body (data: u32[8]) -> u32[4] {") + (
        "\nENTRY e (p: u32[8]) -> u32[4] {\n"
        '  w = u32[4] while(p), condition=c, body=body, '
        'backend_config={"known_trip_count":{"n":"3"}}\n}\n')
    ops = comm.collectives(hlo, {"data": 2})
    assert [(o["kind"], o["bytes"], o["times"]) for o in ops] == [("reduce-scatter", 96, 3)]


def test_conditional_branches_in_a_loop_are_weighed_or_marked_upper_bounds():
    """A psum in each branch of a lax.switch inside a 6-step scan, compiled for real: XLA
    cannot say how often each branch runs, so without weights each counts as running every
    time (marked upper bound); with the caller's weights, exactly those."""
    from functools import partial

    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    def f(x_B, which_T):
        def small(v):  # sums 1 float32 over the group
            return v + jax.lax.psum(v[:1], "data")

        def big(v):  # sums 16 float32 (v's 4, tiled 4 times)
            return v + jax.lax.psum(jnp.tile(v, 4), "data")[:v.size]

        def tick(x, k):
            return jax.lax.switch(k, [small, big], x), None
        return jax.lax.scan(tick, x_B, which_T)[0]

    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    which = jax.ShapeDtypeStruct((6,), jnp.int32, sharding=NamedSharding(mesh, P()))
    hlo_text = f.lower(x, which).compile().as_text()
    conds = hlo.conditionals(hlo_text)
    assert len(conds) == 1 and len(conds[0][1]) == 2
    small_branch, big_branch = conds[0][1]
    guessed = comm.collectives(hlo_text, {"data": 2})
    assert sorted((o["bytes"], o["times"], o["upper_bound"]) for o in guessed) == [
        (4 * 6, 6, True), (4 * 16 * 6, 6, True)]
    assert comm.summarize(guessed).upper_bound_note.startswith("upper bound for all-reduce")
    weighed = comm.collectives(hlo_text, {"data": 2}, {small_branch: 2, big_branch: 4})
    assert sorted((o["bytes"], o["times"], o["upper_bound"]) for o in weighed) == [
        (4 * 2, 2, False), (4 * 16 * 4, 4, False)]
    assert comm.summarize(weighed).upper_bound_note is None


def test_typed_instructions_read_every_attribute_once():
    """hlo.typed: result arrays with dtypes (tuples nested), operands, replica groups in the
    listed and iota forms, called computations and op_name, one record per instruction."""
    text = ("%add (x: f32[], y: f32[]) -> f32[] {\n}\n"
            "ENTRY %main (p: bf16[4,8]) -> f32[] {\n"
            "  %p = bf16[4,8]{1,0} parameter(0)\n"
            "  %q = s4[6]{0} parameter(1)\n"
            "  %r = ((bf16[4,8]{1,0}, f8e4m3fn[3]{0}), u32[]) all-reduce-start(%p, %q), "
            "replica_groups={{0,1},{2,3}}, to_apply=%add, "
            'metadata={op_name="jit(step)/transpose(jvp(block_0))/dot_general"}\n'
            "  %g = f32[16,8]{1,0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}\n"
            "  ROOT %f = f32[] fusion(%g), kind=kLoop, calls=%add\n}\n")
    p, q, r, g, f = hlo.typed(text)
    assert hlo.typed(text) is hlo.typed(text)
    assert (p.name, p.op, p.computation, p.results) == (
        "p", "parameter", "main", (hlo.Array("bf16", (4, 8)),))
    assert p.results[0].bytes == 64 and q.results[0].bytes == 3 and q.results[0].bits == 24
    assert r.result == ((hlo.Array("bf16", (4, 8)), hlo.Array("f8e4m3fn", (3,))),
                        hlo.Array("u32", ()))
    assert [a.bytes for a in r.results] == [64, 3, 4]
    assert (r.operands, r.operand_count, r.collective) == (("p", "q"), 2, "all-reduce")
    assert r.replica_groups == [[0, 1], [2, 3]] and r.calls() == ["add"]
    assert r.op_name == "jit(step)/transpose(jvp(block_0))/dot_general"
    assert g.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and g.op_name is None
    assert g.dims_attributes == {} and g.collective == "all-gather"
    assert (f.root, f.calls("calls"), f.calls("to_apply"), f.collective) == (
        True, ["add"], [], None)
    assert hlo.ring_factor("all-reduce", 4) == 1.5 and hlo.ring_factor("all-gather", 4) == 0.75
    assert hlo.ring_factor("collective-permute", 4) == 1.0 and hlo.ring_factor("all-reduce", 1) == 0
