"""Stage 1: read lines from anywhere and turn each into a `Record`.

A merged training log is many processes talking at once, each behind its launcher's prefix
(`[default0]:[rank3]:`, `srun -l`'s `12: `, pdsh's `node-3: `, NCCL's `host:pid:tid [dev]`,
mpirun's `[1,17]<stderr>:`, kernel and syslog stamps). The prefixes are peeled off into fields
so later stages see the message, and know who said it and when.

Nothing here may raise on a line: invalid UTF-8, NULs, ANSI colour, CR progress bars and
ten-megabyte lines are all part of real logs.
"""

from __future__ import annotations

import calendar
import gzip
import io
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from logdx.hosts import HostScope
from logdx.model import Record

DEFAULT_MAX_LINE_BYTES = 64 * 1024
_READ_CHUNK = 1 << 20

_ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

# --- timestamps ----------------------------------------------------------------------------------
# YYYY-MM-DD[T ]HH:MM (the minute: a cache key), :SS, fraction, zone.
_ISO_BODY = (
    r"\[?(?P<ymdhm>\d{4}-\d\d-\d\d[T ]\d\d:\d\d):(?P<ss>\d\d)(?:[.,](?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d\d:?\d\d)?\]?:?\s*"
)
_ISO = re.compile(_ISO_BODY)
_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}
_MONTH_NAMES = "|".join(_MONTHS)
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_GLOG = re.compile(r"\[?([IWEF])(\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")
_MESSAGE_RANK = re.compile(r"\[(?:PG \d+ (?:\([^)]*\) )?)?Rank (\d+)\]")


# --- launcher / transport prefixes: the table ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LauncherPrefix:
    """One shape of prefix a line can start with. The normaliser peels prefixes off in any order
    until none applies (launchers nest: srun around torchrun), trying the rows in table order.

    The pattern's named groups are the fields it gives: `rank`, `local_rank`, `host`, `pid`, `stream`
    (`out`/`err` read as stdout/stderr), `srun` (srun -l's task label: the rank, unless srun runs one
    task per node), `session_host` (a shell prompt: the host of every later line), and a timestamp,
    whose groups name its kind: ISO (`ymdhm`, `ss`, `frac`, `tz`), ctime (`c_mon`, `c_day`, `c_hh`,
    `c_mm`, `c_ss`, `c_year`) or syslog, without a year (`s_mon`, `s_day`, `s_hh`, `s_mm`, `s_ss`).
    A group that did not take part gives nothing."""

    name: str
    starts: tuple[str, ...]  # what the line may start with for the row to be tried: characters, or "digit",
    #                          "alpha", "upper" (str.isdigit & co., Unicode included, as the patterns' \d, \w)
    pattern: str
    fill: frozenset[str] = frozenset()  # fields it gives only when no earlier prefix gave them
    needs_unknown: str = ""  # tried only while this field is unknown
    ends: bool = False  # the last prefix: what follows is the message, the prefix's own text included
    nests: bool = False  # a launcher that numbers ranks itself: with it, srun's labels number nodes
    guard: str = ""  # a character the line must hold within its first 64 (a cheap test before the regex)


# A host prefix must look like a machine name (lower case, a digit somewhere) so that "RuntimeError: ..."
# or "Epoch 3: ..." are never taken for one; nor a kernel driver's device name ("nvidia-nvswitch3: SXid").
_HOST_NAME = r"(?!nvidia-nvswitch\d+: )(?P<host>[a-z][a-z0-9-]*\d[a-z0-9.-]*|localhost)"

