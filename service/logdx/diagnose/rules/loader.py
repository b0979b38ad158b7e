"""Loading rule packs: YAML -> validated spec -> compiled rules, with errors that name file, line
and rule id (one "file:line: rule 'id': what" each, all of them at once)."""

from __future__ import annotations

import os
import re
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logdx.diagnose.rules.compiled import (
    EXCEPTION_MARKERS,
    KNOWN_KINDS,
    ExampleExpect,
    OriginConfig,
    PackTest,
    Rule,
    RuleError,
)
from logdx.diagnose.rules.examples import check_examples
from logdx.diagnose.rules.keywords import pattern_problem, rule_literals
from logdx.diagnose.rules.matcher import RuleSet
from logdx.diagnose.rules.precedence import refines_problems

if TYPE_CHECKING:  # YAML, pydantic and the pack format load only when packs are compiled, not read from the cache
    import yaml
    from pydantic import ValidationError

    from logdx.diagnose.rules.spec import CulpritExpect, EventExpect, MatchSpec, OriginSpec, RecordExpect, RuleSpec
from logdx.model import FT, Action, Category, EventKind, Label, Role
from logdx.taxonomy import category_of, default_action, is_hardware, make_label

ENV_RULES_DIR = "LOGDX_RULES_DIR"


def default_rules_dir() -> Path:
    """The rules shipped with logdx: $LOGDX_RULES_DIR, the repo's rules/, or <prefix>/share/logdx/rules."""
    candidates: list[Path] = []
    env = os.environ.get(ENV_RULES_DIR)
    if env:
        candidates.append(Path(env))
    here = Path(__file__).resolve()
    if len(here.parents) > 4:
        candidates.append(here.parents[4] / "rules")  # service/logdx/diagnose/rules/loader.py -> repo/rules
    candidates.append(Path(sys.prefix) / "share" / "logdx" / "rules")
    candidates.append(Path("/usr/share/logdx/rules"))
    for c in candidates:
        if c.is_dir() and any(c.glob("*.yaml")):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise RuleError([f"no rules directory found (tried {tried}); set {ENV_RULES_DIR}"])


def load_rules(dirs: Sequence[Path | str] | Path | str, *, verify: bool = True,
               cache_dir: Path | None = None) -> RuleSet:
    """Load every ``*.yaml`` pack of each folder (or pack file) in order.

    ``verify`` also runs every rule's examples and counterexamples (the CLI's ``rules test``
    loads with ``verify=False`` and lists all problems with ``check_examples``). ``cache_dir``: a
    verified rule set is read from and kept there, keyed by its packs' hashes (``rules.cache``)."""
    if isinstance(dirs, (str, Path)):
        dirs = [dirs]
    files: list[Path] = []
    problems: list[str] = []
    for d in dirs:
        p = Path(d)
        if p.is_dir():
            files.extend(sorted([*p.glob("*.yaml"), *p.glob("*.yml")]))
        elif p.is_file():
            files.append(p)
        else:
            problems.append(f"{_display(p)}: no such rules directory or file")
    if problems or not verify or cache_dir is None:
        return _compile(files, problems, verify)
    from logdx.diagnose.rules import cache

    try:
        key = cache.cache_key(files)
    except OSError:  # a pack that cannot be read: the loader says which
        return _compile(files, problems, verify)
    path = cache_dir / cache.CACHE_FILE
    shown = [_display(f) for f in files]
    cached = cache.read_cached(path, key)
    if cached is not None:
        return cache.rename_packs(cached[0], cached[1], shown)
    ruleset = _compile(files, problems, verify)
    cache.write_cached(path, key, ruleset, shown)
    return ruleset


def _compile(files: list[Path], problems: list[str], verify: bool) -> RuleSet:
    rules: list[Rule] = []
    tests: list[PackTest] = []
    origin = OriginConfig()
    packs: dict[str, str] = {}
    seen: dict[str, Rule] = {}
    for f in files:
        loaded = _load_pack(f, start_order=len(rules))
        problems.extend(loaded.problems)
        if loaded.origin is not None:
            origin = origin.merged(loaded.origin)
        if loaded.name:
            packs.setdefault(loaded.name, loaded.description)
        tests.extend(loaded.tests)
        for r in loaded.rules:
            if r.id in seen:
                problems.append(f"{r.where()}: duplicate rule id (first defined at {seen[r.id].file}:{seen[r.id].line})")
                continue
            seen[r.id] = r
            rules.append(r)
    problems.extend(f"{t.where()}: unknown rule '{rid}'" for t in tests for rid, _, _ in t.events
                    if rid is not None and rid not in seen)
    problems.extend(refines_problems(rules))
    if problems:
        raise RuleError(problems)
    ruleset = RuleSet(rules=rules, origin=origin, packs=packs, files=files, tests=tests)
    if verify:
        bad = check_examples(ruleset, require_examples=False)
        if bad:
            raise RuleError(bad)
    return ruleset


