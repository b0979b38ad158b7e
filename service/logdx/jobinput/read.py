"""Inputs as one job, fed to a session: one file or stream (`OneInput`), or several files (`JobFiles`).

`open_job` is the one reading of "these inputs are one job" every face shares (`diagnose`, `logdx mcp`, the
evaluation): one path is one log (text the fast way, a shipper's format through `logdx.formats`); several
paths, or a folder, are the files of one job, each file's host or rank from its name (`files`), their lines
merged in time order (`merge`) and fed as the records the merge made.
"""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from logdx import formats
from logdx.formats import Batch, FormatError
from logdx.jobinput.files import LogFile, collect, read_head, resolve_hosts, year_of
from logdx.jobinput.merge import LineMap, Merge
from logdx.normalize import InputError, Source, iter_lines, open_input

if TYPE_CHECKING:
    from logdx.act.report import Report
    from logdx.config import InputSettings
    from logdx.flightrec import FrFindings
    from logdx.model import FailureContext, TemplateStats
    from logdx.pipeline import Engine, Session

__all__ = ["Diagnosed", "JobFiles", "JobInput", "OneInput", "diagnose_job", "is_several", "open_job"]


class JobInput:
    """What a face feeds a session from: `feed` returns what it refused (records without a line, by reason);
    `notes` are what the report should say about the reading."""

    name: str  # how the input is named to the user ("stdin", a path, "16 files")

    def feed(self, session: Session) -> dict[str, int]:
        raise NotImplementedError

    def notes(self, report: Report) -> list[str]:
        return []


def _meta(settings: InputSettings, source: Source | None = None) -> formats.Meta:
    return formats.Meta(source=source or Source(), job="-", max_line_bytes=settings.max_line_bytes,
                        max_record_bytes=settings.max_record_bytes, max_document_bytes=settings.max_document_bytes)


def format_of(f: BinaryIO, name: str, fmt: str) -> str:
    """The format an input is read as: `fmt`, else what its first bytes say; binary data that is no
    format logdx knows is refused, never read as text."""
    from logdx.formats.text import looks_binary

    head = f.peek(formats.SNIFF_BYTES)[: formats.SNIFF_BYTES] if hasattr(f, "peek") else b""
    chosen = formats.by_name(fmt).name if fmt != "auto" else formats.sniff_file(head).name
    if chosen == formats.TEXT.name and looks_binary(head):
        raise InputError(f"{name}: binary data, not a text log (for a shipper's format, see --format)")
    return chosen


def _year_of_input(path: str, fmt: str, max_line: int) -> tuple[int, int]:
    """The year stamps without one belong to before a line says: a file's first full stamp, else the year it
    was last written; what is piped in is read as it is written (this year)."""
    if path != "-":
        log = LogFile(Path(path), path)
        found = year_of([log], [read_head(log, max_line) if fmt == formats.TEXT.name else None])
        if found is not None:
            return found
    now = time.gmtime()
    return now.tm_year, now.tm_mon


