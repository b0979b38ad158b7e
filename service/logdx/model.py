"""The plain data that flows between pipeline stages.

Every stage imports its inputs from here, never from the stage before it, so the pipeline
reads one way: normalize -> compress -> detect -> diagnose -> act.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Category(StrEnum):
    INFRASTRUCTURE = "infrastructure"
    FRAMEWORK = "framework"
    SCRIPT = "script"
    UNKNOWN = "unknown"


class Action(StrEnum):
    CORDON_AND_RESTART = "cordon_and_restart"
    RESTART = "restart"
    NO_RESTART = "no_restart"
    NONE = "none"


class Role(StrEnum):
    """Whether a matched rule names the cause of a failure or one of its echoes."""

    ROOT_CAUSE = "root_cause"
    SYMPTOM = "symptom"
    # Generic fallbacks (an uncategorised exception): a root cause only when nothing precise exists.
    FALLBACK = "fallback"


class Severity(StrEnum):
    """How grave a rule's finding is; the order of the members is the order of gravity (gravest first)."""

    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for the gravest: what sorting by gravity compares."""
        return _SEVERITY_ORDER[self]


_SEVERITY_ORDER = {s: i for i, s in enumerate(Severity)}


class EventKind(StrEnum):
    """What the detect stage saw (`Event.kind`); a rule's `match.kinds` names these."""

    TRACEBACK = "traceback"
    LINE = "line"
    NCCL = "nccl"
    XID = "xid"
    SIGNAL_EXIT = "signal_exit"
    CHILD_FAILED = "child_failed"
    LOSS_NAN = "loss_nan"
    LOSS_SPIKE = "loss_spike"
    STALL = "stall"
    STACK_DUMP = "stack_dump"
    FR_REPORT = "fr_report"
    PROCESS_STATE = "process_state"  # a process `ps` shows in uninterruptible sleep (logdx/procs.py)


# Events the diagnosis reads as a whole (diagnose/hangs.py, culprit.py), never line by line against the rules.
READ_AS_A_WHOLE = frozenset({EventKind.STACK_DUMP, EventKind.FR_REPORT, EventKind.PROCESS_STATE})


# Failure types, and what each implies, are data: see logdx/taxonomy.yaml and logdx.taxonomy.
class FT(StrEnum):
    """The failure types some code names (a hang is decided by code, not by a rule): most of the taxonomy's,
    since code may not spell a type as a string (tests/test_vocabulary.py), and only those
    (tests/test_registries.py fails on a member no module uses).

    Not the list of failure types: that is taxonomy.yaml, and a new type needs no member here unless code
    must name it. The taxonomy refuses to load when a member names a type it does not declare.
    """

    GPU_FELL_OFF_BUS = "gpu_fell_off_bus"
    ECC_ERROR = "ecc_error"
    NVLINK_ERROR = "nvlink_error"
    GPU_HARDWARE_ERROR = "gpu_hardware_error"
    NODE_FAILURE = "node_failure"
    CUDA_ERROR = "cuda_error"
    NETWORK_ERROR = "network_error"
    CONNECTION_ERROR = "connection_error"
    NCCL_TIMEOUT = "nccl_timeout"
    STORAGE_ERROR = "storage_error"
    DISK_FULL = "disk_full"
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"
    HANG = "hang"
    CUDA_OOM = "cuda_oom"
    GPU_MEMORY_TAKEN = "gpu_memory_taken"
    HOST_OOM = "host_oom"
    DATALOADER_KILLED = "dataloader_killed"
    NAN_LOSS = "nan_loss"
    CONFIG_ERROR = "config_error"
    VERSION_MISMATCH = "version_mismatch"
    ENVIRONMENT_ERROR = "environment_error"
    FRAMEWORK_ERROR = "framework_error"
    FRAMEWORK_HANG = "framework_hang"
    SYNTAX_ERROR = "syntax_error"
    IMPORT_ERROR = "import_error"
    NAME_ERROR = "name_error"
    ATTRIBUTE_ERROR = "attribute_error"
    TYPE_ERROR = "type_error"
    KEY_ERROR = "key_error"
    INDEX_ERROR = "index_error"
    VALUE_ERROR = "value_error"
    FILE_NOT_FOUND = "file_not_found"
    PERMISSION_ERROR = "permission_error"
    ARGUMENT_ERROR = "argument_error"
    CALLED_PROCESS_ERROR = "called_process_error"
    SCRIPT_ERROR = "script_error"
    SCRIPT_HANG = "script_hang"
    UNKNOWN = "unknown"



