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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from logdx.model import Record

DEFAULT_MAX_LINE_BYTES = 64 * 1024
_READ_CHUNK = 1 << 20

_ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

# --- launcher / transport prefixes -------------------------------------------------------------
# Pattern bodies; the families further down join them.
_TORCHRUN_LOCAL = r"\[default(?P<local>\d+)\]:"
_TORCHRUN_RANK = r"\[[Rr]ank\s?(?P<rank>\d+)\]:\s?"
_MPI_TAG = r"\[\d+,(?P<mpi_rank>\d+)\]<(?P<mpi_stream>stdout|stderr)>:\s?"
_SRUN_LABEL = r"\s{0,4}(?P<label>\d{1,6}): "
_TASK_STREAM = r"(?P<t_host>[A-Za-z][\w.-]*):(?P<t_rank>\d+) (?P<t_stream>out|err): ?"
# A host prefix must look like a machine name (lower case, a digit somewhere) so that
# "RuntimeError: ..." or "Epoch 3: ..." are never taken for one.
_HOST_PREFIX = r"(?P<p_host>[a-z][a-z0-9-]*\d[a-z0-9.-]*|localhost): "
_NCCL = r"(?P<n_host>[\w.-]+):(?P<n_pid>\d+):\d+ \[(?P<n_dev>\d+)\] "
# Ray prefixes each worker's output with its actor and process: "(pid=1521961) ", "(RayTrainWorker
# pid=2345, ip=10.0.0.12) ".
_RAY_PREFIX = re.compile(r"\((?:[\w.:]+ )?pid=(?P<pid>\d+)(?:, ip=(?P<ip>[\d.]+))?\) ")
# Slurm's step daemon names its node in its own name on some sites ("slurmstepd-nid001234: error: ...").
_SLURMSTEPD_HOST = re.compile(r"slurmstepd-(?P<host>[A-Za-z0-9][\w.-]*): ")
_SHELL_PROMPT = re.compile(r"(?:\([\w.-]+\) )?[\w.-]+@([\w.-]+)[: ][^\n]{0,80}?[%$#] ")

_MESSAGE_RANK = re.compile(r"\[(?:PG \d+ (?:\([^)]*\) )?)?Rank (\d+)\]")

# --- timestamps ----------------------------------------------------------------------------------
# YYYY-MM-DD[T ]HH:MM (the minute: a cache key), :SS, fraction, zone.
_ISO_BODY = (
    r"\[?(?P<ymdhm>\d{4}-\d\d-\d\d[T ]\d\d:\d\d):(?P<ss>\d\d)(?:[.,](?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d\d:?\d\d)?\]?:?\s*"
)
_ISO = re.compile(_ISO_BODY)
_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}
_CTIME = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\s?")
_SYSLOG = re.compile(r"([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) ([\w.-]+) ")
_SYSLOG_PROGRAM = re.compile(r"[\w./-]+(?:\[\d+\])?: ")  # "kernel: [12345.678] NVRM: ..." / "sshd[123]: ..."
_DMESG_CTIME = (r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<c_mon>[A-Z][a-z]{2}) +(?P<c_day>\d{1,2}) (?P<c_hh>\d\d)"
                r":(?P<c_mm>\d\d):(?P<c_ss>\d\d) (?P<c_year>\d{4})\] ")
_DMESG_REL = r"\[\s*[+]?\d+\.\d+\] "
_GLOG = re.compile(r"\[?([IWEF])(\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")

# --- one regex per peeling step ------------------------------------------------------------------
# The prefixes a line can start with, grouped by the first character they allow, each family ONE
# alternation in the order its patterns are tried (at a fixed position an alternation takes the first
# alternative that matches, as trying them one by one would). An empty named group closes each
# alternative, so `m.lastgroup` names the one that matched.
_BRACKET_PREFIX = re.compile(
    f"{_TORCHRUN_LOCAL}(?P<b_local>)|{_TORCHRUN_RANK}(?P<b_rank>)|{_MPI_TAG}(?P<b_mpi>)"
    f"|{_DMESG_CTIME}(?P<b_dmesg>)|{_DMESG_REL}(?P<b_rel>)|{_ISO_BODY}(?P<b_iso>)"
)
_DIGIT_PREFIX = re.compile(f"{_ISO_BODY}(?P<d_iso>)|{_SRUN_LABEL}(?P<d_srun>)")
_SPACE_PREFIX = re.compile(_SRUN_LABEL)
_HOSTLIKE_PREFIX = re.compile(f"{_NCCL}(?P<h_nccl>)|{_TASK_STREAM}(?P<h_task>)|{_HOST_PREFIX}(?P<h_host>)")

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

