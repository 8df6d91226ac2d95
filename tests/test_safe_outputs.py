"""The readers' outputs are safe and honest: `experiments.report --out` and
`experiments.compare --out` never delete or overwrite a path they did not write (a new or
empty folder, or their own earlier output; anything else: one line, exit 2, untouched); a
claim ratio pairs only runs alike in everything but the layout, and says why when it cannot;
a JAX/PyTorch ratio from simulated CPU devices is labelled, not bold. No jax, no runs: the
records are results.json files written here."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from analysis import claims, compare, report
from jaxdist.record import RunRecord

REFUSED = "; choose a new or empty folder"


def result(layout, *, mode=None, steps=20, framework="jax", backend="cpu", simulated=True,
           sps=100.0, peak=1000):
    """A results.json (valid: jaxdist.record.check) of model m (digits, batch 8, sgd) on 2
    devices."""
    p50 = 8 / sps
    return {"schema_version": 1, "status": "complete", "framework": framework,
            "layout": layout, "mesh": {"workers": 2} if layout == "ps" else {"data": 2},
            "model": {"name": "m", "params": 1, "flops_per_sample": 6.0,
                      "tokens_per_sample": 1},
            "config": {"train": {"batch_size": 8, "optimizer": "sgd", "lr": 0.1, "seed": 0},
                       "model": {"dtype": "float32", "model_opts": "",
                                 "matmul_precision": "default"},
                       "data": {"dataset": "digits", "eval_every": 0},
                       "loop": {"warmup": 2, "steps": steps},
                       "ps": {"ps_mode": mode or "sync", "ps_staleness_lr": False,
                              "ps_shards": 2}},
            "env": {"jax_version": "0.10", "backend": backend, "device_kind": "cpu",
                    "num_devices": 2, "num_processes": 1, "simulated": simulated},
            "torch": {"backend": "gloo", "threads_per_process": 1},
            "compile_s": None,
            "step_time_s": {"n": steps, "mean": p50, "std": 0.0, "p50": p50, "p90": p50,
                            "p99": p50, "min": p50, "max": p50, "ci95": None},
            "warmup_step_time_s": [],
            "throughput": {"samples_per_s": sps, "tokens_per_s": None},
            "mfu": {"value": None, "hfu": None, "peak_flops_per_device": None,
                    "model_flops_per_step": 48.0, "compiled_flops_per_step": None,
                    "reason": "CPU"},
            "memory": {"state_bytes_per_device": peak, "state_bytes_by_device": [],
                       "compiled": {"argument_bytes": peak, "output_bytes": 0,
                                    "alias_bytes": 0, "temp_bytes": 0, "peak_bytes": peak,
                                    "peak_bytes_note": "bound"},
                       "measured_peak_bytes": None},
            "sharding": {"sharded_bytes": 0, "replicated_bytes": 0, "replicated_leaves": 0,
                         "parts": {}},
            "power": {"available": False, "reason": "no NVML"},
            "window": {"start_unix_s": 100.0, "end_unix_s": 100.0 + steps * p50},
            "accuracy": [{"step": steps, "wall_s": steps * p50, "accuracy": 0.9}],
            "loss": [2.3]}


def write_runs(root: Path, **runs) -> Path:
    for name, res in runs.items():
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(json.dumps(res))
    return root


@pytest.fixture
def runs(tmp_path):
    return write_runs(tmp_path / "runs", ddp=result("ddp", peak=1000),
                      fsdp=result("fsdp", peak=250))


def snapshot(path: Path) -> dict:
    """Every file below `path` (and `path` itself) by relative name: its bytes' digest."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(path.rglob("*"))}


def one_line(capsys, prefix) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), err
    return err[0]


# ---------------------------------------------------------------------------- report --out

@pytest.mark.parametrize("kind", ["user folder", "run directory", "file"])
def test_report_refuses_an_output_it_did_not_write(runs, tmp_path, capsys, kind):
    if kind == "user folder":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_bytes(b"my notes\x00\xff")
        expected = f"report: error: --out {out} is a folder report did not write (it holds " \
                   f"notes.txt){REFUSED}"
    elif kind == "run directory":
        out = runs / "ddp"  # e.g. `--out RUNS_DIR/ddp` by mistake
        expected = f"report: error: --out {out} is a run directory (it holds " \
                   f"results.json){REFUSED}"
    else:
        out = tmp_path / "report.txt"
        out.write_text("keep me")
        expected = f"report: error: --out {out} is an existing file{REFUSED}"
    before, siblings = snapshot(out), sorted(os.listdir(out.parent))
    assert report.main([str(runs), "--out", str(out)]) == 2
    assert one_line(capsys, "report: error:") == expected
    assert snapshot(out) == before                       # byte-identical, nothing added
    assert sorted(os.listdir(out.parent)) == siblings    # no temporary folder left beside


