"""Retrieval over past incidents with the real all-MiniLM-L6-v2 model and a real FAISS index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from logdx.config import RetrievalSettings
from logdx.diagnose.retrieval import (
    Neighbour,
    Retriever,
    exception_class,
    load_embedder,
    vote_from_neighbours,
)
from logdx.incidents import Incident, IncidentStore, mask_text
from logdx.model import Action, Category, FailureContext
from logdx.store import open_db


def ctx_of(root: str, *nearby: str, exception_type: str | None = None) -> FailureContext:
    return FailureContext(
        root_text=root,
        root_masked=mask_text(root),
        templates=[mask_text(n) for n in nearby],
        excerpt=[root, *nearby],
        exception_type=exception_type,
    )


@pytest.fixture(scope="module")
def seeded_dir(tmp_path_factory):
    """A seeded database with its index built once; tests copy it instead of re-embedding."""
    d = tmp_path_factory.mktemp("seeded")
    db = open_db(d / "logdx.db")
    r = Retriever(IncidentStore(db))
    r.ensure_index()
    assert r.stats.rebuilds == 1 and r.stats.embedded == IncidentStore(db).count()
    db.close()
    return d


@pytest.fixture
def copy_of(seeded_dir, tmp_path):
    def make() -> tuple:
        for f in seeded_dir.iterdir():
            if f.name.startswith("logdx."):
                shutil.copy(f, tmp_path / f.name)
        db = open_db(tmp_path / "logdx.db")
        return db, IncidentStore(db)
    return make


@pytest.fixture
def retriever(copy_of):
    db, store = copy_of()
    yield Retriever(store)
    db.close()


def test_embedding_model_loads_offline_once():
    a = load_embedder()
    b = load_embedder()
    assert a is b  # module-level cache: one load per process
    assert a.dim == 384 and a.load_seconds > 0
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    v = a.encode(["NCCL WARN NET/IB : Got completion from peer <IP> with error 12"])
    assert v.shape == (1, 384) and abs(float((v * v).sum()) - 1.0) < 1e-4
    assert a.runtime == "numpy"


def test_embedding_a_line_imports_neither_torch_nor_sentence_transformers():
    """Their import costs seconds per `diagnose` process; the default model runs in numpy."""
    code = ("import sys; from logdx.diagnose.retrieval import load_embedder; load_embedder().encode(['x']); "
            "print(sorted(m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_numpy_encoder_gives_sentence_transformers_vectors(tmp_path):
    """Same weights, same vectors: the FAISS index built by either is one vector space. Lines of every
    shape: short, long (truncated at the model's 256 tokens), unicode, a batch of mixed lengths."""
    from sentence_transformers import SentenceTransformer

    from logdx.diagnose.encoder import NumpyBertEncoder, numpy_compatible
    from logdx.diagnose.retrieval import _default_model_path

    path, _ = _default_model_path()
    texts = [
        "NCCL WARN NET/IB : Got completion from peer <IP> with error 12",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)",
        "[rank3]:   File \"/workspace/train.py\", line 212, in <module>",
        "ValueError: Undefined dataset alpaca_en_demo.json in dataset_info.json. — données ünïcödé 数据集",
        "x",
        " ".join(f"tok{i}" for i in range(600)),
    ]
    ours = NumpyBertEncoder(path).encode(texts)
    theirs = SentenceTransformer(str(path), device="cpu").encode(texts, normalize_embeddings=True)
    assert ours.shape == theirs.shape == (len(texts), 384)
    assert float((ours * theirs).sum(axis=1).min()) > 0.9999
    # a folder of another shape (CLS pooling here) is left to sentence-transformers
    other = tmp_path / "cls-model"
    shutil.copytree(path, other)
    (other / "1_Pooling" / "config.json").write_text(
        '{"word_embedding_dimension": 384, "pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}')
    assert numpy_compatible(path) and not numpy_compatible(other)
    assert load_embedder(other).runtime == "sentence-transformers"


