"""Why a collective timed out: the class of the cause, its evidence, and what it implies.

Most NCCL watchdog timeouts are not the machine's. The classes (taxonomy.yaml `timeout_classes`), and what
tells them apart in text users already have, read only from the lines the rules matched and the timeline:

- `misconfig`: at the same sequence number of one process group, the watchdogs report different ops or
  sizes (`WorkNCCL(SeqNum=7097, OpType=ALLREDUCE, NumelIn=..., NumelOut=...)`), or TORCH_DISTRIBUTED_DEBUG's
  wrapper says "Detected mismatch between collectives on ranks";
- `cpu_side`: one rank behind the others (a lower SeqNum, silent in the watchdogs' reports, or a desync report's
  "finished collective #N, but didn't join collective #N+1") whose process still printed its own work after
  the others had stopped: it was elsewhere in the code;
- `gpu_hang`: a rank's work was enqueued and never completed while the others completed it (its own watchdog
  on the lower SeqNum, the desync report's "joined but didn't finish collective #N");
- `network`: an InfiniBand / NIC error line (NET/IB completion or async event, a link down) before the timeouts;
- `unknown`: nothing of the above; `missing` says what would tell.

When a precise root cause the rules chose explains the timeouts (a rank's exception, an Xid), its kind gives
the class and its verdict stands; otherwise a `cpu_side` or `misconfig` class relabels the timeout verdict
(never restarted, never cordoned: the code or configuration makes every rank wait again).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from logdx.diagnose.culprit import Finding as AttributedFinding
from logdx.diagnose.culprit import hang_culprit
from logdx.diagnose.rules.compiled import RuleHit
from logdx.hosts import clean_hostname
from logdx.model import FT, Attribution, Category, CompressionSummary, Label, Role, Severity
from logdx.taxonomy import TimeoutClass, category_of, is_hardware, timeout_class

__all__ = ["TimeoutVerdict", "WorkSeen", "classify", "note_work", "relabel"]

# A watchdog's work, as ProcessGroupNCCL prints it (torch 1.13 to 2.x): the op and sizes are missing in old
# versions; the process group in 2.2+ ("[PG 0 (default_pg) Rank 3]", "[PG ID 0 PG GUID 0(default_pg) Rank 3]").
_WORK = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+)(?:, OpType=(?P<op>\w+))?(?:, NumelIn=(?P<nin>\d+), "
                   r"NumelOut=(?P<nout>\d+))?")
_ENQUEUED = re.compile(r"(?:at work|at NCCL work): (?P<seq>\d+), last enqueued NCCL work: (?P<enq>\d+), "
                       r"last completed NCCL work: (?P<done>-?\d+)")
_PG = re.compile(r"\[PG (?:ID )?(?P<pg>\d+)")
# torch's desync report (TraceUtils.h retrieveDesyncReport, TORCH_NCCL_DESYNC_DEBUG=1) and ProcessGroupWrapper's
# fingerprint check (TORCH_DISTRIBUTED_DEBUG=DETAIL).
_NOT_JOINED = re.compile(r"\[(?P<ranks>[\d, ]+)\] finished collective #(?P<seq>\d+), but didn't join collective")
_NOT_FINISHED = re.compile(r"\[(?P<ranks>[\d, ]+)\] joined but didn't finish collective #(?P<seq>\d+)")
_NEVER_JOINED = re.compile(r"ranks \[(?P<ranks>[\d, ]+)\] are the lagging ranks that caused this timeout")
_MISMATCH = "Detected mismatch between collectives on ranks"
_SIDES = re.compile(r"Rank (\d+) is running collective: .*?, but Rank (\d+) is running collective")
# Ops whose sizes differ across ranks by design (uneven all_to_all splits): only their op type is compared.
_SIZES_MAY_DIFFER = ("ALLTOALL", "SEND", "RECV", "GATHER", "SCATTER")
# The rules whose lines say a collective timed out (besides any line that carries a watchdog's work).
_WATCHDOG_RULES = frozenset({"nccl-watchdog-timeout", "nccl-watchdog-stuck", "desync-report-lagging-rank"})
# The timeout verdicts a class may relabel: a watchdog's symptom, or a hang the rules inferred from one.
_TIMEOUT_RULES = frozenset({"hang-silent-rank", "desync-report-lagging-rank", "hang-flight-recorder"})
_NETWORK_TYPES = frozenset({FT.NETWORK_ERROR, FT.CONNECTION_ERROR})
_GPU_TYPES = frozenset({FT.CUDA_ERROR})
# A rank that printed its own work this long after the others' last step was not waiting with them.
_MIN_GAP_S = 60.0
_GAP_INTERVALS = 3


@dataclass(slots=True)
class WorkSeen:
    """What one rank's watchdog lines say of the collective it timed out in."""

    seq: int
    line_no: int
    op: str | None = None
    numel_in: int | None = None
    numel_out: int | None = None
    completed: int | None = None  # its last completed work, when the line says

    def signature(self) -> tuple[str | None, int | None, int | None]:
        if self.op and self.op.lstrip("_").startswith(_SIZES_MAY_DIFFER):
            return self.op, None, None
        return self.op, self.numel_in, self.numel_out