@dataclass
class _LoadedPack:
    name: str = ""
    description: str = ""
    rules: list[Rule] = field(default_factory=list)
    tests: list[PackTest] = field(default_factory=list)
    origin: OriginConfig | None = None
    problems: list[str] = field(default_factory=list)


class _Lines:
    """Line numbers of a YAML document by path: ("rules", 3, "failure_type") -> 41."""

    def __init__(self, root: yaml.Node | None) -> None:
        import yaml

        self._yaml = yaml
        self.at: dict[tuple[Any, ...], int] = {}
        self.duplicates: list[tuple[tuple[Any, ...], int]] = []
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, path: tuple[Any, ...]) -> None:
        self.at.setdefault(path, node.start_mark.line + 1)  # a key's own line was set first
        yaml = self._yaml
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark)
                kpath = (*path, key)
                if kpath in self.at:
                    self.duplicates.append((kpath, k.start_mark.line + 1))
                # The key's line, not the value's: that is where a wrong value is reported.
                self.at[kpath] = k.start_mark.line + 1
                self._walk(v, kpath)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, (*path, i))

    def line(self, path: Sequence[Any]) -> int:
        """The line of the deepest known prefix of path."""
        p = tuple(path)
        while p and p not in self.at:
            p = p[:-1]
        return self.at.get(p, 1)


def _load_pack(path: Path, start_order: int) -> _LoadedPack:
    from pydantic import ValidationError

    from logdx import yamlsafe
    from logdx.diagnose.rules.spec import PackSpec, RuleSpec

    out = _LoadedPack()
    shown = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
        root, data = yamlsafe.load_with_nodes(text, shown)
    except (OSError, UnicodeDecodeError) as exc:
        out.problems.append(f"{shown}: cannot read: {exc}")
        return out
    except yamlsafe.YamlError as exc:  # not YAML, or an alias bomb / absurd nesting
        out.problems.append(f"{shown}:{exc.line or 1}: {exc.problem}")
        return out
    lines = _Lines(root)
    for dpath, dline in lines.duplicates:
        out.problems.append(f"{shown}:{dline}: {_rule_ref(data, dpath)}duplicate key '{dpath[-1]}'")
    if not isinstance(data, dict):
        out.problems.append(f"{shown}:1: a pack is a mapping with 'pack', 'description' and 'rules'")
        return out
    try:
        spec = PackSpec.model_validate(data)
    except ValidationError as exc:
        out.problems.extend(_pydantic_problems(exc, shown, lines, data, ()))
        return out
    out.name, out.description = spec.pack, spec.description
    if spec.origin is not None:
        out.origin = _compile_origin(spec.origin, shown, lines, out.problems)
    for i, raw in enumerate(spec.rules):
        rpath = ("rules", i)
        if not isinstance(raw, dict):
            out.problems.append(f"{shown}:{lines.line(rpath)}: rule #{i + 1} is not a mapping")
            continue
        try:
            rspec = RuleSpec.model_validate(raw)
        except ValidationError as exc:
            out.problems.extend(_pydantic_problems(exc, shown, lines, data, rpath))
            continue
        rule = _compile_rule(rspec, spec.pack, shown, lines, rpath, start_order + len(out.rules), out.problems)
        if rule is not None:
            out.rules.append(rule)
    for i, raw in enumerate(spec.tests):
        test = _load_test(raw, spec.pack, shown, lines, data, ("tests", i), out.problems)
        if test is not None:
            out.tests.append(test)
    return out


