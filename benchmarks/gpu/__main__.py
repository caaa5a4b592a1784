import sys

from benchmarks.gpu.cli import main

sys.exit(main())
