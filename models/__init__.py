"""Flax NNX models behind a registry: `get_model(name)` -> config with build/batch/loss/FLOPs."""

from models.registry import get_model, model_names, parse_overrides

__all__ = ["get_model", "model_names", "parse_overrides"]
