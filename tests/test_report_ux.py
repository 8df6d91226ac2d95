"""What the report says to someone comparing runs: pipeline runs
side by side with their schedule, bubble and stage bytes; memory ticks at round byte values;
the runs comm.png leaves out, named with the reason; a ps run's state labelled as living on
the servers; energy's reasons one per line; the memory ratio titled by what it divides."""

from pathlib import Path

import pytest

from analysis import claims, plots, report
from jaxdist.record import RunRecord


def res(layout, mesh, *, state=1000, bound=3000, pipeline=None, power=None, comm=True):
    r = {"layout": layout, "mesh": mesh, "model": {"name": "gpt-tiny", "params": 1},
         "config": {"train": {"batch_size": 8, "optimizer": "adamw", "microbatches": 2},
                    "model": {"dtype": "float32", "model_opts": ""},
                    "data": {"dataset": "synthetic"}, "ps": {"ps_mode": "sync"}},
         "env": {"simulated": True, "num_devices": 8},
         "step_time_s": {"n": 3, "mean": 0.1, "p50": 0.1, "p99": 0.2},
         "throughput": {"samples_per_s": 80.0},
         "memory": {"state_bytes_per_device": state, "compiled": {"peak_bytes": bound},
                    "measured_peak_bytes": None},
         "power": power or {"available": False, "reason": "NVML library not found"},
         "comm": {"by_kind": {"all-reduce": {"bytes": 10, "count": 1}}, "by_axis": {},
                  "total_ring_bytes": 10} if comm else None}
    if pipeline:
        r["pipeline"] = pipeline
    return r


def pp(schedule, bubble, stash):
    return {"schedule": schedule, "stages": 2, "virtual": 1, "microbatches": 2,
            "bubble": bubble, "analytic_bubble": bubble,
            "analytic_bubble_formula": "(S-1)/(M+S-1)",
            "stage_bytes": {"total": 32768, "analytic": 32768, "by_stage": [16384, 16384]},
            "memory": {"activation_stash_bytes": stash}}


def runs():
    stage = {"stage": 2, "data": 4, "fsdp": 1}
    return [RunRecord(Path("gp"), res("pp", stage, pipeline=pp("gpipe", 1 / 3, 4096)), "gp"),
            RunRecord(Path("fb"), res("pp", stage, pipeline=pp("1f1b", 1 / 3, 2048)), "fb"),
            RunRecord(Path("ddp"), res("ddp", {"data": 8, "fsdp": 1}), "ddp"),
            RunRecord(Path("fsdp"), res("fsdp", {"data": 1, "fsdp": 8}, state=200, bound=900),
                      "fsdp"),
            RunRecord(Path("ps"), res("ps", {"workers": 2, "devices_per_worker": 1},
                                      power={"available": False,
                                             "reason": "power telemetry is not implemented "
                                                       "yet"}, comm=False), "ps")]


def markdown(rs):
    figures = {"comm.png", "memory.png", "step_times.png"}
    return report.build_markdown(Path("runs"), rs, [], [], {}, figures, claims.ratios(rs),
                                 claims.unpaired(rs))


def test_pipeline_runs_have_their_schedule_in_the_label_and_a_bubble_section():
    rs = runs()
    assert {r.bar for r in rs[:2]} == {"pp gpipe+mb2 @ data:4,stage:2",
                                       "pp 1f1b+mb2 @ data:4,stage:2"}
    text = markdown(rs)
    section = text.split("## Pipeline: bubble and stage bytes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(("| gp ", "| fb "))]
    assert rows == [
        "| gp | pp gpipe+mb2 @ data:4,stage:2 | gpipe | 2 | 1 | 2 | 33.3% | 33.3% "
        "(S-1)/(M+S-1) | 32.00 KiB | 32.00 KiB | 4.00 KiB |",
        "| fb | pp 1f1b+mb2 @ data:4,stage:2 | 1f1b | 2 | 1 | 2 | 33.3% | 33.3% "
        "(S-1)/(M+S-1) | 32.00 KiB | 32.00 KiB | 2.00 KiB |"]


def test_ps_state_energy_reasons_comm_left_out_and_the_memory_ratio_title():
    text = markdown(runs())
    ps_row = next(line for line in text.splitlines() if line.startswith("| ps |"))
    assert "1000 B (a worker's parameters; optimizer state on the servers)" in ps_row
    assert "- NVML library not found: 4 runs (ddp mb2, fsdp mb2, pp 1f1b+mb2, pp gpipe+mb2)" in text
    assert "- power telemetry is not implemented yet: 1 run (ps-sync mb2)" in text
    assert "Left out of the figure: ps-sync mb2 (parameter server: gradients and parameters go " \
           "to the shard servers over gRPC" in text
    # No run measured a peak: the ratio divides the compiler's bounds and says so.
    assert "| FSDP/DDP compiler bound on peak memory |" in text
    assert "| FSDP/DDP peak memory |" not in text


@pytest.mark.parametrize("vmax, labels", [
    (8.4 * 2 ** 20, ["0 B", "2 MiB", "4 MiB", "6 MiB", "8 MiB"]),
    (3.1 * 2 ** 30, ["0 B", "1 GiB", "2 GiB", "3 GiB"])])
def test_memory_ticks_sit_at_round_binary_values(vmax, labels):
    assert [plots._tick_bytes(t) for t in plots.byte_ticks(vmax)] == labels


def test_memory_figure_uses_them(monkeypatch, tmp_path):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    rs = [RunRecord(Path("a"), res("ddp", {"data": 8}, state=4 * 2 ** 20, bound=8 * 2 ** 20),
                    "a")]
    assert plots.plot_memory(rs, tmp_path / "memory.png")
    (ax,) = [a for a in drawn[0].axes if a.get_visible()]
    drawn[0].canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "1.91 MiB" not in labels and {"2 MiB", "4 MiB", "8 MiB"} <= set(labels)
