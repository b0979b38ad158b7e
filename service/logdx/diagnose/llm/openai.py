"""The OpenAI-compatible backend: any chat endpoint (vLLM, llama.cpp's server, Ollama, hosted).

**The reply's shape is sent, not only described.** Small models behind a generic server answer `{}`
to "reply with a JSON object"; given the schema, the server constrains decoding to it (a grammar in
llama.cpp, guided decoding in vLLM). `llm.response_format`:

- `json_schema`: `{"type": "json_schema", "json_schema": {"name", "strict", "schema"}}` (OpenAI's
  structured output: vLLM, llama.cpp's llama-server, Ollama, OpenAI);
- `json_object`: `{"type": "json_object"}` (any JSON object; with `auto` the schema rides along as
  `"schema"`, which llama-cpp-python's server reads);
- `none`: the prompt alone;
- `auto` (default): `json_schema`, and where the server refuses it (HTTP 400, 415, 422, 501, or a 500
  that names the format), `json_object` with the schema, then `json_object`, then `none`. The first
  format the server accepts is kept for the life of the process.

The reply is then validated with pydantic (labels must be canonical); an invalid reply is retried
once with the reason, then the stage gives up (its vote says why).

**Time.** The request streams (`stream: true`), so three budgets are told apart: connecting
(`connect_timeout_s`), the first token (`first_token_timeout_s`: a cold server loads its model
then; 40 s is common), and the rest of the reply after it (`timeout_s`). A server that does not
stream answers in one piece, within the first-token budget. `load()` (called when `logdx serve`
starts) sends one tiny request in the background, with `warmup_timeout_s`, so the model is loaded
and the response format settled before the first diagnosis needs them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from logdx.compress import has_error_word
from logdx.config import LLMSettings
from logdx.diagnose.llm.labels import candidate_labels, example_dict, near_misses, proposed_labels, query_lines
from logdx.diagnose.llm.prompts import Prompts
from logdx.diagnose.llm.redact import Redactor, redacts
from logdx.diagnose.llm.stage import BaseStage, ExampleSource, LLMUnavailable
from logdx.model import Action, Category, Evidence, FailureContext, Label, StageVote
from logdx.taxonomy import action_meanings, default_action, failure_types_of, is_canonical, taxonomy

log = logging.getLogger(__name__)

TEMPERATURE = 0.0
MAX_TOKENS = 400
SCHEMA_NAME = "logdx_diagnosis"
# What `auto` tries, in order, until the server accepts one.
FORMATS_AUTO = ("json_schema", "json_object_schema", "json_object", "none")
_REFUSED_STATUSES = frozenset({400, 415, 422, 501})
_NAMES_THE_FORMAT = re.compile(r"response_format|json_schema|json_object|schema|grammar", re.IGNORECASE)


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
            allowed = ", ".join(failure_types_of(self.category))
            raise ValueError(
                f"failure_type {self.failure_type!r} is not allowed for category {self.category.value} "
                f"(allowed: {allowed})"
            )
        if self.action is Action.NONE:
            raise ValueError("action 'none' is only for healthy jobs")
        return self


def reply_schema() -> dict[str, Any]:
    """The JSON schema of `LLMAnswer`, from the taxonomy: enums for the labels, every field required
    (OpenAI's strict mode wants that; `root_line_no` may be null), no bounds a grammar converter
    might not know (pydantic checks those). Properties in the order a model should think: the
    category before the type, the explanation last."""
    by_category = {c: ts for c, ts in taxonomy().by_category().items() if c is not Category.UNKNOWN}
    failure_types = sorted({t for ts in by_category.values() for t in ts})
    actions = [a.value for a in Action if a is not Action.NONE]
    properties: dict[str, Any] = {
        "category": {"type": "string", "enum": [c.value for c in by_category]},
        "failure_type": {"type": "string", "enum": failure_types},
        "action": {"type": "string", "enum": actions},
        "confidence": {"type": "number"},
        "root_line_no": {"type": ["integer", "null"]},
        "explanation": {"type": "string"},
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def response_format(fmt: str, schema: dict[str, Any]) -> dict[str, Any] | None:
    """The `response_format` request field of one format (None: the field is left out)."""
    if fmt == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "strict": True, "schema": schema}}
    if fmt == "json_object_schema":
        return {"type": "json_object", "schema": schema}
    if fmt == "json_object":
        return {"type": "json_object"}
    return None


class _InvalidReply(ValueError):
    pass


class _FormatRefused(LLMUnavailable):
    """The server refused the request's response_format (auto then tries the next one)."""


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


class OpenAICompatibleClient(BaseStage):
    """Diagnosis by a chat model behind an OpenAI-compatible /chat/completions endpoint."""

    name = "openai"

    def __init__(
        self,
        settings: LLMSettings,
        prompts: Prompts | None = None,
        *,
        examples: ExampleSource | None = None,
        client: Any = None,
    ) -> None:
        import httpx

        super().__init__(examples)
        self.settings = settings
        self.prompts = prompts or Prompts()
        self.schema = reply_schema()
        self.redacts = redacts(settings.redact, settings.base_url)  # names masked before they leave (redact.py)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if settings.api_key:
            headers["Authorization"] = f"Bearer {settings.api_key}"
        # The read timeout is the longest wait for the next bytes: until the first token it is the
        # first-token budget; the rest of the reply has a deadline of its own (see _read_stream).
        timeout = httpx.Timeout(settings.first_token_timeout_s, connect=settings.connect_timeout_s)
        self._http = client or httpx.Client(timeout=timeout, headers=headers)
        self._lock = threading.Lock()
        auto = settings.response_format == "auto"
        self._formats: tuple[str, ...] = FORMATS_AUTO if auto else (settings.response_format,)
        self.response_format = self._formats[0]  # the one in use (auto: the first the server accepted)
        self._format_settled = not auto
        self.last_request: dict[str, Any] | None = None  # the last payload sent (for debugging)
        self.attempts = 0  # requests made by the last vote
        self.warmup: dict[str, Any] = {}  # what the warm-up found: ok, seconds, response_format, error

    def close(self) -> None:
        self._http.close()

    # -- the request ----------------------------------------------------------------------------

    def messages(
        self, ctx: FailureContext, prior_votes: Sequence[StageVote] = (), examples: Sequence[Any] = (),
        redactor: Redactor | None = None,
    ) -> list[dict[str, str]]:
        """The request's messages; with a `redactor`, the log's names masked (what goes to a hosted model)."""
        near = near_misses(prior_votes, examples)
        cands = [f"{lab.category.value}/{lab.failure_type}" for lab in candidate_labels(prior_votes, ctx, 8, near)]
        user = self.prompts.render(
            "chat/user.j2",
            examples=[example_dict(e) for e in list(examples)[: self.settings.max_examples]],
            candidates=cands if prior_votes or near else [],
            exception_type=ctx.exception_type,
            lines=query_lines(ctx, 20),
        )
        if redactor is not None:
            user = redactor.mask(user)
        return [{"role": "system", "content": self._system()}, {"role": "user", "content": user}]

    def _system(self) -> str:
        return self.prompts.render(
            "chat/system.j2",
            failure_types={c.value: list(ts) for c, ts in taxonomy().by_category().items() if c is not Category.UNKNOWN},
            actions=action_meanings(),
        )

    def _payload(self, messages: list[dict[str, str]], fmt: str, max_tokens: int) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": self.settings.model, "messages": messages, "temperature": TEMPERATURE,
                                   "max_tokens": max_tokens, "stream": True}
        rf = response_format(fmt, self.schema)
        if rf is not None:
            payload["response_format"] = rf
        return payload

    def _complete(self, messages: list[dict[str, str]], *, max_tokens: int = MAX_TOKENS,
                  first_token_s: float | None = None) -> str:
        """One completion in the format in use; under `auto`, a refused format moves to the next one
        (settled at the first success). Raises LLMUnavailable or _InvalidReply."""
        with self._lock:
            formats = self._formats[self._formats.index(self.response_format):]
        for i, fmt in enumerate(formats):
            try:
                content = self._post(self._payload(messages, fmt, max_tokens), first_token_s)
            except _FormatRefused as e:
                if self._format_settled or i == len(formats) - 1:
                    raise LLMUnavailable(str(e)) from e
                log.warning("llm: the server refused response_format %s (%s); trying %s", fmt, e, formats[i + 1])
                continue
            with self._lock:
                if not self._format_settled:
                    self.response_format, self._format_settled = fmt, True
            return content
        raise LLMUnavailable("no response format accepted")  # unreachable: the last one raises

    def _post(self, payload: dict[str, Any], first_token_s: float | None) -> str:
        import httpx

        self.last_request = payload
        self.attempts += 1
        url = self.settings.base_url.rstrip("/") + "/chat/completions"
        budget = first_token_s or self.settings.first_token_timeout_s
        timeout = httpx.Timeout(budget, connect=self.settings.connect_timeout_s)
        try:
            with self._http.stream("POST", url, json=payload, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    body = resp.read().decode("utf-8", "replace")[:300]
                    why = f"HTTP {resp.status_code} from {url}: {body}"
                    if "response_format" in payload and _refuses_format(resp.status_code, body):
                        raise _FormatRefused(why)
                    raise LLMUnavailable(why)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    return self._read_stream(resp.iter_lines())
                return _message_content(resp.read())
        except httpx.ConnectTimeout as e:
            raise LLMUnavailable(f"cannot connect to {url} within {self.settings.connect_timeout_s:g}s") from e
        except httpx.ReadTimeout as e:
            raise LLMUnavailable(f"no first token within {budget:g}s from {url} (llm.first_token_timeout_s)") from e
        except httpx.TimeoutException as e:
            raise LLMUnavailable(f"timeout talking to {url}: {type(e).__name__}") from e
        except httpx.HTTPError as e:
            raise LLMUnavailable(f"cannot reach {url}: {type(e).__name__}: {e}") from e

    def _read_stream(self, lines: Iterator[str]) -> str:
        """The content of a streamed completion (server-sent events), within `timeout_s` of its first token."""
        import httpx

        parts: list[str] = []
        deadline: float | None = None
        try:
            for line in lines:
                if deadline is not None and time.monotonic() > deadline:
                    raise LLMUnavailable(f"the reply did not finish within {self.settings.timeout_s:g}s of its "
                                         "first token (llm.timeout_s)")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError as e:
                    raise _InvalidReply(f"not a chat completion stream: {data[:200]}") from e
                if isinstance(chunk, dict) and chunk.get("error"):
                    raise LLMUnavailable(f"the server failed mid-reply: {str(chunk['error'])[:200]}")
                if deadline is None:
                    deadline = time.monotonic() + self.settings.timeout_s
                parts.append(_delta_content(chunk))
        except httpx.ReadTimeout as e:
            if deadline is None:
                raise
            raise LLMUnavailable("the reply stalled after its first token (llm.timeout_s)") from e
        return "".join(parts)

    # -- the answer -----------------------------------------------------------------------------

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
        redactor = Redactor(ctx.hosts) if self.redacts else None
        answer = self.ask(self.messages(ctx, prior_votes, examples, redactor))
        explanation = redactor.unmask(answer.explanation) if redactor is not None else answer.explanation
        action = answer.action or default_action(answer.category, answer.failure_type)
        label = Label(answer.category, answer.failure_type, action)
        # The same guard as the embedded model's: a label no rule, exception or past incident proposed may be
        # what the server says, never what decides.
        if (label.category.value, label.failure_type) not in proposed_labels(prior_votes, ctx, near_misses(prior_votes, examples)):
            return StageVote(source="llm", scores=[], note=(
                f"llm abstains: the server's label, {label.category.value}/{label.failure_type} "
                f"(it said p={answer.confidence:.2f}), is one no rule, exception or past incident proposed"))
        notes = []
        root = ctx.root_text
        line = _root_line(query_lines(ctx, 20), answer.root_line_no)
        if line is not None:
            root = line
        elif answer.root_line_no is not None:
            notes.append(f"llm: its root_line_no {answer.root_line_no} is no error-bearing line of those it was "
                         "shown: the rules' root line stands")
        # A model's own confidence is not calibrated (small ones say 0.9 whatever they read): capped.
        confidence = min(answer.confidence, self.settings.server_max_confidence)
        evidence = [Evidence(line_no=None, text=root, source=f"llm:{self.name}")] if root else []
        return StageVote(
            source="llm", scores=[(label, confidence)], evidence=evidence,
            explanation=" ".join(explanation.split()) or None, note="; ".join(notes) or None,
        )

    # -- warm-up --------------------------------------------------------------------------------

    def load(self) -> threading.Thread | None:
        """Warm the server in the background (`llm.warmup_timeout_s`; 0: not at all): one request of
        one token with the system prompt and the response format, so a cold server loads its model
        (and caches the prompt's prefix) now, and `auto` settles the format, before a diagnosis
        waits on them. Never raises; what it found is in `warmup` and the log."""
        if self.settings.warmup_timeout_s <= 0 or self.warmup:
            return None
        self.warmup = {"ok": None}
        thread = threading.Thread(target=self.warm, name="logdx-llm-warmup", daemon=True)
        thread.start()
        return thread

    def warm(self) -> dict[str, Any]:
        """The warm-up request itself (in the caller's thread)."""
        messages = [{"role": "system", "content": self._system()},
                    {"role": "user", "content": "Warm-up request: answer with the JSON object for an empty log."}]
        t0 = time.perf_counter()
        try:
            self._complete(messages, max_tokens=1, first_token_s=self.settings.warmup_timeout_s)
        except (LLMUnavailable, _InvalidReply) as e:
            self.warmup = {"ok": False, "seconds": round(time.perf_counter() - t0, 2), "error": str(e)}
            log.warning("llm: warm-up of %s failed after %.1fs: %s", self.settings.base_url,
                        self.warmup["seconds"], e)
            return self.warmup
        self.warmup = {"ok": True, "seconds": round(time.perf_counter() - t0, 2),
                       "response_format": self.response_format}
        log.info("llm: %s warm in %.1fs (response_format %s)", self.settings.base_url, self.warmup["seconds"],
                 self.response_format)
        return self.warmup


def _refuses_format(status: int, body: str) -> bool:
    """Whether an error answer refuses the request's shape (rather than the server being down)."""
    return status in _REFUSED_STATUSES or (status >= 500 and _NAMES_THE_FORMAT.search(body) is not None)


def _delta_content(chunk: Any) -> str:
    try:
        choice = chunk["choices"][0]
    except (KeyError, IndexError, TypeError):
        return ""  # keep-alives, usage chunks
    piece = (choice.get("delta") or choice.get("message") or {}).get("content") if isinstance(choice, dict) else None
    return piece if isinstance(piece, str) else ""


def _message_content(body: bytes) -> str:
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise _InvalidReply(f"not a chat completion response: {body[:200].decode('utf-8', 'replace')}") from e
    if not isinstance(content, str):
        raise _InvalidReply("the reply has no text content")
    return content


def _root_line(lines: Sequence[str], line_no: int | None) -> str | None:
    """The line a reply names as the root, when it is one of the lines shown and bears an error word."""
    if line_no is None or not 1 <= line_no <= len(lines):
        return None
    line = lines[line_no - 1]
    return line if has_error_word(line) else None
