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
from tests.helpers import job_of


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


def test_barriers_off_holds_for_its_own_thread_only():
    """A plan traces its hand estimate with the barriers off in a worker thread while the main
    thread lowers the step: the step keeps its barriers."""
    import threading

    from models.layers import barriers_off

    inside, done = threading.Event(), threading.Event()

    def hand_estimate():
        with barriers_off():
            inside.set()
            done.wait(30)

    worker = threading.Thread(target=hand_estimate)
    worker.start()
    try:
        assert inside.wait(30)
        _, jaxpr = _grads_and_jaxpr(True)
    finally:
        done.set()
        worker.join()
    assert len(_barriers(jaxpr.jaxpr)) == 4
    with barriers_off():
        assert _barriers(_grads_and_jaxpr(True)[1].jaxpr) == []


def test_layouts_that_gather_block_weights_order_the_blocks_whatever_the_remat():
    """fsdp, hsdp and fsdp_tp gather each block's weights: their decoders run ordered also
    under dots and without remat; ddp, zero1, tp and the pipelines only under full remat."""
    from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig

    def ordered(layout, mesh, remat):
        cfg = RunConfig(mesh=MeshConfig(mesh=mesh), model=ModelConfig(model="gpt-tiny"),
                        train=TrainConfig(layout=layout, remat=remat, batch_size=8))
        model_cfg = job_of(cfg).model
        return nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0), jnp.float32)).ordered

    for remat in ("none", "dots", "full"):
        assert ordered("fsdp", "2x4", remat) and ordered("hsdp", "2x4", remat)
        assert ordered("fsdp_tp", "data:2,tensor:4", remat)
        for layout, mesh in (("ddp", "2x4"), ("zero1", "2x4"), ("tp", "data:2,tensor:4"),
                             ("pp", "data:2,stage:2")):
            assert ordered(layout, mesh, remat) == (remat == "full"), (layout, remat)
