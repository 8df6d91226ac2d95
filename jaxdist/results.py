"""Moved to jaxdist.record; this name stays only so branches written against it still import.
New code imports jaxdist.record."""

from jaxdist.record import (  # noqa: F401
    COMPILED, INTERRUPTED, SCHEMA, SCHEMA_VERSION, check, ensure_writable_dir, write_json)
