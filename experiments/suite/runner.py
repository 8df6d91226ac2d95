"""Running a suite's plan: each run a fresh `python -m experiments.run` process in a session of
its own (so stopping it stops whatever it started), one at a time, with its output in
DIR/logs/<run>.{out,err} and every run's state in DIR/suite.json; finished runs are skipped,
failed ones recorded with their exit status and stderr tail."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from experiments.suite.matrix import Planned, preflight
from experiments.suite.presets import Preset
from jaxdist import procs
from jaxdist.files import write_json

SUITE_VERSION = 1
STDERR_TAIL_LINES = 25
STOP_GRACE_S = 10.0   # a stopped run's time to write what it has before SIGKILL


def _child_env(preset_env: dict[str, str]) -> dict[str, str]:
    """Our environment plus the preset's [env]; its XLA_FLAGS add to ours."""
    env = procs.python_env()
    for k, v in preset_env.items():
        env[k] = f"{env[k]} {v}".strip() if k == "XLA_FLAGS" and env.get(k) else v
    return env


def _failure_reason(rc: int | None, timed_out: bool, stderr_tail: str) -> str:
    if timed_out:
        return "timed out"
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        extra = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return f"killed by {name}{extra}"
    last = stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else ""
    oom = any(s in stderr_tail for s in ("RESOURCE_EXHAUSTED", "Out of memory",
                                         "out of memory", "OOM"))
    return f"exit {rc}" + (" (out of memory)" if oom else "") + (f": {last}" if last else "")


