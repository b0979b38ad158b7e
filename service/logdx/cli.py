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
        report, context = engine.diagnose_path(args.log, with_context=True)
    except InputError as e:
        raise UsageError(str(e)) from None
    _remember(engine, report, context)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        color = args.color if args.color is not None else (sys.stdout.isatty() and "NO_COLOR" not in os.environ)
        sys.stdout.write(render_text(report, color=color))
    return EXIT_OK


def _remember(engine, report, context) -> None:  # noqa: ANN001
    """Keep the report for `diagnose feedback`; a read-only or locked store must not cost the report."""
    import sqlite3

    try:
        engine.remember(report, context)
    except (OSError, sqlite3.Error) as e:
        report.notes.append(f"report not stored ({e}); feedback on it will not be possible")


def _settings(args: argparse.Namespace):  # noqa: ANN202 - Settings
    from logdx.config import ConfigError, load_settings

    try:
        return load_settings(getattr(args, "config", None))
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _incident_store(args: argparse.Namespace):  # noqa: ANN202 - IncidentStore
    import sqlite3

    from logdx.incidents import IncidentStore
    from logdx.store import MigrationError, open_db

    path = _settings(args).store.path
    try:
        return IncidentStore(open_db(path))
    except (OSError, sqlite3.Error, MigrationError) as e:
        raise UsageError(f"cannot open the store {path}: {e}") from None


def _engine(args: argparse.Namespace):  # noqa: ANN202 - Engine, imported lazily for a fast --help
    from logdx.diagnose.rules import RuleError
    from logdx.pipeline import Engine

    settings = _settings(args)
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


def _cmd_incidents(args: argparse.Namespace) -> int:
    import json

    from logdx.incidents import IncidentError

    store = _incident_store(args)
    try:
        if args.incidents_command == "list":
            for inc in store.list(category=args.category, failure_type=args.failure_type, limit=args.limit):
                print(f"{inc.id}  {inc.category.value}/{inc.failure_type}  [{inc.source}]  {inc.root_line[:100]}")
        elif args.incidents_command == "show":
            inc = store.get(args.id)
            if inc is None:
                raise UsageError(f"no incident {args.id!r}")
            print(json.dumps(inc.to_json(), indent=2, ensure_ascii=False))
        elif args.incidents_command == "add":
            data = json.loads(args.json_text) if args.json_text else {
                "root_line": args.root_line, "category": args.category, "failure_type": args.failure_type,
                "note": args.note or "",
            }
            inc = store.add(data, source="manual")
            print(inc.id)
        elif args.incidents_command == "remove":
            if not store.remove(args.id):
                raise UsageError(f"no incident {args.id!r}")
            print(f"removed {args.id}")
        elif args.incidents_command == "import":
            result = store.import_jsonl(args.file, strict=args.strict)
            for err in result.errors:
                print(err, file=sys.stderr)
            print(f"{result.added} added, {result.updated} updated, {len(result.errors)} rejected")
            return EXIT_OK if not result.errors else 1
        elif args.incidents_command == "export":
            n = store.export_jsonl(sys.stdout if args.file == "-" else args.file)
            if args.file != "-":
                print(f"{n} incidents written to {args.file}")
    except (IncidentError, ValueError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}") from None
    return EXIT_OK


def _cmd_feedback(args: argparse.Namespace) -> int:
    from logdx.incidents import IncidentError

    store = _incident_store(args)
    try:
        inc = store.feedback(args.report_id, args.category, args.failure_type, action=args.action, note=args.note)
    except IncidentError as e:
        raise UsageError(str(e)) from None
    print(f"{inc.id}: {inc.category.value}/{inc.failure_type} ({inc.action.value}) learned from report {args.report_id}")
    return EXIT_OK


def _cmd_model_convert(args: argparse.Namespace) -> int:
    from logdx.diagnose.llm import EmbeddedConfig, ensure_converted

    target = args.dir or EmbeddedConfig.from_settings(_settings(args).llm).cache_dir
    info = ensure_converted(Path(target))
    print(f"{info.cache_dir}: {'converted in %.1f s' % info.seconds if info.converted else 'already converted'}")
    return EXIT_OK


