"""`python -m experiments.compare`: a JAX run and a PyTorch run of the same configuration
give a side-by-side table with JAX/PyTorch ratios; a mismatched pair is named, never lined
up; published records validate, and a malformed one is a one-line error (exit 2)."""

import csv
import json
import shutil
import subprocess
import sys

import pytest

from analysis import baselines
from jaxdist.record import RunRecord
from tests.helpers import ROOT, child_env, run_cli

RUN_ARGS = ["--model", "mlp-tiny", "--batch-size", "32", "--warmup", "1", "--steps", "3"]


def compare(*args, timeout=120):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "experiments.compare", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """One JAX run and one PyTorch run of mlp-tiny, DDP over 2 devices / 2 processes."""
    pytest.importorskip("torch", reason="PyTorch is not installed: make test installs "
                        "torch==2.13.0 (pip install torch==2.13.0 by hand)")
    base = tmp_path_factory.mktemp("cmp")
    jax_dir, torch_dir = base / "jax-ddp", base / "torch-ddp"
    proc = run_cli("--layout", "ddp", "--mesh", "2", *RUN_ARGS, "--logdir", str(jax_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "experiments.torch_run", "--strategy", "ddp",
                           "--nproc", "2", *RUN_ARGS, "--logdir", str(torch_dir),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return base, jax_dir, torch_dir


def mismatched_copy(src, dst, batch=None, matmul_precision=None):
    """A copy of a PyTorch run that claims another global batch or matmul precision: a
    deliberately mismatched counterpart."""
    shutil.copytree(src, dst)
    results = RunRecord.load(dst).results
    if batch is not None:
        results["config"]["train"]["batch_size"] = batch
    if matmul_precision is not None:
        results["config"]["model"]["matmul_precision"] = matmul_precision
    (dst / "results.json").write_text(json.dumps(results))
    return dst


def test_matched_pair_table_with_ratio(pair, tmp_path):
    base, jax_dir, torch_dir = pair
    out = tmp_path / "out"
    proc = compare(jax_dir, torch_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "## JAX vs PyTorch (live, same machine)" in text
    rows = [line for line in text.splitlines() if line.startswith("| mlp-tiny | ddp | 2 | 32 |")]
    # simulated CPU devices: the ratio is labelled, never bold (a performance-looking figure)
    assert [r.split("|")[6].strip() for r in rows] == [
        "JAX", "PyTorch", "JAX/PyTorch (simulated CPU devices: functional, not a performance "
                          "figure)"]
    assert "**" not in rows[2]
    ratio_cell = rows[2].split("|")[10].strip()
    assert "Runs without a counterpart" not in text
    # Same initial weights and batches: the first losses agree.
    first = RunRecord.load(jax_dir).results["loss"][0]
    assert f"first loss JAX {first:.4f}, PyTorch {first:.4f}" in text

    assert (out / "compare.md").read_text() in text
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The ratios, recomputed from the two results.json files (one run per side: the median
    # is the run's own figure).
    jax_res = RunRecord.load(jax_dir).results
    torch_res = RunRecord.load(torch_dir).results
    expected_sps = jax_res["throughput"]["samples_per_s"] / torch_res["throughput"]["samples_per_s"]
    expected_p50 = jax_res["step_time_s"]["p50"] / torch_res["step_time_s"]["p50"]
    expected_state = (jax_res["memory"]["state_bytes_per_device"] /
                      torch_res["memory"]["state_bytes_per_device"])
    assert ratio_cell == f"{expected_sps:.2f}x"
    assert rows[2].split("|")[8].strip() == f"{expected_p50:.2f}x"
    with (out / "compare.csv").open() as f:
        table = list(csv.DictReader(f))
    ratio = next(r for r in table if r["framework"] == "JAX/PyTorch")
    assert float(ratio["samples_per_s"]) == pytest.approx(expected_sps, rel=1e-9)
    assert float(ratio["step_p50_s"]) == pytest.approx(expected_p50, rel=1e-9)
    assert float(ratio["state_bytes_per_device"]) == pytest.approx(expected_state, rel=1e-9)
    assert jax_res["config"]["model"]["matmul_precision"] == "default"
    assert torch_res["config"]["model"]["matmul_precision"] == "default"


def test_mismatched_pair_is_named_not_lined_up(pair, tmp_path):
    base, jax_dir, torch_dir = pair
    other = mismatched_copy(torch_dir, tmp_path / "torch-b16", 16)
    # With a matched pair present, the odd one is listed with its mismatch.
    proc = compare(jax_dir, torch_dir, other, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "## Runs without a counterpart (not compared)" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "torch-b16" in x and "not comparable" in x)
    assert "global batch 16 vs 32" in line
    # Alone, the mismatched pair is an error that names the difference.
    proc = compare(jax_dir, other, "--out", tmp_path / "out2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no JAX run matches a PyTorch run" in lines[0]
    assert "global batch 32 vs 16" in lines[0]
    assert not (tmp_path / "out2").exists()


def test_matmul_precision_mismatch_is_named(pair, tmp_path):
    base, jax_dir, torch_dir = pair
    other = mismatched_copy(torch_dir, tmp_path / "torch-highest", matmul_precision="highest")
    proc = compare(jax_dir, other, "--out", tmp_path / "out")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no JAX run matches a PyTorch run" in lines[0]
    assert lines[0].endswith(": matmul precision default vs highest"), lines[0]
    assert not (tmp_path / "out").exists()


def test_published_mismatches_are_named(pair, tmp_path):
    base, jax_dir, _ = pair
    user = tmp_path / "mine.toml"
    user.write_text("""
[[records]]
id = "my-mlp-tiny-a100"
framework = "PyTorch"
source = { title = "my lab notebook", url = "https://example.org/notebook", locator = "p. 3" }
strategy = "DDP"
layout = "ddp"
model = "mlp-tiny"
jaxdist_model = "mlp-tiny"
hardware = "2x A100 80GB"
device = "A100"
num_gpus = 2
dtype = "float32"
global_batch = 32
local_batch = 16
readout = "mean of 3 steps after 1 warm-up"
metric = "throughput_per_gpu"
value = 1000.0
unit = "samples/s/GPU"
""")
    proc = compare(jax_dir, "--baselines", user, "--top", "2", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "## JAX vs published figures" in proc.stdout
    mine = next(x for x in proc.stdout.splitlines() if "my-mlp-tiny-a100" in x)
    # Simulated CPU devices against an A100 figure: no ratio at all, normalised or not.
    assert "| not comparable (simulated CPU devices vs A100) |" in mine
    assert "ratio" not in mine and "hardware A100 vs CPU (simulated devices)" in mine
    # records of other models (the bundled ResNet ddp benchmarks) are never lined up
    assert not [x for x in proc.stdout.splitlines() if "| ddp-bench-" in x]
    assert (tmp_path / "out" / "compare.md").exists()
    assert not (tmp_path / "out" / "compare.png").exists()  # no JAX / PyTorch pair to plot
    assert "(no compare.png: no matched JAX / PyTorch pair to plot)" in proc.stdout


def test_published_without_a_record_of_the_model_says_no_comparable_record(pair, tmp_path):
    base, jax_dir, _ = pair
    proc = compare(jax_dir, "--published", "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "compare: error: no comparable published record: none of the JAX runs' models "
        "(published records of other models are never lined up)"]
    assert not (tmp_path / "out").exists()


def test_a_run_without_a_record_of_its_model_reads_no_comparable_record():
    from analysis.published import published_section

    rec = [record("r50", "throughput_per_gpu", "samples/s/GPU", 400.0, model="ResNet50",
                  jaxdist_model="resnet50")]
    lines, rows, shown = published_section([fake_run()], rec, top=3)
    assert (rows, shown) == ([], 0)
    assert [x for x in lines if x.startswith("| gpt-small")] == [
        "| gpt-small ddp x8 b64 (jax) | no comparable record (1 ddp record(s), none of model "
        "gpt-small) | | | | | | | |"]


def test_published_records_validate():
    records = baselines.load()
    assert len(records) >= 253
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert r["unit"] and r["source"]["title"], r["id"]
        src = r["source"]
        assert (src.get("repo") and src.get("commit")) or src.get("url") or src.get("paper")
        assert r["value"] is not None or r["value_text"], r["id"]
        assert r["readout"] and r["layout"] in baselines.LAYOUTS
    ids = {r["id"] for r in records}
    assert {"tt24-t1-fsdp-tps", "ovi-v2-fsdp-mem", "ovi-v1-fsdp-mem"} <= ids


@pytest.mark.parametrize("record, message", [
    ({"unit": None}, "unit: missing"),
    ({"source": {"title": "x"}}, "source: needs repo + commit"),
    ({"value": "fast"}, "value: expected a number"),
    ({"layout": "zero9"}, "layout: 'zero9' is not one of"),
    ({"colour": "blue"}, "unknown field(s) colour"),
])
def test_malformed_record_is_a_one_line_error(tmp_path, record, message):
    good = {"id": "r1", "framework": "PyTorch", "strategy": "DDP", "layout": "ddp",
            "model": "m", "hardware": "A100", "readout": "p50", "metric": "step_latency",
            "value": 1.0, "unit": "s", "source": {"title": "t", "url": "https://x",
                                                   "locator": "Table 1"}}
    bad = {k: v for k, v in {**good, **record}.items() if v is not None}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"records": [bad]}))
    with pytest.raises(baselines.UsageError, match="record r1"):
        baselines.load([path], builtin=False)
    proc = compare(tmp_path, "--baselines", path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and message in lines[0], lines


def test_no_runs_is_a_one_line_error(tmp_path):
    proc = compare(tmp_path / "nowhere")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"compare: error: {tmp_path / 'nowhere'}: no such run directory"


# ---------------------------------------------------------------------------- no runs needed

def fake_run(name="jax", *, framework="jax", backend="gpu", kind="NVIDIA H100 80GB HBM3",
             devices=8, precision="default", simulated=False, tokens_per_s=80_000.0,
             p50=0.5, peak=40 * 2 ** 30):
    """A results.json of gpt-small (128 tokens per sample), ddp, global batch 64."""
    from pathlib import Path

    from jaxdist.record import RunRecord as Run

    model = {"model": "gpt-small", "model_opts": "", "dtype": "float32"}
    if precision is not None:
        model["matmul_precision"] = precision
    return Run(Path(name), {
        "framework": framework, "layout": "ddp", "mesh": {"data": devices},
        "model": {"name": "gpt-small", "params": 1, "tokens_per_sample": 128},
        "config": {"model": model, "train": {"batch_size": 64, "optimizer": "adamw"},
                   "loop": {"warmup": 3, "steps": 20}},
        "env": {"backend": backend, "device_kind": kind, "num_devices": devices,
                "num_processes": 1, "simulated": simulated},
        "step_time_s": {"p50": p50, "p99": p50},
        "throughput": {"samples_per_s": tokens_per_s / 128, "tokens_per_s": tokens_per_s},
        "memory": {"measured_peak_bytes": peak, "compiled": None},
        "mfu": {"value": 0.4, "reason": None}, "loss": [1.0]})


def record(rid, metric, unit, value, **over):
    rec = {"id": rid, "framework": "PyTorch", "strategy": "DDP", "layout": "ddp",
           "model": "gpt-small", "jaxdist_model": "gpt-small", "hardware": "16x A100 80GB",
           "device": "A100", "num_gpus": 16, "dtype": "tf32", "local_batch": 8,
           "seq_len": 128, "metric": metric, "unit": unit, "value": value,
           "readout": "p50", "source": {"title": "t", "url": "https://example.org"}}
    return {**rec, **over}


def verdicts(run, records) -> dict[str, str]:
    from analysis.published import published_section

    _, rows, _ = published_section([run], records, top=len(records))
    return {row["record"]: row["verdict"] for row in rows}


def test_only_throughput_is_normalised_per_gpu():
    records = [record("tps", "throughput_per_gpu", "tokens/s/GPU", 4000.0),
               record("lat", "step_latency_p50", "s", 0.25),
               record("mem", "peak_memory_per_gpu", "GiB", 20.0),
               record("mfu", "MFU", "fraction", 0.5)]
    got = verdicts(fake_run(), records)
    # 80,000 tokens/s over 8 H100s = 10,000 per GPU, against 4,000 per A100
    assert got["tps"] == "per-GPU normalised ratio 2.50x"
    assert got["lat"] == got["mem"] == got["mfu"] == "not comparable"
    # the same hardware and GPU count: every quantity is a plain ratio
    same = [dict(r, device="H100", hardware="8x H100", num_gpus=8) for r in records]
    got = verdicts(fake_run(), same)
    assert got == {"tps": "comparable: ratio 2.50x", "lat": "comparable: ratio 2.00x",
                   "mem": "comparable: ratio 2.00x", "mfu": "comparable: ratio 0.80x"}


def test_cpu_run_against_a_gpu_record_is_not_comparable():
    rec = [record("tps", "throughput_per_gpu", "tokens/s/GPU", 4000.0)]
    sim = fake_run(backend="cpu", kind="cpu", simulated=True)
    assert verdicts(sim, rec) == {"tps": "not comparable (simulated CPU devices vs A100)"}
    real_cpu = fake_run(backend="cpu", kind="cpu", devices=1)
    assert verdicts(real_cpu, [dict(rec[0], device=None, hardware="RTX 3090 (24 GB)")]) == \
        {"tps": "not comparable (CPU vs RTX 3090 (24 GB))"}


def test_precision_class_against_published_dtype():
    from analysis.published import published_section

    rec = [record("tps", "throughput_per_gpu", "tokens/s/GPU", 4000.0, device="H100",
                  hardware="8x H100", num_gpus=8)]
    assert verdicts(fake_run(precision="high"), rec) == {"tps": "comparable: ratio 2.50x"}
    lines, rows, _ = published_section([fake_run(precision="highest")], rec, top=1)
    assert rows[0]["verdict"] == "not comparable"
    assert rows[0]["mismatches"] == "precision tf32 vs float32"
    _, rows, _ = published_section([fake_run()], [dict(rec[0], dtype="float32")], top=1)
    assert rows[0]["mismatches"] == \
        "precision float32 vs tf32 (float32 at matmul precision default)"
    # a V100 has no TF32: float32 is float32 at every precision
    _, rows, _ = published_section([fake_run(kind="Tesla V100-SXM2-32GB")],
                                   [dict(rec[0], device="V100", hardware="8x V100",
                                         dtype="float32")], top=1)
    assert (rows[0]["verdict"], rows[0]["mismatches"]) == ("comparable: ratio 2.50x", "")


def test_live_match_names_the_precision_difference():
    from analysis.match import mismatches
    from jaxdist.record import PYTORCH_UNRECORDED

    jax_run = fake_run()
    assert mismatches(jax_run, fake_run("pt", framework="pytorch")) == []
    assert mismatches(jax_run, fake_run("pt", framework="pytorch", precision="highest")) == \
        ["matmul precision default vs highest"]
    # runs from before the flag: JAX ran at XLA's default, PyTorch at its own mixed default
    assert fake_run("old", precision=None).matmul_precision == "default"
    assert mismatches(jax_run, fake_run("pt", framework="pytorch", precision=None)) == \
        [f"matmul precision default vs {PYTORCH_UNRECORDED}"]
