"""The model config of a run: the registered size, its `--model-opts` overrides and remat,
adapted to the run's dataset."""

from __future__ import annotations

import dataclasses
import math

from jaxdist.data import Dataset, load_dataset
from jaxdist.errors import UsageError
from models.registry import families, get_model, parse_overrides


def adapt_model(model_cfg, dataset: Dataset | None):
    """The model config with its input and head sized for `dataset`."""
    if dataset is None:
        return model_cfg
    h, w, c = dataset.image_shape
    if model_cfg.input_kind == "vector":
        return dataclasses.replace(model_cfg, in_dim=h * w * c, num_classes=dataset.num_classes)
    if model_cfg.input_kind == "image":
        adapted = dataclasses.replace(model_cfg, image_size=h, channels=c,
                                      num_classes=dataset.num_classes)
        if hasattr(adapted, "validate"):
            adapted.validate()  # e.g. an ImageNet stem cannot take 28x28 MNIST
        return adapted
    raise UsageError(f"dataset {dataset.name!r} is images; model family "
                     f"{model_cfg.family!r} cannot read it (use an mlp or a CNN: "
                     f"{', '.join(families('image'))})")


def build_model(settings, train, data, shape):
    """(the model config of a run on the mesh `shape`, from its config's model, train and
    data sections (jaxdist.config ModelConfig, TrainConfig, DataConfig): size overrides,
    remat, context parallelism, FP8, sequence parallelism, adapted to the dataset; the
    dataset or None). Called once per job, by jaxdist.job.resolve."""
    dataset = load_dataset(data.dataset, data.data_dir)
    model_cfg = get_model(settings.model, parse_overrides(settings.model_opts))
    if train.remat != "none":
        if not hasattr(model_cfg, "remat"):
            raise UsageError(f"--remat applies to the decoders (gpt, llama and moe models), "
                             f"not {settings.model!r}")
        model_cfg = dataclasses.replace(model_cfg, remat=train.remat)
    from sharding.registry import gathers_block_weights
    if hasattr(model_cfg, "ordered_blocks") and gathers_block_weights(train.layout):
        model_cfg = dataclasses.replace(model_cfg, ordered_blocks=True)
    model_cfg = context_parallel(settings, train, shape, model_cfg)
    if settings.dtype == "float8":
        model_cfg = dataclasses.replace(model_cfg, fp8=check_fp8(settings, train, model_cfg))
    if train.sequence_parallel:
        check_sequence_parallel(train.layout, shape, model_cfg, settings.model)
        from sharding.logical import RULES
        model_cfg = dataclasses.replace(
            model_cfg, sequence_parallel=True,
            **dict(zip(("tp_comm_chunks", "tp_comm_split"),
                       tp_comm_chunks(train, shape, model_cfg))),
            weight_rules=train.layout if train.layout in RULES else None)
    return adapt_model(model_cfg, dataset), dataset


def context_parallel(settings, train, shape, model_cfg):
    """The model config with --context-load-balance, where the mesh has a context axis
    (models/context.py): a model with a sequence, its length divisible by the shards."""
    from models.context import check_sequence
    from sharding.registry import facts

    shards = shape.context
    if shards == 1:
        return model_cfg
    if getattr(model_cfg, "input_kind", None) != "tokens" or not hasattr(
            model_cfg, "context_load_balance"):
        raise UsageError(f"context={shards} splits each sequence over the context axis; "
                         f"model {settings.model!r} has no sequence dimension (use a gpt, "
                         f"llama or moe model, or drop context from --mesh)")
    sizes = shape.axis_sizes
    split = [f"{a}={sizes[a]}" for a in ("tensor", "expert") if sizes.get(a, 1) > 1]
    if train.distributed_optimizer and split and not facts(train.layout).pipelined:
        # parameters split over tensor/expert: the gradients are reduce-scattered in a
        # shard_map over the data axes, which XLA's partitioner aborts on with context free
        # (a pipeline reduces them with context manual: jaxdist/pipeline/program.py)
        raise UsageError(f"--distributed-optimizer with context={shards} runs where the "
                         f"parameters are replicated (--layout zero1); this mesh splits them "
                         f"over {', '.join(split)} (drop the flag, or the context axis)")
    why = check_sequence(model_cfg.seq_len, shards, train.context_load_balance)
    if why:
        raise UsageError(f"--mesh {shape.spec}: {why}")
    from sharding.registry import facts
    if train.context_attention == "ring" and facts(train.layout).pipelined:
        # a permute's pairs span every stage; a stage's lax.switch branch is entered by that
        # stage alone (jaxdist/pipeline/step.py), so the other stages never join it
        raise UsageError(f"--context-attention ring passes key/value blocks between every "
                         f"stage's devices at once, which a pipeline's per-stage branches "
                         f"cannot; use --context-attention allgather with layout "
                         f"{train.layout!r}")
    if train.context_attention == "ring" and model_cfg.attention == "cudnn":
        # cuDNN's log-sum-exp has no gradient in JAX, which the ring's merge needs
        raise UsageError("--context-attention ring attends each block with XLA's dot "
                         "attention (cuDNN's log-sum-exp has no gradient); use "
                         "attention=default with it, or --context-attention allgather")
    return dataclasses.replace(model_cfg,
                               context_load_balance=train.context_load_balance,
                               context_attention=train.context_attention)