# Plan steps: a tuple whose first item says what to do with the spans (offsets into the line) after it.
_P_RANK = 0  # (op, start, end): rec.rank = int(...)              [rank], srun label
_P_ISO = 1  # (op, ymdhm_start, ss_start, frac_start, frac_end, tz_start, tz_end); frac/tz -1 when absent
_P_LOCAL = 2  # (op, start, end): rec.local_rank
_P_MPI = 3  # (op, start, end, stream)
_P_HOST = 4  # (op, host_start, host_end)                          pdsh "node-3: "
_P_NCCL = 5  # (op, host_start, host_end, pid_start, pid_end, dev_start, dev_end); host/dev -1 when already known
_P_TASK = 6  # (op, host_start, host_end, rank_start, rank_end, stream); host/rank -1 when already known
_P_CTIME = 7  # (op, month, day_s, day_e, hh_s, mm_s, ss_s, year_s): ctime / dmesg -T stamp
_P_SYSLOG = 8  # (op, month, day_s, day_e, hh_s, mm_s, ss_s, host_s, host_e); host_s -1 when already known
_P_SHELL = 9  # (op, host_start, host_end): a shell prompt names the session's host
_P_INNER_ISO = 10  # like _P_ISO, for a stamp inside the message (does not set the year)
_P_GLOG = 11  # (op, mon_s, mon_e, day_s, hh_s, mm_s, ss_s, frac_s, frac_e)
_P_MESSAGE_RANK = 12  # (op, start, end)
_P_SRUN = 13  # (op, start, end): srun -l's task label: the rank, unless srun runs one task per node
_P_NESTED = 14  # (op,): this line has a task label and a rank prefix: task labels are nodes, not ranks
_P_RAY = 15  # (op, pid_start, pid_end, ip_start, ip_end): a Ray worker's prefix; ip -1 when absent or known


