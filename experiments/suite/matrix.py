"""A preset expanded into runs: every model x layout entry x variant x sweep point x repeat,
in execution order, each with its settings, its name and its experiments.run flags; and the
checks a run would make itself, made before any starts."""

from __future__ import annotations

import collections
import itertools
import re
from dataclasses import dataclass, field

from experiments.suite.presets import Preset
from jaxdist.config import to_argv
from jaxdist.errors import UsageError

# Short names for sweep keys in run names (microbatches=4 -> mb4).
SHORT = {"microbatches": "mb", "batch_size": "b", "remat": "remat-", "dtype": "",
         "staleness": "s"}


@dataclass
class Planned:
    index: int
    name: str
    model: str
    entry: str
    variant: str
    sweep: dict
    repeat: int
    settings: dict
    args: list[str] = field(default_factory=list)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def sweep_points(sweep: dict[str, list]) -> list[dict]:
    if not sweep:
        return [{}]
    names = list(sweep)
    return [dict(zip(names, combo)) for combo in itertools.product(*(sweep[n] for n in names))]


# A suite of more runs would take weeks at seconds a run; suite.json lists every one.
MAX_RUNS = 10_000


def plan(preset: Preset, overrides: dict) -> list[Planned]:
    """Every run, in execution order: for each repeat, for each model, for each variant and
    sweep point, every layout entry in turn; round r starts at layout entry r (rotation).
    A run's settings: the preset's, its model, layout entry, variant, sweep point, then
    `overrides` (--set), each over the ones before."""
    runs, points = [], sweep_points(preset.sweep)
    n = len(preset.layouts)
    count = preset.repeats * len(preset.models) * len(preset.variants) * len(points) * n
    if count > MAX_RUNS:  # --repeats 100000000 planned for minutes, then ran out of memory
        raise UsageError(
            f"the suite would plan {count:,} runs ({len(preset.models)} model(s) x {n} layout "
            f"entries x {len(preset.variants)} variant(s) x {len(points)} sweep point(s) x "
            f"{preset.repeats:,} repeat(s)); at most {MAX_RUNS:,}: lower --repeats or the "
            f"preset's lists")
    for r in range(preset.repeats):
        order = preset.layouts[r % n:] + preset.layouts[:r % n]
        for model, variant, point, entry in itertools.product(
                preset.models, preset.variants, points, order):
            settings = {**preset.settings, "model": model, **entry.settings,
                        **variant.settings, **point, **overrides}
            runs.append(Planned(len(runs) + 1, _run_name(preset, settings, entry.name,
                                                         variant.name, point, r + 1),
                                str(settings["model"]), entry.name, variant.name, dict(point),
                                r + 1, settings, to_argv(settings)))
    dupes = sorted(x for x, k in collections.Counter(p.name for p in runs).items() if k > 1)
    if dupes:
        raise UsageError(f"preset {preset.path}: runs share a name ({', '.join(dupes[:3])}); "
                         f"give layout entries and variants distinct names")
    return runs


def _run_name(preset: Preset, settings: dict, entry: str, variant: str, point: dict,
              repeat: int) -> str:
    """model-entry[-variant][-sweep point]-rN, e.g. gpt-tiny-tp-remat-mb4-r1."""
    parts = [settings["model"], entry]
    if variant != "base" or len(preset.variants) > 1:
        parts.append(variant)
    parts += [f"{SHORT.get(k, k + '-')}{v}" for k, v in point.items()]
    parts.append(f"r{repeat}")
    return _slug("-".join(str(p) for p in parts))


def validate_names(runs: list[Planned]) -> None:
    """Models and layouts must be registered: one line listing the valid ones, before any run."""
    from models import model_names
    from sharding import layout_names

    models, layouts = set(model_names()), set(layout_names())
    for p in runs:
        if p.settings["model"] not in models:
            raise UsageError(f"unknown model {p.settings['model']!r} (run {p.name}); choose "
                             f"from {', '.join(sorted(models))}")
        layout = p.settings.get("layout")
        if layout not in layouts:
            raise UsageError(f"unknown layout {layout!r} (layout entry {p.entry}); choose from "
                             f"{', '.join(sorted(layouts))}")


def preflight(p: Planned) -> str | None:
    """The checks experiments.run makes before it starts (no devices, no processes): the
    reason the run would stop at once, or None. Only --dry-run uses it; a real run is
    always judged by its own exit status."""
    from experiments.validation import validate

    try:
        validate(_run_config(p))
    except UsageError as e:
        return str(e)
    return None


def check_values(runs: list[Planned]) -> None:
    """What the flags' values alone say, for every run (experiments.validation.check_values):
    a value no run can take (--set steps=-1, a preset's lr = nan) refuses the suite before
    anything is written, where every run would have started only to exit 2. A combination
    one run cannot take (a layout on a mesh without its axis) stays that run's failure."""
    from experiments import validation

    for p in runs:
        try:
            validation.check_values(_run_config(p))
        except UsageError as e:
            raise UsageError(f"run {p.index} ({p.name}): {e}") from None


def _run_config(p: Planned):
    """The RunConfig experiments.run makes of the run's flags (UsageError for a flag it
    refuses)."""
    from experiments import run as run_mod

    parser = run_mod.build_parser()
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))
    return run_mod.from_namespace(parser.parse_args(p.args))

