"""What a job's flight-recorder dumps say about a hang, per process group.

Every rank records, per group, the collectives it entered, numbered by `collective_seq_id`: the
same number on every rank for the same collective. A member whose dump stops below the others'
never entered the next collective, and the ranks that did wait in it forever; the first such
number is where the group stands (the CPUs enqueue collectives ahead of their GPUs, so ranks that
entered it may have queued more behind it). When every rank entered the same collectives, the
group stands at the first one not every rank finished. At each number the ranks must have called
the same operation on the same sizes: the first number where they did not is a desync
(`mismatch`). A rank missing from a stuck collective that waits in no collective of any group is
outside all of them: the silent rank of the hang.

Membership comes from the dumps' `pg_config`; when a dump does not have it (gloo's recorder in
torch 2.13 writes an empty one), the default group is every rank up to the highest known, and
another group is the ranks that recorded it."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from logdx.flightrec.model import FrEntry, FrFindings, PgFindings, RankLast, RankTrace, rank_ranges

__all__ = ["analyse", "culprits_of"]

# Collectives whose per-rank sizes legitimately differ (torch's fr_trace skips the same checks).
_INPUTS_DIFFER = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall", "alltoall_base", "scatter",
                  "all_gather_v", "reduce_scatter_v"}
_OUTPUTS_DIFFER = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall", "alltoall_base", "gather",
                   "all_gather_v", "reduce_scatter_v"}
_MAX_MISSING_LASTS = 64

_Sig = tuple[tuple[object, ...], ...]
_GroupKey = tuple[str, tuple[int, ...] | None]


def _kind(op: str) -> str:
    return op.partition(":")[2].split(" ")[0] if ":" in op else op.split(" ")[0]


def _signature(entries: list[FrEntry]) -> _Sig:
    """What must agree across ranks at one sequence number: the operations, their sizes and dtypes."""
    sig: list[tuple[object, ...]] = []
    for e in entries:
        kind = _kind(e.op)
        ins = None if kind in _INPUTS_DIFFER else e.input_sizes
        outs = None if kind in _OUTPUTS_DIFFER else e.output_sizes
        in_dt = None if kind in ("scatter", "broadcast") or not any(e.input_sizes) else frozenset(e.input_dtypes)
        out_dt = None if kind == "gather" or not any(e.output_sizes) else frozenset(e.output_dtypes)
        sig.append((kind, ins, outs, in_dt, out_dt))
    return tuple(sig)


def _op_label(entries: list[FrEntry]) -> str:
    names = list(dict.fromkeys(e.op for e in entries))
    return "+".join(names[:3]) + ("+..." if len(names) > 3 else "")


@dataclass
class _Group:
    name: str
    desc: str
    members: set[int] | None            # None: not in any pg_config
    recorded_by: set[int] = field(default_factory=set)
    # rank -> seq -> the rank's entries at that seq (several when coalesced)
    by_seq: dict[int, dict[int, list[FrEntry]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    p2p: dict[int, list[FrEntry]] = field(default_factory=lambda: defaultdict(list))


def analyse(traces: Sequence[RankTrace]) -> FrFindings:
    """Per process group: the collective it stands at, the ranks missing from it, those waiting in
    it, the earliest desync; and the ranks outside every collective (the culprits). `traces` is
    what `load_dumps` returned (its skipped files become notes and ranks without a dump)."""
    notes = list(getattr(traces, "notes", []))
    skipped = list(getattr(traces, "skipped", []))
    for s in skipped[:8]:
        notes.append(f"skipped: {s.reason}")
    if len(skipped) > 8:
        notes.append(f"... and {len(skipped) - 8} more unreadable dumps")
    dumped = {t.rank: t for t in traces}
    groups = _collect(traces, notes)
    known = {*dumped, *(s.rank for s in skipped if s.rank is not None)}
    findings = [_findings(g, dumped, known) for g in groups.values()]
    inferred = sorted(f.label for f in findings if not f.members_known and f.pg_desc != "default_pg")
    if inferred:
        notes.append("membership not in the dumps' pg_config, taken from the ranks that recorded it: "
                     + ", ".join(inferred[:6]) + (" ..." if len(inferred) > 6 else ""))
    empty = sorted(r for r, t in dumped.items() if not t.entries)
    if empty:
        notes.append(f"rank{'s' if len(empty) > 1 else ''} {rank_ranges(empty)} dumped no entries (the recorder off "
                     "there, TORCH_FR_BUFFER_SIZE=0? or only active entries dumped and none pending)")
    notes.extend(_version_notes(traces))
    culprits, basis_no_dump = culprits_of(findings)
    findings.sort(key=lambda f: _order(f, culprits))
    if basis_no_dump:
        notes.insert(0, f"{'rank' if len(culprits) == 1 else 'ranks'} {rank_ranges(culprits)} left no dump "
                        "while every rank with one waits: look there first")
    return FrFindings(
        groups=findings, ranks=tuple(sorted(dumped)), culprit_ranks=() if basis_no_dump else culprits,
        source="dumps", notes=notes, versions=tuple(sorted({t.version for t in traces if t.version})),
    )


def _collect(traces: Sequence[RankTrace], notes: list[str]) -> dict[_GroupKey, _Group]:
    configured: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for t in traces:
        for cfg in t.pg_config.values():
            if cfg.ranks:
                configured[cfg.name].add(cfg.ranks)
    groups: dict[_GroupKey, _Group] = {}
    descs: dict[_GroupKey, Counter[str]] = defaultdict(Counter)
    for t in traces:
        for e in t.entries:
            key = _key_of(e.pg_name, t, configured)
            g = groups.get(key)
            if g is None:
                members = set(key[1]) if key[1] is not None else None
                g = groups[key] = _Group(e.pg_name, e.pg_desc, members)
            g.recorded_by.add(t.rank)
            if e.pg_desc:
                descs[key][e.pg_desc] += 1
            if e.is_p2p:
                g.p2p[t.rank].append(e)
            else:
                g.by_seq[t.rank][e.seq].append(e)
    for key, g in groups.items():
        if descs[key]:
            g.desc = descs[key].most_common(1)[0][0]
        if g.members is not None and not g.recorded_by <= g.members:
            strays = sorted(g.recorded_by - g.members)
            notes.append(f"pg {g.name}: ranks {rank_ranges(strays)} recorded it but are not in its pg_config")
    return groups


def _key_of(name: str, t: RankTrace, configured: dict[str, set[tuple[int, ...]]]) -> _GroupKey:
    """Groups are named alike on every rank; split groups can reuse a name for different rank sets,
    told apart by the rank's own pg_config."""
    sets = configured.get(name)
    if not sets:
        return (name, None)
    if len(sets) == 1:
        return (name, next(iter(sets)))
    own = t.pg_config.get(name)
    if own is not None and own.ranks:
        return (name, own.ranks)
    containing = [s for s in sets if t.rank in s]
    return (name, containing[0] if len(containing) == 1 else None)


