"""Study presets: a TOML file (experiments/presets/NAME.toml, or any path) naming models,
layout entries, variants, a sweep and settings, read into a checked `Preset` (format:
docs/suite.md). Every mistake is a one-line UsageError naming the file and the entry."""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from experiments.suite.settings import convert, resolve_key, settings_table
from jaxdist.config import Key
from jaxdist.errors import UsageError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
PRESET_KEYS = ("name", "description", "models", "repeats", "settings", "layouts", "variants",
               "sweep", "env", "timeout_s", "quick", "plan")
QUICK_KEYS = ("models", "repeats", "settings", "layouts", "variants", "sweep", "env",
              "timeout_s")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def find_preset(text: str) -> Path:
    path = Path(text)
    if text.endswith(".toml") or os.sep in text or "/" in text:
        if not path.is_file():
            raise UsageError(f"preset file {text} does not exist; built-in presets: "
                             f"{', '.join(preset_names())}")
        return path
    candidate = PRESETS_DIR / f"{text}.toml"
    if not candidate.is_file():
        raise UsageError(f"unknown preset {text!r}; choose from {', '.join(preset_names())} "
                         f"or give a path to a .toml file")
    return candidate


@dataclass
class Entry:
    """A named group of settings: a layout entry ([[layouts]]) or a variant ([[variants]])."""
    name: str
    settings: dict


@dataclass
class Preset:
    name: str
    path: Path
    description: str
    models: list[str]
    repeats: int
    settings: dict
    layouts: list[Entry]
    variants: list[Entry]
    sweep: dict[str, list]
    env: dict[str, str]
    timeout_s: float | None
    has_quick: bool = False


def load_preset(path: Path, quick: bool, keys: dict[str, Key]) -> Preset:
    """The preset with its [quick] block applied when `quick`; the block is checked either
    way, so a mistake in it shows before the full study runs."""
    preset = _load_preset(path, quick, keys)
    if not quick and preset.has_quick:
        _load_preset(path, True, keys)
    return preset


def _load_preset(path: Path, quick: bool, keys: dict[str, Key]) -> Preset:
    label = f"preset {path}"
    data = _read_toml(path, label)
    q = _quick_block(data, quick, label)
    models = _str_list(q.get("models", data["models"]), f"{label}: models")
    repeats = _positive(q.get("repeats", data.get("repeats", 1)), f"{label}: repeats")
    settings = settings_table(data.get("settings", {}), keys, f"{label} [settings]")
    settings.update(settings_table(q.get("settings", {}), keys, f"{label} [quick.settings]"))
    layouts = _layouts(data["layouts"], q.get("layouts", {}), keys, label)
    variants = _variants(data, q, keys, label)
    sweep = _sweep(q.get("sweep", data.get("sweep", {})), keys, label)
    env = dict(data.get("env", {}))
    env.update(q.get("env", {}))
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError(f"{label}: [env] values must be strings")
    timeout = q.get("timeout_s", data.get("timeout_s"))
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):  # nan and inf: no limit
        raise UsageError(f"{label}: timeout_s must be a positive finite number of seconds")
    name = data.get("name", path.stem)
    return Preset(str(name), path, str(data.get("description", "")), models, repeats, settings,
                  layouts, variants, sweep, env, timeout, has_quick=bool(data.get("quick")))


