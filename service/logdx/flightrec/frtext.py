"""The findings in the text torch's own analyser printed (`torchfrtrace DIR`, formerly
`python tools/flight_recorder/fr_trace.py`), when a user pastes it into a log or a ticket.

It has printed three shapes over the years, all read here, with or without log prefixes before
each line ("[rank0]:", timestamps, "node-3: "):

    Not all ranks joining collective, sequence number: 7097      (torch 2.6 and later)
    internal record id: 7096
    group info: 0:default_pg
    collective: nccl:all_reduce
    missing ranks: {17}
    input sizes: [[4096]]
    ...
    expected ranks: {0, 1, ..., 63}
    collective state: scheduled
    error msg: Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: ...
    collective stack trace:
     all_reduce at .../distributed_c10d.py:2951

    Not all ranks joining collective 5 at entry 4                (torch 2.5: "expected ranks: 8" a count,
    Collective 5 at entry 4 errors                                "error message: Culprit rank 2; ...")

    Not all ranks joining collective for group 0:default_pg collective nccl:all_reduce Missing ranks are {1}
    Collective errors for group 0:default_pg collective nccl:broadcast Found errors: SIZE_OR_SYNTAX_MISMATCH
                                                                 (the first tools/flight_recorder version)

Per process group the first report is the one that matters: fr_trace matches collectives in order,
so its first complaint about a group is where that group's ranks parted."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from logdx.flightrec.analyse import culprits_of
from logdx.flightrec.model import Frame, FrFindings, PgFindings, rank_ranges

__all__ = ["is_report_line", "is_report_start", "parse_fr_trace_text"]

_MAX_LINES = 2_000_000
_MAX_BLOCK_LINES = 400   # a report is a dozen lines plus its stack
_SET = r"(\{[\d,\s]*\}|set\(\))"

_STARTS: list[tuple[str, re.Pattern[str]]] = [
    ("missing", re.compile(r"Not all ranks joining collective, sequence number: (?P<seq>\d+)")),
    ("missing", re.compile(r"Not all ranks joining collective (?P<seq>\d+) at entry (?P<rid>\d+)")),
    ("missing", re.compile(r"Not all ranks joining collective for group (?P<group>\S+) collective (?P<op>\S+)"
                           r"\s+Missing ranks are " + _SET.replace("(", "(?P<missing>", 1)
                           + r"(?:\s+(?P<ins>\[[\[\]\d,\s]*\])\s+(?P<outs>\[[\[\]\d,\s]*\])\s+(?P<world>\d+)"
                             r"\s+(?P<state>\w+))?")),
    ("errors", re.compile(r"Collective sequence number: (?P<seq>\d+) has errors")),
    ("errors", re.compile(r"Collective (?P<seq>\d+) at entry (?P<rid>\d+) errors")),
    ("errors", re.compile(r"Collective errors for group (?P<group>\S+) collective (?P<op>\S+)\s+Found errors: "
                          r"(?P<error>.*)$")),
    ("numel", re.compile(r"Input/output mismatch in the collective sequence number: (?P<seq>\d+)")),
    ("numel", re.compile(r"Input/output mismatch in the collective (?P<seq>\d+) at entry (?P<rid>\d+)")),
    ("numel", re.compile(r"Input/output mismatch in the collective for group (?P<group>\S+) collective (?P<op>\S+)")),
]
_NO_DUMPS = [re.compile(r"missed FR dumps from ranks \(" + _SET + r"\)"),
             re.compile(r"Missing dump files from ranks " + _SET)]
_KEY = re.compile(r"(?:^|[\s\]|>:])(internal record id|group info|collective state|collective stack traces?|collective"
                  r"|missing ranks|input sizes|output sizes|world size|expected ranks|error msg|error message"
                  r"|total input numel|total output numel): ?(.*)$", re.IGNORECASE)
_FRAME = re.compile(r"(?:^|\s)(?P<name>[\w<>.\[\]-]+) at (?P<file>\S+?):(?P<line>\d+)\s*$")
_SIZES = re.compile(r"^\[[\[\]\d,\s]*\]$")


@dataclass
class _Report:
    kind: str
    seq: int | None = None
    group: str = ""
    op: str = ""
    missing: tuple[int, ...] | None = None
    expected: tuple[int, ...] = ()
    world: int | None = None
    state: str = ""
    ins: tuple[tuple[int, ...], ...] | None = None
    outs: tuple[tuple[int, ...], ...] | None = None
    errors: list[str] = field(default_factory=list)
    numel: list[str] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    in_stack: bool = False
    lines: int = 0


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in re.findall(r"\d+", text)}))


def _sizes(text: str) -> tuple[tuple[int, ...], ...] | None:
    text = text.strip()
    if len(text) > 20_000 or not _SIZES.match(text):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, list) or not all(isinstance(s, list) and all(isinstance(d, int) for d in s) for s in value):
        return None
    return tuple(tuple(s) for s in value)


def is_report_start(line: str) -> bool:
    """A line that starts one of fr_trace's reports (the compressor keeps the report whole)."""
    return ("ranks joining" in line or "errors" in line or "mismatch" in line) and _start(line) is not None


