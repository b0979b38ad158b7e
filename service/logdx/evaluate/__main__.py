import sys

from logdx.evaluate.cli import main

sys.exit(main())