LAUNCHER_PREFIXES: tuple[LauncherPrefix, ...] = (
    LauncherPrefix("torchrun local rank", ("[",), r"\[default(?P<local_rank>\d+)\]:"),
    LauncherPrefix("torchrun rank", ("[",), r"\[[Rr]ank\s?(?P<rank>\d+)\]:\s?", nests=True),
    LauncherPrefix("mpirun tag", ("[",), r"\[\d+,(?P<rank>\d+)\]<(?P<stream>stdout|stderr)>:\s?", nests=True),
    LauncherPrefix("dmesg -T stamp", ("[",),
                   rf"\[{_WEEKDAY} (?P<c_mon>[A-Z][a-z]{{2}}) +(?P<c_day>\d{{1,2}}) (?P<c_hh>\d\d):(?P<c_mm>\d\d)"
                   r":(?P<c_ss>\d\d) (?P<c_year>\d{4})\] "),
    # "[  123.456789] ": the kernel's seconds since boot (raw dmesg, kern.log, journalctl -o short-monotonic).
    LauncherPrefix("kernel boot clock", ("[",), r"\[\s*[+]?(?P<boot_s>\d+\.\d+)\] "),
    LauncherPrefix("ISO stamp", ("[", "digit"), _ISO_BODY),
    LauncherPrefix("srun -l label", ("digit", " "), r"\s{0,4}(?P<srun>\d{1,6}): ", needs_unknown="rank"),
    LauncherPrefix("ctime stamp", ("MTWFS",),
                   rf"{_WEEKDAY} (?P<c_mon>[A-Z][a-z]{{2}}) +(?P<c_day>\d{{1,2}}) (?P<c_hh>\d\d):(?P<c_mm>\d\d)"
                   r":(?P<c_ss>\d\d) (?P<c_year>\d{4})\s?"),
    # "Nov 13 10:00:01 node-3 kernel: ...": the program after the host ("kernel: ", "sshd[123]: ") goes too.
    LauncherPrefix("syslog", ("upper",),
                   rf"(?P<s_mon>{_MONTH_NAMES}) +(?P<s_day>\d{{1,2}}) (?P<s_hh>\d\d):(?P<s_mm>\d\d):(?P<s_ss>\d\d) "
                   r"(?P<host>[\w.-]+) (?:[\w./-]+(?:\[\d+\])?: )?", fill=frozenset({"host"})),
    # Ray: "(pid=1521961) ", "(RayTrainWorker pid=2345, ip=10.0.0.12) ".
    LauncherPrefix("ray worker", ("(",), r"\((?:[\w.:]+ )?pid=(?P<pid>\d+)(?:, ip=(?P<host>[\d.]+))?\) ",
                   fill=frozenset({"host"})),
    # Slurm's step daemon names its node in its own name on some sites: the message keeps "slurmstepd-...:".
    LauncherPrefix("slurmstepd host", ("s",), r"slurmstepd-(?P<host>[A-Za-z0-9][\w.-]*): ", needs_unknown="host",
                   ends=True),
    # NCCL's "host:pid:tid [dev] ".
    LauncherPrefix("nccl", ("alpha",), r"(?P<host>[\w.-]+):(?P<pid>\d+):\d+ \[(?P<local_rank>\d+)\] ",
                   fill=frozenset({"host", "local_rank"})),
    LauncherPrefix("task stream", ("alpha",), r"(?P<host>[A-Za-z][\w.-]*):(?P<rank>\d+) (?P<stream>out|err): ?",
                   fill=frozenset({"host", "rank"})),
    LauncherPrefix("pdsh host", ("alpha",), rf"{_HOST_NAME}: ", fill=frozenset({"host"})),
    # A pasted terminal session names its host once, in the prompt.
    LauncherPrefix("shell prompt", ("alpha",), r"(?:\([\w.-]+\) )?[\w.-]+@(?P<session_host>[\w.-]+)[: ][^\n]{0,80}?[%$#] ",
                   ends=True, guard="@"),
)