def is_report_line(line: str) -> bool:
    """A line that can be part of a report: a field, a frame of its stack, sizes, a blank line."""
    s = line.strip()
    return not s or _KEY.search(line) is not None or _FRAME.search(line) is not None or _SIZES.match(s) is not None


def parse_fr_trace_text(text: str | Iterable[str]) -> FrFindings:
    """The findings in `text` (all or part of a log holding fr_trace output, or its lines); no
    groups when it holds none."""
    reports: list[_Report] = []
    no_dump: set[int] = set()
    current: _Report | None = None
    for n, line in enumerate(text.splitlines() if isinstance(text, str) else text):
        if n >= _MAX_LINES:
            break
        line = line.rstrip()
        for pattern in _NO_DUMPS:
            if m := pattern.search(line):
                no_dump.update(_ranks(m.group(1)))
        started = _start(line)
        if started is not None:
            current = started
            reports.append(current)
            continue
        if current is None:
            continue
        current.lines += 1
        if current.lines > _MAX_BLOCK_LINES or not _field(current, line):
            current = None  # a line that is no part of a report ends it
    return _findings(reports, no_dump)


def _start(line: str) -> _Report | None:
    for kind, pattern in _STARTS:
        m = pattern.search(line)
        if m is None:
            continue
        g = m.groupdict()
        r = _Report(kind, seq=int(g["seq"]) if g.get("seq") else None, group=g.get("group") or "",
                    op=g.get("op") or "")
        if g.get("missing") is not None:
            r.missing = _ranks(g["missing"])
        if g.get("ins"):
            r.ins, r.outs = _sizes(g["ins"]), _sizes(g["outs"])
            r.world, r.state = int(g["world"]), g["state"]
        if g.get("error"):
            r.errors.append(g["error"].strip())
        return r
    return None


def _field(r: _Report, line: str) -> bool:
    """Takes one line of a report; False when the line is not part of one."""
    m = _KEY.search(line)
    if m is None:
        if r.in_stack and (f := _FRAME.search(line)):
            if len(r.frames) < 64:
                r.frames.append(Frame(f.group("name"), f.group("file"), int(f.group("line"))))
            return True
        return not line.strip()
    key, value = m.group(1).lower(), m.group(2).strip()
    r.in_stack = key.startswith("collective stack trace")
    if r.in_stack:
        if value and (f := _FRAME.search(" " + value)):
            r.frames.append(Frame(f.group("name"), f.group("file"), int(f.group("line"))))
    elif key == "group info":
        r.group = value
    elif key == "collective":
        r.op = value
    elif key == "missing ranks":
        r.missing = _ranks(value)
    elif key in ("input sizes", "output sizes"):
        sizes = _sizes(value)
        if key == "input sizes":
            r.ins = sizes
        else:
            r.outs = sizes
    elif key == "world size" and value.isdigit():
        r.world = int(value)
    elif key == "expected ranks":
        if value.isdigit():
            r.world = int(value)
        else:
            r.expected = _ranks(value)
    elif key == "collective state":
        r.state = value
    elif key in ("error msg", "error message"):
        r.errors.append(value)
    elif key in ("total input numel", "total output numel"):
        r.numel.append(f"{key.split()[1]} {value}")
    return True


