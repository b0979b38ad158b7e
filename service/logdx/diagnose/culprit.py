"""Who is to blame: the node, rank and GPU behind a root cause, and only what the log shows.

A culprit host comes from the root line itself (its own prefix, the stream it arrived on, or a host
it names), or from an explicit link: the rank's own lines name its host, the same pid, a GPU address
that exists on exactly one host of the job, the silent or lagging rank of a hang, a job its
scheduler ran on one node only (PBS "Exec host:", SLURM_JOB_NODELIST, LSF "executed on host(s)"). It is never
borrowed from a nearby line of another process: a victim's "failed (exitcode: -6)" names the victim.
Every name is checked to be one plain host name, and one of the job's hosts when the job shows any.

A cordon needs more than a name: the attribution is *corroborated* when the blamed host printed
the hardware line itself, or when the blamed rank is the one that stopped (went silent, or made no
progress after the fault). A name that arrives only inside message text is not enough: any
training script can print "Node failure on gpu-007".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from logdx.diagnose.life import stopped_by_output, stopped_by_progress
from logdx.diagnose.rules.compiled import RuleHit
from logdx.hosts import clean_hostname, job_host_in_name
from logdx.model import FT, Attribution, CompressionSummary, Event, EventKind, Role
from logdx.patterns import QUOTED_KERNEL_LINE, pci_key


class Finding(Protocol):
    """What the attribution reads of a finding (`rootcause.Finding`, whose module imports this one: naming
    it here was an import circle): the event, the rule's hit, and the ranks, hosts and collectives seen."""

    @property
    def event(self) -> Event: ...

    @property
    def hit(self) -> RuleHit: ...

    @property
    def ranks(self) -> set[int]: ...

    @property
    def hosts(self) -> set[str]: ...

    @property
    def seq_by_rank(self) -> dict[int, int]: ...

__all__ = ["HANG_BASES", "HANG_OUTPUT_BASIS", "STUCK_IN_KERNEL", "UNVERIFIED", "HangCulprit", "StuckProcess", "attribute",
           "blames_one_node", "hang_culprit", "stuck_in_kernel", "verify_hosts", "with_stuck"]

# A job this small with no host name anywhere is one machine's log: the machine is blamed, unnamed.
_SINGLE_NODE_MAX_RANKS = 8
_WHOLE_NODE_FAILURES = frozenset({FT.NODE_FAILURE})  # every rank on the host went down with it
_LAUNCHER_KINDS = frozenset({EventKind.SIGNAL_EXIT, EventKind.CHILD_FAILED})
_REFUSED_NAME = "refused"  # the root line names its host in a form that is no single host name


def attribute(
    winner: Finding | None, role: Role | None, findings: Sequence[Finding], summary: CompressionSummary
) -> Attribution:
    if winner is None:
        return Attribution()
    if role == Role.SYMPTOM:
        return _silent_or_lagging(findings, summary)
    if winner.event.kind == EventKind.LOSS_SPIKE:
        # The loss is the whole run's, printed by whichever rank logs it (rank 0, the last pipeline
        # stage): that rank's host is no more to blame than any other.
        return Attribution(notes=["a loss that diverged is the run's, not one node's: no culprit"])
    return _from_root(winner, findings, summary)


# -- a root cause ------------------------------------------------------------------------------------


