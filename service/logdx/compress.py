"""Stage 2: compress the stream in real time with Drain template mining.

Millions of lines of a training log are a few hundred templates: progress lines, NCCL init, a
config dump. The compressor counts each template (who emitted it, first/last line, one sample)
and keeps in full only the lines that can matter: error-bearing lines, tracebacks, the first
occurrences of each template, and the last lines of each rank. Everything else is a count.

The hot path is the repeated line. Masking numbers, hex, IPs and paths turns a progress line into
a string already seen, and a dict lookup on that string replaces the Drain tree search; whether a
masked line is error-bearing or a progress line is decided once per distinct masked line too.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hostlist
from drain3.drain import Drain, LogCluster, Node

from logdx.config import CompressSettings
from logdx.flightrec.frtext import is_report_line, is_report_start
from logdx.hosts import clean_hostname
from logdx.model import CompressionSummary, KeptLine, ProgressSummary, Record, TemplateStats
from logdx.patterns import (
    MASK,
    PARAM,
    TRACEBACK_START,
    exception_line,
    is_interleaved_stray,
    is_traceback_body,
    pci_key,
    strip_traceback_prefix,
    traceback_prefix,
)
from logdx.procs import ProcessState, PsColumns, aux_row, header_columns, row_in
from logdx.stacks import classify_line, is_stack_start, section_name
from logdx.timeline import (
    LossSignal,
    ProgressShape,
    Timeline,
    checkpoint_step_of,
    is_completion,
    may_count,
    progress_shape_of,
)

# Words that make a line worth keeping whole. Judged on the masked line, once per distinct line.
_ERROR_WORD_LIST = (
    "error", "exception", "traceback", "fail", "fatal", "abort", "kill", "sigterm", "sigkill", "sigabrt", "sigsegv",
    "sigbus", "segmentation", "signal", "exitcode", "exit code", "exit status", "xid", "nvrm", "ecc", "timeout",
    "timed out", "out of memory", "oom", "warn", "refused", "reset by peer", "broken pipe", "unreachable", "no space",
    "denied", "not found", "no such", "cannot", "can't", "unable", "invalid", "mismatch", "corrupt", "panic", "critical",
    "assert", "unexpected", "lost", "terminat", "cancel", "preempt", "stale", "hang", "stuck", "illegal", "uncorrectable",
    "nvlink", "retry", "rev ff", "does not exist", "not compatible", "unrecognized", "required", "deprecat",
    r"\bno attribute\b", "not defined", "undefined", "interrupt", "core dumped", "nccl (?:warn|error)",
    "slurmstepd", "srun: ", "shm", "bus error", "unhealthy", "degraded", "throttl",
)
_ERROR_WORDS = re.compile("|".join(_ERROR_WORD_LIST), re.IGNORECASE)


def _first_letter_alternation(alternatives: tuple[str, ...]) -> str:
    """The same alternation grouped by first letter ("e(?:rror|xception)|..."): a regex without
    IGNORECASE then only tries the words that can start at a position, not all of them."""
    groups: dict[str, list[str]] = {}
    for alt in alternatives:
        head = alt[0] if alt[0].isalpha() else alt  # escapes and the like stay whole
        groups.setdefault(head, []).append(alt[1:] if head != alt else "")
    return "|".join(head if rests == [""] else f"{head}(?:{'|'.join(rests)})" for head, rests in groups.items())


# Case-insensitive matching is slow in Python's regex engine (~60 µs on a 150-character line for
# _ERROR_WORDS). On ASCII text - nearly every line - IGNORECASE is the same as matching the lower-cased
# text with a lower-case pattern; text with other characters keeps the IGNORECASE pattern (it also
# folds some of them onto ASCII letters: "ſ" onto "s", the Kelvin sign onto "k").
_ERROR_WORDS_LOWER = re.compile(_first_letter_alternation(_ERROR_WORD_LIST))
assert all(a == a.lower() for a in _ERROR_WORD_LIST)


_WARN_LEVEL = re.compile(r"\bWARN(?:ING)?\b|\bwarning:", re.IGNORECASE)


def _only_warns(masked: str) -> bool:
    """The line's only error word is its level, WARNING (judged once per shape)."""
    return _WARN_LEVEL.search(masked) is not None and not _has_error_word(_WARN_LEVEL.sub(" ", masked))


def _has_error_word(masked: str) -> bool:
    if masked.isascii():
        return _ERROR_WORDS_LOWER.search(masked.lower()) is not None
    return _ERROR_WORDS.search(masked) is not None



_DIGITS = b"0123456789"
_TRACEBACK_START_BYTES = TRACEBACK_START.encode()
# NCCL's communicator init line ties a rank to its host, process, CUDA device and PCI bus.
# Lines that state which host a rank ran on, besides NCCL's init lines: MPICH's abort line
# ("[Rank 2047] [job id 5.0] [Fri Aug 28 ...] [nid004069]") and torchrun's error summary box, whose
# "host :" and "rank :" fields come on consecutive lines.
_MPICH_RANK_HOST = re.compile(r"\[Rank (\d+)\] \[job id [^\]]*\] \[[^\]]*\] \[([A-Za-z][\w.-]*)\]")
_BOX_HOST = re.compile(r"^\s*host\s+: ([A-Za-z][\w.-]*)\s*$")
_BOX_RANK = re.compile(r"^\s*rank\s+: (\d+) \(local_rank")
_BOX_PID = re.compile(r"^\s*exitcode\s+: -?\d+ \(pid: (\d+)\)")
# DeepSpeed's launcher on each node: "nnodes=2, num_local_procs=4, node_rank=1", then per worker "process 31870
# spawned with command: [..., '--local_rank=0', ...]": the worker's pid and rank (ranks are numbered node by node).
_DS_NODE = re.compile(r"\bnnodes=\d+, num_local_procs=(\d+), node_rank=(\d+)")
_DS_SPAWN = re.compile(r"\bprocess (\d+) spawned with command: .*'--local_rank=(\d+)'")
# What ends one rank's entry of that box: the next entry ("[2]:"), the box's rules, its "Root Cause" part.
_BOX_END = re.compile(r"^\s*(?:\[\d+\]:\s*$|={8,}|-{8,}|Root Cause|Failures:|\S+ FAILED\s*$)")
# Which stream wrote a line (its upload, host and rank label): a torchrun box is one stream's lines.
_Origin = tuple[int, str | None, int | None]


def _origin(rec: Record) -> _Origin:
    return rec.feed, rec.host, rec.rank


# srun's word on a task: "srun: error: node12: task 5: Out Of Memory", "...: tasks 0-3,6: Exited with exit code 1".
_SRUN_TASKS = re.compile(r"^srun: error: ([A-Za-z][\w.-]*): tasks? ([\d,-]{1,200}): ")
# The job's allocation as its scheduler prints it: PBS/Torque mail "Exec host: n1/0+n2/0", qstat -f
# "exec_host = n1/0*8+n2/0*8", Slurm "SLURM_JOB_NODELIST=n[01-04]" / scontrol "NodeList=n1", LSF's
# job report "Job was executed on host(s) <8*n1>, <8*n2>, in queue <gpu>".
_ALLOCATION = re.compile(
    r"(?:\bExec host:|\bexec_host = |\bSLURM_(?:JOB_)?NODELIST=|\bNodeList=|\bexecuted on host\(s\) )\s*(.+)")
