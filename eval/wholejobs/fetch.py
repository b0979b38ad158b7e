#!/usr/bin/env python3
"""Re-create eval/wholejobs/NNN.log from git mirrors of the repositories its labels cite (stdlib only).

    python eval/wholejobs/fetch.py --mirrors DIR [--out DIR] [--ids 001,009]

Every case is a whole job's own output file committed to a public repository, taken as it is (no recipe needed);
each is checked against its label (the root line exactly at root_line_no). Where a mirror may live: see
eval/mirrorcut.py. The mirrors the labels cite (a clone of the default branch alone lacks some of these commits):

    bigscience-workshop/bigscience      001-005
    microsoft/DeepSpeedExamples         006-009, 036   (009: a merged branch's commit)
    microsoft/Megatron-DeepSpeed        010
    THUDM/GLM-130B                      011-021, 037
    MarioPasc/MU-Diff                   022-024
    pytorch/torchtitan                  025-030        (branch autoresearch-parallelize/may19-qwen3-14b)
    EleutherAI/gpt-neox                 031-032        (branches llemma-f, filtering_training)
    NVIDIA/Megatron-LM                  033-034        (pull request 3213's head)
    jpata/particleflow                  035            (pull request 104's head)
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
