"""In-process tests run on 8 simulated CPU devices; the count is fixed before any backend
starts, which is why this sits in conftest (imported before every test module).

XLA's CPU optimisation level 0 cuts compile time about 4x (a ResNet init: 7 s -> 1.7 s on
2 cores), and the legacy (non fusion-emitter) CPU path halves it again for CNNs. Tests compare numbers between layouts compiled the same way, never speed.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


# Modules whose module-scoped fixtures start runs (a PS job, torch ranks, a suite, CLI runs):
# under `make test -n 2 --dist loadgroup` all of a module's tests go to one xdist worker, so
# each fixture runs once instead of once per worker. (A "ports" group once kept every
# process- and port-using test on one worker, for a two-process failure at exit that was in
# fact the interrupted run's hparams crash, fixed since: writers.hparams_summaries.)
SHARED_FIXTURES = {"test_compare.py", "test_equivalence.py", "test_ps_record.py",
                   "test_ps_run.py", "test_ps_server.py", "test_record.py", "test_run_cli.py",
                   "test_run_dirs_safety.py", "test_suite_report.py",
                   "test_tensor_parallel.py", "test_tensorboard.py", "test_torch_ref.py"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in SHARED_FIXTURES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def pytest_runtest_logreport(report):
    """A flaky test that passed on a rerun must still show why it failed: print the failed
    attempt's report (on the xdist controller too, so CI's log keeps it)."""
    if report.outcome == "rerun":
        import sys
        print(f"\n=== RERUN {report.nodeid} ({report.when}): the failed attempt ===\n"
              f"{report.longreprtext[-6000:]}\n=== end of the failed attempt ===",
              file=sys.stderr)
