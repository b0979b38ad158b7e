"""Drafting rules for what no rule names (`logdx rules draft`, `logdx rules approve`).

A job is diagnosed with rules and the catalog only. When its root line was decided by a generic fallback,
the catalog or no rule at all, the line's Drain template becomes a candidate rule: a regex (the template's
literal words escaped, each `<*>` a bounded non-greedy class), a label proposed from the stages that are not
rules (the catalog, the taxonomy's owner of the exception's module, else `script_error`), the job's raw lines
as the rule's examples and as the pack's raw-input test. Before it is written the pattern is run over
generated healthy runs, the job's other templates and every shipped rule's counterexamples: a pattern that
hits one is tightened (slots narrowed to what the job's values look like, the end anchored), or dropped.

The pack is written in the shipped packs' format; what is a proposal is said in `# proposed:` comments (the
loader refuses unknown keys), which `approve` removes once the pack loads and its tests pass.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from logdx.config import Settings
from logdx.diagnose.rules import Rule, RuleError, RuleSet, check_examples, default_rules_dir, example_hits, load_rules
from logdx.diagnose.rules.compiled import RuleHit
from logdx.diagnose.rules.precedence import overlaps
from logdx.model import FT, Category, FailureContext, Label, Role
from logdx.normalize import InputError, Normalizer, iter_lines, open_input
from logdx.pipeline import Engine
from logdx.taxonomy import advice_of, category_of, default_action, owner_of, title_of

SLOT = "<*>"
PROPOSED_MARK = "# proposed:"
_SLOT_MAX = 256  # a slot's value is bounded: no pattern scans a whole long line for one
_MIN_LITERAL_LETTERS = 8  # a template with fewer constant letters would match unrelated lines
_CATALOG_MIN_SCORE = 0.8  # a catalog match this good names the label; below it is only a near miss
_DRAFT_CONFIDENCE = 0.6  # a proposal: a precise rule but not yet a trusted one
# The healthy runs a pattern must not hit: (flavour, style) pairs of `logdx synth --scenario healthy`.
_HEALTHY_RUNS: tuple[tuple[str, str], ...] = (
    ("plain", "torchrun"), ("deepspeed", "pdsh"), ("fsdp", "srun_torchrun"), ("hf", "torchrun_tee"),
    ("lightning", "srun"), ("megatron", "mpirun"), ("nemo", "pdsh_torchrun"),
)
_HEALTHY_LINES = 3000
_HEALTHY_RANKS = 16


class DraftError(ValueError):
    """Nothing to draft (or the input cannot be read): one line for the user."""


@dataclass
class DraftedRule:
    id: str
    title: str
    template: str
    pattern: str
    label: Label
    basis: str  # where the label was proposed from
    examples: list[str]
    root_raw: str
    tightened: str | None = None  # why the pattern was tightened (what its loose form hit)


@dataclass
class Draft:
    pack: str
    job: str
    rules: list[DraftedRule]
    test_lines: list[str]
    test_root: int  # 1-based, into test_lines
    notes: list[str] = field(default_factory=list)  # what was tightened or dropped, and why
    checked: str = ""  # what the pattern was run against
    path: Path | None = None

    def to_yaml(self) -> str:
        return render_pack(self)


# -- diagnosing the job ---------------------------------------------------------------------------------


@dataclass
class _Diagnosed:
    context: FailureContext
    root_line_no: int
    root_raw: str
    root_rules: list[str]  # the rules whose evidence is the root line
    decided_by: str
    templates: list[tuple[str, str]]  # (template, sample) of every template of the job
    unnamed_errors: list[str]  # error-bearing templates whose sample no rule pattern occurs in


def _diagnose(path: Path, settings: Settings, ruleset: RuleSet, exit_code: int | None) -> _Diagnosed:
    engine = Engine.for_rules(settings, ruleset)
    session = engine.new_session()
    try:
        with open_input(path) as f:
            session.feed_lines(iter_lines(f, settings.input.max_line_bytes))
    except InputError as e:
        raise DraftError(str(e)) from None
    except (OSError, EOFError, ValueError) as e:  # a truncated .gz, a folder
        raise DraftError(f"{path}: cannot read ({e})") from None
    report = session.report(exit_code)
    ctx = session.last_context
    if report.status != "failed" or report.root_cause is None or ctx is None or not ctx.root_message:
        known = " (give --exit-code N when you know how it ended)" if report.status == "unknown" else ""
        raise DraftError(f"{path}: the job did not fail on an error line (status {report.status}): "
                         f"nothing to draft{known}")
    root_no = report.root_cause.line_no
    rules_on_root = [e.source.removeprefix("rule:") for e in report.evidence
                     if e.line_no == root_no and e.source.startswith("rule:")]
    return _Diagnosed(context=ctx, root_line_no=root_no, root_raw=report.root_cause.text,
                      root_rules=rules_on_root, decided_by=report.decided_by,
                      templates=[(t.template, t.sample) for t in session.templates()],
                      unnamed_errors=[t.template for t in session.templates()  # the root's own lines aside
                                      if t.error_bearing and t.sample not in ctx.excerpt
                                      and not ruleset.could_match(t.sample)])


# -- the pattern ------------------------------------------------------------------------------------------


def _literal(piece: str) -> str:
    """A template's constant text as regex: each word escaped, each run of blanks any blanks."""
    return "".join(r"\s+" if part.isspace() else re.escape(part) for part in re.split(r"(\s+)", piece) if part)


