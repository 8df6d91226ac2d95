"""A suite's run settings: `section.field`, `field` or `field-name` (a RunConfig field, from
jaxdist.config.keys()) resolved with a one-line error naming the closest keys, and values from
a preset (TOML-typed) or --set (strings) converted to the field's type, choices checked."""

from __future__ import annotations

import difflib

from jaxdist.config import Key
from jaxdist.errors import UsageError

# Keys the suite sets itself: a preset or --set may not.
RESERVED = {"logdir": "the suite gives every run --logdir DIR/<run-name>"}


def resolve_key(raw: str, keys: dict[str, Key], where: str) -> Key:
    """`train.batch_size`, `batch_size` or `batch-size` -> its Key; else a one-line error
    listing the closest valid keys."""
    name = raw.strip().replace("-", "_")
    section, _, field_name = name.rpartition(".")
    key = keys.get(field_name)
    if key is not None and section in ("", key.section) and field_name not in RESERVED:
        return key
    if field_name in RESERVED and key is not None:
        raise UsageError(f"{where}: key {raw!r} cannot be set: {RESERVED[field_name]}")
    if key is not None:
        raise UsageError(f"{where}: unknown key {raw!r}; {field_name!r} is in section "
                         f"{key.section}: write {key.section}.{key.name} or {key.name}")
    spellings = sorted(set(keys) | {f"{k.section}.{k.name}" for k in keys.values()})
    close = difflib.get_close_matches(name, spellings, n=5, cutoff=0.5)
    if not close:  # a wrong section with a right field, or nothing alike
        close = [s for s in spellings if field_name and field_name in s][:5]
    hint = (f"closest: {', '.join(close)}" if close else
            f"keys are RunConfig fields (section.field or field), e.g. train.batch_size, "
            f"mesh, steps")
    raise UsageError(f"{where}: unknown key {raw!r}; {hint}")


def convert(key: Key, value, where: str):
    """A preset (TOML-typed) or --set (string) value -> the field's type, choices checked."""
    text = value if isinstance(value, str) else None
    try:
        if key.kind == "bool":
            if isinstance(value, bool):
                out = value
            elif text is not None and text.strip().lower() in ("true", "1", "yes", "on"):
                out = True
            elif text is not None and text.strip().lower() in ("false", "0", "no", "off"):
                out = False
            else:
                raise ValueError
        elif key.kind == "int":
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError
            out = int(value)
        elif key.kind == "float":
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        else:
            if isinstance(value, (dict, list)):
                raise ValueError
            out = value if isinstance(value, str) else str(value).lower() \
                if isinstance(value, bool) else str(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: {key.name} must be {'a' if key.kind != 'int' else 'an'} "
                         f"{key.kind}, got {value!r}") from None
    if key.choices and out not in key.choices:
        raise UsageError(f"{where}: {key.name}={out!r} is not one of "
                         f"{', '.join(map(str, key.choices))}")
    return out


def settings_table(table, keys: dict[str, Key], where: str) -> dict[str, object]:
    if not isinstance(table, dict):
        raise UsageError(f"{where}: expected a table of key = value settings")
    out = {}
    for raw, value in table.items():
        key = resolve_key(raw, keys, where)
        out[key.name] = convert(key, value, where)
    return out


def parse_set(items: list[str], keys: dict[str, Key]) -> dict[str, object]:
    out = {}
    for item in items:
        raw, sep, value = item.partition("=")
        if not sep or not raw.strip():
            raise UsageError(f"--set {item!r} is not key=value (e.g. --set batch_size=32)")
        key = resolve_key(raw, keys, "--set")
        out[key.name] = convert(key, value, f"--set {raw.strip()}")
    return out

