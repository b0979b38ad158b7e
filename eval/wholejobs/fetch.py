#!/usr/bin/env python3
"""Re-create eval/wholejobs/NNN.log from git mirrors of the repositories its labels cite (stdlib only).

    python eval/wholejobs/fetch.py --mirrors DIR [--out DIR] [--ids 001,009]

Every case is a whole job's own output file committed to a public repository, taken as it is (no recipe needed);
each is checked against its label (the root line exactly at root_line_no). Mirrors: see eval/mirrorcut.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))               # eval/, for the module both evaluation sets share

from mirrorcut import Recipe, main  # noqa: E402

RECIPES: dict[str, Recipe] = {}                    # whole files only: the default cut

if __name__ == "__main__":
    sys.exit(main(HERE, RECIPES))
