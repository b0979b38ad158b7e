"""`python -m logdx.flightrec PATH [--json]`: what a job's flight-recorder dumps say about its hang.

PATH is a directory of per-rank dumps, one dump file, a file holding torch's `fr_trace` output
(a log it was pasted into), or `-` for that text on stdin. Exit 0 with the findings, 2 when the
input cannot be read (one line on stderr saying which file and why)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from logdx.flightrec.analyse import analyse
from logdx.flightrec.frtext import parse_fr_trace_text
from logdx.flightrec.load import load_dumps
from logdx.flightrec.model import FrDumpError, FrFindings, FrLimits

_DUMP_MAGIC = (b"\x80", b"\x1f\x8b", b"{")
_MAX_TEXT_BYTES = 512 << 20


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read(_MAX_TEXT_BYTES)
    with open(path, "rb") as f:
        return f.read(_MAX_TEXT_BYTES).decode("utf-8", "replace")


def _is_dump(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(64).lstrip()
    return head[:2] == b"\x1f\x8b" or head[:1] in _DUMP_MAGIC


def findings_for(path: str, limits: FrLimits | None = None) -> FrFindings:
    """The findings for a CLI argument; `FrDumpError` when it holds neither dumps nor fr_trace output."""
    p = Path(path)
    if path != "-" and (p.is_dir() or (p.is_file() and _is_dump(p))):
        return analyse(load_dumps(p, limits))
    if path != "-" and not p.is_file():
        raise FrDumpError(f"{p}: no such file or directory")
    try:
        text = _read_text(path)
    except OSError as e:
        raise FrDumpError(f"{path}: cannot read ({e.strerror})") from None
    findings = parse_fr_trace_text(text)
    if not findings.groups and not findings.notes:
        raise FrDumpError(f"{'stdin' if path == '-' else path}: neither a flight-recorder dump nor torch fr_trace output")
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m logdx.flightrec",
                                     description="What a job's flight-recorder dumps (or torch's fr_trace output) "
                                                 "say about its hang.")
    parser.add_argument("path", help="directory of per-rank dumps, one dump, fr_trace output, or - for stdin")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    try:
        findings = findings_for(args.path)
    except FrDumpError as e:
        print(f"logdx.flightrec: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(findings.to_dict(), indent=2))
    else:
        print(findings.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
