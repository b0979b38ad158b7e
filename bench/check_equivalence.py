#!/usr/bin/env python3
"""Check that normalize + compress behave exactly as at a git revision (for hot-path work).

The revision's `normalize.py`, `compress.py` and `patterns.py` run side by side with the working
tree's on ~1M lines: every synth scenario x launcher style (generated once into
.cache/bench/eqcorpus/), failures-dev, loghub, the test fixtures, random prefix combinations (NULs,
CR, ANSI, invalid UTF-8, 5000-digit ranks, impossible dates), the same shapes with random digits, and
tiny caches. Every Record field, every kept line, the tails, the templates and the summary must be
identical; so must iter_lines on edge cases. Both compressors run at the same Drain settings (4 / 0.4,
no wildcard matching). Usage::

    python bench/check_equivalence.py --rev a6d94ff [--same-masks] [--fuzz 4]

--same-masks gives the revision's compressor the working tree's MASK, to compare the rest of the
logic across a deliberate change of the masks.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import io
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service")); sys.path.insert(0, str(REPO / "bench"))
import logdx.compress as C
import logdx.normalize as N
import logdx.patterns as P
from ab_fastpath import load_revision
from logdx.diagnose.rules import default_rules_dir, load_rules

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--rev", default="HEAD")
ap.add_argument("--same-masks", action="store_true")
ap.add_argument("--fuzz", type=int, default=3, help="fuzz rounds of 55k lines")
ARGS = ap.parse_args()
ON, OC = load_revision(ARGS.rev)
rules = load_rules([default_rules_dir()])
if ARGS.same_masks:
    OC.MASK = P.MASK
CORPUS = REPO / ".cache" / "bench" / "eqcorpus"
SHARED = REPO.parent / "shared" / "data"


def make_corpus():
    if CORPUS.exists() and len(list(CORPUS.glob("*.log"))) >= 100:
        return
    CORPUS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "service")}
    listing = subprocess.run([sys.executable, "-m", "logdx.synth", "--list"], capture_output=True, text=True, check=True, env=env)
    scenarios = [line.split()[0] for line in listing.stdout.splitlines()]
    i = 0
    for sc in scenarios:
        for st in ("torchrun", "torchrun_tee", "srun", "srun_torchrun", "pdsh", "pdsh_torchrun"):
            i += 1
            for flavour in (["auto", "megatron", "deepspeed", "fsdp", "lightning"][i % 5], "auto"):
                r = subprocess.run([sys.executable, "-m", "logdx.synth", "--scenario", sc, "--style", st, "--flavour", flavour,
                                    "--seed", str(i), "--ranks", str((i % 3) * 24 + 8), "--lines", "6000",
                                    "-o", str(CORPUS / f"{sc}-{st}.log")], capture_output=True, env=env)
                if r.returncode == 0:
                    break


make_corpus()

PREFIXES = ["[rank{r}]:", "[Rank {r}]: ", "[default{l}]:", "[1,{r}]<stderr>:", "[0,{r}]<stdout>: ", " {r}: ", "{r}: ",
    "node-{h}: ", "gpu{h}.cluster: ", "localhost: ", "node-{h}:{p}:{p} [{l}] ", "worker{h}:{r} err: ", "host-{h}.x:{r} out: ",
    "[2024-05-{d} 1{h}:0{l}:{s},{ms}] ", "2024-{mo}-{d}T12:00:{s}.{ms}Z ", "2024-05-{d} 12:00:{s}+02:00 ", "[2024-{mo}-{d} 12:{s}:00] ",
    "Mon May  {d} 12:00:{s} 2024 ", "Wed Jan {d} 1{h}:00:00 20{s} ", "May {d} 12:00:{s} node-{h} kernel: [{p}.{ms}] ",
    "Jun  {d} 01:02:{s} host{h} sshd[{p}]: ", "Foo {d} 12:00:{s} h ", "[Wed May  1 12:00:0{l} 2024] ", "[  {p}.{ms}] ", "[+{p}.{ms}] ",
    "user@node-{h}:~$ ", "(base) root@gpu{h} /w# ", "[E{mo}{d} 17:40:{s}.{ms} ProcessGroupNCCL.cpp:{p}] ", "I{mo}{d} 12:00:00.{ms} ",
    "[PG 0 (default_pg) Rank {r}] ", "\x1b[31m", "\x1b[0m", "", "", "", "[INFO] ", "{r}:", "   {r}: ", "12345678: ", "1234567: ",
    "[{r}]:", "[2024-13-40 25:61:61] ", "[0000-01-01 00:00:00] ", "9999-12-31 23:59:59.999999999-23:59 ", "2024-02-30 00:00:00,1 ",
    "Xyz {d} 10:00:00 h: ", "[rank{big}]:", "[1,{big}]<stderr>:", "epoch {r}: ", "RuntimeError: ", "abc@def ",]
MSGS = ["iteration {p}/100000 | loss {ms}.{s} | lr 1.0e-04", "NCCL WARN NET/IB : Got completion with error 12", "Traceback (most recent call last):",
    '  File "/w/train.py", line {p}, in <module>', "ValueError: bad {p}", "NVRM: Xid (PCI:0000:8a:00): 79, pid={p}", "hello world",
    "[2024-05-01 12:00:0{l},{ms}] [INFO] step {p}", "[E817 17:40:34.22 x.cpp:1] y", "Rank {r} done", "loss=nan", "{'loss': {ms}.{s}, 'epoch': 0.{s}}",
    "NCCL INFO comm 0x{p}ab rank {r} nranks 64 cudaDev {l} nvmlDev {l} busId {p}0 commId 0x1 - Init COMPLETE", "", " ", "\t x",
    "progress 50%\r progress 60%\r", "a\x00b", "bad \xff\xfe bytes", "loss 3.{ms} it/s", "x" * 300, "y " * 120]

def fuzz_lines(n, seed=0):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        k = rnd.choice([0, 1, 1, 2, 2, 3, 4])
        s = "".join(rnd.choice(PREFIXES) for _ in range(k)) + rnd.choice(MSGS)
        vals = dict(r=rnd.randrange(0, 2000), l=rnd.randrange(8), h=rnd.randrange(100), p=rnd.randrange(1, 10**rnd.randrange(1, 8)),
                    d=rnd.randrange(1, 32), s=rnd.randrange(60), ms=rnd.randrange(1000), mo=f"{rnd.randrange(1, 13):02d}", big="9" * rnd.choice([3, 5000]))
        for key, v in vals.items():
            s = s.replace("{" + key + "}", str(v))
        if rnd.random() < 0.05:
            s = s[: rnd.randrange(len(s) + 1)]
        b = s.encode("utf-8", "surrogateescape") if "\xff" not in s else s.encode("latin-1", "replace")
        if rnd.random() < 0.02:
            b += b"\xc3"
        out.append(b + b"\n")
    return out

def digit_variants(lines, n, seed):
    """Same shapes, other values: every ASCII digit replaced at random (impossible dates included)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        b = bytearray(rnd.choice(lines))
        for i, ch in enumerate(b):
            if 48 <= ch <= 57 and rnd.random() < 0.5:
                b[i] = 48 + rnd.randrange(10)
        out.append(bytes(b))
    return out