def _slot_class(value: str | None, wide: bool = False) -> str:
    """A slot as a bounded non-greedy class: any non-blank run (`wide`: any run, for a slot Drain made of
    words and blanks), or (tight) the shape the job's value had."""
    n = _SLOT_MAX
    if value is None:
        return rf".{{1,{n}}}?" if wide else rf"\S{{1,{n}}}?"
    if re.search(r"\s", value):
        return rf".{{1,{n}}}?"
    if value.isdigit():
        return rf"\d{{1,{max(len(value) * 2, 8)}}}"
    if re.fullmatch(r"0x[0-9a-fA-F]+|[0-9a-fA-F]{6,}", value):
        return rf"(?:0x)?[0-9a-fA-F]{{1,{n}}}"
    if value.startswith("/"):
        return rf"/\S{{0,{n}}}?"
    if re.fullmatch(r"[\w.-]+", value):
        return rf"[\w.-]{{1,{n}}}?"
    return rf"\S{{1,{n}}}?"


_QUALIFIED_EXCEPTION = re.compile(r"((?:[A-Za-z_]\w*\.)+)[A-Za-z_]\w*(?::|$)")


def template_regex(template: str, values: Sequence[str] | None = None, *, wide: bool = False) -> str:
    """The regex of a Drain template. `values`: the job's value of each slot, to narrow each slot to its
    shape and anchor the end (the tight form); without, every slot is any bounded non-blank run."""
    pieces = template.strip().split(SLOT)
    out: list[str] = []
    first = pieces[0]
    if first[:1].isalnum() or first[:1] == "_":
        out.append(r"\b")
    qualified = _QUALIFIED_EXCEPTION.match(first)
    if qualified:  # `pkg.mod.SomeError:` is also printed as `SomeError:` (or from another module path)
        out.append(r"(?:\w+\.){0,8}")
        pieces[0] = first[qualified.end(1):]
    for i, piece in enumerate(pieces):
        out.append(_literal(piece))
        if i < len(pieces) - 1:
            out.append(_slot_class(values[i] if values is not None else None, wide))
    if values is not None:
        out.append(r"\s*$")
    return "".join(out)


def slot_values(template: str, text: str) -> list[str] | None:
    """What each slot of the template held in this line (None when the template does not fit it)."""
    pieces = template.strip().split(SLOT)
    rx = "".join(_literal(p) + ("(.+?)" if i < len(pieces) - 1 else "") for i, p in enumerate(pieces))
    m = re.search(rx + r"\s*$", text)
    return list(m.groups()) if m else None


def literal_letters(template: str) -> int:
    return sum(ch.isalpha() for ch in template.replace(SLOT, ""))


# -- the label ---------------------------------------------------------------------------------------------


