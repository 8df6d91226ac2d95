"""DenseNet-121 (and 169/201): torchvision's `densenet121`, 7,978,856 parameters at
224x224x3 with the 1000-class head.

Architecture as torchvision: growth rate 32, bottleneck width 4 x 32, blocks of (6, 12, 24,
16) dense layers, each BN-ReLU-Conv1x1(-> 128)-BN-ReLU-Conv3x3(-> 32) whose output is
concatenated to its input; between blocks a transition BN-ReLU-Conv1x1 (halving channels) -
AvgPool 2x2/2 (floor); after the last block BN, ReLU, global average pool, Linear(1024,
classes). Convs have no bias (each feeds or follows a BN). Initialisation as torchvision
(convs Kaiming-normal fan-in, BN 1/0, classifier PyTorch's default U(+-1/sqrt(1024)) with
bias 0).

Adaptation to small images, and why:
- `stem="cifar"` (the default, registered as `densenet121`): the 7x7/2 conv + 3x3/2 max-pool
  stem becomes one 3x3 stride-1 conv (still followed by BN-ReLU) and no pool, the DenseNet
  paper's own CIFAR stem. 32x32 inputs then reach the blocks at 32x32 and the last block runs
  at 4x4 (ImageNet's 224 reaches it at 7x7); the ImageNet stem would leave 1x1 in the last
  block at 32 and cannot take 28x28 at all (28-14-7-3-1-0). Cost: 7,680 fewer stem weights
  (3*3 vs 7*7 per filter on 3 channels).
- `stem="imagenet"` is torchvision's stem, for the reference count (`densenet121-imagenet`)
  or for running torchvision's network unchanged on CIFAR (`--model-opts stem=imagenet`).
- `channels` sets the stem's input channels (1 for MNIST); MNIST's 28x28 runs the blocks at
  28, 14, 7 and 3.
- Dropout: torchvision's default drop_rate is 0, so there is nothing to omit.

FLOPs: 2 x multiply-accumulates of every conv and the classifier, x3 for training. Ignored:
BN, ReLU, pooling, concatenation, the loss. At 224 the forward is 2.83 GMACs, torchvision's
published "2.83 GFLOPS".
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from models.layers import (KAIMING_FAN_IN, TORCH_LINEAR, ImageClassifier, batch_norm,
                           check_choice, conv, conv_flops, conv_out, linear)
from models.registry import register

# depth -> dense layers per block (depth = 2 x layers + 5). 15 is not a published DenseNet:
# the CPU-test size (two chained dense layers, then one per block after each transition).
_LAYOUTS = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32), 15: (2, 1, 1, 1)}
_STEMS = ("cifar", "imagenet")


class DenseLayer(nnx.Module):
    def __init__(self, cin, growth, bn_size, *, dtype, rngs):
        inner = bn_size * growth
        self.norm1 = batch_norm(cin, dtype=dtype, rngs=rngs)
        self.conv1 = conv(cin, inner, 1, init=KAIMING_FAN_IN, dtype=dtype, rngs=rngs)
        self.norm2 = batch_norm(inner, dtype=dtype, rngs=rngs)
        self.conv2 = conv(inner, growth, 3, init=KAIMING_FAN_IN, dtype=dtype, rngs=rngs)

    def __call__(self, x_BHWC):
        y_BHWC = self.conv1(nnx.relu(self.norm1(x_BHWC)))
        y_BHWC = self.conv2(nnx.relu(self.norm2(y_BHWC)))
        return jnp.concatenate([x_BHWC, y_BHWC], axis=-1)


class Transition(nnx.Module):
    def __init__(self, cin, cout, *, dtype, rngs):
        self.norm = batch_norm(cin, dtype=dtype, rngs=rngs)
        self.conv = conv(cin, cout, 1, init=KAIMING_FAN_IN, dtype=dtype, rngs=rngs)

    def __call__(self, x_BHWC):
        x_BHWC = self.conv(nnx.relu(self.norm(x_BHWC)))
        return nnx.avg_pool(x_BHWC, (2, 2), (2, 2))  # floor, as torch AvgPool2d(2, 2)


class DenseNet(nnx.Module):
    def __init__(self, cfg: "DenseNetConfig", *, dtype, rngs):
        k = 3 if cfg.stem == "cifar" else 7
        stride = 1 if cfg.stem == "cifar" else 2
        self.stem_pool = cfg.stem == "imagenet"
        self.conv0 = conv(cfg.channels, cfg.init_features, k, stride, init=KAIMING_FAN_IN,
                          dtype=dtype, rngs=rngs)
        self.norm0 = batch_norm(cfg.init_features, dtype=dtype, rngs=rngs)
        layers = []
        for dense, cin, cout in cfg.layer_specs():
            if dense:
                layers.append(DenseLayer(cin, cfg.growth, cfg.bn_size, dtype=dtype, rngs=rngs))
            else:
                layers.append(Transition(cin, cout, dtype=dtype, rngs=rngs))
        self.layers = nnx.List(layers)
        self.norm5 = batch_norm(cfg.features, dtype=dtype, rngs=rngs)
        self.classifier = linear(cfg.features, cfg.num_classes, init=TORCH_LINEAR, dtype=dtype,
                                 rngs=rngs)

    def __call__(self, x_BHWC):
        x_BHWC = nnx.relu(self.norm0(self.conv0(x_BHWC)))
        if self.stem_pool:  # max-pool 3x3/2, padding 1 (with -inf)
            x_BHWC = nnx.max_pool(x_BHWC, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        for layer in self.layers:
            x_BHWC = layer(x_BHWC)
        x_BC = nnx.relu(self.norm5(x_BHWC)).mean(axis=(1, 2))
        return self.classifier(x_BC).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class DenseNetConfig(ImageClassifier):
    depth: int = 121
    growth: int = 32
    init_features: int = 64
    bn_size: int = 4     # bottleneck width = bn_size x growth
    stem: str = "cifar"  # "cifar": 3x3/1 conv, no pool; "imagenet": 7x7/2 conv + max-pool
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    family: str = "densenet"

    def validate(self) -> None:
        check_choice("densenet", "depth", self.depth, _LAYOUTS)
        check_choice("densenet", "stem", self.stem, _STEMS)
        self.check_fits(self.spatial_sizes()[-1], f"the {self.stem} stem and 3 transitions")

    def layer_specs(self) -> list[tuple[bool, int, int]]:
        """(dense?, input channels, output channels) of every dense layer (its output is the
        `growth` new channels it concatenates) and transition (output: half its input), in
        order."""
        check_choice("densenet", "depth", self.depth, _LAYOUTS)
        specs, c = [], self.init_features
        blocks = _LAYOUTS[self.depth]
        for b, count in enumerate(blocks):
            for _ in range(count):
                specs.append((True, c, self.growth))
                c += self.growth
            if b < len(blocks) - 1:
                specs.append((False, c, c // 2))
                c //= 2
        return specs

    @property
    def features(self) -> int:
        """Channels after the last block."""
        dense, cin, cout = self.layer_specs()[-1]
        return cin + cout if dense else cout

    def spatial_sizes(self) -> list[int]:
        """Side of the map entering each block."""
        if self.stem == "cifar":
            hw = conv_out(self.image_size, 3)
        else:
            hw = conv_out(conv_out(self.image_size, 7, 2), 3, 2)
        sizes = [hw]
        for _ in range(len(_LAYOUTS[self.depth]) - 1):
            sizes.append(sizes[-1] // 2)
        return sizes

    def build(self, rngs, dtype):
        self.validate()
        return DenseNet(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        self.validate()
        if self.stem == "cifar":
            forward = conv_flops(3, self.channels, self.init_features, self.image_size)
        else:
            forward = conv_flops(7, self.channels, self.init_features,
                                 conv_out(self.image_size, 7, 2))
        sizes = iter(self.spatial_sizes())
        hw = next(sizes)
        inner = self.bn_size * self.growth
        for dense, cin, cout in self.layer_specs():
            if dense:
                forward += conv_flops(1, cin, inner, hw) + conv_flops(3, inner, cout, hw)
            else:  # transition: the 1x1 conv runs before the pool
                forward += conv_flops(1, cin, cout, hw)
                hw = next(sizes)
        forward += 2 * self.features * self.num_classes
        return 3.0 * forward


register("densenet121", DenseNetConfig())
register("densenet121-imagenet", DenseNetConfig(stem="imagenet", image_size=224,
                                                num_classes=1000))
# CPU tests: blocks of 2, 1, 1, 1 dense layers, growth 8, 16 stem channels (~16K parameters).
register("densenet-tiny", DenseNetConfig(depth=15, growth=8, init_features=16))
