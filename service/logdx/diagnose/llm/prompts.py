"""Prompt templates: Jinja2 files under ``prompts/`` (see prompts/README.md), never strings in code.

Log text is untrusted: it is fenced between <log> markers, fence-like and chat-control text inside
it is neutralised (``neutralize``), and the instructions tell the model never to follow
instructions from inside the fence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2

# The prompts/ folder of the source tree; an installed logdx is given its own (llm.prompts_dir).
REPO_PROMPTS = Path(__file__).resolve().parents[4] / "prompts"
MAX_LINE_CHARS = 400  # per log line in a prompt: one 10 MB line must not become the prompt

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


def neutralize(text: object, limit: int = MAX_LINE_CHARS) -> str:
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
        self.directory = Path(directory or REPO_PROMPTS)
        if not self.directory.is_dir():
            raise PromptError(f"{self.directory}: prompt directory not found (set llm.prompts_dir)")
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
