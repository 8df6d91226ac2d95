"""A chunk's operations on one micro-batch, as the tick loop (jaxdist/pipeline/step.py) runs
them and the predictor (jaxdist/predict/pipeline.py) compiles them:

- F (`forward`): the chunk's blocks under `jax.vjp`. What the backward needs (the vjp's
  residuals, less the inputs the backward reads again: the weights, their FP8 copies and
  the stored input activation) goes to the stash, so the backward runs no second forward.
  A chunk is its stacked parameters and the FP8 copies of its FP8 matmuls' weights, which
  the step quantizes once before its tick loop (Parts.fp8_weights; {} without FP8): every
  micro-batch's forward and backward read those, and the weight gradients go to the
  parameters. --remat full / dots
  make each block a `jax.checkpoint` (jaxdist/pipeline/parts.py), so the stash holds the
  block inputs (and matmul outputs) and the backward recomputes the rest, as under the
  other layouts. The last chunk's F also runs the head and the head's backward at once
  (`head`): loss, the gradient into the chunk's output and the head's weight gradients, so
  no stage stashes logits.
- BACK (`backward`): the whole backward (weight and input gradients) from the stash.
- B and W (zb-h1): BACK's program split in two by data dependence (`SplitBackward`): B is
  every operation the input gradient needs, W every other operation the weight gradients
  need, reading the values of B's it uses ("kept": the weight matmuls' output cotangents).
  So W runs no forward and no input-gradient chain, and B + W = BACK.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core

from jaxdist.pipeline.parts import Parts

# Primitives that call a jaxpr, inlined before the split so that B and W are cut between
# primitive operations (a transposed `jit` is one equation holding the whole backward).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr",
          "custom_jvp_call": "call_jaxpr"}


def _read(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def _run(eqns, env) -> None:
    """Evaluate `eqns` in order (binding their primitives), writing into `env`."""
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        out = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))


def _inlined(jaxpr, consts, *args):
    """Evaluate a jaxpr with its call-like equations' bodies inlined (to trace anew)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        inner = eqn.params.get(_CALLS.get(eqn.primitive.name, ""))
        if inner is None:
            _run([eqn], env)
            continue
        body, body_consts = ((inner.jaxpr, inner.consts) if hasattr(inner, "consts")
                             else (inner, ()))
        env.update(zip(eqn.outvars, _inlined(body, body_consts,
                                             *(_read(env, v) for v in eqn.invars))))
    return [_read(env, v) for v in jaxpr.outvars]


class SplitBackward:
    """A backward `fn(*args) -> (*weight gradient leaves, input gradient)` cut into B
    (`input_grad(*args) -> (input gradient, kept)`) and W (`weight_grad(*args, kept) ->
    weight gradient leaves`) along its data dependence, traced at `avals`."""

    def __init__(self, fn, avals):
        first = jax.make_jaxpr(fn)(*avals)
        closed = jax.make_jaxpr(lambda *a: _inlined(first.jaxpr, first.consts, *a))(*avals)
        jaxpr, self.consts = closed.jaxpr, closed.consts
        self.jaxpr = jaxpr
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}

        def cone(outvars) -> set[int]:
            need, stack = set(), [v for v in outvars if not isinstance(v, core.Literal)]
            while stack:
                i = producer.get(stack.pop())
                if i is None or i in need:
                    continue
                need.add(i)
                stack += [u for u in jaxpr.eqns[i].invars if not isinstance(u, core.Literal)]
            return need

        *self.w_out, self.dx_out = jaxpr.outvars
        b = cone([self.dx_out])
        w = cone(self.w_out) - b
        self.b_eqns = [e for i, e in enumerate(jaxpr.eqns) if i in b]
        self.w_eqns = [e for i, e in enumerate(jaxpr.eqns) if i in w]
        from_b = {v for e in self.b_eqns for v in e.outvars}
        used = [u for e in self.w_eqns for u in e.invars] + list(self.w_out)
        self.kept = list(dict.fromkeys(u for u in used if not isinstance(u, core.Literal)
                                       and u in from_b))

    def _env(self, args):
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, args))
        return env

    def input_grad(self, *args):
        env = self._env(args)
        _run(self.b_eqns, env)
        return _read(env, self.dx_out), [env[v] for v in self.kept]

    def weight_grad(self, *args, kept):
        env = self._env(args)
        env.update(zip(self.kept, kept))
        _run(self.w_eqns, env)
        return [_read(env, v) for v in self.w_out]

    def kept_shapes(self):
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.kept]


