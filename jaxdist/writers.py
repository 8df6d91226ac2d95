"""Run outputs: TensorBoard events (tensorboardX), results.json and the console summary."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams

from jaxdist.results import write_json



def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class RunWriter:
    """Everything a run writes under its directory."""

    def __init__(self, logdir: Path, config: dict):
        self.logdir = logdir
        self.tb = SummaryWriter(logdir=str(logdir), flush_secs=5)
        self.tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self._config = config

    def step(self, index: int, loss: float, step_s: float, timed: bool) -> None:
        self.tb.add_scalar("train/loss", loss, index)
        self.tb.add_scalar("train/step_time_s" if timed else "train/warmup_step_time_s",
                           step_s, index)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.tb.add_scalar(tag, value, step)

    def summary(self, results: dict) -> None:
        scalars = summary_scalars(results)
        for name, value in scalars.items():
            self.tb.add_scalar(name, value, 0)
        # The hparams plugin: one session whose metrics are the summary scalars above.
        flat = {f"{section}.{key}": _hparam_value(value)
                for section, fields in self._config.items() for key, value in fields.items()}
        file_writer = self.tb.file_writer
        for summary in hparams(flat, {name: scalars[name] for name in scalars}):
            file_writer.add_summary(summary)
        write_json(self.logdir / "results.json", results)

    def close(self) -> None:
        self.tb.close()


class NullWriter:
    """What processes other than 0 write: nothing."""

    def step(self, *args) -> None: ...
    def scalar(self, *args) -> None: ...
    def summary(self, *args) -> None: ...
    def close(self) -> None: ...


def _hparam_value(value):
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def summary_scalars(results: dict) -> dict[str, float]:
    t = results["step_time_s"]
    mem = results["memory"]
    out = {
        "summary/step_time_p50_s": t["p50"],
        "summary/step_time_p99_s": t["p99"],
        "summary/samples_per_s": results["throughput"]["samples_per_s"],
        "summary/state_bytes_per_device": mem["state_bytes_per_device"],
    }
    if results["compile_s"] is not None:
        out["summary/compile_s"] = results["compile_s"]
    if results["throughput"]["tokens_per_s"] is not None:
        out["summary/tokens_per_s"] = results["throughput"]["tokens_per_s"]
    if mem["compiled"]:
        out["summary/compiled_peak_bytes"] = mem["compiled"]["peak_bytes"]
    if mem["measured_peak_bytes"] is not None:
        out["summary/measured_peak_bytes"] = mem["measured_peak_bytes"]
    if results["mfu"]["value"] is not None:
        out["summary/mfu"] = results["mfu"]["value"]
    power = results.get("power") or {}
    if power.get("available"):
        out["summary/avg_power_w"] = power["avg_w"]
        out["summary/energy_per_sample_j"] = power["energy_per_sample_j"]
    for kind, row in results.get("comm", {}).get("by_kind", {}).items():
        out[f"comm/{kind}_bytes"] = row["bytes"]
    if "comm" in results:
        out["comm/total_ring_bytes"] = results["comm"]["total_ring_bytes"]
    return {k: float(v) for k, v in out.items()}


def format_summary(results: dict) -> str:
    """The table printed at the end of a run."""
    t = results["step_time_s"]
    mem = results["memory"]
    shard = results["sharding"]
    env = results["env"]
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    mib = human_bytes
    mfu = results["mfu"]
    rows = [
        ("layout / mesh", f"{results['layout']} on " +
         " x ".join(f"{k}={v}" for k, v in results["mesh"].items())),
        ("model", f"{results['model']['name']} ({results['model']['params']:,} params)"),
        ("devices", f"{env['num_devices']} x {env['device_kind']} ({env['backend']}"
                    f"{', simulated' if env['simulated'] else ''})"),
        ("compile", f"{results['compile_s']:.2f} s" if results["compile_s"] is not None
         else f"n/a ({results.get('compile_note') or 'not measured'})"),
        ("step time p50 / p90 / p99", f"{ms(t['p50'])} / {ms(t['p90'])} / {ms(t['p99'])}"),
        ("step time mean ± ci95", f"{ms(t['mean'])} ± {ms(t['ci95'] or 0.0)} (n={t['n']})"),
        ("throughput", f"{results['throughput']['samples_per_s']:.1f} samples/s" + (
            f", {results['throughput']['tokens_per_s']:.0f} tokens/s"
            if results["throughput"]["tokens_per_s"] is not None else "")),
        ("MFU", f"{mfu['value']:.1%}" if mfu["value"] is not None else f"n/a ({mfu['reason']})"),
        ("state per device (shards)", mib(mem["state_bytes_per_device"])),
        ("compiler peak per device", mib((mem["compiled"] or {}).get("peak_bytes"))),
        ("measured peak per device", mib(mem["measured_peak_bytes"]) if
         mem["measured_peak_bytes"] is not None else f"n/a ({mem['measured_peak_reason']})"),
        ("state sharded / replicated", f"{mib(shard['sharded_bytes'])} / "
                                       f"{mib(shard['replicated_bytes'])} "
                                       f"({shard['replicated_leaves']} replicated leaves)"),
        ("collectives per step", _comm_line(results.get("comm"))),
        ("power / energy", _power_line(results.get("power"))),
        ("loss first -> last", f"{results['loss'][0]:.4f} -> {results['loss'][-1]:.4f}"),
    ]
    if results.get("accuracy"):
        last = results["accuracy"][-1]
        rows.append(("test accuracy", f"{last['accuracy']:.2%} at step {last['step']}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _comm_line(block: dict | None) -> str:
    if not block:
        return "n/a"
    kinds = ", ".join(f"{k} {human_bytes(v['bytes'])}" for k, v in block["by_kind"].items())
    line = f"{kinds or 'none'}; ring estimate {human_bytes(int(block['total_ring_bytes']))}"
    if block.get("analytic_ring_bytes"):
        line += f" vs analytic {human_bytes(int(block['analytic_ring_bytes']))}"
    return line


def _power_line(power: dict | None) -> str:
    if not power or not power.get("available"):
        return f"n/a ({(power or {}).get('reason', 'not measured')})"
    line = (f"avg {power['avg_w']:.0f} W, {power['energy_per_sample_j']:.4g} J/sample, "
            f"{power['samples_per_s_per_mj']:.4g} samples/(s*MJ)")
    if power.get("flags"):
        line += " [" + ", ".join(f["code"] for f in power["flags"]) + "]"
    return line
