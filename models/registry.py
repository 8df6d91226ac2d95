"""Model registry: name -> a frozen config that knows how to build, feed and score its model.

Every model family is one frozen dataclass implementing `ModelConfig`. Named sizes
(`gpt-tiny`, `resnet18`, ...) are instances each family module registers when it is
imported (`import models` imports them all); `--model-opts key=value,...` overrides fields
of the chosen size. This module imports no model file.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from jaxdist.errors import UsageError, choices, unknown


class ModelConfig(Protocol):
    family: str
    # What a real dataset's samples become for this model: "image" (image_size, channels and
    # num_classes follow the dataset), "vector" (flattened to in_dim), "tokens" (no image
    # dataset fits). See jaxdist.run_model.adapt_model.
    input_kind: str

    def build(self, rngs, dtype) -> Any:
        """An nnx.Module with float32 parameters computing in `dtype`."""

    def synthetic_batch(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """Random inputs and targets (never zeros) for `batch_size` samples."""

    def loss(self, model, batch) -> Any:
        """Mean training loss of `model` (in train mode) on `batch`, a float32 scalar."""

    def flops_per_sample(self) -> float:
        """Analytic training FLOPs per sample: forward + backward (3x forward)."""

    @property
    def tokens_per_sample(self) -> int:
        """Tokens per sample for token models, 0 otherwise."""


_REGISTRY: dict[str, ModelConfig] = {}


def register(name: str, config: ModelConfig) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} registered twice")
    _REGISTRY[name] = config


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def families(input_kind: str) -> list[str]:
    """The families, sorted, of the registered configs that read `input_kind` samples."""
    return sorted({c.family for c in _REGISTRY.values() if c.input_kind == input_kind})


def get_model(name: str, overrides: dict[str, str] | None = None) -> ModelConfig:
    """The registered config `name`, with `overrides` (strings, as typed on the CLI) applied."""
    if name not in _REGISTRY:
        raise UsageError(unknown("model", name, _REGISTRY))
    config = _REGISTRY[name]
    if not overrides:
        return config
    fields = {f.name: f for f in dataclasses.fields(config)
              if f.name != "family" and not f.metadata.get("set_by_the_layout")}
    changes = {}
    for key, text in overrides.items():
        if key not in fields:
            raise UsageError(
                f"model {name!r} has no option {key!r}; choose from {choices(fields)}")
        changes[key] = _option_value(key, text, getattr(config, key))
    new = dataclasses.replace(config, **changes)
    check = getattr(new, "validate", None)
    if check:
        check()
    return new


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _option_value(key: str, text: str, current):
    """`text` as the type of the option's current value: a bool is one of _BOOLS (any other
    word was read as False), a number is finite and positive."""
    if isinstance(current, bool):
        if text.lower() not in _BOOLS:
            raise UsageError(f"model option {key}={text!r} is not a bool; give true or false")
        return _BOOLS[text.lower()]
    try:
        value = type(current)(text)
    except ValueError:
        raise UsageError(
            f"model option {key}={text!r} is not a valid {type(current).__name__}") from None
    if isinstance(value, (int, float)) and not (0 < value < math.inf):
        raise UsageError(f"model option {key}={text!r} must be a positive, finite number")
    return value


def parse_overrides(text: str) -> dict[str, str]:
    """`depth=2,width=64` -> {'depth': '2', 'width': '64'}."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"--model-opts item {item!r} is not key=value (e.g. depth=2,width=64)")
        key = key.strip().replace("-", "_")
        if key in out:
            raise UsageError(f"--model-opts gives {key} twice ({out[key]} and "
                             f"{value.strip()}); give each option once")
        out[key] = value.strip()
    return out