# --- the prefix-shape cache ------------------------------------------------------------------------
# Which prefixes a line has, where they end and where their fields sit depends on its characters but
# not on which digit is where: no pattern above names a digit, they only count them (\d, \w, [a-z0-9]).
# So lines that are equal once every ASCII digit is read as 0 peel the same way, at the same offsets,
# and the work of matching is done once per such shape; each line only converts its own field values.
# (Values can still differ in ways that matter, e.g. an impossible date, a rank too long for int(): the
# replay converts them exactly as the single-line code did, in the same order.)
_ZERO_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_PLAN_CACHE_SIZE = 8192  # shapes remembered; the cache starts over when full (memory stays bounded: < 10 MB)
_PLAN_MAX_BYTES = 1024  # longer lines (rare) are peeled without the cache
_SECOND_CACHE_SIZE = 4096
_MAX_BOOTS = 4096  # hosts whose boot time is remembered

# Plan steps: a tuple whose first item says which field the spans (offsets into the line) after it give.
# One kind per field, whatever prefix gave it: a prefix of a new shape is a new row, not a new kind.
_F_RANK = 0  # (kind, start, end)
_F_HOST = 1  # (kind, start, end)
_F_LOCAL = 2  # (kind, start, end)
_F_PID = 3  # (kind, start, end)
_F_STREAM = 4  # (kind, "stdout" | "stderr")
_F_SRUN = 5  # (kind, start, end): the rank, unless srun's labels number nodes
_F_NESTED = 6  # (kind,): a task label and a rank prefix on one line: task labels are nodes, not ranks
_F_SESSION_HOST = 7  # (kind, start, end)
_F_ISO = 8  # (kind, ymdhm_start, ss_start, frac_start, frac_end, tz_start, tz_end); frac/tz -1 when absent
_F_CTIME = 9  # (kind, month, day_s, day_e, hh_s, mm_s, ss_s, year_s)
_F_SYSLOG = 10  # (kind, month, day_s, day_e, hh_s, mm_s, ss_s): no year
_F_INNER_ISO = 11  # like _F_ISO, a stamp inside the message (does not set the year)
_F_GLOG = 12  # (kind, mon_s, mon_e, day_s, hh_s, mm_s, ss_s, frac_s, frac_e)
_F_BOOT = 13  # (kind, start, end): the kernel's seconds since boot

_SIMPLE_FIELDS = {"rank": _F_RANK, "host": _F_HOST, "local_rank": _F_LOCAL, "pid": _F_PID, "srun": _F_SRUN,
                  "session_host": _F_SESSION_HOST, "boot_s": _F_BOOT}
_KNOWN_AS = {"srun": "rank", "session_host": "host"}  # a field of these groups counts as this one given
_STREAMS = {"out": "stdout", "err": "stderr", "stdout": "stdout", "stderr": "stderr"}


_CHARACTER_CLASSES = {"digit": str.isdigit, "alpha": str.isalpha, "upper": str.isupper}


@dataclass(frozen=True, slots=True)
class _CompiledPrefix:
    row: LauncherPrefix
    regex: re.Pattern[str]
    chars: str  # the literal characters of `starts`
    classes: tuple[Callable[[str], bool], ...]  # its character classes
    fields: tuple[tuple[str, str], ...]  # (group, the field it gives: "rank", ..., or a stamp's kind)

    def may_start(self, c: str) -> bool:
        return c in self.chars or any(test(c) for test in self.classes)


def _compile_prefix(row: LauncherPrefix) -> _CompiledPrefix:
    regex = re.compile(row.pattern)
    groups = set(regex.groupindex)
    unknown = groups - set(_SIMPLE_FIELDS) - {"stream", *_STAMP_GROUPS}
    if unknown:
        raise ValueError(f"launcher prefix {row.name!r}: unknown field group(s) {sorted(unknown)}")
    # In the pattern's order: the replay converts them in it (a value int() refuses ends the replay there).
    firsts = {first: kind for kind, (first, *_) in _STAMP_GROUPS_BY_KIND.items()}
    fields = [(g, firsts.get(g, g)) for g in regex.groupindex if g in _SIMPLE_FIELDS or g == "stream" or g in firsts]
    return _CompiledPrefix(row, regex, "".join(s for s in row.starts if s not in _CHARACTER_CLASSES),
                           tuple(_CHARACTER_CLASSES[s] for s in row.starts if s in _CHARACTER_CLASSES),
                           tuple(fields))


