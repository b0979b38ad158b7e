"""`diagnose job.log` (= `logdx diagnose job.log`): one report for one log."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from typing import TYPE_CHECKING

from logdx.faces import (
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
    from logdx.flightrec import FrFindings
    from logdx.formats import Meta
    from logdx.model import FailureContext
    from logdx.pipeline import Engine


def add_diagnose_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("diagnose", help="diagnose a log file")
    add_diagnose_args(p)
    p.set_defaults(func=cmd_diagnose)


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="log file to diagnose (.gz is read transparently; - for stdin)")
    p.add_argument("--format", default="auto", metavar="FORMAT",
                   help="text, ndjson, msgpack, otlp, otlp-json, loki, loki-json, or auto (the default: "
                        "recognised by the first bytes where that is unambiguous, else text)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--fr-dumps", default=None, metavar="PATH",
                   help="the job's PyTorch flight-recorder dumps (a directory of per-rank files, or one file): "
                        "the ranks missing from the collective the others wait in name a hang's culprit")
    p.add_argument("--exit-code", type=int, default=None, metavar="N",
                   help="how the job ended, when you know it: 0 with no fatal event in the log is healthy "
                        "(whatever it printed on the way); non-zero is a failure even when the log says nothing")
    add_engine_args(p)
    add_color_args(p)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from logdx.act.render import render_text
    from logdx.formats import FormatError
    from logdx.normalize import InputError

    fr = _flight_recorder(args.fr_dumps) if args.fr_dumps else None
    engine = build_engine(settings_from(args), args.rules)
    try:
        report, context = diagnose_file(engine, args.log, args.format, args.exit_code, fr)
    except (InputError, FormatError) as e:
        raise UsageError(str(e)) from None
    if report.status == "empty":
        raise UsageError(f"{'stdin' if args.log == '-' else args.log}: no log lines to diagnose (empty input)")
    remember(engine, report, context)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report, color=use_color(args, sys.stdout)))
    return EXIT_OK


def _flight_recorder(path: str) -> FrFindings:
    from logdx.flightrec import FrDumpError, analyse, load_dumps

    try:
        return analyse(load_dumps(path))
    except FrDumpError as e:
        raise UsageError(f"--fr-dumps: {e}") from None


def diagnose_file(engine: Engine, path: str, fmt: str, exit_code: int | None = None,
                  fr: FrFindings | None = None) -> tuple[Report, FailureContext | None]:
    """Text goes the fast way (`Engine.diagnose_path`); a shipper's format through `logdx.formats`,
    every record one job's (whatever job it names), records without a line noted in the report."""
    import gzip
    import zlib

    from logdx import formats
    from logdx.formats.text import looks_binary
    from logdx.normalize import InputError, open_input

    settings = engine.settings.input
    meta = formats.Meta(job="-", max_line_bytes=settings.max_line_bytes, max_record_bytes=settings.max_record_bytes,
                        max_document_bytes=settings.max_document_bytes)
    with open_input(path) as f:
        head = f.peek(formats.SNIFF_BYTES)[: formats.SNIFF_BYTES] if hasattr(f, "peek") else b""
        chosen = formats.by_name(fmt).name if fmt != "auto" else formats.sniff_file(head).name
        if chosen == "text" and looks_binary(head):
            name = "stdin" if str(path) == "-" else str(path)
            raise InputError(f"{name}: binary data, not a text log (for a shipper's format, see --format)")
        if chosen == "text":
            if str(path) != "-":
                return engine.diagnose_path(path, exit_code, fr)
            return _feed(engine, f, meta, "text", exit_code, fr)
        try:
            return _feed(engine, f, meta, chosen, exit_code, fr)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{path}: truncated or corrupt gzip data ({e})") from None


def _feed(engine: Engine, f: BinaryIO, meta: Meta, fmt: str, exit_code: int | None = None,
          fr: FrFindings | None = None) -> tuple[Report, FailureContext | None]:
    from logdx import formats

    session = engine.new_session()
    refused: dict[str, int] = {}
    for batch in formats.read_stream(f, meta, fmt):
        session.feed_runs((source, lines) for _, source, lines in batch.runs)
        for reason, n in batch.refused.items():
            refused[reason] = refused.get(reason, 0) + n
    if fr is not None:
        session.add_flight_recorder(fr)
    report = session.report(exit_code)
    if refused:
        report.notes.append("records without a line, skipped: " + ", ".join(f"{n} {r}" for r, n in sorted(refused.items())))
    return report, session.last_context


def remember(engine: Engine, report: Report, context: FailureContext | None) -> None:
    """Keep the report for `diagnose feedback`; a read-only or locked store must not cost the report."""
    try:
        engine.remember(report, context)
    except (OSError, sqlite3.Error) as e:
        report.notes.append(f"report not stored ({e}); feedback on it will not be possible")
