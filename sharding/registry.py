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
_MESH_AXES: dict[str, tuple[str, ...]] = {}
_FAMILIES: dict[str, tuple[str, ...] | None] = {}


def register_layout(name: str, description: str, mesh_axes=("data", "fsdp"), families=None):
    """`mesh_axes`: the axes the layout gives meaning to (others must have size 1);
    `families`: the model families it applies to (None: all)."""
    def wrap(fn: Layout) -> Layout:
        if name in _LAYOUTS:
            raise ValueError(f"layout {name!r} registered twice")
        _LAYOUTS[name] = fn
        _DESCRIPTIONS[name] = description
        _MESH_AXES[name] = tuple(mesh_axes)
        _FAMILIES[name] = tuple(families) if families else None
        return fn
    return wrap


def check_layout(name: str, axis_sizes: dict[str, int], family: str) -> None:
    """A one-line error when the layout cannot use this mesh or model."""
    extra = [f"{a}={n}" for a, n in axis_sizes.items() if n > 1 and a not in _MESH_AXES[name]]
    if extra:
        fits = [other for other in layout_names()
                if all(a in _MESH_AXES[other] for a, n in axis_sizes.items() if n > 1)]
        raise UsageError(f"layout {name!r} uses mesh axes {', '.join(_MESH_AXES[name])}; the "
                         f"mesh has {', '.join(extra)} (layouts for this mesh: "
                         f"{choices(fits) or 'none'})")
    families = _FAMILIES[name]
    if families and family not in families:
        raise UsageError(f"layout {name!r} applies to {', '.join(families)} models, not "
                         f"{family!r}")


def layout_names() -> list[str]:
    return sorted(_LAYOUTS)


def describe_layouts() -> str:
    return "; ".join(f"{name}: {_DESCRIPTIONS[name]}" for name in layout_names())


def get_layout(name: str) -> Layout:
    if name not in _LAYOUTS:
        raise UsageError(f"unknown layout {name!r}; choose from {choices(_LAYOUTS)}")
    return _LAYOUTS[name]


def batch_spec(mesh: Mesh) -> P:
    """The batch's leading dimension is sharded over every axis but `tensor` (a tensor-
    parallel group works on the same rows): over all devices when there is no tensor axis."""
    return P(tuple(a for a in mesh.axis_names if a != "tensor"))
