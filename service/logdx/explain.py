"""What logdx makes of raw lines, line by line: `logdx rules explain`, and the raw-input tests of the
rule packs (`tests:` in `rules/*.yaml`, run by `logdx rules test`).

A rule's examples are checked on text with its prefixes already gone; these go the way a real log
goes (normaliser, compressor, detector, rules, the diagnosis), so a pattern that needs a piece of
the line the normaliser takes for a host or a rank shows here, on the line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from logdx.act.report import Report
from logdx.config import Settings
from logdx.diagnose.rules import RuleHit, RuleSet, example_event
from logdx.diagnose.rules.compiled import PackTest
from logdx.diagnose.rules.matcher import why_not
from logdx.model import READ_AS_A_WHOLE, Event, EventKind, Record, Role
from logdx.pipeline import Engine

__all__ = ["Explanation", "LineReport", "explain_lines", "render_explanation", "run_pack_tests", "run_timeline_tests"]


@dataclass(slots=True)
class LineReport:
    """One raw line: its record, the events it is part of, the rules that hit it, and why the rules
    that came close (its keywords occur) or were asked about did not."""

    record: Record
    events: list[Event] = field(default_factory=list)
    hits: list[RuleHit] = field(default_factory=list)
    misses: list[tuple[str, str]] = field(default_factory=list)  # (rule id, why not)
    catalog: list[str] = field(default_factory=list)  # "entry id (how, score): failure type"


@dataclass(slots=True)
class Explanation:
    lines: list[LineReport]  # every line, or (a long input) the lines an event holds
    report: Report
    every_line: bool


def explain_lines(engine: Engine, raw_lines: Iterable[bytes | str], expected: Sequence[str] = (),
                  catalog: bool = False, every_line_up_to: int | None = None,
                  exit_code: int | None = None) -> Explanation:
    """Feed the lines through a fresh session of `engine`, then say per line what became of it.
    `expected`: rule ids to explain where they do not hit; `catalog`: look each event's anchor up in
    the error catalog too; `every_line_up_to`: past that many lines, only the lines events hold are
    kept (memory stays bounded on a whole job's log); `exit_code`: the job's, as `diagnose --exit-code`."""
    session = engine.new_session()
    kept: list[Record] = []
    every_line = True
    for raw in raw_lines:
        rec = session.feed_record(raw)[0]
        if every_line:
            kept.append(rec)
            if every_line_up_to is not None and len(kept) > every_line_up_to:
                every_line, kept = False, []
    report = session.report(exit_code)
    if not every_line:
        held = {r.line_no: r for ev in session.events for r in (*ev.lines, ev.anchor)}
        kept = [held[n] for n in sorted(held)]
    out = [LineReport(rec) for rec in kept]
    _attach_events(engine.rules, session.events, {ln.record.line_no: ln for ln in out}, expected, catalog)
    if every_line:
        for ln in out:
            if not ln.events:
                ln.misses.extend(_unseen(engine.rules, ln.record, expected))
    return Explanation(out, report, every_line)


def _attach_events(rules: RuleSet, events: Sequence[Event], by_line: dict[int, LineReport], expected: Sequence[str],
                   catalog: bool) -> None:
    """Each event to the lines it holds; its rule hits to the line each hit; its misses to its anchor."""
    for ev in events:
        for line_no in sorted({r.line_no for r in ev.lines} | {ev.anchor.line_no}):
            if line_no in by_line:
                by_line[line_no].events.append(ev)
        hits = rules.match(ev) if ev.kind not in READ_AS_A_WHOLE else []
        for hit in hits:
            if hit.line.line_no in by_line:
                by_line[hit.line.line_no].hits.append(hit)
        anchor = by_line.get(ev.anchor.line_no)
        if anchor is not None:
            anchor.misses.extend(_misses(rules, ev, hits, expected))
            if catalog:
                anchor.catalog.extend(_catalog_hits(ev))


def _misses(rules: RuleSet, ev: Event, hits: Sequence[RuleHit], expected: Sequence[str]) -> list[tuple[str, str]]:
    """Rules that did not hit the event although their keywords occur in it (nearly matched; a generic
    fallback only when nothing hit), and the expected ones: why not."""
    texts = [ev.anchor.text, *(r.text for r in ev.lines), ev.exception_type or ""]
    keywords = frozenset().union(*(rules.prefilter.keywords_in(t.lower()) for t in texts))
    near = {r.id for r in rules.rules if r.literals and not r.literals.isdisjoint(keywords)
            and not (hits and r.role is Role.FALLBACK)}
    out = []
    for rule_id in sorted((near | set(expected)) - {h.rule_id for h in hits}):
        rule = rules.by_id.get(rule_id)
        reason = why_not(rule, ev, rules.prefilter) if rule is not None else None
        if reason is not None:
            out.append((rule_id, f"{ev.kind} event: {reason}"))
    return out


def _unseen(rules: RuleSet, rec: Record, expected: Sequence[str]) -> list[tuple[str, str]]:
    """An expected rule on a line no event holds: the detector made nothing of it; would its text
    alone have matched (the normaliser may have taken a piece of it for a prefix)?"""
    out = []
    for rule_id in expected:
        rule = rules.by_id.get(rule_id)
        if rule is None:
            continue
        alone = why_not(rule, example_event(rec.text, rule), rules.prefilter)
        tried = "and its text alone does not match either: " + alone if alone else \
            f"though its text {rec.text!r} alone would match"
        out.append((rule_id, f"no event holds this line (the detector saw no error in it), {tried}"))
    return out


def _catalog_hits(ev: Event) -> list[str]:
    from logdx.diagnose.catalog_stage import match

    return [f"{h.entry.id} ({h.how}, {h.score:.2f}): {h.entry.category}/{h.entry.failure_type}"
            for h in match(ev.anchor.text, ev.exception_type, limit=3)]


# --- rendering ------------------------------------------------------------------------------------


def render_explanation(ex: Explanation, *, verbose: bool = False, asked: Sequence[str] = ()) -> str:
    """The lines as text (of a long log, only those something happened on), the verdict last. Why a rule
    did not match is said for the rules `asked` about; for the others that nearly matched, only with `verbose`."""
    out: list[str] = []
    for ln in ex.lines:
        if ex.every_line or ln.events or ln.hits or ln.misses:
            out.extend(_render_line(ln, verbose, frozenset(asked)))
    out.append(_render_verdict(ex.report))
    out.extend(_render_timeout(ex.report) + _render_degradations(ex.report))
    return "\n".join(out)


def _render_timeout(report: Report) -> list[str]:
    """Which signal decided the timeout's class, and whether the class set the verdict."""
    t = report.timeout
    if t is None:
        return []
    if t.decided:
        how = f"it set the verdict ({t.action or report.action}: no node to blame)"
    elif t.explained_by:
        how = f"the verdict stands: rule {t.explained_by}'s root cause explains the timeouts"
    else:
        how = "the verdict stands"
    who = ", ".join([f"rank {r}" for r in t.culprit_ranks[:8]] + t.culprit_hosts[:4])
    out = [f"timeout: class {t.cause}{' (' + who + ')' if who else ''}; {how}"]
    out += [f"  signal  {e}" for e in t.evidence[:6]]
    out += [f"  missing {m}" for m in t.missing]
    return out


def _render_degradations(report: Report) -> list[str]:
    return [f"degradation: {g.kind} on {g.host} (line {g.line_no}): {g.effect}" for g in report.degradations]


def _render_line(ln: LineReport, verbose: bool = True, asked: frozenset[str] = frozenset()) -> list[str]:
    r = ln.record
    ts = datetime.fromtimestamp(r.ts, UTC).isoformat() if r.ts else "unanchored (a boot clock)" if r.unanchored else "-"
    out = [f"line {r.line_no}: {r.raw}",
           f"  record  rank={_v(r.rank)} local_rank={_v(r.local_rank)} host={_v(r.host)} stream={_v(r.stream)} "
           f"ts={ts} pid={_v(r.pid)}",
           f"  text    {r.text}"]
    for ev in ln.events:
        span = f"lines {ev.lines[0].line_no}-{ev.lines[-1].line_no}" if len(ev.lines) > 1 else "this line"
        exc = f" {ev.exception_type}" if ev.exception_type else ""
        role = "anchor" if ev.anchor is r else f"part (anchor line {ev.anchor.line_no})"
        out.append(f"  event   {ev.kind}{exc}: {span}, {role}")
    for h in ln.hits:
        label = f"{h.label.category}/{h.label.failure_type}/{h.label.action}"
        out.append(f"  rule    {h.rule_id} ({h.pack}, {h.role}, {h.severity}): {label}")
    out.extend(f"  catalog {c}" for c in ln.catalog)
    shown = [(rule_id, why) for rule_id, why in ln.misses if verbose or rule_id in asked]
    out.extend(f"  not     {rule_id}: {why}" for rule_id, why in shown)
    if len(shown) < len(ln.misses):
        n = len(ln.misses) - len(shown)
        more = " more" if shown else ""
        out.append(f"  not     {n}{more} rule{'s' * (n > 1)} whose words occur here did not match (--verbose: why)")
    return out


def _render_verdict(report: Report) -> str:
    if report.status != "failed":
        return f"verdict: {report.status}"
    root = report.root_cause
    where = f", root line {root.line_no}: {root.text}" if root is not None else ""
    return (f"verdict: failed {report.category}/{report.failure_type}/{report.action} "
            f"(confidence {report.confidence:.2f}){where}")


def _v(value: object) -> str:
    return "-" if value is None else str(value)


# --- the packs' raw-input tests -------------------------------------------------------------------


def run_pack_tests(settings: Settings, rules: RuleSet,
                   hits: list[tuple[str, Sequence[RuleHit]]] | None = None) -> list[str]:
    """Every pack test through the real pipeline: one problem a line ("file:line: test 'name': what").
    `hits`, when given, gets every event of the tests with all its rule hits, best first (for
    `precedence_problems`: two rules that hit one of these events must say which refines the other)."""
    engine = Engine.for_rules(settings, rules)
    problems: list[str] = []
    for test in rules.tests:
        ex = explain_lines(engine, test.lines, exit_code=test.exit_code)
        problems.extend(f"{test.where()}: {p}" for p in _test_problems(test, ex, rules))
        if hits is not None:
            events = {id(ev): ev for ln in ex.lines for ev in ln.events}
            hits.extend((f"test '{test.name}' ({test.where().split(': ')[0]}), line "
                         f"{ev.anchor.line_no}", rules.match(ev)) for ev in events.values())
    return problems


def _test_problems(test: PackTest, ex: Explanation, rules: RuleSet) -> list[str]:
    out: list[str] = []
    line: int | None
    for line, fields in test.records:
        rec = ex.lines[line - 1].record
        out.extend(f"line {line}: the normaliser gave {name}={getattr(rec, name)!r}, expected {want!r}"
                   for name, want in fields if getattr(rec, name) != want)
    for rule_id, kind, line in test.events:
        if not _event_found(ex, rule_id, kind, line):
            what = f"no {kind} event" if kind else "no event"
            out.append(f"{what}{_on(line)}{' hit by rule ' + repr(rule_id) if rule_id else ''}"
                       f"{_why(ex, rules, rule_id, line)}")
    out.extend(_verdict_problems(test, ex.report))
    return out


def _event_found(ex: Explanation, rule_id: str | None, kind: EventKind | None, line: int | None) -> bool:
    lines = ex.lines if line is None else [ex.lines[line - 1]]
    if rule_id is not None:
        return any(h.rule_id == rule_id and (kind is None or h.event.kind == kind) for ln in lines for h in ln.hits)
    return any(kind is None or ev.kind == kind for ln in lines for ev in ln.events)


def _on(line: int | None) -> str:
    return f" on line {line}" if line is not None else ""


def _why(ex: Explanation, rules: RuleSet, rule_id: str | None, line: int | None) -> str:
    """Why the rule missed: on the line asked, else on the first event of the lines."""
    rule = rules.by_id.get(rule_id or "")
    if rule is None:
        return ""
    for ln in ex.lines if line is None else [ex.lines[line - 1]]:
        for ev in ln.events:
            return f": {why_not(rule, ev, rules.prefilter) or f'it hit line {ev.anchor.line_no} instead'}"
        if line is not None and why_not(rule, example_event(ln.record.text, rule), rules.prefilter) is None:
            return f": the line made no event, though its text {ln.record.text!r} alone matches"
    return ": no event holds these lines"


def _verdict_problems(test: PackTest, report: Report) -> list[str]:
    out = []
    if test.status is not None and report.status != test.status:
        out.append(f"verdict {report.status}, expected {test.status}")
    if test.failure_type is not None and report.failure_type != test.failure_type:
        out.append(f"verdict failure_type {report.failure_type}, expected {test.failure_type}")
    if test.category is not None and report.category != test.category:
        out.append(f"verdict category {report.category}, expected {test.category}")
    if test.action is not None and report.action != test.action:
        out.append(f"verdict action {report.action}, expected {test.action}")
    root = report.root_cause.line_no if report.root_cause is not None else None
    if test.root_line is not None and root != test.root_line:
        out.append(f"verdict root line {root}, expected {test.root_line}")
    if test.hosts is not None and tuple(report.culprits.hosts) != test.hosts:
        out.append(f"verdict culprit hosts {report.culprits.hosts}, expected {list(test.hosts)}")
    if test.ranks is not None and tuple(report.culprits.ranks) != test.ranks:
        out.append(f"verdict culprit ranks {report.culprits.ranks}, expected {list(test.ranks)}")
    out.extend(_culprit_problems(test, report))
    if test.hint is not None and test.hint not in report.hint:
        out.append(f"verdict hint {report.hint!r} does not contain {test.hint!r}")
    return out


def _culprit_problems(test: PackTest, report: Report) -> list[str]:
    """`culprit:` the verdict names that one host / rank / GPU (each field stated), or none at all."""
    c = report.culprits
    named = {"host": c.hosts, "rank": c.ranks, "gpu": c.gpus}
    if test.culprit is None:
        return []
    if test.culprit == ():
        return [] if not any(named.values()) else [f"verdict culprit hosts {c.hosts} ranks {c.ranks} gpus {c.gpus}, "
                                                   f"expected none"]
    return [f"verdict culprit {key}s {named[key]}, expected [{want!r}]"
            for key, want in test.culprit if named[key] != [want]]


# --- timeline.yaml's raw-input tests ---------------------------------------------------------------


class _Reads(BaseModel):
    """What the progress forms must read off one raw line (its message, once the normaliser took the
    prefixes): field values, whether it is progress at all, the checkpoint step it says was saved,
    whether it says training is over. A key left out is not checked."""

    model_config = ConfigDict(extra="forbid")
    line: int = Field(ge=1)
    progress: bool | None = None  # false: no form reads a field off it
    checkpoint: int | None = None  # the step of the checkpoint it says was saved
    completion: bool | None = None
    step: float | None = None
    epoch: float | None = None
    total: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    step_time_ms: float | None = None
    step_time_s: float | None = None
    it_per_s: float | None = None
    skipped_iters: float | None = None
    skipped_total: float | None = None
    nan_iters: float | None = None
    throughput: float | None = None


class _JobProgress(BaseModel):
    """What the job's progress block must say of the lines (the report's `progress`)."""

    model_config = ConfigDict(extra="forbid")
    lines: int | None = None
    ranks: int | None = None
    last_step: float | None = None
    checkpoints: list[tuple[int, int]] | None = None  # (step, line), exactly


class _TimelineTest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    lines: list[str] = Field(min_length=1)
    reads: list[_Reads] = []
    progress: _JobProgress | None = None


_NOT_FIELDS = frozenset({"line", "progress", "checkpoint", "completion"})


def run_timeline_tests(settings: Settings, rules: RuleSet, path: Path | None = None) -> list[str]:
    """timeline.yaml's `tests:` (raw lines, prefixes and all, through the real normaliser and session):
    one problem a line ("file:line: test 'name': what"), a test that does not validate included."""
    from logdx import yamlsafe
    from logdx.timeline import FORMS_PATH

    path = path or FORMS_PATH
    shown = _shown(path)
    try:
        root, data = yamlsafe.load_with_nodes(path.read_text(encoding="utf-8"), shown)
    except (OSError, UnicodeDecodeError, yamlsafe.YamlError) as e:
        return [f"{shown}: cannot load: {e}"]
    raw_tests = data.get("tests", []) if isinstance(data, dict) else []
    at = _test_lines(root)
    engine = Engine.for_rules(settings, rules)
    problems: list[str] = []
    for i, raw in enumerate(raw_tests if isinstance(raw_tests, list) else []):
        where = f"{shown}:{at[i] if i < len(at) else 1}: timeline test"
        try:
            test = _TimelineTest.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            problems.append(f"{where} #{i + 1}: {'.'.join(map(str, err['loc']))}: {err['msg']}")
            continue
        where += f" '{test.name}'"
        problems.extend(f"{where}: {p}" for p in _timeline_problems(engine, test))
    return problems


def _timeline_problems(engine: Engine, test: _TimelineTest) -> list[str]:
    from logdx.timeline import checkpoint_step_of, fields_of, is_completion

    out: list[str] = []
    ex = explain_lines(engine, test.lines)
    for want in test.reads:
        if want.line > len(ex.lines):
            out.append(f"line {want.line} of {len(ex.lines)} lines")
            continue
        text = ex.lines[want.line - 1].record.text
        got = fields_of(text)
        if want.progress is not None and bool(got) != want.progress:
            out.append(f"line {want.line}: progress {bool(got)} (read {got}), expected {want.progress}")
        if want.checkpoint is not None and checkpoint_step_of(text) != want.checkpoint:
            out.append(f"line {want.line}: checkpoint step {checkpoint_step_of(text)}, expected {want.checkpoint}")
        if want.completion is not None and is_completion(text) != want.completion:
            out.append(f"line {want.line}: completion {is_completion(text)}, expected {want.completion}")
        for name in sorted(want.model_fields_set - _NOT_FIELDS):
            value = getattr(want, name)
            have = got.get(name)
            if value is None or have is None or not math.isclose(have, value, rel_tol=1e-9, abs_tol=1e-12):
                out.append(f"line {want.line}: {name} {have!r}, expected {value!r} (read {got} of {text!r})")
    p, block = test.progress, ex.report.progress
    if p is not None:
        for name in sorted(p.model_fields_set):
            # no block: the log had no progress line (0 lines, 0 ranks, nothing else)
            had: object = getattr(block, name) if block is not None else (0 if name in ("lines", "ranks") else None)
            want_v: object = getattr(p, name)
            if name == "checkpoints":  # pairs, however YAML or pydantic spell them
                had = [tuple(c) for c in had] if isinstance(had, list) else had
                want_v = [tuple(c) for c in want_v] if isinstance(want_v, list) else want_v
            if had != want_v:
                out.append(f"progress {name} {had!r}, expected {want_v!r}")
    return out


def _test_lines(root: object) -> list[int]:
    """The line of each item of the document's `tests:` sequence."""
    import yaml

    if not isinstance(root, yaml.MappingNode):
        return []
    for k, v in root.value:
        if isinstance(k, yaml.ScalarNode) and k.value == "tests" and isinstance(v, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in v.value]
    return []


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
