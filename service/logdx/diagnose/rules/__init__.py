"""Stage 4a: the rule engine. Precise, explainable matches of events against YAML rule packs.

A rule pack (``rules/*.yaml``, format in ``rules/README.md``) is data. The package follows it from
file to match, one module a step:

- ``spec``: the file format (pydantic, shape only, at the file edge);
- ``loader``: finds the packs, validates what a rule means (regexes, labels, each rule's own
  examples) with errors that name file, line and rule id, and compiles them;
- ``compiled``: the plain dataclasses a rule becomes (``Rule``, ``RuleHit``, ``OriginConfig``);
- ``keywords``: the keyword pre-filter read off each regex's parse tree (the only user of ``re._parser``);
- ``matcher``: ``RuleSet.match(event)`` returns every rule hit on one event, best first;
- ``precedence``: ``refines:`` between rules (which wins when both hit), and the overlaps nothing decides;
- ``examples``: every rule against its own examples and counterexamples, and every example against
  every rule for overlaps without precedence (``logdx rules test``).
"""

from __future__ import annotations

from logdx.diagnose.rules.compiled import KNOWN_KINDS, Origin, OriginConfig, Rule, RuleError, RuleHit
from logdx.diagnose.rules.examples import check_examples, example_event, example_hits, precedence_problems
from logdx.diagnose.rules.loader import ENV_RULES_DIR, default_rules_dir, load_rules
from logdx.diagnose.rules.matcher import RuleSet, classify_origin, render_hint

__all__ = [
    "ENV_RULES_DIR",
    "KNOWN_KINDS",
    "Origin",
    "OriginConfig",
    "Rule",
    "RuleError",
    "RuleHit",
    "RuleSet",
    "check_examples",
    "classify_origin",
    "default_rules_dir",
    "example_event",
    "example_hits",
    "load_rules",
    "precedence_problems",
    "render_hint",
]
