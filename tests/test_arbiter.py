"""The arbiter (diagnose/arbiter.py): a calibrated classifier over retrieval's embedding, fitted on the real
seed incidents and labelled catalog messages; it abstains on what it does not know, refits when feedback
arrives, and obeys the learned stages' guard (never raises the action alone, never cordons)."""

from __future__ import annotations

import shutil
from collections import defaultdict

import pytest

from logdx.config import ArbiterSettings, load_settings
from logdx.diagnose.arbiter import Arbiter
from logdx.diagnose.retrieval import Retriever
from logdx.evaluate.holdout import precise_packs, without_packs
from logdx.incidents import IncidentStore, mask_text
from logdx.model import Action, FailureContext
from logdx.pipeline import Engine
from logdx.store import open_db
from logdx.testing import cpu_seconds, diagnose_lines


def ctx_of(root: str, *nearby: str) -> FailureContext:
    return FailureContext(root_text=root, root_masked=mask_text(root), templates=[mask_text(n) for n in nearby],
                          excerpt=[root, *nearby], exception_type=None)


@pytest.fixture(scope="module")
def seeded_dir(tmp_path_factory):
    """A seeded database, its index and the arbiter's catalog vectors built once; tests copy them."""
    d = tmp_path_factory.mktemp("seeded")
    db = open_db(d / "logdx.db")
    arbiter = Arbiter(Retriever(IncidentStore(db)), cache_dir=d / "cache")
    assert arbiter.fitted() is not None and arbiter.fits == 1
    db.close()
    return d


@pytest.fixture
def store(seeded_dir, tmp_path):
    for f in seeded_dir.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    shutil.copytree(seeded_dir / "cache", tmp_path / "cache")
    db = open_db(tmp_path / "logdx.db")
    yield IncidentStore(db)
    db.close()


def test_a_held_out_seed_incident_is_classified_by_the_others(store, tmp_path):
    """Leave-one-out on the real seeds: one incident of each type that has three or more, hidden from the fit."""
    # Abstention off: the question is whether its best label is right (chance is 1 in 40 classes).
    arbiter = Arbiter(Retriever(store), ArbiterSettings(min_probability=0.0), cache_dir=tmp_path / "cache")
    by_type = defaultdict(list)
    for inc in store.list():
        by_type[inc.failure_type].append(inc)
    held = [incs[0] for ft, incs in sorted(by_type.items()) if len(incs) >= 3][:12]
    assert len(held) == 12
    right = 0
    with cpu_seconds() as cpu:
        for inc in held:
            vote = arbiter.score(ctx_of(inc.root_line, *inc.templates), exclude_ids=[inc.id])
            assert all(not e.source.endswith(inc.id) for e in vote.evidence)  # it never sees itself
            right += bool(vote.scores) and vote.scores[0][0].failure_type == inc.failure_type
    # The seeds of a type are deliberately unlike each other (another wording, another layer): 6 of 12 measured.
    assert right >= 5, f"{right}/12 held-out seed incidents classified"
    assert cpu.seconds < 20  # a refit without one incident is warm-started: a fraction of a second each


def test_the_fit_is_calibrated_and_cached_by_the_incidents_content(store, tmp_path):
    first = Arbiter(Retriever(store), cache_dir=tmp_path / "cache")
    fit = first.fitted()
    assert fit is not None and 0.05 <= fit.temperature <= 5.0 and len(fit.classes) >= 30
    assert first.fits == 0  # the module's fit of the same incidents, read from the cache
    again = first.fitted()
    assert again is fit


def test_gibberish_is_an_abstention_that_names_the_nearest_incidents(store, tmp_path):
    arbiter = Arbiter(Retriever(store), cache_dir=tmp_path / "cache")
    vote = arbiter.score(ctx_of("qwxz flurb zzkj blorp vimmle trundle"))
    assert vote.scores == []
    assert vote.note is not None and vote.note.startswith("arbiter abstains (no example within similarity")
    assert "unknown: the nearest incidents are seed-" in vote.note
    # When it is close to something but unsure, it says so and names what to check.
    unsure = Arbiter(Retriever(store), ArbiterSettings(min_probability=0.99), cache_dir=tmp_path / "cache")
    vote = unsure.score(ctx_of("RuntimeError: CUDA error: an illegal memory access was encountered"))
    assert vote.scores == [] and "has p = " in (vote.note or "") and "; check " in (vote.note or "")


