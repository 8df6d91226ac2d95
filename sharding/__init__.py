"""Layouts: named pure functions from (abstract train state, mesh) to PartitionSpecs."""

from sharding import layouts, pipeline  # noqa: F401  (registers the built-in layouts)
from sharding.optimizer import Layout
from sharding.registry import (batch_spec, check_layout, describe_layouts, get_layout,
                               layout_names, register_layout)

__all__ = ["Layout", "batch_spec", "check_layout", "describe_layouts", "get_layout",
           "layout_names", "register_layout"]
