"""Stack dumps printed into a log: what an engineer runs on a hung job, and what Python prints itself.

- py-spy `dump` (one block per process: ``Process 12345: python train.py``, ``Thread 12345 (active):
  "MainThread"``, then one ``    function (file.py:line)`` line per frame, innermost first);
- faulthandler (``faulthandler.dump_traceback``, ``dump_traceback_later``, SIGUSR1 with
  ``faulthandler.register``, a fatal signal): ``Thread 0x... (most recent call first):`` or ``Current
  thread 0x...``, then ``  File "...", line N in function`` lines, innermost first;
- a stack printed alone: ``Stack (most recent call first):``.

The compressor keeps these lines (they carry no error word); the detector reads them into one
`stack_dump` event per process; the diagnosis groups the processes by where they wait (diagnose/hangs.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from logdx.model import Frame
from logdx.taxonomy import is_stdlib_path

__all__ = ["StackLine", "classify_line", "frame_owner", "is_stack_start", "section_name"]

_PYSPY_PROCESS = re.compile(r"^Process (?P<pid>\d+): (?P<cmd>.*)$")
_PYSPY_PYTHON = re.compile(r"^Python v\d+\.\d+")
_PYSPY_THREAD = re.compile(r'^Thread (?P<tid>0x[0-9A-Fa-f]+|\d+) \((?P<state>[^)]*)\)(?:: "(?P<name>[^"]*)")?\s*$')
_PYSPY_FRAME = re.compile(r"^\s{2,}(?P<func>[^\s(][^(]*?) \((?P<path>[^()\s]+?)(?::(?P<line>\d+))?\)\s*$")
_FAULT_THREAD = re.compile(r"^(?P<current>Current thread|Thread) (?P<tid>0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FAULT_STACK = re.compile(r"^Stack \(most recent call first\):\s*$")
_FAULT_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)\s*$')
# gdb's "thread apply all bt": "Thread 9 (Thread 0x1554539fc700 (LWP 153338)):", then
# "#2  0x0000155520c4a915 in cudaGetLastError () from lib/libcudart.so.11.0" or "#7  start_thread (arg=...) at
# pthread_create.c:477".
_GDB_THREAD = re.compile(r"^Thread (?P<n>\d+) \(Thread 0x[0-9a-fA-F]+ \(LWP (?P<lwp>\d+)\)\)(?: \"[^\"]*\")?:\s*$")
_GDB_FRAME = re.compile(r"^#(?P<n>\d+)\s+(?:0x[0-9a-fA-F]+ in )?(?P<func>\S.*?) \((?:[^()]|\([^()]*\))*\)"
                        r"(?: (?:from|at) (?P<path>\S+?)(?::(?P<line>\d+))?)?\s*$")
# A dump that groups identical stacks says how many processes share the next one ("4 in:").
_GROUP_COUNT = re.compile(r"^\d+ in:$")
# What starts a dump, as a substring test first (cheap, once per line shape).
_STARTS = ("Process ", "Thread ", "Current thread ", "Stack (most recent call first)")


# A collection of dumps of a job says whose they are in a line of its own before each node's: `tail`/`head` of
# the per-node files (``==> trace-gpu-node-12.out <==``), a file or host name echoed alone (``trace-node12``,
# ``gpu-node-12:``, ``### gpu-node-12``), a note's heading (``Node 48:``), or the command that logged into the node
# whose output follows (``ssh gpu-node-12``, ``$ ssh -t user@gpu-node-12``). What it names is only a name here:
# the diagnosis matches it to the job's own hosts (diagnose/culprit.py).
_SECTION_FILES = re.compile(r"^==> (?P<name>\S(?:.*\S)?) <==$")
_SECTION_WORD = re.compile(r"^(?:#{1,6} |[-=*]{3,} ?)?(?P<name>[A-Za-z][\w.-]{0,252}?)(?: ?[-=*]{3,})?:?$")
_SECTION_NODE = re.compile(r"^(?:#{1,6} )?(?P<name>(?:[Nn]ode|NODE|[Hh]ost|HOST) ?#?\d{1,6}):?$")
_SECTION_SSH = re.compile(r"^(?:\$ )?ssh(?: -[A-Za-z46]+)* (?:[\w.-]+@)?(?P<name>[A-Za-z][\w.-]{0,252})$")
_SECTION_MAX = 300


def section_name(text: str) -> str | None:
    """The name a line gives the dumps printed after it (see above), or None: not such a line."""
    if text[:1] in (" ", "\t"):
        return None  # a header starts its line; an indented word is content (a frame's name in a summary)
    s = text.strip()
    if not s or len(s) > _SECTION_MAX:
        return None
    if s.startswith("==> "):
        m = _SECTION_FILES.match(s)
    elif " " not in s.strip("#-=* "):
        m = _SECTION_WORD.match(s)
    elif s.startswith(("ssh ", "$ ssh ")):
        m = _SECTION_SSH.match(s)
    elif s[0] in "#NnHh":
        m = _SECTION_NODE.match(s)
    else:
        return None
    return m.group("name") if m is not None else None


@dataclass(slots=True)
class StackLine:
    """What one line of a dump says."""

    kind: str  # "process" | "thread" | "frame" | "other" (a line a dump may hold: locals, "Python v3.10")
    pid: int | None = None
    thread: str | None = None  # name or id
    tid: str | None = None  # the thread's id (py-spy: the main thread's is the process id)
    main: bool = False  # the main thread (py-spy's "MainThread", faulthandler's "Current thread")
    frame: Frame | None = None


def is_stack_start(text: str) -> bool:
    """A line that starts a stack dump (or a thread of one)."""
    s = text.strip()
    if not s.startswith(_STARTS):
        return False
    return bool(_PYSPY_PROCESS.match(s) or _PYSPY_THREAD.match(s) or _FAULT_THREAD.match(s) or _FAULT_STACK.match(s)
                or _GDB_THREAD.match(s))


def classify_line(text: str) -> StackLine | None:
    """What a line inside a dump is; None when it is not part of one (the dump ended)."""
    s = text.rstrip()
    st = s.lstrip()
    if (m := _PYSPY_PROCESS.match(st)) is not None:
        return StackLine("process", pid=int(m.group("pid")))
    if (m := _PYSPY_THREAD.match(st)) is not None:
        name = m.group("name") or m.group("tid")
        return StackLine("thread", thread=name, main=name == "MainThread", tid=m.group("tid"))
    if (m := _FAULT_THREAD.match(st)) is not None:
        return StackLine("thread", thread=m.group("tid"), main=m.group("current") == "Current thread", tid=m.group("tid"))
    if _FAULT_STACK.match(st):
        return StackLine("thread", thread="stack", main=True)
    if (m := _GDB_THREAD.match(st)) is not None:
        return StackLine("thread", thread=m.group("lwp"), main=m.group("n") == "1", tid=m.group("lwp"))
    if (m := _GDB_FRAME.match(st)) is not None:
        line = m.group("line")
        return StackLine("frame", frame=Frame(path=m.group("path") or "", line=int(line) if line else None,
                                              function=m.group("func").strip()))
    if (m := _FAULT_FRAME.match(s)) is not None:
        return StackLine("frame", frame=Frame(path=m.group("path"), line=int(m.group("line")), function=m.group("func")))
    if (m := _PYSPY_FRAME.match(s)) is not None:
        line = m.group("line")
        return StackLine("frame", frame=Frame(path=m.group("path"), line=int(line) if line else None,
                                              function=m.group("func").strip()))
    if not st or _PYSPY_PYTHON.match(st) or _GROUP_COUNT.match(st) or s.startswith("        "):  # --locals, blanks
        return StackLine("other")
    return None


# -- who owns a frame ----------------------------------------------------------------------------------

_SITE = re.compile(r"[\\/](?:site|dist)-packages[\\/]")


def frame_owner(frame: Frame, library_module: str | None) -> str:
    """"stdlib", "library", "native" (a shared object or C source: --native and gdb frames) or "user",
    for one frame; `library_module` is the installed library the caller recognised the path as."""
    path = frame.path.replace("\\", "/")
    if not path or path.endswith((".so", ".c", ".cc", ".cpp", ".S", ".h")) or ".so." in path:
        return "library" if _SITE.search(path) else "native"
    if _SITE.search(path) or library_module is not None:
        return "library"
    if is_stdlib_path(path):
        return "stdlib"
    return "user"
