"""`python -m experiments.compare`: a JAX run and a PyTorch run of the same configuration
give a side-by-side table with JAX/PyTorch ratios; a mismatched pair is named, never lined
up; published records validate, and a malformed one is a one-line error (exit 2)."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments import baselines
from tests.helpers import ROOT, run_cli

RUN_ARGS = ["--model", "mlp-tiny", "--batch-size", "32", "--warmup", "1", "--steps", "3"]


def compare(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "experiments.compare", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One JAX run and one PyTorch run of mlp-tiny, DDP over 2 devices / 2 processes."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("cmp")
    jax_dir, torch_dir = base / "jax-ddp", base / "torch-ddp"
    proc = run_cli("--layout", "ddp", "--mesh", "2", *RUN_ARGS, "--logdir", str(jax_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "experiments.torch_run", "--strategy", "ddp",
                           "--nproc", "2", *RUN_ARGS, "--logdir", str(torch_dir),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return base, jax_dir, torch_dir


def mismatched_copy(src, dst, batch):
    """A copy of a PyTorch run that claims another global batch: a deliberately
    mismatched counterpart."""
    shutil.copytree(src, dst)
    results = json.loads((dst / "results.json").read_text())
    results["config"]["train"]["batch_size"] = batch
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
    assert [r.split("|")[6].strip() for r in rows] == ["JAX", "PyTorch", "**JAX/PyTorch**"]
    ratio_cell = rows[2].split("|")[10].strip()
    assert ratio_cell.startswith("**") and ratio_cell.endswith("x**")
    assert "Runs without a counterpart" not in text
    # Same initial weights and batches: the first losses agree.
    first = json.loads((jax_dir / "results.json").read_text())["loss"][0]
    assert f"first loss JAX {first:.4f}, PyTorch {first:.4f}" in text

    assert (out / "compare.md").read_text() in text
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (out / "compare.csv").open() as f:
        table = list(csv.DictReader(f))
    ratio = next(r for r in table if r["framework"] == "JAX/PyTorch")
    jax_row = next(r for r in table if r["framework"] == "JAX")
    torch_row = next(r for r in table if r["framework"] == "PyTorch")
    assert float(ratio["samples_per_s"]) == pytest.approx(
        float(jax_row["samples_per_s"]) / float(torch_row["samples_per_s"]), rel=1e-6)
    assert float(ratio["state_bytes_per_device"]) == pytest.approx(1.0, abs=0.01)


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
    assert "per-GPU normalised ratio" in mine and "hardware A100 vs CPU" in mine
    others = [x for x in proc.stdout.splitlines() if "| ddp-bench-" in x]
    assert others and all("not comparable" in x and "model ResNet" in x for x in others)


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
