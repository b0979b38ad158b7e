"""Rule precedence as data (`refines:`), the overlaps `logdx rules test` refuses without it, the
hardware-only cordon, and what examples and raw-input tests may state besides a match (hint, culprit,
exit code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from logdx.cli import main
from logdx.config import Settings
from logdx.diagnose.rules import RuleError, default_rules_dir, example_event, load_rules, precedence_problems
from logdx.explain import run_pack_tests
from logdx.faces import EXIT_FAILED, EXIT_OK

AER = "pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0"

# A new rule that reads the shipped `pcie-fatal-error` line (gpu_hardware_error) as a riser fault of the
# node: both hit the same example as root causes of different types.
_RISER = """\
pack: site
description: a site's own rules
rules:
  - id: pcie-riser-fault
    title: the PCIe riser of the node failed
    role: root_cause
    category: infrastructure
    failure_type: node_failure
    severity: medium
    confidence: 0.6
{refines}    match:
      patterns: ['AER: Uncorrected \\(Fatal\\) error received']
    hint: "reseat the riser of {{host}}"
    examples: ['{aer}']
tests:
  - name: an AER line of a node's kernel log
    lines: ['Nov 13 10:00:01 gpu-node-7 kernel: {aer}']
    verdict: {{failure_type: {expected}}}
"""


def _site(tmp_path: Path, refines: str = "", expected: str = "gpu_hardware_error") -> Path:
    folder = tmp_path / "site"
    folder.mkdir(exist_ok=True)
    (folder / "site.yaml").write_text(_RISER.format(refines=refines, aer=AER, expected=expected), encoding="utf-8")
    return folder


@pytest.mark.slow
def test_a_new_rule_overlapping_a_shipped_one_fails_rules_test_until_it_declares_precedence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "test", "--rules", str(_site(tmp_path))]) == EXIT_FAILED
    out = capsys.readouterr().out
    overlap = [ln for ln in out.splitlines() if "overlaps" in ln]
    assert len(overlap) == 1, out
    assert "rule 'pcie-fatal-error'" in overlap[0] and "'pcie-riser-fault'" in overlap[0]
    assert "(gpu_hardware_error, node_failure)" in overlap[0] and "refines: [pcie-riser-fault]" in overlap[0]
    assert "site.yaml:" in overlap[0] and "rules/node.yaml:" in overlap[0]  # both rules named by file and line

    # Declared: the refining rule wins though its severity and confidence are lower, and the pack's own test
    # (which now expects the riser) passes.
    folder = _site(tmp_path, refines="    refines: [pcie-fatal-error]\n", expected="node_failure")
    assert main(["rules", "test", "--rules", str(folder)]) == EXIT_OK, capsys.readouterr().out
    rules = load_rules([default_rules_dir(), folder])
    hits = rules.match(example_event(AER, rules.by_id["pcie-fatal-error"]))
    assert [h.rule_id for h in hits][:2] == ["pcie-riser-fault", "pcie-fatal-error"]


def test_a_rule_refines_through_chains_but_precedence_is_declared_per_pair(tmp_path: Path) -> None:
    # A third rule refines the site's rule: it comes first, whatever its (lowest) severity says.
    folder = _site(tmp_path)
    (folder / "site2.yaml").write_text(f"""\
pack: site2
rules:
  - id: pcie-aer-uncorrected
    title: an uncorrected AER error, read as the GPU's
    role: root_cause
    category: infrastructure
    failure_type: gpu_hardware_error
    severity: low
    confidence: 0.5
    refines: [pcie-riser-fault]
    match: {{patterns: ['AER: Uncorrected']}}
    examples: ['{AER}']
""", encoding="utf-8")
    rules = load_rules([default_rules_dir(), folder])
    ids = [h.rule_id for h in rules.match(example_event(AER, rules.by_id["pcie-fatal-error"]))]
    assert ids.index("pcie-aer-uncorrected") < ids.index("pcie-riser-fault")
    # pcie-fatal-error and pcie-riser-fault still overlap (neither refines the other, through any chain)
    problems = precedence_problems(rules)
    assert any("'pcie-fatal-error'" in p and "'pcie-riser-fault'" in p for p in problems), problems
    assert not any("'pcie-aer-uncorrected'" in p and "'pcie-riser-fault'" in p for p in problems)


def test_the_shipped_packs_declare_every_overlap_and_rules_test_passes() -> None:
    rules = load_rules([default_rules_dir()])
    hits: list = []
    assert run_pack_tests(Settings(), rules, hits) == []
    assert precedence_problems(rules, hits) == []
    assert sum(len(r.refines) for r in rules.rules) >= 30  # today's overlapping pairs, each declared


_BAD = """\
pack: bad
rules:
  - id: a-rule
    title: a
    role: {role}
    category: infrastructure
    failure_type: {ft}
{extra}    confidence: 0.9
    match: {{patterns: ['the widget broke']}}
    examples: ['the widget broke']
  - id: b-rule
    title: b
    role: root_cause
    category: infrastructure
    failure_type: storage_error
    confidence: 0.9
{b_extra}    match: {{patterns: ['the widget']}}
    examples: ['the widget broke']
