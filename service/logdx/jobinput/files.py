"""A job's files: which files a job is (a folder stands for the files in it), and what each one's name
and first lines say before it is read.

Each file is one stream of the job (a node's output, a rank's, a node's kernel log). Its host or rank comes
from its name (`input.name_patterns`, tried on the name without its extensions, then on the folders it is
in: `node-01.log`, `node-01.stdout.log.gz`, `host=node-01.log`, `logs/node-01/stdout.log`, `rank-3.log`):
the launcher's per-host file naming, taken as stream metadata (a line's own prefix still wins). Once the
files' first lines are read, a host from a name must be one of the hosts the job's lines name
(`resolve_hosts`): a file name never brings in a machine the job does not know.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from logdx.hosts import clean_hostname, job_host_in_name, without_log_kind
from logdx.normalize import InputError, Normalizer, Source, iter_lines, open_input

if TYPE_CHECKING:
    from logdx.config import InputSettings

__all__ = ["Head", "LogFile", "collect", "name_of", "read_head", "resolve_hosts", "year_of"]

# How many of a file's first lines are read, before the merge, for the hosts they name.
HEAD_LINES = 1000
_ROTATED = re.compile(r"\.\d{1,3}$")  # node-01.log.1
# What follows the host in a file's name: node-01.stdout.log, node-01.dmesg.txt, node-01.kernel.json
_EXTENSION = re.compile(r"\.(?:log|txt|out|err|stdout|stderr|kernel|kmsg|dmesg|syslog|journal|messages|console"
                        r"|json|jsonl|ndjson|otlp|pb|msgpack)$", re.I)


@dataclass(frozen=True, slots=True)
class LogFile:
    path: Path
    shown: str  # as the user named it, or relative to the folder named
    host: str | None = None
    rank: int | None = None
    found: bool = False  # found in a folder (a file that is no log is skipped), not named (it is an error)
    host_from: str = ""  # how its host was found: "name", "name, matched to the job's hosts", "the job's only host"

    @property
    def source(self) -> Source | None:
        return Source(rank=self.rank, host=self.host) if self.host or self.rank is not None else None


def name_of(file_name: str) -> str:
    """A file's name without its extensions: node-01.stdout.log.1.gz -> node-01."""
    name = file_name[:-3] if file_name.endswith(".gz") else file_name
    name = _ROTATED.sub("", name)
    for _ in range(3):
        stripped = _EXTENSION.sub("", name)
        if stripped == name or not stripped:
            break
        name = stripped
    return name


