"""The CNN zoo of Ovi 2025 (VGG16, ResNet50, DenseNet121, EfficientNetV2-S, ConvNeXt-Large):
parameter counts against torchvision's, FLOPs against torchvision's published figures and
against the convolutions and matmuls the models actually trace, and one training step of each
family under ddp and fsdp at CIFAR (32x32x3) and MNIST (28x28x1) shapes.

The full models cannot take a step inside the test budget on a 2-core CPU (measured on the
shared 2-core machine, init + one ddp step with batch 2 at CIFAR shape, compiles included:
densenet121 ~135 s, efficientnetv2_s ~130 s, vgg16 ~105 s and 4 GB of replicated AdamW
state; convnext_large, the biggest, was not tried), so the step tests use each family's
CPU-test size, which runs the same code (every layer kind, stem and pooling path) at a
fraction of the width and depth.
"""

import math

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import get_model
from sharding import get_layout

# Parameter counts of torchvision's models (1000-class heads), from the torchvision model
# docs ("num_params" of each weights enum, e.g. VGG16_Weights.IMAGENET1K_V1).
TORCHVISION_PARAMS = {
    "vgg16-imagenet": 138_357_544,              # torchvision.models.vgg16
    "densenet121-imagenet": 7_978_856,          # torchvision.models.densenet121
    "efficientnetv2_s-imagenet": 21_458_488,    # torchvision.models.efficientnet_v2_s
    "convnext_large-imagenet": 197_767_336,     # torchvision.models.convnext_large
    "resnet18-imagenet": 11_689_512,            # torchvision.models.resnet18
    "resnet50-imagenet": 25_557_032,            # torchvision.models.resnet50
}
RESNET50_TORCHVISION = 25_557_032               # torchvision.models.resnet50
# torchvision's published "GFLOPS" (multiply-accumulates, really) and the input size each was
# measured at: EfficientNetV2-S's weights are evaluated at 384x384.
TORCHVISION_GMACS = {
    "vgg16-imagenet": (15.47, 224),
    "densenet121-imagenet": (2.83, 224),
    "efficientnetv2_s-imagenet": (8.37, 384),
    "convnext_large-imagenet": (34.36, 224),
    "resnet18-imagenet": (1.81, 224),
    "resnet50-imagenet": (4.09, 224),
}
TINY = ["vgg-tiny", "densenet-tiny", "efficientnetv2-tiny", "convnext-toy", "resnet-tiny"]
# Compile-time only (the conftest's optimisation level 0 in the same spirit): XLA:CPU's
# older emitters compile these small CNN steps ~2x faster than its MLIR fusion emitters.
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}
SHAPES = {"cifar": {"image_size": "32", "channels": "3"},
          "mnist": {"image_size": "28", "channels": "1"}}


def n_params(cfg) -> int:
    model = nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0), jnp.float32))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def head(features, classes):
    return features * classes + classes


@pytest.mark.parametrize("name", TORCHVISION_PARAMS)
def test_reference_shape_matches_torchvision(name):
    cfg = get_model(name)
    assert (cfg.image_size, cfg.channels, cfg.num_classes) == (224, 3, 1000)
    count = n_params(cfg)
    assert count == pytest.approx(TORCHVISION_PARAMS[name], rel=0.005)  # the requirement
    assert count == TORCHVISION_PARAMS[name]                            # and in fact exact


def test_resnet50_reference_shape():
    # At 224x224x3 with 1000 classes the stem is ImageNet's by itself (stem=auto): torchvision's
    # count exactly. Asked for, the CIFAR stem is 7,680 weights short (3x3, not 7x7, filters).
    cfg = get_model("resnet50", {"image_size": "224", "num_classes": "1000"})
    assert cfg.resolved_stem == "imagenet"
    assert n_params(cfg) == RESNET50_TORCHVISION
    cifar = get_model("resnet50", {"image_size": "224", "num_classes": "1000", "stem": "cifar"})
    assert n_params(cifar) == RESNET50_TORCHVISION - (7 * 7 - 3 * 3) * 3 * 64
    # Off the reference shape, auto is the CIFAR stem; stem=imagenet takes it anywhere.
    assert get_model("resnet50").resolved_stem == "cifar"
    imagenet_at_32 = get_model("resnet50", {"stem": "imagenet"})
    assert n_params(imagenet_at_32) == n_params(get_model("resnet50")) + (7 * 7 - 3 * 3) * 3 * 64