SHAPED = ["[{y}-{mo}-{d} {hh}:{mm}:{ss}] {y}-{mo}-{d} {hh}:{mm}:{ss},{ms} msg loss {ms}", "[{y}-{mo}-{d} {hh}:{mm}:{ss}.{ms}+{hh}:{mm}] [rank{r}]: x",
          "{y}-{mo}-{d}T{hh}:{mm}:{ss}Z [{y}-{mo}-{d} {hh}:{mm}:{ss}] y", "[Wed May {d} {hh}:{mm}:{ss} {y}] [{y}-{mo}-{d} {hh}:{mm}:{ss}] z",
          "May {d} {hh}:{mm}:{ss} node{r} kernel: [{r}.{ms}] NVRM: Xid (PCI:0000:{mo}:00): 79", "Jan {d} {hh}:{mm}:{ss} h{r} I{mo}{d} {hh}:{mm}:{ss}.{ms} c",
          "[rank{r}]:[E{mo}{d} {hh}:{mm}:{ss}.{ms} ProcessGroupNCCL.cpp:{r}] [PG 0 Rank {r}] watchdog", "{r}: [default{r}]:[rank{r}]: {y}-{mo}-{d} {hh}:{mm}:{ss} - INFO",
          "node-{r}:{r}:{r} [{r}] NCCL INFO comm 0x{r} rank {r} nranks 64 cudaDev {r} busId {r}0", "host{r}:{r} err: [rank{r}]: boom",
          "user@node-{r}:~$ python train.py", "[{r},{r}]<stderr>:[PG {r} Rank {r}] hi", "Mon Jan {d} {hh}:{mm}:{ss} {y} [  {r}.{ms}] oops"]

