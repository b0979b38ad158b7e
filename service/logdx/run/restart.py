"""The restart policy of `logdx run`: whether an attempt is restarted, after how long, and with which
command line (culprit nodes excluded, resumed from the last saved checkpoint).

Whether a node is excluded and whether an infrastructure failure is restarted are the service's
rules (`logdx.act.policy`): the same confidence, the same corroborated culprit, the same history
(a failure that follows the job across nodes, or an attempt without progress, stops the restarts;
a time limit is resubmitted from the checkpoint and excludes nothing)."""

from __future__ import annotations

import shlex

from logdx.act.argv import fill_argv
from logdx.act.policy import (
    AttemptOutcome,
    RestartVerdict,
    cordon_refusal,
    cordon_targets,
    restart_confidence_refusal,
    restart_verdict,
)
from logdx.config import ActionsSettings
from logdx.model import Category
from logdx.run.checkpoints import Checkpoint
from logdx.run.options import Attempt, RunOptions


def fill_template(template: str, values: dict[str, str]) -> list[str] | None:
    """`--exclude-arg`/`--resume-arg`: split like a shell, then fill `{name}` placeholders in each
    word (so values never need quoting). None when a placeholder used has no value."""
    words = shlex.split(template)
    if any(not value and "{" + name + "}" in w for w in words for name, value in values.items()):
        return None
    return fill_argv(words, values)


def outcome_of(a: Attempt) -> AttemptOutcome:
    return AttemptOutcome.of(a.report, a.progress_lines, ok=a.trigger == "ok")


def verdict_of(a: Attempt, previous: Attempt | None) -> RestartVerdict:
    """What the job's history says about restarting after `a` (see `logdx.act.policy`)."""
    return restart_verdict(outcome_of(previous) if previous is not None else None, outcome_of(a))


def restart_decision(a: Attempt, opts: RunOptions, actions: ActionsSettings,
                     previous: Attempt | None = None) -> tuple[bool, str]:
    """Whether to restart after this attempt, and why (or why not)."""
    r = a.report
    if a.trigger == "ok":
        return False, "the job succeeded"
    if a.trigger == "interrupted":
        # The signal came to logdx run (a Ctrl-C, an operator's kill) and was passed on: a person stopped it.
        return False, "interrupted: you stopped it (logdx run passed the signal on), not a failure to restart"
    if a.trigger == "launch_failed":
        return False, "the command could not be started"
    if r is None:
        return False, "no report"
    category = Category(r.category or Category.UNKNOWN)
    if r.status != "failed":  # healthy, or unknown: the log shows no failure to restart for
        category = Category.UNKNOWN
    if category not in opts.restart_on:
        hint = " (owner must fix it)" if category in (Category.SCRIPT, Category.FRAMEWORK) else ""
        return False, f"{category} failure{hint}; --restart-on {','.join(sorted(opts.restart_on))}"
    unsure = restart_confidence_refusal(r, actions) if category is Category.INFRASTRUCTURE else None
    if unsure is not None:
        # The LLM (or a weak fallback) alone never restarts a job: the service's threshold holds here too.
        return False, f"infrastructure failure, but {unsure}: handing it to its owner"
    verdict = verdict_of(a, previous)
    if verdict.stop:
        return False, verdict.reason
    restarts = a.number - 1
    if restarts >= opts.max_restarts:
        return False, f"{category} failure but --max-restarts {opts.max_restarts} reached"
    if verdict.decision == "resubmit":
        return True, verdict.reason
    return True, f"{category} failure ({r.failure_type})"


def backoff_delay(opts: RunOptions, number: int) -> float:
    """Seconds to wait before attempt `number + 1`: `--backoff`, doubled each time, capped."""
    return min(opts.backoff_max, opts.backoff * (2 ** (number - 1)))


def culprits_to_exclude(a: Attempt, actions: ActionsSettings) -> list[str]:
    """The nodes an attempt's diagnosis blames, when the policy would cordon them (the cluster-wide
    budget and breaker aside: excluding a node from this job's next launch takes nothing from others)."""
    r = a.report
    if r is None or cordon_refusal(r, actions) is not None:
        return []
    return [str(n) for n in cordon_targets(r)]


def next_argv(
    opts: RunOptions, number: int, excluded: list[str], checkpoint: Checkpoint | None, notes: list[str]
) -> tuple[list[str], dict[str, str] | None]:
    """The command line of attempt `number`, and the checkpoint it resumes from (if any). What could
    not be filled in is said in `notes`."""
    argv = list(opts.command)
    resumed = None
    if excluded and opts.exclude_arg:
        words = fill_template(opts.exclude_arg, {"hosts": ",".join(excluded)})
        if words:
            argv += words
    if number > 1 and opts.resume_arg:
        if checkpoint is None:
            notes.append("no saved checkpoint seen in the log: restarting without --resume-arg")
        else:
            words = fill_template(opts.resume_arg, checkpoint.values())
            if words is None:
                notes.append(f"--resume-arg {opts.resume_arg!r}: the last checkpoint ({checkpoint.checkpoint}) "
                             "lacks a value it uses; restarting without it")
            else:
                argv += words
                resumed = {**checkpoint.values(), "framework": checkpoint.framework}
    return argv, resumed