def _from_root(winner: Finding, findings: Sequence[Finding], summary: CompressionSummary) -> Attribution:
    hit = winner.hit
    out = Attribution(gpus=[hit.gpu] if hit.gpu else [])
    host, basis = _host_of_root(winner, summary, out)
    if basis == _REFUSED_NAME:
        # The line says which machine(s) failed, in a form that is no one host (a range, a list, a
        # glob): no other signal may stand in for it, least of all the host that printed the line.
        out.notes.append("the root line names its node as a range, list or pattern, not one host: no culprit")
        return Attribution(gpus=out.gpus, notes=out.notes)
    rank = hit.rank
    if host is None and rank is not None and rank in summary.rank_hosts:
        host = _checked(summary.rank_hosts[rank], summary, out, trusted=True)
        basis = "srun's error on the task names its node" if summary.srun_task_hosts.get(rank) == host \
            else "the rank's own lines name its host"
    if host is None and rank is None:
        host, rank, basis = _from_section(winner.event, summary)
    if host is None and rank is None:
        host, rank, basis = _linked(winner, findings, summary)
    if host is None and len(summary.allocated_hosts) == 1:
        host = _checked(summary.allocated_hosts[0], summary, out, trusted=False)
        basis = "the job's only node, as its scheduler allocated it" if host else basis
    if host is not None and rank is None:
        rank = _rank_on_host(host, hit.gpu, winner.event, summary)
    ranks = set(winner.ranks) | ({rank} if rank is not None else set())
    if host is not None and hit.label.failure_type in _WHOLE_NODE_FAILURES:
        ranks |= {r for r, h in summary.rank_hosts.items() if h == host}
    if 1 < summary.world_size <= len(ranks):
        out.notes.append("every rank failed alike: no single node or rank is to blame")
        return Attribution(gpus=out.gpus, notes=out.notes)
    hosts = {host} if host else set()
    # The same failure folded from other lines (the same Xid on two nodes): their hosts count too.
    hosts |= {h for h in (_checked(h, summary, out, trusted=False) for h in winner.hosts - hosts) if h}
    hosts |= {summary.rank_hosts[r] for r in ranks if r in summary.rank_hosts}
    if hosts and not basis:
        basis = "the failing lines' own hosts"
    out.hosts, out.ranks = sorted(hosts), sorted(ranks)
    out.basis = basis if hosts else ("the rank's own line" if len(ranks) == 1 and hit.line.rank is not None else "")
    out.single_node = not hosts and _one_unnamed_machine(summary)
    out.corroborated = _corroborated(winner, out, basis, findings, summary)
    if not hosts:
        out.notes.append(_why_no_host(winner, out, summary))
    return out


def _host_of_root(winner: Finding, summary: CompressionSummary, out: Attribution) -> tuple[str | None, str]:
    """A host the root line names in its text, else the host of its own prefix or stream."""
    hit = winner.hit
    named = hit.groups.get("host")
    if named:
        host = _checked(named, summary, out, trusted=named == hit.line.host)
        if host is not None:
            return host, "named in the root line"
        if clean_hostname(named) is None:
            return None, _REFUSED_NAME
    quoted = QUOTED_KERNEL_LINE.search(hit.line.text)
    if quoted is not None and quoted.group("host") != hit.line.host:  # its own host's line: the basis below
        host = _checked(quoted.group("host"), summary, out, trusted=False)
        if host is not None:
            return host, "the kernel line the root line quotes names its host"
    field = winner.event.attrs.get("named_host")
    if isinstance(field, str) and field:  # detect sets it from a regex group: always a str
        host = _checked(field, summary, out, trusted=False)
        if host is not None:
            return host, "named in the root message's own host field"
        if clean_hostname(field) is None:
            return None, _REFUSED_NAME
    if hit.line.host:
        host = _checked(hit.line.host, summary, out, trusted=True)
        if host is not None:
            if _in_failure_box(hit.line.line_no, hit.line.host, summary):
                return host, "torchrun's failure summary names its rank and host"
            return host, "the root line's own host (prefix or stream)"
    return None, ""


def _in_failure_box(line_no: int, host: str, summary: CompressionSummary) -> bool:
    return any(first <= line_no <= last and box_host == host for first, last, _, box_host in summary.failure_boxes)


def _one_unnamed_machine(summary: CompressionSummary) -> bool:
    """No host anywhere and no more ranks than one machine has GPUs: the log is one machine's."""
    return not summary.hosts and summary.world_size <= _SINGLE_NODE_MAX_RANKS


