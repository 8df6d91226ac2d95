"""JAX runs beside published records (analysis/baselines): the closest records per run, each
mismatch named, and a ratio only where the comparison means something (`compare --published`).
"""

from __future__ import annotations

from analysis.match import key as match_key
from analysis.text import GiB, fmt_ratio, ratio
from jaxdist.record import COMPILER_BOUND, RunRecord

# The published quantities that a per-GPU normalisation makes comparable across GPU counts:
# throughput per device. Step time, peak memory and MFU depend on the GPU count and kind.
PER_GPU_KINDS = ("tokens_per_dev", "samples_per_dev")


# jaxdist layout -> the published records' layout class (records normalise theirs the same way)
LAYOUT_CLASS = {"fsdp_tp": "fsdp+tp"}


def layout_classes(run: RunRecord) -> set[str]:
    """Record layouts a run can be set beside: its own class, and "single" on one device."""
    classes = {LAYOUT_CLASS.get(run.layout, run.layout)}
    if run.devices == 1:
        classes.add("single")
    return classes


def quantity(rec: dict):
    """(kind, scale to per-device value) for the record's metric, or None if no run
    quantity corresponds. Kinds: tokens_per_dev, samples_per_dev, step_s, peak_gib, mfu."""
    metric, unit = rec["metric"].lower(), rec["unit"].lower()
    n = rec.get("num_gpus")
    if metric.startswith("throughput") and "bucket" not in metric:
        kind = "tokens_per_dev" if unit.startswith("tokens") else "samples_per_dev"
        per_gpu = "/gpu" in unit or "per gpu" in unit or (metric.startswith("throughput_per_gpu"))
        if per_gpu:
            return kind, 1.0
        return (kind, 1.0 / n) if n else None
    if metric.startswith("step_latency"):
        return {"s/iter": ("step_s", 1.0), "s": ("step_s", 1.0), "ms": ("step_s", 1e-3)}.get(unit)
    if metric == "peak_memory_per_gpu" and unit == "gib":
        return "peak_gib", 1.0
    if metric == "mfu":
        return {"fraction": ("mfu", 1.0), "%": ("mfu", 0.01)}.get(unit)
    return None


def ours(run: RunRecord, kind: str):
    """(value, why not) of the run quantity `kind`."""
    r, n = run.results, run.devices
    if kind == "tokens_per_dev":
        t = r["throughput"]["tokens_per_s"]
        return (t / n, None) if t else (None, "not a token model")
    if kind == "samples_per_dev":
        return r["throughput"]["samples_per_s"] / n, None
    if kind == "step_s":
        return r["step_time_s"]["p50"], None
    if kind == "peak_gib":
        peak = run.peak
        return (peak / GiB, None) if peak is not None else (None, run.peak_basis)
    if kind == "mfu":
        m = r["mfu"]
        return (m["value"], None) if m.get("value") is not None else (None, m.get("reason"))
    raise ValueError(kind)


def bound_not_measured(run: RunRecord, kind: str) -> str | None:
    """COMPILER_BOUND where our peak is the compiler's bound set beside a published measured
    peak (an upper bound, so the table must say it is not a measurement), else None."""
    return COMPILER_BOUND if kind == "peak_gib" and run.peak_basis == COMPILER_BOUND else None


def record_mismatches(run: RunRecord, rec: dict) -> tuple[list[str], list[str]]:
    """(mismatches that make it not comparable, hardware mismatches a per-GPU
    normalisation can absorb)."""
    hard, hw = [], []
    if rec.get("jaxdist_model") != run.model_name:
        hard.append(f"model {rec['model']} vs {run.model}")
    if rec["layout"] not in layout_classes(run):
        hard.append(f"layout {rec['layout']} vs {run.layout}")
    local = run.batch // run.devices
    if rec.get("local_batch") != local:
        hard.append(f"batch {rec.get('local_batch') or 'not stated'} vs {local} per device")
    tokens = run.results["model"]["tokens_per_sample"]
    if (rec.get("seq_len") or tokens) and rec.get("seq_len") != (tokens or None):
        hard.append(f"sequence {rec.get('seq_len') or 'not stated'} vs {tokens or 'none'}")
    image = _image_size(run)
    if (rec.get("image_size") or image) and rec.get("image_size") != image:
        hard.append(f"image {rec.get('image_size') or 'not stated'} vs {image or 'none'} px")
    ours_precision = run.precision_class()
    if rec.get("dtype") != ours_precision:
        shown = (f"tf32 (float32 at matmul precision {run.matmul_precision})"
                 if ours_precision != run.dtype else ours_precision)
        hard.append(f"precision {rec.get('dtype') or rec.get('precision') or 'not stated'} "
                    f"vs {shown}")
    cap = f" {rec['power_cap_w']:g} W cap" if rec.get("power_cap_w") else ""
    kind = run.device_kind
    theirs = rec.get("device") or rec["hardware"]
    if run.backend == "cpu":
        hw.append(f"hardware {theirs}{cap} vs CPU" +
                  (" (simulated devices)" if run.simulated else ""))
    elif not rec.get("device") or rec["device"].upper() not in kind.upper():
        hw.append(f"hardware {theirs}{cap} vs {kind}")
    elif cap:
        hw.append(f"power cap{cap} vs ours (not capped by jaxdist)")
    if rec.get("num_gpus") != run.devices:
        hw.append(f"GPUs {rec.get('num_gpus') or 'not stated'} vs {run.devices}")
    return hard, hw