_STAMP_GROUPS_BY_KIND = {
    "iso": ("ymdhm", "ss", "frac", "tz"),
    "ctime": ("c_mon", "c_day", "c_hh", "c_mm", "c_ss", "c_year"),
    "syslog": ("s_mon", "s_day", "s_hh", "s_mm", "s_ss"),
}
_STAMP_GROUPS = {g for groups in _STAMP_GROUPS_BY_KIND.values() for g in groups}
_PREFIXES = tuple(_compile_prefix(row) for row in LAUNCHER_PREFIXES)


@dataclass(slots=True)
class Source:
    """What the transport already knows about a line (HTTP headers, NDJSON fields), and who says so: the hosts
    its sender may speak for (`scope`; None: the reader's own files, every host)."""

    rank: int | None = None
    host: str | None = None
    ts: float | None = None
    stream: str | None = None
    scope: HostScope | None = None


def sanitize(raw: bytes | str, max_bytes: int = DEFAULT_MAX_LINE_BYTES) -> tuple[str, bool]:
    """Decode and clean one line; returns (text, truncated)."""
    truncated = False
    if isinstance(raw, str):
        if len(raw) > max_bytes:
            raw, truncated = raw[:max_bytes], True
        text = raw
    else:
        if len(raw) > max_bytes:
            raw, truncated = raw[:max_bytes], True
        text = raw.decode("utf-8", errors="replace")
    text = text.rstrip("\r\n")
    if "\x00" in text:
        text = text.replace("\x00", "")
    if "\r" in text:
        # A progress bar redraws with CR: what a terminal would show is the last segment.
        segments = [s for s in text.split("\r") if s.strip()]
        text = segments[-1] if segments else ""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if truncated:
        text += " …[truncated]"
    return text, truncated


