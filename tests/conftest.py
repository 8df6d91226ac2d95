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


# Tests that start servers or several processes on 127.0.0.1 ports (jax.distributed
# coordinators, gRPC shard servers, gloo, tensorboard) run on one xdist worker, one at a
# time: under `make test -n 2` a two-process run once failed at exit while other such tests
# ran beside it, never alone (a port or coordination-service clash is the suspect).
PORT_TESTS = {"test_multiprocess.py", "test_interrupt.py", "test_ps_run.py",
              "test_ps_server.py", "test_chaos_ps.py", "test_torch_ref.py",
              "test_compare.py", "test_tensorboard.py", "test_record.py"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in PORT_TESTS:
            item.add_marker(pytest.mark.xdist_group("ports"))


def pytest_runtest_logreport(report):
    """A flaky test that passed on a rerun must still show why it failed: print the failed
    attempt's report (on the xdist controller too, so CI's log keeps it)."""
    if report.outcome == "rerun":
        import sys
        print(f"\n=== RERUN {report.nodeid} ({report.when}): the failed attempt ===\n"
              f"{report.longreprtext[-6000:]}\n=== end of the failed attempt ===",
              file=sys.stderr)
