"""timeline.yaml's own raw-input tests (`tests:` in the file, run by `logdx rules test`): raw lines with their
launcher prefixes through the real normaliser and session, and what the progress forms must read of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from logdx.config import Settings
from logdx.diagnose.rules import RuleSet, default_rules_dir, load_rules
from logdx.explain import run_timeline_tests
from logdx.timeline import FORMS_PATH, forms


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules([default_rules_dir()])


def test_the_shipped_timeline_tests_pass_and_cover_every_kind_of_form(rules: RuleSet) -> None:
    import yaml

    assert run_timeline_tests(Settings(), rules) == []
    tests = yaml.safe_load(FORMS_PATH.read_text(encoding="utf-8"))["tests"]
    read = {k for t in tests for r in t.get("reads", []) for k, v in r.items() if v is not False}
    # every field the forms know, a checkpoint and a completion are read by some test
    assert {name for name, _ in forms().fields} | {"checkpoint", "completion"} <= read, read


def _with_tests(tmp_path: Path, tests: str) -> tuple[Path, int]:
    """timeline.yaml's forms with other tests; and the line of its `tests:` key."""
    text = FORMS_PATH.read_text(encoding="utf-8").split("\ntests:\n")[0]
    path = tmp_path / "timeline.yaml"
    path.write_text(f"{text}\ntests:\n{tests}", encoding="utf-8")
    return path, text.count("\n") + 2


def test_a_wrong_expectation_names_file_line_and_what_was_read(tmp_path: Path, rules: RuleSet) -> None:
    path, at = _with_tests(tmp_path, """\
  - name: fine
    lines: ['[rank0]: iteration 10/100 | loss 2.31']
    reads: [{line: 1, step: 10, total: 100}]
  - name: wrong on purpose
    lines:
      - '[rank0]: iteration 10/100 | loss 2.31'
      - '[rank0]: Saving model checkpoint to out/checkpoint-40'
    reads: [{line: 1, step: 11, progress: false}, {line: 2, checkpoint: 50}]
    progress: {ranks: 2}
  - name: not a test
    lines: []
""")
    problems = run_timeline_tests(Settings(), rules, path)
    mine = [p for p in problems if "'wrong on purpose'" in p]
    assert all(p.startswith(f"{path}:{at + 4}: timeline test 'wrong on purpose': ") for p in mine), mine
    assert any("line 1: step 10.0, expected 11.0" in p for p in mine)
    assert any("line 1: progress True" in p for p in mine)
    assert any("line 2: checkpoint step 40, expected 50" in p for p in mine)
    assert any("progress ranks 1, expected 2" in p for p in mine)
    assert len(mine) == 4 and not any("'fine'" in p for p in problems)
    assert any(p.startswith(f"{path}:{at + 10}: timeline test #3: lines") for p in problems), problems
