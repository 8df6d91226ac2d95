"""The report's figures (one panel per model, bars labelled `layout @ mesh`) and compare's
JAX vs PyTorch throughput chart. matplotlib is imported when a figure is drawn, not before."""

from __future__ import annotations

import math
from pathlib import Path

from analysis.runs import layout_rank
from analysis.text import fmt_ratio, median

# Settings a figure may mix; named in its caption when its runs differ in them.
SETTINGS = (("steps", "loop", "steps"), ("warm-up", "loop", "warmup"), ("lr", "train", "lr"),
            ("batch", "train", "batch_size"), ("optimizer", "train", "optimizer"),
            ("dtype", "model", "dtype"), ("matmul precision", "model", "matmul_precision"),
            ("ps mode", "ps", "ps_mode"), ("dataset", "data", "dataset"))
LEGEND = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0),
          "borderaxespad": 0.0}   # beside the axes: never over a bar


def mixed_settings(runs) -> str:
    """`steps 4 / 20; lr 0.001 / 0.1` for the settings these runs do not share ('' if none).
    ps mode counts only among parameter-server runs (the others have none)."""
    parts = []
    for label, section, key in SETTINGS:
        rs = [r for r in runs if section != "ps" or r.out_of_process]
        values = {r.cfg(section, key) for r in rs} - {None}
        if len(values) > 1:   # numbers in order, then words
            ordered = sorted(values, key=lambda v: (isinstance(v, str), v if not isinstance(
                v, str) else 0, str(v)))
            parts.append(f"{label} {' / '.join(map(str, ordered))}")
    return "; ".join(parts)


def by_model(runs) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in runs:
        out.setdefault(r.model, []).append(r)
    return out


def bars(runs) -> list[str]:
    """The bar labels (`layout @ mesh`) of these runs: by layout, then device count."""
    order = {r.bar: (layout_rank(r.group), r.devices or 0) for r in runs}
    return sorted(order, key=lambda bar: (order[bar], bar))


def _figure(n_panels: int, n_groups: int = 6, height=3.6):
    import matplotlib.pyplot as plt

    width_per = max(5.0, 0.55 * n_groups) + 1.6   # room for the legend beside the axes
    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width_per * cols, height * rows),
                             squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _panels(runs):
    """(figure, [(axes, model, runs, bar labels)]) with one panel per model."""
    models = by_model(runs)
    fig, axes = _figure(len(models), max(len(bars(rs)) for rs in models.values()))
    return fig, [(ax, m, rs, bars(rs)) for ax, (m, rs) in zip(axes, models.items())]


def _title(ax, model: str, what: str, rs) -> None:
    sim = " (simulated)" if any(r.simulated for r in rs) else ""
    mixed = mixed_settings(rs)
    ax.set_title(f"{model}: {what}{sim}" + (f"\nmixes {mixed}" if mixed else ""), fontsize=9)


