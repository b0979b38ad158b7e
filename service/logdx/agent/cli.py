"""`logdx mcp`: run logdx as a Model Context Protocol server for AI agents.

    logdx mcp                          stdio: what an agent (Claude Code, Codex, Cursor...) launches
    logdx mcp --http [--port 8078]     streamable HTTP at http://HOST:PORT/mcp
    logdx mcp --allow-actions          also feedback, act (cordon/restart per policy), uncordon
"""

from __future__ import annotations

import argparse
from pathlib import Path

from logdx.faces import EXIT_OK, UsageError, add_engine_args, settings_from

__all__ = ["add_mcp_parser"]


def add_mcp_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="serve logdx's tools to AI agents (Model Context Protocol, stdio or HTTP)",
                       description="Serve logdx to AI agents over the Model Context Protocol: diagnose, report, "
                                   "evidence, templates, nodes, search_incidents, jobs (read-only); with "
                                   "--allow-actions also feedback, act and uncordon.")
    p.add_argument("--http", action="store_true", help="streamable HTTP at /mcp instead of stdio")
    p.add_argument("--host", help="--http: address to listen on (default mcp.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="--http: port (default mcp.port, 8078)")
    p.add_argument("--allow-actions", action="store_true", default=None,
                   help="offer the tools that change something (mcp.allow_actions); the action policy, dry run, "
                        "budget and breaker still apply")
    p.add_argument("--service", metavar="URL", help="the running logdx serve, for job ids (mcp.service_url)")
    p.add_argument("--path", action="append", type=Path, default=[], metavar="DIR",
                   help="a folder whose logs the tools may read (repeatable; mcp.paths)")
    add_engine_args(p)
    p.set_defaults(func=cmd_mcp)


def cmd_mcp(args: argparse.Namespace) -> int:
    from logdx.agent.server import is_loopback, run_http, run_stdio
    from logdx.agent.tools import Toolbox

    settings = settings_from(args)
    m = settings.mcp
    if args.allow_actions:
        m.allow_actions = True
    if args.service:
        m.service_url = args.service
    if args.path:
        m.paths = [*m.paths, *args.path]
    for d in args.rules:
        if not d.is_dir():
            raise UsageError(f"--rules {d}: not a directory")
    toolbox = Toolbox(settings, extra_rules=args.rules, http=args.http)
    if not args.http:
        run_stdio(toolbox)
        return EXIT_OK
    host, port = args.host or m.host, args.port or m.port
    tokens = bool(settings.server.token or settings.server.tokens)
    if not tokens and not is_loopback(host):
        raise UsageError(f"refusing to listen on {host} without server.token (LOGDX_SERVER__TOKEN) or "
                         "server.tokens: anyone who reaches it could read logs through it")
    if not tokens and m.allow_actions:
        raise UsageError("--allow-actions over HTTP needs server.token (LOGDX_SERVER__TOKEN) or an operator's "
                         "server.tokens: the operator's credential, sent by the agent as Authorization: Bearer")
    run_http(toolbox, host, port)
    return EXIT_OK