_MAX_ALLOCATION = 4096
_MAX_BOXES = 4096
_HOSTLIST_PART = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")  # a comma inside brackets is a range's
# NCCL's start-up lines on the transport: "NCCL INFO Using network IB" (and 2.19+'s "Assigned NET plugin Socket to
# comm"), "NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'", "NCCL_P2P_DISABLE set by environment to 1"; the
# interface it bootstraps on ("Bootstrap : Using ib0:10.0.0.1<0>", bootstrap.cc; "NET/IB : Using [0]mlx5_0:1/IB ;
# OOB ib0:10.0.0.1<0>", net_ib.cc), its channels ("32 coll channels, 32 collnet channels, ...", init.cc), its
# version ("NCCL version 2.18.1+cuda12.1") and the CUDA driver's ("cudaDriverVersion 12020").
_NCCL_SETUP = re.compile(r"NCCL INFO (?:Using network (?P<network>\w+)|Assigned NET plugin (?P<network2>\w+) to comm"
                         r"|.*GPU Direct RDMA (?P<gdr>Enabled|Disabled) for HCA"
                         r"|NCCL_P2P_DISABLE set by environment to (?P<p2p>[1-9])"
                         r"|Bootstrap ?: Using \[?\d*\]?(?P<bootstrap>[\w.-]+):"
                         r"|NET/IB : Using .*; OOB (?P<oob>[\w.-]+):"
                         r"|(?P<channels>\d+) coll channels, "
                         r"|NCCL version (?P<version>[\w.+-]+)"
                         r"|cudaDriverVersion (?P<driver>\d+))")
_NCCL_COMM = re.compile(r"NCCL INFO comm 0x[0-9a-fA-F]+ rank (\d+) nr?[Rr]anks \d+ cudaDev (\d+)(?: nvmlDev \d+)? busId ([0-9a-fA-F]+)")


def _setting(name: str) -> Any:
    """The default of a knob that is also a setting: declared once, in config.CompressSettings."""
    return CompressSettings.model_fields[name].default


@dataclass(slots=True)
class CompressConfig:
    # Drain's prefix-tree depth and similarity threshold. On loghub-2k (bench/bench_compress.py) depth 5 /
    # 0.75 with `drain_match_params` groups best: average GA 0.87, against 0.75 at drain3's 4 / 0.4.
    # (Knobs that are settings take their defaults from config.CompressSettings.)
    drain_depth: int = _setting("drain_depth")
    drain_sim_th: float = _setting("drain_sim_th")
    drain_max_children: int = 100
    # Count a template's wildcards as matching when comparing a line with it (drain3's `include_params`,
    # which its own `match()` uses). Without it a line whose variables were masked scores low against
    # its own template (each <*> counts as a mismatch), so masking splits templates. With it every
    # similarity is higher, so it only suits a strict threshold: None (default) turns it on when
    # drain_sim_th >= 0.6 (a permissive threshold would then merge templates that differ in a word).
    drain_match_params: bool | None = None
    max_templates: int = _setting("max_templates")  # beyond this, new templates share one overflow bucket
    max_kept_lines: int = _setting("max_kept_lines")  # hard budget for lines kept in full
    kept_per_error_template: int = _setting("kept_per_error_template")
    first_lines_per_template: int = 2
    tail_lines_per_source: int = _setting("tail_lines_per_source")
    max_sources: int = 8192
    max_traceback_lines: int = 400  # per source, per traceback
    max_block_lines: int = 400  # per source, per block (a py-spy dump of one process and its threads, an fr_trace report)
    mask_cache_size: int = 200_000
    max_ids_per_template: int = 4096  # ranks / hosts remembered per template
    max_merged_templates: int = 2000  # above this many templates, merged_ids() leaves them apart
    # A position of a template that only ever held a few words, each on more than one line, is a constant
    # that tells events apart ("VM Paused" / "VM Resumed", "stored as bytes" / "stored as values"), not a
    # variable: its lines are reported as one template per word. Drain cannot see this: it widens a
    # position to <*> at its second value. 0 turns it off.
    split_max_words: int = _setting("split_max_words")
    split_min_lines: int = 2
    max_variants_per_template: int = 32  # beyond this, a template's new lines share one and it is not split
    # Bounds on what one new line may cost (random text must not make mining quadratic): Drain sees the
    # first `max_tokens` words (the rest is one word); a leaf of Drain's tree holds at most
    # `max_leaf_templates` templates (a line that matches none of a full leaf's goes to the "unique lines"
    # template); and once `novelty_min_templates` exist, a window of `novelty_window` new shapes of which more
    # than `novelty_share` made a new template means lines that never repeat: new shapes then skip Drain
    # (the "unique lines" template) except one in `novelty_probe`, which decides when the flood is over.
    max_tokens: int = 64
    max_leaf_templates: int = 1024
    novelty_min_templates: int = 1000
    novelty_window: int = 1024
    novelty_share: float = 0.5
    novelty_probe: int = 16

    @property
    def match_params(self) -> bool:
        return self.drain_sim_th >= 0.6 if self.drain_match_params is None else self.drain_match_params


