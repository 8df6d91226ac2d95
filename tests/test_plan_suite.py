"""`experiments.suite --plan`: the preset's plan rows, the quick form end to end (one
plan.json per row, the ranking, compiles shared across rows), bad input, and the ranking's
breakdown (analysis.plan_rank) on hand-built plans. Every figure here is PREDICTED."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from analysis import plan_rank
from jaxdist.program import compiled
from experiments.suite.plan import plan_rows
from jaxdist.config import keys
from jaxdist.errors import UsageError
from jaxdist.plan_words import TIME_TERMS, TimeTerms
from tests.helpers import ROOT, child_env


def suite(*args):
    """experiments.suite in a process of its own (it sets its own device count), compiled
    at XLA's CPU optimisation level 0 like the other tests (numbers, not speed, are read)."""
    env = child_env()
    return subprocess.run([sys.executable, "-m", "experiments.suite", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)

GO2025 = Path(__file__).resolve().parents[1] / "experiments" / "presets" / "go2025.toml"


def go_rows(quick=False, hardware="h200"):
    return plan_rows(tomllib.loads(GO2025.read_text()), quick, keys(), "go2025", hardware)


def test_go2025_plan_rows_are_go_et_al_grid():
    """The grid as Go et al. ran it: batch 128 at micro-batch 1 (M = 128 / DP), bf16, cuDNN
    flash attention, sequence parallel with TP > 1, four variants, the pipelines timed as
    jaxdist runs them (Megatron's runtime only as a what-if); 32 H200
    and 64 H100 each get their own rows."""
    rows = {r.name: r.settings for r in go_rows()}
    meshes = {m: {s["mesh"] for n, s in rows.items() if n.startswith(m) and "pp" in n}
              for m in ("gpt3-175b", "llama3-70b")}
    assert meshes["gpt3-175b"] == {"stage:16,tensor:2", "stage:8,tensor:4",
                                   "stage:4,tensor:8", "stage:32"}
    assert meshes["llama3-70b"] == {"data:2,stage:2,tensor:8", "data:2,stage:4,tensor:4",
                                    "data:2,stage:8,tensor:2", "data:2,stage:16"}
    for name, s in rows.items():
        assert s["batch_size"] == 128 and s["dtype"] == "bfloat16", name
        assert s["model_opts"] == "attention=cudnn" and "pp_runtime" not in s
        dp = {"data:2": 2}.get(s["mesh"][:6], 1)
        if s["layout"] in ("tp_pp", "pp"):
            assert s["microbatches"] == 128 // dp, name
        assert s.get("sequence_parallel", False) == ("tensor" in s["mesh"] and
                                                      s["layout"] != "ep"), name
    for v, changes in (("base", {}), ("recompute", {"remat": "full"}),
                       ("overlap", {"overlap": True}),
                       ("both", {"remat": "full", "overlap": True})):
        s = rows[f"llama3-70b-fsdp_tp-{v}"]
        assert {k: s[k] for k in ("remat", "overlap") if k in s} == changes
    assert rows["gpt3-175b-tp_pp_4x8-both-gpipe"]["pp_schedule"] == "gpipe"
    assert rows["mixtral-8x22b-ep4_tp2_dp4-base"]["mesh"] == "data:4,tensor:2,expert:4"
    assert rows["mixtral-8x7b-ep8_pp4-base-1f1b"]["mesh"] == "stage:4,expert:8"
    assert {n for n in rows if "ep8_pp4" in n} == {
        f"mixtral-8x{e}b-ep8_pp4-{v}-{p}" for e in (7, 22)
        for v in ("base", "recompute", "overlap", "both") for p in ("1f1b", "gpipe")}
    assert rows["mixtral-8x22b-ep8_pp4-both-gpipe"]["microbatches"] == 16
    assert {n for n in rows if "cp2" in n} == {
        f"llama3-70b-fsdp_tp_cp2_dp2-{v}" for v in ("base", "recompute", "overlap", "both")}
    assert rows["llama3-70b-fsdp_tp_cp2_dp2-base"]["mesh"] == "data:2,context:2,tensor:8"
    assert rows["llama3-70b-fsdp_tp_cp2_dp2-base"]["microbatches"] == 64
    assert len(rows) == 108
    h100 = {r.name: r.settings for r in go_rows(hardware="h100-sxm")}
    assert {s["mesh"] for s in h100.values() if s["layout"] == "tp_pp"} == {
        "stage:32,tensor:2", "stage:16,tensor:4", "stage:8,tensor:8",
        "data:2,stage:4,tensor:8", "data:2,stage:8,tensor:4", "data:2,stage:16,tensor:2"}
    assert not set(h100) & set(rows)
    quick = {r.name: r.settings for r in go_rows(quick=True)}
    assert sorted(quick) == ["gpt-tiny-fsdp_tp-both", "gpt-tiny-tp_pp_4x8-both-1f1b",
                             "gpt-tiny-tp_pp_4x8-both-gpipe"]
    assert quick["gpt-tiny-tp_pp_4x8-both-1f1b"]["batch_size"] == 8


def test_plan_rows_bad_input():
    with pytest.raises(UsageError, match="has no \\[plan\\] rows"):
        plan_rows({"models": ["x"]}, False, keys(), "p")
    with pytest.raises(UsageError, match="unknown entry 'rowz'"):
        plan_rows({"plan": {"rows": [{"name": "a", "models": ["gpt-tiny"]}], "rowz": 1}},
                  False, keys(), "p")
    with pytest.raises(UsageError, match="hardware must be a list"):
        plan_rows({"plan": {"rows": [{"name": "a", "models": ["m"], "hardware": "h200"}]}},
                  False, keys(), "p")
    with pytest.raises(UsageError, match="unknown variant 'x'; variants are base"):
        plan_rows({"plan": {"rows": [{"name": "a", "models": ["m"]}],
                            "variants": [{"name": "base"}], "quick": {"variants": ["x"]}}},
                  True, keys(), "p")
    with pytest.raises(UsageError, match="plan.variants.v"):
        plan_rows({"plan": {"rows": [{"name": "a", "models": ["m"]}],
                            "variants": [{"name": "v", "remat": "sometimes"}]}},
                  False, keys(), "p")
    with pytest.raises(UsageError, match="plan.rows.a"):
        plan_rows({"plan": {"rows": [{"name": "a", "models": ["gpt-tiny"], "bogus": 1}]}},
                  False, keys(), "p")


def test_quick_plan_end_to_end(tmp_path):
    out = tmp_path / "plan"
    r = suite("--preset", "go2025", "--plan", "--quick",
                "--hardware", "h200", "--gpus-per-node", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    plans = sorted(p.parent.name for p in out.glob("*/plan.json"))
    assert plans == ["gpt-tiny-fsdp_tp-both", "gpt-tiny-tp_pp_4x8-both-1f1b",
                     "gpt-tiny-tp_pp_4x8-both-gpipe"]
    for name in plans:
        plan = json.loads((out / name / "plan.json").read_text())
        assert plan["label"] == "predicted" and plan["row"]["name"] == name
        # h200 has a power record: each row's predicted power (jaxdist.predict.power)
        assert 0 < plan["power"]["gpu_avg_w"] <= plan["power"]["limit_w"] == 700
    ranking = json.loads((out / "ranking.json").read_text())
    assert ranking["label"] == "predicted"
    assert [r["name"] for r in ranking["models"]["gpt-tiny"]] and \
        len(ranking["models"]["gpt-tiny"]) == 3
    # each row read from its plan.json by the one reader, plan_rank.row: a PlanRow
    assert all(set(r) == set(plan_rank.PlanRow.__annotations__) and r["hardware"] == "h200"
               for r in ranking["models"]["gpt-tiny"])
    # fsdp_tp: one step compile; tp_pp: F and F + BACK at 1 and 2 blocks and the head's at
    # 1 (6) + the tail, shared by gpipe and 1f1b.
    assert ranking["meta"]["compiles"] == 8
    assert ranking["meta"]["wall_s"] > 0 and len(ranking["meta"]["row_wall_s"]) == 3
    assert (out / "ranking.md").read_text().startswith("PREDICTED (not measured) on h200")
    assert (out / "ranking.png").stat().st_size > 10_000
    assert "PREDICTED" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--plan"], "--plan needs --hardware"),
    (["--plan", "--hardware", "h900"], "unknown --hardware 'h900' (did you mean 'h200'?); known: h100-sxm"),
    (["--hardware", "h200"], "--hardware applies only with --plan"),
])
def test_plan_bad_input_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "o"
    r = suite("--preset", "go2025", "--quick", "--out", str(out),
                *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                    reason="XLA:GPU's topology places hosts; simulated CPU devices are one host")
