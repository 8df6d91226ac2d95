from experiments.run import main
import sys

sys.exit(main())
