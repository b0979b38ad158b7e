"""The error catalog: which known message, raised where, an error line came from.

`kb/catalog.jsonl.gz` is built at build time from the frameworks' own code (`make catalog`,
tools/catalog/): every raise site of torch, DeepSpeed, transformers, datasets, pyarrow, triton...,
NCCL's failure strings, the CUDA runtime's error strings and NVIDIA's Xid table, each with a
message template (`<*>` where the message varies), the module that raises it and a canonical label.
This module only reads it: loaded once, lazily, on the first `match`; no model, no torch.

Matching, best first:

1. `xid`: an `Xid (PCI:...): 79` line is looked up by its code;
2. `symbol`: a line naming a CUDA error (`cudaErrorIllegalAddress`) or an Xid mnemonic;
3. `template`: the line, masked like every log line (`logdx.patterns.mask`), matches a template
   compiled to a regex (`<*>` a lazy wildcard). Only templates whose rarest word is in the line are
   tried, and only if all their words are: a line costs a few set lookups and a handful of regexes;
4. `similar`: no template matches, but the line shares enough rare words with one (TF-IDF cosine
   over masked tokens, at least `SIMILAR_MIN`).

Scores: xid/symbol 0.95; template 0.6-1.0 by how much of the line the template's constant text
covers; similar below 0.8. An exception class that agrees with the entry's adds a little, one that
disagrees takes a little away.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from logdx.patterns import PARAM, mask

__all__ = ["CATALOG_PATH", "Catalog", "CatalogEntry", "CatalogHit", "catalog", "catalog_meta", "content_words"]

CATALOG_PATH = Path(__file__).resolve().parent.parent / "kb" / "catalog.jsonl.gz"
META_PATH = CATALOG_PATH.with_name("catalog.meta.json")
FORMAT_VERSION = 1

SIMILAR_MIN = 0.6  # cosine below which a resemblance is not reported
_MIN_SHARED = 3  # content words a resemblance must share (besides the exception class)
_MIN_LINE_WORDS = 4  # content words a line needs before it may resemble anything: short lines are generic
MAX_LINE = 2000  # characters of a line that are matched (error messages say what they are early)
_MIN_LITERAL = 8  # characters of constant text an exact match needs
_MIN_COVERAGE = 0.3  # and the share of the line's text they must cover,
_LONG_LITERAL = 24  # unless they are this long: a long exact phrase inside a long wrapper line still counts
_MIN_TEMPLATE_SCORE = 0.5  # below this (a short template, another class) a template match is not reported
_COMMON_DF = 0.005  # a word in more than this share of templates only adds to candidates the rare words found

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_']*")
# Words that say nothing about which message a line is: never enough to call two messages alike.
STOPWORDS = frozenset(
    "a an the of to in on at by for from with without into onto over under is are was were be been being "
    "has have had do does did not no nor or and but if then else than that this these those it its as such "
    "can cannot could should would will may might must shall got get out off up you your we our please".split())
_SPACES = re.compile(r"\s+")
_WILD_RUN = re.compile(r"(?:<\*>)(?:\s*<\*>)*")
# The frame of a traceback, not a message: never matched, never a pattern.
_FRAMING = re.compile(r'^\s*(?:Traceback \(most recent call last\)|During handling of the above exception|'
                      r'The above exception was the direct cause|File "[^"]*", line \d+)')
_XID_CAUSE = re.compile(r"caused by previous Xid (\d{1,3})\b")
_XID = re.compile(r"\bXid\b\s*(?:\([^)]*\))?\s*:?\s*(\d{1,3})\b")
# "torch.distributed.DistBackendError: ..." / "ValueError: ...": the class a Python exception line starts with.
_EXCEPTION_PREFIX = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Z]\w*)\s*:\s+")


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One known error message. `template` is its text with `<*>` for the variable parts."""

    id: str
    source: str  # python | cython | cxx | rust | nccl | cudart | xid
    package: str  # the distribution it was read from ("torch", "nvidia-nccl-cu12", "xid")
    template: str
    failure_type: str
    category: str
    label_by: str  # which labelling step decided: rule:..., owner:..., fallback:..., source:..., library_default
    exception: str | None = None  # class as written at the raise site
    qualified: str | None = None  # its dotted name, when known
    module: str | None = None  # the module that raises it
    site: str | None = None  # file:line inside the release
    sites: int = 1  # how many raise sites print this message
    modules: tuple[str, ...] = ()  # other modules that raise it (a few)
    name: str | None = None  # cudaError_t name, Xid mnemonic
    code: int | None = None  # cudaError_t value, Xid number
    patterns: tuple[str, ...] = ()  # texts to match instead of the template (Xid driver messages)
    symbols: tuple[str, ...] = ()  # words that name it exactly (cudaErrorIllegalAddress)
    implicates: str | None = None  # Xid: hardware | application | driver
    role: str | None = None  # Xid: root_cause | symptom | warning
    hardware: bool = False

    @property
    def exception_name(self) -> str | None:
        """The class's last name (`ZeRORuntimeException`), what a log line prints most often."""
        cls = self.qualified or self.exception
        return cls.rpartition(".")[2] if cls else None

    def text(self) -> str:
        """One line that says what this entry is, for embedding beside past incidents."""
        head = f"{self.qualified or self.exception}: " if (self.qualified or self.exception) else ""
        where = f" [{self.module}]" if self.module else ""
        return f"{head}{self.template.splitlines()[0] if self.template else ''}{where}"

    @classmethod
    def from_json(cls, raw: dict) -> CatalogEntry:
        return cls(
            id=raw["id"], source=raw["source"], package=raw["package"], template=raw.get("template", ""),
            failure_type=raw["failure_type"], category=raw["category"], label_by=raw.get("label_by", ""),
            exception=raw.get("exception"), qualified=raw.get("qualified"), module=raw.get("module"),
            site=raw.get("site"), sites=int(raw.get("sites", 1)), modules=tuple(raw.get("modules", ())),
            name=raw.get("name"), code=raw.get("code"), patterns=tuple(raw.get("patterns", ())),
            symbols=tuple(raw.get("symbols", ())), implicates=raw.get("implicates"), role=raw.get("role"),
            hardware=bool(raw.get("hardware", False)),
        )