class OneInput(JobInput):
    """One log: a file, stdin, or bytes in hand. Text goes the fast way (`Session.feed_lines`), a shipper's
    format (and whatever stdin carries) through `logdx.formats`, every record one job's (whatever job it names).
    `year`: what its stamps without one belong to before a line says (None: only its lines say).
    `until`: what a face wraps a live stream's batches in (a Ctrl-C that ends the reading, `logdx.cli`)."""

    def __init__(self, handle: BinaryIO, name: str, fmt: str, settings: InputSettings,
                 year: tuple[int, int] | None = None) -> None:
        self.handle, self.name, self.fmt, self.settings, self.year = handle, name, fmt, settings, year
        self.live = name == "stdin"
        self.until: Callable[[Iterable[Batch]], Iterable[Batch]] | None = None

    @classmethod
    @contextmanager
    def open(cls, path: str, fmt: str, settings: InputSettings) -> Iterator[OneInput]:
        """A file (`-`: stdin), its format `fmt` or sniffed, its year from its first full stamp or when it was
        written (stdin: now)."""
        name = "stdin" if str(path) == "-" else str(path)
        with open_input(path) as f:
            chosen = format_of(f, name, fmt)
            yield cls(f, name, chosen, settings, _year_of_input(path, chosen, settings.max_line_bytes))

    def feed(self, session: Session) -> dict[str, int]:
        try:
            return self._feed(session)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{self.name}: truncated or corrupt gzip data ({e})") from None

    def _feed(self, session: Session) -> dict[str, int]:
        if self.year is not None:
            session.hint_year(*self.year)
        if self.fmt == formats.TEXT.name and not self.live:
            session.feed_lines(iter_lines(self.handle, self.settings.max_line_bytes))
            return {}
        refused: dict[str, int] = {}
        batches: Iterable[Batch] = formats.read_stream(self.handle, _meta(self.settings), self.fmt)
        for batch in (self.until(batches) if self.until is not None else batches):
            session.feed_runs((source, lines) for _, source, lines in batch.runs)
            for reason, n in batch.refused.items():
                refused[reason] = refused.get(reason, 0) + n
        return refused


class JobFiles(JobInput):
    """Several files as one job, merged in time order; a file found in a folder that is no log (binary data)
    is skipped with a note, a file named outright is an error. Open them with `JobFiles.open`."""

    def __init__(self, opened: list[tuple[LogFile, BinaryIO, str]], skipped: list[str],
                 settings: InputSettings) -> None:
        self.settings, self.skipped = settings, skipped
        max_line = settings.max_line_bytes
        # The hosts the job's own lines name decide what the files' names may say (and the year of stamps without one).
        heads = [read_head(f, max_line) if chosen == formats.TEXT.name else None for f, _, chosen in opened]
        self.files, self.host_notes = resolve_hosts([f for f, _, _ in opened], heads)
        self.year = year_of(self.files, heads)
        self.refused: dict[str, int] = {}  # records without a line, by reason
        self.streams = [self._pairs(handle, f, chosen) for f, (_, handle, chosen) in zip(self.files, opened)]
        self.where: LineMap[LogFile] = LineMap(self.files)
        self.name = f"{len(self.files)} files"

    @classmethod
    @contextmanager
    def open(cls, files: Sequence[LogFile], fmt: str, settings: InputSettings) -> Iterator[JobFiles]:
        skipped: list[str] = []
        with ExitStack() as stack:
            opened = []
            for f in files:
                handle = stack.enter_context(open_input(f.path))
                try:
                    chosen = format_of(handle, f.shown, fmt)
                except InputError:
                    if not f.found:
                        raise
                    skipped.append(f.shown)
                    continue
                opened.append((f, handle, chosen))
            if not opened:
                raise InputError(f"no log text in {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}")
            yield cls(opened, skipped, settings)

    def feed(self, session: Session) -> dict[str, int]:
        merge = Merge(self.streams, self.settings.max_line_bytes, self.year)
        if self.year is not None:
            session.hint_year(*self.year)
        try:
            session.feed_records(merge.records(), self.where.note)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"truncated or corrupt gzip data in one of the files ({e})") from None
        except FormatError as e:
            raise InputError(e.message) from None
        session.absorb(merge.clocks)
        return self.refused

    def _pairs(self, handle: BinaryIO, f: LogFile, fmt: str) -> Iterator[tuple[bytes, Source | None]]:
        """One file's lines with what its name says about them (records keep what they say themselves)."""
        if fmt == formats.TEXT.name:
            source = f.source
            for line in iter_lines(handle, self.settings.max_line_bytes):
                yield line, source
            return
        for batch in formats.read_stream(handle, _meta(self.settings, f.source or Source()), fmt):
            for reason, n in batch.refused.items():
                self.refused[reason] = self.refused.get(reason, 0) + n
            for _, source, lines in batch.runs:
                for line in lines:
                    yield line, source

    def notes(self, report: Report) -> list[str]:
        used, skipped = self.files, self.skipped
        named = [f"{f.shown} ({f.host or f'rank {f.rank}'}{'' if f.host_from in ('name', '') else ', ' + f.host_from})"
                 for f in used if f.host or f.rank is not None]
        notes = [f"{len(used)} files read as one job, lines merged in time order"
                 + (f"; from their names: {', '.join(named[:8])}{' ...' if len(named) > 8 else ''}" if named else
                    "; no host or rank in their names (input.name_patterns)")]
        if skipped:
            notes.append(f"skipped {len(skipped)} file(s) that are no log text: {', '.join(skipped[:5])}"
                         + (" ..." if len(skipped) > 5 else ""))
        if report.root_cause is not None and report.root_cause.line_no:
            found = self.where.locate(report.root_cause.line_no)
            if found is not None:
                notes.append(f"line numbers count the merged lines: the root line {report.root_cause.line_no} "
                             f"is {found[0].shown} line {found[1]}")
        return [*notes, *self.host_notes]


