"""scripts/chaos_ps.py --quick: real shard servers, launchers and workers on 127.0.0.1 under
kill -9 and SIGSTOP, the malformed-push corpus, pushes from the future, overflowing
gradients, idle streams and bytes on the data port. Every row of its table must hold,
within a minute."""

import subprocess
import sys

from tests.helpers import ROOT

ROWS = ["malformed-push corpus", "wire edge cases", "data port (TCP)", "push step 10**9 (async)",
        "2 x 3e38 gradient (sync)", "3e38 gradient (async, adamw)",
        "20 idle streams + 20 parked pulls (sync)", "SIGSTOP worker 1 (ssp)",
        "SIGSTOP worker 1 (sync)", "kill -9 worker 1 (async)", "SIGSTOP shard 0 (sync)"]


def test_chaos_quick_every_row_holds():
    proc = subprocess.run([sys.executable, "scripts/chaos_ps.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    table = [line for line in lines if " | " in line][1:]      # rows after the header
    names = [row.split(" | ")[0].strip() for row in table]
    assert len(names) == len(ROWS)
    assert all(name.startswith(want) for name, want in zip(names, ROWS)), names
    for row in table:
        cells = [c.strip() for c in row.split(" | ")]
        assert cells[-1] == "yes" and cells[-2] == "0", row      # held, no orphans
    assert f"{len(ROWS)}/{len(ROWS)} rows held" in proc.stdout
