"""The core every interface shares: lines in, a report out.

`Engine` holds what is loaded once per process (settings, rules, models); a `Session` is one job's
streaming state (normalizer, compressor, detector, events). The CLI feeds a session from a file,
the HTTP service from request bodies, `logdx run` from a child process's output.

A face (CLI, service, `logdx run`) asks the session what it needs (`lines`, `templates()`,
`summary()`, `last_progress`, `take_new_root_causes()`...) and never reaches into its parts.
"""

from __future__ import annotations

import gzip
import io
import pickle
import time
import types
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from logdx import __version__
from logdx.act.report import Report, build_report
from logdx.compress import CompressConfig, Compressor, KeepPolicy
from logdx.config import Settings
from logdx.detect import DetectConfig, Detector
from logdx.diagnose.cascade import Diagnoser
from logdx.diagnose.fusion import FusionWeights
from logdx.diagnose.rules import RuleSet, default_rules_dir, load_rules
from logdx.evidence import EvidenceRecorder
from logdx.model import (
    FT,
    READ_AS_A_WHOLE,
    CompressionSummary,
    Event,
    EventKind,
    FailureContext,
    KeptLine,
    Record,
    Role,
    StageVote,
    TemplateStats,
)

if TYPE_CHECKING:
    from logdx.flightrec import FrFindings
from logdx.hosts import HostScope
from logdx.normalize import InputError, Normalizer, Source, iter_lines, open_input

if TYPE_CHECKING:
    from logdx.diagnose.retrieval import Retriever
    from logdx.incidents import IncidentStore


_TIMING_SAMPLE_MASK = 63
_MAX_STREAMS = 65536  # streams whose time a session remembers apart
_MAX_AWAITING = 4096  # kept lines of one stream waiting for its next stamp
_MAX_TRUSTED = 65536  # hosts a session remembers as vouched for


