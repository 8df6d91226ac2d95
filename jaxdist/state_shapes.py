"""The train state's shapes, cheaply, for plans: nothing is allocated and no device is
needed, so the full-size models of Go et al. (gpt3-175b, llama3-70b) can be planned for a 4x8
cluster on a laptop.

Why not simply `jax.eval_shape` of the whole model's constructor: inside one trace, every
Flax RNG draw updates a counter Variable whose setter asks the tracer for `.sharding`, and
the AttributeError JAX raises builds a message by scanning every equation traced so far.
That is quadratic in the number of parameters: 18-35 s for llama3-70b, 139 s for gpt3-175b,
none of it in the plan. A decoder is a stack of `depth` identical blocks, so its abstract
state is traced at depth 1 and 2 (checked to differ by exactly one identical block) and
the stack is assembled to full depth from those shapes; the optimizer state is then
`eval_shape` of the optimizer's init on the assembled parameters. The tree (paths, shapes,
dtypes) is the one the full trace gives, so the layouts see the same input
(tests/test_dry_run.py compares both ways leaf by leaf).

`pipeline_planning_state`: a pipeline's state, its blocks stacked [S, V, K, ...] and the
embeddings and head on every stage (jaxdist.pipeline.parts.SHARED).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxdist.pipeline.parts import SHARED, chunk_blocks
from jaxdist.train_step import DTYPES, abstract_train_state, split_model
from jaxdist.update import train_state

STACK = "blocks"  # the decoders' nnx.List of identical blocks


def planning_state(model_cfg, dtype_name: str, tx, master: bool = False) -> dict:
    """The abstract train state {params, model_state, opt} (and `master`, jaxdist/update.py):
    assembled from a stack of blocks where the model is one, else `abstract_train_state`
    (a full trace)."""
    stacked = _stacked_model_state(model_cfg, dtype_name)
    if stacked is None:
        return abstract_train_state(model_cfg, dtype_name, tx, master=master)
    params, model_state = stacked
    dtype = DTYPES[dtype_name] if master else None
    return jax.eval_shape(lambda p, m: train_state(p, m, tx, dtype), params, model_state)


def planning_params(model_cfg, dtype_name: str):
    """(params, model_state) as planning_state assembles them, without the optimizer state
    (a pipeline stacks the blocks first and initialises the optimizer on that)."""
    stacked = _stacked_model_state(model_cfg, dtype_name)
    return stacked if stacked is not None else _abstract_split(model_cfg, dtype_name)


def _abstract_split(model_cfg, dtype_name: str):
    _, params, model_state = nnx.eval_shape(
        lambda: split_model(model_cfg, DTYPES[dtype_name], 0))
    return params, model_state


def _stacked_model_state(model_cfg, dtype_name: str):
    """(params, model_state) of a full-depth decoder from its depth-1 and depth-2 shapes,
    or None where the model is not a stack this function can verify."""
    depth = getattr(model_cfg, "depth", None)
    if model_cfg.family not in ("gpt", "moe") or not isinstance(depth, int) or depth <= 2:
        return None
    one = _abstract_split(dataclasses.replace(model_cfg, depth=1), dtype_name)
    two = _abstract_split(dataclasses.replace(model_cfg, depth=2), dtype_name)
    if not all(_same(_stack(a, 2), b) for a, b in zip(one, two)):
        return None  # depth changes more than the number of blocks: trace it whole
    return tuple(_stack(part, depth) for part in one)


def stack_size(model_cfg, dtype_name: str) -> tuple[int, int] | None:
    """(bytes, leaves) of a decoder's parameters and model state at full depth, counted
    from its depth-1 and depth-2 traces (about 0.2 s whatever the depth: the blocks are
    identical), or None where the model is no such stack (depth 2 or less, or not a
    decoder), whose full trace is no bigger than its build."""
    depth = getattr(model_cfg, "depth", None)
    if model_cfg.family not in ("gpt", "moe") or not isinstance(depth, int) or depth <= 2:
        return None
    try:  # a suite's plan rows check the same few models again and again
        return _STACK_SIZES[(model_cfg, dtype_name)]
    except (KeyError, TypeError):
        pass
    sizes = []
    for d in (1, 2):
        leaves = jax.tree.leaves(_abstract_split(dataclasses.replace(model_cfg, depth=d),
                                                 dtype_name))
        sizes.append((sum(x.size * x.dtype.itemsize for x in leaves), len(leaves)))
    (b1, l1), (b2, l2) = sizes
    size = b1 + (depth - 1) * (b2 - b1), l1 + (depth - 1) * (l2 - l1)
    try:
        _STACK_SIZES[(model_cfg, dtype_name)] = size
    except TypeError:  # a config that cannot be a key is counted each time
        pass
    return size


_STACK_SIZES: dict = {}


def _stack(state: nnx.State, depth: int) -> nnx.State:
    """A depth-1 state with its one block repeated `depth` times (the same abstract leaves:
    only shapes and dtypes are read)."""
    mapping = state.raw_mapping  # nested plain dicts: State wraps only the top level
    if STACK not in mapping or list(mapping[STACK]) != [0]:
        return state
    block = mapping[STACK][0]
    return nnx.State({**mapping, STACK: {i: block for i in range(depth)}})


def _same(a, b) -> bool:
    """Equal tree structure (paths, Variable types and metadata) and leaf shapes/dtypes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _stack_abstract(block, S: int, V: int, K: int):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((S, V, K, *x.shape), x.dtype), block)


def pipeline_planning_state(model_cfg, dtype_name: str, tx, S: int, V: int,
                            master: bool = False, stage_blocks: tuple[int, ...] = ()) -> dict:
    """K: the largest chunk's blocks (jaxdist.pipeline.parts.chunk_blocks; the shorter
    chunks' slots padded, as the program holds them)."""
    counts = chunk_blocks(model_cfg, S, V, stage_blocks)
    base = planning_params(model_cfg, dtype_name)[0]
    pure = base.to_pure_dict() if isinstance(base, nnx.State) else base
    K = max(max(row) for row in counts)
    params = {"stages": _stack_abstract(pure["blocks"][0], S, V, K),
              "shared": {k: pure[k] for k in SHARED if k in pure}}
    dtype = DTYPES[dtype_name] if master else None
    return jax.eval_shape(lambda p: train_state(p, {}, tx, dtype), params)
