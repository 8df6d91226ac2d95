"""Published claims as one data table, and the same ratios computed from matched runs.

Each claim of Ovi 2025 (arXiv 2505.12832; v1 May 2025, v2 Jan 2026, abstract level) is one row
of CLAIMS: the quantity this study computes (a ratio in one stated direction), the paper's
words, and its bounds on that quantity. Where the paper gives numbers, the bounds are derived
from its record in analysis/baselines (value_min/value_max, in the record's unit) by the row's
conversion, so every number is stated once; where it gives none, the row states the sign.
Go 2025 publishes setup figures only (its records in analysis/baselines are not claims about a
ratio), so it has no row. The report and compare both take their verdicts from here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from analysis.text import SIMULATED_NOTE, md_escape, median

# quantity -> what this study computes, numerator over denominator: the direction every
# bound below is in. "Timing" quantities are functional only on simulated devices.
QUANTITIES = {
    "mem": "FSDP/DDP peak memory per device (lower: FSDP smaller)",
    "thr": "FSDP/DDP throughput (lower: FSDP slower)",
    "time": "async/sync parameter-server training time (lower: async faster)",
    "acc": "async-sync parameter-server final accuracy, points (negative: async worse)",
    "ssp_time": "ssp/sync parameter-server training time",
    "ssp_acc": "ssp-sync parameter-server final accuracy, points",
}
TIMING = ("thr", "time", "ssp_time")


def times_less(x):
    """A record's "Nx lower/higher" -> the ratio in the table's direction: 1/N."""
    return 1 / x


def pct_less(x):
    """A record's "N% less" -> the ratio: 1 - N/100."""
    return 1 - x / 100


def points_penalty(x):
    """A record's "N points penalty" -> async minus sync: -N."""
    return -x


# Each conversion's "no change", in the record's unit: the other end of an "up to N" claim.
NO_CHANGE = {times_less: 1.0, pct_less: 0.0, points_penalty: 0.0}


@dataclass(frozen=True)
class Claim:
    quantity: str                 # a key of QUANTITIES
    version: str                  # "v1" (May 2025) or "v2" (Jan 2026): kept apart
    says: str                     # the claim, as the abstract puts it
    record: str | None = None     # its record id in analysis/baselines (None: no number)
    convert: object = None        # record unit -> quantity (decreasing functions above)
    bounds: tuple | None = None   # (lo, hi) on the quantity where no record gives them
    shown: str = ""               # the bounds as printed where there are none


CLAIMS = (
    Claim("mem", "v1", "FSDP reduces GPU memory by over 60%", "ovi-v1-fsdp-mem", pct_less),
    Claim("mem", "v2", "FSDP 4-6x lower peak memory", "ovi-v2-fsdp-mem", times_less),
    Claim("thr", "v1", "FSDP training time up to 6x DDP's", "ovi-v1-fsdp-time", times_less),
    Claim("thr", "v2", "DDP 2-3x training throughput (baseline unstated)",
          "ovi-v2-ddp-speedup", times_less),
    Claim("time", "v1", "async PS improves throughput (no number)", bounds=(None, 1.0)),
    Claim("time", "v2", "async PS up to 28% less training time", "ovi-v2-asyncps-time",
          pct_less),
    Claim("acc", "v1", "async PS degrades accuracy (no number)", bounds=(None, 0.0)),
    Claim("acc", "v2", "4% to 17% accuracy penalty (points vs relative not stated)",
          "ovi-v2-asyncps-acc", points_penalty),
    Claim("ssp_time", "v2", "staleness-mitigating protocol: synchronization overhead "
          "negated the throughput gain (no number)", "ovi-v2-asyncps-acc", shown="~1"),
)


@functools.cache
def claim_bounds() -> dict[tuple[str, str], tuple[Claim, tuple | None]]:
    """(quantity, version) -> (claim, bounds on the quantity). Reads analysis/baselines."""
    from analysis import baselines

    records = {r["id"]: r for r in baselines.load()}
    out = {}
    for c in CLAIMS:
        bounds = c.bounds
        if c.convert is not None:
            rec = records[c.record]
            lo, hi = rec["value_min"], rec["value_max"]
            if lo is None and hi is not None and rec["value_text"].startswith("up to"):
                lo = NO_CHANGE[c.convert]
            # the conversions decrease: the record's maximum is the quantity's minimum
            bounds = tuple(None if x is None else c.convert(x) for x in (hi, lo))
        out[(c.quantity, c.version)] = (c, bounds)
    return out


