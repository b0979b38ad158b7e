"""The core every interface shares: lines in, a report out.

`Engine` holds what is loaded once per process (settings, rules, models); a `Session` is one job's
streaming state (normalizer, compressor, detector, events). The CLI feeds a session from a file,
the HTTP service from request bodies, `logdx run` from a child process's output.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from logdx.act.report import Report, build_report
from logdx.compress import CompressConfig, Compressor
from logdx.config import Settings
from logdx.detect import DetectConfig, Detector
from logdx.diagnose import Diagnoser
from logdx.diagnose.fusion import FusionWeights
from logdx.diagnose.rules import RuleSet, default_rules_dir, load_rules
from logdx.model import Event, FailureContext, Role

if TYPE_CHECKING:
    from logdx.incidents import IncidentStore
from logdx.normalize import Normalizer, Source, iter_lines, open_input


_TIMING_SAMPLE_MASK = 63


@dataclass
class Engine:
    settings: Settings
    rules: RuleSet
    diagnoser: Diagnoser
    incidents: IncidentStore | None = None  # past incidents and stored reports (None: rules only)

    @classmethod
    def create(
        cls,
        settings: Settings,
        extra_rule_dirs: Sequence[Path] = (),
        *,
        incidents: IncidentStore | None = None,
        warm: bool = False,
    ) -> Engine:
        """Load rules, and the incident store, retrieval and LLM stages that the settings enable.

        Models load lazily at the first diagnosis that needs them; `warm=True` loads them now
        (a server wants to be ready before its first request, a CLI run on a healthy log never
        needs them)."""
        dirs = [default_rules_dir(), *settings.rules.dirs, *extra_rule_dirs]
        rules = load_rules(dirs)
        diagnoser = Diagnoser(rules=rules, weights=FusionWeights.from_settings(settings.fusion),
                              llm_always=settings.llm.always)
        # The model stages (and numpy, torch) are imported only when enabled: a rules-only run starts fast.
        if incidents is None and (settings.retrieval.enabled or settings.llm.enabled):
            from logdx.incidents import IncidentStore
            from logdx.store import open_db

            incidents = IncidentStore(open_db(settings.store.path))
        if settings.retrieval.enabled and incidents is not None:
            from logdx.diagnose.retrieval import RetrievalConfig, Retriever

            diagnoser.retrieval = Retriever(incidents, RetrievalConfig.from_settings(settings.retrieval))
        if settings.llm.enabled:
            from logdx.diagnose.llm import LLMConfig, make_llm

            examples = diagnoser.retrieval.examples if diagnoser.retrieval is not None else None
            diagnoser.llm = make_llm(LLMConfig.from_settings(settings.llm), examples=examples)
        engine = cls(settings=settings, rules=rules, diagnoser=diagnoser, incidents=incidents)
        if warm:
            engine.warm_up()
        return engine

    def warm_up(self) -> dict[str, float]:
        """Load the models now; returns seconds per stage."""
        took: dict[str, float] = {}
        retrieval, llm = self.diagnoser.retrieval, self.diagnoser.llm
        if retrieval is not None:
            t0 = time.perf_counter()
            retrieval.ensure_index()
            took["retrieval"] = time.perf_counter() - t0
        if llm is not None and hasattr(llm, "load"):
            t0 = time.perf_counter()
            llm.load()
            took["llm"] = time.perf_counter() - t0
        return took

    def remember(self, report: Report, context: FailureContext | None) -> None:
        """Store a report (with the masked context it was made from) so feedback can learn from it."""
        if self.incidents is not None:
            self.incidents.save_report(report.model_dump(mode="json"), context=context)

    def new_session(self) -> Session:
        return Session(self)

    def diagnose_path(self, path: str | Path, *, with_context: bool = False):  # noqa: ANN201
        """Diagnose a whole file (or `-` for stdin) in one streaming pass; with `with_context`,
        also the masked failure context (what `remember` stores for feedback)."""
        session = self.new_session()
        with open_input(path) as f:
            session.feed_lines(iter_lines(f, self.settings.input.max_line_bytes))
        report = session.report()
        return (report, session.last_context) if with_context else report


@dataclass
class Session:
    engine: Engine

    def __post_init__(self) -> None:
        s = self.engine.settings
        self.normalizer = Normalizer(max_line_bytes=s.input.max_line_bytes)
        self.compressor = Compressor(
            CompressConfig(
                drain_depth=s.compress.drain_depth,
                drain_sim_th=s.compress.drain_sim_th,
                max_templates=s.compress.max_templates,
                max_kept_lines=s.compress.max_kept_lines,
                kept_per_error_template=s.compress.kept_per_error_template,
                tail_lines_per_source=s.compress.tail_lines_per_source,
                split_max_words=s.compress.split_max_words,
            ),
            also_error=self.engine.rules.could_match,
        )
        self.detector = Detector(DetectConfig(stall_factor=s.detect.stall_factor, stall_min_s=s.detect.stall_min_s))
        self.events: list[Event] = []
        self.root_cause_events: list[Event] = []  # events a root-cause rule matched, as they came
        self.finished = False
        self.last_context: FailureContext | None = None  # of the last diagnosis, for `remember`
        self._normalize_s = 0.0
        self._compress_s = 0.0
        self._fed = 0

    def feed(self, raw: bytes | str, source: Source | None = None) -> list[Event]:
        """One line in; returns the events it completed (most lines complete none)."""
        self._fed += 1
        if self._fed & _TIMING_SAMPLE_MASK == 0:
            return self._feed_timed(raw, source)
        kept = self.compressor.add(self.normalizer.normalize(raw, source))
        return self._detect(kept) if kept else []

    def _feed_timed(self, raw: bytes | str, source: Source | None) -> list[Event]:
        # Clocks cost as much as a repeated line: one line in 64 is timed, and stands for the 64.
        t0 = time.perf_counter()
        rec = self.normalizer.normalize(raw, source)
        t1 = time.perf_counter()
        kept = self.compressor.add(rec)
        new = self._detect(kept) if kept else []
        self._normalize_s += (t1 - t0) * (_TIMING_SAMPLE_MASK + 1)
        self._compress_s += (time.perf_counter() - t1) * (_TIMING_SAMPLE_MASK + 1)
        return new

    def _detect(self, kept: list) -> list[Event]:  # noqa: ANN001 - list[KeptLine]
        new: list[Event] = []
        for k in kept:
            new.extend(self.detector.feed(k))
        if new:
            self._note_events(new)
        return new

    def feed_lines(self, lines: Iterable[bytes | str], source: Source | None = None) -> None:
        for raw in lines:
            self.feed(raw, source)

    def _note_events(self, new: list[Event]) -> None:
        self.events.extend(new)
        for ev in new:
            hits = self.engine.rules.match(ev)
            if hits and hits[0].role == Role.ROOT_CAUSE:
                self.root_cause_events.append(ev)

    @property
    def root_cause_seen(self) -> bool:
        """A precise root cause has appeared: reason enough to diagnose before the job ends."""
        return bool(self.root_cause_events)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        for kept in self.compressor.flush_tails():
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

    def _summary(self):  # noqa: ANN202 - CompressionSummary
        return self.compressor.summary(bytes_in=self.normalizer.bytes_in, lines_truncated=self.normalizer.truncated)
