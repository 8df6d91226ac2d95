"""analysis.go2025 on hand-built plans: row names split into entry, variant and schedule;
1F1B against GPipe under both runtimes; each finding's agreement decided from the figures."""

import json
import subprocess
import sys

import pytest

from analysis import go2025
from tests.helpers import ROOT


def plan(model, layout, step, hw="h200", fits=True, intra=0.0, inter=0.0, sched=None,
         lockstep=None, dataflow=None, gib=10.0, bottleneck="compute"):
    t = {"step_s": step, "compute_s": step, "hbm_s": 0.0, "intra_node_s": intra,
         "inter_node_s": inter, "comm_exposed_s": 0.0, "bottleneck": bottleneck}
    p = {"label": "predicted", "model": {"name": model}, "layout": layout,
         "mesh": {"stage": 4, "tensor": 8}, "batch_size": 128, "time": t,
         "hardware": {"name": hw},
         "memory": {"total_bytes": gib * 2 ** 30, "fits": fits},
         "throughput": {"tokens_per_s_per_gpu": 128 / step, "mfu": 0.4}}
    if sched:
        p["pipeline"] = {"schedule": sched, "microbatches": 128, "runtime": "megatron",
                         "bubble_fraction_of_ticks": 0.05, "lockstep_s": lockstep,
                         "dataflow_s": dataflow, "tail_s": 1.0}
    return p


def write(directory, plans):
    for name, p in plans.items():
        (directory / name).mkdir(parents=True)
        (directory / name / "plan.json").write_text(json.dumps(p))


@pytest.fixture
def dirs(tmp_path):
    h200, h100 = tmp_path / "h200", tmp_path / "h100"
    write(h200, {
        "m-tp_pp_4x8-both-1f1b": plan("m", "tp_pp", 10.0, sched="1f1b", lockstep=14.0,
                                      dataflow=9.0, gib=40, intra=1.0),
        "m-tp_pp_4x8-both-gpipe": plan("m", "tp_pp", 10.0, sched="gpipe", lockstep=11.0,
                                       dataflow=9.0, gib=90, intra=1.0),
        "m-fsdp_tp-both": plan("m", "fsdp_tp", 12.0, inter=6.0),
        "m-fsdp_tp-base": plan("m", "fsdp_tp", 8.0, fits=False)})
    write(h100, {"m-tp_pp_8x8-both-1f1b": plan("m", "tp_pp", 11.0, hw="h100-sxm",
                                               sched="1f1b", lockstep=15.0, dataflow=10.0,
                                               bottleneck="inter-node", intra=2.0)})
    return h200, h100


def test_names_split_into_entry_variant_schedule():
    assert go2025.split_name("llama3-70b-tp_pp_4x4_dp2-both-1f1b", "llama3-70b") == \
        ("tp_pp_4x4_dp2", "both", "1f1b")
    assert go2025.split_name("mixtral-8x22b-ep8_tp4-recompute", "mixtral-8x22b") == \
        ("ep8_tp4", "recompute", None)
    assert go2025.split_name("gpt3-175b-fsdp", "gpt3-175b") == ("fsdp", "base", None)


def test_findings_and_schedule_pairs(dirs):
    h200, h100 = (go2025.rows_of(d) for d in dirs)
    # the OOM base row never counts as the best
    assert go2025.best(h200, "m", "base") is None
    assert go2025.best(h200, "m", "both")["entry"] == "tp_pp_4x8"
    pairs = go2025.schedule_pairs(h200)
    assert len(pairs) == 1
    p = pairs[0]
    assert (p["gpipe_jaxdist"], p["1f1b_jaxdist"]) == (12.0, 15.0)
    assert (p["gpipe_megatron"], p["1f1b_megatron"]) == (10.0, 10.0)
    assert (p["gpipe_gib"], p["1f1b_gib"]) == (90, 40)
    f = {x["finding"].split(" ")[0]: x for x in go2025.findings(h200, h100)}
    # 10 s on 32 H200 (12.8 tok/s/GPU here) <= 11 s on 64 H100 (11.6)
    assert f["Fewer,"]["agrees"] == "yes"
    assert "best 32 H200 tp_pp_4x8 (both) 10.0 s, 13 tok/s/GPU vs best 64 H100 tp_pp_8x8 " \
           "(both) 11.0 s, 12 tok/s/GPU (bottleneck compute / inter-node)" in \
        f["Fewer,"]["predicted"]
    # per GPU but not per batch: the H100 grid twice as fast per step, half as fast per GPU
    slow = [dict(r, step_s=20.0, tokens_per_s_per_gpu=6.4) if r["entry"] == "tp_pp_4x8" else r
            for r in h200]
    fast = [dict(r, step_s=11.5, tokens_per_s_per_gpu=5.0) for r in h100]
    assert go2025.findings(slow, fast)[0]["agrees"] == "partly: faster per GPU, not per batch"
    assert go2025.findings(slow, [dict(r, tokens_per_s_per_gpu=20.0) for r in fast])[0][
        "agrees"] == "no"
    # TPxPP links busy 10%, 10% and 18% vs fsdp_tp 50% (the OOM row left out)
    assert f["TP"]["agrees"] == "yes" and "busy 10% of" in f["TP"]["predicted"]
    assert "vs 50% (fsdp_tp" in f["TP"]["predicted"]
    assert f["Micro-batch"]["agrees"] is None


def test_cli(dirs):
    r = subprocess.run([sys.executable, "-m", "analysis.go2025", *map(str, dirs)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PREDICTED (not measured)")
    assert "| m | tp_pp_4x8 | both | 12.00 | 15.00 | 1.25 | 10.00 | 10.00 | 1.00 |" in r.stdout
    r = subprocess.run([sys.executable, "-m", "analysis.go2025", "nowhere"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