def test_similar_failure_finds_the_right_incident(retriever):
    ctx = ctx_of(
        "NVRM: Xid (PCI:0000:41:00): 79, pid=777, name=python3, GPU has fallen off the bus.",
        "[rank12]: RuntimeError: CUDA error: unspecified launch failure",
    )
    vote = retriever.search(ctx)
    assert vote.source == "retrieval" and vote.note is None
    best, score = vote.scores[0]
    assert (best.category, best.failure_type) == (Category.INFRASTRUCTURE, "gpu_fell_off_bus")
    assert 0.5 < score <= 1.0 and all(0 <= s <= 1 for _, s in vote.scores)
    assert vote.evidence[0].source == "retrieval:seed-xid79-a"
    assert vote.evidence[0].text.startswith("[infrastructure/gpu_fell_off_bus sim=")
    assert retriever.stats.loaded_from_disk and retriever.stats.rebuilds == 0


@pytest.mark.parametrize("oom", [
    # torch >= 2.2 in a container: its own process is listed by a pid it cannot map ("Process N has ...").
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU 7 has a total capacity of 23.65 GiB "
    "of which 208.06 MiB is free. Process 2271802 has 23.44 GiB memory in use. Of the allocated memory 22.87 GiB is "
    "allocated by PyTorch, and 6.23 MiB is reserved by PyTorch but unallocated.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 3 has a total capacity of 79.15 GiB of "
    "which 312.00 MiB is free. Process 88121 has 61.20 GiB memory in use. Including non-PyTorch memory, this process "
    "has 17.60 GiB memory in use.",
])
def test_a_cuda_out_of_memory_is_never_recalled_as_another_processs(copy_of, oom):
    # Whose memory filled the GPU is in the numbers (which process, how much), and masking removes them: no
    # past incident can tell a job's own OOM from a GPU another process held (the cuda pack's rule reads
    # the numbers). Retrieval must recall an out-of-memory, not a restart, even after an operator taught it
    # one such incident word for word.
    db, store = copy_of()
    store.add(Incident("inc-taught", oom, mask_text(oom), [], Category.INFRASTRUCTURE, "gpu_memory_taken",
                       Action.RESTART, note="another tenant's workers held the GPU"))
    vote = Retriever(store).search(ctx_of(f"[rank7]: {oom}", exception_type="torch.OutOfMemoryError"))
    best, _ = vote.scores[0]
    assert (best.category, best.failure_type) == (Category.FRAMEWORK, "cuda_oom")
    assert all(not e.source.endswith("inc-taught") for e in vote.evidence)
    db.close()


def test_masked_numbers_and_hosts_do_not_change_the_result(retriever):
    a = ctx_of("node-17:3468:3905 [4] NCCL WARN NET/IB : Got completion from peer 10.1.2.3<5001> with error 12, opcode 0, len 0, vendor err 129 (Recv)")
    b = ctx_of("gpu-b-992:11:12 [7] NCCL WARN NET/IB : Got completion from peer 172.16.9.99<61234> with error 12, opcode 0, len 0, vendor err 129 (Recv)")
    assert a.as_query() == b.as_query()  # NCCL's host:pid:tid prefix, the peer and ports are masked
    na, nb = retriever.neighbours(a), retriever.neighbours(b)
    assert [(n.incident.id, n.similarity) for n in na] == [(n.incident.id, n.similarity) for n in nb]
    assert na[0].incident.failure_type == "network_error"


def test_exception_class_reranking(retriever):
    vote = retriever.search(ctx_of("KeyError: 'save_every_n_steps'", exception_type="KeyError"))
    assert vote.scores[0][0].failure_type == "key_error"
    assert exception_class("torch.OutOfMemoryError: CUDA out of memory") == "OutOfMemoryError"
    assert exception_class("[rank3]: KeyError: 'x'") == "KeyError"
    assert exception_class("NCCL WARN something") is None


def test_exclude_ids_for_leave_one_out(retriever):
    inc = retriever.incidents.get("seed-dl-shm")
    ctx = FailureContext(inc.root_line, inc.root_template, inc.templates, [inc.root_line])
    top = retriever.neighbours(ctx)[0]
    assert top.incident.id == "seed-dl-shm" and top.similarity > 0.99
    without = retriever.search(ctx, exclude_ids={"seed-dl-shm"})
    assert all(e.source != "retrieval:seed-dl-shm" for e in without.evidence)
    assert without.scores[0][0].failure_type == "dataloader_killed"  # its siblings still vote


def test_unrelated_text_gives_an_empty_vote_with_a_note(retriever):
    vote = retriever.search(ctx_of("epoch 3 finished, validation accuracy 0.91, saving best model"))
    assert vote.scores == [] and vote.evidence == []
    assert vote.note.startswith("retrieval: no incident above similarity 0.55 (best ")
    empty = retriever.search(FailureContext("", "", [], []))
    assert empty.scores == [] and "empty failure context" in empty.note


