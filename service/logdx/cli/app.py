"""The command lines: `logdx COMMAND ...`, and `diagnose` (its short form for one log).

Exit codes: 0 a report was produced (whatever it says), 1 a check found problems, 2 bad usage or
unreadable input (one line on stderr), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from logdx import __version__, progress
from logdx.cli.diagnose import add_diagnose_args, add_diagnose_parser, cmd_diagnose
from logdx.faces import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, FACE_COMMANDS, Parser, UsageError

_DESCRIPTION = "Diagnose why a training job failed, from its logs."
# What `diagnose X` reaches besides a log: the commands a user of `diagnose` needs.
_DIAGNOSE_SUBCOMMANDS = frozenset({"incidents", "feedback", "rules"})


def build_parser(prog: str = "logdx") -> argparse.ArgumentParser:
    # The other commands' modules load only when their parsers are built: `diagnose` (the common
    # command, see `_build_diagnose_only`) imports none of them.
    import importlib

    from logdx.cli.config import add_config_parsers
    from logdx.cli.costs import add_cost_parsers
    from logdx.cli.incidents import add_incident_parsers
    from logdx.cli.nodes import add_node_parsers
    from logdx.cli.tools import add_tool_parsers

    parser, sub = _top_parser(prog)
    add_diagnose_parser(sub)
    add_tool_parsers(sub, Parser)
    add_incident_parsers(sub, Parser)
    add_node_parsers(sub, Parser)
    add_cost_parsers(sub)
    add_config_parsers(sub, Parser)
    for spec in FACE_COMMANDS:  # `logdx run`, `serve`, `mcp`: the other faces' own commands, by name
        module, _, add_parser = spec.partition(":")
        getattr(importlib.import_module(module), add_parser)(sub)
    return parser


def _top_parser(prog: str) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = Parser(prog=prog, description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"logdx {__version__}")
    return parser, parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")


def _build_diagnose_only(prog: str = "logdx") -> argparse.ArgumentParser:
    """`logdx diagnose ...`: the same parser as `build_parser`'s for that command, without the others
    (their modules cost more to import than a short log costs to diagnose)."""
    parser, sub = _top_parser(prog)
    add_diagnose_parser(sub)
    return parser


def build_diagnose_parser(prog: str = "diagnose") -> argparse.ArgumentParser:
    """`diagnose LOG [options]`: the diagnose command as a program of its own."""
    parser = Parser(prog=prog, description=_DESCRIPTION,
                    epilog=f"also: {prog} incidents|feedback|rules ... (see logdx --help)")
    parser.add_argument("--version", action="version", version=f"logdx {__version__}")
    add_diagnose_args(parser)
    parser.set_defaults(func=cmd_diagnose)
    return parser


def run_command(argv: Sequence[str], prog: str, build: Callable[[str], argparse.ArgumentParser]) -> int:
    """Parse and run one command; every way it can end becomes an exit code and at most one line."""
    try:
        parser = build(prog)
        args = parser.parse_args(list(argv))
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return EXIT_USAGE
        # Slow first-time work (model conversion, indexing) says what it does on stderr; the
        # server logs it instead (its listener is the app's).
        listener = progress.to_stderr() if getattr(args, "progress", "stderr") == "stderr" else None
        try:
            return int(func(args))
        finally:
            if listener is not None:
                progress.remove_listener(listener)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. piped into `head`: not an error
        _silence_stdout()
        return EXIT_OK


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """`logdx COMMAND ...`"""
    args = list(sys.argv[1:] if argv is None else argv)
    # `logdx diagnose LOG` parses exactly as with every command's parser; `logdx --help` needs them all.
    build = _build_diagnose_only if args[:1] == ["diagnose"] else build_parser
    return run_command(args, "logdx", build)


def diagnose_main(argv: Sequence[str] | None = None) -> int:
    """`diagnose job.log` is `logdx diagnose job.log`; `diagnose incidents ...` etc. reach the others."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DIAGNOSE_SUBCOMMANDS:
        return run_command(args, "diagnose", build_parser)
    return run_command(args, "diagnose", build_diagnose_parser)