def check_fp8(settings, train, model_cfg) -> str:
    """--dtype float8's scaling (models/fp8.py), where the model and layout have an FP8
    path: the decoders' block matmuls, on the jax.sharding layouts."""
    if not hasattr(model_cfg, "fp8"):
        raise UsageError(f"--dtype float8 runs the decoders' matmuls in FP8 (gpt, llama and "
                         f"moe models); {settings.model!r} has no FP8 path: use --dtype "
                         f"bfloat16")
    from sharding.registry import facts
    if facts(train.layout).out_of_process:
        raise UsageError("--dtype float8 runs on the jax.sharding layouts, not --layout ps "
                         "(its workers compute in float32 or bfloat16); use --dtype bfloat16 "
                         "or another layout")
    stateful = settings.fp8_scaling == "delayed"
    if stateful and (facts(train.layout).pipelined or train.sequence_parallel):
        raise UsageError(f"--fp8-scaling delayed keeps amax histories in the train state, "
                         f"which the pipeline layouts and --sequence-parallel do not carry; "
                         f"use --fp8-scaling current with layout {train.layout!r}")
    return settings.fp8_scaling


def tp_comm_chunks(train, shape, model_cfg) -> tuple[int, str]:
    """(--tp-comm-chunks, --tp-comm-split) resolved: how the sequence-parallel blocks split
    their tensor-axis collectives (models/sequence_parallel.py). Chunks auto (0): under tp
    and fsdp_tp 2 where each device's micro-batch is even, else 1 (XLA:GPU plans of
    fsdp_tp: faster and smaller with the same weight gathers, docs/layouts.md); the auto
    figure is the layout registry's. Split auto: batch, but sequence under the pipeline
    layouts, which run each stage's blocks as one chain (batch slices are refused there)."""
    from sharding.axes import batch_axes
    from sharding.registry import facts

    asked, split = train.tp_comm_chunks, train.tp_comm_split
    sizes = shape.axis_sizes
    if asked < 0:
        raise UsageError(f"--tp-comm-chunks {asked}: give 0 (auto), 1 (off) or more")
    shards = math.prod(sizes[a] for a in batch_axes(sizes))
    local = train.batch_size // max(1, shards * train.microbatches)
    pipelined = sizes.get("stage", 1) > 1
    if split == "batch" and pipelined:
        raise UsageError("--tp-comm-split batch: the pipeline layouts run each stage's "
                         "blocks as one chain; use --tp-comm-split sequence")
    chunks = asked or (1 if pipelined else facts(train.layout).tp_comm_chunks)
    if split == "auto":
        split = "sequence" if pipelined else "batch"
    if split == "batch" and local % chunks:
        if not asked:
            return 1, "batch"
        raise UsageError(f"--tp-comm-chunks {asked} does not divide each device's micro-batch "
                         f"of {local} (--batch-size {train.batch_size} over {shards} "
                         f"batch shards, --microbatches {train.microbatches}); use a "
                         f"divisor of {local}, --tp-comm-split sequence, or 0 for auto")
    tokens = model_cfg.seq_len // (sizes.get("context", 1) * sizes.get("tensor", 1))
    if split == "sequence" and tokens % chunks:
        raise UsageError(f"--tp-comm-chunks {chunks} does not divide each device's sequence "
                         f"shard of {tokens} tokens (seq_len {model_cfg.seq_len} over "
                         f"context x tensor); use a divisor of {tokens}")
    return chunks, split


def check_sequence_parallel(layout: str, shape, model_cfg, model: str) -> None:
    """--sequence-parallel splits each block's sequence, heads and MLP columns over the
    tensor axis (models/sequence_parallel.py): a tensor layout, a tensor axis, and sizes it
    divides."""
    from sharding.registry import facts, layouts_where

    if not facts(layout).sequence_parallel:
        raise UsageError(f"--sequence-parallel splits activations over the tensor axis of a "
                         f"tensor-parallel layout; layout {layout!r} has none (use "
                         f"{', '.join(layouts_where(sequence_parallel=True))})")
    if getattr(model_cfg, "family", None) != "gpt" or not hasattr(model_cfg,
                                                                   "sequence_parallel"):
        raise UsageError(f"--sequence-parallel applies to the dense decoders (gpt, llama "
                         f"models), not {model!r}")
    tensor = shape.axis_sizes.get("tensor", 1)
    if tensor < 2:
        raise UsageError(f"--sequence-parallel needs a tensor axis of size 2 or more; mesh "
                         f"{shape.spec!r} has tensor={tensor} (e.g. --mesh data:2,tensor:2)")
    hidden = getattr(model_cfg, "mlp_hidden", model_cfg.mlp_ratio * model_cfg.width)
    sizes = {"seq_len": model_cfg.seq_len, "heads": model_cfg.heads,
             "kv_heads": getattr(model_cfg, "kv_heads", model_cfg.heads), "mlp": hidden}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tensor]
    if bad:
        raise UsageError(f"--sequence-parallel splits the sequence, heads and MLP over "
                         f"tensor={tensor}: {', '.join(bad)} not divisible by {tensor}; "
                         f"use --model-opts with multiples of {tensor}")
