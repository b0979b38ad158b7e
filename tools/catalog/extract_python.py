"""Raise sites of Python source, read with `ast` (never imported): exception class as written and
resolved through the module's imports, message template with its variable parts as `<*>`.

Also the messages that custom exception classes build for themselves (`super().__init__(f"...")`,
`self.message = ...`, `__str__`), since a raise site like `raise OutOfResources(a, b, "shared")`
shows only the class's own template in the log.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field

from .templates import WILD, Site, format_to_wild, is_informative, printf_to_wild, tidy

_BUILTIN_NAMES = frozenset(dir(builtins))
_MESSAGE_KEYWORDS = ("msg", "message", "detail", "details", "reason", "error_msg", "err_msg", "error_message")
_MESSAGE_ATTRS = ("message", "msg", "_message", "error_message")
_MAX_DEPTH = 8  # how far a message variable is followed through assignments


@dataclass(slots=True)
class Assignment:
    line: int
    value: ast.expr
    augmented: bool  # "name += ...": appends to what the name held


@dataclass(slots=True)
class Scope:
    """Simple assignments of one function (or the module), by name, in source order: how
    `msg = f"..."; raise ValueError(msg)` recovers the message."""

    assignments: dict[str, list[Assignment]] = field(default_factory=dict)
    local_names: set[str] = field(default_factory=set)  # every name bound here: it hides the module's

    @classmethod
    def of(cls, body: list[ast.stmt], args: ast.arguments | None = None) -> Scope:
        scope = cls()
        if args is not None:
            scope.local_names.update(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
            scope.local_names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
        for node in _walk_same_scope(body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                scope.local_names.add(node.id)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                scope._add(node.targets[0].id, Assignment(node.lineno, node.value, False))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                scope._add(node.target.id, Assignment(node.lineno, node.value, False))
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
                scope._add(node.target.id, Assignment(node.lineno, node.value, True))
        return scope

    def _add(self, name: str, assignment: Assignment) -> None:
        self.assignments.setdefault(name, []).append(assignment)

    def value_before(self, name: str, line: int) -> list[Assignment] | None:
        """The last plain assignment to `name` before `line`, then every `+=` after it."""
        chain: list[Assignment] = []
        for a in reversed(self.assignments.get(name, [])):
            if a.line >= line:
                continue
            chain.append(a)
            if not a.augmented:
                return list(reversed(chain))
        return None


def _walk_same_scope(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a body without entering nested functions or classes (they have their own scope)."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


class Imports:
    """Local names bound by import statements, and classes defined in the module: how a class name
    as written becomes a dotted one."""

    def __init__(self, tree: ast.Module, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.names: dict[str, str] = {}
        self.classes: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.names[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.names[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for alias in node.names:
                    if alias.name != "*":
                        self.names[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
            elif isinstance(node, ast.ClassDef):
                self.classes.add(node.name)

    def _absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.package.split(".") if self.package else []
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    def qualify(self, written: str) -> str | None:
        """`errors.OutOfResources` -> `triton.runtime.errors.OutOfResources`; builtins stay bare."""
        head, _, rest = written.partition(".")
        if head in self.names:
            return self.names[head] + (f".{rest}" if rest else "")
        if head in self.classes:
            return f"{self.module}.{written}"
        if head in _BUILTIN_NAMES and not rest:
            return written
        return None


class TemplateRenderer:
    """Turns a message expression into a template: string constants kept, everything computed `<*>`."""

    def __init__(self, scopes: list[Scope]) -> None:
        self.scopes = scopes  # innermost first

    def render(self, node: ast.expr | None, line: int, depth: int = 0) -> str:
        if node is None or depth > _MAX_DEPTH:
            return WILD
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else WILD
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else WILD
                           for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left = self._constant(node.left, line, depth)
            return printf_to_wild(left) if left is not None else WILD
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.render(node.left, line, depth + 1) + self.render(node.right, line, depth + 1)
        if isinstance(node, ast.Call):
            return self._render_call(node, line, depth)
        if isinstance(node, ast.Name):
            return self._render_name(node.id, line, depth)
        return WILD

    def _render_call(self, node: ast.Call, line: int, depth: int) -> str:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "format":
            text = self._constant(func.value, line, depth)
            return format_to_wild(text) if text is not None else WILD
        if isinstance(func, ast.Attribute) and func.attr == "join" and node.args:
            separator = self._constant(func.value, line, depth)
            items = node.args[0]
            if separator is not None and isinstance(items, (ast.List, ast.Tuple)):
                return separator.join(self.render(e, line, depth + 1) for e in items.elts)
            return WILD
        if isinstance(func, ast.Attribute) and func.attr in ("strip", "rstrip", "lstrip") and not node.args:
            return self.render(func.value, line, depth + 1).strip()
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("dedent", "cleandoc") and node.args:
            return textwrap.dedent(self.render(node.args[0], line, depth + 1))
        return WILD

    def _render_name(self, name: str, line: int, depth: int) -> str:
        for scope in self.scopes:
            chain = scope.value_before(name, line) if scope is self.scopes[0] else scope.value_before(name, 1 << 30)
            if chain:
                return "".join(self.render(a.value, a.line, depth + 1) for a in chain)
            if name in scope.local_names:
                return WILD  # a parameter or a name bound some other way: not the module's
        return WILD

    def _constant(self, node: ast.expr, line: int, depth: int) -> str | None:
        """The literal text of a format string (a constant, or a name bound to one), else None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            text = self._render_name(node.id, line, depth + 1)
            return text if text != WILD else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self._constant(node.left, line, depth + 1), self._constant(node.right, line, depth + 1)
            return left + right if left is not None and right is not None else None
        return None


