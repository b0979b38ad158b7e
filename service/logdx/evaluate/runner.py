"""Diagnose every log of a set once per cascade, and score each report.

A log is read once (normalize, compress, detect: the cost of a long log); then each cascade diagnoses
the same session: ``rules`` (rules and the error catalog, what ``--no-llm --no-retrieval`` gives) and
``default`` (with retrieval and the LLM when they are enabled). When the set knows how the job exited,
each cascade also reports with that exit code (what ``diagnose --exit-code N`` and ``logdx run`` see).
Generated logs live in memory; ``keep`` writes them (and their truth) to a folder to look at misses.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, TextIO

from logdx.act.report import Report
from logdx.evaluate.corpus import CaseResult, same_incidents
from logdx.jobinput.read import OneInput
from logdx.pipeline import Engine


@dataclass(frozen=True, slots=True)
class Cascade:
    name: str
    retrieval: bool
    llm: bool
    arbiter: bool = False
    same_as: str | None = None  # the report of that cascade (of the same stages), not diagnosed twice


# What `compare` adds: each arbiter in turn, behind retrieval (arbiter.stage's choices).
_ARBITERS = (("retrieval", False, False), ("classifier", True, False), ("llm", False, True), ("both", True, True))


def cascades_of(engine: Engine, *, quick: bool, compare: bool = False, default_stage: str | None = None) -> list[Cascade]:
    """``rules`` always; ``default`` when the engine has a later stage and ``quick`` is off. ``compare``: also
    retrieval without an arbiter, then the classifier, the LLM and both (whichever the engine has), ``default``
    being the one ``default_stage`` (arbiter.stage) names."""
    d = engine.diagnoser
    out = [Cascade("rules", False, False)]
    if quick or (d.retrieval is None and d.llm is None and d.arbiter is None):
        return out
    if not compare:
        return [*out, Cascade("default", d.retrieval is not None, d.llm is not None, d.arbiter is not None)]
    for name, arbiter, llm in _ARBITERS:
        if (arbiter and d.arbiter is None) or (llm and d.llm is None):
            continue
        out.append(Cascade(name, d.retrieval is not None, llm, arbiter))
    names = [c.name for c in out]
    if default_stage in names:
        out.append(Cascade("default", False, False, same_as=default_stage))
    return out


Scorer = Callable[[dict, Report, Any], dict[str, bool | None]]


@dataclass(slots=True)
class Item:
    """One log of a set: how to get its bytes and truth, its label, how to score a report of it."""

    case_id: str
    make: Callable[[], tuple[bytes, Any]]  # -> (the log, its truth or None)
    label_of: Callable[[Any], dict]  # truth -> label
    score: Scorer  # (label, report, truth) -> marks
    exit_code_of: Callable[[Any], int | None] = lambda _truth: None
    variant: dict[str, Any] | None = None
    corpus_label: dict | None = None  # a corpus case: hidden from retrieval while it is diagnosed


@dataclass(slots=True)
class JobResult:
    set_name: str
    case_id: str
    label: dict
    truth: Any
    variant: dict[str, Any] | None
    lines: int
    seconds: float
    reports: dict[str, Report] = field(default_factory=dict)
    exit_reports: dict[str, Report] = field(default_factory=dict)
    marks: dict[str, dict[str, bool | None]] = field(default_factory=dict)
    exit_marks: dict[str, dict[str, bool | None]] = field(default_factory=dict)

    def view(self, cascade: str, *, exit_known: bool = False) -> CaseResult:
        """This run as the excerpts' ``CaseResult`` (for their tables, calibration and misses)."""
        reports, marks = (self.exit_reports, self.exit_marks) if exit_known else (self.reports, self.marks)
        return CaseResult(self.case_id, self.label, reports[cascade], correct=marks[cascade], seconds=self.seconds,
                          variant=self.variant, truth=self.truth)


def generated(write: Callable[[TextIO], Any]) -> tuple[bytes, Any]:
    """Run a generator into memory: the log as a file would hold it (odd bytes kept), and its truth."""
    buf = io.StringIO()
    truth = write(buf)
    return buf.getvalue().encode("utf-8", "surrogateescape"), truth


def diagnose_log(engine: Engine, data: bytes, cascades: list[Cascade], exit_code: int | None,
                 exclude: tuple[str, ...] = ()) -> tuple[dict[str, Report], dict[str, Report]]:
    """Read ``data`` once, then one report per cascade (and one per cascade given ``exit_code``)."""
    session = engine.new_session()
    # Read as `diagnose` reads a text log (`logdx.jobinput`), with no year but its own lines' (the bytes have no file).
    OneInput(io.BytesIO(data), "log", "text", engine.settings.input).feed(session)
    d = engine.diagnoser
    saved = (d.retrieval, d.llm, d.arbiter, d.exclude_incidents)
    reports: dict[str, Report] = {}
    exit_reports: dict[str, Report] = {}
    try:
        for c in cascades:
            if c.same_as is not None:
                reports[c.name] = reports[c.same_as]
                if c.same_as in exit_reports:
                    exit_reports[c.name] = exit_reports[c.same_as]
                continue
            d.retrieval = saved[0] if c.retrieval else None
            d.llm = saved[1] if c.llm else None
            d.arbiter = saved[2] if c.arbiter else None
            d.exclude_incidents = exclude
            reports[c.name] = session.report()
            if exit_code is not None:
                exit_reports[c.name] = session.report(exit_code=exit_code)
    finally:
        d.retrieval, d.llm, d.arbiter, d.exclude_incidents = saved
    return reports, exit_reports


def run_set(set_name: str, items: list[Item], engine: Engine, cascades: list[Cascade], *, keep: Path | None = None,
            progress: TextIO | None = sys.stderr) -> list[JobResult]:
    results = []
    t_set = time.perf_counter()
    last_note = t_set
    for i, item in enumerate(items, start=1):
        t0 = time.perf_counter()
        data, truth = item.make()
        label = item.label_of(truth)
        exit_code = item.exit_code_of(truth)
        exclude = tuple(same_incidents(engine, item.corpus_label)) if item.corpus_label is not None else ()
        reports, exit_reports = diagnose_log(engine, data, cascades, exit_code, exclude)
        r = JobResult(set_name, item.case_id, label, truth, item.variant, data.count(b"\n"), time.perf_counter() - t0,
                      reports, exit_reports)
        r.marks = {name: item.score(label, rep, truth) for name, rep in reports.items()}
        r.exit_marks = {name: item.score(label, rep, truth) for name, rep in exit_reports.items()}
        if keep is not None:
            _keep(keep / set_name, item.case_id, data, truth)
        results.append(r)
        now = time.perf_counter()
        if progress is not None and (now - last_note > 15.0 or i == len(items)):
            last_note = now
            print(f"  {set_name}: {i}/{len(items)} logs, {now - t_set:.0f} s", file=progress, flush=True)
    return results


def _keep(folder: Path, case_id: str, data: bytes, truth: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    name = case_id.replace("/", "_").replace("#", "_")
    (folder / f"{name}.log").write_bytes(data)
    if truth is not None and is_dataclass(truth) and not isinstance(truth, type):
        (folder / f"{name}.truth.json").write_text(json.dumps(asdict(truth), indent=1, default=str))


def by_cascade(results: Iterable[JobResult], cascade: str, *, exit_known: bool = False) -> list[CaseResult]:
    return [r.view(cascade, exit_known=exit_known) for r in results
            if cascade in (r.exit_reports if exit_known else r.reports)]
