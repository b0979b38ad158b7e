"""The shapes of flight-recorder data: one rank's dump as read (`RankTrace`), and what the dumps of a
job say about it (`FrFindings`, one `PgFindings` per process group). Plain dataclasses, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DumpSet", "FrDumpError", "FrEntry", "FrFindings", "FrLimits", "Frame", "PgConfig", "PgFindings",
    "RankTrace", "Skipped", "rank_ranges",
]


class FrDumpError(ValueError):
    """A dump (or a directory of them) that cannot be read; the message names the file and says why."""


@dataclass(frozen=True)
class FrLimits:
    """Bounds on what `load_dumps` reads: dumps come from users, so every size is capped.

    The defaults fit a 16k-GPU job whose dumps hold torch's default 2,000 entries (a rank's dump is
    then about 1 MB): wide enough for real jobs, small enough that a hostile file cannot exhaust memory."""

    max_files: int = 16_384             # dump files read from one directory
    max_dir_entries: int = 200_000      # names looked at while walking the directory
    max_file_bytes: int = 128 << 20     # one dump, after gunzip
    max_total_bytes: int = 4 << 30      # all dumps together
    max_entries_per_file: int = 1_000_000
    keep_entries_per_rank: int = 4_096  # the newest entries of a rank kept for analysis
    max_total_entries: int = 2_000_000  # kept over all ranks (fewer per rank when there are many ranks; ~1.5 GB)
    max_frames_per_entry: int = 64
    max_tensors_per_entry: int = 256    # input/output sizes kept per entry
    max_dims: int = 16
    max_groups_per_rank: int = 65_536
    max_str_chars: int = 4_096          # longer strings (names, paths) are cut
    max_ranks_str_chars: int = 2 << 20  # a group's "ranks" string ("[0, 1, ..., 16383]")


@dataclass(frozen=True, slots=True)
class Frame:
    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.name} at {self.filename}:{self.line}"


@dataclass(frozen=True, slots=True)
class FrEntry:
    """One recorded operation of one rank (one entry of torch's `entries` list)."""

    record_id: int
    pg_name: str                 # process_group[0]: the group's name ("0" for the default group)
    pg_desc: str                 # process_group[1]: "default_pg", "mesh_dp", "undefined"...
    pg_id: int | None            # the backend's uid in this process (not the same across ranks)
    seq: int                     # collective_seq_id (seq_id before format 2.0)
    p2p_seq: int
    op_id: int
    is_p2p: bool
    op: str                      # profiling_name: "nccl:all_reduce", "nccl:send 0->1"...
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    state: str                   # "scheduled" | "started" | "completed" ("" when the dump has none)
    retired: bool | None
    time_created_ns: int | None
    time_started_ns: int | None  # when the watchdog saw it start (time_discovered_started_ns)
    time_completed_ns: int | None
    timeout_ms: int | None
    frames: tuple[Frame, ...] = ()

    @property
    def backend(self) -> str:
        return self.op.partition(":")[0] if ":" in self.op else ""

    @property
    def done(self) -> bool:
        """Finished on this rank. NCCL tracks completion by CUDA events ("completed"); backends without
        events (gloo) leave every entry "scheduled", and retire an entry once its work finished."""
        if self.state == "completed":
            return True
        return self.state in ("scheduled", "") and self.retired is True and self.backend not in ("nccl", "ncclx", "rccl")


@dataclass(frozen=True)
class PgConfig:
    name: str
    desc: str
    ranks: tuple[int, ...] | None   # global ranks of the group; None when the dump does not say


@dataclass
class RankTrace:
    """One rank's flight-recorder dump, as read: its entries (oldest first) and what it says of its
    process groups. `rank` comes from the file name (torch names dumps `<prefix><rank>`)."""

    rank: int
    path: str
    version: str
    fmt: str                                        # "pickle" | "json"
    entries: list[FrEntry]
    pg_config: dict[str, PgConfig] = field(default_factory=dict)
    pg_status: dict[str, dict[str, int]] = field(default_factory=dict)   # pg uid -> last_*_collective
    comm_lib_version: str = ""
    entries_dropped: int = 0                        # older entries not kept (limits)
    size_bytes: int = 0                             # the dump's size as read (after gunzip)


@dataclass(frozen=True)
class Skipped:
    path: str
    rank: int | None
    reason: str


class DumpSet(list[RankTrace]):
    """What `load_dumps` returns: the rank traces (a list), plus the files it could not use."""

    def __init__(self, traces: Iterable[RankTrace] = (), skipped: Iterable[Skipped] = (),
                 notes: Iterable[str] = ()) -> None:
        super().__init__(traces)
        self.skipped: list[Skipped] = list(skipped)
        self.notes: list[str] = list(notes)


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 5, 7, 8] -> "0-3,5,7-8"."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def _ranks_phrase(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + rank_ranges(rs)


