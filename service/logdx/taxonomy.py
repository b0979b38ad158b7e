"""The one taxonomy: categories, failure types, and what each implies (``taxonomy.yaml``).

Loaded once, validated at load (errors name the file and line). Everything that needs to know
whether a label exists, which action it implies, or whether it may ever take a node out of a
cluster asks here.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from logdx import yamlsafe
from logdx.model import FT, Action, Category, Label

TAXONOMY_PATH = Path(__file__).with_name("taxonomy.yaml")

__all__ = [
    "KNOWN_CATEGORIES",
    "LABEL_ACTIONS",
    "FailureType",
    "Taxonomy",
    "TaxonomyError",
    "action_meanings",
    "category_of",
    "category_titles",
    "default_action",
    "reach_of",
    "Family",
    "failure_types_of",
    "family_title",
    "graded_family",
    "is_canonical",
    "is_learnable",
    "advice_of",
    "is_hardware",
    "is_resubmit",
    "make_label",
    "module_of_path",
    "owner_of",
    "taxonomy",
    "timeout_class",
    "title_of",
    "TIMEOUT_CLASSES",
    "TimeoutClass",
]


# What a recognised failure can be labelled: a known category (a past incident is never "unknown"),
# an action a label can carry ("none" is a healthy report's, never a label's).
KNOWN_CATEGORIES: tuple[Category, ...] = tuple(c for c in Category if c is not Category.UNKNOWN)
LABEL_ACTIONS: tuple[Action, ...] = tuple(a for a in Action if a is not Action.NONE)


class TaxonomyError(ValueError):
    """taxonomy.yaml does not load; the message names file and line."""


class _ActionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    meaning: str  # when it applies, one line
    advice: str  # what to do, as a report words it ("cordon the node, then restart")


class _CategorySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Action
    title: str


class _FamilySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str
    graded: bool = True  # false: the family blames no node (the scheduler's), a node's grade never counts it


class _TypeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    category: Category
    action: Action
    title: str
    family: str = ""
    hardware: bool = False
    resubmit: bool = False
    by_numbers: bool = False
    advice: str = ""
    check: str = ""


class _TimeoutClassSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str
    advice: str
    failure_type: str | None = None
    action: Action | None = None


class _FileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    actions: dict[Action, _ActionSpec]
    categories: dict[Category, _CategorySpec]
    families: dict[str, _FamilySpec]
    failure_types: dict[str, _TypeSpec]
    timeout_classes: dict[str, _TimeoutClassSpec] = {}
    owners: dict[str, str] = {}
    library_default: str


@dataclass(frozen=True, slots=True)
class FailureType:
    name: str
    category: Category
    action: Action
    title: str
    hardware: bool = False
    resubmit: bool = False
    by_numbers: bool = False  # only the numbers masking removes tell it apart: rules decide it, nothing learned
    advice: str = ""
    family: str = ""  # infrastructure types: what a node's repeated failures are counted by (`families`)
    check: str = ""  # the one check that confirms it, when the report is unsure ({host} and {rank} filled)


@dataclass(frozen=True, slots=True)
class Family:
    """A family of infrastructure failure (taxonomy.yaml `families`): what a node's grade counts blames by."""

    name: str
    title: str
    graded: bool = True


@dataclass(frozen=True, slots=True)
class TimeoutClass:
    """Why a collective timed out, and what it implies (taxonomy.yaml `timeout_classes`)."""

    name: str
    title: str
    advice: str
    failure_type: str | None  # the label a timeout verdict takes for this cause; None: its own
    action: Action | None  # None: the verdict's own action


TIMEOUT_CLASSES = ("cpu_side", "gpu_hang", "misconfig", "network", "unknown")


@dataclass(frozen=True)
class Taxonomy:
    types: dict[str, FailureType]
    action_meanings: dict[Action, str]  # when it applies, one line (the prompts)
    action_advice: dict[Action, str]  # what to do, as reports word it
    category_actions: dict[Category, Action]
    category_titles: dict[Category, str]
    owners: dict[str, str]  # dotted module prefix -> failure type of what it raises
    library_default: str  # failure type of a library error no owner names
    timeout_classes: dict[str, TimeoutClass] = field(default_factory=dict)
    families: dict[str, Family] = field(default_factory=dict)

    def by_category(self) -> dict[Category, tuple[str, ...]]:
        out: dict[Category, list[str]] = {c: [] for c in Category}
        for t in self.types.values():
            out[t.category].append(t.name)
        return {c: tuple(v) for c, v in out.items()}