def _fmt(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.2f}"


def shown(quantity: str, version: str) -> tuple[str, str]:
    """(bounds as printed, the paper's words) of a claim; ("-", "not in vN") for none."""
    found = claim_bounds().get((quantity, version))
    if found is None:
        return "-", f"not in {version}" if quantity.startswith("ssp") and version == "v1" \
            else "no figure"
    claim, bounds = found
    if bounds is None:
        return claim.shown or "-", claim.says
    lo, hi = bounds
    if lo is not None and hi is not None:
        return f"{_fmt(lo)}{' to ' if lo < 0 else '-'}{_fmt(hi)}", claim.says
    return (f"< {_fmt(hi)}" if lo is None else f">= {_fmt(lo)}"), claim.says


@dataclass
class Ratio:
    what: str
    kind: str              # key of QUANTITIES
    model: str
    context: str           # variant / batch when they are not the defaults
    value: float | None
    shown: str
    basis: str
    simulated: bool

    @property
    def timing(self) -> bool:
        return self.kind in TIMING

    def verdict(self, version: str) -> str:
        found = claim_bounds().get((self.kind, version))
        if self.value is None or found is None or found[1] is None:
            return "-"
        if self.timing and self.simulated:
            return "n/a (simulated)"
        lo, hi = found[1]
        ok = (lo is None or self.value >= lo - 1e-9) and (hi is None or self.value <= hi + 1e-9)
        return "within" if ok else "outside"


def _ps(get):
    """A parameter-server setting: None for other layouts (their config holds the default)."""
    return lambda r: get(r) if r.out_of_process else None


# Everything runs compared in a ratio share, as (label, value of a run): like with like, on
# as many devices (an FSDP run over 32 devices against a DDP run over 8 measures the device
# count, not the layout), for as many steps, at the same learning rate and seed. Only the
# layout (and the parameter server's mode, the thing compared) may differ.
KEY_FIELDS = (
    ("model", lambda r: r.model), ("variant", lambda r: r.variant or "none"),
    ("global batch", lambda r: r.batch), ("dtype", lambda r: r.dtype),
    ("matmul precision", lambda r: r.matmul_precision),
    ("dataset", lambda r: r.dataset), ("optimizer", lambda r: r.optimizer),
    ("learning rate", lambda r: r.cfg("train", "lr")),
    ("seed", lambda r: r.cfg("train", "seed")),
    ("timed steps", lambda r: r.cfg("loop", "steps")),
    ("warm-up steps", lambda r: r.cfg("loop", "warmup")),
    ("eval every", lambda r: r.cfg("data", "eval_every")),
    ("devices", lambda r: r.devices),
    ("processes", lambda r: (r.results.get("env") or {}).get("num_processes")),
    ("framework", lambda r: r.framework), ("backend", lambda r: r.backend),
    ("device kind", lambda r: r.device_kind),
    # counted here only where the variant does not already say it: never twice
    ("compiler overlap", lambda r: bool(r.cfg("compiler", "overlap"))
     and "overlap" not in r.variant.split("+")),
    ("XLA flags", lambda r: r.cfg("compiler", "xla_flags")),
    ("checkpoint every", lambda r: r.cfg("checkpoint", "checkpoint_every")),
    ("profiled steps", lambda r: r.cfg("output", "profile_steps")),
    ("PS shards", _ps(lambda r: r.cfg("ps", "ps_shards"))),
    ("PS gradient clip", _ps(lambda r: r.cfg("ps", "ps_clip_norm"))),
)


def compare_key(r, without: str = "") -> tuple:
    """The values of KEY_FIELDS (but `without`, a label) of run `r`."""
    return tuple(get(r) for label, get in KEY_FIELDS if label != without)


def key_labels(without: str = "") -> str:
    return ", ".join(label for label, _ in KEY_FIELDS if label != without)