def test_report_refuses_the_runs_folder_itself(runs, capsys):
    before = snapshot(runs)
    assert report.main([str(runs), "--out", str(runs)]) == 2
    assert one_line(capsys, "report: error:").endswith(REFUSED)
    assert snapshot(runs) == before


def test_report_fills_an_empty_folder_and_replaces_only_its_own_report(runs, tmp_path,
                                                                         capsys):
    out = tmp_path / "rep"
    out.mkdir()
    inode = out.stat().st_ino
    assert report.main([str(runs), "--out", str(out)]) == 0
    assert out.stat().st_ino == inode                  # the user's folder, filled, not replaced
    written = sorted(os.listdir(out))
    assert written == [".jaxdist-report", "accuracy.png", "memory.png", "report.md"]
    assert json.loads((out / ".jaxdist-report").read_text()) == {
        "tool": "report", "files": ["accuracy.png", "memory.png", "report.md"]}
    # an earlier report is replaced (its files only), with no temporary folder left
    (out / "report.md").write_text("# Study report\nstale\n")
    assert report.main([str(runs), "--out", str(out)]) == 0
    assert "stale" not in (out / "report.md").read_text()
    assert sorted(os.listdir(out)) == written
    assert sorted(os.listdir(tmp_path)) == ["rep", "runs"]
    # a file the user put beside it makes it a folder the report did not (only) write
    (out / "mine.txt").write_text("mine")
    before = snapshot(out)
    capsys.readouterr()
    assert report.main([str(runs), "--out", str(out)]) == 2
    assert one_line(capsys, "report: error:") == (
        f"report: error: --out {out} holds mine.txt, which report did not write{REFUSED}")
    assert snapshot(out) == before


