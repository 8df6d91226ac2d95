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
@pytest.mark.parametrize("remat", ["selective_op", "minimal_flash",
                                   "save_dot_with_context_except_mlp"])
def test_context_policies_keep_cudnn_attention_outputs(remat):
    """With cuDNN's flash attention the kernel's own outputs are kept (output and
    logsumexp, what its backward reads; torchtitan keeps SDPA's, MaxText's `context`), not a
    named copy."""
    block, x = _block_and_input(jnp.bfloat16, attention="cudnn")
    saved = _saved(block, x, remat)
    kernel = [aval.shape for aval, source in saved if "dot_product_attention_fwd" in source]
    assert sorted(kernel, key=len) == [(B, 4, L), (B, L, 4, 8)]
    assert "context" not in _named(saved)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_other_policies_unchanged_by_the_names(remat):
    """full keeps no name; dots keeps every matmul (names do not change what it picks)."""
    block, x = _block_and_input()
    assert _named(_saved(block, x, remat)) == {}


# MaxText's named policies (models.layers REMAT_NAMES) on the llama block above: what JAX's
# own report says each keeps by name. The backward reads every named value but the MLP's
# output (mlpwo: the residual add needs none), so save_dot_except_mlpwi keeps what
# save_dot_except_mlp keeps.
QKV_SHAPES = {"query_proj": (B, L, 4, 8), "key_proj": (B, L, 2, 8), "value_proj": (B, L, 2, 8)}
CONTEXT, OUT = {"context": (B, L, 4, 8)}, {"out_proj": (B, L, 32)}
MLP_IN = {"mlpwi_0": (B, L, 48), "mlpwi_1": (B, L, 48)}
NAMED_SAVES = {
    "minimal": {**QKV_SHAPES, **OUT, **MLP_IN},
    "minimal_flash": {**QKV_SHAPES, **CONTEXT, **OUT, **MLP_IN},
    "save_dot_with_context_except_mlp": {**QKV_SHAPES, **CONTEXT, **OUT},
    "save_dot_except_mlpwi": {**QKV_SHAPES, **OUT},
    "save_dot_except_mlp": {**QKV_SHAPES, **OUT},
    "save_qkv_proj": QKV_SHAPES,
    "save_out_proj": OUT,
}
# the offloading ones: the same values, in host memory
OFFLOADS = {"minimal_offloaded": NAMED_SAVES["minimal"], "qkv_proj_offloaded": QKV_SHAPES}


def test_every_named_policy_is_listed():
    from models.layers import REMAT_NAMES
    assert set(REMAT_NAMES) == set(NAMED_SAVES) | set(OFFLOADS)


@pytest.mark.parametrize("remat", sorted(NAMED_SAVES))
def test_named_policy_keeps_its_names(remat):
    block, x = _block_and_input()
    saved = _saved(block, x, remat)
    assert _named(saved) == NAMED_SAVES[remat]
    # else only the block's input and the parameters, all in device memory
    assert [s for _, s in saved if not s.startswith(("named '", "from the argument"))] == []
    assert {str(a.memory_space) for a, _ in saved} == {"MemorySpace.Device"}


@pytest.mark.parametrize("remat", sorted(OFFLOADS))
def test_offloading_policy_moves_its_names_to_host_memory(remat):
    """Nothing kept by name in device memory; in host memory exactly the values the
    device-side policy keeps (JAX's report names them by the device_put that moves them)."""
    block, x = _block_and_input()
    saved = _saved(block, x, remat)
    host = sorted(a.shape for a, _ in saved if str(a.memory_space) == "MemorySpace.Host")
    assert _named(saved) == {}
    assert host == sorted(OFFLOADS[remat].values())
    assert all(s.startswith("from the argument") for a, s in saved
               if str(a.memory_space) != "MemorySpace.Host")


def test_gpt_block_names_its_single_up_projection_mlpwi():
    """GPT's MLP has one up projection (MaxText's `mlpwi`), no gate."""
    cfg = get_model("gpt-tiny", {"width": "32", "heads": "4", "seq_len": "8", "vocab": "64",
                                 "depth": "1"})
    block = cfg.build(nnx.Rngs(0), jnp.float32).blocks[0]
    saved = _named(_saved(block, jnp.ones((B, L, 32)), "minimal"))
    assert saved == {**{k: (B, L, 4, 8) for k in QKV_SHAPES}, **OUT, "mlpwi": (B, L, 128)}


def test_moe_experts_name_gate_up_and_down():
    """The MoE block's experts are tagged as MaxText's: mlpwi_0, mlpwi_1, mlpwo, all kept by
    minimal (the combine's backward reads the experts' outputs for the gates' gradient),
    the attention as llama's."""
    cfg = get_model("moe-tiny", {"seq_len": "8", "vocab": "64", "depth": "1"})
    block = cfg.build(nnx.Rngs(0), jnp.float32).blocks[0]
    run = block_runner(type(block), "minimal")
    graphdef, state = nnx.split(block)
    saved = saved_residuals(lambda s, x: run(nnx.merge(graphdef, s), x)[0].sum(), state,
                            jnp.ones((B, L, cfg.width)))
    assert set(_named(saved)) == {"query_proj", "key_proj", "value_proj", "out_proj",
                                  "mlpwi_0", "mlpwi_1", "mlpwo"}


def test_sequence_parallel_names_its_row_projections():
    """Under sequence parallelism out_proj and mlpwo name the reduce-scattered shards."""
    block, x = _block_and_input(sequence_parallel=True)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    run = block_runner(type(block), "minimal")
    graphdef, state = nnx.split(block)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda state, x: run(nnx.merge(graphdef, state), x))(
            state, x).jaxpr
    names = _checkpoint_names(jaxpr)
    assert [n for n in names if not n.startswith(("matmul_", "reduce_scatter"))] == [
        "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1",
        "mlpwo"]
