"""The evidence capsule: what the log said, kept before a node is cordoned (once it is drained, its evidence
goes with it).

A capsule is a folder under `actions.capsule.dir` named by the sha256 of its manifest, which lists every other
file with its own sha256: the same evidence is the same capsule, and a changed byte shows. Its files and
folders are written read-only. `diagnose CAPSULE/` reads its log files as a job's folder and gives the
verdict again:

    CAPSULE/rank-3.log              the lines of rank 3 around the root line (±actions.capsule.context_lines)
    CAPSULE/host=gpu-7.log          the lines of a host's own stream (no rank; host=gpu-7/local_rank-N.log: by
                                    local rank)
    CAPSULE/host=gpu-7.kernel.log   the culprit host's kernel lines ±actions.capsule.kernel_window_s
    CAPSULE/job.log                 lines that name neither
    CAPSULE/.capsule/report.json    the report; decision.json: what the policy decided and what the actuator
                                    does; collector/<host>.out: the collector's output; dumps/: flight-recorder
                                    and stack dumps the diagnosis read; manifest.json: every file, its sha256,
                                    and what the size cap left out

(the metadata is in a hidden folder: `diagnose` skips it, so it reads the lines only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdx.act.argv import fill_argv
from logdx.act.report import Report
from logdx.config import CapsuleSettings
from logdx.evidence import EvidenceRecorder, Window
from logdx.model import Record

__all__ = ["META", "Capsule", "CapsuleError", "CapsuleWriter", "Evidence", "expire_capsules", "run_bounded", "verify"]

META = ".capsule"
MANIFEST = f"{META}/manifest.json"
_READ_CHUNK = 64 * 1024
_MANIFEST_ENTRY = 200  # bytes a file takes in the manifest, at most (a name of up to ~100 characters, its sha256)


class CapsuleError(Exception):
    """The capsule could not be written; the message says why (the audit records it)."""


@dataclass
class Evidence:
    """What the face acting on a diagnosis holds beyond the report: the recent lines, the dumps it read."""

    recorder: EvidenceRecorder | None = None
    dumps: dict[str, bytes] = field(default_factory=dict)  # file name -> contents


@dataclass(frozen=True)
class Capsule:
    digest: str  # sha256 of the manifest: the folder's name
    path: Path
    size: int  # bytes of all its files
    left_out: tuple[str, ...] = ()

    def describe(self) -> str:
        left = f"; the size cap left out parts of {len(self.left_out)} stream(s): see its manifest" if self.left_out else ""
        return f"sha256:{self.digest} at {self.path} ({self.size} bytes{left})"


@dataclass
class _Stream:
    name: str
    lines: list[Record]
    distance: int  # how far its lines are from the root line: nearer streams are kept first


class CapsuleWriter:
    def __init__(self, settings: CapsuleSettings) -> None:
        self.settings = settings

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def write(self, job_id: str, report: Report, decision: dict[str, Any], culprits: Sequence[str],
              evidence: Evidence | None, *, collect: bool = True) -> Capsule:
        """Write the capsule of this diagnosis; `CapsuleError` says why it could not be. `collect=False` (a dry
        run: nothing touches the nodes) leaves the collector unrun, and the capsule says what it would run."""
        s = self.settings
        if s.dir is None:
            raise CapsuleError("actions.capsule.dir is not set")
        try:
            files, left_out = self._contents(job_id, report, decision, culprits, evidence or Evidence(), collect)
            return _store(Path(s.dir), files, left_out, s.max_bytes)
        except CapsuleError:
            raise
        except (OSError, ValueError) as e:
            raise CapsuleError(f"{type(e).__name__}: {e}") from e

    # -- what goes in ---------------------------------------------------------------------------

    def _contents(self, job_id: str, report: Report, decision: dict[str, Any], culprits: Sequence[str],
                  evidence: Evidence, collect: bool) -> tuple[dict[str, bytes], list[str]]:
        s = self.settings
        files: dict[str, bytes] = {
            f"{META}/report.json": (report.model_dump_json(indent=2) + "\n").encode(),
            f"{META}/decision.json": (json.dumps({"job_id": job_id, **decision}, indent=2, sort_keys=True)
                                      + "\n").encode(),
        }
        # The root's own stream and the culprit's kernel lines first, then the collector, then the other ranks.
        first, rest = self._streams(report, culprits, evidence.recorder)
        # Room for the manifest: a line per file, and per file left out.
        entries = len(first) + len(rest) + 2 * len(culprits) + len(evidence.dumps) + len(files) + 1
        budget = s.max_bytes - sum(map(len, files.values())) - _MANIFEST_ENTRY * 2 * entries - 1024
        if budget < 0:
            raise CapsuleError(f"the report and the decision (and room for the manifest) are more than "
                               f"actions.capsule.max_bytes ({s.max_bytes})")
        left_out: list[str] = []
        root_line = report.root_cause.line_no if report.root_cause else 0
        for stream in first:
            budget = _add_lines(files, stream, root_line, budget, left_out)
        for host in culprits:
            out, note = self._collect(host, max(0, min(budget, s.collector_max_bytes)), collect)
            if out is not None:
                files[f"{META}/collector/{_safe(host)}.out"] = out
                files[f"{META}/collector/{_safe(host)}.json"] = (json.dumps(note, indent=2) + "\n").encode()
                budget -= len(out) + 512
        for stream in rest:
            budget = _add_lines(files, stream, root_line, budget, left_out)
        for name, blob in sorted(evidence.dumps.items()):
            if len(blob) > budget:
                left_out.append(f"dump {name} ({len(blob)} bytes)")
                continue
            files[f"{META}/dumps/{_safe(name)}"] = blob
            budget -= len(blob)
        return files, left_out

    def _streams(self, report: Report, culprits: Sequence[str],
                 recorder: EvidenceRecorder | None) -> tuple[list[_Stream], list[_Stream]]:
        """The streams of lines to keep: the root line's own first, the culprits' kernel lines, then the others
        nearest first."""
        root = report.root_cause
        if recorder is None:
            # Nothing recorded the lines (the service hands over the report alone): the root line at least.
            lines = [Record(line_no=root.line_no, raw=root.text, text=root.text, rank=root.rank, host=root.host)] \
                if root else []
            return [_Stream(_file_name(lines[0].source_key if lines else "-", lines), lines, 0)], []
        window = recorder.window_of(root.line_no if root else None)
        by_source = _window_lines(window) if window is not None else {k: list(v) for k, v in recorder.tails.items()}
        root_rec = window.root if window is not None else None
        root_key = root_rec.source_key if root_rec is not None else _key_of_root(report, by_source)
        root_line = root_rec.line_no if root_rec is not None else (root.line_no if root else 0)
        when = (root_rec.at if root_rec is not None and root_rec.at is not None
                else _time_near(by_source.get(root_key, []), root_line))
        kernel: list[_Stream] = []
        taken: set[int] = set()
        for host in culprits:
            lines = recorder.kernel_lines(host, when, self.settings.kernel_window_s)
            taken.update(r.line_no for r in lines)
            kernel.append(_Stream(f"host={_safe(host)}.kernel.log", lines, 0))
        streams: list[_Stream] = []
        for key, lines in by_source.items():
            lines = [r for r in lines if r.line_no not in taken]
            if not lines:
                continue
            distance = min(abs(r.line_no - root_line) for r in lines)
            streams.append(_Stream(_file_name(key, lines), lines, -1 if key == root_key else distance))
        streams.sort(key=lambda st: (st.distance, st.name))
        if len(streams) > self.settings.max_sources:
            streams = streams[: self.settings.max_sources]
        head = [st for st in streams[:1] if st.distance < 0]
        return [*head, *kernel], streams[len(head):]

    def _collect(self, host: str, max_bytes: int, collect: bool) -> tuple[bytes | None, dict[str, Any]]:
        """Run `actions.capsule.collector` against `host` (bounded in time and output)."""
        s = self.settings
        if not s.collector:
            return None, {}
        argv = fill_argv(s.collector, {"host": host})
        if not collect:
            return b"", {"argv": argv, "exit_code": None, "error": "dry run: the collector was not run"}
        return run_bounded(argv, s.collector_timeout_s, max_bytes)


def run_bounded(argv: list[str], timeout_s: float, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """Run a command without a shell; its stdout and stderr together, at most `max_bytes` of them (the rest is
    read and dropped), killed with its process group after `timeout_s`. What happened is the note."""
    started = time.monotonic()
    note: dict[str, Any] = {"argv": argv}
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        note.update(exit_code=None, error=f"cannot run {argv[0]}: {e.strerror or e}")
        return b"", note
    kept = bytearray()
    dropped = [0]

    def read() -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, _READ_CHUNK):
            room = max_bytes - len(kept)
            kept.extend(chunk[:room])
            dropped[0] += max(0, len(chunk) - room)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        code = None
        note["error"] = f"timed out after {timeout_s:g} s (actions.capsule.collector_timeout_s): killed"
    reader.join(5.0)
    if proc.stdout is not None:
        proc.stdout.close()
    note.update(exit_code=code, seconds=round(time.monotonic() - started, 3), bytes_kept=len(kept),
                bytes_dropped=dropped[0])
    if dropped[0]:
        note["truncated"] = f"output cut at {max_bytes} bytes (actions.capsule.collector_max_bytes or the size cap)"
    return bytes(kept), note


# -- the lines ------------------------------------------------------------------------------------


def _window_lines(window: Window) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for key, before in window.before.items():
        out[key] = [*before]
    out.setdefault(window.root.source_key, []).append(window.root)
    for key, after in window.after.items():
        out.setdefault(key, []).extend(after)
    return out


def _key_of_root(report: Report, by_source: dict[str, list[Record]]) -> str:
    root = report.root_cause
    if root is None:
        return "-"
    for key, lines in by_source.items():
        if any(r.line_no == root.line_no for r in lines):
            return key
    return Record(line_no=root.line_no, raw=root.text, text=root.text, rank=root.rank, host=root.host).source_key


def _time_near(lines: list[Record], line_no: int) -> float | None:
    timed = [r for r in lines if r.at is not None]
    if not timed:
        return None
    return min(timed, key=lambda r: abs(r.line_no - line_no)).at


def _file_name(key: str, lines: list[Record]) -> str:
    """A name the folder reader takes for the stream's rank or host (`input.name_patterns`)."""
    if key.startswith("r") and key[1:].isdigit():
        return f"rank-{key[1:]}.log"
    if key.startswith("h"):
        host, _, local = key[1:].rpartition(":")
        # A host's local rank: a folder named for the host (a file name would be read as the host's name).
        return f"host={_safe(host)}.log" if not local else f"host={_safe(host)}/local_rank-{_safe(local)}.log"
    if key.startswith("l") and key[1:].isdigit():
        return f"job.local_rank-{key[1:]}.log"
    return "job.log"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)[:200] or "_"


