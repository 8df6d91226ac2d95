"""`python -m experiments.suite`: the command line, read top to bottom: parse, load the
preset and apply the flags to it, plan the runs, then run them (or print them: --dry-run)."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

from experiments.suite.matrix import Planned, check_values, plan, sweep_points, validate_names
from experiments.suite.presets import (PRESETS_DIR, Preset, find_preset, load_preset,
                                           preset_names)
from experiments.suite.runner import Suite
from experiments.suite.settings import convert, parse_set
from jaxdist import procs
from jaxdist.config import keys as run_keys
from jaxdist.errors import OneLineParser, UsageError, path_arg
from jaxdist.files import ensure_writable_dir


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m experiments.suite",
        description="Run a study preset: every model x layout entry x variant (x sweep point, "
                    "x repeat), each as a fresh experiments.run process, interleaved; failures "
                    "recorded, finished runs skipped on a rerun. Then: python -m "
                    "experiments.report DIR.")
    p.add_argument("--preset", required=False, default=None, type=path_arg,
                   help=f"built-in preset ({', '.join(preset_names())}) or a path to a .toml "
                        f"file (format: docs/suite.md)")
    p.add_argument("--out", default=None, type=path_arg,
                   help="suite directory: one run directory per run, "
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
                   help="comma-separated models, replacing the preset's list; with --plan, "
                        "only the plan rows of these models")
    p.add_argument("--layouts", default=None,
                   help="comma-separated layout entry names of the preset to keep; with "
                        "--plan, the [[plan.rows]] names to keep (e.g. ep8_dp4)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of the whole plan (each round starts at the next layout)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="stop a run after this many seconds and record it as failed")
    p.add_argument("--launcher", default=None,
                   help="command prefix for every run, e.g. 'srun -N4 --ntasks-per-node=1' "
                        "(multi-host runs; not for --layout ps)")
    p.add_argument("--retry-failed", action=argparse.BooleanOptionalAction, default=None,
                   help="rerun runs that failed before (default); --no-retry-failed keeps "
                        "their failure")
    p.add_argument("--dry-run", action="store_true",
                   help="print the planned commands in order and start nothing; with "
                        "--plan, list the rows it would plan, each with the command that "
                        "plans it alone, and plan nothing")
    p.add_argument("--list-presets", action="store_true", help="list built-in presets")
    p.add_argument("--plan", action="store_true",
                   help="predict the preset's [plan] rows (full-size models) on --hardware "
                        "instead of running anything: one plan.json per row and a ranking "
                        "(PREDICTED) in --out (default runs/plan-<preset>[-quick])")
    p.add_argument("--hardware", default="",
                   help="with --plan: the GPU part to predict for (jaxdist.parts, e.g. h200)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --plan: override the part's GPUs per node")
    return p


# Flags that only a suite that runs reads, and flags only --plan reads: given in the other
# mode, each is refused in one line (nothing is ignored without a word).
RUN_ONLY = {"repeats": ("--repeats", "a plan row is predicted once"),
            "timeout_s": ("--timeout-s", "nothing is run"),
            "launcher": ("--launcher", "nothing is run"),
            "retry_failed": ("--retry-failed/--no-retry-failed", "nothing is run")}
PLAN_ONLY = {"hardware": "--hardware", "gpus_per_node": "--gpus-per-node"}


def check_mode(args) -> None:
    """Every flag given applies to the mode chosen (a UsageError naming the first that
    does not)."""
    given = [a for a, v in vars(args).items()
             if a != "list_presets" and v not in (None, False, [], "")]
    if args.list_presets and given:
        raise UsageError(f"--list-presets takes no other flags (got --"
                         f"{given[0].replace('_', '-')}); run it alone")
    if args.plan:
        for dest, (flag, why) in RUN_ONLY.items():
            if getattr(args, dest) is not None:
                raise UsageError(f"{flag} applies only to a suite that runs, not to --plan "
                                 f"({why}); drop it")
    else:
        for dest, flag in PLAN_ONLY.items():
            if getattr(args, dest) not in (None, ""):
                raise UsageError(f"{flag} applies only with --plan (predict the preset's plan "
                                 f"rows); add --plan or drop {flag}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_mode(args)
    except UsageError as e:
        print(f"suite: error: {e}", file=sys.stderr)
        return 2
    if args.list_presets:
        return _list_presets()
    if args.plan:
        return _main_plan(args)
    args.launcher = args.launcher or ""
    args.retry_failed = args.retry_failed is not False
    try:
        preset, runs, out = prepare(args)
    except UsageError as e:
        print(f"suite: error: {e}", file=sys.stderr)
        return 2
    print(f"suite {preset.name}{' (quick)' if args.quick else ''}: {len(runs)} runs "
          f"({len(preset.models)} model(s) x {len(preset.layouts)} layout entries x "
          f"{len(preset.variants)} variant(s) x {len(sweep_points(preset.sweep))} sweep "
          f"point(s) x {preset.repeats} repeat(s)) -> {out}", flush=True)
    suite = Suite(out, preset, runs, _meta(args, preset),
                  shlex.split(args.launcher) if args.launcher else [],
                  args.timeout_s if args.timeout_s is not None else preset.timeout_s,
                  args.retry_failed)
    try:
        if args.dry_run:
            print(f"each run: stopped after {suite.timeout_s:g} s" if suite.timeout_s else
                  "each run: no time limit", end="")
            print(f"; failed runs {'rerun' if suite.retry_failed else 'kept as failed'}; "
                  f"launcher: {args.launcher or 'none'}")
            return suite.dry_run()
        # A scheduler's SIGTERM (or SIGHUP) exits through the runner's `finally`, which stops
        # the current run's process group too (it runs in a session of its own, so it would
        # outlive the suite).
        with procs.TerminationHandlers():
            return suite.run()
    except KeyboardInterrupt:
        print("\nsuite: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def _main_plan(args) -> int:
    from experiments.suite.plan import main_plan

    try:
        if not args.preset:
            raise UsageError(f"--preset is required; built-in presets: "
                             f"{', '.join(preset_names())}")
        path = find_preset(args.preset)
        out = (Path(args.out) if args.out else Path("runs") /
               f"plan-{path.stem}{'-quick' if args.quick else ''}").absolute()
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a directory")
        check_out(out, "ranking.json or */plan.json", lambda d: (
            (d / "ranking.json").is_file() or any(d.glob("*/plan.json"))))
        keys = run_keys()
        overrides = parse_set(args.sets, keys)
        if args.dataset is not None:
            overrides["dataset"] = convert(keys["dataset"], args.dataset, "--dataset")
        return main_plan(args, path, keys, out, overrides)
    except UsageError as e:
        print(f"suite: error: {e}", file=sys.stderr)
        return 2


def check_launcher(text: str, dry_run: bool) -> None:
    """--launcher splits into words, and (for a suite that runs) its command is found here:
    a missing one was a FileNotFoundError traceback once suite.json had been written. A dry
    run only prints the commands, which may be meant for another host."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"--launcher {text!r} does not split into words: {e}") from None
    if words and not dry_run and not shutil.which(words[0]):
        raise UsageError(f"--launcher: {words[0]!r} is not a command on this host (not an "
                         f"executable on PATH)")


