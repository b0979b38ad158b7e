"""Long quiet phases that are not hangs: a checkpoint save or an evaluation in progress.

Training prints nothing while it writes a 500 GB checkpoint or runs a long evaluation; `logdx run`
must not call that a stall. The frameworks say when such a phase starts, and usually when it ends:

| framework | starts | ends |
|---|---|---|
| Megatron-LM | `saving checkpoint at iteration N to DIR`, `Evaluating iter i/n` | `successfully saved checkpoint`, `validation loss at iteration` |
| DeepSpeed | `[Torch] Checkpoint TAG is about to be saved!`, `Saving model checkpoint: PATH` | `Checkpoint TAG is ready now!` |
| HF Trainer | `Saving model checkpoint to DIR`, `***** Running Evaluation *****` | `'eval_loss':` (its metrics) |
| Lightning | `saving model to PATH`, `Validation DataLoader 0:` | the next progress line |
| others | `Saving checkpoint`, `Running evaluation`, `Evaluating` | `checkpoint saved`, `evaluation finished` |

The next training progress line ends any phase too. While one is in progress the stall timer is
paused, for at most `hangs.pause_max_s` (`--pause-max`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_STARTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("checkpoint save", re.compile(r"saving checkpoint at iteration\s+\d+", re.I)),
    ("checkpoint save", re.compile(r"\[Torch\] Checkpoint \S+ is about to be saved")),
    ("checkpoint save", re.compile(r"Saving model checkpoint(?: to|:)")),
    ("checkpoint save", re.compile(r"saving model to ['\"]?\S")),
    ("checkpoint save", re.compile(r"\b(?:saving|writing)(?: the)? checkpoint\b", re.I)),
    ("evaluation", re.compile(r"\*+ Running Evaluation \*+|\bRunning evaluation\b", re.I)),
    ("evaluation", re.compile(r"\bEvaluating iter\b|^\s*Evaluating\b|\bstarting evaluation\b", re.I)),
    ("evaluation", re.compile(r"\bValidation DataLoader \d+\b|^\s*Validation(?: sanity check)?:", re.I)),
)
_ENDS: tuple[re.Pattern[str], ...] = (
    re.compile(r"successfully saved checkpoint", re.I),
    re.compile(r"Checkpoint \S+ is ready now"),
    re.compile(r"\bcheckpoint (?:saved|written)\b|\bsaved checkpoint\b", re.I),
    re.compile(r"validation loss at iteration", re.I),
    re.compile(r"['\"]eval_loss['\"]\s*:"),
    re.compile(r"\bevaluation (?:done|finished|complete[d]?)\b", re.I),
)
_HINTS = (b"heckpoint", b"HECKPOINT", b"aving model", b"valuat", b"VALUAT", b"alidation", b"eval_loss")


@dataclass(frozen=True, slots=True)
class Phase:
    what: str  # "checkpoint save" | "evaluation"
    line: str


def interesting(line: bytes) -> bool:
    """A cheap test before the regular expressions: most lines are not about a save or an evaluation."""
    return any(h in line for h in _HINTS)


def phase_change(text: str) -> Phase | None | bool:
    """A `Phase` when `text` starts one, True when it ends one, None when it says neither."""
    for pattern in _ENDS:
        if pattern.search(text):
            return True
    for what, pattern in _STARTS:
        if pattern.search(text):
            return Phase(what, text.strip()[:200])
    return None