def propose_label(ctx: FailureContext) -> tuple[Label, str]:
    """The label the stages that are not rules give the root line, and which one gave it."""
    from logdx.diagnose.catalog_stage import match as catalog_match

    for hit in catalog_match(ctx.root_message or ctx.root_text, ctx.exception_type, 3):
        cat = category_of(hit.entry.failure_type)
        if cat is not None and hit.score >= _CATALOG_MIN_SCORE:
            return (Label(cat, hit.entry.failure_type, default_action(cat, hit.entry.failure_type)),
                    f"the error catalog ({hit.entry.id}, score {hit.score:.2f})")
    exc = ctx.exception_type or ""
    if "." in exc:
        ft = owner_of(exc.rsplit(".", 1)[0])
        cat = category_of(ft) if ft else None
        if ft and cat is not None:
            return Label(cat, ft, default_action(cat, ft)), f"the taxonomy's owner of {exc.rsplit('.', 1)[0]}"
    ft = FT.SCRIPT_ERROR
    cat = category_of(ft) or Category.SCRIPT
    return Label(cat, ft, default_action(cat, ft)), "no catalog entry or owner names it: an error of the job's own code"


# -- the healthy check -------------------------------------------------------------------------------------


def healthy_texts() -> list[str]:
    """The distinct lines (message and raw) of generated healthy runs of several frameworks and launchers."""
    from logdx.synth.generate import generate

    seen: set[str] = set()
    norm = Normalizer()
    for seed, (flavour, style) in enumerate(_HEALTHY_RUNS):
        buf = io.StringIO()
        generate(buf, scenario="healthy", seed=seed, ranks=_HEALTHY_RANKS, lines=_HEALTHY_LINES, style=style,
                 flavour=flavour, noise=1.0)
        for raw in buf.getvalue().splitlines():
            seen.add(raw)
            seen.add(norm.normalize(raw).text)
    return sorted(seen)


def other_rules_lines(ruleset: RuleSet) -> list[str]:
    """Every loaded rule's counterexamples, and the examples of the rules that are not generic fallbacks: a
    drafted pattern that hits one overlaps a rule that exists (or a line its author said is no error)."""
    return [*(c for r in ruleset.rules for c in r.counterexamples),
            *(e for r in ruleset.rules if r.role is not Role.FALLBACK for e in r.examples)]


def first_hit(pattern: str, texts: Iterable[str]) -> str | None:
    rx = re.compile(pattern)
    return next((t for t in texts if rx.search(t)), None)


def guarded_pattern(template: str, text: str, guard: Sequence[str]) -> tuple[str, str | None]:
    """The template's pattern, and why it was tightened (None: it was not): loose when it hits no guard line,
    else narrowed to the shape of the job's values with the end anchored. DraftError when the template does
    not fit its own line, or even the tight form hits a guard line (the rule is dropped)."""
    loose = next((p for p in (template_regex(template), template_regex(template, wide=True)) if re.search(p, text)),
                 None)
    if loose is None:
        raise DraftError(f"the root line's template {template!r} does not fit its own line")
    hit = first_hit(loose, guard)
    if hit is None:
        return loose, None
    values = slot_values(template, text)
    tight = template_regex(template, values) if values is not None else None
    still = first_hit(tight, guard) if tight is not None and re.search(tight, text) else hit
    if tight is None or still is not None:
        raise DraftError(f"the pattern drawn from {template!r} also hits a healthy or unrelated line "
                         f"({(still or hit)[:120]!r}), tightened or not: dropped, nothing to draft")
    return tight, f"its loose form also hit {hit[:120]!r}"


# -- drafting ----------------------------------------------------------------------------------------------


def _slug(text: str, limit: int = 40) -> str:
    words = re.findall(r"[a-z0-9]+", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1-\2", re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", text)).lower())
    slug = ""
    for w in words:  # whole words only, up to the limit
        if slug and len(slug) + 1 + len(w) > limit:
            break
        slug = f"{slug}-{w}" if slug else w[:limit]
    return slug or "error"


def _rule_id(ctx: FailureContext, template: str, taken: set[str]) -> str:
    short = _QUALIFIED_EXCEPTION.sub(lambda m: m.group(0)[len(m.group(1)):], template.strip(), count=1)
    words = [w for w in short.replace(SLOT, " ").split() if re.search(r"[A-Za-z]", w)]
    base = "draft-" + _slug(" ".join(words[:5]))
    rid, n = base, 2
    while rid in taken:
        rid, n = f"{base}-{n}", n + 1
    return rid


def _title(template: str) -> str:
    return re.sub(r"\s+", " ", template.replace(SLOT, "…")).strip()[:120]


