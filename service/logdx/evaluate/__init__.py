"""``make eval``: measure logdx on labelled real excerpts and on whole realistic jobs.

Five sets, each scored with the same columns (status, category, action, failure type, root line,
culprit where labelled, crashes called healthy, healthy runs called failed; with the exit code known
too), one row per cascade (``rules``, ``default``):

* ``excerpts``: the labelled real logs (``eval/corpus``: 208 excerpts from public threads, each with its
  source URL and a thread-settled label; the shared development sample) — ``corpus.py``;
* ``buried``: each excerpt buried in a realistic long multi-rank job (8-128 ranks, seven launcher
  styles, start-up noise, recovered warnings, checkpoints, evaluations, the failure's cascade), labelled
  by the excerpt's label — ``buried.py``;
* ``healthy``, ``hangs``, ``divergence``: whole jobs written by ``logdx.synth`` (``healthy.py``,
  ``hangs.py``, ``divergence.py``), labelled by their generators — ``jobs.py`` (hang culprits: rank and
  host; divergences: the step, within two logging intervals).

``runner.py`` reads each log once and diagnoses it with each cascade; ``tables.py`` prints the tables
and the one-screen summary; ``cli.py`` is ``python -m logdx.evaluate``. The labelled logs are for
measuring: nothing in logdx may be keyed to them.
"""

from __future__ import annotations

from logdx.evaluate.buried import (
    burial_culprit_named,
    buried_culprit_correct,
    buried_root_line_correct,
    bury_variants,
    label_culprit_rank,
    score_buried,
)
from logdx.evaluate.cli import main
from logdx.evaluate.corpus import (
    CaseResult,
    calibration,
    confusion,
    culprit_correct,
    evaluate,
    load_cases,
    load_labels,
    root_line_correct,
    score_case,
    summarize,
)
from logdx.evaluate.jobs import report_divergence_step, score_job

__all__ = [
    "CaseResult", "burial_culprit_named", "buried_culprit_correct", "buried_root_line_correct", "bury_variants",
    "calibration", "confusion", "culprit_correct", "evaluate", "label_culprit_rank", "load_cases", "load_labels",
    "main", "report_divergence_step", "root_line_correct", "score_buried", "score_case", "score_job", "summarize",
]