def _read_toml(path: Path, label: str) -> dict:
    """The file's top-level table, its entries checked and `models`, `layouts` present."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{label}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{label}: cannot read it: {getattr(e, 'strerror', None) or e}") \
            from None
    _check_keys(data, PRESET_KEYS, label)
    for need in ("models", "layouts"):
        if need not in data:
            raise UsageError(f"{label}: missing {need!r}")
    return data


def _quick_block(data: dict, quick: bool, label: str) -> dict:
    """The [quick] overrides when `quick` (an error if there are none), else {}; checked
    either way."""
    q = data.get("quick", {})
    if not isinstance(q, dict):
        raise UsageError(f"{label}: [quick] must be a table")
    _check_keys(q, QUICK_KEYS, f"{label} [quick]")
    if quick and not q:
        raise UsageError(f"--quick: {label} has no [quick] block (docs/suite.md); add one or "
                         f"run without --quick")
    return q if quick else {}


def _entries(raw, keys: dict[str, Key], label: str, kind: str, fallback: str = "") -> list[Entry]:
    """[[layouts]] or [[variants]]: tables with a distinct `name` (or the `fallback` key's
    value) and settings."""
    if not isinstance(raw, list) or not raw or not all(isinstance(e, dict) for e in raw):
        raise UsageError(f"{label}: {kind}s must be a non-empty array of tables "
                         f"([[{kind}s]] with name = ... and settings)")
    entries, seen = [], set()
    what = "layout entry" if kind == "layout" else "variant"
    for i, table in enumerate(raw):
        table = dict(table)
        name = table.pop("name", None) or (table.get(fallback) if fallback else None)
        if not isinstance(name, str) or not name:
            raise UsageError(f"{label}: {kind}s[{i}] needs name = \"...\"" +
                             (f" (or {fallback} = ...)" if fallback else ""))
        if name in seen:
            raise UsageError(f"{label}: {what} {name!r} given twice")
        seen.add(name)
        entries.append(Entry(name, settings_table(table, keys, f"{label} {kind}s.{name}")))
    return entries


def _layouts(raw, quick_layouts, keys: dict[str, Key], label: str) -> list[Entry]:
    """The layout entries, each with its `layout` (default: its name) and its
    [quick.layouts.NAME] overrides."""
    layouts = _entries(raw, keys, label, "layout", fallback="layout")
    for entry in layouts:
        entry.settings.setdefault("layout", entry.name)
    if not isinstance(quick_layouts, dict):
        raise UsageError(f"{label}: [quick.layouts] must be tables [quick.layouts.NAME]")
    for name, table in quick_layouts.items():
        match = [e for e in layouts if e.name == name]
        if not match:
            raise UsageError(f"{label}: [quick.layouts.{name}] names no layout entry; entries: "
                             f"{', '.join(e.name for e in layouts)}")
        match[0].settings.update(settings_table(table, keys, f"{label} quick.layouts.{name}"))
    return layouts


def _variants(data: dict, q: dict, keys: dict[str, Key], label: str) -> list[Entry]:
    """The variants (one, "base", with no settings, when the preset names none), narrowed
    to quick.variants when that is given."""
    variants = [Entry("base", {})]
    if "variants" in data:
        variants = _entries(data["variants"], keys, label, "variant")
    if "variants" in q:
        wanted = _str_list(q["variants"], f"{label}: quick.variants")
        names = [v.name for v in variants]
        for w in wanted:
            if w not in names:
                raise UsageError(f"{label}: quick.variants names {w!r}; variants are "
                                 f"{', '.join(names)}")
        variants = [v for v in variants if v.name in wanted]
    return variants


def _sweep(raw, keys: dict[str, Key], label: str) -> dict[str, list]:
    if not isinstance(raw, dict):
        raise UsageError(f"{label}: [sweep] must be a table of key = [values]")
    sweep = {}
    for name, values in raw.items():
        key = resolve_key(name, keys, f"{label} [sweep]")
        if not isinstance(values, list) or not values:
            raise UsageError(f"{label} [sweep]: {name} must be a non-empty list of values")
        sweep[key.name] = [convert(key, v, f"{label} [sweep]") for v in values]
    return sweep


def _check_keys(table: dict, allowed, where: str) -> None:
    for k in table:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=3, cutoff=0.5)
            hint = ("closest: " + ", ".join(close)) if close else \
                ("entries are " + ", ".join(allowed))
            raise UsageError(f"{where}: unknown entry {k!r}; {hint}")


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v
                                                           for v in value):
        raise UsageError(f"{where}: expected a non-empty list of names")
    return list(value)


def _positive(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: expected a positive integer, got {value!r}")
    return value
