"""results.json: its schema (documented in docs/results.md), a checker, and an atomic write."""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA_VERSION = 1

NUM = (int, float)
OPT_NUM = (int, float, type(None))

# key -> expected type, or a nested spec dict. Extra keys are allowed (later issues add
# blocks); missing keys and wrong types are not.
SCHEMA = {
    "schema_version": int,
    "framework": str,
    "layout": str,
    "mesh": dict,
    "model": {"name": str, "params": int, "flops_per_sample": NUM, "tokens_per_sample": int},
    "config": dict,
    "env": {"jax_version": str, "backend": str, "device_kind": str, "num_devices": int,
            "num_processes": int, "simulated": bool},
    "compile_s": OPT_NUM,  # null where nothing is compiled (eager PyTorch): not 0.0
    "step_time_s": {"n": int, "mean": NUM, "std": NUM, "p50": NUM, "p90": NUM, "p99": NUM,
                    "min": NUM, "max": NUM, "ci95": OPT_NUM},
    "warmup_step_time_s": list,
    "throughput": {"samples_per_s": NUM, "tokens_per_s": OPT_NUM},
    "mfu": {"value": OPT_NUM, "hfu": OPT_NUM, "peak_flops_per_device": OPT_NUM,
            "model_flops_per_step": NUM, "compiled_flops_per_step": OPT_NUM,
            "reason": (str, type(None))},
    "memory": {"state_bytes_per_device": int, "state_bytes_by_device": list,
               "compiled": (dict, type(None)), "measured_peak_bytes": OPT_NUM},
    "sharding": {"sharded_bytes": int, "replicated_bytes": int, "replicated_leaves": int,
                 "parts": dict},
    "loss": list,
    "power": {"available": bool},
}

COMPILED = {"argument_bytes": int, "output_bytes": int, "alias_bytes": int,
            "temp_bytes": int, "peak_bytes": int, "peak_bytes_note": str}


# A run interrupted before its first timed step has no latency figures: null, with a reason.
INTERRUPTED = dict(SCHEMA,
                   step_time_s={"n": int, "reason": str},
                   throughput={"samples_per_s": OPT_NUM, "tokens_per_s": OPT_NUM})


def check(results: dict) -> list[str]:
    """Problems with `results` against the schema; empty when it conforms."""
    timed = (results.get("step_time_s") or {}).get("n")
    spec = INTERRUPTED if results.get("status") == "interrupted" and not timed else SCHEMA
    problems = _check(results, spec, "")
    if results.get("status") not in (None, "complete", "interrupted"):
        problems.append(f"status: expected complete or interrupted, got {results['status']!r}")
    compiled = results.get("memory", {}).get("compiled")
    if isinstance(compiled, dict):
        problems += _check(compiled, COMPILED, "memory.compiled.")
    if isinstance(results.get("loss"), list):
        if not all(isinstance(x, NUM) for x in results["loss"]):
            problems.append("loss: every entry must be a number")
    return problems


def _check(obj: dict, spec: dict, prefix: str) -> list[str]:
    problems = []
    for key, kind in spec.items():
        if key not in obj:
            problems.append(f"{prefix}{key}: missing")
        elif isinstance(kind, dict):
            if not isinstance(obj[key], dict):
                problems.append(f"{prefix}{key}: expected an object")
            else:
                problems += _check(obj[key], kind, f"{prefix}{key}.")
        elif isinstance(obj[key], bool) and kind in (int, NUM, OPT_NUM):
            problems.append(f"{prefix}{key}: expected a number, got a boolean")
        elif not isinstance(obj[key], kind):
            problems.append(f"{prefix}{key}: expected {kind}, got {type(obj[key]).__name__}")
    return problems


def ensure_writable_dir(path: Path, flag: str) -> None:
    """Create `path` and prove a file can be written in it, or a one-line UsageError naming
    the flag (root bypasses permission bits, so only an actual write tells)."""
    from jaxdist.errors import UsageError

    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to {flag} {path}: {e.strerror or e}") from None


def write_json(path: Path, data) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