@dataclass
class Engine:
    settings: Settings
    rules: RuleSet
    diagnoser: Diagnoser
    incidents: IncidentStore | None = None  # past incidents and stored reports (None: rules only)
    # Which lines each session's compressor keeps whole: a factory of the job's CompressConfig (a class taking
    # it does); None: logdx's own (compress.DefaultKeepPolicy). See keep_policy.py.
    keep_policy: Callable[[CompressConfig], KeepPolicy] | None = None

    @classmethod
    def create(
        cls,
        settings: Settings,
        extra_rule_dirs: Sequence[Path] = (),
        *,
        incidents: IncidentStore | None = None,
        warm: bool = False,
        keep_policy: Callable[[CompressConfig], KeepPolicy] | None = None,
    ) -> Engine:
        """Load rules, and the incident store, retrieval and LLM stages that the settings enable.

        Models load lazily at the first diagnosis that needs them; `warm=True` loads them now
        (a server wants to be ready before its first request, a CLI run on a healthy log never
        needs them). `keep_policy`: see `Engine.keep_policy`."""
        dirs = [default_rules_dir(), *settings.rules.dirs, *extra_rule_dirs]
        rules = load_rules(dirs, cache_dir=settings.data_dir / "cache")
        diagnoser = _rules_and_catalog(settings, rules)
        # The model stages (and numpy, torch) are imported only when enabled: a rules-only run starts fast.
        if incidents is None and (settings.retrieval.enabled or settings.llm.enabled):
            from logdx.incidents import IncidentStore
            from logdx.store import open_db

            incidents = IncidentStore(open_db(settings.store.location, settings.store.pool_size))
        retriever: Retriever | None = None
        if settings.retrieval.enabled and incidents is not None:
            from logdx.diagnose.retrieval import Retriever

            diagnoser.retrieval = retriever = Retriever(incidents, settings.retrieval)
        if retriever is not None and settings.arbiter.stage in ("classifier", "both"):
            from logdx.diagnose.arbiter import Arbiter

            diagnoser.arbiter = Arbiter(retriever, settings.arbiter, cache_dir=settings.data_dir / "cache")
        if settings.llm.enabled and settings.arbiter.stage in ("llm", "both"):
            from logdx.diagnose.llm import make_llm

            examples = retriever.examples if retriever is not None else None
            diagnoser.llm = make_llm(settings.llm, examples=examples)
        engine = cls(settings=settings, rules=rules, diagnoser=diagnoser, incidents=incidents, keep_policy=keep_policy)
        if warm:
            engine.warm_up()
        return engine

    @classmethod
    def for_rules(cls, settings: Settings, rules: RuleSet) -> Engine:
        """An engine of these rules and the catalog (as the settings say), no model stage: what a
        rule pack's raw-input tests and `logdx rules explain` run on."""
        return cls(settings=settings, rules=rules, diagnoser=_rules_and_catalog(settings, rules))

    def model_stages(self) -> list[tuple[str, str, Callable[[], str]]]:
        """The models to load before the first diagnosis, in order: (stage, what loading it does,
        load() -> what it loaded). Loading is idempotent; a stage that has nothing to load is absent."""
        stages: list[tuple[str, str, Callable[[], str]]] = []
        # The retrieval stage an engine loads is create()'s Retriever (the cascade needs only its search).
        retrieval, llm = cast("Retriever | None", self.diagnoser.retrieval), self.diagnoser.llm
        if retrieval is not None:
            def load_retrieval() -> str:
                retrieval.ensure_index()
                s = retrieval.stats
                how = "loaded from disk" if s.loaded_from_disk else f"built ({s.embedded} embedded)"
                return f"index of past incidents {how}"

            stages.append(("retrieval", "loading the embedding model and the index of past incidents", load_retrieval))
        arbiter = self.diagnoser.arbiter
        fitted = getattr(arbiter, "fitted", None)
        if fitted is not None:
            def fit_arbiter() -> str:
                fit = fitted()
                return f"arbiter over {len(fit.names) if fit else 0} examples"

            stages.append(("arbiter", "fitting the arbiter over past incidents (cached by their content)", fit_arbiter))
        load_llm = getattr(llm, "load", None)
        if llm is not None and load_llm is not None:
            where = getattr(llm, "model_dir", "")

            def load_lm() -> str:
                lm = load_llm()
                return f"{getattr(lm, 'runtime', 'model')} runtime, {where}"

            stages.append(("llm", f"loading the LLM from {where} (converting the packaged one first if missing)",
                           load_lm))
        return stages

    def warm_up(self) -> dict[str, float]:
        """Load the models now; returns seconds per stage."""
        took: dict[str, float] = {}
        for name, _, load in self.model_stages():
            t0 = time.perf_counter()
            load()
            took[name] = time.perf_counter() - t0
        return took

    def remember(self, report: Report, context: FailureContext | None) -> None:
        """Store a report (with the masked context it was made from) so feedback can learn from it."""
        if self.incidents is not None:
            self.incidents.save_report(report.model_dump(mode="json"), context=context)

    def new_session(self, *, live: bool = False, vouching: bool = False, evidence: bool = False) -> Session:
        """A job's session. `live`: its lines are read as they are written (the service's streams, `logdx
        run`'s child), so a stamp without a year is of this year; otherwise such a stamp waits for a line
        that says the year (or the reader's `Session.hint_year`). `vouching`: its lines come from senders who
        may speak for some hosts only (`Source.scope`): a host is trusted as the job's when one of them named
        it (else every host the lines name is: the reader's own files). `evidence`: keep the recent lines for
        the evidence capsule (`logdx.evidence`), when an actuator is configured and `actions.capsule.enabled`."""
        session = Session(self)
        capsule = self.settings.actions.capsule
        if evidence and capsule.enabled and self.settings.actions.actuator_settings() is not None:
            # Lines are kept for the evidence capsule only where a cordon may follow.
            session.record_evidence(capsule.context_lines, capsule.max_sources, capsule.near_s)
        if vouching:
            session.trusted = set()
        if live:
            now = time.gmtime()
            session.hint_year(now.tm_year, now.tm_mon)
        return session

    def diagnose_path(self, path: str | Path, exit_code: int | None = None,
                      fr: FrFindings | None = None) -> tuple[Report, FailureContext | None]:
        """Diagnose a whole file (or `-` for stdin) in one streaming pass: the report, and the
        masked failure context it was made from (what `remember` stores for feedback). `exit_code`:
        how the job ended, when known (0 and no fatal event is healthy); `fr`: its flight-recorder findings.

        Raises `InputError` when the input cannot be read, a truncated or corrupt gzip included."""
        session = self.new_session()
        with open_input(path) as f:
            try:
                session.feed_lines(iter_lines(f, self.settings.input.max_line_bytes))
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                name = "stdin" if str(path) == "-" else str(path)
                raise InputError(f"{name}: truncated or corrupt gzip data ({e})") from None
        if fr is not None:
            session.add_flight_recorder(fr)
        report = session.report(exit_code)
        return report, session.last_context


