"""jaxdist.parts and jaxdist.hardware: GPUs as data, each figure with its source; --hardware on
the command line."""

import pytest

from jaxdist import parts
from jaxdist.errors import UsageError
from jaxdist.hardware import MODEL_CONSTANTS, get_hardware
from tests.helpers import cli_main

KNOWN = ("h100-sxm, h100-sxm-a3-high, h100-sxm-a3-mega, h100-pcie, h200, h100-sxm-96gb-500w, "
         "a100-sxm-40gb, a100-sxm-80gb, a10g, l4")


def test_the_parts_the_issue_names_are_there():
    assert ", ".join(parts.PREDICTABLE) == KNOWN


@pytest.mark.parametrize("name", parts.PREDICTABLE)
def test_every_part_has_flop_peaks_from_metrics_and_sources(name):
    hw = parts.NAMED[name]
    # One FLOP table: the peaks are jaxdist.parts' rows, found by device_kind.
    assert hw.peak_flops("bfloat16") == parts.peak_flops(hw.device_kind, "bfloat16")
    assert hw.peak_flops("bfloat16") is not None
    assert hw.peak_flops("float32", "highest") == parts.peak_row(hw.device_kind).fp32
    assert len(hw.sources) == 3  # memory + TDP, intra-node link, inter-node link
    assert hw.intra_node_bandwidth > hw.inter_node_bandwidth


def test_one_record_per_part_is_every_view():
    """A part's facts are one record of jaxdist.parts; the --hardware help,
    the peak lookup, the XLA:GPU targets and the kernel rates are views of it."""
    import dataclasses

    from jaxdist.config import OutputConfig

    assert len(parts.NAMED) == len(parts.PARTS)  # names are unique
    assert all(p.peak is not None for p in parts.PARTS if p.patterns)
    assert all(p.predictable or not (p.target or p.rates) for p in parts.PARTS)
    field = {f.name: f for f in dataclasses.fields(OutputConfig)}["hardware"]
    assert f"({KNOWN})" in field.metadata["help"]


def test_datasheet_figures():
    h200 = get_hardware("H200")
    assert (h200.hbm_bytes, h200.hbm_bandwidth, h200.tdp_w) == (141e9, 4.8e12, 700)
    assert h200.peak_flops("bfloat16") == 1979e12 / 2  # datasheet's 1,979 TF is sparse
    assert h200.intra_node_bandwidth == 450e9 and h200.inter_node_bandwidth == 50e9
    assert get_hardware("h100-pcie").peak_flops("bfloat16") == 1513e12 / 2
    assert get_hardware("a100-sxm-40gb").hbm_bandwidth == 1.555e12
    assert get_hardware("l4").inter_node_bandwidth == 12.5e9 / 8
    # Google Cloud A3 VMs: GPUDirect-TCPX(O) NICs, 800 / 1,600 Gbps over 8 GPUs
    assert get_hardware("h100-sxm-a3-high").inter_node_bandwidth == 12.5e9
    assert get_hardware("h100-sxm-a3-mega").inter_node_bandwidth == 25e9


def test_every_constant_says_why():
    assert set(MODEL_CONSTANTS) == {
        "compute_efficiency_hopper", "compute_efficiency_ampere",
        "kernel_efficiency_hopper", "kernel_efficiency_ampere", "hbm_efficiency",
        "link_efficiency", "ring_base_latency_s", "nvlink_hop_latency_s", "pcie_hop_latency_s",
        "network_hop_latency_s", "power_cap_clock_exponent", "host_link_bandwidth_hopper",
        "host_link_bandwidth_ampere", "tree_ll_base_latency_s", "tree_ll_intra_hop_latency_s",
        "tree_ll_network_hop_latency_s", "tree_ll_bandwidth_factor"}
    # every part names an efficiency and an intra-node link that have a constant
    for hw in map(parts.NAMED.get, parts.PREDICTABLE):
        assert f"compute_efficiency_{hw.efficiency}" in MODEL_CONSTANTS
        assert f"kernel_efficiency_{hw.efficiency}" in MODEL_CONSTANTS
        assert f"{hw.intra_node_link}_hop_latency_s" in MODEL_CONSTANTS
        assert f"host_link_bandwidth_{hw.efficiency}" in MODEL_CONSTANTS
    assert all(len(c.why) > 40 for c in MODEL_CONSTANTS.values())


def test_gpus_per_node_override():
    assert get_hardware("h200", 4).gpus_per_node == 4
    assert get_hardware("h200", 0).gpus_per_node == 8
    with pytest.raises(UsageError, match="negative"):
        get_hardware("h200", -1)


