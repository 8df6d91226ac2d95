"""Layouts by name. A layout is a pure function (abstract train state, mesh) -> a tree of
PartitionSpecs with the state's structure; it holds no training code.

The train state is a dict with three parts, so a layout can treat them differently:
`params` (trainable), `model_state` (non-trainable model variables, e.g. BatchNorm
statistics) and `opt` (optimizer state).
"""

from __future__ import annotations

from typing import Any, Callable

from jax.sharding import Mesh, PartitionSpec as P

from jaxdist.errors import UsageError, choices

Layout = Callable[[Any, Mesh], Any]
_LAYOUTS: dict[str, Layout] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register_layout(name: str, description: str):
    def wrap(fn: Layout) -> Layout:
        if name in _LAYOUTS:
            raise ValueError(f"layout {name!r} registered twice")
        _LAYOUTS[name] = fn
        _DESCRIPTIONS[name] = description
        return fn
    return wrap


def layout_names() -> list[str]:
    return sorted(_LAYOUTS)


def describe_layouts() -> str:
    return "; ".join(f"{name}: {_DESCRIPTIONS[name]}" for name in layout_names())


def get_layout(name: str) -> Layout:
    if name not in _LAYOUTS:
        raise UsageError(f"unknown layout {name!r}; choose from {choices(_LAYOUTS)}")
    return _LAYOUTS[name]


def batch_spec(mesh: Mesh) -> P:
    """Every layout shards the batch's leading dimension over all devices."""
    return P(tuple(mesh.axis_names))