@dataclass(slots=True)
class PythonStats:
    raise_sites: int = 0
    asserts: int = 0  # `assert cond, "message"`: raises AssertionError with that message
    reraises: int = 0  # bare `raise` and `raise err`: no new message
    class_templates: int = 0
    unparsable_files: int = 0


class RaiseCollector(ast.NodeVisitor):
    """Walks one module, keeping the function scope of each raise."""

    def __init__(self, imports: Imports, module_scope: Scope, site_base: Site, stats: PythonStats,
                 exception_classes: set[str]) -> None:
        self.imports = imports
        self.exception_classes = exception_classes
        self.scopes = [module_scope]
        self.base = site_base
        self.stats = stats
        self.sites: list[Site] = []
        self.class_stack: list[ast.ClassDef] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.insert(0, Scope.of(node.body, node.args))
        self.generic_visit(node)
        self.scopes.pop(0)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.class_stack.append(node)
        if node.name in self.exception_classes:
            self._class_templates(node)
        self.generic_visit(node)
        self.class_stack.pop()

    def visit_Raise(self, node: ast.Raise) -> None:
        self.generic_visit(node)
        exc = node.exc
        if exc is None:
            self.stats.reraises += 1
            return
        call = exc if isinstance(exc, ast.Call) else None
        target = call.func if call is not None else exc
        written = _dotted(target)
        if call is None and (written is None or not _class_like(written)):
            self.stats.reraises += 1  # `raise err`: re-raises what was caught
            return
        self.stats.raise_sites += 1
        template = self._message(call, node.lineno) if call is not None else ""
        self.sites.append(self._site(template, written or _short(target), node.lineno))

    def visit_Assert(self, node: ast.Assert) -> None:
        self.generic_visit(node)
        if node.msg is None:
            return  # a bare assert prints no message of its own
        self.stats.asserts += 1
        template = tidy(TemplateRenderer(self.scopes).render(node.msg, node.lineno))
        self.sites.append(self._site(template, "AssertionError", node.lineno))

    def _message(self, call: ast.Call, line: int) -> str:
        renderer = TemplateRenderer(self.scopes)
        candidates = list(call.args) + [k.value for k in call.keywords if k.arg in _MESSAGE_KEYWORDS]
        rendered = [tidy(renderer.render(arg, line)) for arg in candidates if not isinstance(arg, ast.Starred)]
        informative = [t for t in rendered if is_informative(t)]
        return informative[0] if informative else (rendered[0] if rendered else "")

    def _class_templates(self, node: ast.ClassDef) -> None:
        """Templates an exception class builds itself, from `__init__` or `__str__`."""
        qualified_name = ".".join([c.name for c in self.class_stack])
        for item in node.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or item.name not in ("__init__", "__str__"):
                continue
            scopes = [Scope.of(item.body, item.args)] + self.scopes
            renderer = TemplateRenderer(scopes)
            for expr, line in _message_expressions(item):
                template = tidy(renderer.render(expr, line + 1))
                if is_informative(template):
                    self.stats.class_templates += 1
                    self.sites.append(self._site(template, qualified_name, line, from_class=True))

    def _site(self, template: str, written: str, line: int, from_class: bool = False) -> Site:
        qualified = (f"{self.imports.module}.{written}" if from_class else self.imports.qualify(written))
        site = Site(source=self.base.source, package=self.base.package, template=template, exception=written,
                    qualified=qualified, module=self.base.module, file=self.base.file, line=line)
        if from_class:
            site.extra["class_template"] = True
        return site


