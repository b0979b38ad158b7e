"""Every registry is the only list (issue 34): an input format, an actuator, an alert destination declares its
own name, and nothing else in `service/logdx` spells it as a string. The CLI choices, the API's enumerations,
the settings sections and their reference are read from the registries (`formats.FORMATS`,
`act.actuators.ACTUATORS`, `act.alerts.destinations.DESTINATIONS`); a name typed elsewhere is a second list
that goes stale.

The scan is `tests/test_vocabulary.py`'s: every module's string constants (`ast`, docstrings skipped). A name
that is also an ordinary word (`text`, `json`, `slack`, `kubernetes`, ...) counts only where it can only be
the registry's: compared with something named like a format, an actuator or a kind, given to a registry
lookup (`section_of`, `by_name`) or a `format=`/`actuator=` argument, or listed with another name of the
same registry.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from logdx import formats
from logdx.act.actuators import ACTUATORS
from logdx.act.alerts.destinations import DESTINATIONS
from logdx.model import FT

PACKAGE = Path(__file__).resolve().parents[1] / "service" / "logdx"
# A string that is some other list's name, not the registry's (the flight recorder's dump formats: json | pickle).
_NOT_THE_REGISTRY = {("flightrec/synth.py", "json")}
_LOOKUPS = frozenset({"section_of", "by_name", "make_actuator"})
_NAMED_LIKE_AN_ENTRY = ("format", "fmt", "actuator", "kind", "destination", "hook")


@dataclass(frozen=True)
class Registry:
    what: str
    names: frozenset[str]
    declared_in: frozenset[Path]  # the modules that declare the names (the entries themselves)


def _module_of(obj: object) -> Path:
    import sys

    return Path(sys.modules[obj.__module__].__file__ or "").resolve()


def registries() -> list[Registry]:
    fmt_modules = {_module_of(f.parser) for f in formats.FORMATS.values()}
    return [
        Registry("input format", frozenset(formats.accepted_names()) - {"auto"},
                 frozenset({*fmt_modules, Path(formats.__file__).resolve()})),
        Registry("actuator", frozenset(ACTUATORS), frozenset(_module_of(c) for c in ACTUATORS.values())),
        Registry("alert destination", frozenset({d.kind for d in DESTINATIONS} | {d.config_key for d in DESTINATIONS}),
                 frozenset(_module_of(d) for d in DESTINATIONS)),
    ]


def _is_word(name: str) -> bool:
    """A name an English text or another field may hold for its own reasons (`text`, `slack`)."""
    return re.fullmatch(r"[a-z]+", name) is not None and name not in {"ndjson", "msgpack", "otlp", "loki",
                                                                       "fluentbit", "jsonl"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _names_an_entry(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lower().endswith(_NAMED_LIKE_AN_ENTRY)


def _consts(node: ast.AST, names: frozenset[str]) -> list[ast.Constant]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]


def _in_context(tree: ast.AST, names: frozenset[str]) -> set[int]:
    """The constants that can only be a registry's name: compared with an entry's name, given to a lookup or
    to a `format=`-like argument, or listed with another name of the registry."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_an_entry(n) for n in [node.left, *node.comparators]):
            out.update(id(c) for n in [node.left, *node.comparators] for c in _consts(n, names))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in _LOOKUPS:
                out.update(id(c) for a in node.args for c in _consts(a, names))
            out.update(id(c) for k in node.keywords if k.arg and k.arg.lower().endswith(_NAMED_LIKE_AN_ENTRY)
                       for c in _consts(k.value, names))
        items: list[ast.expr | None] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        listed = [c for c in items if isinstance(c, ast.Constant) and c.value in names]
        if len({c.value for c in listed}) >= 2:
            out.update(id(c) for c in listed)
    return out


@dataclass(frozen=True)
class Spelled:
    path: str
    line: int
    value: str
    what: str