def _sizes(sizes: tuple[tuple[int, ...], ...] | None) -> str:
    return "" if sizes is None else str([list(s) for s in sizes])


@dataclass
class RankLast:
    """Where one rank of a group stands: its newest collective in the group."""

    rank: int
    seq: int | None               # None: no collective of this group in its dump
    op: str = ""
    state: str = ""               # "completed", "started", "scheduled" (as the dump says)
    done: bool = False
    time_created_ns: int | None = None

    def describe(self) -> str:
        if self.seq is None:
            return "no record of this group in its dump"
        return f"{self.op} #{self.seq} {'completed' if self.done else self.state or 'in flight'}"


@dataclass
class PgFindings:
    """What the dumps say about one process group.

    `seq` is the collective sequence number the group stands at: the first collective not every
    rank entered (ranks' CPUs enqueue collectives ahead of their GPUs, so the highest number any rank
    reached, `max_seq`, can be past it), else the first not every rank finished, else the last;
    `stuck_op` is the operation at `seq`. `missing_ranks` never entered it (their dumps stop
    earlier), `waiting_ranks` entered it and did not finish; `no_dump_ranks` are members without a
    dump (nothing can be said of them). `mismatch` describes the earliest sequence number at which
    the ranks called different operations, sizes or dtypes (a desync), else None."""

    pg_name: str
    pg_desc: str
    ranks: tuple[int, ...]
    seq: int | None
    stuck_op: str | None
    max_seq: int | None = None                 # the highest sequence number any rank reached
    missing_ranks: tuple[int, ...] = ()
    waiting_ranks: tuple[int, ...] = ()
    no_dump_ranks: tuple[int, ...] = ()
    not_started_ranks: tuple[int, ...] = ()   # entered, but the kernel never started while others' did
    input_sizes: tuple[tuple[int, ...], ...] | None = None
    output_sizes: tuple[tuple[int, ...], ...] | None = None
    mismatch: str | None = None
    mismatch_seq: int | None = None
    mismatch_ranks: tuple[int, ...] = ()       # the minority side of the mismatch
    last_of_missing: dict[int, RankLast] = field(default_factory=dict)
    p2p_waiting: dict[int, str] = field(default_factory=dict)   # rank -> pending send/recv
    members_known: bool = True                 # False: membership guessed from the entries
    stuck_since_ns: int | None = None          # when the first rank entered `seq`
    stack: tuple[Frame, ...] = ()              # where the stuck op was called (one entered rank)

    @property
    def stuck(self) -> bool:
        return bool(self.missing_ranks or self.waiting_ranks or self.mismatch or self.p2p_waiting
                    or self.not_started_ranks)

    @property
    def label(self) -> str:
        desc = self.pg_desc if self.pg_desc and self.pg_desc != "undefined" else ""
        return f"pg {self.pg_name} ({desc})" if desc else f"pg {self.pg_name}"

    def summary(self) -> str:
        """One line an on-call engineer reads: who waits where, who never came."""
        parts: list[str] = []
        op = self.stuck_op or "collective"
        if self.seq is None:
            parts.append("no collective recorded")
        elif self.waiting_ranks:
            # at a desync the minority waits in its own op: the mismatch part names it
            odd = set(self.mismatch_ranks) if self.mismatch_seq == self.seq else set()
            waiting = [r for r in self.waiting_ranks if r not in odd] or list(self.waiting_ranks)
            verb = "waits" if len(waiting) == 1 else "wait"
            parts.append(f"{_ranks_phrase(waiting)} {verb} in {op} #{self.seq}")
        elif not self.missing_ranks and not self.mismatch:
            n = len(self.ranks) - len(self.no_dump_ranks)
            parts.append(f"all {n} ranks with a dump completed {op} #{self.seq}")
        else:
            parts.append(f"the last collective is {op} #{self.seq}")
        if self.missing_ranks:
            parts.append(self._missing_phrase())
        if self.not_started_ranks:
            parts.append(f"it never started on {_ranks_phrase(self.not_started_ranks)} (the others' kernels did)")
        if self.mismatch:
            parts.append(f"mismatch {self.mismatch}")
        if self.p2p_waiting:
            waits = ", ".join(f"rank {r} in {op}" for r, op in sorted(self.p2p_waiting.items())[:4])
            more = len(self.p2p_waiting) - 4
            parts.append(f"p2p waits: {waits}" + (f" and {more} more" if more > 0 else ""))
        if self.no_dump_ranks:
            parts.append(f"{_ranks_phrase(self.no_dump_ranks)} left no dump")
        return f"{self.label}: " + "; ".join(parts)

    def _missing_phrase(self) -> str:
        head = f"{_ranks_phrase(self.missing_ranks)} never entered it"
        lasts = [self.last_of_missing[r] for r in self.missing_ranks if r in self.last_of_missing]
        if not lasts:
            return head
        described = {last.describe() for last in lasts}
        if len(described) == 1:
            own = "its" if len(self.missing_ranks) == 1 else "their"
            return f"{head} ({own} last: {described.pop()})"
        shown = ", ".join(f"rank {last.rank}: {last.describe()}" for last in lasts[:3])
        return f"{head} (last: {shown}{', ...' if len(lasts) > 3 else ''})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "pg_name": self.pg_name, "pg_desc": self.pg_desc, "ranks": list(self.ranks), "seq": self.seq,
            "max_seq": self.max_seq,
            "stuck_op": self.stuck_op, "stuck": self.stuck, "missing_ranks": list(self.missing_ranks),
            "waiting_ranks": list(self.waiting_ranks), "no_dump_ranks": list(self.no_dump_ranks),
            "not_started_ranks": list(self.not_started_ranks),
            "input_sizes": None if self.input_sizes is None else [list(s) for s in self.input_sizes],
            "output_sizes": None if self.output_sizes is None else [list(s) for s in self.output_sizes],
            "mismatch": self.mismatch, "mismatch_seq": self.mismatch_seq, "mismatch_ranks": list(self.mismatch_ranks),
            "last_of_missing": {str(r): last.describe() for r, last in self.last_of_missing.items()},
            "p2p_waiting": {str(r): op for r, op in self.p2p_waiting.items()},
            "members_known": self.members_known, "stuck_since_ns": self.stuck_since_ns,
            "stack": [str(f) for f in self.stack], "summary": self.summary(),
        }


