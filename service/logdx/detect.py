"""Stage 3: turn kept lines into events.

A Python traceback, printed by one rank while 63 others print theirs line by line in between,
becomes one event with its frames and exception. An NCCL warning, an Xid, a signal exit, a NaN
loss, a stall are events too. Events are what rules are matched against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from logdx.config import DetectSettings
from logdx.flightrec.frtext import parse_fr_trace_text
from logdx.model import CompressionSummary, Event, EventKind, Frame, KeptLine, Record
from logdx.patterns import (
    CHAINED,
    GLUED_EXCEPTION,
    ORIGINAL_TRACEBACK,
    TRACEBACK_START,
    exception_line,
    is_interleaved_stray,
    is_traceback_body,
    strip_traceback_prefix,
    traceback_prefix,
)
from logdx.stacks import classify_line

_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S+))?')
_RICH_PATH = re.compile(r"(?P<path>(?:[A-Za-z]:)?[/\\~][^\s│:]*\.py):(?P<line>\d+)?(?: in (?P<func>[\w<>]+))?")
_RICH_LINE_FUNC = re.compile(r"^[│|\s]*(?P<line>\d+) in (?P<func>[\w<>]+)")
_XID = re.compile(r"Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>\d+)")
_XID_PID = re.compile(r"\bpid=(\d+)")
_KILLED_PROCESS = re.compile(r"\bKilled process (\d+)")
_PCI = re.compile(r"\b(?P<pci>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")
_EXITCODE = re.compile(r"exitcode\s*:\s*(?P<code>-?\d+)|Signal (?P<sig>\d+) \((?P<name>SIG\w+)\)")
_PID = re.compile(r"\(pid:? (\d+)\)|\bpid[= ](\d+)")
_LOSS = re.compile(r"\bloss\b['\"]?[\s\w/]{0,20}?[\s:=|]+\s*(?P<v>nan|-?inf|[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.I)
_CONTINUATION_LINES = 3
# "ORTE has lost communication with its daemon located on node:" then, a line or two later,
# "  hostname:  node123": the host of a message is in a field of its own.
_ON_NODE = re.compile(r"\b(?:on|located on|from) (?:the )?(?:node|host)s?:\s*$", re.I)
_HOST_FIELD = re.compile(r"^\s*(?:hostname|host|node|Node|Local host|Remote host)\s*:\s*([A-Za-z0-9][\w.-]*)\s*$")
_HOST_FIELD_LINES = 3
_LOGGER_ERROR = re.compile(r"(?:CRITICAL|ERROR)\b[:\s]")
_LOGGER_LEVEL = re.compile(r"(?:CRITICAL|ERROR|WARNING|WARN|INFO|DEBUG)\b[:\s]")
# No watchdog lets a job hang this long: a "gap" that size is two clocks disagreeing, not a stall.
_CLOCK_JUMP_S = 2 * 86400.0
_BOX = ("│", "┃", "╭", "╰", "┏", "┗")
_RETRY = re.compile(r"(?i)\bretrying\b|\bwill retry\b|\[retry \d+/\d+\]|\bretry(?: attempt)? \d+(?:/| of )\d+")
_RETRY_LINES = 3


def _introduces(wrapper: Event, rec: Record) -> bool:
    """An exception whose message ends in a colon ("BackendCompilerFailed: backend='inductor'
    raised:") introduces the one printed right after it: the error it wraps."""
    return (
        "wraps" not in wrapper.attrs
        and (wrapper.exception_message or "").rstrip().endswith(":")
        and 0 < rec.line_no - wrapper.anchor.line_no <= 2
    )


_RAISE = re.compile(r"raise\s+(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)\s*(?:\(|$)")


def _raised_by_last_frame(ev: Event) -> None:
    """A traceback cut off before its exception line still names it when its last frame's code is the
    raise statement ("raise ChildFailedError("): that class is the exception, its message unknown."""
    if ev.frames and ev.frames[-1].code and (m := _RAISE.match(ev.frames[-1].code)) is not None:
        ev.exception_type, ev.exception_message = m.group("type"), ""


@dataclass(slots=True)
class DetectConfig:
    # Declared once, in config.DetectSettings: a stall is this many typical step intervals without
    # progress, and at least this long.
    stall_factor: float = DetectSettings.model_fields["stall_factor"].default
    stall_min_s: float = DetectSettings.model_fields["stall_min_s"].default
    max_events: int = 20_000


@dataclass(slots=True)
class _OpenTraceback:
    event: Event
    pending_path: str | None = None  # rich tracebacks split "path.py:" and "123 in func" over lines
    closed: bool = False
    continuation_left: int = 0
    prefix: str = ""  # what the logger writes before each traceback line
    glued: str | None = None  # the exception class glued to the closing line; its ": message" is next
    writers: int = 1  # headers seen while open: processes printing their tracebacks into one stream at once
    strays: int = 0  # lines in a row, among those, that are no traceback body (a frame's code that lost its indent)


@dataclass(slots=True)
class _Thread:
    name: str
    main: bool
    tid: str | None = None
    frames: list[Frame] = field(default_factory=list)  # innermost first, as dumps print them
    records: list[Record] = field(default_factory=list)  # the line of each frame


@dataclass(slots=True)
class _OpenStack:
    """A stack dump being read: one process's threads (py-spy `dump`, faulthandler, gdb), or, in a
    dump that groups identical stacks ("4 in:" then the thread lines that share the stack after them),
    the main threads of several processes."""

    header: Record
    pid: int | None = None
    section: str | None = None  # the name the collection gave the dumps (a node's file, a host): KeptLine.section
    threads: list[_Thread] = field(default_factory=list)
    group: list[_Thread] = field(default_factory=list)  # the threads the next frames belong to
    lines: list[Record] = field(default_factory=list)

    def thread(self, name: str, main: bool, tid: str | None = None) -> None:
        t = _Thread(name=name, main=main, tid=tid)
        self.threads.append(t)
        if self.group and self.group[0].frames:
            self.group = []  # the previous stack is complete: this header starts the next one
        self.group.append(t)

    def frame(self, frame: Frame, rec: Record) -> None:
        if not self.group:
            self.thread("", main=False)
        for t in self.group:
            t.frames.append(frame)
            t.records.append(rec)

    def events(self) -> list[Event]:
        """One `stack_dump` event per process: its main thread's frames (outermost first, as in a
        traceback; `attrs["frame_lines"]` the line of each), anchored at its innermost frame."""
        threads = [t for t in self.threads if t.frames]
        mains = [t for t in threads if t.main]
        if self.pid is None and len(mains) > 1:  # several processes' main threads in one block
            return [self._event(t, t.tid or t.name) for t in mains]
        # faulthandler marks no thread when it dumps them all (dump_traceback_later): one thread per process
        # runs the script's top level, so several such threads are several processes' dumps one after another.
        tops = [t for t in threads if t.frames[-1].function == "<module>"]
        if self.pid is None and not mains and len(tops) > 1:
            return [self._event(t, t.tid or t.name) for t in tops]
        if not threads:
            return []
        return [self._event(mains[0] if mains else _likely_main(threads), self.pid)]

    def _event(self, t: _Thread, pid: object) -> Event:
        attrs: dict[str, object] = {"pid": pid, "tid": t.tid, "thread": t.name, "threads": len(self.threads),
                                    "frame_lines": list(reversed(t.records))}
        if self.section is not None:
            attrs["section"] = self.section
        return Event(kind=EventKind.STACK_DUMP, anchor=t.records[0], lines=self.lines, frames=list(reversed(t.frames)),
                     attrs=attrs)


def _process_state(kept: KeptLine) -> Event:
    """A process `ps` shows in uninterruptible sleep, with the name the collection gave its listing."""
    proc = kept.process
    assert proc is not None
    attrs: dict[str, object] = {"pid": proc.pid, "state": proc.state, "command": proc.command}
    if proc.wchan:
        attrs["wchan"] = proc.wchan
    if kept.section is not None:
        attrs["section"] = kept.section
    return Event(kind=EventKind.PROCESS_STATE, anchor=kept.record, lines=[kept.record], attrs=attrs)


_MAX_STACK_THREADS = 256
# A thread the threading module started: its outermost frame is the bootstrap (never the main thread).
_THREAD_BOOTSTRAP = frozenset({"_bootstrap", "_bootstrap_inner"})


def _likely_main(threads: list[_Thread]) -> _Thread:
    """The main thread of a dump that does not mark it (faulthandler's dump_traceback_later lists every
    thread as "Thread 0x..."): the one running the script's top level; else, of the threads the
    threading module did not start, the last listed (CPython lists the newest thread first, so the main
    thread, the oldest, comes last)."""
    top = next((t for t in threads if t.frames[-1].function == "<module>"), None)
    if top is not None:
        return top
    own = [t for t in threads if t.frames[-1].function not in _THREAD_BOOTSTRAP]
    return (own or threads)[-1]


@dataclass
class Detector:
    config: DetectConfig = field(default_factory=DetectConfig)

    def __post_init__(self) -> None:
        self._open: dict[str, _OpenTraceback] = {}
        # The last exception each process raised: a re-raised "Original Traceback", or the next
        # link of a chain, refers to it.
        self._last_raised: dict[str, Event] = {}
        self._chain_pending: set[str] = set()  # "During handling of the above exception" was said
        self._host_follows: dict[str, Event] = {}  # an event whose host is on one of the next lines
        self._stacks: dict[str, _OpenStack] = {}  # a stack dump being read, per source
        self._reports: dict[str, list[Record]] = {}  # an fr_trace report being read, per source
        self._last_line_event: dict[str, Event] = {}  # per source: what a "Retrying in 1s" line is about
        self.events_emitted = 0

    def feed(self, kept: KeptLine) -> list[Event]:
        """Consume one kept line; returns the events it completes or starts (usually none)."""
        rec = kept.record
        key = rec.source_key
        self._note_named_host(key, rec)
        if kept.reason == "stack":
            return self._stack_line(key, rec, kept.section)
        if kept.reason == "fr":
            self._reports.setdefault(key, []).append(rec)
            return []
        if key in self._stacks or key in self._reports:  # anything else from the process ends its block
            return self._count(self._close_stack(key) + self._close_report(key)) + self.feed(kept)
        if kept.reason == "dstate" and kept.process is not None:
            return self._count([_process_state(kept)])
        if rec.text.lstrip().startswith(CHAINED):
            self._chain_pending.add(key)  # the traceback that follows is the next link of the chain
            return []
        if kept.reason == "traceback":
            return self._traceback_line(key, rec)
        out: list[Event] = []
        open_tb = self._open.get(key)
        if open_tb is not None and open_tb.closed:
            del self._open[key]
        if kept.reason == "error" and not rec.text.startswith(_BOX):
            # A box-drawn line is source code quoted by a rich traceback, not something that happened.
            self._note_retry(key, rec)
            ev = self._line_event(rec)
            self._last_line_event[key] = ev
            self._expect_host(ev)
            if ev.exception_type:  # a stray exception line: its message may go on, as after a traceback
                self._open[key] = _OpenTraceback(event=ev, closed=True, continuation_left=_CONTINUATION_LINES)
            out.append(ev)
        elif kept.reason == "loss":
            out.append(self._loss_event(kept))
        return self._count(out)

    def _note_retry(self, key: str, rec: Record) -> None:
        """"Retrying in 1s [Retry 1/5]" right after an error line: the program handles that error by
        trying again, it does not end with it (the retries that run out end in an error of their own)."""
        previous = self._last_line_event.get(key)
        if previous is not None and rec.line_no - previous.line_no <= _RETRY_LINES and _RETRY.search(rec.text):
            previous.attrs["retried"] = True
        if len(self._last_line_event) > 8192:
            self._last_line_event.clear()

    def _note_named_host(self, key: str, rec: Record) -> None:
        """A message that ends "... located on node:" names the host on one of its next lines, in a
        "hostname: X" field (Open MPI's help boxes): that host is the event's own."""
        ev = self._host_follows.get(key)
        if ev is None:
            return
        if rec.line_no - ev.anchor.line_no > _HOST_FIELD_LINES:  # lines of the log, kept or not
            del self._host_follows[key]
        elif (m := _HOST_FIELD.match(rec.text)) is not None:
            ev.attrs["named_host"] = m.group(1)
            del self._host_follows[key]

    def _expect_host(self, ev: Event) -> None:
        if _ON_NODE.search(ev.anchor.text):
            self._host_follows[ev.anchor.source_key] = ev

    def finish(self, summary: CompressionSummary, last_progress: Record | None = None) -> list[Event]:
        """Close what is still open and look at the stream as a whole (stalls)."""
        dumps = [ev for key in list(self._stacks) for ev in self._close_stack(key)]
        dumps += [ev for key in list(self._reports) for ev in self._close_report(key)]
        for tb in self._open.values():
            if tb.glued is not None:  # the stream ended on a closing line with a glued class
                tb.event.exception_type, tb.event.exception_message = tb.glued, ""
                tb.event.anchor = tb.event.lines[-1]
        out = dumps + [tb.event for tb in self._open.values() if not tb.closed]
        for ev in out:
            if not ev.exception_type:
                _raised_by_last_frame(ev)
                # The log ends inside it: a crash being printed. (One that other lines cut into may
                # have its exception printed further on, between them: nothing is said of that one.)
                ev.attrs["ends_log"] = True
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

    # -- stack dumps --------------------------------------------------------------------------------

    def _stack_line(self, key: str, rec: Record, section: str | None) -> list[Event]:
        what = classify_line(rec.text)
        out: list[Event] = []
        dump = self._stacks.get(key)
        # Another node's dumps (a new section) start a dump of their own, "Process" line or not (grouped dumps).
        if what is None or what.kind == "process" or dump is None or dump.section != section:
            if dump is not None:
                out = self._close_stack(key)
            dump = self._stacks[key] = _OpenStack(header=rec, section=section)
        if what is None:
            return self._count(out)
        dump.lines.append(rec)
        if what.kind == "process":
            dump.pid = what.pid
        elif what.kind == "thread" and len(dump.threads) < _MAX_STACK_THREADS:
            dump.thread(what.thread or "", what.main, what.tid)
        elif what.kind == "frame" and what.frame is not None:
            dump.frame(what.frame, rec)
        return self._count(out)

    def _close_report(self, key: str) -> list[Event]:
        """An fr_trace report (torch's flight-recorder analyser) as one `fr_report` event with its findings."""
        lines = self._reports.pop(key, None)
        if not lines:
            return []
        findings = parse_fr_trace_text(r.text for r in lines)
        if not findings.groups:
            return []
        return [Event(kind=EventKind.FR_REPORT, anchor=lines[0], lines=lines, attrs={"findings": findings})]

    def _close_stack(self, key: str) -> list[Event]:
        dump = self._stacks.pop(key, None)
        return dump.events() if dump is not None else []

    # -- tracebacks ---------------------------------------------------------------------------------

    def _traceback_line(self, key: str, rec: Record) -> list[Event]:
        text = rec.text
        tb = self._open.get(key)
        if TRACEBACK_START in text:
            if tb is None or tb.closed:
                chained = key in self._chain_pending
                self._chain_pending.discard(key)
                tb = _OpenTraceback(event=Event(kind=EventKind.TRACEBACK, anchor=rec, lines=[rec]), prefix=traceback_prefix(text))
                self._open[key] = tb
                self._link(key, tb.event, original=ORIGINAL_TRACEBACK in text, chained=chained)
                # An exception printed with a traceback as its message ("IndexError: Traceback...").
                m = exception_line(text)
                if m and m.group("type") and not text.startswith(TRACEBACK_START):
                    tb.event.attrs["header_exception"] = m.group("type")
            else:
                tb.event.lines.append(rec)
                tb.writers += 1
            return []
        if tb is None:
            # A stray exception or continuation without a header we saw: stand-alone line event.
            return self._count([self._line_event(rec)]) if exception_line(text) else []
        text = strip_traceback_prefix(text, tb.prefix)
        if tb.glued is not None:
            return self._unglue(key, tb, rec, text)
        if tb.closed:
            return self._continue_message(key, tb, rec, text)
        tb.event.lines.append(rec)
        if is_traceback_body(text):
            tb.strays = 0
            self._add_frame(tb, text)
            return []
        if is_interleaved_stray(text, tb.writers, tb.strays):
            tb.strays += 1
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

    def _link(self, key: str, event: Event, *, original: bool, chained: bool) -> None:
        """A re-raise's "Original Traceback" is the cause of the exception just raised by the same
        process, which only wraps it; a chained traceback follows the one it was chained to."""
        previous = self._last_raised.get(key)
        if previous is None:
            return
        if original:
            previous.attrs["wraps"] = event
            event.attrs["wrapped_by"] = previous
        elif chained:
            previous.attrs["chained_to"] = event
            event.attrs["chained_from"] = previous

    def _close_with_exception(self, tb: _OpenTraceback, rec: Record, text: str) -> list[Event]:
        ev = tb.event
        tb.closed = True
        m = exception_line(text, closes_traceback=True)
        if m:
            ev.exception_type = m.group("type")
            ev.exception_message = (m.group("msg") or "").strip()
            ev.anchor = rec
            tb.continuation_left = _CONTINUATION_LINES
            self._last_raised[tb.event.anchor.source_key] = ev
        elif (g := GLUED_EXCEPTION.search(text.rstrip())) is not None:
            tb.closed, tb.glued = False, g.group("type")  # wait for the next line: its ": message"?
            return []
        else:
            # A traceback cut off (the log was truncated, or another tool's output followed).
            ev.anchor = ev.lines[-2] if len(ev.lines) > 1 else ev.lines[0]
            ev.lines.pop()
            _raised_by_last_frame(ev)
        return self._count([ev])

    def _unglue(self, key: str, tb: _OpenTraceback, rec: Record, text: str) -> list[Event]:
        """The line after a closing line with a glued class: ": message" completes the exception
        (a class glued to its own end is the next writer's, dropped); anything else means the
        exception had no message, and the line is read as usual."""
        ev, glued = tb.event, tb.glued
        tb.glued, tb.closed = None, True
        ev.exception_type = glued
        self._last_raised[ev.anchor.source_key] = ev
        stripped = text.strip()
        if stripped.startswith(":"):
            ev.exception_message = GLUED_EXCEPTION.sub("", stripped[1:].strip()).strip()
            ev.anchor = rec
            ev.lines.append(rec)
            tb.continuation_left = _CONTINUATION_LINES
            return self._count([ev])
        ev.exception_message = ""
        ev.anchor = ev.lines[-1]
        return self._count([ev]) + self._traceback_line(key, rec)

    def _continue_message(self, key: str, tb: _OpenTraceback, rec: Record, text: str) -> list[Event]:
        ev = tb.event
        text = text.strip()
        # A message goes on in plain words; a line with its own timestamp, a progress bar or a new
        # exception is the next record, whatever it printed next to it.
        introduced = _introduces(ev, rec) and exception_line(text, closes_traceback=True) is not None
        looks_like_record = (
            (not text) or text.startswith("[") or rec.ts is not None or "%|" in text or bool(exception_line(text))
            or introduced  # "BackendCompilerFailed: ... raised:" then "OutOfResources: ...": the wrapped error
            or text.startswith(": ")  # another writer's glued exception message (see _unglue)
            or _LOGGER_LEVEL.match(text) is not None  # "ERROR:torch.distributed...": a logger's next record
        )
        if tb.continuation_left > 0 and ev.exception_type and not looks_like_record:
            tb.continuation_left -= 1
            ev.exception_message = f"{ev.exception_message} {text}".strip()
            ev.lines.append(rec)
            return []
        del self._open[key]
        # The next record, kept as the message's continuation: an event of its own when it says one
        # (an exception, a launcher's exit, an Xid, an NCCL warning, a logger's error).
        ev = self._line_event(rec, any_class=introduced)
        if ev.kind != EventKind.LINE or ev.exception_type or _LOGGER_ERROR.match(text):
            return self._count([ev])
        return []

    # -- single-line events -------------------------------------------------------------------------

    def _line_event(self, rec: Record, any_class: bool = False) -> Event:
        """`any_class`: the line is introduced as an exception (after "... raised:"), whatever its
        class is called."""
        text = rec.text
        ev = Event(kind=EventKind.LINE, anchor=rec, lines=[rec])
        if "Xid" in text:
            m = _XID.search(text)
            if m:
                ev.kind = EventKind.XID
                ev.gpu = m.group("pci")
                ev.attrs["xid"] = int(m.group("code"))
                pid = _XID_PID.search(text)
                if pid:
                    ev.attrs["pid"] = int(pid.group(1))
        elif "NCCL" in text and ("WARN" in text or "ERROR" in text):
            ev.kind = EventKind.NCCL
        elif "ChildFailedError" in text:
            ev.kind = EventKind.CHILD_FAILED
        elif "Killed process" in text and (m := _KILLED_PROCESS.search(text)):
            ev.attrs["pid"] = int(m.group(1))  # the kernel's OOM killer names the process it killed
        else:
            m = _EXITCODE.search(text)
            if m:
                ev.kind = EventKind.SIGNAL_EXIT
                code = m.group("code")
                ev.attrs["exitcode"] = int(code) if code else -int(m.group("sig"))
                pid = _PID.search(text)
                if pid:
                    ev.attrs["pid"] = int(pid.group(1) or pid.group(2))
        if ev.gpu is None:
            m = _PCI.search(text)
            if m:
                ev.gpu = m.group("pci")
        m = exception_line(text, closes_traceback=any_class)
        if m:
            ev.exception_type = m.group("type")
            ev.exception_message = (m.group("msg") or "").strip()
            previous = self._last_raised.get(rec.source_key)
            if previous is not None and _introduces(previous, rec):
                previous.attrs["wraps"] = ev
                ev.attrs["wrapped_by"] = previous
            self._last_raised[rec.source_key] = ev
        return ev

    def _loss_event(self, kept: KeptLine) -> Event:
        """A NaN/inf loss as it is printed (`loss_nan`), or a divergence the timeline confirmed
        (`loss_spike`: a spike that did not come back, skipped or NaN iterations every interval, a
        gradient blow-up), anchored where it began."""
        rec = kept.record
        d = kept.divergence
        if d is not None and d.kind != "nan":
            attrs: dict[str, object] = {"divergence": d.kind, "step": d.step, "loss_before": d.loss_before,
                                        "loss_after": d.loss_after, "rollback_to_step": d.rollback_to_step}
            return Event(kind=EventKind.LOSS_SPIKE, anchor=rec, lines=[rec], attrs=attrs)
        m = _LOSS.search(rec.text)
        value = m.group("v").lower() if m else "nan"
        attrs = {"loss": value}
        if d is not None:
            attrs.update({"divergence": d.kind, "step": d.step, "rollback_to_step": d.rollback_to_step})
        return Event(kind=EventKind.LOSS_NAN, anchor=rec, lines=[rec], attrs=attrs)

    def _stall_event(self, summary: CompressionSummary, last_progress: Record | None) -> Event | None:
        if last_progress is None or last_progress.ts is None or summary.last_progress_ts is None or summary.last_ts is None:
            return None  # the last progress line says no time: how long ago it was cannot be told
        gap = summary.last_ts - summary.last_progress_ts
        interval = summary.step_interval_s or 0.0
        if gap < max(self.config.stall_factor * interval, self.config.stall_min_s):
            return None
        if gap > _CLOCK_JUMP_S:
            return None  # two clocks (a local glog stamp, a UTC one), not a job stuck for days
        return Event(
            kind=EventKind.STALL,
            anchor=last_progress,
            lines=[last_progress],
            attrs={"stalled_s": round(gap, 1), "step_interval_s": round(interval, 3)},
        )