class Finding(AttributedFinding, Protocol):
    """What the timeout reading takes of a finding (`rootcause.Finding`, whose module imports this one): what
    the attribution reads, and each watchdog's work."""

    @property
    def works(self) -> dict[tuple[str, int], WorkSeen]: ...


@dataclass(frozen=True, slots=True)
class Relabelled:
    """The winner's new hit and culprits, for `rootcause` to put on its finding."""

    hit: RuleHit
    ranks: set[int]
    hosts: set[str]
    role: Role
    attribution: Attribution


def note_work(works: dict[tuple[str, int], WorkSeen], rank: int, text: str, line_no: int) -> None:
    """A matched watchdog line's work, per (process group, rank): the first collective it timed out in."""
    m = _WORK.search(text)
    e = _ENQUEUED.search(text) if m is None else None
    if m is None and e is None:
        return
    pg_m = _PG.search(text)
    key = (pg_m.group("pg") if pg_m else "", rank)
    seq = int((m or e).group("seq"))  # type: ignore[union-attr]
    seen = works.get(key)
    if seen is None or seq < seen.seq:
        seen = works[key] = WorkSeen(seq=seq, line_no=line_no)
    if seen.seq != seq:
        return
    if m is not None and m.group("op"):
        seen.op = m.group("op")
        if m.group("nin"):
            seen.numel_in, seen.numel_out = int(m.group("nin")), int(m.group("nout"))
    if e is not None:
        seen.completed = int(e.group("done"))


def _merged(parts: Sequence[dict[tuple[str, int], WorkSeen]]) -> dict[tuple[str, int], WorkSeen]:
    """One rank's lines fall into several findings (the watchdog's line, its "last enqueued" line): per (group,
    rank), its lowest sequence number with whatever each line says of it."""
    out: dict[tuple[str, int], WorkSeen] = {}
    for works in parts:
        for key, w in works.items():
            seen = out.get(key)
            if seen is None or w.seq < seen.seq:
                out[key] = replace(w)
            elif w.seq == seen.seq:
                seen.line_no = min(seen.line_no, w.line_no)
                seen.op = seen.op or w.op
                if seen.numel_in is None:
                    seen.numel_in, seen.numel_out = w.numel_in, w.numel_out
                if seen.completed is None:
                    seen.completed = w.completed
    # A line that names no process group (torch's "[Rank 3] Watchdog caught ...") is the same rank's line as the
    # one that does, when they tell of the same collective.
    for (pg, rank), w in list(out.items()):
        named = next((k for k in out if k[1] == rank and k[0] and out[k].seq == w.seq), None) if not pg else None
        if named is not None:
            target = out[named]
            target.op = target.op or w.op
            if target.numel_in is None:
                target.numel_in, target.numel_out = w.numel_in, w.numel_out
            target.line_no = min(target.line_no, w.line_no)
            del out[(pg, rank)]
    return out


@dataclass(slots=True)
class TimeoutVerdict:
    """The cause of a job's collective timeouts."""

    cause: str  # one of taxonomy.TIMEOUT_CLASSES
    evidence: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    hint: str = ""
    explained_by: str | None = None  # the rule of the root cause that explains the timeouts
    decided: bool = False  # the class set the verdict's label and action

    @property
    def spec(self) -> TimeoutClass:
        return timeout_class(self.cause)


