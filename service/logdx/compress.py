"""Stage 2: compress the stream in real time with Drain template mining.

Millions of lines of a training log are a few hundred templates: progress lines, NCCL init, a
config dump. The compressor counts each template (who emitted it, first/last line, one sample)
and keeps in full only the lines that can matter: error-bearing lines, tracebacks, the first
occurrences of each template, and the last lines of each rank. Everything else is a count.

The hot path is the repeated line. Masking numbers, hex, IPs and paths turns a progress line into
a string already seen, and a dict lookup on that string replaces the Drain tree search; whether a
masked line is error-bearing or a progress line is decided once per distinct masked line too.

`Compressor` is the orchestration over three parts, as drain3 keeps its algorithm apart from its
`TemplateMiner`: template mining (`mining.py`: Drain's tree, the shapes cache, variants, the reported
templates), the keep policy (`keep_policy.py`: which lines are kept whole, a `KeepPolicy` one may swap)
and the topology (`topology.py`: which rank ran on which host, GPU, process). The per-line loop in `add`
stays inlined here (dict lookups and attribute reads, no call per common line); the parts are called on
a new shape, on a line that may be kept, on a line that names the topology.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from logdx.compress_config import CompressConfig
from logdx.flightrec.frtext import is_report_start
from logdx.keep_policy import DefaultKeepPolicy, KeepPolicy, SourceState
from logdx.mining import Shape, TemplateMiner
from logdx.model import CompressionSummary, KeptLine, ProgressSummary, Record, TemplateStats
from logdx.patterns import MASK, PARAM, TRACEBACK_START
from logdx.procs import ProcessState, aux_row, header_columns, row_in
from logdx.stacks import is_stack_start, section_name
from logdx.timeline import (
    LossSignal,
    Timeline,
    checkpoint_step_of,
    is_completion,
    may_count,
    progress_shape_of,
)
from logdx.topology import Topology, is_topology_line

__all__ = ["CompressConfig", "Compressor", "DefaultKeepPolicy", "KeepPolicy"]

# Words that make a line worth keeping whole. Judged on the masked line, once per distinct line.
_ERROR_WORD_LIST = (
    "error", "exception", "traceback", "fail", "fatal", "abort", "kill", "sigterm", "sigkill", "sigabrt", "sigsegv",
    "sigbus", "segmentation", "signal", "exitcode", "exit code", "exit status", "xid", "nvrm", "ecc", "timeout",
    "timed out", "out of memory", "oom", "warn", "refused", "reset by peer", "broken pipe", "unreachable", "no space",
    "denied", "not found", "no such", "cannot", "can't", "unable", "invalid", "mismatch", "corrupt", "panic", "critical",
    "assert", "unexpected", "lost", "terminat", "cancel", "preempt", "stale", "hang", "stuck", "illegal", "uncorrectable",
    "nvlink", "retry", "rev ff", "does not exist", "not compatible", "unrecognized", "required", "deprecat",
    r"\bno attribute\b", "not defined", "undefined", "interrupt", "core dumped", "nccl (?:warn|error)",
    "slurmstepd", "srun: ", "shm", "bus error", "unhealthy", "degraded", "throttl",
)
_ERROR_WORDS = re.compile("|".join(_ERROR_WORD_LIST), re.IGNORECASE)


def _first_letter_alternation(alternatives: tuple[str, ...]) -> str:
    """The same alternation grouped by first letter ("e(?:rror|xception)|..."): a regex without
    IGNORECASE then only tries the words that can start at a position, not all of them."""
    groups: dict[str, list[str]] = {}
    for alt in alternatives:
        head = alt[0] if alt[0].isalpha() else alt  # escapes and the like stay whole
        groups.setdefault(head, []).append(alt[1:] if head != alt else "")
    return "|".join(head if rests == [""] else f"{head}(?:{'|'.join(rests)})" for head, rests in groups.items())


# Case-insensitive matching is slow in Python's regex engine (~60 µs on a 150-character line for
# _ERROR_WORDS). On ASCII text - nearly every line - IGNORECASE is the same as matching the lower-cased
# text with a lower-case pattern; text with other characters keeps the IGNORECASE pattern (it also
# folds some of them onto ASCII letters: "ſ" onto "s", the Kelvin sign onto "k").
_ERROR_WORDS_LOWER = re.compile(_first_letter_alternation(_ERROR_WORD_LIST))
assert all(a == a.lower() for a in _ERROR_WORD_LIST)


_WARN_LEVEL = re.compile(r"\bWARN(?:ING)?\b|\bwarning:", re.IGNORECASE)


def _only_warns(masked: str) -> bool:
    """The line's only error word is its level, WARNING (judged once per shape)."""
    return _WARN_LEVEL.search(masked) is not None and not has_error_word(_WARN_LEVEL.sub(" ", masked))


