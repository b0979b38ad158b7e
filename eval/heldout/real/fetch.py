#!/usr/bin/env python3
"""Re-create eval/heldout/real/NNN.log from git mirrors of the sources its labels cite (stdlib only).

    python eval/heldout/real/fetch.py --mirrors DIR [--out DIR] [--ids 001,004]

DIR holds one git mirror per cited repository (eval/mirrorcut.py says which layouts are found). Each log is cut as
the table below says, then checked: the label's root line must be exactly line root_line_no. Cases citing an issue
thread (020-025) cannot be re-created: no git mirror holds a thread's text.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))           # eval/, for the module both evaluation sets share

from mirrorcut import Recipe, main  # noqa: E402

# Cases not listed take the default: the code blocks of the cited section that hold the root line (or an
# alternative of it). A case without a root line (healthy runs, silent hangs) names its blocks.
RECIPES: dict[str, Recipe] = {
    "002": Recipe(blocks=(0,), why="the spike's iteration lines (not the block of checkpoint paths after it)"),
    "003": Recipe(blocks=(0,), why="the silent log: the last iteration, the eval result, then only PULSE lines"),
    "004": Recipe(blocks=(2, 3, 4, 5, 6), captions=True,
                  why="the five py-spy dumps of the 2-node repro under their node/group captions"),
    "005": Recipe(blocks=(2, 3), why="the grouped py-spy summary of the 48 nodes, then the DataLoader stack"),
    "008": Recipe(blocks=(0,), why="the section's one log block"),
    "013": Recipe(blocks=(2, 3, 4, 8, 15, 16),
                  why="the log's last lines, the py-spy attempt, a barrier stack, the failed py-spy of rank 0 "
                      "(twice), ps showing it in D state"),
    # The commit the label cites holds an earlier text of the tutorial without the torchfrtrace example; this
    # later commit has the example with the label's root line and alternatives word for word.
    "019": Recipe(commit="0052a445bbd575c0bc24173c7f965530c1fd49ca", why="the torchfrtrace output block"),
}

if __name__ == "__main__":
    sys.exit(main(HERE, RECIPES))
