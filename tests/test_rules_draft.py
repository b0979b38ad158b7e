"""`logdx rules draft` / `logdx rules approve`: a candidate pack for a root line no rule names, through
the real CLI entry, the real loader and the real pipeline."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import yaml

from logdx.cli.app import main
from logdx.config import Settings
from logdx.diagnose.rules import default_rules_dir, load_rules
from logdx.pipeline import Engine
from logdx.ruledraft import PROPOSED_MARK, DraftError, draft
from logdx.synth.generate import generate


def _job(*, seed: int, bad_rank: int, shard: str, path: str, ranks: int = 16, steps: int = 80) -> tuple[list[str], int]:
    """A two-node torchrun job: start-up, noisy training, one rank raising an error of the job's own store
    library, the others' NCCL watchdogs timing out after it, the agent's summary. Returns the lines and
    the 1-based line number of the exception line."""
    rnd = random.Random(seed)
    hosts = ["gpu-a17", "gpu-a18"]
    out = [f"W1203 07:{seed % 60:02d}:01.156000 181448 torch/distributed/run.py:793] Setting OMP_NUM_THREADS "
           "environment variable for each process to be 1 in default"]
    for r in range(ranks):
        out.append(f"[rank{r}]:2026-12-03 07:10:{r:02d},926 - INFO - train.py:88 - rank {r}/{ranks} local_rank "
                   f"{r % 8} on {hosts[r // 8]} (cuda:{r % 8})")
        out.append(f"[rank{r}]:{hosts[r // 8]}:181{450 + r}:181{450 + r} [{r % 8}] NCCL INFO Channel 00/0 : "
                   f"{r} -> {(r + 1) % ranks} via P2P/IPC")
    for s in range(1, steps + 1):
        for r in range(ranks):
            if rnd.random() < 0.03:
                out.append(f"[rank{r}]:/usr/local/lib/python3.11/site-packages/torch/autograd/graph.py:825: "
                           "UserWarning: grad and param do not obey the gradient layout contract.")
        out.append(f"[rank0]:2026-12-03 07:{11 + s // 60:02d}:{s % 60:02d},100 - INFO - train.py:140 - step {s} "
                   f"loss {3.2 - s * 0.01 + rnd.random() * 0.05:.4f} lr 3.0e-04 tokens/s {rnd.randint(90000, 99000)}")
    b = f"[rank{bad_rank}]:"
    out += [
        f"{b}Traceback (most recent call last):",
        f'{b}  File "/home/alice/proj/train.py", line 211, in <module>',
        f"{b}    main()",
        f'{b}  File "/home/alice/proj/train.py", line 174, in main',
        f"{b}    batch = next(loader)",
        f'{b}  File "/home/alice/proj/data/store.py", line 88, in read_shard',
        f'{b}    raise MyStoreError(f"shard {{idx:04d}} checksum mismatch on {{path}}")',
        f"{b}MyStoreError: shard {shard} checksum mismatch on {path}",
    ]
    root = len(out)
    for r in range(ranks):
        if r != bad_rank:
            out.append(f"[rank{r}]:[E1203 07:23:{r:02d}.826483488 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught "
                       f"collective operation timeout: WorkNCCL(SeqNum=4711, OpType=ALLREDUCE, NumelIn=1048576, "
                       f"NumelOut=1048576, Timeout(ms)=600000) ran for 600{r:03d} milliseconds before timing out.")
    out.append("E1203 07:23:30.256000 181448 torch/distributed/elastic/multiprocessing/api.py:869] failed "
               f"(exitcode: 1) local_rank: {bad_rank % 8} (pid: 181{450 + bad_rank}) of binary: /usr/local/bin/python3.11")
    return out, root


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _diagnose_json(capsys: pytest.CaptureFixture[str], log: Path, *extra: str) -> dict:
    capsys.readouterr()
    rc = main(["diagnose", "--json", "--no-store", "--no-llm", "--no-retrieval", *extra, str(log)])
    assert rc in (0, 1)
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, str]:
    """The job, the folder `rules draft` wrote, the root line number and what the command printed."""
    tmp = tmp_path_factory.mktemp("draft")
    lines, root = _job(seed=3, bad_rank=11, shard="0042", path="/lustre/fs1/alice/data/shard-0042.bin")
    log = _write(tmp / "job.log", lines)
    out = tmp / "drafts"
    buf = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(buf):
        assert main(["rules", "draft", str(log), "--out", str(out)]) == 0
    return log, out, root, buf.getvalue()


def test_without_the_draft_a_fallback_decides_the_job(capsys: pytest.CaptureFixture[str], drafted) -> None:
    log, _, root, _ = drafted
    report = _diagnose_json(capsys, log)
    assert report["root_cause"]["line_no"] == root
    assert {e["source"] for e in report["evidence"] if e["line_no"] == root} == {"rule:py-exception-fallback"}


def test_the_draft_is_one_pack_in_the_shipped_format(drafted) -> None:
    _, out, root, printed = drafted
    (pack,) = out.glob("*.yaml")
    text = pack.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    (rule,) = data["rules"]
    assert rule["role"] == "root_cause"
    assert (rule["category"], rule["failure_type"]) == ("script", "script_error")
    assert "[rank11]:MyStoreError: shard 0042 checksum mismatch on /lustre/fs1/alice/data/shard-0042.bin" in rule["examples"]
    (test,) = data["tests"]
    assert test["events"] == [{"rule": rule["id"], "line": test["verdict"]["root_line"]}]
    assert test["lines"][test["verdict"]["root_line"] - 1].startswith("[rank11]:MyStoreError: shard 0042")
    assert PROPOSED_MARK in text and "proposed script / script_error / no_restart" in printed
    assert "generated healthy runs" in printed and "examples and counterexamples" in printed


def test_rules_test_passes_with_the_draft(capsys: pytest.CaptureFixture[str], drafted) -> None:
    _, out, _, _ = drafted
    capsys.readouterr()
    assert main(["rules", "test", "--rules", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


def test_the_draft_names_the_root_line_and_its_variants(capsys: pytest.CaptureFixture[str], drafted,
                                                        tmp_path: Path) -> None:
    log, out, root, _ = drafted
    (pack,) = out.glob("*.yaml")
    rule_id = yaml.safe_load(pack.read_text())["rules"][0]["id"]
    report = _diagnose_json(capsys, log, "--rules", str(out))
    assert report["root_cause"]["line_no"] == root
    assert f"rule:{rule_id}" in {e["source"] for e in report["evidence"] if e["line_no"] == root}
    assert (report["category"], report["failure_type"], report["action"]) == ("script", "script_error", "no_restart")
    # The same error on another rank, another shard, another file system: the template's variants.
    lines, root2 = _job(seed=9, bad_rank=2, shard="1317", path="/scratch/bob/ds/shard-1317.bin")
    other = _write(tmp_path / "other.log", lines)
    report = _diagnose_json(capsys, other, "--rules", str(out))
    assert report["root_cause"]["line_no"] == root2
    assert f"rule:{rule_id}" in {e["source"] for e in report["evidence"] if e["line_no"] == root2}


@pytest.mark.parametrize(("flavour", "style", "seed"), [("deepspeed", "srun", 21), ("megatron", "torchrun", 22)])
def test_healthy_long_runs_stay_healthy_with_the_draft(drafted, tmp_path: Path, flavour: str, style: str,
                                                       seed: int) -> None:
    _, out, _, _ = drafted
    log = tmp_path / "healthy.log"
    with log.open("w", encoding="utf-8") as f:
        generate(f, scenario="healthy", seed=seed, ranks=32, lines=20000, style=style, flavour=flavour)
    settings = Settings()
    engine = Engine.for_rules(settings, load_rules([default_rules_dir(), out]))
    report, _ = engine.diagnose_path(log)
    assert report.status == "healthy"
    assert not [e for e in report.evidence if e.source.startswith("rule:draft-")]


def test_approve_copies_the_pack_without_its_marks(capsys: pytest.CaptureFixture[str], drafted,
                                                   tmp_path: Path) -> None:
    log, out, root, _ = drafted
    (pack,) = out.glob("*.yaml")
    mine = tmp_path / "my-rules"
    assert main(["rules", "approve", str(pack), "--into", str(mine)]) == 0
    (approved,) = mine.glob("*.yaml")
    text = approved.read_text(encoding="utf-8")
    assert PROPOSED_MARK not in text
    assert yaml.safe_load(text) == yaml.safe_load(pack.read_text(encoding="utf-8"))
    report = _diagnose_json(capsys, log, "--rules", str(mine))
    assert report["root_cause"]["line_no"] == root and report["confidence"] >= 0.5


def test_approve_refuses_a_pack_whose_test_fails(capsys: pytest.CaptureFixture[str], drafted, tmp_path: Path) -> None:
    _, out, _, _ = drafted
    (pack,) = out.glob("*.yaml")
    broken = tmp_path / "broken" / pack.name
    broken.parent.mkdir()
    broken.write_text(pack.read_text().replace("failure_type: script_error, root_line", "failure_type: key_error, root_line"))
    capsys.readouterr()
    assert main(["rules", "approve", str(broken), "--into", str(tmp_path / "mine")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expected key_error" in err
    assert not (tmp_path / "mine").exists()


def test_approve_needs_a_rules_folder(capsys: pytest.CaptureFixture[str], drafted, monkeypatch) -> None:
    _, out, _, _ = drafted
    (pack,) = out.glob("*.yaml")
    monkeypatch.delenv("LOGDX_RULES__DIRS", raising=False)
    capsys.readouterr()
    assert main(["rules", "approve", str(pack)]) == 2
    assert "--into DIR" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    capsys.readouterr()
    assert main(["rules", "draft", str(tmp_path / "missing.log"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such file" in err
    # A job whose root line a precise rule names: nothing to draft.
    xid = tmp_path / "xid.log"
    with xid.open("w", encoding="utf-8") as f:
        generate(f, scenario="xid79", seed=5, ranks=16, lines=1500)
    assert main(["rules", "draft", str(xid), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is named by rule" in err and "nothing to draft" in err
    # A hang whose only evidence is the watchdogs' timeouts: a symptom rule names the root line, and an echo
    # is no cause to write a root-cause rule for.
    hang = tmp_path / "hang.log"
    with hang.open("w", encoding="utf-8") as f:
        generate(f, scenario="nccl_hang", seed=5, ranks=16, lines=1500)
    assert main(["rules", "draft", str(hang), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is named by rule" in err
    # A healthy job: no failure, nothing to draft.
    healthy = tmp_path / "healthy.log"
    with healthy.open("w", encoding="utf-8") as f:
        generate(f, scenario="healthy", seed=5, ranks=8, lines=1500)
    assert main(["rules", "draft", str(healthy), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing to draft" in err
    assert not (tmp_path / "o").exists()


def test_a_pattern_that_hits_a_healthy_line_is_tightened_or_dropped(tmp_path: Path) -> None:
    lines, _ = _job(seed=4, bad_rank=1, shard="0007", path="/lustre/fs1/alice/data/shard-0007.bin")
    log = _write(tmp_path / "job.log", lines)
    loose_hit = "MyStoreError: shard warm-up checksum mismatch on cache (retrying) fine"
    d = draft(log, Settings(), healthy=[loose_hit])
    (rule,) = d.rules
    assert rule.tightened and loose_hit[:20] in rule.tightened and d.notes
    assert rule.pattern.endswith(r"\s*$") and r"\d{" in rule.pattern
    import re

    assert re.search(rule.pattern, "MyStoreError: shard 0007 checksum mismatch on /lustre/fs1/alice/data/shard-0007.bin")
    assert not re.search(rule.pattern, loose_hit)
    # A healthy line that even the tight form hits: the rule is dropped, and the user is told.
    with pytest.raises(DraftError, match="dropped"):
        draft(log, Settings(), healthy=["MyStoreError: shard 0001 checksum mismatch on /tmp/probe.bin"])


def _traceback_job(tmp_path: Path, exception_line: str, library_file: str) -> Path:
    lines = [f"[rank{r}]:2026-12-03 07:10:0{r},100 - INFO - train.py:140 - step 1 loss 3.1 lr 3.0e-04" for r in range(4)]
    lines += ["[rank2]:Traceback (most recent call last):",
              '[rank2]:  File "/home/alice/proj/train.py", line 40, in <module>',
              "[rank2]:    engine.load_checkpoint(args.ckpt)",
              f'[rank2]:  File "{library_file}", line 812, in load_checkpoint',
              "[rank2]:    raise err",
              f"[rank2]:{exception_line}"]
    return _write(tmp_path / "job.log", lines)


def test_a_library_exception_is_labelled_by_its_owner_and_matched_by_its_short_name(tmp_path: Path) -> None:
    import re

    from logdx.ruledraft import pack_problems, write_draft

    log = _traceback_job(tmp_path, "deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded "
                         "used a DP world size of 8 but the current world size is 16",
                         "/opt/conda/lib/python3.11/site-packages/deepspeed/runtime/engine.py")
    d = draft(log, Settings(), healthy=[])
    (rule,) = d.rules
    assert (rule.label.category.value, rule.label.failure_type) == ("framework", "framework_error")
    assert "owner of deepspeed" in rule.basis
    assert re.search(rule.pattern, "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 4 "
                     "but the current world size is 32")
    assert not re.search(rule.pattern, "ZeRORuntimeException: optimizer state missing for param group 0")
    assert pack_problems(write_draft(d, tmp_path / "out"), Settings()) == []


def test_a_line_the_catalog_knows_is_labelled_by_the_catalog(tmp_path: Path) -> None:
    from logdx.ruledraft import pack_problems, write_draft

    log = _traceback_job(tmp_path, "RuntimeError: Expected a 'cuda' device type for generator but found 'cpu'",
                         "/home/alice/proj/sampler.py")
    d = draft(log, Settings(), healthy=[])
    (rule,) = d.rules
    assert rule.basis.startswith("the error catalog")
    assert rule.label.failure_type == "config_error"
    assert pack_problems(write_draft(d, tmp_path / "out"), Settings()) == []


def test_a_plain_error_line_is_drafted_when_the_exit_code_says_the_job_failed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lines = [f"gpu-a17: [rank{r}]:2026-12-03 07:10:0{r},100 - INFO - train.py:140 - step {s} loss 3.1 lr 3.0e-04"
             for s in (1, 2) for r in range(4)]
    lines.append("gpu-a17: [rank1]:2026-12-03 07:10:09,100 - ERROR - storectl: volume vol-7781 lease revoked by "
                 "controller, aborting writer")
    root = len(lines)
    log = _write(tmp_path / "job.log", lines)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["rules", "draft", str(log), "--out", str(out)]) == 2
    assert "--exit-code" in capsys.readouterr().err
    assert main(["rules", "draft", str(log), "--out", str(out), "--exit-code", "1"]) == 0
    report = _diagnose_json(capsys, log, "--rules", str(out), "--exit-code", "1")
    assert report["root_cause"]["line_no"] == root
    assert any(e["source"].startswith("rule:draft-") for e in report["evidence"] if e["line_no"] == root)
