"""Model registry and families: shapes, parameter counts, FLOPs, losses (CPU, ~15 s)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.errors import UsageError
from models import get_model, model_names

SMALL = ["mlp-tiny", "gpt-tiny", "resnet-tiny"]


def n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def abstract(name, dtype=jnp.float32):
    cfg = get_model(name)
    return nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0), dtype))


@functools.lru_cache(maxsize=None)
def built(name, dtype=jnp.float32):
    # Real init compiles one RNG program per parameter shape; threefry's take ~0.5 s each on a
    # small CPU (~7 s for resnet-tiny), rbg's a fraction of that. Tests that only read a model
    # share one copy.
    return get_model(name).build(nnx.Rngs(jax.random.key(0, impl="rbg")), dtype)


def batch_of(name, batch_size=2):
    cfg = get_model(name)
    return {k: jnp.asarray(v) for k, v in cfg.synthetic_batch(np.random.default_rng(0),
                                                              batch_size).items()}


def mlp_tiny_params():
    dims = [32, 64, 64, 10]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def gpt_tiny_params(vocab=256, seq=32, depth=2, d=64, ratio=4):
    ln = 2 * d
    attn = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * ratio * d + ratio * d) + (ratio * d * d + d)
    return vocab * d + seq * d + depth * (2 * ln + attn + mlp) + ln + d * vocab + vocab


def resnet18_cifar_params(width=64, classes=10):
    conv = lambda k, a, b: k * k * a * b  # noqa: E731
    bn = lambda c: 2 * c  # noqa: E731
    total = conv(3, 3, width) + bn(width)
    cin = width
    for stage in range(4):
        c = width * 2 ** stage
        for i in range(2):
            total += conv(3, cin, c) + bn(c) + conv(3, c, c) + bn(c)
            if cin != c:
                total += conv(1, cin, c) + bn(c)
            cin = c
    return total + cin * classes + classes


# Go et al.'s full-size decoders take ~20 s each to trace; tests/test_dry_run.py covers them.
FULL_SIZE = {"gpt3-175b", "llama3-70b", "mixtral-8x7b"}


@pytest.mark.parametrize("name", sorted(set(model_names()) - FULL_SIZE))
def test_every_model_builds_abstractly(name):
    cfg = get_model(name)
    model = abstract(name)
    assert n_params(model) > 0
    assert cfg.flops_per_sample() > 0
    batch = cfg.synthetic_batch(np.random.default_rng(0), 2)
    assert all(v.shape[0] == 2 and np.any(v != 0) for v in batch.values())


@pytest.mark.parametrize("name, expected", [
    ("mlp-tiny", mlp_tiny_params()),
    ("gpt-tiny", gpt_tiny_params()),
    ("resnet18", resnet18_cifar_params()),
])
def test_param_counts(name, expected):
    assert n_params(abstract(name)) == expected


def test_reference_resnet_sizes():
    assert resnet18_cifar_params() == 11_173_962
    # torchvision resnet50 (25,557,032) - 1000-class head + 10-class head - (7x7 - 3x3 stem).
    assert n_params(abstract("resnet50")) == 25_557_032 - 2_049_000 + 20_490 - 7_680
    assert n_params(abstract("resnet-tiny")) < 1_000_000


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_loss_is_finite_f32_scalar(name, dtype):
    cfg = get_model(name)
    model = built(name, dtype)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    loss = nnx.jit(cfg.loss)(model, batch_of(name))
    assert loss.shape == () and loss.dtype == jnp.float32
    assert np.isfinite(float(loss))


def test_gpt_loss_starts_near_uniform():
    cfg = get_model("gpt-tiny")
    loss = nnx.jit(cfg.loss)(built("gpt-tiny"), batch_of("gpt-tiny", 4))
    assert abs(float(loss) - np.log(cfg.vocab)) < 1.0


def test_gpt_is_causal():
    cfg = get_model("gpt-tiny")
    tokens = batch_of("gpt-tiny")["tokens"][:, :-1]
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % cfg.vocab)
    logits = nnx.jit(lambda m, t: m(t))(built("gpt-tiny"), jnp.concatenate([tokens, changed]))
    np.testing.assert_allclose(logits[:2, :-1], logits[2:, :-1], atol=1e-5)
    assert np.abs(logits[:2, -1] - logits[2:, -1]).max() > 1e-3


def test_resnet_train_mode_uses_and_updates_batch_stats():
    cfg = get_model("resnet-tiny")
    model = nnx.clone(built("resnet-tiny"))  # a copy: this test changes stats and mode
    model.train()
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    grads = nnx.jit(nnx.grad(cfg.loss))(model, batch_of("resnet-tiny", 4))
    after = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after)
    assert all(jax.tree.leaves(moved))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]
    assert norms and not any(bn.use_running_average for bn in norms)
    model.eval()
    assert all(bn.use_running_average for bn in norms)


def test_flops_per_sample():
    assert get_model("mlp-tiny").flops_per_sample() == 3 * 2 * (32 * 64 + 64 * 64 + 64 * 10)
    gpt = get_model("gpt-tiny")
    per_token = 2 * (2 * 12 * 64 * 64 + 64 * 256) + 4 * 2 * 32 * 64
    assert gpt.flops_per_sample() == 3 * per_token * 32
    assert gpt.tokens_per_sample == 32
    assert get_model("resnet18").tokens_per_sample == 0
    # resnet18 CIFAR is ~0.56 GMACs forward.
    assert get_model("resnet18").flops_per_sample() == pytest.approx(3 * 2 * 0.556e9, rel=0.01)


def test_overrides_and_validation():
    assert get_model("gpt-tiny", {"depth": "3"}).depth == 3
    with pytest.raises(UsageError, match="heads"):
        get_model("gpt-tiny", {"heads": "5"})
    with pytest.raises(UsageError, match="18, 34, 50"):
        get_model("resnet18", {"depth": "20"})
    assert get_model("resnet18", {"depth": "34"}).flops_per_sample() > 0


def test_unknown_model_lists_names():
    with pytest.raises(UsageError) as info:
        get_model("nope")
    for name in ("gpt-tiny", "mlp-tiny", "resnet18", "resnet-tiny"):
        assert name in str(info.value)
