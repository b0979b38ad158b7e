"""Incidents: CRUD, JSONL import/export, the seed knowledge base, reports and feedback."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from logdx.incidents import SEED_PATH, Incident, IncidentError, IncidentIn, IncidentStore, mask_text
from logdx.model import Action, Category, FailureContext
from logdx.store import open_db
from logdx.taxonomy import is_hardware, is_learnable, taxonomy

# ../shared beside the checkout, as CI has it
DEV_LOGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "failures-dev"


@pytest.fixture
def store(backend_db):
    return IncidentStore(backend_db, seed_path=None)


def ecc_incident(**kw) -> dict:
    base = {
        "id": "t-ecc",
        "root_line": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "nearby": ["NVRM: Xid (PCI:0000:8a:00): 48, pid=1234, DBE error", "node-7 rank 12 exited"],
        "category": "infrastructure",
        "failure_type": "ecc_error",
        "culprit_kind": "gpu",
        "note": "drained node-7",
    }
    return {**base, **kw}


def a_report(**kw) -> dict:
    base = {
        "status": "failed",
        "category": "script",
        "failure_type": "script_error",
        "action": "no_restart",
        "confidence": 0.4,
        "culprits": {"hosts": ["node-3"], "ranks": [5], "gpus": []},
        "root_cause": {"line_no": 812, "text": "FluxError: capacitor 7 desynchronised", "rank": 5, "host": "node-3"},
        "evidence": [
            {"line_no": 812, "text": "FluxError: capacitor 7 desynchronised", "source": "rule:py-fallback"},
            {"line_no": 790, "text": "flux: shard 12 lost sync after 4001 steps", "source": "detect:line"},
        ],
    }
    return {**base, **kw}


# --- seed knowledge base ---------------------------------------------------------------------------


def seed_rows() -> list[dict]:
    return [json.loads(line) for line in SEED_PATH.read_text().splitlines() if line.strip()]


def test_seed_is_valid_and_covers_every_canonical_failure_type():
    rows = seed_rows()
    assert len(rows) >= 60
    items = [IncidentIn.model_validate(r) for r in rows]  # raises on any invalid line
    assert len({i.id for i in items}) == len(items)
    covered = {i.failure_type for i in items}
    # A type only the numbers tell apart (taxonomy: by_numbers) is a rule's: no incident can recall it.
    assert covered == {t for t in taxonomy().types if is_learnable(t)} - {"unknown"}
    per_type = {ft: sum(i.failure_type == ft for i in items) for ft in covered}
    assert min(per_type.values()) >= 2, per_type
    for i in items:
        assert 1 <= len(i.nearby) <= 5, i.id
        assert i.note, i.id
        if is_hardware(i.failure_type):
            assert i.action is Action.CORDON_AND_RESTART, i.id
        if i.category is not Category.INFRASTRUCTURE:
            assert i.action is Action.NO_RESTART, i.id


@pytest.mark.skipif(not DEV_LOGS.is_dir(), reason="development logs not available")
def test_seed_lines_are_not_copied_from_the_dev_logs():
    dev_lines = set()
    for log in DEV_LOGS.glob("*.log"):
        dev_lines |= {line.strip() for line in log.read_text(errors="replace").splitlines() if len(line.strip()) > 25}
    for label in (DEV_LOGS / "labels.jsonl").read_text().splitlines():
        dev_lines.add(json.loads(label)["root_line"].strip())
    for row in seed_rows():
        for line in [row["root_line"], *row["nearby"]]:
            # A fixed library message ("IndexError: list index out of range", CUDA's error strings)
            # is the same in every log; a line with variable parts (ids, numbers, paths, hosts)
            # that matches a dev log line verbatim can only have been copied.
            if mask_text(line) != line.strip():
                assert line.strip() not in dev_lines, f"{row['id']} copies a dev log line: {line}"


def test_seed_loads_once_and_an_upgrade_brings_only_what_it_changed(backend_db, tmp_path):
    shipped = tmp_path / "seed.jsonl"
    rows = seed_rows()[:6]
    shipped.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = IncidentStore(backend_db, seed_path=shipped)
    assert first.count() == 6 and {i.source for i in first.list()} == {"seed"}
    # A person removes one seed incident and corrects another; a restart changes nothing of that.
    first.remove(rows[0]["id"])
    first.add({**rows[1], "note": "our cluster: this one is a bad riser", "source": "manual"})
    assert IncidentStore(backend_db, seed_path=shipped).count() == 5
    # An upgrade ships a new incident and rewrites a seed one: the store learns both; the person's
    # correction stays, and so does the removal (the shipped file changed, but not that line).
    new_row = {**rows[2], "id": "seed-new-in-this-release", "note": "new"}
    changed = {**rows[3], "note": "reworded in this release"}
    shipped.write_text("".join(json.dumps(r) + "\n" for r in [rows[1], rows[2], changed, *rows[4:], new_row]))
    upgraded = IncidentStore(backend_db, seed_path=shipped)
    assert upgraded.get("seed-new-in-this-release") is not None
    assert upgraded.get(rows[3]["id"]).note == "reworded in this release"
    assert upgraded.get(rows[1]["id"]).note == "our cluster: this one is a bad riser"
    assert upgraded.get(rows[0]["id"]) is None
    assert upgraded.count() == 6


def test_seed_incidents_are_masked_for_retrieval(tmp_path):
    db = open_db(tmp_path / "seeded.db")
    inc = IncidentStore(db).get("seed-xid48-dbe")
    assert inc is not None
    assert "0000:8a:00" not in inc.root_template and "21457" not in inc.root_template
    assert inc.root_template.startswith("NVRM: Xid (PCI:<*>): <*>, pid=<*>, name=python3, An uncorrectable double bit")
    assert inc.templates and all("21457" not in t for t in inc.templates)
    assert inc.as_query().splitlines()[0] == inc.root_template
    nccl = IncidentStore(db).get("seed-ib-wc-12")
    assert nccl.root_template.startswith("NCCL WARN NET/IB : Got completion from peer <*>")  # host:pid:tid peeled
    db.close()


# --- masking ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, GPU has fallen off the bus.",
         "NVRM: Xid (PCI:<*>): <*>, pid=<*>, GPU has fallen off the bus."),
        ("OSError: [Errno 28] No space left on device: '/ckpt/run-7/step_1200/model.pt'",
         "OSError: [Errno <*>] No space left on device: '<*>'"),
        ("node-7:3468:3905 [4] NCCL WARN peer 10.216.3.4<54862> with status=12", "NCCL WARN peer <*> with status=<*>"),
        ("[default0]:[rank12]: KeyError: 'input_ids'", "KeyError: 'input_ids'"),
        ("2024-03-01 12:00:01,123 job 09c561ee-a44c-4795-967c-7183a83b3160 done", "job <*> done"),
    ],
)
def test_mask_text_is_the_pipelines_mask(line, expected):
    assert mask_text(line) == expected


# --- CRUD ------------------------------------------------------------------------------------------


def test_add_get_list_remove(store):
    rev0 = store.revision()
    inc = store.add(ecc_incident())
    assert inc.action is Action.CORDON_AND_RESTART  # derived: hardware
    assert inc.root_template == mask_text(inc.root_line)
    assert inc.templates == [mask_text(x) for x in ecc_incident()["nearby"]]
    assert store.get("t-ecc") == inc
    store.add(ecc_incident(id="t-oom", root_line="torch.OutOfMemoryError: CUDA out of memory.",
                           category="framework", failure_type="cuda_oom"))
    assert store.count() == 2
    assert [i.id for i in store.list(category=Category.FRAMEWORK)] == ["t-oom"]
    assert [i.id for i in store.list(failure_type="ecc_error")] == ["t-ecc"]
    assert store.revision() > rev0
    assert store.remove("t-oom") is True
    assert store.remove("t-oom") is False
    assert store.get("t-oom") is None and store.count() == 1


def test_add_is_an_upsert_by_id(store):
    first = store.add(ecc_incident())
    second = store.add(ecc_incident(note="replaced the GPU"))
    assert store.count() == 1
    assert store.get("t-ecc").note == "replaced the GPU"
    assert second.created_at >= first.created_at


@pytest.mark.parametrize(
    "bad",
    [
        {"category": "infrastructure", "failure_type": "cuda_oom"},  # type of another category
        {"category": "unknown", "failure_type": "unknown"},
        {"failure_type": "gpu_lost"},
        {"action": "none"},
        {"root_line": ""},
    ],
)
def test_add_rejects_non_canonical_input(store, bad):
    with pytest.raises(IncidentError):
        store.add(ecc_incident(**bad))
    assert store.count() == 0


def test_fingerprint_tracks_what_retrieval_uses(store):
    store.add(ecc_incident())
    fp = store.fingerprint()
    rev = store.revision()
    store.add(ecc_incident(note="a note only"))
    assert store.fingerprint() == fp  # notes are not embedded
    assert store.revision() > rev  # but any write is visible
    store.add(ecc_incident(failure_type="gpu_hardware_error"))
    assert store.fingerprint() != fp


# --- import / export -------------------------------------------------------------------------------


def test_export_import_round_trip(store, tmp_path):
    store.add(ecc_incident())
    store.add(ecc_incident(id="t-key", root_line="KeyError: 'input_ids'", category="script",
                           failure_type="key_error", nearby=[]))
    out = tmp_path / "kb.jsonl"
    assert store.export_jsonl(out) == 2
    db2 = open_db(tmp_path / "other.db")
    other = IncidentStore(db2, seed_path=None)
    res = other.import_jsonl(out)
    assert (res.added, res.updated, res.errors) == (2, 0, [])
    for a, b in zip(store.list(), other.list()):
        assert a.to_json() == b.to_json()  # ids, labels, masked text and timestamps survive
    res = other.import_jsonl(out)
    assert (res.added, res.updated) == (0, 2)
    db2.close()


def test_import_reports_bad_lines_with_file_and_line(store, tmp_path):
    good = json.dumps(ecc_incident(id="ok-1"))
    bad_label = json.dumps(ecc_incident(id="bad-1", failure_type="cuda_oom"))
    path = tmp_path / "mixed.jsonl"
    path.write_text(f"{good}\n{bad_label}\n{{not json\n\n# a comment\n")
    res = store.import_jsonl(path)
    assert res.added == 1
    assert len(res.errors) == 2
    assert res.errors[0].startswith(f"{path}:2:") and "cuda_oom" in res.errors[0]
    assert res.errors[1].startswith(f"{path}:3:")
    with pytest.raises(IncidentError, match="mixed.jsonl:2"):
        store.import_jsonl(path, strict=True)
    assert store.count() == 1  # strict import wrote nothing


def test_import_from_stream_sets_source(store):
    stream = io.StringIO(json.dumps(ecc_incident(id="s-1")) + "\n")
    assert store.import_jsonl(stream).added == 1
    assert store.get("s-1").source == "import"


# --- reports and feedback --------------------------------------------------------------------------


def test_save_and_get_report(store):
    rid = store.save_report(a_report())
    assert rid.startswith("rep-")
    assert store.get_report(rid)["root_cause"]["line_no"] == 812
    assert store.get_report("rep-missing") is None
    rid2 = store.save_report(json.dumps(a_report()))  # JSON text works too
    assert rid2 != rid


def test_feedback_turns_a_corrected_report_into_an_incident(store):
    ctx = FailureContext(
        root_text="FluxError: capacitor 7 desynchronised",
        root_masked="FluxError: capacitor <NUM> desynchronised",
        templates=["flux: shard <NUM> lost sync after <NUM> steps"],
        excerpt=["FluxError: capacitor 7 desynchronised"],
        exception_type="FluxError",
    )
    rid = store.save_report(a_report(), context=ctx)
    inc = store.feedback(rid, "infrastructure", "gpu_hardware_error", note="bad flux GPU, RMA")
    assert inc.source == "feedback" and inc.report_id == rid
    assert (inc.category, inc.failure_type, inc.action) == (
        Category.INFRASTRUCTURE, "gpu_hardware_error", Action.CORDON_AND_RESTART)
    assert inc.root_template == ctx.root_masked and inc.templates == ctx.templates
    assert inc.culprit_kind == "node"
    assert store.get(inc.id) == inc


def test_feedback_without_stored_context_uses_the_report_text(store):
    rid = store.save_report(a_report())
    inc = store.feedback(rid, "script", "script_error")  # a confirmation
    assert inc.root_template == mask_text("FluxError: capacitor 7 desynchronised")
    assert inc.templates == [mask_text("flux: shard 12 lost sync after 4001 steps")]
    assert "confirmed" in inc.note
    assert inc.action is Action.NO_RESTART


def test_feedback_twice_updates_the_same_incident(store):
    rid = store.save_report(a_report())
    first = store.feedback(rid, "script", "script_error")
    second = store.feedback(rid, "framework", "config_error", action="no_restart", note="wrong flag")
    assert second.id == first.id and second.created_at == first.created_at
    assert store.count() == 1 and store.get(first.id).failure_type == "config_error"


def test_feedback_validation(store):
    rid = store.save_report(a_report())
    with pytest.raises(IncidentError, match="no report"):
        store.feedback("rep-nope", "script", "script_error")
    with pytest.raises(IncidentError, match="not canonical"):
        store.feedback(rid, "script", "cuda_oom")
    with pytest.raises(IncidentError, match="unknown category"):
        store.feedback(rid, "hardware", "ecc_error")
    with pytest.raises(IncidentError, match="unknown action"):
        store.feedback(rid, "script", "script_error", action="reboot")
    empty = store.save_report({"status": "failed", "root_cause": None, "evidence": []})
    with pytest.raises(IncidentError, match="no root line"):
        store.feedback(empty, "script", "script_error")
    assert store.count() == 0


def test_incident_dataclass_label_and_query_shape():
    inc = Incident("x", "raw", "tmpl", ["a", "b"], Category.SCRIPT, "key_error", Action.NO_RESTART)
    assert inc.label.failure_type == "key_error"
    ctx = FailureContext(root_text="raw", root_masked="tmpl", templates=["a", "b"], excerpt=[])
    assert inc.as_query() == ctx.as_query()
