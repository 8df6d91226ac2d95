"""The printed summary and the HParams row of a run, from results.json dicts: missing
values read 'n/a', the summary never contradicts itself, old and new `mfu` blocks."""

from __future__ import annotations

import copy

from jaxdist.summary import format_markdown, format_summary, summary_rows
from jaxdist.writers import GIB, run_hparams, run_metrics


def results(**changes) -> dict:
    """A results.json of a simulated fsdp run, before the `status` / `hfu` contract."""
    r = {
        "framework": "jax", "layout": "fsdp", "mesh": {"data": 2, "fsdp": 4},
        "model": {"name": "mlp-tiny", "params": 6922},
        "config": {"train": {"layout": "fsdp", "batch_size": 16, "optimizer": "adamw",
                             "lr": 0.001, "seed": 0, "microbatches": 1, "remat": "none"},
                   "model": {"model": "mlp-tiny", "dtype": "float32"},
                   "compiler": {"overlap": False, "xla_flags": ""},
                   "data": {"dataset": "synthetic"},
                   "checkpoint": {"checkpoint_dir": "", "checkpoint_every": 0},
                   "ps": {"ps_mode": "sync", "ps_shards": 2, "staleness": 2}},
        "env": {"backend": "cpu", "device_kind": "cpu", "num_devices": 8, "simulated": True},
        "compile_s": 1.5,
        "step_time_s": {"n": 1, "mean": 0.002, "std": 0.0, "p50": 0.002, "p90": 0.002,
                        "p99": 0.002, "min": 0.002, "max": 0.002, "ci95": None},
        "throughput": {"samples_per_s": 8000.0, "tokens_per_s": None},
        "mfu": {"value": None, "analytic_value": None, "peak_flops_per_device": None,
                "compiled_flops_per_step": 1e6, "analytic_flops_per_step": 9e5,
                "reason": "peak FLOP/s unknown for device kind 'cpu'"},
        "memory": {"state_bytes_per_device": 10496, "measured_peak_bytes": None,
                   "measured_peak_reason": "cpu backend reports no memory_stats()",
                   "compiled": {"peak_bytes": 27494}},
        "sharding": {"sharded_bytes": 82944, "replicated_bytes": 4, "replicated_leaves": 0},
        "comm": {"by_kind": {}, "total_ring_bytes": 0.0, "analytic_ring_bytes": 0},
        "power": {"available": False, "reason": "NVML library not found"},
        "loss": [2.5, 2.4],
        "accuracy": [],
    }
    for key, value in changes.items():
        r[key] = value
    return r


def row(r: dict, label: str) -> str:
    return dict(summary_rows(r))[label]


def test_one_step_has_no_interval_rather_than_zero():
    assert row(results(), "step time mean ± ci95") == "2.00 ms ± n/a (one step: no interval) (n=1)"
    assert "± 0.00" not in format_summary(results())


def test_missing_figures_read_na_never_zero():
    r = results(compile_s=None, loss=[], memory={"state_bytes_per_device": None,
                                                 "compiled": None,
                                                 "measured_peak_bytes": None})
    r["step_time_s"] = {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None,
                        "ci95": None}
    r["throughput"] = {"samples_per_s": None, "tokens_per_s": None}
    assert row(r, "compile") == "n/a"
    assert row(r, "step time p50 / p90 / p99") == "n/a / n/a / n/a"
    assert row(r, "step time mean ± ci95") == "n/a"
    assert row(r, "throughput") == "n/a"
    assert row(r, "state per device (shards)") == "n/a"
    assert row(r, "compiler bound per device") == "n/a"
    assert row(r, "measured peak per device") == "n/a (not measured)"
    assert row(r, "loss first -> last") == "n/a"


SHARDED = "state sharded / replicated (totals, all devices)"


def test_replicated_scalars_are_not_contradicted_by_a_zero_leaf_count():
    assert row(results(), SHARDED) == \
        "81.00 KiB / 4 B (scalars only: step counters)"
    r = results(sharding={"sharded_bytes": 82944, "replicated_bytes": 124,
                          "replicated_leaves": 3})
    assert row(r, SHARDED) == \
        "81.00 KiB / 124 B (3 non-scalar leaves, plus any scalar counters)"
    r = results(sharding={"sharded_bytes": 82944, "replicated_bytes": 0,
                          "replicated_leaves": 0})
    assert row(r, SHARDED) == "81.00 KiB / nothing replicated"


