"""Every flag an entry point accepts acts or is refused: this walks each entry point's
parser (experiments.run and experiments.plan, experiments.suite as it runs and with --plan,
experiments.predict, experiments.report, experiments.compare, analysis.plan_rank and
analysis.go2025) and, for
every option it has, calls main(argv) in this process with and without the flag: what it
printed, its exit status or the files it wrote must differ, or it must be one line, exit 2,
naming the flag. A new option without a case here fails the walk. Nothing compiles: suites
are dry runs, and what would plan or predict for minutes is replaced by a stub that says
what it was asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import predict as predict_mod
from experiments import run as run_mod
from experiments.suite import cli as suite_cli
from experiments.suite import plan as suite_plan
from jaxdist.config import from_namespace, keys
from tests.helpers import ROOT

ACTS, REFUSED = "acts", "refused"


def options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def positionals(parser) -> set[str]:
    return {a.dest for a in parser._actions if not a.option_strings}


def call(capsys, main, argv, folder: Path | None = None):
    """(exit status, stdout, stderr, the files under `folder`) of main(argv)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder else []
    return code, out, err, files


def check(capsys, main, name, flag, without, with_, expect, folder=None, message=None):
    """`with_` (the flag given) against `without`: ACTS, something differs and it did not
    fail; REFUSED, one line `NAME: error: ...` naming the flag (or `message`), exit 2."""
    before = call(capsys, main, without, folder) if expect == ACTS else None
    after = call(capsys, main, with_, folder)
    code, _, err, _ = after
    if expect == REFUSED:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (flag, code, err)
        assert lines[0].startswith(f"{name}: error: "), lines
        assert (message or flag) in lines[0], lines
        return
    assert code in (0, 130) or code != before[0], (flag, after)
    assert "error" not in err.lower() or code == before[0] != 2, (flag, err)
    assert after != before, f"{flag}: changed nothing ({with_} against {without})"


# ---- experiments.run / experiments.plan: every flag sets a field of the run's config -----

# A valid value that is not the default, for the fields whose values are free text
TEXT = {"mesh": "2x2", "coordinator": "host:1234", "xla_flags": "--xla_foo=1",
        "model": "llama-tiny", "model_opts": "depth=2", "layout": "ddp",
        "pp_stage_blocks": "1,1", "data_dir": "data", "ps_bind": "0.0.0.0",
        "ps_tls_cert": "c.pem", "ps_tls_key": "k.pem", "checkpoint_dir": "ck",
        "logdir": "runs/x", "profile_steps": "2,3", "hardware": "h200",
        "power_limit": "300"}


def other_value(key) -> list[str]:
    if key.kind == "bool":
        return [key.arg(not key.default)]
    if key.choices:
        return [key.arg(next(c for c in key.choices if c != key.default))]
    if key.kind == "int":
        return [key.arg(key.default + 1)]
    if key.kind == "float":
        return [key.arg(key.default + 0.5)]
    return [key.arg(TEXT[key.name])]


@pytest.mark.parametrize("entry", [run_mod.RUN, ("plan", "plans")], ids=["run", "plan"])
def test_run_flags_each_set_the_config(entry):
    """Every option of experiments.run (and experiments.plan, the same parser) is a field of
    the run's config, and giving it a value other than its default changes that config (a
    flag that does nothing for the job chosen is a notice line at the run: test_cli_truth)."""
    parser = run_mod.build_parser(entry)
    base = from_namespace(parser.parse_args([]))
    fields = {k.name: k for k in keys().values()}
    flags = {}
    for key in fields.values():
        flags[key.flag] = key
        if key.kind == "bool":
            flags["--no-" + key.flag[2:]] = key
    assert options(parser) == set(flags) and positionals(parser) == set()
    for key in fields.values():
        cfg = from_namespace(parser.parse_args(other_value(key)))
        assert cfg != base, key.flag
        assert getattr(getattr(cfg, key.section), key.name) != key.default, key.flag


