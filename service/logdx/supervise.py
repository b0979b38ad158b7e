"""`logdx run [options] -- CMD ARGS...`: run a training job, watch its logs, diagnose and restart it.

The command's stdout and stderr pass through to ours unchanged, byte for byte and as they come;
every line also goes to one pipeline `Session` (the same one `diagnose` and the service use).
An attempt ends when

- the command exits (trigger `exit`, or `ok` for exit code 0);
- a root cause was seen (an Xid on one rank, say) and the job did not die by itself within
  `--root-cause-grace` seconds, nor made progress since: the other ranks are hanging
  (trigger `root_cause`);
- no training progress line came for `--stall-timeout` seconds (trigger `stall`; by default
  max(stall_factor x the median step interval, detect.stall_min_s), armed once the step time
  is known);
- the loss turned NaN or spiked (triggers `loss_nan`, `loss_spike`; see `--loss-trigger`);
- logdx was interrupted (SIGINT/SIGTERM/SIGHUP are forwarded to the job's process group;
  trigger `interrupted`, never restarted).

logdx ends a job with SIGTERM to its process group and SIGKILL after `--kill-grace` seconds.
Each attempt is diagnosed; infrastructure failures (or the categories of `--restart-on`) are
restarted at most `--max-restarts` times with exponential backoff. Before a restart the culprit
node is cordoned through `Actions` (dry-run unless enabled) and excluded from the next launch:
`LOGDX_EXCLUDE_HOSTS` (always set, accumulated) and `--exclude-arg`; `--resume-arg` points the
restart at the last checkpoint the log says was saved. logdx exits with the last attempt's exit
code (128+N when it was killed by signal N).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any

from logdx.normalize import Source

if TYPE_CHECKING:
    from logdx.act.report import Report

__all__ = ["add_run_parser", "CheckpointTracker", "Supervisor", "RunOptions", "Attempt", "main"]

_READ_CHUNK = 64 * 1024
_POLL_S = 0.05
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
TRIGGERS = ("ok", "exit", "root_cause", "stall", "loss_nan", "loss_spike", "interrupted", "launch_failed")


# -- checkpoints the log says were saved ------------------------------------------------------------

_MEGATRON = re.compile(r"successfully saved checkpoint (?:at|from) iteration\s+(\d+) to (\S+)", re.I)
_DS_SAVING = re.compile(r"(?:Saving model checkpoint: |\[Torch\] Saved )(\S+)")
_DS_READY = re.compile(r"Checkpoint (\S+) is ready now")
_HF = re.compile(r"Saving model checkpoint to (\S+)")
_LIGHTNING = re.compile(r"saving model to ['\"]?([^'\"\s]+)")
_GENERIC = re.compile(r"(?:saved checkpoint|checkpoint saved) (?:to|at|in) ['\"]?([^'\"\s]+)", re.I)
_STEP_IN_PATH = re.compile(r"(?:global_step|checkpoint-|step=|iter_|iteration[_-]?)(\d+)")
_TRAILING = "'\".,;:!)]"


@dataclass
class Checkpoint:
    checkpoint: str  # the path as logged (file or directory)
    checkpoint_dir: str  # what a load option takes (see CheckpointTracker)
    iteration: int | None
    line: str
    framework: str

    def values(self) -> dict[str, str]:
        return {
            "checkpoint": self.checkpoint,
            "checkpoint_dir": self.checkpoint_dir,
            "iteration": "" if self.iteration is None else str(self.iteration),
        }


class CheckpointTracker:
    """The last checkpoint the log says was saved successfully.

    `{checkpoint_dir}` is what the framework's load option takes: Megatron's save dir (`--load`),
    DeepSpeed's root holding `global_stepN` (`load_checkpoint(dir)`), HF Trainer's `checkpoint-N`
    directory (`resume_from_checkpoint`), the directory of a Lightning `.ckpt`. `{checkpoint}` is
    the path exactly as logged (the `.ckpt` file for Lightning) and `{iteration}` the step."""

    def __init__(self) -> None:
        self.last: Checkpoint | None = None
        self._ds_pending: str | None = None

    @staticmethod
    def interesting(line: bytes) -> bool:
        return b"heckpoint" in line or b"aving model" in line or b"HECKPOINT" in line

    def feed(self, text: str) -> Checkpoint | None:
        found = self._parse(text)
        if found is not None:
            self.last = found
        return found

    def _parse(self, text: str) -> Checkpoint | None:
        m = _MEGATRON.search(text)
        if m:
            path = _clean(m.group(2))
            return Checkpoint(path, path, int(m.group(1)), text, "megatron")
        m = _DS_READY.search(text)
        if m:
            tag = _clean(m.group(1))
            step = _STEP_IN_PATH.search(tag)
            pending, self._ds_pending = self._ds_pending, None
            root = tag_dir = ""
            if pending and f"/{tag}" in pending:
                tag_dir = pending[: pending.index(f"/{tag}") + len(tag) + 1]
                root = os.path.dirname(tag_dir)
            return Checkpoint(tag_dir or tag, root, int(step.group(1)) if step else None, text, "deepspeed")
        m = _DS_SAVING.search(text)
        if m:
            self._ds_pending = _clean(m.group(1))
            return None
        m = _HF.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, path, _step(path), text, "hf")
        m = _LIGHTNING.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, os.path.dirname(path) or ".", _step(path), text, "lightning")
        m = _GENERIC.search(text)
        if m:
            path = _clean(m.group(1))
            return Checkpoint(path, path, _step(path), text, "generic")
        return None


def _clean(path: str) -> str:
    return path.rstrip(_TRAILING).strip("'\"")


def _step(path: str) -> int | None:
    m = _STEP_IN_PATH.search(path)
    return int(m.group(1)) if m else None


def fill_template(template: str, values: dict[str, str]) -> list[str] | None:
    """`--exclude-arg`/`--resume-arg`: split like a shell, then fill `{name}` placeholders in each
    word (so values never need quoting). None when a placeholder used has no value."""
    words = shlex.split(template)
    out = []
    for w in words:
        for name, value in values.items():
            token = "{" + name + "}"
            if token in w:
                if not value:
                    return None
                w = w.replace(token, value)
        out.append(w)
    return out


# -- options and results ----------------------------------------------------------------------------


@dataclass
class RunOptions:
    command: list[str]
    job_id: str
    max_restarts: int = 3
    backoff: float = 10.0
    backoff_max: float = 300.0
    restart_on: frozenset[str] = frozenset({"infrastructure"})
    root_cause_grace: float = 30.0
    stall_timeout: float | None = None  # None: derived from the step time; 0: off
    kill_grace: float = 10.0
    loss_triggers: frozenset[str] = frozenset({"loss_nan", "loss_spike"})
    exclude_arg: str | None = None
    resume_arg: str | None = None
    json_history: Path | None = None
    color: bool = False


@dataclass
class Attempt:
    number: int
    argv: list[str]
    started_at: float
    ended_at: float = 0.0
    exit_code: int = 0
    trigger: str = "exit"
    trigger_detail: str = ""
    report: Report | None = None
    excluded_hosts: list[str] = field(default_factory=list)
    resumed_from: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the last one saved during this attempt
    actions: list[dict[str, Any]] = field(default_factory=list)
    alert_queued: bool = False
    decision: str = ""  # what logdx did next: restart / stop, and why
    event_counts: dict[str, int] = field(default_factory=dict)  # the pipeline's events, by kind

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "argv": self.argv,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "duration_s": round(self.duration_s, 3),
            "exit_code": self.exit_code,
            "trigger": self.trigger,
            "trigger_detail": self.trigger_detail,
            "excluded_hosts": self.excluded_hosts,
            "resumed_from": self.resumed_from,
            "checkpoint": self.checkpoint,
            "actions": self.actions,
            "alert_queued": self.alert_queued,
            "decision": self.decision,
            "event_counts": self.event_counts,
            "report": self.report.model_dump(mode="json") if self.report else None,
        }


# -- one attempt: the child, its pipes, the session -------------------------------------------------


class _Watch:
    """What the analyzer thread learns from the lines, read by the main loop (under `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.root_cause_count = 0
        self.root_cause_at: float | None = None  # wall time the latest root-cause event arrived
        self.root_cause_text = ""
        self.root_cause_line = 0
        self.progress_count = 0
        self.progress_at_root_cause = 0
        self.last_progress_at: float | None = None
        self.last_progress_rec: Any = None
        self.loss_events: dict[str, str] = {}  # the first loss_nan / loss_spike line
        self.intervals: deque[float] = deque(maxlen=64)
        self.source_last: dict[str, float] = {}

    def step_interval(self) -> float | None:
        with self.lock:
            if len(self.intervals) < 2:
                return None
            return statistics.median(self.intervals)


class _AttemptRunner:
    def __init__(self, sup: Supervisor, attempt: Attempt, env: dict[str, str]) -> None:
        self.sup = sup
        self.attempt = attempt
        self.env = env
        self.session = sup.engine.new_session()
        self.watch = _Watch()
        # At most 4096 chunks of 64 kB: a burst the pipeline cannot keep up with waits here
        # instead of slowing the job down (the job is only held back beyond that).
        self.queue: Queue[tuple[str, bytes | None, float]] = Queue(maxsize=4096)
        self.proc: subprocess.Popen[bytes] | None = None
        self._end_reason: tuple[str, str] | None = None
        self._kill_at: float | None = None
        self._killed = False
        self.analysis_error: str | None = None
        self._max_line = sup.engine.settings.input.max_line_bytes

    # -- the child --

    def start(self) -> bool:
        try:
            self.proc = subprocess.Popen(
                self.attempt.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, env=self.env, bufsize=0,
            )
        except OSError as e:
            self.sup.say(f"cannot run {self.attempt.argv[0]}: {e.strerror or e}")
            self.attempt.exit_code = 127 if isinstance(e, FileNotFoundError) else 126
            self.attempt.trigger = "launch_failed"
            self.attempt.trigger_detail = str(e)
            return False
        self.sup.current = self
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, 1, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, 2, "stderr"), daemon=True),
        ]
        self._analyzer = threading.Thread(target=self._analyze, daemon=True)
        for t in (*self._readers, self._analyzer):
            t.start()
        return True

    def signal_group(self, sig: int) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def end(self, trigger: str, detail: str) -> None:
        """Stop a job that will not stop by itself: SIGTERM now, SIGKILL after the grace."""
        if self._end_reason is not None:
            return
        self._end_reason = (trigger, detail)
        self.sup.say(f"{detail}: ending the job (SIGTERM, then SIGKILL after {self.sup.opts.kill_grace:g} s)")
        self.signal_group(signal.SIGTERM)
        self._kill_at = time.monotonic() + self.sup.opts.kill_grace

    # -- the pipes --

    def _pump(self, pipe: Any, out_fd: int, stream: str) -> None:
        fd = pipe.fileno()
        passthrough = True
        try:
            while True:
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                if passthrough:
                    passthrough = _write_all(out_fd, chunk)
                self.queue.put((stream, chunk, time.time()))
        finally:
            self.queue.put((stream, None, time.time()))

    def _analyze(self) -> None:
        pending = {"stdout": bytearray(), "stderr": bytearray()}
        skipping = {"stdout": False, "stderr": False}
        open_streams = 2
        limit = self._max_line
        feed = self._safe_feed
        while open_streams:
            stream, chunk, arrived = self.queue.get()
            if stream == "logdx":  # a line of our own (the stall notice), fed like the others
                feed(chunk or b"", None, arrived, mark=True)
                continue
            buf = pending[stream]
            if chunk is None:
                open_streams -= 1
                if buf and not skipping[stream]:
                    feed(bytes(buf), stream, arrived)
                buf.clear()
                continue
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                if nl < 0:
                    break
                if skipping[stream]:
                    skipping[stream] = False
                else:
                    buf += chunk[start:nl]
                    feed(bytes(buf), stream, arrived)
                buf.clear()
                start = nl + 1
            if start < len(chunk) and not skipping[stream]:
                buf += chunk[start:]
                if len(buf) > limit:  # a line longer than we keep: feed its head, skip the rest
                    feed(bytes(buf[: limit + 1]), stream, arrived)
                    buf.clear()
                    skipping[stream] = True

    def _safe_feed(self, line: bytes, stream: str | None, now: float, mark: bool = False) -> None:
        """`_feed`, except that a failure of the analysis never holds the job up: the pipes keep
        being drained (and passed through); only the diagnosis of this attempt is lost."""
        if self.analysis_error is not None:
            return
        try:
            self._feed(line, stream, now, mark)
        except Exception as e:  # noqa: BLE001
            self.analysis_error = f"{type(e).__name__}: {e}"
            self.sup.say(f"log analysis failed ({self.analysis_error}); the job runs on unwatched")

    def _feed(self, line: bytes, stream: str | None, now: float, mark: bool = False) -> None:
        """One line into the session; `now` is when its bytes arrived (the analysis may lag)."""
        sess = self.session
        ts = self._stall_ts(now) if mark else None
        events = sess.feed(line, Source(stream=stream, ts=ts))
        w = self.watch
        rec = sess.compressor.last_progress
        if rec is not w.last_progress_rec:
            with w.lock:
                w.last_progress_rec = rec
                w.progress_count += 1
                w.last_progress_at = now
                key = rec.source_key
                prev = w.source_last.get(key)
                if prev is not None and now > prev:
                    w.intervals.append(now - prev)
                if len(w.source_last) < 65536:
                    w.source_last[key] = now
        if events:
            for ev in events:
                if ev.kind in ("loss_nan", "loss_spike") and ev.kind not in w.loss_events:
                    with w.lock:
                        w.loss_events[ev.kind] = ev.anchor.raw
            n = len(sess.root_cause_events)
            if n > w.root_cause_count:
                for ev in sess.root_cause_events[w.root_cause_count:n]:
                    if "loss_nan" not in w.loss_events and self._diverged(ev):
                        with w.lock:
                            w.loss_events["loss_nan"] = ev.anchor.raw
                with w.lock:
                    w.root_cause_count = n
                    w.root_cause_at = now
                    w.root_cause_text = sess.root_cause_events[-1].anchor.raw
                    w.root_cause_line = sess.root_cause_events[-1].anchor.line_no
                    w.progress_at_root_cause = w.progress_count
        if not mark and CheckpointTracker.interesting(line):
            ck = self.sup.checkpoints.feed(line.decode("utf-8", "replace"))
            if ck is not None:
                self.attempt.checkpoint = {**ck.values(), "framework": ck.framework}

    def _diverged(self, ev: Any) -> bool:
        """A root cause that says the loss went NaN/inf (however the pipeline tagged the line:
        a `loss_nan` event, or a line a `nan_loss` rule matched)."""
        if ev.kind == "loss_nan":
            return True
        hits = self.session.engine.rules.match(ev)
        return bool(hits) and hits[0].label.failure_type == "nan_loss"

    def _stall_ts(self, now: float) -> float | None:
        """The stall notice's time on the log's own clock, so that the pipeline's stall detector
        measures the same gap we did (None when the log's progress lines carry no time)."""
        w = self.watch
        rec = w.last_progress_rec
        if rec is None or rec.ts is None or w.last_progress_at is None:
            return None
        return rec.ts + (now - w.last_progress_at)

    # -- the watch loop --

    def run(self) -> None:
        proc = self.proc
        assert proc is not None
        opts = self.sup.opts
        w = self.watch
        while True:
            try:
                rc = proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            now_m = time.monotonic()
            now = time.time()
            if self._kill_at is not None:
                if not self._killed and now_m >= self._kill_at:
                    self.signal_group(signal.SIGKILL)
                    self._killed = True
                continue
            if self.sup.interrupted is not None:
                continue  # forwarded already; wait for the job to stop
            with w.lock:
                loss = next(((k, v) for k, v in w.loss_events.items() if k in opts.loss_triggers), None)
                rc_at, rc_line = w.root_cause_at, w.root_cause_line
                progressed = w.progress_count > w.progress_at_root_cause
                last_progress = w.last_progress_at
            if loss is not None:
                what = "NaN/inf loss" if loss[0] == "loss_nan" else "loss spike"
                self.end(loss[0], f"{what} ({loss[1].strip()[:160]})")
                continue
            if rc_at is not None and now - rc_at >= opts.root_cause_grace:
                if progressed:
                    with w.lock:  # training went on after it: not fatal; wait for a new one
                        if w.root_cause_at == rc_at:
                            w.root_cause_at = None
                else:
                    self.end("root_cause", f"root cause at line {rc_line}, {now - rc_at:.0f} s ago, "
                             "and no progress since")
                    continue
            timeout = self.sup.stall_timeout(w)
            if timeout and last_progress is not None and now - last_progress >= timeout:
                gap = now - last_progress
                notice = (f"logdx run: training stalled: no progress line for {gap:.1f} s "
                          f"(stall timeout {timeout:g} s)")
                self.queue.put(("logdx", notice.encode(), now))
                self.end("stall", f"no training progress for {gap:.1f} s (stall timeout {timeout:g} s)")
        self._drain_after_exit()
        self.attempt.exit_code = _exit_code(rc)
        self.sup.current = None

    def _drain_after_exit(self) -> None:
        """Read what is left in the pipes. Stragglers of the job's process group that keep them
        open after the command exited are ended too (a restart must not share the GPUs with them)."""
        grace = max(1.0, min(self.sup.opts.kill_grace, 5.0))
        for t in self._readers:
            t.join(grace)
        if any(t.is_alive() for t in self._readers):
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.sup.opts.kill_grace
            for t in self._readers:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._readers):
                self.signal_group(signal.SIGKILL)
                for t in self._readers:
                    t.join(2.0)
        if any(t.is_alive() for t in self._readers):
            # Held open outside the process group: stop waiting for it.
            self.queue.put(("stdout", None, time.time()))
            self.queue.put(("stderr", None, time.time()))
        else:
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._analyzer.join()

    def finish(self) -> Report | None:
        a = self.attempt
        if self._end_reason is not None:
            a.trigger, a.trigger_detail = self._end_reason
        elif self.sup.interrupted is not None:
            a.trigger = "interrupted"
            a.trigger_detail = f"logdx received {signal.Signals(self.sup.interrupted).name}"
        elif a.exit_code == 0:
            a.trigger, a.trigger_detail = "ok", "exit code 0"
        else:
            a.trigger, a.trigger_detail = "exit", f"exit code {a.exit_code}"
        if self.analysis_error is not None:
            return None
        try:
            report = self.session.report(exit_code=a.exit_code)
        except Exception as e:  # noqa: BLE001 - the exit code and the history matter more
            self.sup.say(f"diagnosis failed: {type(e).__name__}: {e}")
            return None
        counts: dict[str, int] = {}
        for ev in self.session.events:
            counts[ev.kind] = counts.get(ev.kind, 0) + 1
        a.event_counts = counts
        return report


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        except OSError:
            return False  # our stdout went away (closed pipe): keep watching, stop copying
        view = view[n:]
    return True


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


# -- the loop over attempts -------------------------------------------------------------------------


class Supervisor:
    def __init__(self, engine: Any, opts: RunOptions, actions: Any = None, outbox: Any = None) -> None:
        self.engine = engine
        self.opts = opts
        self.actions = actions
        self.outbox = outbox
        self.checkpoints = CheckpointTracker()
        self.attempts: list[Attempt] = []
        self.excluded: list[str] = []
        self.current: _AttemptRunner | None = None
        self.interrupted: int | None = None
        self._signal_count = 0
        self._wake = threading.Event()
        self.worker: Any = None  # an OutboxWorker to wake after an enqueue
        settings = engine.settings.detect
        self._stall_factor = settings.stall_factor
        self._stall_min = settings.stall_min_s

    def say(self, msg: str) -> None:
        try:
            sys.stderr.write(f"logdx: {msg}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def stall_timeout(self, watch: _Watch) -> float | None:
        if self.opts.stall_timeout is not None:
            return self.opts.stall_timeout or None
        interval = watch.step_interval()
        if interval is None:
            return None  # not armed until the step time is known
        return max(self._stall_factor * interval, self._stall_min)

    # -- signals --

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
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
        old = {}
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
        try:
            return self._loop()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _argv_for(self, number: int) -> tuple[list[str], dict[str, Any] | None]:
        argv = list(self.opts.command)
        resumed = None
        if self.excluded and self.opts.exclude_arg:
            words = fill_template(self.opts.exclude_arg, {"hosts": ",".join(self.excluded)})
            if words:
                argv += words
        if number > 1 and self.opts.resume_arg:
            ck = self.checkpoints.last
            if ck is None:
                self.say("no saved checkpoint seen in the log: restarting without --resume-arg")
            else:
                words = fill_template(self.opts.resume_arg, ck.values())
                if words is None:
                    self.say(f"--resume-arg {self.opts.resume_arg!r}: the last checkpoint ({ck.checkpoint}) "
                             "lacks a value it uses; restarting without it")
                else:
                    argv += words
                    resumed = {**ck.values(), "framework": ck.framework}
        return argv, resumed

    def _loop(self) -> int:
        opts = self.opts
        number = 0
        exit_code = 0
        while True:
            number += 1
            argv, resumed = self._argv_for(number)
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
            runner = _AttemptRunner(self, attempt, env)
            if self.interrupted is not None:
                attempt.ended_at = time.time()
                attempt.trigger, attempt.exit_code = "interrupted", 128 + self.interrupted
                return self._done(attempt.exit_code)
            if runner.start():
                if self.interrupted is not None:
                    runner.signal_group(self.interrupted)
                runner.run()
                attempt.report = runner.finish()
            attempt.ended_at = time.time()
            exit_code = attempt.exit_code
            if attempt.report is not None:
                self._alert(attempt)
            restart, why = self._should_restart(attempt)
            if not restart:
                attempt.decision = f"stop: {why}"
                return self._done(exit_code)
            delay = min(opts.backoff_max, opts.backoff * (2 ** (number - 1)))
            attempt.decision = f"restart in {delay:g} s: {why}"
            self._print_attempt(attempt)
            self._before_restart(attempt)
            self.say(f"restarting in {delay:g} s ({number}/{opts.max_restarts} restarts used)")
            self._wake.clear()
            deadline = time.monotonic() + delay
            while self.interrupted is None and time.monotonic() < deadline:
                self._wake.wait(max(0.0, min(0.5, deadline - time.monotonic())))
            if self.interrupted is not None:
                attempt.decision = "stop: interrupted during the backoff"
                return self._done(128 + self.interrupted)

    def _should_restart(self, a: Attempt) -> tuple[bool, str]:
        r = a.report
        if a.trigger == "ok":
            return False, "the job succeeded"
        if a.trigger == "interrupted":
            return False, "interrupted"
        if a.trigger == "launch_failed":
            return False, "the command could not be started"
        if r is None:
            return False, "no report"
        category = r.category or "unknown"
        if r.status == "healthy":
            category = "unknown"
        if category not in self.opts.restart_on:
            hint = " (owner must fix it)" if category in ("script", "framework") else ""
            return False, f"{category} failure{hint}; --restart-on {','.join(sorted(self.opts.restart_on))}"
        restarts = a.number - 1
        if restarts >= self.opts.max_restarts:
            return False, f"{category} failure but --max-restarts {self.opts.max_restarts} reached"
        return True, f"{category} failure ({r.failure_type})"

    def _before_restart(self, a: Attempt) -> None:
        r = a.report
        if r is None or r.category != "infrastructure" or r.action != "cordon_and_restart":
            return
        hosts = [h for h in r.culprits.hosts if h]
        for h in hosts:
            if h not in self.excluded:
                self.excluded.append(h)
        if self.actions is not None and hosts:
            try:
                records = self.actions.apply(f"{self.opts.job_id}/attempt-{a.number}", r, restart=False)
            except Exception as e:  # noqa: BLE001 - a broken actuator must not stop the restart
                self.say(f"actions failed: {type(e).__name__}: {e}")
                records = []
            a.actions = [rec.to_dict() for rec in records]
            for rec in records:
                if rec.outcome == "dry_run":
                    self.say(f"{rec.action} {rec.node or ''} (dry run): {rec.detail}")
                else:
                    self.say(f"{rec.action} {rec.node or ''}: {rec.outcome}: {rec.detail}")
        elif hosts:
            self.say(f"not cordoning {', '.join(hosts)}: no actuator configured (actions.actuator)")

    def _alert(self, a: Attempt) -> None:
        if self.outbox is None or a.report is None or a.report.status != "failed":
            return
        try:
            a.alert_queued = self.outbox.enqueue(f"{self.opts.job_id}/attempt-{a.number}", a.report)
            if a.alert_queued and self.worker is not None:
                self.worker.wake()
        except Exception as e:  # noqa: BLE001
            self.say(f"alert not queued: {type(e).__name__}: {e}")

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
    if r.status == "healthy":
        return "healthy"
    return f"{r.category or 'unknown'}/{r.failure_type or 'unknown'}"


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


# -- the command line -------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job-id", help="name for alerts and the audit (default: $SLURM_JOB_ID or command-time-pid)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N", help="at most N restarts (default 3)")
    p.add_argument("--backoff", type=float, default=10.0, metavar="S",
                   help="seconds before the first restart, doubled each time (default 10)")
    p.add_argument("--backoff-max", type=float, default=300.0, metavar="S", help="cap of the backoff (default 300)")
    p.add_argument("--restart-on", default="infrastructure", metavar="CATS",
                   help="categories that are restarted (default infrastructure; also framework, script, unknown)")
    p.add_argument("--root-cause-grace", type=float, default=30.0, metavar="S",
                   help="after a root cause, seconds the job may take to die by itself (default 30)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="end the job after S seconds without a progress line (default: max(stall_factor x median "
                        "step time, detect.stall_min_s), armed once the step time is known; 0: off)")
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
    p.add_argument("--config", type=Path, help="config file (YAML or TOML); default $LOGDX_CONFIG")
    p.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                   help="extra rule pack folder (repeatable)")
    p.add_argument("--no-llm", action="store_true", help="skip the LLM stage")
    p.add_argument("--no-retrieval", action="store_true", help="skip retrieval over past incidents")
    color = p.add_mutually_exclusive_group()
    color.add_argument("--color", dest="color", action="store_true", default=None, help="force colour")
    color.add_argument("--no-color", dest="color", action="store_false", help="never colour")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command to run, after --")


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `logdx run` on the umbrella command's subparsers."""
    p = sub.add_parser(
        "run",
        help="run a training command; diagnose, cordon and restart it when it fails or hangs",
        description="Run CMD, pass its output through unchanged, diagnose it when it fails, hangs, "
                    "stalls or diverges, and restart infrastructure failures without the bad node.",
        epilog="example: logdx run --max-restarts 3 --exclude-arg=--exclude={hosts} "
               "--resume-arg '--load {checkpoint_dir}' -- srun python pretrain_gpt.py --save /ckpt ... "
               "(the command also gets $LOGDX_EXCLUDE_HOSTS and $LOGDX_ATTEMPT)",
    )
    _add_run_args(p)
    p.set_defaults(func=cmd_run)
    return p


def _usage(message: str) -> Exception:
    try:
        from logdx.cli import UsageError
    except ImportError:  # pragma: no cover
        return SystemExit(f"logdx run: error: {message}")
    return UsageError(message)


def _options(args: argparse.Namespace) -> RunOptions:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _usage("no command to run: logdx run [options] -- CMD ARGS...")
    for name in ("max_restarts",):
        if getattr(args, name) < 0:
            raise _usage(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("backoff", "backoff_max", "root_cause_grace", "kill_grace"):
        if getattr(args, name) < 0:
            raise _usage(f"--{name.replace('_', '-')} must be >= 0")
    if args.stall_timeout is not None and args.stall_timeout < 0:
        raise _usage("--stall-timeout must be >= 0")
    restart_on = set(_csv(args.restart_on))
    bad = restart_on - {"infrastructure", "framework", "script", "unknown"}
    if bad:
        raise _usage(f"--restart-on: unknown category {sorted(bad)[0]!r} (infrastructure, framework, script, unknown)")
    loss = set(_csv(args.loss_trigger))
    if not loss <= {"nan", "spike", "none"}:
        raise _usage("--loss-trigger: use nan, spike, both (nan,spike) or none")
    loss_triggers = frozenset(f"loss_{k}" for k in loss if k != "none")
    for name, template in (("--exclude-arg", args.exclude_arg), ("--resume-arg", args.resume_arg)):
        if template is not None:
            try:
                shlex.split(template)
            except ValueError as e:
                raise _usage(f"{name}: {e}") from None
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
    from logdx.config import ConfigError, load_settings
    from logdx.diagnose.rules import RuleError
    from logdx.pipeline import Engine

    opts = _options(args)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        raise _usage(str(e)) from None
    if args.no_llm:
        settings.llm.enabled = False
    if args.no_retrieval:
        settings.retrieval.enabled = False
    if opts.stall_timeout:
        # The pipeline's stall detector judges the same gap by the same yardstick.
        settings = settings.model_copy(update={"detect": settings.detect.model_copy(
            update={"stall_min_s": opts.stall_timeout, "stall_factor": 1.000001})})
    if args.dry_run is not None:
        actions = settings.actions.model_copy(update={"dry_run": args.dry_run})
        settings = settings.model_copy(update={"actions": actions})
    for d in args.rules:
        if not d.is_dir():
            raise _usage(f"--rules {d}: not a directory")
    try:
        engine = Engine.create(settings, extra_rule_dirs=args.rules)
    except RuleError as e:
        raise _usage(str(e)) from None

    db = actions = outbox = worker = None
    wants_actions = settings.actions.actuator != "none"
    wants_alerts = bool(settings.alerts.slack or settings.alerts.webhooks)
    if wants_actions or wants_alerts:
        from logdx.store import open_db

        try:
            db = open_db(settings.store.path)
            if wants_actions:
                from logdx.act.actuators import Actions

                actions = Actions(db, settings.actions)
            if wants_alerts:
                from logdx.act.alerts import Outbox, OutboxWorker

                # Reports of `logdx run` live in --json-history, not on a server: no report link.
                outbox = Outbox(db, settings.alerts, public_url="")
                worker = OutboxWorker(outbox).start()
        except Exception as e:  # noqa: BLE001 - supervising the job matters more than auditing it
            sys.stderr.write(f"logdx: store {settings.store.path} unavailable ({type(e).__name__}: {e}); "
                             "running without actions and alerts\n")
            actions = outbox = worker = None

    sup = Supervisor(engine, opts, actions=actions, outbox=outbox)
    sup.worker = worker
    try:
        return sup.run()
    finally:
        if worker is not None:
            worker.stop()
            try:
                outbox.deliver_due()  # whatever is due now; retries stay queued in the store
            except Exception:  # noqa: BLE001
                pass
            outbox.close()
        if db is not None:
            db.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m logdx.supervise [options] -- CMD ...`: the same as `logdx run` (for wrappers)."""
    from logdx.cli import UsageError

    parser = argparse.ArgumentParser(prog="logdx run", description=add_run_parser.__doc__)
    _add_run_args(parser)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        return cmd_run(args)
    except UsageError as e:
        print(f"logdx run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
