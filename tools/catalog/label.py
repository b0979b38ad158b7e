"""Labels a catalog entry with a canonical failure type: the ordered rules of `labels.toml` around the
taxonomy's module owners (logdx.taxonomy), so that everything that decides a label is data."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from logdx.taxonomy import category_of, owner_of, taxonomy

from .templates import Site

LABELS_PATH = Path(__file__).with_name("labels.toml")


@dataclass(frozen=True, slots=True)
class LabelRule:
    name: str
    failure_type: str
    message: re.Pattern[str] | None = None
    exception: re.Pattern[str] | None = None
    sources: frozenset[str] | None = None
    modules: tuple[str, ...] | None = None

    def matches(self, site: Site) -> bool:
        if self.sources is not None and site.source not in self.sources:
            return False
        if self.modules is not None and not any(_in_module(site.module, m) for m in self.modules):
            return False
        if self.exception is not None and not any(
                c and self.exception.fullmatch(c) for c in (site.exception, site.qualified)):
            return False
        return self.message is None or bool(self.message.search(site.template))


def _in_module(module: str | None, prefix: str) -> bool:
    return bool(module) and (module == prefix or module.startswith(prefix + "."))  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class Label:
    failure_type: str
    category: str
    by: str  # which step decided: "rule:<name>", "owner:<module>", "fallback:<name>", "source:<source>", "library_default"


@dataclass(frozen=True)
class Labeller:
    rules: tuple[LabelRule, ...]
    fallbacks: tuple[LabelRule, ...]
    source_defaults: dict[str, str]

    @classmethod
    def load(cls, path: Path = LABELS_PATH) -> Labeller:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        known = set(taxonomy().types)
        labeller = cls(tuple(_rule(r, path) for r in raw.get("rule", [])),
                       tuple(_rule(r, path) for r in raw.get("fallback", [])),
                       dict(raw.get("source_default", {})))
        unknown = {r.failure_type for r in labeller.rules + labeller.fallbacks} | set(labeller.source_defaults.values())
        if unknown - known:
            raise ValueError(f"{path}: failure types not in the taxonomy: {', '.join(sorted(unknown - known))}")
        return labeller

    def label(self, site: Site) -> Label:
        if site.failure_type:
            return Label(site.failure_type, _category(site.failure_type), f"source:{site.source}")
        for rule in self.rules:
            if rule.matches(site):
                return Label(rule.failure_type, _category(rule.failure_type), f"rule:{rule.name}")
        owned = owner_of(site.module)
        if owned is not None:
            return Label(owned, _category(owned), f"owner:{_owner_prefix(site.module)}")
        for rule in self.fallbacks:
            if rule.matches(site):
                return Label(rule.failure_type, _category(rule.failure_type), f"fallback:{rule.name}")
        if site.source in self.source_defaults:
            ft = self.source_defaults[site.source]
            return Label(ft, _category(ft), f"source:{site.source}")
        ft = taxonomy().library_default
        return Label(ft, _category(ft), "library_default")


def _rule(raw: dict, path: Path) -> LabelRule:
    try:
        return LabelRule(
            name=raw["name"],
            failure_type=raw["failure_type"],
            message=re.compile(raw["message"], re.IGNORECASE) if "message" in raw else None,
            exception=re.compile(raw["exception"]) if "exception" in raw else None,
            sources=frozenset(raw["sources"]) if "sources" in raw else None,
            modules=tuple(raw["modules"]) if "modules" in raw else None,
        )
    except (KeyError, re.error) as e:
        raise ValueError(f"{path}: rule {raw.get('name', '?')}: {e}") from None


def _category(failure_type: str) -> str:
    category = category_of(failure_type)
    if category is None:
        raise ValueError(f"unknown failure type {failure_type}")
    return category.value


def _owner_prefix(module: str | None) -> str:
    """The owners entry that decided (its longest dotted prefix), for the record."""
    owners = taxonomy().owners
    parts = (module or "").split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in owners:
            return ".".join(parts[:n])
    return module or ""
