"""`python -m experiments.suite --preset P --plan --hardware H`: the preset's [plan] rows
(full-size models; [plan.quick] for tiny ones) predicted on H, nothing run. Each row is the
`experiments.run --dry-run --hardware H` of its settings (same parser, same checks); one
plan.json per row under OUT/NAME/, then the ranking (analysis.plan_rank): ranking.json,
ranking.md and ranking.png, all labelled PREDICTED.

Compiles are shared across rows whose program is the same (`cache`, see
jaxdist.predict.prediction), and the wall time of the whole plan is measured and recorded.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.suite.settings import settings_table
from jaxdist.config import Key
from jaxdist.errors import UsageError
from jaxdist.files import ensure_writable_dir, write_json

PLAN_KEYS = ("settings", "models", "rows", "quick", "pp_schedules", "variants")
QUICK_KEYS = ("settings", "models", "rows", "pp_schedules", "variants")


@dataclass
class PlanRow:
    name: str       # model-row, e.g. llama3-70b-tp_pp_4x4_dp2
    model: str
    row: str
    settings: dict


def plan_rows(data: dict, quick: bool, keys: dict[str, Key], label: str,
              hardware: str | None = None) -> list[PlanRow]:
    """The [plan] table of a preset (parsed TOML) expanded into one row per model x row
    entry (x variant of [[plan.variants]], x schedule of pp_schedules), each with its
    settings; an entry with `hardware = [...]` only for those parts (None: every entry). A
    mistake is one UsageError naming the entry."""
    plan = data.get("plan")
    if not isinstance(plan, dict) or not plan.get("rows"):
        raise UsageError(f"{label} has no [plan] rows ([[plan.rows]]); --plan needs them "
                         f"(see experiments/presets/go2025.toml)")
    _check(plan, PLAN_KEYS, f"{label} [plan]")
    q = plan.get("quick", {}) if quick else {}
    if quick and not q:
        raise UsageError(f"--plan --quick: {label} has no [plan.quick] block")
    _check(q, QUICK_KEYS, f"{label} [plan.quick]")
    settings = settings_table(plan.get("settings", {}), keys, f"{label} [plan.settings]")
    quick_settings = settings_table(q.get("settings", {}), keys,
                                    f"{label} [plan.quick.settings]")
    per_model = {m: settings_table(t, keys, f"{label} [plan.models.{m}]")
                 for m, t in plan.get("models", {}).items()}
    variants = _variants(plan.get("variants"), q.get("variants"), keys, label)
    tiny, quick_rows = q.get("models", {}), q.get("rows", {})
    rows = []
    for i, entry in enumerate(plan["rows"]):
        entry = dict(entry)
        name, models = entry.pop("name", None), entry.pop("models", None)
        parts = entry.pop("hardware", None)
        if not isinstance(name, str) or not isinstance(models, list) or not models:
            raise UsageError(f"{label}: plan.rows[{i}] needs name = \"...\" and models = "
                             f"[...]")
        if parts is not None and (not isinstance(parts, list) or
                                  not all(isinstance(x, str) for x in parts)):
            raise UsageError(f"{label}: plan.rows.{name}: hardware must be a list of parts, "
                             f"e.g. [\"h200\"]")
        own = settings_table(entry, keys, f"{label} plan.rows.{name}")
        if quick and name not in quick_rows:
            continue
        if hardware is not None and parts is not None and not quick and hardware not in parts:
            continue
        for model in models:
            if not quick:
                merged = {**settings, **per_model.get(model, {}), **own, "model": model}
            elif model in tiny:  # quick: its settings over the row's, the tiny twin
                model = tiny[model]
                merged = {**settings, **own, **quick_settings,
                          **settings_table(quick_rows[name], keys,
                                           f"{label} plan.quick.rows.{name}"),
                          "model": model}
            else:
                continue
            for variant, changes in variants:
                for sched, values in _schedules({**merged, **changes},
                                                q.get("pp_schedules", plan.get("pp_schedules")),
                                                label):
                    rows.append(PlanRow(f"{model}-{name}{variant}{sched}", model, name,
                                        values))
    unknown = [n for n in quick_rows if n not in {e.get("name") for e in plan["rows"]}]
    if unknown:
        raise UsageError(f"{label}: [plan.quick.rows.{unknown[0]}] names no plan row")
    return rows


def _variants(tables, keep, keys: dict[str, Key], label: str) -> list[tuple[str, dict]]:
    """[(name suffix, settings)] of [[plan.variants]] (each a name and the settings it
    changes), those named in `keep` where given; one unnamed variant without any."""
    if tables is None:
        return [("", {})]
    if not isinstance(tables, list) or not all(isinstance(t, dict) and
                                               isinstance(t.get("name"), str) for t in tables):
        raise UsageError(f"{label}: [[plan.variants]] entries each need name = \"...\"")
    names = [t["name"] for t in tables]
    for n in keep or ():
        if n not in names:
            raise UsageError(f"{label} [plan.quick] variants: unknown variant {n!r}; "
                             f"variants are {', '.join(names)}")
    return [(f"-{t['name']}", settings_table({k: v for k, v in t.items() if k != "name"},
                                             keys, f"{label} plan.variants.{t['name']}"))
            for t in tables if keep is None or t["name"] in keep]


def _schedules(settings: dict, schedules, label: str) -> list[tuple[str, dict]]:
    """A pipeline row once per schedule of `pp_schedules` (name suffix, settings); its
    chunks' compiles are shared, only the tick model differs. Other rows once."""
    from sharding.pipeline import PIPELINE_LAYOUTS

    if not schedules or settings.get("layout") not in PIPELINE_LAYOUTS:
        return [("", settings)]
    if not isinstance(schedules, list) or not all(isinstance(x, str) for x in schedules):
        raise UsageError(f"{label}: pp_schedules must be a list of schedule names")
    return [(f"-{x}", {**settings, "pp_schedule": x}) for x in schedules]


