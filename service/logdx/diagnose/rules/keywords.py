"""The keyword pre-filter: which rules can possibly match a line, read off their regexes.

Every pattern's required literal keywords are read off its regex parse tree once (Python's
``re._parser``: private, so all of its use lives in this module and its tests). A trie-shaped regex
of those keywords is the pre-filter (``RuleSet.could_match``: is this line error-bearing?) and also
picks the few rules worth trying on an event.
"""

from __future__ import annotations

import functools
import re
import re._constants as sre_c  # type: ignore[import-not-found]  # (typeshed: no stubs) the parse tree is only
import re._parser as sre_parse  # type: ignore[import-not-found]  # read, to find literal keywords
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from logdx.diagnose.rules.compiled import EXCEPTION_MARKERS, Rule


def pattern_problem(src: str) -> str | None:
    """What a rule pattern may not use: back-references, so that all patterns stay combinable into
    one alternation (the tests check the pre-filter against it). (Inline flags anywhere but at the
    start are already a re.error in Python 3.11.)"""
    if _has_op(sre_parse.parse(src), {sre_c.GROUPREF, sre_c.GROUPREF_EXISTS}):
        return "back-references are not supported"
    return None


def _has_op(items: Iterable[Any], ops: set[Any]) -> bool:
    for op, av in items:
        if op in ops:
            return True
        if op == sre_c.SUBPATTERN and _has_op(av[3], ops):
            return True
        if op == sre_c.BRANCH and any(_has_op(b, ops) for b in av[1]):
            return True
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT) and _has_op(av[2], ops):
            return True
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT) and _has_op(av[1], ops):
            return True
    return False


def _exception_pattern(names: Iterable[str]) -> str:
    shorts = sorted({n.rsplit(".", 1)[-1] for n in names})
    return r"\b(?:" + "|".join(re.escape(s) for s in shorts) + r")\b"


@dataclass(frozen=True, slots=True)
class Prefilter:
    """Which rules and patterns can possibly match a text, from the literal keywords they need."""

    keywords: re.Pattern[str]  # trie-shaped alternation of every lower-case keyword
    prefixes: dict[str, tuple[str, ...]]  # keyword -> the keywords that are prefixes of it (itself too)
    patterns_by_keyword: dict[str, tuple[re.Pattern[str], ...]]
    patterns_always: tuple[re.Pattern[str], ...]  # patterns without a usable keyword
    rules_by_keyword: dict[str, frozenset[int]]  # keyword -> positions of the rules that need it
    rules_always: frozenset[int]  # rules to try on every event (no pattern, or one without keyword)

    @staticmethod
    def build(rules: Sequence[Rule]) -> Prefilter:
        needs: list[tuple[re.Pattern[str], frozenset[str] | None]] = []
        for r in rules:
            needs.extend((p, required_literals(p.pattern)) for p in r.patterns)
        names = {e.rsplit(".", 1)[-1] for r in rules for e in (r.exceptions or ()) if e not in EXCEPTION_MARKERS}
        if names:
            needs.append((re.compile(_exception_pattern(names)), frozenset(n.lower() for n in names)))
        patterns_by_kw: dict[str, list[re.Pattern[str]]] = {}
        patterns_always: list[re.Pattern[str]] = []
        for pat, lits in needs:
            if not lits:
                patterns_always.append(pat)
            for w in lits or ():
                patterns_by_kw.setdefault(w, []).append(pat)
        rules_by_kw: dict[str, set[int]] = {}
        rules_always: set[int] = set()
        for i, r in enumerate(rules):
            if not r.patterns or r.literals is None:
                rules_always.add(i)
            for w in r.literals or ():
                rules_by_kw.setdefault(w, set()).add(i)
        words = sorted(patterns_by_kw)
        trie = trie_regex(words) if words else r"(?!x)x"
        return Prefilter(
            keywords=re.compile(trie),
            prefixes={w: tuple(w[:i] for i in range(1, len(w) + 1) if w[:i] in patterns_by_kw) for w in words},
            patterns_by_keyword={k: tuple(dict.fromkeys(v)) for k, v in patterns_by_kw.items()},
            patterns_always=tuple(patterns_always),
            rules_by_keyword={k: frozenset(v) for k, v in rules_by_kw.items()},
            rules_always=frozenset(rules_always),
        )

    def keywords_in(self, low: str) -> frozenset[str]:
        """Every keyword occurring in a lower-cased text.

        The trie regex finds the longest keyword starting at a position; the shorter ones starting
        there are its prefixes, and searching again one character further finds the rest."""
        found: set[str] = set()
        m = self.keywords.search(low)
        while m is not None:
            found.update(self.prefixes[m.group()])
            m = self.keywords.search(low, m.start() + 1)
        return frozenset(found)

    def could_match(self, text: str) -> bool:
        if self.patterns_always and any(p.search(text) for p in self.patterns_always):
            return True
        low = text.lower()
        if self.keywords.search(low) is None:  # the common case: one search, no keyword
            return False
        return any(p.search(text) for kw in self.keywords_in(low) for p in self.patterns_by_keyword[kw])

    def candidate_rules(self, keyword_sets: Iterable[frozenset[str]]) -> list[int]:
        """Positions of the rules that could hit texts with these keywords, in load order."""
        cands = set(self.rules_always)
        for kws in keyword_sets:
            for kw in kws:
                cands |= self.rules_by_keyword.get(kw, frozenset())
        return sorted(cands)


