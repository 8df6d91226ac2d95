"""The validation table's summary reads two things apart: the predictor's error on rows of
the program family jaxdist plans (JAX: MaxText, Paxml) and the framework gap on PyTorch
rows, each with its median and sign balance. Rows are hand-made: no compile."""

import math

import pytest

from experiments.predict import family, format_rows, summary


def row(case, framework, ratio, role="out-of-sample", same_as=None):
    return {"case": case, "framework": framework, "role": role, "same_as": same_as,
            "ratio_tokens_per_s_per_gpu": ratio, "ratio_memory_gib": None,
            "gpus": 8, "layout": "fsdp", "hardware": "h100-sxm",
            "published_tokens_per_s_per_gpu": 100.0,
            "predicted_tokens_per_s_per_gpu": 100.0 * ratio, "published_memory_gib": None,
            "predicted_memory_gib": 10.0, "hbm_gib": 80.0, "fits": True,
            "hand_memory_gib": 10.0, "xla_gpu_memory_gib": 10.0,
            "memory_source": "XLA:GPU buffer assignment", "bottleneck": "compute",
            "time_model": "kernel by kernel"}


ROWS = [row("mt-a", "JAX (MaxText)", 0.9), row("mt-b", "JAX (MaxText)", 1.1),
        row("px-a", "JAX (Paxml)", 0.8), row("px-cal", "JAX (Paxml)", 1.0, "calibration"),
        row("tt-a", "PyTorch (torchtitan)", 1.35),
        row("tt-a-again", "PyTorch (torchtitan)", 1.3, same_as="tt-a"),
        row("nemo-a", "NeMo (Megatron-Core, Transformer Engine)", 0.8)]


def test_families_are_named_by_the_program_they_ran():
    assert family("JAX (MaxText)") == family("JAX (Paxml)") == "JAX"
    assert family("PyTorch (torchtitan)") == "PyTorch"
    assert family("Megatron-Bridge (Megatron-Core, Transformer Engine)") == "PyTorch"


def test_summary_splits_independent_rows_by_family_with_their_sign_balance():
    s = summary(ROWS, "tokens_per_s_per_gpu")
    assert s["rows"] == 5  # calibration and repeat rows left out
    jax, torch = s["by_family"]["JAX"], s["by_family"]["PyTorch"]
    assert (jax["rows"], jax["below"], jax["above"]) == (3, 2, 1)
    assert jax["median_abs_log_ratio"] == pytest.approx(abs(math.log(0.9)))
    assert (jax["worst"], jax["worst_ratio"]) == ("px-a", 0.8)
    assert (torch["rows"], torch["below"], torch["above"]) == (2, 1, 1)
    assert torch["worst"] == "tt-a"
    text = format_rows(ROWS)
    assert ("  JAX rows (the predictor's own error: the program family jaxdist plans): 3, "
            "median |log ratio| 0.105, 2 below 1.0 and 1 above") in text
    assert "  PyTorch rows (a cross-framework gap, not a target): 2," in text