class Normalizer:
    """Turns raw lines into Records, numbering them and remembering context across lines."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self.line_no = 0
        self.truncated = 0
        self.bytes_in = 0
        # Stamps without a year (syslog "Nov 13", glog "W1113") take the year that puts them nearest the
        # last full stamp seen, so a log that crosses New Year does not jump a year. Before any, the year is
        # not known (a log of 2024 read in 2026 is not of 2026) and such stamps give no time, unless the
        # reader knows it (`hint_year`: a live stream's is this year's; a file's, the year it was written).
        now = datetime.now(UTC)
        self._year, self._month = now.year, now.month
        self._year_known = False
        # A pasted terminal session names its host once, in the prompt.
        self._session_host: str | None = None
        self._srun_labels_nodes = False
        self.srun_labels_ranks = False  # srun's labels gave lines their rank
        # line with its digits read as 0 -> how to peel it (see _plan)
        self._plans: dict[bytes, tuple[tuple[tuple, ...], int]] = {}
        self._cache_limit = min(max_line_bytes, _PLAN_MAX_BYTES)
        # "YYYY-MM-DD HH:MM:SS" -> (year, its epoch seconds): see _iso
        self._seconds: dict[str, tuple[int, float]] = {}
        # host ("" when none) -> when it booted, from a line with both a wall clock and a boot clock
        self._boots: dict[str, float] = {}
        self._boot_s: float | None = None  # the boot clock of the line being read

    @property
    def srun_tasks_are_ranks(self) -> bool:
        """srun's labels number the job's ranks (`srun -l python train.py`), not its nodes (`srun -l torchrun`)."""
        return self.srun_labels_ranks and not self._srun_labels_nodes

    @property
    def year_known(self) -> bool:
        """A stamp (or `hint_year`) has said the year the log's stamps without one belong to."""
        return self._year_known

    @property
    def year(self) -> tuple[int, int]:
        """(year, month) of the last stamp that said them."""
        return self._year, self._month

    def hint_year(self, year: int, month: int) -> None:
        """The year the log's first stamps without one (glog's "W0114 23:52:06") belong to, when a reader
        that looked ahead knows it: otherwise they take today's until a full stamp says otherwise."""
        self._year, self._month = year, month
        self._year_known = True

    def absorb(self, other: Normalizer) -> None:
        """What another normaliser read counts as read here: the bytes and what srun's labels were (a job's files,
        each read by its own normaliser, fed to one session; its records' lines and truncations are counted as
        they are fed)."""
        self.bytes_in += other.bytes_in
        self.srun_labels_ranks = self.srun_labels_ranks or other.srun_labels_ranks
        self._srun_labels_nodes = self._srun_labels_nodes or other._srun_labels_nodes

    def normalize(self, raw: bytes | str, source: Source | None = None) -> Record:
        self.line_no += 1
        self.bytes_in += len(raw) + 1
        plan = key = None
        truncated = False
        if raw.__class__ is bytes and len(raw) <= self._cache_limit:
            key = raw.translate(_ZERO_DIGITS)
            plan = self._plans.get(key)
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if plan is None and ("\x00" in line or "\r" in line or "\x1b" in line):
                line, truncated = sanitize(line, self.max_line_bytes)  # what sanitize(raw) gives; not cached
                key = None
        else:
            line, truncated = sanitize(raw, self.max_line_bytes)
        if truncated:
            self.truncated += 1
        rec = Record(self.line_no, line, line, None, None, None, None, None, truncated)
        try:
            if plan is None:
                plan = self._plan(line)
                if key is not None:
                    if len(self._plans) >= _PLAN_CACHE_SIZE:
                        self._plans.clear()
                    self._plans[key] = plan
            self._replay(rec, line, plan)
        except Exception:  # noqa: BLE001 - a strange line must never stop the stream
            rec.text = line
        if source is not None:
            _apply_source(rec, source)
        if rec.host is None and self._session_host is not None:
            rec.host = self._session_host
        if self._boot_s is not None:
            self._place_boot_clock(rec, self._boot_s)
            self._boot_s = None
        return rec

    def _place_boot_clock(self, rec: Record, boot_s: float) -> None:
        """A kernel line stamped in seconds since boot. With a wall-clock stamp too (kern.log's
        "Nov 13 10:00:01 node-3 kernel: [1234.5] ..."), it says when its host booted; without one, it
        takes its time from that boot, or stays unanchored: a boot clock is no wall clock (the same
        second of two nodes, or of one node before and after a reboot, are different times)."""
        where = rec.host or ""
        if rec.ts:
            if len(self._boots) < _MAX_BOOTS or where in self._boots:
                self._boots[where] = rec.ts - boot_s
            return
        booted = self._boots.get(where)
        if booted is not None:
            rec.ts = booted + boot_s
        else:
            rec.unanchored = True

    # -- applying a plan: per line -----------------------------------------------------------------

    def _replay(self, rec: Record, line: str, plan: tuple[tuple[tuple, ...], int]) -> None:
        """Set the record's fields from this line's values at the offsets the plan names, in the order
        the prefixes were peeled (a later stamp does not replace an earlier one, `rec.ts or ...`)."""
        steps, text_at = plan
        for step in steps:
            kind = step[0]
            if kind == _F_RANK:
                rec.rank = int(line[step[1]:step[2]])
            elif kind == _F_INNER_ISO:  # the commonest stamps first, without a call more
                rec.ts = self._iso(line, step, not self._year_known)
            elif kind == _F_ISO and not rec.ts:
                rec.ts = self._iso(line, step, True)
            elif kind == _F_HOST:
                rec.host = line[step[1]:step[2]]
            elif kind == _F_LOCAL:
                rec.local_rank = int(line[step[1]:step[2]])
            elif kind == _F_STREAM:
                rec.stream = step[1]
            elif kind == _F_PID:
                rec.pid = int(line[step[1]:step[2]])
            elif kind == _F_SRUN:
                if not self._srun_labels_nodes:
                    rec.rank = int(line[step[1]:step[2]])
                    self.srun_labels_ranks = True
            elif kind == _F_NESTED:
                # `srun -l torchrun ...`: "5: [rank44]: ..." - srun's label numbers the node's task, so
                # on the agent's own lines ("5: Sending process ...") it is no rank either.
                self._srun_labels_nodes = True
            elif kind == _F_SESSION_HOST:
                self._session_host = rec.host = line[step[1]:step[2]]
            elif kind == _F_BOOT:
                self._boot_s = float(line[step[1]:step[2]])
            else:
                self._stamp(rec, line, step)
        rec.text = line[text_at:] if text_at else line

    def _stamp(self, rec: Record, line: str, step: tuple) -> None:
        """A timestamp step the replay does not take itself: a line's first ctime or syslog stamp sets its
        time (a ctime one, like an ISO one, also the year of later year-less stamps), a glog stamp in the
        message its time, and an ISO stamp after the line's time only the year."""
        kind = step[0]
        if kind == _F_ISO:  # a second ISO stamp (the first is the replay's): it sets the year only
            self._year, self._month = int(line[step[1]:step[1] + 4]), int(line[step[1] + 5:step[1] + 7])
            self._year_known = True
        elif kind == _F_CTIME:
            if not rec.ts:
                _, month, d0, d1, hh, mm, ss, yy = step
                self._year, self._month = int(line[yy:yy + 4]), month
                self._year_known = True
                rec.ts = _mk_ts(self._year, month, int(line[d0:d1]), int(line[hh:hh + 2]),
                                int(line[mm:mm + 2]), int(line[ss:ss + 2]))
        elif not self._year_known:
            return  # a stamp without a year, and no line has said which: its time is not known (yet)
        elif kind == _F_SYSLOG:
            if not rec.ts:
                _, month, d0, d1, hh, mm, ss = step
                rec.ts = _mk_ts(self._year_of(month), month, int(line[d0:d1]), int(line[hh:hh + 2]),
                                int(line[mm:mm + 2]), int(line[ss:ss + 2]))
        else:  # _F_GLOG
            _, mo0, mo1, d0, hh, mm, ss, f0, f1 = step
            try:
                month = int(line[mo0:mo1])
                rec.ts = _mk_ts(self._year_of(month), month, int(line[d0:d0 + 2]), int(line[hh:hh + 2]),
                                int(line[mm:mm + 2]), int(line[ss:ss + 2])) + float("0." + line[f0:f1])
            except ValueError:
                rec.ts = None

    def _year_of(self, month: int) -> int:
        """The year of a year-less stamp in `month`: the one nearest the last full stamp."""
        if month - self._month > 6:
            return self._year - 1  # "Dec 31" read just after a "2025-01-01" stamp
        if self._month - month > 6:
            return self._year + 1
        return self._year

    def _iso(self, line: str, step: tuple, sets_year: bool) -> float:
        """The epoch seconds of an ISO stamp (as the single-line code computed them: the whole
        seconds from calendar.timegm, or 0.0 for an impossible date, then the fraction, then the zone),
        through a per-second cache: the ranks of a job write many lines in the same second."""
        _, at, ss, f0, f1, z0, z1 = step
        key = line[at:ss + 2]  # YYYY-MM-DD HH:MM:SS
        hit = self._seconds.get(key)
        if hit is None:
            year = int(key[0:4])
            try:
                whole = float(calendar.timegm((year, int(key[5:7]), int(key[8:10]), int(key[11:13]), int(key[14:16]),
                                               int(line[ss:ss + 2]), 0, 0, 0)))
            except (ValueError, OverflowError):
                whole = 0.0  # as _mk_ts
            if len(self._seconds) >= _SECOND_CACHE_SIZE:
                self._seconds.clear()
            hit = self._seconds[key] = (year, whole)
        if sets_year:
            self._year, self._month = hit[0], int(key[5:7])
            self._year_known = True
        ts = hit[1]
        if f0 >= 0:
            ts += float("0." + line[f0:f1])
        if z0 >= 0 and line[z0] != "Z":
            sign = 1 if line[z0] == "+" else -1
            digits = line[z0 + 1:z1].replace(":", "")
            ts -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        return ts

    # -- making a plan: once per shape -------------------------------------------------------------

    def _plan(self, line: str) -> tuple[tuple[tuple, ...], int]:
        """Peel the prefixes off one line, recording what each gave and where, not yet converting values.

        Prefixes come off in any order until none applies: launchers nest (srun around torchrun).
        Whether a field is already known when a later prefix names it again is part of the shape
        (a prefix either sets it or not), so it is decided here; a timestamp is the exception (an
        impossible date gives 0.0, and a later stamp may then replace it), so it is left to the replay.
        """
        steps: list[tuple] = []
        text, at = line, 0
        known: set[str] = set()  # the fields the steps so far gave ("ts" for any stamp)
        nests = False
        for _ in range(8):
            found = _peel(text, known) if text else None
            if found is None:
                break
            prefix, m = found
            steps.extend(_field_steps(prefix, m, at, known))
            nests = nests or prefix.row.nests
            if prefix.row.ends:
                break
            end = m.end()
            text, at = text[end:], at + end
        if text.startswith("slurmstepd"):
            # srun labels what its step daemon says with a task of the node it runs on: the daemon is no rank.
            steps = [step for step in steps if step[0] != _F_SRUN]
            known.discard("rank")
        steps.extend(_message_steps(text, at, "ts" in known, "rank" in known))
        if nests and any(step[0] == _F_SRUN for step in steps):
            steps.insert(0, (_F_NESTED,))
        return tuple(steps), at