def test_compiler_figure_is_labelled_an_upper_bound():
    assert row(results(), "compiler bound per device") == (
        "<= 26.85 KiB (argument + output - alias + temp: an allocation upper bound, not a "
        "measured peak)")


def test_mfu_and_hfu_of_the_new_block_and_the_reason_when_null():
    assert row(results(), "MFU / HFU") == "n/a (peak FLOP/s unknown for device kind 'cpu')"
    new = {"value": 0.412, "hfu": 0.5, "peak_flops_per_device": 989e12,
           "model_flops_per_step": 1e15, "compiled_flops_per_step": 1.2e15, "reason": None}
    assert row(results(mfu=new), "MFU / HFU") == "mfu 41.2%, hfu 50.0%"
    assert run_metrics(results(mfu=new))["hfu"] == 0.5
    partial = dict(new, value=None, reason="model FLOPs unknown for this model")
    assert row(results(mfu=partial), "MFU / HFU") == \
        "mfu n/a, hfu 50.0% (model FLOPs unknown for this model)"


def test_interrupted_run_says_so():
    assert "status" not in dict(summary_rows(results()))
    assert row(results(status="interrupted"), "status") == "interrupted"


def test_hparams_are_the_settings_that_define_a_run():
    hp = run_hparams(results())
    assert hp == {"layout": "fsdp", "mesh": "2x4", "model": "mlp-tiny", "dtype": "float32",
                  "status": "complete", "steps": "2", "devices": 8, "batch": 16,
                  "microbatches": 1, "remat": "none", "overlap": False, "framework": "jax",
                  "simulated": True}
    r = results(layout="ps", mesh={"workers": 2, "devices_per_worker": 1})
    r["config"] = copy.deepcopy(r["config"])
    r["config"]["ps"]["ps_mode"] = "ssp"
    hp = run_hparams(r)
    assert (hp["mesh"], hp["ps_mode"]) == ("2x1", "ssp")
    # 25 columns in all, the settings a user compares by marked to show first
    from jaxdist.writers import HPARAMS, IDENTITY, METRICS
    assert len(HPARAMS) + len(METRICS) == 25
    assert IDENTITY == ("layout", "mesh", "model", "dtype", "status")


def test_metrics_leave_out_what_was_not_measured():
    assert run_metrics(results()) == {  # memory in KiB: the largest figure is 26.8 KiB
        "step_time_p50_s": 0.002, "step_time_p99_s": 0.002, "ksamples_per_s": 8.0,
        "state_kib_per_device": 10496 / 1024, "compiler_bound_kib": 27494 / 1024,
        "comm_ring_gib": 0.0, "final_loss": 2.4}


def test_a_metric_column_reads_in_one_format():
    """TensorBoard prints a metric as toPrecision(5): fixed from 1e-6 to 1e5, exponent
    notation outside; throughputs up to 1e8/s stay fixed, and memory is in the unit of the
    run's scale, named in the tag and title, so it reads 0.1-9,999 from 1.1 kB to 97 TiB."""
    from jaxdist.writers import memory_unit, metric_columns

    def fixed(x):
        return 1e-6 <= abs(x) < 1e5
    for state, samples, unit in ((1100, 1.0, "KiB"), (50692, 8000.0, "KiB"),
                                 (1.622e6, 2.5e5, "KiB"), (141e9, 1e6, "GiB"),
                                 (90 * 2 ** 40, 1e3, "TiB"), (9 * 2 ** 30, 1e3, "MiB")):
        r = results(memory={"state_bytes_per_device": state, "measured_peak_bytes": state,
                            "compiled": {"peak_bytes": state}},
                    throughput={"samples_per_s": samples, "tokens_per_s": samples * 64})
        assert memory_unit(r)[0] == unit, (state, memory_unit(r))
        m = run_metrics(r)
        u = unit.lower()
        for tag in ("ksamples_per_s", "ktokens_per_s"):
            assert fixed(m[tag]), (tag, m[tag])
        for tag in (f"state_{u}_per_device", f"compiler_bound_{u}", f"measured_peak_{u}"):
            assert 0.1 <= m[tag] <= 9_999, (tag, m[tag])
        titles = dict(metric_columns(r))
        assert titles[f"state_{u}_per_device"] == f"state {unit}/device"