def has_error_word(masked: str) -> bool:
    """Whether a line bears one of the words that make it error-bearing (what the compressor keeps whole)."""
    if masked.isascii():
        return _ERROR_WORDS_LOWER.search(masked.lower()) is not None
    return _ERROR_WORDS.search(masked) is not None


_DIGITS = b"0123456789"
_TRACEBACK_START_BYTES = TRACEBACK_START.encode()


# Lines between a section's name and its dumps, or between its dumps ("4 in:", blanks, a markdown fence).
_SECTION_GAP = 6


@dataclass
class Compressor:
    config: CompressConfig = field(default_factory=CompressConfig)
    # Whatever else makes a line worth keeping (the rule packs' own patterns, so a site's rule
    # about a line without any error word still sees it). Asked once per shape, on its first line.
    also_error: Callable[[str], bool] | None = None
    # Which lines are kept whole (keep_policy.py), as `policy`; None: the DefaultKeepPolicy of the config.
    keep_policy: InitVar[KeepPolicy | None] = None

    def __post_init__(self, keep_policy: KeepPolicy | None) -> None:
        self.miner = TemplateMiner(self.config)
        self.topology = Topology(self.config)
        self.policy: KeepPolicy = keep_policy if keep_policy is not None else DefaultKeepPolicy(self.config)
        # The miner's shapes cache, read on every line (the same dict: the miner never replaces it).
        self._shapes: dict[bytes, Shape] = self.miner.shapes
        self._sources: dict[str, SourceState] = {}
        self._rank_keys: dict[int, str] = {}  # rank -> its source key
        self._kept_ids: set[int] = set()  # line numbers kept, so the tail does not repeat them
        self.lines_in = 0
        self.lines_kept = 0
        self._first_ts: float | None = None
        self._last_ts: float | None = None
        self._progress_lines = 0
        self._last_progress_line: dict[str, int] = {}
        self._last_finite_loss_line: dict[str, int] = {}
        self._last_progress_ts: float | None = None
        self.last_progress: Record | None = None  # the last progress line itself: a stall's anchor
        self.timeline = Timeline()
        self._quiet = 0  # lines without an error word, all sources

    # -- the hot path ----------------------------------------------------------------------------

    def add(self, rec: Record) -> list[KeptLine]:
        """Account for one record; returns the lines kept in full because of it (usually none)."""
        self.lines_in += 1
        # Lines that differ only in their digits share a shape: deleting digits from the bytes is
        # ten times cheaper than masking, so the regex runs once per shape, not once per line.
        text = rec.text
        encoded = text.encode("utf-8", "surrogatepass")
        key = encoded.translate(None, _DIGITS)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._new_shape(key, MASK.sub(PARAM, text), text)
        stats = shape.stats
        assert stats is not None  # _new_shape sets it
        line_no = rec.line_no
        stats.count += 1
        stats.last_line = line_no
        # Who emitted it, and when.
        if stats.count == 1:
            stats.first_line = line_no
            stats.sample = rec.raw
        topology = self.topology
        if topology.box is not None:
            topology.within_box(rec)
        rank, host, ts = rec.rank, rec.host, rec.ts
        if rank is not None or host is not None:
            topology.note_origin(rank, host, stats)
        if shape.topology:
            topology.note(rec, self.lines_in)
        if rank is not None:
            # Record.source_key is "r<rank>" whenever the rank is known: built once per rank.
            source_key = self._rank_keys.get(rank)
            if source_key is None:
                source_key = rec.source_key
                if len(self._rank_keys) < self.config.max_sources:
                    self._rank_keys[rank] = source_key
        else:
            source_key = rec.source_key
        src = self._source(source_key)
        src.last_line = line_no
        src.quiet += shape.quiet
        self._quiet += shape.quiet
        if ts is not None:
            if self._first_ts is None:
                self._first_ts = ts
            # The time the log reached, by line order: a max would let one mis-dated line (a stamp
            # without a year, an skewed host) stretch the log by months.
            self._last_ts = src.last_ts = ts
        if shape.work and not (src.in_traceback or src.in_block):
            src.last_work = rec
        signal = None
        if shape.progress is not None:
            signal = self._note_progress(rec, src, source_key, shape, encoded)
        elif shape.watch:
            self._watch_shape(key, shape, rec, source_key)
        if signal is not None and signal.kind == "diverged":
            # Confirmed only now, lines after it began: the line where it began stands for it.
            return [KeptLine(record=signal.record, template_id=stats.template_id, reason="loss",
                             divergence=signal.divergence)]
        loss_anomaly = signal is not None and signal.kind == "nan"
        listed = False  # a line of a collection of the nodes' dumps and listings (keeps its section open)
        if shape.collected or src.ps is not None:
            listed, kept = self._collection_line(rec, shape, stats, src)
            if kept is not None:
                return [kept]
        if (src.in_traceback or src.after_exception or shape.traceback or loss_anomaly or shape.error
                or src.in_block or shape.block or stats.count <= self.config.first_lines_per_template):
            # The keep policy is asked only here: the common line (a known shape, no error) never reaches it.
            reason = self.policy.reason(rec, shape, stats, src, loss_anomaly, self.lines_kept)
            if reason is not None:
                return [self._keep_in(src, rec, stats, reason, listed)]
        if src.section is not None:
            # An indented line is the section's own content (a summary of its frames, a file's lines): it keeps it open.
            self._in_section(src, None, listed or rec.raw[:1] in (" ", "\t"))
        # The common case: a line like many before it, remembered only in its source's tail.
        src.tail.append(rec)
        return []

    def _collection_line(self, rec: Record, shape: Shape, stats: TemplateStats,
                         src: SourceState) -> tuple[bool, KeptLine | None]:
        """A line of what an operator collected from the nodes of a hung job: the name of a node's part (a
        section header), a line of a `ps` listing; the row of a process in state D is kept. Returns (whether
        it is one of those, the line kept)."""
        if shape.section and (name := section_name(rec.text)) is not None:
            src.section, src.section_gap = name, 0
            return True, None
        if shape.ps_header is None and not shape.ps_row and src.ps is None:
            return False, None
        listed, stuck = self._ps_line(src, shape, rec.text)
        if stuck is not None and self.policy.room(self.lines_kept):
            kept = self._keep_in(src, rec, stats, "dstate", True)
            kept.process = stuck
            return True, kept
        return listed, None

    def _keep_in(self, src: SourceState, rec: Record, stats: TemplateStats, reason: str, listed: bool) -> KeptLine:
        """Keep a line of `src`, with the name of the section it is printed in (if it is a dump's, a process's)."""
        kept = self._keep(rec, stats, reason)
        if src.section is not None:
            self._in_section(src, kept, listed)
        return kept

    @staticmethod
    def _ps_line(src: SourceState, shape: Shape, text: str) -> tuple[bool, ProcessState | None]:
        """Whether the line is one of a `ps` listing (its header, a row), and the process of a row in state D
        that is no kernel thread."""
        if shape.ps_header is not None:
            src.ps = shape.ps_header
            return True, None
        row = None
        if src.ps is not None:
            row = row_in(text, src.ps)
            if row is None:
                src.ps = None
        if row is None and shape.ps_row:
            row = aux_row(text) if shape.ps_row == 2 else None
            return True, row
        if row is None:
            return False, None
        return True, row if row.uninterruptible and not row.kernel_thread else None

    @staticmethod
    def _in_section(src: SourceState, kept: KeptLine | None, listing: bool) -> None:
        """A dump's line (or a process's row in a `ps` listing) under a section's name carries that name;
        other lines end the section soon."""
        if kept is not None and kept.reason in ("stack", "dstate"):
            kept.section, src.section_gap = src.section, 0
            return
        if listing:
            src.section_gap = 0
            return
        src.section_gap += 1
        if src.section_gap > _SECTION_GAP:
            src.section = None

    def _new_shape(self, key: bytes, masked: str, text: str) -> Shape:
        stats = self.miner.variant_for(masked)
        error = has_error_word(masked) or (self.also_error is not None and self.also_error(text))
        # "*** STEP 42 CANCELLED ***" names a step but is no progress. (NaN losses are found by
        # value, not by word, so Megatron's "number of nan iterations: 0" stays progress.)
        # A save names its step ("saved checkpoint at iteration 200") but is not a step of training.
        checkpoint = not error and checkpoint_step_of(text) is not None
        # "Training completed", the trainer's final metrics: the end of training, not a step of it.
        completion = not error and not checkpoint and is_completion(text)
        progress = None if error or checkpoint or completion else progress_shape_of(text)
        shape = Shape(
            template_id=stats.template_id,
            error=error,
            progress=progress,
            checkpoint=checkpoint,
            completion=completion,
            block="stack" if is_stack_start(text) else "fr" if is_report_start(text) else None,
            section=section_name(text) is not None,
            ps_header=header_columns(text),
            ps_row=_ps_row_kind(text),
            # A line of digits no form knows may be a counter: the timeline learns it (or not).
            watch=checkpoint or completion or (progress is None and not error and len(key) < len(text) and may_count(text)),
            topology=is_topology_line(text, masked),
        )
        shape.stats = stats
        shape.collected = shape.section or shape.ps_header is not None or bool(shape.ps_row)
        shape.quiet = 0 if error else 1
        shape.loss = b"loss" in key or b"Loss" in key
        shape.traceback = _TRACEBACK_START_BYTES in key
        # A process's own work: quiet lines, and its logger's warnings (a rank that skips a batch and draws
        # another, and says so at WARNING level, is still at work: diagnose/timeouts.py reads who went on).
        shape.work = ((bool(shape.quiet) or _only_warns(masked)) and shape.block is None and not shape.traceback)
        if shape.error:
            shape.stats.error_bearing = True
        self.miner.remember(key, shape)
        return shape

    def _source(self, key: str) -> SourceState:
        src = self._sources.get(key)
        if src is None:
            if len(self._sources) >= self.config.max_sources:
                key = "overflow"
                src = self._sources.get(key)
            if src is None:
                src = SourceState(tail=deque(maxlen=self.policy.tail_lines))
                self._sources[key] = src
        return src

    def _keep(self, rec: Record, stats: TemplateStats, reason: str) -> KeptLine:
        stats.kept += 1
        self.lines_kept += 1
        self._kept_ids.add(rec.line_no)
        if len(self._kept_ids) > 4 * self.config.max_kept_lines:
            self._kept_ids.clear()
        return KeptLine(record=rec, template_id=stats.template_id, reason=reason)

    # -- progress: what stalls and loss anomalies are judged by -----------------------------------

    def _note_progress(self, rec: Record, src: SourceState, source_key: str, shape: Shape,
                       encoded: bytes) -> LossSignal | None:
        """A progress line: step timing for stalls, and the timeline (per-rank steps, the loss)."""
        self._progress_lines += 1
        self.last_progress = rec
        self._last_progress_line[source_key] = rec.line_no
        ts = rec.ts
        if ts is not None:
            if src.last_progress_ts is not None and ts > src.last_progress_ts:
                gap = ts - src.last_progress_ts
                src.interval_ema = gap if src.interval_ema is None else 0.9 * src.interval_ema + 0.1 * gap
            src.last_progress_ts = ts
            if self._last_progress_ts is None or ts > self._last_progress_ts:
                self._last_progress_ts = ts
        assert shape.progress is not None
        progress = shape.progress
        signal = self.timeline.note(rec, source_key, progress, shape.template_id, encoded)
        if progress.loss_series:
            loss = self.timeline.last_loss
            if loss is not None and math.isfinite(loss):
                self._last_finite_loss_line[source_key] = rec.line_no
        return signal

    def _watch_shape(self, key: bytes, shape: Shape, rec: Record, source_key: str) -> None:
        """A line that may say a checkpoint was saved, or may turn out to be a counter."""
        if shape.completion:
            self.timeline.note_completion(rec.line_no, rec.ts)
            return
        if shape.checkpoint:
            step = checkpoint_step_of(rec.text)
            if step is not None:
                self.timeline.note_checkpoint(step, rec.line_no, rec.ts if rec.ts is not None else rec.at)
            return
        learner = self.timeline.learner(key)
        learned = learner.look(rec.text, source_key, rec.ts)
        if learned is not None:
            shape.progress = learned
        if learner.done:
            shape.watch = False

    # -- the end of the stream ---------------------------------------------------------------------

    def flush_tails(self) -> list[KeptLine]:
        """The last lines of every source, kept at the end (they often say how a rank died)."""
        out: list[KeptLine] = []
        for src in self._sources.values():
            for rec in src.tail:
                if rec.line_no not in self._kept_ids:
                    out.append(KeptLine(record=rec, template_id=-2, reason="tail"))
            src.tail.clear()
        out.sort(key=lambda k: k.record.line_no)
        self.lines_kept += len(out)
        return out

    # -- templates: the miner's, as of the line count ---------------------------------------------

    def templates(self) -> list[TemplateStats]:
        """Per-template statistics, as reported (see `TemplateMiner.templates`)."""
        return self.miner.templates(self.lines_in)

    def group_ids(self) -> dict[int, int]:
        """Variant id (`KeptLine.template_id`) -> the id of the template it is reported in."""
        return self.miner.group_ids(self.lines_in)

    def merged_ids(self) -> dict[int, int]:
        """Drain cluster id -> the id of the group it is reported in (see `TemplateMiner.merged_ids`)."""
        return self.miner.merged_ids(self.lines_in)

    # -- the topology's, for a streaming reader -------------------------------------------------------

    @property
    def nccl_setup(self) -> dict[str, dict[str, tuple[str, int, str]]]:
        """host -> NCCL's start-up words so far (the streaming service's advice reads it; do not modify)."""
        return self.topology.nccl_setup

    @property
    def nccl_setup_words(self) -> int:
        """How many words `nccl_setup` holds: what changed since a reader last looked."""
        return self.topology.nccl_setup_words

    @property
    def template_cap_reached(self) -> bool:
        """New templates now go to the overflow template (CompressConfig.max_templates)."""
        return self.miner.cap_reached

    def template_id_of(self, text: str) -> int | None:
        """The id of the template (as `templates()` reports it) of the lines of this message's shape; None
        if never seen (or if its shape was evicted from the cache since). For benchmarks and tests: costs
        nothing in `add()`."""
        shape = self._shapes.get(text.encode("utf-8", "surrogatepass").translate(None, _DIGITS))
        if shape is None:
            return None
        return self.group_ids().get(shape.template_id, shape.template_id)

    def summary(self, bytes_in: int = 0, lines_truncated: int = 0, srun_tasks_are_ranks: bool = False) -> CompressionSummary:
        """`srun_tasks_are_ranks`: srun's labels numbered the job's ranks (not its nodes), so the tasks its error
        lines name are ranks, and the node they name each one's host."""
        intervals = sorted(s.interval_ema for s in self._sources.values() if s.interval_ema)
        groups = self.group_ids()
        summary = CompressionSummary(
            lines_in=self.lines_in,
            bytes_in=bytes_in,
            templates=len({groups.get(vid, vid) for vid in self.miner.stats}),
            lines_kept=self.lines_kept,
            lines_truncated=lines_truncated,
            world_size=0,  # these and the hosts, ranks, GPUs: the topology's (below)
            hosts=[],
            first_ts=self._first_ts,
            last_ts=self._last_ts,
            progress_lines=self._progress_lines,
            last_progress_line=dict(self._last_progress_line),
            last_progress_ts=self._last_progress_ts,
            last_finite_loss_line=dict(self._last_finite_loss_line),
            step_interval_s=intervals[len(intervals) // 2] if intervals else None,
            progress=self._progress(),
        )
        self.topology.fill(summary, srun_tasks_are_ranks)
        return summary

    def output_mark(self, source_key: str) -> tuple[int, int]:
        """(lines without an error word the source printed so far, the same for the whole job)."""
        src = self._sources.get(source_key)
        return (src.quiet if src is not None else 0), self._quiet

    def _progress(self) -> ProgressSummary:
        progress = self.timeline.summary({k: (s.last_line, s.last_ts) for k, s in self._sources.items()})
        progress.quiet = {k: s.quiet for k, s in self._sources.items()}
        progress.last_work = {k: (w.line_no, w.ts if w.ts is not None else w.at) for k, s in self._sources.items()
                              if (w := s.last_work) is not None}
        progress.job_quiet = self._quiet
        for s in progress.sources:  # a progress line rarely says its host; the rank's other lines do
            if s.host is None and s.rank is not None:
                s.host = self.topology.rank_host(s.rank)
        return progress

    def finish_timeline(self) -> list[KeptLine]:
        """The stream ended: a loss still far above its course, or a NaN never followed by a finite
        loss, is a divergence (kept as the line where it began)."""
        signal = self.timeline.close()
        if signal is None or signal.divergence is None:
            return []
        return [KeptLine(record=signal.record, template_id=-2, reason="loss", divergence=signal.divergence)]


def _ps_row_kind(text: str) -> int:
    """Whether a line is a `ps aux` row (1), one in state D (2), or neither (0): asked once per shape (the state
    is a word, so a row in another state has another shape). The TTY column ("?", "pts/3") comes first."""
    if " ? " not in text and " pts/" not in text and " tty" not in text:
        return 0
    row = aux_row(text)
    if row is None:
        return 0
    return 2 if row.uninterruptible and not row.kernel_thread else 1

