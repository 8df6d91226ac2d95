"""FP8 matmuls as Transformer Engine runs them: operands quantized to float8_e4m3fn in the
forward, the output gradient to float8_e5m2 in the backward (TE's HYBRID format), each with
a per-tensor float32 scale; everything else stays in the compute dtype (bfloat16).

A scale s maps a tensor x to q = clip(x / s) in FP8 and back to q * s, with
s = amax / FP8_MAX (1 where amax is 0 or not finite), TE's recipe with margin 0:

- `current` scaling (torchtitan's and Megatron-Bridge's FP8-CS): amax of the tensor itself,
  each call. No state.
- `delayed` scaling (TE's DelayedScaling, its default): amax the largest of the last
  AMAX_HISTORY calls' amaxes, recorded before this call's own is added. The histories are
  model variables (`Fp8History`, `Fp8GradHistory`) of the train state's `model_state`:
  placed by the layout, checkpointed and resumed with it. The forward operands' histories
  are updated in the forward; the output gradient's only exists in the backward, so the
  backward hands its amax out as the cotangent of its history (slot 0, zeros elsewhere;
  where a layer runs k times in one step the slot holds the sum of the k amaxes, an upper
  bound of their largest) and `value_and_grad` rolls it into the history.

The dot itself is `lax.dot_general` on the FP8 operands with bfloat16 output, then scaled:
XLA:GPU makes one cuBLASLt FP8 GEMM of it on Hopper and newer, XLA:CPU runs it as written.
The quantized operands are what the backward keeps (TE's FP8 activation copies).

A step that runs the same weights on many micro-batches quantizes each weight once (TE's
FP8 weight cache, its `is_first_microbatch`): `quantize_weights` gives every FP8 matmul's
weight of a module quantized as its forward would (current scaling: the scale is the
weight's own amax, so the copy is the very tensor each call would make), and inside
`quantized_weights` the matmuls read that copy instead of quantizing. The weight's gradient
still goes to the weight itself (straight through the quantization, as without the copy).
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import dot_general_transpose_lhs, dot_general_transpose_rhs

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
SCALINGS = ("delayed", "current")
AMAX_HISTORY = 1024  # TE's DelayedScaling amax_history_len (and flax's, MaxText's)


class Fp8History(nnx.Variable):
    """A forward operand's amax history (delayed scaling), newest first."""


class Fp8GradHistory(nnx.Variable):
    """An output gradient's amax history (delayed scaling), newest first; its new value
    comes out of the backward (value_and_grad)."""


def _max(dtype):
    return jnp.finfo(dtype).max.astype(jnp.float32)


def scale_of(amax, dtype):
    """The dequantization scale for a tensor of largest magnitude `amax`."""
    amax = amax.astype(jnp.float32)
    # amax < inf, not isfinite: XLA:GPU fuses the compare into the quantizing kernel, and
    # ran is-finite as a kernel of its own (NaN fails both comparisons)
    ok = (amax > 0) & (amax < jnp.inf)
    return jnp.where(ok, amax / _max(dtype), 1.0)


def amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def quantize(x, scale, dtype):
    m = _max(dtype).astype(x.dtype)
    return jnp.clip(x / scale.astype(x.dtype), -m, m).astype(dtype)


def roll_in(history, value):
    """`history` with `value` as its newest entry, the oldest dropped (one concatenate: a
    roll and a set were two kernels per history on XLA:GPU)."""
    return jnp.concatenate([jnp.reshape(value, (1,)).astype(history.dtype), history[:-1]])


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fp8_dot(x, w, qw, sx, sw, g_history, dims, out_dtype):
    """x . w in FP8, `qw` being w quantized with scale `sw`: the forward reads qw, w only
    takes the weight gradient (w itself is not read, so not kept)."""
    qx = quantize(x, sx, E4M3)
    y = jax.lax.dot_general(qx, qw, dims, preferred_element_type=out_dtype)
    return y * (sx * sw).astype(out_dtype)


def _fp8_dot_fwd(x, w, qw, sx, sw, g_history, dims, out_dtype):
    qx = quantize(x, sx, E4M3)
    y = jax.lax.dot_general(qx, qw, dims, preferred_element_type=out_dtype)
    return y * (sx * sw).astype(out_dtype), (qx, qw, sx, sw, g_history)