def _naming_rule(d: _Diagnosed, ruleset: RuleSet) -> str | None:
    """The rule that names the root line already: a precise one, or a symptom (an echo is no cause to write a
    root-cause rule for). None when only a generic fallback, the catalog or no rule decided it."""
    for rid in d.root_rules:
        rule = ruleset.by_id.get(rid)
        if rule is not None and rule.role is not Role.FALLBACK:
            return rid
    return None


def draft(path: Path, settings: Settings, extra_dirs: Sequence[Path] = (), healthy: Sequence[str] | None = None,
          exit_code: int | None = None) -> Draft:
    """The candidate pack for the job's unnamed root template. Raises DraftError when there is nothing to
    draft (a healthy job, a root line a precise rule already names, a template too generic to be a rule).
    `exit_code`: how the job ended, when known (as `diagnose --exit-code`)."""
    try:
        ruleset = load_rules([default_rules_dir(), *settings.rules.dirs, *extra_dirs])
    except RuleError as e:
        raise DraftError(str(e).splitlines()[0]) from None
    d = _diagnose(path, settings, ruleset, exit_code)
    named = _naming_rule(d, ruleset)
    if named is not None:
        role = ruleset.by_id[named].role.value.replace("_", " ")
        raise DraftError(f"{path}: the root line {d.root_line_no} is named by rule '{named}' ({role}) already: "
                         "nothing to draft")
    ctx = d.context
    template, text = ctx.root_masked.strip(), ctx.root_message
    if literal_letters(template) < _MIN_LITERAL_LETTERS or template.startswith("Traceback (most recent call"):
        raise DraftError(f"{path}: the root line's template {template!r} is too generic to be a rule")
    label, basis = propose_label(ctx)
    others = [s for t, s in d.templates if t.strip() != template]
    healthy_lines = list(healthy) if healthy is not None else healthy_texts()
    counter = other_rules_lines(ruleset)
    checked = (f"{len(healthy_lines)} distinct lines of {len(_HEALTHY_RUNS)} generated healthy runs, "
               f"{len(counter)} examples and counterexamples of the loaded rules, the job's {len(others)} other "
               "templates")
    try:
        pattern, tightened = guarded_pattern(template, text, [*healthy_lines, *counter, *others])
    except DraftError as e:
        raise DraftError(f"{path}: {e}") from None
    notes = [f"tightened the pattern of {template!r}: {tightened}"] if tightened else []
    rest = [t for t in d.unnamed_errors if t.strip() != template]
    if rest:
        shown = "; ".join(repr(t[:80]) for t in rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
        notes.append(f"not drafted (not the root line): {len(rest)} other error template(s) no rule names: {shown}")
    rid = _rule_id(ctx, template, set(ruleset.by_id))
    examples = list(dict.fromkeys([d.root_raw, text]))
    rule = DraftedRule(id=rid, title=_title(template), template=template, pattern=pattern, label=label, basis=basis,
                       examples=examples, root_raw=d.root_raw, tightened=tightened)
    lines = list(ctx.excerpt) if d.root_raw in ctx.excerpt else [d.root_raw]
    return Draft(pack=rid.replace("draft-", "drafted-", 1), job=str(path), rules=[rule], test_lines=lines,
                 test_root=lines.index(d.root_raw) + 1, notes=notes, checked=checked)


# -- the pack file -----------------------------------------------------------------------------------------


def _q(s: str) -> str:
    """A YAML scalar that reads back as s: single-quoted (backslashes stay literal), else JSON-quoted."""
    out = "'" + s.replace("'", "''") + "'"
    try:
        if yaml.safe_load(out) == s:
            return out
    except yaml.YAMLError:
        pass
    return json.dumps(s, ensure_ascii=False)


def _hint(label: Label) -> str:
    """Plain wording from the taxonomy: what the proposed type is and what its action says to do."""
    advice = advice_of(label.action, label.failure_type)
    return (f"Drafted from a job, proposed as {title_of(label.failure_type)}: read the lines around it; "
            f"{advice} (review this hint when approving).")


def render_pack(d: Draft) -> str:
    out = [f"{PROPOSED_MARK} drafted by `logdx rules draft` from {d.job}; review, then `logdx rules approve`",
           f"pack: {d.pack}",
           "description: >",
           "  Drafted from a job whose root line no rule named: one rule per unnamed root template.",
           "",
           "rules:"]
    for r in d.rules:
        lab = r.label
        out += [f"  {PROPOSED_MARK} {lab.category.value} / {lab.failure_type} / {lab.action.value}, from {r.basis}",
                f"  {PROPOSED_MARK} Drain template {r.template!r}"]
        if r.tightened:
            out.append(f"  {PROPOSED_MARK} pattern tightened: {r.tightened}")
        out += [f"  - id: {r.id}",
                f"    title: {_q(r.title)}",
                "    role: root_cause",
                f"    category: {lab.category.value}",
                f"    failure_type: {lab.failure_type}",
                "    severity: medium",
                f"    confidence: {_DRAFT_CONFIDENCE}",
                "    match:",
                "      patterns:",
                f"        - {_q(r.pattern)}",
                f"    hint: {_q(_hint(lab))}",
                "    examples:",
                *(f"      - {_q(e)}" for e in r.examples)]
    out += ["", "tests:"]
    for r in d.rules:
        out += [f"  - name: {_q('the job the rule was drafted from: its root line, raw')}",
                "    lines:",
                *(f"      - {_q(ln)}" for ln in d.test_lines),
                "    events:",
                f"      - {{rule: {r.id}, line: {d.test_root}}}",
                f"    verdict: {{category: {r.label.category.value}, failure_type: {r.label.failure_type}, "
                f"root_line: {d.test_root}}}"]
    return "\n".join(out) + "\n"


def pack_problems(pack: Path, settings: Settings) -> list[str]:
    """What is wrong with a pack loaded beside the shipped and configured ones: load errors, examples and
    counterexamples, its own raw-input tests through the real pipeline, and a rule of it that overlaps
    another rule without saying which refines which (what `logdx rules test` checks): a drafted rule
    approved without that would silently compete with a rule that exists."""
    from logdx.explain import run_pack_tests

    try:
        # The pack's own folder may be a configured one (a draft written into rules.dirs): loaded once.
        dirs = [x for x in settings.rules.dirs if Path(x).resolve() != pack.resolve().parent]
        ruleset = load_rules([default_rules_dir(), *dirs, pack], verify=False)
    except RuleError as e:
        return e.problems
    mine = pack.resolve()
    problems = [f"{r.where()}: {what}" for r in ruleset.rules if Path(r.file).resolve() == mine
                for what in _rule_problems(r, ruleset)]
    ruleset.tests = [t for t in ruleset.tests if Path(t.file).resolve() == mine]
    hits: list[tuple[str, Sequence[RuleHit]]] = []
    problems += run_pack_tests(settings, ruleset, hits)
    mine_ids = {r.id for r in ruleset.rules if Path(r.file).resolve() == mine}
    found = overlaps([*example_hits(ruleset), *hits], ruleset.by_id, ruleset.outranks)
    problems += [o.problem() for o in found if o.winner.id in mine_ids or o.loser.id in mine_ids]
    return problems


def _rule_problems(rule: Rule, ruleset: RuleSet) -> list[str]:
    one = RuleSet(rules=[rule], origin=ruleset.origin)
    return [p.split(f"rule '{rule.id}': ", 1)[-1] for p in check_examples(one)]


def write_draft(d: Draft, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{d.rules[0].id}.yaml"
    path.write_text(d.to_yaml(), encoding="utf-8")
    d.path = path
    return path


def approved_text(text: str) -> str:
    """The pack without its `# proposed:` marks."""
    return "".join(ln for ln in text.splitlines(keepends=True) if not ln.lstrip().startswith(PROPOSED_MARK))


def approve(draft_path: Path, settings: Settings, into: Path | None) -> Path:
    """Validate a drafted pack with the real loader and its tests, then copy it (marks removed) into the
    user's rules folder. Raises DraftError with the first problem."""
    if not draft_path.is_file():
        raise DraftError(f"{draft_path}: no such file")
    target_dir = into if into is not None else (settings.rules.dirs[0] if settings.rules.dirs else None)
    if target_dir is None:
        raise DraftError("no rules folder to approve into: give --into DIR or set rules.dirs in the config")
    problems = pack_problems(draft_path, settings)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DraftError(f"{draft_path}: {problems[0]}{more}")
    target = Path(target_dir) / draft_path.name
    if target.exists() and target.resolve() != draft_path.resolve():
        raise DraftError(f"{target}: exists already (remove it, or rename the draft)")
    text = approved_text(draft_path.read_text(encoding="utf-8"))
    Path(target_dir).mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    return target
