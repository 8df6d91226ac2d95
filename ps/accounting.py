"""What a shard counts for the results: outcomes of pushes, staleness histograms, waiting
time, the learning-rate scale staleness applied, and notable events. Kept across a restart
(in the snapshot's meta.json); ps.core updates it under its own lock."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Every outcome counter stats() reports, 0 when it never happened.
OUTCOMES = ("applied", "rejected", "deduplicated", "applies", "snapshots",
            "rejected_nonfinite", "clipped")


@dataclass
class ShardAccounting:
    num_workers: int
    counts: Counter = field(default_factory=Counter)
    staleness_hist: Counter = field(default_factory=Counter)       # version lag at apply
    step_staleness_hist: Counter = field(default_factory=Counter)  # clock lag at pull
    wait_s: dict = field(default_factory=lambda: {"barrier": 0.0, "bound": 0.0})
    wait_s_by_worker: dict = field(default_factory=dict)
    lr_scale_sum: float = 0.0
    lr_scale_min: float = 1.0
    events: list = field(default_factory=list)

    def __post_init__(self):
        self.wait_s_by_worker = {w: 0.0 for w in range(self.num_workers)}

    def applied(self, stale: int, scale: float, gradients: int = 1) -> None:
        """`gradients` gradients applied at staleness `stale` with learning-rate `scale`."""
        self.counts["applied"] += gradients
        self.staleness_hist[stale] += gradients
        self.lr_scale_sum += scale * gradients
        self.lr_scale_min = min(self.lr_scale_min, scale)

    def waited(self, kind: str, worker: int, seconds: float) -> None:
        self.wait_s[kind] += seconds
        self.wait_s_by_worker[worker] += seconds

    def meta(self) -> dict:
        """The part of a snapshot's meta.json that continues after a restart."""
        return {"counts": dict(self.counts),
                "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
                "step_staleness_hist": {str(k): v for k, v in self.step_staleness_hist.items()},
                "lr_scale_sum": self.lr_scale_sum, "lr_scale_min": self.lr_scale_min}

    def load(self, meta: dict) -> None:
        self.counts = Counter(meta["counts"])
        self.staleness_hist = Counter({int(k): v for k, v in meta["staleness_hist"].items()})
        self.step_staleness_hist = Counter(
            {int(k): v for k, v in meta["step_staleness_hist"].items()})
        self.lr_scale_sum, self.lr_scale_min = meta["lr_scale_sum"], meta["lr_scale_min"]

    def stats(self) -> dict:
        applied = self.counts["applied"]
        return {
            **{name: self.counts[name] for name in OUTCOMES},
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "step_staleness_hist": {str(k): v for k, v in
                                    sorted(self.step_staleness_hist.items())},
            "wait_s": dict(self.wait_s),
            "wait_s_by_worker": [self.wait_s_by_worker[w] for w in range(self.num_workers)],
            "lr_scale_mean": self.lr_scale_sum / applied if applied else None,
            "lr_scale_min": self.lr_scale_min,
            "events": list(self.events[-50:]),
        }
