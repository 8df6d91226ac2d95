"""`python -m experiments.report RUNS_DIR [--out DIR]`: the study report. The code lives in
analysis.report (readers of results.json, no jax); this name stays the entry point."""

import sys

from analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
