"""Published figures as data: one record per metric, each with its source and the controls
a comparison needs (hardware, GPUs, precision, batch, sequence length, power cap, read-out).

Records live in JSON or TOML files. Every `*.json` / `*.toml` file in this folder is loaded
(`published.json` holds the 253 records of shared/notes/published-baselines.json, normalised);
`experiments.compare --baselines PATH` adds a user's files or folders. The format is in
docs/compare.md ("Adding a published record"); `FIELDS` below is its machine-readable form.

A file is either a list of records, or an object whose `records` key holds the list (JSON);
TOML: `[[records]]` tables. TOML has no null: leave a key out to mean "not stated".
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

from jaxdist.errors import UsageError

HERE = Path(__file__).resolve().parent

STR, INT, NUM = "str", "int", "num"
# name -> (kind, required). Optional fields default to None ("not stated in the source").
FIELDS = {
    "id": (STR, True),              # unique over every loaded file
    "framework": (STR, True),       # "PyTorch (torchtitan)", "JAX (MaxText)", ...
    "source": ("source", True),     # object, see SOURCE_FIELDS
    "strategy": (STR, True),        # as published, e.g. "FSDP2 (1D) + torch.compile"
    "layout": (STR, True),          # one of LAYOUTS: what compare matches on
    "model": (STR, True),           # as published, e.g. "Llama 3.1 8B"
    "jaxdist_model": (STR, False),  # a registered model name when the record measured one
    "params": (STR, False),
    "hardware": (STR, True),        # as published
    "device": (STR, False),         # normalised GPU name: H200, H100, A100, V100, ...
    "num_gpus": (INT, False),
    "precision": (STR, False),      # as published
    "dtype": (STR, False),          # normalised: one of DTYPES
    "global_batch": (INT, False),
    "local_batch": (INT, False),    # per GPU
    "seq_len": (INT, False),
    "image_size": (INT, False),
    "power_cap_w": (NUM, False),
    "readout": (STR, True),         # read-out rule: "iteration 90", "p50 over iterations"
    "metric": (STR, True),
    "value": (NUM, False),          # a number; else value_text (and value_min / value_max)
    "value_min": (NUM, False),
    "value_max": (NUM, False),
    "value_text": (STR, False),     # the value as published when it is not a plain number
    "unit": (STR, True),
    "notes": (STR, False),
}
SOURCE_FIELDS = ("title", "repo", "path", "commit", "url", "paper", "locator", "detail")
LAYOUTS = ("ddp", "fsdp", "hsdp", "zero1", "fsdp+tp", "single", "ps", "comparison", "other")
DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8", "mixed")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def load(extra=(), builtin: bool = True) -> list[dict]:
    """Every record of this folder (if `builtin`) and of `extra` (files or folders),
    validated; raises UsageError naming the file, the record and the problem."""
    files = sorted(_data_files(HERE)) if builtin else []
    for item in extra:
        path = Path(item)
        if not path.exists():
            raise UsageError(f"baselines {path}: no such file or folder")
        files += sorted(_data_files(path)) if path.is_dir() else [path]
    records, seen = [], {}
    for path in files:
        for i, rec in enumerate(_read(path)):
            name = rec.get("id", f"#{i}") if isinstance(rec, dict) else f"#{i}"
            where = f"baselines {path}: record {name}"
            problems = validate(rec)
            if problems:
                raise UsageError(f"{where}: {'; '.join(problems)}")
            if rec["id"] in seen:
                raise UsageError(f"{where}: id {rec['id']!r} already used in {seen[rec['id']]}")
            seen[rec["id"]] = path
            full = {name: rec.get(name) for name in FIELDS}
            full["file"] = str(path)
            records.append(full)
    return records


def _data_files(folder: Path):
    return [p for p in folder.iterdir() if p.suffix in (".json", ".toml") and p.is_file()]


def _read(path: Path) -> list:
    if path.suffix not in (".json", ".toml"):
        raise UsageError(f"baselines {path}: not a .json or .toml file")
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = tomllib.loads(path.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"baselines {path}: cannot parse: {e}") from None
    if isinstance(data, dict):
        data = data.get("records")
    if not isinstance(data, list):
        raise UsageError(f"baselines {path}: expected a list of records (or an object "
                         f"with a 'records' list)")
    return data


def validate(rec) -> list[str]:
    """Problems with one record; empty when it is valid."""
    if not isinstance(rec, dict):
        return ["a record must be an object (a table in TOML)"]
    problems = []
    unknown = sorted(set(rec) - set(FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} (fields: {', '.join(FIELDS)})")
    for name, (kind, required) in FIELDS.items():
        value = rec.get(name)
        if value is None:
            if required:
                problems.append(f"{name}: missing")
            continue
        if kind == "source":
            problems += _check_source(value)
        elif kind == STR and not (isinstance(value, str) and value.strip()):
            problems.append(f"{name}: expected a non-empty string, got {value!r}")
        elif kind == INT and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
            problems.append(f"{name}: expected a positive integer, got {value!r}")
        elif kind == NUM and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value)):
            problems.append(f"{name}: expected a number, got {value!r}")
    if rec.get("value") is None and not rec.get("value_text"):
        problems.append("value: missing (give a number, or value_text for a claim that is "
                        "not one)")
    if isinstance(rec.get("layout"), str) and rec["layout"] not in LAYOUTS:
        problems.append(f"layout: {rec['layout']!r} is not one of {', '.join(LAYOUTS)}")
    if isinstance(rec.get("dtype"), str) and rec["dtype"] not in DTYPES:
        problems.append(f"dtype: {rec['dtype']!r} is not one of {', '.join(DTYPES)}")
    return problems


def _check_source(src) -> list[str]:
    if not isinstance(src, dict):
        return ["source: expected an object with title and repo/path/commit, paper or url"]
    problems = []
    unknown = sorted(set(src) - set(SOURCE_FIELDS))
    if unknown:
        problems.append(f"source: unknown field(s) {', '.join(unknown)}")
    if not (isinstance(src.get("title"), str) and src["title"].strip()):
        problems.append("source.title: missing")
    has_repo = all(isinstance(src.get(k), str) and src[k] for k in ("repo", "commit"))
    if has_repo and not _COMMIT.fullmatch(src["commit"]):
        problems.append(f"source.commit: {src['commit']!r} is not a git commit hash")
    if not (has_repo or src.get("url") or src.get("paper")):
        problems.append("source: needs repo + commit (+ path), a paper, or a url")
    if not (src.get("locator") or src.get("path") or src.get("detail")):
        problems.append("source: say where in it (locator: table, section or row; or path)")
    return problems
