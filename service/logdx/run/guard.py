"""The guardian of `logdx run`: the job's process group dies with logdx run, however logdx run dies.

`logdx run` starts each attempt in a process group of its own (so that it can signal the launcher
and every worker at once). If logdx run itself were killed (SIGKILL, the OOM killer, a crash), that
group would live on under PID 1, holding the GPUs. So logdx run starts this small process first, in
a session of its own (a Ctrl-C at the terminal does not reach it), with a pipe on its stdin, and
tells it the process group of each attempt (`watch PGID GRACE`) and when it ended (`clear`). When
the pipe reaches end-of-file without a `clear` (logdx run is gone: the kernel closed its end), the
guardian sends SIGTERM to the group, then SIGKILL after GRACE seconds, and exits. A clean logdx run
says `clear` and closes the pipe: the guardian exits at once.

This is a parent-death signal for a whole process group (Linux's PR_SET_PDEATHSIG only reaches the
direct child, and not across exec of set-user-ID programs). Processes that leave the group (setsid,
daemons) escape it: run logdx run inside a cgroup (`systemd-run --scope`, a container) for those.

Standard library only, started by path (`python -I guard.py`): no logdx import on this path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_POLL_S = 0.05


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(pgid: int, grace: float) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pgid):
        time.sleep(_POLL_S)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe's end says logdx run is gone
    watched: tuple[int, float] | None = None
    for line in sys.stdin:
        words = line.split()
        if len(words) == 3 and words[0] == "watch":
            watched = (int(words[1]), float(words[2]))
        elif words == ["clear"]:
            watched = None
    if watched is not None:
        _end_group(*watched)
    return 0


class Guardian:
    """logdx run's side: start the guardian, tell it which group to watch."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Guardian:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True,
            )
        except OSError:
            self.proc = None  # supervising the job matters more: run on unguarded
        return self

    def _say(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def watch(self, pgid: int, grace: float) -> None:
        self._say(f"watch {pgid} {grace:g}")

    def clear(self) -> None:
        self._say("clear")

    def close(self) -> None:
        """The job is over: the guardian exits without touching anything."""
        if self.proc is None:
            return
        self.clear()
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


if __name__ == "__main__":
    sys.exit(main())