def test_run_flags_each_act_refuse_or_say_so(tmp_path, monkeypatch):
    """Validation level: each flag, given alone at a value other than its default, passes
    the run's one validation pass or is refused there in one line (a UsageError, never a
    traceback), and a flag the job does not read is a notice line naming it."""
    from experiments.validation import validate
    from jaxdist.errors import UsageError

    monkeypatch.chdir(tmp_path)
    parser = run_mod.build_parser()
    base = ["--model", "gpt-tiny", "--layout", "fsdp", "--mesh", "2x2", "--batch-size", "8"]
    said = {}
    for key in keys().values():
        argv = [*base, *other_value(key)]
        try:
            job = validate(from_namespace(parser.parse_args(argv)))
        except UsageError as e:
            assert "\n" not in str(e), (key.flag, str(e))
            said[key.flag] = "refused"
            continue
        for line in job.notices:
            assert "\n" not in line and line.startswith("notice: "), (key.flag, line)
        said[key.flag] = "noticed" if any(key.flag in n for n in job.notices) else "acts"
    # the walk read something for each: e.g. a parameter-server flag on fsdp is a notice
    assert said["--ps-shards"] == "noticed" and said["--steps"] == "acts"
    assert said["--layout"] == "acts" and set(said) == {k.flag for k in keys().values()}


@pytest.mark.parametrize("argv, message", [
    (["--remat", "ful"], "run: error: argument --remat: invalid choice: 'ful'"),
    (["--steps", "x"], "run: error: argument --steps: invalid int value: 'x'"),
    (["--bogus"], "run: error: unrecognized arguments: --bogus"),
])
def test_run_parse_errors_say_run(capsys, argv, message):
    """A parse error starts as the run's own checks do, `run: error:`."""
    code, _, err, _ = call(capsys, run_mod.main, argv)
    assert code == 2 and err.strip().splitlines() == [err.strip()]
    assert err.startswith(message), err


# ---- experiments.suite, as it runs (dry runs) ---------------------------------------------

PRESET = """name = "walk"
models = ["gpt-tiny"]
[settings]
batch_size = 8
warmup = 1
steps = 2
[[layouts]]
name = "ddp"
mesh = "2"
[[layouts]]
name = "fsdp"
mesh = "2"
[quick.settings]
steps = 1
"""


def test_suite_run_mode_flags_act_or_are_refused(tmp_path, capsys, monkeypatch):
    preset, other = tmp_path / "walk.toml", tmp_path / "other.toml"
    preset.write_text(PRESET)
    other.write_text(PRESET.replace('["gpt-tiny"]', '["llama-tiny"]'))
    out = str(tmp_path / "s")
    base = ["--preset", str(preset), "--dry-run", "--out", out]
    monkeypatch.setattr(suite_cli.Suite, "run", lambda self: 7)  # a suite that runs: 7
    cases = {
        "--preset": (base, [*base, "--preset", str(other)], ACTS),
        "--out": (base, [*base, "--out", str(tmp_path / "t")], ACTS),
        "--quick": (base, [*base, "--quick"], ACTS),
        "--dataset": (base, [*base, "--dataset", "synthetic"], ACTS),
        "--set": (base, [*base, "--set", "steps=3"], ACTS),
        "--models": (base, [*base, "--models", "gpt-tiny,llama-tiny"], ACTS),
        "--layouts": (base, [*base, "--layouts", "ddp"], ACTS),
        "--repeats": (base, [*base, "--repeats", "2"], ACTS),
        "--timeout-s": (base, [*base, "--timeout-s", "60"], ACTS),
        "--launcher": (base, [*base, "--launcher", "srun -N1"], ACTS),
        "--no-retry-failed": (base, [*base, "--no-retry-failed"], ACTS),
        "--retry-failed": ([*base, "--no-retry-failed"],
                           [*base, "--no-retry-failed", "--retry-failed"], ACTS),
        "--dry-run": (base, base[:2] + base[3:], ACTS),
        "--list-presets": (base, ["--list-presets"], ACTS),
        "--plan": (base, [*base, "--plan"], REFUSED),
        "--hardware": (base, [*base, "--hardware", "h200"], REFUSED),
        "--gpus-per-node": (base, [*base, "--gpus-per-node", "4"], REFUSED),
    }
    assert set(cases) == options(suite_cli.build_parser())
    for flag, (without, with_, expect) in cases.items():
        check(capsys, suite_cli.main, "suite", flag, without, with_, expect,
              message="--plan" if flag == "--plan" else None)
    # --list-presets lists, and with other flags is refused
    check(capsys, suite_cli.main, "suite", "--list-presets", None, ["--list-presets", *base],
          REFUSED)


