"""Step options that must not change the math: gradient accumulation and recomputation."""

import functools

import jax
import numpy as np
import pytest

from jaxdist.mesh import MeshShape
from tests.helpers import train

MESH = MeshShape(2, 4)


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


# SGD for the parameter comparison: Adam divides by sqrt(v), which turns float rounding of
# a gradient that is mathematically zero (a GPT's key bias: softmax ignores a constant shift)
# into a full-size step of either sign.
@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny"])
def test_microbatches_equal_one_batch(model):
    whole, state_whole, _ = train(model, "fsdp", MESH, steps=3, batch_size=32, optimizer="sgd")
    split, state_split, _ = train(model, "fsdp", MESH, steps=3, batch_size=32, optimizer="sgd",
                                  microbatches=4)
    np.testing.assert_allclose(split, whole, rtol=1e-5)
    for a, b in zip(_params(state_whole), _params(state_split)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# Full remat also orders the backward (models.layers.run_blocks: an optimization barrier on
# each block's gradients), which must change no number either: gpt's stack and moe's (whose
# carry holds the balance loss too).
@pytest.mark.parametrize("model,policy", [("gpt-tiny", "full"), ("gpt-tiny", "dots"),
                                          ("moe-tiny", "full"), ("llama-tiny", "selective_op")])
def test_remat_equals_no_remat(model, policy):
    plain, state_plain, _ = train(model, "fsdp", MESH, steps=3, optimizer="sgd")
    remat, state_remat, _ = train(model, "fsdp", MESH, steps=3, optimizer="sgd",
                                  remat=policy)
    np.testing.assert_allclose(remat, plain, rtol=1e-6)
    for a, b in zip(_params(state_plain), _params(state_remat)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


NAMED_REMATS = ("minimal", "minimal_flash", "save_dot_with_context_except_mlp",
                "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj",
                "minimal_offloaded", "qkv_proj_offloaded")
SMALL = MeshShape(1, 2)


@functools.lru_cache(maxsize=None)
def _plain_losses(model):
    return train(model, "fsdp", SMALL, steps=2, optimizer="sgd")[0]


# MaxText's named policies (models.layers REMAT_NAMES) keep or offload other values; the
# numbers are no-remat's. The offloading ones run on XLA:CPU, where host memory is device
# memory: XLA:CPU compiles the placement away (the XLA:GPU program holds the copies).
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("policy", NAMED_REMATS)
def test_named_remat_equals_no_remat(model, policy):
    losses = train(model, "fsdp", SMALL, steps=2, optimizer="sgd", remat=policy)[0]
    np.testing.assert_allclose(losses, _plain_losses(model), rtol=1e-5)
