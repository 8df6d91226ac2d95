"""In-process tests run on 8 simulated CPU devices; the count is fixed before any backend
starts, which is why this sits in conftest (imported before every test module).

XLA's CPU optimisation level 0 cuts compile time about 4x (a ResNet init: 1.7 s against 7 s
on 2 cores), the legacy (non fusion-emitter) CPU path halves it again for CNNs, and one LLVM
module per program instead of XLA's split into parallel codegen pieces takes another 20-40%
of a step's compile CPU (gpt-tiny fsdp 0.70 s against 0.92, densenet-tiny 1.1 s against 2.0): the
pieces only pay off on idle cores, and the suite keeps both busy. Tests compare numbers
between layouts compiled the same way, never speed. The device-less XLA:GPU compiles hand
their PTX to ptxas at -O0 (about 15% of such a test's time): the tests read the HLO, its
schedule and buffers, never the machine code.

Everything here is set in the environment, so the processes the tests start (runs, PS
shards and workers, plans) inherit it through tests.helpers.child_env:
- the fast XLA flags above;
- JAX_PLATFORMS=cpu: no process probes for a CUDA driver this machine does not have;
- one persistent JAX compilation cache for the processes the tests start
  (tests.helpers.CHILD_CACHE_ENV: a PS run's workers, the runs of test_run_cli/test_record/...
  compile the same tiny programs again and again); file-locked (its size cap turns the lock
  on), so two processes never read an entry half written. Not in the xdist workers
  themselves: they wrote 741 entries in a suite (68 s of CPU, 80-107 ms each) and read back
  362 hits that saved 15.4 s of compile, measured with jax's cache events;
- one XLA:GPU kernel cache per xdist worker (jaxdist.program.compiled.KERNEL_CACHE_ENV), which the
  worker's device-less compiles and its children's reuse in turn (never two writers at once).
The folder is made by the process pytest started (the xdist controller), and removed by it.
"""

import os
import tempfile
from pathlib import Path

FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
                  " --xla_cpu_parallel_codegen_split_count=1"
                  " --xla_gpu_disable_gpuasm_optimizations=true")
_SESSION_ENV = "JAXDIST_TEST_SESSION_DIR"
OWNS_SESSION_DIR = _SESSION_ENV not in os.environ  # xdist workers inherit the controller's
if OWNS_SESSION_DIR:
    os.environ[_SESSION_ENV] = tempfile.mkdtemp(prefix="jaxdist-tests-")
SESSION_DIR = Path(os.environ[_SESSION_ENV])

if FAST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # workers inherit the controller's
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAGS}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAXDIST_XLA_KERNEL_CACHE"] = str(
    SESSION_DIR / f"xla-kernels-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.bin")

# A pytest started as a background job of a non-interactive shell (CI runners, `cmd &` in a
# script) begins with SIGINT ignored, and an ignored signal stays ignored across exec: every
# run a test starts would then ignore the Ctrl-C the test sends (jaxdist.stop keeps a
# signal its parent ignored, as nohup'd programs expect) and the test would wait out its
# timeout. Python's own handler is reset to the default by exec, so children get SIGINT back.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


# Modules whose fixtures start runs (a PS job, torch ranks, a suite, CLI runs): under `make
# test -n 2 --dist loadgroup` all of a module's tests go to one xdist worker, so each fixture
# runs once instead of once per worker. Those fixtures are session-scoped: a worker may run
# other modules' tests between a group's, and a module-scoped fixture would be made again.
SHARED_FIXTURES = {"test_compare.py", "test_equivalence.py", "test_ps_record.py",
                   "test_ps_run.py", "test_ps_server.py", "test_record.py", "test_run_cli.py",
                   "test_run_dirs_safety.py", "test_suite_report.py",
                   "test_tensor_parallel.py", "test_tensorboard.py", "test_torch_ref.py",
                   "test_ps_tcp.py"}


# First: xdist's worker reads the xdist_group marks in its own modifyitems hook, which could
# otherwise run before this one and miss them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
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


def pytest_sessionfinish(session):
    """The process that made the session's caches removes them; xdist workers leave them to
    the controller."""
    if OWNS_SESSION_DIR:
        import shutil
        shutil.rmtree(SESSION_DIR, ignore_errors=True)
