"""`python -m experiments.compare RUNS... [--published] [--out DIR]`: JAX vs PyTorch and
published figures. The code lives in analysis.compare (readers of results.json, no jax);
this name stays the entry point."""

import sys

from analysis.compare import main

if __name__ == "__main__":
    sys.exit(main())
