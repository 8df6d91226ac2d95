"""Finding runs: a suite's directory (finished, failed and unfinished runs, for the report)
or the run directories a user names (for compare), each finished run as a RunRecord."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from jaxdist.errors import UsageError
from jaxdist.record import RecordError, RunRecord

LAYOUT_ORDER = ("ddp", "zero1", "fsdp", "hsdp", "tp", "fsdp_tp", "ep", "ps-sync", "ps-async",
                "ps-ssp")


def layout_rank(group: str) -> tuple:
    """Sort key putting layouts (`RunRecord.group`) in LAYOUT_ORDER, unknown ones last."""
    base = group.split(" ")[0].split("+")[0]
    return (LAYOUT_ORDER.index(base) if base in LAYOUT_ORDER else len(LAYOUT_ORDER), group)


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from every event file under logdir, read through the TFRecord
    framing (u64 length, u32 crc, payload, u32 crc) without the tensorboard package. A record
    cut short (a run killed while writing) ends that file."""
    from jaxdist.tbx import tensorboardx
    tensorboardx()  # without torch
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            if pos + 12 + length + 4 > len(data):
                break
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            try:
                event = event_pb2.Event.FromString(payload)
            except Exception:  # noqa: BLE001 - a corrupt record: skip the rest of the file
                break
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@dataclass
class Failure:
    name: str
    status: str
    reason: str
    stderr_tail: str
    command: str


def collect(root: Path, skip: Path | None) -> tuple[list[RunRecord], list[Failure], list[str],
                                                      dict]:
    """(finished runs, failed or unfinished runs, problems, suite meta). Unfinished: the
    suite's records, results.json with status "interrupted" (a missing status is a complete
    run), and run directories without a results.json (a run killed with SIGKILL)."""
    if not root.exists():
        raise UsageError(f"runs directory {root} does not exist")
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    try:
        found = sorted(p for p in root.rglob("results.json")
                       if skip is None or skip.resolve() not in p.resolve().parents)
    except OSError as e:
        raise UsageError(f"cannot read runs directory {root}: {e.strerror or e}") from None
    if not os.access(root, os.R_OK | os.X_OK):
        raise UsageError(f"cannot read runs directory {root}: permission denied")
    runs, problems, unfinished = [], [], []
    for path in found:
        name = _name(root, path.parent)
        try:
            run = RunRecord.load(path, name)
        except (OSError, RecordError) as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        if run.status == "interrupted":
            unfinished.append(Failure(name, "interrupted", "results.json has status "
                                      f"\"interrupted\" ({len(run.loss)} steps recorded)",
                                      "", ""))
            continue
        timed = read_scalars(path.parent).get("train/step_time_s", [])
        by_step = dict(timed)  # the last value written for a step wins
        runs.append(RunRecord(path.parent, run.results, name,
                              tuple(by_step[s] for s in sorted(by_step)),
                              "tensorboard" if timed else "none"))

    failures, meta = [], {}
    suite_json = root / "suite.json"
    if suite_json.exists():
        try:
            meta = json.loads(suite_json.read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{suite_json}: unreadable ({e})")
            meta = {}
        finished = {r.path.resolve() for r in runs}
        for rec in meta.get("runs", []) if isinstance(meta, dict) else []:
            if not isinstance(rec, dict) or "name" not in rec:
                continue
            if (root / rec["name"]).resolve() in finished:
                continue
            status = rec.get("status", "pending")
            failures.append(Failure(rec["name"], status,
                                    rec.get("reason") or ("not run yet" if status == "pending"
                                                          else status),
                                    rec.get("stderr_tail") or "", rec.get("command", "")))
    named = {f.name for f in failures}
    without = _dirs_without_results(root, skip, found)
    unfinished += [Failure(name, "unfinished", "no results.json: the run was killed, or is "
                           "still running", "", "")
                   for name, _ in without]
    failures += sorted((f for f in unfinished if f.name not in named), key=lambda f: f.name)
    # Empty folders count as killed runs only beside evidence of runs: a folder of empty
    # folders alone (e.g. /etc's) is not a runs directory, and the report is not written there.
    if not (runs or suite_json.exists() or any(events for _, events in without)
            or any(f.status == "interrupted" for f in unfinished)):
        if problems:  # records there, none readable: say which, not that there are none
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UsageError(f"no runs in {root}: {problems[0]}{more}")
        raise UsageError(f"no runs in {root}: no results.json, TensorBoard events or "
                         f"suite.json below it (run python -m experiments.suite or "
                         f"experiments.run first)")
    runs.sort(key=lambda r: (r.model, layout_rank(r.group), r.name))
    return runs, failures, problems, meta


def _name(root: Path, run_dir: Path) -> str:
    return str(run_dir.relative_to(root)) if run_dir != root else run_dir.name


def _dirs_without_results(root: Path, skip: Path | None, found: list[Path]
                          ) -> list[tuple[str, bool]]:
    """(name, holds event files) of the run directories that never got a results.json:
    those holding TensorBoard event files (a run writes them from its first step) and empty
    ones (a run killed while compiling), unless they sit inside a run that has a
    results.json. Hidden directories and the report's own output are not runs."""
    finished = {p.parent.resolve() for p in found}
    names = []
    try:
        dirs = sorted([root, *(p for p in root.rglob("*") if p.is_dir())])
    except OSError:
        return []
    for d in dirs:
        rel = d.relative_to(root).parts
        if any(part.startswith(".") for part in rel) or (
                skip is not None and (d.resolve() == skip.resolve() or
                                      skip.resolve() in d.resolve().parents)):
            continue
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        has_events = any(e.name.startswith("events.out.tfevents.") for e in entries)
        if not has_events and (entries or d == root):
            continue
        resolved = d.resolve()
        if resolved in finished or finished & set(resolved.parents):
            continue
        names.append((_name(root, d), has_events))
    return names


def find_runs(paths) -> list[RunRecord]:
    """The runs a user names: run directories, results.json files, or folders searched for
    them. Anything that is not a valid results.json is a UsageError naming the file."""
    runs = []
    for item in paths:
        path = Path(item)
        if not path.exists():
            raise UsageError(f"{path}: no such run directory")
        files = [path] if path.is_file() else (
            [path / "results.json"] if (path / "results.json").exists()
            else sorted(path.rglob("results.json")))
        if not files:
            raise UsageError(f"{path}: no results.json in it or below it")
        for f in files:
            try:
                runs.append(RunRecord.load(f, require_valid=True))
            except RecordError as e:
                raise UsageError(f"{f}: {e}") from None
    unique = {r.path.resolve(): r for r in runs}
    return list(unique.values())