def shaped_lines(n, seed):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        s = rnd.choice(SHAPED)
        two = lambda: f"{rnd.randrange(100):02d}"
        vals = dict(y=f"{rnd.choice([0, 1970, 2024, 9999, rnd.randrange(10000)]):04d}", mo=two(), d=two(), hh=two(), mm=two(), ss=two(),
                    ms=f"{rnd.randrange(1000):03d}", r=str(rnd.choice([0, 7, 63, rnd.randrange(10**6)])))
        for key, v in vals.items():
            s = s.replace("{" + key + "}", v)
        out.append(s.encode() + b"\n")
    return out

def same(a, b):
    """Equal, with a NaN equal to a NaN (a NaN loss in the timeline's series is not the same float object on both
    sides, and NaN != NaN)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b

def rec_tuple(r):
    return tuple(getattr(r, f) for f in r.__slots__)

def kept_tuple(k):
    return (rec_tuple(k.record), k.template_id, k.reason)

def stats_tuple(s):
    return tuple(getattr(s, f) for f in s.__slots__)

def _config(module, extra):
    """Both sides at the same Drain settings, whatever each side's defaults are."""
    fields = module.CompressConfig.__dataclass_fields__
    same = {"drain_depth": 4, "drain_sim_th": 0.4, "drain_match_params": False}
    return module.CompressConfig(**{k: v for k, v in same.items() if k in fields}, **(extra or {}))


def compare(name, lines, also_error=True, max_line_bytes=N.DEFAULT_MAX_LINE_BYTES, cfg=None):
    n1, n2 = ON.Normalizer(max_line_bytes), N.Normalizer(max_line_bytes)
    n1._year = n2._year = 2024
    ae = rules.could_match if also_error else None
    c1 = OC.Compressor(_config(OC, cfg), also_error=ae)
    c2 = C.Compressor(_config(C, cfg), also_error=ae)
    for i, raw in enumerate(lines):
        r1, r2 = n1.normalize(raw), n2.normalize(raw)
        t1, t2 = rec_tuple(r1), rec_tuple(r2)
        if t1 != t2:
            raise AssertionError(f"{name}: record {i} differs\n raw={raw!r}\n old={t1}\n new={t2}")
        k1, k2 = [kept_tuple(k) for k in c1.add(r1)], [kept_tuple(k) for k in c2.add(r2)]
        if k1 != k2:
            raise AssertionError(f"{name}: kept {i} differs\n raw={raw!r}\n old={k1}\n new={k2}")
        raw_id = c2._shapes[r2.text.encode("utf-8", "surrogatepass").translate(None, b"0123456789")].template_id
        if c2.template_id_of(r2.text) != c2.group_ids().get(raw_id, raw_id):  # reported groups may join variants
            raise AssertionError("template_id_of")
    assert (n1.line_no, n1.bytes_in, n1.truncated, n1._year, n1._session_host) == (n2.line_no, n2.bytes_in, n2.truncated, n2._year, n2._session_host), name
    assert [kept_tuple(k) for k in c1.flush_tails()] == [kept_tuple(k) for k in c2.flush_tails()], name
    assert [stats_tuple(s) for s in c1.templates()] == [stats_tuple(s) for s in c2.templates()], name
    s1, s2 = c1.summary(7, 3), c2.summary(7, 3)
    assert same(tuple(getattr(s1, f) for f in s1.__slots__), tuple(getattr(s2, f) for f in s2.__slots__)), name
    return len(lines)

