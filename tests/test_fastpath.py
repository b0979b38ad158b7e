"""The fast paths give the same answers as the slow ones they stand in for."""

from __future__ import annotations

import random

import pytest

from logdx.compress import (
    _ERROR_WORDS,
    CompressConfig,
    Compressor,
    has_error_word,
)
from logdx.normalize import Normalizer
from logdx.patterns import mask

SHAPES = [
    "[rank{r}]:[{y}-{mo}-{d} {hh}:{mm}:{ss},{ms}] [INFO] [timer.py:260:stop] epoch=0/micro_step={n} loss {ms}.{ss}",
    "[default{l}]:[rank{r}]: iteration {n}/100000 | lm loss: 2.{ms}E+00 | grad norm: 0.{ms}",
    "[{y}-{mo}-{d}T{hh}:{mm}:{ss}.{ms}+{hh}:{mm}] [{y}-{mo}-{d} {hh}:{mm}:{ss}] both stamps",
    "node-{r}:{n}:{n} [{l}] NCCL INFO comm 0x{n}ab rank {r} nranks 64 cudaDev {l} busId {n}0 - Init COMPLETE",
    "{r}: [rank{r}]: [E{mo}{d} {hh}:{mm}:{ss}.{ms} ProcessGroupNCCL.cpp:{n}] [PG 0 Rank {r}] Watchdog caught",
    "May {d} {hh}:{mm}:{ss} gpu{r} kernel: [{n}.{ms}] NVRM: Xid (PCI:0000:{mo}:00): 79, pid={n}",
    "[Wed May {d} {hh}:{mm}:{ss} {y}] [{r},{r}]<stderr>:hello",
    "host{r}:{r} err: Traceback (most recent call last):",
    "I{mo}{d} {hh}:{mm}:{ss}.{ms} glog line {n}",
    "user@node-{r}:~$ torchrun train.py",
    "[rank{big}]: a rank too long for int()",
]


def _lines(n: int, seed: int) -> list[bytes]:
    """Lines of a few shapes with random values, impossible dates and months included."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        s = rnd.choice(SHAPES)
        two = lambda: f"{rnd.randrange(100):02d}"  # noqa: E731
        values = {"y": f"{rnd.choice([0, 1970, 2024, rnd.randrange(10000)]):04d}", "mo": two(), "d": two(), "hh": two(),
                  "mm": two(), "ss": two(), "ms": f"{rnd.randrange(1000):03d}", "r": str(rnd.randrange(64)),
                  "l": str(rnd.randrange(8)), "n": str(rnd.randrange(10**6)), "big": "9" * rnd.choice([3, 5000])}
        for k, v in values.items():
            s = s.replace("{" + k + "}", v)
        out.append(s.encode() + b"\n")
    return out


def _fields(rec) -> tuple:
    return tuple(getattr(rec, f) for f in rec.__slots__)


def test_prefix_shape_cache_gives_what_peeling_each_line_gives():
    cached, fresh = Normalizer(), Normalizer()
    fresh._cache_limit = -1  # every line planned afresh
    for raw in _lines(5000, 1):
        assert _fields(cached.normalize(raw)) == _fields(fresh.normalize(raw)), raw
    assert cached._year == fresh._year and cached._session_host == fresh._session_host
    assert len(cached._plans) < 100  # a few shapes, not one per line


@pytest.mark.slow
def test_prefix_shape_cache_is_bounded():
    n = Normalizer()
    for i in range(20000):
        n.normalize(f"[rank1]: {'x' * (i % 50)}{'y' * (i // 50)}\n".encode())
    assert len(n._plans) <= 8192


@pytest.mark.slow
def test_case_folding_fast_path_matches_ignorecase():
    texts = ["\u212aill -9", "ſigterm", "TİMEOUT", "tıMEOUT", "ERROR", "CAN'T open", "xId 79", "Rev FF", "no attribute 'x'",
             "no attributes", "fooerror", "STEP 3", "Iteration 5", "it/S", "ſtep", "Epoch: 1", "losses", "é no attribute é"]
    texts += [mask(r.decode()) for r in _lines(2000, 2)]
    for t in texts:
        assert has_error_word(t) == bool(_ERROR_WORDS.search(t)), t


def test_template_id_of_names_the_template_add_used():
    c = Compressor(CompressConfig())
    n = Normalizer()
    for raw in _lines(500, 3):
        rec = n.normalize(raw)
        c.add(rec)
        tid = c.template_id_of(rec.text)
        assert tid is not None and any(t.template_id == tid for t in c.templates())
    assert c.template_id_of("never seen") is None


def test_match_params_follows_the_threshold_unless_set():
    assert CompressConfig(drain_sim_th=0.4).match_params is False
    assert CompressConfig(drain_sim_th=0.75).match_params is True
    assert CompressConfig(drain_sim_th=0.75, drain_match_params=False).match_params is False
