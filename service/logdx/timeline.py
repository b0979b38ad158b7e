"""The life of a job: where each rank is in training, how fast it goes, and how its loss behaves.

An on-call engineer reads a dead job backwards from where progress stopped: the last iterations of
each rank, which rank went quiet first, what the job recovered from before, whether the loss blew
up. The timeline keeps exactly that, in the streaming core, in bounded memory:

- per source (a rank, else a host): first and last progress line, first and last step, the time
  of the last one, its rate (steps per second), how often its counter advanced;
- per job: the highest step, the loss and step-time series (decimated to a fixed number of points),
  the checkpoints the log says were saved, and a divergence watch over the loss (a spike that does
  not come back, NaN, NaN or skipped iterations, a gradient-norm blow-up).

What a progress line says is data (`timeline.yaml`): fields read from a line's numbers, decided once
per line shape so that each of millions of progress lines costs one number scan. What no pattern
knows is learned from the log: a repeated line whose integer rises by the same amount on every line
of one rank is progress too.

The compressor feeds it (it knows each line's shape and source); the session stamps every event
with where its rank and the job were (`mark`), so that the diagnosis can tell what the job went on
after (recovered) from what ended it.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from logdx import yamlsafe
from logdx.model import Divergence, ProgressMark, ProgressSummary, Record, Restart, SourceProgress

FORMS_PATH = Path(__file__).with_name("timeline.yaml")

__all__ = ["FORMS_PATH", "ProgressShape", "Timeline", "TimelineError", "checkpoint_step_of", "fields_of",
           "is_completion",
           "progress_shape_of"]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE = rf"(?P<v>{_NUM}|(?i:nan|[-+]?inf(?:inity)?))"
# Every number of a line, in order. Its digits-free shape fixes how many there are and where each
# field is among them (see ProgressShape).
_NUMBER = re.compile(rf"(?<![\w.]){_NUM}")
_COUNTERS = ("step", "epoch")
_MAX_POINTS = 512  # per series in the report
_MAX_SOURCES = 4096
_MAX_CHECKPOINTS = 256
# Learning progress from the log: how many lines of one shape are looked at, and how many times its
# integer must rise by the same amount on one source's consecutive lines.
_LEARN_LINES = 48
_LEARN_RISES = 4
_WARM_UP_STEPS = 50
_GRAD_SURGE = 10  # a gradient norm this many times its course has blown up...
_GRAD_LEAD = 3  # ...and a loss spike within this many points after it began there
# The counter-only fast path (most progress lines of a big job: every rank printing the same step) reads
# the number of a loop's first lines, then of one line in _SAMPLE.
_EXACT_LINES = 32
_SAMPLE = 8
_MAX_LOOPS = 16  # loops (progress templates) followed per source
_TIMED_ADVANCES = 64  # (time, step) of a source's latest counter rises kept
_COURSE_POINTS = 32  # (time, step) over a source's whole run, decimated (2x this at most): its pace's changes
_MAX_PER_FEED = 64  # sources of one stream an event's mark remembers
_MAX_RESTARTS = 64  # falls of the step counter kept (an epoch bar falls every epoch)


class TimelineError(ValueError):
    """timeline.yaml does not load; the message names the file and line."""


class _FormsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fields: dict[str, list[str]]
    checkpoints: list[str]
    completions: list[str] = []
    tests: list[Any] = []  # raw lines and what must be read of them: `logdx rules test` runs them (explain.py)


@dataclass(frozen=True, slots=True)
class _Forms:
    fields: tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]
    checkpoints: tuple[re.Pattern[str], ...]
    completion: re.Pattern[str] | None  # any of the completion lines (one search per line shape)
    words: re.Pattern[str]  # a cheap first look: could this line be progress at all?


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    if pattern.count("{n}") != 1:
        raise TimelineError(f"{where}: a pattern needs exactly one {{n}}: {pattern!r}")
    flags = ""
    if pattern.startswith("(?i)"):
        flags, pattern = "(?i)", pattern[4:]
    try:
        return re.compile(flags + pattern.replace("{n}", _VALUE))
    except re.error as e:
        raise TimelineError(f"{where}: {e}: {pattern!r}") from None


@cache
def forms(path: Path = FORMS_PATH) -> _Forms:
    """The progress forms of `timeline.yaml`, compiled and validated (errors name file and line)."""
    try:
        text = path.read_text(encoding="utf-8")
        spec = _FormsFile.model_validate(yamlsafe.load(text, str(path)))
    except yamlsafe.YamlError as e:
        raise TimelineError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TimelineError(f"{path}: cannot load: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise TimelineError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    lines = text.splitlines()

    def where(pattern: str) -> str:
        for i, line in enumerate(lines, 1):
            if pattern in line or repr(pattern)[1:-1] in line:
                return f"{path}:{i}"
        return str(path)

    compiled = tuple((name, tuple(_compile(p, where(p)) for p in pats)) for name, pats in spec.fields.items())
    unknown = {name for name, _ in compiled} - set(_FIELDS)
    if unknown:
        raise TimelineError(f"{path}: unknown field(s) {', '.join(sorted(unknown))} (known: {', '.join(_FIELDS)})")
    return _Forms(fields=compiled, checkpoints=tuple(_compile(p, where(p)) for p in spec.checkpoints),
                  completion=_any_of(spec.completions, where), words=_PROGRESS_HINT)


def _any_of(patterns: list[str], where: Callable[[str], str]) -> re.Pattern[str] | None:
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise TimelineError(f"{where(p)}: {e}: {p!r}") from None
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


_FIELDS = ("step", "epoch", "total", "loss", "grad_norm", "lr", "step_time_ms", "step_time_s", "it_per_s",
           "skipped_iters", "skipped_total", "nan_iters", "throughput")
# A line can only be a progress line of a known form if it holds one of these (lower-cased).
_PROGRESS_HINT = re.compile(r"iter|step|epoch|loss|it/s|s/it|/s\b|/sec|per second|norm|\[\s*\d+\s*/|\d/\d+\s*\[")


@dataclass(slots=True)
class ProgressShape:
    """How to read the fields of every line of one shape (the line with its digits removed): the
    index of each field among the line's numbers, decided on the shape's first line."""

    n_numbers: int
    fields: tuple[tuple[str, int], ...]  # (field, index into the line's numbers)
    consts: tuple[tuple[str, float], ...] = ()  # fields spelled in letters on this shape (nan, inf)
    counter: int = -1  # index of the step (else epoch) number; -1: none
    learned: bool = False  # from the log itself, not from timeline.yaml
    # A bar that restarts every epoch ("Epoch 3: 45%| 450/1000 [...]"): the counter is then
    # epoch * total + step, so that it keeps rising across epochs. -1: not such a line.
    epoch: int = -1
    total: int = -1
    # The fast way to the counter, for the many ranks whose loss nobody reads: its index among the line's
    # runs of digits (-1: the counter is not a plain integer, read the slow way), and how many runs.
    counter_run: int = -1
    epoch_run: int = -1
    total_run: int = -1
    n_runs: int = 0
    loss_series: bool = False  # says something of the loss (read from one source only)
    time_series: bool = False  # says the step time (read from one source only)

def progress_shape_of(text: str) -> ProgressShape | None:
    """How to read progress from lines shaped like `text` (None: they are not progress lines)."""
    low = text.lower()
    if not _PROGRESS_HINT.search(low):
        return None
    starts = {m.start(): i for i, m in enumerate(_NUMBER.finditer(text))}
    fields: list[tuple[str, int]] = []
    consts: list[tuple[str, float]] = []
    for name, patterns in forms().fields:
        for pattern in patterns:
            m = pattern.search(text)
            if m is None:
                continue
            value = m.group("v")
            if value[-1].isalpha():  # nan / inf: the shape spells it, every line of it has it
                consts.append((name, float(value)))
            elif m.start("v") in starts:
                fields.append((name, starts[m.start("v")]))
            else:
                continue
            break
    if not fields and not consts:
        return None
    counter = next((i for c in _COUNTERS for f, i in fields if f == c), -1)
    found = dict(fields)
    per_epoch = "step" in found and "epoch" in found and "total" in found
    runs = _digit_runs(text)
    numbers = list(_NUMBER.finditer(text))

    def run_of(index: int) -> int:
        """The digit run of a plain-integer number (-1 when the number is not one)."""
        if index < 0:
            return -1
        token = numbers[index].group().lstrip("+-")
        if not token.isdigit():
            return -1
        at = numbers[index].start() + (len(numbers[index].group()) - len(token))
        return next((k for k, (start, _) in enumerate(runs) if start == at), -1)

    epoch_i, total_i = (found["epoch"], found["total"]) if per_epoch else (-1, -1)
    shape = ProgressShape(n_numbers=len(starts), fields=tuple(fields), consts=tuple(consts), counter=counter,
                          epoch=epoch_i, total=total_i, counter_run=run_of(counter), n_runs=len(runs))
    named = {f for f, _ in fields} | {f for f, _ in consts}
    shape.loss_series, shape.time_series = bool(named & _LOSS_FIELDS), bool(named & _TIME_FIELDS)
    if per_epoch:
        shape.epoch_run, shape.total_run = run_of(epoch_i), run_of(total_i)
        if shape.epoch_run < 0 or shape.total_run < 0:
            shape.counter_run = -1
    return shape


_LOSS_FIELDS = frozenset({"loss", "grad_norm", "skipped_iters", "skipped_total", "nan_iters"})
# Logging intervals in a row with NaN iterations that make a divergence (one or two can be a bad batch).
_NAN_RUN = 4
# Divergences read from skipped or NaN iterations: the loss printed meanwhile stays flat, which says nothing.
_FLAT_LOSS_KINDS = frozenset({"skipped", "nan_iterations"})
_TIME_FIELDS = frozenset({"step_time_ms", "step_time_s", "it_per_s"})
_DIGIT_RUN = re.compile(rb"\d+")


def _digit_runs(text: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"\d+", text)]


def fields_of(text: str) -> dict[str, float]:
    """The fields the forms read off one message (what `progress_shape_of` decides, with this line's values):
    `timeline.yaml`'s own tests check them."""
    shape = progress_shape_of(text)
    if shape is None:
        return {}
    numbers = [m.group() for m in _NUMBER.finditer(text)]
    out = {name: float(numbers[i]) for name, i in shape.fields if i < len(numbers)}
    out.update(dict(shape.consts))
    return out


def checkpoint_step_of(text: str) -> int | None:
    """The step of a checkpoint this line says was saved, or None."""
    for pattern in forms().checkpoints:
        m = pattern.search(text)
        if m is not None:
            try:
                return int(float(m.group("v")))
            except (ValueError, OverflowError):
                return None
    return None


def is_completion(text: str) -> bool:
    """The line says the run's training is over (it ran to its end; timeline.yaml `completions`)."""
    pattern = forms().completion
    return pattern is not None and pattern.search(text) is not None


# -- learning a progress line from the log itself --------------------------------------------------------


# A line that may carry a counter no form of timeline.yaml knows: it says what it counts, or shows
# the counter against its total ("12/500").
_COUNTER_HINT = re.compile(r"(?i)train|step|iter|epoch|batch|update|round|progress|sample|token|\bit\b|global")
_OF_TOTAL = re.compile(r"(?<![\w.])(\d+)\s*/\s*(\d+)(?![\w.])")


def may_count(text: str) -> bool:
    """Whether a line no form knows is worth watching for a counter (see Learner)."""
    return _COUNTER_HINT.search(text) is not None or any(
        int(m.group(2)) > 0 and int(m.group(1)) <= int(m.group(2)) for m in _OF_TOTAL.finditer(text))


@dataclass(slots=True)
class Learner:
    """Watches the first lines of one shape that no form knows: does one of its integers rise by the
    same amount on consecutive lines of the same source (a counter)? Dates and clocks do not count
    (a number next to ':' or '-' on both sides), nor do numbers that never change, nor a burst of
    lines printed within the same moment (set-up enumerating its channels is not training)."""

    seen: int = 0
    last: dict[str, list[float]] = field(default_factory=dict)  # source -> the numbers of its last line
    deltas: dict[int, tuple[float, int]] = field(default_factory=dict)  # index -> (delta, times seen alike)
    bad: set[int] = field(default_factory=set)
    done: bool = False
    first_ts: float | None = None
    last_ts: float | None = None

    def look(self, text: str, source: str, ts: float | None = None) -> ProgressShape | None:
        """Feed one line; a ProgressShape once the shape is learned to be progress."""
        self.seen += 1
        if ts is not None:
            self.first_ts = ts if self.first_ts is None else self.first_ts
            self.last_ts = ts
        matches = list(_NUMBER.finditer(text))
        values = []
        for m in matches:
            try:
                values.append(float(m.group()))
            except ValueError:
                values.append(math.nan)
        before = self.last.get(source)
        self.last[source] = values
        if before is not None and len(before) == len(values):
            for i, (a, b) in enumerate(zip(before, values)):
                if i in self.bad:
                    continue
                delta = b - a
                if not (0 < delta <= 100_000) or not float(b).is_integer() or _clock_like(text, matches[i]):
                    self.bad.add(i)
                    self.deltas.pop(i, None)
                    continue
                known, times = self.deltas.get(i, (delta, 0))
                if known != delta:
                    self.bad.add(i)
                    self.deltas.pop(i, None)
                    continue
                self.deltas[i] = (delta, times + 1)
                if times + 1 >= _LEARN_RISES and not self._burst():
                    self.done = True
                    return ProgressShape(n_numbers=len(values), fields=(("step", i),), counter=i, learned=True)
        if self.seen >= _LEARN_LINES or len(self.last) > 64:
            self.done = True
        return None


    def _burst(self) -> bool:
        return self.first_ts is not None and self.last_ts is not None and self.last_ts - self.first_ts < 1.0


def _clock_like(text: str, m: re.Match[str]) -> bool:
    before = text[m.start() - 1] if m.start() > 0 else " "
    after = text[m.end()] if m.end() < len(text) else " "
    return (before in ":-/" and after in ":-/.,") or (before in ":-/" and after == " ") or after in ":-"


# -- the streaming state ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Source:
    rank: int | None
    host: str | None
    first_line: int
    last_line: int
    first_ts: float | None = None
    last_ts: float | None = None
    lines: int = 0
    advances: int = 0
    first_step: float | None = None
    step: float | None = None  # the counter of its main loop (the template that advanced most)
    main: int = -1  # that template
    main_value: float | None = None  # its counter (or line count)
    step_delta: float | None = None  # the smallest rise of its main loop's counter: its logging interval
    loops: dict[int, list[float]] = field(default_factory=dict)  # template -> [last counter, advances]
    plain: dict[int, int] = field(default_factory=dict)  # template of a loss line without a counter -> lines
    main_lines: int = 0  # lines of its main loop (the counter-only fast path samples them)
    pending: tuple[ProgressShape, int, bytes, float | None, float | None] | None = None  # its last line, unread
    rate_anchor: tuple[float, float] | None = None  # (ts, step) of its first timed step
    rate_last: tuple[float, float] | None = None  # and of its last
    # (time, step) of its counter's latest rises (the fast path reads one line in `_SAMPLE`): did it go on
    # after a given moment, by the clocks? (life.went_on_after)
    advanced_at: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_TIMED_ADVANCES))
    # and over its whole run, by its own clock (a slow node's step time jumping up: diagnose/stragglers.py)
    course: _Series = field(default_factory=lambda: _Series(cap=_COURSE_POINTS))
    falls: int = 0  # how often its main loop's counter fell back: its n-th fall is the job's n-th restart

    @property
    def steps_per_s(self) -> float | None:
        if self.rate_anchor is None or self.rate_last is None or self.rate_last[0] <= self.rate_anchor[0]:
            return None
        return (self.rate_last[1] - self.rate_anchor[1]) / (self.rate_last[0] - self.rate_anchor[0])