def _check(table: dict, allowed, where: str) -> None:
    for k in table:
        if k not in allowed:
            raise UsageError(f"{where}: unknown entry {k!r}; entries are {', '.join(allowed)}")


def row_job(row: PlanRow, hardware: str, gpus_per_node: int):
    """The resolved job of a row (jaxdist.job), through experiments.run's own parser and
    checks."""
    from experiments import run as run_mod
    from experiments.validation import validate
    from jaxdist.config import to_argv

    parser = run_mod.build_parser()
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))
    values = {**row.settings, "dry_run": True, "hardware": hardware}
    if gpus_per_node:
        values["gpus_per_node"] = gpus_per_node
    return validate(run_mod.from_namespace(parser.parse_args(to_argv(values))))


PLAN_THREADS = 2  # entries predicted side by side: one lowers (Python) while one compiles


def run_plan(configs: list[tuple], hardware: str, out: Path,
             log=lambda line, row=None: print(line)) -> dict:
    """Predict every (row, job) of `configs`, write OUT/NAME/plan.json and the ranking;
    returns the ranking. JAX must have as many CPU devices as the largest mesh (main sets
    it: devices_needed).

    The rows of one model and [[plan.rows]] entry (its variants and schedules) share one
    cache of compiles, lowerings and readings, dropped when the entry is done; two entries
    are predicted side by side, so a core does not wait while the other compiles alone."""
    from analysis.plan_rank import write_ranking
    from jaxdist.program import xla_compile

    check_topologies(configs)
    ensure_writable_dir(out, "--out")  # after every row's checks: bad input writes nothing
    entries: dict[tuple, list] = {}
    for item in configs:
        entries.setdefault((item[0].model, item[0].row), []).append(item)
    started, compiles = time.perf_counter(), xla_compile.compiles_run()
    stop = threading.Event()  # set by an error or Ctrl-C: no row is written after it
    done = side_by_side([functools.partial(predict_entry, items, out, log, stop)
                         for items in entries.values()], PLAN_THREADS, stop)
    timings = [t for entry in done for t in entry]
    meta = {"hardware": hardware, "rows": len(configs), "wall_s": time.perf_counter() - started,
            "row_wall_s": timings, "compiles": xla_compile.compiles_run() - compiles,
            "compilers": sorted({t["compiler"] for t in timings if t["compiler"]}),
            "note": "wall time of the predictions on this machine, two plan entries side by "
                    "side (a row's wall_s overlaps another's); every row's program compiled "
                    "by the compiler(s) named (XLA:GPU without a device where installed)"}
    return write_ranking(out, meta)


