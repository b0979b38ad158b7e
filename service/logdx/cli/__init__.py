"""Command-line interfaces, thin shells over `logdx.pipeline`: `diagnose` and `logdx`.

`app` builds the parsers and turns every ending into an exit code (what every face shares is in
`logdx.faces`); one module per group of commands:
`diagnose`, `incidents` (and feedback), `tools` (rules test, prompts check, model convert, synth).
`logdx run` lives in `logdx.run`, `logdx serve` in `logdx.api.server`.
"""

from __future__ import annotations

from logdx.cli.app import diagnose_main, main

__all__ = ["diagnose_main", "main"]