def side(r) -> str:
    """What a ratio sets against another: the layout, parameter-server runs by mode
    (ps-sync, ps-async, ps-async+slr, ps-ssp(staleness N)): never pooled across modes."""
    mode = r.layout_mode
    if r.ps_mode == "ssp":
        mode = mode.replace("ps-ssp", f"ps-ssp(staleness {r.cfg('ps', 'staleness')})")
    return mode


def _groups(runs) -> dict[tuple, dict[str, list]]:
    groups: dict[tuple, dict[str, list]] = {}
    for r in runs:
        groups.setdefault(compare_key(r), {}).setdefault(side(r), []).append(r)
    return groups


def _pairs(groups) -> list[tuple[str, str, str]]:
    """(numerator side, denominator side, what) of every ratio a claim speaks to."""
    sides = sorted({s for by in groups.values() for s in by})
    return [("fsdp", "ddp", "FSDP/DDP")] + [
        (s, "ps-sync", f"{s[3:]}/sync PS") for s in sides
        if s.startswith(("ps-async", "ps-ssp"))]


def _context(r) -> str:
    bits = [r.variant, f"{r.devices} devices" if r.devices else "",
            f"batch {r.batch}" if r.batch else "", r.dtype,
            f"matmul precision {r.matmul_precision}" if r.matmul_precision != "default" else "",
            r.dataset, "PyTorch" if r.framework == "pytorch" else ""]
    return ", ".join(b for b in bits if b)


def _memory_basis(runs) -> tuple[str, object]:
    """The memory figure every run of a ratio has: measured peak, else the compiler's
    allocation bound, else the exact train-state bytes."""
    if all(r.measured_peak is not None for r in runs):
        return MEASURED_BASIS, lambda r: r.measured_peak
    if all(r.compiled_bound is not None for r in runs):
        return BOUND_BASIS, lambda r: r.compiled_bound
    return STATE_BASIS, lambda r: r.state_bytes


STATE_BASIS = "train-state bytes per device (exact)"
MEASURED_BASIS = "measured peak per device"
BOUND_BASIS = ("compiler allocation bound per device (argument+output-alias+temp: an upper "
               "bound, not a measured peak)")
# The row's title says which figure it divides: "peak memory" only when it was measured.
MEMORY_TITLES = {MEASURED_BASIS: "FSDP/DDP peak memory",
                 BOUND_BASIS: "FSDP/DDP compiler bound on peak memory",
                 STATE_BASIS: "FSDP/DDP train-state bytes"}


def ratios(runs) -> list[Ratio]:
    """Every ratio a claim speaks to, from runs that share compare_key(): FSDP/DDP memory
    and throughput; async (and ssp) against sync parameter server, time and accuracy."""
    groups = _groups(runs)
    ps_pairs = _pairs(groups)[1:]
    out = []
    for key, by in sorted(groups.items(), key=lambda kv: str(kv[0])):
        first = next(iter(by.values()))[0]
        model, ctx = first.model, _context(first)

        def add(what, kind, a, b, get, text, basis, rs):
            x, y = median(map(get, a)), median(map(get, b))
            if y and x is not None:
                v = x / y
                sim = any(r.simulated for r in rs)
                note = f"; {SIMULATED_NOTE}" if sim and kind in TIMING else ""
                out.append(Ratio(what, kind, model, ctx, v, text(v, x, y), basis + note, sim))

        if "ddp" in by and "fsdp" in by:
            ddp, fsdp = by["ddp"], by["fsdp"]
            basis, get = _memory_basis(ddp + fsdp)
            less = lambda v, f, d: f"{v:.3f} ({(1 - v) * 100:.0f}% less" + (  # noqa: E731
                f"; DDP/FSDP {d / f:.2f}x)" if f else ")")
            add(MEMORY_TITLES[basis], "mem", fsdp, ddp, get, less, basis, ddp + fsdp)
            if basis != STATE_BASIS:
                add("FSDP/DDP train-state bytes", "mem", fsdp, ddp, lambda r: r.state_bytes,
                    lambda v, f, d: f"{v:.3f} ({(1 - v) * 100:.0f}% less)",
                    "train-state shard bytes per device (exact)", ddp + fsdp)
            add("FSDP/DDP throughput", "thr", fsdp, ddp, lambda r: r.samples_per_s,
                lambda v, f, d: f"{v:.3f} (FSDP time {d / f:.2f}x DDP's)" if f else f"{v:.3f}",
                "samples/s, mean step time", ddp + fsdp)
        sync = by.get("ps-sync")
        for mode, _, _ in ps_pairs:
            other, label = by.get(mode), mode[3:]
            if not sync or not other:
                continue
            kind_t, kind_a = ("time", "acc") if mode.startswith("ps-async") else \
                ("ssp_time", "ssp_acc")
            add(f"{label}/sync PS training time", kind_t, other, sync, lambda r: r.train_time,
                lambda v, a, s: f"{v:.3f} ({abs(1 - v) * 100:.0f}% "
                                f"{'less' if v <= 1 else 'more'} time)",
                "wall time of the timed steps", sync + other)
            s = median(r.final_accuracy for r in sync)
            a = median(r.final_accuracy for r in other)
            if s is not None and a is not None:
                v = (a - s) * 100
                rel = f", {a / s:.3f}x" if s and label == "async" else ""
                out.append(Ratio(f"{label}-sync PS final accuracy", kind_a, model, ctx,
                                 v if label == "async" else None,
                                 f"{v:+.1f} points ({a:.1%} vs {s:.1%}{rel})",
                                 "final test accuracy, same steps",
                                 any(r.simulated for r in sync + other)))
    return out