class Suite:
    def __init__(self, out: Path, preset: Preset, runs: list[Planned], meta: dict,
                 launcher: list[str], timeout_s: float | None, retry_failed: bool):
        self.out, self.preset, self.runs, self.meta = out, preset, runs, meta
        self.launcher, self.timeout_s, self.retry_failed = launcher, timeout_s, retry_failed
        self.logs = out / "logs"
        self.records: dict[str, dict] = {}
        self.started_before: set[str] = set()  # runs suite.json says an earlier pass started

    # -- state on disk
    def load_previous(self) -> None:
        path = self.out / "suite.json"
        if path.exists():
            try:
                old = json.loads(path.read_text())
                self.records = {r["name"]: r for r in old.get("runs", [])
                                if isinstance(r, dict) and "name" in r}
            except (OSError, ValueError):
                self.records = {}
        self.started_before = {n for n, r in self.records.items() if "started_unix_s" in r}

    def record(self, p: Planned, **fields) -> dict:
        rec = self.records.get(p.name, {})
        rec.update({"name": p.name, "index": p.index, "model": p.model, "layout_entry": p.entry,
                    "layout": p.settings.get("layout"), "variant": p.variant, "sweep": p.sweep,
                    "repeat": p.repeat, "settings": p.settings,
                    "command": shlex.join(self.command(p)), "logdir": p.name})
        rec.update(fields)
        self.records[p.name] = rec
        return rec

    def save(self) -> None:
        planned = {p.name for p in self.runs}
        ordered = [self.records[p.name] for p in self.runs if p.name in self.records]
        others = [r for n, r in self.records.items() if n not in planned]  # from other plans
        counts = {}
        for r in ordered:
            counts[r.get("status", "pending")] = counts.get(r.get("status", "pending"), 0) + 1
        write_json(self.out / "suite.json", dict(
            self.meta, suite_version=SUITE_VERSION, updated_unix_s=time.time(), counts=counts,
            runs=ordered + others))

    def command(self, p: Planned) -> list[str]:
        return [*self.launcher, *procs.python_argv("experiments.run", *p.args,
                                                   f"--logdir={self.out / p.name}",
                                                   "--no-progress")]

    # -- one run
    def execute(self, p: Planned) -> dict:
        run_dir = self.out / p.name
        if run_dir.exists() and p.name not in self.started_before:
            # not a run this suite started: never deleted, and the run is not started over it
            rec = self.record(p, status="failed", seconds=0.0, reason=(
                f"{run_dir} exists, and suite.json does not say this suite started it: "
                f"move it away and rerun"))
            self.save()
            return rec
        if run_dir.exists():  # a partial directory from an interrupted or failed attempt
            shutil.rmtree(run_dir)
        out_path, err_path = self.logs / f"{p.name}.out", self.logs / f"{p.name}.err"
        started = time.time()
        self.record(p, status="running", started_unix_s=started)
        self.save()
        child = procs.start(p.name, self.command(p), _child_env(self.preset.env), out_path,
                            err_log=err_path, truncate=True, cwd=procs.ROOT)
        try:
            timed_out = procs.watch([child], self.timeout_s).timed_out
        except BaseException:  # Ctrl-C: stop the run, keep the state, re-raise
            procs.stop(child, STOP_GRACE_S)
            self.record(p, status="interrupted", seconds=round(time.time() - started, 2))
            self.save()
            raise
        procs.stop(child, STOP_GRACE_S)  # a timed-out run; else what it left in its group
        seconds = round(time.time() - started, 2)
        rc = child.proc.returncode
        ok = rc == 0 and not timed_out and (run_dir / "results.json").exists()
        tail = procs.log_tail(err_path, STDERR_TAIL_LINES)
        fields = {"status": "ok" if ok else "failed", "returncode": rc, "seconds": seconds,
                  "timed_out": timed_out, "stdout": str(out_path.relative_to(self.out)),
                  "stderr": str(err_path.relative_to(self.out)),
                  "stderr_tail": "" if ok else tail,
                  "reason": None if ok else (_failure_reason(rc, timed_out, tail)
                                             if rc != 0 or timed_out else
                                             "exit 0 but no results.json")}
        rec = self.record(p, **fields)
        write_json(self.logs / f"{p.name}.status.json", rec)
        self.save()
        return rec

    # -- the plan
    def _tag(self, p: Planned) -> str:
        n = len(self.runs)
        name_w = min(max(len(q.name) for q in self.runs), 48)
        return f"run {p.index:>{len(str(n))}}/{n}  {p.name:<{name_w}}"

    def dry_run(self) -> int:
        """Print every command in order and what would fail the run's own checks; start
        nothing, write nothing."""
        failed = 0
        for p in self.runs:
            tag = self._tag(p)
            problem = preflight(p)
            print(f"{tag}  {shlex.join(self.command(p))}")
            if problem:
                failed += 1
                print(f"{' ' * len(tag)}  would fail: {problem}")
        print(f"{len(self.runs)} runs planned, {failed} would fail the run's own checks (dry "
              f"run: nothing started)")
        return 0

    def run(self) -> int:
        """Every run not finished yet, in order (failed ones again unless not retry_failed)."""
        self.load_previous()
        self.out.mkdir(parents=True, exist_ok=True)
        for p in self.runs:  # the state before this pass: finished, or still to do
            prev = self.records.get(p.name, {})
            if (self.out / p.name / "results.json").exists():
                self.record(p, status="ok")
            elif prev.get("status") in (None, "running", "interrupted", "pending"):
                self.record(p, status="pending")
            else:
                self.record(p)
        self.save()
        done = failed = skipped = 0
        t0 = time.time()
        for p in self.runs:
            tag = self._tag(p)
            if (self.out / p.name / "results.json").exists():
                skipped += 1
                print(f"{tag}  skipped (finished)", flush=True)
                continue
            prev = self.records.get(p.name, {})
            if prev.get("status") == "failed" and not self.retry_failed:
                skipped += 1
                failed += 1
                print(f"{tag}  skipped (failed before: {prev.get('reason')})", flush=True)
                continue
            print(f"{tag}  running ...", flush=True)
            rec = self.execute(p)
            if rec["status"] == "ok":
                done += 1
                print(f"{tag}  ok      {rec['seconds']:.1f} s", flush=True)
            else:
                failed += 1
                print(f"{tag}  FAILED  {rec['seconds']:.1f} s  {rec['reason']}", flush=True)
        print(f"\nsuite {self.preset.name}: {len(self.runs)} runs: {done} ran ok, {failed} "
              f"failed, {skipped} skipped (finished or failed before) in "
              f"{time.time() - t0:.0f} s")
        print(f"state:  {self.out / 'suite.json'}")
        print(f"report: {sys.executable} -m experiments.report {self.out} --out "
              f"{self.out / 'report'}")
        return 0