def prepare(args) -> tuple[Preset, list[Planned], Path]:
    """(the preset with the flags applied, its runs, the suite directory), or UsageError."""
    if not args.preset:
        raise UsageError(f"--preset is required; built-in presets: {', '.join(preset_names())}")
    keys = run_keys()
    preset = load_preset(find_preset(args.preset), args.quick, keys)
    overrides = parse_set(args.sets, keys)
    if args.dataset is not None:
        overrides["dataset"] = convert(keys["dataset"], args.dataset, "--dataset")
    _narrow(preset, args)
    if args.timeout_s is not None and not (args.timeout_s > 0 and math.isfinite(args.timeout_s)):
        raise UsageError(f"--timeout-s must be a positive finite number, got {args.timeout_s}")
    check_launcher(args.launcher, args.dry_run)
    runs = plan(preset, overrides)
    validate_names(runs)
    check_values(runs)
    # Absolute: the runs start in the repository root, wherever the suite was started.
    out = (Path(args.out) if args.out else
           Path("runs") / f"suite-{preset.name}{'-quick' if args.quick else ''}").absolute()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    check_out(out, "suite.json", lambda d: (d / "suite.json").is_file())
    if not args.dry_run:
        ensure_writable_dir(out, "--out")
    return preset, runs, out


def check_out(out: Path, marker: str, written_by_a_suite) -> None:
    """--out is new, empty, or a folder a suite wrote (`written_by_a_suite(out)`, which
    finds its `marker`), to resume. Never a user's folder: the suite writes a folder per
    run there, and deletes a run's folder before running it again."""
    if not out.is_dir():
        return
    try:
        entries = os.listdir(out)
    except OSError as e:
        raise UsageError(f"cannot read --out {out}: {e.strerror or e}") from None
    if entries and not written_by_a_suite(out):
        raise UsageError(f"--out {out} is a folder no suite wrote (it has files but no "
                         f"{marker}); choose a new or empty folder, or an earlier suite's "
                         f"to resume it")


def _narrow(preset: Preset, args) -> None:
    """--models, --layouts and --repeats, applied to the preset."""
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


def _meta(args, preset: Preset) -> dict:
    """What suite.json records about the command."""
    return {"preset": preset.name, "preset_path": str(preset.path.resolve()),
            "description": preset.description, "quick": args.quick, "sets": args.sets,
            "dataset": args.dataset, "repeats": preset.repeats, "env": preset.env,
            "launcher": args.launcher}


def _list_presets() -> int:
    for name in preset_names():
        try:
            desc = tomllib.loads((PRESETS_DIR / f"{name}.toml").read_text()).get(
                "description", "")
        except (OSError, tomllib.TOMLDecodeError):
            desc = "(unreadable)"
        print(f"{name:<16} {desc}")
    return 0
