"""`diagnose job.log` (= `logdx diagnose job.log`): one report for one job's log, or for its files.

`diagnose DIR` or `diagnose node-01.log node-02.log ...` reads several files as one job, each file's
host or rank taken from its name, the lines merged in time order (`logdx.cli.inputs`).

Every report is stored (`store.path`) so that `diagnose feedback ID` can learn from it, rules-only
runs included, and the nodes the log names (and the one it blames) feed `logdx nodes`; `--no-store`
leaves the store alone (a log from another cluster, read for a look)."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import sqlite3
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from logdx import formats
from logdx.cli.interrupt import Interrupted, until_interrupted
from logdx.faces import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    add_color_args,
    add_engine_args,
    build_engine,
    settings_from,
    use_color,
)

if TYPE_CHECKING:
    from typing import BinaryIO

    from logdx.act.report import Report
    from logdx.cli.inputs import LineMap, LogFile
    from logdx.config import Settings
    from logdx.flightrec import FrFindings
    from logdx.formats import Meta
    from logdx.incidents import IncidentStore
    from logdx.model import FailureContext, TemplateStats
    from logdx.normalize import Source
    from logdx.pipeline import Engine, Session


def add_diagnose_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="diagnose a log file, or a job's files")
    add_diagnose_args(p)
    p.set_defaults(func=cmd_diagnose)


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG",
                   help="the job's log (.gz is read transparently; - for stdin); several files or a folder are "
                        "one job: each file's host or rank from its name (node-01.log, host=node-01.log, "
                        "rank-3.log; input.name_patterns), the lines merged in time order")
    p.add_argument("--format", default="auto", metavar="FORMAT",
                   help=f"{', '.join(formats.names()[:-1])}, or auto (the default: "
                        "recognised by the first bytes where that is unambiguous, else text)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="also write the job page to FILE: one self-contained HTML file (verdict, per-host "
                        "timeline, curves, root line in context, evidence, templates) that opens from disk")
    p.add_argument("--fr-dumps", default=None, metavar="PATH",
                   help="the job's PyTorch flight-recorder dumps (a directory of per-rank files, or one file): "
                        "the ranks missing from the collective the others wait in name a hang's culprit")
    p.add_argument("--exit-code", type=int, default=None, metavar="N",
                   help="how the job ended, when you know it: 0 with no fatal event in the log is healthy "
                        "(whatever it printed on the way; a process's own abort or uncaught exception still fails "
                        "it); non-zero is a failure even when the log says nothing. Without it, a log that shows "
                        "neither a failure nor health (no end of the run, no training past its errors) is unknown")
    p.add_argument("--job-id", metavar="ID",
                   help="the job's name in the node history (logdx nodes); default: the log's path")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="how far the input has been read, on stderr: auto (on a terminal, for inputs read in more "
                        "than 2 s), always (a line a second and one at the end), never")
    p.add_argument("--no-store", action="store_true",
                   help="store neither the report nor the nodes it names (feedback on it is then impossible)")
    add_engine_args(p)
    add_color_args(p)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from logdx.cli.inputs import collect
    from logdx.formats import FormatError
    from logdx.normalize import InputError

    settings = settings_from(args)
    fr = _flight_recorder(args.fr_dumps) if args.fr_dumps else None
    engine = build_engine(settings, args.rules)
    logs: list[str] = args.logs
    several = len(logs) > 1 or Path(logs[0]).is_dir()
    try:
        if several:
            diagnosed = diagnose_files(engine, collect(logs, settings.input), args.format, args.exit_code, fr,
                                       args.progress)
        else:
            diagnosed = diagnose_file(engine, logs[0], args.format, args.exit_code, fr, args.progress)
    except (InputError, FormatError) as e:
        raise UsageError(str(e)) from None
    report = diagnosed.report
    if report.status == "empty" and diagnosed.partial:
        raise KeyboardInterrupt  # stopped before a line came: nothing to report
    if report.status == "empty":
        what = "stdin" if logs == ["-"] else " ".join(logs)
        raise UsageError(f"{what}: no log lines to diagnose (empty input)")
    job_id = args.job_id or _default_job_id(logs)
    if not args.no_store:
        keep(engine, diagnosed, job_id)
    if args.html:
        _write_page(args.html, job_id, diagnosed)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        from logdx.act.render import render_text  # (not for --json: the report's own JSON)

        sys.stdout.write(render_text(report, color=use_color(args, sys.stdout)))
    return EXIT_INTERRUPTED if diagnosed.partial else EXIT_OK


@dataclass(slots=True)
class Diagnosed:
    report: Report
    context: FailureContext | None
    hosts: list[str]  # every host the log named: nodes `logdx nodes` has now seen
    templates: list[TemplateStats]  # the job's Drain templates (what `logdx mcp` shows an agent)
    session: Session | None = None  # what diagnosed it (the job page is drawn from its state)
    partial: bool = False  # the reading was interrupted: the report is of what was read until then


def _write_page(path: str, job_id: str, diagnosed: Diagnosed) -> None:
    """The job page as one file (`--html`); an unwritable path is a usage error."""
    from logdx.web.render import Done, render_job_page
    from logdx.web.view import build_view

    assert diagnosed.session is not None
    html = render_job_page(build_view(job_id, diagnosed.report, diagnosed.session), Done(served=False), inline=True)
    try:
        Path(path).write_text(html, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--html {path}: cannot write: {e.strerror or e}") from None


def _flight_recorder(path: str) -> FrFindings:
    from logdx.flightrec import FrDumpError, analyse, load_dumps

    try:
        return analyse(load_dumps(path))
    except FrDumpError as e:
        raise UsageError(f"--fr-dumps: {e}") from None


@dataclass(slots=True)
class Watch:
    """What stderr's progress line reads while an input is fed (cli/progress.py)."""

    name: str
    mode: str = "never"
    position: Callable[[], tuple[int, int] | None] | None = None


