"""What every plan kind has: its JSON (`to_json`, the file `file_name` names), its text
(`text`), and the header line they share."""

from __future__ import annotations

import math


class PlanBase:
    """A plan kind is a frozen dataclass with `to_json()`, `text()`, `file_name` and the
    facts `headline` reads (model, layout, distributed_optimizer, mesh, seq_len)."""

    file_name: str

    def to_json(self) -> dict:
        raise NotImplementedError

    def text(self) -> str:
        raise NotImplementedError

    def get(self, key: str, default=None):
        """One top-level block of the plan's JSON by name (for code that reads a plan as
        plan.json; typed code reads the fields)."""
        return self.to_json().get(key, default)


def model_text(p) -> str:
    """'NAME (N params, sequence L)'."""
    seq = f", sequence {p.seq_len:,}" if p.seq_len else ""
    return f"{p.model['name']} ({p.model['params']:,} params{seq})"


def headline(p) -> str:
    """The first line of a plan from shapes: model, layout and mesh."""
    from jaxdist.summary import dist_opt_text

    dist_opt = dist_opt_text({"distributed_optimizer": p.distributed_optimizer,
                              "layout": p.layout})
    return (f"dry run: {model_text(p)}, layout {p.layout}{dist_opt} on "
            + " x ".join(f"{k}={v}" for k, v in p.mesh.items())
            + f" ({math.prod(p.mesh.values())} devices)")