def _load_test(raw: Any, pack: str, shown: str, lines: _Lines, data: Any, tpath: tuple[Any, ...],
               problems: list[str]) -> PackTest | None:
    """One raw-input test of a pack, checked as far as it can be alone (its rule ids: by `load_rules`)."""
    from pydantic import ValidationError

    from logdx.diagnose.rules.spec import PackTestSpec

    if not isinstance(raw, dict):
        problems.append(f"{shown}:{lines.line(tpath)}: test #{tpath[1] + 1} is not a mapping")
        return None
    try:
        spec = PackTestSpec.model_validate(raw)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, shown, lines, data, tpath))
        return None
    n_before = len(problems)

    def where(*sub: Any) -> str:
        return f"{shown}:{lines.line((*tpath, *sub))}: test '{spec.name}'"

    if not (spec.records or spec.events or spec.verdict):
        problems.append(f"{where()}: a test expects records, events or a verdict")
    n = len(spec.lines)
    expected: tuple[tuple[str, Sequence[RecordExpect | EventExpect]], ...] = (
        ("records", spec.records), ("events", spec.events))
    for field_name, items in expected:
        for i, item in enumerate(items):
            if item.line is not None and item.line > n:
                problems.append(f"{where(field_name, i, 'line')}: line {item.line} of {n} lines")
    for i, ev in enumerate(spec.events):
        if ev.kind is not None and ev.kind not in KNOWN_KINDS:
            problems.append(f"{where('events', i, 'kind')}: unknown event kind '{ev.kind}'")
    v = spec.verdict
    if v is not None:
        if v.root_line is not None and v.root_line > n:
            problems.append(f"{where('verdict', 'root_line')}: line {v.root_line} of {n} lines")
        if v.failure_type is not None and category_of(v.failure_type) is None:
            problems.append(f"{where('verdict', 'failure_type')}: unknown failure_type '{v.failure_type}'")
        elif v.failure_type is not None and v.category is not None and category_of(v.failure_type) != v.category:
            problems.append(f"{where('verdict', 'category')}: {v.failure_type} is not of category {v.category}")
    if len(problems) > n_before:
        return None
    return PackTest(
        name=spec.name, pack=pack, file=shown, line=lines.line(tpath), lines=tuple(spec.lines),
        records=tuple((r.line, tuple((k, getattr(r, k)) for k in sorted(r.model_fields_set - {"line"})))
                      for r in spec.records),
        events=tuple((e.rule, EventKind(e.kind) if e.kind else None, e.line) for e in spec.events),
        status=v.status if v else None, category=v.category if v else None,
        failure_type=v.failure_type if v else None, root_line=v.root_line if v else None,
        action=v.action.value if v and v.action else None,
        hosts=tuple(v.hosts) if v and v.hosts is not None else None,
        ranks=tuple(v.ranks) if v and v.ranks is not None else None,
        culprit=_culprit_fields(v.culprit) if v else None,
        hint=v.hint if v else None,
        exit_code=spec.exit_code,
    )


def _culprit_fields(c: CulpritExpect | str | None) -> tuple[tuple[str, object], ...] | None:
    """A stated culprit as (field, value) pairs; () for `none` (no culprit); None when not stated."""
    if c is None:
        return None
    if isinstance(c, str):
        return ()
    return tuple((k, getattr(c, k)) for k in ("host", "rank", "gpu") if getattr(c, k) is not None)


def _rule_ref(data: Any, path: Sequence[Any]) -> str:
    if len(path) >= 2 and path[0] == "rules" and isinstance(path[1], int) and isinstance(data, dict):
        rules = data.get("rules")
        if isinstance(rules, list) and path[1] < len(rules) and isinstance(rules[path[1]], dict):
            rid = rules[path[1]].get("id")
            if rid is not None:
                return f"rule '{rid}': "
        return f"rule #{path[1] + 1}: "
    return ""


def _pydantic_problems(
    exc: ValidationError, shown: str, lines: _Lines, data: Any, prefix: tuple[Any, ...]
) -> list[str]:
    out = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        field_name = ".".join(str(x) for x in err["loc"]) or "(top)"
        kind = err["type"]
        if kind == "extra_forbidden":
            what = f"unknown key '{err['loc'][-1]}'"
        elif kind == "missing":
            what = f"missing field '{field_name}'"
        else:
            what = f"{field_name}: {err['msg']}"
            if "input" in err and kind != "model_type":
                what += f" (got {err['input']!r})"
        out.append(f"{shown}:{lines.line(loc)}: {_rule_ref(data, loc)}{what}")
    return out


def _compile_origin(spec: OriginSpec, shown: str, lines: _Lines, problems: list[str]) -> OriginConfig:
    libs: list[re.Pattern[str]] = []
    for i, src in enumerate(spec.library_paths):
        pat = _compile_regex(src, f"{shown}:{lines.line(('origin', 'library_paths', i))}: origin", problems)
        if pat is not None:
            libs.append(pat)
    passes: list[tuple[re.Pattern[str], re.Pattern[str]]] = []
    for i, src in enumerate(spec.passthrough):
        where = f"{shown}:{lines.line(('origin', 'passthrough', i))}: origin"
        file_src, func_src = _split_passthrough(src)
        if not file_src or not func_src:
            problems.append(f"{where}: passthrough must be 'file-regex:function-regex', got {src!r}")
            continue
        f, g = _compile_regex(file_src, where, problems), _compile_regex(func_src, where, problems)
        if f is not None and g is not None:
            passes.append((f, g))
    return OriginConfig(tuple(libs), tuple(passes))