@dataclass(frozen=True, slots=True)
class CatalogHit:
    entry: CatalogEntry
    score: float  # 0..1, see the module docstring
    how: str  # xid | symbol | template | similar
    pattern: str  # the (masked) template line that matched


@dataclass(slots=True)
class _Pattern:
    """One matchable line of an entry: a template line masked like log lines."""

    entry: int  # index into Catalog.entries
    text: str  # masked, wildcards merged
    pieces: tuple[str, ...]  # the constant text between wildcards (empty ends dropped)
    required: frozenset[str]  # lower-cased words the line must contain
    literal: int  # characters of constant text
    tokens: frozenset[str]  # words for the similarity fallback
    regex: re.Pattern[str] | None = None  # compiled on first use


@dataclass
class Catalog:
    entries: list[CatalogEntry]
    _patterns: list[_Pattern] = field(default_factory=list, repr=False)
    _anchors: dict[str, list[int]] = field(default_factory=dict, repr=False)  # rarest word -> patterns
    _postings: dict[str, list[int]] = field(default_factory=dict, repr=False)  # word -> patterns
    _idf: dict[str, float] = field(default_factory=dict, repr=False)
    _norms: list[float] = field(default_factory=list, repr=False)
    _xids: dict[int, int] = field(default_factory=dict, repr=False)  # Xid code -> entry
    _symbols: dict[str, int] = field(default_factory=dict, repr=False)  # symbol -> entry
    _by_id: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index()

    @classmethod
    def load(cls, path: Path = CATALOG_PATH) -> Catalog:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return cls([CatalogEntry.from_json(json.loads(line)) for line in f if line.strip()])

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, entry_id: str) -> CatalogEntry | None:
        i = self._by_id.get(entry_id)
        return self.entries[i] if i is not None else None

    # ---- matching --------------------------------------------------------------------------------

    def match(self, line: str, exception_type: str | None = None, limit: int = 5) -> list[CatalogHit]:
        """The known messages this line came from, best first (empty when none is close enough)."""
        text = _SPACES.sub(" ", line[:MAX_LINE]).strip()
        if not text or _FRAMING.match(text):
            return []
        prefix = _EXCEPTION_PREFIX.match(text)
        exc = exception_type or (prefix.group(1) if prefix else None)
        message = text[prefix.end():] if prefix else text
        if _FRAMING.match(message):
            return []  # "IndexError: Traceback (most recent call last):" - a worker's traceback follows
        masked = _WILD_RUN.sub(PARAM, mask(message))
        hits = self._structured_hits(text)
        hits += self._template_hits(masked, exc)
        if not any(h.how == "template" for h in hits):
            hits += self._similar_hits(masked, exc)
        return _best(hits, limit)

    def _structured_hits(self, text: str) -> list[CatalogHit]:
        hits = []
        # The driver names the Xid that started it all ("45, ... caused by previous Xid 149"): that
        # one says what broke; the later one is its cleanup.
        xid = _XID_CAUSE.search(text) or _XID.search(text)
        if xid and int(xid.group(1)) in self._xids:
            hits.append(CatalogHit(self.entries[self._xids[int(xid.group(1))]], 0.95, "xid", xid.group(0)))
        if self._symbols:
            for word in set(_TOKEN.findall(text)):
                if word in self._symbols:
                    hits.append(CatalogHit(self.entries[self._symbols[word]], 0.95, "symbol", word))
        return hits

    def _template_hits(self, masked: str, exc: str | None) -> list[CatalogHit]:
        words = {w.lower() for w in _TOKEN.findall(masked)}
        hits = []
        size = max(len(masked.replace(PARAM, "")), 1)
        for word in words:
            for p_index in self._anchors.get(word, ()):  # one anchor per pattern: each is tried once
                pattern = self._patterns[p_index]
                if not pattern.required <= words:
                    continue
                if pattern.regex is None:
                    pattern.regex = re.compile(".*?".join(re.escape(p) for p in pattern.pieces), re.DOTALL)
                if not pattern.regex.search(masked):
                    continue
                coverage = min(1.0, pattern.literal / size)
                if pattern.literal < _MIN_LITERAL or (coverage < _MIN_COVERAGE and pattern.literal < _LONG_LITERAL):
                    continue
                entry = self.entries[pattern.entry]
                score = 0.6 + 0.4 * coverage + _exception_agreement(entry, exc)
                if score >= _MIN_TEMPLATE_SCORE:
                    hits.append(CatalogHit(entry, _clip(score), "template", pattern.text))
        return hits

    def _similar_hits(self, masked: str, exc: str | None) -> list[CatalogHit]:
        """Templates sharing enough rare words with the line (TF-IDF cosine over content words). Rare
        words accumulate through the postings; common words only ever add a bounded amount, so a
        template whose bound falls short is never scored in full."""
        line_words = set(content_words(masked))
        if len(line_words) < _MIN_LINE_WORDS:
            return []
        exc_words = _exception_words(exc)
        known = [w for w in line_words | exc_words if w in self._idf]
        line_norm = math.sqrt(sum(self._idf[w] ** 2 for w in known)) if known else 0.0
        if not line_norm:
            return []
        limit_df = max(1, int(_COMMON_DF * len(self._patterns)))
        rare = [w for w in known if len(self._postings[w]) <= limit_df]
        common = [w for w in known if len(self._postings[w]) > limit_df]
        common_mass = sum(self._idf[w] ** 2 for w in common)
        partial: dict[int, float] = defaultdict(float)
        count: dict[int, int] = defaultdict(int)
        for w in rare:
            weight = self._idf[w] ** 2
            for p_index in self._postings[w]:
                partial[p_index] += weight
                count[p_index] += w not in exc_words
        hits = []
        for p_index, dot in partial.items():
            norm = line_norm * self._norms[p_index]
            if not norm or (dot + common_mass) / norm < SIMILAR_MIN:
                continue
            pattern = self._patterns[p_index]
            shared_common = [w for w in common if w in pattern.tokens]
            if count[p_index] + sum(w not in exc_words for w in shared_common) < _MIN_SHARED:
                continue
            cosine = (dot + sum(self._idf[w] ** 2 for w in shared_common)) / norm
            if cosine >= SIMILAR_MIN:
                entry = self.entries[pattern.entry]
                hits.append(CatalogHit(entry, _clip(0.8 * cosine + _exception_agreement(entry, exc) / 2, 0.79),
                                       "similar", pattern.text))
        return hits

    # ---- index -------------------------------------------------------------------------------------

    def _index(self) -> None:
        for i, entry in enumerate(self.entries):
            self._by_id[entry.id] = i
            if entry.source == "xid" and entry.code is not None:
                self._xids[entry.code] = i
            for symbol in entry.symbols:
                self._symbols.setdefault(symbol, i)
            for line in _pattern_lines(entry):
                pattern = _compile_pattern(i, line, entry)
                if pattern is not None:
                    self._patterns.append(pattern)
        df: dict[str, int] = defaultdict(int)
        for p_index, pattern in enumerate(self._patterns):
            for w in pattern.tokens:
                df[w] += 1
                self._postings.setdefault(w, []).append(p_index)
        n = max(len(self._patterns), 1)
        self._idf = {w: math.log((n + 1) / (c + 0.5)) for w, c in df.items()}
        self._norms = [math.sqrt(sum(self._idf[w] ** 2 for w in p.tokens)) for p in self._patterns]
        # Each pattern is tried only for lines holding its anchor: its rarest required word, a content
        # word when it has one (stopwords are in nearly every line).
        required_df: dict[str, int] = defaultdict(int)
        for pattern in self._patterns:
            for w in pattern.required:
                required_df[w] += 1
        for p_index, pattern in enumerate(self._patterns):
            if pattern.required:
                anchor = min(pattern.required, key=lambda w: (w in STOPWORDS, required_df[w], w))
                self._anchors.setdefault(anchor, []).append(p_index)


