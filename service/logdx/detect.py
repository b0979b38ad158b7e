"""Stage 3: turn kept lines into events.

A Python traceback, printed by one rank while 63 others print theirs line by line in between,
becomes one event with its frames and exception. An NCCL warning, an Xid, a signal exit, a NaN
loss, a stall are events too. Events are what rules are matched against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from logdx.model import CompressionSummary, Event, Frame, KeptLine, Record
from logdx.patterns import TRACEBACK_START, is_traceback_body, strip_traceback_prefix, traceback_prefix

_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S+))?')
_RICH_PATH = re.compile(r"(?P<path>(?:[A-Za-z]:)?[/\\~][^\s│:]*\.py):(?P<line>\d+)?(?: in (?P<func>[\w<>]+))?")
_RICH_LINE_FUNC = re.compile(r"^[│|\s]*(?P<line>\d+) in (?P<func>[\w<>]+)")
# "torch.OutOfMemoryError: CUDA out of memory", "KeyError: 'x'", "raise ValueError(" is not one.
_EXCEPTION = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure|Iteration|Timeout|Abort)\w*"
    r"|KeyboardInterrupt|SystemExit|StopIteration|AssertionError)(?::\s?(?P<msg>.*))?$"
)
_XID = re.compile(r"Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>\d+)")
_XID_PID = re.compile(r"\bpid=(\d+)")
_PCI = re.compile(r"\b(?P<pci>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")
_EXITCODE = re.compile(r"exitcode\s*:\s*(?P<code>-?\d+)|Signal (?P<sig>\d+) \((?P<name>SIG\w+)\)")
_LOSS = re.compile(r"\bloss\b['\"]?[\s\w/]{0,20}?[\s:=|]+\s*(?P<v>nan|-?inf|[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.I)
_CONTINUATION_LINES = 3
_BOX = ("│", "┃", "╭", "╰", "┏", "┗")


@dataclass(slots=True)
class DetectConfig:
    stall_factor: float = 10.0  # a stall is this many typical step intervals without progress...
    stall_min_s: float = 300.0  # ...and at least this long
    max_events: int = 20_000


@dataclass(slots=True)
class _OpenTraceback:
    event: Event
    pending_path: str | None = None  # rich tracebacks split "path.py:" and "123 in func" over lines
    closed: bool = False
    continuation_left: int = 0
    prefix: str = ""  # what the logger writes before each traceback line


@dataclass
class Detector:
    config: DetectConfig = field(default_factory=DetectConfig)

    def __post_init__(self) -> None:
        self._open: dict[str, _OpenTraceback] = {}
        self.events_emitted = 0

    def feed(self, kept: KeptLine) -> list[Event]:
        """Consume one kept line; returns the events it completes or starts (usually none)."""
        rec = kept.record
        key = rec.source_key
        if kept.reason == "traceback":
            return self._traceback_line(key, rec)
        out: list[Event] = []
        open_tb = self._open.get(key)
        if open_tb is not None and open_tb.closed:
            del self._open[key]
        if kept.reason == "error" and not rec.text.startswith(_BOX):
            # A box-drawn line is source code quoted by a rich traceback, not something that happened.
            out.append(self._line_event(rec))
        elif kept.reason == "loss":
            out.append(self._loss_event(rec))
        return self._count(out)

    def finish(self, summary: CompressionSummary, last_progress: Record | None = None) -> list[Event]:
        """Close what is still open and look at the stream as a whole (stalls)."""
        out = [tb.event for tb in self._open.values() if not tb.closed]
        self._open.clear()
        stall = self._stall_event(summary, last_progress)
        if stall is not None:
            out.append(stall)
        return self._count(out)

    def _count(self, events: list[Event]) -> list[Event]:
        if self.events_emitted >= self.config.max_events:
            return []
        self.events_emitted += len(events)
        return events

    # -- tracebacks ---------------------------------------------------------------------------------

    def _traceback_line(self, key: str, rec: Record) -> list[Event]:
        text = rec.text
        tb = self._open.get(key)
        if TRACEBACK_START in text:
            if tb is None or tb.closed:
                tb = _OpenTraceback(event=Event(kind="traceback", anchor=rec, lines=[rec]), prefix=traceback_prefix(text))
                self._open[key] = tb
                # An exception printed with a traceback as its message ("IndexError: Traceback...").
                m = _EXCEPTION.match(text.strip())
                if m and m.group("type") and not text.startswith(TRACEBACK_START):
                    tb.event.attrs["header_exception"] = m.group("type")
            else:
                tb.event.lines.append(rec)
            return []
        if tb is None:
            # A stray exception or continuation without a header we saw: stand-alone line event.
            return self._count([self._line_event(rec)]) if _EXCEPTION.match(text.strip()) else []
        text = strip_traceback_prefix(text, tb.prefix)
        if tb.closed:
            return self._continue_message(key, tb, rec, text)
        tb.event.lines.append(rec)
        if is_traceback_body(text):
            self._add_frame(tb, text)
            return []
        return self._close_with_exception(tb, rec, text)

    def _add_frame(self, tb: _OpenTraceback, text: str) -> None:
        frames = tb.event.frames
        m = _FRAME.search(text)
        if m:
            frames.append(Frame(path=m.group("path"), line=int(m.group("line")), function=m.group("func")))
            return
        m = _RICH_PATH.search(text)
        if m and (m.group("line") or m.group("func")):
            line = int(m.group("line")) if m.group("line") else None
            frames.append(Frame(path=m.group("path"), line=line, function=m.group("func")))
            return
        if m:
            tb.pending_path = m.group("path")
            return
        if tb.pending_path is not None:
            m2 = _RICH_LINE_FUNC.match(text)
            if m2:
                frames.append(Frame(path=tb.pending_path, line=int(m2.group("line")), function=m2.group("func")))
                tb.pending_path = None
                return
        stripped = text.strip(" │|")
        if frames and frames[-1].code is None and stripped and not stripped.startswith(("^", "~")):
            frames[-1].code = stripped

    def _close_with_exception(self, tb: _OpenTraceback, rec: Record, text: str) -> list[Event]:
        ev = tb.event
        tb.closed = True
        m = _EXCEPTION.match(text.strip())
        if m:
            ev.exception_type = m.group("type")
            ev.exception_message = (m.group("msg") or "").strip()
            ev.anchor = rec
            tb.continuation_left = _CONTINUATION_LINES
        else:
            # A traceback cut off (the log was truncated, or another tool's output followed).
            ev.anchor = ev.lines[-2] if len(ev.lines) > 1 else ev.lines[0]
            ev.lines.pop()
        return self._count([ev])

    def _continue_message(self, key: str, tb: _OpenTraceback, rec: Record, text: str) -> list[Event]:
        ev = tb.event
        text = text.strip()
        looks_like_record = (not text) or text.startswith("[") or bool(_EXCEPTION.match(text))
        if tb.continuation_left > 0 and ev.exception_type and not looks_like_record:
            tb.continuation_left -= 1
            ev.exception_message = f"{ev.exception_message} {text}".strip()
            ev.lines.append(rec)
            return []
        del self._open[key]
        if _EXCEPTION.match(text):
            return self._count([self._line_event(rec)])
        return []

    # -- single-line events -------------------------------------------------------------------------

    def _line_event(self, rec: Record) -> Event:
        text = rec.text
        ev = Event(kind="line", anchor=rec, lines=[rec])
        if "Xid" in text:
            m = _XID.search(text)
            if m:
                ev.kind = "xid"
                ev.gpu = m.group("pci")
                ev.attrs["xid"] = int(m.group("code"))
                pid = _XID_PID.search(text)
                if pid:
                    ev.attrs["pid"] = int(pid.group(1))
        elif "NCCL" in text and ("WARN" in text or "ERROR" in text):
            ev.kind = "nccl"
        elif "ChildFailedError" in text:
            ev.kind = "child_failed"
        else:
            m = _EXITCODE.search(text)
            if m:
                ev.kind = "signal_exit"
                code = m.group("code")
                ev.attrs["exitcode"] = int(code) if code else -int(m.group("sig"))
        if ev.gpu is None:
            m = _PCI.search(text)
            if m:
                ev.gpu = m.group("pci")
        m = _EXCEPTION.match(text.strip())
        if m:
            ev.exception_type = m.group("type")
            ev.exception_message = (m.group("msg") or "").strip()
        return ev

    def _loss_event(self, rec: Record) -> Event:
        m = _LOSS.search(rec.text)
        value = m.group("v").lower() if m else "?"
        kind = "loss_nan" if value in ("nan", "inf", "-inf") else "loss_spike"
        return Event(kind=kind, anchor=rec, lines=[rec], attrs={"loss": value})

    def _stall_event(self, summary: CompressionSummary, last_progress: Record | None) -> Event | None:
        if last_progress is None or summary.last_progress_ts is None or summary.last_ts is None:
            return None
        gap = summary.last_ts - summary.last_progress_ts
        interval = summary.step_interval_s or 0.0
        if gap < max(self.config.stall_factor * interval, self.config.stall_min_s):
            return None
        return Event(
            kind="stall",
            anchor=last_progress,
            lines=[last_progress],
            attrs={"stalled_s": round(gap, 1), "step_interval_s": round(interval, 3)},
        )