def is_several(paths: Sequence[str]) -> bool:
    """Several paths, or a folder: the files of one job (one path is one log)."""
    return len(paths) > 1 or Path(paths[0]).is_dir()


@contextmanager
def open_job(paths: Sequence[str], settings: InputSettings, fmt: str = "auto") -> Iterator[JobInput]:
    """The paths as one job's input, open until the block ends; `InputError` (the user's to fix) when they
    cannot be read as one."""
    if is_several(paths):
        with JobFiles.open(collect(paths, settings), fmt, settings) as job:
            yield job
    else:
        with OneInput.open(paths[0], fmt, settings) as one:
            yield one


@dataclass(slots=True)
class Diagnosed:
    report: Report
    context: FailureContext | None
    hosts: list[str]  # every host the log named: nodes `logdx nodes` has now seen
    templates: list[TemplateStats]  # the job's Drain templates (what `logdx mcp` shows an agent)
    session: Session | None = None  # what diagnosed it (the job page is drawn from its state)
    partial: bool = False  # the reading was interrupted: the report is of what was read until then


def diagnose_job(engine: Engine, job: JobInput, exit_code: int | None = None, fr: FrFindings | None = None,
                 watch: Callable[[Session], AbstractContextManager[object]] | None = None) -> Diagnosed:
    """Feed a new session from `job`, then diagnose it (`exit_code`: how the job ended, when known; `fr`: its
    flight-recorder findings; `watch`: what runs while it is fed, given the session: a face's progress line)."""
    session = engine.new_session()
    with watch(session) if watch is not None else nullcontext():
        refused = job.feed(session)
    if fr is not None:
        session.add_flight_recorder(fr)
    report = session.report(exit_code)
    if refused:
        report.notes.append("records without a line, skipped: " + ", ".join(f"{n} {r}" for r, n in sorted(refused.items())))
    report.notes.extend(job.notes(report))
    return Diagnosed(report, session.last_context, sorted(session.summary().hosts), session.templates(), session)


def diagnose_paths(engine: Engine, paths: Sequence[str], fmt: str = "auto", exit_code: int | None = None,
                   fr: FrFindings | None = None) -> Diagnosed:
    """`open_job` and `diagnose_job` in one: what a face without progress or Ctrl-C needs."""
    with open_job(paths, engine.settings.input, fmt) as job:
        return diagnose_job(engine, job, exit_code, fr)


def diagnose_files(engine: Engine, files: Sequence[LogFile], fmt: str = "auto", exit_code: int | None = None,
                   fr: FrFindings | None = None) -> Diagnosed:
    """The files `collect` found, as one job."""
    with JobFiles.open(files, fmt, engine.settings.input) as job:
        return diagnose_job(engine, job, exit_code, fr)
