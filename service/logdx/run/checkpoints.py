"""The last checkpoint the log says was saved: what `--resume-arg` points a restart at."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_MEGATRON = re.compile(r"successfully saved checkpoint (?:at|from) iteration\s+(\d+) to (\S+)", re.I)
_DS_SAVING = re.compile(r"(?:Saving model checkpoint: |\[Torch\] Saved )(\S+)")
_DS_READY = re.compile(r"Checkpoint (\S+) is ready now")
_HF = re.compile(r"Saving model checkpoint to (\S+)")
_LIGHTNING = re.compile(r"saving model to ['\"]?([^'\"\s]+)")
_GENERIC = re.compile(r"(?:saved checkpoint|checkpoint saved) (?:to|at|in) ['\"]?([^'\"\s]+)", re.I)
_STEP_IN_PATH = re.compile(r"(?:global_step|checkpoint-|step=|iter_|iteration[_-]?)(\d+)")
_TRAILING = "'\".,;:!)]"


@dataclass
class Checkpoint:
    checkpoint: str  # the path as logged (file or directory)
    checkpoint_dir: str  # what a load option takes (see CheckpointTracker)
    iteration: int | None
    line: str
    framework: str

    def values(self) -> dict[str, str]:
        return {
            "checkpoint": self.checkpoint,
            "checkpoint_dir": self.checkpoint_dir,
            "iteration": "" if self.iteration is None else str(self.iteration),
        }


class CheckpointTracker:
    """The last checkpoint the log says was saved successfully.

    `{checkpoint_dir}` is what the framework's load option takes: Megatron's save dir (`--load`),
    DeepSpeed's root holding `global_stepN` (`load_checkpoint(dir)`), HF Trainer's `checkpoint-N`
    directory (`resume_from_checkpoint`), the directory of a Lightning `.ckpt`. `{checkpoint}` is
    the path exactly as logged (the `.ckpt` file for Lightning) and `{iteration}` the step."""

    def __init__(self) -> None:
        self.last: Checkpoint | None = None
        self._ds_pending: str | None = None

    @staticmethod
    def interesting(line: bytes) -> bool:
        return b"heckpoint" in line or b"aving model" in line or b"HECKPOINT" in line

    def feed(self, text: str) -> Checkpoint | None:
        found = self._parse(text)
        if found is not None:
            self.last = found
        return found

    def _parse(self, text: str) -> Checkpoint | None:
        m = _MEGATRON.search(text)
        if m:
            path = _clean(m.group(2))
            return Checkpoint(path, path, int(m.group(1)), text, "megatron")
        m = _DS_READY.search(text)
        if m:
            tag = _clean(m.group(1))
            step = _STEP_IN_PATH.search(tag)
            pending, self._ds_pending = self._ds_pending, None
            root = tag_dir = ""
            if pending and f"/{tag}" in pending:
                tag_dir = pending[: pending.index(f"/{tag}") + len(tag) + 1]
                root = os.path.dirname(tag_dir)
            return Checkpoint(tag_dir or tag, root, int(step.group(1)) if step else None, text, "deepspeed")
        m = _DS_SAVING.search(text)
        if m:
            self._ds_pending = _clean(m.group(1))
            return None
        m = _HF.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, path, _step(path), text, "hf")
        m = _LIGHTNING.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, os.path.dirname(path) or ".", _step(path), text, "lightning")
        m = _GENERIC.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, path, _step(path), text, "generic")
        return None


def _clean(path: str) -> str:
    return path.rstrip(_TRAILING).strip("'\"")


def _step(path: str) -> int | None:
    m = _STEP_IN_PATH.search(path)
    return int(m.group(1)) if m else None