class ChunkOps:
    """F, BACK, B and W of one chunk for one micro-batch (see the module's docstring).
    `microbatches`: the loss is the mean over them, so each backward starts from 1/M."""

    def __init__(self, parts: Parts, microbatches: int):
        self.parts = parts
        self.scale = 1.0 / microbatches
        self._pullback: dict = {}
        self._split: dict = {}

    # ---- F
    def forward(self, chunk, shared, x, tokens, is_first, count=None):
        """(output activation, balance-loss term, the stash: the vjp's residuals that are
        not the chunk's own inputs). `chunk`: (stacked parameters [K, ...], their FP8
        weights). `count`: the chunk's blocks where chunks differ
        (jaxdist/pipeline/parts.py); its skipped slots' flags are in the stash."""
        blocks, quantized = self._blocks(chunk)
        (y, aux), vjp = jax.vjp(lambda b, sh, x_: self.parts.chunk(
            b, sh, x_, tokens, is_first, count, quantized), blocks, shared, x)
        leaves, tree = jax.tree.flatten(vjp)
        inputs = self._inputs(blocks, shared, x, quantized)
        forwarded = tuple(next((i for i, a in enumerate(inputs) if a is leaf), None)
                          for leaf in leaves)
        self._pullback.setdefault("tree", tree)
        self._pullback.setdefault("forwarded", forwarded)
        if forwarded != self._pullback["forwarded"]:
            raise RuntimeError("the chunk's vjp residuals differ between traces")
        return y, aux, [leaf for leaf, i in zip(leaves, forwarded) if i is None]

    def stash_shapes(self, chunk, shared, x, tokens):
        flag = jax.ShapeDtypeStruct((), jnp.bool_)
        count = jax.ShapeDtypeStruct((), jnp.int32)
        return jax.eval_shape(lambda *a: self.forward(*a)[2], chunk, shared, x, tokens, flag,
                              count)

    def head(self, shared, h, tokens):
        """The last chunk's head: (loss, gradient into `h`, the head's weight gradients as
        a `shared` tree with only its own leaves)."""
        own = {k: shared[k] for k in ("ln_f", "head") if k in shared}
        loss, vjp = jax.vjp(lambda sh, h_: self.parts.head_loss(
            {**shared, **sh}, h_, self.parts.targets(tokens)), own, h)
        d_own, dh = vjp(jnp.float32(self.scale))
        return loss, dh.astype(h.dtype), d_own

    def _blocks(self, chunk) -> tuple[list, list]:
        """The chunk's K per-block parameters and K per-block FP8 weight dicts."""
        params, quantized = chunk
        return self.parts.block_params(params), self.parts.chunk_fp8(quantized)

    @staticmethod
    def _inputs(blocks, shared, x, quantized) -> list:
        """What the vjp may keep that the chunk's backward is given again: the vjp's
        arguments and the FP8 weights it closes over."""
        return jax.tree.leaves((blocks, shared)) + [x] + jax.tree.leaves(quantized)

    # ---- BACK
    def _restore(self, stash, chunk, shared, x):
        """The vjp rebuilt from the stash and the inputs it forwarded."""
        blocks, quantized = self._blocks(chunk)
        inputs = self._inputs(blocks, shared, x, quantized)
        it = iter(stash)
        leaves = [next(it) if i is None else inputs[i] for i in self._pullback["forwarded"]]
        return jax.tree.unflatten(self._pullback["tree"], leaves)

    def backward(self, stash, chunk, shared, x, dy):
        """(chunk gradients [K, ...], shared gradients, input gradient) from the stash."""
        vjp = self._restore(stash, chunk, shared, x)
        d_blocks, d_shared, dx = vjp((dy, jnp.float32(self.scale)))
        return jax.tree.map(lambda *g: jnp.stack(g), *d_blocks), d_shared, dx

    # ---- B and W
    def _splitter(self, stash, chunk, shared, x, dy) -> tuple[SplitBackward, object]:
        flat, tree = jax.tree.flatten((stash, chunk, shared, x, dy))
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
        key = (tree, tuple((a.shape, a.dtype) for a in avals))
        if key not in self._split:
            grads = {}

            def fn(*leaves):
                d_chunk, d_shared, dx = self.backward(*jax.tree.unflatten(tree, leaves))
                out, grads["tree"] = jax.tree.flatten((d_chunk, d_shared))
                return [*out, dx]
            split = SplitBackward(fn, avals)
            self._split[key] = (split, grads["tree"])
        return self._split[key], flat

    def input_grad(self, stash, chunk, shared, x, dy):
        """B: (input gradient, kept: what W reads of B's)."""
        (split, _), flat = self._splitter(stash, chunk, shared, x, dy)
        return split.input_grad(*flat)

    def weight_grad(self, stash, chunk, shared, x, dy, kept):
        """W: (chunk gradients, shared gradients) from the stash and B's kept values."""
        (split, tree), flat = self._splitter(stash, chunk, shared, x, dy)
        return jax.tree.unflatten(tree, split.weight_grad(*flat, kept=kept))

    def kept_shapes(self, stash, chunk, shared, x, dy):
        return self._splitter(stash, chunk, shared, x, dy)[0][0].kept_shapes()
