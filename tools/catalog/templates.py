"""Message templates: the constant text of an error message with each variable part as `<*>`
(logdx.patterns.PARAM, the wildcard of the log-line mask), and the record one raise site becomes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from logdx.diagnose.catalog import content_words
from logdx.patterns import PARAM

WILD = PARAM
_WILD_RUN = re.compile(r"(?:<\*>)(?:\s*<\*>)*")
_SPACES = re.compile(r"[ \t]+")
# printf conversions: "%s", "%d", "%-8.3f", "%lu", "%zu", "%p", "%(name)s", and NCCL's "%ld" etc.
_PRINTF = re.compile(r"%%|%(?:\([^)]*\))?[-+ #0']*(?:\*|\d+)?(?:\.(?:\*|\d+))?"
                     r"(?:hh|h|ll|l|L|q|j|z|Z|t)?[diouxXeEfFgGaAcspn]")
# str.format / Rust format! fields: "{}", "{0}", "{name!r:>10}", "{:?}"; doubled braces are literal.
_FORMAT_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_MAX_TEMPLATE = 2000


def printf_to_wild(text: str) -> str:
    return _PRINTF.sub(lambda m: "%" if m.group() == "%%" else WILD, text)


def format_to_wild(text: str) -> str:
    return _FORMAT_FIELD.sub(lambda m: {"{{": "{", "}}": "}"}.get(m.group(), WILD), text)


def tidy(template: str) -> str:
    """One spelling per template: runs of wildcards merged, spaces collapsed, each line stripped,
    blank lines dropped, bounded length."""
    lines = [_SPACES.sub(" ", _WILD_RUN.sub(WILD, line)).strip() for line in template.splitlines()]
    return "\n".join(line for line in lines if line)[:_MAX_TEMPLATE]


def is_informative(template: str, min_words: int = 2, min_letters: int = 8) -> bool:
    """Whether a template says enough to recognise a line by: a bare wildcard, a lone word or
    "<*> is not defined" does not. Counted in content words, the same the matcher compares."""
    words = content_words(template)
    return len(words) >= min_words and sum(len(w) for w in words) >= min_letters


@dataclass(slots=True)
class Site:
    """One place an error message comes from, before labelling and de-duplication."""

    source: str  # python | cython | cxx | rust | nccl | cudart | xid
    package: str  # the distribution it was read from ("torch", "nvidia-nccl-cu12", "xid")
    template: str
    exception: str | None = None  # the class as written at the raise site
    qualified: str | None = None  # the class's dotted name, when the imports resolve it
    module: str | None = None  # dotted module that raises it
    file: str | None = None  # path inside the release
    line: int | None = None
    name: str | None = None  # a symbolic name: cudaError_t enumerator, "Xid 79"
    code: int | None = None  # numeric code: cudaError_t value, Xid number
    failure_type: str | None = None  # set by a source that knows its own label (the Xid table)
    extra: dict[str, object] = field(default_factory=dict)