def _fp8_dot_bwd(dims, out_dtype, res, g):
    qx, qw, sx, sw, g_history = res
    g_amax = amax(g)
    # delayed: the history's largest (before this step's); current: a history of None
    sg = scale_of(g_amax if g_history is None else jnp.max(g_history), E5M2)
    qg = quantize(g, sg, E5M2)
    dx = dot_general_transpose_lhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                   preferred_element_type=out_dtype)
    dw = dot_general_transpose_rhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                   preferred_element_type=out_dtype)
    dx = dx * (sg * sw).astype(out_dtype)
    dw = dw * (sg * sx).astype(out_dtype)
    g_cot = None if g_history is None else jnp.zeros_like(g_history).at[0].set(g_amax)
    return dx, dw, None, jnp.zeros_like(sx), jnp.zeros_like(sw), g_cot


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


class Fp8Scales(nnx.Module):
    """The scaling of one matmul's operands: `dot_general(x, w, dims)` in FP8 (e4m3 forward,
    e5m2 output gradient), output in x's dtype. Delayed scaling holds three amax histories
    (input, weight, output gradient); current scaling none. `weight`: the attribute of the
    module that owns these scales holding the weight they scale, `dtype` the compute dtype
    it is cast to first (what `quantize_weights` reads)."""

    def __init__(self, scaling: str, history: int = AMAX_HISTORY, weight: str | None = None,
                 dtype=None):
        if scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling {scaling!r}: one of {SCALINGS}")
        self.scaling = scaling
        self.weight, self.dtype = weight, dtype
        if scaling == "delayed":
            self.x_history = Fp8History(jnp.zeros((history,), jnp.float32))
            self.w_history = Fp8History(jnp.zeros((history,), jnp.float32))
            self.g_history = Fp8GradHistory(jnp.zeros((history,), jnp.float32))

    def dot_general(self, x, w, dims):
        w = w.astype(x.dtype)
        copy = getattr(_QUANTIZED, "table", {}).get(id(self))
        if copy is not None:  # quantized once for the step (quantized_weights)
            qw, sw = copy
            if qw.shape != w.shape or x.dtype != self.dtype:
                raise ValueError(f"the FP8 copy of a {w.shape} {x.dtype} weight is "
                                 f"{qw.shape} from {self.dtype}")
            sx = jax.lax.stop_gradient(scale_of(amax(x), E4M3))
            return _fp8_dot(x, w, qw, sx, sw, None, dims, x.dtype)
        if self.scaling == "current":
            sx, sw, gh = scale_of(amax(x), E4M3), scale_of(amax(w), E4M3), None
        else:
            xh, wh = self.x_history[...], self.w_history[...]
            sx, sw = scale_of(jnp.max(xh), E4M3), scale_of(jnp.max(wh), E4M3)
            self.x_history[...] = roll_in(xh, jax.lax.stop_gradient(amax(x)))
            self.w_history[...] = roll_in(wh, jax.lax.stop_gradient(amax(w)))
            gh = self.g_history[...]
        sx, sw = jax.lax.stop_gradient(sx), jax.lax.stop_gradient(sw)
        qw = quantize(jax.lax.stop_gradient(w), sw, E4M3)
        return _fp8_dot(x, w, qw, sx, sw, gh, dims, x.dtype)


# ---- each weight quantized once for many calls (TE's FP8 weight cache) -----------------

_QUANTIZED = threading.local()


