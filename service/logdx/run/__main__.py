"""`python -m logdx.run [options] -- CMD ...`: the same as `logdx run`."""

import sys

from logdx.run.cli import main

sys.exit(main())