@dataclass(slots=True)
class Record:
    """One log line after normalisation: the message plus what its prefixes told us."""

    line_no: int
    raw: str  # the whole line, sanitised (no ANSI, no NUL, no CR), possibly truncated
    text: str  # the message with launcher/host/rank prefixes stripped
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    ts: float | None = None  # epoch seconds, when the line carried a timestamp
    stream: str | None = None  # "stdout" | "stderr" when known
    truncated: bool = False
    pid: int | None = None  # the writing process, when a prefix names it (NCCL's host:pid:tid)
    # The line's only clock is the kernel's seconds since boot ("[1234.567890] ...", raw dmesg) and no line of
    # its host said when that boot was: its time is unknown, and it is kept out of judgements by time.
    unanchored: bool = False
    # When it was written as far as its stream tells: `ts`, else the time of the line before it in its stream
    # (a traceback's frames, a bare progress bar were written then or just after), and then, once known, the
    # time of its stream's next stamped line (written by then). `ts` stays the line's own stamp.
    at: float | None = None
    until: float | None = None
    feed: int = 0  # which stream it came in on (a file, a shipper's upload for one host or rank): see Session

    @property
    def source_key(self) -> str:
        """Which process wrote the line, as far as we can tell: tracebacks are grouped by this."""
        if self.rank is not None:
            return f"r{self.rank}"
        if self.host is not None:
            return f"h{self.host}:{self.local_rank if self.local_rank is not None else ''}"
        if self.local_rank is not None:
            return f"l{self.local_rank}"
        return "-"


@dataclass(slots=True)
class TemplateStats:
    """What the compressor remembers about one Drain template."""

    template_id: int
    template: str
    count: int = 0
    first_line: int = 0
    last_line: int = 0
    sample: str = ""
    ranks: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    kept: int = 0  # how many of its lines were kept in full
    error_bearing: bool = False


@dataclass(frozen=True, slots=True)
class ProcessState:
    """A row of a `ps` listing printed into the log (logdx/procs.py)."""

    pid: int
    state: str
    command: str
    wchan: str | None = None

    @property
    def uninterruptible(self) -> bool:
        return self.state.startswith("D")

    @property
    def kernel_thread(self) -> bool:
        """ps shows a kernel thread's command in brackets ("[kworker/u8:2]", "[jbd2/sda1-8]")."""
        return self.command.startswith("[")


@dataclass(slots=True)
class KeptLine:
    """A line the compressor kept in full, with the template it belongs to."""

    record: Record
    template_id: int
    reason: str  # "error" | "traceback" | "new_template" | "tail" | "loss" | "stack" | "fr" | "dstate"
    divergence: Divergence | None = None  # reason "loss": the divergence the line began, once confirmed
    section: str | None = None  # reason "stack", "dstate": the name the collection gave it (stacks.section_name)
    process: ProcessState | None = None  # reason "dstate": the process `ps` shows in uninterruptible sleep


@dataclass(slots=True)
class Divergence:
    """Where the loss left its course: a spike that did not come back, NaN/inf, skipped iterations in
    every interval, a gradient-norm blow-up (or, in `recovered_spikes`, one that came back)."""

    kind: str  # "spike" | "nan" | "nan_iterations" | "skipped" | "grad_norm"
    step: float | None
    line_no: int
    loss_before: float | None = None
    loss_after: float | None = None
    rollback_to_step: int | None = None  # the last checkpoint the log says was saved before `step`