def test_plan_row_that_cannot_be_placed_fails_before_any_compile(tmp_path):
    """A row whose mesh cannot be laid out on the part's nodes (here 12 GPUs on nodes of 8:
    they do not fill them) is one line, exit 2, before any row is predicted or anything is
    written. Any mesh that fills its nodes is placed (jaxdist.mesh.placement)."""
    preset = tmp_path / "p.toml"
    preset.write_text('name = "p"\n[plan]\n[plan.settings]\nbatch_size = 96\n'
                      '[[plan.rows]]\nname = "ok"\nlayout = "fsdp"\nmesh = "4x8"\n'
                      'models = ["gpt-tiny"]\n'
                      '[[plan.rows]]\nname = "wide"\nlayout = "fsdp"\nmesh = "3x4"\n'
                      'models = ["gpt-tiny"]\n')
    out = tmp_path / "o"
    r = suite("--preset", str(preset), "--plan", "--hardware", "h200", "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == ["suite: error: the mesh's 12 devices do not fill nodes of 8 GPUs (h200); "
                     "give --gpus-per-node a divisor of 12, or a mesh of a multiple of 8 "
                     "devices"]
    assert "predicted" not in r.stdout and not out.exists()


def plan(step, compute, hbm, intra, inter, exposed, bubble=0.0, tps=100.0, layout="fsdp",
         fits=True):
    t = {"step_s": step, "compute_s": compute, "hbm_s": hbm, "intra_node_s": intra,
         "inter_node_s": inter, "comm_exposed_s": exposed, "bubble_s": bubble,
         "bottleneck": "compute"}
    return {"label": "predicted", "model": {"name": "m"}, "layout": layout,
            "mesh": {"data": 4, "fsdp": 8}, "batch_size": 8, "time": t,
            "memory": {"total_bytes": 2 ** 30, "fits": fits},
            "throughput": {"tokens_per_s_per_gpu": tps, "mfu": 0.5}}