def load_taxonomy(path: Path = TAXONOMY_PATH) -> Taxonomy:
    try:
        text = path.read_text(encoding="utf-8")
        raw = yamlsafe.load(text, str(path))
        spec = _FileSpec.model_validate(raw)
    except yamlsafe.YamlError as e:
        raise TaxonomyError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaxonomyError(f"{path}: cannot load: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        line = _line_of(text, [str(p) for p in err["loc"]])
        raise TaxonomyError(f"{path}:{line}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    problems = []
    for name, t in spec.failure_types.items():
        where = f"{path}:{_line_of(text, ['failure_types', name])}"
        if t.action == Action.CORDON_AND_RESTART and not t.hardware:
            problems.append(f"{where}: {name}: only a hardware type may default to cordon_and_restart")
        if t.hardware and t.category != Category.INFRASTRUCTURE:
            problems.append(f"{where}: {name}: hardware types are infrastructure")
        if t.resubmit and t.hardware:
            problems.append(f"{where}: {name}: a resubmit type blames no node, it cannot be hardware")
        if t.category != Category.INFRASTRUCTURE and t.action != Action.NO_RESTART:
            problems.append(f"{where}: {name}: only infrastructure types restart by default")
        if t.category == Category.INFRASTRUCTURE and t.family not in spec.families:
            problems.append(f"{where}: {name}: family {t.family or '(none)'} is not one of families: "
                            f"{', '.join(spec.families)}")
        if t.category != Category.INFRASTRUCTURE and t.family:
            problems.append(f"{where}: {name}: only infrastructure types have a family (a node's grade counts them)")
    for module, ft in spec.owners.items():
        if ft not in spec.failure_types:
            problems.append(f"{path}:{_line_of(text, ['owners', module])}: owner {module}: unknown failure type {ft}")
    for ft in FT:  # the names code reasons about must be declared here (model.FT)
        if ft.value not in spec.failure_types:
            problems.append(f"{path}: failure_types: {ft.value} is missing (logdx.model.FT names it)")
    if spec.library_default not in spec.failure_types:
        problems.append(f"{path}: library_default: unknown failure type {spec.library_default}")
    missing = set(Category) - set(spec.categories)
    if missing:
        problems.append(f"{path}: categories missing: {', '.join(sorted(c.value for c in missing))}")
    missing_actions = set(Action) - set(spec.actions)
    if missing_actions:
        problems.append(f"{path}: actions missing: {', '.join(sorted(a.value for a in missing_actions))}")
    problems += _timeout_class_problems(spec, path, text)
    if problems:
        raise TaxonomyError("\n".join(problems))
    types = {name: FailureType(name, t.category, t.action, t.title, t.hardware, t.resubmit, t.by_numbers, t.advice,
                               t.family, t.check)
             for name, t in spec.failure_types.items()}
    return Taxonomy(
        types=types,
        action_meanings={a: s.meaning for a, s in spec.actions.items()},
        action_advice={a: s.advice for a, s in spec.actions.items()},
        category_actions={c: s.action for c, s in spec.categories.items()},
        category_titles={c: s.title for c, s in spec.categories.items()},
        owners=dict(spec.owners),
        library_default=spec.library_default,
        timeout_classes={name: TimeoutClass(name, c.title, c.advice, c.failure_type, c.action)
                         for name, c in spec.timeout_classes.items()},
        families={name: Family(name, f.title, f.graded) for name, f in spec.families.items()},
    )


def _timeout_class_problems(spec: _FileSpec, path: Path, text: str) -> list[str]:
    """Every class the code decides on is declared, names a known type, and states the type's own action."""
    problems = []
    if set(spec.timeout_classes) != set(TIMEOUT_CLASSES):
        problems.append(f"{path}: timeout_classes: must be exactly {', '.join(TIMEOUT_CLASSES)}")
    for name, c in spec.timeout_classes.items():
        where = f"{path}:{_line_of(text, ['timeout_classes', name])}: {name}"
        t = spec.failure_types.get(c.failure_type or "")
        if c.failure_type is not None and t is None:
            problems.append(f"{where}: unknown failure type {c.failure_type}")
        elif t is not None and c.action is not None and c.action != t.action:
            problems.append(f"{where}: action {c.action.value} is not {c.failure_type}'s ({t.action.value})")
        if c.action is Action.CORDON_AND_RESTART:
            problems.append(f"{where}: a timeout's cause alone never cordons")
    return problems


def timeout_class(name: str) -> TimeoutClass:
    return taxonomy().timeout_classes[name]


def _line_of(text: str, keys: list[str]) -> int:
    """The line where a nested key is written (1-based; 1 when not found): errors point at it."""
    line, indent = 0, -1
    lines = text.splitlines()
    for key in keys:
        for i in range(line, len(lines)):
            stripped = lines[i].lstrip()
            depth = len(lines[i]) - len(stripped)
            if depth > indent and stripped.startswith(f"{key}:"):
                line, indent = i, depth
                break
        else:
            return line + 1
    return line + 1


@cache
def taxonomy() -> Taxonomy:
    return load_taxonomy()


def failure_types_of(category: Category | str) -> tuple[str, ...]:
    return taxonomy().by_category().get(Category(category), ())


def category_of(failure_type: str) -> Category | None:
    """The category a canonical failure type belongs to (failure types are unique across categories)."""
    t = taxonomy().types.get(failure_type)
    return t.category if t is not None else None


def is_canonical(category: Category | str, failure_type: str) -> bool:
    try:
        cat = Category(category)
    except ValueError:
        return False
    t = taxonomy().types.get(failure_type)
    return t is not None and t.category == cat and cat is not Category.UNKNOWN


def title_of(failure_type: str) -> str:
    """The few words for humans the taxonomy gives a failure type (the type itself when unknown)."""
    t = taxonomy().types.get(failure_type)
    return t.title if t is not None else failure_type.replace("_", " ")


def category_titles() -> dict[str, str]:
    """The taxonomy's few words for each category a label can have ("framework: resources, ...")."""
    return {c.value: taxonomy().category_titles[c] for c in KNOWN_CATEGORIES}


def action_meanings() -> dict[str, str]:
    """When each action a label can carry applies, one line each: what the prompts tell a model."""
    return {a.value: taxonomy().action_meanings[a] for a in LABEL_ACTIONS}


def is_hardware(failure_type: str | None) -> bool:
    t = taxonomy().types.get(failure_type or "")
    return bool(t and t.hardware)


def advice_of(action: Action, failure_type: str | None = None) -> str:
    """What to do, as a report words it: the failure type's own words where the action's would mislead
    ("resubmit", not "restart"), else the action's."""
    t = taxonomy().types.get(failure_type or "")
    return t.advice if t is not None and t.advice else taxonomy().action_advice[action]


def is_learnable(failure_type: str | None) -> bool:
    """Whether retrieval and the LLM may propose it: not a type only the masked-away numbers tell apart."""
    t = taxonomy().types.get(failure_type or "")
    return not (t and t.by_numbers)


def graded_family(failure_type: str | None) -> str | None:
    """The family a node's grade counts a blame of this failure type in (taxonomy.yaml `families`); None when
    the grade never counts it: not infrastructure, a resubmit (the scheduler ended the job), an ungraded family."""
    t = taxonomy().types.get(failure_type or "")
    if t is None or t.category != Category.INFRASTRUCTURE or t.resubmit:
        return None
    f = taxonomy().families.get(t.family)
    return f.name if f is not None and f.graded else None


def family_title(name: str) -> str:
    f = taxonomy().families.get(name)
    return f.title if f is not None else name


def is_resubmit(failure_type: str | None) -> bool:
    t = taxonomy().types.get(failure_type or "")
    return bool(t and t.resubmit)


def reach_of(action: Action) -> int:
    """How far an action reaches, 0 for the mildest: taxonomy.yaml lists the actions most drastic first."""
    order = list(taxonomy().action_meanings)
    return len(order) - 1 - order.index(action)


def default_action(category: Category | str, failure_type: str | None) -> Action:
    """The action a label implies when nothing more specific is known."""
    t = taxonomy().types.get(failure_type or "")
    if t is not None and t.category == Category(category):
        return t.action
    return taxonomy().category_actions[Category(category)]


def allowed_actions(category: Category | str, failure_type: str) -> frozenset[Action]:
    """The actions a rule may state for a label: a restart only for infrastructure, a cordon only
    for infrastructure (a rule may say a signal implicates one machine, e.g. a NIC link down), never
    for a resubmit type."""
    cat = Category(category)
    if cat is Category.UNKNOWN:
        # A hang with no error says nothing of its cause, and a restart is what clears most hangs.
        return frozenset({Action.NO_RESTART, Action.RESTART})
    if cat is not Category.INFRASTRUCTURE or default_action(cat, failure_type) is Action.NO_RESTART:
        # The second: infrastructure that nothing should rerun (a job somebody cancelled).
        return frozenset({Action.NO_RESTART})
    if is_resubmit(failure_type):
        return frozenset({Action.RESTART})
    return frozenset({Action.RESTART, Action.CORDON_AND_RESTART})


def make_label(category: Category | str, failure_type: str, action: Action | str | None = None) -> Label:
    """A canonical Label; raises ValueError for a failure type outside its category or an action
    the label does not allow."""
    cat = Category(category)
    if cat is Category.UNKNOWN and failure_type == FT.UNKNOWN:
        return Label(cat, failure_type, Action(action) if action is not None else default_action(cat, failure_type))
    if not is_canonical(cat, failure_type):
        raise ValueError(f"not a canonical label: {cat.value}/{failure_type}")
    act = Action(action) if action is not None else default_action(cat, failure_type)
    if act not in allowed_actions(cat, failure_type):
        raise ValueError(f"{cat.value}/{failure_type} cannot have action {act.value}")
    return Label(cat, failure_type, act)


_SITE_DIRS = ("site-packages", "dist-packages")
_STDLIB = frozenset(sys.stdlib_module_names)
# Python's own library: /usr/lib/python3.10/enum.py, <conda>/lib/python3.8/queue.py (not its site-packages).
_PYTHON_LIB = re.compile(r"[\\/]lib[\\/]python\d+(?:\.\d+)?[\\/](?!site-packages|dist-packages)")


def is_stdlib_path(path: str) -> bool:
    """A file of Python's own standard library: a full path under lib/pythonX.Y (not its site-packages),
    `<frozen ...>`, or a short path (py-spy's) whose top module is a standard one ("queue.py",
    "multiprocessing/connection.py")."""
    p = path.replace("\\", "/")
    if p.startswith("<frozen") or _PYTHON_LIB.search(p):
        return True
    if p.startswith(("/", ".")) or ":" in p:
        return False  # a full or relative path elsewhere: not Python's own
    top = p.split("/", 1)[0].removesuffix(".py")
    return top in _STDLIB and top not in ("test", "tests")


def module_of_path(path: str) -> str | None:
    """The dotted module a source path belongs to, when it is an installed (or vendored) library:
    `/x/lib/python3.10/site-packages/torch/utils/data/dataloader.py` -> `torch.utils.data.dataloader`."""
    parts = path.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _SITE_DIRS:
            rest = [p for p in parts[i + 1:] if p]
            break
    else:
        # A framework run from its source checkout (Megatron, NeMo): its package directory.
        tops = {m.split(".", 1)[0] for m in taxonomy().owners}
        at = next((i for i in range(len(parts) - 2, -1, -1) if parts[i] in tops), None)
        if at is None:
            return None
        rest = parts[at:]
    if not rest:
        return None
    rest[-1] = rest[-1].removesuffix(".py").removesuffix(".pyx")
    if rest[-1] == "__init__":
        rest.pop()
    return ".".join(rest) or None


def owner_of(module: str | None) -> str | None:
    """The failure type of an error raised in this module, by its longest listed dotted prefix."""
    if not module:
        return None
    owners = taxonomy().owners
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        ft = owners.get(".".join(parts[:n]))
        if ft is not None:
            return ft
    return None
