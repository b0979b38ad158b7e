"""`diagnose incidents list|show|add|remove|import|export` and `diagnose feedback REPORT_ID`: the
knowledge base of past incidents that retrieval learns from."""

from __future__ import annotations

import argparse
import json
import sys

from logdx.faces import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_config_arg,
    failure_type_arg,
    open_incidents,
    settings_from,
)
from logdx.incidents import IncidentError, IncidentStore
from logdx.taxonomy import KNOWN_CATEGORIES, LABEL_ACTIONS

_CATEGORIES = [c.value for c in KNOWN_CATEGORIES]


def add_incident_parsers(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    inc = sub.add_parser("incidents", help="the knowledge base of past incidents")
    inc_sub = inc.add_subparsers(dest="incidents_command", parser_class=parser_class, metavar="SUBCOMMAND",
                                 required=True)
    ls = inc_sub.add_parser("list", help="list incidents")
    ls.add_argument("--category", choices=_CATEGORIES)
    ls.add_argument("--failure-type", type=failure_type_arg)
    ls.add_argument("--limit", type=int)
    ls.set_defaults(func=_list)
    show = inc_sub.add_parser("show", help="one incident as JSON")
    show.add_argument("id")
    show.set_defaults(func=_show)
    add = inc_sub.add_parser("add", help="add an incident (from flags, or --json)")
    add.add_argument("--root-line")
    add.add_argument("--category", choices=_CATEGORIES)
    add.add_argument("--failure-type", type=failure_type_arg)
    add.add_argument("--note")
    add.add_argument("--json", dest="json_text", metavar="OBJECT", help="the incident as a JSON object")
    add.set_defaults(func=_add)
    rm = inc_sub.add_parser("remove", help="remove an incident")
    rm.add_argument("id")
    rm.set_defaults(func=_remove)
    imp = inc_sub.add_parser("import", help="import incidents from JSONL")
    imp.add_argument("file")
    imp.add_argument("--strict", action="store_true", help="reject the whole file on one bad line")
    imp.set_defaults(func=_import)
    exp = inc_sub.add_parser("export", help="export incidents as JSONL (- for stdout)")
    exp.add_argument("file", nargs="?", default="-")
    exp.set_defaults(func=_export)
    for p in (ls, show, add, rm, imp, exp):
        add_config_arg(p)

    fb = sub.add_parser("feedback", help="confirm or correct a report: it becomes an incident; or --false-alarm")
    fb.add_argument("report_id")
    fb.add_argument("--category", choices=_CATEGORIES)
    fb.add_argument("--failure-type", type=failure_type_arg)
    fb.add_argument("--false-alarm", action="store_true",
                    help="the job did not fail: the report is marked so and the nodes it blamed are not charged "
                         "with it (no incident is learned)")
    fb.add_argument("--action", choices=[a.value for a in LABEL_ACTIONS])
    fb.add_argument("--note")
    add_config_arg(fb)
    fb.set_defaults(func=cmd_feedback)


def _store(args: argparse.Namespace) -> IncidentStore:
    return open_incidents(settings_from(args))


def _list(args: argparse.Namespace) -> int:
    for inc in _store(args).list(category=args.category, failure_type=args.failure_type, limit=args.limit, tenant=None):
        whose = f" tenant {inc.tenant}" if inc.tenant else ""
        print(f"{inc.id}  {inc.category.value}/{inc.failure_type}  [{inc.source}{whose}]  {inc.root_line[:100]}")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    inc = _store(args).get(args.id)
    if inc is None:
        raise UsageError(f"no incident {args.id!r}")
    print(json.dumps(inc.to_json(), indent=2, ensure_ascii=False))
    return EXIT_OK


def _add(args: argparse.Namespace) -> int:
    try:
        data = json.loads(args.json_text) if args.json_text else {
            "root_line": args.root_line, "category": args.category, "failure_type": args.failure_type,
            "note": args.note or "",
        }
        print(_store(args).add(data, source="manual").id)
    except (IncidentError, ValueError) as e:
        raise UsageError(str(e)) from None
    return EXIT_OK


def _remove(args: argparse.Namespace) -> int:
    if not _store(args).remove(args.id):
        raise UsageError(f"no incident {args.id!r}")
    print(f"removed {args.id}")
    return EXIT_OK


def _import(args: argparse.Namespace) -> int:
    try:
        result = _store(args).import_jsonl(args.file, strict=args.strict)
    except (IncidentError, ValueError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}") from None
    for err in result.errors:
        print(err, file=sys.stderr)
    print(f"{result.added} added, {result.updated} updated, {len(result.errors)} rejected")
    return EXIT_OK if not result.errors else EXIT_FAILED


def _export(args: argparse.Namespace) -> int:
    try:
        n = _store(args).export_jsonl(sys.stdout if args.file == "-" else args.file)
    except OSError as e:
        raise UsageError(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}") from None
    if args.file != "-":
        print(f"{n} incidents written to {args.file}")
    return EXIT_OK


def cmd_feedback(args: argparse.Namespace) -> int:
    if args.false_alarm:
        if args.category or args.failure_type or args.action:
            raise UsageError("--false-alarm says the job did not fail: give it no --category, --failure-type or --action")
        return _false_alarm(args)
    if not (args.category and args.failure_type):
        raise UsageError("feedback needs --category and --failure-type (what the failure was), or --false-alarm")
    try:
        inc = _store(args).feedback(args.report_id, args.category, args.failure_type, action=args.action,
                                    note=args.note)
    except IncidentError as e:
        raise UsageError(str(e)) from None
    print(f"{inc.id}: {inc.category.value}/{inc.failure_type} ({inc.action.value}) learned from report {args.report_id}")
    return EXIT_OK


def _false_alarm(args: argparse.Namespace) -> int:
    from logdx.act.feedback import record_false_alarm

    settings = settings_from(args)
    try:
        done = record_false_alarm(open_incidents(settings), settings.actions, args.report_id, args.note)
    except IncidentError as e:
        raise UsageError(str(e)) from None
    print(done.describe())
    return EXIT_OK