def _cmd_prompts_check(args: argparse.Namespace) -> int:
    from logdx.diagnose.llm import PromptError, Prompts

    try:
        problems = Prompts(args.dir or _settings(args).llm.prompts_dir).check()
    except PromptError as e:
        raise UsageError(str(e)) from None
    for p in problems:
        print(p)
    print("prompts: ok" if not problems else f"prompts: {len(problems)} problem(s)")
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

    _add_incident_parsers(sub)

    md = sub.add_parser("model", help="the embedded LLM")
    md_sub = md.add_subparsers(dest="model_command", parser_class=_Parser, metavar="SUBCOMMAND", required=True)
    mc = md_sub.add_parser("convert", help="convert the packaged GGUF once into the cache (about a minute)")
    mc.add_argument("dir", nargs="?", type=Path, help="target folder (default: llm.cache_dir/gemma3-270m)")
    mc.add_argument("--config", type=Path)
    mc.set_defaults(func=_cmd_model_convert)

    pr = sub.add_parser("prompts", help="the LLM prompt templates")
    pr_sub = pr.add_subparsers(dest="prompts_command", parser_class=_Parser, metavar="SUBCOMMAND", required=True)
    pc = pr_sub.add_parser("check", help="compile every template; errors name file and line")
    pc.add_argument("dir", nargs="?", type=Path)
    pc.add_argument("--config", type=Path)
    pc.set_defaults(func=_cmd_prompts_check)

    sy = sub.add_parser("synth", help="generate a realistic multi-rank training log", add_help=False)
    sy.add_argument("synth_args", nargs=argparse.REMAINDER)
    sy.set_defaults(func=_cmd_synth)

    from logdx.api.server import add_serve_parser  # light: FastAPI loads only when serve runs
    from logdx.supervise import add_run_parser

    add_run_parser(sub)
    add_serve_parser(sub)
    return parser


def _add_incident_parsers(sub: argparse._SubParsersAction) -> None:
    from logdx.model import Category

    categories = [c.value for c in Category if c != Category.UNKNOWN]
    inc = sub.add_parser("incidents", help="the knowledge base of past incidents")
    inc_sub = inc.add_subparsers(dest="incidents_command", parser_class=_Parser, metavar="SUBCOMMAND", required=True)
    ls = inc_sub.add_parser("list", help="list incidents")
    ls.add_argument("--category", choices=categories)
    ls.add_argument("--failure-type")
    ls.add_argument("--limit", type=int)
    show = inc_sub.add_parser("show", help="one incident as JSON")
    show.add_argument("id")
    add = inc_sub.add_parser("add", help="add an incident (from flags, or --json)")
    add.add_argument("--root-line")
    add.add_argument("--category", choices=categories)
    add.add_argument("--failure-type")
    add.add_argument("--note")
    add.add_argument("--json", dest="json_text", metavar="OBJECT", help="the incident as a JSON object")
    rm = inc_sub.add_parser("remove", help="remove an incident")
    rm.add_argument("id")
    imp = inc_sub.add_parser("import", help="import incidents from JSONL")
    imp.add_argument("file")
    imp.add_argument("--strict", action="store_true", help="reject the whole file on one bad line")
    exp = inc_sub.add_parser("export", help="export incidents as JSONL (- for stdout)")
    exp.add_argument("file", nargs="?", default="-")
    for p in (ls, show, add, rm, imp, exp):
        p.add_argument("--config", type=Path)
        p.set_defaults(func=_cmd_incidents)

    fb = sub.add_parser("feedback", help="confirm or correct a report: it becomes an incident")
    fb.add_argument("report_id")
    fb.add_argument("--category", required=True, choices=categories)
    fb.add_argument("--failure-type", required=True)
    fb.add_argument("--action", choices=["cordon_and_restart", "restart", "no_restart"])
    fb.add_argument("--note")
    fb.add_argument("--config", type=Path)
    fb.set_defaults(func=_cmd_feedback)


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