# The CIFAR-shaped defaults: torchvision's count with a 10-class head and the documented
# stem change (DenseNet 3x3 instead of 7x7 on 3 channels, ConvNeXt 2x2 instead of 4x4
# patches; VGG and EfficientNetV2 keep every stem weight).
@pytest.mark.parametrize("name, features, stem_change", [
    ("vgg16", 4096, 0),
    ("densenet121", 1024, -(7 * 7 - 3 * 3) * 3 * 64),
    ("efficientnetv2_s", 1280, 0),
    ("convnext_large", 1536, -(4 * 4 - 2 * 2) * 3 * 192),
])
def test_cifar_shape_counts(name, features, stem_change):
    cfg = get_model(name)
    assert (cfg.image_size, cfg.channels, cfg.num_classes) == (32, 3, 10)
    reference = TORCHVISION_PARAMS[name + "-imagenet"]
    expected = reference - head(features, 1000) + head(features, 10) + stem_change
    assert n_params(cfg) == expected


@pytest.mark.parametrize("name", TORCHVISION_GMACS)
def test_flops_match_torchvision(name):
    gmacs, size = TORCHVISION_GMACS[name]
    cfg = get_model(name, {"image_size": str(size)})
    assert cfg.flops_per_sample() / 3 / 2 / 1e9 == pytest.approx(gmacs, rel=0.005)
    assert cfg.tokens_per_sample == 0