def _dress(ax, model: str, what: str, rs, ylabel: str, *, ticks=None, legend=False,
           grid="y") -> None:
    """What every panel has: bar labels (`ticks`: positions, labels), axis label, title with
    the mixed settings, the legend beside the axes, a light grid."""
    if ticks is not None:
        ax.set_xticks(list(ticks[0]), ticks[1], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    _title(ax, model, what, rs)
    if legend:
        ax.legend(**LEGEND)
    ax.grid(axis=grid, alpha=0.3)


def plot_step_times(runs, path: Path) -> bool:
    timed = [r for r in runs if r.step_times]
    if not timed:
        return False
    fig, panels = _panels(timed)
    for ax, model, rs, groups in panels:
        data = [[t * 1e3 for r in rs if r.bar == g for t in r.step_times] for g in groups]
        ax.boxplot(data, showfliers=True, widths=0.6)
        _dress(ax, model, "per-step latency", rs, "step time (ms)",
               ticks=(range(1, len(groups) + 1), groups))
    _save(fig, path)
    return True


def _tick_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B"


def byte_ticks(vmax: float, bins: int = 6) -> list[float]:
    """Tick positions at round numbers of the largest binary unit under `vmax` (0, 2, 4, 6,
    8 MiB), where matplotlib's decimal ticks read 1.91 / 3.81 / 5.72 MiB."""
    from matplotlib.ticker import MaxNLocator

    unit = next((u for u in (2 ** 30, 2 ** 20, 2 ** 10) if vmax >= u), 1)
    ticks = MaxNLocator(bins, steps=[1, 2, 2.5, 5, 10]).tick_values(0, vmax / unit)
    return [t * unit for t in ticks if 0 <= t * unit <= vmax * 1.0001]


MEMORY_SERIES = (("train state (shards)", lambda r: r.state_bytes),
                 ("compiler allocation bound", lambda r: r.compiled_bound),
                 ("measured peak", lambda r: r.measured_peak))


def plot_memory(runs, path: Path) -> bool:
    """Linear axis, each bar's value written on it: a small FSDP shard reads as small."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    fig, panels = _panels(runs)
    for ax, model, rs, groups in panels:
        series = [(label, get) for label, get in MEMORY_SERIES
                  if any(get(r) is not None for r in rs)]
        x = np.arange(len(groups))
        w = 0.8 / max(1, len(series))
        for i, (label, get) in enumerate(series):
            vals = [median(get(r) for r in rs if r.bar == g) for g in groups]
            drawn = ax.bar(x + (i - (len(series) - 1) / 2) * w, [v or 0 for v in vals], w,
                           label=label)
            ax.bar_label(drawn, labels=[_tick_bytes(v) if v is not None else "n/a"
                                        for v in vals], fontsize=6, rotation=90, padding=2)
        ax.margins(y=0.25)   # headroom for the value labels
        ax.set_yticks(byte_ticks(ax.get_ylim()[1]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick_bytes(v)))
        _dress(ax, model, "memory per device", rs, "bytes per device", ticks=(x, groups),
               legend=bool(series))
    _save(fig, path)
    return True


def plot_energy(runs, path: Path) -> bool:
    measured = [r for r in runs if r.energy_per_sample is not None]
    if not measured:
        return False
    fig, panels = _panels(measured)
    for ax, model, rs, groups in panels:
        vals = [median(r.energy_per_sample for r in rs if r.bar == g) for g in groups]
        drawn = ax.bar(range(len(groups)), vals)
        ax.bar_label(drawn, labels=[f"{v:.3g}" for v in vals], fontsize=7, padding=2)
        _dress(ax, model, "energy per sample", rs, "J per sample",
               ticks=(range(len(groups)), groups))
    _save(fig, path)
    return True


def plot_accuracy(runs, path: Path) -> bool:
    chosen = [r for r in runs if r.replicated and r.accuracy]
    if not chosen:
        return False
    fig, panels = _panels(chosen)
    for ax, model, rs, _ in panels:
        for r in sorted(rs, key=lambda r: (layout_rank(r.group), r.name)):
            ax.plot([p["wall_s"] for p in r.accuracy], [p["accuracy"] * 100 for p in r.accuracy],
                    marker="o", ms=3, label=f"{r.bar} ({r.name})" if len(rs) > 6 else r.bar)
        ax.set_xlabel("wall time since the first step (s)")
        _dress(ax, model, "accuracy vs time", rs, "test accuracy (%)", legend=True,
               grid="both")
    _save(fig, path)
    return True


def plot_comm(runs, path: Path) -> bool:
    import numpy as np

    with_comm = [r for r in runs if (r.results.get("comm") or {}).get("by_kind") is not None]
    if not with_comm:
        return False
    fig, panels = _panels(with_comm)
    for ax, model, rs, groups in panels:
        kinds = sorted({k for r in rs for k in r.results["comm"]["by_kind"]})
        bottom = np.zeros(len(groups))
        for kind in kinds:
            vals = np.array([median(r.results["comm"]["by_kind"].get(kind, {}).get("bytes", 0)
                                    for r in rs if r.bar == g) or 0
                             for g in groups], dtype=float) / 2 ** 20
            ax.bar(range(len(groups)), vals, bottom=bottom, label=kind)
            bottom += vals
        _dress(ax, model, "collectives by kind", rs, "MiB per step (per device)",
               ticks=(range(len(groups)), groups), legend=bool(kinds))
    _save(fig, path)
    return True


REPORT_FIGURES = (("step_times.png", plot_step_times), ("memory.png", plot_memory),
                  ("energy.png", plot_energy), ("accuracy.png", plot_accuracy),
                  ("comm.png", plot_comm))


def throughput_chart(path: Path, chart: list[dict], where: str = "") -> None:
    """compare's chart: samples/s of each matched JAX / PyTorch pair, JAX/PyTorch above.
    `where` (e.g. "CPU, simulated devices: ...") is the title's second line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.8 * len(chart) + 2) + 1.2, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if not chart:
        ax.text(0.5, 0.5, "no matched JAX / PyTorch pair", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=100)
        return
    xs = range(len(chart))
    w = 0.38
    jax_v = [c["jax"] for c in chart]
    pt_v = [c["pytorch"] for c in chart]
    ax.bar([x - w / 2 for x in xs], jax_v, w, label="JAX")
    ax.bar([x + w / 2 for x in xs], pt_v, w, label="PyTorch")
    for x, c in zip(xs, chart):
        ax.text(x, max(c["jax"], c["pytorch"]) * 1.02, fmt_ratio(c["ratio"]), ha="center",
                fontsize=9)
    ax.set_xticks(list(xs), [c["label"] for c in chart], fontsize=8)
    ax.set_ylabel("samples/s (median over runs)")
    ax.set_title("throughput, JAX vs PyTorch (label: JAX/PyTorch)" +
                 (f"\n{where}" if where else ""))
    ax.legend(**LEGEND)
    values = [v for v in jax_v + pt_v if v]
    if values and max(values) / min(values) > 20:  # models of very different cost
        ax.set_yscale("log")
        ax.set_ylabel("samples/s (median over runs, log scale)")
    else:
        ax.set_ylim(0, max(values or [1]) * 1.15)
    fig.savefig(path, dpi=100)
