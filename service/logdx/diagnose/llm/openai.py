"""The OpenAI-compatible backend: any chat endpoint (vLLM, llama.cpp server, Ollama, hosted). It asks
for a JSON object, validates it with pydantic (labels must be canonical), retries once on an
invalid reply, then gives up (the stage's vote then says why)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from logdx.config import LLMSettings
from logdx.diagnose.llm.labels import candidate_labels, example_dict, query_lines
from logdx.diagnose.llm.prompts import Prompts
from logdx.diagnose.llm.stage import BaseStage, ExampleSource, LLMUnavailable
from logdx.model import Action, Category, Evidence, FailureContext, Label, StageVote
from logdx.taxonomy import default_action, failure_types_of, is_canonical, taxonomy

TEMPERATURE = 0.0
MAX_TOKENS = 400


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
        headers = {"Content-Type": "application/json"}
        if settings.api_key:
            headers["Authorization"] = f"Bearer {settings.api_key}"
        self._http = client or httpx.Client(timeout=httpx.Timeout(settings.timeout_s), headers=headers)
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
            failure_types={c.value: list(ts) for c, ts in taxonomy().by_category().items() if c is not Category.UNKNOWN},
        )
        user = self.prompts.render(
            "chat/user.j2",
            examples=[example_dict(e) for e in list(examples)[: self.settings.max_examples]],
            candidates=cands if prior_votes else [],
            exception_type=ctx.exception_type,
            lines=query_lines(ctx, 20),
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _complete(self, messages: list[dict[str, str]]) -> str:
        import httpx

        payload: dict[str, Any] = {
            "model": self.settings.model,
            "messages": messages,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
        }
        if self.settings.json_mode:
            payload["response_format"] = {"type": "json_object"}
        self.last_request = payload
        self.attempts += 1
        url = self.settings.base_url.rstrip("/") + "/chat/completions"
        try:
            resp = self._http.post(url, json=payload)
        except httpx.TimeoutException as e:
            raise LLMUnavailable(f"timeout after {self.settings.timeout_s:g}s") from e
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
        lines = query_lines(ctx, 20)
        root = ctx.root_text
        if answer.root_line_no is not None and answer.root_line_no <= len(lines):
            root = lines[answer.root_line_no - 1]
        evidence = [Evidence(line_no=None, text=root, source=f"llm:{self.name}")] if root else []
        return StageVote(
            source="llm", scores=[(label, answer.confidence)], evidence=evidence,
            explanation=" ".join(answer.explanation.split()) or None,
        )
