"""The pipeline equivalence matrix: pp, tp_pp and fsdp_pp x gpt and llama x gpipe, 1f1b and
interleaved (V = 2) x S in {2, 4} x M in {S, 2S}, each equal to one device's loss over 3
steps (rtol 1e-5): 72 compiled pipeline programs, 9 of them in `make test` (one per layout
and schedule, in_default_suite says which). Each also checks the stage-to-stage bytes read
from its compiled HLO against the analytic volume, and pp's per-stage parameters.

Kept cheap (the suite has 16 minutes on 2 cores): the smallest dimensions that still
exercise every part (grouped-query attention, tensor-parallel heads, vocabulary and MLP over
tensor:2, fsdp-sharded leaves), depth = S x V (one block per chunk); one single-device
reference per (model, depth); the initial pipeline state computed once per (model, S, V)
and placed with each layout's shardings instead of a compiled init per case. The step
itself compiles one tick whatever S and M (jaxdist/pipeline/step.py)."""

import os

import jax
import numpy as np
import pytest

from jaxdist.data import TrainStream
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.pipeline.parts import split_pipeline_model
from jaxdist.pipeline.program import build_pipeline_program
from jaxdist.program import comm
from jaxdist.pipeline.report import (local_activation_bytes, stage_param_bytes, stage_sends,
                                    switch_runs)
from jaxdist.train_step import make_optimizer, put_batch
from models import get_model
from sharding import get_layout
from tests.helpers import train

BATCH, STEPS = 16, 3
# Width 32 in 4 heads (llama: 2 kv heads, so tensor:2 splits both), 8 tokens of a 64-word
# vocabulary: every matrix still divides over tensor:2 and fsdp:2.
OPTS = {"gpt-tiny": {"width": 32, "heads": 4, "seq_len": 8, "vocab": 64},
        "llama-tiny": {"width": 32, "heads": 4, "kv_heads": 2, "mlp_hidden": 64,
                       "seq_len": 8, "vocab": 64},
        "moe-tiny": {"width": 32, "heads": 4, "kv_heads": 2, "mlp_hidden": 32, "experts": 4,
                     "seq_len": 8, "vocab": 64}}
MESHES = {"pp": "data:2,stage:{S}", "tp_pp": "stage:{S},tensor:2", "fsdp_pp": "fsdp:2,stage:{S}"}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
MODELS = ("gpt-tiny", "llama-tiny")

CASES = [(model, layout, schedule, V, S, M)
         for model in MODELS for layout in MESHES for schedule, V in SCHEDULES
         for S in (2, 4) for M in (S, 2 * S)]
LAYOUTS, NAMES = list(MESHES), [name for name, _ in SCHEDULES]


def in_default_suite(model, layout, schedule, V, S, M) -> bool:
    """An eighth of the matrix runs in `make test` (the whole suite has 16 minutes on 2
    cores): one case per (layout, schedule), laid out as a 3 x 3 grid of layouts by
    schedules whose three diagonals d = (schedule - layout) mod 3 pick S and M: d = 0 runs
    S = 4, M = 2S; d = 1 S = 2, M = 2S; d = 2 S = 2, M = S. llama-tiny takes the cells where
    layout + schedule = 0 mod 3 (one per layout and per schedule, one on each diagonal),
    gpt-tiny the other six. So every layout and every schedule meets both models, both S
    and both M = S, 2S, and each model meets both S and both M. (S = 4 with M = S runs in
    test_zb_h1_equals_single_device.) JAXDIST_PP_MATRIX=full runs all 72 (they passed at
    the commit that added this file)."""
    row, col = LAYOUTS.index(layout), NAMES.index(schedule)
    d = (col - row) % 3
    if (S, M == 2 * S) != ((4, True), (2, True), (2, False))[d]:
        return False
    return model == MODELS[(row + col) % 3 == 0]


FULL = os.environ.get("JAXDIST_PP_MATRIX") == "full"
# Under `make test -n 2 --dist loadgroup` one worker takes each model's cases, so each
# worker builds only its model's three references.
PARAMS = [pytest.param(*case, marks=[pytest.mark.xdist_group(f"pp-matrix-{case[0]}")] + (
    [] if FULL or in_default_suite(*case) else [pytest.mark.skip(
        reason="the rest of the matrix: JAXDIST_PP_MATRIX=full runs it")]))
    for case in CASES]
