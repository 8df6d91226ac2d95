"""Model registry and families: shapes, parameter counts, FLOPs, losses (CPU, ~15 s)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.errors import UsageError
from models import get_model, model_names
from tests.test_zoo import _macs

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


def resnet18_cifar_params(width=64, classes=10, blocks=(2, 2, 2, 2), stem_k=3):
    """Basic-block ResNets (18, 34): stem, blocks, 1x1 projections where the shape changes."""
    conv = lambda k, a, b: k * k * a * b  # noqa: E731
    bn = lambda c: 2 * c  # noqa: E731
    total = conv(stem_k, 3, width) + bn(width)
    cin = width
    for stage in range(4):
        c = width * 2 ** stage
        for i in range(blocks[stage]):
            total += conv(3, cin, c) + bn(c) + conv(3, c, c) + bn(c)
            if cin != c:
                total += conv(1, cin, c) + bn(c)
            cin = c
    return total + cin * classes + classes


# Go et al.'s full-size decoders take ~20 s each to trace; tests/test_dry_run.py covers them.
FULL_SIZE = {"gpt3-175b", "llama3-70b", "llama2-7b", "mixtral-8x7b", "mixtral-8x22b"}


@pytest.mark.parametrize("name", sorted(set(model_names()) - FULL_SIZE))
def test_every_model_builds_abstractly(name):
    """Every registered model builds without allocating and its synthetic batch is non-zero.
    For the mlp, decoder and ResNet sizes, the analytic training FLOPs are exactly 3 x 2 x
    the multiply-accumulates of every matmul and convolution the forward pass traces. (The
    other CNN families: tests/test_zoo.py, traced at test size and against torchvision's
    published counts at full size; the MoE counts the top-k experts a token uses, not the
    capacity-padded dispatch it traces: its formula is checked by hand below.)"""
    cfg = get_model(name)
    graphdef, state = nnx.split(abstract(name))
    batch = cfg.synthetic_batch(np.random.default_rng(0), 2)
    assert all(v.shape[0] == 2 and np.any(v != 0) for v in batch.values())
    if cfg.family not in ("mlp", "gpt", "resnet"):
        return
    if "tokens" in batch:
        x = jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32)
    else:
        x = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    assert cfg.flops_per_sample() == 3 * 2 * _macs(jaxpr.jaxpr) / 2


@pytest.mark.parametrize("name, expected", [
    ("mlp-tiny", mlp_tiny_params()),
    ("gpt-tiny", gpt_tiny_params()),
    ("resnet18", resnet18_cifar_params()),
])
def test_param_counts(name, expected):
    assert n_params(abstract(name)) == expected


def test_reference_resnet_sizes():
    assert resnet18_cifar_params() == 11_173_962
    # torchvision resnet18 (11,689,512): the ImageNet stem and a 1000-class head.
    assert resnet18_cifar_params(classes=1000, stem_k=7) == 11_689_512
    assert n_params(abstract("resnet18-imagenet")) == 11_689_512
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
    # llama-tiny by hand (d=64, 4 heads of 16, 2 kv heads, SwiGLU 128, vocab 256, L=32, 2
    # layers). N = matmul weights: q 64x64 + k, v 64x32 each + out 64x64 + gate, up, down
    # 3 x 64x128 = 36,864 per layer; x2 + head 64x256 = 90,112. Per token 6N + 12*2*32*64.
    assert get_model("llama-tiny").flops_per_sample() == (6 * 90_112 + 49_152) * 32
    # moe-tiny: as llama-tiny with top-2 of 4 SwiGLU experts (hidden 64) and a 64x4 router:
    # per layer 12,288 + 2 x 12,288 + 256 = 37,120; x2 + 16,384 = 90,624.
    assert get_model("moe-tiny").flops_per_sample() == (6 * 90_624 + 49_152) * 32
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
    resnet34 = get_model("resnet18", {"depth": "34"})
    assert resnet34.depth == 34
    assert n_params(nnx.eval_shape(lambda: resnet34.build(nnx.Rngs(0), jnp.float32))) == \
        resnet18_cifar_params(blocks=(3, 4, 6, 3))
    # At the reference shape the ImageNet stem comes with it: torchvision's resnet34 count.
    resnet34 = get_model("resnet18", {"depth": "34", "image_size": "224", "num_classes": "1000"})
    assert n_params(nnx.eval_shape(lambda: resnet34.build(nnx.Rngs(0), jnp.float32))) == \
        21_797_672
    with pytest.raises(UsageError, match="auto, cifar, imagenet"):
        get_model("resnet18", {"stem": "patch"})
    # A bool is a bool word (ordered_blocks=2 ran as False) and a number finite and positive
    # (capacity_factor=nan passed `<= 0` and reached the router).
    assert get_model("gpt-tiny", {"ordered_blocks": "True"}).ordered_blocks is True
    assert get_model("gpt-tiny", {"ordered_blocks": "no"}).ordered_blocks is False
    with pytest.raises(UsageError, match=r"ordered_blocks='2' is not a bool; give true or false"):
        get_model("gpt-tiny", {"ordered_blocks": "2"})
    for bad in ("nan", "inf", "-inf", "0", "-0.5"):
        with pytest.raises(UsageError, match=f"capacity_factor='{bad}' must be a positive, fin"):
            get_model("moe-tiny", {"capacity_factor": bad})


def test_unknown_model_lists_names():
    with pytest.raises(UsageError) as info:
        get_model("nope")
    for name in ("gpt-tiny", "mlp-tiny", "resnet18", "resnet-tiny"):
        assert name in str(info.value)


def test_moe_implementations_route_alike_and_drop_over_capacity():
    """moe_impl dense (GShard's one-hot einsums), sorted (index dispatch, batched GEMMs) and
    ragged (ragged_dot grouped GEMMs) are one routing: equal outputs, also where a full
    expert drops choices (capacity 1 of 8 tokens x top-2 over 2 experts), and a choice not
    in the set is one line."""
    def out(impl, **opts):
        cfg = get_model("moe-tiny", {"moe_impl": impl, "depth": "1", **opts})
        model = cfg.build(nnx.Rngs(0), jnp.float32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)))
        return nnx.jit(lambda m, t: m(t))(model, tokens)  # one compile, not one per op

    for opts in ({}, {"experts": "2", "capacity_factor": "0.125"}):
        (ref, ref_aux), *rest = [out(impl, **opts) for impl in ("dense", "sorted", "ragged")]
        for logits, aux in rest:
            np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(aux, ref_aux, rtol=1e-6)
    with pytest.raises(UsageError, match="moe_impl='gmm' is not supported"):
        get_model("moe-tiny", {"moe_impl": "gmm"}).validate()


def test_an_abstract_build_never_walks_the_trace(monkeypatch):
    """nnx stores each value after probing its `sharding`; on jax 0.10.2 a tracer's refusal
    walked every equation traced so far (quadratic builds: models/tracing.py). The probe
    still fails as hasattr expects, and an abstract build walks nothing."""
    from jax._src.interpreters import partial_eval
    walks = []
    real = partial_eval.JaxprStackFrame.find_progenitors
    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors",
                        lambda self, t: walks.append(1) or real(self, t))
    model = abstract("resnet-tiny")
    assert n_params(model) > 0 and walks == []
    assert jax.jit(lambda x: jnp.float32(hasattr(x, "sharding") + hasattr(x, "device")))(
        jnp.ones(2)) == 0