# ---- experiments.suite --plan (dry runs; a plan that would compile is a stub) -------------

def plan_json(model: str, step: float) -> dict:
    t = {"step_s": step, "compute_s": step, "hbm_s": 0.0, "intra_node_s": 0.0,
         "inter_node_s": 0.0, "comm_exposed_s": 0.0, "bubble_s": 0.0, "bottleneck": "compute"}
    return {"label": "predicted", "model": {"name": model}, "layout": "ep",
            "hardware": {"name": "h200"}, "mesh": {"data": 4, "expert": 8}, "batch_size": 128,
            "time": t, "memory": {"total_bytes": 2 ** 30, "fits": True},
            "throughput": {"tokens_per_s_per_gpu": 1000.0 / step, "mfu": 0.4}}


def interrupted_after_two(configs, hardware, out, log):
    """run_plan as a Ctrl-C after two rows leaves it: their plan.json written."""
    out.mkdir(parents=True, exist_ok=True)
    for i, (row, _) in enumerate(configs[:2]):
        (out / row.name).mkdir()
        (out / row.name / "plan.json").write_text(json.dumps(plan_json(row.model, 1.0 + i)))
        log(f"predicted {row.name}", row.name)
    raise KeyboardInterrupt


def test_suite_plan_mode_flags_act_or_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(suite_plan, "set_devices", lambda configs: None)
    monkeypatch.setattr(suite_plan, "run_plan", interrupted_after_two)
    out = str(tmp_path / "p")
    full = ["--preset", "go2025", "--plan", "--hardware", "h200", "--dry-run", "--out", out,
            "--models", "mixtral-8x7b"]
    base = [*full, "--layouts", "ep8_dp4"]
    fsdp_tp = [*full[:-2], "--layouts", "fsdp_tp"]
    cases = {
        "--preset": (base, [*base, "--preset", "ovi2025"], REFUSED),
        "--out": (base, [*base, "--out", str(tmp_path / "q")], ACTS),
        "--quick": (fsdp_tp, [*fsdp_tp, "--quick"], ACTS),
        "--dataset": (base, [*base, "--dataset", "synthetic"], ACTS),
        "--set": (base, [*base, "--set", "steps=3"], ACTS),
        "--models": (base, [*base, "--models", "mixtral-8x22b"], ACTS),
        "--layouts": (full, base, ACTS),
        "--hardware": (full, [*full, "--hardware", "h100-sxm"], ACTS),
        "--gpus-per-node": (base, [*base, "--gpus-per-node", "4"], ACTS),
        "--dry-run": (base, [a for a in base if a != "--dry-run"], ACTS),
        "--plan": (base, [a for a in base if a != "--plan"], REFUSED),
        "--repeats": (base, [*base, "--repeats", "2"], REFUSED),
        "--timeout-s": (base, [*base, "--timeout-s", "60"], REFUSED),
        "--launcher": (base, [*base, "--launcher", "srun"], REFUSED),
        "--retry-failed": (base, [*base, "--retry-failed"], REFUSED),
        "--no-retry-failed": (base, [*base, "--no-retry-failed"], REFUSED),
        "--list-presets": (base, [*base, "--list-presets"], REFUSED),
    }
    assert set(cases) == options(suite_cli.build_parser())
    messages = {"--preset": "has no [plan] rows", "--plan": "--hardware applies only with "
                "--plan", "--retry-failed": "--retry-failed/--no-retry-failed",
                "--no-retry-failed": "--retry-failed/--no-retry-failed"}
    for flag, (without, with_, expect) in cases.items():
        check(capsys, suite_cli.main, "suite", flag, without, with_, expect,
              message=messages.get(flag))


