"""Report figures people can read: memory on a linear axis with each bar's value on
it, legends beside the axes, settings the runs do not share named in the title, and the
compare chart saying when its runs were simulated CPU devices."""

from pathlib import Path

import pytest

from analysis import compare, plots
from jaxdist.record import RunRecord


def run(name, layout, mesh, *, state, bound, steps=20, lr=0.001, simulated=True,
        backend="cpu"):
    return RunRecord(Path(name), {
        "layout": layout, "mesh": mesh, "model": {"name": "m"},
        "config": {"train": {"batch_size": 8, "lr": lr}, "loop": {"steps": steps},
                   "model": {}},
        "env": {"simulated": simulated, "backend": backend},
        "step_time_s": {"n": steps, "p50": 0.1},
        "memory": {"state_bytes_per_device": state, "compiled": {"peak_bytes": bound},
                   "measured_peak_bytes": None}}, name)


@pytest.fixture
def figures(monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    return drawn


def test_memory_bars_are_linear_with_values_and_legend_beside(figures, tmp_path):
    runs = [run("ddp", "ddp", {"data": 8}, state=4 * 2 ** 20, bound=6 * 2 ** 20),
            run("fsdp", "fsdp", {"fsdp": 8}, state=512 * 2 ** 10, bound=2 * 2 ** 20)]
    assert plots.plot_memory(runs, tmp_path / "memory.png")
    fig = figures[0]
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.texts] == ["4 MiB", "512 KiB", "6 MiB", "2 MiB"]
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [512 * 2 ** 10, 2 * 2 ** 20, 4 * 2 ** 20, 6 * 2 ** 20]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["train state (shards)", "compiler allocation bound"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(renderer).x0 >= \
        ax.get_window_extent(renderer).x1          # beside the axes, over no bar


def test_mixed_settings_are_named(figures, tmp_path):
    runs = [run("ddp", "ddp", {"data": 8}, state=1, bound=2, steps=4, lr=0.1),
            run("fsdp", "fsdp", {"fsdp": 8}, state=1, bound=2, steps=20)]
    assert plots.mixed_settings(runs) == "steps 4 / 20; lr 0.001 / 0.1"
    assert plots.mixed_settings(runs[:1]) == ""
    plots.plot_memory(runs, tmp_path / "memory.png")
    (ax,) = [a for a in figures[0].axes if a.get_visible()]
    assert ax.get_title() == ("m: memory per device (simulated)\n"
                              "mixes steps 4 / 20; lr 0.001 / 0.1")


def test_compare_chart_says_where_it_ran():
    sim = [run("a", "ddp", {"data": 2}, state=1, bound=1)]
    cpu = [run("b", "ddp", {"data": 2}, state=1, bound=1, simulated=False)]
    gpu = [run("c", "ddp", {"data": 2}, state=1, bound=1, simulated=False, backend="gpu")]
    assert compare.chart_where([{"runs": sim + cpu}]) == \
        "CPU, simulated devices: functional only, not a performance figure"
    assert compare.chart_where([{"runs": cpu}]) == "CPU"
    assert compare.chart_where([{"runs": gpu}]) == ""
