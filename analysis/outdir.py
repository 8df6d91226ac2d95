"""An output folder a reader tool (report, compare) may fill: a new path, an empty folder, or
a folder the same tool wrote earlier, recognised by its marker file, which lists what it
wrote. Anything else (a user's folder, a run directory, a file) is refused before anything
is touched: the tools never delete a path they did not create.

The output is built in a temporary sibling and moved into place, so a failure leaves nothing
half-written; replacing an earlier output removes only the files its marker lists.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from jaxdist.errors import UsageError


@dataclass(frozen=True)
class Tool:
    name: str                 # "report": the marker says which tool wrote the folder
    marker: str               # the marker's file name, e.g. ".jaxdist-report"
    # An output written before markers existed: its index file, that file's first line, and
    # every name such an output holds (recognised only when it holds nothing else).
    legacy_index: str = ""
    legacy_first_line: str = ""
    legacy_names: frozenset = frozenset()


REFUSE = "; choose a new or empty folder"


def _entries(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise UsageError(f"cannot read --out {path}: {e.strerror or e}{REFUSE}") from None


def _written_earlier(path: Path, tool: Tool, entries: list[str]) -> set[str] | None:
    """The files an earlier output of `tool` in `path` wrote (marker or legacy), else None."""
    try:
        marker = json.loads((path / tool.marker).read_text())
        files = set(marker["files"]) if marker.get("tool") == tool.name else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        files = None
    if files is None and tool.legacy_index and tool.legacy_index in entries:
        try:
            first = (path / tool.legacy_index).read_text().split("\n", 1)[0]
        except (OSError, UnicodeDecodeError):
            first = ""
        if first == tool.legacy_first_line:
            files = set(tool.legacy_names)
    return files


def check(out: Path, tool: Tool) -> str:
    """"new", "empty" or "ours" (an earlier output of `tool` holding only what it wrote);
    UsageError, one line, for anything else."""
    if out.is_symlink():
        raise UsageError(f"--out {out} is a symbolic link{REFUSE}")
    if not out.exists():
        return "new"
    if not out.is_dir():
        raise UsageError(f"--out {out} is an existing file{REFUSE}")
    entries = _entries(out)
    if not entries:
        return "empty"
    if "results.json" in entries:
        raise UsageError(f"--out {out} is a run directory (it holds results.json){REFUSE}")
    files = _written_earlier(out, tool, entries)
    if files is None:
        raise UsageError(f"--out {out} is a folder {tool.name} did not write (it holds "
                         f"{entries[0]}{', ...' if len(entries) > 1 else ''}){REFUSE}")
    others = [e for e in entries if e != tool.marker and
              (e not in files or (out / e).is_dir() and not (out / e).is_symlink())]
    if others:
        raise UsageError(f"--out {out} holds {others[0]}, which {tool.name} did not write"
                         f"{REFUSE}")
    return "ours"


@contextmanager
def staged(out: Path, tool: Tool):
    """Yield a temporary folder to write the output into; on success it becomes `out` (as
    `check` allows: a new path, filled into an empty folder, or swapped for an earlier
    output whose listed files are then removed). On failure only the temporary folder goes."""
    state = check(out, tool)
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror or e}") from None
    try:
        yield tmp
        files = sorted(os.listdir(tmp))
        (tmp / tool.marker).write_text(json.dumps({"tool": tool.name, "files": files}) + "\n")
        if state == "new":
            os.rename(tmp, out)
        elif state == "empty":
            # fill the user's folder rather than replace it: it keeps its owner and mode.
            # The marker goes first, so a partial fill is still recognised as ours.
            for name in [tool.marker, *files]:
                os.replace(tmp / name, out / name)
            tmp.rmdir()
        else:
            earlier = _written_earlier(out, tool, _entries(out)) or set()
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=parent))
            os.replace(out, old)      # onto the empty folder just made for it
            os.rename(tmp, out)
            # only entries actually there and listed: a marker naming "../x" removes nothing
            for name in os.listdir(old):
                if (name in earlier or name == tool.marker) and (
                        (old / name).is_symlink() or (old / name).is_file()):
                    (old / name).unlink()
            try:
                old.rmdir()
            except OSError:
                pass  # something appeared meanwhile that the earlier output did not write
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