def _peel(text: str, known: set[str]) -> tuple[_CompiledPrefix, re.Match[str]] | None:
    """The first prefix of the table the text starts with (None: the message starts here)."""
    c = text[0]
    for prefix in _PREFIXES:
        row = prefix.row
        if not prefix.may_start(c) or (row.needs_unknown and row.needs_unknown in known):
            continue
        if row.guard and text.find(row.guard, 0, 64) < 0:
            continue
        m = prefix.regex.match(text)
        if m is not None:
            return prefix, m
    return None


def _field_steps(prefix: _CompiledPrefix, m: re.Match[str], at: int, known: set[str]) -> list[tuple]:
    """The plan steps of one peeled prefix: a field it fills that an earlier prefix gave is left out."""
    steps: list[tuple] = []
    for group, field_name in prefix.fields:
        if field_name in _STAMP_GROUPS_BY_KIND:
            steps.append(_stamp_step(field_name, m, at))
            known.add("ts")
            continue
        start, end = m.span(group)
        given = _KNOWN_AS.get(field_name, field_name)
        if start < 0 or (field_name in prefix.row.fill and given in known):
            continue
        known.add(given)
        if field_name == "stream":
            steps.append((_F_STREAM, _STREAMS[m.group(group)]))
        else:
            steps.append((_SIMPLE_FIELDS[field_name], at + start, at + end))
    return steps


