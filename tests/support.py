"""Small helpers several test modules share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_receiver() -> ModuleType:
    """tests/fixtures/run/receiver.py: a real webhook receiver on loopback (one module, however many tests load it)."""
    name = "logdx_test_receiver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "fixtures" / "run" / "receiver.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


class Clock:
    """A clock the test moves by hand (`clock.t += 60`), for code that takes `clock=time.time`."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
