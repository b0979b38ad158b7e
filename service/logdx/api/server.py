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
from pathlib import Path

EXIT_OK = 0
EXIT_USAGE = 2


class ServeError(Exception):
    """A configuration that must not start (e.g. a public address without a token)."""


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register `serve` on the `logdx` subcommands."""
    p = sub.add_parser("serve", help="run the HTTP service (log ingestion, diagnosis, alerts)",
                       description="Run the logdx HTTP service. Settings come from the config file and "
                                   "LOGDX_SERVER__* variables; the options below override them.")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="config file (YAML or TOML); default $LOGDX_CONFIG")
    p.add_argument("--host", help="address to bind (default server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default server.port, 8077)")
    p.add_argument("--workers", type=int, help="worker processes (default server.workers, 1)")
    p.add_argument("--no-llm", action="store_true", help="skip the LLM stage")
    p.add_argument("--no-retrieval", action="store_true", help="skip retrieval over past incidents")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_bind(host: str, token: str) -> None:
    from logdx.api.limits import is_loopback

    if not token and not is_loopback(host):
        raise ServeError(
            f"refusing to listen on {host} without a token: set server.token (LOGDX_SERVER__TOKEN) "
            "or bind to 127.0.0.1")


def cmd_serve(args: argparse.Namespace) -> int:
    from logdx.config import ConfigError, load_settings

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
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
    if args.no_llm:
        settings.llm.enabled = False
    if args.no_retrieval:
        settings.retrieval.enabled = False
    try:
        check_bind(s.host, s.token)
    except ServeError as e:
        return _usage(str(e))
    return serve(settings, log_level=args.log_level)


def serve(settings, log_level: str = "info") -> int:  # noqa: ANN001 - Settings
    import uvicorn

    from logdx.api.app import SETTINGS_ENV, create_app

    s = settings.server
    check_bind(s.host, s.token)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common = dict(host=s.host, port=s.port, log_level=log_level, access_log=s.access_log, server_header=False,
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
