"""`python -m benchmarks.testbed` (see benchmarks.testbed.cli)."""

import sys

from benchmarks.testbed.cli import main

sys.exit(main())
