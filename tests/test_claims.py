"""analysis.claims: each published claim stated once, its bounds derived from its record, and
the report and compare taking their verdicts from the same ratios."""

from pathlib import Path

import pytest

from analysis import claims, compare
from jaxdist.record import RunRecord


def test_bounds_come_from_the_records():
    got = {k: b for k, (_, b) in claims.claim_bounds().items()}
    assert got[("mem", "v1")] == (None, pytest.approx(0.40))       # ovi-v1: >60% less
    assert got[("mem", "v2")] == (pytest.approx(1 / 6), 0.25)      # ovi-v2: 4-6x lower
    assert got[("thr", "v1")] == (pytest.approx(1 / 6), 1.0)       # time up to 6x DDP's
    assert got[("thr", "v2")] == (pytest.approx(1 / 3), 0.5)       # DDP 2-3x throughput
    assert got[("time", "v2")] == (pytest.approx(0.72), 1.0)       # up to 28% less time
    assert got[("acc", "v2")] == (-17.0, -4.0)                     # 4-17 points penalty
    assert got[("time", "v1")] == (None, 1.0) and got[("acc", "v1")] == (None, 0.0)
    assert got[("ssp_time", "v2")] is None
    # one row per (quantity, version): no claim is stated twice
    assert len({(c.quantity, c.version) for c in claims.CLAIMS}) == len(claims.CLAIMS)


def _run(name, layout, sps, peak):
    return RunRecord(Path(name), {
        "layout": layout, "mesh": {"data": 2}, "model": {"name": "m"},
        "config": {"train": {"batch_size": 8, "optimizer": "sgd"}, "model": {}},
        "env": {"num_devices": 2, "backend": "gpu", "simulated": False},
        "step_time_s": {"n": 4, "p50": 0.1}, "throughput": {"samples_per_s": sps},
        "memory": {"state_bytes_per_device": peak, "measured_peak_bytes": peak}})


def test_compare_states_the_reports_verdicts_in_the_claims_direction():
    # FSDP faster than DDP: v1's "FSDP training time up to 6x DDP's" does not hold. The
    # time ratio is FSDP's time over DDP's (0.5), not FSDP/DDP throughput (2.0, which would
    # read "within up to 6x").
    runs = [_run("ddp", "ddp", 100.0, 1000), _run("fsdp", "fsdp", 200.0, 200)]
    rs = {r.what: r for r in claims.ratios(runs)}
    assert rs["FSDP/DDP throughput"].value == 2.0
    assert rs["FSDP/DDP throughput"].verdict("v1") == "outside"
    assert rs["FSDP/DDP peak memory"].value == 0.2
    assert rs["FSDP/DDP peak memory"].verdict("v2") == "within"
    lines, rows = compare.ovi_section(runs)
    assert {row["comparison"]: (row["ratio"], row["verdict_v1"], row["verdict_v2"])
            for row in rows} == {
        "FSDP/DDP peak memory": (0.2, "within", "within"),
        "FSDP/DDP train-state bytes": (0.2, "within", "within"),
        "FSDP/DDP throughput": (2.0, "outside", "outside")}
    assert lines[-2].startswith("| FSDP/DDP throughput | m | 2 devices, batch 8, float32 | "
                                "2.000 (FSDP time 0.50x DDP's) |")
