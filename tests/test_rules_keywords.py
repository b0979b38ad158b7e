"""The keyword pre-filter (logdx.diagnose.rules.keywords): literals read off regex parse trees,
the trie regex of them, and a pre-filter that agrees exactly with trying every pattern."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from logdx.diagnose.rules import Rule, RuleSet, default_rules_dir, load_rules
from logdx.diagnose.rules.compiled import EXCEPTION_MARKERS
from logdx.diagnose.rules.keywords import Prefilter, pattern_problem, required_literals, rule_literals, trie_regex
from logdx.model import Action, Category, Label, Role


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules([default_rules_dir()])


# -- literals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"GPU has fallen off the bus", {"gpu has fallen off the bus"}),
        (r"(?i)Out Of Memory", {"out of memory"}),  # lower-cased: valid for (?i) too
        (r"Node(?:NotReady|Lost)", {"nodenotready", "nodelost"}),  # alternations of literals expand
        (r"\bXid\b.*: 79", {": 79"}),  # of two runs, the longer is the rarer
        (r"[Ee]rror: disk", {"error: disk"}),  # [Ee] is one literal once lower-cased
        (r"(?:fo\d+|barbaz)", None),  # a branch without a usable literal: unknown
        (r"\d+\s+\w+", None),  # no literal at all
        (r"(", None),  # not a regex: unknown, the loader reports it
    ],
)
def test_required_literals(pattern: str, expected: set[str] | None) -> None:
    got = required_literals(pattern)
    assert (set(got) if got is not None else None) == expected


def test_common_words_give_way_to_rarer_literals() -> None:
    # "loss" is in nearly every progress line: the rarer "nan detected" is the keyword.
    assert required_literals(r"loss.*\d+.*nan detected") == frozenset({"nan detected"})


def test_rule_literals_are_unknown_when_one_pattern_has_none() -> None:
    assert rule_literals(["ECC error", "Xid.*48"]) == frozenset({"ecc error", "xid"})
    assert rule_literals(["ECC error", r"\d+"]) is None


def test_back_references_are_refused() -> None:
    assert pattern_problem(r"(a)\1") == "back-references are not supported"
    assert pattern_problem(r"(?P<x>a)(?(x)b|c)") == "back-references are not supported"
    assert pattern_problem(r"(?P<host>node-\d+) down") is None


# -- the trie regex ----------------------------------------------------------------------------


def test_trie_regex_matches_exactly_its_words() -> None:
    words = ["nccl", "nccl error", "ecc", "xid", "x"]
    rx = re.compile(trie_regex(words))
    for w in words:
        assert rx.fullmatch(w), w
    for other in ["ncc", "ec", "nccl erro", "y"]:
        assert not rx.fullmatch(other), other


# -- the pre-filter ----------------------------------------------------------------------------


def _rule(rid: str, *patterns: str, exceptions: Sequence[str] | None = None) -> Rule:
    return Rule(
        id=rid, pack="t", title=rid, role=Role.ROOT_CAUSE, severity="high", confidence=0.9,
        label=Label(Category.INFRASTRUCTURE, "ecc_error", Action.RESTART), by_origin=None, patterns=tuple(re.compile(p) for p in patterns),
        kinds=None, exceptions=frozenset(exceptions) if exceptions is not None else None, unless=(),
        hint="", examples=(), counterexamples=(), file="t.yaml", line=1, order=0,
        literals=rule_literals(patterns) if patterns else None,
    )


def test_keywords_in_finds_overlapping_and_prefix_keywords() -> None:
    pf = Prefilter.build([_rule("a", "nccl"), _rule("b", "nccl error"), _rule("c", "error code")])
    assert pf.keywords_in("nccl error code 3") == {"nccl", "nccl error", "error code"}
    assert pf.keywords_in("all good") == frozenset()


def test_candidate_rules_are_the_ones_whose_keywords_occur_plus_those_without() -> None:
    rules = [_rule("ecc", "ECC error"), _rule("xid", r"Xid.*79"), _rule("any", r"\d+\s\d+"), _rule("exc", exceptions=["KeyError"])]
    pf = Prefilter.build(rules)
    assert pf.candidate_rules([pf.keywords_in("uncorrectable ecc error")]) == [0, 2, 3]
    assert pf.candidate_rules([frozenset()]) == [2, 3]


def test_exception_names_are_keywords_too() -> None:
    pf = Prefilter.build([_rule("exc", exceptions=["torch.OutOfMemoryError"])])
    assert pf.could_match("torch.OutOfMemoryError: CUDA out of memory")
    assert not pf.could_match("OutOfMemoryErrors were avoided")  # a whole word, like the rule


# The reference the pre-filter must agree with: one alternation of every pattern (slow on long
# lines, exact). It lives here, not in the product: nothing else needs it.
_GLOBAL_FLAGS = re.compile(r"^\(\?([aiLmsux]+)\)")
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?P<\w+>")


def _as_alternative(src: str) -> str:
    """One pattern as a branch of a larger alternation: no names, flags scoped to it."""
    body = _NAMED_GROUP.sub("(?:", src)
    m = _GLOBAL_FLAGS.match(body)
    return f"(?{m.group(1)}:{body[m.end():]})" if m else f"(?:{body})"


def _full_alternation(rules: Sequence[Rule]) -> re.Pattern[str]:
    parts = [_as_alternative(p.pattern) for r in rules for p in r.patterns]
    names = sorted({e.rsplit(".", 1)[-1] for r in rules for e in (r.exceptions or ()) if e not in EXCEPTION_MARKERS})
    if names:
        parts.append(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b")
    return re.compile("|".join(dict.fromkeys(parts)))


SAMPLE_LINES = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout",
    " iteration      100/    1000 | consumed samples:        3200 | lm loss: 6.45E+00 |",
    "2024-05-01 03:12:44,123 - INFO - step 100/1000 | loss 2.31 | lr 1e-4 | tokens/s 123456",
    "",
]


@pytest.mark.slow
def test_prefilter_agrees_with_the_full_alternation(rules: RuleSet) -> None:
    oracle = _full_alternation(rules.rules)
    samples = list(SAMPLE_LINES)
    for r in rules.rules:
        samples.extend(r.examples)
        samples.extend(r.counterexamples)
    for text in samples:
        for line in text.split("\n"):
            assert rules.could_match(line) == bool(oracle.search(line)), line