def _diagnose(engine: Engine, feed: Callable[[Session], dict[str, int]], exit_code: int | None,
              fr: FrFindings | None = None, watch: Watch | None = None) -> Diagnosed:
    """Feed a session (`feed` returns what it refused, by reason), then diagnose it (`exit_code`: how
    the job ended, when known; `fr`: its flight-recorder findings; `watch`: progress on stderr)."""
    from logdx.cli.progress import Progress

    session = engine.new_session()
    watch = watch or Watch("")
    with Progress(watch.name, lambda: session.lines, watch.position, mode=watch.mode):
        refused = feed(session)
    if fr is not None:
        session.add_flight_recorder(fr)
    report = session.report(exit_code)
    if refused:
        report.notes.append("records without a line, skipped: " + ", ".join(f"{n} {r}" for r, n in sorted(refused.items())))
    return Diagnosed(report, session.last_context, sorted(session.summary().hosts), session.templates(), session)


def _position_of(f: BinaryIO) -> Callable[[], tuple[int, int] | None] | None:
    from logdx.cli.progress import file_position

    try:
        return file_position(f.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def _meta(settings: Settings, source: Source | None = None) -> Meta:
    from logdx import formats
    from logdx.normalize import Source

    s = settings.input
    return formats.Meta(source=source or Source(), job="-", max_line_bytes=s.max_line_bytes,
                        max_record_bytes=s.max_record_bytes, max_document_bytes=s.max_document_bytes)


def _format_of(f: BinaryIO, name: str, fmt: str) -> str:
    """The format an input is read as: `fmt`, else what its first bytes say; binary data that is no
    format logdx knows is refused, never read as text."""
    from logdx import formats
    from logdx.formats.text import looks_binary
    from logdx.normalize import InputError

    head = f.peek(formats.SNIFF_BYTES)[: formats.SNIFF_BYTES] if hasattr(f, "peek") else b""
    chosen = formats.by_name(fmt).name if fmt != "auto" else formats.sniff_file(head).name
    if chosen == "text" and looks_binary(head):
        raise InputError(f"{name}: binary data, not a text log (for a shipper's format, see --format)")
    return chosen


def _year_of_input(path: str, fmt: str, max_line: int) -> tuple[int, int]:
    """The year stamps without one belong to before a line says: a file's first full stamp, else the year it
    was last written; what is piped in is read as it is written (this year)."""
    import time

    from logdx.cli.inputs import LogFile, read_head, year_of

    if path != "-":
        log = LogFile(Path(path), path)
        found = year_of([log], [read_head(log, max_line) if fmt == formats.TEXT.name else None])
        if found is not None:
            return found
    now = time.gmtime()
    return now.tm_year, now.tm_mon


def diagnose_file(engine: Engine, path: str, fmt: str, exit_code: int | None = None,
                  fr: FrFindings | None = None, progress: str = "never") -> Diagnosed:
    """One input: text goes the fast way, a shipper's format through `logdx.formats`, every record
    one job's (whatever job it names), records without a line noted in the report."""
    from logdx import formats
    from logdx.normalize import InputError, iter_lines, open_input

    name = "stdin" if str(path) == "-" else str(path)
    max_line = engine.settings.input.max_line_bytes
    with open_input(path) as f:
        chosen = _format_of(f, name, fmt)
        year = _year_of_input(path, chosen, max_line)

        def feed(session: Session) -> dict[str, int]:
            session.hint_year(*year)
            if chosen == "text" and name != "stdin":
                session.feed_lines(iter_lines(f, max_line))
                return {}
            refused: dict[str, int] = {}
            batches = formats.read_stream(f, _meta(engine.settings), chosen)
            for batch in (until_interrupted(batches, interrupted) if name == "stdin" else batches):
                session.feed_runs((source, lines) for _, source, lines in batch.runs)
                for reason, n in batch.refused.items():
                    refused[reason] = refused.get(reason, 0) + n
            return refused

        interrupted = Interrupted()
        try:
            # Only a live stream is cut by Ctrl-C into a partial report; a file is read whole or not at all.
            with interrupted.on_sigint() if name == "stdin" else contextlib.nullcontext():
                diagnosed = _diagnose(engine, feed, exit_code, fr, Watch(name, progress, _position_of(f)))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{name}: truncated or corrupt gzip data ({e})") from None
        if interrupted.stopped:
            diagnosed.partial = True
            diagnosed.report.notes.append(
                f"partial: interrupted (Ctrl-C) after {diagnosed.report.compression.lines_in:,} lines; this is what "
                "they show, and the job may still be running")
        return diagnosed


def diagnose_files(engine: Engine, files: list[LogFile], fmt: str, exit_code: int | None = None,
                   fr: FrFindings | None = None, progress: str = "never") -> Diagnosed:
    """Several files as one job, merged in time order; a file found in a folder that is no log
    (binary data) is skipped with a note, a file named outright is an error."""
    from logdx.cli.inputs import LineMap, merged_lines, open_log, read_head, resolve_hosts, year_of
    from logdx.formats import FormatError
    from logdx.normalize import InputError

    skipped: list[str] = []
    refused: dict[str, int] = {}  # records without a line, by reason
    max_line = engine.settings.input.max_line_bytes
    with ExitStack() as stack:
        opened = []
        for f in files:
            handle = stack.enter_context(open_log(f))
            try:
                chosen = _format_of(handle, f.shown, fmt)
            except InputError:
                if not f.found:
                    raise
                skipped.append(f.shown)
                continue
            opened.append((f, handle, chosen))
        if not opened:
            raise InputError(f"no log text in {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}")
        # The hosts the job's own lines name decide what the files' names may say (and the year of stamps without one).
        heads = [read_head(f, max_line) if chosen == "text" else None for f, _, chosen in opened]
        used, host_notes = resolve_hosts([f for f, _, _ in opened], heads)
        year = year_of(used, heads)
        streams = [_pairs(engine, handle, f, chosen, refused) for f, (_, handle, chosen) in zip(used, opened)]
        where = LineMap(used)

        def feed(session: Session) -> dict[str, int]:
            if year is not None:
                session.hint_year(*year)
            counts = [0] * len(used)
            for index, raw, source in merged_lines(streams, max_line, year):
                counts[index] += 1
                session.feed(raw, source)
                where.note(session.lines, index, counts[index])
            return refused

        try:
            diagnosed = _diagnose(engine, feed, exit_code, fr, Watch(f"{len(used)} files", progress))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"truncated or corrupt gzip data in one of the files ({e})") from None
        except FormatError as e:
            raise InputError(e.message) from None
    diagnosed.report.notes.extend(_merge_notes(used, skipped, where, diagnosed.report) + host_notes)
    return diagnosed


