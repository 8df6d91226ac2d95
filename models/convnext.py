"""ConvNeXt-Large (and Tiny, Small, Base): torchvision's `convnext_large`, 197,767,336
parameters at 224x224x3 with the 1000-class head.

Architecture as torchvision: a patchify stem (4x4 stride-4 conv with bias, LayerNorm); four
stages of (3, 3, 27, 3) blocks at 192/384/768/1536 channels, joined by LayerNorm + 2x2
stride-2 conv downsamplers; each block is a 7x7 depthwise conv (bias), LayerNorm, Linear(d,
4d), GELU (exact, erf), Linear(4d, d), a learned per-channel layer scale (initialised 1e-6)
and a residual add; then global average pool, LayerNorm, Linear(1536, classes). Every
LayerNorm has eps 1e-6. Initialisation as torchvision (conv and linear weights truncated
normal, std 0.02; zero biases).

Adaptation to small images, and why:
- `stem="cifar"` (the default, registered as `convnext_large`): the patchify stem is 2x2
  stride 2 instead of 4x4 stride 4 (still non-overlapping patches), so the total stride is 16
  instead of 32 and a 32x32 image runs the stages at 16, 8, 4 and 2 (MNIST's 28x28 at 14, 7,
  3, 1). With the ImageNet stem the last stage's three 1536-channel blocks would run on a 1x1
  map, where the 7x7 depthwise conv sees only its centre tap, and 28x28 would not fit at all
  (7-3-1-0); a stride-1 stem would cost 4x more again (~11 GMACs per 32x32 image, a third of
  ImageNet's cost) for no gain in fidelity. The smaller stem has 6,912 fewer weights
  (2*2*3*192 instead of 4*4*3*192).
- `stem="imagenet"` is torchvision's stem (`convnext_large-imagenet`, or torchvision's
  network unchanged on CIFAR with `--model-opts stem=imagenet`).
- Stochastic depth (torchvision: 0.5 for Large, rising linearly over the blocks) is omitted:
  the training step carries no RNG, and it does not change the throughput or memory the study
  compares. It regularises accuracy runs; expect more overfitting on CIFAR than with it.
- `channels` sets the stem's input channels (1 for MNIST).

The CPU-test size is registered as `convnext-toy`, not `convnext-tiny`: ConvNeXt-Tiny is a
published 28.6M-parameter network (`variant=tiny` here), and the two names would be confused.

FLOPs: 2 x multiply-accumulates of every conv (depthwise: 49 per output element) and linear
layer, x3 for training. Ignored: LayerNorms, GELU, layer scale, residual adds, pooling, the
loss. At 224 the forward is 34.4 GMACs, torchvision's published "34.36 GFLOPS".
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from models.layers import (ImageClassifier, check_choice, conv, conv_flops, conv_out, layer_norm,
                           linear)
from models.registry import register

# variant -> (stage-1 channels; stages double it), blocks per stage. "toy" is not a published
# network: the CPU-test size.
_VARIANTS = {"tiny": (96, (3, 3, 9, 3)), "small": (96, (3, 3, 27, 3)),
             "base": (128, (3, 3, 27, 3)), "large": (192, (3, 3, 27, 3)),
             "toy": (16, (1, 1, 1, 1))}
_STEMS = {"cifar": 2, "imagenet": 4}  # stem -> patch size (kernel = stride)
_EPS = 1e-6
_INIT = nnx.initializers.truncated_normal(0.02)
_LAYER_SCALE = 1e-6


def _norm(d, *, dtype, rngs):
    return layer_norm(d, epsilon=_EPS, dtype=dtype, rngs=rngs)


def _linear(a, b, *, dtype, rngs):
    return linear(a, b, init=_INIT, dtype=dtype, rngs=rngs)


class CNBlock(nnx.Module):
    def __init__(self, d, *, dtype, rngs):
        kw = dict(dtype=dtype, rngs=rngs)
        self.dwconv = conv(d, d, 7, groups=d, bias=True, init=_INIT, **kw)
        self.norm = _norm(d, **kw)
        self.up = _linear(d, 4 * d, **kw)
        self.down = _linear(4 * d, d, **kw)
        self.layer_scale = nnx.Param(jnp.full((d,), _LAYER_SCALE, jnp.float32))

    def __call__(self, x_BHWC):
        y_BHWC = self.down(nnx.gelu(self.up(self.norm(self.dwconv(x_BHWC))), approximate=False))
        return x_BHWC + y_BHWC * self.layer_scale[...].astype(y_BHWC.dtype)


class Downsample(nnx.Module):
    def __init__(self, cin, cout, *, dtype, rngs):
        self.norm = _norm(cin, dtype=dtype, rngs=rngs)
        self.conv = conv(cin, cout, 2, 2, padding=0, bias=True, init=_INIT, dtype=dtype,
                         rngs=rngs)

    def __call__(self, x_BHWC):
        return self.conv(self.norm(x_BHWC))


class ConvNeXt(nnx.Module):
    def __init__(self, cfg: "ConvNeXtConfig", *, dtype, rngs):
        kw = dict(dtype=dtype, rngs=rngs)
        dims, depths = cfg.dims, _VARIANTS[cfg.variant][1]
        p = cfg.patch
        self.stem = conv(cfg.channels, dims[0], p, p, padding=0, bias=True, init=_INIT, **kw)
        self.stem_norm = _norm(dims[0], **kw)
        layers = []
        for i, (d, n) in enumerate(zip(dims, depths)):
            if i > 0:
                layers.append(Downsample(dims[i - 1], d, **kw))
            layers += [CNBlock(d, **kw) for _ in range(n)]
        self.layers = nnx.List(layers)
        self.head_norm = _norm(dims[-1], **kw)
        self.classifier = _linear(dims[-1], cfg.num_classes, **kw)

    def __call__(self, x_BHWC):
        x_BHWC = self.stem_norm(self.stem(x_BHWC))
        for layer in self.layers:
            x_BHWC = layer(x_BHWC)
        x_BC = self.head_norm(x_BHWC.mean(axis=(1, 2)))
        return self.classifier(x_BC).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ConvNeXtConfig(ImageClassifier):
    variant: str = "large"
    stem: str = "cifar"  # "cifar": 2x2/2 patchify stem; "imagenet": 4x4/4
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    family: str = "convnext"

    def validate(self) -> None:
        check_choice("convnext", "variant", self.variant, _VARIANTS)
        check_choice("convnext", "stem", self.stem, _STEMS)
        self.check_fits(self.stage_sizes()[-1], f"the {self.stem} stem and 3 downsamplers")

    @property
    def patch(self) -> int:
        return _STEMS[self.stem]

    @property
    def dims(self) -> tuple[int, ...]:
        width = _VARIANTS[self.variant][0]
        return tuple(width * 2 ** i for i in range(4))

    def stage_sizes(self) -> list[int]:
        """Side of the map in each stage."""
        sizes = [conv_out(self.image_size, self.patch, self.patch, 0)]
        for _ in range(3):
            sizes.append(conv_out(sizes[-1], 2, 2, 0))
        return sizes

    def build(self, rngs, dtype):
        self.validate()
        return ConvNeXt(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        self.validate()
        dims, depths, sizes = self.dims, _VARIANTS[self.variant][1], self.stage_sizes()
        forward = conv_flops(self.patch, self.channels, dims[0], sizes[0])
        for i, (d, n, hw) in enumerate(zip(dims, depths, sizes)):
            if i > 0:
                forward += conv_flops(2, dims[i - 1], d, hw)
            block = conv_flops(7, d, d, hw, groups=d) + 2 * 2 * d * 4 * d * hw * hw
            forward += n * block
        forward += 2 * dims[-1] * self.num_classes
        return 3.0 * forward


register("convnext_large", ConvNeXtConfig())
register("convnext_large-imagenet", ConvNeXtConfig(stem="imagenet", image_size=224,
                                                   num_classes=1000))
# CPU tests: one block per stage at 16/32/64/128 channels (~0.23M parameters).
register("convnext-toy", ConvNeXtConfig(variant="toy"))
