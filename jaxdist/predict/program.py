"""What the compiled step for the real mesh says, read on simulated CPU devices from abstract
shapes (nothing allocated): per-device FLOPs, bytes accessed, collectives, compiler memory.

Big decoders: compiling all of llama3-70b's 80 blocks on 2 cores takes too long, and a
decoder is a stack of identical blocks, so the step is compiled at depth 1 and 2 and every
figure is extrapolated linearly, F(d) = F(1) + (d - 1) (F(2) - F(1)); exact for a uniform
stack (tests/test_predict.py compares it with a full compile of a 4-block model).

Attention: with `attention=cudnn` a GPU runs `jax.nn.dot_product_attention` as cuDNN's
fused (flash) attention, which keeps no L x L score matrix; XLA:CPU cannot compile cuDNN, so
the step is compiled here with the XLA implementation (same shapes and FLOPs), which keeps
them. `attention_scores` measures that part of the temporaries and bytes accessed per block
(compiles at L and at L/2 with twice the batch) and the prediction leaves it out. With
`attention=default` JAX 0.10 itself picks the XLA implementation on every platform
("defaults to None, which currently falls back to xla", jax.nn.dot_product_attention's
docstring), so a GPU keeps the scores too and nothing is removed.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxdist import comm, metrics
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.predict.model import aggregate
from jaxdist.train_step import build_program, compiled_step_flops, make_optimizer
from sharding import get_layout

FULL_DEPTH_MAX = 8  # "auto": compile whole up to this many blocks, else extrapolate


def figures(cfg, model_cfg, shape: MeshShape) -> dict:
    """One compile of the step for `model_cfg` on the mesh (jax must have shape.size CPU
    devices): {flops, bytes_accessed, comm (aggregated), memory (compiler's)}."""
    mesh = build_mesh(shape, jax.devices()[:shape.size])
    model_cfg = cpu_compilable(model_cfg)
    tx = make_optimizer(cfg.train.optimizer, cfg.train.lr)
    program = build_program(model_cfg, cfg.model.dtype, tx, get_layout(cfg.train.layout), mesh,
                            cfg.train.seed, cfg.train.microbatches, cfg.model.matmul_precision)
    one = model_cfg.synthetic_batch(np.random.default_rng(0), 1)
    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, *v.shape[1:]), v.dtype)
             for k, v in one.items()}
    compiled = program.step.lower(program.abstract_state, batch).compile()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    memory = metrics.compiled_memory(compiled) or {}
    return {"flops": compiled_step_flops(program, compiled) or 0.0,
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "comm": aggregate(comm.collectives(compiled.as_text(), dict(shape.axis_sizes))),
            "memory": {k: v for k, v in memory.items() if k.endswith("_bytes")}}


def is_stack(model_cfg) -> bool:
    return model_cfg.family in ("gpt", "moe") and isinstance(getattr(model_cfg, "depth", None),
                                                             int)


def extrapolate(one: dict, two: dict, depth: int) -> dict:
    """Figures at `depth` from the depth-1 and depth-2 figures, linearly."""
    def line(a, b):
        return a + (depth - 1) * (b - a)

    rows = {}
    for row in one["comm"]:
        rows[(row["kind"], tuple(row["axes"]), row["group_size"])] = (row, None)
    for row in two["comm"]:
        key = (row["kind"], tuple(row["axes"]), row["group_size"])
        rows[key] = (rows.get(key, (None,))[0], row)
    comm_rows = []
    for (kind, axes, n), (a, b) in rows.items():
        zero = {"count": 0, "bytes": 0, "ring_bytes": 0.0}
        a, b = a or zero, b or zero
        comm_rows.append({"kind": kind, "axes": list(axes), "group_size": n,
                          **{f: line(a[f], b[f]) for f in ("count", "bytes", "ring_bytes")}})
    return {"flops": line(one["flops"], two["flops"]),
            "bytes_accessed": line(one["bytes_accessed"], two["bytes_accessed"]),
            "comm": comm_rows,
            "memory": {k: line(one["memory"][k], two["memory"][k]) for k in one["memory"]}}


def step_figures(cfg, model_cfg, shape: MeshShape, blocks: str = "auto") -> dict:
    """Figures of the full step; blocks: "full" (compile everything), "extrapolate" (depth
    1 and 2) or "auto" (extrapolate a stack deeper than FULL_DEPTH_MAX)."""
    depth = getattr(model_cfg, "depth", None)
    stack = is_stack(model_cfg) and depth > 2
    if blocks == "extrapolate" and not stack:
        blocks = "full"
    if blocks == "full" or (blocks == "auto" and (not stack or depth <= FULL_DEPTH_MAX)):
        return {**figures(cfg, model_cfg, shape), "method": "full compile"}
    one = figures(cfg, dataclasses.replace(model_cfg, depth=1), shape)
    two = figures(cfg, dataclasses.replace(model_cfg, depth=2), shape)
    return {**extrapolate(one, two, depth), "depth_1": one, "depth_2": two,
            "method": f"compiled at depth 1 and 2, extrapolated linearly to {depth}"}


def attention_scores(cfg, model_cfg, shape: MeshShape, one: dict | None = None,
                     two: dict | None = None) -> dict:
    """The L x L attention-score part, at full sequence length and depth, of temp bytes and
    bytes accessed. Per block (depth 2 - depth 1), at the same tokens per step: P(k) =
    A + S / k at sequence L / k and batch k B (activations A follow the tokens, scores S the
    tokens x L), so S = 2 (P(1) - P(2)); times the depth. `one`, `two`: the depth-1 and -2
    figures at L, where already compiled."""
    depth, seq = model_cfg.depth, model_cfg.seq_len
    one = one or figures(cfg, dataclasses.replace(model_cfg, depth=1), shape)
    two = two or figures(cfg, dataclasses.replace(model_cfg, depth=2), shape)
    wide = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, batch_size=2 * cfg.train.batch_size))
    half = dataclasses.replace(model_cfg, seq_len=seq // 2)
    h1 = figures(wide, dataclasses.replace(half, depth=1), shape)
    h2 = figures(wide, dataclasses.replace(half, depth=2), shape)

    def scores(get):
        return depth * 2 * ((get(two) - get(one)) - (get(h2) - get(h1)))

    return {"temp_bytes": scores(lambda f: f["memory"]["temp_bytes"]),
            "bytes_accessed": scores(lambda f: f["bytes_accessed"])}


def cpu_compilable(model_cfg):
    """`model_cfg` with cuDNN attention replaced by XLA's (same shapes and FLOPs): XLA:CPU
    cannot compile the cuDNN custom call."""
    if getattr(model_cfg, "attention", None) == "cudnn":
        return dataclasses.replace(model_cfg, attention="xla")
    return model_cfg


def flash_attention_applies(model_cfg, dtype: str) -> bool:
    """cuDNN flash attention: decoders asking for it (`attention=cudnn`) in bf16 on Ampere
    and newer (every part in jaxdist.hardware), even sequence length for the fit. Not
    `attention=default`: JAX 0.10 runs that as XLA attention on a GPU too."""
    return is_stack(model_cfg) and dtype == "bfloat16" and model_cfg.seq_len % 2 == 0 and \
        getattr(model_cfg, "attention", "default") == "cudnn"