def _findings(reports: list[_Report], no_dump: set[int]) -> FrFindings:
    first: dict[str, _Report] = {}
    repeats: dict[str, int] = {}
    for r in reports:
        key = r.group or "?"
        if key in first:
            repeats[key] = repeats.get(key, 0) + 1
        else:
            first[key] = r
    groups = [_group(r, no_dump) for r in first.values()]
    notes = [f"fr_trace reported {n} more problems in {_label(k)} after the first" for k, n in repeats.items()]
    if no_dump:
        notes.append(f"fr_trace had no dumps from {'rank' if len(no_dump) == 1 else 'ranks'} {rank_ranges(no_dump)}")
    culprits, no_dump_basis = culprits_of(groups)
    if no_dump_basis:
        culprits = ()
    return FrFindings(groups=groups, culprit_ranks=culprits, source="fr_trace", notes=notes)


def _label(group: str) -> str:
    return f"pg {group.replace(':', ' (', 1)})" if ":" in group else f"pg {group}"


def _group(r: _Report, no_dump: set[int]) -> PgFindings:
    name, _, desc = r.group.partition(":")
    expected = r.expected
    missing = tuple(r.missing or ())
    f = PgFindings(pg_name=name or "?", pg_desc=desc, ranks=expected, seq=r.seq, stuck_op=r.op or None,
                   missing_ranks=missing, input_sizes=r.ins, output_sizes=r.outs, stack=tuple(r.frames),
                   members_known=bool(expected),
                   no_dump_ranks=tuple(sorted(set(expected) & no_dump)) if expected else ())
    if expected and missing and r.state != "completed":
        f.waiting_ranks = tuple(x for x in expected if x not in set(missing) | no_dump)
    culprits: list[int] = []
    details: list[str] = []
    for err in r.errors:
        for part in re.split(r",\s*(?=Culprit rank)", err):
            kind = re.search(r"(?:Error type: |MatchState\.)?([A-Z_]{6,})", part)
            rank = re.search(r"Culprit rank (\d+)", part)
            if kind and kind.group(1) == "COLLECTIVE_STATE_MISMATCH" and rank:
                f.not_started_ranks = (*f.not_started_ranks, int(rank.group(1)))
                continue
            if rank:
                culprits.append(int(rank.group(1)))
            details.append(_condense(part))
    if r.kind == "numel":
        details.append("input/output numel differ across ranks (" + ", ".join(r.numel) + ")" if r.numel
                       else "input/output numel differ across ranks")
    if details:
        where = f"at #{r.seq}" if r.seq is not None else "at the first unmatched collective"
        f.mismatch = f"{where} {r.op}: " + "; ".join(details)[:600]
        f.mismatch_seq = r.seq
        f.mismatch_ranks = tuple(sorted(set(culprits)))
    return f


def _condense(error: str) -> str:
    """"Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH, Expected ..." -> "rank 2
    (COLLECTIVE_TYPE_MISMATCH): Expected ..."."""
    m = re.match(r"\s*Culprit rank (\d+); (?:Error type: |MatchState\.)?([A-Z_]+),?\s*(.*)$", error)
    if m is None:
        return error.strip()
    rank, kind, detail = m.groups()
    return f"rank {rank} ({kind})" + (f": {detail.strip()}" if detail.strip() else "")
