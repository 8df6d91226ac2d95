"""A plain MLP classifier: the cheapest model that still has matmuls worth sharding."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import classifier_loss, linear, teacher_labels
from models.registry import register


class MLP(nnx.Module):
    def __init__(self, in_dim: int, width: int, depth: int, num_classes: int, *, dtype, rngs):
        dims = [in_dim] + [width] * depth
        self.hidden = nnx.List(linear(a, b, dtype=dtype, rngs=rngs)
                               for a, b in zip(dims[:-1], dims[1:]))
        self.head = linear(dims[-1], num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x_BD):
        x_BD = x_BD.reshape(x_BD.shape[0], -1)  # images (a real dataset) arrive unflattened
        for layer in self.hidden:
            x_BD = nnx.relu(layer(x_BD))
        return self.head(x_BD).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    in_dim: int = 784
    width: int = 512
    depth: int = 2
    num_classes: int = 10
    family: str = "mlp"
    # A dataset's images arrive flattened to in_dim (jaxdist.run_model.adapt_model).
    input_kind: ClassVar[str] = "vector"

    def build(self, rngs, dtype):
        return MLP(self.in_dim, self.width, self.depth, self.num_classes, dtype=dtype, rngs=rngs)

    def synthetic_batch(self, rng: np.random.Generator, batch_size: int):
        x_BD = rng.standard_normal((batch_size, self.in_dim), dtype=np.float32)
        return {"x": x_BD, "y": teacher_labels(x_BD, self.num_classes)}

    def loss(self, model, batch):
        return classifier_loss(model, batch)

    def flops_per_sample(self) -> float:
        dims = [self.in_dim] + [self.width] * self.depth + [self.num_classes]
        forward = sum(2 * a * b for a, b in zip(dims[:-1], dims[1:]))
        return 3.0 * forward

    @property
    def tokens_per_sample(self) -> int:
        return 0


register("mlp-tiny", MLPConfig(in_dim=32, width=64, depth=2))
register("mlp", MLPConfig())
register("mlp-small", MLPConfig())
# The 10.6M-parameter MLP the PyTorch/JAX CPU probes in shared/notes used.
register("mlp-10m", MLPConfig(in_dim=1024, width=2048, depth=3))
