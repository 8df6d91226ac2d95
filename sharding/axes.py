"""Which mesh axes the batch is split on: every axis but `tensor` (a tensor-parallel group
works on the same rows), `stage` (every pipeline stage sees the same micro-batches) and
`context` (a context-parallel group works on the same rows, each on its part of the
sequence: models/context.py; gradients are reduced over it as over a batch axis). The
batch's placement, the data-parallel gradient reduction and the distributed optimizer all
read it from here."""

from __future__ import annotations

NOT_BATCH = ("tensor", "stage", "context")


def batch_axes(axis_names) -> tuple[str, ...]:
    """The batch's mesh axes among `axis_names`, outer to inner."""
    return tuple(a for a in axis_names if a not in NOT_BATCH)
