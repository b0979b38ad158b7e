"""Words that match the verdict, for every failure type at a low and a high confidence.

Each shipped rule's own examples, as the last words of a short job, go through the real diagnosis and are rendered
as the terminal shows them: a root-cause rule's verdict (high confidence, a line that says why), a symptom's (low
confidence, only symptoms); the failure types no rule names come from the exceptions and generated jobs that make
them. Every report must say what its own verdict says: the action line its action, the explanation its basis, and no
template left unfilled."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from logdx.act.render import render_text
from logdx.act.report import Report
from logdx.config import load_settings
from logdx.model import Action
from logdx.pipeline import Engine
from logdx.synth import generate
from logdx.taxonomy import advice_of, taxonomy

TRAINING = [f"[rank0]:step {s} | loss {2.5 - s / 100:.3f} | lr 3.0e-04 | 412 samples/s" for s in range(1, 21)]


def _traceback(exc: str) -> list[str]:
    return ["Traceback (most recent call last):", '  File "/home/user/train.py", line 88, in <module>',
            "    main(cfg)", '  File "/home/user/train.py", line 61, in main', "    run(model, data)", exc]


# What no rule names: an exception class the taxonomy's origin reads, a hang the timeline reads.
WITHOUT_A_RULE = {
    "name_error": _traceback("NameError: name 'optimzer' is not defined"),
    "type_error": _traceback("TypeError: forward() missing 1 required positional argument: 'mask'"),
    "value_error": _traceback("ValueError: too many values to unpack (expected 2)"),
}
SCENARIOS = ("syntax_error", "stall", "nccl_hang")


@pytest.fixture(scope="module")
def engine() -> Engine:
    settings = load_settings()
    settings.llm.enabled = False
    settings.retrieval.enabled = False
    return Engine.create(settings)


def _diagnosed(engine: Engine, tmp: Path, lines: list[str]) -> Report:
    path = tmp / "job.log"
    path.write_text("\n".join(lines) + "\n")
    return engine.diagnose_path(path)[0]


_ACTION_WORDS = {
    Action.CORDON_AND_RESTART: re.compile(r"^CORDON"),
    Action.RESTART: re.compile(r"^RESTART|^RESUBMIT"),
    Action.NO_RESTART: re.compile(r"^DO NOT RESTART"),
}
_LEFTOVER = re.compile(r"\{[a-z_]+\}|\bNone\b|\(\?\)|\brank \?|\bon \?")


def _problems(report: Report, text: str) -> list[str]:
    problems = []
    if report.status != "failed":
        return [f"status {report.status}"]
    action_line = next((ln.split("action", 1)[1].strip() for ln in text.splitlines() if ln.strip().startswith("action")), "")
    if not _ACTION_WORDS[Action(report.action)].search(action_line):
        problems.append(f"action {report.action} worded {action_line!r}")
    if report.action == Action.CORDON_AND_RESTART and not taxonomy().types[report.failure_type].hardware:
        problems.append(f"a cordon for {report.failure_type}, not a hardware type")
    words = f"{report.explanation or ''} {report.hint or ''}"
    if _LEFTOVER.search(words):
        problems.append(f"unfilled: {_LEFTOVER.search(words).group(0)!r} in {words!r}")  # type: ignore[union-attr]
    symptom_words = (report.explanation or "").startswith("Only symptoms")
    if symptom_words and report.confidence >= 0.8:
        problems.append(f"'only symptoms' at confidence {report.confidence}")
    if not report.hint:
        problems.append("no hint")
    return problems


def test_every_rule_example_reads_as_its_verdict(engine: Engine, tmp_path: Path) -> None:
    seen: dict[str, set[str]] = {}
    bad: list[str] = []
    for rule in engine.rules.rules:
        if rule.label is None or not rule.examples:
            continue
        report = _diagnosed(engine, tmp_path, [*TRAINING, rule.examples[0]])
        text = render_text(report)
        if report.failure_type != rule.label.failure_type:
            continue  # another rule reads that line better (rules test checks which): its own words are checked there
        level = "high" if report.confidence >= 0.75 else "low" if report.confidence < 0.5 else "mid"
        seen.setdefault(report.failure_type, set()).add(level)
        bad += [f"{rule.id} ({report.failure_type}, {report.confidence:.2f}): {p}" for p in _problems(report, text)]
    assert not bad, "\n".join(bad)
    lows = {t for t, v in seen.items() if "low" in v}
    highs = {t for t, v in seen.items() if "high" in v}
    assert len(lows) >= 5 and len(highs) >= 30, (sorted(lows), sorted(highs))


def test_the_types_no_rule_names_read_as_their_verdict(engine: Engine, tmp_path: Path) -> None:
    bad: list[str] = []
    for ft, tail in WITHOUT_A_RULE.items():
        report = _diagnosed(engine, tmp_path, [*TRAINING, *tail])
        assert report.failure_type == ft, (ft, report.failure_type)
        bad += [f"{ft}: {p}" for p in _problems(report, render_text(report))]
    for scenario in SCENARIOS:
        buf = io.StringIO()
        truth = generate(buf, scenario=scenario, seed=3, ranks=8, lines=4000, style="torchrun")
        report = _diagnosed(engine, tmp_path, buf.getvalue().splitlines())
        assert report.failure_type == truth.failure_type, (scenario, report.failure_type)
        bad += [f"{scenario}: {p}" for p in _problems(report, render_text(report))]
    assert not bad, "\n".join(bad)


def test_every_failure_type_is_worded_by_the_taxonomy_at_every_action_it_may_take() -> None:
    """The action's words come from the taxonomy for each type (its own advice, else its action's): none empty, and a
    type's own advice never tells to cordon unless the type may cordon."""
    for name, ft in taxonomy().types.items():
        for action in (Action.RESTART, Action.NO_RESTART, Action(ft.action)):
            words = advice_of(action, name)
            assert words.strip(), (name, action)
            if "cordon" in words.lower() or "drain" in words.lower():
                assert ft.hardware and action == Action.CORDON_AND_RESTART, (name, action, words)