def _rules_and_catalog(settings: Settings, rules: RuleSet) -> Diagnoser:
    diagnoser = Diagnoser(rules=rules, weights=FusionWeights.from_settings(settings.fusion),
                          llm_always=settings.llm.always)
    if settings.catalog.enabled:
        diagnoser.catalog = _CatalogVote(settings.data_dir / "cache")
    return diagnoser


@dataclass(frozen=True, slots=True)
class _CatalogVote:
    """The catalog stage, imported when a root line first needs it: most jobs' errors a rule names,
    and then the catalog's module (and its regexes) never loads."""

    cache_dir: Path  # where its index is built if none was installed

    def __call__(self, ctx: FailureContext) -> StageVote:
        from logdx.diagnose.catalog_stage import catalog_vote, use_cache_dir

        use_cache_dir(self.cache_dir)
        return catalog_vote(ctx)


_SNAPSHOT_MAGIC = b"LDXSESS1"


class _SnapshotPickler(pickle.Pickler):
    """Pickles a session without its engine: the engine, its rules and the rules' bound methods
    (the compressor's `also_error`) are named, and the restoring process puts its own in."""

    def __init__(self, file: io.BytesIO, engine: Engine) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.engine = engine

    def persistent_id(self, obj: object) -> object:
        if obj is self.engine:
            return "engine"
        if obj is self.engine.rules:
            return "rules"
        if isinstance(obj, types.MethodType) and obj.__self__ is self.engine.rules:
            return ("rules.", obj.__func__.__name__)
        return None


class _SnapshotUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, engine: Engine) -> None:
        super().__init__(file)
        self.engine = engine

    def persistent_load(self, pid: object) -> object:
        if pid == "engine":
            return self.engine
        if pid == "rules":
            return self.engine.rules
        if isinstance(pid, tuple) and pid[0] == "rules.":
            return getattr(self.engine.rules, pid[1])
        raise pickle.UnpicklingError(f"unknown reference {pid!r} in a session snapshot")


class SnapshotError(ValueError):
    """A saved session that cannot be restored here (another logdx version, damaged bytes)."""


