"""jaxdist.record.RunRecord reads what the real producers write (experiments.run for the mesh
layouts, ps/driver for the parameter server), and the readers start without jax."""

import json
import subprocess
import sys

import pytest

from jaxdist.record import COMPILER_BOUND, RecordError, RunRecord, check, read_results
from tests.helpers import ROOT, run_cli

TINY = ["--model", "mlp-tiny", "--batch-size", "16", "--warmup", "1", "--steps", "3",
        "--no-progress"]


@pytest.fixture(scope="session")
def produced(tmp_path_factory):
    """(fsdp run dir, ps-async run dir), each from a real run of the producer."""
    base = tmp_path_factory.mktemp("record")
    fsdp, ps = base / "fsdp", base / "ps"
    proc = run_cli("--layout", "fsdp", "--mesh", "1x2", *TINY, "--logdir", str(fsdp))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("--layout", "ps", "--mesh", "2x1", "--ps-mode", "async", *TINY,
                   "--logdir", str(ps), timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return fsdp, ps


def test_record_of_a_mesh_run(produced):
    run_dir = produced[0]
    r = RunRecord.load(run_dir)
    d = r.results
    assert (r.path, r.name, r.status) == (run_dir, "fsdp", "complete")
    assert (r.framework, r.layout, r.layout_mode, r.group) == ("jax", "fsdp", "fsdp", "fsdp")
    assert (r.model, r.model_name, r.variant) == ("mlp-tiny", "mlp-tiny", "")
    assert (r.mesh, r.bar, r.devices) == ("1x2", "fsdp @ 1x2", 2)
    assert (r.batch, r.dtype, r.optimizer, r.matmul_precision) == \
        (16, "float32", d["config"]["train"]["optimizer"], "default")
    assert (r.backend, r.device_kind, r.simulated) == ("cpu", d["env"]["device_kind"], True)
    assert r.precision_class() == "float32"        # no TF32 on a CPU
    assert (r.step_p50, r.step_p99, r.step_p("n")) == \
        (d["step_time_s"]["p50"], d["step_time_s"]["p99"], 3)
    assert r.samples_per_s == d["throughput"]["samples_per_s"]
    assert r.state_bytes == d["memory"]["state_bytes_per_device"]
    # CPU reports no measured peak: the peak is the compiler's allocation bound
    assert r.measured_peak is None
    assert r.peak == r.compiled_bound == d["memory"]["compiled"]["peak_bytes"]
    assert r.peak_basis == COMPILER_BOUND
    assert r.energy_per_sample is None and r.final_accuracy is None
    assert r.loss == d["loss"] and len(r.loss) == 4
    w = d["window"]
    assert r.train_time == w["end_unix_s"] - w["start_unix_s"]


def test_record_of_a_parameter_server_run(produced):
    r = RunRecord.load(produced[1] / "results.json", name="ps-run")
    assert (r.name, r.layout, r.ps_mode, r.layout_mode, r.bar) == \
        ("ps-run", "ps", "async", "ps-async", "ps-async @ 2x1")
    assert r.step_p("n") == 3 and r.devices == 2


# The blocks record_builder.build writes first, in this order, for every producer (the PyTorch
# reference's record: tests/test_torch_ref.py)
BUILT = ["schema_version", "framework", "layout", "layout_facts", "mesh", "model", "config",
         "status",
         "steps_done", "interrupted", "env", "compile_s", "step_time_s", "warmup_step_time_s",
         "throughput", "mfu", "memory", "sharding", "loss", "comm", "power", "window"]


def test_mesh_and_ps_records_come_from_the_one_builder(produced):
    """jaxdist.run_record and ps.collect build their records with record_builder.build: the same
    blocks in the same order, schema-valid, the producer's own blocks after them."""
    from jaxdist.record import check

    for run_dir, own in zip(produced, ("program", "ps")):
        d = RunRecord.load(run_dir).results
        assert list(d)[:len(BUILT)] == BUILT and own in list(d)[len(BUILT):]
        assert check(d) == [] and (d["status"], d["interrupted"]) == ("complete", None)
        assert d["steps_done"] == len(d["loss"]) == 4
        # the layout registry's facts, which the readers ask instead of the name
        ps = own == "ps"
        assert d["layout_facts"] == {"out_of_process": ps, "pipelined": False,
                                     "replicated": ps, "distributed_optimizer": False}
        r = RunRecord.load(run_dir)
        assert (r.out_of_process, r.replicated) == (ps, ps)


def test_the_schema_doc_has_a_row_for_every_key_the_builder_writes():
    """docs/results.md against the code: a row for each block record_builder.build writes, and each
    field the schema checks named in its block's row (or a row of its own)."""
    import re

    from jaxdist.record import SCHEMA

    doc = (ROOT / "docs" / "results.md").read_text()
    rows = {m.group(1): m.group(0)
            for m in re.finditer(r"^\| `([a-z_.0-9]+)` \|.*$", doc, re.M)}
    missing = [k for k in BUILT if k not in rows and not any(r.startswith(k + ".") for r in rows)]
    for key, kind in SCHEMA.items():
        if isinstance(kind, dict):
            missing += [f"{key}.{sub}" for sub in kind if f"{key}.{sub}" not in rows
                        and f"`{sub}`" not in rows.get(key, "")]
    assert missing == []


def test_what_is_not_a_record(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text("[1, 2]")
    (tmp_path / "c.json").write_text(json.dumps({"layout": "ddp", "step_time_s": {"n": 1}}))
    with pytest.raises(RecordError, match="not JSON"):
        RunRecord.load(tmp_path / "a.json")
    with pytest.raises(RecordError, match=r"not a jaxdist results.json \(not an object\)"):
        RunRecord.load(tmp_path / "b.json")
    # a reader that tolerates partial records reads it; a strict one names the first problem
    assert RunRecord.load(tmp_path / "c.json").layout == "ddp"
    with pytest.raises(RecordError, match=r"\(schema_version: missing\)"):
        RunRecord.load(tmp_path / "c.json", require_valid=True)
    # ... but not a field of the wrong type, which a reader would crash on: the report
    # stopped with AttributeError on a step_time_s of 5 (now listed as unreadable)
    for i, (fields, problem) in enumerate((
            ({"step_time_s": 5}, "step_time_s: expected an object"),
            ({"step_time_s": {"n": 1}, "mfu": 3}, "mfu: expected an object"),
            ({"step_time_s": {"n": "1"}}, "step_time_s.n: expected int, got str"),
            ({"step_time_s": {"n": 1}, "loss": [1.0, "x"]},
             "loss: every entry must be a number, or null where it was not finite"))):
        (tmp_path / f"d{i}.json").write_text(json.dumps(fields))
        with pytest.raises(RecordError, match=f"not a jaxdist results.json \\({problem}\\)"):
            RunRecord.load(tmp_path / f"d{i}.json")
    # the strict check (compare's) lists a block of the wrong type: it raised AttributeError
    # on a str step_time_s or a list memory; a status that is neither is refused by both
    for fields, problem in (
            ({"step_time_s": "fast"}, "step_time_s: expected an object"),
            ({"step_time_s": {"n": 1}, "memory": [1]}, "memory: expected an object"),
            ({"step_time_s": {"n": 1}, "status": 3},
             "status: expected complete or interrupted, got 3")):
        assert problem in check(fields)
    (tmp_path / "s.json").write_text(json.dumps({"step_time_s": {"n": 1}, "status": 3}))
    with pytest.raises(RecordError, match=r"\(status: expected complete or interrupted"):
        RunRecord.load(tmp_path / "s.json")
    (tmp_path / "e.json").write_text(json.dumps({"step_time_s": {"n": 1, "p50": None},
                                                 "mfu": None}))
    assert RunRecord.load(tmp_path / "e.json").step_p50 is None  # null is absent, not wrong


@pytest.mark.parametrize("module", ["experiments.report", "experiments.compare"])
def test_readers_start_without_jax(module):
    """`--help` of the readers imports no jax, flax, torch or matplotlib (the import list of
    `python -X importtime`), which is what lets them start in well under a second."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "analysis.claims" in imported and "jaxdist.record" in imported
    heavy = sorted(m for m in imported
                   if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "torch",
                                          "matplotlib", "tensorboardX"))
    assert heavy == []


def test_header_records_the_image_size_readers_match_on():
    # analysis/published.py matches published records on the input size; it reads it from
    # the record instead of importing the model registry (and jax) to recompute it.
    from jaxdist.config import RunConfig
    from jaxdist.record_builder import header
    from models import get_model

    cfg = RunConfig()
    image = header("jax", "ddp", {"data": 1}, cfg.to_dict(), get_model("resnet18-imagenet", {}),
                   1)
    tokens = header("jax", "ddp", {"data": 1}, cfg.to_dict(), get_model("gpt-tiny", {}), 1)
    assert image["model"]["image_size"] == 224
    assert tokens["model"]["image_size"] is None


def test_variant_reads_compiler_overlap(tmp_path):
    """--overlap lives in the compiler config (train.overlap in older records): both mark
    the run's variant, so an overlapped run is never pooled with a plain one."""
    header = {"status": "complete", "framework": "jax", "layout": "fsdp", "mesh": {"data": 2},
              "step_time_s": {"n": 0}}
    for config in ({"compiler": {"overlap": True}}, {"train": {"overlap": True}}):
        (tmp_path / "results.json").write_text(json.dumps({**header, "config": config}))
        assert RunRecord.load(tmp_path).variant == "overlap"


def gpu_run(measured_peak, compiled_peak=30 * 2 ** 30):
    """A gpt-small ddp run on 8 H100s (batch 64, 128 tokens), results.json as written."""
    from pathlib import Path

    return RunRecord(Path("gpu"), {
        "framework": "jax", "layout": "ddp", "mesh": {"data": 8},
        "model": {"name": "gpt-small", "params": 1, "tokens_per_sample": 128},
        "config": {"model": {"model": "gpt-small", "dtype": "bfloat16",
                             "matmul_precision": "default"},
                   "train": {"batch_size": 64, "optimizer": "adamw"}},
        "env": {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "num_devices": 8,
                "num_processes": 1, "simulated": False},
        "step_time_s": {"p50": 0.5, "p99": 0.5},
        "throughput": {"samples_per_s": 128.0, "tokens_per_s": 16384.0},
        "memory": {"measured_peak_bytes": measured_peak,
                   "measured_peak_reason": None if measured_peak else "no allocator stats",
                   "compiled": {"peak_bytes": compiled_peak}},
        "mfu": {"value": 0.4, "reason": None}, "loss": [1.0]})


def test_peak_falling_back_to_the_compiler_bound_says_not_measured():
    """A published peak is measured; when ours is the compiler's bound the record and the
    published comparison both say "compiler bound, not measured", never a plain ratio."""
    from analysis.published import published_section

    assert COMPILER_BOUND == "compiler bound, not measured"
    rec = {"id": "mem", "framework": "PyTorch", "strategy": "DDP", "layout": "ddp",
           "model": "gpt-small", "jaxdist_model": "gpt-small", "hardware": "8x H100",
           "device": "H100", "num_gpus": 8, "dtype": "bfloat16", "local_batch": 8,
           "seq_len": 128, "metric": "peak_memory_per_gpu", "unit": "GiB", "value": 20.0,
           "readout": "max", "source": {"title": "t", "url": "https://example.org"}}
    bound = gpu_run(None)
    assert (bound.peak, bound.peak_basis) == (30 * 2 ** 30, COMPILER_BOUND)
    lines, rows, _ = published_section([bound], [rec], top=1)
    assert rows[0]["verdict"] == ("ours is the compiler bound, not measured: ratio 1.50x is "
                                  "an upper bound")
    assert rows[0]["ours_basis"] == COMPILER_BOUND
    assert any("30.000 GiB (compiler bound, not measured)" in line for line in lines)
    _, rows, _ = published_section([bound], [dict(rec, local_batch=4)], top=1)
    assert rows[0]["verdict"] == "not comparable (ours: compiler bound, not measured)"
    measured = gpu_run(24 * 2 ** 30)
    _, rows, _ = published_section([measured], [rec], top=1)
    assert (rows[0]["verdict"], rows[0]["ours_basis"]) == ("comparable: ratio 1.20x", "measured")


def test_a_diverged_run_writes_standard_json(tmp_path, monkeypatch, capsys):
    """A loss that is not finite is null in results.json: Python wrote NaN tokens, which jq
    and JSON.parse refuse. The schema takes null there, and the reader reads it back as
    nan (summary and report say nan, as the run's own summary did)."""
    import math

    from jaxdist.record import check
    from tests.helpers import cli_main

    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--model", "mlp-tiny", "--mesh", "2x4", "--batch-size", "8",
                    "--warmup", "0", "--steps", "3", "--lr", "1e30", "--logdir", "run")
    assert proc.returncode == 0, proc.stderr

    results = read_results(tmp_path / "run", standard=True)  # NaN or Infinity: RecordError
    assert results["loss"][0] > 0 and None in results["loss"] and check(results) == []
    record = RunRecord.load(tmp_path / "run", require_valid=True)
    assert len(record.loss) == 3 and math.isnan(record.loss[-1])


def test_layout_facts_of_a_record_without_them():
    """A record written before `layout_facts` reads its layout's facts from itself: the
    parameter server by its workers, a pipeline by its `pipeline` block, a replicated state
    by no sharded bytes."""
    from jaxdist.record import layout_facts

    old = {"step_time_s": {"n": 1}}
    ps = RunRecord(ROOT, {**old, "layout": "ps", "mesh": {"workers": 2, "devices_per_worker": 1}})
    ddp = RunRecord(ROOT, {**old, "layout": "ddp", "mesh": {"data": 2},
                           "sharding": {"sharded_bytes": 0}})
    fsdp = RunRecord(ROOT, {**old, "layout": "fsdp", "mesh": {"data": 2},
                            "sharding": {"sharded_bytes": 64}})
    assert [(r.out_of_process, r.replicated) for r in (ps, ddp, fsdp)] == \
        [(True, True), (False, True), (False, False)]
    assert (ps.layout_mode, ps.ps_mode, ddp.layout_mode) == ("ps-sync", "sync", "ddp")
    assert layout_facts({"pipeline": {"schedule": "gpipe"}})["pipelined"] is True
    assert layout_facts({**old, "layout_facts": {"out_of_process": True}}) == {
        "out_of_process": True, "pipelined": False, "replicated": False,
        "distributed_optimizer": False}