def _image_size(run: RunRecord):
    """The input image size of an image-model run, as its results.json records it (runs
    written before `model.image_size` existed say nothing: None, never a guess)."""
    return run.results["model"].get("image_size")


def published_section(runs: list[RunRecord], records: list[dict], top: int):
    lines = ["## JAX vs published figures", "",
             "Published records of each JAX run's model (fewest mismatches first; a run "
             "with none reads \"no comparable record\": records of other models are never "
             "lined up). A ratio is shown only when model, layout, per-device batch, "
             "sequence/image size and precision (float32 at matmul precision default/high "
             "on an Ampere or newer GPU counts as tf32) all match; when only the hardware or GPU count differs, a "
             "throughput per device becomes a per-GPU normalised ratio, labelled so; "
             "otherwise \"not comparable\" with every mismatch named. A run on CPU devices is "
             "never set against a GPU figure. Where our peak memory is the compiler's "
             f"allocation bound it says \"{COMPILER_BOUND}\" (published peaks are "
             "measured).", "",
             "| JAX run | record | source | metric | published | ours | verdict | mismatches |"
             " their read-out |", "|---|---|---|---|---|---|---|---|---|"]
    rows, shown = [], 0
    jax_groups: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        if r.framework == "jax":
            jax_groups.setdefault(match_key(r), []).append(r)
    for key in sorted(jax_groups, key=str):
        run = jax_groups[key][0]
        scored, unlike = [], 0
        for rec in records:
            q = quantity(rec)
            if q is None or rec["layout"] not in layout_classes(run) or rec.get("value") is None:
                continue
            if rec.get("jaxdist_model") != run.model_name:
                unlike += 1
                continue
            hard, hw = record_mismatches(run, rec)
            measurable = ours(run, q[0])[0] is not None  # what we can set beside it first
            scored.append((len(hard) + len(hw) + (0 if measurable else 1),
                           rec["id"], rec, q, hard, hw))
        scored.sort(key=lambda s: (s[0], s[1]))
        label = f"{run.model} {run.layout} x{run.devices} b{run.batch} ({run.name})"
        if not scored:
            why = (f"{unlike} {run.layout} record(s), none of model {run.model}" if unlike
                   else f"no published record for layout {run.layout}")
            lines.append(f"| {label} | no comparable record ({why}) | | | | | | | |")
            continue
        for _, rid, rec, (kind, scale), hard, hw in scored[:top]:
            theirs = rec["value"] * scale
            mine, why = ours(run, kind)
            verdict = published_verdict(run, rec, kind, mine, theirs, why, hard, hw)
            src = rec["source"]
            where = (f"{src['repo']}@{src['commit'][:8]} {src.get('path') or ''}".strip()
                     if src.get("repo") and src.get("commit") else src.get("url") or src["title"])
            if src.get("locator"):
                where += f", {src['locator']}"
            bound = bound_not_measured(run, kind)
            shown_ours = _fmt_ours(kind, mine) + (f" ({bound})" if bound and mine else "")
            lines.append(f"| {label} | {rid} | {where} | {rec['metric']} | {rec['value']:g} "
                         f"{rec['unit']} | {shown_ours} | {verdict} | "
                         f"{'; '.join(hard + hw) or 'none'} | {rec['readout']} |")
            rows.append({"section": "published", "model": run.model, "layout": run.layout,
                         "devices": run.devices, "batch": run.batch, "dtype": run.dtype,
                         "framework": "JAX", "record": rid, "metric": rec["metric"],
                         "published": rec["value"], "unit": rec["unit"], "ours": mine,
                         "ours_basis": bound or ("measured" if kind == "peak_gib" else None),
                         "verdict": verdict, "mismatches": "; ".join(hard + hw)})
            shown += 1
        if len(scored) > top:
            lines.append(f"| {label} | ({len(scored) - top} more {run.model} {run.layout} "
                         f"records, all with at least as many mismatches; --top to list "
                         f"them) | | | | | | | |")
    return (lines + [""] if shown or len(lines) > 6 else []), rows, shown


def published_verdict(run: RunRecord, rec: dict, kind: str, mine, theirs, why, hard, hw) -> str:
    """A ratio only where it means something: never a CPU run against a (GPU) figure; a
    per-GPU normalised ratio only for throughput per device; a plain ratio only when nothing
    the comparison depends on differs."""
    if run.backend == "cpu":
        what = "simulated CPU devices" if run.simulated else "CPU"
        return f"not comparable ({what} vs {rec.get('device') or rec['hardware']})"
    if mine is None:
        return f"n/a: ours not measured ({why})"
    bound = bound_not_measured(run, kind)
    if hard or (hw and kind not in PER_GPU_KINDS):
        return f"not comparable (ours: {bound})" if bound else "not comparable"
    x = ratio(mine, theirs)
    if bound:
        return f"ours is the {bound}: ratio {fmt_ratio(x)} is an upper bound"
    return f"per-GPU normalised ratio {fmt_ratio(x)}" if hw else f"comparable: ratio {fmt_ratio(x)}"


def _fmt_ours(kind, v):
    if v is None:
        return "n/a"
    return {"tokens_per_dev": f"{v:,.0f} tokens/s/device",
            "samples_per_dev": f"{v:,.1f} samples/s/device",
            "step_s": f"{v * 1e3:.1f} ms", "peak_gib": f"{v:.3f} GiB",
            "mfu": f"{v:.1%}"}[kind]