def test_suite_plan_lists_only_the_rows_asked_for(tmp_path, capsys, monkeypatch):
    """`--preset go2025 --plan --hardware h200 --models mixtral-8x7b --dry-run`: only Mixtral
    8x7B's rows, each with the command that plans it alone (experiments.plan with the row's
    settings); nothing planned, nothing written."""
    def planned(*args, **kwargs):
        raise AssertionError("--dry-run planned the rows instead of listing them")

    monkeypatch.setattr(suite_plan, "run_plan", planned)
    out = tmp_path / "p"
    code, text, err, _ = call(capsys, suite_cli.main, [
        "--preset", "go2025", "--plan", "--hardware", "h200", "--models", "mixtral-8x7b",
        "--dry-run", "--out", str(out)])
    assert code == 0 and err == ""
    lines = text.strip().splitlines()
    assert lines[0].startswith("suite plan go2025: 16 of 108 rows on h200 (dry run")
    rows = lines[1:-1]
    assert len(rows) == 16 and all(r.startswith("mixtral-8x7b-") for r in rows)
    assert {r.split()[0].split("-")[2] for r in rows} == {"ep8_dp4", "ep4_tp2_dp4", "ep8_pp4"}
    first = rows[0].split()
    assert first[0] == "mixtral-8x7b-ep8_dp4-base"
    assert first[2:6] == ["-m", "experiments.plan", "--hardware", "h200"]
    assert {"--layout=ep", "--mesh=data:4,expert:8", "--model=mixtral-8x7b",
            "--microbatches=4", "--batch-size=128"} <= set(first)
    assert lines[-1] == f"16 rows; drop --dry-run to plan them all into {out}"
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--models", "mixtral-8x7"], "--models: unknown model 'mixtral-8x7' (did you mean "
                                  "'mixtral-8x7b' or 'mixtral-8x22b'?)"),
    (["--layouts", "ep8"], "--layouts: unknown plan row entry 'ep8'"),
    (["--layouts", "tp_pp_2x16", "--models", "mixtral-8x7b"], "no plan row of"),
    (["--set", "hardware=h100-sxm"], "--set hardware: give --hardware to the suite itself"),
    (["--set", "stepz=3"], "--set: unknown key 'stepz'"),
])
def test_suite_plan_filters_refuse_unknown_names(tmp_path, capsys, argv, message):
    out = tmp_path / "p"
    code, _, err, _ = call(capsys, suite_cli.main, [
        "--preset", "go2025", "--plan", "--hardware", "h200", "--dry-run", "--out",
        str(out), *argv])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("suite: error: ") and message in err, err
    assert not out.exists()


def test_interrupted_plan_ranks_the_rows_done(tmp_path, capsys, monkeypatch):
    """Ctrl-C after two rows: exit 130, and the two rows predicted so far ranked (the faster
    first), the ranking only printed."""
    monkeypatch.setattr(suite_plan, "set_devices", lambda configs: None)
    monkeypatch.setattr(suite_plan, "run_plan", interrupted_after_two)
    out = tmp_path / "p"
    code, _, err, _ = call(capsys, suite_cli.main, [
        "--preset", "go2025", "--plan", "--hardware", "h200", "--models", "mixtral-8x7b",
        "--out", str(out)])
    assert code == 130
    assert f"suite: interrupted after 2 of 16 rows (their plan.json under {out}" in err
    ranked = [line.split()[1] for line in err.splitlines() if line[:2] in ("1 ", "2 ")]
    assert ranked == ["mixtral-8x7b-ep8_dp4-base", "mixtral-8x7b-ep8_dp4-recompute"]
    assert "PREDICTED (not measured) on h200" in err
    assert sorted(p.name for p in out.iterdir()) == ranked  # no ranking written


# ---- experiments.predict (the predictions and the suite it calls are stubs) --------------