_TX = make_optimizer("adamw", 1e-2)
_REFERENCE, _INITIAL = {}, {}


def _cfg(model, depth, **extra):
    return get_model(model, {k: str(v) for k, v in {**OPTS[model], "depth": depth,
                                                     **extra}.items()})


def _reference(model, depth, microbatches=1):
    key = (model, depth, microbatches)
    if key not in _REFERENCE:
        _REFERENCE[key] = train(model, "ddp", parse_mesh("1"), steps=STEPS, batch_size=BATCH,
                                microbatches=microbatches, depth=depth, **OPTS[model])[0]
    return _REFERENCE[key]


def _initial(program, cfg, S, V, stage_blocks=()):
    """The initial pipeline state (what program.init() makes), built eagerly once per
    (model, S, V, stage blocks) instead of compiled per case, and placed with this
    program's shardings (the layouts differ only in placement)."""
    key = (cfg, S, V, stage_blocks)
    if key not in _INITIAL:
        _, params = split_pipeline_model(cfg, "float32", 0, S, V, stage_blocks)
        # on the host: the step donates its state, so each case needs its own device copy
        _INITIAL[key] = jax.device_get({"params": params, "model_state": {},
                                        "opt": _TX.init(params)})
    return jax.device_put(_INITIAL[key], program.state_shardings)


def test_matrix_has_every_case():
    assert len(CASES) == 72 == len(set(CASES))
    default = [c for c in CASES if in_default_suite(*c)]
    assert len(default) == 9 == len({(c[1], c[2]) for c in default})
    # every layout and every schedule with both models, both S and both M = S, 2S
    for where in (lambda c: c[1], lambda c: c[2]):
        for pick in (lambda c: c[0], lambda c: c[4], lambda c: c[5] == c[4]):
            assert len({(where(c), pick(c)) for c in default}) == 3 * 2
    # each model at both S and both M = S, 2S
    for pick in (lambda c: c[4], lambda c: c[5] == c[4]):
        assert len({(c[0], pick(c)) for c in default}) == 2 * 2


@pytest.mark.parametrize("model,layout,schedule,V,S,M", PARAMS)
def test_pipeline_matrix_equals_single_device(model, layout, schedule, V, S, M):
    _check_case(model, layout, MESHES[layout].format(S=S), schedule, V, S, M,
                _reference(model, S * V))


# MoE: the balance loss is a mean over a micro-batch's tokens, so the reference is one
# device accumulating the same M micro-batches (rows m, m+M, ...); data stays 1 (a data
# shard would average its own rows only: refused, tests/test_pipeline.py).
@pytest.mark.parametrize("layout,mesh,schedule,V", [
    ("pp", "stage:2", "1f1b", 1), ("tp_pp", "stage:2,tensor:2", "gpipe", 1),
    ("fsdp_pp", "fsdp:2,stage:2", "interleaved", 2),
    ("ep_pp", "stage:2,expert:2", "1f1b", 1),
    ("ep_pp", "stage:2,expert:2", "interleaved", 2)])
def test_moe_pipeline_equals_single_device_microbatched(layout, mesh, schedule, V):
    _check_case("moe-tiny", layout, mesh, schedule, V, 2, 2,
                _reference("moe-tiny", 2 * V, microbatches=2))


# ZB-H1 (backward split into B and W): every layout once, both models, S in {2, 4}.
@pytest.mark.parametrize("model,layout,S,M", [
    ("gpt-tiny", "pp", 2, 4), ("llama-tiny", "tp_pp", 4, 4), ("gpt-tiny", "fsdp_pp", 4, 8)])
def test_zb_h1_equals_single_device(model, layout, S, M):
    _check_case(model, layout, MESHES[layout].format(S=S), "zb-h1", 1, S, M,
                _reference(model, S))


# Combined 1F1B (--pp-combined-1f1b): a tick's F and BACK as one computation; both
# schedules that have it, each model, a tensor axis inside the stages (uneven stages under
# combined ticks: tests/test_pipeline.py, the step's dot FLOPs).
@pytest.mark.parametrize("model,layout,schedule,V,S,M,blocks", [
    ("gpt-tiny", "tp_pp", "1f1b", 1, 2, 4, ()),
    ("llama-tiny", "pp", "interleaved", 2, 2, 4, ())])
