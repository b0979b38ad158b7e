"""YAML that someone else wrote (rule packs, the taxonomy, config files), loaded without trusting it.

PyYAML's safe loader builds no arbitrary objects, but two shapes still hurt. An alias bomb ("billion
laughs": nine levels of nine aliases) composes quickly into shared nodes, then hangs whoever walks
the result (the rule loader's line index, pydantic). Nesting tens of thousands of levels deep
overflows the C composer's stack: a segfault, not an exception. So the document's events are read
first, iteratively, and it is refused past the limits below before any node is built; the error
names the file and the line.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_ALIASES", "MAX_DEPTH", "MAX_NODES", "YamlError", "compose", "load", "load_with_nodes"]

MAX_DEPTH = 64  # nested mappings and sequences; the deepest shipped file has 5
MAX_ALIASES = 1_000  # `*name` references in one document
MAX_NODES = 1_000_000  # nodes once every alias is expanded; the largest shipped pack has ~1,100

_Loader: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlError(ValueError):
    """Not YAML, or YAML past a limit. `str()` is one line: `source:line: problem`.

    `kind` says which: "syntax" (PyYAML could not read it), "depth", "aliases", "recursive_alias",
    "nodes" (past a limit of ours), "documents" (more than one)."""

    def __init__(self, source: str, line: int | None, problem: str, kind: str = "syntax") -> None:
        super().__init__(f"{source}:{line}: {problem}" if line else f"{source}: {problem}")
        self.source = source
        self.line = line
        self.problem = problem
        self.kind = kind


def load(text: str, source: str) -> Any:
    """The data of a one-document YAML text (None when empty), or YamlError."""
    return load_with_nodes(text, source)[1]


def compose(text: str, source: str) -> yaml.Node | None:
    """The node tree of a one-document YAML text, checked against the limits."""
    return load_with_nodes(text, source)[0]


def load_with_nodes(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """Node tree (for line numbers) and data, from one parse once the text passed the checks."""
    _check_events(text, source)
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        raise _syntax_error(e, source) from None
    finally:
        loader.dispose()
    return root, data


def _check_events(text: str, source: str) -> None:
    """Depth, alias count and expanded size, counted on the event stream (no recursion, no tree).

    libyaml reads up to 1,024 characters ahead of the event it hands out, and newer releases stop
    past a nesting depth of their own there: "[[[[..." fails in its scanner before our depth check
    sees the 65th level. So a syntax error from libyaml is checked again with PyYAML's pure-Python
    parser, which reads ahead too but has no such limit: our limits then speak first, whatever the
    libyaml release."""
    try:
        _walk_events(text, source, _Loader)
    except YamlError as e:
        if e.kind != "syntax" or _Loader is yaml.SafeLoader:
            raise
        _walk_events(text, source, yaml.SafeLoader)
        raise


def _walk_events(text: str, source: str, loader_class: type[Any]) -> None:
    expanded = 0
    aliases = 0
    anchors: dict[str | None, int] = {}  # anchor -> expanded size of the node it names (the stubs let an anchor be None)
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, `expanded` when it opened)
    documents = 0
    loader = loader_class(text)
    try:
        while loader.check_event():
            ev = loader.get_event()
            line = ev.start_mark.line + 1 if ev.start_mark is not None else None
            if isinstance(ev, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise YamlError(source, line, "more than one YAML document ('---' starts another); "
                                                  "one is expected", "documents")
            elif isinstance(ev, yaml.CollectionStartEvent):
                if len(open_nodes) >= MAX_DEPTH:
                    raise YamlError(source, line, f"nested more than {MAX_DEPTH} levels deep", "depth")
                open_nodes.append((ev.anchor, expanded))
                expanded += 1
            elif isinstance(ev, yaml.CollectionEndEvent):
                anchor, start = open_nodes.pop()
                if anchor is not None:
                    anchors[anchor] = expanded - start
            elif isinstance(ev, yaml.ScalarEvent):
                expanded += 1
                if ev.anchor is not None:
                    anchors[ev.anchor] = 1
            elif isinstance(ev, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    raise YamlError(source, line, f"more than {MAX_ALIASES} aliases", "aliases")
                if any(anchor == ev.anchor for anchor, _ in open_nodes):
                    raise YamlError(source, line, f"alias *{ev.anchor} refers to a node that contains it",
                                    "recursive_alias")
                expanded += anchors.get(ev.anchor, 1)  # an unknown anchor: the composer names it
            if expanded > MAX_NODES:
                raise YamlError(source, line, f"more than {MAX_NODES:,} nodes once aliases are expanded "
                                              "(an alias bomb?)", "nodes")
    except yaml.YAMLError as e:
        raise _syntax_error(e, source) from None
    finally:
        loader.dispose()


def _syntax_error(e: yaml.YAMLError, source: str) -> YamlError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"{context}: " if context else ""
    return YamlError(source, mark.line + 1 if mark is not None else None, f"invalid YAML: {where}{problem}")
