"""models/attention.py: how cuDNN attention is placed under the tensor layouts (q, k and v in
one sharding, kv heads repeated where tensor would not divide them). XLA:CPU cannot run the
cuDNN kernel, so the placement runs here around XLA's attention and must give the same
numbers, forward and backward; tests/test_gpu_compiler.py compiles the cuDNN calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from models.attention import kv_repeats, qkv_spec, sharded_alike


@pytest.mark.parametrize("heads, kv_heads, tensor, repeats", [
    (64, 8, 8, 1),    # llama3-70b on TP8: one kv head per device
    (4, 2, 4, 2),     # llama-tiny on tensor:4: each kv head twice
    (4, 2, 2, 1),
    (32, 4, 8, 2),    # two devices share a kv head: two copies, not eight
    (4, 2, 8, 1),     # query heads not divisible: heads stay whole, no repeat
    (8, 8, 4, 1),     # no GQA
])
def test_kv_repeats_are_the_fewest_that_tensor_divides(heads, kv_heads, tensor, repeats):
    assert kv_repeats(heads, kv_heads, tensor) == repeats


def auto_mesh(sizes, names):
    """As jaxdist.mesh builds them: every axis Auto (the partitioner's)."""
    return jax.make_mesh(sizes, names, devices=jax.devices()[:int(np.prod(sizes))],
                         axis_types=(AxisType.Auto,) * len(names))


def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def loss(attend):
    return lambda q, k, v: (attend(q, k, v).astype(jnp.float32) ** 2).sum()


@pytest.mark.parametrize("axes, heads, kv_heads", [
    ((("data", 2), ("fsdp", 1), ("tensor", 4)), 4, 2),   # GQA, kv heads repeated
    ((("data", 4), ("tensor", 2)), 4, 2),
    ((("data", 2), ("fsdp", 2), ("tensor", 2)), 8, 8),
    ((("data", 2), ("tensor", 4)), 2, 1),                 # heads whole over tensor
])
def test_placement_gives_xla_attentions_numbers(axes, heads, kv_heads):
    names, sizes = zip(*axes)
    mesh = auto_mesh(sizes, names)
    keys = jax.random.split(jax.random.key(0), 3)
    B, L, H = 4, 16, 8
    q, k, v = (jax.random.normal(key, (B, L, n, H), jnp.float32)
               for key, n in zip(keys, (heads, kv_heads, kv_heads)))
    want = jax.jit(jax.value_and_grad(loss(xla), argnums=(0, 1, 2)))(q, k, v)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(lambda *a: sharded_alike(xla, *a)),
                                         argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_spec_uses_only_axes_an_enclosing_shard_map_left_free():
    """Inside a pipeline stage (stage manual) q, k, v are split over the rest; inside
    sequence parallelism's shard_map (all manual) the call runs as it is."""
    mesh = auto_mesh((2, 2, 2), ("data", "stage", "tensor"))
    seen = {}

    def stage(x):
        seen["spec"] = qkv_spec(jax.sharding.get_abstract_mesh(), x.shape[0], 4)
        return x

    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(stage, in_specs=P(), out_specs=P(), axis_names={"stage"},
                              check_vma=False))(jnp.zeros((4, 8, 4, 2)))
    assert seen["spec"] == P(("data",), None, "tensor", None)
    assert qkv_spec(mesh.abstract_mesh, 3, 4) == P(None, None, "tensor", None)  # 3 rows: whole