def trie_regex(words: Iterable[str]) -> str:
    """An alternation of literal words shaped as a prefix tree: the regex engine tries a handful of
    first characters at each position instead of hundreds of words (about 10x faster)."""
    root: dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 and not ends else "(?:" + "|".join(alts) + ")"
        return body + "?" if ends else body

    return build(root)


def rule_literals(patterns: Sequence[str]) -> frozenset[str] | None:
    out: set[str] = set()
    for src in patterns:
        lits = required_literals(src)
        if lits is None:
            return None
        out |= lits
    return frozenset(out) if out else None


_MIN_LITERAL = 3
_MAX_EXPANSION = 64
# Words nearly every progress line contains: as a pattern's keyword they would let every line
# through the pre-filter, so a rarer literal of the same pattern is preferred when there is one.
_COMMON_WORDS = frozenset({"loss", "step", "epoch", "iteration", "info", "train", "time", "rank"})


@functools.lru_cache(maxsize=4096)
def required_literals(src: str) -> frozenset[str] | None:
    """Lower-cased strings one of which occurs in every text the pattern matches (None: unknown).

    Read off the regex parse tree: runs of literal characters (alternations of literals expanded,
    so ``Node(?:NotReady|Lost)`` gives both words), and alternations whose every branch has such a
    run. Lower-casing makes it valid for (?i) too."""
    try:
        tree = sre_parse.parse(src)
    except re.error:
        return None
    _, candidates = _analyze(list(tree))
    good = [c for c in candidates if min(len(x) for x in c) >= _MIN_LITERAL]
    if not good:
        return None
    best: set[str] = max(good, key=_selectivity)
    return frozenset(best)


def _selectivity(lits: set[str]) -> tuple[bool, int]:
    return (not any(x.strip() in _COMMON_WORDS for x in lits), min(len(x) for x in lits))


def _analyze(items: list[Any]) -> tuple[set[str] | None, list[set[str]]]:
    """(the exact strings the sequence matches if it is a finite set of literals, else None;
    sets of strings one of which must occur)."""
    candidates: list[set[str]] = []
    cur: set[str] | None = None  # the exact strings of the current run of literal pieces
    exact_so_far = True

    def flush() -> None:
        nonlocal cur
        if cur:
            candidates.append(cur)
        cur = None

    def extend(strings: set[str]) -> None:
        nonlocal cur
        if cur is None:
            cur = set(strings)
        elif len(cur) * len(strings) <= _MAX_EXPANSION:
            cur = {a + b for a in cur for b in strings}
        else:
            flush()
            cur = set(strings)

    for op, av in items:
        sub_exact: set[str] | None = None
        sub_cands: list[set[str]] = []
        if op == sre_c.LITERAL:
            sub_exact = {chr(av).lower()}
        elif op == sre_c.IN and (one := _single_char(av)) is not None:
            sub_exact = {one}  # [Xx]
        elif op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT):
            continue  # zero-width: the characters on either side are still adjacent
        elif op == sre_c.SUBPATTERN:
            sub_exact, sub_cands = _analyze(list(av[3]))
        elif op == sre_c.BRANCH:
            sub_exact, sub_cands = _analyze_branch(av[1])
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT) and av[0] >= 1:
            body_exact, sub_cands = _analyze(list(av[2]))
            if body_exact:
                sub_cands = [*sub_cands, body_exact]
        if sub_exact is not None:
            extend(sub_exact)
            continue
        exact_so_far = False
        flush()
        candidates.extend(sub_cands)
    exact = cur if exact_so_far and cur is not None else None
    flush()
    return exact, candidates


def _analyze_branch(alternatives: list[Any]) -> tuple[set[str] | None, list[set[str]]]:
    results = [_analyze(list(b)) for b in alternatives]
    if all(ex is not None for ex, _ in results):
        exact: set[str] = set().union(*(ex for ex, _ in results if ex is not None))
        return exact, [exact]
    bests = []
    for ex, cands in results:
        options = ([ex] if ex else []) + [c for c in cands if min(len(x) for x in c) >= _MIN_LITERAL]
        if not options:
            return None, []
        bests.append(max(options, key=_selectivity))
    return None, [set().union(*bests)]


def _single_char(av: list[Any]) -> str | None:
    """[Xx] is the literal x once lower-cased."""
    if not all(op == sre_c.LITERAL for op, _ in av):
        return None
    chars = {chr(v).lower() for _, v in av}
    return chars.pop() if len(chars) == 1 else None