def side_by_side(tasks: list, threads: int, stop: threading.Event | None = None) -> list:
    """[task() for task in tasks] on `threads` threads, in order; the first error (or a
    Ctrl-C in the caller) sets `stop`, no task starts after it, and the error is raised. The
    threads are daemons: a Ctrl-C does not wait for the tasks in progress."""
    results: list = [None] * len(tasks)
    errors: list = []
    todo = queue.SimpleQueue()
    for i in range(len(tasks)):
        todo.put(i)
    stop = stop or threading.Event()

    def work():
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = tasks[i]()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
                stop.set()

    workers = [threading.Thread(target=work, daemon=True, name=f"plan-{n}")
               for n in range(max(1, min(threads, len(tasks))))]
    for w in workers:
        w.start()
    try:
        for w in workers:
            while w.is_alive():
                w.join(0.5)
    finally:
        stop.set()
    if errors:
        raise errors[0]
    return results


def predict_entry(items: list[tuple], out: Path, log, stop: threading.Event) -> list[dict]:
    """Predict the rows of one entry in order with one cache; each row's plan.json (none
    once `stop` is set)."""
    from experiments.advice import with_advice
    from jaxdist import plan as plans

    cache: dict = {}
    timings = []
    for row, job in items:
        t0 = time.perf_counter()
        plan = plans.plan(job, cache=cache)
        if stop.is_set():
            break
        plan = with_advice(plan, job)
        body = {**plan.to_json(),
                "row": {"name": row.name, "entry": row.row, "settings": row.settings}}
        (out / row.name).mkdir(exist_ok=True)
        write_json(out / row.name / "plan.json", body)
        timings.append({"row": row.name, "wall_s": time.perf_counter() - t0,
                        "compiler": plan.compiled.compiler})
        log(f"predicted {row.name}: {plan.time.step_s:.3f} s/step "
            f"({timings[-1]['wall_s']:.1f} s to predict)", row.name)
    return timings


def check_topologies(configs: list[tuple]) -> None:
    """Every row's mesh laid out on the part's nodes (jaxdist.mesh.placement) before anything
    compiles: a row that cannot be placed is one line naming it, not a failure after the
    rows before it were predicted."""
    from jaxdist.program import compiled
    from jaxdist.mesh import build_mesh

    for row, job in configs:
        shape = job.shape
        target = compiled.for_part(job.part, shape.size, job.compiler.compiler)
        try:
            build_mesh(shape, target.devices[:shape.size])
        except UsageError as e:
            raise UsageError(f"plan row {row.name}: {e}") from None


def devices_needed(configs: list[tuple]) -> int:
    """The CPU devices JAX needs for the rows' compiles (their largest mesh)."""
    from jaxdist.program.compiled import plan_cpu_devices

    return max(plan_cpu_devices(job.shape.size, job.compiler.compiler) for _, job in configs)


def narrow_rows(rows: list[PlanRow], models: str | None, layouts: str | None,
                label: str) -> list[PlanRow]:
    """The rows of the models in `models` and the [[plan.rows]] entries in `layouts`
    (comma-separated; None: all); a name no row has is one UsageError with the nearest."""
    from jaxdist.errors import unknown

    every = rows
    for flag, text, attr in (("--models", models, "model"), ("--layouts", layouts, "row")):
        if text is None:
            continue
        wanted = [w.strip() for w in text.split(",") if w.strip()]
        names = list(dict.fromkeys(getattr(r, attr) for r in every))
        if not wanted:
            raise UsageError(f"{flag}: give at least one name; {label}'s plan rows have "
                             f"{', '.join(names)}")
        for w in wanted:
            if w not in names:
                what = "model" if attr == "model" else "plan row entry"
                raise UsageError(f"{flag}: {unknown(what, w, names)} (the plan rows of "
                                 f"{label} on this part)")
        rows = [r for r in rows if getattr(r, attr) in wanted]
    if not rows:
        raise UsageError(f"--models {models} --layouts {layouts}: no plan row of {label} has "
                         f"both; drop one of them")
    return rows


def row_command(row: PlanRow, hardware: str, gpus_per_node: int | None) -> list[str]:
    """The command that plans `row` alone (experiments.plan, the run's --dry-run)."""
    from jaxdist import procs
    from jaxdist.config import to_argv

    extra = ["--gpus-per-node", str(gpus_per_node)] if gpus_per_node is not None else []
    return procs.python_argv("experiments.plan", "--hardware", hardware, *extra,
                             *to_argv(row.settings))