def test_predict_flags_act_or_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(predict_mod, "set_devices", lambda cases: None)
    monkeypatch.setattr(predict_mod, "validate", lambda cases: [len(cases)])
    monkeypatch.setattr(predict_mod, "format_rows", lambda rows: f"rows: {rows}")

    def suite_main(argv):
        print("suite", *argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        for name in ("ranking.png", "ranking.json"):
            (out / name).write_text("x")
        return 0

    monkeypatch.setattr(suite_cli, "main", suite_main)
    work = tmp_path / "w"
    work.mkdir()
    v, g = ["--validate"], ["--go2025", "--out", str(work / "g")]
    cases = {
        "--validate": ([], v, ACTS),
        "--power": ([], ["--power"], ACTS),
        "--go2025": ([], g, ACTS),
        "--quick": (v, [*v, "--quick"], ACTS),
        "--json": (v, [*v, "--json", str(work / "rows.json")], ACTS),
        "--hardware": (g, [*g, "--hardware", "h100-sxm"], ACTS),
        "--plot": (g, [*g, "--plot", str(work / "r.png")], ACTS),
        "--out": (g, [*g, "--out", str(work / "h")], ACTS),
    }
    parser_flags = {"--validate", "--power", "--go2025", "--quick", "--json", "--hardware",
                    "--plot", "--out"}
    assert set(cases) == parser_flags
    for flag, (without, with_, expect) in cases.items():
        check(capsys, predict_mod.main, "predict", flag, without, with_, expect, folder=work)
    # each mode's flags, given to the other, are refused
    for flag, with_ in (("--hardware", [*v, "--hardware", "h200"]),
                        ("--plot", [*v, "--plot", str(work / "p.png")]),
                        ("--out", [*v, "--out", str(work / "o")]),
                        ("--quick", [*g, "--quick"]),
                        ("--quick", ["--power", "--quick"]),
                        ("--hardware", ["--power", "--hardware", "h200"])):
        check(capsys, predict_mod.main, "predict", flag, None, with_, REFUSED)


def test_predict_walk_covers_its_parser(monkeypatch):
    """The walk above names every option predict's parser has."""
    seen = {}

    def stop(self, args=None, namespace=None):
        seen["flags"] = options(self)
        raise SystemExit(0)

    monkeypatch.setattr(predict_mod.OneLineParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        predict_mod.main([])
    assert seen["flags"] == {"--validate", "--power", "--go2025", "--quick", "--json",
                             "--hardware", "--plot", "--out"}


# ---- experiments.report, analysis.plan_rank, analysis.go2025 -----------------------------

def test_report_flags_act(tmp_path, capsys):
    from analysis import report

    from tests.test_suite_report import _result

    runs, other = tmp_path / "runs", tmp_path / "other"
    for folder, layouts in ((runs, ("ddp",)), (other, ("ddp", "fsdp"))):
        for layout in layouts:
            (folder / layout).mkdir(parents=True)
            (folder / layout / "results.json").write_text(json.dumps(_result(
                layout, {"data": 8} if layout == "ddp" else {"data": 1, "fsdp": 8},
                state=1000, peak=1000, sps=100.0, window=1.0, acc=0.5)))
    parser = report.build_parser()
    assert options(parser) == {"--out"} and positionals(parser) == {"runs"}
    check(capsys, report.main, "report", "RUNS_DIR", [str(runs)], [str(other)], ACTS,
          folder=tmp_path)
    check(capsys, report.main, "report", "--out", [str(runs)],
          [str(runs), "--out", str(tmp_path / "r")], ACTS, folder=tmp_path)


def valid_result(layout: str, mesh: dict, samples_per_s: float) -> dict:
    """A results.json that passes jaxdist.record's schema (no run needed)."""
    devices = 1
    for n in mesh.values():
        devices *= n
    step = {k: 0.5 for k in ("mean", "p50", "p90", "p99", "min", "max")}
    return {
        "schema_version": 1, "framework": "jax", "layout": layout, "mesh": mesh,
        "model": {"name": "resnet50", "params": 1, "flops_per_sample": 1.0,
                  "tokens_per_sample": 1},
        "config": {"model": {"model": "resnet50", "model_opts": "", "dtype": "float32"},
                   "train": {"batch_size": 64, "optimizer": "adamw"},
                   "loop": {"warmup": 3, "steps": 20}, "data": {"dataset": "synthetic"}},
        "env": {"jax_version": "0", "backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
                "num_devices": devices, "num_processes": 1, "simulated": False},
        "compile_s": 1.0, "step_time_s": {"n": 10, "std": 0.0, "ci95": None, **step},
        "warmup_step_time_s": [],
        "throughput": {"samples_per_s": samples_per_s, "tokens_per_s": None},
        "mfu": {"value": 0.4, "hfu": None, "peak_flops_per_device": None,
                "model_flops_per_step": 1.0, "compiled_flops_per_step": None, "reason": None},
        "memory": {"state_bytes_per_device": 100, "state_bytes_by_device": [],
                   "compiled": None, "measured_peak_bytes": 1e9},
        "sharding": {"sharded_bytes": 0, "replicated_bytes": 0, "replicated_leaves": 0,
                     "parts": {}},
        "loss": [1.0], "power": {"available": False}}


def test_compare_flags_act(tmp_path, capsys):
    """experiments.compare (analysis.compare): runs, --published, --baselines (implies
    --published), --top and --out each change what it prints or writes."""
    from analysis import compare
    from jaxdist.record import check as schema_problems

    runs, other = tmp_path / "runs", tmp_path / "other"
    for folder, sps in ((runs, 500.0), (other, 250.0)):
        for layout, mesh in (("ddp", {"data": 8}), ("fsdp", {"data": 1, "fsdp": 8})):
            result = valid_result(layout, mesh, sps if layout == "ddp" else 300.0)
            assert schema_problems(result) == []
            (folder / layout).mkdir(parents=True)
            (folder / layout / "results.json").write_text(json.dumps(result))
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"records": [
        {"id": f"r{i}", "framework": "PyTorch", "strategy": "DDP", "layout": "ddp",
         "model": "ResNet-50", "jaxdist_model": "resnet50", "hardware": "8x H100",
         "device": "H100", "num_gpus": 8, "dtype": "tf32", "local_batch": 8,
         "metric": "step_latency", "unit": "s", "value": value, "readout": "p50",
         "source": {"title": "t", "url": "https://example.org", "locator": "Table 1"}}
        for i, value in enumerate((0.4, 0.6))]}))
    parser = compare.build_parser()
    assert options(parser) == {"--published", "--baselines", "--top", "--out"}
    assert positionals(parser) == {"runs"}
    out = ["--out", str(tmp_path / "c")]
    base = [str(runs), *out]
    mine = [*base, "--baselines", str(records)]
    for flag, without, with_ in (
            ("RUNS", base, [str(other), *out]),
            ("--published", base, [*base, "--published"]),
            ("--baselines", base, mine),
            ("--top", mine, [*mine, "--top", "1"]),
            ("--out", base, [str(runs), "--out", str(tmp_path / "d")])):
        check(capsys, compare.main, "compare", flag, without, with_, ACTS, folder=tmp_path)
    check(capsys, compare.main, "compare", "--top", None, [*base, "--top", "0"], REFUSED)


