"""What the power telemetry writes besides its results.json block.

- `power/<metric>_<gpu>.csv`: one file per metric per GPU, rows `epoch_seconds,value`, no
  header: Go et al.'s artifact format and file names (gpu_power_0.csv, sm_clock_0.csv, ...),
  so their post-processing scripts read these folders unchanged. Rows are the window's
  samples plus one beyond each edge (see energy.window_slice).
- `power/window.png`: power, temperature and SM clock over the window, one line per GPU.
- TensorBoard scalars under `power/`: the time series with step = milliseconds since the
  window opened (walltime = the sample's time), and the window's summary figures at step 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# metric -> Go et al.'s file prefix (the last two are this project's additions)
CSV_NAMES = {"power_w": "gpu_power", "temp_gpu_c": "gpu_thermal", "temp_mem_c": "mem_thermal",
             "sm_clock_mhz": "sm_clock", "mem_clock_mhz": "mem_clock", "util_pct": "gpu_util",
             "used_bytes": "mem_used_bytes", "clock_event_reasons": "clock_event_reasons"}

TB_SERIES = {"power_w": "power_w", "temp_gpu_c": "temperature_c", "sm_clock_mhz": "sm_clock_mhz"}
TB_SUMMARY = ("energy_per_step_j", "energy_j", "avg_w", "peak_gpu_w", "samples_per_s_per_mj")


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(round(float(v), 6))


def write_csvs(folder: Path, series: dict[int, dict]) -> list[Path]:
    """series: gpu index -> arrays of the window (t and one array per metric)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for gpu, arr in series.items():
        for metric, prefix in CSV_NAMES.items():
            ok = np.isfinite(arr[metric])
            if not ok.any():
                continue  # unsupported on this GPU: no file rather than an empty one
            path = folder / f"{prefix}_{gpu}.csv"
            path.write_text("".join(f"{t:.6f},{_fmt(v)}\n"
                                    for t, v in zip(arr["t"][ok], arr[metric][ok])))
            written.append(path)
    return written


def write_plot(path: Path, series: dict[int, dict], start: float, end: float) -> Path:
    # The object API with the Agg canvas: no pyplot, so no global backend state to disturb.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    panels = (("power_w", "power (W)"), ("temp_gpu_c", "GPU temperature (°C)"),
              ("sm_clock_mhz", "SM clock (MHz)"))
    for ax, (metric, label) in zip(axes, panels):
        for gpu, arr in series.items():
            ok = np.isfinite(arr[metric])
            ax.plot(arr["t"][ok] - start, arr[metric][ok], label=f"GPU {gpu}", lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize="small", ncol=min(len(series), 4) or 1)
    axes[0].set_title(f"measurement window: {end - start:.3f} s")
    axes[-1].set_xlabel("seconds since the window opened")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def write_tensorboard(tb, series: dict[int, dict], start: float, result: dict) -> None:
    for gpu, arr in series.items():
        for metric, name in TB_SERIES.items():
            for t, v in zip(arr["t"], arr[metric]):
                if np.isfinite(v) and t >= start:
                    tb.add_scalar(f"power/gpu{gpu}/{name}", float(v),
                                  int(round((t - start) * 1000)), walltime=float(t))
        g = next((g for g in result["gpus"] if g["index"] == gpu), None)
        if g and g["energy_integral_j"] is not None:
            tb.add_scalar(f"power/gpu{gpu}/energy_integral_j", g["energy_integral_j"], 0)
    write_summary(tb, result)


def write_summary(tb, result: dict) -> None:
    """The window's figures at step 0 under `power/`; also for a run whose processes each
    wrote their own series (a PS run's workers, the PyTorch ranks: combine.combine)."""
    if not result.get("available"):
        return
    for key in TB_SUMMARY:
        if result.get(key) is not None:
            tb.add_scalar(f"power/{key}", float(result[key]), 0)
    tb.flush()