class _Drain(Drain):
    """drain3's Drain core; optionally counting a template's wildcards as matching in `add_log_message`;
    with bounded work per line (`add_bounded`)."""

    def __init__(self, *, match_params: bool = False, max_tokens: int = 64, max_leaf: int = 1024,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.match_params = match_params
        self.max_tokens = max_tokens
        self.max_leaf = max_leaf

    def tree_search(self, root_node: Node, tokens: Sequence[str], sim_th: float,
                    include_params: bool) -> LogCluster | None:
        return super().tree_search(root_node, tokens, sim_th, include_params or self.match_params)

    def get_content_as_tokens(self, content: str) -> list[str]:
        return split_tokens(content, self.max_tokens)

    def add_bounded(self, content: str) -> LogCluster | None:
        """`add_log_message`, except that a line matching no template of a full leaf makes none (None)."""
        tokens = self.get_content_as_tokens(content)
        leaf = self._leaf(tokens)
        match = None
        if leaf is not None:
            match = self.fast_match(leaf.cluster_ids, tokens, self.sim_th, self.match_params)
        if match is None:
            if leaf is not None and len(leaf.cluster_ids) >= self.max_leaf:
                return None
            return self.add_log_message(content)[0]
        template = tuple(self.create_template(tokens, match.log_template_tokens))
        if template != match.log_template_tokens:
            match.log_template_tokens = template
        match.size += 1
        return match

    def _leaf(self, tokens: list[str]) -> Node | None:
        """The leaf `tree_search` would search for these tokens (drain3's descent), or None."""
        node = self.root_node.key_to_child_node.get(str(len(tokens)))
        if node is None or not tokens:
            return node
        depth = 1
        for token in tokens:
            if depth >= self.max_node_depth or depth == len(tokens):
                break
            children = node.key_to_child_node
            node = children.get(token) or children.get(self.param_str)
            if node is None:
                return None
            depth += 1
        return node


def split_tokens(text: str, max_tokens: int) -> list[str]:
    """Words as Drain splits them, the words past `max_tokens` kept together as one."""
    return text.strip().split(None, max_tokens)


@dataclass(slots=True)
class _Novelty:
    """Whether new shapes are lines that never repeat (see CompressConfig.novelty_*)."""

    window: int
    share: float
    min_templates: int
    probe: int
    seen: int = 0
    novel: int = 0
    flooding: bool = False
    tick: int = 0

    def skip(self) -> bool:
        """True for a new shape that should not be mined (a flood, and not a probe)."""
        if not self.flooding:
            return False
        self.tick += 1
        return self.tick % self.probe != 0

    def note(self, created: bool, templates: int) -> None:
        self.seen += 1
        self.novel += created
        if self.seen >= (max(1, self.window // self.probe) if self.flooding else self.window):
            self.flooding = templates >= self.min_templates and self.novel > self.share * self.seen
            self.seen = self.novel = 0


# What counts as a word when telling events apart by one (see CompressConfig.split_max_words).
_WORD = re.compile(r"[A-Za-z][A-Za-z_-]*")


@dataclass(slots=True)
class _Cluster:
    """One Drain cluster's lines, as variants: lines with the same words at the positions that, so far,
    only ever held a few words (`words`) share a variant, and each variant has its own statistics. Whether
    such a position tells events apart is decided when templates are reported (`Compressor._grouping`)."""

    words: list[set[str] | None]  # per position, the words seen there; None once it held a non-word or too many
    variants: dict[tuple[str | None, ...], TemplateStats] = field(default_factory=dict)
    closed: bool = False  # it reached max_variants_per_template: never split

    def variant_key(self, tokens: list[str], max_words: int) -> tuple[str | None, ...]:
        key: list[str | None] = []
        for p, token in enumerate(tokens):
            seen = self.words[p]
            if seen is not None and token not in seen:
                if len(seen) >= max_words or not _WORD.fullmatch(token):
                    seen = self.words[p] = None
                else:
                    seen.add(token)
            key.append(None if seen is None else token)
        return tuple(key)


@dataclass(slots=True)
class _Shape:
    """What is known about one distinct masked line (the fast-path cache entry)."""

    template_id: int  # of the variant its lines are counted in (Compressor._stats)
    error: bool
    progress: ProgressShape | None  # how to read a progress line's step, loss... (None: not progress)
    quiet: int = 0  # 1 when the line has no error word (a count, added per line)
    topology: bool = False  # an NCCL init line: which rank drives which GPU
    stats: TemplateStats | None = None  # the template's statistics (saves a lookup per line)
    # Whether the line's text can hold these words at all, known from the shape: a word without digits
    # that is in the text is in its digit-free key too, so a key without it rules the word out.
    loss: bool = True  # "loss" / "Loss": where a loss value is read
    traceback: bool = True  # TRACEBACK_START
    # A line the timeline looks at besides progress: a checkpoint save, or a repeated line that may
    # turn out to be progress (its counter rises: see timeline.Learner). Cleared once decided.
    watch: bool = False
    checkpoint: bool = False
    completion: bool = False  # the run says its training is over (timeline.yaml `completions`)
    # Starts a block kept whole although its lines carry no error word: "stack" (a py-spy / faulthandler /
    # gdb dump), "fr" (a report of torch's flight-recorder analyser). None: not one.
    block: str | None = None
    section: bool = False  # may name the stack dumps that follow it (stacks.section_name)
    ps_header: PsColumns | None = None  # a `ps` header: the rows after it are read by its columns (procs.py)
    ps_row: int = 0  # a `ps aux` row: 1, one in uninterruptible sleep (state D): 2
    collected: bool = False  # any of the three above: a line of what an operator collected from the nodes
    work: bool = False  # no error word, no traceback, no dump: a line of the process's own work (timeouts.py)


@dataclass(slots=True)
class _SourceState:
    tail: deque[Record]
    in_traceback: int = 0  # lines left in the current traceback, 0 when not in one
    after_exception: int = 0  # continuation lines of an exception message still to keep
    tb_prefix: str = ""  # what the logger writes before each traceback line
    tb_writers: int = 0  # tracebacks begun in the current one: several processes printing into one stream
    tb_strays: int = 0  # lines in a row among those that are no body (see patterns.is_interleaved_stray)
    in_block: int = 0  # lines left in the current block (see _Shape.block), 0 when not in one
    block_kind: str = ""
    last_progress_ts: float | None = None
    interval_ema: float | None = None
    last_line: int = 0  # its last line of any kind, and that line's time: which rank went quiet
    last_ts: float | None = None
    quiet: int = 0  # its lines without an error word: did it go on doing its work?
    # The name the line before its stack dumps gave them (a node's file, a host: stacks.section_name), and how
    # many lines since that line or the last dump line: a name stops naming dumps a few lines after them.
    section: str | None = None
    section_gap: int = 0
    ps: PsColumns | None = None  # the columns of the `ps` listing being printed
    # Its last line of its own work (no error word, outside a traceback or a dump) and that line's time: a rank
    # still printing while the others wait in a collective (diagnose/timeouts.py).
    last_work: Record | None = None


# Lines between a section's name and its dumps, or between its dumps ("4 in:", blanks, a markdown fence).
_SECTION_GAP = 6


@dataclass
class Compressor:
    config: CompressConfig = field(default_factory=CompressConfig)
    # Whatever else makes a line worth keeping (the rule packs' own patterns, so a site's rule
    # about a line without any error word still sees it). Asked once per shape, on its first line.
    also_error: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        c = self.config
        self._drain = _Drain(depth=c.drain_depth, sim_th=c.drain_sim_th, max_children=c.drain_max_children,
                             match_params=c.match_params, max_tokens=c.max_tokens, max_leaf=c.max_leaf_templates)
        self._novelty = _Novelty(c.novelty_window, c.novelty_share, c.novelty_min_templates, c.novelty_probe)
        self._shapes: dict[bytes, _Shape] = {}
        self._stats: dict[int, TemplateStats] = {}  # per variant (see _Cluster), by its own id
        self._clusters: dict[int, _Cluster] = {}  # by Drain cluster id
        self._next_variant_id = 1
        self._sources: dict[str, _SourceState] = {}
        self._rank_keys: dict[int, str] = {}  # rank -> its source key
        self._kept_ids: set[int] = set()  # line numbers kept, so the tail does not repeat them
        self.lines_in = 0
        self.lines_kept = 0
        self._max_rank = -1
        self._hosts: set[str] = set()
        self._rank_hosts: dict[int, str] = {}
        self._allocated: list[str] | None = None  # the job's nodes, from the scheduler's own lines
        # The "host :" of a torchrun error box, until its "rank :", with the stream that printed it.
        self._box_host: tuple[_Origin, str] | None = None
        # The rank (and host) whose entry of that box is being printed, and the stream printing it: its
        # error lines are that rank's. Another stream's lines in between (other nodes' uploads interleave)
        # are not.
        self._box: tuple[_Origin, int, str | None] | None = None
        self._srun_tasks: dict[int, str] = {}  # srun's task -> node, from its error lines
        # host -> what NCCL's start-up said of its transport: "network" / "gdr" / "p2p" -> (value, line, raw line)
        self._nccl_setup: dict[str, dict[str, tuple[str, int, str]]] = {}
        self.nccl_setup_words = 0  # how many words `_nccl_setup` holds: what changed since a reader last looked
        # (first line, last line, rank, host of the stream) of ranks' entries in that box
        self._boxes: list[tuple[int, int, int, str | None]] = []
        self._gpu_ranks: dict[str, int] = {}
        self._ds_nodes: dict[str, tuple[int, int]] = {}  # host -> (DeepSpeed's workers on it, its node rank)
        self._first_ts: float | None = None
        self._last_ts: float | None = None
        self._progress_lines = 0
        self._last_progress_line: dict[str, int] = {}
        self._last_finite_loss_line: dict[str, int] = {}
        self._last_progress_ts: float | None = None
        self.last_progress: Record | None = None  # the last progress line itself: a stall's anchor
        self.timeline = Timeline()
        self._quiet = 0  # lines without an error word, all sources
        self._merged: tuple[int, dict[int, int]] | None = None  # (lines_in when computed, merged_ids())
        self._groups: tuple[int, dict[int, int], dict[int, str]] | None = None  # (lines_in, _grouping())

    # -- the hot path ----------------------------------------------------------------------------

    def add(self, rec: Record) -> list[KeptLine]:
        """Account for one record; returns the lines kept in full because of it (usually none)."""
        self.lines_in += 1
        # Lines that differ only in their digits share a shape: deleting digits from the bytes is
        # ten times cheaper than masking, so the regex runs once per shape, not once per line.
        text = rec.text
        encoded = text.encode("utf-8", "surrogatepass")
        key = encoded.translate(None, _DIGITS)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._new_shape(key, MASK.sub(PARAM, text), text)
        stats = shape.stats
        assert stats is not None  # _new_shape sets it
        line_no = rec.line_no
        stats.count += 1
        stats.last_line = line_no
        # Who emitted it, and when.
        if stats.count == 1:
            stats.first_line = line_no
            stats.sample = rec.raw
        if self._box is not None:
            self._within_box(rec)
        rank, host, ts = rec.rank, rec.host, rec.ts
        if rank is not None or host is not None:
            self._note_origin(rank, host, stats)
        if shape.topology:
            self._note_topology(rec)
        if rank is not None:
            # Record.source_key is "r<rank>" whenever the rank is known: built once per rank.
            source_key = self._rank_keys.get(rank)
            if source_key is None:
                source_key = rec.source_key
                if len(self._rank_keys) < self.config.max_sources:
                    self._rank_keys[rank] = source_key
        else:
            source_key = rec.source_key
        src = self._source(source_key)
        src.last_line = line_no
        src.quiet += shape.quiet
        self._quiet += shape.quiet
        if ts is not None:
            if self._first_ts is None:
                self._first_ts = ts
            # The time the log reached, by line order: a max would let one mis-dated line (a stamp
            # without a year, an skewed host) stretch the log by months.
            self._last_ts = src.last_ts = ts
        if shape.work and not (src.in_traceback or src.in_block):
            src.last_work = rec
        signal = None
        if shape.progress is not None:
            signal = self._note_progress(rec, src, source_key, shape, encoded)
        elif shape.watch:
            self._watch_shape(key, shape, rec, source_key)
        if signal is not None and signal.kind == "diverged":
            # Confirmed only now, lines after it began: the line where it began stands for it.
            return [KeptLine(record=signal.record, template_id=stats.template_id, reason="loss",
                             divergence=signal.divergence)]
        loss_anomaly = signal is not None and signal.kind == "nan"
        listed = False  # a line of a collection of the nodes' dumps and listings (keeps its section open)
        if shape.collected or src.ps is not None:
            listed, kept = self._collection_line(rec, shape, stats, src)
            if kept is not None:
                return [kept]
        if (src.in_traceback or src.after_exception or shape.traceback or loss_anomaly or shape.error
                or src.in_block or shape.block or stats.count <= self.config.first_lines_per_template):
            reason = self._keep_reason(rec, shape, stats, src, loss_anomaly)
            if reason is not None:
                return [self._keep_in(src, rec, stats, reason, listed)]
        if src.section is not None:
            # An indented line is the section's own content (a summary of its frames, a file's lines): it keeps it open.
            self._in_section(src, None, listed or rec.raw[:1] in (" ", "\t"))
        # The common case: a line like many before it, remembered only in its source's tail.
        src.tail.append(rec)
        return []

    def _collection_line(self, rec: Record, shape: _Shape, stats: TemplateStats,
                         src: _SourceState) -> tuple[bool, KeptLine | None]:
        """A line of what an operator collected from the nodes of a hung job: the name of a node's part (a
        section header), a line of a `ps` listing; the row of a process in state D is kept. Returns (whether
        it is one of those, the line kept)."""
        if shape.section and (name := section_name(rec.text)) is not None:
            src.section, src.section_gap = name, 0
            return True, None
        if shape.ps_header is None and not shape.ps_row and src.ps is None:
            return False, None
        listed, stuck = self._ps_line(src, shape, rec.text)
        if stuck is not None and self._room():
            kept = self._keep_in(src, rec, stats, "dstate", True)
            kept.process = stuck
            return True, kept
        return listed, None

    def _keep_in(self, src: _SourceState, rec: Record, stats: TemplateStats, reason: str, listed: bool) -> KeptLine:
        """Keep a line of `src`, with the name of the section it is printed in (if it is a dump's, a process's)."""
        kept = self._keep(rec, stats, reason)
        if src.section is not None:
            self._in_section(src, kept, listed)
        return kept

    @staticmethod
    def _ps_line(src: _SourceState, shape: _Shape, text: str) -> tuple[bool, ProcessState | None]:
        """Whether the line is one of a `ps` listing (its header, a row), and the process of a row in state D
        that is no kernel thread."""
        if shape.ps_header is not None:
            src.ps = shape.ps_header
            return True, None
        row = None
        if src.ps is not None:
            row = row_in(text, src.ps)
            if row is None:
                src.ps = None
        if row is None and shape.ps_row:
            row = aux_row(text) if shape.ps_row == 2 else None
            return True, row
        if row is None:
            return False, None
        return True, row if row.uninterruptible and not row.kernel_thread else None

    @staticmethod
    def _in_section(src: _SourceState, kept: KeptLine | None, listing: bool) -> None:
        """A dump's line (or a process's row in a `ps` listing) under a section's name carries that name;
        other lines end the section soon."""
        if kept is not None and kept.reason in ("stack", "dstate"):
            kept.section, src.section_gap = src.section, 0
            return
        if listing:
            src.section_gap = 0
            return
        src.section_gap += 1
        if src.section_gap > _SECTION_GAP:
            src.section = None

    def _new_shape(self, key: bytes, masked: str, text: str) -> _Shape:
        if len(self._shapes) >= self.config.mask_cache_size:
            self._shapes.clear()
        stats = self._variant_for(masked)
        error = _has_error_word(masked) or (self.also_error is not None and self.also_error(text))
        # "*** STEP 42 CANCELLED ***" names a step but is no progress. (NaN losses are found by
        # value, not by word, so Megatron's "number of nan iterations: 0" stays progress.)
        # A save names its step ("saved checkpoint at iteration 200") but is not a step of training.
        checkpoint = not error and checkpoint_step_of(text) is not None
        # "Training completed", the trainer's final metrics: the end of training, not a step of it.
        completion = not error and not checkpoint and is_completion(text)
        progress = None if error or checkpoint or completion else progress_shape_of(text)
        shape = _Shape(
            template_id=stats.template_id,
            error=error,
            progress=progress,
            checkpoint=checkpoint,
            completion=completion,
            block="stack" if is_stack_start(text) else "fr" if is_report_start(text) else None,
            section=section_name(text) is not None,
            ps_header=header_columns(text),
            ps_row=_ps_row_kind(text),
            # A line of digits no form knows may be a counter: the timeline learns it (or not).
            watch=checkpoint or completion or (progress is None and not error and len(key) < len(text) and may_count(text)),
            topology=("NCCL INFO comm" in masked and "busId" in masked) or "[Rank <*>] [job id" in masked
            or _BOX_HOST.match(text) is not None or _BOX_RANK.match(text) is not None
            or _ALLOCATION.search(text) is not None or _SRUN_TASKS.match(text) is not None
            or "num_local_procs=" in masked or "spawned with command" in masked
            or _NCCL_SETUP.search(text) is not None,
        )
        shape.stats = stats
        shape.collected = shape.section or shape.ps_header is not None or bool(shape.ps_row)
        shape.quiet = 0 if error else 1
        shape.loss = b"loss" in key or b"Loss" in key
        shape.traceback = _TRACEBACK_START_BYTES in key
        # A process's own work: quiet lines, and its logger's warnings (a rank that skips a batch and draws
        # another, and says so at WARNING level, is still at work: diagnose/timeouts.py reads who went on).
        shape.work = ((bool(shape.quiet) or _only_warns(masked)) and shape.block is None and not shape.traceback)
        if shape.error:
            shape.stats.error_bearing = True
        self._shapes[key] = shape
        return shape

    def _variant_for(self, masked: str) -> TemplateStats:
        """The statistics a new shape's lines are counted in: its Drain cluster's variant."""
        if len(self._stats) >= self.config.max_templates:
            overflow = self._stats.get(-1)
            if overflow is None:
                overflow = self._stats[-1] = TemplateStats(template_id=-1, template="<overflow: too many templates>")
            return overflow
        if self._novelty.skip():
            return self._unique()
        known = self._drain.clusters_counter
        cluster = self._drain.add_bounded(masked)
        if cluster is None:
            return self._unique()
        self._novelty.note(self._drain.clusters_counter != known, len(self._stats))
        cid = cluster.cluster_id
        tokens = split_tokens(masked, self.config.max_tokens)  # as Drain splits it
        state = self._clusters.get(cid)
        if state is None:
            state = self._clusters[cid] = _Cluster(words=[set() for _ in tokens])
        key = state.variant_key(tokens, self.config.split_max_words)
        stats = state.variants.get(key)
        if stats is None and len(state.variants) >= self.config.max_variants_per_template:
            state.closed = True
            key = (None,) * len(tokens)
            stats = state.variants.get(key)
        if stats is None:
            stats = TemplateStats(template_id=self._next_variant_id, template=cluster.get_template())
            self._next_variant_id += 1
            state.variants[key] = stats
            self._stats[stats.template_id] = stats
        return stats

    def _unique(self) -> TemplateStats:
        """Where lines that never repeat are counted, once they flood (see CompressConfig.novelty_*)."""
        stats = self._stats.get(-3)
        if stats is None:
            stats = self._stats[-3] = TemplateStats(template_id=-3, template="<lines that never repeat>")
        return stats

    @property
    def template_cap_reached(self) -> bool:
        """New templates now go to the overflow template (CompressConfig.max_templates)."""
        return len(self._stats) >= self.config.max_templates

    def _note_origin(self, rank: int | None, host: str | None, stats: TemplateStats) -> None:
        cap = self.config.max_ids_per_template
        if rank is not None:
            if rank > self._max_rank:
                self._max_rank = rank
            if len(stats.ranks) < cap:
                stats.ranks.add(rank)
        if host is not None:
            if rank is not None and rank not in self._rank_hosts and len(self._rank_hosts) < cap:
                self._rank_hosts[rank] = host
            if len(self._hosts) < cap:
                self._hosts.add(host)
            if len(stats.hosts) < cap:
                stats.hosts.add(host)

    def _note_topology(self, rec: Record) -> None:
        if self._note_named_rank_host(rec) or self._note_nccl_setup(rec):
            return
        m = _NCCL_COMM.search(rec.text)
        if m is None or rec.host is None or len(self._gpu_ranks) > 3 * self.config.max_ids_per_template:
            return
        rank = int(m.group(1))
        self._gpu_ranks[f"{rec.host}|dev:{m.group(2)}"] = rank
        self._gpu_ranks[f"{rec.host}|bus:{pci_key(m.group(3))}"] = rank
        if rec.pid is not None:
            self._gpu_ranks[f"{rec.host}|pid:{rec.pid}"] = rank
        self._rank_hosts.setdefault(rank, rec.host)
        self._max_rank = max(self._max_rank, rank)

    def _note_nccl_setup(self, rec: Record) -> bool:
        """NCCL's start-up word on how a host's ranks talk to the others: the network it chose (IB, Socket...),
        GPU Direct RDMA on or off, P2P off, the interface it bootstraps on, its channels, NCCL's and the CUDA
        driver's versions; the first line of each kind per host (what diagnose/degradations.py reads)."""
        m = _NCCL_SETUP.search(rec.text)
        if m is None:
            return False
        host = rec.host or ""
        if len(self._nccl_setup) < self.config.max_sources or host in self._nccl_setup:
            seen = self._nccl_setup.setdefault(host, {})
            kind = m.lastgroup or ""
            value = "disabled" if kind == "p2p" else m.group(kind)
            # One word per kind per host: its first (the default process group's communicator comes first).
            word = {"network2": "network", "oob": "bootstrap"}.get(kind, kind)
            if word not in seen:
                seen[word] = (value, rec.line_no, rec.raw)
                self.nccl_setup_words += 1
        return True

    @property
    def nccl_setup(self) -> dict[str, dict[str, tuple[str, int, str]]]:
        """host -> NCCL's start-up words so far (the streaming service's advice reads it; do not modify)."""
        return self._nccl_setup

    def _note_named_rank_host(self, rec: Record) -> bool:
        """A line that names a rank and its host in words (not NCCL's init line), or the job's
        allocation; True if it was one."""
        text = rec.text
        if (m := _ALLOCATION.search(text)) is not None:
            if self._allocated is None:  # the first statement of the allocation counts
                self._allocated = allocation_hosts(m.group(1))
            return True
        if (m := _BOX_HOST.match(text)) is not None:
            self._box_host = (_origin(rec), m.group(1))
            return True
        if (m := _BOX_RANK.match(text)) is not None:
            rank = int(m.group(1))
            origin = _origin(rec)
            host = self._box_host[1] if self._box_host is not None and self._box_host[0] == origin else None
            if host is not None:
                self._rank_hosts.setdefault(rank, host)
            self._box = (origin, rank, host)
            self._box_host = None
            if len(self._boxes) < _MAX_BOXES:
                self._boxes.append((self.lines_in, self.lines_in, rank, rec.host or host))
            return True
        if (m := _SRUN_TASKS.match(text)) is not None:
            host = clean_hostname(m.group(1))
            if host is not None:
                for task in _task_list(m.group(2)):
                    if len(self._srun_tasks) < self.config.max_ids_per_template:
                        self._srun_tasks.setdefault(task, host)
            return True
        if (m := _MPICH_RANK_HOST.search(text)) is not None:
            self._rank_hosts.setdefault(int(m.group(1)), m.group(2))
            return True
        return self._note_deepspeed_worker(rec)

    def _note_deepspeed_worker(self, rec: Record) -> bool:
        """DeepSpeed's launcher lines on a node: its rank among the nodes, then each worker's pid and local rank."""
        if rec.host is None:
            return False
        if (m := _DS_NODE.search(rec.text)) is not None:
            if len(self._ds_nodes) < self.config.max_ids_per_template:
                self._ds_nodes[rec.host] = (int(m.group(1)), int(m.group(2)))
            return True
        node = self._ds_nodes.get(rec.host)
        if node is not None and (m := _DS_SPAWN.search(rec.text)) is not None:
            procs, node_rank = node
            rank = node_rank * procs + int(m.group(2))
            self._note_pid(rec.host, int(m.group(1)), rank)
            self._rank_hosts.setdefault(rank, rec.host)
            return True
        return False

    def _note_pid(self, host: str, pid: int, rank: int) -> None:
        """Which rank a process of a host is (its stack dump, a ps row, an Xid name it by pid)."""
        if len(self._gpu_ranks) <= 3 * self.config.max_ids_per_template:
            self._gpu_ranks.setdefault(f"{host}|pid:{pid}", rank)

    def _within_box(self, rec: Record) -> None:
        """A line of a rank's entry in torchrun's failure box (its exit code, the traceback of its error file) is
        that rank's report: it gets the rank (and the host) the entry names, unless its own prefix says another."""
        assert self._box is not None
        origin, rank, host = self._box
        if _origin(rec) != origin:
            return
        if _BOX_END.match(rec.text) is not None or _BOX_HOST.match(rec.text) is not None:
            self._box = None
            return
        if rec.rank is None:
            rec.rank = rank
            if rec.host is None:
                rec.host = host
        if "(pid: " in rec.text and (m := _BOX_PID.match(rec.text)) is not None and (host or rec.host):
            self._note_pid(host or rec.host or "", int(m.group(1)), rank)
        if self._boxes and self._boxes[-1][2] == rank:
            first, _, _, box_host = self._boxes[-1]
            self._boxes[-1] = (first, rec.line_no, rank, box_host)

    def _source(self, key: str) -> _SourceState:
        src = self._sources.get(key)
        if src is None:
            if len(self._sources) >= self.config.max_sources:
                key = "overflow"
                src = self._sources.get(key)
            if src is None:
                src = _SourceState(tail=deque(maxlen=self.config.tail_lines_per_source))
                self._sources[key] = src
        return src

    def _keep_reason(
        self, rec: Record, shape: _Shape, stats: TemplateStats, src: _SourceState, loss_anomaly: bool
    ) -> str | None:
        text = rec.text
        if src.in_block or shape.block:
            reason = self._block_step(text, shape, src)
            if reason is not None:
                return reason
        if src.in_traceback:
            return self._traceback_step(strip_traceback_prefix(text, src.tb_prefix), src)
        if src.after_exception:
            text = strip_traceback_prefix(text, src.tb_prefix)
            src.after_exception -= 1
            if text and not text[0].isspace() and TRACEBACK_START not in text and self._room():
                return "traceback"
            src.after_exception = 0
        if TRACEBACK_START in text:
            src.in_traceback = self.config.max_traceback_lines
            src.tb_prefix = traceback_prefix(text)
            src.tb_writers, src.tb_strays = 1, 0
            return "traceback"
        if loss_anomaly:
            return "loss"
        if shape.error:
            # Lines that never repeat share one template: its quota would let a flood hide the one
            # real error among them, so only the overall budget bounds them.
            if (stats.kept < self.config.kept_per_error_template or stats.template_id == -3) and self._room():
                if exception_line(text):  # a stray exception line: its message may go on, as after a traceback
                    src.after_exception = 3
                return "error"
            return None
        if stats.count <= self.config.first_lines_per_template and self._room(soft=True):
            return "new_template"
        return None

    def _block_step(self, text: str, shape: _Shape, src: _SourceState) -> str | None:
        """A block's lines are kept whole, up to `max_block_lines` per block; None: not one (any more)."""
        if shape.block:
            src.in_block, src.block_kind = self.config.max_block_lines, shape.block
        elif not (classify_line(text) is not None if src.block_kind == "stack" else is_report_line(text)):
            src.in_block = 0
            return None
        src.in_block -= 1
        return src.block_kind if self._room() else None

    def _traceback_step(self, text: str, src: _SourceState) -> str:
        src.in_traceback -= 1
        if TRACEBACK_START in text:
            src.tb_writers += 1  # another process's, into the same stream
            return "traceback"
        if is_traceback_body(text):
            src.tb_strays = 0
            return "traceback"
        if is_interleaved_stray(text, src.tb_writers, src.tb_strays):
            src.tb_strays += 1
            return "traceback"
        # The first line back at the margin is the exception itself; its message may go on.
        src.in_traceback = 0
        src.after_exception = 3
        return "traceback"

    def _room(self, soft: bool = False) -> bool:
        budget = self.config.max_kept_lines
        return self.lines_kept < (budget // 2 if soft else budget)

    def _keep(self, rec: Record, stats: TemplateStats, reason: str) -> KeptLine:
        stats.kept += 1
        self.lines_kept += 1
        self._kept_ids.add(rec.line_no)
        if len(self._kept_ids) > 4 * self.config.max_kept_lines:
            self._kept_ids.clear()
        return KeptLine(record=rec, template_id=stats.template_id, reason=reason)

    # -- progress: what stalls and loss anomalies are judged by -----------------------------------

    def _note_progress(self, rec: Record, src: _SourceState, source_key: str, shape: _Shape,
                       encoded: bytes) -> LossSignal | None:
        """A progress line: step timing for stalls, and the timeline (per-rank steps, the loss)."""
        self._progress_lines += 1
        self.last_progress = rec
        self._last_progress_line[source_key] = rec.line_no
        ts = rec.ts
        if ts is not None:
            if src.last_progress_ts is not None and ts > src.last_progress_ts:
                gap = ts - src.last_progress_ts
                src.interval_ema = gap if src.interval_ema is None else 0.9 * src.interval_ema + 0.1 * gap
            src.last_progress_ts = ts
            if self._last_progress_ts is None or ts > self._last_progress_ts:
                self._last_progress_ts = ts
        assert shape.progress is not None
        progress = shape.progress
        signal = self.timeline.note(rec, source_key, progress, shape.template_id, encoded)
        if progress.loss_series:
            loss = self.timeline.last_loss
            if loss is not None and math.isfinite(loss):
                self._last_finite_loss_line[source_key] = rec.line_no
        return signal

    def _watch_shape(self, key: bytes, shape: _Shape, rec: Record, source_key: str) -> None:
        """A line that may say a checkpoint was saved, or may turn out to be a counter."""
        if shape.completion:
            self.timeline.note_completion(rec.line_no, rec.ts)
            return
        if shape.checkpoint:
            step = checkpoint_step_of(rec.text)
            if step is not None:
                self.timeline.note_checkpoint(step, rec.line_no, rec.ts if rec.ts is not None else rec.at)
            return
        learner = self.timeline.learner(key)
        learned = learner.look(rec.text, source_key, rec.ts)
        if learned is not None:
            shape.progress = learned
        if learner.done:
            shape.watch = False

    # -- the end of the stream ---------------------------------------------------------------------

    def flush_tails(self) -> list[KeptLine]:
        """The last lines of every source, kept at the end (they often say how a rank died)."""
        out: list[KeptLine] = []
        for src in self._sources.values():
            for rec in src.tail:
                if rec.line_no not in self._kept_ids:
                    out.append(KeptLine(record=rec, template_id=-2, reason="tail"))
            src.tail.clear()
        out.sort(key=lambda k: k.record.line_no)
        self.lines_kept += len(out)
        return out

    def templates(self) -> list[TemplateStats]:
        """Per-template statistics, as reported: the variants of one group (`group_ids()`) summed under
        the group's id (its lowest variant id), with the group's template text."""
        ids, texts = self._grouping()
        out: dict[int, TemplateStats] = {}
        for vid in sorted(self._stats):
            stats = self._stats[vid]
            gid = ids.get(vid, vid)
            if gid == vid:
                stats.template = texts.get(gid, stats.template)
                out[gid] = stats
                continue
            into = out.get(gid)
            if into is None:  # the group's lowest id comes first: should not happen
                out[vid] = stats
                continue
            if into is self._stats.get(gid):  # copy before summing: the live statistics stay per variant
                into = out[gid] = TemplateStats(
                    template_id=gid, template=into.template, count=into.count, first_line=into.first_line,
                    last_line=into.last_line, sample=into.sample, ranks=set(into.ranks), hosts=set(into.hosts),
                    kept=into.kept, error_bearing=into.error_bearing)
            if stats.count and (not into.count or stats.first_line < into.first_line):
                into.first_line, into.sample = stats.first_line, stats.sample
            into.count += stats.count
            into.last_line = max(into.last_line, stats.last_line)
            into.ranks |= stats.ranks
            into.hosts |= stats.hosts
            into.kept += stats.kept
            into.error_bearing |= stats.error_bearing
        return sorted(out.values(), key=lambda s: s.first_line)

    def group_ids(self) -> dict[int, int]:
        """Variant id (`KeptLine.template_id`) -> the id of the template it is reported in."""
        return self._grouping()[0]

    def _grouping(self) -> tuple[dict[int, int], dict[int, str]]:
        """(variant id -> group id, group id -> template text). A group is the variants of the Drain
        clusters `merged_ids()` joins that have the same words at the positions that tell events apart
        (`_telling_positions`). Computed when asked, not in `add()`; cached until the next line."""
        if self._groups is not None and self._groups[0] == self.lines_in:
            return self._groups[1], self._groups[2]
        merged = self.merged_ids()
        members: dict[int, list[int]] = {}
        for cid in sorted(self._clusters):
            members.setdefault(merged.get(cid, cid), []).append(cid)
        ids: dict[int, int] = {}
        texts: dict[int, str] = {}
        for cids in members.values():
            states = [self._clusters[c] for c in cids]
            template = _common_template([self._drain.id_to_cluster[c].log_template_tokens for c in cids])
            telling = self._telling_positions(states, len(template))
            groups: dict[tuple[str | None, ...], list[int]] = {}
            for state in states:
                for key, stats in state.variants.items():
                    groups.setdefault(tuple(key[p] for p in telling), []).append(stats.template_id)
            for words, vids in groups.items():
                gid = min(vids)
                for vid in vids:
                    ids[vid] = gid
                tokens = list(template)
                for p, word in zip(telling, words):
                    tokens[p] = word or PARAM
                texts[gid] = " ".join(tokens)
        self._groups = (self.lines_in, ids, texts)
        return ids, texts

    def _telling_positions(self, states: list[_Cluster], length: int) -> list[int]:
        """The positions that only ever held a few words, each on `split_min_lines` lines or more."""
        c = self.config
        if c.split_max_words < 2 or any(s.closed for s in states):
            return []
        telling = []
        for p in range(length):
            if any(s.words[p] is None for s in states):
                continue
            lines: dict[str | None, int] = {}
            for state in states:
                for key, stats in state.variants.items():
                    lines[key[p]] = lines.get(key[p], 0) + stats.count
            if 2 <= len(lines) <= c.split_max_words and min(lines.values()) >= c.split_min_lines:
                telling.append(p)
        return telling

    def merged_ids(self) -> dict[int, int]:
        """Cluster id -> the id of the group it is reported in. Drain never joins two clusters once
        made, so a cluster that became general (`a <*> c`) sits next to an earlier, more specific one
        (`a b c`) that its lines no longer reach. Templates of the same length that differ only in
        positions where one of them has `<*>` (or are equal) are one group (transitively; the lowest id names it).
        Computed when asked (templates(), template_id_of()), not in `add()`; cached until the next line."""
        if self._merged is not None and self._merged[0] == self.lines_in:
            return self._merged[1]
        parent: dict[int, int] = {}
        if len(self._drain.clusters) > self.config.max_merged_templates:  # pairwise: bounded
            self._merged = (self.lines_in, {})
            return self._merged[1]

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        by_length: dict[int, list[tuple[int, list[str]]]] = {}
        for cluster in sorted(self._drain.clusters, key=lambda c: c.cluster_id):
            cid = cluster.cluster_id
            parent[cid] = cid
            tokens = list(cluster.log_template_tokens)
            if PARAM not in tokens:
                continue  # nothing to widen: it can only be the specific side, found from the other
            by_length.setdefault(len(tokens), []).append((cid, tokens))
        for cluster in self._drain.clusters:
            tokens = cluster.log_template_tokens
            for cid, general in by_length.get(len(tokens), ()):
                if cid != cluster.cluster_id and _covers(general, tokens):
                    a, b = find(cid), find(cluster.cluster_id)
                    if a != b:
                        parent[max(a, b)] = min(a, b)
        merged = {cid: find(cid) for cid in parent}
        self._merged = (self.lines_in, merged)
        return merged

    def template_id_of(self, text: str) -> int | None:
        """The id of the template (as `templates()` reports it) of the lines of this message's shape; None
        if never seen (or if its shape was evicted from the cache since). For benchmarks and tests: costs
        nothing in `add()`."""
        shape = self._shapes.get(text.encode("utf-8", "surrogatepass").translate(None, _DIGITS))
        if shape is None:
            return None
        return self.group_ids().get(shape.template_id, shape.template_id)

    def summary(self, bytes_in: int = 0, lines_truncated: int = 0, srun_tasks_are_ranks: bool = False) -> CompressionSummary:
        """`srun_tasks_are_ranks`: srun's labels numbered the job's ranks (not its nodes), so the tasks its error
        lines name are ranks, and the node they name each one's host."""
        intervals = sorted(s.interval_ema for s in self._sources.values() if s.interval_ema)
        groups = self.group_ids()
        return CompressionSummary(
            lines_in=self.lines_in,
            bytes_in=bytes_in,
            templates=len({groups.get(vid, vid) for vid in self._stats}),
            lines_kept=self.lines_kept,
            lines_truncated=lines_truncated,
            world_size=self._max_rank + 1,
            hosts=sorted(self._hosts),
            first_ts=self._first_ts,
            last_ts=self._last_ts,
            progress_lines=self._progress_lines,
            last_progress_line=dict(self._last_progress_line),
            last_progress_ts=self._last_progress_ts,
            last_finite_loss_line=dict(self._last_finite_loss_line),
            step_interval_s=intervals[len(intervals) // 2] if intervals else None,
            rank_hosts={**self._srun_tasks, **self._rank_hosts} if srun_tasks_are_ranks else dict(self._rank_hosts),
            gpu_ranks=dict(self._gpu_ranks),
            allocated_hosts=list(self._allocated or []),
            failure_boxes=list(self._boxes),
            nccl_setup={h: dict(kinds) for h, kinds in self._nccl_setup.items()},
            srun_task_hosts=dict(self._srun_tasks) if srun_tasks_are_ranks else {},
            launcher_hosts=sorted(set(self._srun_tasks.values())),
            progress=self._progress(),
        )

    def output_mark(self, source_key: str) -> tuple[int, int]:
        """(lines without an error word the source printed so far, the same for the whole job)."""
        src = self._sources.get(source_key)
        return (src.quiet if src is not None else 0), self._quiet

    def _progress(self) -> ProgressSummary:
        progress = self.timeline.summary({k: (s.last_line, s.last_ts) for k, s in self._sources.items()})
        progress.quiet = {k: s.quiet for k, s in self._sources.items()}
        progress.last_work = {k: (w.line_no, w.ts if w.ts is not None else w.at) for k, s in self._sources.items()
                              if (w := s.last_work) is not None}
        progress.job_quiet = self._quiet
        for s in progress.sources:  # a progress line rarely says its host; the rank's other lines do
            if s.host is None and s.rank is not None:
                s.host = self._rank_hosts.get(s.rank)
        return progress

    def finish_timeline(self) -> list[KeptLine]:
        """The stream ended: a loss still far above its course, or a NaN never followed by a finite
        loss, is a divergence (kept as the line where it began)."""
        signal = self.timeline.close()
        if signal is None or signal.divergence is None:
            return []
        return [KeptLine(record=signal.record, template_id=-2, reason="loss", divergence=signal.divergence)]


def _ps_row_kind(text: str) -> int:
    """Whether a line is a `ps aux` row (1), one in state D (2), or neither (0): asked once per shape (the state
    is a word, so a row in another state has another shape). The TTY column ("?", "pts/3") comes first."""
    if " ? " not in text and " pts/" not in text and " tty" not in text:
        return 0
    row = aux_row(text)
    if row is None:
        return 0
    return 2 if row.uninterruptible and not row.kernel_thread else 1


def _task_list(spec: str) -> list[int]:
    """srun's task list, "0-3,6" -> [0, 1, 2, 3, 6] (at most 4096)."""
    tasks: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        tasks += range(int(lo), min(int(hi or lo), int(lo) + 4096) + 1)
        if len(tasks) > 4096:
            return tasks[:4096]
    return tasks


def allocation_hosts(spec: str) -> list[str]:
    """The hosts of an allocation as a scheduler writes it ("n1/0+n2/0*8", "n[01-03,07],m5",
    "<8*n1>, <n2>, in queue <q>"); [] when any part of it is not a plain host name."""
    spec = spec.strip()
    if spec.startswith("<"):  # LSF
        parts = re.findall(r"<(?:\d+\*)?([^>]+)>", spec.split(" in queue", 1)[0])
    elif "+" in spec or "/" in spec:  # PBS: host/slot[*count] joined by +
        parts = [p.split("/", 1)[0] for p in spec.split()[0].split("+")]
    else:  # Slurm hostlist
        parts = _expand_hostlist(spec.split()[0].rstrip(",;"))
    hosts: list[str] = []
    for part in parts:
        host = clean_hostname(part.strip())
        if host is None or len(hosts) >= _MAX_ALLOCATION:
            return []
        if host not in hosts:
            hosts.append(host)
    return hosts


def _expand_hostlist(expr: str) -> list[str]:
    """Slurm's hostlist syntax ("gpu[01-03,07]-ib[1,3],login1"), expanded by python-hostlist one
    top-level part at a time, so that a huge list stops past `_MAX_ALLOCATION` names (each part is
    bounded by the library); [] when a part is not a hostlist."""
    names: list[str] = []
    for part in _HOSTLIST_PART.findall(expr):
        try:
            names += hostlist.expand_hostlist(part)
        except hostlist.BadHostlist:
            return []
        if len(names) > _MAX_ALLOCATION:
            break
    return names


def _common_template(templates: list[list[str]]) -> list[str]:
    """Templates of one length as one: their token where they all agree, <*> where they do not."""
    first = templates[0]
    return [t if all(other[p] == t for other in templates[1:]) else PARAM for p, t in enumerate(first)]


def _covers(general: list[str], tokens: list[str]) -> bool:
    """Whether two templates of one length differ only where one of them has a wildcard (or not at all)."""
    return all(g == t or PARAM in (g, t) for g, t in zip(general, tokens))


