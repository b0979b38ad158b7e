"""Where an exception was raised, and what that says about it.

The innermost frame that is not a pass-through decides: the user's own code (a script failure),
or an installed library. Inside a library, the module that raised it names the failure type of an
error nobody wrote a rule for, through the taxonomy's owners (`logdx/taxonomy.yaml`): a
`pyarrow.lib.ArrowInvalid` is a dataset that does not load, a `ZeRORuntimeException` an error
inside DeepSpeed, an exception from `torch.serialization` a checkpoint problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from logdx.model import Event, Label
from logdx.patterns import TRACEBACK_START
from logdx.taxonomy import category_of, default_action, is_stdlib_path, module_of_path, owner_of, taxonomy

if TYPE_CHECKING:
    from logdx.diagnose.rules.compiled import OriginConfig

__all__ = ["Origin", "OriginInfo", "classify_origin", "locate", "owner_label"]

Origin = Literal["user", "library"]

_TB_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>[^\s,]+))?')


@dataclass(frozen=True, slots=True)
class OriginInfo:
    where: Origin
    module: str | None = None  # the library module that raised it, when one can be named
    path: str | None = None  # the innermost frame that decided
    line: int | None = None
    function: str | None = None


@dataclass(slots=True)
class _FrameRef:
    path: str
    function: str | None
    line: int | None = None


def locate(event: Event, origin: OriginConfig) -> OriginInfo:
    """``library`` when the innermost frame that is not a pass-through is library code.

    An exception re-raised from a DataLoader worker (or another process) carries the original
    traceback in its message: its frames are the ones that say where the error was raised."""
    frames = _original_frames(event) or [_FrameRef(f.path, f.function, f.line) for f in event.frames]
    etype = event.exception_type or ""
    stdlib = None
    for fr in reversed(frames):  # printed outermost first: the innermost is last
        if origin.is_passthrough(fr.path, fr.function):
            continue
        if is_stdlib_path(fr.path):
            # Python's own library raised it on behalf of its caller (enum refusing a value, queue, json):
            # the caller is the origin; with no caller shown, the error came from library code.
            stdlib = stdlib or fr
            continue
        if origin.is_library(fr.path):
            return OriginInfo("library", module_of_path(fr.path) or _module_of_type(etype), fr.path, fr.line, fr.function)
        return OriginInfo("user", None, fr.path, fr.line, fr.function)
    if stdlib is not None:
        return OriginInfo("library", None, stdlib.path, stdlib.line, stdlib.function)
    # No frame at all (a bare "KeyError: 'x'"): a qualified type names the module that raised it.
    if "." in etype and not etype.startswith("__main__."):
        return OriginInfo("library", _module_of_type(etype))
    return OriginInfo("user")


def classify_origin(event: Event, origin: OriginConfig) -> Origin:
    return locate(event, origin).where


def owner_label(info: OriginInfo, event: Event) -> Label:
    """The label of a library error no rule names: its module's owner, else the exception's own
    module's owner (`pyarrow.lib.ArrowInvalid` raised from a `datasets` frame), else the
    taxonomy's default for library errors."""
    ft = owner_of(info.module) or owner_of(_module_of_type(event.exception_type or "")) or taxonomy().library_default
    cat = category_of(ft)
    assert cat is not None  # the taxonomy checks its owners at load
    return Label(cat, ft, default_action(cat, ft))


def _module_of_type(etype: str) -> str | None:
    return etype.rsplit(".", 1)[0] if "." in etype else None


def _original_frames(event: Event) -> list[_FrameRef]:
    msg = event.exception_message or ""
    if TRACEBACK_START in msg:
        tail = msg[msg.rindex(TRACEBACK_START):]
        return [_FrameRef(m["path"], m["func"], int(m["line"])) for m in _TB_FRAME.finditer(tail)]
    # The message continued on the event's lines after the exception line.
    start = next((i for i, r in enumerate(event.lines) if r is event.anchor), None)
    if start is None:
        return []
    rest = event.lines[start + 1:]
    for i, rec in enumerate(rest):
        if TRACEBACK_START in rec.text:
            refs = [_TB_FRAME.search(r.text) for r in rest[i + 1:]]
            return [_FrameRef(m["path"], m["func"], int(m["line"])) for m in refs if m]
    return []
