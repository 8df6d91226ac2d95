"""Command-line plumbing shared by the PS entry points: one-line usage errors, and a run
config turned back into the flags that reproduce it (servers and workers get exactly the
options the user typed, so every process computes the same model, map and optimizer)."""

from __future__ import annotations

import dataclasses

from jaxdist.errors import OneLineParser  # noqa: F401  (re-exported for the PS entry points)


def config_argv(cfg) -> list[str]:
    """`RunConfig` -> ["--mesh", "4x1", "--no-progress", ...], the inverse of
    jaxdist.config.from_namespace."""
    out = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            flag = "--" + f.name.replace("_", "-")
            value = getattr(part, f.name)
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            else:
                out += [flag, str(value)]
    return out