def _members(g: _Group, known: set[int]) -> tuple[set[int], bool]:
    """The group's ranks: from pg_config; else, for the default group, every rank up to the highest
    known (global ranks are 0..world-1: a hole is a rank whose dump is missing) as long as the
    numbering is dense; else the ranks that recorded the group."""
    if g.members is not None:
        return g.members, True
    if g.desc == "default_pg" and known:
        top = max(known)
        return (set(range(top + 1)) if top < 2 * len(known) + 64 else set(known)) | g.recorded_by, False
    return set(g.recorded_by), False


def _findings(g: _Group, dumped: dict[int, RankTrace], known_ranks: set[int]) -> PgFindings:
    members, known = _members(g, known_ranks)
    have = sorted(r for r in members if r in dumped)
    last = {r: max(g.by_seq[r]) if g.by_seq.get(r) else None for r in have}
    reached = [s for s in last.values() if s is not None]
    f = PgFindings(pg_name=g.name, pg_desc=g.desc, ranks=tuple(sorted(members)), seq=None, stuck_op=None,
                   no_dump_ranks=tuple(sorted(members - set(dumped))), members_known=known,
                   max_seq=max(reached) if reached else None)
    f.p2p_waiting = _p2p_waiting(g, have)
    if not reached:
        return f
    seq = f.seq = _stuck_seq(g, last)
    at_seq = {r: g.by_seq[r][seq] for r in have if (lr := last[r]) is not None and lr >= seq and seq in g.by_seq[r]}
    if not at_seq:  # numbering with holes (no dump torch wrote has them): report the ranks behind
        f.missing_ranks = tuple(r for r in have if (lr := last[r]) is None or lr < seq)
        return f
    sigs = Counter(_signature(es) for es in at_seq.values())
    common = sigs.most_common(1)[0][0]
    sample = next(es for es in at_seq.values() if _signature(es) == common)
    f.stuck_op = _op_label(sample)
    f.input_sizes, f.output_sizes = sample[0].input_sizes, sample[0].output_sizes
    f.stack = sample[-1].frames or sample[0].frames
    f.missing_ranks = tuple(r for r in have if (lr := last[r]) is None or lr < seq)
    # Nobody completes a collective a member never entered: with a rank missing, every rank in it
    # waits (gloo retires a collective that failed on a timeout as if it had finished).
    f.waiting_ranks = tuple(r for r, es in at_seq.items() if f.missing_ranks or not all(e.done for e in es))
    f.not_started_ranks = _not_started(g, at_seq)
    created = [e.time_created_ns for es in at_seq.values() for e in es if e.time_created_ns]
    f.stuck_since_ns = min(created) if created else None
    for r in f.missing_ranks[:_MAX_MISSING_LASTS]:
        f.last_of_missing[r] = _rank_last(g, r, last[r])
    _find_mismatch(g, have, f.max_seq or seq, f)
    return f


