"""What every command-line face shares (`diagnose`, `logdx ...`, `logdx run`, `logdx serve`): usage
errors, the parser class, the flags that build an engine, and building it: once, here.

It sits outside `logdx.cli` so that `logdx.run`, `logdx.api` and `logdx.agent` can use it while `logdx.cli`
registers their commands (`FACE_COMMANDS`, by name: no face imports another)."""

from __future__ import annotations

import argparse
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # imported lazily: `--help` must not load the pipeline
    from logdx.config import Settings
    from logdx.incidents import IncidentStore
    from logdx.pipeline import Engine

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

# The commands of the other faces on `logdx`'s parser, each `module:function(subparsers)`, in help order: each
# face declares its own command; `logdx.cli` imports them by name when it builds the whole parser, so the
# faces stay apart (tests/test_layout.py) and `diagnose` loads none of them. Each module is light (the
# face's heavy part, FastAPI, the MCP SDK, loads only when its command runs).
FACE_COMMANDS = (
    "logdx.run.cli:add_run_parser",
    "logdx.api.server:add_serve_parser",
    "logdx.agent.cli:add_mcp_parser",
)


class UsageError(Exception):
    """Anything the user can fix: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        """argparse's check of a choice, with the nearest valid one named ("did you mean 'script'?")."""
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{did_you_mean(str(value), choices)} "
                                                 f"(choose from {', '.join(map(repr, choices))})")


def did_you_mean(value: str, valid: list[str]) -> str:
    from logdx.config import nearest_name

    close = nearest_name(value, valid)
    return f"; did you mean {close!r}?" if close else ""


def failure_type_arg(value: str) -> str:
    """A failure type of the taxonomy (an argparse type: a misspelt one is refused with the nearest named)."""
    from logdx.taxonomy import taxonomy

    known = sorted(taxonomy().types)
    if value not in known:
        raise argparse.ArgumentTypeError(f"unknown failure type {value!r}{did_you_mean(value, known)} "
                                         "(logdx's taxonomy: service/logdx/taxonomy.yaml)")
    return value


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="config file (YAML or TOML); default $LOGDX_CONFIG")


def add_engine_args(p: argparse.ArgumentParser, *, rules: bool = True) -> None:
    """--config, --rules, --no-llm, --no-retrieval: what decides how an engine is built."""
    add_config_arg(p)
    if rules:
        p.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                       help="extra rule pack folder (repeatable)")
    p.add_argument("--no-llm", action="store_true", help="skip the LLM stage")
    p.add_argument("--no-retrieval", action="store_true", help="skip retrieval over past incidents")


def add_color_args(p: argparse.ArgumentParser) -> None:
    color = p.add_mutually_exclusive_group()
    color.add_argument("--color", dest="color", action="store_true", default=None, help="force colour")
    color.add_argument("--no-color", dest="color", action="store_false", help="never colour")


def use_color(args: argparse.Namespace, stream: IO[str]) -> bool:
    """--color / --no-color, else colour on a terminal unless $NO_COLOR."""
    if args.color is not None:
        return bool(args.color)
    return stream.isatty() and "NO_COLOR" not in os.environ


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings (file, environment), with --no-llm / --no-retrieval applied."""
    from logdx.config import ConfigError, load_settings

    try:
        settings = load_settings(getattr(args, "config", None))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "no_llm", False):
        settings.llm.enabled = False
    if getattr(args, "no_retrieval", False):
        settings.retrieval.enabled = False
    return settings


def build_engine(settings: Settings, extra_rules: Sequence[Path] = ()) -> Engine:
    """Rules (the shipped packs, then `rules.dirs`, then --rules) and the stages the settings enable."""
    from logdx.diagnose.rules import RuleError
    from logdx.pipeline import Engine

    for d in extra_rules:
        if not d.is_dir():
            raise UsageError(f"--rules {d}: not a directory")
    try:
        return Engine.create(settings, extra_rule_dirs=extra_rules)
    except RuleError as e:
        raise UsageError(str(e)) from None


def open_incidents(settings: Settings) -> IncidentStore:
    from logdx.incidents import IncidentStore
    from logdx.store import MigrationError, open_db

    path = settings.store.location
    try:
        return IncidentStore(open_db(path, settings.store.pool_size))
    except (OSError, sqlite3.Error, MigrationError) as e:
        raise UsageError(f"cannot open the store {path}: {e}") from None
