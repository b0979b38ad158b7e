"""One vocabulary: a category, an action or a failure type is named by the taxonomy and the enums of
`logdx.model`, never spelled again as a string in the package (issue 23).

The scan reads every module's string constants (`ast`; docstrings are prose and skipped). A value that
is also a common word (`none`, `unknown`, `restart`, ...) is only taken for the vocabulary where it
can only be that: compared with something named category/action/failure_type, or listed with another
value of the vocabulary (a tuple, a set, a `Literal[...]`, the keys of a dict).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from logdx.model import FT, Action, Category, EventKind, Severity
from logdx.taxonomy import load_taxonomy, taxonomy

PACKAGE = Path(__file__).resolve().parents[1] / "service" / "logdx"
# Where the vocabulary is declared: the only places its values are written.
DECLARED_IN = {PACKAGE / "model.py", PACKAGE / "taxonomy.py"}
# Values that are also ordinary words (a settings value "none", an "unknown" placeholder, the audit's
# "restart" step, a checkpoint's "framework" field, the word "hang" in a list of error words).
COMMON_WORDS = frozenset({"none", "unknown", "restart", "script", "framework", "hang"})
_NAMED_LIKE_A_LABEL = ("category", "action", "failure_type")


def vocabulary() -> frozenset[str]:
    return frozenset({c.value for c in Category} | {a.value for a in Action} | set(taxonomy().types))


@dataclass(frozen=True)
class Spelled:
    path: str
    line: int
    value: str


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _names_a_label(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lower().endswith(_NAMED_LIKE_A_LABEL)


def _in_context(tree: ast.AST, vocab: frozenset[str]) -> set[int]:
    """The constants that can only be the vocabulary: compared with a label's field, or listed with
    another of its values."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_a_label(n) for n in [node.left, *node.comparators]):
            out.update(id(c) for n in [node.left, *node.comparators] for c in ast.walk(n)
                       if isinstance(c, ast.Constant) and c.value in vocab)
        items: list[ast.expr | None] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        consts = [c for c in items if isinstance(c, ast.Constant) and c.value in vocab]
        if len(consts) >= 2:
            out.update(id(c) for c in consts)
    return out


def spelled_values(root: Path = PACKAGE, vocab: frozenset[str] | None = None) -> list[Spelled]:
    vocab = vocab or vocabulary()
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in DECLARED_IN:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip, context = _docstrings(tree), _in_context(tree, vocab)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or node.value not in vocab:
                continue
            if id(node) in skip or (node.value in COMMON_WORDS and id(node) not in context):
                continue
            found.append(Spelled(str(path.relative_to(root.parent)), node.lineno, node.value))
    return found


def test_no_taxonomy_value_is_spelled_outside_the_taxonomy_and_the_enums() -> None:
    spelled = spelled_values()
    assert not spelled, "use the enums of logdx.model (Category, Action, FT) or the taxonomy:\n" + "\n".join(
        f"{s.path}:{s.line}: {s.value!r}" for s in spelled)


@pytest.mark.parametrize("source, expected", [
    ('if report.action == "cordon_and_restart":\n    pass\n', ["cordon_and_restart"]),
    ('LABEL = ("framework", "nan_loss", "no_restart")\n', ["framework", "nan_loss", "no_restart"]),
    ('ok = category == "script"\n', ["script"]),
    ('A = Literal["infrastructure", "framework", "script", "unknown"]\n',
     ["infrastructure", "framework", "script", "unknown"]),
    ('def f() -> None:\n    """A hang_label for the gpu_fell_off_bus case."""\n', []),
    ('choice = mode or "none"\nwords = ("hang", "stuck")\nstep = ("restart", "stop")\n', []),
])
def test_the_scan_finds_spelled_values_and_spares_prose(tmp_path: Path, source: str, expected: list[str]) -> None:
    (tmp_path / "mod.py").write_text(source, encoding="utf-8")
    assert sorted(s.value for s in spelled_values(tmp_path)) == sorted(expected)


def test_every_failure_type_the_code_names_is_declared_in_the_taxonomy(tmp_path: Path) -> None:
    assert {ft.value for ft in FT} <= set(taxonomy().types)
    text = (PACKAGE / "taxonomy.yaml").read_text(encoding="utf-8")
    without_hang = tmp_path / "taxonomy.yaml"
    without_hang.write_text("\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("hang:")
                                      and "title: \"the job hung: a rank stopped" not in ln), encoding="utf-8")
    with pytest.raises(ValueError, match="hang is missing"):
        load_taxonomy(without_hang)


def test_severity_order_is_the_order_of_the_enum() -> None:
    assert [s.rank for s in Severity] == list(range(len(Severity)))
    assert sorted(Severity, key=lambda s: s.rank)[0] is Severity.CRITICAL


def test_rule_kinds_are_the_event_kinds() -> None:
    from logdx.diagnose.rules import KNOWN_KINDS

    assert {k.value for k in EventKind} == KNOWN_KINDS


def _rendered_prompts() -> tuple[str, str]:
    """The chat backend's system message and the embedded scorer's prompt, rendered by the code paths the
    backends use (no model, no server)."""
    from logdx.config import LLMSettings
    from logdx.diagnose.llm.embedded import EmbeddedScorer
    from logdx.diagnose.llm.openai import OpenAICompatibleClient
    from logdx.diagnose.llm.prompts import Prompts
    from logdx.model import FailureContext

    ctx = FailureContext(root_text="[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
                         root_masked="", templates=[], excerpt=[], exception_type="RuntimeError")
    prompts, settings = Prompts(), LLMSettings()
    client = OpenAICompatibleClient(settings, prompts)
    try:
        system = client.messages(ctx)[0]["content"]
    finally:
        client.close()
    return system, EmbeddedScorer(settings, prompts).build_prompt(ctx, [])


def test_prompts_take_the_words_of_actions_and_categories_from_the_taxonomy(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts_dir = PACKAGE.parents[1] / "prompts"
    sources = "".join(p.read_text(encoding="utf-8") for p in sorted(prompts_dir.rglob("*.j2")))
    meanings = taxonomy().action_meanings
    system, scorer = _rendered_prompts()
    for action in (Action.CORDON_AND_RESTART, Action.RESTART, Action.NO_RESTART):
        assert f'"{action.value}" ({meanings[action]})' in system
        assert meanings[action] not in sources  # passed in, never typed in a template
    for category in (Category.INFRASTRUCTURE, Category.FRAMEWORK, Category.SCRIPT):
        assert taxonomy().category_titles[category] in scorer
        assert taxonomy().category_titles[category] not in sources
    # A word changed in the taxonomy is the word the model reads.
    monkeypatch.setitem(meanings, Action.RESTART, "a meaning only this test gives")
    monkeypatch.setitem(taxonomy().category_titles, Category.SCRIPT, "script: a title only this test gives")
    system, scorer = _rendered_prompts()
    assert '"restart" (a meaning only this test gives)' in system
    assert "script: a title only this test gives" in scorer
