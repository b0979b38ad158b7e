"""`logdx run [options] -- CMD ARGS...`: its options, and building what runs it."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logdx.faces import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Parser,
    UsageError,
    add_color_args,
    add_engine_args,
    build_engine,
    settings_from,
)
from logdx.model import Category
from logdx.run.options import RunOptions

if TYPE_CHECKING:
    from logdx.act.respond import Responder
    from logdx.config import Settings
    from logdx.store import Database

_DESCRIPTION = ("Run CMD, pass its output through unchanged, diagnose it when it fails, hangs, stalls or "
                "diverges, and restart infrastructure failures without the bad node.")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job-id", help="name for alerts and the audit (default: $SLURM_JOB_ID or command-time-pid)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N", help="at most N restarts (default 3)")
    p.add_argument("--backoff", type=float, default=10.0, metavar="S",
                   help="seconds before the first restart, doubled each time (default 10)")
    p.add_argument("--backoff-max", type=float, default=300.0, metavar="S", help="cap of the backoff (default 300)")
    p.add_argument("--restart-on", default=Category.INFRASTRUCTURE.value, metavar="CATS",
                   help="categories that are restarted (default infrastructure; also framework, script, unknown)")
    p.add_argument("--root-cause-grace", type=float, default=30.0, metavar="S",
                   help="after a root cause, seconds the job may take to die by itself (default 30)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="end the job after S seconds without a progress line (default: max(stall_factor x median "
                        "step time, detect.stall_min_s), armed once the step time is known; 0: off)")
    p.add_argument("--pause-max", type=float, default=None, metavar="S",
                   help="a checkpoint save or an evaluation in progress (Megatron, DeepSpeed, Lightning, HF lines) "
                        "pauses the stall timer for at most S seconds (default: hangs.pause_max_s, 3600)")
    p.add_argument("--kill-grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when logdx ends the job (default 10)")
    p.add_argument("--loss-trigger", default="nan,spike", metavar="KINDS",
                   help="end the job on these loss anomalies: nan, spike, none (default nan,spike)")
    p.add_argument("--exclude-arg", metavar="TEMPLATE",
                   help="appended on restarts once nodes are excluded, e.g. --exclude-arg=--exclude={hosts} "
                        "(write it with = since the value starts with a dash)")
    p.add_argument("--resume-arg", metavar="TEMPLATE",
                   help="appended on restarts, from the last saved checkpoint, e.g. '--load {checkpoint_dir}' "
                        "({checkpoint_dir}, {checkpoint}, {iteration})")
    p.add_argument("--json-history", type=Path, metavar="FILE", help="write every attempt and its report as JSON")
    p.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=None,
                   help="only audit what a cordon would do (default: actions.dry_run, true unless configured)")
    add_engine_args(p)
    add_color_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command to run, after --")


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `logdx run` on the umbrella command's subparsers."""
    p = sub.add_parser(
        "run",
        help="run a training command; diagnose, cordon and restart it when it fails or hangs",
        description=_DESCRIPTION,
        epilog="example: logdx run --max-restarts 3 --exclude-arg=--exclude={hosts} "
               "--resume-arg '--load {checkpoint_dir}' -- srun python pretrain_gpt.py --save /ckpt ... "
               "(the command also gets $LOGDX_EXCLUDE_HOSTS and $LOGDX_ATTEMPT)",
    )
    _add_run_args(p)
    p.set_defaults(func=cmd_run)
    return p


def _options(args: argparse.Namespace) -> RunOptions:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to run: logdx run [options] -- CMD ARGS...")
    for name in ("max_restarts",):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("backoff", "backoff_max", "root_cause_grace", "kill_grace"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    if args.stall_timeout is not None and args.stall_timeout < 0:
        raise UsageError("--stall-timeout must be >= 0")
    if args.pause_max is not None and args.pause_max < 0:
        raise UsageError("--pause-max must be >= 0")
    restart_on = set(_csv(args.restart_on))
    bad = restart_on - set(Category)
    if bad:
        raise UsageError(f"--restart-on: unknown category {sorted(bad)[0]!r} ({', '.join(Category)})")
    loss = set(_csv(args.loss_trigger))
    if not loss <= {"nan", "spike", "none"}:
        raise UsageError("--loss-trigger: use nan, spike, both (nan,spike) or none")
    loss_triggers = frozenset(f"loss_{k}" for k in loss if k != "none")
    for name, template in (("--exclude-arg", args.exclude_arg), ("--resume-arg", args.resume_arg)):
        if template is not None:
            try:
                shlex.split(template)
            except ValueError as e:
                raise UsageError(f"{name}: {e}") from None
    job_id = args.job_id or _default_job_id(command)
    color = args.color if args.color is not None else (sys.stderr.isatty() and "NO_COLOR" not in os.environ)
    return RunOptions(
        command=command, job_id=job_id, max_restarts=args.max_restarts, backoff=args.backoff,
        backoff_max=args.backoff_max, restart_on=frozenset(restart_on), root_cause_grace=args.root_cause_grace,
        stall_timeout=args.stall_timeout, kill_grace=args.kill_grace, loss_triggers=loss_triggers,
        exclude_arg=args.exclude_arg, resume_arg=args.resume_arg, json_history=args.json_history, color=color,
    )


def _default_job_id(command: list[str]) -> str:
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    name = os.path.basename(command[0]) or "job"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def cmd_run(args: argparse.Namespace) -> int:
    opts = _options(args)
    settings = settings_from(args)
    if opts.stall_timeout:
        # The pipeline's stall detector judges the same gap by the same yardstick.
        settings.detect.stall_min_s = opts.stall_timeout
        settings.detect.stall_factor = 1.000001
    if args.dry_run is not None:
        settings.actions.dry_run = args.dry_run
    opts.pause_max = args.pause_max if args.pause_max is not None else settings.hangs.pause_max_s
    from logdx.run.supervisor import Supervisor

    engine = build_engine(settings, args.rules)
    responder, db = _open_responder(settings)
    sup = Supervisor(engine, opts, responder=responder)
    try:
        return sup.run()
    finally:
        if responder is not None:
            responder.close(deliver_due=True)  # whatever is due now; retries stay queued in the store
        if db is not None:
            db.close()


def _open_responder(settings: Settings) -> tuple[Responder | None, Database | None]:
    """Alerts and actions, when configured. Supervising the job matters more than auditing it: a
    store that cannot be opened costs them, with a message, not the run."""
    wanted = settings.actions.actuator_settings() is not None or settings.alerts.has_destinations()
    if not wanted:
        return None, None
    from logdx.act.respond import Responder
    from logdx.store import open_db

    db = None
    try:
        db = open_db(settings.store.location, settings.store.pool_size)
        # Reports of `logdx run` live in --json-history, not on a server: no report link.
        return Responder(db, settings).start(), db
    except Exception as e:  # noqa: BLE001 - see the docstring
        sys.stderr.write(f"logdx: store {settings.store.path} unavailable ({type(e).__name__}: {e}); "
                         "running without actions and alerts\n")
        if db is not None:
            db.close()
        return None, None


def main(argv: list[str] | None = None) -> int:
    """`python -m logdx.run [options] -- CMD ...`: the same as `logdx run` (for wrappers)."""
    parser = Parser(prog="logdx run", description=_DESCRIPTION)
    _add_run_args(parser)
    try:
        return cmd_run(parser.parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"logdx run: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("logdx run: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
