"""`python -m logdx` is the `logdx` command."""

import sys

from logdx.cli import main

sys.exit(main())
