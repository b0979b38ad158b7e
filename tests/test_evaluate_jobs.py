"""The whole-job evaluation: scoring of generated jobs, the one-read-many-cascades runner, and the
command line on a small labelled folder written here (rules only: no model is loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from logdx.act.report import Culprits, Report, RootCause
from logdx.config import load_settings
from logdx.evaluate import main, report_divergence_step, score_job
from logdx.evaluate.corpus import CaseResult, calibration, confusion
from logdx.evaluate.runner import Cascade, diagnose_log, generated
from logdx.pipeline import Engine
from logdx.synth.hangs import silent_rank_hang
from logdx.synth.longjob import JobTruth
from logdx.testing import failed_report


def _report(status: str = "failed", *, ranks: list[int] | None = None, hosts: list[str] | None = None,
            line_no: int | None = None, failure_type: str = "hang", category: str = "infrastructure",
            action: str = "restart") -> Report:
    failed = status == "failed"
    return failed_report(
        status=status, category=category if failed else None, failure_type=failure_type if failed else None,
        action=action if failed else "none", culprits=Culprits(ranks=ranks or [], hosts=hosts or []),
        root_cause=RootCause(line_no=line_no, text="x") if line_no else None)


HANG = JobTruth(kind="silent_hang", status="failed", category="infrastructure", failure_type="hang", action="restart",
                exit_code=1, root_line_nos=[40, 55], culprit_ranks=[17], culprit_hosts=["node-03"])


def test_a_hang_culprit_must_be_named_alone_with_its_host() -> None:
    right = score_job(HANG, _report(ranks=[17], hosts=["node-03"], line_no=55))
    assert right["culprit"] and right["culprit_rank"] and right["culprit_host"] and right["root_line"]
    assert all(right[f] for f in ("status", "category", "action", "failure_type"))
    everyone = score_job(HANG, _report(ranks=list(range(64)), hosts=["node-03"]))
    assert everyone["culprit_rank"] is False and everyone["culprit"] is False
    no_host = score_job(HANG, _report(ranks=[17], hosts=[]))
    assert no_host["culprit_rank"] and no_host["culprit_host"] is False and no_host["culprit"] is False
    assert score_job(HANG, _report(line_no=41))["root_line"] is False
    unnamed_host = JobTruth(**{**HANG.to_dict(), "culprit_hosts": []})  # type: ignore[arg-type]
    scored = score_job(unnamed_host, _report(ranks=[17]))
    assert scored["culprit_host"] is None and scored["culprit"] is True


def test_a_healthy_job_is_scored_on_its_status_only() -> None:
    ok = JobTruth(kind="healthy", status="healthy", category=None, failure_type=None, action="none", exit_code=0)
    assert score_job(ok, _report("healthy")) == {"status": True, **dict.fromkeys(("category", "action", "failure_type", "root_line", "culprit", "culprit_rank", "culprit_host", "step", "timeout_class", "degradation"))}
    assert score_job(ok, _report("failed"))["status"] is False


def test_unknown_is_a_status_miss_on_both_but_neither_costly_mistake() -> None:
    ok = JobTruth(kind="healthy", status="healthy", category=None, failure_type=None, action="none", exit_code=0)
    assert score_job(ok, _report("unknown"))["status"] is False
    assert score_job(HANG, _report("unknown"))["status"] is False
    views = [CaseResult(str(i), {"status": want}, _report(got)) for i, (want, got) in enumerate(
        [("failed", "unknown"), ("healthy", "unknown"), ("failed", "healthy"), ("healthy", "failed"), ("healthy", "healthy")])]
    assert confusion(views) == {"crashes": 2, "crashes_called_healthy": 1, "healthy": 3, "healthy_called_failed": 1,
                                "unknown": 2, "runs": 5, "crashes_unknown": 1, "healthy_unknown": 1}
    for v in views:
        v.correct = {"status": v.report.status == v.label["status"]}
    assert sum(int(row["n"]) for row in calibration(views)) == 3  # an unknown report claims nothing: no point of it


def test_the_outside_scorer_counts_unknown_apart() -> None:
    """eval/heldout/score.py (standalone, no logdx import): unknown is a status miss on a failed and a healthy
    label alike, never a crash called healthy nor a healthy run called failed, and it has its own line."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "eval" / "heldout" / "score.py"
    spec = importlib.util.spec_from_file_location("heldout_score", path)
    assert spec is not None and spec.loader is not None
    score = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score)
    labels = [{"id": "1", "status": "failed", "category": "script", "failure_type": "syntax_error", "action": "no_restart"},
              {"id": "2", "status": "healthy", "action": "none"}, {"id": "3", "status": "failed", "action": "restart"},
              {"id": "4", "status": "healthy", "action": "none"}]
    reports = {"1": {"status": "unknown", "action": "none"}, "2": {"status": "unknown", "action": "none"},
               "3": {"status": "healthy", "action": "none"}, "4": {"status": "failed", "action": "restart"}}
    res = score.score_set("s", labels, reports)
    assert res["metrics"]["status"] == [0, 4]
    assert (res["crash_called_healthy"], res["healthy_called_failed"], res["unknown"]) == (["3"], ["4"], ["1", "2"])