def _pairs(engine: Engine, handle: BinaryIO, f: LogFile, fmt: str,
           refused: dict[str, int]) -> Iterator[tuple[bytes, Source | None]]:
    """One file's lines with what its name says about them (records keep what they say themselves)."""
    from logdx import formats
    from logdx.normalize import Source, iter_lines

    if fmt == formats.TEXT.name:
        source = f.source
        for line in iter_lines(handle, engine.settings.input.max_line_bytes):
            yield line, source
        return
    for batch in formats.read_stream(handle, _meta(engine.settings, f.source or Source()), fmt):
        for reason, n in batch.refused.items():
            refused[reason] = refused.get(reason, 0) + n
        for _, source, lines in batch.runs:
            for line in lines:
                yield line, source


def _merge_notes(used: list[LogFile], skipped: list[str], where: LineMap, report: Report) -> list[str]:
    named = [f"{f.shown} ({f.host or f'rank {f.rank}'}{'' if f.host_from in ('name', '') else ', ' + f.host_from})"
             for f in used if f.host or f.rank is not None]
    notes = [f"{len(used)} files read as one job, lines merged in time order"
             + (f"; from their names: {', '.join(named[:8])}{' ...' if len(named) > 8 else ''}" if named else
                "; no host or rank in their names (input.name_patterns)")]
    if skipped:
        notes.append(f"skipped {len(skipped)} file(s) that are no log text: {', '.join(skipped[:5])}"
                     + (" ..." if len(skipped) > 5 else ""))
    if report.root_cause is not None and report.root_cause.line_no:
        found = where.locate(report.root_cause.line_no)
        if found is not None:
            notes.append(f"line numbers count the merged lines: the root line {report.root_cause.line_no} "
                         f"is {found[0].shown} line {found[1]}")
    return notes