def test_ranking_bars_add_up_to_the_step():
    # A plan.json without time.terms is read as the roofline reads it. Overlap: 3 s of
    # communication (1 intra, 2 inter) behind 2 s of compute -> 1 s exposed, by link 1/3, 2/3.
    b = plan_rank.bars(plan(3.0, 2.0, 1.0, 1.0, 2.0, 1.0))
    assert list(b) == list(TIME_TERMS)
    assert (b["compute"], b["memory-bound kernels"], b["launches"]) == (2.0, 0.0, 0.0)
    assert b["intra-node"] == pytest.approx(1 / 3) and b["inter-node"] == pytest.approx(2 / 3)
    b = plan_rank.bars(plan(6.0, 1.0, 3.0, 1.0, 2.0, 3.0))
    assert (b["compute"], b["memory-bound kernels"], b["intra-node"], b["inter-node"]) == \
        (0.0, 3.0, 1.0, 2.0)
    # a plan's own terms are read as written
    terms = TimeTerms(1.0, 2.0, 0.5, 0.25, 0.125, 4.0, True)
    with_terms = plan(7.875, 1.0, 2.0, 0.25, 0.125, 0.375)
    with_terms["time"]["terms"] = terms.to_json()
    b = plan_rank.bars(with_terms)
    assert list(b.values()) == [1.0, 2.0, 0.5, 0.25, 0.125, 4.0]
    assert sum(b.values()) == with_terms["time"]["step_s"]


def test_ranking_orders_by_tokens_per_gpu(tmp_path):
    # A row that does not fit goes last whatever its speed; unknown (None) ranks by speed.
    for name, tps, fits in (("slow", 10.0, True), ("fast", 30.0, None), ("mid", 20.0, True),
                            ("oom", 99.0, False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plan.json").write_text(json.dumps(plan(1, 1, 0, 0, 0, 0, tps=tps,
                                                                   fits=fits)))
    ranking = plan_rank.write_ranking(tmp_path, {"hardware": "h200"})
    assert [r["name"] for r in ranking["models"]["m"]] == ["fast", "mid", "slow", "oom"]
    text = (tmp_path / "ranking.md").read_text()
    assert text.index("| 1 | fast |") < text.index("| 2 | mid |") < text.index("| 3 | slow |")


