"""Side-by-side tables: `python -m experiments.compare RUNS... [--published] [--out DIR]`.

RUNS are run directories (holding results.json) or folders containing them, from
`experiments.run` (JAX) and `experiments.torch_run` (PyTorch). Three tables, never a silent
line-up of mismatched numbers:

1. JAX vs live PyTorch: runs matched on (model, layout/strategy, devices, global batch,
   dtype, matmul precision, optimizer, backend); step p50/p99, samples/s, peak memory and
   train state per device, energy per sample where measured, and JAX/PyTorch ratios. Runs with no
   counterpart are listed with the closest candidate and every field that differs.
2. Ovi 2025's claims as ratios (FSDP vs DDP memory and throughput; async vs sync parameter
   server time and accuracy), when the runs needed are present.
3. With --published: for each JAX run, the closest published records (experiments/baselines)
   with each mismatch named and the verdict "not comparable", a per-GPU normalised
   throughput ratio, or a ratio when everything the comparison depends on matches. A run on
   CPU devices (simulated or not) is never set against a GPU figure.

Writes compare.md, compare.csv and compare.png under --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jaxdist.errors import OneLineParser, UsageError
from jaxdist.results import check

GiB = 2 ** 30
# The fields a JAX run and a PyTorch run must share to be compared, with their labels.
MATCH_FIELDS = (("model", "model"), ("layout", "layout"), ("devices", "devices"),
                ("batch", "global batch"), ("dtype", "dtype"),
                ("matmul_precision", "matmul precision"), ("optimizer", "optimizer"),
                ("backend", "backend"), ("device_kind", "device"),
                ("step_options", "step options"))


PYTORCH_UNRECORDED = "not recorded (PyTorch's default: float32 matmuls, TF32 convolutions)"
# GPUs without TF32 tensor cores: float32 stays float32 at every precision.
PRE_AMPERE = ("V100", "T4", "P100", "P40", "K80")
# The published quantities that a per-GPU normalisation makes comparable across GPU counts:
# throughput per device. Step time, peak memory and MFU depend on the GPU count and kind.
PER_GPU_KINDS = ("tokens_per_dev", "samples_per_dev")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.compare",
                      description="Compare JAX runs with live PyTorch runs (experiments."
                                  "torch_run) and, with --published, with published figures.")
    p.add_argument("runs", nargs="+", metavar="RUNS",
                   help="run directories (with results.json) or folders containing them")
    p.add_argument("--published", action="store_true",
                   help="also compare JAX runs with published records (experiments/baselines)")
    p.add_argument("--baselines", action="append", default=[], metavar="PATH",
                   help="extra baseline records: a .json/.toml file or a folder of them "
                        "(repeatable); implies --published")
    p.add_argument("--top", type=int, default=3,
                   help="published records shown per JAX run, closest first (default: 3)")
    p.add_argument("--out", default="", help="folder for compare.md, compare.csv and "
                   "compare.png (default: runs/compare-<time>)")
    return p


# ---------------------------------------------------------------------------- runs

@dataclass
class Run:
    path: Path
    results: dict
    framework: str = field(init=False)

    def __post_init__(self):
        self.framework = "pytorch" if self.results.get("framework") == "pytorch" else "jax"

    # -- what runs are matched on
    @property
    def model(self) -> str:
        opts = self.cfg("model", "model_opts")
        return self.results["model"]["name"] + (f"[{opts}]" if opts else "")

    @property
    def layout(self) -> str:
        return self.results["layout"]

    @property
    def devices(self) -> int:
        return self.results["env"]["num_devices"]

    @property
    def batch(self) -> int:
        return self.cfg("train", "batch_size")

    @property
    def dtype(self) -> str:
        return self.cfg("model", "dtype")

    @property
    def matmul_precision(self) -> str:
        """--matmul-precision. Runs made before it was recorded ran at their framework's
        default: XLA's (what "default" selects) for JAX; PyTorch's own (float32 matmuls, TF32
        convolutions), which no value of the flag reproduces, for PyTorch."""
        recorded = self.cfg("model", "matmul_precision")
        if recorded:
            return recorded
        return "default" if self.framework == "jax" else PYTORCH_UNRECORDED

    def precision_class(self) -> str:
        """The arithmetic of float32 matmuls as published records name it: float32 compute at
        default/high precision on an Ampere or newer GPU is TF32."""
        if (self.dtype == "float32" and self.backend == "gpu" and
                self.matmul_precision in ("default", "high") and
                not any(old in self.results["env"]["device_kind"].upper()
                        for old in PRE_AMPERE)):
            return "tf32"
        return self.dtype

    @property
    def optimizer(self) -> str:
        return self.cfg("train", "optimizer")

    @property
    def backend(self) -> str:
        b = self.results["env"]["backend"]
        return "gpu" if b in ("gpu", "cuda") else b

    @property
    def device_kind(self) -> str:
        # On CPU the JAX and PyTorch names differ and say nothing: match "cpu" to "cpu".
        return "cpu" if self.backend == "cpu" else self.results["env"]["device_kind"]

    @property
    def step_options(self) -> str:
        # PyTorch runs have neither: a JAX run with accumulation or remat has no twin.
        return (f"microbatches {self.cfg('train', 'microbatches', 1)}, "
                f"remat {self.cfg('train', 'remat', 'none')}")

    def key(self) -> tuple:
        return tuple(getattr(self, name) for name, _ in MATCH_FIELDS)

    def cfg(self, section: str, name: str, default=None):
        return self.results.get("config", {}).get(section, {}).get(name, default)

    # -- what is reported
    @property
    def label(self) -> str:
        return self.path.name

    def where(self) -> str:
        env = self.results["env"]
        if self.framework == "pytorch":
            t = self.results.get("torch", {})
            threads = t.get("threads_per_process", env.get("threads_per_process"))
            how = f"{env['num_processes']} processes ({t.get('backend', '?')}"
            return how + (f", {threads} thread(s) each)" if self.backend == "cpu" else ")")
        if env.get("simulated"):
            return f"{env['num_devices']} simulated CPU devices in {env['num_processes']} " \
                   f"process(es)"
        return f"{env['num_devices']} x {env['device_kind']}"

    def peak(self) -> tuple[float | None, str]:
        """(peak bytes per device, what it is)."""
        mem = self.results["memory"]
        if mem.get("measured_peak_bytes") is not None:
            return float(mem["measured_peak_bytes"]), "measured"
        if mem.get("compiled"):
            return float(mem["compiled"]["peak_bytes"]), "compiler estimate"
        return None, mem.get("measured_peak_reason") or "not measured"

    def energy_per_sample(self) -> float | None:
        power = self.results.get("power") or {}
        return power.get("energy_per_sample_j") if power.get("available") else None

    def protocol(self) -> str:
        return f"{self.cfg('loop', 'warmup')} warm-up + {self.cfg('loop', 'steps')} timed"


def find_runs(paths) -> list[Run]:
    runs = []
    for item in paths:
        path = Path(item)
        if not path.exists():
            raise UsageError(f"{path}: no such run directory")
        files = [path] if path.is_file() else (
            [path / "results.json"] if (path / "results.json").exists()
            else sorted(path.rglob("results.json")))
        if not files:
            raise UsageError(f"{path}: no results.json in it or below it")
        for f in files:
            try:
                results = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UsageError(f"{f}: not JSON ({e})") from None
            problems = check(results) if isinstance(results, dict) else ["not an object"]
            if problems:
                raise UsageError(f"{f}: not a jaxdist results.json ({problems[0]})")
            runs.append(Run(f.parent, results))
    unique = {r.path.resolve(): r for r in runs}
    return list(unique.values())


def group(runs: list[Run]) -> dict[tuple, dict[str, list[Run]]]:
    groups: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        groups.setdefault(r.key(), {"jax": [], "pytorch": []})[r.framework].append(r)
    return groups


def mismatches(a: Run, b: Run) -> list[str]:
    out = []
    for name, label in MATCH_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x != y and not (name == "device_kind" and a.backend != b.backend):
            out.append(f"{label} {x} vs {y}")
    return out


def closest(run: Run, others: list[Run]) -> tuple[Run | None, list[str]]:
    if not others:
        return None, []
    best = min(others, key=lambda o: (len(mismatches(run, o)), str(o.path)))
    return best, mismatches(run, best)


# ---------------------------------------------------------------------------- stats

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass
class Side:
    """One framework's runs of one key, summarised (median over repeated runs)."""
    runs: list[Run]

    @property
    def n(self):
        return len(self.runs)

    def value(self, metric: str):
        get = {
            "p50": lambda r: r.results["step_time_s"]["p50"],
            "p99": lambda r: r.results["step_time_s"]["p99"],
            "samples_per_s": lambda r: r.results["throughput"]["samples_per_s"],
            "peak": lambda r: r.peak()[0],
            "state": lambda r: r.results["memory"]["state_bytes_per_device"],
            "energy": lambda r: r.energy_per_sample(),
            "loss0": lambda r: r.results["loss"][0] if r.results["loss"] else None,
        }[metric]
        return med(get(r) for r in self.runs)

    def peak_kind(self) -> str:
        kinds = {r.peak()[1] for r in self.runs}
        return kinds.pop() if len(kinds) == 1 else "mixed"


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def fmt_ms(s):
    return f"{s * 1e3:.1f}" if s is not None else "n/a"