def _checked(name: str, summary: CompressionSummary, out: Attribution, *, trusted: bool) -> str | None:
    """`name` when it is one plain host name, and (unless it comes from a prefix or stream, which
    is how the job's host set is known) one of the job's hosts when the job shows any."""
    host = clean_hostname(name)
    if host is None:
        out.notes.append(f"ignored culprit {name[:80]!r}: not a single plain host name")
        return None
    if not trusted and summary.hosts and host not in summary.hosts:
        out.notes.append(f"ignored culprit {host!r}: not one of the job's hosts ({len(summary.hosts)} seen)")
        return None
    return host


def _linked(winner: Finding, findings: Sequence[Finding], summary: CompressionSummary) -> tuple[str | None, int | None, str]:
    """A line that names no process (a kernel Xid, an anonymous traceback) linked to one host
    explicitly: the same pid, or a GPU address that exists on exactly one host of the job."""
    event = winner.event
    pid = event.attrs.get("pid") or event.anchor.pid
    if pid is not None:
        rank: int | None
        owners = {k.split("|", 1)[0]: r for k, r in summary.gpu_ranks.items() if k.endswith(f"|pid:{pid}")}
        if len(owners) == 1:
            (host, rank), = owners.items()
            return clean_hostname(host), rank, "same pid as the rank's NCCL lines"
        launchers = {
            (f.hit.host, f.hit.rank) for f in findings
            if f is not winner and f.event.kind in _LAUNCHER_KINDS and f.event.attrs.get("pid") == pid and f.hit.host
        }
        if len(launchers) == 1:
            (host, rank), = launchers
            return clean_hostname(host), rank, "same pid as the launcher's exit line"
    gpu = winner.hit.gpu
    if gpu:
        key = f"|bus:{pci_key(gpu)}"
        owners = {k.split("|", 1)[0]: r for k, r in summary.gpu_ranks.items() if k.endswith(key)}
        if len(owners) == 1:
            (host, rank), = owners.items()
            return clean_hostname(host), rank, "GPU address found on one host only"
    return None, None, ""


_SECTION_BASIS = "the section header of its dump names its host"
_NODE_NUMBER = re.compile(r"^(?:node|host) ?#?(\d+)$", re.I)
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def _from_section(event: Event, summary: CompressionSummary) -> tuple[str | None, int | None, str]:
    """A stack dump in a collection of every node's dumps: the host the collection's header names for it (one of
    the job's hosts, never a file's name), and the rank of its pid on that host (pids repeat across nodes)."""
    name = event.attrs.get("section") if event.kind == EventKind.STACK_DUMP else None
    if not isinstance(name, str):
        return None, None, ""
    host = _job_host_named(name, summary)
    if host is None:
        return None, None, ""
    rank = _rank_on_host(host, None, event, summary)
    return host, rank, _SECTION_BASIS + ("; its pid is that rank's on the host" if rank is not None else "")


def _job_host_named(name: str, summary: CompressionSummary) -> str | None:
    """The one job host a header names: the host itself, a file name that holds it (trace-node12.out), or a
    note's "Node 48" when exactly one of the job's hosts is numbered 48."""
    known = (set(summary.hosts) | set(summary.allocated_hosts) | set(summary.rank_hosts.values())
             | set(summary.launcher_hosts))
    host = clean_hostname(name)
    if host is not None and host in known:
        return host
    matched = job_host_in_name(name, known)
    if matched is not None:
        return matched
    if (m := _NODE_NUMBER.match(name)) is not None:
        numbered = {h for h in known if (t := _TRAILING_NUMBER.search(h)) is not None and int(t.group(1)) == int(m.group(1))}
        return numbered.pop() if len(numbered) == 1 else None
    return None


def _rank_on_host(host: str, gpu: str | None, event: Event, summary: CompressionSummary) -> int | None:
    """The rank behind a kernel or NCCL line that names only its host, GPU, process or device."""
    keys = []
    if gpu:
        keys.append(f"{host}|bus:{pci_key(gpu)}")
    pid = event.attrs.get("pid") or event.anchor.pid
    if pid is not None:
        keys.append(f"{host}|pid:{pid}")
    if event.anchor.local_rank is not None:
        keys.append(f"{host}|dev:{event.anchor.local_rank}")
    for key in keys:
        if key in summary.gpu_ranks:
            return summary.gpu_ranks[key]
    return None


