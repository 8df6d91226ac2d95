"""`experiments.suite` and `experiments.report` as a user runs them: a quick suite of tiny
runs (one of them failing) on simulated CPU devices, resuming it, the report's figures, table
and ratios, and every kind of bad input (exit 2, one line, nothing written)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import claims, plots, report
from experiments.suite import cli, matrix, presets, settings
from jaxdist import config
from jaxdist.record import RunRecord
from tests.helpers import ROOT, child_env

# Two layouts x one model, plus an entry that fails inside the run (a global batch of 8 does
# not split over 3 devices) between them: the suite must record it and go on.
PRESET = """
name = "t"
description = "test preset"
models = ["resnet-tiny"]

[settings]
dataset = "digits"
eval_every = 2
batch_size = 8
warmup = 1
steps = 20
platform = "cpu"

[[layouts]]
name = "ddp"
mesh = "2x1"

[[layouts]]
name = "bad"
layout = "fsdp"
mesh = "3x1"

[[layouts]]
name = "fsdp"
mesh = "2x1"

[quick]
models = ["mlp-tiny"]
[quick.settings]
steps = 4
[quick.env]
XLA_FLAGS = "--xla_backend_optimization_level=0"
"""

NAMES = ["mlp-tiny-ddp-r1", "mlp-tiny-bad-r1", "mlp-tiny-fsdp-r1"]


def run_module(module: str, *args: str, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def preset_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("preset") / "t.toml"
    path.write_text(PRESET)
    return path


@pytest.fixture(scope="session")
def suite_run(preset_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "s"
    proc = run_module("experiments.suite", "--preset", str(preset_file), "--quick",
                      "--out", str(out))
    return proc, out


def test_suite_runs_records_failure_and_goes_on(suite_run):
    proc, out = suite_run
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(NAMES, 1):
        assert f"run {i}/3  {name}" in proc.stdout
    assert "FAILED" in proc.stdout and "exit 2" in proc.stdout
    state = json.loads((out / "suite.json").read_text())
    runs = {r["name"]: r for r in state["runs"]}
    assert [r["name"] for r in state["runs"]] == NAMES
    assert state["quick"] is True and state["counts"] == {"ok": 2, "failed": 1}
    for name in (NAMES[0], NAMES[2]):
        assert runs[name]["status"] == "ok" and runs[name]["seconds"] > 0
        results = RunRecord.load(out / name).results
        assert results["model"]["name"] == "mlp-tiny"
        assert results["step_time_s"]["n"] == 4           # the quick override applied
        assert results["env"]["simulated"] is True
    assert runs[NAMES[0]]["layout"] == "ddp" and runs[NAMES[2]]["layout"] == "fsdp"
    bad = runs[NAMES[1]]
    assert bad["status"] == "failed" and bad["returncode"] == 2
    assert "not divisible by the 3 batch shards" in bad["stderr_tail"]
    assert "not divisible" in bad["reason"]
    assert json.loads((out / "logs" / f"{NAMES[1]}.status.json").read_text())["status"] \
        == "failed"
    assert not (out / NAMES[1] / "results.json").exists()


def test_report_figures_table_and_failures(suite_run, tmp_path):
    import matplotlib.image as mpimg

    _, out = suite_run
    rep = tmp_path / "rep"
    assert report.main([str(out), "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    for png in ("step_times.png", "memory.png", "accuracy.png", "comm.png"):
        image = mpimg.imread(rep / png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert f"]({png})" in text
    assert not (rep / "energy.png").exists() and "Not measured in any run" in text
    section = text.split("## All runs", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| mlp-tiny-")]
    assert len(table) == 2
    rows = {line.split(" | ")[0][2:]: line for line in table}
    assert {NAMES[0], NAMES[2]} <= set(rows)
    cells = rows[NAMES[2]].split(" | ")
    assert cells[1] == "fsdp" and cells[3] == "2" and cells[4] == "8"
    float(cells[5]), float(cells[6]), float(cells[7])   # step p50, p99, samples/s parse
    assert cells[-1].rstrip(" |").endswith("%")          # final accuracy
    assert f"| {NAMES[1]} | failed | exit 2" in text     # the failed run is listed
    # simulated CPU runs have no measured peak: the title names the compiler bound
    assert "| FSDP/DDP compiler bound on peak memory | mlp-tiny |" in text
    assert "| FSDP/DDP throughput | mlp-tiny |" in text and "n/a (simulated)" in text
    assert "simulated devices" in text


def test_resume_skips_finished_runs(suite_run, preset_file):
    _, out = suite_run
    before = {n: (out / n / "results.json").stat().st_mtime_ns for n in (NAMES[0], NAMES[2])}
    proc = run_module("experiments.suite", "--preset", str(preset_file), "--quick",
                      "--out", str(out), "--no-retry-failed")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("skipped (finished)") == 2
    assert "skipped (failed before: exit 2" in proc.stdout
    assert "running" not in proc.stdout
    after = {n: (out / n / "results.json").stat().st_mtime_ns for n in before}
    assert after == before
    state = json.loads((out / "suite.json").read_text())
    assert [r["status"] for r in state["runs"]] == ["ok", "failed", "ok"]


def test_rerun_retries_failed_run_from_a_clean_directory(suite_run, preset_file):
    _, out = suite_run
    stale = out / NAMES[1]
    stale.mkdir()
    (stale / "events.out.tfevents.stale").write_text("left by a killed attempt")
    proc = run_module("experiments.suite", "--preset", str(preset_file), "--quick",
                      "--out", str(out), "--layouts", "bad")
    assert proc.returncode == 0, proc.stderr
    assert f"run 1/1  {NAMES[1]}  running ..." in proc.stdout and "FAILED" in proc.stdout
    assert not stale.exists()               # removed before the new attempt
    state = json.loads((out / "suite.json").read_text())
    assert [r["name"] for r in state["runs"]][:1] == [NAMES[1]]
    assert {r["name"] for r in state["runs"]} == set(NAMES)   # other runs' records kept


def test_plan_interleaves_and_rotates(preset_file):
    keys = config.keys()
    preset = presets.load_preset(preset_file, quick=False, keys=keys)
    preset.models, preset.repeats = ["mlp-tiny", "resnet-tiny"], 2
    runs = matrix.plan(preset, settings.parse_set(["loop.steps=3", "batch-size=16"], keys))
    assert [r.name for r in runs] == [
        "mlp-tiny-ddp-r1", "mlp-tiny-bad-r1", "mlp-tiny-fsdp-r1",
        "resnet-tiny-ddp-r1", "resnet-tiny-bad-r1", "resnet-tiny-fsdp-r1",
        "mlp-tiny-bad-r2", "mlp-tiny-fsdp-r2", "mlp-tiny-ddp-r2",     # round 2 starts later
        "resnet-tiny-bad-r2", "resnet-tiny-fsdp-r2", "resnet-tiny-ddp-r2"]
    for r in runs:  # --set applies to every run, over the preset's settings
        assert "--steps=3" in r.args and "--batch-size=16" in r.args
        assert "--steps=20" not in r.args
    assert "--layout=ddp" in runs[0].args and "--model=mlp-tiny" in runs[0].args


def test_dry_run_relative_out_and_preflight(preset_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--preset", str(preset_file), "--quick", "--out", "rel", "--dry-run",
                       "--layouts", "bad,fsdp"]) == 0
    out = capsys.readouterr().out
    # runs start in the repository root, so the suite hands them an absolute --logdir
    assert f"--logdir={tmp_path / 'rel' / 'mlp-tiny-fsdp-r1'}" in out
    assert "would fail: global batch 8 is not divisible by the 3 batch shards" in out
    assert "2 runs planned, 1 would fail" in out
    assert list(tmp_path.iterdir()) == []    # a dry run writes nothing


def test_variants_and_sweep_names(tmp_path):
    path = tmp_path / "v.toml"
    path.write_text('models = ["gpt-tiny"]\n[[layouts]]\nname = "tp"\nmesh = "2x1x2"\n'
                    '[[variants]]\nname = "base"\n[[variants]]\nname = "remat"\n'
                    'remat = "full"\n[sweep]\nmicrobatches = [1, 4]\n')
    keys = config.keys()
    runs = matrix.plan(presets.load_preset(path, False, keys), {})
    assert [r.name for r in runs] == ["gpt-tiny-tp-base-mb1-r1", "gpt-tiny-tp-base-mb4-r1",
                                      "gpt-tiny-tp-remat-mb1-r1", "gpt-tiny-tp-remat-mb4-r1"]
    assert "--remat=full" in runs[3].args and "--microbatches=4" in runs[3].args


def test_builtin_presets_plan_and_pass_the_runs_checks():
    for name in presets.preset_names():
        for quick in (False, True):
            keys = config.keys()
            runs = matrix.plan(presets.load_preset(presets.find_preset(name), quick, keys), {})
            matrix.validate_names(runs)
            assert runs and all(matrix.preflight(r) is None for r in runs), name


def _result(layout, mesh, *, mode=None, state, peak, sps, window, acc, simulated=False):
    return {"layout": layout, "mesh": mesh, "model": {"name": "m", "params": 1},
            "config": {"train": {"batch_size": 8, "optimizer": "sgd"},
                       "model": {"dtype": "float32", "model_opts": ""},
                       "data": {"dataset": "digits"},
                       "ps": {"ps_mode": mode or "sync", "ps_staleness_lr": False}},
            "env": {"simulated": simulated},
            "step_time_s": {"n": 10, "mean": 0.1, "p50": 0.1, "p99": 0.2},
            "throughput": {"samples_per_s": sps},
            "memory": {"state_bytes_per_device": state, "compiled": {"peak_bytes": peak},
                       "measured_peak_bytes": peak},
            "power": {"available": False, "reason": "no NVML"},
            "window": {"start_unix_s": 100.0, "end_unix_s": 100.0 + window},
            "accuracy": [{"step": 10, "wall_s": window, "accuracy": acc}]}


@pytest.mark.parametrize("simulated", [False, True])
def test_ratios_against_published(simulated):
    R = RunRecord
    runs = [R(Path(n), r, n) for n, r in [
        ("ddp", _result("ddp", {"data": 2}, state=400, peak=1000, sps=200.0, window=5.0,
                        acc=0.9, simulated=simulated)),
        ("fsdp", _result("fsdp", {"data": 2}, state=100, peak=200, sps=100.0, window=10.0,
                         acc=0.9, simulated=simulated)),
        ("sync", _result("ps", {"workers": 2}, mode="sync", state=400, peak=1000, sps=50.0,
                         window=10.0, acc=0.90, simulated=simulated)),
        ("async", _result("ps", {"workers": 2}, mode="async", state=400, peak=1000, sps=60.0,
                          window=8.0, acc=0.80, simulated=simulated))]]
    got = {r.what: r for r in claims.ratios(runs)}
    mem = got["FSDP/DDP peak memory"]
    assert mem.value == pytest.approx(0.2) and mem.basis == "measured peak per device"
    assert mem.verdict("v1") == "within" and mem.verdict("v2") == "within"
    assert got["FSDP/DDP train-state bytes"].value == pytest.approx(0.25)
    thr = got["FSDP/DDP throughput"]
    assert thr.value == pytest.approx(0.5)
    t = got["async/sync PS training time"]
    assert t.value == pytest.approx(0.8)
    acc = got["async-sync PS final accuracy"]
    assert acc.value == pytest.approx(-10.0)
    assert acc.verdict("v2") == "within"          # memory and accuracy are never "simulated"
    if simulated:
        assert thr.verdict("v2") == t.verdict("v2") == "n/a (simulated)"
        assert "simulated devices" in thr.basis
    else:
        assert thr.verdict("v1") == "within" and thr.verdict("v2") == "within"
        assert t.verdict("v2") == "within"


def test_report_measured_memory_and_energy(tmp_path):
    """GPU-like runs (no simulation, measured peak, power telemetry), results.json only."""
    import matplotlib.image as mpimg

    for name, layout, peak, sps, joules in (("ddp", "ddp", 4000, 300.0, 2.0),
                                            ("fsdp", "fsdp", 1000, 120.0, 3.5)):
        res = _result(layout, {"data": 1, "fsdp": 8}, state=peak // 2, peak=peak, sps=sps,
                      window=3.0, acc=0.5)
        res["power"] = {"available": True, "avg_w": 300.0, "energy_per_sample_j": joules}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    rep = tmp_path / "rep"
    assert report.main([str(tmp_path), "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    assert mpimg.imread(rep / "energy.png").ndim == 3
    assert not (rep / "step_times.png").exists()
    assert "Runs without per-step TensorBoard times" in text
    row = next(line for line in text.splitlines() if line.startswith("| FSDP/DDP peak memory"))
    assert "0.250 (75% less" in row and "measured peak per device" in row
    assert row.endswith("| within | 0.17-0.25: FSDP 4-6x lower peak memory | within |")
    row = next(line for line in text.splitlines() if line.startswith("| FSDP/DDP throughput"))
    assert "0.400" in row and "simulated" not in row and row.endswith("| within |")
    table = text.split("## All runs", 1)[1]
    assert "| 3.5 |" in table and "| 3.91 KiB |" in table


def _runs(*specs):
    """RunRecord objects from (name, layout, mesh, peak bytes) tuples."""
    return [RunRecord(Path(name), _result(layout, mesh, state=peak, peak=peak, sps=100.0,
                                          window=1.0, acc=0.5), name)
            for name, layout, mesh, peak in specs]


def test_ratios_pair_only_runs_on_as_many_devices():
    runs = _runs(("ddp8", "ddp", {"data": 8}, 1000),
                 ("fsdp8", "fsdp", {"data": 1, "fsdp": 8}, 250),
                 ("fsdp32", "fsdp", {"data": 4, "fsdp": 8}, 40))
    mem = [r for r in claims.ratios(runs) if r.what == "FSDP/DDP peak memory"]
    # fsdp over 32 devices has no ddp run over 32: it is paired with nothing
    assert [(r.value, r.context) for r in mem] == [
        (0.25, "8 devices, batch 8, float32, digits")]


def test_runs_of_another_framework_or_precision_are_not_paired():
    runs = _runs(("ddp", "ddp", {"data": 8}, 1000), ("fsdp", "fsdp", {"fsdp": 8}, 250))
    runs[1].results["framework"] = "pytorch"
    assert claims.ratios(runs) == []
    runs[1].results["framework"] = "jax"
    runs[1].results["config"]["model"]["matmul_precision"] = "highest"
    assert claims.ratios(runs) == []


def test_bars_are_labelled_layout_at_mesh(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    runs = _runs(("fsdp32", "fsdp", {"data": 4, "fsdp": 8}, 40),
                 ("ddp8", "ddp", {"data": 8}, 1000),
                 ("fsdp8", "fsdp", {"data": 1, "fsdp": 8}, 250))
    assert plots.plot_memory(runs, tmp_path / "memory.png")
    (ax,) = [a for a in figures[0].axes if a.get_visible()]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ddp @ 8", "fsdp @ 1x8",
                                                           "fsdp @ 4x8"]


def test_unfinished_runs_are_listed_by_name(tmp_path):
    from jaxdist.writers import RunWriter

    done = _result("ddp", {"data": 2}, state=400, peak=1000, sps=200.0, window=5.0, acc=0.9)
    for name, extra in (("done", {"status": "complete"}), ("legacy", {}),
                        ("stopped", {"status": "interrupted", "loss": [2.0, 1.9, 1.8]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({**done, **extra}))
    # what a run killed mid-training leaves: its event files and no results.json
    writer = RunWriter(tmp_path / "killed", {"model": {"model": "mlp-tiny"}})
    writer.step(0, 2.3, 0.01, False)
    writer.tb.flush()
    (tmp_path / "killed-compiling").mkdir()        # killed before its first step
    (tmp_path / "done" / "plugins").mkdir()         # empty, but inside a finished run
    rep = tmp_path / "rep"
    assert report.main([str(tmp_path), "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    table = text.split("## Failed and unfinished runs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == [
        "| run | status | reason |",
        "| killed | unfinished | no results.json: the run was killed, or is still running |",
        "| killed-compiling | unfinished | no results.json: the run was killed, or is still "
        "running |",
        "| stopped | interrupted | results.json has status \"interrupted\" (3 steps recorded) |"]
    assert "2 finished, 0 failed, 3 not finished" in text
    runs = text.split("## All runs", 1)[1].split("\n## ", 1)[0]
    assert "| done |" in runs and "| legacy |" in runs and "stopped" not in runs


def test_a_run_killed_with_sigkill_is_listed_unfinished(tmp_path, capsys):
    import signal
    import time

    logdir = tmp_path / "runs" / "killed-ddp"
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.run", "--layout", "ddp",
                             "--mesh", "2", "--platform", "cpu", "--model", "mlp-tiny",
                             "--batch-size", "8", "--warmup", "0", "--steps", "1000000",
                             "--no-progress", "--logdir", str(logdir)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(logdir.glob("events.out.tfevents.*")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (logdir / "results.json").exists()
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    assert "0 runs, 0 failed, 1 not finished" in capsys.readouterr().out
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| killed-ddp | unfinished | no results.json" in text


# ---------------------------------------------------------------------------- bad input

def _one_line_error(capsys, code, expected):
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


SUITE_BAD = [
    (["--preset", "nope"], "unknown preset 'nope'; choose from go2025, ovi2025"),
    (["--preset", "ovi2025", "--set", "batchsize=3"],
     "--set: unknown key 'batchsize'; closest: batch_size, train.batch_size"),
    (["--preset", "ovi2025", "--set", "train.mesh=3"], "'mesh' is in section mesh"),
    (["--preset", "ovi2025", "--set", "steps=many"], "steps must be an int, got 'many'"),
    (["--preset", "ovi2025", "--set", "dtype=float64"], "is not one of float32, bfloat16"),
    (["--preset", "ovi2025", "--set", "logdir=x"], "key 'logdir' cannot be set"),
    (["--preset", "ovi2025", "--models", "vgg17"], "unknown model 'vgg17'"),
    (["--preset", "ovi2025", "--dataset", "imagenet"], "dataset='imagenet' is not one of"),
    (["--preset", "ovi2025", "--layouts", "ddp,zero9"], "--layouts: zero9"),
    (["--preset", "/no/such/preset.toml"], "preset file /no/such/preset.toml does not exist"),
    (["--preset", "ovi2025", "--timeout-s", "nan"], "--timeout-s must be a positive finite"),
    # a FileNotFoundError traceback once suite.json was written; a ValueError traceback
    (["--preset", "ovi2025", "--launcher", "no-such-launcher -N4"],
     "--launcher: 'no-such-launcher' is not a command on this host"),
    (["--preset", "ovi2025", "--launcher", "srun 'x"], "does not split into words: No closing"),
    # a value no run can take: every run started, exited 2, and the suite exited 0
    (["--preset", "ovi2025", "--quick", "--set", "steps=-1"],
     "run 1 (mlp-tiny-ddp-r1): --steps must be a positive integer, got -1"),
    (["--preset", "ovi2025", "--quick", "--set", "lr=nan"], "--lr must be a positive finite"),
    # planned for minutes, growing, before it would have run out of memory
    (["--preset", "ovi2025", "--repeats", "100000000"], "the suite would plan 3,000,000,000 "
                                                        "runs (5 model(s) x 6 layout entries"),
]


@pytest.mark.parametrize("args, message", SUITE_BAD, ids=[" ".join(a) for a, _ in SUITE_BAD])
def test_suite_bad_input(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    _one_line_error(capsys, cli.main([*args, "--out", str(out)]), message)
    assert not out.exists()


def test_out_is_never_a_users_folder(tmp_path, capsys, preset_file):
    """--out /etc wrote a plan folder per row into /etc, and a run whose name matched one of
    the user's folders had that folder deleted before it ran. Now --out is new, empty or a
    suite's own (suite.json; a plan's ranking.json or */plan.json); a run folder that exists
    but that suite.json does not say the suite started is neither deleted nor run over."""
    mine = tmp_path / "mine"
    (mine / NAMES[0]).mkdir(parents=True)
    (mine / NAMES[0] / "notes.txt").write_text("mine")
    for argv, marker in ((["--preset", str(preset_file), "--quick"], "no suite.json"),
                         (["--preset", "go2025", "--plan", "--hardware", "h200"],
                          "no ranking.json or */plan.json")):
        _one_line_error(capsys, cli.main([*argv, "--out", str(mine)]),
                        f"--out {mine} is a folder no suite wrote (it has files but {marker})")
    assert [p.name for p in mine.iterdir()] == [NAMES[0]]
    # A suite's folder (suite.json) holding a folder the suite did not start: left alone,
    # the run recorded failed with the reason, on every pass.
    (mine / "suite.json").write_text('{"runs": []}')
    for _ in range(2):
        assert cli.main(["--preset", str(preset_file), "--quick", "--layouts", "ddp",
                         "--out", str(mine)]) == 0
        (rec,) = json.loads((mine / "suite.json").read_text())["runs"]
        assert rec["status"] == "failed" and rec["reason"].startswith(
            f"{mine / NAMES[0]} exists, and suite.json does not say this suite started it")
        assert (mine / NAMES[0] / "notes.txt").read_text() == "mine"
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ('models = ["mlp-tiny", "resnet9000"]\n[[layouts]]\nname = "ddp"\n',
     "unknown model 'resnet9000'"),
    ('models = ["mlp-tiny"]\n[[layouts]]\nname = "ddp"\nbatchsize = 4\n',
     "layouts.ddp: unknown key 'batchsize'"),
    ('models = ["mlp-tiny"]\nlayouts = [\n', "not valid TOML"),
    ('models = ["mlp-tiny"]\n', "missing 'layouts'"),
    ('models = ["mlp-tiny"]\nrepeat = 2\n[[layouts]]\nname = "ddp"\n',
     "unknown entry 'repeat'; closest: repeats"),
    ('models = ["mlp-tiny"]\n[[layouts]]\nname = "ddp"\n[quick.layouts.fsdp]\nmesh = "2"\n',
     "[quick.layouts.fsdp] names no layout entry"),
    ('models = ["mlp-tiny"]\n[[layouts]]\nname = "ddp"\n[quick.settings]\nstep = 2\n',
     "[quick.settings]: unknown key 'step'; closest: steps"),
    # nan and inf passed '<= 0' and ran every run with no limit
    ('models = ["mlp-tiny"]\ntimeout_s = nan\n[[layouts]]\nname = "ddp"\n',
     "timeout_s must be a positive finite number of seconds"),
    ('models = ["mlp-tiny"]\ntimeout_s = inf\n[[layouts]]\nname = "ddp"\n',
     "timeout_s must be a positive finite number of seconds"),
])
def test_suite_bad_preset_file(tmp_path, capsys, text, message):
    path = tmp_path / "p.toml"
    path.write_text(text)
    out = tmp_path / "out"
    _one_line_error(capsys, cli.main(["--preset", str(path), "--out", str(out)]), message)
    assert not out.exists()


def test_quick_needs_a_quick_block(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text('models = ["mlp-tiny"]\n[[layouts]]\nname = "ddp"\n')
    _one_line_error(capsys, cli.main(["--preset", str(path), "--quick", "--out",
                                        str(tmp_path / "out")]), "has no [quick] block")
    assert not (tmp_path / "out").exists()


def test_report_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rep = tmp_path / "rep"
    _one_line_error(capsys, report.main([str(tmp_path / "missing"), "--out", str(rep)]),
                    "does not exist")
    _one_line_error(capsys, report.main([str(empty), "--out", str(rep)]),
                    f"no runs in {empty}")
    (tmp_path / "file").write_text("x")
    _one_line_error(capsys, report.main([str(tmp_path / "file"), "--out", str(rep)]),
                    "is not a directory")
    # Folders that are empty and nothing else (e.g. /etc's): no run ever wrote there, so no
    # report is written into it (the default --out is RUNS_DIR/report); they counted as
    # runs killed while compiling, and the report went in.
    holder = tmp_path / "not-runs"
    for name in ("a", "b"):
        (holder / name).mkdir(parents=True)
    _one_line_error(capsys, report.main([str(holder)]), f"no runs in {holder}")
    # a results.json that is not a record: the error names it, not "no results.json"
    (empty / "r1").mkdir()
    (empty / "r1" / "results.json").write_text(json.dumps({"step_time_s": "fast"}))
    _one_line_error(capsys, report.main([str(empty), "--out", str(rep)]),
                    f"no runs in {empty}: {empty / 'r1' / 'results.json'}: unreadable (not a "
                    "jaxdist results.json (step_time_s: expected an object))")
    (empty / "r1" / "results.json").unlink()
    (empty / "r1").rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "not-runs"]
    assert sorted(p.name for p in holder.iterdir()) == ["a", "b"]
    assert list(empty.iterdir()) == []


def test_cli_exit_status_is_2_with_one_line(tmp_path):
    for module, args, message in (
            ("experiments.suite", ["--preset", "nope"], "unknown preset 'nope'"),
            ("experiments.report", [str(tmp_path)], "no runs in")):
        proc = run_module(module, *args, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_report_sets_every_layout_against_ddp(tmp_path, capsys):
    """zero1, fsdp and hsdp each get their ratios to ddp (step, throughput, memory, state),
    in report.md and in what the command prints; runs on other devices are not paired."""
    for name, layout, mesh, state, peak, sps in (
            ("ddp", "ddp", {"data": 8}, 800, 1000, 200.0),
            ("zero1", "zero1", {"data": 8}, 400, 600, 190.0),
            ("fsdp", "fsdp", {"data": 1, "fsdp": 8}, 100, 250, 100.0),
            ("hsdp", "hsdp", {"data": 2, "fsdp": 4}, 200, 400, 150.0),
            ("fsdp4", "fsdp", {"data": 1, "fsdp": 4}, 200, 500, 120.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_result(
            layout, mesh, state=state, peak=peak, sps=sps, window=1.0, acc=0.5)))
    rep = tmp_path / "rep"
    assert report.main([str(tmp_path), "--out", str(rep)]) == 0
    out = capsys.readouterr().out
    text = (rep / "report.md").read_text()
    section = text.split("## Every layout against DDP", 1)[1].split("\n## ", 1)[0]
    rows = {line.split(" | ")[1]: line.split(" | ") for line in section.splitlines()
            if line.startswith("| m |")}
    assert set(rows) == {"zero1", "fsdp", "hsdp"}  # fsdp4: no ddp run on 4 devices
    assert rows["zero1"][4] == "0.950" and rows["zero1"][5].startswith("0.600 (measured")
    assert rows["zero1"][6] == "0.500"
    assert rows["fsdp"][4] == "0.500" and rows["hsdp"][5].startswith("0.400")
    assert "zero1/ddp" in out and "samples/s 0.950; memory 0.600" in out
    assert "hsdp/ddp" in out