def _stamp_step(kind: str, m: re.Match[str], at: int) -> tuple:
    if kind == "iso":
        return _iso_step(_F_ISO, m, at)
    p = "c_" if kind == "ctime" else "s_"
    month = _MONTHS.get(m.group(p + "mon"), 1)
    offsets = (at + m.start(p + "day"), at + m.end(p + "day"), at + m.start(p + "hh"), at + m.start(p + "mm"),
               at + m.start(p + "ss"))
    if kind == "ctime":
        return (_F_CTIME, month, *offsets, at + m.start("c_year"))
    return (_F_SYSLOG, month, *offsets)


def _message_steps(text: str, at: int, has_ts: bool, has_rank: bool) -> list[tuple]:
    """What the message itself says when no prefix did: a stamp (glog/c10 `[E817 17:40:34.22]`, logging
    `2024-...`), the rank c10d names ("[PG 0 (default_pg) Rank 12] ...")."""
    steps: list[tuple] = []
    if not has_ts:
        m = _ISO.search(text, 0, 96) if text.find("-", 0, 96) >= 0 else None
        if m:
            steps.append(_iso_step(_F_INNER_ISO, m, at))
        elif text and text[0] in "[IWEF" and (m := _GLOG.match(text, 0, 96)):
            steps.append((_F_GLOG, at + m.start(2), at + m.end(2), at + m.start(3), at + m.start(4), at + m.start(5),
                          at + m.start(6), at + m.start(7), at + m.end(7)))
    if not has_rank and text.find("Rank ", 0, 160) >= 0:
        m = _MESSAGE_RANK.search(text, 0, 160)
        if m:
            steps.append((_F_RANK, at + m.start(1), at + m.end(1)))
    return steps


