"""How long bad input takes to be refused: `python -m experiments.run --layout fdsp` (a
misspelled layout), `--layout hsdp --mesh 8` (a degenerate one) and the launcher's refusal
of a mesh that does not split over its processes, each started as a user starts it (a new
process). Prints the median of N starts and its ratio to the 2 s target; exits 1 if a
refusal is not exit 2 with one line.

    .venv/bin/python scripts/bench_refusal.py [--repeats 5]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.errors import OneLineParser

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 2.0
CASES = {
    "misspelled layout": ["-m", "experiments.run", "--layout", "fdsp", "--mesh", "8"],
    "degenerate layout": ["-m", "experiments.run", "--layout", "hsdp", "--mesh", "8"],
    "launcher, mesh split": ["-m", "experiments.launch", "--processes", "2", "--",
                             "--mesh", "3x1", "--batch-size", "6"],
}


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parser.require_at_least(args, repeats=1)
    ok = True
    for name, argv in CASES.items():
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                                  text=True)
            seconds.append(time.perf_counter() - start)
            lines = proc.stderr.strip().splitlines()
            if proc.returncode != 2 or len(lines) != 1:
                ok = False
                print(f"{name}: exit {proc.returncode}, {len(lines)} line(s): "
                      f"{proc.stderr[-500:]}")
        median = statistics.median(seconds)
        print(f"{name:22s} median {median:.2f} s of {args.repeats} starts; "
              f"{median / TARGET_S:.2f} x the {TARGET_S:.0f} s target; {lines[0] if lines else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