def test_status_and_steps_columns():
    assert (run_hparams(results())["status"], run_hparams(results())["steps"]) == \
        ("complete", "2")  # a record from before `status`: finished, its losses counted
    r = results(status="interrupted", steps_done=18,
                interrupted={"signal": "SIGINT", "steps_planned": 303})
    assert (run_hparams(r)["status"], run_hparams(r)["steps"]) == ("interrupted", "18 of 303")
    r = results(status="complete", steps_done=23, interrupted=None)
    assert run_hparams(r)["steps"] == "23"


def test_markdown_escapes_pipes():
    md = format_markdown(results(model={"name": "a|b", "params": 1}))
    assert "| model | a\\|b (1 params) |" in md.splitlines()


def test_ps_figures_are_metrics_not_one_point_charts():
    r = results(layout="ps", mesh={"workers": 2, "devices_per_worker": 1},
                ps={"push_latency_s": {"p50": 0.001}, "pull_latency_s": {"p50": 0.004},
                    "bytes_per_step": {"push": 1000.0, "pull": 1500.0},
                    "staleness": {"mean": 0.5, "max": 2}})
    m = run_metrics(r)
    assert (m["ps_push_p50_s"], m["ps_pull_p50_s"], m["ps_gib_per_step"],
            m["ps_staleness_mean"], m["ps_staleness_max"]) == (0.001, 0.004, 2500 / GIB,
                                                               0.5, 2.0)


PIPELINE = {"schedule": "interleaved", "stages": 2, "virtual": 2, "microbatches": 4,
            "bubble": 0.2, "analytic_bubble": 0.2, "analytic_bubble_formula": "(S-1)/(VM+S-1)",
            "live_activation_slots": 4,
            "stage_bytes": {"total": 4096, "analytic": 4096, "by_stage": [2048, 2048]},
            "memory": {"activation_stash_bytes": 1024, "activation_bytes_per_microbatch": 256,
                       "param_bytes_by_stage": [100, 100]}}


def test_a_pipeline_run_has_its_schedule_as_a_column_and_bubble_and_stage_bytes_as_metrics():
    r = results(layout="tp_pp", mesh={"stage": 2, "data": 1, "fsdp": 1, "tensor": 2},
                pipeline=PIPELINE)
    hp = run_hparams(r)
    assert hp["schedule"] == "interleaved-v2"
    assert hp["mesh"] == "data:1,stage:2,tensor:2"  # what --mesh takes back
    from jaxdist.writers import METRICS
    from jaxdist.writers import FIGURES
    m = run_metrics(r)
    assert (m["pp_bubble"], m["pp_stage_gib"]) == (0.2, 4096 / GIB)
    tags = [tag for tag, _ in METRICS]
    assert "pp_bubble" in tags and "pp_stage_gib" in FIGURES  # a column; a trial/ scalar
    assert "schedule" not in run_hparams(results())  # absent, not empty, for others


def test_memory_metrics_are_among_the_five_shown_by_default_and_times_say_functional():
    from jaxdist.writers import METRICS
    first = [tag for tag, _ in METRICS[:4]]
    assert first == ["step_time_p50_s", "state_{unit}_per_device", "compiler_bound_{unit}",
                     "measured_peak_{unit}"]
    titles = dict(METRICS)
    for tag in ("step_time_p50_s", "ktokens_per_s"):
        assert "functional only if simulated" in titles[tag]


def test_a_pipeline_mesh_reads_the_same_in_the_summary_and_parses_back():
    from jaxdist.mesh import MeshShape, parse_mesh
    shape = MeshShape(2, 1, 2, 1, 2)
    r = results(layout="tp_pp", mesh=shape.axis_sizes, pipeline=PIPELINE)
    assert row(r, "layout / mesh") == \
        "tp_pp on stage=2 x data=2 x fsdp=1 x tensor=2 (--mesh data:2,stage:2,tensor:2)"
    assert parse_mesh(shape.spec) == shape
    assert parse_mesh(run_hparams(r)["mesh"]) == shape
    assert row(results(), "layout / mesh") == "fsdp on data=2 x fsdp=4 (--mesh 2x4)"