def _pattern_lines(entry: CatalogEntry) -> Iterable[str]:
    if entry.source == "xid":
        return entry.patterns  # the Xid's description is ours, not a text the driver prints
    return entry.patterns or [line for line in entry.template.splitlines() if line.strip() and not _FRAMING.match(line)]


def _compile_pattern(entry_index: int, line: str, entry: CatalogEntry) -> _Pattern | None:
    masked = _WILD_RUN.sub(PARAM, mask(_SPACES.sub(" ", line).strip()))
    pieces = masked.split(PARAM)
    required: set[str] = set()
    for k, piece in enumerate(pieces):
        for m in _TOKEN.finditer(piece):
            glued_before = m.start() == 0 and k > 0  # "<*>size": the line may print "12size"
            glued_after = m.end() == len(piece) and k < len(pieces) - 1
            if not glued_before and not glued_after and len(m.group()) > 1:
                required.add(m.group().lower())
    constant = tuple(p for p in pieces if p)
    literal = sum(len(p) for p in constant)
    if not constant or literal < 4:
        return None
    tokens = set(content_words(masked)) | _exception_words(entry.exception_name)
    return _Pattern(entry_index, masked, constant, frozenset(required), literal, frozenset(tokens))


def content_words(text: str) -> list[str]:
    """The words of a text or template that can tell messages apart: lower-cased, three letters or
    more, no stopwords, none of a template's wildcards."""
    return [w for w in (m.lower() for m in _WORD.findall(text.replace(PARAM, " "))) if len(w) >= 3 and w not in STOPWORDS]


