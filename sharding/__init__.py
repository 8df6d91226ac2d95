"""Layouts: named pure functions from (abstract train state, mesh) to PartitionSpecs."""

from sharding import layouts, pipeline  # noqa: F401  (registers the built-in layouts)
from sharding.registry import (batch_spec, check_layout, describe_layouts, get_layout,
                               layout_names, register_layout)

__all__ = ["batch_spec", "check_layout", "describe_layouts", "get_layout", "layout_names",
           "register_layout"]
