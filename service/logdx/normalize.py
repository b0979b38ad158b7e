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
_TORCHRUN_LOCAL = re.compile(r"\[default(\d+)\]:")
_TORCHRUN_RANK = re.compile(r"\[[Rr]ank\s?(\d+)\]:\s?")
_MPI_TAG = re.compile(r"\[\d+,(\d+)\]<(stdout|stderr)>:\s?")
_SRUN_LABEL = re.compile(r"\s{0,4}(\d{1,6}): ")
_TASK_STREAM = re.compile(r"([A-Za-z][\w.-]*):(\d+) (out|err): ?")
# A host prefix must look like a machine name (lower case, a digit somewhere) so that
# "RuntimeError: ..." or "Epoch 3: ..." are never taken for one.
_HOST_PREFIX = re.compile(r"([a-z][a-z0-9-]*\d[a-z0-9.-]*|localhost): ")
_NCCL = re.compile(r"([\w.-]+):(\d+):(\d+) \[(\d+)\] ")
_SHELL_PROMPT = re.compile(r"(?:\([\w.-]+\) )?[\w.-]+@([\w.-]+)[: ][^\n]{0,80}?[%$#] ")

_MESSAGE_RANK = re.compile(r"\[(?:PG \d+ (?:\([^)]*\) )?)?Rank (\d+)\]")

