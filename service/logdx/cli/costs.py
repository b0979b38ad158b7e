"""`logdx costs`: the GPU-hours failed jobs lost since their last checkpoint, rolled up, over the same
database as `logdx serve`, `logdx run` and `diagnose` (`store.path`; the `job_costs` table).

    logdx costs [--since 7d] [--by cause|node|category] [--json]
    logdx costs --job ID                       one job's row (JSON)
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from logdx.faces import EXIT_OK, UsageError, add_config_arg, settings_from

if TYPE_CHECKING:
    from logdx.act.costs import CostBook

__all__ = ["add_cost_parsers", "cost_book", "parse_since"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")


def add_cost_parsers(sub: argparse._SubParsersAction) -> None:
    costs = sub.add_parser("costs", help="GPU-hours lost to failures since their last checkpoint, by cause, node or "
                           "category")
    costs.add_argument("--since", default="", metavar="SPAN",
                       help="only failures recorded in the last SPAN (30m, 12h, 7d, 2w); default: all")
    costs.add_argument("--by", choices=("cause", "node", "category"), default="cause",
                       help="group by failure type (cause), culprit node, or category (default: cause)")
    costs.add_argument("--limit", type=int, default=50, help="groups shown (default 50)")
    costs.add_argument("--job", default="", metavar="ID", help="one job's recorded cost, as JSON")
    costs.add_argument("--json", action="store_true")
    add_config_arg(costs)
    costs.set_defaults(func=_costs)


def parse_since(span: str, now: float | None = None) -> float | None:
    """The epoch second `span` ago ("7d", "12h"); None for "" (all)."""
    if not span:
        return None
    m = _SPAN.match(span.strip())
    if m is None:
        raise UsageError(f"--since {span!r}: a number and a unit (s, m, h, d, w), e.g. 7d")
    return (time.time() if now is None else now) - float(m.group(1)) * _UNITS[m.group(2)]


@contextmanager
def cost_book(args: argparse.Namespace) -> Iterator[CostBook]:
    from logdx.act.costs import CostBook
    from logdx.store import MigrationError, open_db

    settings = settings_from(args)
    try:
        db = open_db(settings.store.location, settings.store.pool_size)
    except (OSError, sqlite3.Error, MigrationError) as e:
        raise UsageError(f"cannot open the store {settings.store.path}: {e}") from None
    try:
        try:
            book = CostBook(db)
        except (sqlite3.Error, MigrationError) as e:
            raise UsageError(f"cannot open the store {settings.store.path}: {e}") from None
        yield book
    finally:
        db.close()


def _costs(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UsageError("--limit must be >= 1")
    since = parse_since(args.since)
    if args.job:
        with cost_book(args) as book:
            one = book.row(args.job)
        if one is None:
            raise UsageError(f"no cost recorded for job {args.job!r} (only failed jobs have one)")
        print(json.dumps(one, indent=2))
        return EXIT_OK
    with cost_book(args) as book:
        rows = book.rollup(args.by, since, limit=args.limit)
        jobs, hours, unknown = book.total(since)
    if args.json:
        print(json.dumps({"by": args.by, "since": since, "failed_jobs": jobs, "lost_gpu_hours": hours,
                          "unknown": unknown, "groups": [r.to_dict() for r in rows]}, indent=2))
        return EXIT_OK
    span = f" in the last {args.since}" if args.since else ""
    if not jobs:
        print(f"no failed job recorded{span}")
        return EXIT_OK
    print(f"{jobs} failed job{'s' if jobs != 1 else ''}{span} lost {hours:,.1f} GPU-hours since their last checkpoint"
          + (f" ({unknown} with no cost: their logs do not say)" if unknown else ""))
    table = [(args.by, "GPU-hours", "share", "jobs", "unknown")]
    for r in rows:
        share = f"{r.lost_gpu_hours / hours:.0%}" if hours else "-"
        table.append((r.key, f"{r.lost_gpu_hours:,.1f}", share, str(r.jobs), str(r.unknown) if r.unknown else ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    return EXIT_OK
