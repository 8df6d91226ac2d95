"""Input checks of a pipelined run that need no device (experiments/run.py calls them)."""

from __future__ import annotations

from jaxdist.errors import UsageError
from jaxdist.pipeline.parts import chunk_blocks
from jaxdist.pipeline.schedule import check_schedule
from models.layers import REMAT_NAMES


def check_moe_data(model_cfg, data: int, context: int = 1) -> None:
    """MoE's balance loss is a mean over each micro-batch's tokens (not a per-row mean like
    the cross-entropy): with `data` manual in the pipeline's shard_map each data shard would
    average only its own rows, a different loss from one device's; `context`, manual there
    too, would average each shard's own tokens. On `fsdp` (left to the partitioner) the mean
    is over the whole micro-batch, as on one device."""
    if getattr(model_cfg, "family", None) != "moe":
        return
    if data > 1:
        raise UsageError(f"moe under the pipeline layouts needs data=1 (got data={data}): "
                         f"its balance loss would be averaged per data shard; put the batch "
                         f"on fsdp instead (fsdp_pp, e.g. --mesh fsdp:{data},stage:2)")
    if context > 1:
        raise UsageError(f"moe under the pipeline layouts needs context=1 (got "
                         f"context={context}): its balance loss would be averaged per "
                         f"sequence shard; run moe's context parallelism under --layout ep")


def check_remat(model_cfg) -> None:
    """A remat policy that offloads (models.layers REMAT_NAMES) leaves F's residuals in host
    memory, and the stash carries them between ticks in device buffers that every branch of
    a tick's switch returns alike (jaxdist/pipeline/ops.py): refused, naming the policy
    that keeps the same values in device memory."""
    remat = getattr(model_cfg, "remat", "none")
    moved = REMAT_NAMES.get(remat, ((), ()))[1]
    if moved:
        twin = next(n for n, (kept, off) in REMAT_NAMES.items() if not off and
                    set(kept) == set(moved))
        raise UsageError(f"--remat {remat} moves saved values to host memory, which the "
                         f"pipeline layouts' stash (device buffers between ticks) cannot "
                         f"hold; use --remat {twin} (the same values in device memory) or a "
                         f"layout without stages")


def check_pipeline(model_cfg, stages: int, schedule: str, microbatches: int, virtual: int,
                   eval_every: int = 0, data: int = 1,
                   stage_blocks: tuple[int, ...] = (), context: int = 1,
                   combined: bool = False) -> None:
    V = virtual if schedule == "interleaved" else 1
    check_schedule(schedule, stages, microbatches, V, combined)
    chunk_blocks(model_cfg, stages, V, stage_blocks)
    check_moe_data(model_cfg, data, context)
    check_remat(model_cfg)
    if eval_every:
        # Evaluation is test-split accuracy on an image dataset (jaxdist/loop_hooks.py evaluate);
        # the pipeline layouts run decoders, which read tokens (models/build.py), so there
        # is nothing a pipelined forward could be evaluated on.
        raise UsageError("--eval-every measures test-split accuracy on an image dataset "
                         "(digits, cifar10, mnist), which the decoders of the pipeline "
                         "layouts (pp, tp_pp, fsdp_pp, ep_pp) cannot read; drop --eval-every")