def test_threshold_is_configurable(copy_of):
    db, store = copy_of()
    ctx = ctx_of("RuntimeError: CUDA error: uncorrectable ECC error encountered")
    strict = Retriever(store, RetrievalSettings(min_similarity=0.999))
    assert strict.search(ctx).scores == []
    loose = Retriever(store, RetrievalSettings(min_similarity=0.2, k=3))
    assert len(loose.search(ctx).evidence) == 3
    db.close()


def test_index_is_persisted_beside_the_db(retriever, tmp_path):
    assert retriever.index_path == tmp_path / "logdx.incidents.faiss"
    retriever.ensure_index()
    assert retriever.index_path.exists() and retriever.sidecar_path.exists()
    assert retriever.stats.loaded_from_disk and retriever.stats.embedded == 0


def test_rebuilds_when_the_db_changes_behind_it(copy_of):
    db, store = copy_of()
    r = Retriever(store)
    ctx = ctx_of("QuantumFluxError: flux capacitor 3 lost phase lock on shard 9")
    before = r.search(ctx)
    # Another process (another connection to the same file) adds an incident.
    other_db = open_db(db.path)
    other = IncidentStore(other_db)
    other.add({
        "id": "inc-flux", "root_line": "QuantumFluxError: flux capacitor 1 lost phase lock on shard 2",
        "category": "infrastructure", "failure_type": "gpu_hardware_error", "note": "replace flux board",
    })
    after = r.search(ctx)
    assert r.stats.rebuilds == 1 and r.stats.reasons == ["incidents changed"]
    assert r.stats.embedded == 1  # the other incidents' vectors were reused
    assert after.evidence[0].source == "retrieval:inc-flux"
    assert after.scores[0][0].failure_type == "gpu_hardware_error"
    assert before.evidence == [] or before.evidence[0].source != "retrieval:inc-flux"
    # Removing it behind our back is noticed too.
    other.remove("inc-flux")
    assert all(e.source != "retrieval:inc-flux" for e in r.search(ctx).evidence)
    other_db.close()
    db.close()


def test_changes_made_while_down_are_picked_up_at_start(copy_of):
    db, store = copy_of()
    store.add({
        "id": "inc-new", "root_line": "ZebraError: stripes misaligned on rank 4",
        "category": "script", "failure_type": "script_error",
    })
    r = Retriever(store)  # the sidecar on disk predates the new incident
    r.ensure_index()
    assert not r.stats.loaded_from_disk
    assert r.stats.rebuilds == 1 and r.stats.embedded == 1
    assert r.neighbours(ctx_of("ZebraError: stripes misaligned on rank 11"))[0].incident.id == "inc-new"
    # ... and the rebuilt index is what the next process loads.
    r2 = Retriever(store)
    r2.ensure_index()
    assert r2.stats.loaded_from_disk and r2.stats.rebuilds == 0
    db.close()


SMALL_KB = [
    {"id": "s-ecc", "root_line": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
     "category": "infrastructure", "failure_type": "ecc_error"},
    {"id": "s-oom", "root_line": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "category": "framework", "failure_type": "cuda_oom"},
    {"id": "s-key", "root_line": "KeyError: 'input_ids'", "category": "script", "failure_type": "key_error"},
]


def small_store(path) -> IncidentStore:
    """A three-incident knowledge base: tests that must re-embed everything stay fast."""
    store = IncidentStore(open_db(path), seed_path=None)
    for item in SMALL_KB:
        store.add(item)
    return store


@pytest.mark.parametrize("damage", ["delete_index", "corrupt_index", "corrupt_sidecar", "torn_pair"])
def test_missing_or_damaged_files_trigger_a_rebuild(tmp_path, damage):
    store = small_store(tmp_path / "small.db")
    Retriever(store).ensure_index()
    db = store.db
    r = Retriever(store)
    if damage == "delete_index":
        r.index_path.unlink()
    elif damage == "corrupt_index":
        r.index_path.write_bytes(b"\x00garbage")
    elif damage == "corrupt_sidecar":
        r.sidecar_path.write_text("{not json")
    else:  # an index from another build with a sidecar that does not describe it
        data = bytearray(r.index_path.read_bytes())
        data[-10] ^= 0xFF
        r.index_path.write_bytes(bytes(data))
    vote = r.search(ctx_of("RuntimeError: CUDA error: uncorrectable ECC error encountered"))
    assert vote.scores[0][0].failure_type == "ecc_error"
    assert r.stats.rebuilds == 1 and not r.stats.loaded_from_disk
    assert r.stats.embedded == len(SMALL_KB)  # nothing trustworthy to reuse: all re-embedded
    db.close()


