"""Unpickling a file a user handed us, without running anything it asks for.

A pickle is a program: `GLOBAL`/`STACK_GLOBAL` name any importable callable and `REDUCE` calls it
(`os.system`, `eval`...). Flight-recorder dumps are written by torch's own pickler as plain data
(dicts, lists, tuples, str, int, float, bool, None), so the unpickler here resolves no global at
all, except the list builders torch's jit pickler names for specialised lists
(`torch.jit._pickle.build_intlist`...), mapped to plain functions without importing torch. Anything
else, and any persistent id, stops the load with `RefusedPickle` before a single call is made."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

__all__ = ["RefusedPickle", "unpickle"]


class RefusedPickle(pickle.UnpicklingError):
    """The pickle asks for something other than plain data."""


def _as_list(values: Any) -> list[Any]:
    if not isinstance(values, list | tuple):
        raise RefusedPickle("a list builder was given something other than a list")
    return list(values)


def _restore_type_tag(value: Any, _type_str: Any = None) -> Any:
    return value


# What torch's jit pickler may name in a data pickle; each maps to a function that builds plain data.
_TORCH_BUILDERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch.jit._pickle", "build_intlist"): _as_list,
    ("torch.jit._pickle", "build_doublelist"): _as_list,
    ("torch.jit._pickle", "build_boollist"): _as_list,
    ("torch.jit._pickle", "build_tensorlist"): _as_list,
    ("torch.jit._pickle", "restore_type_tag"): _restore_type_tag,
}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        builder = _TORCH_BUILDERS.get((module, name))
        if builder is None:
            raise RefusedPickle(f"it asks for {module[:80]}.{name[:80]}: a flight-recorder dump holds only plain data")
        return builder

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("it holds a persistent id (torch.save data?): a flight-recorder dump holds only plain data")


def unpickle(data: bytes) -> Any:
    """The plain data in `data`; `RefusedPickle` when it asks for any callable, other
    `pickle.UnpicklingError`/`ValueError`/`EOFError` subclasses when it is not a valid pickle."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()
