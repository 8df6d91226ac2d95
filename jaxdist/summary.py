"""The console summary of a run and its markdown copy (TensorBoard's `summary` text): one
row per figure, "n/a" with the reason where the run does not have it."""

from __future__ import annotations

from pathlib import Path

from jaxdist.record import RunRecord, mesh_spec


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def mesh_text(mesh: dict) -> str:
    """`stage=2 x data=2 x fsdp=1 x tensor=2 (--mesh data:2,stage:2,tensor:2)`: every axis,
    outer to inner, and the form `--mesh` takes back. The console's first line and the
    summary both say it so."""
    return " x ".join(f"{k}={v}" for k, v in mesh.items()) + f" (--mesh {mesh_spec(mesh)})"


def replicated_text(sharding: dict) -> str:
    """Replicated bytes and what they are. `replicated_leaves` counts non-scalar leaves
    only, while the bytes include scalars (step counters, replicated by design)."""
    size, leaves = sharding["replicated_bytes"], sharding["replicated_leaves"]
    if not size:
        return "nothing replicated"
    if not leaves:
        return f"{human_bytes(size)} (scalars only: step counters)"
    return f"{human_bytes(size)} ({leaves} non-scalar leaves, plus any scalar counters)"


def summary_rows(results: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the summary, read through RunRecord; a value the run does not
    have reads 'n/a'."""
    rec = RunRecord(Path(""), results)
    t, mem, thr = rec.block("step_time_s"), rec.block("memory"), rec.block("throughput")
    loss = rec.loss or []
    rows = [
        ("layout / mesh", f"{rec.layout}{dist_opt_text(results)} on "
                          f"{mesh_text(results.get('mesh') or {})}"),
        ("model", f"{rec.model_name} ({_num(rec.params, '{:,}')} params)"),
        ("devices", f"{_num(rec.devices, '{}')} x {rec.device_kind or 'n/a'} "
                    f"({rec.backend or 'n/a'}{', simulated' if rec.simulated else ''})"),
    ]
    if rec.status != "complete":
        rows.append(("status", rec.status))
    compile_s = results.get("compile_s")
    rows += [
        ("compile", _num(compile_s, "{:.2f} s") + (
            f" ({results['compile_note']})" if compile_s is None
            and results.get("compile_note") else "")),
        ("step time p50 / p90 / p99", " / ".join(_ms(rec.step_p(k)) for k in
                                                ("p50", "p90", "p99"))),
        ("step time mean ± ci95", _mean_line(t)),
        ("throughput", _num(rec.samples_per_s, "{:.1f} samples/s",
                            thr.get("reason") or t.get("reason")) + (
            f", {rec.tokens_per_s:.0f} tokens/s" if rec.tokens_per_s is not None else "")),
        ("MFU / HFU", _mfu_line(rec.block("mfu"))),
        ("state per device (shards)", human_bytes(rec.state_bytes) +
         _parts_text(mem.get("state_bytes_by_part"))),
        ("compiler bound per device",
         f"<= {human_bytes(rec.compiled_bound)} (argument + output - alias + temp: an "
         f"allocation upper bound, not a measured peak)" if rec.compiled_bound
         is not None else _num(None, "", mem.get("compiled_reason"))),
        ("measured peak per device", human_bytes(rec.measured_peak) if
         rec.measured_peak is not None else
         f"n/a ({mem.get('measured_peak_reason') or 'not measured'})"),
    ]
    shard = rec.block("sharding")
    if shard:
        rows.append(("state sharded / replicated (totals, all devices)",
                     f"{human_bytes(shard['sharded_bytes'])} / {replicated_text(shard)}"))
    pp = rec.block("pipeline")
    if pp:
        rows += [
            ("pipeline", f"{pp['schedule']}{' combined' * bool(pp.get('combined_f_back'))} "
                         f"S={pp['stages']} V={pp['virtual']} "
                         f"M={pp['microbatches']}: bubble {pp['bubble']:.1%} counted vs "
                         f"{pp['analytic_bubble']:.1%} {pp['analytic_bubble_formula']}"),
            ("pipeline stage bytes", f"{human_bytes(pp['stage_bytes']['total'])} sent per "
                                     f"step, a device of each stage summed (by stage: " +
                                     ", ".join(
                                         human_bytes(b) for b in pp['stage_bytes']['by_stage'])
             + f") vs analytic {human_bytes(pp['stage_bytes']['analytic'])}"),
            ("pipeline memory", f"params by stage " + ", ".join(
                human_bytes(b) for b in pp["memory"]["param_bytes_by_stage"]) +
             f"; activation stash {pp['live_activation_slots']} x "
             f"{human_bytes(pp['memory']['activation_bytes_per_microbatch'])}" +
             (f" (inputs), {pp['residual_slots']} micro-batches' backward stash"
              if pp.get("residual_slots") else "")),
        ]
    rows += [
        ("collectives per device/step", _comm_line(rec.block("comm"),
                                                   results.get("comm_reason"))),
        ("power / energy", _power_line(results.get("power"))),
        ("loss first -> last", f"{loss[0]:.4f} -> {loss[-1]:.4f}" if loss else "n/a"),
    ]
    if rec.final_accuracy is not None:
        last = results["accuracy"][-1]
        rows.append(("test accuracy", f"{last['accuracy']:.2%} at step {last['step']}"))
    return rows


def format_summary(results: dict) -> str:
    """The table printed at the end of a run."""
    rows = summary_rows(results)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def format_markdown(results: dict) -> str:
    """The same table for TensorBoard's Text tab."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    lines = ["| | |", "|---|---|"]
    lines += [f"| {cell(name)} | {cell(value)} |" for name, value in summary_rows(results)]
    return "\n".join(lines)


def dist_opt_text(p: dict) -> str:
    """' + distributed optimizer' where a run or plan has it and its layout is not defined
    by it (zero1 is ddp with it: its name says so; the layout registry's fact)."""
    if not p.get("distributed_optimizer"):
        return ""
    from sharding.registry import facts
    own = facts(p["layout"]).distributed_optimizer is True
    return "" if own else " + distributed optimizer"


def _parts_text(parts: dict | None) -> str:
    """' (params X, master Y, opt Z)': the exact shard bytes of each state part."""
    if not parts:
        return ""
    return " (" + ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items()
                            if k != "total" and v) + ")"