# --- timestamps ----------------------------------------------------------------------------------
_ISO = re.compile(
    r"\[?(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d:?\d\d)?\]?\s*"
)
_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}
_CTIME = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\s?")
_SYSLOG = re.compile(r"([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) ([\w.-]+) ")
_DMESG_CTIME = re.compile(r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\] ")
_DMESG_REL = re.compile(r"\[\s*[+]?\d+\.\d+\] ")
_GLOG = re.compile(r"\[?([IWEF])(\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")


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
        # Year for stamps that carry none (syslog, glog), taken from the last full stamp seen.
        self._year = datetime.now(timezone.utc).year
        # A pasted terminal session names its host once, in the prompt.
        self._session_host: str | None = None

    def normalize(self, raw: bytes | str, source: Source | None = None) -> Record:
        self.line_no += 1
        self.bytes_in += len(raw) + 1
        line, truncated = sanitize(raw, self.max_line_bytes)
        if truncated:
            self.truncated += 1
        rec = Record(line_no=self.line_no, raw=line, text=line, truncated=truncated)
        try:
            self._peel(rec)
        except Exception:  # noqa: BLE001 - a strange line must never stop the stream
            rec.text = line
        if source is not None:
            _apply_source(rec, source)
        if rec.host is None and self._session_host is not None:
            rec.host = self._session_host
        return rec

    def _peel(self, rec: Record) -> None:
        text = rec.text
        # Peel prefixes in any order until none applies: launchers nest (srun around torchrun).
        for _ in range(8):
            before = text
            text = self._peel_one(rec, text)
            if text is before:
                break
        rec.text = text
        if rec.ts is None:
            rec.ts = self._inner_timestamp(text)
        if rec.rank is None and "Rank " in text[:160]:
            # c10d names the rank inside the message: "[PG 0 (default_pg) Rank 12] ..."
            m = _MESSAGE_RANK.search(text, 0, 160)
            if m:
                rec.rank = int(m.group(1))

    def _peel_one(self, rec: Record, text: str) -> str:
        if not text:
            return text
        c = text[0]
        if c == "[":
            return self._peel_bracket(rec, text)
        if c.isdigit():
            return self._peel_digit(rec, text)
        if c == " ":
            m = _SRUN_LABEL.match(text)
            if m and rec.rank is None:
                rec.rank = int(m.group(1))
                return text[m.end():]
            return text
        if c in "MTWFS" and (m := _CTIME.match(text)):
            rec.ts = rec.ts or _mk_ts(int(m.group(6)), _MONTHS.get(m.group(1), 1), *map(int, m.group(2, 3, 4, 5)))
            return text[m.end():]
        if c.isupper() and (m := _SYSLOG.match(text)) and m.group(1) in _MONTHS:
            rec.ts = rec.ts or _mk_ts(self._year, _MONTHS[m.group(1)], *map(int, m.group(2, 3, 4, 5)))
            rec.host = rec.host or m.group(6)
            rest = text[m.end():]
            # "kernel: [12345.678] NVRM: ..." / "sshd[123]: ..."
            km = re.match(r"[\w./-]+(?:\[\d+\])?: ", rest)
            return rest[km.end():] if km else rest
        if c.isalpha():
            return self._peel_host(rec, text)
        return text

    def _peel_bracket(self, rec: Record, text: str) -> str:
        if text.startswith("[default"):
            m = _TORCHRUN_LOCAL.match(text)
            if m:
                rec.local_rank = int(m.group(1))
                return text[m.end():]
        if text.startswith(("[rank", "[Rank")):
            m = _TORCHRUN_RANK.match(text)
            if m:
                rec.rank = int(m.group(1))
                return text[m.end():]
        m = _MPI_TAG.match(text)
        if m:
            rec.rank = int(m.group(1))
            rec.stream = m.group(2)
            return text[m.end():]
        m = _DMESG_CTIME.match(text)
        if m:
            rec.ts = rec.ts or _mk_ts(int(m.group(6)), _MONTHS.get(m.group(1), 1), *map(int, m.group(2, 3, 4, 5)))
            return text[m.end():]
        m = _DMESG_REL.match(text)
        if m:
            return text[m.end():]
        m = _ISO.match(text)
        if m:
            rec.ts = rec.ts or _iso_ts(m)
            self._year = int(m.group(1))
            return text[m.end():]
        return text

    def _peel_digit(self, rec: Record, text: str) -> str:
        m = _ISO.match(text)
        if m:
            rec.ts = rec.ts or _iso_ts(m)
            self._year = int(m.group(1))
            return text[m.end():]
        m = _SRUN_LABEL.match(text)
        if m and rec.rank is None:
            rec.rank = int(m.group(1))
            return text[m.end():]
        return text

    def _peel_host(self, rec: Record, text: str) -> str:
        m = _NCCL.match(text)
        if m:
            rec.host = rec.host or m.group(1)
            rec.pid = int(m.group(2))
            if rec.local_rank is None:
                rec.local_rank = int(m.group(4))
            return text[m.end():]
        m = _TASK_STREAM.match(text)
        if m:
            rec.host = rec.host or m.group(1)
            if rec.rank is None:
                rec.rank = int(m.group(2))
            rec.stream = "stdout" if m.group(3) == "out" else "stderr"
            return text[m.end():]
        m = _HOST_PREFIX.match(text)
        if m:
            rec.host = rec.host or m.group(1)
            return text[m.end():]
        if "@" in text[:64]:
            m = _SHELL_PROMPT.match(text)
            if m:
                self._session_host = m.group(1)
                rec.host = m.group(1)
        return text

    def _inner_timestamp(self, text: str) -> float | None:
        """A stamp inside the message (glog/c10 `[E817 17:40:34.22]`, logging `2024-...`)."""
        head = text[:96]
        m = _ISO.search(head)
        if m:
            return _iso_ts(m)
        m = _GLOG.match(head)
        if m:
            _, mon, day, hh, mm, ss, frac = m.groups()
            try:
                return _mk_ts(self._year, int(mon), int(day), int(hh), int(mm), int(ss)) + float("0." + frac)
            except ValueError:
                return None
        return None


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


def _iso_ts(m: re.Match[str]) -> float | None:
    year, mon, day, hh, mm, ss, frac, tz = m.groups()
    try:
        ts = _mk_ts(int(year), int(mon), int(day), int(hh), int(mm), int(ss))
    except ValueError:
        return None
    if frac:
        ts += float("0." + frac)
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        ts -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return ts


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
