"""Study suites: `python -m experiments.suite --preset ovi2025 --out DIR [--quick]`.

A preset (a TOML file in experiments/presets/, or any path) lists models, layout entries,
variants and settings; the suite expands them into runs and starts each one as a fresh
`python -m experiments.run ... --logdir DIR/<run-name>` process, so peak-memory counters and
compilation caches start from zero. Runs are interleaved (every layout of a model in turn,
the starting layout rotated each repeat) so slow drift of a shared machine is spread over the
layouts instead of looking like a layout effect.

A failed run (non-zero exit, killed, timed out) is recorded with its exit status and the tail
of its stderr, and the suite goes on. Finished runs (those with results.json) are skipped, so
the same command resumes an interrupted suite. State: DIR/suite.json (every run: command,
status, seconds, stderr tail) and DIR/logs/<run-name>.{out,err,status.json}.

Preset format, report and the commands of the two studies: docs/suite.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from jaxdist.errors import OneLineParser, UsageError
from jaxdist.record import ensure_writable_dir, write_json

ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
SUITE_VERSION = 1
STDERR_TAIL_LINES = 25

# Keys the suite sets itself: a preset or --set may not.
RESERVED = {"logdir": "the suite gives every run --logdir DIR/<run-name>"}
# Short names for sweep keys in run names (microbatches=4 -> mb4).
SHORT = {"microbatches": "mb", "batch_size": "b", "remat": "remat-", "dtype": "",
         "staleness": "s"}

PRESET_KEYS = ("name", "description", "models", "repeats", "settings", "layouts", "variants",
               "sweep", "env", "timeout_s", "quick")
QUICK_KEYS = ("models", "repeats", "settings", "layouts", "variants", "sweep", "env",
              "timeout_s")


# ---------------------------------------------------------------------------- run settings

@dataclass(frozen=True)
class Key:
    """One RunConfig field, addressable as `section.field` or `field`."""
    section: str
    name: str
    kind: str                      # int, float, str, bool
    choices: tuple | None
    default: object

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def run_keys() -> dict[str, Key]:
    """field name -> Key, from jaxdist.config (so a field added there is a key here)."""
    from jaxdist.config import _SECTIONS

    keys = {}
    for section, kind in _SECTIONS.items():
        for f in dataclasses.fields(kind):
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            choices = f.metadata.get("choices")
            keys[f.name] = Key(section, f.name, t, tuple(choices) if choices else None,
                               f.default)
    return keys


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


def to_args(settings: dict[str, object], keys: dict[str, Key]) -> list[str]:
    """Settings -> experiments.run flags (`--flag=value`, so a value may start with '-')."""
    args = []
    for name, value in settings.items():
        key = keys[name]
        if key.kind == "bool":
            args.append(key.flag if value else "--no-" + key.flag[2:])
        else:
            args.append(f"{key.flag}={value}")
    return args


# ---------------------------------------------------------------------------- presets

def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def find_preset(text: str) -> Path:
    path = Path(text)
    if text.endswith(".toml") or os.sep in text or "/" in text:
        if not path.is_file():
            raise UsageError(f"preset file {text} does not exist; built-in presets: "
                             f"{', '.join(preset_names())}")
        return path
    candidate = PRESETS_DIR / f"{text}.toml"
    if not candidate.is_file():
        raise UsageError(f"unknown preset {text!r}; choose from {', '.join(preset_names())} "
                         f"or give a path to a .toml file")
    return candidate


@dataclass
class LayoutEntry:
    name: str
    settings: dict


@dataclass
class Variant:
    name: str
    settings: dict


@dataclass
class Preset:
    name: str
    path: Path
    description: str
    models: list[str]
    repeats: int
    settings: dict
    layouts: list[LayoutEntry]
    variants: list[Variant]
    sweep: dict[str, list]
    env: dict[str, str]
    timeout_s: float | None
    has_quick: bool = False


def _check_keys(table: dict, allowed, where: str) -> None:
    for k in table:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=3, cutoff=0.5)
            hint = ("closest: " + ", ".join(close)) if close else \
                ("entries are " + ", ".join(allowed))
            raise UsageError(f"{where}: unknown entry {k!r}; {hint}")


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v
                                                           for v in value):
        raise UsageError(f"{where}: expected a non-empty list of names")
    return list(value)


def _positive(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: expected a positive integer, got {value!r}")
    return value


def load_preset(path: Path, quick: bool, keys: dict[str, Key]) -> Preset:
    """The preset with its [quick] block applied when `quick`; the block is checked either
    way, so a mistake in it shows before the full study runs."""
    preset = _load_preset(path, quick, keys)
    if not quick and preset.has_quick:
        _load_preset(path, True, keys)
    return preset


def _load_preset(path: Path, quick: bool, keys: dict[str, Key]) -> Preset:
    label = f"preset {path}"
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{label}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{label}: cannot read it: {getattr(e, 'strerror', None) or e}") \
            from None
    _check_keys(data, PRESET_KEYS, label)
    for need in ("models", "layouts"):
        if need not in data:
            raise UsageError(f"{label}: missing {need!r}")
    q = data.get("quick", {})
    if not isinstance(q, dict):
        raise UsageError(f"{label}: [quick] must be a table")
    _check_keys(q, QUICK_KEYS, f"{label} [quick]")
    if quick and not q:
        raise UsageError(f"--quick: {label} has no [quick] block (docs/suite.md); add one or "
                         f"run without --quick")
    if not quick:
        q = {}

    models = _str_list(q.get("models", data["models"]), f"{label}: models")
    repeats = _positive(q.get("repeats", data.get("repeats", 1)), f"{label}: repeats")
    settings = settings_table(data.get("settings", {}), keys, f"{label} [settings]")
    settings.update(settings_table(q.get("settings", {}), keys, f"{label} [quick.settings]"))

    raw_layouts = data["layouts"]
    if not isinstance(raw_layouts, list) or not raw_layouts or not all(
            isinstance(e, dict) for e in raw_layouts):
        raise UsageError(f"{label}: layouts must be a non-empty array of tables "
                         f"([[layouts]] with name = ... and settings)")
    layouts, seen = [], set()
    for i, entry in enumerate(raw_layouts):
        entry = dict(entry)
        name = entry.pop("name", None) or entry.get("layout")
        if not isinstance(name, str) or not name:
            raise UsageError(f"{label}: layouts[{i}] needs name = \"...\" (or layout = ...)")
        if name in seen:
            raise UsageError(f"{label}: layout entry {name!r} given twice")
        seen.add(name)
        s = settings_table(entry, keys, f"{label} layouts.{name}")
        s.setdefault("layout", name)
        layouts.append(LayoutEntry(name, s))
    quick_layouts = q.get("layouts", {})
    if not isinstance(quick_layouts, dict):
        raise UsageError(f"{label}: [quick.layouts] must be tables [quick.layouts.NAME]")
    for name, table in quick_layouts.items():
        match = [e for e in layouts if e.name == name]
        if not match:
            raise UsageError(f"{label}: [quick.layouts.{name}] names no layout entry; entries: "
                             f"{', '.join(e.name for e in layouts)}")
        match[0].settings.update(settings_table(table, keys, f"{label} quick.layouts.{name}"))

    variants = [Variant("base", {})]
    if "variants" in data:
        raw = data["variants"]
        if not isinstance(raw, list) or not raw or not all(isinstance(v, dict) for v in raw):
            raise UsageError(f"{label}: variants must be a non-empty array of tables "
                             f"([[variants]] with name = ... and settings)")
        variants, seen = [], set()
        for i, entry in enumerate(raw):
            entry = dict(entry)
            name = entry.pop("name", None)
            if not isinstance(name, str) or not name:
                raise UsageError(f"{label}: variants[{i}] needs name = \"...\"")
            if name in seen:
                raise UsageError(f"{label}: variant {name!r} given twice")
            seen.add(name)
            variants.append(Variant(name, settings_table(entry, keys,
                                                         f"{label} variants.{name}")))
    if "variants" in q:
        wanted = _str_list(q["variants"], f"{label}: quick.variants")
        names = [v.name for v in variants]
        for w in wanted:
            if w not in names:
                raise UsageError(f"{label}: quick.variants names {w!r}; variants are "
                                 f"{', '.join(names)}")
        variants = [v for v in variants if v.name in wanted]

    sweep_raw = q.get("sweep", data.get("sweep", {}))
    if not isinstance(sweep_raw, dict):
        raise UsageError(f"{label}: [sweep] must be a table of key = [values]")
    sweep = {}
    for raw, values in sweep_raw.items():
        key = resolve_key(raw, keys, f"{label} [sweep]")
        if not isinstance(values, list) or not values:
            raise UsageError(f"{label} [sweep]: {raw} must be a non-empty list of values")
        sweep[key.name] = [convert(key, v, f"{label} [sweep]") for v in values]

    env = dict(data.get("env", {}))
    env.update(q.get("env", {}))
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError(f"{label}: [env] values must be strings")
    timeout = q.get("timeout_s", data.get("timeout_s"))
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise UsageError(f"{label}: timeout_s must be a positive number of seconds")
    name = data.get("name", path.stem)
    return Preset(str(name), path, str(data.get("description", "")), models, repeats, settings,
                  layouts, variants, sweep, env, timeout, has_quick=bool(data.get("quick")))


# ---------------------------------------------------------------------------- the plan

@dataclass
class Planned:
    index: int
    name: str
    model: str
    entry: str
    variant: str
    sweep: dict
    repeat: int
    settings: dict
    args: list[str] = field(default_factory=list)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def sweep_points(sweep: dict[str, list]) -> list[dict]:
    if not sweep:
        return [{}]
    names = list(sweep)
    return [dict(zip(names, combo)) for combo in itertools.product(*(sweep[n] for n in names))]


def plan(preset: Preset, overrides: dict, keys: dict[str, Key]) -> list[Planned]:
    """Every run, in execution order: for each repeat, for each model, for each variant and
    sweep point, every layout entry in turn; round r starts at layout entry r (rotation)."""
    runs = []
    points = sweep_points(preset.sweep)
    n = len(preset.layouts)
    for r in range(preset.repeats):
        order = preset.layouts[r % n:] + preset.layouts[:r % n]
        for model in preset.models:
            for variant in preset.variants:
                for point in points:
                    for entry in order:
                        settings = dict(preset.settings)
                        settings["model"] = model
                        settings.update(entry.settings)
                        settings.update(variant.settings)
                        settings.update(point)
                        settings.update(overrides)
                        parts = [settings.get("model", model), entry.name]
                        if variant.name != "base" or len(preset.variants) > 1:
                            parts.append(variant.name)
                        parts += [f"{SHORT.get(k, k + '-')}{v}" for k, v in point.items()]
                        parts.append(f"r{r + 1}")
                        name = _slug("-".join(str(p) for p in parts))
                        p = Planned(len(runs) + 1, name, str(settings["model"]), entry.name,
                                    variant.name, dict(point), r + 1, settings)
                        p.args = to_args(settings, keys)
                        runs.append(p)
    names = [p.name for p in runs]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise UsageError(f"preset {preset.path}: runs share a name ({', '.join(dupes[:3])}); "
                         f"give layout entries and variants distinct names")
    return runs


def validate_names(runs: list[Planned]) -> None:
    """Models and layouts must be registered: one line listing the valid ones, before any run."""
    from models import model_names
    from sharding import layout_names

    models, layouts = set(model_names()), set(layout_names())
    for p in runs:
        if p.settings["model"] not in models:
            raise UsageError(f"unknown model {p.settings['model']!r} (run {p.name}); choose "
                             f"from {', '.join(sorted(models))}")
        layout = p.settings.get("layout")
        if layout not in layouts:
            raise UsageError(f"unknown layout {layout!r} (layout entry {p.entry}); choose from "
                             f"{', '.join(sorted(layouts))}")


def preflight(p: Planned) -> str | None:
    """The checks experiments.run makes before it starts (no devices, no processes): the
    reason the run would stop at once, or None. Only --dry-run uses it; a real run is
    always judged by its own exit status."""
    from experiments import run as run_mod

    try:
        parser = run_mod.build_parser()
        parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))
        cfg = run_mod.from_namespace(parser.parse_args(p.args))
        shape = run_mod.validate(cfg)
        if shape.size is not None:
            run_mod.check_batch(cfg, shape)
        elif cfg.train.layout == "ps":
            raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
    except UsageError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------- running

def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    # A progress bar rewrites its line with \r: keep the last state of each line.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    kept = [line[-400:] for line in kept if line.strip()]
    return "\n".join(kept[-lines:])




def _child_env(preset_env: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for k, v in preset_env.items():
        env[k] = f"{env[k]} {v}".strip() if k == "XLA_FLAGS" and env.get(k) else v
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the run and whatever it started (PS servers and workers): its process group,
    which start_new_session gave it, so nothing else is touched."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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
        return [*self.launcher, sys.executable, "-m", "experiments.run", *p.args,
                f"--logdir={self.out / p.name}", "--no-progress"]

    # -- one run
    def execute(self, p: Planned) -> dict:
        run_dir = self.out / p.name
        if run_dir.exists():  # a partial directory from an interrupted or failed attempt
            shutil.rmtree(run_dir)
        self.logs.mkdir(parents=True, exist_ok=True)
        out_path, err_path = self.logs / f"{p.name}.out", self.logs / f"{p.name}.err"
        started = time.time()
        self.record(p, status="running", started_unix_s=started)
        self.save()
        timed_out = False
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
            proc = subprocess.Popen(self.command(p), cwd=ROOT, env=_child_env(self.preset.env),
                                    stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                    start_new_session=True)
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _stop_group(proc)
            except BaseException:  # Ctrl-C: stop the run, keep the state, re-raise
                _stop_group(proc)
                self.record(p, status="interrupted", seconds=round(time.time() - started, 2))
                self.save()
                raise
        seconds = round(time.time() - started, 2)
        rc = proc.returncode
        ok = rc == 0 and not timed_out and (run_dir / "results.json").exists()
        tail = _tail(err_path)
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

    def run(self, dry_run: bool = False) -> int:
        n = len(self.runs)
        width = len(str(n))
        name_w = min(max(len(p.name) for p in self.runs), 48)
        self.load_previous()
        if not dry_run:
            self.out.mkdir(parents=True, exist_ok=True)
            for p in self.runs:
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
            tag = f"run {p.index:>{width}}/{n}  {p.name:<{name_w}}"
            if dry_run:
                problem = preflight(p)
                print(f"{tag}  {shlex.join(self.command(p))}")
                if problem:
                    failed += 1
                    print(f"{' ' * len(tag)}  would fail: {problem}")
                continue
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
        if dry_run:
            print(f"{n} runs planned, {failed} would fail the run's own checks (dry run: "
                  f"nothing started)")
            return 0
        print(f"\nsuite {self.preset.name}: {n} runs: {done} ran ok, {failed} failed, "
              f"{skipped} skipped (finished or failed before) in {time.time() - t0:.0f} s")
        print(f"state:  {self.out / 'suite.json'}")
        print(f"report: {sys.executable} -m experiments.report {self.out} --out "
              f"{self.out / 'report'}")
        return 0


# ---------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m experiments.suite",
        description="Run a study preset: every model x layout entry x variant (x sweep point, "
                    "x repeat), each as a fresh experiments.run process, interleaved; failures "
                    "recorded, finished runs skipped on a rerun. Then: python -m "
                    "experiments.report DIR.")
    p.add_argument("--preset", required=False, default=None,
                   help=f"built-in preset ({', '.join(preset_names())}) or a path to a .toml "
                        f"file (format: docs/suite.md)")
    p.add_argument("--out", default=None, help="suite directory: one run directory per run, "
                   "suite.json, logs/ (default: runs/suite-<preset>[-quick])")
    p.add_argument("--quick", action="store_true",
                   help="apply the preset's [quick] overrides (tiny models, few steps, small "
                        "simulated meshes: minutes on a CPU)")
    p.add_argument("--dataset", default=None,
                   help="dataset for every run (same as --set dataset=NAME)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run setting for every run: a RunConfig field as "
                        "section.field or field (train.batch_size=32, steps=10); repeatable")
    p.add_argument("--models", default=None,
                   help="comma-separated models, replacing the preset's list")
    p.add_argument("--layouts", default=None,
                   help="comma-separated layout entry names of the preset to keep")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of the whole plan (each round starts at the next layout)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="stop a run after this many seconds and record it as failed")
    p.add_argument("--launcher", default="",
                   help="command prefix for every run, e.g. 'srun -N4 --ntasks-per-node=1' "
                        "(multi-host runs; not for --layout ps)")
    p.add_argument("--retry-failed", action=argparse.BooleanOptionalAction, default=True,
                   help="rerun runs that failed before (default); --no-retry-failed keeps "
                        "their failure")
    p.add_argument("--dry-run", action="store_true",
                   help="print the planned commands in order and start nothing")
    p.add_argument("--list-presets", action="store_true", help="list built-in presets")
    return p


def prepare(args) -> tuple[Preset, list[Planned], dict[str, Key]]:
    keys = run_keys()
    preset_path = find_preset(args.preset)
    preset = load_preset(preset_path, args.quick, keys)
    overrides = parse_set(args.sets, keys)
    if args.dataset is not None:
        overrides["dataset"] = convert(keys["dataset"], args.dataset, "--dataset")
    if args.models is not None:
        preset.models = [m.strip() for m in args.models.split(",") if m.strip()]
        if not preset.models:
            raise UsageError("--models: give at least one model")
    if args.layouts is not None:
        wanted = [x.strip() for x in args.layouts.split(",") if x.strip()]
        names = [e.name for e in preset.layouts]
        unknown = [w for w in wanted if w not in names]
        if unknown or not wanted:
            raise UsageError(f"--layouts: {', '.join(unknown) or 'nothing given'}: the "
                             f"preset's layout entries are {', '.join(names)}")
        preset.layouts = [e for e in preset.layouts if e.name in wanted]
    if args.repeats is not None:
        if args.repeats < 1:
            raise UsageError(f"--repeats must be a positive integer, got {args.repeats}")
        preset.repeats = args.repeats
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise UsageError(f"--timeout-s must be positive, got {args.timeout_s}")
    runs = plan(preset, overrides, keys)
    validate_names(runs)
    return preset, runs, keys


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_presets:
        for name in preset_names():
            try:
                desc = tomllib.loads((PRESETS_DIR / f"{name}.toml").read_text()).get(
                    "description", "")
            except (OSError, tomllib.TOMLDecodeError):
                desc = "(unreadable)"
            print(f"{name:<16} {desc}")
        return 0
    try:
        if not args.preset:
            raise UsageError(f"--preset is required; built-in presets: "
                             f"{', '.join(preset_names())}")
        preset, runs, _ = prepare(args)
        # Absolute: the runs start in the repository root, wherever the suite was started.
        out = (Path(args.out) if args.out else
               Path("runs") / f"suite-{preset.name}{'-quick' if args.quick else ''}").absolute()
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a directory")
        if not args.dry_run:
            ensure_writable_dir(out, "--out")
    except UsageError as e:
        print(f"suite: error: {e}", file=sys.stderr)
        return 2
    meta = {"preset": preset.name, "preset_path": str(preset.path.resolve()),
            "description": preset.description, "quick": args.quick, "sets": args.sets,
            "dataset": args.dataset, "repeats": preset.repeats, "env": preset.env,
            "launcher": args.launcher}
    launcher = shlex.split(args.launcher) if args.launcher else []
    timeout = args.timeout_s if args.timeout_s is not None else preset.timeout_s
    print(f"suite {preset.name}{' (quick)' if args.quick else ''}: {len(runs)} runs "
          f"({len(preset.models)} model(s) x {len(preset.layouts)} layout entries x "
          f"{len(preset.variants)} variant(s) x {len(sweep_points(preset.sweep))} sweep "
          f"point(s) x {preset.repeats} repeat(s)) -> {out}", flush=True)
    suite = Suite(out, preset, runs, meta, launcher, timeout, args.retry_failed)
    if not args.dry_run:
        # A scheduler's SIGTERM: stop the current run's process group too (it runs in a
        # session of its own, so it would outlive the suite), then exit.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return suite.run(dry_run=args.dry_run)
    except KeyboardInterrupt:
        print("\nsuite: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