def fmt_bytes(b):
    if b is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_ratio(x):
    return f"{x:.2f}x" if x is not None else "n/a"


def fmt_num(x, digits=1):
    return f"{x:,.{digits}f}" if x is not None else "n/a"


# ---------------------------------------------------------------------------- live table

def live_section(groups) -> tuple[list[str], list[dict], list[dict]]:
    """(markdown lines, csv rows, chart rows)."""
    lines = ["## JAX vs PyTorch (live, same machine)", "",
             "Matched on model, layout, devices, global batch, dtype, matmul precision, "
             "optimizer and backend. "
             "Times are medians over the runs of each side; ratios are JAX / PyTorch "
             "(throughput > 1: JAX faster; time and memory < 1: JAX smaller).", "",
             "| model | layout | devices | batch | dtype | framework | runs | step p50 (ms) | "
             "step p99 (ms) | samples/s | peak mem / device | state / device | "
             "energy / sample |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows, chart, notes = [], [], []
    matched = 0
    for key in sorted(groups, key=str):
        sides = groups[key]
        if not (sides["jax"] and sides["pytorch"]):
            continue
        matched += 1
        model, layout, devices, batch, dtype = key[:5]
        jax_s, pt_s = Side(sides["jax"]), Side(sides["pytorch"])
        head = f"| {model} | {layout} | {devices} | {batch} | {dtype} "
        for name, side in (("JAX", jax_s), ("PyTorch", pt_s)):
            peak = side.value("peak")
            peak_text = fmt_bytes(peak) + (f" ({side.peak_kind()})" if peak is not None
                                           else f" ({_short(side.peak_kind())})")
            energy = side.value("energy")
            lines.append(head + f"| {name} | {side.n} | {fmt_ms(side.value('p50'))} | "
                         f"{fmt_ms(side.value('p99'))} | {fmt_num(side.value('samples_per_s'))}"
                         f" | {peak_text} | {fmt_bytes(side.value('state'))} | "
                         f"{f'{energy:.3g} J' if energy is not None else 'not measured'} |")
            rows.append({"section": "live", "model": model, "layout": layout,
                         "devices": devices, "batch": batch, "dtype": dtype,
                         "framework": name, "runs": side.n,
                         "step_p50_s": side.value("p50"), "step_p99_s": side.value("p99"),
                         "samples_per_s": side.value("samples_per_s"),
                         "peak_bytes_per_device": peak, "peak_kind": side.peak_kind(),
                         "state_bytes_per_device": side.value("state"),
                         "energy_per_sample_j": energy})
        r = {m: ratio(jax_s.value(m), pt_s.value(m))
             for m in ("p50", "p99", "samples_per_s", "peak", "state", "energy")}
        peak_note = "" if jax_s.peak_kind() == pt_s.peak_kind() or r["peak"] is None \
            else " (different definitions)"
        lines.append(head + f"| **JAX/PyTorch** | | **{fmt_ratio(r['p50'])}** | "
                     f"{fmt_ratio(r['p99'])} | **{fmt_ratio(r['samples_per_s'])}** | "
                     f"{fmt_ratio(r['peak'])}{peak_note} | {fmt_ratio(r['state'])} | "
                     f"{fmt_ratio(r['energy'])} |")
        rows.append({"section": "live", "model": model, "layout": layout, "devices": devices,
                     "batch": batch, "dtype": dtype, "framework": "JAX/PyTorch",
                     "step_p50_s": r["p50"], "step_p99_s": r["p99"],
                     "samples_per_s": r["samples_per_s"], "peak_bytes_per_device": r["peak"],
                     "state_bytes_per_device": r["state"], "energy_per_sample_j": r["energy"]})
        chart.append({"label": f"{model}\n{layout} x{devices}, b{batch}",
                      "jax": jax_s.value("samples_per_s"),
                      "pytorch": pt_s.value("samples_per_s"), "ratio": r["samples_per_s"]})
        j, p = jax_s.runs[0], pt_s.runs[0]
        extra = []
        if j.protocol() != p.protocol():
            extra.append(f"protocol differs: JAX {j.protocol()}, PyTorch {p.protocol()}")
        l0j, l0p = jax_s.value("loss0"), pt_s.value("loss0")
        if l0j is not None and l0p is not None:
            extra.append(f"first loss JAX {l0j:.4f}, PyTorch {l0p:.4f}")
        notes.append(f"- {model} {layout} x{devices}, matmul precision "
                     f"{j.matmul_precision}: JAX on {j.where()}; PyTorch on "
                     f"{p.where()}" + ("; " + "; ".join(extra) if extra else "") + ".")
    if not matched:
        lines.append("| (no JAX run matches a PyTorch run) | | | | | | | | | | | | |")
    return lines + [""] + notes, rows, chart


def _short(reason: str) -> str:
    return "n/a on CPU" if "CPU" in reason or "cpu" in reason else reason[:40]


def unmatched_section(runs: list[Run], groups) -> list[str]:
    lines = []
    for key in sorted(groups, key=str):
        sides = groups[key]
        if sides["jax"] and sides["pytorch"]:
            continue
        for fw, other_fw in (("jax", "pytorch"), ("pytorch", "jax")):
            for run in sides[fw]:
                others = [r for r in runs if r.framework == other_fw]
                best, diff = closest(run, others)
                name = "JAX" if fw == "jax" else "PyTorch"
                other_name = "PyTorch" if fw == "jax" else "JAX"
                what = (f"{name} {run.model} {run.layout} x{run.devices} batch {run.batch} "
                        f"{run.dtype} ({run.path})")
                if best is None:
                    lines.append(f"- {what}: not comparable: no {other_name} run was given")
                else:
                    lines.append(f"- {what}: not comparable: the closest {other_name} run "
                                 f"({best.path}) differs: {'; '.join(diff)}")
    if lines:
        lines = ["## Runs without a counterpart (not compared)", ""] + lines + [""]
    return lines


# ---------------------------------------------------------------------------- Ovi claims

def ovi_section(runs: list[Run], records: dict) -> tuple[list[str], list[dict]]:
    lines, rows = [], []
    by_key: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        key = (r.framework, r.model, r.devices, r.batch, r.dtype, r.optimizer, r.backend,
               r.matmul_precision, r.cfg("data", "dataset"))
        by_key.setdefault(key, {}).setdefault(r.layout, []).append(r)

    def claim(rid, fallback):
        rec = records.get(rid)
        return rec["value_text"] if rec and rec.get("value_text") else fallback

    table = []
    for key, layouts in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        if "ddp" not in layouts or "fsdp" not in layouts:
            continue
        ddp, fsdp = Side(layouts["ddp"]), Side(layouts["fsdp"])
        fw, model, devices = key[:3]
        basis = "peak" if ddp.value("peak") is not None and fsdp.value("peak") is not None \
            and ddp.peak_kind() == fsdp.peak_kind() else "state"
        mem = ratio(ddp.value(basis), fsdp.value(basis))
        basis_text = f"{ddp.peak_kind()} peak" if basis == "peak" else "train state"
        thr = ratio(ddp.value("samples_per_s"), fsdp.value("samples_per_s"))
        reduction = (1 - 1 / mem) * 100 if mem else None
        table.append(
            f"| {'JAX' if fw == 'jax' else 'PyTorch'} | {model} | {devices} | "
            f"{fmt_ratio(mem)} ({basis_text}; {fmt_num(reduction, 0)}% less) | "
            f"{_verdict(mem, 4, 6)} | {_verdict(reduction, 60, None)} | {fmt_ratio(thr)} | "
            f"{_verdict(thr, 2, 3)} | {fmt_ratio(ratio(1, thr) if thr else None)} | "
            f"{_verdict(ratio(1, thr) if thr else None, None, 6)} |")
        rows.append({"section": "ovi", "framework": fw, "model": model, "devices": devices,
                     "layout": "fsdp vs ddp", "ddp_over_fsdp_memory": mem,
                     "memory_basis": basis_text, "ddp_over_fsdp_throughput": thr})
    if table:
        lines += ["## Ovi 2025 claims as ratios (FSDP vs DDP)", "",
                  f"Claims: v2 (ovi-v2-fsdp-mem) FSDP {claim('ovi-v2-fsdp-mem', '4-6')}x lower "
                  f"peak memory; v1 (ovi-v1-fsdp-mem) >{60}% less memory; v2 "
                  f"(ovi-v2-ddp-speedup) DDP {claim('ovi-v2-ddp-speedup', '2-3')}x throughput; "
                  f"v1 (ovi-v1-fsdp-time) FSDP up to 6x longer. Published on A100/A10G GPU "
                  f"clusters for CNNs at batch sizes not stated: these are shape checks, not "
                  f"like-for-like numbers.", "",
                  "| framework | model | devices | memory DDP/FSDP | v2: 4-6x | v1: >60% | "
                  "throughput DDP/FSDP | v2: 2-3x | time FSDP/DDP | v1: up to 6x |",
                  "|---|---|---|---|---|---|---|---|---|---|", *table, ""]

    ps_lines = []
    ps_groups: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        if r.layout == "ps":
            key = (r.model, r.devices, r.batch, r.dtype, r.optimizer)
            ps_groups.setdefault(key, {}).setdefault(r.cfg("ps", "ps_mode", "sync"), []).append(r)
    for key, modes in sorted(ps_groups.items(), key=lambda kv: str(kv[0])):
        if "sync" not in modes or "async" not in modes:
            continue
        sync_t = med(_train_time(r) for r in modes["sync"])
        async_t = med(_train_time(r) for r in modes["async"])
        cut = (1 - async_t / sync_t) * 100 if sync_t and async_t else None
        acc = {m: med(_final_acc(r) for r in modes[m]) for m in ("sync", "async")}
        penalty = (acc["sync"] - acc["async"]) * 100 \
            if acc["sync"] is not None and acc["async"] is not None else None
        ps_lines.append(f"| {key[0]} | {key[1]} | {fmt_num(cut)}% | {_verdict(cut, None, 28)} | "
                        f"{fmt_num(penalty)} points | {_verdict(penalty, 4, 17)} |")
        rows.append({"section": "ovi-ps", "model": key[0], "devices": key[1],
                     "async_time_reduction_pct": cut, "async_accuracy_penalty_points": penalty})
    if ps_lines:
        lines += ["## Ovi 2025 claims: asynchronous vs synchronous parameter server", "",
                  "Claims (v2): async up to 28% less training time (ovi-v2-asyncps-time); "
                  "4-17% accuracy penalty (ovi-v2-asyncps-acc; absolute vs relative not "
                  "stated, read here as percentage points).", "",
                  "| model | workers | time saved by async | v2: up to 28% | accuracy penalty "
                  "| v2: 4-17 |", "|---|---|---|---|---|---|", *ps_lines, ""]
    return lines, rows


def _train_time(r: Run):
    w = r.results.get("window") or {}
    if w.get("start_unix_s") and w.get("end_unix_s"):
        return w["end_unix_s"] - w["start_unix_s"]
    t = r.results["step_time_s"]
    return t["mean"] * t["n"]


def _final_acc(r: Run):
    acc = r.results.get("accuracy") or []
    return acc[-1]["accuracy"] if acc else None


def _verdict(x, lo, hi) -> str:
    if x is None:
        return "n/a"
    if lo is not None and x < lo:
        return "below"
    if hi is not None and x > hi:
        return "above"
    return "within"


# ---------------------------------------------------------------------------- published

FAMILY_WORDS = {"gpt": ("llama", "gpt", "t5", "transformer", "mixtral"),
                "llama": ("llama",), "moe": ("mixtral", "moe"),
                "resnet": ("resnet",), "mlp": ("mlp",), "vgg": ("vgg",),
                "densenet": ("densenet",), "efficientnet": ("efficientnet",),
                "convnext": ("convnext",)}
# jaxdist layout -> the published records' layout class (records normalise theirs the same way)
LAYOUT_CLASS = {"fsdp_tp": "fsdp+tp"}


def layout_classes(run: "Run") -> set[str]:
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


def ours(run: Run, kind: str):
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
        peak, what = run.peak()
        return (peak / GiB, None) if peak is not None else (None, what)
    if kind == "mfu":
        m = r["mfu"]
        return (m["value"], None) if m.get("value") is not None else (None, m.get("reason"))
    raise ValueError(kind)


def record_mismatches(run: Run, rec: dict) -> tuple[list[str], list[str]]:
    """(mismatches that make it not comparable, hardware mismatches a per-GPU
    normalisation can absorb)."""
    hard, hw = [], []
    if rec.get("jaxdist_model") != run.results["model"]["name"]:
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
    kind = run.results["env"]["device_kind"]
    theirs = rec.get("device") or rec["hardware"]
    if run.backend == "cpu":
        hw.append(f"hardware {theirs}{cap} vs CPU" +
                  (" (simulated devices)" if run.results["env"].get("simulated") else ""))
    elif not rec.get("device") or rec["device"].upper() not in kind.upper():
        hw.append(f"hardware {theirs}{cap} vs {kind}")
    elif cap:
        hw.append(f"power cap{cap} vs ours (not capped by jaxdist)")
    if rec.get("num_gpus") != run.devices:
        hw.append(f"GPUs {rec.get('num_gpus') or 'not stated'} vs {run.devices}")
    return hard, hw


def _image_size(run: Run):
    if run.results["model"]["name"].startswith("resnet"):
        from models import get_model, parse_overrides
        try:
            cfg = get_model(run.results["model"]["name"],
                            parse_overrides(run.cfg("model", "model_opts") or ""))
            return getattr(cfg, "image_size", None)
        except UsageError:
            return None
    return None


def published_section(runs: list[Run], records: list[dict], top: int):
    lines = ["## JAX vs published figures", "",
             "Closest published records per JAX run (fewest mismatches first). A ratio is "
             "shown only when model, layout, per-device batch, sequence/image size and "
             "precision (float32 at matmul precision default/high on an Ampere or newer GPU "
             "counts as tf32) all match; when only the hardware or GPU count differs, a "
             "throughput per device becomes a per-GPU normalised ratio, labelled so; "
             "otherwise \"not comparable\" with every mismatch named. A run on CPU devices is "
             "never set against a GPU figure.", "",
             "| JAX run | record | source | metric | published | ours | verdict | mismatches |"
             " their read-out |", "|---|---|---|---|---|---|---|---|---|"]
    rows, shown = [], 0
    jax_groups: dict[tuple, list[Run]] = {}
    for r in runs:
        if r.framework == "jax":
            jax_groups.setdefault(r.key(), []).append(r)
    for key in sorted(jax_groups, key=str):
        run = jax_groups[key][0]
        family = next((f for f in FAMILY_WORDS if run.results["model"]["name"].startswith(f)),
                      "")
        scored = []
        for rec in records:
            q = quantity(rec)
            if q is None or rec["layout"] not in layout_classes(run) or rec.get("value") is None:
                continue
            hard, hw = record_mismatches(run, rec)
            words = FAMILY_WORDS.get(family, ())
            related = any(w in rec["model"].lower() for w in words)
            measurable = ours(run, q[0])[0] is not None  # what we can set beside it first
            scored.append((len(hard) + len(hw) + (0 if related else 1) + (0 if measurable else 1),
                           rec["id"], rec, q, hard, hw))
        scored.sort(key=lambda s: (s[0], s[1]))
        label = f"{run.model} {run.layout} x{run.devices} b{run.batch} ({run.label})"
        if not scored:
            lines.append(f"| {label} | (no published record for layout {run.layout}) | | | | "
                         f"| | | |")
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
            lines.append(f"| {label} | {rid} | {where} | {rec['metric']} | {rec['value']:g} "
                         f"{rec['unit']} | {_fmt_ours(kind, mine)} | {verdict} | "
                         f"{'; '.join(hard + hw) or 'none'} | {rec['readout']} |")
            rows.append({"section": "published", "model": run.model, "layout": run.layout,
                         "devices": run.devices, "batch": run.batch, "dtype": run.dtype,
                         "framework": "JAX", "record": rid, "metric": rec["metric"],
                         "published": rec["value"], "unit": rec["unit"], "ours": mine,
                         "verdict": verdict, "mismatches": "; ".join(hard + hw)})
            shown += 1
        if len(scored) > top:
            lines.append(f"| {label} | ({len(scored) - top} more {run.layout} records, all "
                         f"with at least as many mismatches; --top to list them) | | | | | | "
                         f"| |")
    return (lines + [""] if shown or len(lines) > 6 else []), rows, shown


def published_verdict(run: Run, rec: dict, kind: str, mine, theirs, why, hard, hw) -> str:
    """A ratio only where it means something: never a CPU run against a (GPU) figure; a
    per-GPU normalised ratio only for throughput per device; a plain ratio only when nothing
    the comparison depends on differs."""
    if run.backend == "cpu":
        what = "simulated CPU devices" if run.results["env"].get("simulated") else "CPU"
        return f"not comparable ({what} vs {rec.get('device') or rec['hardware']})"
    if mine is None:
        return f"n/a: ours not measured ({why})"
    if hard or (hw and kind not in PER_GPU_KINDS):
        return "not comparable"
    x = ratio(mine, theirs)
    return f"per-GPU normalised ratio {fmt_ratio(x)}" if hw else f"comparable: ratio {fmt_ratio(x)}"


def _fmt_ours(kind, v):
    if v is None:
        return "n/a"
    return {"tokens_per_dev": f"{v:,.0f} tokens/s/device",
            "samples_per_dev": f"{v:,.1f} samples/s/device",
            "step_s": f"{v * 1e3:.1f} ms", "peak_gib": f"{v:.3f} GiB",
            "mfu": f"{v:.1%}"}[kind]


# ---------------------------------------------------------------------------- outputs

CSV_FIELDS = ["section", "model", "layout", "devices", "batch", "dtype", "framework", "runs",
              "step_p50_s", "step_p99_s", "samples_per_s", "peak_bytes_per_device",
              "peak_kind", "state_bytes_per_device", "energy_per_sample_j", "record",
              "metric", "published", "unit", "ours", "verdict", "mismatches",
              "ddp_over_fsdp_memory", "memory_basis", "ddp_over_fsdp_throughput",
              "async_time_reduction_pct", "async_accuracy_penalty_points"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_chart(path: Path, chart: list[dict]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.8 * len(chart) + 2), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if not chart:
        ax.text(0.5, 0.5, "no matched JAX / PyTorch pair", ha="center", va="center")
        ax.set_axis_off()
    else:
        xs = range(len(chart))
        w = 0.38
        jax_v = [c["jax"] for c in chart]
        pt_v = [c["pytorch"] for c in chart]
        ax.bar([x - w / 2 for x in xs], jax_v, w, label="JAX")
        ax.bar([x + w / 2 for x in xs], pt_v, w, label="PyTorch")
        for x, c in zip(xs, chart):
            top = max(c["jax"], c["pytorch"])
            ax.text(x, top * 1.02, f"{fmt_ratio(c['ratio'])}", ha="center", fontsize=9)
        ax.set_xticks(list(xs), [c["label"] for c in chart], fontsize=8)
        ax.set_ylabel("samples/s (median over runs)")
        ax.set_title("throughput, JAX vs PyTorch (label: JAX/PyTorch)")
        ax.legend()
        values = [v for v in jax_v + pt_v if v]
        if values and max(values) / min(values) > 20:  # models of very different cost
            ax.set_yscale("log")
            ax.set_ylabel("samples/s (median over runs, log scale)")
        else:
            ax.set_ylim(0, max(values or [1]) * 1.15)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.top < 1:
            raise UsageError(f"--top must be at least 1, got {args.top}")
        from experiments import baselines
        records = baselines.load(args.baselines)  # bad records fail before any run is read
        runs = find_runs(args.runs)
        published = args.published or bool(args.baselines)
        groups = group(runs)
        live, rows, chart = live_section(groups)
        unmatched = unmatched_section(runs, groups)
        ovi, ovi_rows = ovi_section(runs, {r["id"]: r for r in records})
        pub, pub_rows, pub_shown = (published_section(runs, records, args.top)
                                    if published else ([], [], 0))
        if not chart and not ovi and not pub_shown:
            raise UsageError(_nothing_to_compare(runs, groups, published))
        out = Path(args.out) if args.out else Path("runs") / time.strftime(
            "compare-%Y%m%d-%H%M%S")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot write to --out {out}: {e.strerror or e}") from None
    except UsageError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    title = ["# Cross-framework comparison", "",
             f"{len(runs)} run(s): " + ", ".join(sorted(str(r.path) for r in runs)), ""]
    doc = title + (live if chart else []) + [""] + unmatched + ovi + pub
    text = "\n".join(doc).replace("\n\n\n", "\n\n").rstrip() + "\n"
    print(text)
    (out / "compare.md").write_text(text)
    write_csv(out / "compare.csv", rows + ovi_rows + pub_rows)
    write_chart(out / "compare.png", chart)
    print(f"written: {out / 'compare.md'}, {out / 'compare.csv'}, {out / 'compare.png'}")
    return 0


def _nothing_to_compare(runs, groups, published) -> str:
    jax = [r for r in runs if r.framework == "jax"]
    torch = [r for r in runs if r.framework == "pytorch"]
    if not torch and not published:
        return ("no PyTorch run among RUNS to compare with (make one with "
                "python -m experiments.torch_run, or add --published)")
    if not jax:
        return "no JAX run among RUNS (make one with python -m experiments.run)"
    if published:
        return "no JAX run matches a PyTorch run, and no published record fits the JAX runs"
    run = jax[0]
    best, diff = closest(run, torch)
    return (f"no JAX run matches a PyTorch run: e.g. {run.path} vs the closest, {best.path}: "
            f"{'; '.join(diff)}")


if __name__ == "__main__":
    sys.exit(main())
