"""The train state's parts and the optimizer update, shared by the one-program step
(jaxdist/train_step.py), the pipeline step (jaxdist/pipeline/program.py) and the plans.

State: `params` (what the model computes with), `model_state`, `opt`, and under the
distributed optimizer with --dtype bfloat16 `master`: Megatron's layout, bfloat16 working
weights beside a float32 master copy that the optimizer updates (sharded over the data axes
with the optimizer state, sharding/optimizer.py). Without `master` the float32 parameters
are their own master.

The update: gradients (float32; cast up from bfloat16 working weights, so they are reduced in
float32 as Megatron's `accumulate_allreduce_grads_in_fp32`) are constrained to the update
placement, which under the distributed optimizer is the data-sharded one, so the partitioner
reduce-scatters them there; the optimizer updates the shard; the new parameters leave the
step in the layout's placement (replicated over data), which all-gathers them.
"""

from __future__ import annotations

import jax
import optax


def train_state(params, model_state, tx, master_dtype=None) -> dict:
    """{params, model_state, opt} from float32 `params`; with `master_dtype` (bfloat16) the
    working weights are cast to it and the float32 ones kept as `master`."""
    if master_dtype is None:
        return {"params": params, "model_state": model_state, "opt": tx.init(params)}
    working = jax.tree.map(lambda x: x.astype(master_dtype), params)
    return {"params": working, "master": params, "model_state": model_state,
            "opt": tx.init(params)}


def apply_gradients(tx, state: dict, grads, update_shardings) -> dict:
    """The state after one optimizer step on `grads` (model_state as it was: the caller
    replaces it), the update run in `update_shardings`."""
    master = "master" in state
    weights = state["master"] if master else state["params"]
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, weights)
    grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    weights = jax.lax.with_sharding_constraint(weights, update_shardings)
    updates, opt = tx.update(grads, state["opt"], weights)
    weights = optax.apply_updates(weights, updates)
    out = {**state, "opt": opt}
    if master:
        out["master"] = weights
        # cast on the shard, so the all-gather moves bfloat16 (Megatron's parameter gather)
        working = jax.tree.map(lambda w, p: w.astype(p.dtype), weights, state["params"])
        out["params"] = jax.lax.with_sharding_constraint(working, update_shardings)
    else:
        out["params"] = weights
    return out


def weight_part(state) -> str:
    """The state part holding the float32 weights the optimizer updates."""
    return "master" if "master" in state else "params"
