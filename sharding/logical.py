"""Logical axes for decoder parameters and activations, and the rules mapping them to mesh
axes.

All of it is data (the MaxText / Flax logical-axis idea): `LOGICAL` names each dimension of a
decoder parameter by (module, parameter) name; a layout's `RULES` entry maps those names to
mesh axes. A parameter's optimizer state (Adam's mu and nu) has the same path suffix and
shape, so it gets the same spec. `ACTIVATION_RULES` maps the activations' logical names
(MaxText's `activation_batch`, `activation_embed`, ...) to mesh axes; the decoders pin their
activations with them (models/layers.py `constrain`).
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
    # FP8 delayed scaling (models/fp8.py): a per-tensor amax history of each matmul's input,
    # weight and output gradient, whole on every device (its amaxes are the whole tensor's)
    **{(scales, history): (None,) for scales in ("fp8", "fp8_gate", "fp8_up", "fp8_down")
       for history in ("x_history", "w_history", "g_history")},
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


# Activations under the tensor layouts (tp, fsdp_tp, ep x tp, tp_pp: the mesh has a tensor
# axis) and under context parallelism (a context axis): the batch over the data axes (every
# axis but tensor, stage and context, as the batch itself), the sequence over context
# (models/context.py: each device holds its own tokens; attention gathers the keys and
# values), and over tensor too in sequence-parallel regions, heads, MLP hidden and
# vocabulary over tensor, the embedding dimension whole. Pinned so, a weight whose embed
# dimension is sharded over data/fsdp (fsdp_tp) is all-gathered for its matmul and its
# gradient reduce-scattered there (torchtitan's FSDP2 x TP); without them XLA's partitioner
# may reshard the activations over data instead (an all-to-all of activations across nodes).
ACTIVATION_RULES = {
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": "context",
    "activation_norm_length": ("context", "tensor"),  # Megatron sequence parallel
    "activation_embed": None,
    "activation_heads": "tensor",
    "activation_kv_heads": "tensor",
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
}
# The mesh axes whose presence (size > 1, not manual) makes the activation rules apply; the
# data-parallel layouts leave activations to the batch's own sharding.
ACTIVATION_RULES_AXES = ("tensor", "context")


def activation_spec(shape, names) -> P | None:
    """The PartitionSpec pinning an activation of `shape` whose dimensions have the logical
    `names` (ACTIVATION_RULES), on the ambient mesh; None where no rule applies (no mesh, no
    free tensor or context axis, e.g. inside sequence parallel's shard_map). Mesh axes that
    are absent,
    of size 1 or manual drop out; a dimension the remaining axes do not divide is left to
    the partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or len(shape) != len(names):
        return None
    manual = set(mesh.manual_axes)
    if all(mesh.shape.get(a, 1) == 1 or a in manual for a in ACTIVATION_RULES_AXES):
        return None
    out = []
    for name, size in zip(names, shape):
        target = ACTIVATION_RULES[name] if name else None
        parts = (target,) if isinstance(target, str) else (target or ())
        parts = tuple(a for a in parts if mesh.shape.get(a, 1) > 1 and a not in manual)
        if not parts:
            out.append(None)
        elif size % math.prod(mesh.shape[a] for a in parts):
            out.append(P.UNCONSTRAINED)
        else:
            out.append(parts[0] if len(parts) == 1 else parts)
    return P(*out)


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


# A logical dimension a rule splits but the mesh does not divide is split anyway, stored
# padded (sharding/padding.py), where padding is what the anchors do: the vocabulary (Megatron
# pads it to a multiple of the tensor size; gpt3-175b's 50257 is odd) and the embedding
# dimension FSDP splits (FSDP2 pads). Heads, MLP hidden and experts are the model's structure:
# a tensor or expert axis that does not divide them is an error, as in Megatron.
MAY_PAD = ("vocab", "embed")


def leaf_rule_spec(path, shape, mesh_shape: dict[str, int], layout: str,
                   bad: list | None = None) -> P:
    """The spec of one decoder leaf under `RULES[layout]`; a dimension the rule's mesh axes
    do not divide (and may not be padded) is appended to `bad` and left whole."""
    axes = logical_axes(path)
    if axes is None or len(axes) != len(shape):
        where = "/".join(_names(path))
        raise UsageError(f"layout {layout!r} applies to decoder models (gpt, moe); "
                         f"parameter {where!r} has no logical axes")
    rules = RULES[layout]
    out = []
    for name, size in zip(axes, shape):
        target = rules.get(name)
        parts = (target,) if isinstance(target, str) else (target or ())
        parts = tuple(a for a in parts if mesh_shape.get(a, 1) > 1)
        n = math.prod(mesh_shape[a] for a in parts)
        if parts and size % n and name not in MAY_PAD:
            if bad is not None:
                bad.append(("/".join(_names(path)), name, size, parts))
            out.append(None)
        else:
            out.append(None if not parts else (parts[0] if len(parts) == 1 else parts))
    return P(*out)


def rule_specs(state, mesh: Mesh, layout: str):
    """Specs for a decoder state under `RULES[layout]`. A leaf with no logical axes (not a
    decoder) is an error; so is a dimension the rule's mesh axes do not divide (one line:
    the dimension, its size, the axes' product and a mesh that works), but the vocabulary and
    the embedding dimension, which are padded."""
    bad: list[tuple[str, str, int, tuple[str, ...]]] = []
    shape = dict(mesh.shape)

    def spec(path, leaf):
        if not leaf.shape:
            return P()  # optimizer step counts
        return leaf_rule_spec(path, tuple(leaf.shape), shape, layout, bad)

    specs = jax.tree_util.tree_map_with_path(spec, state)
    if bad:
        raise_indivisible(bad, shape, layout)
    return specs


def raise_indivisible(bad, mesh_shape: dict[str, int], layout: str):
    """One line for the first leaf of `bad` (a parameter named rather than its optimizer
    state): the dimension, its size, the axes and a mesh that divides it."""
    where, name, size, parts = min(bad, key=lambda b: not b[0].startswith("params/"))
    sizes = {b[2] for b in bad if b[1] == name}
    axes = " x ".join(f"{a}={mesh_shape[a]}" for a in parts)
    if len(parts) > 1:
        axes += f" = {math.prod(mesh_shape[a] for a in parts)}"
    raise UsageError(f"layout {layout!r} splits the {name} dimension ({where.split('/', 1)[-1]}"
                     f": {size}) over {axes}, which does not divide it; "
                     f"{_working_mesh(mesh_shape, parts, sizes)}")


def _working_mesh(mesh_shape: dict[str, int], parts: tuple[str, ...], sizes: set[int]) -> str:
    """A mesh like `mesh_shape` whose `parts` axes together divide every size in `sizes`:
    their product cut to the largest such divisor (inner axes kept where they divide it)."""
    n = math.prod(mesh_shape[a] for a in parts)
    d = max(k for k in range(1, n + 1) if all(s % k == 0 for s in sizes))
    if d == 1:
        return f"no {' x '.join(parts)} size above 1 divides it"
    new = dict(mesh_shape)
    left = d
    for a in reversed(parts):  # inner first: fsdp stays inside a host where it can
        new[a] = math.gcd(mesh_shape[a], left)
        left //= new[a]
    new[parts[0]] *= left
    named = ",".join(f"{a}:{k}" for a, k in new.items() if k > 1 or a == "data")
    return f"e.g. --mesh {named}"
