"""eval/gpualert/score.py on a small corpus laid out as GPUAlert's (labels.jsonl, corpus/injected, baselines/):
the label-naming `[inject]` line is gone before logdx or a baseline reads a log, the mapping is checked against the
taxonomy, and a miss is a miss."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCORE = Path(__file__).resolve().parents[1] / "eval" / "gpualert" / "score.py"

LOGS = {
    "cuda_oom-injected-0001": ("cuda_oom", 1, [
        "[inject] mode=cuda_oom host=gpu07 pid=4411",
        "step 0001 | loss = 2.31",
        "Traceback (most recent call last):",
        '  File "train.py", line 40, in <module>',
        "    out = model(batch)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "31.74 GiB of which 1.12 GiB is free.",
    ]),
    "missing_module-injected-0001": ("missing_module", 1, [
        "[inject] mode=missing_module host=gpu07 pid=4412",
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "    import apex",
        "ModuleNotFoundError: No module named 'apex'",
    ]),
    # everything that says "segfault" is in the line a reader must never see: what is left is a run that trains
    "segfault-injected-0001": ("segfault", -11, [
        "[inject] mode=segfault note='Segmentation fault (core dumped)' host=gpu07",
        "step 0001 | loss = 2.31",
        "step 0002 | loss = 2.29",
    ]),
}

GREP = '''
NAME = "grep"
def classify(sample):
    return "segfault" if "Segmentation fault" in sample["log"] else "generic"
'''


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpualert_score", SCORE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "corpus" / "injected").mkdir(parents=True)
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "grep_baseline.py").write_text(GREP)
    labels = []
    for case_id, (mode, code, lines) in LOGS.items():
        rel = f"corpus/injected/{case_id}.log"
        (tmp_path / rel).write_text("\n".join(lines) + "\n")
        labels.append({"id": case_id, "mode": mode, "source": "injected", "log_path": rel, "true_exit_code": code})
    (tmp_path / "corpus" / "labels.jsonl").write_text("".join(json.dumps(x) + "\n" for x in labels))
    return tmp_path


def test_the_mapping_names_only_logdx_failure_types_and_every_class() -> None:
    mapping = _load().load_mapping()
    assert len(mapping) == 15
    assert mapping["missing_module"].same == {"import_error"}
    assert "key_error" in mapping["traceback"].same  # `category: script` admits the script's types
    assert all(m.same <= m.refined for m in mapping.values())


def test_the_inject_line_is_read_by_no_one_and_a_miss_fails_the_run(corpus: Path, tmp_path: Path) -> None:
    score = _load()
    out = tmp_path / "figures.json"
    assert score.main([str(corpus), "--json", str(out)]) == 1  # the stripped segfault log shows no failure
    f = json.loads(out.read_text())
    for column in ("no exit code", "with exit code"):
        row = f["cascades"]["rules"][column]["all"]
        assert row["n"] == 3 and row["typed"] == pytest.approx(2 / 3, abs=1e-3), row
        assert [m.split(":")[0] for m in row["misses"]] == ["segfault-injected-0001"], row
    assert f["baselines"]["grep"]["all"] == 0.0  # its needle was only in the [inject] line


def test_a_corpus_all_typed_passes(corpus: Path) -> None:
    labels = corpus / "corpus" / "labels.jsonl"
    kept = [x for x in labels.read_text().splitlines() if "segfault" not in x]
    labels.write_text("\n".join(kept) + "\n")
    assert _load().main([str(corpus)]) == 0


def test_a_folder_that_is_not_the_corpus_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a gpualert-eval work tree nor a git mirror"):
        _load().main([str(tmp_path)])