def _default_job_id(logs: list[str]) -> str:
    if logs == ["-"]:
        return "stdin"
    return ", ".join(str(Path(p).resolve()) for p in logs[:3]) + (" ..." if len(logs) > 3 else "")


def keep(engine: Engine, diagnosed: Diagnosed, job_id: str) -> None:
    """Store the report (for `diagnose feedback`), and the nodes the log named and blamed (for
    `logdx nodes`); a read-only or locked store must not cost the report: it says so in a note."""
    from logdx.act.costs import CostBook
    from logdx.act.nodes import NodeBook
    from logdx.act.policy import cordon_targets
    from logdx.store import MigrationError

    report, settings = diagnosed.report, engine.settings
    try:
        if engine.incidents is None:  # a rules-only engine: no model stage opened the store
            engine.incidents = _open_incidents(settings)
        engine.remember(report, diagnosed.context)
        book = NodeBook(engine.incidents.db, settings.actions)
        book.seen(diagnosed.hosts)
        book.record_diagnosis(job_id, report, cordon_targets(report))
        costs = CostBook(engine.incidents.db)
        costs.record(job_id, report)
        if diagnosed.session is not None:
            costs.follow(job_id, diagnosed.session.summary().progress)
    except (OSError, sqlite3.Error, MigrationError) as e:
        report.notes.append(f"report not stored ({e}); feedback on it will not be possible")


def _open_incidents(settings: Settings) -> IncidentStore:
    from logdx.incidents import IncidentStore
    from logdx.store import open_db

    return IncidentStore(open_db(settings.store.location, settings.store.pool_size))