def test_the_divergence_step_is_read_from_the_report_when_it_has_one() -> None:
    div = JobTruth(kind="divergence", status="failed", category="framework", failure_type="nan_loss",
                   action="no_restart", exit_code=None, root_line_nos=[9], divergence_step=4150, step_tolerance=20)
    without = _report(failure_type="nan_loss", category="framework", action="no_restart")
    assert report_divergence_step(without) is None
    assert score_job(div, without)["step"] is False  # a report that does not say counts as a miss
    for step, right in ((4150, True), (4170, True), (4131, True), (4171, False), (4100, False)):
        as_dicts = SimpleNamespace(progress={"divergence": {"kind": "spike", "step": step}}, **_fields(without))
        as_models = SimpleNamespace(progress=SimpleNamespace(divergence=SimpleNamespace(step=step)), **_fields(without))
        assert report_divergence_step(as_dicts) == report_divergence_step(as_models) == step  # type: ignore[arg-type]
        assert score_job(div, as_dicts)["step"] is right  # type: ignore[arg-type]
    assert report_divergence_step(SimpleNamespace(progress={"divergence": None})) is None  # type: ignore[arg-type]


def _fields(report: Report) -> dict[str, object]:
    return {name: getattr(report, name) for name in type(report).model_fields if name != "progress"}


@pytest.fixture(scope="module")
def rules_engine() -> Engine:
    settings = load_settings(env={})
    settings.llm.enabled = False
    settings.retrieval.enabled = False
    return Engine.create(settings)


def test_one_read_gives_a_report_per_cascade_and_with_the_exit_code(rules_engine: Engine) -> None:
    data, truth = generated(lambda out: silent_rank_hang(out, seed=2, flavour="plain", style="torchrun", ranks=8,
                                                         lines=2500))
    cascades = [Cascade("rules", False, False), Cascade("again", False, False)]
    reports, exit_reports = diagnose_log(rules_engine, data, cascades, exit_code=truth.exit_code)
    assert set(reports) == set(exit_reports) == {"rules", "again"}
    strip = {"id", "timings_ms"}
    assert reports["rules"].model_dump(exclude=strip) == reports["again"].model_dump(exclude=strip)
    assert reports["rules"].compression.lines_in == truth.lines_written
    assert exit_reports["rules"].status == "failed"


# -- the command line, on a labelled folder of our own -----------------------------------------------

DISK_FULL = """[rank3]:Traceback (most recent call last):
[rank3]:  File "/home/ci/train.py", line 120, in save
[rank3]:    torch.save(state, path)
[rank3]:OSError: [Errno 28] No space left on device
"""
WARNING = """[rank0]:/usr/lib/python3/site-packages/torch/nn/modules/module.py:1511: UserWarning: a harmless notice
[rank0]:  warnings.warn(
"""


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "labelled"
    folder.mkdir()
    (folder / "a1.log").write_text(DISK_FULL)
    (folder / "a2.log").write_text(WARNING)
    labels = [
        {"id": "a1", "source": "local:a1", "status": "failed", "category": "infrastructure", "failure_type": "disk_full",
         "action": "restart", "culprit": "rank 3", "root_line": "OSError: [Errno 28] No space left on device"},
        {"id": "a2", "source": "local:a2", "status": "healthy"},
    ]
    (folder / "labels.jsonl").write_text("".join(json.dumps(label) + "\n" for label in labels))
    return folder