def _add_lines(files: dict[str, bytes], stream: _Stream, root_line: int, budget: int, left_out: list[str]) -> int:
    """The stream's lines nearest the root line that fit the budget, in their order; returns what is left."""
    if not stream.lines or budget <= 0:
        if stream.lines:
            left_out.append(f"{stream.name} ({len(stream.lines)} lines)")
        return budget
    nearest = sorted(stream.lines, key=lambda r: (abs(r.line_no - root_line), r.line_no))
    kept: list[Record] = []
    size = 0
    for rec in nearest:
        n = len(rec.raw.encode("utf-8", "replace")) + 1
        if size + n > budget:
            break
        kept.append(rec)
        size += n
    if len(kept) < len(stream.lines):
        left_out.append(f"{len(stream.lines) - len(kept)} of {len(stream.lines)} lines of {stream.name}")
    if kept:
        kept.sort(key=lambda r: r.line_no)
        name = stream.name
        existing = files.get(name, b"")
        files[name] = existing + "".join(r.raw + "\n" for r in kept).encode("utf-8", "replace")
    return budget - size


# -- the folder -----------------------------------------------------------------------------------


def _manifest(files: dict[str, bytes], left_out: list[str]) -> bytes:
    listing = {name: {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
               for name, blob in sorted(files.items())}
    return (json.dumps({"files": listing, "left_out": left_out}, indent=2, sort_keys=True) + "\n").encode()


def _store(root: Path, files: dict[str, bytes], left_out: list[str], max_bytes: int) -> Capsule:
    """Write the files into a folder named by the manifest's sha256 (read-only); an existing one is the same."""
    manifest = _manifest(files, left_out)
    digest = hashlib.sha256(manifest).hexdigest()
    files = {**files, MANIFEST: manifest}
    size = sum(map(len, files.values()))
    if size > max_bytes:  # the estimate of the manifest's size was short: never more than the cap
        raise CapsuleError(f"{size} bytes, more than actions.capsule.max_bytes ({max_bytes})")
    final = root / digest
    if (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == manifest:
        return Capsule(digest, final, size, tuple(left_out))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        for name, blob in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            path.chmod(0o444)
        for folder in sorted({p for p in tmp.rglob("*") if p.is_dir()}, key=lambda p: -len(p.parts)):
            folder.chmod(0o555)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not another writer of the same capsule: a real failure
                raise
            _remove(tmp)
            return Capsule(digest, final, size, tuple(left_out))
        final.chmod(0o555)
    except BaseException:
        _remove(tmp)
        raise
    return Capsule(digest, final, size, tuple(left_out))


def _remove(tmp: Path) -> None:
    if not tmp.exists():
        return
    for p in [tmp, *tmp.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)
    shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path) -> list[str]:
    """What is wrong with a capsule (empty: every file is as its manifest says, and the name is its sha256)."""
    manifest = (path / MANIFEST).read_bytes()
    problems = [] if hashlib.sha256(manifest).hexdigest() == path.name else ["the folder's name is not its sha256"]
    listed = json.loads(manifest)["files"]
    for name, meta in listed.items():
        blob = (path / name).read_bytes() if (path / name).is_file() else None
        if blob is None or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            problems.append(f"{name}: missing or changed")
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    problems += [f"{name}: not in the manifest" for name in sorted(present - set(listed))]
    return problems


def expire_capsules(root: Path, cutoff: float) -> int:
    """Delete the capsules (and unfinished writes) under `root` written before `cutoff`; how many went."""
    if not root.is_dir():
        return 0
    gone = 0
    for folder in root.iterdir():
        if not folder.is_dir() or folder.is_symlink():
            continue
        stamp = folder / MANIFEST if (folder / MANIFEST).is_file() else folder
        try:
            written = stamp.stat().st_mtime
        except OSError:
            continue
        if written < cutoff:
            _remove(folder)
            gone += not folder.name.startswith(".tmp-")
    return gone
