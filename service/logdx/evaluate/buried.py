"""The real excerpts buried in realistic long multi-rank jobs (``logdx.synth.bury`` with ``realism``).

Every case of the corpus is buried ``per_case`` times, each time in another job: 8 to 128 ranks, one of
the launcher styles (torchrun, ``srun -l``, srun+torchrun, DeepSpeed over pdsh, pdsh+torchrun, torchrun
``--tee``, mpirun), 2,000 to 20,000 lines, with the start-up noise of real multi-node jobs (the c10d
store's connect-refused retries, retried downloads...), recovered warnings, checkpoints and evaluations,
then the failure and its cascade. A start-up failure (import, syntax, argument, environment, version
errors) is buried where those happen, before training (its log is then as long as a multi-rank
job's start-up: tens to hundreds of lines); a healthy excerpt is buried in a run that goes
on and ends well. Everything is deterministic in (case id, variant number, seed).

Labels are the corpus labels. Scored like the excerpts, and:

* root_line is right when the report's root line *is* the buried copy of the labelled line: its line
  number is where ``bury`` wrote (one of) the real line(s) the label names, and its text, once the
  prefix ``bury`` added is stripped, matches the label as in the excerpt;
* action is the excerpt's, except for a hardware fault whose real lines went in bare into a job of
  several hosts, naming none: no node can be cordoned there, and a restart is right (`buried_action`);
* culprit (when labelled) is right when the excerpt's check passes, or when the report names the rank
  or the host the real lines were buried under (their prefix says so: the culprit of the buried job). A
  label "rank N" makes rank N the culprit of the burial, so both agree.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any

from logdx.act.report import Report
from logdx.evaluate.corpus import CaseResult, culprit_correct, is_healthy_label, root_line_correct, score_case
from logdx.model import FT, Action
from logdx.synth.bury import BuriedTruth, bury, read_real_lines
from logdx.synth.healthy import RANK_CHOICES
from logdx.synth.longjob import startup_lines
from logdx.synth.styles import STYLES

# Failures that happen before training starts: buried where they happen, not after hours of training.
LAUNCH_TYPES = frozenset({FT.IMPORT_ERROR, FT.SYNTAX_ERROR, FT.ARGUMENT_ERROR})  # as the workers start
STARTUP_TYPES = frozenset({FT.ENVIRONMENT_ERROR, FT.VERSION_MISMATCH})  # after the framework's banner
_BURY_STYLES = tuple(STYLES)


def buried_root_line_correct(label_line: str, report: Report, truth: BuriedTruth) -> bool:
    """The report's root line is the buried copy of the labelled line: same place, same text."""
    if report.root_cause is None:
        return False
    line_no = report.root_cause.line_no
    if line_no not in truth.root_line_nos_for(label_line):
        return False
    got = truth.strip_prefix(line_no, report.root_cause.text)
    return root_line_correct(label_line, report.model_copy(update={
        "root_cause": report.root_cause.model_copy(update={"text": got})}))


def buried_culprit_correct(label: str | None, report: Report, truth: BuriedTruth) -> bool | None:
    ok = culprit_correct(label, report)
    if ok is None or ok:
        return ok
    c = report.culprits
    return truth.culprit_rank in c.ranks or truth.culprit_host in c.hosts


def burial_culprit_named(report: Report, truth: BuriedTruth) -> bool:
    """Informational: the report names the rank or host the real lines were buried under. Every
    burial has one (its launcher reports the death; prefixed lines name it), labelled or not."""
    return truth.culprit_rank in report.culprits.ranks or truth.culprit_host in report.culprits.hosts


def buried_action(label: dict, truth: BuriedTruth) -> str:
    """The action the buried log allows. A hardware fault whose real lines went in bare (a kernel's
    line, an excerpt's unprefixed traceback) into a job of several hosts, and that names no host
    itself, cannot be pinned on one machine: logdx restarts rather than cordon a node the log does not
    name (README "Safety model"), whatever the excerpt, one machine's own log, allowed."""
    if label.get("action") != Action.CORDON_AND_RESTART or len(set(truth.hosts)) <= 1:
        return label.get("action", "")
    named = label.get("culprit") or ""
    if any(h and h in named for h in [*truth.hosts, *re.findall(r"[A-Za-z][\w.-]*\d[\w.-]*", named)]):
        return label["action"]  # the excerpt names its host (its lines say so wherever they go)
    indices = truth.original_indices_for(label.get("root_line", ""))
    if indices and all(not truth.prefixes.get(i) for i in indices):
        return Action.RESTART
    return label["action"]