def spelled_names(root: Path, regs: list[Registry]) -> list[Spelled]:
    found = []
    every = frozenset().union(*(r.names for r in regs))
    # a constant equal to a name is written quoted: a module without one quoted needs no parse
    quoted = re.compile("[\"']({})[\"']".format("|".join(map(re.escape, sorted(every)))))
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not quoted.search(text):
            continue
        tree = ast.parse(text)
        skip = _docstrings(tree)
        for reg in regs:
            if path.resolve() in reg.declared_in:
                continue
            context = _in_context(tree, reg.names)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or node.value not in reg.names:
                    continue
                if id(node) in skip or (_is_word(node.value) and id(node) not in context):
                    continue
                if (path.relative_to(root).as_posix(), node.value) in _NOT_THE_REGISTRY:
                    continue
                found.append(Spelled(str(path.relative_to(root.parent)), node.lineno, node.value, reg.what))
    return found


def test_no_registry_name_is_spelled_outside_its_entry() -> None:
    spelled = spelled_names(PACKAGE, registries())
    assert not spelled, "read the name from its registry entry (FORMATS, ACTUATORS, DESTINATIONS):\n" + "\n".join(
        f"{s.path}:{s.line}: {s.what} {s.value!r}" for s in spelled)


@pytest.mark.parametrize(("source", "expected"), [
    ('auth = Authenticator(s, settings.actions.section_of("kubernetes"))\n', ["kubernetes"]),
    ('if fmt == "text":\n    pass\n', ["text"]),
    ('SHIPPERS = ("ndjson", "otlp")\n', ["ndjson", "otlp"]),
    ('parser = read_file(path, format="loki-json")\n', ["loki-json"]),
    ('KINDS = {"slack": 1, "webhook": 2}\n', ["slack", "webhook"]),
    ('row = {"text": line.text, "host": h}\nmode = "json" if j else "text"\n', []),
    ('def f() -> None:\n    """Reads msgpack from Fluent Bit."""\n', []),
])
def test_the_scan_finds_spelled_names_and_spares_ordinary_words(tmp_path: Path, source: str,
                                                               expected: list[str]) -> None:
    (tmp_path / "mod.py").write_text(source, encoding="utf-8")
    regs = [Registry(r.what, r.names, frozenset()) for r in registries()]
    assert sorted(s.value for s in spelled_names(tmp_path, regs)) == sorted(expected)


def test_every_ft_member_is_named_by_code() -> None:
    """`FT` holds the failure types code reasons about by name (its docstring): a member no module of
    `service/logdx` uses is a list of types kept for nothing."""
    used = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "model.py":
            used |= set(re.findall(r"\bFT\.([A-Z_]+)\b", path.read_text(encoding="utf-8")))
    assert [m.name for m in FT if m.name not in used] == []


# -- formats route by the media types they declare --------------------------------------------------


def test_every_declared_media_type_routes_to_a_format_that_declares_it() -> None:
    for media in sorted(formats.media_types()):
        name, parser = formats.choose(formats.Meta(job="j"), content_type=f"{media}; charset=utf-8")
        declaring = [f.name for f in formats.declaring(media)]
        assert name in declaring or (name == "auto" and len(formats.declaring("application/json")) > 1), (media, name)


def test_a_media_type_no_format_declares_is_refused_even_under_text() -> None:
    for media in ("text/csv", "text/html", "image/png"):
        with pytest.raises(formats.FormatError) as e:
            formats.choose(formats.Meta(job="j"), content_type=media)
        assert e.value.code == "unsupported_media_type" and "text/plain" in str(e.value)


def test_a_new_format_is_routed_by_its_own_media_type(monkeypatch: pytest.MonkeyPatch) -> None:
    widget = formats.Format(name="widget-log", media_types=frozenset({"application/x-widget-log"}),
                            parser=formats.TEXT.parser, description="a widget's log lines")
    monkeypatch.setitem(formats.FORMATS, widget.name, widget)
    assert formats.choose(formats.Meta(job="j"), content_type="application/x-widget-log")[0] == "widget-log"
    assert "widget-log" in formats.accepted_names()
