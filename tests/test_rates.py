"""jaxdist.parts' kernel rates: published achievable kernel rates per part, each with its
source, below the datasheet peaks they are achieved against, and a clear KeyError where none
exists."""

import subprocess
import sys

import pytest

from jaxdist import parts
from tests.helpers import ROOT

PARTS = ("h100-sxm", "h200", "a100-sxm-80gb", "a100-sxm-40gb")


@pytest.mark.parametrize("part", PARTS)
def test_every_part_has_every_kind_with_a_source(part):
    for kind in parts.KINDS:
        r = parts.rate(part, kind, "bfloat16")
        assert r.value > 0 and r.source
    assert set(PARTS) <= set(parts.rate_parts())


@pytest.mark.parametrize("part", PARTS)
def test_achievable_rates_stay_below_the_datasheet(part):
    hw = parts.NAMED[part]
    peak = hw.peak_flops("bfloat16")
    for kind, low in (("gemm", 0.7), ("attention_fwd", 0.6), ("attention_bwd", 0.5)):
        assert low * peak < parts.rate(part, kind, "bfloat16").value < peak, kind
    assert 0.75 * hw.hbm_bandwidth < parts.rate(part, "hbm_copy", "bfloat16").value \
        < hw.hbm_bandwidth
    assert 1e-6 <= parts.rate(part, "launch", "float32").value <= 1e-5


def test_figures_as_published():
    bf16 = "bfloat16"
    assert parts.rate("h100-sxm", "gemm", bf16).value == 794.5e12
    assert parts.rate("a100-sxm-80gb", "gemm", bf16).value == 271.2e12
    assert parts.rate("h200", "attention_fwd", bf16).value == 688e12
    assert parts.rate("h200", "hbm_copy", bf16).value == 3770.9e9
    # measured on the part itself, or labelled with how it was carried over
    assert parts.rate("h200", "attention_bwd", bf16).measured_on_part
    assert not parts.rate("h100-sxm", "attention_bwd", bf16).measured_on_part
    assert "H800" in parts.rate("h100-sxm", "hbm_copy", bf16).derived
    assert parts.rate("a100-sxm-80gb", "hbm_copy", bf16).value == pytest.approx(1607.7e9,
                                                                                  rel=1e-4)
    # H200's HBM3e is faster than H100's HBM3; the same die computes at the same rate
    assert parts.rate("h200", "hbm_copy", bf16).value > parts.rate("h100-sxm", "hbm_copy",
                                                                     bf16).value
    curve = parts.attention_curve("h200", bf16)
    assert [s for s, _, _ in curve] == sorted(s for s, _, _ in curve)
    assert all(a[1] < b[1] and a[2] < b[2] for a, b in zip(curve, curve[1:]))
    assert parts.attention_curve("a100-sxm-80gb", bf16) == ()


def test_absent_rates_raise_a_keyerror_naming_what_exists():
    with pytest.raises(KeyError, match="no published gemm rate for h100-sxm in float32; "
                                       "h100-sxm has: attention_bwd/bfloat16"):
        parts.rate("h100-sxm", "gemm", "float32")
    with pytest.raises(KeyError, match="parts with rates: a100-sxm-40gb, a100-sxm-80gb, "
                                       "h100-sxm, h200"):
        parts.rate("l4", "gemm", "bfloat16")
    with pytest.raises(KeyError, match="unknown kernel kind 'conv': choose from gemm"):
        parts.rate("h200", "conv", "bfloat16")


def test_parts_module_imports_no_jax():
    code = ("import sys, jaxdist.parts; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
