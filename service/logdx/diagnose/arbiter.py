"""The arbiter: a calibrated classifier over the embedding retrieval already computes, for what no rule names.

Where the rules do not decide and past incidents are absent or split, something has to weigh the near
misses. A generative model asked to pick a label copies its prior (issue 30: the 270M LLM answered
`network_error` whenever retrieval had nothing above its threshold). This stage is a multinomial logistic
regression (numpy; the fit takes a fraction of a second) over the vectors of retrieval's own index:

- examples: the shared past incidents (the seed incidents and every incident feedback stored: their
  vectors are read back from the index, nothing is embedded again) and a few error-catalog entries per
  failure type whose label a source or a rule settled (embedded once, cached);
- refit when the incidents change: the fit is keyed by the incidents' fingerprint and the catalog's
  build (memory, then ``<data_dir>/cache/arbiter-<key>.npz``), so feedback changes the next answer;
- calibrated: the logits are divided by a temperature chosen on held-out folds of the examples (the
  mean log-loss of 5-fold cross-validation), so "p = 0.7" means about 7 in 10;
- it abstains, and says so, when its best class is below ``arbiter.min_probability`` or no example is
  within ``arbiter.min_similarity`` of the failure (text unlike anything known, gibberish): "arbiter
  abstains: unknown: the nearest incidents are A (0.52), B (0.49); check X". An abstention is a vote
  with no scores: fusion keeps what the evidence said.

It is an opinion like the LLM's: fusion weighs it (``fusion.arbiter``), `guard_action` keeps its action
no further than an evidence-bearing stage reaches, and `settle_action` never lets it cordon.
Leave-one-out evaluation (``exclude_ids``) refits without the excluded incidents, warm-started.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from logdx.config import ArbiterSettings
from logdx.diagnose.catalog import CATALOG_PATH, META_PATH
from logdx.diagnose.fusion import format_neighbour_evidence
from logdx.diagnose.retrieval import GENERIC_EXCEPTIONS, exception_class
from logdx.model import Category, Evidence, FailureContext, Label, StageVote
from logdx.patterns import mask
from logdx.taxonomy import category_of, default_action, is_learnable, taxonomy

if TYPE_CHECKING:
    from logdx.diagnose.retrieval import Retriever

__all__ = ["Arbiter", "ArbiterFit", "fit_softmax"]

log = logging.getLogger(__name__)

_Key = tuple[Category, str]
_FORMAT = 2  # of the cached fit: another layout means refit
_L2 = 1e-3  # ridge on the weights (per example): strong enough that 2-3 examples a class do not overfit
_CATALOG_LABELLED_BY = ("source:", "rule:")  # catalog labels a person or the source itself settled
_CATALOG_WEIGHT = 0.5  # a catalog message is a template, not a whole failure: it counts half
_EXCEPTION_WEIGHT = 1.0  # beside a unit-norm embedding
_TEMPERATURES = tuple(float(t) for t in np.geomspace(0.05, 5.0, 41))


@dataclass(slots=True)
class ArbiterFit:
    classes: list[_Key]
    weights: np.ndarray  # (dim, K)
    bias: np.ndarray  # (K,)
    temperature: float
    vectors: np.ndarray  # the examples' features (n, dim + exceptions): the nearest are named when it abstains
    names: list[str]  # per example: incident id or catalog:<id>
    targets: np.ndarray  # per example: its class index
    key: str
    exceptions: list[str]  # the exception classes the examples raise: one feature each, after the embedding

    @property
    def dim(self) -> int:
        return self.vectors.shape[1] - len(self.exceptions)

    def features(self, vec: np.ndarray, exception: str | None) -> np.ndarray:
        return np.concatenate([vec.astype(np.float64).ravel(), _exception_features(self.exceptions, exception)])

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return _softmax((x @ self.weights + self.bias) / self.temperature)

    def similarities(self, x: np.ndarray) -> np.ndarray:
        """Of the failure to each example, as retrieval measures it (the embedding alone)."""
        return self.vectors[:, : self.dim] @ x[: self.dim] if len(self.vectors) else np.zeros(0)


def _exception_features(vocabulary: list[str], exception: str | None) -> np.ndarray:
    """The exception class, one-hot: the strongest single word of a Python failure, which the sentence embedding
    barely tells apart ("KeyError: 'x'" and "TypeError: 'x'"); a catch-all class (RuntimeError) counts a third, as
    in retrieval's re-ranking."""
    f = np.zeros(len(vocabulary))
    if exception is not None and exception in vocabulary:
        f[vocabulary.index(exception)] = _EXCEPTION_WEIGHT / (3.0 if exception in GENERIC_EXCEPTIONS else 1.0)
    return f


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def fit_softmax(x: np.ndarray, y: np.ndarray, k: int, sample_weight: np.ndarray | None = None, *,
                l2: float = _L2, iterations: int = 400,
                start: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression (weighted mean cross-entropy + l2/2 |W|^2) by Nesterov's accelerated
    gradient. Run in the examples' span (x = U S Vt: n features, not dim), which gives the same minimiser."""
    n = x.shape[0]
    sw = np.ones(n) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    sw = sw / sw.sum()
    u, s, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    keep = s > 1e-6 * (s[0] if len(s) else 1.0)
    z, v = u[:, keep] * s[keep], vt[keep].T  # x = z @ v.T
    onehot = np.zeros((n, k))
    onehot[np.arange(n), y] = 1.0
    # A bound on the gradient's Lipschitz constant: softmax's Hessian is below I/2 per example, and the largest
    # eigenvalue of the weighted Gram matrix is below its trace (the bias is one more unit feature).
    lipschitz = 0.5 * (float(np.sum(sw[:, None] * z * z)) + 1.0) + l2
    step = 1.0 / lipschitz
    w = (v.T @ start[0]) if start is not None else np.zeros((z.shape[1], k))
    b = start[1].astype(np.float64).copy() if start is not None else np.zeros(k)
    w_prev, b_prev = w.copy(), b.copy()
    for t in range(1, iterations + 1):
        mom = (t - 1) / (t + 2)
        wy, by = w + mom * (w - w_prev), b + mom * (b - b_prev)
        g = (_softmax(z @ wy + by) - onehot) * sw[:, None]
        w_prev, b_prev = w, b
        w = wy - step * (z.T @ g + l2 * wy)
        b = by - step * g.sum(axis=0)
    return v @ w, b


def _temperature(x: np.ndarray, y: np.ndarray, k: int, sw: np.ndarray, folds: int = 5) -> float:
    """The temperature that minimises the log-loss of held-out folds (each example scored by a fit without it)."""
    n = len(y)
    if n < 2 * folds:
        return 1.0
    order = np.random.default_rng(0).permutation(n)
    logits = np.zeros((n, k))
    for f in range(folds):
        test = order[f::folds]
        train = np.setdiff1d(order, test)
        w, b = fit_softmax(x[train], y[train], k, sw[train], iterations=250)
        logits[test] = x[test] @ w + b
    best, best_loss = 1.0, float("inf")
    for t in _TEMPERATURES:
        p = _softmax(logits / t)[np.arange(n), y]
        loss = -float(np.sum(sw * np.log(np.maximum(p, 1e-12))) / sw.sum())
        if loss < best_loss:
            best, best_loss = t, loss
    return best


def _catalog_examples(per_type: int) -> list[tuple[str, str, str, str]]:
    """(id, root, context, failure_type) of up to `per_type` catalog entries per learnable type whose label a
    source or a rule settled (not the owner's or a library's default), chosen by id so the set is stable."""
    if per_type <= 0 or not CATALOG_PATH.is_file():
        return []
    by_type: dict[str, list[tuple[str, str, str, str]]] = {}
    with gzip.open(CATALOG_PATH, "rt", encoding="utf-8") as f:
        for line in f:
            raw = json.loads(line)
            ft = raw.get("failure_type", "")
            if not str(raw.get("label_by", "")).startswith(_CATALOG_LABELLED_BY) or not is_learnable(ft) \
                    or category_of(ft) is None:
                continue
            template = str(raw.get("template", "")).splitlines()[0] if raw.get("template") else ""
            if not template:
                continue
            exc = raw.get("qualified") or raw.get("exception")
            text = f"{exc}: {template}" if exc else template
            by_type.setdefault(ft, []).append((f"catalog:{raw['id']}", mask(text), mask(text), ft))
    out = []
    for ft in sorted(by_type):
        out.extend(sorted(by_type[ft])[:per_type])
    return out


@cache
def _catalog_stamp() -> str:
    try:
        return hashlib.sha256(META_PATH.read_bytes()).hexdigest()[:12]
    except OSError:
        return "none"


class Arbiter:
    """The stage (cascade.py: ``Diagnoser.arbiter``): ``score(ctx, votes, exclude_ids=...)`` -> a StageVote
    from source "arbiter", or one with no scores and a note saying why it abstained."""

    name = "arbiter"

    def __init__(self, retriever: Retriever, settings: ArbiterSettings | None = None, *,
                 cache_dir: Path | None = None) -> None:
        self.retriever = retriever
        self.settings = settings or ArbiterSettings()
        self.cache_dir = cache_dir
        self._lock = threading.Lock()
        self._fit: ArbiterFit | None = None
        self._catalog: tuple[list[tuple[str, str, str, str]], np.ndarray] | None = None
        self._held_out: dict[tuple[str, frozenset[str]], ArbiterFit] = {}
        self.fits = 0  # fits computed in this process (not read from the cache): a test's count

    # -- the vote ---------------------------------------------------------------------------------------

    def score(self, ctx: FailureContext, votes: Sequence[StageVote] = (), *,
              exclude_ids: Sequence[str] = ()) -> StageVote:
        if not ctx.as_query().strip():
            return StageVote(source=self.name, scores=[], note="arbiter abstains: empty failure context")
        fit = self.fitted(exclude_ids)
        if fit is None or not fit.classes:
            return StageVote(source=self.name, scores=[], note="arbiter abstains: no labelled examples to learn from")
        exc = exception_class(ctx.exception_type) or exception_class(ctx.root_text or ctx.root_masked)
        q = fit.features(self.retriever.query_vector(ctx), exc)
        p = fit.probabilities(q)
        order = np.argsort(-p)
        sims = fit.similarities(q)
        nearest = self._nearest(fit, sims)
        best_sim = float(sims.max()) if sims.size else 0.0
        top = int(order[0])
        s = self.settings
        if best_sim < s.min_similarity or p[top] < s.min_probability:
            why = (f"no example within similarity {s.min_similarity:.2f} (best {best_sim:.2f})"
                   if best_sim < s.min_similarity else
                   f"its best label, {_name(fit.classes[top])}, has p = {p[top]:.2f} < {s.min_probability:.2f}")
            unknown = self._unknown(fit, nearest, with_check=best_sim >= s.min_similarity)
            return StageVote(source=self.name, scores=[], note=f"arbiter abstains ({why}): {unknown}")
        scores = [(_label(fit.classes[int(i)]), round(float(p[int(i)]), 4)) for i in order[:3] if p[int(i)] >= 0.01]
        want = fit.classes[top]
        evidence = [Evidence(line_no=None, text=format_neighbour_evidence(_label(fit.classes[fit.targets[i]]), sim, text),
                             source=f"arbiter:{name}")
                    for i, name, sim, text in nearest if fit.classes[fit.targets[i]] == want][:3]
        runner_up = f"; then {_name(fit.classes[int(order[1])])} (p = {p[int(order[1])]:.2f})" if len(order) > 1 else ""
        note = f"arbiter: {_name(want)} (p = {p[top]:.2f}){runner_up}"
        return StageVote(source=self.name, scores=scores, evidence=evidence, note=note)

    def _nearest(self, fit: ArbiterFit, sims: np.ndarray, n: int = 3) -> list[tuple[int, str, float, str]]:
        """The closest examples: (row, name, similarity, text)."""
        rows = [int(i) for i in np.argsort(-sims)[:n]] if sims.size else []
        ids = [fit.names[i] for i in rows if not fit.names[i].startswith("catalog:")]
        by_id = self.retriever.incidents.get_many(ids) if ids else {}
        out = []
        for i in rows:
            name = fit.names[i]
            inc = by_id.get(name)
            out.append((i, name, float(sims[i]), inc.root_line if inc is not None else name))
        return out

    @staticmethod
    def _unknown(fit: ArbiterFit, nearest: list[tuple[int, str, float, str]], *, with_check: bool) -> str:
        """What an abstention tells a person: the closest examples, and the check the nearest one's type names
        (none when even the nearest is unlike the failure)."""
        if not nearest:
            return "unknown: no past incident to compare with"
        parts = ", ".join(f"{name} {_name(fit.classes[fit.targets[i]])} ({sim:.2f})" for i, name, sim, _ in nearest[:2])
        spec = taxonomy().types.get(fit.classes[fit.targets[nearest[0][0]]][1]) if with_check else None
        check = spec.check if spec is not None and spec.check else ""
        check = check.replace("{host}", "the node that printed it").replace("{rank}", "each rank")
        return f"unknown: the nearest incidents are {parts}" + (f"; check {check}" if check else "")

    # -- the fit ----------------------------------------------------------------------------------------

    def fitted(self, exclude_ids: Sequence[str] = ()) -> ArbiterFit | None:
        """The fit for the incidents as they are now (refit when they changed), without `exclude_ids`."""
        with self._lock:
            key = self._key(self.retriever.fingerprint())
            if self._fit is None or self._fit.key != key:
                ids, vecs, fingerprint = self.retriever.vectors()  # read back only when the incidents changed
                key = self._key(fingerprint)
                self._held_out.clear()
                self._fit = self._load(key) or self._compute(key, ids, vecs)
            excluded = frozenset(exclude_ids) & set(self._fit.names)
            if not excluded:
                return self._fit
            cached = self._held_out.get((key, excluded))
            if cached is None:
                cached = self._without(self._fit, excluded)
                if len(self._held_out) > 256:
                    self._held_out.clear()
                self._held_out[(key, excluded)] = cached
            return cached

    def _key(self, fingerprint: str) -> str:
        return hashlib.sha256(f"{_FORMAT}|{self.retriever.layout}|{fingerprint}|{_catalog_stamp()}|"
                              f"{self.settings.catalog_per_type}|{_L2}".encode()).hexdigest()[:16]

    def _examples(self, ids: list[str], vecs: np.ndarray
                  ) -> tuple[list[str], np.ndarray, list[_Key], np.ndarray, list[str]]:
        incidents = self.retriever.incidents.get_many(ids)
        names, rows, labels, weights, excs = [], [], [], [], []
        for n, i in enumerate(ids):
            inc = incidents.get(i)
            if inc is None or not is_learnable(inc.failure_type) or category_of(inc.failure_type) is None:
                continue
            names.append(i)
            rows.append(vecs[n])
            labels.append((inc.category, inc.failure_type))
            weights.append(1.0)
            excs.append(exception_class(inc.root_line))
        cat_entries, cat_vecs = self._catalog_vectors()
        for (cid, root, _, ft), vec in zip(cat_entries, cat_vecs):
            cat = category_of(ft)
            assert cat is not None
            names.append(cid)
            rows.append(vec)
            labels.append((cat, ft))
            weights.append(_CATALOG_WEIGHT)
            excs.append(exception_class(root))
        vocabulary = sorted({e for e in excs if e})
        dim = vecs.shape[1] if vecs.ndim == 2 else 0
        x = np.asarray([np.concatenate([np.asarray(r, dtype=np.float64), _exception_features(vocabulary, e)])
                        for r, e in zip(rows, excs)]).reshape(len(rows), dim + len(vocabulary))
        return names, x, labels, np.asarray(weights), vocabulary

    def _catalog_vectors(self) -> tuple[list[tuple[str, str, str, str]], np.ndarray]:
        if self._catalog is None:
            entries = _catalog_examples(self.settings.catalog_per_type)
            path = self._cache_path(f"catalog-{_catalog_stamp()}-{self.settings.catalog_per_type}-"
                                    f"{hashlib.sha256(self.retriever.layout.encode()).hexdigest()[:8]}")
            vecs = None
            if path is not None and path.is_file():
                try:
                    with np.load(path) as data:
                        if list(data["ids"]) == [e[0] for e in entries]:
                            vecs = data["vectors"]
                except (OSError, ValueError, KeyError):
                    vecs = None
            if vecs is None:
                vecs = self.retriever.embed_pairs([(r, f) for _, r, f, _ in entries]) if entries else \
                    np.zeros((0, 0), dtype=np.float32)
                self._save(path, ids=np.asarray([e[0] for e in entries]), vectors=vecs)
            self._catalog = (entries, np.asarray(vecs))
        return self._catalog

    def _compute(self, key: str, ids: list[str], vecs: np.ndarray) -> ArbiterFit:
        names, x, labels, sw, vocabulary = self._examples(ids, vecs)
        classes = sorted(set(labels), key=lambda c: (c[0].value, c[1]))
        index = {c: n for n, c in enumerate(classes)}
        y = np.asarray([index[c] for c in labels], dtype=np.int64)
        if len(classes) < 2:
            w, b, t = np.zeros((x.shape[1], len(classes))), np.zeros(len(classes)), 1.0
        else:
            w, b = fit_softmax(x, y, len(classes), sw)
            t = _temperature(x, y, len(classes), sw)
        self.fits += 1
        fit = ArbiterFit(classes, w, b, t, x, names, y, key, vocabulary)
        self._save(self._cache_path(f"arbiter-{key}"), weights=w, bias=b, temperature=np.asarray(t), vectors=x,
                   names=np.asarray(names), targets=y, exceptions=np.asarray(vocabulary, dtype=str),
                   classes=np.asarray([f"{c[0].value}/{c[1]}" for c in classes]))
        log.info("arbiter fitted on %d examples, %d classes, temperature %.2f", len(y), len(classes), t)
        return fit

    def _without(self, fit: ArbiterFit, excluded: frozenset[str]) -> ArbiterFit:
        """The fit without some examples (leave-one-out evaluation): warm-started from the full fit."""
        keep = np.asarray([n not in excluded for n in fit.names])
        x, y = fit.vectors[keep], fit.targets[keep]
        sw = np.asarray([_CATALOG_WEIGHT if n.startswith("catalog:") else 1.0 for n in fit.names])[keep]
        present = sorted({int(c) for c in y})
        remap = {c: n for n, c in enumerate(present)}
        w, b = fit_softmax(x, np.asarray([remap[int(c)] for c in y]), len(present), sw, iterations=200,
                           start=(fit.weights[:, present], fit.bias[present]))
        names = [n for n, k in zip(fit.names, keep) if k]
        self.fits += 1
        return ArbiterFit([fit.classes[c] for c in present], w, b, fit.temperature, x, names,
                          np.asarray([remap[int(c)] for c in y]), fit.key, fit.exceptions)

    # -- the cache --------------------------------------------------------------------------------------

    def _cache_path(self, stem: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{stem}.npz"

    @staticmethod
    def _save(path: Path | None, **arrays: np.ndarray) -> None:
        if path is None:
            return
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}.npz")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, **arrays)  # type: ignore[arg-type]
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not cache the arbiter's fit at %s: %s", path, e)
        finally:
            tmp.unlink(missing_ok=True)

    def _load(self, key: str) -> ArbiterFit | None:
        path = self._cache_path(f"arbiter-{key}")
        if path is None or not path.is_file():
            return None
        try:
            with np.load(path) as d:
                classes: list[_Key] = []
                for c in d["classes"]:
                    cat, _, ft = str(c).partition("/")
                    classes.append((Category(cat), ft))
                return ArbiterFit(classes, d["weights"], d["bias"], float(d["temperature"]), d["vectors"],
                                  [str(n) for n in d["names"]], d["targets"], key, [str(e) for e in d["exceptions"]])
        except (OSError, ValueError, KeyError) as e:
            log.info("arbiter cache %s not usable (%s): refitting", path, e)
            return None


def _label(key: _Key) -> Label:
    return Label(key[0], key[1], default_action(*key))


def _name(key: _Key) -> str:
    return f"{key[0].value}/{key[1]}"