def _message_expressions(func: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.expr, int]]:
    """`super().__init__(X)`, `Base.__init__(self, X)`, `self.message = X`, `return X` (in __str__)."""
    for node in _walk_same_scope(func.body):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__":
            args = node.args[1:] if isinstance(node.func.value, (ast.Name, ast.Attribute)) else node.args
            if args:
                yield args[0], node.lineno
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                    and t.attr in _MESSAGE_ATTRS:
                yield node.value, node.lineno
        elif isinstance(node, ast.Return) and func.name == "__str__" and node.value is not None:
            yield node.value, node.lineno


_EXCEPTION_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Failure", "Failed", "Exceeded", "Timeout", "Abort")


def exception_classes(tree: ast.Module) -> set[str]:
    """Names of the classes of a module that are exceptions: named like one, deriving from one, or
    deriving (at any depth) from such a class of the same module (`BackendCompilerFailed(ShortenTraceback)`,
    `ShortenTraceback(TorchDynamoException)`)."""
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    bases = {c.name: [(_dotted(b) or "").rpartition(".")[2] for b in c.bases] for c in classes}
    found = {name for name, bs in bases.items()
             if name.endswith(_EXCEPTION_SUFFIXES) or any(b.endswith(_EXCEPTION_SUFFIXES) for b in bs)}
    grew = True
    while grew:
        grew = False
        for name, bs in bases.items():
            if name not in found and any(b in found for b in bs):
                found.add(name)
                grew = True
    return found


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _short(node: ast.expr) -> str:
    return ast.unparse(node)[:80]


def _class_like(dotted: str) -> bool:
    """`ValueError`, `errors.OutOfResources`: a class (CapWords), not a caught variable (`e`, `err`)."""
    last = dotted.rpartition(".")[2]
    return last[:1].isupper()


def extract_python(source: bytes | str, module: str, file: str, package: str, is_package: bool,
                   stats: PythonStats, kind: str = "python") -> list[Site]:
    """Every raise site (and exception-class template) of one Python module."""
    try:
        tree = ast.parse(source, filename=file)
    except (SyntaxError, ValueError):
        stats.unparsable_files += 1
        return []
    imports = Imports(tree, module, is_package)
    base = Site(source=kind, package=package, template="", module=module, file=file)
    collector = RaiseCollector(imports, Scope.of(tree.body), base, stats, exception_classes(tree))
    collector.visit(tree)
    return collector.sites
