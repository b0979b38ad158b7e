"""``python -m logdx.synth ...``"""

import sys

from logdx.synth.cli import main

sys.exit(main())