@dataclass(slots=True)
class _Series:
    """A decimated series: every `stride`-th point is kept; when full, every other one is dropped."""

    points: list[tuple[float, float]] = field(default_factory=list)
    stride: int = 1
    seen: int = 0
    cap: int = _MAX_POINTS

    def add(self, x: float, y: float) -> None:
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return
        self.points.append((x, y))
        if len(self.points) >= 2 * self.cap:
            self.points = self.points[::2]
            self.stride *= 2


@dataclass(slots=True)
class _Watch:
    """The divergence watch over one source's loss. Its course: an average that follows the loss
    slowly (`baseline`), the lowest that average reached (`low`) and the loss's usual wobble around it
    (`spread`). A run of points above the course starts a candidate (`onset`); the run ends when the
    loss is back on its course (a spike that came back: a note when it was big), and it is a divergence
    when it went far above the course (half as high again) and did not come back within `window` points
    (or before the log ended). A sudden jump and a steady climb are read alike."""

    baseline: float | None = None
    low: float | None = None
    spread: float = 0.0  # the loss's usual wobble: the average change from one point to the next
    prev: float | None = None  # the last finite loss
    seen: int = 0
    onset: tuple[Record, float, float, float] | None = None  # (line, step, loss before, peak)
    onset_kind: str = ""
    after: int = 0  # points since the onset
    last: float = math.nan  # the loss of the last of them
    run_sum: float = 0.0  # their sum (a run that settles slightly higher becomes the new course: its mean)
    skipped_runs: int = 0  # consecutive logging intervals with skipped iterations
    skipped_from: tuple[Record, float] | None = None  # (line, step) where that run began
    nan_runs: int = 0  # consecutive logging intervals with NaN iterations (Megatron)
    nan_from: tuple[Record, float] | None = None
    skipped_total: float | None = None  # the last cumulative count (DeepSpeed's "skipped=N")
    grad_baseline: float | None = None
    # A gradient norm far above its course, with the loss still on its own: (line, step, points since).
    # The norm blows up a point or two before the loss follows; that first point is where it began.
    grad_surge: tuple[Record, float, int] | None = None