def read_all(path, mlb=N.DEFAULT_MAX_LINE_BYTES):
    with ON.open_input(path) as f:
        a = list(ON.iter_lines(f, mlb))
    with N.open_input(path) as f:
        b = list(N.iter_lines(f, mlb))
    assert a == b, f"iter_lines differs on {path}"
    return a

total = 0
files = sorted(glob.glob(str(CORPUS / "*.log"))) + sorted(glob.glob(str(SHARED / "failures-dev/*.log"))) \
    + sorted(glob.glob(str(SHARED / "loghub-2k/*/*_2k.log"))) + sorted(glob.glob(str(REPO / "tests/fixtures/**/*.log"), recursive=True))
for path in files:
    total += compare(os.path.basename(path), read_all(path))
# iter_lines edge cases
for data in [b"", b"\n", b"a", b"a\nb", b"a\r\nb\r\n", b"x" * 10 + b"\n" + b"y" * 11 + b"\n" + b"z" * 12 + b"\nq" + b"w" * 30,
             b"x" * 11, b"x" * 12, b"x" * 10, (b"x" * 5000 + b"\n") * 3 + b"abc", bytes(range(256)) * 50]:
    for mlb in (1, 5, 10, 11, 64, 4096):
        with tempfile.NamedTemporaryFile(delete=False) as t:
            t.write(data)
        read_all(t.name, mlb)
        a = list(ON.iter_lines(io.BufferedReader(io.BytesIO(data)), mlb)); b = list(N.iter_lines(io.BufferedReader(io.BytesIO(data)), mlb))
        assert a == b, (data[:50], mlb, a[:3], b[:3])
        os.unlink(t.name)
big = read_all(str(CORPUS / "xid79-torchrun.log"), 40)
total += compare("small-mlb", big, max_line_bytes=40)
for seed in range(ARGS.fuzz):
    total += compare(f"fuzz{seed}", fuzz_lines(50000, seed), also_error=seed % 2 == 0)
    total += compare(f"fuzz-str{seed}", [l.decode("utf-8", "replace") for l in fuzz_lines(5000, seed + 100)])
corpus_lines = [l for p in files[:60] for l in read_all(p)]
total += compare("digit-variants", digit_variants(corpus_lines, 200000, 5))
total += compare("shaped", shaped_lines(100000, 6))
total += compare("tiny-cache", fuzz_lines(20000, 99), cfg=dict(mask_cache_size=50, max_templates=40, max_kept_lines=100, max_sources=10))
# mask
pass
print("equivalent on", total, "lines")
# error / progress words on masked lines, including Unicode that IGNORECASE folds onto ASCII
extra = ["\u212aill", "ſigterm", "TİMEOUT", "tıMEOUT", "ERROR", "Can\u2019t", "CAN'T", "xId", "Rev FF", "no attribute", "x no attributes",
         "fooerror", "STEP 3", "Iteration", "ıteration", "it/S", "The KİLL", "ſtep", "Epoch:", "losses", "no_attribute", "é no attribute é"]
texts = extra + [P.mask(l.decode("utf-8", "replace")) for l in corpus_lines[::3]] + [P.mask(l.decode("utf-8", "replace")) for l in fuzz_lines(20000, 8)]
for t in texts:
    assert bool(OC._ERROR_WORDS.search(t)) == C.has_error_word(t), t
print("error/progress words equivalent on", len(texts))