def _corroborated(winner: Finding, att: Attribution, basis: str, findings: Sequence[Finding],
                  summary: CompressionSummary) -> bool:
    """A second signal beside the name: the host printed the fault itself, or the blamed rank is
    the one that stopped (silent while the others timed out, or its progress ended first), or it
    reported a cause of its own besides the root line."""
    if att.hosts and winner.hit.line.host in att.hosts and basis.startswith("the root line's own host"):
        return True
    blamed = set(att.ranks)
    if not blamed:
        return False
    if _silent_among_victims(blamed, findings) or _stopped_first(blamed, summary):
        return True
    return any(f is not winner and f.hit.role is not Role.SYMPTOM and f.hit.rank in blamed for f in findings)


def _silent_among_victims(blamed: set[int], findings: Sequence[Finding]) -> bool:
    reporting: set[int] = set()
    for f in findings:
        if f.hit.role is Role.SYMPTOM:
            reporting |= f.ranks
    return bool(reporting) and not (blamed & reporting)


def _stopped_first(blamed: set[int], summary: CompressionSummary) -> bool:
    last = {k: v for k, v in summary.last_progress_line.items() if k.startswith("r")}
    mine = [last[f"r{r}"] for r in blamed if f"r{r}" in last]
    others = [v for k, v in last.items() if int(k[1:]) not in blamed] if all(k[1:].isdigit() for k in last) else []
    return bool(mine and others) and max(mine) < min(others)


def _why_no_host(winner: Finding, att: Attribution, summary: CompressionSummary) -> str:
    if att.single_node:
        return "the culprit node is the one machine that wrote this log; its name is not in the log"
    section = winner.event.attrs.get("section") if winner.event.kind == EventKind.STACK_DUMP else None
    if isinstance(section, str):
        return f"the dump's section header {section[:80]!r} names none of the job's hosts: no host taken from it"
    if att.ranks and len(att.ranks) == 1:
        return f"the culprit is rank {att.ranks[0]}, but no line names the host it ran on"
    if summary.hosts:
        return ("the root line names no host and nothing links it to one of the job's "
                f"{len(summary.hosts)} hosts explicitly (same pid, a GPU address on one host only)")
    return "no line names the host the failure happened on"


# -- only symptoms: a hang ----------------------------------------------------------------------------

_MIN_WORLD_FOR_SILENT = 4
_LAGGING = "the rank lagging in collective sequence numbers"
_SILENT = "the silent rank, missing from the watchdogs' reports"
_PROGRESS = "its training progress stopped before the other ranks'"
_OUTPUT = HANG_OUTPUT_BASIS = "it fell silent while the other ranks went on"
# How a hang's culprit can be told. The first three are independent observations of the rank; output
# that stops says little alone (a rank may just have nothing to print) and corroborates nothing.
HANG_BASES = frozenset({_LAGGING, _SILENT, _PROGRESS, _OUTPUT})
_INDEPENDENT = (_LAGGING, _SILENT, _PROGRESS)
_WAITED_FOR_LAG = 0.5  # the others waited in a collective: one logging interval behind them is behind


@dataclass(slots=True)
class HangCulprit:
    """The rank(s) the others waited for, and which signals name them."""

    attribution: Attribution
    signals: list[str]  # the independent signals that name exactly these ranks (HANG_BASES)