def test_report_recognises_a_report_written_before_the_marker(runs, tmp_path):
    out = tmp_path / "old-report"
    out.mkdir()
    (out / "report.md").write_text("# Study report\n\nRuns from ...\n")
    (out / "step_times.png").write_bytes(b"\x89PNG")
    assert report.main([str(runs), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == [".jaxdist-report", "accuracy.png", "memory.png",
                                       "report.md"]
    # a folder holding report.md that is not a report is not taken for one
    other = tmp_path / "other"
    other.mkdir()
    (other / "report.md").write_text("# My report\n")
    assert report.main([str(runs), "--out", str(other)]) == 2
    assert (other / "report.md").read_text() == "# My report\n"


# ---------------------------------------------------------------------------- compare --out

@pytest.fixture
def pair(tmp_path):
    """A JAX run on 2 simulated CPU devices and a PyTorch run of the same configuration."""
    return write_runs(tmp_path / "pair", jax=result("ddp"),
                      torch=result("ddp", framework="pytorch", simulated=False, sps=50.0))


@pytest.mark.parametrize("kind", ["user folder", "file", "run directory"])
def test_compare_refuses_an_output_it_did_not_write(pair, tmp_path, capsys, kind):
    if kind == "user folder":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "compare.md").write_text("my own notes, not compare's\n")
        expected = f"compare: error: --out {out} is a folder compare did not write (it " \
                   f"holds compare.md){REFUSED}"
    elif kind == "file":
        out = tmp_path / "compare.md"
        out.write_text("keep me")
        expected = f"compare: error: --out {out} is an existing file{REFUSED}"
    else:
        out = pair / "torch"
        expected = f"compare: error: --out {out} is a run directory (it holds " \
                   f"results.json){REFUSED}"
    before, siblings = snapshot(out), sorted(os.listdir(out.parent))
    assert compare.main([str(pair / "jax"), str(pair / "torch"), "--out", str(out)]) == 2
    assert one_line(capsys, "compare: error:") == expected
    assert capsys.readouterr().out == ""
    assert snapshot(out) == before
    assert sorted(os.listdir(out.parent)) == siblings


def test_compare_replaces_its_own_earlier_output(pair, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = [str(pair / "jax"), str(pair / "torch"), "--out", str(out)]
    assert compare.main(args) == 0
    names = [".jaxdist-compare", "compare.csv", "compare.md", "compare.png"]
    assert sorted(os.listdir(out)) == names
    (out / "compare.md").write_text("# Cross-framework comparison\nstale\n")
    assert compare.main(args) == 0
    assert "stale" not in (out / "compare.md").read_text()
    assert sorted(os.listdir(out)) == names
    assert sorted(os.listdir(tmp_path)) == ["cmp", "pair"]


# ---------------------------------------------------------------------------- labels

def test_simulated_jax_pytorch_ratio_is_labelled_not_bold(pair, tmp_path, capsys):
    assert compare.main([str(pair / "jax"), str(pair / "torch"), "--out",
                         str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert md in printed
    row = next(line for line in md.splitlines() if "JAX/PyTorch (" in line)
    assert row.split("|")[6].strip() == ("JAX/PyTorch (simulated CPU devices: functional, "
                                         "not a performance figure)")
    # JAX 100 samples/s, PyTorch 50: step p50 0.08 s vs 0.16 s
    assert row.split("|")[8].strip() == "0.50x" and row.split("|")[10].strip() == "2.00x"
    assert "**" not in md


def test_gpu_jax_pytorch_ratio_stays_bold(tmp_path, capsys):
    gpu = dict(backend="gpu", simulated=False)
    pair = write_runs(tmp_path / "gpu", jax=result("ddp", **gpu),
                      torch=result("ddp", framework="pytorch", sps=50.0, **gpu))
    assert compare.main([str(pair / "jax"), str(pair / "torch"), "--out",
                         str(tmp_path / "cmp")]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "JAX/PyTorch" in line)
    assert row.split("|")[6].strip() == "**JAX/PyTorch**"
    assert row.split("|")[10].strip() == "**2.00x**"


# ---------------------------------------------------------------------------- claim pairs

def records(**runs) -> list[RunRecord]:
    return [RunRecord(Path(name), res, name) for name, res in runs.items()]


def test_runs_differing_only_in_steps_form_no_ratio_and_say_why(tmp_path, capsys):
    rs = records(sync=result("ps", mode="sync", steps=20),
                 asyn=result("ps", mode="async", steps=40))
    assert claims.ratios(rs) == []
    assert claims.unpaired(rs) == [claims.Unpaired(
        "async/sync PS", "m", "no ratio: ps-async run asyn and the closest ps-sync run sync "
                              "differ in timed steps 40 vs 20")]
    root = write_runs(tmp_path / "runs", **{r.name: r.results for r in rs})
    assert report.main([str(root), "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    assert "differ in timed steps 40 vs 20" in printed
    md = (tmp_path / "rep" / "report.md").read_text()
    assert ("- async/sync PS, m: no ratio: ps-async run asyn and the closest ps-sync run sync "
            "differ in timed steps 40 vs 20") in md
    # alike in everything but the mode: the ratio is formed and nothing is unpaired
    rs[1].results["config"]["loop"]["steps"] = 20
    assert [r.what for r in claims.ratios(rs)] == ["async/sync PS training time",
                                                   "async-sync PS final accuracy"]
    assert claims.unpaired(rs) == []


@pytest.mark.parametrize("section,key,value,label", [
    ("train", "lr", 0.01, "learning rate 0.01 vs 0.1"),
    ("train", "seed", 1, "seed 1 vs 0"),
    ("loop", "warmup", 5, "warm-up steps 5 vs 2"),
    ("train", "batch_size", 16, "global batch 16 vs 8"),
    ("model", "matmul_precision", "highest", "matmul precision highest vs default")])
def test_fsdp_ddp_pairs_need_every_setting_alike(section, key, value, label):
    rs = records(ddp=result("ddp"), fsdp=result("fsdp", peak=250))
    rs[1].results["config"][section][key] = value
    assert claims.ratios(rs) == []
    [u] = claims.unpaired(rs)
    assert u.text == f"no ratio: fsdp run fsdp and the closest ddp run ddp differ in {label}"


def test_async_runs_with_and_without_scaled_lr_are_not_pooled():
    slr = result("ps", mode="async")
    slr["config"]["ps"]["ps_staleness_lr"] = True
    slr["window"]["end_unix_s"] = 100.0 + 3 * 20 * 0.08
    rs = records(sync=result("ps", mode="sync"), asyn=result("ps", mode="async"), slr=slr)
    got = {r.what: r.value for r in claims.ratios(rs) if "time" in r.what}
    assert got == {"async/sync PS training time": pytest.approx(1.0),
                   "async+slr/sync PS training time": pytest.approx(3.0)}


def test_a_marker_naming_paths_outside_removes_nothing_outside(runs, tmp_path):
    out = tmp_path / "rep"
    assert report.main([str(runs), "--out", str(out)]) == 0
    (tmp_path / "precious.txt").write_text("keep")
    marker = json.loads((out / ".jaxdist-report").read_text())
    marker["files"] += ["../precious.txt", "../runs"]
    (out / ".jaxdist-report").write_text(json.dumps(marker))
    before = snapshot(runs)
    assert report.main([str(runs), "--out", str(out)]) == 0
    assert (tmp_path / "precious.txt").read_text() == "keep" and snapshot(runs) == before
    assert sorted(os.listdir(tmp_path)) == ["precious.txt", "rep", "runs"]


def test_one_tools_output_is_not_the_others(runs, pair, tmp_path, capsys):
    out = tmp_path / "rep"
    assert report.main([str(runs), "--out", str(out)]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert compare.main([str(pair / "jax"), str(pair / "torch"), "--out", str(out)]) == 2
    assert one_line(capsys, "compare: error:") == (
        f"compare: error: --out {out} is a folder compare did not write (it holds "
        f".jaxdist-report, ...){REFUSED}")
    assert snapshot(out) == before
