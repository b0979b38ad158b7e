"""`logdx rules explain` and the rule packs' raw-input tests (`tests:` in a pack, run by `logdx rules test`):
raw lines through the real normaliser, detector, rules and diagnosis."""

from __future__ import annotations

from pathlib import Path

import pytest

from logdx.cli import main
from logdx.config import Settings
from logdx.diagnose.rules import RuleError, default_rules_dir, load_rules
from logdx.explain import explain_lines, run_pack_tests
from logdx.faces import EXIT_OK, EXIT_USAGE
from logdx.pipeline import Engine

XID79 = "May 21 03:12:44 node-12 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, GPU has fallen off the bus."
PROGRESS = "[default0]:[rank{r}]: iteration 10/100 | loss 2.31"

_PACK = """\
pack: extra
description: a test pack
rules:
  - id: widget-broke
    title: the widget broke
    role: root_cause
    category: infrastructure
    failure_type: storage_error
    confidence: 0.9
    match:
      patterns: ['the widget \\d+ broke for good']
    examples: ['the widget 7 broke for good']
tests:
{tests}
"""


@pytest.fixture(scope="module")
def shipped() -> Engine:
    settings = Settings()
    settings.catalog.enabled = False  # the rules' own say, quick
    return Engine.for_rules(settings, load_rules([default_rules_dir()]))


def _pack(tmp_path: Path, tests: str) -> Path:
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "extra.yaml").write_text(_PACK.format(tests=tests), encoding="utf-8")
    return folder


def test_every_shipped_pack_carries_raw_input_tests_and_they_pass() -> None:
    rules = load_rules([default_rules_dir()])
    packs_with_tests = {t.pack for t in rules.tests}
    assert packs_with_tests == set(rules.packs), f"packs without tests: {set(rules.packs) - packs_with_tests}"
    assert run_pack_tests(Settings(), rules) == []


def test_a_line_shows_its_record_events_rules_and_the_verdict(shipped: Engine) -> None:
    ex = explain_lines(shipped, [PROGRESS.format(r=r) for r in range(4)] + [XID79])
    last = ex.lines[-1]
    assert (last.record.host, last.record.rank, last.record.text[:9]) == ("node-12", None, "NVRM: Xid")
    assert [ev.kind for ev in last.events] == ["xid"]
    assert last.hits[0].rule_id == "xid-79-fell-off-bus"
    assert [(ln.record.rank, ln.record.local_rank) for ln in ex.lines[:2]] == [(0, 0), (1, 0)]
    assert ex.report.failure_type == "gpu_fell_off_bus" and ex.report.root_cause.line_no == 5


def test_an_expected_rule_says_which_condition_failed(shipped: Engine) -> None:
    ex = explain_lines(shipped, ["[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered"],
                       expected=["xid-79-fell-off-bus", "disk-full"])
    why = dict(ex.lines[0].misses)
    assert "no pattern matches" in why["disk-full"]
    assert "xid-79-fell-off-bus" in why


def test_a_line_no_event_holds_says_so_and_whether_its_text_alone_would_match(shipped: Engine) -> None:
    ex = explain_lines(shipped, [PROGRESS.format(r=0)], expected=["disk-full"])
    assert ex.lines[0].events == []
    assert "no event holds this line" in dict(ex.lines[0].misses)["disk-full"]


def test_a_failing_pack_test_names_its_file_line_and_what_differs(tmp_path: Path) -> None:
    tests = """\
  - name: wrong on purpose
    lines: ['node-3: the widget 7 broke for good']
    records: [{line: 1, host: node-9}]
    events: [{rule: widget-broke, kind: xid}]
    verdict: {failure_type: disk_full}"""
    rules = load_rules([default_rules_dir(), _pack(tmp_path, tests)])
    problems = run_pack_tests(Settings(), rules)
    mine = [p for p in problems if "wrong on purpose" in p]
    assert all(p.startswith(f"{tmp_path / 'pack' / 'extra.yaml'}:14: test 'wrong on purpose': ") for p in mine), mine
    assert any("host='node-3', expected 'node-9'" in p for p in mine)
    assert any("no xid event" in p and "event kind line is not in match.kinds" not in p for p in mine)
    assert any("failure_type storage_error, expected disk_full" in p for p in mine)
    assert len(mine) == 3


