"""`logdx nodes` and `logdx actions`: the nodes logdx knows and the safety switches, on the command
line, over the same database as `logdx serve` and `logdx run` (`store.path`).

    logdx nodes [--blamed] [--json]          nodes seen in job logs; blamed / cordoned first, with their grades
    logdx nodes --by lost-gpu-hours          ... the nodes whose failures lost the most GPU-hours first
    logdx nodes show NODE                    one node's history (JSON)
    logdx nodes uncordon NODE --by NAME      a person's all-clear (audited; "resolved" alerts follow)
    logdx nodes check                        run actions.health_check_command now
    logdx actions [--json]                   dry run?, breaker, budget used, the latest audit rows
    logdx actions reset --by NAME            close the circuit breaker (audited)
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from logdx.faces import EXIT_OK, UsageError, add_config_arg, settings_from

if TYPE_CHECKING:
    from logdx.act.actions import ActionRecord
    from logdx.act.costs import CostBook
    from logdx.act.respond import Responder

__all__ = ["add_node_parsers"]


def add_node_parsers(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    nodes = sub.add_parser("nodes", help="nodes seen in job logs, what was blamed on them; uncordon")
    nodes.add_argument("--blamed", action="store_true", help="only nodes a diagnosis blamed")
    nodes.add_argument("--json", action="store_true", help="the list as JSON")
    nodes.add_argument("--limit", type=int, default=500)
    nodes.add_argument("--by", choices=("events", "lost-gpu-hours"), default="events",
                       help="order: by the node book (blamed, cordoned first), or by the GPU-hours the failures "
                       "blamed on each node lost (logdx costs)")
    nodes.add_argument("--since", default="", metavar="SPAN", help="with --by lost-gpu-hours: failures in the last "
                       "SPAN only (7d, 12h)")
    add_config_arg(nodes)
    nodes.set_defaults(func=_list)
    nodes_sub = nodes.add_subparsers(dest="nodes_command", parser_class=parser_class, metavar="SUBCOMMAND")
    show = nodes_sub.add_parser("show", help="one node and its history, as JSON")
    show.add_argument("node")
    show.set_defaults(func=_show)
    unc = nodes_sub.add_parser("uncordon", help="put a node back into scheduling (audited)")
    unc.add_argument("node")
    unc.add_argument("--by", required=True, help="who decided the node is healthy (audited)")
    unc.add_argument("--reason", default="")
    unc.set_defaults(func=_uncordon)
    check = nodes_sub.add_parser("check", help="run the health check on cordoned nodes now; uncordon those that pass")
    check.set_defaults(func=_check)
    for p in (show, unc, check):
        add_config_arg(p)

    actions = sub.add_parser("actions", help="the safety switches: dry run, circuit breaker, budget, audit")
    actions.add_argument("--json", action="store_true")
    actions.add_argument("--limit", type=int, default=20, help="audit rows shown (default 20)")
    add_config_arg(actions)
    actions.set_defaults(func=_status)
    act_sub = actions.add_subparsers(dest="actions_command", parser_class=parser_class, metavar="SUBCOMMAND")
    reset = act_sub.add_parser("reset", help="close the circuit breaker (audited)")
    reset.add_argument("--by", required=True, help="who resets it (audited)")
    reset.add_argument("--note", default="")
    add_config_arg(reset)
    reset.set_defaults(func=_reset)


@contextmanager
def _responder(args: argparse.Namespace) -> Iterator[Responder]:
    from logdx.act.respond import Responder
    from logdx.store import MigrationError, open_db

    settings = settings_from(args)
    try:
        db = open_db(settings.store.location, settings.store.pool_size)
    except (OSError, sqlite3.Error, MigrationError) as e:
        raise UsageError(f"cannot open the store {settings.store.path}: {e}") from None
    try:
        responder = Responder(db, settings, public_url=settings.server.public_url)
    except (sqlite3.Error, MigrationError) as e:
        db.close()
        raise UsageError(f"cannot open the store {settings.store.path}: {e}") from None
    try:
        yield responder
    finally:
        responder.close(deliver_due=True)  # a "resolved" alert, if any, leaves now
        db.close()


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def _list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UsageError("--limit must be >= 1")
    if args.by == "lost-gpu-hours":
        return _by_lost_hours(args)
    with _responder(args) as r:
        nodes = r.actions.nodes.list(blamed_only=args.blamed, limit=args.limit)
        lost = _lost_hours_by_node(r.costs)
    if args.json:
        print(json.dumps([{**n.to_dict(), "lost_gpu_hours": lost.get(n.node)} for n in nodes], indent=2))
        return EXIT_OK
    if not nodes:
        print("no node seen yet")
        return EXIT_OK
    rows = [("node", "grade", "state", "since", "events", "jobs", "GPU-h lost", "failure types")]
    for n in nodes:
        jobs = f"{len(n.jobs)}" + (" (several jobs)" if n.blamed_by_several_jobs else "")
        types = ", ".join(f"{t or '?'} x{c}" for t, c in n.failure_types.items()) or "-"
        grade = (n.grade.grade if n.grade is not None else "ok") + (" (avoided)" if n.avoided else "")
        hours = f"{lost[n.node]:,.1f}" if n.node in lost else "-"
        rows.append((n.node, grade, n.state, _when(n.state_since) if n.state != "ok" else "-", str(n.events), jobs,
                     hours, types))
    _table(rows)
    graded = [n for n in nodes if n.grade is not None and n.grade.grade != "ok"]
    if graded:
        print("")
        for n in graded:
            assert n.grade is not None
            charged = f"; {lost[n.node]:,.1f} GPU-hours lost to its failures" if n.node in lost else ""
            print(f"{n.node}: {n.grade.grade}: {n.grade.reason}{charged}")
    return EXIT_OK


def _lost_hours_by_node(book: CostBook) -> dict[str, float]:
    """The GPU-hours the failures blamed on each node lost (job_costs), for the grade's reason."""
    from logdx.act.costs import NO_HOST

    return {r.key: r.lost_gpu_hours for r in book.rollup("node", None, limit=100_000) if r.key != NO_HOST}


