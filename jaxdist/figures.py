"""Typed figures: what a prediction is made of (the step's time terms, the memory verdict,
the throughput, what the compiled program says) are frozen records, read by attribute;
`to_json` turns one into its plan.json / results.json block at the edge.

A record lists every field any kind of its figure has; a field a kind does not have (a
roofline step has no kernel launches, a one-program step no pipeline ticks) is `ABSENT`:
false, and left out of the JSON, so each kind's block holds only its own keys."""

from __future__ import annotations

import dataclasses
from typing import Any


class _Absent:
    """The value of a field this kind of figure does not have."""

    _one = None

    def __new__(cls):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self):
        return (_Absent, ())

    def __deepcopy__(self, memo):
        return self


ABSENT: Any = _Absent()


def json_of(value):
    """`value` as JSON data: records by their `to_json`, containers item by item."""
    if isinstance(value, Figures):
        return value.to_json()
    if isinstance(value, dict):
        return {k: json_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_of(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class Figures:
    """A frozen record of figures; its JSON is its fields in order, ABSENT ones left out."""

    def to_json(self) -> dict:
        return {f.name: json_of(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not ABSENT}

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def has(self, name: str) -> bool:
        """Whether this kind of figure has field `name` (it is not ABSENT)."""
        return getattr(self, name, ABSENT) is not ABSENT
