"""Building a model under a trace (nnx.eval_shape, a jitted init) in linear time.

flax NNX's `Variable.set_value` probes `getattr(value, "sharding", None)` on every value it
stores (e.g. each RNG stream's counter, once per initialised parameter). On a tracer that
attribute raises AttributeError, and jax 0.10.2 builds the error's message by walking every
equation traced so far (`_origin_msg` -> `find_progenitors`): a model's abstract init is
then quadratic in its parameter count. Measured here (nnx.eval_shape of the build, 2 cores),
with this module against without: efficientnetv2_s 0.71 against 2.75 s, densenet121 0.63
against 2.58 s, convnext_large 0.31 against 1.60 s; a sixth of the model tests' time. jax-ml/jax#40041 removes that part of the message
upstream; this applies the same change to jax releases without it (the pinned 0.10.2):
`sharding` and `device` of a tracer still raise AttributeError (hasattr/getattr keep their
meaning), with the message minus the walk. Other tracer errors keep their full message."""

import jax
from jax._src import core

FIXED_UPSTREAM = (0, 10, 3)  # the first jax release that may carry #40041; not patched there


def _unavailable(attribute: str) -> property:
    def probe(self):
        raise AttributeError(f"The '{attribute}' attribute is not available on "
                             f"{self._error_repr()}.")
    return property(probe)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


if _version(jax.__version__) < FIXED_UPSTREAM:
    core.Tracer.sharding = _unavailable("sharding")
    core.Tracer.device = _unavailable("device")
