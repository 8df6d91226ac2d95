"""Shard snapshots on disk: raw .npy arrays plus one meta.json, made visible atomically.

A snapshot is written into `snap-<version>.tmp/`, fsynced, renamed to `snap-<version>/`, and
only then named in `LATEST` (a small file replaced with os.replace). A crash at any point
leaves the previous LATEST intact; a reader never sees half a snapshot. `EPOCH` counts the
lives of the shard so a restarted server can tell requests of an earlier life apart.
`shard_meta` and `restore_shard` say what of a ps.core.ShardCore a snapshot holds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(directory: Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write a snapshot; OSError naming the file that could not be written (a full disk, a
    file-size limit), with nothing of this snapshot left behind."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"snap-{meta['version']:012d}"
    tmp = directory / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    path = tmp
    try:
        for key, value in arrays.items():
            path = tmp / f"{key}.npy"
            with open(path, "wb") as f:
                np.save(f, np.asarray(value), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        path = tmp / "meta.json"
        _write_atomic(path, json.dumps(meta))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # numpy's short write ("N requested and M written") carries no errno or file
        raise OSError(e.errno, e.strerror or "short write (a full disk or a file-size "
                      "limit)", str(path)) from None
    final = directory / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(directory / "LATEST", name)
    # The one LATEST names and the one before: shards killed between their snapshots of
    # one version still share one (ps.resume); unfinished ones go.
    keep = {name, *(f"snap-{v:012d}" for v in versions(directory)[-2:])}
    for old in directory.glob("snap-*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return final


def versions(directory: Path) -> list[int]:
    """The versions of the complete snapshots in `directory`, oldest first."""
    out = []
    for snap in directory.glob("snap-*"):
        digits = snap.name[len("snap-"):]
        if digits.isdigit() and (snap / "meta.json").is_file():
            out.append(int(digits))
    return sorted(out)


def meta_of(directory: Path, version: int) -> dict:
    return json.loads((directory / f"snap-{version:012d}" / "meta.json").read_text())


def load(directory: Path, version: int | None = None
         ) -> tuple[dict[str, np.ndarray], dict] | None:
    """(arrays, meta) of the latest complete snapshot (or of `version`), or None if there
    is none."""
    if version is None:
        latest = directory / "LATEST"
        if not latest.exists():
            return None
        snap = directory / latest.read_text().strip()
    else:
        snap = directory / f"snap-{version:012d}"
    meta = json.loads((snap / "meta.json").read_text())
    arrays = {p.stem: np.load(p, allow_pickle=False) for p in snap.glob("*.npy")}
    return arrays, meta


def next_epoch(directory: Path) -> int:
    """Bump and return this shard's life count (0 for the first life)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "EPOCH"
    epoch = int(path.read_text()) + 1 if path.exists() else 0
    _write_atomic(path, str(epoch))
    return epoch


def shard_meta(core) -> dict:
    """meta.json of a ShardCore: its version and epoch, each worker's last applied step and
    clock, who is retired, and its accounting (the arrays come from its optimizer)."""
    workers = range(core.num_workers)
    return {"version": core.version, "epoch": core.epoch, "mode": core.mode,
            "num_workers": core.num_workers, "size": core.size,
            "last_step": [core.last_step[w] for w in workers],
            "clock": [core.clock[w] for w in workers],
            "retired": {str(w): r for w, r in core.retired.items()},
            **core.accounting.meta()}


def restore_shard(core, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Put a snapshot back into a ShardCore (under its lock; its epoch is already the new
    one); ValueError when the snapshot is of another shape of shard."""
    if meta["size"] != core.size or meta["num_workers"] != core.num_workers:
        raise ValueError("snapshot does not match this shard (size or workers)")
    core.optimizer.load(arrays)
    core.version = meta["version"]
    core.last_step = dict(enumerate(meta["last_step"]))
    core.clock = dict(enumerate(meta["clock"]))
    core.retired = {int(w): r for w, r in meta["retired"].items()}
    core.alive = set(range(core.num_workers)) - set(core.retired)
    core.started = set(core.alive)  # they were training when the snapshot was taken
    core.accounting.load(meta)
    core.resync = True
    core.accounting.events.append(f"epoch {core.epoch}: restored version {core.version} "
                                  f"from a snapshot written in epoch {meta['epoch']}")
