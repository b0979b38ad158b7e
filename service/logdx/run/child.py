"""One attempt of `logdx run`: the child process, its pipes, and what the log says as it runs.

The command's stdout and stderr pass through to ours unchanged, byte for byte and as they come
(reader threads); every line also goes to one pipeline `Session` (an analyzer thread), which tells
the watch loop about root causes, progress and loss anomalies. The watch loop ends the job when a
trigger fires: SIGTERM to its process group, SIGKILL after `--kill-grace`.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
from collections import deque
from queue import Queue
from typing import TYPE_CHECKING, Any, Protocol

from logdx.model import EventKind
from logdx.normalize import Source
from logdx.run import pauses
from logdx.run.checkpoints import CheckpointTracker
from logdx.run.options import Attempt, RunOptions

if TYPE_CHECKING:
    from logdx.act.report import Report
    from logdx.pipeline import Engine

_READ_CHUNK = 64 * 1024
_POLL_S = 0.05


class Supervising(Protocol):
    """What an attempt asks of the `Supervisor` that runs it (run/supervisor.py): its options, engine and
    checkpoint tracker, a place to say things, the stall timeout, whether a signal came; it marks itself
    the current attempt while its child runs."""

    current: AttemptRunner | None

    @property
    def opts(self) -> RunOptions: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def checkpoints(self) -> CheckpointTracker: ...

    @property
    def interrupted(self) -> int | None: ...

    def say(self, msg: str) -> None: ...

    def stall_timeout(self, watch: Watch) -> float | None: ...


class Watch:
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
        self.paused_since: float | None = None  # a checkpoint save or an evaluation in progress since
        self.pause: pauses.Phase | None = None
        self.pauses: list[dict[str, Any]] = []  # finished ones: what, when, how long

    def end_pause(self, now: float) -> None:
        """A save or an evaluation finished: the stall timer starts again from now (hold `lock`)."""
        if self.paused_since is None or self.pause is None:
            return
        if len(self.pauses) < 1000:
            self.pauses.append({"what": self.pause.what, "line": self.pause.line, "started_at": self.paused_since,
                                "duration_s": round(max(0.0, now - self.paused_since), 3)})
        self.last_progress_at = max(self.last_progress_at or now, now)
        self.paused_since, self.pause = None, None

    def step_interval(self) -> float | None:
        with self.lock:
            if len(self.intervals) < 2:
                return None
            return statistics.median(self.intervals)


class AttemptRunner:
    def __init__(self, sup: Supervising, attempt: Attempt, env: dict[str, str]) -> None:
        self.sup = sup
        self.attempt = attempt
        self.env = env
        self.session = sup.engine.new_session(live=True, evidence=True)
        if self.session.recorder is not None:
            from logdx.act.capsule import Evidence

            attempt.evidence = Evidence(recorder=self.session.recorder)
        self.watch = Watch()
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
        rec = sess.last_progress
        if rec is not w.last_progress_rec:
            assert rec is not None  # last_progress_rec starts None and sess.last_progress never returns to None
            with w.lock:
                w.end_pause(now)  # training is back: whatever paused it is over
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
                if ev.kind in (EventKind.LOSS_NAN, EventKind.LOSS_SPIKE) and ev.kind not in w.loss_events:
                    with w.lock:
                        w.loss_events[ev.kind] = ev.anchor.raw
            new_causes = sess.take_new_root_causes()
            for ev in new_causes:
                if EventKind.LOSS_NAN not in w.loss_events and sess.is_diverged(ev):
                    with w.lock:
                        w.loss_events[EventKind.LOSS_NAN] = ev.anchor.raw
            if new_causes:
                with w.lock:
                    w.root_cause_count += len(new_causes)
                    w.root_cause_at = now
                    w.root_cause_text = new_causes[-1].anchor.raw
                    w.root_cause_line = new_causes[-1].anchor.line_no
                    w.progress_at_root_cause = w.progress_count
        if not mark and pauses.interesting(line):
            self._note_phase(line.decode("utf-8", "replace"), now)
        if not mark and CheckpointTracker.interesting(line):
            ck = self.sup.checkpoints.feed(line.decode("utf-8", "replace"))
            if ck is not None:
                self.attempt.checkpoint = {**ck.values(), "framework": ck.framework}

    def _note_phase(self, text: str, now: float) -> None:
        change = pauses.phase_change(text)
        if change is None:
            return
        w = self.watch
        with w.lock:
            if isinstance(change, pauses.Phase):
                if w.paused_since is None:
                    w.paused_since, w.pause = now, change
            else:
                w.end_pause(now)

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
                what = "NaN/inf loss" if loss[0] == EventKind.LOSS_NAN else "loss spike"
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
            with w.lock:
                paused_since, pause = w.paused_since, w.pause
            if paused_since is not None and pause is not None:
                if now - paused_since < opts.pause_max:
                    continue  # a save or an evaluation in progress: not a stall
                self.end("stall", f"{pause.what} in progress for {now - paused_since:.1f} s, longer than "
                         f"--pause-max {opts.pause_max:g} s ({pause.line[:120]})")
                continue
            timeout = self.sup.stall_timeout(w)
            if timeout and last_progress is not None and now - last_progress >= timeout:
                gap = now - last_progress
                notice = (f"logdx run: training stalled: no progress line for {gap:.1f} s "
                          f"(stall timeout {timeout:g} s)")
                self.queue.put(("logdx", notice.encode(), now))
                self.end("stall", f"no training progress for {gap:.1f} s (stall timeout {timeout:g} s)")
        self._drain_after_exit()
        self.attempt.exit_code = exit_code_of(rc)
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
            assert self.proc is not None  # run() started it
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
        a.event_counts = self.session.event_counts()
        summary = self.session.summary()
        a.progress_lines, a.hosts = summary.progress_lines, sorted(summary.hosts)
        with self.watch.lock:
            a.pauses = list(self.watch.pauses)
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


def exit_code_of(rc: int) -> int:
    """A shell's exit code: 128+N when signal N killed the process."""
    return 128 - rc if rc < 0 else rc