def test_a_passing_pack_test_gives_no_problem(tmp_path: Path) -> None:
    tests = """\
  - name: right
    lines: ['node-3: the widget 7 broke for good']
    records: [{line: 1, host: node-3, rank: null, text: 'the widget 7 broke for good'}]
    events: [{rule: widget-broke, line: 1}]
    verdict: {category: infrastructure, failure_type: storage_error, root_line: 1}"""
    rules = load_rules([default_rules_dir(), _pack(tmp_path, tests)])
    assert [p for p in run_pack_tests(Settings(), rules) if "extra.yaml" in p] == []


@pytest.mark.parametrize("test, problem", [
    ("  - name: t\n    lines: ['x']\n    events: [{rule: widget-broke, line: 2}]", "line 2 of 1 lines"),
    ("  - name: t\n    lines: ['x']\n    events: [{rule: no-such-rule}]", "unknown rule 'no-such-rule'"),
    ("  - name: t\n    lines: ['x']\n    events: [{kind: lines}]", "unknown event kind 'lines'"),
    ("  - name: t\n    lines: ['x']\n    verdict: {failure_type: gpu_lost}", "unknown failure_type 'gpu_lost'"),
    ("  - name: t\n    lines: ['x']", "a test expects records, events or a verdict"),
    ("  - name: t\n    lines: ['x']\n    record: []", "unknown key 'record'"),
])
def test_a_bad_pack_test_does_not_load_and_names_file_and_line(tmp_path: Path, test: str, problem: str) -> None:
    with pytest.raises(RuleError) as err:
        load_rules([_pack(tmp_path, test)])
    assert any("extra.yaml:" in p and problem in p for p in err.value.problems), err.value.problems


def test_cli_explains_lines_given_as_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["rules", "explain", "--rule", "disk-full", XID79])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "host=node-12" in out and "rule    xid-79-fell-off-bus" in out
    assert "not     disk-full" in out
    assert out.rstrip().splitlines()[-1].startswith("verdict: failed infrastructure/gpu_fell_off_bus/")


@pytest.mark.slow
def test_cli_says_why_a_near_rule_missed_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    # Every Xid rule shares the word "Xid": by default, one line counts them; --verbose says why each missed.
    assert main(["rules", "explain", XID79]) == EXIT_OK
    quiet = capsys.readouterr().out
    assert "rule    xid-79-fell-off-bus" in quiet and "not     xid-" not in quiet
    assert "rules whose words occur here did not match (--verbose: why)" in quiet
    assert main(["rules", "explain", "--verbose", XID79]) == EXIT_OK
    loud = capsys.readouterr().out
    assert "not     xid-48-dbe: xid event: no pattern matches" in loud and len(loud) > 3 * len(quiet)


def test_cli_explains_a_raw_multi_rank_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "job.log"
    log.write_text("\n".join([PROGRESS.format(r=r % 8) for r in range(300)] + [XID79]) + "\n", encoding="utf-8")
    assert main(["rules", "explain", "--file", str(log)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "line 301: " in out and "line 1: " not in out  # a long log: only the lines something happened on
    assert out.rstrip().splitlines()[-1].startswith("verdict: failed")


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["rules", "explain"],
    ["rules", "explain", "--file", "/nonexistent/job.log"],
    ["rules", "explain", "--rule", "no-such-rule", "a line"],
    ["rules", "explain", "--file", "-", "a line"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err


@pytest.mark.slow
def test_cli_unreadable_or_empty_files_are_one_line_and_exit_2(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(gzip.compress(("\n".join(PROGRESS.format(r=r) for r in range(2000)) + "\n").encode())[:-40])
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    for path in (cut, empty):
        assert main(["rules", "explain", "--file", str(path)]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "error:" in err