def test_ranking_cli_refuses_what_is_not_a_plan_folder(tmp_path, capsys):
    """One line, exit 2, nothing written: `plan_rank /etc` wrote /etc/ranking.{json,md}, and
    a plan.json without a field or a ranking.json that is not a ranking were tracebacks."""
    from analysis import go2025

    def refused(main, *args):
        assert main(list(map(str, args))) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    other = tmp_path / "other"
    (other / "a").mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    assert refused(plan_rank.main, other) == (
        f"plan_rank: error: no */plan.json in {other}: not a suite --plan output folder "
        f"(experiments.suite --plan --out DIR)")
    assert refused(plan_rank.main, tmp_path / "nowhere") == (
        f"plan_rank: error: {tmp_path / 'nowhere'} is not a directory (give a suite --plan "
        f"output folder)")
    (other / "a" / "plan.json").write_text('{"label": "predicted"}')
    line = f"{other / 'a' / 'plan.json'} is not a plan jaxdist wrote (no 'time' field)"
    assert refused(plan_rank.main, other) == f"plan_rank: error: {line}"
    assert refused(go2025.main, other, other) == f"go2025: error: {line}"
    (other / "a" / "plan.json").write_text("{")
    assert "is not a plan jaxdist wrote (Expecting" in refused(plan_rank.main, other)
    (other / "a" / "plan.json").write_text(json.dumps(plan(1, 1, 0, 0, 0, 0)))
    (other / "ranking.json").write_text("mine")
    assert refused(plan_rank.main, other) == (
        f"plan_rank: error: {other / 'ranking.json'} is not a ranking plan_rank wrote; move "
        f"it aside to write one")
    assert sorted(p.name for p in other.iterdir()) == ["a", "notes.txt", "ranking.json"]
    (other / "ranking.json").unlink()
    assert plan_rank.main([str(other)]) == 0
    assert json.loads((other / "ranking.json").read_text())["models"]["m"][0]["name"] == "a"


def test_ranking_cli_names_the_part_the_plans_record(tmp_path, capsys):
    """`python -m analysis.plan_rank DIR` on plans alone (no ranking.json, so no suite's
    meta) titles its table with the part every plan.json records, not "on ?"."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plan.json").write_text(json.dumps(
            {**plan(1, 1, 0, 0, 0, 0), "hardware": {"name": "h200"}}))
    assert plan_rank.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("PREDICTED (not measured) on h200: ranked")
    assert (tmp_path / "ranking.md").read_text().startswith("PREDICTED (not measured) on h200")
    (tmp_path / "ranking.json").unlink()
    (tmp_path / "b" / "plan.json").write_text(json.dumps(
        {**plan(1, 1, 0, 0, 0, 0), "hardware": {"name": "h100-sxm"}}))
    assert plan_rank.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("PREDICTED (not measured) on h100-sxm, h200:")


def test_side_by_side_keeps_order_and_stops_at_the_first_error():
    """The plan's entries run on two threads: results come back in task order, and after a
    task fails no task starts; its error is raised."""
    import threading

    from experiments.suite.plan import side_by_side

    names = set()

    def task(i):
        names.add(threading.current_thread().name)
        return i * i

    assert side_by_side([lambda i=i: task(i) for i in range(6)], 2) == [0, 1, 4, 9, 16, 25]
    assert names <= {"plan-0", "plan-1"}
    started = []

    def failing(i):
        started.append(i)
        if i == 0:
            raise UsageError("row 0 cannot be predicted")
        return i

    with pytest.raises(UsageError, match="row 0 cannot"):
        side_by_side([lambda i=i: failing(i) for i in range(20)], 1)
    assert started == [0]


def test_ctrl_c_after_two_rows_ranks_them(tmp_path):
    """SIGINT once two rows are predicted: exit 130, and stderr ranks those two (it passes
    through XLA's warning filter while the rows compile; the filter is left first)."""
    import signal

    preset = tmp_path / "p.toml"
    preset.write_text('name = "p"\n[plan]\n[plan.settings]\nbatch_size = 8\n'
                      + "".join(f'[[plan.variants]]\nname = "b{b}"\nbatch_size = {b}\n'
                                for b in (8, 16, 32))
                      + '[[plan.rows]]\nname = "a"\nlayout = "fsdp"\nmesh = "2x2"\n'
                        'models = ["gpt-tiny"]\n')
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.suite", "--preset", str(preset), "--plan",
         "--hardware", "h200", "--gpus-per-node", "2", "--out", str(out)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    predicted = []
    for line in proc.stdout:
        if line.startswith("predicted "):
            predicted.append(line.split()[1].rstrip(":"))
            if len(predicted) == 2:
                proc.send_signal(signal.SIGINT)
                break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"suite: interrupted after 2 of 3 rows (their plan.json under {out}" in err
    ranked = [line.split()[1] for line in err.splitlines() if line[:2] in ("1 ", "2 ")]
    assert sorted(ranked) == sorted(predicted) == ["gpt-tiny-a-b16", "gpt-tiny-a-b8"]
    assert not (out / "ranking.json").exists()