def _iso_step(op: int, m: re.Match[str], at: int) -> tuple:
    frac, tz = m.span("frac"), m.span("tz")  # (-1, -1) when absent
    return (op, at + m.start("ymdhm"), at + m.start("ss"), frac[0] + at if frac[0] >= 0 else -1, frac[1] + at,
            tz[0] + at if tz[0] >= 0 else -1, tz[1] + at)


def _apply_source(rec: Record, source: Source) -> None:
    if rec.rank is None:
        rec.rank = source.rank
    if rec.host is None:
        rec.host = source.host
    if rec.ts is None:
        rec.ts = source.ts
    if rec.stream is None:
        rec.stream = source.stream


def _mk_ts(year: int, month: int, day: int, hh: int, mm: int, ss: int) -> float:
    try:
        return float(calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0)))
    except (ValueError, OverflowError):
        return 0.0


# --- reading ---------------------------------------------------------------------------------------


class InputError(Exception):
    """The input cannot be read at all (missing file, a directory, permission denied)."""


def open_input(path: str | Path) -> BinaryIO:
    """Open a file, `-` for stdin, transparently gunzipping `.gz` (detected by magic bytes)."""
    if str(path) == "-":
        stream: BinaryIO = sys.stdin.buffer
        # typeshed's BinaryIO has no readinto, which BufferedReader wants (stdin's buffer has it)
        return _maybe_gunzip(io.BufferedReader(stream, _READ_CHUNK)  # type: ignore[type-var]
                             if not hasattr(stream, "peek") else stream)
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p} is a directory, not a log file")
    try:
        f = open(p, "rb", buffering=_READ_CHUNK)  # noqa: SIM115 - returned to the caller
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except PermissionError:
        raise InputError(f"{p}: permission denied") from None
    except OSError as e:
        raise InputError(f"{p}: {e.strerror or e}") from None
    return _maybe_gunzip(f)


def _maybe_gunzip(f: BinaryIO) -> BinaryIO:
    head = f.peek(2)[:2] if hasattr(f, "peek") else b""
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f)  # type: ignore[return-value]
    return f


def iter_lines(f: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[bytes]:
    """Yield lines in bounded memory: a line longer than the limit is cut and the rest skipped."""
    readline = f.readline
    while True:
        line = readline(max_line_bytes + 1)
        if not line:
            return
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            # Skip the remainder of the over-long line without holding it; mark it as truncated
            # by yielding one byte more than the limit.
            while True:
                rest = readline(_READ_CHUNK)
                if not rest or rest.endswith(b"\n"):
                    break
        yield line