def claim_sources() -> str:
    """The records the claims come from, for a table's caption."""
    return ", ".join(f"{c.version} {c.quantity}: {c.record}" for c in CLAIMS if c.record)


@dataclass(frozen=True)
class Unpaired:
    """A ratio a claim speaks to that is not formed: its runs differ in more than the layout."""
    what: str              # "FSDP/DDP", "async/sync PS"
    model: str
    text: str              # "no ratio: ... differ in timed steps 20 vs 40"


def _differences(a: tuple, b: tuple) -> list[str]:
    return [f"{label} {x} vs {y}" for (label, _), x, y in zip(KEY_FIELDS, a, b) if x != y]


def unpaired(runs) -> list[Unpaired]:
    """For each run group with one side of a ratio whose other side exists only among unlike
    runs: the closest such run and every setting that differs (each pair named once)."""
    groups = _groups(runs)
    out = []
    for num, den, what in _pairs(groups):
        seen = set()
        for mine, theirs in ((num, den), (den, num)):
            for key, by in sorted(groups.items(), key=lambda kv: str(kv[0])):
                if mine not in by or theirs in by:
                    continue
                others = [k for k, b in groups.items() if theirs in b]
                if not others:
                    continue
                best = min(others, key=lambda k: (len(_differences(key, k)), str(k)))
                if frozenset((key, best)) in seen:
                    continue
                seen.add(frozenset((key, best)))
                a, b = by[mine][0], groups[best][theirs][0]
                out.append(Unpaired(what, a.model,
                                    f"no ratio: {mine} run {a.name} and the closest {theirs} "
                                    f"run {b.name} differ in "
                                    f"{'; '.join(_differences(key, best))}"))
    return out


def ratio_lines(rs: list[Ratio], unlike: list[Unpaired] = ()) -> list[str]:
    if not rs and not unlike:
        return ["No comparison could be formed: it needs ddp and fsdp runs of the same model, "
                "settings and device count, or ps-sync with ps-async / ps-ssp.", ""]
    lines = []
    if rs:
        lines += ["| comparison | model | settings | this study | basis | Ovi v1 (May 2025) | "
                  "v1 | Ovi v2 (Jan 2026) | v2 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        (b1, s1), (b2, s2) = shown(r.kind, "v1"), shown(r.kind, "v2")
        lines.append(f"| {r.what} | {md_escape(r.model)} | {md_escape(r.context)} | "
                     f"{r.shown} | {r.basis} | {b1}: {s1} | {r.verdict('v1')} | "
                     f"{b2}: {s2} | {r.verdict('v2')} |")
    if unlike:
        lines += [""] * bool(rs) + [
            "Ratios not formed: the runs differ in more than the layout (a ratio of unlike "
            "runs would measure the difference, not the layout):", ""]
        lines += [f"- {u.what}, {md_escape(u.model)}: {md_escape(u.text)}" for u in unlike]
    lines.append("")
    return lines