def report_interrupted(done: list[str], total: int, out: Path, hardware: str) -> str:
    """What an interrupted plan prints: the rows predicted so far (`done`, read back from
    their plan.json), ranked; nothing is written."""
    from analysis.plan_rank import format_ranking, rank, row

    rows = []
    for name in done:
        try:
            rows.append(row(name, load_json(out / name / "plan.json")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written as the signal came: not counted
    head = (f"suite: interrupted after {len(rows)} of {total} rows (their plan.json under "
            f"{out}; rerun the command to predict them all)")
    if not rows:
        return head
    ranking = {"label": "predicted", "meta": {"hardware": hardware},
               "models": rank(rows)}
    return f"{head}; the rows done, ranked:\n\n{format_ranking(ranking)}"


def set_devices(configs: list[tuple]) -> None:
    """JAX on CPU with as many devices as the largest row's mesh needs."""
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices_needed(configs))


def main_plan(args, preset_path: Path, keys: dict[str, Key], out: Path,
              overrides: dict | None = None) -> int:
    """The --plan branch of experiments.suite's main (its errors: one line, exit 2):
    the preset's rows on --hardware, narrowed by --models and --layouts, with --set's
    `overrides` over every row; --dry-run lists them with their commands."""
    import shlex
    import tomllib

    from analysis.plan_rank import format_ranking

    if not args.hardware:
        raise UsageError("--plan needs --hardware PART (e.g. --hardware h200)")
    for name in overrides or {}:
        if name in ("hardware", "gpus_per_node", "dry_run"):
            flag = f"--{name.replace('_', '-')}"
            raise UsageError(f"--set {name}: give {flag} to the suite itself"
                             if name != "dry_run" else
                             "--set dry_run: every plan row is a dry run already")
    data = tomllib.loads(preset_path.read_text())
    label = f"preset {preset_path}"
    rows = plan_rows(data, args.quick, keys, label, args.hardware)
    if not rows:
        raise UsageError(f"preset {preset_path}: no plan rows left")
    every = len(rows)
    rows = narrow_rows(rows, args.models, args.layouts, label)
    for row in rows:
        row.settings = {**row.settings, **(overrides or {})}
    # Every row's job, each checked (one line) before JAX's devices are set for the largest
    configs = [(row, row_job(row, args.hardware, args.gpus_per_node)) for row in rows]
    name = data.get("name", preset_path.stem)
    head = (f"suite plan {name}{' (quick)' if args.quick else ''}: "
            f"{len(rows)}{f' of {every}' if len(rows) < every else ''} rows on {args.hardware}")
    if args.dry_run:
        print(f"{head} (dry run: the command that plans each row alone; nothing planned, "
              f"nothing written)")
        width = max(len(r.name) for r in rows)
        for row in rows:
            print(f"{row.name:<{width}}  "
                  f"{shlex.join(row_command(row, args.hardware, args.gpus_per_node))}")
        print(f"{len(rows)} rows; drop --dry-run to plan them all into {out}")
        return 0
    set_devices(configs)
    print(f"{head} -> {out} (PREDICTED, nothing is run)", flush=True)
    from jaxdist.stop import EXIT_CODES, StopRequest, StoppedInSetup, run_abandonable

    # The rows compile in a thread a signal can leave (XLA's compile holds the main thread in
    # C++ for minutes): SIGINT or SIGTERM ends the suite at once; each plan.json is written
    # whole, so what was planned stays and nothing is half-written.
    done: list[str] = []

    def log(line: str, row: str | None = None) -> None:
        if row is not None:
            done.append(row)
        print(line, flush=True)

    from jaxdist.program.xla_log import explained_xla_warnings

    stop = StopRequest().install()
    stopped = None
    try:
        # XLA:GPU's rematerialization warnings, said in one line. Left before anything is
        # said about a stop: it passes file descriptor 2 through a thread, which the
        # process's end after a stop would not wait for.
        with explained_xla_warnings():
            try:
                ranking = run_abandonable(
                    lambda: run_plan(configs, args.hardware, out, log=log), stop)
            except (StoppedInSetup, KeyboardInterrupt) as e:
                stopped = e
    finally:
        stop.restore()
    if stopped is not None:
        print(f"\n{report_interrupted(list(done), len(rows), out, args.hardware)}",
              file=sys.stderr)
        if isinstance(stopped, StoppedInSetup):
            sys.stderr.flush()
            os._exit(EXIT_CODES[stopped.signal])  # the row's compile still runs in its thread
        return 130
    print(format_ranking(ranking))
    print(f"\nranking: {out / 'ranking.md'}; wall time {ranking['meta']['wall_s']:.0f} s")
    return 0


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())