@pytest.mark.parametrize("module, argv", [
    ("plan_rank", ["DIR", "--bogus"]), ("plan_rank", []),
    ("go2025", ["A", "B", "--hardware", "h200"]), ("go2025", ["A"]),
])
def test_analysis_clis_refuse_what_they_do_not_take(capsys, module, argv):
    """analysis.plan_rank and analysis.go2025 take folders only: anything else is their
    usage line, exit 2."""
    import importlib

    main = importlib.import_module(f"analysis.{module}").main
    code, out, err, _ = call(capsys, main, argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"usage: python -m analysis.{module} ")


def test_every_entry_point_is_walked():
    """The entry points with a parser are the ones walked here (a new one needs a walk)."""
    walked = {"experiments/run.py", "experiments/plan.py", "experiments/suite/cli.py",
              "experiments/predict.py", "analysis/report.py", "analysis/plan_rank.py",
              "analysis/go2025.py", "experiments/report.py", "analysis/compare.py",
              "experiments/compare.py"}
    # Not walked here: the PyTorch side (experiments.torch_run) and the launchers
    # (experiments.launch, ps.*), whose flags have tests of their own.
    elsewhere = {"experiments/torch_run.py",
                 "experiments/launch.py", "experiments/__main__.py", "experiments/torch_worker.py",
                 "experiments/suite/__main__.py"}
    mains = {str(p.relative_to(ROOT)) for d in ("experiments", "analysis")
             for p in (ROOT / d).rglob("*.py") if "def main(" in p.read_text()
             or "__main__" in p.name}
    assert mains <= walked | elsewhere, sorted(mains - walked - elsewhere)