def _scales_in(module):
    """(key, owner, Fp8Scales, the weight's path) of every FP8 matmul in `module`: the key
    its scales' path."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Fp8Scales):
            owner = module
            for name in path[:-1]:
                owner = owner[name] if isinstance(name, int) else getattr(owner, name)
            yield "/".join(map(str, path)), owner, node, (*path[:-1], node.weight)


def weight_paths(module) -> dict:
    """{key: the path of its weight in `module`'s parameters} of `quantize_weights`' keys
    (a copy is placed as its weight is)."""
    return {key: path for key, _, _, path in _scales_in(module)}


def quantize_weights(module) -> dict:
    """{key: (qw, sw)}: every FP8 matmul's weight of `module` quantized to e4m3 as its
    forward quantizes it under current scaling (cast to the compute dtype, scale from its
    own amax), keyed by the path of its Fp8Scales. No gradient flows through it: the
    matmuls that read it (`quantized_weights`) send theirs to the weight. Delayed scaling's
    weight scale comes from a history each call rolls, so it has no such copy. A module
    whose forward runs its matmuls on shards of their weights, each scaled by its own
    amax (sequence parallelism's blocks), quantizes its copies itself, as its forward
    would: its `fp8_weights()`, whose scales may then hold one per shard."""
    own = getattr(module, "fp8_weights", None)
    return own() if own is not None else quantize_each(module)


def quantize_each(module) -> dict:
    """`quantize_weights` of each weight whole, by its matmul's own scales."""
    out = {}
    for key, owner, scales, _ in _scales_in(module):
        if scales.scaling != "current" or scales.weight is None:
            raise ValueError(f"{key}: only current scaling's weights, with their owner's "
                             f"weight named, are quantized once (got {scales.scaling!r}, "
                             f"weight {scales.weight!r})")
        w = jax.lax.stop_gradient(getattr(owner, scales.weight)[...].astype(scales.dtype))
        sw = scale_of(amax(w), E4M3)
        out[key] = (quantize(w, sw, E4M3), sw)
    return out


def copies(module) -> dict:
    """{key: (qw, sw)} of `module`'s FP8 matmuls whose copies the enclosing
    `quantized_weights` gives ({} outside one): what a module that rebuilds its matmuls
    (split and merged into a shard_map) hands on to them."""
    table = getattr(_QUANTIZED, "table", {})
    return {key: table[id(scales)] for key, _, scales, _ in _scales_in(module)
            if id(scales) in table}


@contextlib.contextmanager
def quantized_weights(module, weights: dict):
    """Inside, the FP8 matmuls of `module` read their weights from `weights`
    (`quantize_weights` of the same parameters, traced once for many calls) instead of
    quantizing them at each call."""
    table = {id(scales): weights[key] for key, _, scales, _ in _scales_in(module)} \
        if weights else {}
    outer = getattr(_QUANTIZED, "table", {})
    _QUANTIZED.table = {**outer, **table}
    try:
        yield
    finally:
        _QUANTIZED.table = outer


# ---- where the decoders' matmuls are built in FP8 ---------------------------------------

_BUILDING = threading.local()


@contextlib.contextmanager
def fp8_matmuls(scaling: str | None):
    """Linears (models.layers.linear) and MoE experts built inside run in FP8 with
    `scaling` (None: as they are)."""
    outer = getattr(_BUILDING, "scaling", None)
    _BUILDING.scaling = scaling
    try:
        yield
    finally:
        _BUILDING.scaling = outer


def building() -> str | None:
    """The FP8 scaling of matmuls being built now, or None."""
    return getattr(_BUILDING, "scaling", None)


def scales(weight: str, dtype) -> Fp8Scales | None:
    """A new Fp8Scales for a matmul being built whose owner holds its weight as `weight`,
    cast to `dtype` to compute; None outside fp8_matmuls."""
    scaling = building()
    return None if scaling is None else Fp8Scales(scaling, weight=weight, dtype=dtype)


# ---- the train step's gradient: delayed scaling's gradient histories -------------------

def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def value_and_grad(loss_fn):
    """jax.value_and_grad(loss_fn, has_aux=True) for loss_fn(params, model_state, batch) ->
    (loss, model_state): with Fp8GradHistory variables in model_state, also differentiated
    by them, and the returned model_state's histories rolled with the backward's amaxes
    (their cotangents' slot 0)."""
    plain = jax.value_and_grad(loss_fn, has_aux=True)

    def run(params, model_state, batch):
        leaves, treedef = jax.tree.flatten(model_state, is_leaf=_is_var)
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Fp8GradHistory)]
        if not at:
            return plain(params, model_state, batch)

        def with_histories(params, histories, batch):
            new = list(leaves)
            for i, h in zip(at, histories):
                new[i] = leaves[i].replace(h)
            return loss_fn(params, jax.tree.unflatten(treedef, new), batch)

        (loss, out_state), (grads, cots) = jax.value_and_grad(
            with_histories, argnums=(0, 1), has_aux=True)(
                params, [leaves[i][...] for i in at], batch)
        out_leaves = jax.tree.flatten(out_state, is_leaf=_is_var)[0]
        for i, c in zip(at, cots):
            out_leaves[i] = out_leaves[i].replace(roll_in(leaves[i][...], c[0]))
        return (loss, jax.tree.unflatten(treedef, out_leaves)), grads
    return run
