"""A PS worker's per-step figures, on disk as the run goes.

A worker keeps ~10 numbers a step (loss, step time, phases, each call's latency). Written
as JSON when the worker stopped, they made a preempted run's exit grow with its length:
70,886 steps were a 14 MB worker file and part of a ~90 s exit, past SLURM's 30 s between
SIGTERM and SIGKILL. Now each series is appended, every CHUNK_STEPS steps, to its own file
of little-endian float64 (`worker<w>.series/<name>.f64`): at a stop only the last chunk is
left to write, and the collector reads the files with numpy. worker<w>.json names them
(`series`); `read_worker` puts the lists back where the JSON had them, so the collector and
an older worker file read alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHUNK_STEPS = 1024
DTYPE = "<f8"
# name -> where read_worker puts it in the worker's record (phases_s.* nested)
NAMES = ("losses", "step_s", "compute_s", "pull_wait_s", "push_s", "pull_s",
         "phases_s.pull_s", "phases_s.push_s", "phases_s.batch_s")


class SeriesWriter:
    """Appends the new values of named lists (which the worker keeps appending to) to
    `folder/<name>.f64`; nothing is written when folder is None."""

    def __init__(self, folder: Path | None, lists: dict[str, list]):
        self.folder, self.lists = folder, lists
        self.written = dict.fromkeys(lists, 0)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            for name in lists:
                (folder / f"{name}.f64").write_bytes(b"")  # a rerun's files start empty

    def step_done(self, steps: int) -> None:
        if steps % CHUNK_STEPS == 0:
            self.flush()

    def flush(self) -> None:
        if self.folder is None:
            return
        for name, values in self.lists.items():
            new = values[self.written[name]:]
            if new:
                path = self.folder / f"{name}.f64"
                try:
                    with open(path, "ab") as f:
                        f.write(np.asarray(new, DTYPE).tobytes())
                except OSError as e:  # a full disk: one line naming the file (WriteError)
                    from jaxdist.errors import WriteError

                    raise WriteError(f"cannot write {path}: {e.strerror or e}") from None
                self.written[name] += len(new)

    def describe(self, relative_to: Path) -> dict:
        """What worker<w>.json says of the files (after the last flush)."""
        return {"dir": str(self.folder.relative_to(relative_to)), "dtype": DTYPE,
                "counts": dict(self.written)}


def read_worker(path: Path) -> dict:
    """A worker's record with its series as lists, where an all-JSON record had them."""
    record = json.loads(Path(path).read_text())
    series = record.pop("series", None)
    if series:
        folder = Path(path).parent / series["dir"]
        for name, count in series["counts"].items():
            values = np.fromfile(folder / f"{name}.f64", series["dtype"], count).tolist()
            where, _, leaf = name.rpartition(".")
            (record.setdefault(where, {}) if where else record)[leaf] = values
    return record