@pytest.mark.slow
def test_the_command_line_scores_excerpts_and_their_burials(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    keep = tmp_path / "kept"
    code = main([str(_folder(tmp_path)), "--sets", "excerpts,buried", "--quick", "--json", str(out), "--keep", str(keep)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "== excerpts:" in printed and "== buried:" in printed and "== summary" in printed
    figures = json.loads(out.read_text())
    assert figures["cascades"] == ["rules"]
    excerpts = figures["sets"]["excerpts"]["figures"]["rules"]
    assert excerpts["accuracy"]["status"]["n"] == 2
    buried = figures["sets"]["buried"]
    assert [r["id"] for r in buried["runs"]] == ["a1#b0", "a2#b0"]
    assert buried["runs"][0]["truth"]["culprit_rank"] == 3  # the label names rank 3: buried under rank 3
    assert buried["figures"]["rules"]["confusion_exit_known"]["healthy"] == 1
    assert sorted(p.name for p in (keep / "buried").iterdir()) == ["a1_b0.log", "a1_b0.truth.json", "a2_b0.log",
                                                                    "a2_b0.truth.json"]


@pytest.mark.slow
def test_the_command_line_runs_one_generated_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    assert main(["--sets", "hangs", "--only", "silent-00-", "--quick", "--misses", "0", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["sets"]["hangs"]["runs"]
    assert len(runs) == 1 and runs[0]["truth"]["culprit_ranks"]
    assert set(runs[0]["rules"]["correct"]) >= {"culprit_rank", "culprit_host", "step"}
    assert "culprit rank" in capsys.readouterr().out


def test_the_command_line_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--sets", "excerpts"]) == 2
    assert "no labels.jsonl" in capsys.readouterr().err
    assert main(["--sets", "nonsense"]) == 2
    assert "unknown set" in capsys.readouterr().err
    assert main(["--bury", "0"]) == 2
    assert main(["--sets", "healthy", "--without", "nonsense"]) == 2
    assert "unknown noise" in capsys.readouterr().err



def test_the_gate_names_every_column_where_the_default_cascade_is_worse_than_rules() -> None:
    from logdx.evaluate.tables import COLUMNS, regressions

    def figures(**correct: int) -> dict:
        return {"accuracy": {c: {"correct": correct.get(c, 10), "n": 12, "accuracy": correct.get(c, 10) / 12}
                             for c in COLUMNS}}
    sets = {"excerpts": {"rules": figures(), "default": figures(action=9, category=11)},
            "hangs": {"rules": figures(culprit=4), "default": figures(culprit=5)},
            "healthy": {"rules": figures()}}  # rules only (--quick): nothing to compare
    assert regressions(sets) == ["excerpts action: default 9/12 < rules 10/12"]


def test_the_command_line_holds_rule_packs_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--hold-out: the same cases with a precise pack gone, its table and JSON under the pack's name."""
    out = tmp_path / "figures.json"
    folder = _folder(tmp_path)
    assert main([str(folder), "--sets", "excerpts", "--quick", "--misses", "0", "--json", str(out)]) == 0
    with_all = json.loads(out.read_text())["sets"]["excerpts"]["runs"][0]["rules"]
    assert with_all["correct"]["failure_type"] is True and with_all["got"]["decided_by"] == "rules"
    capsys.readouterr()
    assert main([str(folder), "--sets", "excerpts", "--quick", "--hold-out", "python", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held out: python ==" in printed and "== packs held out" in printed
    held = json.loads(out.read_text())["hold_out"]["excerpts without python"]["runs"][0]["rules"]
    assert set(held["correct"]) >= {"category", "action", "failure_type"} and held["got"]["status"] == "failed"
    assert main([str(folder), "--sets", "excerpts", "--quick", "--hold-out", "nonsense"]) == 2
    assert "no rule pack named nonsense" in capsys.readouterr().err