@dataclass(slots=True)
class ProgressMark:
    """Where a source (the rank that printed an event) and the whole job were when the event was
    found: the diagnosis compares it with where they ended (did they go on?)."""

    source_advances: int = 0
    source_step: float | None = None
    job_advances: int = 0
    job_rises: int = 0  # how often the job's highest step had risen
    job_step: float | None = None
    job_lines: int = 0
    # Lines without an error word the source, and the whole job, had printed: did the process go on
    # doing its work after an event, in a job that makes no progress (yet)?
    source_quiet: int = 0
    job_quiet: int = 0
    # (source, its advances) of every source printing progress in the event's own stream, whose order of
    # lines is the order they were written in: did the job go on after it, in that stream?
    stream_advances: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class SourceProgress:
    """One rank's (else one host's) training progress."""

    key: str  # Record.source_key
    rank: int | None
    host: str | None
    first_line: int
    last_line: int
    first_step: float | None
    last_step: float | None
    first_ts: float | None
    last_ts: float | None
    lines: int
    advances: int  # progress lines whose counter rose
    steps_per_s: float | None
    step_delta: float | None = None  # the smallest step between two of its progress lines (its logging interval)
    advanced_at: tuple[tuple[float, float], ...] = ()  # (time, step) of its counter's latest rises, by time
    course: tuple[tuple[float, float], ...] = ()  # (time, step) over its whole run by its own clock, decimated


@dataclass(slots=True)
class Restart:
    """The job's step counter fell back (a restarted attempt resuming from a checkpoint, or an epoch's bar
    starting again: diagnose/cost.py tells them apart): where it was and where it went on from."""

    from_step: float  # the highest step the sources that fell back had reached
    from_ts: float | None  # the time of their last rise before the fall
    to_step: float  # the lowest step they went on from
    line_no: int  # the first line that fell back
    ts: float | None  # its time: the restarted attempt's first progress line
    passed_ts: float | None = None  # when a source that fell back reached `from_step` again (None: never)
    sources: int = 1  # how many sources fell back into it


@dataclass(slots=True)
class ProgressSummary:
    """The job's training progress as the timeline saw it (logdx/timeline.py)."""

    lines: int = 0
    last_step: float | None = None
    last_line: int = 0
    last_ts: float | None = None
    sources: list[SourceProgress] = field(default_factory=list)
    loss: list[tuple[float, float]] = field(default_factory=list)  # (step, loss), decimated
    step_time_s: list[tuple[float, float]] = field(default_factory=list)
    divergence: Divergence | None = None
    recovered_spikes: list[Divergence] = field(default_factory=list)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (step, line_no) saved
    # The time each of `checkpoints` was last said saved (the last rank's line, the "successfully saved" after
    # the "saving"), None when its lines had no time: index for index with `checkpoints`.
    checkpoint_ts: list[float | None] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)  # where the step counter fell back, in order
    step_times: list[tuple[float, float]] = field(default_factory=list)  # (time, step) of the job's highest step, decimated
    completed_line: int = 0  # the last line that said the run's training is over (0: none said so)
    completed_ts: float | None = None  # its time (the last completion line's that said one)
    completed_advances: int = 0  # how often the job had advanced (job_advances) when it was said
    # Every source's last line of any kind (line_no, ts): which rank went quiet first.
    last_output: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    quiet: dict[str, int] = field(default_factory=dict)  # per source, lines without an error word
    # Every source's last line of its own work (no error word, outside a traceback or dump): (line_no, ts).
    last_work: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    job_quiet: int = 0
    job_advances: int = 0
    job_rises: int = 0  # how often the job's highest step rose

    def first_progress_ts(self) -> float | None:
        """The time of the job's first progress line (None: no progress line had a time)."""
        return min((s.first_ts for s in self.sources if s.first_ts is not None), default=None)

    def passed_at(self, step: float) -> float | None:
        """When the job's highest step first reached `step` (to the decimation of `step_times`; None: never)."""
        return next((ts for ts, reached in self.step_times if reached >= step), None)


