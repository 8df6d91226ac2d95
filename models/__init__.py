"""Flax NNX models behind a registry: `get_model(name)` -> config with build/batch/loss/FLOPs.

Importing the package imports every family module, and each registers its sizes.
"""

from models import tracing  # noqa: F401  (first: model builds under a trace)
from models import convnext, densenet, efficientnet, gpt, llama, mlp, moe, resnet, vgg  # noqa: F401
from models.registry import get_model, model_names, parse_overrides

__all__ = ["get_model", "model_names", "parse_overrides"]
