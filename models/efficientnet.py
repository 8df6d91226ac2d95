"""EfficientNetV2-S (and M, L): torchvision's `efficientnet_v2_s`, 21,458,488 parameters at
224x224x3 with the 1000-class head.

Architecture as torchvision: a 3x3 stride-2 conv-BN-SiLU stem to 24 channels; stages of
Fused-MBConv blocks (one kxk conv expanding by the ratio, BN, SiLU, then a 1x1 project conv +
BN; ratio 1: a single kxk conv-BN-SiLU) then MBConv blocks (1x1 expand-BN-SiLU, kxk depthwise
conv-BN-SiLU, squeeze-and-excitation to input/4 channels with SiLU and a sigmoid gate, 1x1
project-BN); a residual add when a block keeps stride 1 and its channel count; a 1x1
conv-BN-SiLU head to 1280 channels, global average pool, Linear(1280, classes). BatchNorm eps
1e-3. Convs have no bias (each feeds a BN) except the SE's two 1x1 layers, written here as
Linear layers on the pooled vector (the same weights and FLOPs). Initialisation as
torchvision (convs and SE Kaiming-normal fan-out, classifier U(+-1/sqrt(classes)), zero
biases).

Adaptation to small images, and why:
- `stem="cifar"` (the default, registered as `efficientnetv2_s`): the stem conv has stride 1
  instead of 2, the usual CIFAR change for EfficientNets. The total stride drops from 32 to
  16, so a 32x32 image reaches the last stage at 2x2 (with stride 2 it would be 1x1, where a
  3x3 depthwise conv sees only its centre tap), and MNIST's 28x28 at 2x2 as well. A stride
  changes no parameter: the CIFAR model has exactly torchvision's weights except the head.
- `stem="imagenet"` keeps stride 2 (`efficientnetv2_s-imagenet`, or torchvision's network
  unchanged on CIFAR with `--model-opts stem=imagenet`).
- Stochastic depth (torchvision: 0.2, rising linearly over the blocks) and dropout before the
  classifier (0.2) are omitted: the training step carries no RNG, and neither changes the
  throughput or memory the study compares. Both regularise accuracy runs; expect slightly
  more overfitting on CIFAR than torchvision's recipe.
- Padding is PyTorch's symmetric (k-1)//2 (not XLA's "SAME"), so output sizes match
  torchvision for every input size.

FLOPs: 2 x multiply-accumulates of every conv (depthwise: k*k per output element), the SE's
two small layers and the classifier, x3 for training. Ignored: BN, SiLU, sigmoid, the SE's
pooling and gating multiply, residual adds, the loss. The forward is 2.85 GMACs at 224x224
and 8.37 at 384x384, the resolution torchvision evaluates these weights at and publishes
"8.37 GFLOPS" (MACs) for.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from models.layers import (KAIMING_FAN_OUT, ImageClassifier, batch_norm, check_choice, conv,
                           conv_flops, conv_out, linear)
from models.registry import register

# variant -> stages (fused?, expand ratio, kernel, stride, in, out, blocks), head channels.
# s/m/l are torchvision's tables; "toy" is not a published network: the CPU-test size, one
# block of each kind (fused without and with expansion, MBConv strided and residual).
_VARIANTS = {
    "s": ([(True, 1, 3, 1, 24, 24, 2), (True, 4, 3, 2, 24, 48, 4), (True, 4, 3, 2, 48, 64, 4),
           (False, 4, 3, 2, 64, 128, 6), (False, 6, 3, 1, 128, 160, 9),
           (False, 6, 3, 2, 160, 256, 15)], 1280),
    "m": ([(True, 1, 3, 1, 24, 24, 3), (True, 4, 3, 2, 24, 48, 5), (True, 4, 3, 2, 48, 80, 5),
           (False, 4, 3, 2, 80, 160, 7), (False, 6, 3, 1, 160, 176, 14),
           (False, 6, 3, 2, 176, 304, 18), (False, 6, 3, 1, 304, 512, 5)], 1280),
    "l": ([(True, 1, 3, 1, 32, 32, 4), (True, 4, 3, 2, 32, 64, 7), (True, 4, 3, 2, 64, 96, 7),
           (False, 4, 3, 2, 96, 192, 10), (False, 6, 3, 1, 192, 224, 19),
           (False, 6, 3, 2, 224, 384, 25), (False, 6, 3, 1, 384, 640, 7)], 1280),
    "toy": ([(True, 1, 3, 1, 8, 8, 1), (True, 4, 3, 2, 8, 16, 1), (False, 4, 3, 2, 16, 24, 1),
             (False, 6, 3, 1, 24, 24, 1)], 64),
}
_STEMS = ("cifar", "imagenet")
_EPS = 1e-3


def make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: round to a multiple of 8, never below 90% of v."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    fused: bool
    expand: int  # expanded channels
    kernel: int
    stride: int
    cin: int
    cout: int

    @property
    def squeeze(self) -> int:
        return max(1, self.cin // 4)

    @property
    def residual(self) -> bool:
        return self.stride == 1 and self.cin == self.cout


class ConvBN(nnx.Module):
    """Conv (no bias) - BN - optional SiLU, torchvision's Conv2dNormActivation."""

    def __init__(self, cin, cout, k, stride=1, groups=1, act=True, *, dtype, rngs):
        self.conv = conv(cin, cout, k, stride, groups=groups, dtype=dtype, rngs=rngs)
        self.bn = batch_norm(cout, epsilon=_EPS, dtype=dtype, rngs=rngs)
        self.act = act

    def __call__(self, x_BHWC):
        x_BHWC = self.bn(self.conv(x_BHWC))
        return nnx.silu(x_BHWC) if self.act else x_BHWC


