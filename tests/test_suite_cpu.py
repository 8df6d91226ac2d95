"""scripts/suite_cpu.py: each test's own CPU and its children's, read back from a real pytest
run on an xdist worker (the plugin must reach a worker process for the suite's figures)."""

import re
import subprocess
import sys

from tests.helpers import ROOT, child_env

PROBE = '''
import subprocess, sys, time

SPIN = "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"

def test_own():
    exec(SPIN)

def test_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)
'''


def test_own_and_child_cpu_are_told_apart_on_a_worker(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "suite_cpu.py"), "--top", "5", "-q",
         "-p", "no:cacheprovider", "-n", "1", "test_probe.py"],
        cwd=tmp_path, env=child_env(TMPDIR=str(scratch)), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {m.group(4): (float(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"^ +([\d.]+) +([\d.]+) +([\d.]+)  (test_probe\.py::\w+)$",
                                 proc.stdout, re.M)}
    own, child = rows["test_probe.py::test_own"], rows["test_probe.py::test_child"]
    assert own[0] >= 0.35 and own[1] == 0.0        # 0.4 s spun in the worker itself
    assert child[1] >= 0.35 and child[0] < 0.3     # 0.4 s spun in the process it started
    totals = re.search(r"^2 tests \(run or skipped\): ([\d.]+) s of CPU, ([\d.]+) s in the "
                       r"pytest processes and ([\d.]+) s in the processes", proc.stdout, re.M)
    assert totals and float(totals.group(3)) >= 0.35
    assert not list(scratch.glob("jaxdist-suite-cpu-*"))  # its log folder is removed
