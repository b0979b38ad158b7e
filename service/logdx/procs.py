"""What `ps` printed into a hung job's log: the processes in uninterruptible sleep.

A process in state ``D`` waits in the kernel and cannot be interrupted: on an NFS or Lustre mount that stopped
answering, in a GPU driver call that never returns. A rank in that state on one node while the others wait in a
collective points at that node's host side. Two shapes reach a log:

- ``ps aux`` (also piped through ``grep python``, so without its header): ``USER PID %CPU %MEM VSZ RSS TTY STAT
  START TIME COMMAND``, the state in the eighth column;
- ``ps -eo pid,stat,wchan:32,cmd`` / ``ps -o ...`` / ``ps -elf``: a header line names the columns (``PID``, ``STAT``
  or ``S``, maybe ``WCHAN``), the command comes last.

The compressor keeps the rows in state D (a shape of its own: the state is a word, not a digit); the detector
makes each a `process_state` event; the diagnosis names its host and rank for a hang (diagnose/culprit.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from logdx.model import ProcessState

__all__ = ["PsColumns", "ProcessState", "aux_row", "header_columns", "row_in"]

# ps aux: USER PID %CPU %MEM VSZ RSS TTY STAT START TIME COMMAND ("START" is "10:01", "Jun03" or "2024").
_AUX = re.compile(r"^(?P<user>[\w.+-]{1,32})\s+(?P<pid>\d{1,9})\s+\d+(?:\.\d+)?\s+\d+(?:\.\d+)?\s+\d+\s+\d+\s+\S+\s+"
                  r"(?P<stat>[DRSTtWXZIP][<NLslI+]*)\s+\S+\s+\d+:\d\d(?::\d\d)?\s+(?P<cmd>\S.*)$")
_STATE = re.compile(r"^[DRSTtWXZIP][<NLslI+]*$")
_PID_NAMES = ("PID",)
_STATE_NAMES = ("STAT", "S")
_COMMAND_NAMES = ("COMMAND", "CMD", "ARGS", "COMM", "UCMD")
_MAX_COLUMNS = 24


@dataclass(frozen=True, slots=True)
class PsColumns:
    """Where a header put the pid, the state and the kernel function it waits in (WCHAN), and how many
    columns come before the command (the one that may hold spaces)."""

    pid: int
    state: int
    wchan: int | None
    before_command: int


def header_columns(text: str) -> PsColumns | None:
    """The columns of a `ps` header line, or None: not one (it must name a pid, a state and the command last)."""
    if "PID" not in text:
        return None
    names = text.split()
    if not 3 <= len(names) <= _MAX_COLUMNS or names[-1] not in _COMMAND_NAMES:
        return None
    pid = next((i for i, n in enumerate(names) if n in _PID_NAMES), None)
    state = next((i for i, n in enumerate(names) if n in _STATE_NAMES), None)
    if pid is None or state is None:
        return None
    wchan = names.index("WCHAN") if "WCHAN" in names else None
    return PsColumns(pid=pid, state=state, wchan=wchan, before_command=len(names) - 1)


def row_in(text: str, columns: PsColumns) -> ProcessState | None:
    """A row of the listing `columns` describes, or None: the listing ended."""
    parts = text.split(None, columns.before_command)
    if len(parts) != columns.before_command + 1:
        return None
    pid, state = parts[columns.pid], parts[columns.state]
    if not pid.isdigit() or _STATE.match(state) is None:
        return None
    wchan = parts[columns.wchan] if columns.wchan is not None else None
    return ProcessState(pid=int(pid), state=state, command=parts[-1].strip(), wchan=None if wchan == "-" else wchan)


def aux_row(text: str) -> ProcessState | None:
    """A `ps aux` row (header or not), or None."""
    m = _AUX.match(text.strip())
    if m is None:
        return None
    return ProcessState(pid=int(m.group("pid")), state=m.group("stat"), command=m.group("cmd").strip())
