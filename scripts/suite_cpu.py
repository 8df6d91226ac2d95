"""Where the test suite's CPU goes: each test's own CPU and its child processes' CPU.

On two busy cores the suite's wall time is its CPU time over two, and `--durations` shows a
test's wall only: a test that waits on a process it started (a PS run, a CLI run, torch
ranks) looks idle there, though its children use a core. This runs pytest with a plugin that
reads the process's CPU (getrusage: self, and children it has waited for) before and after
each test, in every xdist worker, and prints the totals, the modules by CPU and the tests
that cost most. A child a test never waits for (killed and not reaped) is not counted.

Usage: .venv/bin/python scripts/suite_cpu.py [--top N] [pytest arguments, e.g. -n 2
       --dist loadgroup tests]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxdist.errors import OneLineParser  # noqa: E402

_LOG_ENV = "JAXDIST_SUITE_CPU_DIR"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuPlugin:
    """Writes one JSON line per test (nodeid, wall, self and child CPU seconds) into a file of
    this process's own in the folder JAXDIST_SUITE_CPU_DIR names."""

    def __init__(self, folder: str):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out = open(Path(folder) / f"{worker}.jsonl", "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        own, children, wall = (_cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN),
                               time.perf_counter())
        yield
        self.out.write(json.dumps({
            "test": item.nodeid, "wall": time.perf_counter() - wall,
            "self": _cpu(resource.RUSAGE_SELF) - own,
            "child": _cpu(resource.RUSAGE_CHILDREN) - children}) + "\n")
        self.out.flush()

    def pytest_unconfigure(self, config):
        self.out.close()


def pytest_configure(config):
    """Entry point as a pytest plugin (`-p suite_cpu`, in the controller and each worker)."""
    folder = os.environ.get(_LOG_ENV)
    if folder:
        config.pluginmanager.register(CpuPlugin(folder), "suite-cpu-log")


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line]


def report(rows: list[dict], top: int) -> str:
    own, child = sum(r["self"] for r in rows), sum(r["child"] for r in rows)
    lines = [f"{len(rows)} tests (run or skipped): {own + child:.1f} s of CPU, {own:.1f} s "
             f"in the pytest processes and {child:.1f} s in the processes the tests started; "
             f"{sum(r['wall'] for r in rows):.1f} s of test wall time summed"]
    modules = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        m = modules[r["test"].split("::")[0]]
        m[0], m[1], m[2] = m[0] + r["self"], m[1] + r["child"], m[2] + 1
    lines.append(f"\n{'self s':>8} {'child s':>8}  tests  module (by CPU)")
    for name, (s, c, n) in sorted(modules.items(), key=lambda kv: -kv[1][0] - kv[1][1])[:top]:
        lines.append(f"{s:8.1f} {c:8.1f} {n:6d}  {name}")
    lines.append(f"\n{'self s':>8} {'child s':>8} {'wall s':>8}  test (by CPU)")
    for r in sorted(rows, key=lambda r: -r["self"] - r["child"])[:top]:
        lines.append(f"{r['self']:8.1f} {r['child']:8.1f} {r['wall']:8.1f}  {r['test']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                           epilog="Every other argument goes to pytest.")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args, pytest_args = parser.parse_known_args(argv)
    parser.require_at_least(args, top=1)
    folder = Path(tempfile.mkdtemp(prefix="jaxdist-suite-cpu-"))
    here = str(Path(__file__).resolve().parent)
    # the xdist workers are new processes: they find the plugin and the folder here
    os.environ[_LOG_ENV] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    try:
        held = _UsageHeld(sys.stderr)
        with contextlib.redirect_stderr(held):
            code = pytest.main(["-p", "suite_cpu", *pytest_args])
        if code == pytest.ExitCode.USAGE_ERROR and held.text:
            # pytest's usage, error and ini lines: its error alone, as every entry point does
            error = next((line.split(": error: ", 1)[1] for line in held.text.splitlines()
                          if ": error: " in line), held.text.strip().splitlines()[-1])
            parser.error(f"pytest: {error}")
        print(report(read_rows(folder), args.top))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return int(code)


class _UsageHeld(io.TextIOBase):
    """sys.stderr while pytest runs: passed through, except pytest's usage error (the
    first thing written, `ERROR: usage: ...`), which is held for main to say in one line."""

    def __init__(self, stream):
        self.stream, self.text, self.decided = stream, "", False

    def write(self, s: str) -> int:
        if not self.decided and s:
            self.decided = True
            self.holding = s.lstrip().startswith("ERROR: usage:")
        if self.decided and self.holding:
            self.text += s
        else:
            self.stream.write(s)
        return len(s)

    def flush(self) -> None:
        self.stream.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