class SqueezeExcite(nnx.Module):
    def __init__(self, c, squeeze, *, dtype, rngs):
        kw = dict(init=KAIMING_FAN_OUT, dtype=dtype, rngs=rngs)
        self.fc1 = linear(c, squeeze, **kw)
        self.fc2 = linear(squeeze, c, **kw)

    def __call__(self, x_BHWC):
        s_BC = self.fc2(nnx.silu(self.fc1(x_BHWC.mean(axis=(1, 2)))))
        return x_BHWC * nnx.sigmoid(s_BC)[:, None, None, :]


class Block(nnx.Module):
    """Fused-MBConv or MBConv, from its BlockSpec."""

    def __init__(self, s: BlockSpec, *, dtype, rngs):
        kw = dict(dtype=dtype, rngs=rngs)
        self.residual = s.residual
        layers = []
        if s.fused:
            if s.expand != s.cin:
                layers += [ConvBN(s.cin, s.expand, s.kernel, s.stride, **kw),
                           ConvBN(s.expand, s.cout, 1, act=False, **kw)]
            else:
                layers += [ConvBN(s.cin, s.cout, s.kernel, s.stride, **kw)]
        else:
            if s.expand != s.cin:
                layers.append(ConvBN(s.cin, s.expand, 1, **kw))
            layers += [ConvBN(s.expand, s.expand, s.kernel, s.stride, groups=s.expand, **kw),
                       SqueezeExcite(s.expand, s.squeeze, **kw),
                       ConvBN(s.expand, s.cout, 1, act=False, **kw)]
        self.layers = nnx.List(layers)

    def __call__(self, x_BHWC):
        y_BHWC = x_BHWC
        for layer in self.layers:
            y_BHWC = layer(y_BHWC)
        return y_BHWC + x_BHWC if self.residual else y_BHWC


class EfficientNetV2(nnx.Module):
    def __init__(self, cfg: "EfficientNetV2Config", *, dtype, rngs):
        kw = dict(dtype=dtype, rngs=rngs)
        specs = cfg.block_specs()
        self.stem = ConvBN(cfg.channels, specs[0].cin, 3, cfg.stem_stride, **kw)
        self.blocks = nnx.List(Block(s, **kw) for s in specs)
        self.head = ConvBN(specs[-1].cout, cfg.features, 1, **kw)
        init = nnx.initializers.variance_scaling(1 / 3, "fan_out", "uniform")
        self.classifier = linear(cfg.features, cfg.num_classes, init=init, **kw)

    def __call__(self, x_BHWC):
        x_BHWC = self.stem(x_BHWC)
        for block in self.blocks:
            x_BHWC = block(x_BHWC)
        x_BC = self.head(x_BHWC).mean(axis=(1, 2))
        return self.classifier(x_BC).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class EfficientNetV2Config(ImageClassifier):
    variant: str = "s"
    stem: str = "cifar"  # "cifar": stem stride 1; "imagenet": stride 2
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    family: str = "efficientnetv2"

    def validate(self) -> None:
        check_choice("efficientnetv2", "variant", self.variant, _VARIANTS)
        check_choice("efficientnetv2", "stem", self.stem, _STEMS)

    @property
    def stem_stride(self) -> int:
        return 1 if self.stem == "cifar" else 2

    @property
    def features(self) -> int:
        return _VARIANTS[self.variant][1]

    def block_specs(self) -> list[BlockSpec]:
        """Every block in order: a stage's first block takes its stride and input channels,
        the rest stride 1 from the stage's output channels (as torchvision builds them)."""
        self.validate()
        specs = []
        for fused, ratio, k, stride, cin, cout, count in _VARIANTS[self.variant][0]:
            for i in range(count):
                c = cin if i == 0 else cout
                specs.append(BlockSpec(fused, make_divisible(c * ratio), k,
                                       stride if i == 0 else 1, c, cout))
        return specs

    def build(self, rngs, dtype):
        self.validate()
        return EfficientNetV2(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        specs = self.block_specs()
        hw = conv_out(self.image_size, 3, self.stem_stride)
        forward = conv_flops(3, self.channels, specs[0].cin, hw)
        for s in specs:
            out = conv_out(hw, s.kernel, s.stride)
            if s.fused:
                if s.expand != s.cin:
                    forward += conv_flops(s.kernel, s.cin, s.expand, out)
                    forward += conv_flops(1, s.expand, s.cout, out)
                else:
                    forward += conv_flops(s.kernel, s.cin, s.cout, out)
            else:
                if s.expand != s.cin:
                    forward += conv_flops(1, s.cin, s.expand, hw)
                forward += conv_flops(s.kernel, s.expand, s.expand, out, groups=s.expand)
                forward += 2 * 2 * s.expand * s.squeeze
                forward += conv_flops(1, s.expand, s.cout, out)
            hw = out
        forward += conv_flops(1, specs[-1].cout, self.features, hw)
        forward += 2 * self.features * self.num_classes
        return 3.0 * forward


register("efficientnetv2_s", EfficientNetV2Config())
register("efficientnetv2_s-imagenet", EfficientNetV2Config(stem="imagenet", image_size=224,
                                                           num_classes=1000))
# CPU tests: 4 blocks of 8-24 channels covering every block kind, 64-channel head (~21K
# parameters).
register("efficientnetv2-tiny", EfficientNetV2Config(variant="toy"))