@dataclass(slots=True)
class CompressionSummary:
    lines_in: int
    bytes_in: int
    templates: int
    lines_kept: int
    lines_truncated: int
    world_size: int  # 1 + the highest rank seen (0 when no rank was seen)
    hosts: list[str]
    first_ts: float | None
    last_ts: float | None
    # Training progress (iteration/step/loss lines): what stalls and non-fatal errors are judged by.
    progress_lines: int = 0
    last_progress_line: dict[str, int] = field(default_factory=dict)  # per source_key
    last_progress_ts: float | None = None
    last_finite_loss_line: dict[str, int] = field(default_factory=dict)  # per source_key
    step_interval_s: float | None = None  # typical time between progress lines of one source
    rank_hosts: dict[int, str] = field(default_factory=dict)  # which host each rank ran on, when seen
    # Which rank drove which GPU, from NCCL's init lines: keys "host|bus:<busId>", "host|pid:<pid>",
    # "host|dev:<cuda device>". How a kernel Xid (host, PCI address, pid) is traced to a rank.
    gpu_ranks: dict[str, int] = field(default_factory=dict)
    # The job's nodes as its scheduler printed them (PBS "Exec host:", Slurm SLURM_JOB_NODELIST, LSF
    # "executed on host(s)"): a job on exactly one node links a line without a host to that node.
    allocated_hosts: list[str] = field(default_factory=list)
    # (first line, last line, rank, host) of each rank's entry in torchrun's failure box: those lines of that
    # host's stream are that rank's (another node's lines may arrive in between).
    failure_boxes: list[tuple[int, int, int, str | None]] = field(default_factory=list)
    srun_task_hosts: dict[int, str] = field(default_factory=dict)  # srun's task -> node, when its tasks are ranks
    launcher_hosts: list[str] = field(default_factory=list)  # the nodes srun's errors name, ranks or not: the job's
    # host -> NCCL's start-up word on its transport: "network" (IB, Socket...), "gdr" (Enabled/Disabled), "p2p"
    # (disabled) -> (value, line number, the line): diagnose/degradations.py
    nccl_setup: dict[str, dict[str, tuple[str, int, str]]] = field(default_factory=dict)
    progress: ProgressSummary = field(default_factory=ProgressSummary)
    # The hosts a sender that may speak for them named (a node's own credential, a collector of the operator's);
    # None: every host the lines name (the reader's own files, senders that may speak for every host).
    trusted_hosts: frozenset[str] | None = None


@dataclass(slots=True)
class Frame:
    path: str
    line: int | None
    function: str | None
    code: str | None = None


@dataclass(slots=True)
class Event:
    """Something that happened: a traceback, an NCCL warning, an Xid, a signal exit, a NaN..."""

    kind: EventKind
    anchor: Record  # the one line that stands for the event (the exception line, the Xid line...)
    lines: list[Record] = field(default_factory=list)  # the event's lines, anchor included
    exception_type: str | None = None  # for tracebacks: "torch.OutOfMemoryError" style, as printed
    exception_message: str | None = None
    frames: list[Frame] = field(default_factory=list)
    gpu: str | None = None
    attrs: dict[str, object] = field(default_factory=dict)

    @property
    def line_no(self) -> int:
        return self.anchor.line_no

    @property
    def ts(self) -> float | None:
        return self.anchor.ts


@dataclass(slots=True)
class Evidence:
    line_no: int | None
    text: str
    source: str  # "rule:<id>" | "retrieval:<incident id>" | "llm:<backend>" | "detect:<kind>"


@dataclass(slots=True)
class Label:
    """One point of the label space every diagnosis stage votes over."""

    category: Category
    failure_type: str
    action: Action