def _by_lost_hours(args: argparse.Namespace) -> int:
    """The nodes ranked by the work their failures destroyed (job_costs), not by how often they failed."""
    from logdx.act.costs import NO_HOST
    from logdx.cli.costs import cost_book, parse_since

    with cost_book(args) as book:
        rows = [r for r in book.rollup("node", parse_since(args.since), limit=args.limit + 1)
                if r.key != NO_HOST][:args.limit]
    if args.json:
        print(json.dumps([{"node": r.key, "lost_gpu_hours": r.lost_gpu_hours, "jobs": r.jobs, "unknown": r.unknown}
                          for r in rows], indent=2))
        return EXIT_OK
    if not rows:
        print("no failure blamed on a node has a cost yet")
        return EXIT_OK
    _table([("node", "GPU-hours lost", "failed jobs", "unknown"),
            *((r.key, f"{r.lost_gpu_hours:,.1f}", str(r.jobs), str(r.unknown) if r.unknown else "") for r in rows)])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    with _responder(args) as r:
        info = r.actions.nodes.get(args.node)
    if info is None:
        raise UsageError(f"logdx has not seen node {args.node!r}")
    print(json.dumps(info.to_dict(), indent=2))
    return EXIT_OK


def _uncordon(args: argparse.Namespace) -> int:
    with _responder(args) as r:
        if r.actions.nodes.get(args.node) is None:
            raise UsageError(f"logdx has not seen node {args.node!r} (a plain host name, as in `logdx nodes`)")
        rec = r.uncordon(args.node, args.by, args.reason)
    _say(rec)
    return EXIT_OK if rec.outcome in ("ok", "dry_run") else 1


def _check(args: argparse.Namespace) -> int:
    with _responder(args) as r:
        if r.actions.health_check is None:
            raise UsageError("no health check configured (actions.health_check_command)")
        recs = r.health_checks()
    for rec in recs:
        _say(rec)
    if not recs:
        print("no cordoned node passed its health check (or none was cordoned long enough: actions.uncordon_after_s)")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise UsageError("--limit must be >= 0")
    with _responder(args) as r:
        status = r.actions.status()
        audit = r.actions.audit(limit=args.limit) if args.limit else []
    if args.json:
        print(json.dumps({**status.to_dict(), "audit": [a.to_dict() for a in audit]}, indent=2))
        return EXIT_OK
    b = status.breaker
    print(f"actions      {'DRY RUN (actions.dry_run: true): nothing is changed' if status.dry_run else 'LIVE'}"
          f", actuator {status.actuator}")
    if b.open:
        print(f"breaker      OPEN since {_when(b.since)}: {b.reason}")
        print("             nothing is cordoned until a person resets it: logdx actions reset --by NAME")
    else:
        print(f"breaker      closed (opens past {status.breaker_max_share:.0%} of {status.known_nodes} known nodes"
              " under cordon)")
    used = ", ".join(status.cordoned_in_window) or "none"
    print(f"budget       {len(status.cordoned_in_window)}/{status.max_cordons} cordons in the last "
          f"{status.window_s:g} s ({used})")
    print(f"cordoned     {', '.join(status.cordoned_nodes) or 'none'}")
    if audit:
        print("")
        rows = [("when", "job", "action", "node", "outcome", "detail")]
        rows += [(_when(a.ts), a.job_id, a.action + (" (dry run)" if a.dry_run else ""), a.node or "-", a.outcome,
                  a.detail[:100]) for a in audit]
        _table(rows)
    return EXIT_OK


def _reset(args: argparse.Namespace) -> int:
    with _responder(args) as r:
        rec = r.actions.reset_breaker(args.by, args.note)
    _say(rec)
    return EXIT_OK


def _say(rec: ActionRecord) -> None:
    what = f"{rec.action} {rec.node}" if rec.node else rec.action
    print(f"{what}: {rec.outcome}: {rec.detail}")


def _table(rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
