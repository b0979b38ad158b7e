"""Command-line interface: a thin shell over the pipeline.

`diagnose job.log` is the short form of `logdx diagnose job.log`; `logdx` is the umbrella command.
Exit codes: 0 a report was produced (whatever it says), 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from logdx import __version__

EXIT_OK = 0
EXIT_USAGE = 2


class UsageError(Exception):
    """Anything the user can fix: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)")


def _add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="log file to diagnose (.gz is read transparently; - for stdin)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                   help="extra rule pack folder (repeatable)")
    p.add_argument("--config", type=Path, help="config file (YAML or TOML); default $LOGDX_CONFIG")
    p.add_argument("--no-llm", action="store_true", help="skip the LLM stage")
    p.add_argument("--no-retrieval", action="store_true", help="skip retrieval over past incidents")
    color = p.add_mutually_exclusive_group()
    color.add_argument("--color", dest="color", action="store_true", default=None, help="force colour")
    color.add_argument("--no-color", dest="color", action="store_false", help="never colour")


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from logdx.act.render import render_text
    from logdx.normalize import InputError

    engine = _engine(args)
    try:
        report = engine.diagnose_path(args.log)
    except InputError as e:
        raise UsageError(str(e)) from None
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        color = args.color if args.color is not None else (sys.stdout.isatty() and "NO_COLOR" not in os.environ)
        sys.stdout.write(render_text(report, color=color))
    return EXIT_OK


def _engine(args: argparse.Namespace):  # noqa: ANN202 - Engine, imported lazily for a fast --help
    from logdx.config import ConfigError, load_settings
    from logdx.diagnose.rules import RuleError
    from logdx.pipeline import Engine

    try:
        settings = load_settings(getattr(args, "config", None))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "no_llm", False):
        settings.llm.enabled = False
    if getattr(args, "no_retrieval", False):
        settings.retrieval.enabled = False
    for d in getattr(args, "rules", []) or []:
        if not d.is_dir():
            raise UsageError(f"--rules {d}: not a directory")
    try:
        return Engine.create(settings, extra_rule_dirs=getattr(args, "rules", []) or [])
    except RuleError as e:
        raise UsageError(str(e)) from None


def _cmd_rules_test(args: argparse.Namespace) -> int:
    from logdx.diagnose.rules import RuleError, check_examples, default_rules_dir, load_rules

    dirs = [default_rules_dir(), *args.dirs]
    try:
        ruleset = load_rules(dirs)
    except RuleError as e:
        raise UsageError(str(e)) from None
    problems = check_examples(ruleset)
    for p in problems:
        print(p)
    print(f"{len(ruleset.rules)} rules in {len(dirs)} folder(s): {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return EXIT_OK if not problems else 1


def _cmd_synth(args: argparse.Namespace) -> int:
    from logdx import synth

    return synth.main(args.synth_args)


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Diagnose why a training job failed, from its logs.")
    parser.add_argument("--version", action="version", version=f"logdx {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("diagnose", help="diagnose a log file")
    _add_diagnose_args(p)
    p.set_defaults(func=_cmd_diagnose)

    rules = sub.add_parser("rules", help="work with rule packs")
    rules_sub = rules.add_subparsers(dest="rules_command", parser_class=_Parser, metavar="SUBCOMMAND")
    rt = rules_sub.add_parser("test", help="load all packs and check every rule against its examples")
    rt.add_argument("dirs", nargs="*", type=Path, help="extra rule pack folders")
    rt.set_defaults(func=_cmd_rules_test)

    sy = sub.add_parser("synth", help="generate a realistic multi-rank training log", add_help=False)
    sy.add_argument("synth_args", nargs=argparse.REMAINDER)
    sy.set_defaults(func=_cmd_synth)

    from logdx.api.server import add_serve_parser  # light: FastAPI loads only when serve runs
    from logdx.supervise import add_run_parser

    add_run_parser(sub)
    add_serve_parser(sub)
    return parser


def _run(argv: Sequence[str], prog: str, build: Callable[[str], argparse.ArgumentParser]) -> int:
    parser = build(prog)
    try:
        args = parser.parse_args(list(argv))
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return EXIT_USAGE
        return int(func(args))
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """`logdx COMMAND ...`"""
    return _run(sys.argv[1:] if argv is None else argv, "logdx", _build_parser)


def diagnose_main(argv: Sequence[str] | None = None) -> int:
    """`diagnose job.log` is `logdx diagnose job.log`; `diagnose incidents ...` etc. reach the others."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DIAGNOSE_SUBCOMMANDS:
        return _run(args, "diagnose", _build_parser)
    return _run(["diagnose", *args], "diagnose", _build_parser)


_DIAGNOSE_SUBCOMMANDS = {"incidents", "feedback", "rules"}


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy, so that its exception classes are the ones
    # other modules raise (`python -m logdx.cli` would otherwise have two UsageErrors).
    from logdx import cli

    sys.exit(cli.main())