@dataclass(slots=True)
class StageVote:
    """What one stage of diagnosis believes: a distribution over labels, with its evidence."""

    source: str  # "rules" | "retrieval" | "llm"
    scores: list[tuple[Label, float]]  # best first; scores in 0..1 (need not sum to 1)
    evidence: list[Evidence] = field(default_factory=list)
    explanation: str | None = None  # the LLM may write one
    note: str | None = None  # e.g. "llm unavailable: timeout; fell back to rules + retrieval"


@dataclass(slots=True)
class FailureContext:
    """The compressed failure, as text for retrieval and the LLM (numbers and names masked)."""

    root_text: str  # the root line (raw) or "" when none was found
    root_masked: str  # its template
    templates: list[str]  # masked error-bearing templates near the failure, most relevant first
    excerpt: list[str]  # a few raw lines around the root cause (for the LLM prompt)
    exception_type: str | None = None
    root_message: str = ""  # the root line without its launcher/host/rank prefixes
    hosts: tuple[str, ...] = ()  # the machines these lines came from (what a prompt for a hosted model masks)

    def as_query(self) -> str:
        """The text that is embedded for nearest-neighbour search."""
        return "\n".join([self.root_masked, *self.templates[:8]])


@dataclass(slots=True)
class Attribution:
    """Who is to blame, and on what grounds (see logdx/diagnose/culprit.py)."""

    hosts: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)
    basis: str = ""  # how the host (or the lone rank) was found; "" when nothing was
    corroborated: bool = False  # a second signal agrees: the host printed the fault, or the rank stopped
    single_node: bool = False  # no host anywhere and few ranks: one machine's log, blamed unnamed
    notes: list[str] = field(default_factory=list)  # why a host is unknown, which names were refused
    # Every culprit host was named by a sender that may speak for it (CompressionSummary.trusted_hosts): only
    # then may a node be cordoned. Otherwise the name is a claim, reported as such.
    verified: bool = True


@dataclass(slots=True)
class Recovered:
    """An event the job went on making progress after: a note, never the root, never an action."""

    line_no: int
    text: str
    kind: str
    rank: int | None
    host: str | None
    source: str  # "rule:<id>"


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """One of the few labels an unsure report still holds possible, and the check that would confirm it."""

    label: Label
    p: float  # its share of the report's belief (the hypotheses of one report sum to at most 1)
    check: str


@dataclass(slots=True)
class StoppedFirst:
    """The rank(s) whose progress or output stopped before the others': the silent rank of a hang."""

    ranks: list[int]
    hosts: list[str]
    step: float | None
    line_no: int
    basis: str


# The stages whose verdict rests on knowledge someone wrote down and tested (a rule, an entry of the error
# catalog drawn from the frameworks' own code). A verdict chosen by any other stage (retrieval, the LLM,
# their fusion) is an opinion: it may name and explain a failure, never take a machine out of service.
EVIDENCE_STAGES = frozenset({"rules", "catalog"})


def rests_on_evidence(decided_by: str) -> bool:
    """Whether the stage that chose a verdict is one a cordon may follow (EVIDENCE_STAGES)."""
    return decided_by in EVIDENCE_STAGES


@dataclass(frozen=True, slots=True)
class Degradation:
    """Something the job's start-up says will make it slow (diagnose/degradations.py): advice, never an action."""

    kind: str  # "network_fallback" | "gdr_disabled" | "p2p_disabled" | "bootstrap_interface" | "fewer_channels" | ...
    # ... "nccl_version_differs" | "driver_version_differs"
    host: str
    line_no: int
    text: str
    effect: str


@dataclass(frozen=True, slots=True)
class Straggler:
    """A host whose ranks step slower than the others', or whose step time jumped up and stayed there
    (diagnose/stragglers.py): advice, never an action, never a cordon on this alone."""

    host: str
    ranks: tuple[int, ...]
    kind: str  # "lagging" (slower than the other hosts all along) | "slowed" (its step time jumped up)
    steps_per_s: float  # its pace (since the jump, for "slowed")
    others_steps_per_s: float  # the other hosts' median pace (its own before the jump, for "slowed")
    since_ts: float | None
    since_step: float | None
    since_line: int | None
    evidence: tuple[tuple[int, str], ...]  # (line number, line) of its kernel/NIC lines in that window
    effect: str