@dataclass(slots=True)
class Source:
    """What the transport already knows about a line (HTTP headers, NDJSON fields)."""

    rank: int | None = None
    host: str | None = None
    ts: float | None = None
    stream: str | None = None


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
        # last full stamp seen (before any: today), so a log that crosses New Year does not jump a year.
        now = datetime.now(timezone.utc)
        self._year, self._month = now.year, now.month
        # A pasted terminal session names its host once, in the prompt.
        self._session_host: str | None = None
        self._srun_labels_nodes = False
        # line with its digits read as 0 -> how to peel it (see _plan)
        self._plans: dict[bytes, tuple[tuple[tuple, ...], int]] = {}
        self._cache_limit = min(max_line_bytes, _PLAN_MAX_BYTES)
        # "YYYY-MM-DD HH:MM:SS" -> (year, its epoch seconds): see _iso
        self._seconds: dict[str, tuple[int, float]] = {}

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
        return rec

    # -- applying a plan: per line -----------------------------------------------------------------

    def _replay(self, rec: Record, line: str, plan: tuple[tuple[tuple, ...], int]) -> None:
        """Set the record's fields from this line's values at the offsets the plan names, in the order
        the prefixes were peeled (a later stamp does not replace an earlier one, `rec.ts or ...`)."""
        steps, text_at = plan
        for step in steps:
            op = step[0]
            if op == _P_RANK:
                rec.rank = int(line[step[1]:step[2]])
            elif op == _P_SRUN:
                if not self._srun_labels_nodes:
                    rec.rank = int(line[step[1]:step[2]])
            elif op == _P_NESTED:
                # `srun -l torchrun ...`: "5: [rank44]: ..." - srun's label numbers the node's task, so
                # on the agent's own lines ("5: Sending process ...") it is no rank either.
                self._srun_labels_nodes = True
            elif op == _P_ISO:
                if not rec.ts:
                    rec.ts = self._iso(line, step, True)
                else:
                    self._year, self._month = int(line[step[1]:step[1] + 4]), int(line[step[1] + 5:step[1] + 7])
            elif op == _P_LOCAL:
                rec.local_rank = int(line[step[1]:step[2]])
            elif op == _P_HOST:
                rec.host = line[step[1]:step[2]]
            elif op == _P_NCCL:
                if step[1] >= 0:
                    rec.host = line[step[1]:step[2]]
                rec.pid = int(line[step[3]:step[4]])
                if step[5] >= 0:
                    rec.local_rank = int(line[step[5]:step[6]])
            elif op == _P_MPI:
                rec.rank = int(line[step[1]:step[2]])
                rec.stream = step[3]
            elif op == _P_TASK:
                if step[1] >= 0:
                    rec.host = line[step[1]:step[2]]
                if step[3] >= 0:
                    rec.rank = int(line[step[3]:step[4]])
                rec.stream = step[5]
            elif op == _P_CTIME:
                if not rec.ts:
                    _, month, d0, d1, hh, mm, ss, yy = step
                    self._year, self._month = int(line[yy:yy + 4]), month
                    rec.ts = _mk_ts(self._year, month, int(line[d0:d1]), int(line[hh:hh + 2]),
                                    int(line[mm:mm + 2]), int(line[ss:ss + 2]))
            elif op == _P_SYSLOG:
                _, month, d0, d1, hh, mm, ss, h0, h1 = step
                if not rec.ts:
                    rec.ts = _mk_ts(self._year_of(month), month, int(line[d0:d1]), int(line[hh:hh + 2]), int(line[mm:mm + 2]),
                                    int(line[ss:ss + 2]))
                if h0 >= 0:
                    rec.host = line[h0:h1]
            elif op == _P_SHELL:
                self._session_host = rec.host = line[step[1]:step[2]]
            elif op == _P_INNER_ISO:
                rec.ts = self._iso(line, step, False)
            elif op == _P_GLOG:
                _, mo0, mo1, d0, hh, mm, ss, f0, f1 = step
                try:
                    month = int(line[mo0:mo1])
                    rec.ts = _mk_ts(self._year_of(month), month, int(line[d0:d0 + 2]), int(line[hh:hh + 2]),
                                    int(line[mm:mm + 2]), int(line[ss:ss + 2])) + float("0." + line[f0:f1])
                except ValueError:
                    rec.ts = None
            elif op == _P_RAY:
                rec.pid = int(line[step[1]:step[2]])
                if step[3] >= 0:
                    rec.host = line[step[3]:step[4]]
            else:  # _P_MESSAGE_RANK
                rec.rank = int(line[step[1]:step[2]])
        rec.text = line[text_at:] if text_at else line

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
        rank = local = host = ts = False  # which fields the steps so far set
        for _ in range(8):
            if not text:
                break
            c = text[0]
            if c == "[":
                m = _BRACKET_PREFIX.match(text)
                if m is None:
                    break
                kind = m.lastgroup
                if kind == "b_rank":
                    steps.append((_P_RANK, at + m.start("rank"), at + m.end("rank")))
                    rank = True
                elif kind == "b_iso":
                    steps.append(_iso_step(_P_ISO, m, at))
                    ts = True
                elif kind == "b_local":
                    steps.append((_P_LOCAL, at + m.start("local"), at + m.end("local")))
                    local = True
                elif kind == "b_mpi":
                    steps.append((_P_MPI, at + m.start("mpi_rank"), at + m.end("mpi_rank"), m.group("mpi_stream")))
                    rank = True
                elif kind == "b_dmesg":
                    steps.append((_P_CTIME, _MONTHS.get(m.group("c_mon"), 1), at + m.start("c_day"), at + m.end("c_day"),
                                  at + m.start("c_hh"), at + m.start("c_mm"), at + m.start("c_ss"),
                                  at + m.start("c_year")))
                    ts = True
                # b_rel: a relative kernel stamp ("[  123.456] "), dropped
            elif c.isdigit():
                m = _DIGIT_PREFIX.match(text)
                if m is None:
                    break
                if m.lastgroup == "d_iso":
                    steps.append(_iso_step(_P_ISO, m, at))
                    ts = True
                elif not rank:
                    steps.append((_P_SRUN, at + m.start("label"), at + m.end("label")))
                    rank = True
                else:
                    break
            elif c == " ":
                if rank:
                    break
                m = _SPACE_PREFIX.match(text)
                if m is None:
                    break
                steps.append((_P_SRUN, at + m.start("label"), at + m.end("label")))
                rank = True
            elif c in "MTWFS" and (m := _CTIME.match(text)):
                steps.append((_P_CTIME, _MONTHS.get(m.group(1), 1), at + m.start(2), at + m.end(2), at + m.start(3),
                              at + m.start(4), at + m.start(5), at + m.start(6)))
                ts = True
            elif c.isupper() and (m := _SYSLOG.match(text)) and m.group(1) in _MONTHS:
                steps.append((_P_SYSLOG, _MONTHS[m.group(1)], at + m.start(2), at + m.end(2), at + m.start(3),
                              at + m.start(4), at + m.start(5), -1 if host else at + m.start(6), at + m.end(6)))
                ts = host = True
                end = m.end()
                km = _SYSLOG_PROGRAM.match(text, end)  # the program after the host: "kernel: ", "sshd[123]: "
                if km:
                    end = km.end()
                text, at = text[end:], at + end
                continue
            elif c == "(" and (m := _RAY_PREFIX.match(text)):
                ip = m.span("ip")
                steps.append((_P_RAY, at + m.start("pid"), at + m.end("pid"),
                              at + ip[0] if ip[0] >= 0 and not host else -1, at + ip[1]))
                host = host or ip[0] >= 0
            elif c == "s" and not host and (m := _SLURMSTEPD_HOST.match(text)):
                # The host is in the daemon's name; the message keeps "slurmstepd-...:" for the rules.
                steps.append((_P_HOST, at + m.start("host"), at + m.end("host")))
                host = True
                break
            elif c.isalpha():
                m = _HOSTLIKE_PREFIX.match(text)
                if m is None:
                    if text.find("@", 0, 64) >= 0 and (m := _SHELL_PROMPT.match(text)):
                        steps.append((_P_SHELL, at + m.start(1), at + m.end(1)))
                        host = True
                    break
                kind = m.lastgroup
                if kind == "h_nccl":
                    steps.append((_P_NCCL, -1 if host else at + m.start("n_host"), at + m.end("n_host"),
                                  at + m.start("n_pid"), at + m.end("n_pid"),
                                  -1 if local else at + m.start("n_dev"), at + m.end("n_dev")))
                    host = local = True
                elif kind == "h_task":
                    steps.append((_P_TASK, -1 if host else at + m.start("t_host"), at + m.end("t_host"),
                                  -1 if rank else at + m.start("t_rank"), at + m.end("t_rank"),
                                  "stdout" if m.group("t_stream") == "out" else "stderr"))
                    host = rank = True
                else:
                    if not host:
                        steps.append((_P_HOST, at + m.start("p_host"), at + m.end("p_host")))
                    host = True
            else:
                break
            end = m.end()
            text, at = text[end:], at + end
        if not ts:
            # A stamp inside the message: glog/c10 `[E817 17:40:34.22]`, logging `2024-...`.
            m = _ISO.search(text, 0, 96) if text.find("-", 0, 96) >= 0 else None
            if m:
                steps.append(_iso_step(_P_INNER_ISO, m, at))
            elif text and text[0] in "[IWEF" and (m := _GLOG.match(text, 0, 96)):
                steps.append((_P_GLOG, at + m.start(2), at + m.end(2), at + m.start(3), at + m.start(4), at + m.start(5),
                              at + m.start(6), at + m.start(7), at + m.end(7)))
        if not rank and text.find("Rank ", 0, 160) >= 0:
            # c10d names the rank inside the message: "[PG 0 (default_pg) Rank 12] ..."
            m = _MESSAGE_RANK.search(text, 0, 160)
            if m:
                steps.append((_P_MESSAGE_RANK, at + m.start(1), at + m.end(1)))
        ops = {step[0] for step in steps}
        if _P_SRUN in ops and (_P_RANK in ops or _P_MPI in ops):
            steps.insert(0, (_P_NESTED,))
        return tuple(steps), at


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
        return _maybe_gunzip(io.BufferedReader(stream, _READ_CHUNK) if not hasattr(stream, "peek") else stream)
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


def normalize_stream(lines: Iterable[bytes | str], normalizer: Normalizer | None = None) -> Iterator[Record]:
    n = normalizer or Normalizer()
    for raw in lines:
        yield n.normalize(raw)