def score_buried(label: dict, report: Report, truth: BuriedTruth) -> dict[str, bool | None]:
    label = {**label, "action": buried_action(label, truth)}
    marks = score_case(label, report)
    if not is_healthy_label(label):
        marks["root_line"] = buried_root_line_correct(label.get("root_line", ""), report, truth)
        marks["culprit"] = buried_culprit_correct(label.get("culprit"), report, truth)
    return marks


def label_culprit_rank(label: dict, ranks: int) -> int | None:
    """A label naming one rank ("rank 12") fixes the rank the real lines are buried under."""
    m = re.search(r"\brank\s*(\d+)\b", label.get("culprit") or "", re.IGNORECASE)
    return int(m.group(1)) if m and int(m.group(1)) < ranks else None


def bury_variants(case_id: str, case_index: int, n: int, base_seed: int = 0) -> list[dict[str, Any]]:
    """N different buryings of one case: seed, launcher style, whether the real lines get a prefix,
    the job's size (ranks, lines) and whether NCCL prints its INFO lines."""
    out = []
    for k in range(n):
        seed = zlib.crc32(f"logdx-eval-bury:{base_seed}:{case_id}:{k}".encode()) & 0x7FFFFFFF
        ranks = RANK_CHOICES[(seed >> 3) % len(RANK_CHOICES)]
        lines = max(2000 + (seed >> 7) % 18001, startup_lines(ranks) + 30 * (ranks + 2))
        out.append({
            "seed": seed,
            "style": _BURY_STYLES[(case_index + k) % len(_BURY_STYLES)],
            "prefix_real": (case_index + 3 * k) % 4 != 3,  # one burial in four leaves them bare
            "ranks": ranks,
            "lines": lines,
            "nccl_debug": (seed >> 5) % 3 != 0,
        })
    return out


def phase_of(failure_type: str | None) -> str:
    if failure_type in LAUNCH_TYPES:
        return "launch"
    return "startup" if failure_type in STARTUP_TYPES else "training"


@dataclass(slots=True)
class BuriedCase:
    """One burial of one corpus case: writes its log on demand."""

    case_id: str
    label: dict
    variant: dict[str, Any]
    without: frozenset[str] = frozenset()  # noise families left out

    def generate(self, out: Any) -> BuriedTruth:
        label = self.label
        v = self.variant
        ranks = v["ranks"]
        return bury(read_real_lines(label["_log"]), out, seed=v["seed"], ranks=ranks, lines=v["lines"],
                    style=v["style"], culprit_rank=label_culprit_rank(label, ranks), prefix_real=v["prefix_real"],
                    realism=True, nccl_debug=v["nccl_debug"],
                    phase=phase_of(label.get("failure_type")),
                    healthy=is_healthy_label(label), without=self.without)


def buried_cases(cases: list[dict], per_case: int, base_seed: int = 0,
                 without: frozenset[str] = frozenset()) -> list[BuriedCase]:
    """Every corpus case (healthy ones too) buried ``per_case`` times."""
    out = []
    for ci, label in enumerate(cases):
        for k, variant in enumerate(bury_variants(label["id"], ci, per_case, base_seed)):
            out.append(BuriedCase(f"{label['id']}#b{k}", label, variant, without))
    return out


def describe_burial(r: CaseResult, wrong: list[str]) -> list[str]:
    """How a missed burial was made, and where its right root line is."""
    t, v, lab, rep = r.truth, r.variant or {}, r.label, r.report
    out = [f"    buried: seed={v.get('seed')} style={v.get('style')} ranks={v.get('ranks')} prefix_real="
           f"{v.get('prefix_real')} culprit=rank {t.culprit_rank} on {t.culprit_host} flavour={t.flavour} "
           f"lines={t.lines_written} noise={','.join(t.families)}"]
    if "root_line" in wrong:
        want_nos = t.root_line_nos_for(lab.get("root_line", ""))
        out.append(f"    want line {','.join(map(str, want_nos)) or '?'}: {lab.get('root_line', '')[:150]}")
        got_no = rep.root_cause.line_no if rep.root_cause else None
        out.append(f"    got  line {got_no}: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
    return out


def burial_record(r: CaseResult) -> dict[str, object]:
    t = r.truth
    return {"culprit_rank": t.culprit_rank, "culprit_host": t.culprit_host, "flavour": t.flavour,
            "lines": t.lines_written, "failure_line_no": t.failure_line_no, "families": t.families,
            "want_root_line_nos": t.root_line_nos_for(r.label.get("root_line", "")),
            "culprit_named": burial_culprit_named(r.report, t)}


__all__ = ["LAUNCH_TYPES", "STARTUP_TYPES", "BuriedCase", "burial_culprit_named", "burial_record", "buried_cases",
           "buried_culprit_correct", "buried_root_line_correct", "bury_variants", "describe_burial",
           "label_culprit_rank", "score_buried"]
