"""VGG-16 (configuration "D", no BatchNorm): torchvision's `vgg16`, the classic 138,357,544
parameters at 224x224x3 with the 1000-class head.

Architecture as torchvision: thirteen 3x3 convs (padding 1, bias, ReLU) in five stages of
64/128/256/512/512 channels, each stage ending in a 2x2 stride-2 max-pool; an adaptive average
pool to 7x7; a classifier Linear(512*7*7, 4096) - ReLU - Linear(4096, 4096) - ReLU -
Linear(4096, classes). Initialisation as torchvision (convs Kaiming-normal fan-out, linears
N(0, 0.01), zero biases).

Adaptation to small images (CIFAR 32x32x3, MNIST 28x28x1), and why:
- The 7x7 adaptive pool and the 25088-4096-4096 classifier are KEPT. After five pools a
  32x32 image is 1x1x512, which the adaptive pool replicates to 7x7 (exactly what
  torchvision's `vgg16(num_classes=10)` does on CIFAR, the PyTorch setup Ovi 2025 most likely
  ran). The classifier holds 119.6M of the 134.3M parameters (10-class head): it is what makes
  VGG16 the communication- and memory-heavy model of the study, so a 512-512-10 "CIFAR VGG"
  (15M parameters) would measure a different DDP/FSDP trade-off. `pool=1,hidden=512` gives
  that variant when wanted.
- Max-pools round up (ceil mode, padding with -inf): identical to torchvision on 224 and 32
  (every pool halves an even size) and needed for MNIST, where floor pooling takes
  28-14-7-3-1-0; ceil gives 28-14-7-4-2-1.
- Dropout (p=0.5, twice in the classifier) is omitted: the training step carries no RNG, and
  the throughput/memory comparison does not depend on it.
- `channels` sets the first conv's input channels (1 for MNIST); nothing else changes.

FLOPs: 2 x multiply-accumulates of every conv and linear layer, x3 for training (forward +
backward). Ignored: biases, ReLUs, pooling (max and adaptive), the loss. At 224 the forward is
15.47 GMACs, torchvision's published "15.47 GFLOPS" (which counts MACs).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import ImageClassifier, check_choice, conv, conv_flops, linear
from models.registry import register

# depth -> convs per stage (torchvision configurations A, B, D, E)
_LAYOUTS = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}
_STAGE_WIDTHS = (1, 2, 4, 8, 8)  # x width


def adaptive_avg_pool(x_BHWC, out: int):
    """torch.nn.AdaptiveAvgPool2d(out): output cell i averages input rows
    floor(i*h/out) .. ceil((i+1)*h/out) - 1 (the same for columns)."""
    b, h, w, c = x_BHWC.shape
    if (h, w) == (out, out):
        return x_BHWC
    if (h, w) == (1, 1):  # every cell averages the one pixel (CIFAR and MNIST after 5 pools)
        return jnp.broadcast_to(x_BHWC, (b, out, out, c))

    def weights(n):
        m = np.zeros((out, n), np.float32)
        for i in range(out):
            lo, hi = (i * n) // out, -(-((i + 1) * n) // out)
            m[i, lo:hi] = 1.0 / (hi - lo)
        return jnp.asarray(m, x_BHWC.dtype)

    return jnp.einsum("bhwc,ph,qw->bpqc", x_BHWC, weights(h), weights(w))


class VGG(nnx.Module):
    def __init__(self, cfg: "VGGConfig", *, dtype, rngs):
        self.pool = cfg.pool
        self.convs = nnx.List(conv(a, b, 3, bias=True, dtype=dtype, rngs=rngs)
                              for a, b, _ in cfg.conv_specs())
        self.pool_after = tuple(last for _, _, last in cfg.conv_specs())
        dims = [cfg.features * cfg.pool ** 2, cfg.hidden, cfg.hidden, cfg.num_classes]
        init = nnx.initializers.normal(0.01)
        self.classifier = nnx.List(linear(a, b, init=init, dtype=dtype, rngs=rngs)
                                   for a, b in zip(dims[:-1], dims[1:]))

    def __call__(self, x_BHWC):
        for conv_, pool in zip(self.convs, self.pool_after):
            x_BHWC = nnx.relu(conv_(x_BHWC))
            if pool:
                x_BHWC = nnx.max_pool(x_BHWC, (2, 2), (2, 2), padding="SAME")  # ceil mode
        x_BHWC = adaptive_avg_pool(x_BHWC, self.pool)
        # Flatten channel-major, as torch.flatten on NCHW, so classifier rows line up.
        x_BD = x_BHWC.transpose(0, 3, 1, 2).reshape(x_BHWC.shape[0], -1)
        for i, layer in enumerate(self.classifier):
            x_BD = layer(x_BD)
            if i < len(self.classifier) - 1:
                x_BD = nnx.relu(x_BD)
        return x_BD.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class VGGConfig(ImageClassifier):
    depth: int = 16
    width: int = 64      # channels of stage 1; stages are width x (1, 2, 4, 8, 8)
    hidden: int = 4096   # classifier hidden width
    pool: int = 7        # side of the adaptive average pool before the classifier
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    family: str = "vgg"

    def validate(self) -> None:
        check_choice("vgg", "depth", self.depth, _LAYOUTS)

    @property
    def features(self) -> int:
        return self.width * _STAGE_WIDTHS[-1]

    def conv_specs(self) -> list[tuple[int, int, bool]]:
        """(input channels, output channels, max-pool after?) of every conv, in order."""
        self.validate()
        specs, cin = [], self.channels
        for count, mult in zip(_LAYOUTS[self.depth], _STAGE_WIDTHS):
            for i in range(count):
                specs.append((cin, self.width * mult, i == count - 1))
                cin = self.width * mult
        return specs

    def build(self, rngs, dtype):
        self.validate()
        return VGG(self, dtype=dtype, rngs=rngs)

    def flops_per_sample(self) -> float:
        hw, forward = self.image_size, 0
        for cin, cout, pool in self.conv_specs():
            forward += conv_flops(3, cin, cout, hw)
            if pool:
                hw = -(-hw // 2)
        dims = [self.features * self.pool ** 2, self.hidden, self.hidden, self.num_classes]
        forward += sum(2 * a * b for a, b in zip(dims[:-1], dims[1:]))
        return 3.0 * forward


register("vgg16", VGGConfig())
register("vgg16-imagenet", VGGConfig(image_size=224, num_classes=1000))
# CPU tests: the same 13 convs, 5 pools, adaptive pool and 3-layer classifier, 1/8 the
# channels and a 64-wide classifier (~0.44M parameters).
register("vgg-tiny", VGGConfig(width=8, hidden=64))
