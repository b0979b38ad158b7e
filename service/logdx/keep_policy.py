"""The keep policy: which lines the compressor keeps whole, and why (`KeptLine.reason`).

Most lines of a training log are counted, not kept (`compress.py`). A line is kept whole when it may matter to
the diagnosis: an error-bearing line (up to a quota per template), a traceback and the message after it, a
block (a stack dump, a flight-recorder report), a loss anomaly, the first lines of each template; the last lines
of each source are kept when the stream ends (its tail). `KeepPolicy` is that decision as a seam: the compressor
asks its policy only about lines that may be kept (in a traceback or a block, the start of one, an error or
loss anomaly, one of a template's first `CompressConfig.first_lines_per_template` lines) - the common line, a
repeat of a known shape, never reaches it. `DefaultKeepPolicy` is logdx's; another one is given to the
`Compressor` (`keep_policy=`) or to the `Engine` (`Engine.keep_policy`, a factory of the `CompressConfig`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from logdx.compress_config import CompressConfig
from logdx.flightrec.frtext import is_report_line
from logdx.mining import Shape
from logdx.model import Record, TemplateStats
from logdx.patterns import (
    TRACEBACK_START,
    exception_line,
    is_interleaved_stray,
    is_traceback_body,
    strip_traceback_prefix,
    traceback_prefix,
)
from logdx.procs import PsColumns
from logdx.stacks import classify_line


@dataclass(slots=True)
class SourceState:
    """One source's state (a rank, a host: `Record.source_key`): the keep policy's (in a traceback, a block),
    and the compressor's (its tail, progress timing, the section or `ps` listing it is printing)."""

    tail: deque[Record]
    in_traceback: int = 0  # lines left in the current traceback, 0 when not in one
    after_exception: int = 0  # continuation lines of an exception message still to keep
    tb_prefix: str = ""  # what the logger writes before each traceback line
    tb_writers: int = 0  # tracebacks begun in the current one: several processes printing into one stream
    tb_strays: int = 0  # lines in a row among those that are no body (see patterns.is_interleaved_stray)
    in_block: int = 0  # lines left in the current block (see mining.Shape.block), 0 when not in one
    block_kind: str = ""
    last_progress_ts: float | None = None
    interval_ema: float | None = None
    last_line: int = 0  # its last line of any kind, and that line's time: which rank went quiet
    last_ts: float | None = None
    quiet: int = 0  # its lines without an error word: did it go on doing its work?
    # The name the line before its stack dumps gave them (a node's file, a host: stacks.section_name), and how
    # many lines since that line or the last dump line: a name stops naming dumps a few lines after them.
    section: str | None = None
    section_gap: int = 0
    ps: PsColumns | None = None  # the columns of the `ps` listing being printed
    # Its last line of its own work (no error word, outside a traceback or a dump) and that line's time: a rank
    # still printing while the others wait in a collective (diagnose/timeouts.py).
    last_work: Record | None = None


class KeepPolicy(Protocol):
    """Which lines are kept whole. Asked in the compressor's hot loop, but only for lines that may be kept (see
    the module's doc); it may advance the source's traceback and block state (`SourceState.in_traceback`,
    `after_exception`, `in_block`...), which decides which later lines are asked. It must pickle (a session's
    snapshot holds it)."""

    @property
    def tail_lines(self) -> int:
        """Per source, how many of its last lines are kept when the stream ends (0: none)."""
        ...

    def reason(self, rec: Record, shape: Shape, stats: TemplateStats, src: SourceState, loss_anomaly: bool,
               kept: int) -> str | None:
        """Why this line of `src` is kept whole ("error", "traceback", "stack", "new_template"...), or None.
        `stats` is its template's (its `count` includes this line), `kept` how many lines were kept so far."""
        ...

    def room(self, kept: int, soft: bool = False) -> bool:
        """Whether the budget allows one more line kept (`soft`: a line only kept while there is plenty)."""
        ...


@dataclass(slots=True)
class DefaultKeepPolicy:
    """logdx's policy: errors up to `kept_per_error_template` per template, tracebacks and blocks up to their
    length caps, loss anomalies, a template's first lines while half the budget is left, within
    `max_kept_lines` in all; `tail_lines_per_source` tail lines per source."""

    config: CompressConfig

    @property
    def tail_lines(self) -> int:
        return self.config.tail_lines_per_source

    def reason(self, rec: Record, shape: Shape, stats: TemplateStats, src: SourceState, loss_anomaly: bool,
               kept: int) -> str | None:
        text = rec.text
        if src.in_block or shape.block:
            reason = self._block_step(text, shape, src, kept)
            if reason is not None:
                return reason
        if src.in_traceback:
            return self._traceback_step(strip_traceback_prefix(text, src.tb_prefix), src)
        if src.after_exception:
            text = strip_traceback_prefix(text, src.tb_prefix)
            src.after_exception -= 1
            if text and not text[0].isspace() and TRACEBACK_START not in text and self.room(kept):
                return "traceback"
            src.after_exception = 0
        if TRACEBACK_START in text:
            src.in_traceback = self.config.max_traceback_lines
            src.tb_prefix = traceback_prefix(text)
            src.tb_writers, src.tb_strays = 1, 0
            return "traceback"
        if loss_anomaly:
            return "loss"
        if shape.error:
            # Lines that never repeat share one template: its quota would let a flood hide the one
            # real error among them, so only the overall budget bounds them.
            if (stats.kept < self.config.kept_per_error_template or stats.template_id == -3) and self.room(kept):
                if exception_line(text):  # a stray exception line: its message may go on, as after a traceback
                    src.after_exception = 3
                return "error"
            return None
        if stats.count <= self.config.first_lines_per_template and self.room(kept, soft=True):
            return "new_template"
        return None

    def _block_step(self, text: str, shape: Shape, src: SourceState, kept: int) -> str | None:
        """A block's lines are kept whole, up to `max_block_lines` per block; None: not one (any more)."""
        if shape.block:
            src.in_block, src.block_kind = self.config.max_block_lines, shape.block
        elif not (classify_line(text) is not None if src.block_kind == "stack" else is_report_line(text)):
            src.in_block = 0
            return None
        src.in_block -= 1
        return src.block_kind if self.room(kept) else None

    def _traceback_step(self, text: str, src: SourceState) -> str:
        src.in_traceback -= 1
        if TRACEBACK_START in text:
            src.tb_writers += 1  # another process's, into the same stream
            return "traceback"
        if is_traceback_body(text):
            src.tb_strays = 0
            return "traceback"
        if is_interleaved_stray(text, src.tb_writers, src.tb_strays):
            src.tb_strays += 1
            return "traceback"
        # The first line back at the margin is the exception itself; its message may go on.
        src.in_traceback = 0
        src.after_exception = 3
        return "traceback"

    def room(self, kept: int, soft: bool = False) -> bool:
        budget = self.config.max_kept_lines
        return kept < (budget // 2 if soft else budget)