def test_cli_gpus_per_node_that_does_not_fill_nodes_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--dry-run", "--hardware", "h200", "--gpus-per-node", "3", "--mesh",
                    "4x8", "--model", "mlp-tiny")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "run: error: the mesh's 32 devices do not fill nodes of 3 GPUs (h200); give "
        "--gpus-per-node a divisor of 32, or a mesh of a multiple of 3 devices")
    assert list(tmp_path.iterdir()) == []


def test_unknown_part_names_the_known_ones():
    with pytest.raises(UsageError) as e:
        get_hardware("tpu-v5")
    assert str(e.value) == f"unknown --hardware 'tpu-v5'; known: {KNOWN}"


@pytest.mark.parametrize("name, hint", [
    ("h100", " (did you mean 'h100-sxm' or 'h100-pcie'?)"),
    ("h20", " (did you mean 'h200'?)"),
    ("a100-sxm-80", " (did you mean 'a100-sxm-80gb' or 'a100-sxm-40gb'?)"),
    ("tpu-v5", ""),
])
def test_unknown_part_names_the_nearest(name, hint):
    with pytest.raises(UsageError) as e:
        get_hardware(name)
    assert str(e.value) == f"unknown --hardware '{name}'{hint}; known: {KNOWN}"


def test_cli_unknown_hardware_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--dry-run", "--hardware", "h900", "--mesh", "2x4")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"run: error: unknown --hardware 'h900' (did you mean "
                                   f"'h200'?); known: {KNOWN}")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_cli_unknown_hardware_on_a_real_run(tmp_path, monkeypatch, capsys):
    # A real run with --hardware carries the prediction (tests/test_inrun_prediction.py);
    # an unknown part is refused before anything starts.
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--hardware", "h900", "--mesh", "2x4")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"run: error: unknown --hardware 'h900' (did you mean "
                                   f"'h200'?); known: {KNOWN}")
    assert list(tmp_path.iterdir()) == []


def test_notices_with_hardware():
    from jaxdist.config import CompilerConfig, OutputConfig, RunConfig, TrainConfig
    from experiments.notices import notices

    # --hardware compiles the step: batch, micro-batches and overlap are read; --seed is not.
    cfg = RunConfig(output=OutputConfig(dry_run=True, hardware="h200"),
                    train=TrainConfig(batch_size=32, microbatches=2, seed=3),
                    compiler=CompilerConfig(overlap=True))
    assert notices(cfg) == ["notice: --seed applies only to a training run, not --dry-run "
                            "(which plans memory from shapes only); ignored"]
    assert notices(RunConfig(output=OutputConfig(gpus_per_node=4))) == [
        "notice: --gpus-per-node applies only to --hardware; ignored"]


def test_a_power_cap_slows_compute_by_the_clock_it_leaves_and_not_hbm():
    """A part may carry a power cap; its compute runs at the clock the cap
    leaves, (cap / rated)^(1/3) (dynamic power ~ f^3, MODEL_CONSTANTS), its streaming kernels
    at its own HBM's rate. torchtitan's Grand Teton H100: 500 W against the 700 W at which
    h100-sxm's rates were measured, and 2.4 TB/s HBM2e against 3.35 TB/s HBM3."""
    from jaxdist.hardware import clock_factor, rates_part
    from jaxdist.predict.kernels_time import Rates

    capped, full = get_hardware("h100-sxm-96gb-500w"), get_hardware("h100-sxm")
    assert (capped.power_cap_w, capped.hbm_bytes, capped.hbm_bandwidth) == (500, 96e9, 2.4e12)
    assert clock_factor(capped) == pytest.approx((500 / 700) ** (1 / 3)) == \
        pytest.approx(0.8939, abs=1e-4)
    assert clock_factor(full) == 1.0 and rates_part(full) == ("h100-sxm", 1.0, 1.0)
    assert rates_part(capped) == ("h100-sxm", clock_factor(capped), 2.4 / 3.35)
    r, ref = Rates(capped), Rates(full)
    assert r.gemm_bf16 == pytest.approx(ref.gemm_bf16 * 0.8939, rel=1e-4)
    assert r.attention["attention_bwd"] == pytest.approx(ref.attention["attention_bwd"] * 0.8939,
                                                         rel=1e-4)
    assert r.hbm == pytest.approx(ref.hbm * 2.4 / 3.35) and r.launch == ref.launch
    assert "x 0.894, its clock under the 500 W cap" in r.sources["gemm"]
    assert parts.MAMF in r.sources["gemm"]
    # a cap at or above the rated power changes nothing
    from dataclasses import replace
    assert clock_factor(replace(full, power_cap_w=700)) == 1.0
    assert clock_factor(replace(full, power_cap_w=350)) == pytest.approx(0.5 ** (1 / 3))