def _macs(jaxpr) -> int:
    """Multiply-accumulates of every convolution and matmul in `jaxpr`, nested ones too."""
    total = 0
    for eqn in jaxpr.eqns:
        out = eqn.outvars[0].aval
        if eqn.primitive.name == "conv_general_dilated":
            rhs = eqn.invars[1].aval
            out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += math.prod(out.shape) * math.prod(rhs.shape) // out_features
        elif eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            total += math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    total += _macs(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    total += _macs(sub)
    return total


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("opts", [{}, SHAPES["mnist"], {"stem": "imagenet", "image_size": "64"}],
                         ids=["cifar", "mnist", "imagenet-stem"])
def test_flops_match_traced_model(name, opts):
    """The analytic count equals the MACs the forward pass really traces (x2, x3 for
    training). Exactly, except for VGG on a 64x64 image, whose 2x2 -> 7x7 adaptive pool is an
    einsum the analytic count ignores (~0.2%)."""
    if "stem" in opts and name == "vgg-tiny":
        opts = {"image_size": "64"}
    cfg = get_model(name, opts)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0), jnp.float32)))
    x = jax.ShapeDtypeStruct((2, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    traced = 3 * 2 * _macs(jaxpr.jaxpr) / 2
    if cfg.image_size == 64 and name == "vgg-tiny":
        assert cfg.flops_per_sample() == pytest.approx(traced, rel=3e-3)
    else:
        assert cfg.flops_per_sample() == traced


def test_cifar_and_mnist_flops():
    # 32x32 VGG16: 0.313 GMACs of convs + 0.1196 of classifier (the 1x1 map replicated 7x7).
    assert get_model("vgg16").flops_per_sample() / 6 == pytest.approx(0.4332e9, rel=1e-3)
    for name in ("vgg16", "densenet121", "efficientnetv2_s", "convnext_large"):
        cifar, mnist = get_model(name), get_model(name, SHAPES["mnist"])
        assert 0.5 * cifar.flops_per_sample() < mnist.flops_per_sample() < cifar.flops_per_sample()


def test_stems_and_validation():
    # The ImageNet stems leave nothing of a 28x28 image for the last stage.
    for name, features in (("densenet121", 1024), ("convnext_large", 1536)):
        with pytest.raises(UsageError, match="image_size=28 is too small"):
            get_model(name, {"stem": "imagenet", **SHAPES["mnist"]})
        # 32 still fits, and the override took: torchvision's stem weights, 10-class head.
        cfg = get_model(name, {"stem": "imagenet"})
        assert cfg.stem == "imagenet"
        assert n_params(cfg) == (TORCHVISION_PARAMS[name + "-imagenet"] - head(features, 1000)
                                 + head(features, 10))
    with pytest.raises(UsageError, match="cifar, imagenet"):
        get_model("efficientnetv2_s", {"stem": "patch"})
    with pytest.raises(UsageError, match="auto, cifar, imagenet"):
        get_model("resnet18", {"stem": "patch"})
    with pytest.raises(UsageError, match="l, m, s, toy"):
        get_model("efficientnetv2_s", {"variant": "xl"})
    with pytest.raises(UsageError, match="base, large, small, tiny, toy"):
        get_model("convnext_large", {"variant": "huge"})
    with pytest.raises(UsageError, match="11, 13, 16, 19"):
        get_model("vgg16", {"depth": "17"})
    with pytest.raises(UsageError, match="121, 15, 169, 201"):
        get_model("densenet121", {"depth": "100"})
    # Same weights whatever the stem stride: EfficientNetV2's CIFAR change costs no parameter.
    assert (get_model("efficientnetv2-tiny").flops_per_sample()
            > get_model("efficientnetv2-tiny", {"stem": "imagenet"}).flops_per_sample())


def test_synthetic_batch_is_cheap_and_learnable_at_224():
    cfg = get_model("convnext_large-imagenet")
    batch = cfg.synthetic_batch(np.random.default_rng(0), 8)
    assert batch["x"].shape == (8, 224, 224, 3) and batch["x"].dtype == np.float32
    assert batch["y"].dtype == np.int32 and 0 <= batch["y"].min() and batch["y"].max() < 1000
    assert len(set(batch["y"].tolist())) > 1
    again = cfg.synthetic_batch(np.random.default_rng(0), 8)
    np.testing.assert_array_equal(batch["y"], again["y"])


# resnet-tiny at CIFAR shape already steps under every layout in test_equivalence.
STEP_CASES = [(name, shape) for name in TINY for shape in SHAPES
              if (name, shape) != ("resnet-tiny", "cifar")]


@pytest.mark.parametrize("name, shape", STEP_CASES)
def test_one_step_ddp_and_fsdp(name, shape):
    """One AdamW step from the same initial state under ddp and fsdp on 2 devices (batch 2):
    the same finite loss (one forward, sharded two ways), every parameter updated and finite."""
    cfg = get_model(name, SHAPES[shape])
    mesh = build_mesh(MeshShape(2, 1), jax.devices()[:2])
    tx = make_optimizer("adamw", 1e-3)
    programs = {layout: build_program(cfg, "float32", tx, get_layout(layout), mesh, seed=0)
                for layout in ("ddp", "fsdp")}
    init = programs["ddp"].init.lower().compile(FAST_COMPILE)
    initial = jax.device_get(init())  # one init compile, shared by both layouts
    batch = cfg.synthetic_batch(np.random.default_rng(0), 2)
    assert batch["x"].shape == (2, cfg.image_size, cfg.image_size, cfg.channels)
    losses = {}
    for layout, program in programs.items():
        state = jax.device_put(initial, program.state_shardings)
        batch_dev = put_batch(batch, program.batch_sharding)
        step = program.step.lower(state, batch_dev).compile(FAST_COMPILE)
        state, loss = step(state, batch_dev)
        losses[layout] = float(loss)
        params = jax.device_get(state["params"])
        assert all(np.isfinite(p).all() for p in jax.tree.leaves(params))
        moved = [not np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(params), jax.tree.leaves(initial["params"]))]
        assert all(moved)
    assert np.isfinite(losses["ddp"]) and 0 < losses["ddp"] < 20
    np.testing.assert_allclose(losses["fsdp"], losses["ddp"], rtol=1e-5)


@pytest.mark.parametrize("name", TINY[:4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float32_params_and_logits(name, dtype):
    """Abstractly (no compile): float32 parameters, and float32 (B, 10) logits in train and
    eval mode, as the step's loss and the accuracy count (`Program.correct`) read them."""
    cfg = get_model(name)
    model = nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0), dtype))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    for mode in (model.train, model.eval):
        mode()
        x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
        logits = nnx.eval_shape(lambda m, x: m(x), model, x)
        assert logits.shape == (2, 10) and logits.dtype == jnp.float32


@pytest.mark.parametrize("h, w, out", [(1, 1, 7), (2, 2, 7), (3, 5, 7), (7, 7, 7), (9, 6, 4)])
def test_adaptive_avg_pool_matches_torch(h, w, out):
    torch = pytest.importorskip("torch")
    from models.vgg import adaptive_avg_pool

    x_BHWC = np.random.default_rng(0).standard_normal((2, h, w, 3)).astype(np.float32)
    ours = np.asarray(adaptive_avg_pool(jnp.asarray(x_BHWC), out))
    theirs = torch.nn.AdaptiveAvgPool2d(out)(torch.from_numpy(x_BHWC).permute(0, 3, 1, 2))
    np.testing.assert_allclose(ours, theirs.permute(0, 2, 3, 1).numpy(), rtol=1e-6, atol=1e-6)