def _stuck_seq(g: _Group, last: dict[int, int | None]) -> int:
    """The collective the group stands at. The CPU enqueues collectives ahead of the GPU (NCCL is
    asynchronous), so ranks' last entries differ by how far each ran ahead: the one that matters is
    the first that not every rank entered. When all entered the same, the first not finished on
    every rank (the others queue behind it); when all finished, the last."""
    reached = [s for s in last.values() if s is not None]
    low, top = min(reached), max(reached)
    if low < top:
        return low + 1
    ranks = [r for r, s in last.items() if s is not None]
    start = max(min(g.by_seq[r]) for r in ranks)
    for s in _seqs_between(g, ranks, start, top):
        if any(s in g.by_seq[r] and not all(e.done for e in g.by_seq[r][s]) for r in ranks):
            return s
    return top


def _seqs_between(g: _Group, ranks: list[int], start: int, stop: int) -> list[int]:
    """The sequence numbers recorded from `start` to `stop`, ascending (never a range: a dump may hold
    any numbers)."""
    return sorted({s for r in ranks for s in g.by_seq[r] if start <= s <= stop})


def _rank_last(g: _Group, rank: int, seq: int | None) -> RankLast:
    if seq is None:
        return RankLast(rank, None)
    es = g.by_seq[rank][seq]
    return RankLast(rank, seq, _op_label(es), es[-1].state, all(e.done for e in es), es[0].time_created_ns)


def _not_started(g: _Group, at_seq: dict[int, list[FrEntry]]) -> tuple[int, ...]:
    """Ranks whose entry of the stuck collective is still "scheduled" while others' "started": their
    kernel never launched (the stream is blocked by something before it). Only where the backend
    reports starts (NCCL with events); gloo leaves every entry "scheduled"."""
    started = {r for r, es in at_seq.items() if any(e.state in ("started", "completed") for e in es)}
    if not started or len(started) == len(at_seq):
        return ()
    return tuple(sorted(r for r, es in at_seq.items() if r not in started and not all(e.done for e in es)))