def _split_passthrough(src: str) -> tuple[str, str]:
    """'file-regex:function-regex' split at the last ':' outside parentheses (not '(?:')."""
    depth, cut, i = 0, -1, 0
    while i < len(src):
        ch = src[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == ":" and depth == 0:
            cut = i
        i += 1
    return (src[:cut], src[cut + 1 :]) if cut >= 0 else ("", "")


def _compile_regex(src: str, where: str, problems: list[str]) -> re.Pattern[str] | None:
    try:
        pat = re.compile(src)
    except re.error as exc:
        problems.append(f"{where}: bad regex {src!r}: {exc}")
        return None
    return pat


def _make_label(category: Category, failure_type: str, action: Action | None) -> tuple[Label | None, str | None]:
    """The rule's label from the taxonomy; a stated action must be one the label allows, and
    stating the default is noise (the taxonomy says it once)."""
    cat = Category(category)
    if category_of(failure_type) != cat and not (cat is Category.UNKNOWN and failure_type == FT.UNKNOWN):
        return None, f"unknown failure_type '{failure_type}' for category {category} (see logdx/taxonomy.yaml)"
    if action is not None and Action(action) == default_action(cat, failure_type):
        return None, f"action {action} is already the default of {failure_type}: leave it out"
    try:
        return make_label(cat, failure_type, action), None
    except ValueError as e:
        return None, str(e)


def _cordon_problem(label: Label | None) -> str | None:
    """Only a hardware type (taxonomy.yaml `hardware: true`) may take a node out: a cordon on any other
    type would drain healthy machines for a software fault."""
    if label is not None and label.action is Action.CORDON_AND_RESTART and not is_hardware(label.failure_type):
        return (f"action {Action.CORDON_AND_RESTART} on {label.failure_type}, which the taxonomy does not mark "
                f"hardware: only hardware types may cordon a node (logdx/taxonomy.yaml `hardware: true`)")
    return None


def _by_origin_labels(spec: RuleSpec, where: Callable[..., str], problems: list[str]) -> dict[str, Label | None]:
    """The labels of a rule whose verdict depends on whose code raised (user or library)."""
    from logdx.diagnose.rules.spec import LabelSpec

    assert spec.by_origin is not None
    if spec.category is not None or spec.failure_type is not None or spec.action is not None:
        problems.append(f"{where('by_origin')}: give either category/failure_type/action or by_origin, not both")
    by_origin: dict[str, Label | None] = {}
    for which in ("user", "library"):
        ls: LabelSpec | str = getattr(spec.by_origin, which)
        if ls == "owner":
            by_origin[which] = None
            continue
        assert isinstance(ls, LabelSpec)
        lab, err = _make_label(ls.category, ls.failure_type, ls.action)
        cordon = _cordon_problem(lab)
        if err:
            problems.append(f"{where('by_origin', which, 'failure_type')}: {err}")
        elif cordon:
            problems.append(f"{where('by_origin', which, 'action')}: {cordon}")
        elif lab is not None:
            by_origin[which] = lab
    if not spec.match.exceptions and spec.match.kinds != [EventKind.TRACEBACK]:
        problems.append(f"{where('by_origin')}: by_origin needs match.exceptions (or kinds: [traceback])")
    return by_origin


def _rule_label(spec: RuleSpec, where: Callable[..., str], problems: list[str]) -> Label | None:
    if spec.category is None:
        problems.append(f"{where()}: missing field 'category' (or by_origin)")
    if spec.failure_type is None:
        problems.append(f"{where()}: missing field 'failure_type' (or by_origin)")
    if spec.category is None or spec.failure_type is None:
        return None
    label, err = _make_label(spec.category, spec.failure_type, spec.action)
    cordon = _cordon_problem(label)
    if err:
        problems.append(f"{where('failure_type')}: {err}")
    elif cordon:
        problems.append(f"{where('action')}: {cordon}")
        return None
    return label


def _match_regexes(m: MatchSpec, where: Callable[..., str], problems: list[str]) -> tuple[list[re.Pattern[str]], list[re.Pattern[str]]]:
    """The compiled `patterns` and `unless` of a rule's match (bad ones are problems)."""
    if not m.patterns and not m.exceptions and not m.kinds:
        problems.append(f"{where('match')}: match needs patterns, exceptions or kinds")
    patterns = []
    for i, src in enumerate(m.patterns):
        pat = _compile_regex(src, where("match", "patterns", i), problems)
        if pat is not None and pattern_problem(src):
            problems.append(f"{where('match', 'patterns', i)}: {pattern_problem(src)} in {src!r}")
        elif pat is not None:
            patterns.append(pat)
    unless = [u for i, src in enumerate(m.unless) if (u := _compile_regex(src, where("match", "unless", i), problems))]
    return patterns, unless


def _check_match_names(m: MatchSpec, where: Callable[..., str], problems: list[str]) -> None:
    """Event kinds and exception names a match lists exist (or look like exception types)."""
    for i, k in enumerate(m.kinds or []):
        if k not in KNOWN_KINDS:
            problems.append(f"{where('match', 'kinds', i)}: unknown event kind '{k}' (known: {', '.join(sorted(KNOWN_KINDS))})")
    for i, e in enumerate(m.exceptions or []):
        if e not in EXCEPTION_MARKERS and not re.fullmatch(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*", e):
            problems.append(f"{where('match', 'exceptions', i)}: not an exception type name: {e!r}")


def _compile_rule(
    spec: RuleSpec, pack: str, shown: str, lines: _Lines, rpath: tuple[Any, ...], order: int, problems: list[str]
) -> Rule | None:
    n_before = len(problems)

    def where(*sub: Any) -> str:
        return f"{shown}:{lines.line((*rpath, *sub))}: rule '{spec.id}'"

    label: Label | None = None
    by_origin: dict[str, Label | None] | None = None
    if spec.by_origin is not None:
        by_origin = _by_origin_labels(spec, where, problems)
    else:
        label = _rule_label(spec, where, problems)
    m = spec.match
    patterns, unless = _match_regexes(m, where, problems)
    _check_match_names(m, where, problems)
    cleared = [c for i, src in enumerate(spec.cleared_by) if (c := _compile_regex(src, where("cleared_by", i), problems))]
    hint_err = hint_problem(spec.hint)
    if hint_err:
        problems.append(f"{where('hint')}: {hint_err}")
    refines = tuple(dict.fromkeys(spec.refines))
    if len(refines) < len(spec.refines):
        problems.append(f"{where('refines')}: names a rule twice")
    if len(problems) > n_before:
        return None
    return Rule(
        id=spec.id,
        pack=pack,
        title=spec.title,
        role=Role(spec.role),
        severity=spec.severity,
        confidence=float(spec.confidence),
        label=label,
        by_origin=by_origin,
        patterns=tuple(patterns),
        kinds=tuple(EventKind(k) for k in m.kinds) if m.kinds is not None else None,
        exceptions=frozenset(m.exceptions) if m.exceptions is not None else None,
        unless=tuple(unless),
        cleared_by=tuple(cleared),
        hint=spec.hint,
        examples=tuple(e if isinstance(e, str) else e.text for e in spec.examples),
        example_expects=_example_expects(spec),
        refines=refines,
        counterexamples=tuple(spec.counterexamples),
        file=shown,
        line=lines.line(rpath),
        order=order,
        literals=rule_literals(m.patterns),
        example_lines=tuple(lines.line((*rpath, "examples", i)) for i in range(len(spec.examples))),
        counterexample_lines=tuple(
            lines.line((*rpath, "counterexamples", i)) for i in range(len(spec.counterexamples))
        ),
    )


def _example_expects(spec: RuleSpec) -> tuple[ExampleExpect | None, ...]:
    """What each example written as a mapping expects of the hit (None: a plain line, it must only match)."""
    out: list[ExampleExpect | None] = []
    for e in spec.examples:
        if isinstance(e, str) or (e.hint is None and e.culprit is None):
            out.append(None)
            continue
        c = e.culprit
        out.append(ExampleExpect(hint=e.hint, host=c.host if c else None, rank=c.rank if c else None,
                                 gpu=c.gpu if c else None))
    return tuple(out) if any(x is not None for x in out) else ()


def _display(path: Path) -> str:
    """rules/gpu.yaml rather than /work/main/rules/gpu.yaml when under the working directory."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def hint_problem(template: str) -> str | None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"bad hint template: {exc}"
    for f in fields:
        if not f.isidentifier():
            return f"hint field {{{f}}} must be a plain name like {{host}}"
    return None

