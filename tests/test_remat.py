"""What each remat policy keeps for the backward (models.layers.REMAT_POLICIES), read from
JAX's own list of saved residuals; that the numbers do not change is test_step_options'."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
# jax.ad_checkpoint exports only the printing wrapper of this list
from jax._src.ad_checkpoint import saved_residuals

from jaxdist.program import compiled
from jaxdist.config import TrainConfig
from models import get_model
from models.layers import REMAT_POLICIES, block_runner

# llama-tiny's shapes made distinct: q and out 32 wide, k and v 16 (2 of 4 heads), MLP 48
OPTS = {"width": 32, "heads": 4, "kv_heads": 2, "mlp_hidden": 48, "seq_len": 8, "vocab": 64,
        "depth": 1}
B, L = 2, 8


def _block_and_input(dtype=jnp.float32, **opts):
    cfg = get_model("llama-tiny", {k: str(v) for k, v in {**OPTS, **opts}.items()})
    model = cfg.build(nnx.Rngs(0), dtype)
    return model.blocks[0], jnp.ones((B, L, cfg.width), dtype)


def _saved(block, x, remat):
    """JAX's list of (aval, where it comes from) the block's backward reads."""
    run = block_runner(type(block), remat)
    graphdef, state = nnx.split(block)
    return saved_residuals(lambda state, x: run(nnx.merge(graphdef, state), x).sum(), state, x)


def _named(saved) -> dict:
    """{name: shape} of the residuals saved by name."""
    out = {}
    for aval, source in saved:
        if source.startswith("named '"):
            out[source.split("'")[1]] = aval.shape
    return out


def test_policy_names_are_the_cli_choices():
    choices = TrainConfig.__dataclass_fields__["remat"].metadata["choices"]
    assert tuple(REMAT_POLICIES) == tuple(choices)


def test_selective_op_keeps_every_other_matmul_and_the_attention_output():
    """torchtitan's op-level SAC on a Llama block (wq wk wv wo w1 w3 w2): the 1st, 3rd and
    5th matmul's outputs (q, v, gate) and the attention's output, nothing else but the
    block's input. The 7th (down) no backward reads: torchtitan's cache holds it until the
    recompute, JAX keeps only what the backward reads."""
    block, x = _block_and_input()
    saved = _saved(block, x, "selective_op")
    assert _named(saved) == {"matmul_1": (B, L, 32), "matmul_3": (B, L, 16),
                             "matmul_5": (B, L, 48), "context": (B, L, 4, 8)}
    # else only the block's input and the parameters
    assert [source for _, source in saved if not source.startswith(("named '", "from the "
                                                                    "argument"))] == []
    # the numbering restarts with each block: a second call saves the same names
    assert _named(_saved(block, x, "selective_op")) == _named(saved)


def test_selective_op_saves_less_than_dots_and_more_than_full():
    block, x = _block_and_input()
    nbytes = {remat: sum(np.prod(a.shape) * a.dtype.itemsize for a, _ in _saved(block, x, remat))
              for remat in ("full", "selective_op", "dots")}
    assert nbytes["full"] < nbytes["selective_op"] < nbytes["dots"]


def _checkpoint_names(jaxpr) -> list[str]:
    """The names of checkpoint_name in a jaxpr and the jaxprs inside it, in order."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            names.append(eqn.params["name"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    names += _checkpoint_names(inner)
    return names


def test_sequence_parallel_block_counts_its_row_matmuls_and_names_its_reduce_scatters():
    """Under sequence parallelism the row-parallel projections (out, down) are written as
    dots inside a shard_map: they still count, so the numbering is the plain block's (the
    policy keeps q, v, gate, down as there), and both reduce-scatters are named."""
    block, x = _block_and_input(sequence_parallel=True)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    run = block_runner(type(block), "selective_op")
    graphdef, state = nnx.split(block)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda state, x: run(nnx.merge(graphdef, state), x))(
            state, x).jaxpr
    names = _checkpoint_names(jaxpr)
    assert [n for n in names if n.startswith("matmul_")] == [f"matmul_{k}" for k in range(1, 8)]
    assert names.count("reduce_scatter") == 2


@pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                    reason="tracing cuDNN attention needs jax's CUDA plugin (make gpu-compiler)")
def test_selective_op_keeps_cudnn_attention_outputs():
    """With cuDNN's flash attention the kernel's own outputs are kept (output and
    logsumexp, what its backward reads; torchtitan keeps SDPA's), not a named copy."""
    block, x = _block_and_input(jnp.bfloat16, attention="cudnn")
    saved = _saved(block, x, "selective_op")
    kernel = [aval.shape for aval, source in saved if "dot_product_attention_fwd" in source]
    assert sorted(kernel, key=len) == [(B, 4, L), (B, L, 4, 8)]
    assert "context" not in _named(saved)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_other_policies_unchanged_by_the_names(remat):
    """full keeps no name; dots keeps every matmul (names do not change what it picks)."""
    block, x = _block_and_input()
    assert _named(_saved(block, x, remat)) == {}