@dataclass
class FrFindings:
    """What a job's flight-recorder dumps (or torch's `fr_trace` report of them) say: one
    `PgFindings` per process group, stuck groups first.

    `culprit_ranks` are the ranks missing from a stuck collective that wait in no collective of any
    group: outside every collective (in the data loader, in I/O, hung on the GPU), the silent ranks
    of the hang. Empty when every missing rank is itself blocked elsewhere, or when all ranks entered
    (then `not_started_ranks` of a group, or the network, is the lead)."""

    groups: list[PgFindings]
    ranks: tuple[int, ...] = ()          # ranks whose dumps were read
    culprit_ranks: tuple[int, ...] = ()
    source: str = "dumps"                # "dumps" | "fr_trace"
    notes: list[str] = field(default_factory=list)
    versions: tuple[str, ...] = ()

    @property
    def stuck_groups(self) -> list[PgFindings]:
        return [g for g in self.groups if g.stuck]

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for r in g.missing_ranks}))

    @property
    def desync_ranks(self) -> tuple[int, ...]:
        """The minority side of every group's earliest mismatch: the ranks whose code path differed."""
        return tuple(sorted({r for g in self.groups for r in g.mismatch_ranks}))

    def summary(self) -> str:
        """The findings as a few lines: the culprit first, then one line per stuck group (or a line
        saying nothing is stuck), then what could not be read."""
        lines: list[str] = []
        if self.culprit_ranks:
            lines.append(f"{_ranks_phrase(self.culprit_ranks)} outside every collective while the others wait: "
                         "the silent rank" + ("" if len(self.culprit_ranks) == 1 else "s") + " of the hang")
        stuck = self.stuck_groups
        lines.extend(g.summary() for g in stuck[:16])
        if len(stuck) > 16:
            lines.append(f"... and {len(stuck) - 16} more stuck groups")
        if not stuck:
            what = "these dumps" if self.source == "dumps" else "this fr_trace report"
            if not self.groups:
                lines.append(f"no collective in {what}")
            elif self.ranks:
                lines.append(f"no process group is stuck in {what} ({len(self.groups)} groups, {len(self.ranks)} ranks)")
            else:
                lines.append(f"no process group is stuck in {what}")
        lines.extend(self.notes[:8])
        if len(self.notes) > 8:
            lines.append(f"... and {len(self.notes) - 8} more notes")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "ranks": list(self.ranks), "culprit_ranks": list(self.culprit_ranks),
            "missing_ranks": list(self.missing_ranks), "desync_ranks": list(self.desync_ranks),
            "versions": list(self.versions),
            "groups": [g.to_dict() for g in self.groups], "notes": list(self.notes), "summary": self.summary(),
        }