def test_feedback_refits_it_and_changes_the_next_answer(store, tmp_path):
    arbiter = Arbiter(Retriever(store), cache_dir=tmp_path / "cache")
    failure = ctx_of("megablox.kernels: grouped GEMM tile 128x64 produced inconsistent expert offsets (expert 7)",
                     "megablox: expert routing table checksum mismatch on step 1200")
    before = arbiter.score(failure)
    assert not before.scores or before.scores[0][0].failure_type != "version_mismatch"
    report = {"status": "failed", "category": "script", "failure_type": "script_error", "action": "no_restart",
              "confidence": 0.3, "culprits": {"hosts": [], "ranks": [7], "gpus": []},
              "root_cause": {"line_no": 99, "text": failure.root_text, "rank": 7, "host": None}, "evidence": []}
    rid = store.save_report(report, context=failure)
    store.feedback(rid, "framework", "version_mismatch", note="megablox 0.3 needs torch 2.5; pin it")
    later = ctx_of("megablox.kernels: grouped GEMM tile 256x128 produced inconsistent expert offsets (expert 3)",
                   "megablox: expert routing table checksum mismatch on step 88")
    after = arbiter.score(later)
    assert arbiter.fits == 1  # the incidents changed: refitted once
    assert after.scores and after.scores[0][0].failure_type == "version_mismatch"


@pytest.fixture(scope="module")
def no_precise_rule(tmp_path_factory):
    """The default cascade with every precise rule pack held out and retrieval's votes out of reach (threshold
    0.99): a failure no rule names and no past incident votes for, where only the arbiter has an opinion."""
    settings = load_settings(env={"LOGDX_DATA_DIR": str(tmp_path_factory.mktemp("data")),
                                  "LOGDX_RETRIEVAL__MIN_SIMILARITY": "0.99"})
    engine = Engine.create(settings)
    assert engine.diagnoser.arbiter is not None and engine.diagnoser.llm is None  # the default: no LLM to load
    engine.rules = engine.diagnoser.rules = without_packs(engine.rules, precise_packs(engine.rules))
    return engine


def _job(crash: str, rank: int = 1) -> list[str]:
    """A 4-rank torchrun job that trains, then one rank raises a vendor library's exception no rule knows."""
    lines = []
    for step in range(1, 60):
        for r in range(4):
            if step % 10 == 0 or r == 0:
                lines.append(f"[default{r}]:[2026-03-02 10:{step // 60:02d}:{step % 60:02d}] iteration {step}/5000 | "
                             f"consumed samples {step * 512} | lm loss {3.9 - step / 50:.4f} | grad norm 1.{step % 9}")
    lines += [f"[default{rank}]:Traceback (most recent call last):",
              f'[default{rank}]:  File "/workspace/pretrain.py", line 88, in <module>',
              f"[default{rank}]:    trainer.step(batch)",
              f"[default{rank}]:{crash}"]
    lines += [f"[default{r}]:[W302 10:01:12.000 ProcessGroupNCCL.cpp:1168] Rank {r} is shutting down" for r in range(4)]
    return lines


@pytest.mark.parametrize(("crash", "proposed"), [
    ("fabric.errors.LinkDownError: IB port mlx5_2/1 is down (peer unreachable)", Action.RESTART),
    ("nvwatch.GpuMemoryError: double bit ECC error on GPU 3, pages pending retirement", Action.CORDON_AND_RESTART),
])
def test_the_arbiter_alone_never_raises_no_restart_to_restart_nor_cordons(no_precise_rule, crash, proposed):
    report = diagnose_lines(no_precise_rule, _job(crash), 1)
    assert report.status == "failed" and report.decided_by == "arbiter", report.notes
    assert report.category == "infrastructure"
    # Its label implies a restart (an IB link) or a cordon (ECC): no rule, catalog entry or incident agrees.
    assert report.action == Action.NO_RESTART.value
    assert any(n.startswith(f"arbiter proposed {proposed.value}, and no rule") for n in report.notes), report.notes
