"""`diagnose job.log` (= `logdx diagnose job.log`): one report for one job's log, or for its files.

`diagnose DIR` or `diagnose node-01.log node-02.log ...` reads several files as one job, each file's
host or rank taken from its name, the lines merged in time order (`logdx.jobinput`, the reading every
face shares).

Every report is stored (`store.path`) so that `diagnose feedback ID` can learn from it, rules-only
runs included, and the nodes the log names (and the one it blames) feed `logdx nodes`; `--no-store`
leaves the store alone (a log from another cluster, read for a look)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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

    from logdx.flightrec import FrFindings
    from logdx.jobinput.read import Diagnosed, JobInput
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
    from logdx.formats import FormatError
    from logdx.jobinput.keep import keep
    from logdx.jobinput.read import open_job
    from logdx.normalize import InputError

    settings = settings_from(args)
    fr = _flight_recorder(args.fr_dumps) if args.fr_dumps else None
    engine = build_engine(settings, args.rules)
    logs: list[str] = args.logs
    try:
        with open_job(logs, engine.settings.input, args.format) as job:
            diagnosed = _diagnose(engine, job, args.exit_code, fr, args.progress)
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


def _diagnose(engine: Engine, job: JobInput, exit_code: int | None, fr: FrFindings | None,
              progress: str) -> Diagnosed:
    """The job diagnosed, with progress on stderr (`progress`: cli/progress.py's mode); a live stream (stdin)
    is read until its end or the first Ctrl-C, which ends the reading: the report is then of what was read,
    marked partial (a file is read whole or not at all)."""
    from logdx.cli.progress import Progress
    from logdx.jobinput.read import OneInput, diagnose_job

    one = job if isinstance(job, OneInput) else None
    position = _position_of(one.handle) if one is not None else None

    def watch(session: Session) -> Progress:
        return Progress(job.name, lambda: session.lines, position, mode=progress)

    if one is None or not one.live:
        return diagnose_job(engine, job, exit_code, fr, watch)
    interrupted = Interrupted()
    one.until = lambda batches: until_interrupted(batches, interrupted)
    with interrupted.on_sigint():
        diagnosed = diagnose_job(engine, job, exit_code, fr, watch)
    if interrupted.stopped:
        diagnosed.partial = True
        diagnosed.report.notes.append(
            f"partial: interrupted (Ctrl-C) after {diagnosed.report.compression.lines_in:,} lines; this is what "
            "they show, and the job may still be running")
    return diagnosed


def _position_of(f: BinaryIO) -> Callable[[], tuple[int, int] | None] | None:
    from logdx.cli.progress import file_position

    try:
        return file_position(f.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def _default_job_id(logs: list[str]) -> str:
    if logs == ["-"]:
        return "stdin"
    return ", ".join(str(Path(p).resolve()) for p in logs[:3]) + (" ..." if len(logs) > 3 else "")