@dataclass(slots=True)
class LostWork:
    """What one failure cost (diagnose/cost.py): the work since the last checkpoint saved before it, and,
    when the log holds the attempt restarted after it, how long the job stood still and how long until it
    was back where it failed. None: the log does not say (the cost's notes say why)."""

    failure_ts: float | None = None
    failure_step: float | None = None
    failure_line: int | None = None
    checkpoint_step: int | None = None  # the last checkpoint saved before the failure
    checkpoint_ts: float | None = None
    checkpoint_line: int | None = None
    since: str = ""  # what the lost work is counted from: "checkpoint" | "attempt_start" | "job_start" | "" (unknown)
    since_ts: float | None = None
    lost_s: float | None = None  # failure_ts - since_ts
    lost_gpu_hours: float | None = None  # gpus * lost_s / 3600
    restart_ts: float | None = None  # the restarted attempt's first progress line
    resumed_step: float | None = None  # the step it went on from
    stood_still_s: float | None = None  # restart_ts - failure_ts: no training between the attempts
    passed_ts: float | None = None  # when the restarted attempt reached failure_step again
    back_after_s: float | None = None  # passed_ts - failure_ts


@dataclass(slots=True)
class Cost:
    """A failed job's lost work (diagnose/cost.py): this failure's, and that of earlier attempts in the log."""

    gpus: int | None
    gpus_from: str  # "launcher" | "ranks" | "" (unknown)
    failure: LostWork
    earlier: list[LostWork] = field(default_factory=list)  # failures of earlier attempts the log restarted after
    notes: list[str] = field(default_factory=list)  # each part the log does not give, and why


class TimeoutSpec(Protocol):
    """What a timeout class implies (`taxonomy.TimeoutClass`)."""

    @property
    def title(self) -> str: ...

    @property
    def action(self) -> Action | None: ...


class TimeoutFacts(Protocol):
    """Why a job's collectives timed out (`diagnose.timeouts.TimeoutVerdict`, a later stage's class: the
    model names only what the report and the action read of it, so it imports no stage)."""

    @property
    def cause(self) -> str: ...

    @property
    def evidence(self) -> list[str]: ...

    @property
    def missing(self) -> list[str]: ...

    @property
    def ranks(self) -> list[int]: ...

    @property
    def hosts(self) -> list[str]: ...

    @property
    def explained_by(self) -> str | None: ...

    @property
    def decided(self) -> bool: ...

    @property
    def spec(self) -> TimeoutSpec: ...


@dataclass(slots=True)
class Diagnosis:
    status: str  # "failed" | "healthy" | "unknown" (neither shown) | "empty" (no log text at all)
    label: Label | None
    confidence: float
    root: Record | None
    attribution: Attribution = field(default_factory=Attribution)
    evidence: list[Evidence] = field(default_factory=list)
    explanation: str = ""
    hint: str = ""
    votes: list[StageVote] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    context: FailureContext | None = None  # what retrieval and the LLM saw; kept with the report
    decided_by: str = "rules"  # the stage whose label stands: "rules", or the later stage that changed it
    recovered: list[Recovered] = field(default_factory=list)  # what the job went on after
    stopped_first: StoppedFirst | None = None
    stage_ms: dict[str, float] = field(default_factory=dict)  # time spent in each diagnosis stage
    timeout: TimeoutFacts | None = None  # why the job's collectives timed out, when they did
    degradations: list[Degradation] = field(default_factory=list)  # what its start-up says will make it slow
    stragglers: list[Straggler] = field(default_factory=list)  # hosts that step slower than the others
    hypotheses: list[Hypothesis] = field(default_factory=list)  # when unsure: what else it may be, how to tell
    cost: Cost | None = None  # what the failure cost (failed diagnoses only)