@dataclass
class Session:
    engine: Engine

    def __post_init__(self) -> None:
        s = self.engine.settings
        self.normalizer = Normalizer(max_line_bytes=s.input.max_line_bytes)
        config = CompressConfig(
            drain_depth=s.compress.drain_depth,
            drain_sim_th=s.compress.drain_sim_th,
            max_templates=s.compress.max_templates,
            max_tokens=s.compress.max_tokens,
            max_kept_lines=s.compress.max_kept_lines,
            kept_per_error_template=s.compress.kept_per_error_template,
            tail_lines_per_source=s.compress.tail_lines_per_source,
            split_max_words=s.compress.split_max_words,
        )
        make_policy = self.engine.keep_policy
        self.compressor = Compressor(config, also_error=self.engine.rules.could_match,
                                     keep_policy=make_policy(config) if make_policy is not None else None)
        self.detector = Detector(DetectConfig(stall_factor=s.detect.stall_factor, stall_min_s=s.detect.stall_min_s))
        self.events: list[Event] = []
        self.root_cause_events: list[Event] = []  # events a root-cause rule matched, as they came
        self.finished = False
        self.last_context: FailureContext | None = None  # of the last diagnosis, for `remember`
        self._root_causes_taken = 0
        # Hosts named by a sender that may speak for them (`Source.scope`); None: every host the lines name.
        self.trusted: set[str] | None = None
        self._scope: HostScope | None = None  # the current stream's, when it may speak for some host
        self._everywhere_only = True  # every stream so far could speak for every host
        # The stream lines come in on (its source, as the transport gave it) and the time of its last stamped line.
        self._stream_source: Source | None = None
        self._stream_key: tuple | None = None
        self._stream_ts: float | None = None
        self._stream_index = 0
        self._stream_times: dict[tuple | None, tuple[int, float | None]] = {}
        self._awaiting: dict[int, list[Record]] = {}  # per stream: kept lines whose time has only a lower bound
        self._normalize_s = 0.0
        self._compress_s = 0.0
        self._fed = 0
        # The recent lines per source, for the evidence capsule (`record_evidence`); None: not kept.
        self.recorder: EvidenceRecorder | None = None

    def feed(self, raw: bytes | str, source: Source | None = None) -> list[Event]:
        """One line in; returns the events it completed (most lines complete none)."""
        self._fed += 1
        if self._fed & _TIMING_SAMPLE_MASK == 0:
            return self._feed_timed(raw, source)
        rec = self.normalizer.normalize(raw, source)
        if source is not self._stream_source:
            self._switch_stream(source)
        rec.feed = self._stream_index
        if rec.ts is None:
            if not rec.unanchored:
                rec.at = self._stream_ts
        else:
            rec.at = self._stream_ts = rec.ts
            if self._awaiting:
                self._bound(rec)
        if self._scope is not None and rec.host is not None:
            self._vouch(rec.host)
        if self.recorder is not None:
            self.recorder.add(rec)
        kept = self.compressor.add(rec)
        return self._detect(kept) if kept else []

    def record_evidence(self, context_lines: int, max_sources: int, near_s: float) -> EvidenceRecorder:
        """Keep the recent lines of every source from now on, for an evidence capsule (`logdx.evidence`)."""
        self.recorder = EvidenceRecorder(context_lines, max_sources, near_s)
        return self.recorder

    def hint_year(self, year: int, month: int) -> None:
        """The year (and month) the log's first stamps without a year belong to, when the reader knows it:
        the file's modification time, a live stream's now."""
        self.normalizer.hint_year(year, month)

    def feed_record(self, raw: bytes | str, source: Source | None = None) -> tuple[Record, list[Event]]:
        """One line in, with the record the normaliser made of it (`logdx rules explain`)."""
        rec = self._record(raw, source)
        kept = self.compressor.add(rec)
        return rec, (self._detect(kept) if kept else [])

    def _record(self, raw: bytes | str, source: Source | None) -> Record:
        """The line's record, with when it was written as far as its stream tells (`Record.at`): a line without
        a stamp of its own (a traceback's frames and exception, a bare progress bar) was written when the line
        before it in its stream was, or just after.
        (`feed` has this inline: it is the hot path.)"""
        rec = self.normalizer.normalize(raw, source)
        if source is not self._stream_source:
            self._switch_stream(source)
        rec.feed = self._stream_index
        if rec.ts is None:
            if not rec.unanchored:
                rec.at = self._stream_ts
        else:
            rec.at = self._stream_ts = rec.ts
            if self._awaiting:
                self._bound(rec)
        if self._scope is not None and rec.host is not None:
            self._vouch(rec.host)
        if self.recorder is not None:
            self.recorder.add(rec)
        return rec

    def _vouch(self, host: str) -> None:
        trusted = self.trusted
        if trusted is not None and host not in trusted and len(trusted) < _MAX_TRUSTED and self._scope is not None \
                and self._scope.allows(host):
            trusted.add(host)

    def _bound(self, stamped: Record) -> None:
        """A stamped line: the kept lines of its stream that had only their predecessor's time were written
        by this one's."""
        waiting = self._awaiting.pop(stamped.feed, None)
        if waiting:
            for rec in waiting:
                rec.until = stamped.ts

    def _switch_stream(self, source: Source | None) -> None:
        """Lines of another stream (a file, a shipper's upload for one host or rank) come in: each stream keeps
        its own time."""
        streams = self._stream_times
        streams[self._stream_key] = (self._stream_index, self._stream_ts)
        key: tuple | None = None if source is None else (source.host, source.rank, source.stream)
        if key not in streams and len(streams) >= _MAX_STREAMS:
            key = ("overflow",)
        self._stream_source, self._stream_key = source, key
        self._stream_index, self._stream_ts = streams.get(key, (len(streams), None))
        if self.trusted is not None:
            scope = source.scope if source is not None else None
            if scope is None or not scope.is_everywhere:
                self._everywhere_only = False
            self._scope = None if scope is None or scope.is_nowhere else scope

    def _feed_timed(self, raw: bytes | str, source: Source | None) -> list[Event]:
        # Clocks cost as much as a repeated line: one line in 64 is timed, and stands for the 64.
        t0 = time.perf_counter()
        rec = self._record(raw, source)
        t1 = time.perf_counter()
        kept = self.compressor.add(rec)
        new = self._detect(kept) if kept else []
        self._normalize_s += (t1 - t0) * (_TIMING_SAMPLE_MASK + 1)
        self._compress_s += (time.perf_counter() - t1) * (_TIMING_SAMPLE_MASK + 1)
        return new

    def _detect(self, kept: list[KeptLine]) -> list[Event]:
        new: list[Event] = []
        for k in kept:
            if k.record.ts is None and k.record.at is not None:  # written by its stream's next stamp: wait for it
                waiting = self._awaiting.setdefault(k.record.feed, [])
                if len(waiting) < _MAX_AWAITING:
                    waiting.append(k.record)
            new.extend(self.detector.feed(k))
        if new:
            self._note_events(new)
        return new

    def feed_lines(self, lines: Iterable[bytes | str], source: Source | None = None) -> int:
        """Lines that share one source; returns how many were fed. (`feed` inline, the stream chosen once: this
        loop is where a whole file's lines go.)"""
        if source is not self._stream_source:
            self._switch_stream(source)
        normalize, add, feed_index = self.normalizer.normalize, self.compressor.add, self._stream_index
        vouch = self._vouch if self._scope is not None else None
        record = self.recorder.add if self.recorder is not None else None
        n = 0
        for raw in lines:
            n += 1
            self._fed += 1
            if self._fed & _TIMING_SAMPLE_MASK == 0:
                self._feed_timed(raw, source)
                continue
            rec = normalize(raw, source)
            rec.feed = feed_index
            if rec.ts is None:
                if not rec.unanchored:
                    rec.at = self._stream_ts
            else:
                rec.at = self._stream_ts = rec.ts
                if self._awaiting:
                    self._bound(rec)
            if vouch is not None and rec.host is not None:
                vouch(rec.host)
            if record is not None:
                record(rec)
            kept = add(rec)
            if kept:
                self._detect(kept)
        return n

    def feed_records(self, records: Iterable[tuple[int, Record, Source | None]],
                     on_line: Callable[[int, int, int], None] | None = None) -> int:
        """Records a reader already normalised, each with its stream's index and the source it was normalised with
        (a job's files merged in time order: the merge read each line to place it, `logdx.jobinput`); returns how
        many were fed. They are numbered here, in the order they come (`on_line(line_no, stream index, its line
        number in its stream)` for each); what their normalisers read (bytes, srun's labels) joins the session's
        reading with `absorb`. (`feed` inline, without normalising.)"""
        normalizer, add, detect = self.normalizer, self.compressor.add, self._detect
        record = self.recorder.add if self.recorder is not None else None
        mask = _TIMING_SAMPLE_MASK
        n = 0
        before = time.perf_counter()  # when the line before a timed one was done: the reader made the record since
        for index, rec, source in records:
            n += 1
            self._fed += 1
            timed = self._fed & mask == 0
            if timed:
                t0 = time.perf_counter()
                self._normalize_s += (t0 - before) * (mask + 1)
            normalizer.line_no += 1
            if on_line is not None:
                on_line(normalizer.line_no, index, rec.line_no)
            rec.line_no = normalizer.line_no
            if rec.truncated:
                normalizer.truncated += 1
            if source is not self._stream_source:
                self._switch_stream(source)
            rec.feed = self._stream_index
            if rec.ts is None:
                if not rec.unanchored:
                    rec.at = self._stream_ts
            else:
                rec.at = self._stream_ts = rec.ts
                if self._awaiting:
                    self._bound(rec)
            if self._scope is not None and rec.host is not None:
                self._vouch(rec.host)
            if record is not None:
                record(rec)
            kept = add(rec)
            if kept:
                detect(kept)
            if timed:
                # One line in 64 is timed, and stands for the 64: its reading (the reader's read, normalise and
                # merge) and its compressing.
                self._compress_s += (time.perf_counter() - t0) * (mask + 1)
            elif (self._fed + 1) & mask == 0:
                before = time.perf_counter()
        return n

    def absorb(self, normalizers: Iterable[Normalizer]) -> None:
        """What the normalisers of `feed_records`' records read counts as this session's reading."""
        for n in normalizers:
            self.normalizer.absorb(n)

    def feed_runs(self, runs: Iterable[tuple[Source, Sequence[bytes | str]]]) -> int:
        """Runs of lines, each run sharing a source (what the service's parsers produce)."""
        return sum(self.feed_lines(lines, source) for source, lines in runs)

    def _note_events(self, new: list[Event]) -> None:
        self.events.extend(new)
        timeline = self.compressor.timeline
        for ev in new:
            # Where its rank and the job were when it happened: did they go on after it?
            if "progress_at" not in ev.attrs:
                mark = timeline.mark(ev.anchor.source_key, ev.anchor.feed)
                mark.source_quiet, mark.job_quiet = self.compressor.output_mark(ev.anchor.source_key)
                ev.attrs["progress_at"] = mark
            if ev.kind in READ_AS_A_WHOLE:
                continue  # read as a whole by the diagnosis (diagnose/hangs.py, culprit.py)
            hits = self.engine.rules.match(ev)
            if hits and hits[0].role == Role.ROOT_CAUSE:
                self.root_cause_events.append(ev)
                if self.recorder is not None:
                    self.recorder.freeze(ev.anchor)

    @property
    def root_cause_seen(self) -> bool:
        """A precise root cause has appeared: reason enough to diagnose before the job ends."""
        return bool(self.root_cause_events)

    def add_flight_recorder(self, findings: FrFindings, where: str = "flight-recorder dumps") -> None:
        """A job's flight-recorder findings (logdx.flightrec), read beside its log: the ranks missing
        from the collective everyone else waits in. They stand as a line of their own (line 0: not the
        log's) that the diagnosis reads like an fr_trace report printed in the log."""
        first = findings.summary().splitlines()[0] if findings.groups else "no collective recorded"
        text = f"{where}: {first}"
        rec = Record(line_no=0, raw=text, text=text)
        self._note_events([Event(kind=EventKind.FR_REPORT, anchor=rec, lines=[rec], attrs={"findings": findings})])

    def take_new_root_causes(self) -> list[Event]:
        """Root-cause events that appeared since the last call (all of them the first time)."""
        new = self.root_cause_events[self._root_causes_taken:]
        self._root_causes_taken = len(self.root_cause_events)
        return new

    # -- what faces ask ---------------------------------------------------------------------------

    @property
    def lines(self) -> int:
        """Lines fed so far."""
        return self.normalizer.line_no

    @property
    def truncated_lines(self) -> int:
        """Lines cut at `input.max_line_bytes` so far."""
        return self.normalizer.truncated

    @property
    def last_progress(self) -> Record | None:
        """The last training progress line (iteration/step/loss) seen, or None."""
        return self.compressor.last_progress

    @property
    def templates_capped(self) -> bool:
        """The job reached `compress.max_templates`: new templates share one overflow template."""
        return self.compressor.template_cap_reached

    def templates(self) -> list[TemplateStats]:
        """Every Drain template so far, with its counts, ranks and hosts."""
        return self.compressor.templates()

    def summary(self) -> CompressionSummary:
        return self._summary()

    def event_counts(self) -> dict[str, int]:
        """Events so far, by kind."""
        counts: dict[str, int] = {}
        for ev in self.events:
            counts[ev.kind] = counts.get(ev.kind, 0) + 1
        return counts

    def is_diverged(self, event: Event) -> bool:
        """Whether a root-cause event says the loss went NaN/inf (however the pipeline tagged the
        line: a `loss_nan` event, or a line a `nan_loss` rule matched)."""
        if event.kind == EventKind.LOSS_NAN:
            return True
        if event.kind == EventKind.LOSS_SPIKE:
            return False  # a spike that stayed up is its own trigger (`--loss-trigger spike`), not NaN
        hits = self.engine.rules.match(event)
        return bool(hits) and hits[0].label.failure_type == FT.NAN_LOSS

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        for kept in self.compressor.flush_tails():
            self._note_events(self.detector.feed(kept))
        for kept in self.compressor.finish_timeline():
            self._note_events(self.detector.feed(kept))
        summary = self._summary()
        self._note_events(self.detector.finish(summary, self.compressor.last_progress))

    def report(self, exit_code: int | None = None, final: bool = True) -> Report:
        """Diagnose what has been seen. `final=False` leaves the stream open for more lines."""
        if final:
            self.finish()
        t0 = time.perf_counter()
        summary = self._summary()
        diagnosis = self.engine.diagnoser.diagnose(self.events, summary, self.compressor.templates(), exit_code)
        self.last_context = diagnosis.context
        timings = {"read": self._normalize_s * 1000, "compress": self._compress_s * 1000}
        timings["diagnose"] = (time.perf_counter() - t0) * 1000
        timings.update({f"diagnose.{stage}": ms for stage, ms in diagnosis.stage_ms.items()})
        return build_report(diagnosis, summary, timings)

    def _summary(self) -> CompressionSummary:
        summary = self.compressor.summary(bytes_in=self.normalizer.bytes_in, lines_truncated=self.normalizer.truncated,
                                          srun_tasks_are_ranks=self.normalizer.srun_tasks_are_ranks)
        if self.trusted is not None and not self._everywhere_only:
            summary.trusted_hosts = frozenset(self.trusted)
        return summary

    # -- snapshots: a session moves to another process ---------------------------------------

    def snapshot(self) -> bytes:
        """The whole streaming state (normaliser, Drain miner, detector, events) as bytes another
        process of the same logdx version restores with `Session.restore`. The engine is not in
        it. Pickle: the bytes must come from a store only logdx writes (they are code to Python)."""
        buf = io.BytesIO()
        _SnapshotPickler(buf, self.engine).dump((__version__, self))
        return _SNAPSHOT_MAGIC + zlib.compress(buf.getvalue(), 1)

    @classmethod
    def restore(cls, engine: Engine, blob: bytes) -> Session:
        """A session from `snapshot()` bytes, attached to `engine`; `SnapshotError` when it cannot be."""
        if not blob.startswith(_SNAPSHOT_MAGIC):
            raise SnapshotError("not a logdx session snapshot")
        try:
            version, session = _SnapshotUnpickler(io.BytesIO(zlib.decompress(blob[len(_SNAPSHOT_MAGIC):])),
                                                  engine).load()
        except Exception as e:
            raise SnapshotError(f"session snapshot unreadable: {type(e).__name__}: {e}") from e
        if version != __version__ or not isinstance(session, cls):
            raise SnapshotError(f"session snapshot of logdx {version}, this is {__version__}")
        return session
