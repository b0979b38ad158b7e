"""Argv templates: commands logdx runs with values from a diagnosis, never through a shell.

A string template is split into words the way a shell would (quotes group words) once, when it is
read; then each `{name}` placeholder is filled inside its word. Whatever a value holds (spaces,
quotes, `$(...)`) it stays inside that one argument: nothing parses it again. A list is taken word
for word. A placeholder inside a shell's `-c` script text is refused, since that shell would parse
the value as code: pass values as the script's arguments (`sh -c '... "$1" ...' sh {job_id}`).

Standard library only: `logdx.config` checks templates with it when the settings are read.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence

__all__ = ["HEALTH_CHECK_PLACEHOLDERS", "RESTART_PLACEHOLDERS", "TemplateError", "fill_argv", "parse_template"]

# What `actions.restart_command` and `actions.health_check_command` may say.
RESTART_PLACEHOLDERS = ("job_id", "tenant", "report_id", "category", "failure_type", "action", "hosts", "node",
                        "confidence")
HEALTH_CHECK_PLACEHOLDERS = ("node",)

_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "fish", "busybox"})
_ANY_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


class TemplateError(ValueError):
    """An argv template that cannot be used safely; the message says why."""


def parse_template(template: str | Sequence[str], placeholders: Sequence[str]) -> list[str]:
    """The words of an argv template, checked: not empty, and no placeholder inside a shell's `-c`
    script (the shell would parse the value as code)."""
    try:
        words = shlex.split(template) if isinstance(template, str) else [str(w) for w in template]
    except ValueError as e:
        raise TemplateError(f"cannot split {template!r}: {e}") from None
    if not words:
        raise TemplateError("empty command")
    pattern = re.compile(r"\{(" + "|".join(map(re.escape, placeholders)) + r")\}")
    for shell, script in _scripts(words):
        if pattern.search(script):
            raise TemplateError(
                f"{shell} -c script text holds a placeholder: its value would be parsed by the shell; "
                "pass it as an argument instead (sh -c '... \"$1\" ...' sh {job_id}) or call a script")
    return words


def _scripts(words: Sequence[str]) -> list[tuple[str, str]]:
    """(shell, script text) of every shell the command runs with a script, wherever it stands: after
    `env`, `nice`, `timeout 5`, `sudo -u x`... and with the `c` among other options (`sh -ec`,
    `bash -xc`, `bash -o pipefail -c`)."""
    out = []
    for i, word in enumerate(words):
        if os.path.basename(word) not in _SHELLS:
            continue
        j = i + 1
        while j < len(words) and words[j].startswith("-") and words[j] not in ("-", "--"):
            option = words[j]
            if option in ("-o", "+o", "-O", "+O") and j + 1 < len(words):
                j += 2  # an option with its argument (bash -o pipefail)
                continue
            if not option.startswith("--") and "c" in option[1:]:
                if j + 1 < len(words):
                    out.append((word, words[j + 1]))
                break
            j += 1
    return out


def fill_argv(words: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Each word with its `{name}` placeholders (names in `values`) replaced by the values, as is
    (no quoting is needed: no shell reads them). Other braces (`awk '{print $1}'`) are left alone."""
    def sub(m: re.Match[str]) -> str:
        return values[m.group(1)] if m.group(1) in values else m.group(0)

    return [_ANY_PLACEHOLDER.sub(sub, w) if "{" in w else w for w in words]