@dataclass(slots=True)
class LossSignal:
    """What one progress line said about the loss: a NaN/inf, a divergence confirmed (with where it
    began), or a spike that came back (recovered)."""

    kind: str  # "nan" | "diverged" | "recovered"
    record: Record  # the line where it began
    divergence: Divergence | None = None


@dataclass
class Timeline:
    """Per-source and job-wide progress, fed line by line by the compressor."""

    window: int = 20  # loss points after a spike within which it must come back
    min_points: int = 20  # intervals before skipped iterations or a gradient norm can count (warm-up is noisy)

    def __post_init__(self) -> None:
        self._sources: dict[str, _Source] = {}
        self.rises = 0  # how often the job's highest step rose (many ranks printing one step: one rise)
        self.max_step: float | None = None
        self._loss = _Series()
        self._step_time = _Series()
        self._job_steps = _Series()  # (time, step) of the job's highest step as it rose: when it got where
        self._unread: list[_Source] = []  # sources whose last line the fast path left unread
        self._loss_source: str | None = None  # the one source the loss is read from
        self._time_source: str | None = None  # and the step time
        self._watch = _Watch()
        self.divergence: Divergence | None = None
        self.recovered_spikes: list[Divergence] = []
        self.checkpoints: list[tuple[int, int]] = []  # (step, line_no)
        self.checkpoint_ts: list[float | None] = []  # the last time each was said saved
        self.restarts: list[Restart] = []
        self._unpassed = 0  # restarts whose sources have not reached where they fell from yet
        self.completed_line = 0  # the last line that said training is over (0: none)
        self.completed_ts: float | None = None  # and its time, when it says one
        self.completed_advances = 0  # how often the job had advanced when it was said
        self.last_loss: float | None = None  # the loss the last progress line gave (None: none)
        self.learners: dict[bytes, Learner] = {}
        self._by_feed: dict[int, list[str]] = {}  # stream -> the sources whose progress came in on it
        self._advances = 0  # every source's advances, summed as they happen
        self._stream_marks: dict[int, tuple[int, int, tuple[tuple[str, int], ...]]] = {}

    # -- the hot path: one progress line ----------------------------------------------------------------

    def note(self, rec: Record, source_key: str, shape: ProgressShape, template_id: int,
             encoded: bytes | None = None) -> LossSignal | None:
        """One progress line of `source_key` (`encoded`: its text as UTF-8, when the caller has it);
        returns a loss signal when the line gives one. Most progress lines of a big job are the same
        step printed by every rank: for those only the counter is read, from the line's digit runs;
        the loss and the step time are read from one source only (the first that printed them)."""
        if shape.counter_run >= 0 and encoded is not None and not (
                (shape.loss_series or shape.time_series) and self._reads_series(source_key, shape)):
            self._count_fast(rec, source_key, shape, template_id, encoded)
            return None
        nums = _NUMBER.findall(rec.text)
        if len(nums) != shape.n_numbers:
            return None  # a line this shape does not describe (a number written another way)
        self.last_loss = None
        line_no, ts = rec.line_no, rec.ts
        src = self._sources.get(source_key)
        if src is None:
            src = self._new_source(rec, source_key)
            if src is None:
                return None
        src.lines += 1
        src.last_line = line_no
        if ts is not None:
            src.last_ts = ts
        values: dict[str, float] = dict(shape.consts)
        for name, index in shape.fields:
            try:
                values[name] = float(nums[index])
            except ValueError:
                continue
        if shape.counter >= 0:
            counter = float(nums[shape.counter])
            if shape.epoch >= 0:
                counter += float(nums[shape.epoch]) * float(nums[shape.total])
            self._count(src, template_id, counter, ts, at=rec.at)
        elif "loss" in values:
            # A loss printed every step without its number: its n-th line is the step (a line printed
            # once or twice, like an exit summary's "train/loss 3.66", is no loop).
            seen = src.plain.get(template_id, 0) + 1
            if len(src.plain) < 16 or template_id in src.plain:
                src.plain[template_id] = seen
            if seen >= 3:
                self._count(src, template_id, float(seen), ts, numbered=False)
        return self._measure(rec, source_key, values, src)

    def _new_source(self, rec: Record, source_key: str) -> _Source | None:
        if len(self._sources) >= _MAX_SOURCES:
            return None
        src = self._sources[source_key] = _Source(rank=rec.rank, host=rec.host, first_line=rec.line_no,
                                                  last_line=rec.line_no, first_ts=rec.ts)
        feed = self._by_feed.setdefault(rec.feed, [])
        if len(feed) < _MAX_PER_FEED:
            feed.append(source_key)
        return src

    def _reads_series(self, source_key: str, shape: ProgressShape) -> bool:
        """Whether this line's loss or step time is read: it is the series' source, or could become it."""
        if shape.loss_series and (self._loss_source is None or source_key == self._loss_source):
            return True
        return shape.time_series and (self._time_source is None or source_key == self._time_source)

    def _count_fast(self, rec: Record, source_key: str, shape: ProgressShape, template_id: int,
                    encoded: bytes) -> None:
        """A counter-only line: the number of its loop's first lines is read, then of one line in
        `_SAMPLE` of the source's main loop (a line in between counts as one advance); the last line is
        kept unread until someone asks where the source is (`mark`, `summary`)."""
        src = self._sources.get(source_key)
        line_no, ts = rec.line_no, rec.ts
        if src is None:
            src = self._new_source(rec, source_key)
            if src is None:
                return
        src.lines += 1
        src.last_line = line_no
        if ts is not None:
            src.last_ts = ts
        if template_id == src.main:
            n = src.main_lines = src.main_lines + 1
            if n > _EXACT_LINES and n % _SAMPLE:
                if src.pending is None:
                    self._unread.append(src)
                src.pending = (shape, template_id, encoded, ts, rec.at)
                return
        src.pending = None
        self._read_counter(src, shape, template_id, encoded, ts, rec.at)

    def _read_counter(self, src: _Source, shape: ProgressShape, template_id: int, encoded: bytes,
                      ts: float | None, at: float | None = None) -> None:
        runs = _DIGIT_RUN.findall(encoded)
        if len(runs) != shape.n_runs:
            return
        counter = int(runs[shape.counter_run])
        if shape.epoch_run >= 0:
            counter += int(runs[shape.epoch_run]) * int(runs[shape.total_run])
        self._count(src, template_id, float(counter), ts, at=at)

    def _flush_all(self) -> None:
        for src in self._unread:
            self._flush(src)
        self._unread.clear()

    def _flush(self, src: _Source) -> None:
        """Read the last, unread line of a source: where exactly it is."""
        if src.pending is not None:
            shape, template_id, encoded, ts, at = src.pending
            src.pending = None
            self._read_counter(src, shape, template_id, encoded, ts, at)

    def _count(self, src: _Source, template_id: int, value: float, ts: float | None, numbered: bool = True,
               at: float | None = None) -> None:
        """A counter of one of the source's loops. The loop that advanced most is its main one (the
        training steps; an evaluation bar or a second line printing the same step is not): only that
        one's rises are the source's advances. A loop that is not `numbered` (lines counted, not a step
        the line prints) advances the source but says nothing of the job's step."""
        # The main loop's count, going on in a line of another shape (tqdm's bar glyph grows a block every
        # percent, an elapsed time passes an hour): the same loop, which takes over its advances.
        continues = numbered and src.main >= 0 and src.main != template_id and self._continues_main(src, value)
        loop = src.loops.get(template_id)
        if loop is None:
            if len(src.loops) >= _MAX_LOOPS:
                if not continues:
                    return
                del src.loops[min((k for k in src.loops if k != src.main), key=lambda k: src.loops[k][1])]
            loop = src.loops[template_id] = [value, 0.0]
        elif value > loop[0]:
            loop[0] = value
            loop[1] += 1
        else:
            loop[0] = value  # a new epoch's bar, an evaluation: the loop starts again
        if continues:
            loop[1] = max(loop[1], src.loops[src.main][1])
            src.main = template_id
        if src.main != template_id and (src.main < 0 or loop[1] > src.loops[src.main][1]):
            src.main = template_id
        if template_id != src.main:
            return
        if src.main_value is not None and value > src.main_value:
            src.advances += 1
            self._advances += 1
            when = ts if ts is not None else at  # its own stamp, else its stream's time before it
            if when is not None and numbered:
                src.advanced_at.append((when, value))
                if self._unpassed and src.falls:
                    self._passes(src, value, when)
            if numbered:
                delta = value - src.main_value
                if src.step_delta is None or delta < src.step_delta:
                    src.step_delta = delta
        elif numbered and src.main_value is not None and value < src.main_value:
            self._fell(src, value, ts if ts is not None else at, src.main_value)
        src.main_value = value
        if not numbered:
            return
        if src.first_step is None:
            src.first_step = value
        src.step = value
        if ts is not None:
            if src.rate_anchor is None:
                src.rate_anchor = (ts, value)
            src.rate_last = (ts, value)
            src.course.add(ts, value)
        if self.max_step is None or value > self.max_step:
            self.rises += self.max_step is not None
            self.max_step = value
            when = ts if ts is not None else at
            if when is not None:
                self._job_steps.add(when, value)

    def _fell(self, src: _Source, value: float, when: float | None, before: float) -> None:
        """The main loop's counter fell back (a restart, a new epoch's bar): its n-th fall joins the job's n-th
        restart, so that every rank resuming from one checkpoint makes one restart."""
        n, src.falls = src.falls, src.falls + 1
        last_rise = src.advanced_at[-1][0] if src.advanced_at else None
        if n < len(self.restarts):
            r = self.restarts[n]
            if before > r.from_step:  # this rank had got further: back there is further on
                self._unpassed += r.passed_ts is not None
                r.from_step, r.passed_ts = before, None
            if last_rise is not None and (r.from_ts is None or last_rise > r.from_ts):
                r.from_ts = last_rise
            r.to_step = min(r.to_step, value)
            r.sources += 1
        elif n == len(self.restarts) < _MAX_RESTARTS:
            line_no = src.last_line
            self.restarts.append(Restart(from_step=before, from_ts=last_rise, to_step=value, line_no=line_no,
                                         ts=when))
            self._unpassed += 1

    def _passes(self, src: _Source, value: float, when: float) -> None:
        """A source that fell back rose again: has it reached where the job had been?"""
        for r in self.restarts[:src.falls]:
            if r.passed_ts is None and value >= r.from_step:
                r.passed_ts = when
                self._unpassed -= 1

    @staticmethod
    def _continues_main(src: _Source, value: float) -> bool:
        """`value` is just past the main loop's last read count (which a sampled read may leave up to
        `_SAMPLE` lines behind)."""
        if src.main_value is None:
            return False
        delta = src.step_delta or 1.0
        return 0 < value - src.main_value <= (_SAMPLE + 2) * delta

    def _measure(self, rec: Record, source_key: str, values: dict[str, float], src: _Source) -> LossSignal | None:
        self.last_loss = values.get("loss")
        if src.pending is not None:
            self._flush(src)  # the counter's last line, sampled and left unread: where the loss is now
        step = src.step if src.step is not None else (self.max_step if self.max_step is not None else float(src.lines))
        in_epochs = "step" not in values and "epoch" in values
        if in_epochs and self.max_step is not None and self.max_step > step:
            # HF Trainer's "{'loss': ..., 'epoch': 0.18}" counts in fractions of an epoch; a step counter on
            # another line of the job (its tqdm bar) says where that is in steps.
            step, in_epochs = self.max_step, False
        timed = "step_time_ms" in values or "step_time_s" in values or "it_per_s" in values
        if timed and self._time_source is None:
            self._time_source = source_key
        if source_key != self._time_source:
            pass
        elif "step_time_ms" in values:
            self._step_time.add(step, values["step_time_ms"] / 1000)
        elif "step_time_s" in values:
            self._step_time.add(step, values["step_time_s"])
        elif values.get("it_per_s"):
            self._step_time.add(step, 1 / values["it_per_s"])
        if self._loss_source is None and ("loss" in values or "nan_iters" in values):
            self._loss_source = source_key
        if source_key != self._loss_source:
            return None
        signal = None
        if "loss" in values:
            self._loss.add(step, values["loss"])
            signal = self._watch_loss(rec, step, values["loss"], in_epochs)
        if "nan_iters" in values:
            nan_signal = self._watch_nan_iters(rec, step, values["nan_iters"])
            signal = signal or nan_signal
        if signal is None and ("skipped_iters" in values or "skipped_total" in values):
            signal = self._watch_skips(rec, step, values)
        if signal is None and "grad_norm" in values:
            signal = self._watch_grad(rec, step, values["grad_norm"], values.get("loss"))
        return signal

    # -- divergence -------------------------------------------------------------------------------------

    def _watch_loss(self, rec: Record, step: float, loss: float, in_epochs: bool = False) -> LossSignal | None:
        w = self._watch
        if not math.isfinite(loss):
            if w.onset is None:
                _start(w, rec, step, "nan", loss)
                return LossSignal("nan", rec)
            first_nan = w.onset_kind != "nan"
            w.onset_kind = "nan"  # a run above the course that went on to NaN: it began there
            tick = self._tick(w, rec, loss)
            return tick or (LossSignal("nan", rec) if first_nan else None)
        w.seen += 1
        if w.prev is not None:  # every point counts: a noisy per-step loss wobbles a lot, an average little
            w.spread = 0.9 * w.spread + 0.1 * abs(loss - w.prev)
        w.prev = loss
        if self.divergence is not None and self.divergence.kind not in _FLAT_LOSS_KINDS \
                and self.divergence.loss_before is not None \
                and loss <= _course(self.divergence.loss_before, w.spread):
            # It came back after all, later than the window: a spike, not a divergence. (Skipped or NaN
            # iterations leave the printed loss where it was: a flat loss does not clear those.)
            self._retract()
        if w.onset is not None:
            return self._tick(w, rec, loss)
        if w.baseline is None or w.low is None:
            w.baseline = w.low = loss
            return None
        # Warm-up by steps, or by points when the counter is a fraction of an epoch (never 50 of them).
        warming = w.seen < self.min_points if in_epochs else _warming_up(step, w.seen)
        if loss > _course(w.low, w.spread) and not warming:
            surge = w.grad_surge
            began, began_step = (surge[0], surge[1]) if surge is not None and surge[2] <= _GRAD_LEAD else (rec, step)
            _start(w, began, began_step, "spike", loss)
            return None
        w.baseline = 0.9 * w.baseline + 0.1 * loss
        w.low = min(w.low, w.baseline)
        return None

    def _retract(self) -> None:
        assert self.divergence is not None
        if len(self.recovered_spikes) < 64:
            self.recovered_spikes.append(self.divergence)
        self.divergence = None

    def _tick(self, w: _Watch, rec: Record, loss: float) -> LossSignal | None:
        """One more loss point of a run above the course: back on it (recovered, or only noise), still
        far above it after `window` points (diverged), or still going."""
        assert w.onset is not None
        start, step, before, peak = w.onset
        w.after += 1
        if math.isfinite(loss):
            w.last = loss
            w.run_sum += loss
            peak = max(peak, loss) if math.isfinite(peak) else loss
            w.onset = (start, step, before, peak)
            if not math.isfinite(before) or loss <= _course(before, w.spread):
                return self._back(w, start, step, before, peak, loss)
        if w.after >= self.window:
            if w.onset_kind == "spike" and not _far_above(before, peak, w.spread):
                mean = w.run_sum / w.after
                w.onset, w.baseline, w.low = None, mean, mean  # a new, slightly higher course: not a blow-up
                return None
            return self._diverged(w, start, step, before, loss)
        return None

    def _back(self, w: _Watch, start: Record, step: float, before: float, peak: float, loss: float) -> LossSignal | None:
        kind = w.onset_kind
        w.onset, w.onset_kind, w.after = None, "", 0
        if math.isfinite(before) and kind == "spike" and not _far_above(before, peak, w.spread):
            return None  # a wobble above the course, nothing to note
        d = Divergence(kind=kind, step=step, line_no=start.line_no, loss_before=_finite(before),
                       loss_after=_finite(peak))
        if len(self.recovered_spikes) < 64:
            self.recovered_spikes.append(d)
        w.baseline = loss if w.baseline is None else 0.5 * w.baseline + 0.5 * loss
        return LossSignal("recovered", start, d)

    def _diverged(self, w: _Watch, start: Record, step: float, before: float, loss: float) -> LossSignal:
        peak = w.onset[3] if w.onset is not None else loss
        d = Divergence(kind=w.onset_kind, step=step, line_no=start.line_no, loss_before=_finite(before),
                       loss_after=_finite(loss) if math.isfinite(loss) else _finite(peak),
                       rollback_to_step=self._checkpoint_before(step))
        w.onset, w.onset_kind, w.after = None, "", 0
        if self.divergence is None:
            self.divergence = d
        w.baseline = loss if math.isfinite(loss) else w.baseline  # a new level: watch from there
        return LossSignal("diverged", start, d)

    def _watch_nan_iters(self, rec: Record, step: float, nan_iters: float) -> LossSignal | None:
        """Megatron's `number of nan iterations` per logging interval. The loss it prints stays finite
        (the NaN iterations are left out of it), so each interval with NaNs is a NaN signal, and a run of
        them that does not end is a divergence that began where the run began."""
        w = self._watch
        w.nan_runs = w.nan_runs + 1 if nan_iters > 0 else 0
        if nan_iters <= 0:
            return None
        if w.nan_runs == 1:
            w.nan_from = (rec, step)
        if w.nan_runs >= _NAN_RUN and self.divergence is None:
            began, began_step = w.nan_from or (rec, step)
            d = Divergence(kind="nan_iterations", step=began_step, line_no=began.line_no,
                           loss_before=_finite(w.baseline), rollback_to_step=self._checkpoint_before(began_step))
            self.divergence = d
            return LossSignal("diverged", began, d)
        if w.onset is None:
            _start(w, rec, step, "nan", math.nan)
            return LossSignal("nan", rec)
        return None

    def _watch_skips(self, rec: Record, step: float, values: dict[str, float]) -> LossSignal | None:
        """Skipped iterations in every logging interval, long after warm-up: the loss scaler cannot find
        a scale at which the gradients are finite any more."""
        w = self._watch
        skipped = values.get("skipped_iters")
        if skipped is None:
            total = values["skipped_total"]
            skipped = total - (w.skipped_total if w.skipped_total is not None else total)
            w.skipped_total = total
        w.skipped_runs = w.skipped_runs + 1 if skipped > 0 else 0
        if w.skipped_runs == 1:
            w.skipped_from = (rec, step)
        if w.skipped_runs >= 8 and w.seen > self.min_points and self.divergence is None:
            # Confirmed now, it began where the run of skipping intervals began: that line stands for it,
            # and the rollback is to a checkpoint before it.
            began, began_step = w.skipped_from or (rec, step)
            d = Divergence(kind="skipped", step=began_step, line_no=began.line_no, loss_before=_finite(w.baseline),
                           rollback_to_step=self._checkpoint_before(began_step))
            self.divergence = d
            w.skipped_runs = 0
            return LossSignal("diverged", began, d)
        return None

    def _watch_grad(self, rec: Record, step: float, grad: float, loss: float | None) -> LossSignal | None:
        w = self._watch
        if not math.isfinite(grad):
            if loss is None and w.onset is None:
                _start(w, rec, step, "grad_norm", math.nan)
            return None
        if w.grad_baseline is None or w.seen <= self.min_points:
            w.grad_baseline = grad if w.grad_baseline is None else 0.9 * w.grad_baseline + 0.1 * grad
            return None
        if grad > 100 * max(w.grad_baseline, 1e-6) and w.onset is None and loss is None:
            _start(w, rec, step, "grad_norm", grad)
            return None
        if loss is not None and grad > _GRAD_SURGE * max(w.grad_baseline, 1e-6):
            surge = w.grad_surge
            w.grad_surge = (rec, step, 0) if surge is None else (surge[0], surge[1], surge[2] + 1)
            return None  # the course is not moved by a surge
        w.grad_surge = None
        w.grad_baseline = 0.95 * w.grad_baseline + 0.05 * grad
        return None

    def _checkpoint_before(self, step: float) -> int | None:
        saved = [s for s, _ in self.checkpoints if s < step]
        return max(saved) if saved else None

    def close(self) -> LossSignal | None:
        """The log ended: a NaN never followed by a finite loss, or a run far above the course that had
        not come back, diverged."""
        w = self._watch
        if w.onset is None:
            return None
        start, step, before, peak = w.onset
        if w.onset_kind != "spike":
            return self._diverged(w, start, step, before, peak)
        # Every point since the onset stayed above the course (else the run would have ended): it
        # diverged when the loss was still far above where it had been (a spike on its way back down
        # when the log ended says nothing), or when the log ends on a jump that doubled the loss.
        still_high = w.after >= 1 and w.last >= before + max(0.4 * abs(before), 4 * w.spread)
        if math.isfinite(before) and (still_high or (w.after == 0 and peak >= 2 * before > 0)):
            return self._diverged(w, start, step, before, peak)
        return None

    # -- checkpoints, completion, learning ----------------------------------------------------------------

    def note_completion(self, line_no: int, ts: float | None = None) -> None:
        if line_no >= self.completed_line:
            self._flush_all()  # the advances so far, exactly (completion lines are few)
            self.completed_line = line_no
            self.completed_ts = ts if ts is not None else self.completed_ts
            self.completed_advances = sum(s.advances for s in self._sources.values())

    def note_checkpoint(self, step: int, line_no: int, ts: float | None = None) -> None:
        recent = len(self.checkpoints) - 4
        for i, (s, _) in enumerate(self.checkpoints[-4:]):
            if s == step:  # every rank says it saved its shard of the same checkpoint: saved when the last said so
                known = self.checkpoint_ts[max(recent, 0) + i]
                if ts is not None and (known is None or ts > known):
                    self.checkpoint_ts[max(recent, 0) + i] = ts
                return
        if len(self.checkpoints) >= _MAX_CHECKPOINTS:
            self.checkpoints = self.checkpoints[len(self.checkpoints) // 2:]
            self.checkpoint_ts = self.checkpoint_ts[len(self.checkpoint_ts) // 2:]
        self.checkpoints.append((step, line_no))
        self.checkpoint_ts.append(ts)

    def learner(self, key: bytes) -> Learner:
        learner = self.learners.get(key)
        if learner is None:
            if len(self.learners) > 4096:
                self.learners.clear()
            learner = self.learners[key] = Learner()
        return learner

    # -- what the rest of the pipeline asks ------------------------------------------------------------

    def mark(self, source_key: str, feed: int = 0) -> ProgressMark:
        """Where a source, the sources of its stream (`feed`) and the job are now: stamped on each event as
        it is found (the lines the fast path left unread are read first: the job's highest step must be
        exact here as at the end)."""
        self._flush_all()
        src = self._sources.get(source_key)
        return ProgressMark(
            stream_advances=self._stream_mark(feed),
            source_advances=src.advances if src is not None else 0,
            source_step=src.step if src is not None else None,
            job_advances=self._advances,
            job_rises=self.rises,
            job_step=self.max_step,
            job_lines=sum(s.lines for s in self._sources.values()),
        )

    def _stream_mark(self, feed: int) -> tuple[tuple[str, int], ...]:
        """Each source of the stream with its advances so far; the same tuple again while none advanced (a
        burst of events, 64 ranks' watchdogs, is one look at the stream, not 64)."""
        keys = self._by_feed.get(feed, ())
        cached = self._stream_marks.get(feed)
        if cached is not None and cached[0] == self._advances and cached[1] == len(keys):
            return cached[2]
        stream = tuple((key, self._sources[key].advances) for key in keys)
        self._stream_marks[feed] = (self._advances, len(keys), stream)
        return stream

    def summary(self, last_output: dict[str, tuple[int, float | None]] | None = None) -> ProgressSummary:
        """The report's view (see ProgressSummary); `last_output`: each source's last line of any kind."""
        self._flush_all()
        sources = [
            SourceProgress(
                key=key, rank=s.rank, host=s.host, first_line=s.first_line, last_line=s.last_line,
                first_step=s.first_step, last_step=s.step, first_ts=s.first_ts, last_ts=s.last_ts,
                lines=s.lines, advances=s.advances, steps_per_s=s.steps_per_s, step_delta=s.step_delta,
                advanced_at=tuple(sorted(s.advanced_at)), course=tuple(s.course.points),
            )
            for key, s in self._sources.items()
        ]
        return ProgressSummary(
            lines=sum(s.lines for s in self._sources.values()),
            last_step=self.max_step,
            last_line=max((s.last_line for s in self._sources.values()), default=0),
            last_ts=max((s.last_ts for s in self._sources.values() if s.last_ts is not None), default=None),
            sources=sources,
            loss=list(self._loss.points),
            step_time_s=list(self._step_time.points),
            divergence=self.divergence,
            recovered_spikes=list(self.recovered_spikes),
            checkpoints=list(self.checkpoints),
            checkpoint_ts=list(self.checkpoint_ts),
            step_times=list(self._job_steps.points),
            restarts=[Restart(r.from_step, r.from_ts, r.to_step, r.line_no, r.ts, r.passed_ts, r.sources)
                      for r in self.restarts],
            completed_line=self.completed_line,
            completed_ts=self.completed_ts,
            completed_advances=self.completed_advances,
            last_output=dict(last_output or {}),
            job_advances=self._advances,
            job_rises=self.rises,
        )


def _start(w: _Watch, rec: Record, step: float, kind: str, peak: float) -> None:
    course = w.low if w.low is not None else w.baseline
    w.onset = (rec, step, course if course is not None else math.nan, peak)
    w.onset_kind, w.after, w.last, w.run_sum = kind, 0, math.nan, 0.0


def _warming_up(step: float | None, seen: int) -> bool:
    """The first steps of a run (warm-up, a learning rate still rising) jump about: no divergence there."""
    return (step is not None and step < _WARM_UP_STEPS) or seen < 2


def _course(low: float, spread: float) -> float:
    """The highest a loss can be and still be on its course: its low, plus its usual wobble or a few
    percent (a loss that settles 10% above where it was is a damaged run, not a recovered one)."""
    return low + max(0.05 * abs(low), 3 * spread, 0.02)


def _far_above(before: float, peak: float, spread: float) -> bool:
    """Far enough above its course to be a blow-up: half as high again (6.4 -> 9.6), a little more for
    small losses (2.0 -> 3.3), and well beyond the loss's usual wobble (a per-step loss jumps a lot)."""
    return peak > max(1.5 * before + 0.3, before + 6 * spread)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