def hang_culprit(findings: Sequence[Finding], summary: CompressionSummary) -> HangCulprit:
    """Each signal names its ranks; the ranks named by most independent signals are the culprit, and
    two that agree corroborate it (enough to name its node for a cordon). Output that stopped first
    names a culprit only when no independent signal names any."""
    reporting: set[int] = set()
    seq_by_rank: dict[int, int] = {}
    for f in findings:
        if f.hit.role == Role.SYMPTOM:
            reporting |= f.ranks
            seq_by_rank.update(f.seq_by_rank)
    progress = stopped_by_progress(summary, min_lag=_WAITED_FOR_LAG)
    named = {_LAGGING: _lagging(seq_by_rank), _SILENT: _silent(reporting, summary),
             _PROGRESS: progress.ranks if progress is not None else []}
    groups: dict[tuple[int, ...], list[str]] = {}
    for basis in _INDEPENDENT:
        if named[basis]:
            groups.setdefault(tuple(named[basis]), []).append(basis)
    if groups:
        ranks, signals = max(groups.items(), key=lambda kv: len(kv[1]))  # ties: the first signal's (in order)
    elif (output := stopped_by_output(summary)) is not None:
        ranks, signals = tuple(output.ranks), [_OUTPUT]
    else:
        return HangCulprit(Attribution(single_node=_one_unnamed_machine(summary),
                                       notes=["only symptoms, and no silent or lagging rank to point at"]), [])
    hosts = sorted({h for r in ranks if r in summary.rank_hosts if (h := clean_hostname(summary.rank_hosts[r]))})
    corroborated = len([b for b in signals if b in _INDEPENDENT]) >= 2
    notes = [] if corroborated else [f"one signal only ({signals[0]}): the rank is named, its node not blamed"]
    return HangCulprit(Attribution(hosts=hosts, ranks=list(ranks), basis="; ".join(signals), corroborated=corroborated,
                                   notes=notes), signals)


def _silent_or_lagging(findings: Sequence[Finding], summary: CompressionSummary) -> Attribution:
    return hang_culprit(findings, summary).attribution