def _ranks(text: str) -> list[int]:
    return sorted({int(x) for x in text.replace(" ", "").split(",") if x.isdigit()})


def _is_timeout_verdict(winner: Finding | None, role: Role | None) -> bool:
    if winner is None:
        return False
    return role is Role.SYMPTOM or winner.hit.rule_id in _TIMEOUT_RULES


def classify(winner: Finding | None, role: Role | None, findings: Sequence[Finding],
             summary: CompressionSummary) -> TimeoutVerdict | None:
    """The class of the job's collective timeouts; None when the job shows none."""
    timeouts = [f for f in findings if f.works or f.hit.rule_id in _WATCHDOG_RULES]
    mismatch = [f for f in findings if _MISMATCH in f.hit.line.text]
    if not timeouts and not mismatch:
        return None
    works = _merged([f.works for f in timeouts])
    desync = _desync(findings)
    verdict = _misconfig(works, mismatch, summary)
    if verdict is not None:
        return verdict
    if winner is not None and not _is_timeout_verdict(winner, role):
        return _explained(winner, summary)
    return (_cpu_side(works, desync, findings, summary) or _gpu_hang(works, desync, summary)
            or _unknown(works, desync, summary))


# -- the signals ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Desync:
    not_joined: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (collective #, line)
    not_finished: dict[int, tuple[int, int]] = field(default_factory=dict)
    never_joined: dict[int, int] = field(default_factory=dict)  # rank -> line


def _desync(findings: Sequence[Finding]) -> _Desync:
    out = _Desync()
    for f in findings:
        for rec in f.event.lines or [f.hit.line]:
            text = rec.text
            if "collective" not in text:
                continue
            if (m := _NOT_JOINED.search(text)) is not None:
                out.not_joined.update({r: (int(m.group("seq")), rec.line_no) for r in _ranks(m.group("ranks"))})
            elif (m := _NOT_FINISHED.search(text)) is not None:
                out.not_finished.update({r: (int(m.group("seq")), rec.line_no) for r in _ranks(m.group("ranks"))})
            elif (m := _NEVER_JOINED.search(text)) is not None:
                out.never_joined.update(dict.fromkeys(_ranks(m.group("ranks")), rec.line_no))
    return out


def _hosts(ranks: Sequence[int], summary: CompressionSummary) -> list[str]:
    return sorted({h for r in ranks if r in summary.rank_hosts if (h := clean_hostname(summary.rank_hosts[r]))})


def _misconfig(works: dict[tuple[str, int], WorkSeen], mismatch: Sequence[Finding],
               summary: CompressionSummary) -> TimeoutVerdict | None:
    if mismatch:
        f = min(mismatch, key=lambda x: x.hit.line.line_no)
        raised = sorted(f.ranks) or ([f.hit.rank] if f.hit.rank is not None else [])
        # Every rank's check raises when one rank's collective differs (each compares itself with the others): a
        # culprit stands out only when one or two raised; the line names the two sides either way.
        named = raised if len(raised) <= 2 else []
        pair = _SIDES.search(f.hit.line.text)
        who = (f"rank {pair.group(1)} and rank {pair.group(2)}" if pair else
               f"rank{'s' if len(raised) > 1 else ''} {', '.join(map(str, raised[:8])) or '?'}")
        return TimeoutVerdict(
            "misconfig", evidence=[f"line {f.hit.line.line_no}: {_clip(f.hit.line.text)}"]
            + ([f"{len(raised)} ranks raised it"] if len(raised) > 2 else []), ranks=named, hosts=_hosts(named, summary),
            hint=f"TORCH_DISTRIBUTED_DEBUG's check found {who} running different collectives (line "
                 f"{f.hit.line.line_no}): {timeout_class('misconfig').advice}.")
    by_seq: dict[tuple[str, int], dict[int, WorkSeen]] = defaultdict(dict)
    for (pg, rank), w in works.items():
        if w.op is not None:
            by_seq[(pg, w.seq)][rank] = w
    for (pg, seq), ranks in sorted(by_seq.items(), key=lambda kv: kv[0][1]):
        counts = Counter(w.signature() for w in ranks.values())
        if len(counts) < 2:
            continue
        common, _ = counts.most_common(1)[0]
        odd = sorted(r for r, w in ranks.items() if w.signature() != common)
        if not pg and (len(counts) > 2 or len(odd) > max(1, len(ranks) // 8)):
            continue  # lines that name no process group: the same number in two groups may be two collectives
        if len(counts) > 3:
            continue  # every rank its own size: not one collective
        if len(odd) > len(ranks) // 2:
            odd = []  # no majority to call the others odd: every side is named in the evidence
        sides = [f"{_sig(sig)} on {n} rank{'s' if n > 1 else ''}" for sig, n in counts.most_common(4)]
        first = min(ranks.values(), key=lambda w: w.line_no)
        culprit = f"rank {', '.join(map(str, odd[:8]))}" if odd else "the ranks"
        return TimeoutVerdict(
            "misconfig", evidence=[f"SeqNum {seq}{' of PG ' + pg if pg else ''}: {'; '.join(sides)} "
                                   f"(watchdog lines from line {first.line_no})"],
            ranks=odd, hosts=_hosts(odd, summary),
            hint=f"At SeqNum {seq} {culprit} called {_sig(ranks[odd[0]].signature()) if odd else 'another collective'}"
                 f" while the others called {_sig(common)}: {timeout_class('misconfig').advice}.")
    return None


def _sig(sig: tuple[str | None, int | None, int | None]) -> str:
    op, nin, nout = sig
    return f"{op}" + (f" (NumelIn={nin}, NumelOut={nout})" if nin is not None else "")


def _explained(winner: Finding, summary: CompressionSummary) -> TimeoutVerdict:
    """A root cause the rules chose explains the timeouts: its kind is the class; its verdict stands."""
    label = winner.hit.label
    ft = label.failure_type
    if ft in _NETWORK_TYPES:
        cause = "network"
    elif is_hardware(ft) and ft != FT.NODE_FAILURE or ft in _GPU_TYPES:
        cause = "gpu_hang"
    elif label.category in (Category.SCRIPT, Category.FRAMEWORK):
        cause = "cpu_side"
    else:
        cause = "unknown"
    line = winner.hit.line
    ranks = sorted(winner.ranks | ({winner.hit.rank} if winner.hit.rank is not None else set()))
    hosts = sorted(set(_hosts(ranks, summary)) | {h for h in [winner.hit.host, *winner.hosts] if h})
    return TimeoutVerdict(cause, evidence=[f"line {line.line_no}: {_clip(line.text)} (rule {winner.hit.rule_id}), "
                                           "before the others timed out"],
                          ranks=ranks, hosts=hosts, explained_by=winner.hit.rule_id)


def _others_stop(summary: CompressionSummary, culprits: set[int]) -> tuple[int, float | None] | None:
    """Where the other ranks' training stopped: their last progress line (and its time)."""
    last = [(s.last_line, s.last_ts) for s in summary.progress.sources if s.rank is not None and s.rank not in culprits]
    if not last:
        return None
    line = max(x[0] for x in last)
    times = [x[1] for x in last if x[1] is not None]
    return line, (max(times) if times else None)


def _still_working(rank: int, others_stop: tuple[int, float | None], watchdogs: dict[tuple[str, int], WorkSeen],
                   findings: Sequence[Finding], summary: CompressionSummary) -> tuple[int, float | None] | None:
    """The rank's last line of its own work, when it came after the others had stopped: after their watchdogs
    fired, or (by the clock) well after their last step. Lines of one host's stream arrive in the order they were
    written, streams in any order (per-node files, uploads): arrival order is read only within the rank's host."""
    work = summary.progress.last_work.get(f"r{rank}")
    if work is None:
        return None
    line, ts = work
    host = summary.rank_hosts.get(rank)
    beside = [w.line_no for (_, r), w in watchdogs.items() if host is not None and summary.rank_hosts.get(r) == host]
    if beside and line > min(beside):
        return work
    # A line without a stamp of its own keeps its stream's last time: a lower bound, so a later time is sure.
    first = min(watchdogs.values(), key=lambda w: w.line_no)
    first_ts = min((t for w in watchdogs.values() if (t := _ts_of_line(findings, w.line_no)) is not None), default=None)
    if ts is not None and first_ts is not None and ts > first_ts:
        return work
    if not summary.hosts and line > first.line_no:
        return work  # no host anywhere: one stream, in the order it was written
    stop_ts = others_stop[1]
    if ts is not None and stop_ts is not None:
        gap = max(_MIN_GAP_S, _GAP_INTERVALS * (summary.step_interval_s or 0.0))
        if ts - stop_ts >= gap:
            return work
    return None


def _cpu_side(works: dict[tuple[str, int], WorkSeen], desync: _Desync, findings: Sequence[Finding],
              summary: CompressionSummary) -> TimeoutVerdict | None:
    behind = hang_culprit(findings, summary).attribution.ranks
    # A rank whose own watchdog fired was inside a collective itself: what it printed then is no work of its own.
    reported = {rank for _, rank in works}
    candidates = sorted((set(behind) | set(desync.not_joined) | set(desync.never_joined)) - reported)
    if not candidates or not works:
        return None
    first = min(works.values(), key=lambda w: w.line_no)  # the others': no candidate reported
    # Where the others stopped: their last progress line; when only the candidate prints progress (a framework
    # whose rank 0 alone logs, and rank 0 went on), their first watchdog: they were waiting by then at the latest.
    others = _others_stop(summary, set(candidates)) or (first.line_no, _ts_of_line(findings, first.line_no))
    working = {r: w for r in candidates if (w := _still_working(r, others, works, findings, summary)) is not None}
    if not working or len(working) > max(1, summary.world_size // 8):
        return None
    ranks = sorted(working)
    waited = min(works.values(), key=lambda w: w.seq)
    op = f"{waited.op} " if waited.op else ""
    at = _step_of(ranks[0], summary)
    evidence = [f"rank {r} printed its own work until line {working[r][0]}, after the others' watchdogs fired "
                f"(line {first.line_no}) or long after their last step (line {others[0]})" for r in ranks[:4]]
    evidence.append(f"the others waited in {op}SeqNum {waited.seq} (line {waited.line_no})")
    for r in ranks:
        if r in desync.not_joined:
            evidence.append(f"line {desync.not_joined[r][1]}: the desync report: rank {r} finished collective "
                            f"#{desync.not_joined[r][0]} but did not join the next")
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    hint = (f"{who} {'was' if len(ranks) == 1 else 'were'} still printing{' at step ' + at if at else ''} (until line "
            f"{working[ranks[0]][0]}) while the others waited in {op}SeqNum {waited.seq}: "
            f"{timeout_class('cpu_side').advice}.")
    return TimeoutVerdict("cpu_side", evidence=evidence, ranks=ranks, hosts=_hosts(ranks, summary), hint=hint)


def _step_of(rank: int, summary: CompressionSummary) -> str:
    for s in summary.progress.sources:
        if s.rank == rank and s.last_step is not None:
            return f"{s.last_step:g}"
    return f"{summary.progress.last_step:g}" if summary.progress.last_step is not None else ""


def _ts_of_line(findings: Sequence[Finding], line_no: int) -> float | None:
    for f in findings:
        for rec in f.event.lines or [f.hit.line]:
            if rec.line_no == line_no:
                return rec.ts
    return None


def _gpu_hang(works: dict[tuple[str, int], WorkSeen], desync: _Desync,
              summary: CompressionSummary) -> TimeoutVerdict | None:
    evidence: list[str] = []
    ranks: set[int] = set()
    world = summary.world_size
    if desync.not_finished and len(desync.not_finished) <= max(1, world // 8):
        for r, (seq, line) in sorted(desync.not_finished.items()):
            evidence.append(f"line {line}: the desync report: rank {r} joined collective #{seq} and never finished it")
            ranks.add(r)
    by_pg: dict[str, dict[int, WorkSeen]] = defaultdict(dict)
    for (pg, rank), w in works.items():
        by_pg[pg][rank] = w
    for seen in by_pg.values():
        seqs = Counter(w.seq for w in seen.values())
        if len(seqs) < 2:
            continue
        top = max(seqs)
        low = [r for r, w in seen.items() if w.seq < top]
        if not low or len(low) > max(1, len(seen) // 8):
            continue
        for r in sorted(low):
            w = seen[r]
            evidence.append(f"line {w.line_no}: rank {r}'s own watchdog timed out on {w.op or 'work'} SeqNum {w.seq} "
                            f"(enqueued, never completed) while the others had completed it and waited in SeqNum {top}")
            ranks.add(r)
    if not ranks:
        return None
    rs = sorted(ranks)
    who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"
    return TimeoutVerdict("gpu_hang", evidence=evidence, ranks=rs, hosts=_hosts(rs, summary),
                          hint=f"{who}'s GPU never completed a collective the others completed: "
                               f"{timeout_class('gpu_hang').advice}.")


def _unknown(works: dict[tuple[str, int], WorkSeen], desync: _Desync, summary: CompressionSummary) -> TimeoutVerdict:
    evidence = []
    if works:
        seqs = Counter(w.seq for w in works.values())
        seq, n = seqs.most_common(1)[0]
        op = next((w.op for w in works.values() if w.seq == seq and w.op), None)
        evidence.append(f"{n} rank{'s' if n > 1 else ''} timed out on {op + ' ' if op else ''}SeqNum {seq}"
                        + (f" ({len(seqs)} sequence numbers in all)" if len(seqs) > 1 else ", all alike"))
    for r, (seq, line) in sorted(desync.not_joined.items())[:4]:
        evidence.append(f"line {line}: the desync report: rank {r} finished collective #{seq} and never joined the "
                        "next (its CPU never issued it: elsewhere in the code, or dead; nothing it printed tells which)")
    if desync.never_joined:
        evidence.append(f"the desync report: ranks {', '.join(map(str, sorted(desync.never_joined)))} never joined "
                        "any collective")
    missing = []
    if not (desync.not_joined or desync.not_finished or desync.never_joined):
        missing.append("the flight recorder's dumps (TORCH_NCCL_TRACE_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1; "
                       "logdx --fr-dumps) or the desync report (TORCH_NCCL_DESYNC_DEBUG=1): which rank never joined, "
                       "which joined and never finished")
    if not any(k[:1] == "r" and k[1:].isdigit() for k in summary.progress.last_work):
        missing.append("every rank's output prefixed with its rank (torchrun --tee 3 or --local-ranks-filter, srun "
                       "--label): which rank went on printing while the others waited")
    missing.append("py-spy dump of each rank at the hang (or faulthandler): where each process sits")
    ranks = sorted(set(desync.never_joined) | set(desync.not_joined))
    return TimeoutVerdict("unknown", evidence=evidence or ["collective timeouts with no op, size or rank to compare"],
                          missing=missing, ranks=ranks, hosts=_hosts(ranks, summary))


def _clip(text: str, limit: int = 160) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- what the class does to the verdict ---------------------------------------------------------------------


def relabel(winner: Finding, role: Role | None, verdict: TimeoutVerdict, att: Attribution,
            summary: CompressionSummary) -> Relabelled | None:
    """A timeout verdict whose cause is the code's or the config's takes the class's label and action, and its
    culprit ranks; nothing to cordon. None: the verdict stands (a precise root cause, or a class without a label)."""
    spec = verdict.spec
    if spec.failure_type is None or not _is_timeout_verdict(winner, role):
        return None
    category = category_of(spec.failure_type)
    if category is None:  # the taxonomy checks its classes' types at load
        return None
    action = spec.action or winner.hit.label.action
    hit = replace(winner.hit, rule_id=f"timeout-{verdict.cause.replace('_', '-')}", pack="timeouts",
                  title=f"Collective timeout: {spec.title}", role=Role.ROOT_CAUSE,
                  label=Label(category, spec.failure_type, action), severity=Severity.HIGH,
                  confidence=0.8, hint=verdict.hint, hint_rule=None)
    ranks = verdict.ranks or att.ranks
    new_att = Attribution(hosts=verdict.hosts if verdict.ranks else att.hosts, ranks=ranks,
                          basis=f"the timeout's cause ({verdict.cause}): " + "; ".join(verdict.evidence[:1]),
                          notes=[f"no node to blame: {spec.title}"])
    verdict.decided = True
    return Relabelled(hit=hit, ranks=set(ranks), hosts=set(new_att.hosts), role=Role.ROOT_CAUSE, attribution=new_att)
