"""`logdx serve`: run the HTTP service with uvicorn.

Kept free of heavy imports at module level: the CLI imports `add_serve_parser` to build its
parser, and `logdx --help` should not load FastAPI.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from logdx.faces import EXIT_OK, EXIT_USAGE, UsageError, add_engine_args, settings_from

if TYPE_CHECKING:
    from logdx.config import ServerSettings, Settings


class ServeError(Exception):
    """A configuration that must not start (e.g. a public address without a token)."""


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the `logdx` subcommands."""
    p = sub.add_parser("serve", help="run the HTTP service (log ingestion, diagnosis, alerts)",
                       description="Run the logdx HTTP service. Settings come from the config file and "
                                   "LOGDX_SERVER__* variables; the options below override them.")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve, progress="log")  # the app logs its stages (api/app.py)
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, rules=False)
    p.add_argument("--host", help="address to bind (default server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default server.port, 8077)")
    p.add_argument("--workers", type=int, help="worker processes (default server.workers, 1)")
    p.add_argument("--role", choices=["all", "ingest", "worker"],
                   help="with bus.url: ingest (uploads, reads), worker (diagnose owned partitions, act, alert) "
                        "or all (default server.role, all)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_bind(server: ServerSettings) -> None:
    """Refuse what would let anyone in: a reachable address, or any Host name, without a token."""
    from logdx.jobs.limits import is_loopback

    if server.token or server.tokens:
        return
    if not is_loopback(server.host):
        raise ServeError(
            f"refusing to listen on {server.host} without a token: configure server.tokens (or server.token, "
            "LOGDX_SERVER__TOKEN) or bind to 127.0.0.1")
    if "*" in (h.strip() for h in server.allowed_hosts):
        raise ServeError("server.allowed_hosts '*' needs a token: without one any web page could reach "
                         "the service through DNS rebinding; list the names instead")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except UsageError as e:
        return _usage(str(e))
    s = settings.server
    if args.host is not None:
        s.host = args.host
    if args.port is not None:
        if not 1 <= args.port <= 65535:
            return _usage("--port must be in 1..65535")
        s.port = args.port
    if args.workers is not None:
        if args.workers < 1:
            return _usage("--workers must be at least 1")
        s.workers = args.workers
    if args.role is not None:
        if args.role != "all" and not settings.bus.url:
            return _usage(f"--role {args.role} needs bus.url (LOGDX_BUS__URL=nats://...): without a bus one "
                          "process does all")
        s.role = args.role
    if settings.bus.url and s.workers > 1:
        return _usage("with bus.url run one worker per replica (server.workers 1) and scale with replicas")
    try:
        check_bind(s)
        check_cluster(settings)
    except ServeError as e:
        return _usage(str(e))
    return serve(settings, log_level=args.log_level)


def check_cluster(settings: Settings) -> None:
    """With store.url / bus.url: refuse to start, in one line, when PostgreSQL or NATS cannot be reached."""
    if settings.store.url:
        import psycopg

        from logdx.store_postgres import _redacted

        try:
            psycopg.connect(settings.store.url, connect_timeout=5).close()
        except psycopg.Error as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ServeError(f"store.url {_redacted(settings.store.url)}: {why}") from None
    if settings.bus.url:
        from logdx.bus import open_bus

        try:
            open_bus(settings.bus, name="logdx-check").close()
        except Exception as e:  # noqa: BLE001
            raise ServeError(f"bus.url {settings.bus.url}: {e}") from None


def serve(settings: Settings, log_level: str = "info") -> int:
    import uvicorn

    from logdx.api.app import SETTINGS_ENV, create_app

    s = settings.server
    check_bind(s)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common: dict[str, Any] = dict(host=s.host, port=s.port, log_level=log_level, access_log=s.access_log, server_header=False,
                  timeout_graceful_shutdown=30, proxy_headers=False)
    if s.workers > 1:
        # Worker processes import the app by name; they get the effective settings through the
        # environment (they include the token: the same process tree already knows it).
        os.environ[SETTINGS_ENV] = json.dumps(settings.model_dump(mode="json"))
        uvicorn.run("logdx.api.app:app_from_env", factory=True, workers=s.workers, **common)
    else:
        uvicorn.Server(uvicorn.Config(create_app(settings), **common)).run()
    return EXIT_OK


def _usage(message: str) -> int:
    print(f"logdx serve: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """`python -m logdx.api [options]`: the same as `logdx serve`."""
    parser = argparse.ArgumentParser(prog="python -m logdx.api", description="Run the logdx HTTP service.")
    _add_serve_args(parser)
    return cmd_serve(parser.parse_args(argv))