"""


@pytest.mark.parametrize(("role", "ft", "extra", "b_extra", "line", "problem"), [
    ("root_cause", "disk_full", "    refines: [no-such-rule]\n", "", 3, "refines unknown rule 'no-such-rule'"),
    ("root_cause", "disk_full", "    refines: [a-rule]\n", "", 3, "refines itself"),
    ("symptom", "disk_full", "    refines: [b-rule]\n", "", 3, "a symptom rule may only refine rules of its own role"),
    ("root_cause", "disk_full", "    refines: [b-rule]\n", "    refines: [a-rule]\n", 3, "which refines it back"),
    ("root_cause", "disk_full", "    action: cordon_and_restart\n", "", 8, "only hardware types may cordon"),
])
def test_bad_precedence_or_a_software_cordon_does_not_load_and_names_file_and_line(
        tmp_path: Path, role: str, ft: str, extra: str, b_extra: str, line: int, problem: str) -> None:
    pack = tmp_path / "bad.yaml"
    pack.write_text(_BAD.format(role=role, ft=ft, extra=extra, b_extra=b_extra), encoding="utf-8")
    with pytest.raises(RuleError) as err:
        load_rules([pack])
    assert any(p.startswith(f"{pack}:{line}: rule 'a-rule': ") and problem in p for p in err.value.problems), \
        err.value.problems


def test_a_hardware_type_may_state_a_cordon_only_where_it_is_not_the_default(tmp_path: Path) -> None:
    pack = tmp_path / "hw.yaml"
    pack.write_text(_BAD.format(role="root_cause", ft="node_failure", extra="    action: restart\n", b_extra="",
                                ).replace("storage_error", "node_failure"), encoding="utf-8")
    assert len(load_rules([pack])) == 2


_STATED = """\
pack: stated
rules:
  - id: widget-host-broke
    title: the widget of a host broke
    role: root_cause
    category: infrastructure
    failure_type: node_failure
    confidence: 0.9
    match: {{patterns: ['widget of (?P<host>[a-z0-9-]+) broke']}}
    hint: "drain {{host}} and replace its widget"
    examples:
      - {{text: 'the widget of gpu-node-3 broke', hint: 'drain gpu-node-3', culprit: {{host: {host}}}}}
tests:
  - name: the widget line among two ranks' progress
    exit_code: {exit_code}
    lines:
      - '[rank0]: iteration 10/100 | loss 2.31'
      - '[rank1]: iteration 10/100 | loss 2.30'
      - 'Nov 13 10:00:01 gpu-node-3 kernel: the widget of gpu-node-3 broke'
    verdict: {{failure_type: node_failure, culprit: {{host: {host}}}, hint: '{hint}'}}
"""


def _stated(tmp_path: Path, host: str = "gpu-node-3", hint: str = "replace its widget", exit_code: int = 1) -> Path:
    pack = tmp_path / "stated.yaml"
    pack.write_text(_STATED.format(host=host, hint=hint, exit_code=exit_code), encoding="utf-8")
    return pack


def test_examples_and_pack_tests_may_state_hint_culprit_and_exit_code(tmp_path: Path) -> None:
    rules = load_rules([_stated(tmp_path)])
    assert rules.tests[0].exit_code == 1 and rules.tests[0].culprit == (("host", "gpu-node-3"),)
    assert run_pack_tests(Settings(), rules) == []


def test_a_stated_hint_or_culprit_that_differs_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(RuleError) as err:  # the example's culprit: checked with the rule's own examples
        load_rules([_stated(tmp_path, host="gpu-node-4")])
    assert any("stated.yaml:12: rule 'widget-host-broke'" in p and "culprit host 'gpu-node-3', expected 'gpu-node-4'"
               in p for p in err.value.problems), err.value.problems
    rules = load_rules([_stated(tmp_path, hint="reboot the switch")])
    problems = run_pack_tests(Settings(), rules)
    assert len(problems) == 1 and "does not contain 'reboot the switch'" in problems[0], problems
    assert problems[0].startswith(f"{tmp_path / 'stated.yaml'}:14: test ")


def test_a_stated_exit_code_reaches_the_diagnosis(tmp_path: Path) -> None:
    # Lines with no error: the exit code alone says whether the job failed.
    pack = tmp_path / "quiet.yaml"
    pack.write_text("""\
pack: quiet
tests:
  - name: a clean exit
    exit_code: 0
    lines: ['[rank0]: iteration 10/100 | loss 2.31']
    verdict: {status: healthy, culprit: none}
  - name: a crash with nothing printed
    exit_code: 1
    lines: ['[rank0]: iteration 10/100 | loss 2.31']
    verdict: {status: healthy}
""", encoding="utf-8")
    problems = run_pack_tests(Settings(), load_rules([pack]))
    assert problems == [f"{pack}:7: test 'a crash with nothing printed': verdict failed, expected healthy"], problems


@pytest.mark.slow
def test_approve_refuses_a_pack_that_overlaps_a_shipped_rule_until_it_declares_precedence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `rules approve` copies a pack into the rules a service loads: an undeclared overlap would compete silently.
    pack = _site(tmp_path) / "site.yaml"
    mine = tmp_path / "mine"
    assert main(["rules", "approve", str(pack), "--into", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "overlaps" in err and "pcie-fatal-error" in err and "pcie-riser-fault" in err, err
    assert not mine.exists() or not list(mine.glob("*.yaml"))

    pack = _site(tmp_path, refines="    refines: [pcie-fatal-error]\n", expected="node_failure") / "site.yaml"
    assert main(["rules", "approve", str(pack), "--into", str(mine)]) == 0, capsys.readouterr()
    assert (mine / "site.yaml").is_file()