def _identity(names: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> tuple[str | None, int | None]:
    """The host or rank the first matching pattern reads from the first name it matches."""
    for name in names:
        for pattern in patterns:
            m = pattern.search(name)
            if m is None:
                continue
            groups = m.groupdict()
            host = clean_hostname(groups.get("host"))
            rank = int(groups["rank"]) if groups.get("rank") and groups["rank"].isdigit() else None
            if host is not None or rank is not None:
                return host, rank
    return None, None


def _describe(path: Path, shown: str, parents: Sequence[str], patterns: Sequence[re.Pattern[str]],
              found: bool) -> LogFile:
    name = name_of(path.name)
    names = [without_log_kind(name), name, *reversed(parents)]
    host, rank = _identity(list(dict.fromkeys(names)), patterns)
    return LogFile(path=path, shown=shown, host=host, rank=rank, found=found, host_from="name" if host else "")


def _walk(root: Path) -> Iterator[Path]:
    """Regular files under `root`, sorted, hidden names (and folders) left out."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if not name.startswith(".") and path.is_file():
                yield path


def collect(args: Sequence[str], settings: InputSettings) -> list[LogFile]:
    """The files named (a folder stands for the files in it), each with the host or rank its name gives;
    `InputError` (the user's to fix) when they are no job's files."""
    if "-" in args:
        raise InputError("- (stdin) is one log on its own: name files or a folder, or pipe one log")
    patterns = [re.compile(p) for p in settings.name_patterns]
    out: list[LogFile] = []
    seen: set[Path] = set()

    def add(f: LogFile) -> None:
        key = f.path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(f)
        if len(out) > settings.max_files:
            raise InputError(f"more than {settings.max_files} files (input.max_files): name fewer, "
                             "or raise input.max_files (each file is open while they are merged)")

    for arg in args:
        path = Path(arg)
        if path.is_dir():
            before = len(out)
            for f in _walk(path):
                rel = f.relative_to(path)
                add(_describe(f, str(path / rel), rel.parts[:-1], patterns, found=True))
            if len(out) == before:
                raise InputError(f"{arg}: no log files in this folder")
        elif path.exists():
            add(_describe(path, arg, path.parts[:-1], patterns, found=False))
        else:
            raise InputError(f"{arg}: no such file or folder")
    return out


@dataclass(frozen=True, slots=True)
class Head:
    """What a text file's first lines say before it is read: the hosts its lines' own prefixes name, and the
    year (and month) of its first stamp that has one."""

    hosts: frozenset[str]
    year: tuple[int, int] | None


def read_head(f: LogFile, max_line_bytes: int, lines: int = HEAD_LINES) -> Head:
    """The first `lines` lines of a text file, read through a normaliser of their own."""
    clock = Normalizer(max_line_bytes=max_line_bytes)
    hosts: set[str] = set()
    year = None
    try:
        with open_input(f.path) as handle:
            for i, raw in enumerate(iter_lines(handle, max_line_bytes)):
                if i >= lines:
                    break
                rec = clock.normalize(raw)
                if rec.host is not None and len(hosts) < 4096 and (host := clean_hostname(rec.host)):
                    hosts.add(host)
                if year is None and clock.year_known:
                    year = clock.year
    except (InputError, OSError, EOFError, ValueError):
        pass  # read for real later, where the error is reported
    return Head(frozenset(hosts), year)


def resolve_hosts(files: Sequence[LogFile], heads: Sequence[Head | None]) -> tuple[list[LogFile], list[str]]:
    """Each file's host, now that the job's own hosts are known (those its lines name): a host from a file's
    name must be one of them, or the one of them the name holds (dmesg-node11 -> node11); a name that
    matches none gives no host (and a note), never a machine the job does not know. A file without a host
    in a job whose lines name one host only is that host's. When the job's lines name no host at all, the
    names are all there is and stand."""
    job_hosts = set().union(*(h.hosts for h in heads if h is not None))
    if not job_hosts:
        return list(files), []
    out, notes = [], []
    for f, head in zip(files, heads):
        host, how = f.host, f.host_from
        if host is not None and host not in job_hosts:
            matched = job_host_in_name(f.shown, job_hosts)
            if matched is not None:
                host, how = matched, f"name, matched to the job's host {matched}"
            else:
                notes.append(f"{f.shown}: its name gives host {host!r}, which is none of the {len(job_hosts)} hosts the "
                             "job's lines name: no host taken from it")
                host, how = None, ""
        elif host is None and f.rank is None:
            matched = job_host_in_name(f.shown, job_hosts)
            if matched is not None:
                host, how = matched, f"name, matched to the job's host {matched}"
            elif len(job_hosts) == 1 and (head is None or not head.hosts):
                (host,) = job_hosts
                how = "the job's only host"
        out.append(LogFile(f.path, f.shown, host, f.rank, f.found, how))
    return out, notes


def year_of(files: Sequence[LogFile], heads: Sequence[Head | None]) -> tuple[int, int] | None:
    """The year the job's first stamps without one belong to: the first full stamp any file's head has, else
    the year its newest file was last written."""
    stated = [h.year for h in heads if h is not None and h.year is not None]
    if stated:
        return min(stated)
    mtimes = []
    for f in files:
        try:
            mtimes.append(f.path.stat().st_mtime)
        except OSError:
            continue
    if not mtimes:
        return None
    t = time.gmtime(max(mtimes))
    return t.tm_year, t.tm_mon


