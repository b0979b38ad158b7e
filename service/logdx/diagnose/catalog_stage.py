"""The error catalog as a diagnosis stage: which catalog `match` consults (the prebuilt index, read a row at a
time, else the catalog parsed in memory), and the stage's vote (cascade.py). Apart from `catalog.py` (the catalog
itself) and `catalog_index.py` (its index), which both sit below it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from logdx.diagnose import catalog as _catalog
from logdx.diagnose import catalog_index
from logdx.diagnose.catalog import Catalog, CatalogHit
from logdx.diagnose.fusion import format_neighbour_evidence
from logdx.model import Evidence, FailureContext, Label, StageVote
from logdx.taxonomy import category_of, default_action

__all__ = ["catalog_vote", "match", "use_cache_dir"]

_matcher: Catalog | None = None  # what `match` asks: the prebuilt index's view, else the parsed catalog
_cache_dir: Path | None = None


def use_cache_dir(path: Path | None) -> None:
    """Where an index of the catalog is built when none was installed (`<data_dir>/cache`)."""
    global _cache_dir
    _cache_dir = path


def _the_matcher() -> Catalog:
    """The catalog `match` consults, chosen once: the prebuilt index, read a row at a time; without one, the
    catalog parsed in memory (and indexed into the cache dir for next time)."""
    global _matcher
    if _matcher is None:
        with _catalog.lock:
            if _matcher is None:
                found = catalog_index.find_or_build(cache_dir=_cache_dir, parsed=_catalog.parsed_unlocked)
                parsed_before = _catalog.already_parsed()
                _matcher = found.catalog if found is not None and not parsed_before else _catalog.parsed_unlocked()
    return _matcher


def match(line: str, exception_type: str | None = None, limit: int = 5) -> list[CatalogHit]:
    """The known messages a line came from, best first (the same answers as `catalog().match`)."""
    global _matcher
    matcher = _the_matcher()
    try:
        return matcher.match(line, exception_type, limit)
    except sqlite3.Error:  # an index that broke under us: the catalog itself answers from now on
        _matcher = _catalog.catalog()
        return _matcher.match(line, exception_type, limit)


def catalog_vote(ctx: FailureContext, limit: int = 3) -> StageVote:
    """What the catalog says of the root line: the labels of the messages it came from, scored by
    how well they match (a stage vote; see cascade.py)."""
    line = ctx.root_message or ctx.root_text
    if not line:
        return StageVote(source="catalog", scores=[])
    scores: dict[tuple[str, str], tuple[Label, float]] = {}
    evidence: list[Evidence] = []
    for hit in match(line, ctx.exception_type, limit):
        e = hit.entry
        cat = category_of(e.failure_type)
        if cat is None:
            continue
        label = Label(cat, e.failure_type, default_action(cat, e.failure_type))
        key = (cat.value, e.failure_type)
        if key not in scores or hit.score > scores[key][1]:
            scores[key] = (label, hit.score)
        evidence.append(Evidence(line_no=None, text=format_neighbour_evidence(label, hit.score, e.text()),
                                 source=f"catalog:{e.id}"))
    ranked = sorted(scores.values(), key=lambda s: -s[1])
    return StageVote(source="catalog", scores=ranked, evidence=evidence[:limit])
