"""Flax NNX models behind a registry: `get_model(name)` -> config with build/batch/loss/FLOPs.

Importing the package imports every family module, and each registers its sizes.
"""

from models import convnext, densenet, efficientnet, gpt, llama, mlp, moe, resnet, vgg  # noqa: F401
from models.build import adapt_model, build_model
from models.registry import get_model, model_names, parse_overrides

__all__ = ["adapt_model", "build_model", "get_model", "model_names", "parse_overrides"]
