"""A shard's slice of the model and its optimizer state: the jitted update over one flat
vector, kept only when its result is finite, and the arrays a snapshot saves and restores.
No versions, workers or locks here: ps.core decides when an update is applied."""

from __future__ import annotations

import time

import numpy as np


def make_apply(tx, clip_norm: float = 0.0):
    """Jitted (params, opt state, gradient, scale) -> (params, opt state, finite, norm) on a
    flat vector. Elementwise optimizers make a flat slice of the model exact. `scale`
    multiplies the update (i.e. the learning rate): for adam, scaling the gradient instead
    would cancel out in m / sqrt(v).

    `finite` is whether the gradient, the new parameters and every new optimizer leaf are
    finite: a finite gradient can still overflow (3e38 squared is inf in adam's second
    moment, which then freezes every later update), so the result is what gets checked and
    the caller keeps the old state when it is not. `clip_norm` > 0 rescales the gradient to
    at most that L2 norm (over this shard's slice). The norm is computed as max|g| *
    ||g / max|g|||, which does not overflow for finite g; `norm` is 0 when not clipping (a
    non-finite gradient still shows: the optimizer moments take its inf or nan)."""
    import jax
    import jax.numpy as jnp

    def apply(params, opt, grad, scale):
        norm = jnp.float32(0)   # only computed when clipping: two more passes over the slice
        if clip_norm > 0:
            peak = jnp.max(jnp.abs(grad))
            safe = jnp.where(peak > 0, peak, 1.0)
            norm = peak * jnp.sqrt(jnp.sum(jnp.square(grad / safe)))
            grad = grad * jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
        updates, new_opt = tx.update(grad, opt, params)
        new_params = params + scale * updates
        # One sum per array: inf or nan anywhere makes it non-finite (so would a sum past
        # 3.4e38 of finite values, i.e. parameters or moments near float32's limit).
        total = norm + jnp.sum(new_params)
        for leaf in jax.tree.leaves(new_opt):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                total = total + jnp.sum(leaf)
        return new_params, new_opt, jnp.isfinite(total), norm
    return jax.jit(apply)


def mean_in_worker_order(grads: dict[int, np.ndarray], out: np.ndarray | None = None
                         ) -> np.ndarray:
    """The mean of one sync step's gradients, {worker: gradient}, summed in worker order:
    float sums do not depend on arrival order, so runs are reproducible. `out` (a reused
    buffer of the same shape) receives it: two fresh arrays a step cost a shard ~3 ms of
    page faults on `mlp` here, ten times the arithmetic. Same bits either way."""
    total = np.zeros_like(next(iter(grads.values()))) if out is None else out
    total.fill(0)
    with np.errstate(over="ignore"):  # an overflow is caught when applied, as non-finite
        for w in sorted(grads):
            total += grads[w]
        return np.divide(total, np.float32(len(grads)), out=total)


class ShardOptimizer:
    """Parameters + optimizer state of one shard. `serve` is what pulls send: a new array
    after every kept update, so pulls in flight keep the one they got."""

    def __init__(self, params: np.ndarray, tx, clip_norm: float = 0.0):
        import jax
        import jax.numpy as jnp

        from jaxdist.program.xla_compile import compile_timed

        self.clip_norm = clip_norm
        self._apply = make_apply(tx, clip_norm)
        self._params = jnp.asarray(params, dtype=jnp.float32)
        self._opt = jax.jit(tx.init)(self._params)
        self._opt_treedef = jax.tree.structure(self._opt)
        self.serve = np.asarray(self._params)
        self.apply_s = 0.0              # optimizer time (jitted update), all applies
        # Compile now, not inside the first push: the first step would otherwise time XLA.
        compile_timed(self._apply, self._params, self._opt, self._params, np.float32(1))

    def update(self, grad: np.ndarray, scale: float) -> tuple[bool, bool]:
        """(kept, clipped): apply one gradient; if the result is not finite nothing changes
        and kept is False."""
        t0 = time.perf_counter()
        params, opt, finite, norm = self._apply(self._params, self._opt, grad,
                                                np.float32(scale))
        finite = bool(finite)  # waits for the update
        self.apply_s += time.perf_counter() - t0
        if not finite:
            return False, False
        self._params, self._opt = params, opt
        self.serve = np.asarray(self._params)
        return True, bool(self.clip_norm and float(norm) > self.clip_norm)

    def arrays(self) -> dict[str, np.ndarray]:
        """What a snapshot saves: the parameters and every optimizer leaf, in tree order."""
        import jax

        arrays = {"params": np.asarray(self._params)}
        for i, leaf in enumerate(jax.tree.leaves(self._opt)):
            arrays[f"opt_{i:03d}"] = np.asarray(leaf)
        return arrays

    def load(self, arrays: dict) -> None:
        """Take the state `arrays()` saved; ValueError (and nothing changed) when it does
        not fit this optimizer."""
        import jax
        import jax.numpy as jnp

        template = jax.tree.leaves(self._opt)
        saved = sorted(k for k in arrays if k.startswith("opt_"))
        if len(saved) != len(template):
            raise ValueError(f"snapshot optimizer state has {len(saved)} arrays, the "
                             f"optimizer {len(template)}")
        leaves = [arrays[k] for k in saved]
        for new, old in zip(leaves, template):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError("snapshot optimizer state does not match the optimizer")
        self._params = jnp.asarray(arrays["params"])
        self._opt = jax.tree.unflatten(self._opt_treedef, [jnp.asarray(x) for x in leaves])
        self.serve = np.asarray(self._params)

    def opt_bytes(self) -> int:
        import jax

        return int(sum(x.nbytes for x in jax.tree.leaves(self._opt)))
