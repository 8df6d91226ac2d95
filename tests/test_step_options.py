"""Step options that must not change the math: gradient accumulation and recomputation."""

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
