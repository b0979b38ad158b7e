"""Stage 4: diagnosis, a cascade (see cascade.py). Rules decide what they recognise precisely; the
error catalog, retrieval over past incidents and a local LLM fill in what they do not.

The package imports nothing heavy itself: `logdx.diagnose.catalog` or `.taxonomy` users need not
load the cascade."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from logdx.diagnose.cascade import Diagnoser

__all__ = ["Diagnoser"]


def __getattr__(name: str) -> Any:
    if name == "Diagnoser":
        from logdx.diagnose.cascade import Diagnoser

        return Diagnoser
    raise AttributeError(name)
