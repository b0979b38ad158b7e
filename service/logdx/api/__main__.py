"""`python -m logdx.api [--host H --port P ...]`: run the service (same as `logdx serve`)."""

import sys

from logdx.api.server import main

sys.exit(main())
