"""The generated whole-job sets: long healthy runs, hangs, divergences (``logdx.synth``).

Labels come from the generators (``JobTruth``; each generator module documents its own). Scored:

* status, category, action, failure type: equal to the label (a healthy job: status only);
* root_line: the report's root line number is one of the truth's ``root_line_nos``;
* culprit_rank / culprit_host (hangs): the report's ``culprits.ranks`` (``hosts``) contain the culprit
  and name at most two (naming every rank but one is not naming the culprit); the host is scored only
  when the log names it; ``culprit`` is both;
* step (divergences): the report's ``progress.divergence.step`` is within ``step_tolerance`` of the
  truth's ``divergence_step`` (two logging intervals). A report without that field (a logdx that does
  not read the loss series yet) counts as a miss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from logdx.act.report import Report
from logdx.evaluate.corpus import CaseResult
from logdx.synth.divergence import divergence_set
from logdx.synth.hangs import hang_set
from logdx.synth.healthy import healthy_set, teardown_set
from logdx.synth.longjob import GeneratedCase, JobTruth
from logdx.synth.pasted import pasted_set
from logdx.synth.startup import startup_set
from logdx.synth.timeouts import timeout_set

# set name -> its cases (deterministic in the seed)
GENERATED_SETS: dict[str, Callable[[int], list[GeneratedCase]]] = {
    "healthy": lambda seed: healthy_set(32, seed),
    "hangs": lambda seed: hang_set(20, 20, seed),
    "divergence": lambda seed: divergence_set(5, 8, seed),
    "pasted": lambda seed: pasted_set(48, seed),
    "teardown": lambda seed: teardown_set(24, seed),
    "timeouts": lambda seed: timeout_set(8, seed),
    "startup": lambda seed: startup_set(4, 12, seed),
}
_MAX_NAMED = 2  # a culprit list longer than this does not single anyone out


def label_of(truth: JobTruth) -> dict[str, Any]:
    """The label a generated job carries, in the corpus' shape."""
    culprit = ", ".join([f"rank {r}" for r in truth.culprit_ranks] + truth.culprit_hosts) or None
    return {"status": truth.status, "category": truth.category, "failure_type": truth.failure_type,
            "action": truth.action, "culprit": culprit, "root_line": truth.root_line or ""}


def report_divergence_step(report: Report) -> int | None:
    """``progress.divergence.step`` when the report has it (the field is new: tolerate its absence)."""
    progress = getattr(report, "progress", None)
    if progress is None:
        return None
    div = progress.get("divergence") if isinstance(progress, dict) else getattr(progress, "divergence", None)
    if div is None:
        return None
    step = div.get("step") if isinstance(div, dict) else getattr(div, "step", None)
    return int(step) if isinstance(step, int | float) else None


def _names(want: list[Any], got: list[Any]) -> bool:
    return bool(want) and all(w in got for w in want) and len(got) <= max(_MAX_NAMED, len(want))


def score_job(truth: JobTruth, report: Report) -> dict[str, bool | None]:
    want_class = truth.variant.get("timeout_class")  # timeouts: the report's `timeout.cause`
    got_class = None if want_class is None else report.timeout is not None and report.timeout.cause == want_class
    degradation = None
    if "degradation" in truth.variant:  # startup: the one degradation on its host, nothing on a clean start-up
        want = {(truth.variant["degradation"], truth.variant["degraded_host"])} if truth.variant["degradation"] else set()
        degradation = {(g.kind, g.host) for g in report.degradations} == want
    if truth.status == "healthy":
        return {"status": report.status == "healthy", "category": None, "action": None, "failure_type": None,
                "root_line": None, "culprit": None, "culprit_rank": None, "culprit_host": None, "step": None,
                "timeout_class": None, "degradation": degradation}
    c = report.culprits
    rank = _names(truth.culprit_ranks, c.ranks) if truth.culprit_ranks else None
    host = _names(truth.culprit_hosts, c.hosts) if truth.culprit_hosts else None
    step = None
    if truth.divergence_step is not None:
        got = report_divergence_step(report)
        step = got is not None and abs(got - truth.divergence_step) <= truth.step_tolerance
    return {
        "status": report.status == "failed",
        "category": report.category == truth.category,
        "action": report.action == truth.action,
        "failure_type": report.failure_type == truth.failure_type,
        "root_line": report.root_cause is not None and report.root_cause.line_no in truth.root_line_nos,
        "culprit": None if rank is None else bool(rank and host is not False),
        "culprit_rank": rank,
        "culprit_host": host,
        "step": step,
        "timeout_class": got_class,
        "degradation": degradation,
    }


def describe_job(r: CaseResult, wrong: list[str]) -> list[str]:
    t: JobTruth = r.truth
    rep = r.report
    out = [f"    job: {t.kind} seed={t.seed} flavour={t.flavour} style={t.style} ranks={t.ranks} lines={t.lines_written} "
           f"exit={t.exit_code} variant={t.variant} noise={','.join(t.families)}"]
    if t.culprit_ranks and {"culprit", "culprit_rank", "culprit_host"} & set(wrong):
        out.append(f"    want culprit ranks={t.culprit_ranks} hosts={t.culprit_hosts}")
    if "step" in wrong:
        out.append(f"    want divergence step {t.divergence_step} (+-{t.step_tolerance}), got {report_divergence_step(rep)}")
    if "root_line" in wrong or (t.status == "healthy" and rep.root_cause is not None):
        if t.root_line_nos:
            nos = t.root_line_nos
            out.append(f"    want line {','.join(map(str, nos[:6]))}{'...' if len(nos) > 6 else ''}: {(t.root_line or '')[:150]}")
        got_no = rep.root_cause.line_no if rep.root_cause else None
        out.append(f"    got  line {got_no}: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
    return out


def job_record(r: CaseResult) -> dict[str, object]:
    t: JobTruth = r.truth
    return {"kind": t.kind, "exit_code": t.exit_code, "culprit_ranks": t.culprit_ranks, "culprit_hosts": t.culprit_hosts,
            "divergence_step": t.divergence_step, "got_divergence_step": report_divergence_step(r.report),
            "want_root_line_nos": t.root_line_nos[:20], "lines": t.lines_written, "flavour": t.flavour,
            "style": t.style, "ranks": t.ranks, "families": t.families, "variant": t.variant}