def _p2p_waiting(g: _Group, have: list[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in have:
        pending = [e for e in g.p2p.get(r, ()) if not e.done]
        if pending:
            e = pending[-1]
            out[r] = f"{e.op} (p2p #{e.p2p_seq})"
    return out


def _find_mismatch(g: _Group, have: list[int], seq: int, f: PgFindings) -> None:
    """The earliest sequence number, among those every rank's dump still covers, where the ranks'
    operations, sizes or dtypes differ."""
    present = [r for r in have if g.by_seq.get(r)]
    if len(present) < 2:
        return
    start = max(min(g.by_seq[r]) for r in present)
    for s in _seqs_between(g, present, start, seq):
        by_sig: dict[_Sig, list[int]] = defaultdict(list)
        entries: dict[_Sig, list[FrEntry]] = {}
        for r in present:
            es = g.by_seq[r].get(s)
            if es:
                sig = _signature(es)
                by_sig[sig].append(r)
                entries.setdefault(sig, es)
        if len(by_sig) > 1:
            f.mismatch_seq = s
            f.mismatch, f.mismatch_ranks = _describe_mismatch(s, by_sig, entries)
            return


def _describe_mismatch(s: int, by_sig: dict[_Sig, list[int]], entries: dict[_Sig, list[FrEntry]]
                       ) -> tuple[str, tuple[int, ...]]:
    ordered = sorted(by_sig, key=lambda sig: (-len(by_sig[sig]), min(by_sig[sig])))
    major, minors = ordered[0], ordered[1:]
    minority = tuple(sorted(r for sig in minors for r in by_sig[sig]))
    tie = len(by_sig[major]) == len(by_sig[minors[0]])
    a, b = entries[major], entries[minors[0]]
    what, major_val, minor_val = _difference(a, b)
    minor_ranks = _phrase(by_sig[minors[0]])
    major_ranks = _phrase(by_sig[major]) if tie or len(minors) > 1 else (
        f"the other {len(by_sig[major])} ranks" if len(by_sig[major]) > 1 else _phrase(by_sig[major]))
    extra = f" (and {len(minors) - 1} more variants)" if len(minors) > 1 else ""
    if what == "op":
        text = f"at #{s}: {minor_ranks} called {minor_val}, {major_ranks} {major_val}{extra}"
    else:
        text = f"at #{s} {_op_label(a)}: {minor_ranks} with {what} {minor_val}, {major_ranks} {major_val}{extra}"
    return text, minority


def _difference(a: list[FrEntry], b: list[FrEntry]) -> tuple[str, str, str]:
    if [_kind(e.op) for e in a] != [_kind(e.op) for e in b]:
        return "op", _op_label(a), _op_label(b)
    for ea, eb in zip(a, b):
        if ea.input_sizes != eb.input_sizes and _kind(ea.op) not in _INPUTS_DIFFER:
            return "input sizes", _sz(ea.input_sizes), _sz(eb.input_sizes)
        if ea.output_sizes != eb.output_sizes and _kind(ea.op) not in _OUTPUTS_DIFFER:
            return "output sizes", _sz(ea.output_sizes), _sz(eb.output_sizes)
        if set(ea.input_dtypes) != set(eb.input_dtypes) or set(ea.output_dtypes) != set(eb.output_dtypes):
            return "dtypes", "/".join(sorted(set(ea.input_dtypes) | set(ea.output_dtypes))), \
                "/".join(sorted(set(eb.input_dtypes) | set(eb.output_dtypes)))
    return "op", _op_label(a), _op_label(b)


def _sz(sizes: tuple[tuple[int, ...], ...]) -> str:
    return str([list(s) for s in sizes])


def _phrase(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


def culprits_of(findings: list[PgFindings]) -> tuple[tuple[int, ...], bool]:
    """Ranks missing from a stuck collective that wait in no collective anywhere; failing those, the
    ranks of stuck groups without a dump when every dumped member waits (second value True)."""
    stuck = [f for f in findings if f.missing_ranks or f.waiting_ranks]
    busy = {r for f in findings for r in (*f.waiting_ranks, *f.p2p_waiting)}
    outside = sorted({r for f in stuck for r in f.missing_ranks} - busy)
    if outside:
        return tuple(outside), False
    if stuck and all(not f.missing_ranks for f in stuck):
        silent = sorted({r for f in stuck if f.waiting_ranks for r in f.no_dump_ranks})
        if silent:
            return tuple(silent), True
    return (), False


def _order(f: PgFindings, culprits: tuple[int, ...]) -> tuple[object, ...]:
    """Stuck groups first, those that blame a culprit before the others, the longest stuck first;
    then the rest by name ("2" before "10")."""
    name = (int(f.pg_name), "") if f.pg_name.isdigit() else (1 << 62, f.pg_name)
    if not f.stuck:
        return (1, name)
    blames = bool(set(f.missing_ranks) & set(culprits)) or bool(set(f.no_dump_ranks) & set(culprits))
    return (0, not blames, f.stuck_since_ns is None, f.stuck_since_ns or 0, name)


def _version_notes(traces: Sequence[RankTrace]) -> list[str]:
    versions = Counter(t.version for t in traces)
    notes: list[str] = []
    if len(versions) > 1:
        notes.append("the dumps come from different torch versions (" + ", ".join(
            f"{v or 'none'} on {n} ranks" for v, n in versions.most_common(4)) + "): two jobs mixed?")
    for v in versions:
        major = v.partition(".")[0]
        if major.isdigit() and int(major) > 2:
            notes.append(f"dump format {v} is newer than the 2.x this reader knows: fields read by name")
    return notes
