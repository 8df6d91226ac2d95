"""ResNet-18/34/50: the BatchNorm model, i.e. the one with mutable state.

Two stems (`stem=`):
- "cifar": one 3x3 stride-1 conv (+ BN, ReLU), no max-pool, so 32x32 inputs keep 32x32
  activations into stage 1 and stage 4 still sees 4x4. 7,680 fewer weights than ImageNet's
  (3x3 instead of 7x7 filters on 3 channels).
- "imagenet": torchvision's 7x7 stride-2 conv (padding 3) + BN, ReLU + 3x3 stride-2 max-pool
  (padding 1); at 224x224x3 with 1000 classes the parameter count is torchvision's exactly
  (resnet18 11,689,512; resnet50 25,557,032; registered as `resnet18-imagenet`,
  `resnet50-imagenet`).
- "auto" (the default): "imagenet" at that reference shape (224x224x3, 1000 classes), else
  "cifar".
Downsampling is stride 2 at the first block of stages 2-4, with a 1x1 conv + BN
projection shortcut whenever the shape changes. Bottleneck blocks put the stride on the 3x3 conv
(torchvision's "v1.5").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxdist.errors import UsageError, choices
from models.layers import ImageClassifier, batch_norm, check_choice, conv_flops, conv_out, linear
from models.registry import register

# depth -> (bottleneck?, blocks per stage)
_LAYOUTS = {18: (False, (2, 2, 2, 2)), 34: (False, (3, 4, 6, 3)), 50: (True, (3, 4, 6, 3))}
_EXPANSION = 4  # bottleneck output channels / inner channels
_STEMS = ("auto", "cifar", "imagenet")
REFERENCE_SHAPE = (224, 3, 1000)  # torchvision's ImageNet models: image size, channels, classes


def _conv(cin, cout, k, stride, *, dtype, rngs, padding="SAME"):
    # XLA's "SAME" padding and flax's default init, unlike layers.conv (torchvision's): this
    # family predates the zoo and its numbers are pinned by tests. No bias: every conv is
    # followed by BN, whose shift makes a bias redundant.
    return nnx.Conv(cin, cout, (k, k), strides=stride, padding=padding, use_bias=False,
                    dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class Shortcut(nnx.Module):
    """Identity, or 1x1 conv + BN when stride or channel count changes."""

    def __init__(self, cin, cout, stride, *, dtype, rngs):
        self.project = stride != 1 or cin != cout
        if self.project:
            self.conv = _conv(cin, cout, 1, stride, dtype=dtype, rngs=rngs)
            self.bn = batch_norm(cout, dtype=dtype, rngs=rngs)

    def __call__(self, x_BHWC):
        return self.bn(self.conv(x_BHWC)) if self.project else x_BHWC


class Block(nnx.Module):
    """Basic block (two 3x3 convs) or bottleneck (1x1 reduce, 3x3, 1x1 expand)."""

    def __init__(self, cin, inner, stride, bottleneck, *, dtype, rngs):
        if bottleneck:
            cout = inner * _EXPANSION
            specs = [(cin, inner, 1, 1), (inner, inner, 3, stride), (inner, cout, 1, 1)]
        else:
            cout = inner
            specs = [(cin, inner, 3, stride), (inner, inner, 3, 1)]
        self.convs = nnx.List(_conv(a, b, k, s, dtype=dtype, rngs=rngs) for a, b, k, s in specs)
        self.bns = nnx.List(batch_norm(b, dtype=dtype, rngs=rngs) for _, b, _, _ in specs)
        self.shortcut = Shortcut(cin, cout, stride, dtype=dtype, rngs=rngs)

    def __call__(self, x_BHWC):
        y_BHWC = x_BHWC
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            y_BHWC = bn(conv(y_BHWC))
            if i < len(self.convs) - 1:  # the last ReLU comes after the residual add
                y_BHWC = nnx.relu(y_BHWC)
        return nnx.relu(y_BHWC + self.shortcut(x_BHWC))


class ResNet(nnx.Module):
    def __init__(self, cfg: "ResNetConfig", *, dtype, rngs):
        self.stem_pool = cfg.resolved_stem == "imagenet"
        if self.stem_pool:  # torchvision: Conv2d(3, 64, 7, stride=2, padding=3)
            self.stem = _conv(cfg.channels, cfg.width, 7, 2, padding=((3, 3), (3, 3)),
                              dtype=dtype, rngs=rngs)
        else:
            self.stem = _conv(cfg.channels, cfg.width, 3, 1, dtype=dtype, rngs=rngs)
        self.stem_bn = batch_norm(cfg.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(Block(cin, inner, stride, cfg.bottleneck, dtype=dtype, rngs=rngs)
                               for cin, inner, stride in cfg.block_specs())
        self.head = linear(cfg.features, cfg.num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x_BHWC):
        x_BHWC = nnx.relu(self.stem_bn(self.stem(x_BHWC)))
        if self.stem_pool:  # MaxPool2d(3, stride=2, padding=1), padding with -inf
            x_BHWC = nnx.max_pool(x_BHWC, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            x_BHWC = block(x_BHWC)
        x_BC = x_BHWC.mean(axis=(1, 2))
        return self.head(x_BC).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ResNetConfig(ImageClassifier):
    depth: int = 18
    width: int = 64
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    stem: str = "auto"  # "cifar", "imagenet", or "auto": imagenet at the reference shape
    family: str = "resnet"

    def validate(self) -> None:
        check_choice("resnet", "depth", self.depth, _LAYOUTS)
        if self.stem not in _STEMS:
            raise UsageError(f"resnet stem={self.stem!r}: choose from {choices(_STEMS)}")

    @property
    def resolved_stem(self) -> str:
        if self.stem != "auto":
            return self.stem
        shape = (self.image_size, self.channels, self.num_classes)
        return "imagenet" if shape == REFERENCE_SHAPE else "cifar"

    @property
    def bottleneck(self) -> bool:
        return _LAYOUTS[self.depth][0]

    @property
    def features(self) -> int:
        return self.width * 8 * (_EXPANSION if self.bottleneck else 1)

    def block_specs(self) -> list[tuple[int, int, int]]:
        """(input channels, inner channels, stride) of every block, in order."""
        self.validate()
        bottleneck, counts = _LAYOUTS[self.depth]
        specs, cin = [], self.width
        for stage, count in enumerate(counts):
            inner = self.width * 2 ** stage
            for i in range(count):
                specs.append((cin, inner, 2 if stage > 0 and i == 0 else 1))
                cin = inner * _EXPANSION if bottleneck else inner
        return specs

    def build(self, rngs, dtype):
        self.validate()
        return ResNet(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        self.validate()
        if self.resolved_stem == "imagenet":
            hw = conv_out(self.image_size, 7, 2)
            forward = conv_flops(7, self.channels, self.width, hw)
            hw = conv_out(hw, 3, 2)  # the max-pool (no FLOPs counted, as for every pool)
        else:
            hw = self.image_size
            forward = conv_flops(3, self.channels, self.width, hw)
        for cin, inner, stride in self.block_specs():
            out_hw = -(-hw // stride)  # SAME padding: ceil(hw / stride)
            if self.bottleneck:
                cout = inner * _EXPANSION
                forward += conv_flops(1, cin, inner, hw) + conv_flops(3, inner, inner, out_hw)
                forward += conv_flops(1, inner, cout, out_hw)
            else:
                cout = inner
                forward += (conv_flops(3, cin, inner, out_hw)
                            + conv_flops(3, inner, inner, out_hw))
            if stride != 1 or cin != cout:
                forward += conv_flops(1, cin, cout, out_hw)
            hw = out_hw
        forward += 2 * self.features * self.num_classes
        return 3.0 * forward


register("resnet18", ResNetConfig(depth=18, width=64))
register("resnet50", ResNetConfig(depth=50, width=64))
# torchvision's resnet18/resnet50 exactly (ImageNet stem, 224x224x3, 1000 classes).
register("resnet18-imagenet", ResNetConfig(depth=18, width=64, image_size=224,
                                           num_classes=1000))
register("resnet50-imagenet", ResNetConfig(depth=50, width=64, image_size=224,
                                           num_classes=1000))
# A BatchNorm model small enough for CPU tests (~0.18M params).
register("resnet-tiny", ResNetConfig(depth=18, width=8))
