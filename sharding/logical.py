"""Logical axes for decoder parameters, and per-layout rules mapping them to mesh axes.

Both are data (the MaxText / Flax logical-axis idea): `LOGICAL` names each dimension of a
decoder parameter by (module, parameter) name; a layout's `RULES` entry maps those names to
mesh axes. A parameter's optimizer state (Adam's mu and nu) has the same path suffix and
shape, so it gets the same spec.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdist.errors import UsageError

# (module name or prefix, parameter name) -> one logical name (or None) per dimension.
LOGICAL = {
    ("tok", "embedding"): ("vocab", "embed"),
    ("pos", "embedding"): (None, "embed"),
    ("q", "kernel"): ("embed", "heads"), ("q", "bias"): ("heads",),
    ("k", "kernel"): ("embed", "heads"), ("k", "bias"): ("heads",),
    ("v", "kernel"): ("embed", "heads"), ("v", "bias"): ("heads",),
    ("out", "kernel"): ("heads", "embed"), ("out", "bias"): ("embed",),
    ("up", "kernel"): ("embed", "mlp"), ("up", "bias"): ("mlp",),
    ("gate", "kernel"): ("embed", "mlp"),
    ("down", "kernel"): ("mlp", "embed"), ("down", "bias"): ("embed",),
    ("ln", "scale"): ("embed",), ("ln", "bias"): ("embed",),
    ("head", "kernel"): ("embed", "vocab"), ("head", "bias"): ("vocab",),
    ("router", "kernel"): ("embed", None),
    ("moe", "up"): ("experts", "embed", "mlp"),
    ("moe", "gate"): ("experts", "embed", "mlp"),
    ("moe", "down"): ("experts", "mlp", "embed"),
}

RULES = {
    # Megatron: heads and MLP hidden split over `tensor` (column-parallel q/k/v/up,
    # row-parallel out/down, one all-reduce after each), vocabulary too; the rest replicated.
    "tp": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
    # 2-D (Go et al.'s TP8 + FSDP): the tp split, and the embedding dimension of every
    # parameter sharded over data and fsdp at once.
    "fsdp_tp": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                "embed": ("data", "fsdp")},
    # Expert parallel: each device of the `expert` axis holds whole experts; with a
    # `tensor` axis, Megatron's EP x TP: heads, every expert's hidden and the vocabulary
    # split over it as under tp.
    "ep": {"experts": "expert", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
}


def _names(path) -> list[str]:
    out = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name != "value":
            out.append(name)
    return out


def logical_axes(path) -> tuple | None:
    names = _names(path)
    if len(names) < 2:
        return None
    module, param = names[-2], names[-1]
    for (mod, par), axes in LOGICAL.items():
        if par == param and (module == mod or (mod == "ln" and module.startswith("ln"))):
            return axes
    return None


def rule_specs(state, mesh: Mesh, layout: str):
    """Specs for a decoder state under `RULES[layout]`; a dimension that the mesh axes do not
    divide stays whole. A leaf with no logical axes (not a decoder) is an error."""
    rules = RULES[layout]

    def spec(path, leaf):
        if not leaf.shape:
            return P()  # optimizer step counts
        axes = logical_axes(path)
        if axes is None or len(axes) != len(leaf.shape):
            where = "/".join(_names(path))
            raise UsageError(f"layout {layout!r} applies to decoder models (gpt, moe); "
                             f"parameter {where!r} has no logical axes")
        out = []
        for name, size in zip(axes, leaf.shape):
            target = rules.get(name)
            parts = (target,) if isinstance(target, str) else (target or ())
            parts = tuple(a for a in parts if mesh.shape.get(a, 1) > 1)
            n = math.prod(mesh.shape[a] for a in parts)
            out.append(None if not parts or size % n else
                       (parts[0] if len(parts) == 1 else parts))
        return P(*out)

    return jax.tree_util.tree_map_with_path(spec, state)
