"""The power model (jaxdist.predict.power) on hand-made timelines, the published power rows
(experiments.power_validation) within their targets, and the refusals of --power-limit and
--sm-clock. CPU, no compiles."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxdist.errors import UsageError
from jaxdist.hardware import power_constant
from jaxdist.parts import NAMED
from jaxdist.predict.power import (StageBusy, Timeline, check_settings, parse_limits,
                                   power_line, predict_power, sweep, sweep_lines)
from tests.helpers import ROOT

A100 = NAMED["a100-pcie"].power      # 300 W card of a 400 W die: compute is limit-bound
H100 = NAMED["h100-sxm"].power


def one(compute=0.0, memory=0.0, step=1.0, fixed=0.0) -> Timeline:
    return Timeline(step_s=step, stages=(StageBusy(compute_s=compute, memory_s=memory),),
                    fixed_s=fixed)


def wait_w(rec) -> float:
    return power_constant("waiting", rec.generation) * rec.die_rated_w


def test_all_compute_at_the_limit_draws_the_limit():
    p = predict_power(one(compute=1.0), A100, gpus=4)
    assert p.gpu_avg_w == pytest.approx(300.0)
    assert p.energy_per_step_j == pytest.approx(300.0 * 4 * p.step_s)
    assert p.terms["compute_clock_mhz"] < A100.max_clock_mhz  # held there by lowering it
    assert p.step_s == 1.0  # the timeline is the step at the part's own limit
    low = predict_power(one(compute=1.0), A100, gpus=4, limit_w=200)
    assert low.gpu_avg_w == pytest.approx(200.0)
    assert low.step_s == pytest.approx(p.terms["compute_clock_mhz"] /
                                       low.terms["compute_clock_mhz"])


def test_all_waiting_draws_the_waiting_power():
    p = predict_power(one(step=2.0, fixed=2.0), H100, gpus=8)
    assert p.gpu_avg_w == pytest.approx(wait_w(H100))
    assert p.step_s == 2.0 and p.energy_per_step_j == pytest.approx(wait_w(H100) * 8 * 2.0)


def test_a_bubble_lowers_a_stage_average_by_its_share():
    tl = Timeline(step_s=1.0, stages=(StageBusy(1.0, 0.0), StageBusy(0.75, 0.0)))
    p = predict_power(tl, A100, gpus=2)
    busy_w = p.gpu_avg_w_by_stage[0]
    assert busy_w == pytest.approx(300.0)
    # stage 1 waits a quarter of the (stretched) step
    assert p.gpu_avg_w_by_stage[1] == pytest.approx(busy_w - 0.25 * (busy_w - wait_w(A100)))
    assert "(stage 0: 300 W)" in power_line(p)


def test_a_binding_limit_stretches_compute_not_communication():
    compute, comm = one(compute=1.0), one(step=1.0, fixed=1.0)
    full = predict_power(compute, H100, gpus=8, limit_w=700)
    low = predict_power(compute, H100, gpus=8, limit_w=400)
    assert low.step_s > full.step_s * 1.05 and low.gpu_avg_w == pytest.approx(400.0)
    for limit in (700, 400, 200):
        assert predict_power(comm, H100, gpus=8, limit_w=limit).step_s == 1.0


def test_memory_bound_time_does_not_stretch_under_a_limit():
    p = predict_power(one(memory=1.0), H100, gpus=8, limit_w=300)
    assert p.step_s == 1.0 and p.gpu_avg_w <= 300.0


def test_a_locked_clock_stretches_compute_and_lowers_power():
    tl = one(compute=0.5, memory=0.5)
    top = predict_power(tl, H100, gpus=8, limit_w=700)
    low = predict_power(tl, H100, gpus=8, limit_w=700, sm_clock_mhz=990)
    assert low.step_s == pytest.approx(0.5 * top.terms["compute_clock_mhz"] / 990 + 0.5)
    assert low.gpu_avg_w < top.gpu_avg_w


def test_sweep_time_and_power_monotone():
    tl = Timeline(step_s=1.0, stages=(StageBusy(0.8, 0.1),), fixed_s=0.1)
    rows = sweep(tl, A100, gpus=4, limits=(300, 275, 250, 225, 200, 175, 150))
    steps = [r.step_s for r in rows]
    watts = [r.gpu_avg_w for r in rows]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    assert watts == sorted(watts, reverse=True)
    # above the knee a lower limit saves energy; the sweep names the least
    assert rows[1].energy_per_step_j < rows[0].energy_per_step_j
    best = min(rows, key=lambda r: r.energy_per_step_j)
    assert sweep_lines(rows)[-1].startswith(f"least energy per step: {best.limit_w:.0f} W")


def test_waiting_energy_does_not_depend_on_the_limit():
    rows = sweep(one(step=1.0, fixed=1.0), A100, gpus=4, limits=(300, 200, 150))
    assert len({round(r.energy_per_step_j, 9) for r in rows}) == 1


def test_tokens_samples_and_node():
    node = __import__("jaxdist.parts", fromlist=["NODES"]).NODES["hgx-h100"]
    p = predict_power(one(compute=1.0), H100, gpus=16, tokens_per_step=65536,
                      samples_per_step=16, node=node)
    assert p.tokens_per_j == pytest.approx(65536 / p.energy_per_step_j)
    assert p.samples_per_s_per_mj == pytest.approx(16 / p.step_s / (p.energy_per_step_j / 1e6))
    assert p.node_avg_w == pytest.approx(8 * p.gpu_avg_w + node.non_gpu_training_w)
    assert p.node_energy_per_step_j == pytest.approx(2 * p.node_avg_w * p.step_s)


def test_the_published_rows_within_their_targets():
    from experiments.power_validation import validate
    out = validate()
    s = out["summary"]
    assert len(out["ranks"]) == 8 and s["rank_power"]["worst"] < 0.08
    assert s["energy"]["worst"] < 0.10
    assert len([r for r in out["sweeps"] if r["in_target"]]) == 4
    assert s["sweep_points"]["worst"] < 5.0
    assert len(out["clocks"]) == 6 and s["clock_power"]["worst"] < 0.08
    # the figures docs/power.md states
    assert (round(s["rank_power"]["worst"], 3), round(s["energy"]["worst"], 3),
            round(s["sweep_points"]["worst"], 1), round(s["clock_power"]["worst"], 3)) == \
        (0.078, 0.048, 4.5, 0.069)


@pytest.mark.parametrize("limit, clock, message", [
    (900, None, "--power-limit 900 W is outside h100-sxm's range 200-700 W"),
    (None, 1234, "--sm-clock 1234 MHz is not a clock of h100-sxm: 345-1980 MHz in steps of 15"),
])
def test_settings_the_part_lacks_are_refused(limit, clock, message):
    with pytest.raises(UsageError) as e:
        check_settings(H100, "h100-sxm", limit, clock)
    assert str(e.value) == message
    check_settings(H100, "h100-sxm", 400, 1410)  # in range, a clock it has


def test_a_part_without_a_power_record_is_refused():
    with pytest.raises(UsageError, match="a10g has no power record"):
        check_settings(None, "a10g", 100, None)


@pytest.mark.parametrize("text", ["", "abc", "300,-1", "0"])
def test_bad_limit_text(text):
    with pytest.raises(UsageError, match="--power-limit"):
        parse_limits(text)
    assert parse_limits("700, 500,300") == [700.0, 500.0, 300.0]


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "h100-sxm", "--power-limit", "900"],
     "plan: error: --power-limit 900 W is outside h100-sxm's range 200-700 W"),
    (["--hardware", "a10g", "--sm-clock", "1005"], "plan: error: a10g has no power record"),
    (["--power-limit", "300"], "plan: error: --power-limit applies to a plan on a part"),
])
def test_plan_refuses_in_one_line_before_jax(tmp_path, argv, message):
    code = ("import sys; from experiments import plan; rc = plan.main(sys.argv[1:]); "
            "assert 'jax' not in sys.modules, 'jax imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "--model", "gpt-tiny", "--layout", "fsdp",
                        "--mesh", "1x8", "--batch-size", "16", "--logdir",
                        str(tmp_path / "out"), *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_pipeline_plan_prints_and_writes_its_power(tmp_path):
    """One compile: a two-stage plan on h200 with a two-limit sweep."""
    import json

    from tests.helpers import run_cli
    r = run_cli("--dry-run", "--hardware", "h200", "--gpus-per-node", "2", "--model",
                "gpt-tiny", "--layout", "pp", "--mesh", "stage:2", "--microbatches", "2",
                "--pp-schedule", "gpipe", "--batch-size", "4", "--power-limit", "700,400",
                "--logdir", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    power = plan["power"]
    assert len(power["gpu_avg_w_by_stage"]) == 2 and power["limit_w"] == 700
    assert power["gpu_avg_w"] == pytest.approx(sum(power["gpu_avg_w_by_stage"]) / 2)
    assert [row["limit_w"] for row in power["sweep"]] == [700, 400]
    assert power["least_energy_limit_w"] in (700, 400)
    assert len(plan["pipeline"]["stage_busy"]) == 2
    stage = max(range(2), key=power["gpu_avg_w_by_stage"].__getitem__)
    assert (f"  power: {power['gpu_avg_w']:.0f} W/GPU (stage {stage}: "
            f"{power['gpu_avg_w_by_stage'][stage]:.0f} W)") in r.stdout
    assert "least energy per step: " in r.stdout


def plan_json(model: str, fits: bool, power: dict) -> dict:
    """A plan.json as analysis.plan_rank reads it, with its `power` block."""
    time = {"step_s": 10.0, "compute_s": 10.0, "hbm_s": 0.0, "intra_node_s": 0.0,
            "inter_node_s": 0.0, "comm_exposed_s": 0.0, "bubble_s": 0.0,
            "bottleneck": "compute"}
    return {"label": "predicted", "model": {"name": model}, "layout": "fsdp",
            "mesh": {"fsdp": 8}, "batch_size": 8, "time": time,
            "memory": {"total_bytes": 2 ** 30, "fits": fits},
            "throughput": {"tokens_per_s_per_gpu": 1.0, "mfu": 0.5}, "power": power}


def test_go2025_power_table_ranks_rows_by_energy(tmp_path):
    import json

    from analysis.go2025 import power_rows, power_table
    for name, energy, stages in (("a", 3e5, [500.0, 560.0]), ("b", 2e5, None), ("c", None, None)):
        (tmp_path / name).mkdir()
        power = ({"available": False, "reason": "no record"} if energy is None else
                 {"step_s": 10.0, "gpu_avg_w": 520.0, "energy_per_step_j": energy,
                  "samples_per_s_per_mj": 1.0, "tokens_per_j": 0.5, "node_avg_w": None,
                  **({"gpu_avg_w_by_stage": stages} if stages else {})})
        (tmp_path / name / "plan.json").write_text(json.dumps(plan_json("m", True, power)))
    (tmp_path / "z").mkdir()  # another model ranks apart, whatever its energy
    (tmp_path / "z" / "plan.json").write_text(json.dumps(plan_json("k", False, {
        "step_s": 1.0, "gpu_avg_w": 100.0, "energy_per_step_j": 9e9,
        "samples_per_s_per_mj": None, "tokens_per_j": None, "node_avg_w": 800.0})))
    rows = power_rows(tmp_path)
    assert [r["name"] for r in rows] == ["z", "b", "a"]  # c has no power: left out
    assert rows[2]["top_stage_w"] == 560.0
    table = power_table(rows)
    assert table[2] == "| z | no | 1.00 | 100 | 100 | 9,000,000 | - | - | 0.80 |"
    assert table[3] == "| b | yes | 10.00 | 520 | 520 | 200 | 1.00 | 0.500 | - |"


def test_roofline_compute_and_memory_share_the_device_time():
    from jaxdist.predict.power import busy_of
    b = busy_of(3.0, 1.0, 3.0)  # the roofline: device time is the larger of the two
    assert (b.compute_s, b.memory_s) == (2.25, 0.75)
    b = busy_of(2.0, 1.0, 3.5)  # kernel by kernel: apart, launches beside them
    assert (b.compute_s, b.memory_s) == (2.0, 1.0)


def test_a_run_records_predicted_power_beside_the_measured():
    from types import SimpleNamespace

    from jaxdist.predict.inrun import power_beside
    step = SimpleNamespace(step_s=1.0, compute_s=1.0, hbm_s=0.0, device_s=1.0,
                           comm_exposed_s=0.0, launch_s=0.0, exposed_host_transfer_s=0.0,
                           pipeline=None)
    measured = {"available": True, "avg_w": 1200.0, "gpus": [{}, {}]}
    got = power_beside(step, NAMED["h200"], 2, measured)
    assert got == {"predicted": pytest.approx(700.0), "measured": 600.0}
    assert power_beside(step, NAMED["a10g"], 2, measured)["predicted"] is None
    assert power_beside(step, NAMED["h200"], 2, {"available": False})["measured"] is None


def test_a_written_plan_is_repowered_from_its_json():
    from jaxdist.predict.power import timeline_of_plan
    plan = {"time": {"step_s": 2.0, "compute_s": 1.0, "hbm_s": 0.5, "device_s": 1.6,
                     "comm_exposed_s": 0.4, "launch_s": 0.1},
            "pipeline": {"stage_busy": [{"compute_s": 1.0, "hbm_s": 0.5, "device_s": 1.6},
                                        {"compute_s": 0.8, "hbm_s": 0.5, "device_s": 1.3}]}}
    tl = timeline_of_plan(plan)
    assert [(s.compute_s, s.memory_s) for s in tl.stages] == [(1.0, 0.5), (0.8, 0.5)]
    assert (tl.step_s, tl.fixed_s) == (2.0, pytest.approx(0.5))
    del plan["pipeline"]
    assert len(timeline_of_plan(plan).stages) == 1


def test_a_parameter_server_plan_on_a_part_without_a_record_says_why(tmp_path):
    """One compile: the parameter server's workers planned on h100-pcie, which has no power
    record: the plan says so in its power line and block."""
    import json

    from tests.helpers import run_cli
    r = run_cli("--dry-run", "--hardware", "h100-pcie", "--model", "mlp-tiny", "--layout",
                "ps", "--mesh", "2x1", "--batch-size", "16", "--logdir", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    reason = "h100-pcie has no power record (jaxdist.parts): no power is predicted"
    assert f"  power: none predicted ({reason})\n" in r.stdout
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["power"] == {"available": False, "reason": reason}


def test_plan_rank_ranks_layouts_by_energy_beside_time(tmp_path):
    import json

    from analysis import plan_rank
    for name, tps, energy in (("fast", 30.0, 4e5), ("frugal", 20.0, 1e5), ("none", 10.0, None)):
        (tmp_path / name).mkdir()
        power = ({"available": False, "reason": "no record"} if energy is None else
                 {"step_s": 10.0, "gpu_avg_w": energy / 10.0, "energy_per_step_j": energy,
                  "samples_per_s_per_mj": 1.0, "tokens_per_j": 0.5, "node_avg_w": None})
        body = plan_json("m", True, power)
        body["throughput"]["tokens_per_s_per_gpu"] = tps
        (tmp_path / name / "plan.json").write_text(json.dumps(body))
    ranking = plan_rank.write_ranking(tmp_path, {"hardware": "h200"})
    assert [r["name"] for r in ranking["models"]["m"]] == ["fast", "frugal", "none"]
    text = (tmp_path / "ranking.md").read_text()
    assert "| W/GPU | kJ/step | energy rank |" in text
    assert "| 40000 | 400.0 | 2 |" in text and "| 10000 | 100.0 | 1 |" in text
    (none,) = [line for line in text.splitlines() if "| none |" in line]
    assert none.endswith("| - | - | - |")  # no power record: no power, no energy rank