def _exception_words(exc: str | None) -> set[str]:
    return {exc.rpartition(".")[2].lower()} if exc else set()


_CATCH_ALL = frozenset({"RuntimeError", "Exception", "ValueError", "OSError", "AssertionError", "TypeError"})


def _exception_agreement(entry: CatalogEntry, exc: str | None) -> float:
    """A little for an exception class that agrees with the entry's; a clear penalty for one that does
    not, since a raise site prints its own class (the same text raised elsewhere is only a hint)."""
    if not exc or not entry.exception_name:
        return 0.0
    short = exc.rpartition(".")[2]
    if short == entry.exception_name:
        return 0.02 if short in _CATCH_ALL else 0.08
    return -0.25


def _clip(score: float, top: float = 1.0) -> float:
    return round(max(0.0, min(top, score)), 4)


_HOW_RANK = {"xid": 0, "symbol": 1, "template": 2, "similar": 3}


def _best(hits: list[CatalogHit], limit: int) -> list[CatalogHit]:
    best: dict[str, CatalogHit] = {}
    for hit in hits:
        seen = best.get(hit.entry.id)
        if seen is None or (_HOW_RANK[hit.how], -hit.score) < (_HOW_RANK[seen.how], -seen.score):
            best[hit.entry.id] = hit
    ordered = sorted(best.values(), key=lambda h: (-h.score, _HOW_RANK[h.how], h.entry.id))
    return ordered[:limit]


# ---- the shipped catalog ---------------------------------------------------------------------------

lock = threading.Lock()  # guards the parse (and catalog_stage's choice of matcher)
_loaded: Catalog | None = None


def catalog() -> Catalog:
    """The shipped catalog, loaded on first use (about a second) and shared by every thread."""
    global _loaded
    if _loaded is None:
        with lock:
            if _loaded is None:
                _loaded = _load_checked()
    return _loaded


def _load_checked() -> Catalog:
    built = catalog_meta().get("format")
    if built != FORMAT_VERSION:
        raise RuntimeError(f"{CATALOG_PATH} has format {built}; this logdx reads format "
                           f"{FORMAT_VERSION}: rebuild it with `make catalog`")
    return Catalog.load()


def parsed_unlocked() -> Catalog:
    """The shipped catalog parsed, for a caller that already holds `lock` (`catalog()` takes it)."""
    global _loaded
    if _loaded is None:
        _loaded = _load_checked()
    return _loaded


def already_parsed() -> bool:
    return _loaded is not None


@cache
def catalog_meta() -> dict:
    """What the shipped catalog was built from: format, framework versions and files, counts."""
    return json.loads(META_PATH.read_text(encoding="utf-8"))