def test_combined_ticks_equal_single_device(model, layout, schedule, V, S, M, blocks):
    _check_case(model, layout, MESHES[layout].format(S=S), schedule, V, S, M,
                _reference(model, sum(blocks) or S * V), stage_blocks=blocks, combined=True)


# Uneven stages (--pp-stage-blocks): a stage's blocks split over its V chunks, the shorter
# chunks' padded slots skipped; each schedule once, pp and tp_pp / fsdp_pp, both models.
@pytest.mark.parametrize("model,layout,schedule,V,S,M,blocks", [
    ("gpt-tiny", "pp", "gpipe", 1, 2, 2, (1, 2)),
    ("llama-tiny", "pp", "1f1b", 1, 2, 4, (2, 1)),
    ("gpt-tiny", "pp", "interleaved", 2, 2, 2, (3, 2)),
    ("llama-tiny", "tp_pp", "interleaved", 2, 2, 4, (2, 3)),
    ("gpt-tiny", "fsdp_pp", "1f1b", 1, 2, 2, (1, 2)),
    ("llama-tiny", "tp_pp", "zb-h1", 1, 2, 2, (2, 1))])
def test_uneven_stages_equal_single_device(model, layout, schedule, V, S, M, blocks):
    _check_case(model, layout, MESHES[layout].format(S=S), schedule, V, S, M,
                _reference(model, sum(blocks)), stage_blocks=blocks)


def _check_case(model, layout, mesh, schedule, V, S, M, reference, stage_blocks=(),
                combined=False, **extra):
    depth = sum(stage_blocks) or S * V
    cfg = _cfg(model, depth, **extra)
    shape = parse_mesh(mesh)
    program = build_pipeline_program(cfg, "float32", _TX, get_layout(layout),
                                     build_mesh(shape, jax.devices()[:shape.size]), 0, M,
                                     schedule, V, stage_blocks=stage_blocks,
                                     combined=combined)
    assert (program.schedule.stages, program.schedule.virtual,
            program.schedule.microbatches) == (S, V, M)
    stream = TrainStream(cfg, None, BATCH, 0)
    state = _initial(program, cfg, S, V, stage_blocks)
    compiled = program.step.lower(state, put_batch(stream.batch(0), program.batch_sharding)
                                  ).compile()
    losses = []
    for _ in range(STEPS):
        state, loss = compiled(state, put_batch(stream.next(), program.batch_sharding))
        losses.append(float(loss))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    # Each stage's parameters: its 1/S of the blocks plus the shared embeddings and head.
    if layout == "pp":
        stacked = sum(x.nbytes for x in jax.tree.leaves(state["params"]["stages"]))
        shared = sum(x.nbytes for x in jax.tree.leaves(state["params"]["shared"]))
        assert stage_param_bytes(state, program.batch_sharding.mesh) == [
            stacked // S + shared] * S
    # ep_pp: each device holds its 1/expert of every stage's experts, whole
    if layout == "ep_pp":
        experts = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(
            state["params"]["stages"])[0] if jax.tree_util.keystr(path).endswith(
                ("['moe']['gate']", "['moe']['up']", "['moe']['down']"))]
        assert len(experts) == 3 and all(
            x.sharding.shard_shape(x.shape)[3] == cfg.experts // shape.axis_sizes["expert"]
            for _, x in experts)
    # The activations and gradients each stage sends, read from the compiled HLO: one
    # micro-batch's activation per message, forward and backward, M x (S*V - 1) boundaries.
    act = local_activation_bytes(program, BATCH)
    sends = stage_sends(compiled.as_text(), dict(program.batch_sharding.mesh.shape),
                        program.schedule)
    assert sends["messages"] == 2 * M * (S * V - 1)
    assert sends["total_bytes"] == 2 * act * M * (S * V - 1)
    # The step's collectives, each branch of the tick loop's switches weighed by the
    # schedule table: none left an upper bound, and the permutes' bytes per device are the
    # stages' sends over the stages (a device of each stage sends its stage's share).
    hlo_text, mesh_shape = compiled.as_text(), dict(program.batch_sharding.mesh.shape)
    ops = comm.collectives(hlo_text, mesh_shape,
                           switch_runs(hlo_text, mesh_shape, program.schedule))
    assert not [o for o in ops if o["upper_bound"]]
    assert comm.summarize(ops).by_kind["collective-permute"]["bytes"] == pytest.approx(
        sends["total_bytes"] / S)
