import sys

from experiments.suite.cli import main

sys.exit(main())
