"""The compiled rule set, cached by what it is compiled from: loading, validating and compiling the
packs (YAML, pydantic, every rule's examples, the keyword pre-filter) costs ~0.3 CPU-s a process;
reading the cache back costs a fifth of that.

The key is the sha256 of every pack file's path and bytes, of the code and taxonomy that compile
them (this package, `logdx.model`, `logdx.taxonomy` and its YAML), logdx's version and Python's. A
cache file says its key and the sha256 of its body before anything is unpickled: a stale one (other
key) or a corrupt one (other digest, or a body that does not unpickle to a rule set) is ignored and
rebuilt from the packs, never trusted. Packs with problems are never cached: they raise as before.
Written atomically (a temporary file renamed), so concurrent processes never read half a file; an
unwritable cache directory only costs the saving.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from logdx import __version__
from logdx.diagnose.rules.matcher import RuleSet

_MAGIC = b"logdx-rules-cache 1\n"
_HERE = Path(__file__).resolve().parent
_PACKAGE = _HERE.parent.parent  # service/logdx
# What a compiled rule is made of besides its pack: a change to any of these is a new key.
_CODE = (*sorted(_HERE.glob("*.py")), _PACKAGE / "model.py", _PACKAGE / "taxonomy.py", _PACKAGE / "taxonomy.yaml")
CACHE_FILE = "rules.pickle"


def cache_key(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    h.update(f"logdx {__version__} python {sys.version}\n".encode())
    for part in (*_CODE, None, *files):
        if part is None:  # code above, packs below
            h.update(b"--packs--\n")
            continue
        h.update(str(part.resolve()).encode() + b"\0")
        h.update(hashlib.sha256(part.read_bytes()).digest())
    return h.hexdigest()


def read_cached(path: Path, key: str) -> tuple[RuleSet, list[str]] | None:
    """The rule set cached at `path` under `key`, and its packs' names as shown when it was cached;
    None when absent, stale or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = _MAGIC + key.encode() + b"\n"
    if not data.startswith(head):
        return None  # absent key or another one: stale
    digest, _, body = data[len(head):].partition(b"\n")
    if digest != hashlib.sha256(body).hexdigest().encode():
        return None  # torn or altered
    try:
        ruleset, shown = pickle.loads(body)
    except Exception:  # noqa: BLE001 - whatever a damaged pickle raises, the packs are read instead
        return None
    if not isinstance(ruleset, RuleSet) or not isinstance(shown, list):
        return None
    return ruleset, shown


def write_cached(path: Path, key: str, ruleset: RuleSet, shown: list[str]) -> None:
    """Cache `ruleset` under `key` at `path` (`shown`: its packs' names as shown now); a directory
    that cannot be written is left alone."""
    import tempfile  # (only a cache miss writes)

    body = pickle.dumps((ruleset, shown), protocol=pickle.HIGHEST_PROTOCOL)
    data = _MAGIC + key.encode() + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".rules-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def rename_packs(ruleset: RuleSet, was: list[str], now: list[str]) -> RuleSet:
    """The rule set with its rules' and tests' pack names as this process shows them (relative to its
    working directory, which the process that cached them may not have shared)."""
    shown = dict(zip(was, now))
    if was == now:
        return ruleset
    # The pre-filter refers to rules by position: replacing them in place keeps it valid.
    ruleset.rules = [replace(r, file=shown.get(r.file, r.file)) for r in ruleset.rules]
    ruleset.tests = [replace(t, file=shown.get(t.file, t.file)) for t in ruleset.tests]
    ruleset.by_id = {r.id: r for r in ruleset.rules}
    return ruleset
