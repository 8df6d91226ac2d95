"""models.layers.run_blocks with `ordered` (full remat): block k+1's weights and block k's input
pass one optimization barrier together in the forward (k+1's weights are not gathered before
block k starts), and their gradients another in the backward (block k-1's backward waits for
k+1's weight gradients); the numbers are those of the unordered stack."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import run_blocks


def _grads_and_jaxpr(ordered: bool):
    blocks = [nnx.Linear(4, 4, rngs=nnx.Rngs(k)) for k in range(3)]
    graphdef, state = nnx.split(blocks)
    x = jnp.arange(8.0).reshape(2, 4) / 8

    def loss(state, x):
        stack = nnx.merge(graphdef, state)
        y = run_blocks(stack, lambda block, h: jnp.tanh(block(h)), x, ordered)
        return jnp.sum(y ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    return grad(state, x), jax.make_jaxpr(grad)(state, x)


def _barriers(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            found.append(sorted(tuple(v.aval.shape) for v in eqn.invars))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _barriers(sub)
    return found


def test_ordered_stack_has_one_barrier_per_block_pair_and_the_same_gradients():
    (ordered, dx_ordered), jaxpr = _grads_and_jaxpr(True)
    (plain, dx_plain), plain_jaxpr = _grads_and_jaxpr(False)
    for a, b in zip(jax.tree.leaves(ordered), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(dx_ordered, dx_plain)
    # 3 blocks: blocks 1 and 2 each tied to the input of the block before them, in the
    # forward (their weights with that input) and in the backward (their kernel and bias
    # gradients with that input's gradient): 2 x 2 barriers of a (4, 4) kernel, a (4,) bias
    # and a (2, 4) activation
    assert _barriers(jaxpr.jaxpr) == [[(2, 4), (4,), (4, 4)]] * 4
    assert _barriers(plain_jaxpr.jaxpr) == []
