"""What start-up reuses between processes: the compiled rule set cached by its packs' hashes, and the
error catalog's prebuilt index. A cache that is stale or corrupt is rebuilt, never trusted; the index
answers exactly as the catalog parsed in memory does."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from logdx.diagnose.rules import RuleError, default_rules_dir, load_rules
from logdx.diagnose.rules.cache import CACHE_FILE

REPO = Path(__file__).resolve().parents[1]

PACK = """\
pack: tiny
description: one rule, for the cache
rules:
  - id: disk-full
    title: the disk is full
    role: root_cause
    severity: high
    confidence: 0.9
    category: infrastructure
    failure_type: disk_full
    match:
      patterns: ['No space left on device']
    examples: ['OSError: [Errno 28] No space left on device: /ckpt/step_100.pt']
"""


def _signature(ruleset):  # what a rule set decides with: its rules, their patterns, the pre-filter's keywords
    return ([(r.id, r.file, r.line, r.order, r.label, tuple(p.pattern for p in r.patterns), r.literals)
             for r in ruleset.rules],
            sorted(ruleset.prefilter.rules_by_keyword), ruleset.packs, [t.name for t in ruleset.tests])


def test_the_shipped_rules_read_back_from_the_cache_are_the_rules_the_packs_compile_to(tmp_path):
    fresh = load_rules(default_rules_dir())
    first = load_rules(default_rules_dir(), cache_dir=tmp_path)  # builds the cache
    assert (tmp_path / CACHE_FILE).is_file()
    again = load_rules(default_rules_dir(), cache_dir=tmp_path)  # reads it
    assert _signature(fresh) == _signature(first) == _signature(again)
    assert again.could_match("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert not again.could_match("step 1200 loss 2.31 lr 3e-4")


def test_a_changed_pack_is_a_new_key_the_stale_cache_is_rebuilt(tmp_path):
    packs, cache = tmp_path / "packs", tmp_path / "cache"
    packs.mkdir()
    (packs / "tiny.yaml").write_text(PACK)
    assert [r.id for r in load_rules(packs, cache_dir=cache).rules] == ["disk-full"]
    (packs / "tiny.yaml").write_text(PACK.replace("disk-full", "disk-is-full"))
    assert [r.id for r in load_rules(packs, cache_dir=cache).rules] == ["disk-is-full"]
    # a pack added to the folder is part of the key too
    (packs / "more.yaml").write_text(PACK.replace("pack: tiny", "pack: more").replace("disk-full", "quota"))
    assert sorted(r.id for r in load_rules(packs, cache_dir=cache).rules) == ["disk-is-full", "quota"]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "not-a-ruleset", "garbage"])
def test_a_corrupt_cache_is_ignored_and_rebuilt(tmp_path, damage):
    packs, cache = tmp_path / "packs", tmp_path / "cache"
    packs.mkdir()
    (packs / "tiny.yaml").write_text(PACK)
    load_rules(packs, cache_dir=cache)
    path = cache / CACHE_FILE
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "not-a-ruleset":
        # a well-formed file of the right key whose body is something else: refused after unpickling
        import hashlib

        body = pickle.dumps(("not rules", []))
        path.write_bytes(data[: data.index(b"\n", len(b"logdx-rules-cache 1\n")) + 1]
                         + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    else:
        path.write_bytes(b"\x00garbage" * 100)
    ruleset = load_rules(packs, cache_dir=cache)
    assert [r.id for r in ruleset.rules] == ["disk-full"]
    # ... and the cache is whole again: the next load reads it
    assert path.read_bytes() != b"\x00garbage" * 100
    assert [r.id for r in load_rules(packs, cache_dir=cache).rules] == ["disk-full"]


def test_a_pack_with_problems_still_fails_whatever_is_cached(tmp_path):
    packs, cache = tmp_path / "packs", tmp_path / "cache"
    packs.mkdir()
    (packs / "tiny.yaml").write_text(PACK)
    load_rules(packs, cache_dir=cache)
    (packs / "tiny.yaml").write_text(PACK.replace("'No space left on device'", "'No space (left'"))
    with pytest.raises(RuleError, match="bad regex"):
        load_rules(packs, cache_dir=cache)


def test_an_unwritable_cache_directory_costs_only_the_saving(tmp_path):
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "tiny.yaml").write_text(PACK)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert [r.id for r in load_rules(packs, cache_dir=blocker / "cache").rules] == ["disk-full"]


def test_pack_names_are_shown_as_this_process_sees_them_not_as_the_cacher_did(tmp_path, monkeypatch):
    packs, cache = tmp_path / "packs", tmp_path / "cache"
    packs.mkdir()
    (packs / "tiny.yaml").write_text(PACK)
    monkeypatch.chdir(tmp_path)
    assert load_rules(packs, cache_dir=cache).rules[0].file == "packs/tiny.yaml"
    monkeypatch.chdir(packs)
    rule = load_rules(packs, cache_dir=cache).rules[0]
    assert rule.file == "tiny.yaml" and rule.where().startswith("tiny.yaml:")


def test_diagnose_gives_the_same_report_with_a_cold_and_a_warm_cache(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("".join(f"[rank{r}]: step {s} loss 2.{s}{r}\n" for s in range(8) for r in range(2))
                   + "[rank1]: OSError: [Errno 28] No space left on device: '/ckpt/step_8.pt'\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "service"), "LOGDX_DATA_DIR": str(tmp_path / "data")}
    cmd = [sys.executable, "-m", "logdx", "diagnose", str(log), "--no-llm", "--no-retrieval", "--json", "--no-store"]
    cold = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "data" / "cache" / CACHE_FILE).is_file()
    warm = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout

    def verdict(out: str) -> dict:
        import json

        report = json.loads(out)
        return {k: v for k, v in report.items() if k not in ("id", "timings_ms", "created_at")}

    assert verdict(cold) == verdict(warm)
    assert verdict(cold)["failure_type"] != "unknown"


def _sample_lines(n: int) -> list[str]:
    """Lines of every kind the catalog is asked about: its own templates filled in, near misses,
    Xid and CUDA symbols, and ordinary lines."""
    from logdx.diagnose.catalog import catalog

    rng = random.Random(35)
    entries = rng.sample(catalog().entries, n)
    lines = []
    for i, e in enumerate(entries):
        text = (e.patterns[0] if e.patterns else e.template.splitlines()[0] if e.template else e.id)
        filled = text.replace("<*>", str(rng.randint(0, 4096)))
        head = f"{e.exception_name}: " if e.exception_name and i % 3 else ""
        lines.append(head + filled)
        if i % 4 == 0:  # a near miss: a word dropped
            words = filled.split()
            if len(words) > 4:
                del words[rng.randrange(len(words))]
            lines.append(" ".join(words))
    lines += ["NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
              "RuntimeError: CUDA error: cudaErrorIllegalAddress",
              "step 12 loss 2.31", "", "Traceback (most recent call last):",
              "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"]
    return lines


def test_the_catalog_index_answers_exactly_as_the_catalog_parsed_in_memory(tmp_path):
    from logdx.diagnose.catalog import catalog
    from logdx.diagnose.catalog_index import CatalogIndex, build_index

    path = tmp_path / "catalog.sqlite"
    build_index(path)
    index = CatalogIndex.open(path)
    assert index is not None and len(index) == len(catalog())
    memory = catalog()
    kinds = set()
    for line in _sample_lines(400):
        for exc in (None, "RuntimeError"):
            want = [(h.entry, h.score, h.how) for h in memory.match(line, exc)]
            got = [(h.entry, h.score, h.how) for h in index.match(line, exc)]
            assert got == want, line
            kinds.update(how for _, _, how in want)
    assert kinds == {"xid", "symbol", "template", "similar"}  # the sample reaches every way of matching


def test_a_stale_or_corrupt_catalog_index_is_not_used(tmp_path):
    from logdx.diagnose.catalog_index import CatalogIndex, build_index

    path = tmp_path / "catalog.sqlite"
    build_index(path, catalog_sha="0" * 64)  # built from another catalog
    assert CatalogIndex.open(path) is None
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    assert CatalogIndex.open(path) is None
    assert CatalogIndex.open(tmp_path / "absent.sqlite") is None


def test_without_a_prebuilt_index_one_is_built_once_into_the_data_dirs_cache(tmp_path):
    from logdx.diagnose import catalog_index

    found = catalog_index.find_or_build(shipped=tmp_path / "read-only" / "absent.sqlite", cache_dir=tmp_path / "cache")
    assert found is not None and found.path.parent == tmp_path / "cache"
    again = catalog_index.find_or_build(shipped=tmp_path / "read-only" / "absent.sqlite", cache_dir=tmp_path / "cache")
    assert again is not None and again.path == found.path


def test_single_value_settings_read_from_the_environment_as_pydantic_settings_reads_them():
    # Start-up reads LOGDX_DATA_DIR (and any other single-value setting) without pydantic-settings:
    # the same nested strings, for every such setting logdx has.
    from logdx import config

    plain = [n for n in config.env_names() if config._is_plain_setting(n)]
    assert "LOGDX_DATA_DIR" in plain and "LOGDX_STORE__PATH" in plain and len(plain) > 50
    assert not config._is_plain_setting("LOGDX_ALERTS__SLACK")  # a list of objects: JSON, pydantic-settings'
    env = {name: f"7{i}" for i, name in enumerate(plain)}
    assert config._plain_values(env) == config._environment_source()(env)()
    for name in plain:  # one at a time, as a deployment sets a few
        assert config._plain_values({name: "x"}) == config._environment_source()({name: "x"})(), name