def _num(value, fmt: str, reason: str | None = None) -> str:
    """`value` formatted, else n/a with the record's reason when it gives one."""
    if value is None:
        return f"n/a ({reason})" if reason else "n/a"
    return fmt.format(value)


def _ms(seconds) -> str:
    return _num(None if seconds is None else seconds * 1e3, "{:.2f} ms")


def _mean_line(t: dict) -> str:
    if t.get("mean") is None:
        return f"n/a ({t['reason']})" if t.get("reason") else "n/a"
    ci = (f" ± {_ms(t['ci95'])}" if t.get("ci95") is not None
          else " ± n/a (one step: no interval)")
    note = f"; {t['profiled_note']}" if t.get("profiled_note") else ""
    return f"{_ms(t['mean'])}{ci} (n={t.get('n', 'n/a')}{note})"


def _mfu_line(mfu: dict) -> str:
    value, hfu = mfu.get("value"), mfu.get("hfu")
    if value is None and hfu is None:
        return f"n/a ({mfu.get('reason') or 'not computed'})"
    line = f"mfu {_num(value, '{:.1%}')}, hfu {_num(hfu, '{:.1%}')}"
    if mfu.get("peak_basis"):
        line += f" against the {mfu['peak_basis']} peak"
    return line + (f" ({mfu['reason']})" if mfu.get("reason") else "")


def _comm_line(block: dict | None, reason: str | None = None) -> str:
    if not block:
        return _num(None, "", reason)
    kinds = ", ".join(f"{k} {human_bytes(v['bytes'])}" for k, v in block["by_kind"].items())
    line = f"{kinds or 'none'}; ring estimate {human_bytes(int(block['total_ring_bytes']))}"
    if block.get("analytic_ring_bytes"):
        line += f" vs analytic {human_bytes(int(block['analytic_ring_bytes']))}"
    return line


def _power_line(power: dict | None) -> str:
    if not power or not power.get("available"):
        return f"n/a ({(power or {}).get('reason', 'not measured')})"
    line = (f"avg {_num(power.get('avg_w'), '{:.0f} W')}, "
            f"{_num(power.get('energy_per_step_j'), '{:.4g} J/step')}, "
            f"{_num(power.get('energy_per_sample_j'), '{:.4g} J/sample')}, "
            f"{_num(power.get('samples_per_s_per_mj'), '{:.4g} samples/(s*MJ)')}")
    if power.get("flags"):
        line += " [" + ", ".join(f["code"] for f in power["flags"]) + "]"
    return line