def test_learning_loop_a_corrected_report_changes_the_next_retrieval(copy_of):
    db, store = copy_of()
    r = Retriever(store)
    first_ctx = ctx_of(
        "megablox.kernels: grouped GEMM tile 128x64 produced inconsistent expert offsets (expert 7)",
        "megablox: expert routing table checksum mismatch on step 1200",
    )
    first = r.search(first_ctx)
    assert not first.scores or first.scores[0][0].failure_type != "version_mismatch"
    # The pipeline reported something wrong; the on-call engineer corrects it.
    report = {
        "status": "failed", "category": "script", "failure_type": "script_error", "action": "no_restart",
        "confidence": 0.3, "culprits": {"hosts": [], "ranks": [7], "gpus": []},
        "root_cause": {"line_no": 99, "text": first_ctx.root_text, "rank": 7, "host": None},
        "evidence": [],
    }
    rid = store.save_report(report, context=first_ctx)
    inc = store.feedback(rid, "framework", "version_mismatch", note="megablox 0.3 needs torch 2.5; pin it")
    # A similar failure later (other numbers, other wording around it) is now recognised.
    later = ctx_of(
        "megablox.kernels: grouped GEMM tile 256x128 produced inconsistent expert offsets (expert 3)",
        "megablox: expert routing table checksum mismatch on step 88",
    )
    vote = r.search(later)
    assert vote.scores[0][0].failure_type == "version_mismatch"
    assert vote.evidence[0].source == f"retrieval:{inc.id}"
    assert vote.scores[0][1] > 0.7
    db.close()


def test_in_memory_database_works_without_files():
    store = small_store(":memory:")
    r = Retriever(store)
    assert r.index_path is None
    assert r.search(ctx_of("RuntimeError: CUDA error: uncorrectable ECC error encountered")).scores
    store.db.close()


def _inc(i: str, ft: str, cat: Category = Category.SCRIPT, action: Action = Action.NO_RESTART) -> Incident:
    return Incident(i, f"root {i}", f"root {i}", [], cat, ft, action)


def test_vote_aggregation_weights_closest_neighbours_and_similarity():
    cfg = RetrievalSettings(min_similarity=0.55, temperature=0.05)
    near_dup = vote_from_neighbours([Neighbour(_inc("a", "key_error"), 0.98)], cfg)
    loose = vote_from_neighbours([Neighbour(_inc("a", "key_error"), 0.60)], cfg)
    assert near_dup.scores[0][1] > 0.85 > 0.4 > loose.scores[0][1]  # unanimous but weak
    mixed = vote_from_neighbours(
        [Neighbour(_inc("a", "key_error"), 0.90), Neighbour(_inc("b", "type_error"), 0.80),
         Neighbour(_inc("c", "type_error"), 0.79)],
        cfg,
    )
    # Two farther type_error neighbours do not outvote one clearly closer key_error neighbour.
    assert mixed.scores[0][0].failure_type == "key_error"
    assert [e.source for e in mixed.evidence] == ["retrieval:a", "retrieval:b", "retrieval:c"]
    actions = vote_from_neighbours(
        [Neighbour(_inc("a", "network_error", Category.INFRASTRUCTURE, Action.RESTART), 0.9),
         Neighbour(_inc("b", "network_error", Category.INFRASTRUCTURE, Action.RESTART), 0.9),
         Neighbour(_inc("c", "network_error", Category.INFRASTRUCTURE, Action.CORDON_AND_RESTART), 0.9)],
        cfg,
    )
    assert len(actions.scores) == 1 and actions.scores[0][0].action is Action.RESTART
    assert vote_from_neighbours([], cfg).scores == []


@pytest.mark.integration
def test_faiss_loads_without_module_not_found_noise():
    # faiss' loader logs a ModuleNotFoundError at INFO for each optional build it lacks; a server
    # logging at INFO opened with it. logdx imports faiss quietly.
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from logdx.diagnose.retrieval import _faiss; _faiss()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ModuleNotFoundError" not in out.stderr and "Could not load library" not in out.stderr, out.stderr
