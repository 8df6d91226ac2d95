"""Writing outputs: a folder proven writable before a run starts, and JSON written whole (a
temporary file renamed), so a reader never sees half a file. Imports no jax."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def ensure_writable_dir(path: Path, flag: str) -> None:
    """Create `path` and prove a file can be written in it, or a one-line UsageError naming
    the flag (root bypasses permission bits, so only an actual write tells)."""
    from jaxdist.errors import UsageError

    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        raise UsageError(f"cannot write to {flag} {path}: {file} is a file, not a folder "
                         f"({flag} takes a folder, new or existing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to {flag} {path}: {e.strerror or e}") from None


def write_json(path: Path, data, strict: bool = False) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file (and a
    write that fails, a full disk, leaves the previous file whole: WriteError). `strict`
    (results.json): standard JSON, a number that is not finite (a diverged run's loss)
    written as null; Python's NaN token stopped jq and every JSON.parse at the first one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    if hasattr(data, "to_json"):  # a typed record (a plan) written as its JSON
        data = data.to_json()
    text = json.dumps(_finite(data) if strict else data, indent=2, sort_keys=False,
                      allow_nan=not strict)
    try:
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a full disk: what was there stays whole, the partial copy goes
        from jaxdist.errors import WriteError

        tmp.unlink(missing_ok=True)
        kept = "; the previous one is kept" if path.exists() else ""
        raise WriteError(f"cannot write {path}: {e.strerror or e}{kept}") from None


def _finite(obj):
    """`obj` with every float that is nan or infinite replaced by None, at every depth."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