def _silent(reporting: set[int], summary: CompressionSummary) -> list[int]:
    world = summary.world_size
    if world < _MIN_WORLD_FOR_SILENT or not reporting:
        return []  # one of two ranks not reporting is as likely an excerpt cut short as a silent rank
    silent = sorted(set(range(world)) - reporting)
    # Only a few silent ranks point at a culprit; half the job silent says nothing.
    return silent if 0 < len(silent) <= max(1, world // 8) else []


def _lagging(seq_by_rank: dict[int, int]) -> list[int]:
    if len(set(seq_by_rank.values())) < 2:
        return []
    low = min(seq_by_rank.values())
    counts = Counter(seq_by_rank.values())
    if counts[low] > len(seq_by_rank) // 2:
        return []
    return sorted(r for r, s in seq_by_rank.items() if s == low)


# -- a process in uninterruptible sleep ---------------------------------------------------------------

STUCK_IN_KERNEL = "ps shows its process in uninterruptible sleep (D state)"


@dataclass(slots=True)
class StuckProcess:
    """A process of the job `ps` showed in state D, with its host and rank when the log ties them to it."""

    event: Event
    host: str | None
    rank: int | None

    def describe(self) -> str:
        pid, wchan = self.event.attrs.get("pid"), self.event.attrs.get("wchan")
        who = f"pid {pid}" + (f" (rank {self.rank})" if self.rank is not None else "")
        where = f" on {self.host}" if self.host else ""
        waits = f", waiting in the kernel's {wchan}" if wchan else ""
        return f"{who}{where} is in uninterruptible sleep (state {self.event.attrs.get('state')}{waits})"


def stuck_in_kernel(events: Sequence[Event], summary: CompressionSummary) -> list[StuckProcess]:
    """The job's processes `ps` printed in state D: a rank's pid, or a Python process (a DataLoader worker is
    one too), each with the host of its line (a prefix, its stream, the listing's section header when that is
    one of the job's hosts, a pid NCCL saw on one host only) and its rank on that host."""
    out = []
    seen: set[tuple[object, object, object]] = set()
    for ev in events:
        if ev.kind != EventKind.PROCESS_STATE:
            continue
        host = clean_hostname(ev.anchor.host) if ev.anchor.host else None
        section = ev.attrs.get("section")
        if host is None and isinstance(section, str):
            host = _job_host_named(section, summary)
        rank = _rank_on_host(host, None, ev, summary) if host is not None else None
        if host is None:
            owners = {k.split("|", 1)[0]: r for k, r in summary.gpu_ranks.items() if k.endswith(f"|pid:{ev.attrs.get('pid')}")}
            if len(owners) == 1:
                (named, rank), = owners.items()
                host = clean_hostname(named)
        command = str(ev.attrs.get("command", "")).lower()
        who = (host, section if host is None else None, ev.attrs.get("pid"))  # ps -L lists a process per thread
        if (rank is not None or "python" in command or "pt_main_thread" in command) and who not in seen:
            seen.add(who)
            out.append(StuckProcess(ev, host, rank))
    return out


def with_stuck(att: Attribution, stuck: Sequence[StuckProcess], findings: Sequence[Finding]) -> Attribution:
    """A hang's culprit with what `ps` showed: a process stuck in the kernel on one host names that host (and its
    rank) when nothing else named one, and corroborates the culprit host it agrees with."""
    hosts = {p.host for p in stuck if p.host}
    if len(hosts) != 1:
        if len(hosts) > 1:
            att.notes.append(f"ps shows processes in uninterruptible sleep on {len(hosts)} hosts: no single host to blame")
        return att
    (host,) = hosts
    if att.hosts == [host]:
        att.corroborated = True
        att.notes = [n for n in att.notes if not n.startswith("one signal only")]
        att.basis = f"{att.basis}; {STUCK_IN_KERNEL}" if att.basis else STUCK_IN_KERNEL
        return att
    if att.hosts:
        att.notes.append(f"ps shows a process in uninterruptible sleep on {host}, not on the culprit's host")
        return att
    ranks = sorted({p.rank for p in stuck if p.host == host and p.rank is not None})
    silent = bool(ranks) and _silent_among_victims(set(ranks), findings)
    return Attribution(hosts=[host], ranks=ranks or list(att.ranks), gpus=att.gpus, basis=STUCK_IN_KERNEL,
                       corroborated=silent, verified=att.verified,
                       notes=[] if silent else [f"one signal only ({STUCK_IN_KERNEL}): its node is named, not blamed"])


UNVERIFIED = "unverified host"


def verify_hosts(att: Attribution, summary: CompressionSummary) -> Attribution:
    """Whether each culprit host was named by a sender that may speak for it. A name that only a tenant's
    shipper, or a token not bound to that host, sent is a claim: the report names it, marked, and nothing may
    cordon it (a node's own credential, a collector the operator runs, or the scheduler must say so)."""
    trusted = summary.trusted_hosts
    if trusted is None or not att.hosts:
        return att
    claimed = [h for h in att.hosts if h not in trusted]
    if claimed:
        att.verified = False
        att.notes.append(f"{UNVERIFIED} {', '.join(claimed[:4])}: named only by a sender that may not speak for it "
                         "(no node credential, collector or scheduler says the job ran there): reported, never cordoned")
    return att


# An unnamed machine (a one-machine log, a rank's own line) is recommended for a cordon only on a
# precise rule's verdict this sure: the person who reads the report must find the machine by hand.
UNNAMED_CORDON_MIN_CONFIDENCE = 0.8


def blames_one_node(att: Attribution, *, unnamed_ok: bool = True) -> tuple[bool, str]:
    """Whether the log blames exactly one machine, and if not, why not. Only then may a report
    recommend cordoning it: one named host; or, when `unnamed_ok` (a precise rule decided, and is
    sure), one machine the log shows without naming it (a one-machine log, a rank's own line). Whether
    logdx may cordon it on its own also needs a name and a second signal: act/policy.py."""
    if len(att.hosts) > 1:
        return False, f"the failure shows on {len(att.hosts)} hosts ({', '.join(att.hosts[:4])}): no single node to cordon"
    if len(att.hosts) == 1:
        return True, ""
    unnamed = att.single_node or (len(att.ranks) == 1 and att.basis == "the rank's own line")
    if unnamed and unnamed_ok:
        return True, ""
    if unnamed:
        return False, "the log names no node, and the verdict is not a precise rule's sure one: no node to cordon"
    return False, att.notes[-1] if att.notes else "no line names the node"
