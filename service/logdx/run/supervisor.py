"""The loop over attempts of `logdx run`: start, watch, diagnose, alert and act, restart or stop;
signals forwarded to the job; the history printed and written."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from logdx.model import FT, Category
from logdx.run.checkpoints import CheckpointTracker
from logdx.run.child import AttemptRunner, Watch
from logdx.run.guard import Guardian
from logdx.run.options import Attempt, RunOptions
from logdx.run.restart import backoff_delay, culprits_to_exclude, next_argv, restart_decision, verdict_of

if TYPE_CHECKING:
    from logdx.act.report import Report
    from logdx.act.respond import Responder
    from logdx.pipeline import Engine

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Supervisor:
    def __init__(self, engine: Engine, opts: RunOptions, responder: Responder | None = None) -> None:
        self.engine = engine
        self.opts = opts
        self.responder = responder  # alerts and actions; None: neither is configured
        self.checkpoints = CheckpointTracker()
        self.attempts: list[Attempt] = []
        self.excluded: list[str] = []
        self.current: AttemptRunner | None = None
        self.interrupted: int | None = None
        self._signal_count = 0
        self._wake = threading.Event()
        self.actions_settings = engine.settings.actions
        self.guardian = Guardian()
        settings = engine.settings.detect
        self._stall_factor = settings.stall_factor
        self._stall_min = settings.stall_min_s

    def say(self, msg: str) -> None:
        try:
            sys.stderr.write(f"logdx: {msg}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def stall_timeout(self, watch: Watch) -> float | None:
        if self.opts.stall_timeout is not None:
            return self.opts.stall_timeout or None
        interval = watch.step_interval()
        if interval is None:
            return None  # not armed until the step time is known
        return max(self._stall_factor * interval, self._stall_min)

    # -- signals --

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum in _STOPPING:
            self._signal_count += 1
            if self.interrupted is None:
                self.interrupted = signum
            self._wake.set()
        cur = self.current
        if cur is not None:
            # A third Ctrl-C means "now": the job did not stop on the first two.
            cur.signal_group(signal.SIGKILL if self._signal_count >= 3 else signum)

    def _install_signals(self) -> dict[int, Any]:
        old: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return old
        for sig in _FORWARDED:
            try:
                old[sig] = signal.signal(sig, self._on_signal)
            except (OSError, ValueError):
                pass
        return old

    # -- the loop --

    def run(self) -> int:
        old = self._install_signals()
        self.guardian.start()  # the job's process group dies with us, even if we are SIGKILLed
        try:
            return self._loop()
        finally:
            self.guardian.close()
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        opts = self.opts
        number = 0
        exit_code = 0
        while True:
            number += 1
            notes: list[str] = []
            argv, resumed = next_argv(opts, number, self.excluded, self.checkpoints.last, notes)
            for note in notes:
                self.say(note)
            env = dict(os.environ)
            env["LOGDX_EXCLUDE_HOSTS"] = ",".join(self.excluded)
            env["LOGDX_ATTEMPT"] = str(number)
            env["LOGDX_JOB_ID"] = opts.job_id
            env.setdefault("PYTHONUNBUFFERED", "1")  # a Python child writing to a pipe would buffer
            attempt = Attempt(number=number, argv=argv, started_at=time.time(),
                              excluded_hosts=list(self.excluded), resumed_from=resumed)
            self.attempts.append(attempt)
            if number > 1:
                self.say(f"attempt {number}/{opts.max_restarts + 1}: {shlex.join(argv)}")
            runner = AttemptRunner(self, attempt, env)
            if self.interrupted is not None:
                attempt.ended_at = time.time()
                attempt.trigger, attempt.exit_code = "interrupted", 128 + self.interrupted
                return self._done(attempt.exit_code)
            if runner.start():
                assert runner.proc is not None
                self.guardian.watch(runner.proc.pid, opts.kill_grace)
                if self.interrupted is not None:
                    runner.signal_group(self.interrupted)
                runner.run()
                self.guardian.clear()
                attempt.report = runner.finish()
                self._follow(attempt, runner)
            attempt.ended_at = time.time()
            exit_code = attempt.exit_code
            previous = self.attempts[-2] if len(self.attempts) > 1 else None
            restart, why = restart_decision(attempt, opts, self.actions_settings, previous)
            culprits = culprits_to_exclude(attempt, self.actions_settings)
            if not restart:
                attempt.decision = f"stop: {why}"
                self._respond(attempt, excluded=[], previous=previous)
                if attempt.trigger == "ok":
                    self._credit(attempt)
                    self._resolved()
                return self._done(exit_code)
            delay = backoff_delay(opts, number)
            attempt.decision = f"restart in {delay:g} s: {why}"
            self._print_attempt(attempt)
            self.excluded += [h for h in culprits if h not in self.excluded]
            self._respond(attempt, excluded=culprits, previous=previous)
            self.say(f"restarting in {delay:g} s ({number}/{opts.max_restarts} restarts used)")
            self._wake.clear()
            deadline = time.monotonic() + delay
            while self.interrupted is None and time.monotonic() < deadline:
                self._wake.wait(max(0.0, min(0.5, deadline - time.monotonic())))
            if self.interrupted is not None:
                attempt.decision = "stop: interrupted during the backoff"
                return self._done(128 + self.interrupted)

    def _follow(self, a: Attempt, runner: AttemptRunner) -> None:
        """The previous attempt's cost learns how long the job stood still and when this one was back."""
        if self.responder is None or a.number < 2:
            return
        try:
            self.responder.costs.follow(self._alert_id(a), runner.session.summary().progress,
                                        previous=self._alert_id(self.attempts[-2]))
        except Exception as e:  # noqa: BLE001 - the store failing must not stop the supervision
            self.say(f"the previous attempt's cost was not completed: {type(e).__name__}: {e}")

    def _alert_id(self, a: Attempt) -> str:
        return f"{self.opts.job_id}/attempt-{a.number}"

    def _respond(self, a: Attempt, excluded: list[str], previous: Attempt | None) -> None:
        """Alert about a failed attempt and cordon its culprit as the policy allows: the one path from
        a diagnosis to alerts and actions (`logdx.act.respond`), as in the service. `logdx run`
        restarts the job itself, so the restart hook is not run here."""
        r = self.responder
        if a.report is None or a.report.status != "failed" or a.trigger == "interrupted":
            return  # stopped by whoever signalled logdx run: they know; nobody is paged for it
        also = [f"excluded {', '.join(excluded)} from the next launch"] if excluded else []
        also.append(f"logdx run: {a.decision}")
        if r is None:
            if excluded and self.actions_settings.actuator_settings() is None:
                self.say(f"not cordoning {', '.join(excluded)}: no actuator configured (actions.actuator)")
            return
        response = r.respond(self._alert_id(a), a.report, restart=False, verdict=verdict_of(a, previous),
                             seen_hosts=a.hosts, also_done=also)
        a.alert_queued = response.alert_queued
        for err in response.errors:
            self.say(err)
        a.actions = [rec.to_dict() for rec in response.actions]
        for rec in response.actions:
            if rec.outcome == "dry_run":
                self.say(f"{rec.action} {rec.node or ''} (dry run): {rec.detail}")
            else:
                self.say(f"{rec.action} {rec.node or ''}: {rec.outcome}: {rec.detail}")

    def _credit(self, a: Attempt) -> None:
        """The job ended well and its report earned `healthy`: evidence for the nodes it ran on (their grades,
        `logdx nodes`), its runtime the attempt's own."""
        if self.responder is None or a.report is None or a.report.status != "healthy":
            return
        runtime_s = max(0.0, (a.ended_at or a.started_at) - a.started_at)
        for rec in self.responder.credit(self._alert_id(a), a.report, a.hosts, runtime_s):
            self.say(f"{rec.action} {rec.node or ''}: {rec.outcome}: {rec.detail}")

    def _resolved(self) -> None:
        """The job succeeded: the alerts about its failed attempts get a "resolved" follow-up."""
        if self.responder is None:
            return
        last = self.attempts[-1]
        for a in self.attempts[:-1]:
            if a.alert_queued:
                self.responder.resolved_job(self._alert_id(a), f"{self.opts.job_id} succeeded on attempt {last.number}")

    # -- output --

    def _print_attempt(self, a: Attempt) -> None:
        r = a.report
        what = _diag(r)
        culprit = _culprit(r)
        self.say(f"attempt {a.number} ended after {a.duration_s:.1f} s: {a.trigger} (exit {a.exit_code}); "
                 f"{what}{' on ' + culprit if culprit != '-' else ''}; {r.action if r else '-'}")
        if r is not None and r.root_cause is not None:
            self.say(f"  root line {r.root_cause.line_no}: {r.root_cause.text.strip()[:200]}")

    def _done(self, exit_code: int) -> int:
        last = self.attempts[-1] if self.attempts else None
        if last is not None and last.trigger == "ok" and last.report is not None and last.report.status == "failed":
            r = last.report
            where = f" (line {r.root_cause.line_no})" if r.root_cause else ""
            self.say(f"the job succeeded; its log also shows {_diag(r)}{where}: {r.explanation}")
        elif last is not None and last.trigger == "interrupted":
            shown = last.report is not None and last.report.status == "failed" and last.report.failure_type != FT.CANCELLED
            before = f"; before that its log showed {_diag(last.report)}" if shown and last.report else ""
            self.say(f"stopped by you ({last.trigger_detail}, passed on to the job){before}: no alert, no restart")
        elif last is not None and last.report is not None and last.report.status == "failed":
            from logdx.act.render import render_text

            try:
                sys.stderr.write("\n" + render_text(last.report, color=self.opts.color))
            except (OSError, ValueError):
                pass
        self.say(f"{len(self.attempts)} attempt(s); exit code {exit_code}; "
                 f"{last.decision if last else ''}")
        try:
            sys.stderr.write(history_table(self.attempts) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if self.opts.json_history is not None:
            data = {
                "job_id": self.opts.job_id,
                "command": self.opts.command,
                "exit_code": exit_code,
                "excluded_hosts": self.excluded,
                "attempts": [a.to_dict() for a in self.attempts],
            }
            try:
                self.opts.json_history.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            except OSError as e:
                self.say(f"--json-history {self.opts.json_history}: {e.strerror or e}")
        return exit_code


def _diag(r: Report | None) -> str:
    if r is None:
        return "-"
    if r.status != "failed":
        return r.status  # healthy, unknown (neither a failure nor health shown), empty
    return f"{r.category or Category.UNKNOWN}/{r.failure_type or FT.UNKNOWN}"


def _culprit(r: Report | None) -> str:
    if r is None or r.status != "failed":
        return "-"
    if r.culprits.hosts:
        return ",".join(r.culprits.hosts[:3]) + ("…" if len(r.culprits.hosts) > 3 else "")
    if r.culprits.ranks:
        return "rank " + ",".join(str(x) for x in r.culprits.ranks[:3])
    return "-"


def history_table(attempts: list[Attempt]) -> str:
    head = ("attempt", "exit", "trigger", "diagnosis", "culprit", "action", "duration")
    rows = [head]
    for a in attempts:
        r = a.report
        rows.append((str(a.number), str(a.exit_code), a.trigger, _diag(r), _culprit(r),
                     r.action if r else "-", f"{a.duration_s:.1f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
