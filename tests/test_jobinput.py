"""One reading of "these inputs are one job" (`logdx.jobinput`), shared by the faces: the merge's records fed
to the session are what the session would have made of the merged lines itself, and no face reaches into
another for it."""

from __future__ import annotations

import random
from pathlib import Path

from logdx.jobinput import JobFiles, collect, merged_lines
from logdx.jobinput.read import Diagnosed, diagnose_job, open_job
from logdx.pipeline import Engine
from test_layout import import_graph

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _write_job(folder: Path, seed: int) -> None:
    """Three nodes' torchrun output (ISO stamps, rank prefixes, noise, a line longer than input.max_line_bytes)
    and one node's kernel log (syslog stamps, no year: the job's year is read from the others)."""
    rng = random.Random(seed)
    folder.mkdir()
    for n in range(3):
        lines = []
        for step in range(1, 201):  # the job dies at step 200, when node-01's GPU falls off the bus
            t = f"2024-12-31T23:{50 + step // 60:02d}:{step % 60:02d}.{rng.randrange(1000):03d}Z"
            rank = n * 8 + rng.randrange(8)
            host = f"node-{n:02d}: {t}"  # pdsh's prefix, then torchrun's
            lines.append(f"{host} [rank{rank}]: iteration {step}/1000 | lm loss: {2.5 - step / 1000:.4f}")
            if rng.random() < 0.05:
                lines.append(f"{host} [rank{rank}]: UserWarning: TypedStorage is deprecated")
            if n == 1 and step == 200:
                lines.append(f"{host} [rank{rank}]: RuntimeError: CUDA error: unspecified launch failure")
                lines.append(f"node-01: [rank{rank}]:   File \"train.py\", line 88, in <module>")  # no stamp
                lines.append("x" * 70_000)  # cut at input.max_line_bytes
        (folder / f"node-{n:02d}.log").write_text("\n".join(lines) + "\n")
    kern = [f"Dec 31 23:5{m}:00 node-01 kernel: eth0: link up" for m in range(4)]
    kern.append(f"Dec 31 23:53:19 node-01 kernel: {XID}")
    (folder / "node-01.kern.log").write_text("\n".join(kern) + "\n")


def test_the_merges_records_are_what_the_session_makes_of_the_merged_lines(tmp_path, engine: Engine):
    _write_job(tmp_path / "job", seed=4)
    files = collect([str(tmp_path / "job")], engine.settings.input)
    with JobFiles.open(files, "auto", engine.settings.input) as job:
        fed = diagnose_job(engine, job, exit_code=1)
    # The same merged lines, each normalised by the session itself (the reading before the merge's records).
    with JobFiles.open(files, "auto", engine.settings.input) as job:
        session = engine.new_session()
        assert job.year is not None
        session.hint_year(*job.year)
        for _, raw, source in merged_lines(job.streams, engine.settings.input.max_line_bytes, job.year):
            session.feed(raw, source)
        by_lines = session.report(exit_code=1)
    assert fed.report.status == "failed" and fed.report.culprits.hosts == ["node-01"]
    mine, theirs = fed.report.model_dump(mode="json"), by_lines.model_dump(mode="json")
    for doc in (mine, theirs):
        doc.pop("id"), doc.pop("timings_ms"), doc.pop("notes")
    assert mine == theirs
    assert fed.report.compression.lines_in == by_lines.compression.lines_in > 600
    assert fed.session is not None and fed.session.truncated_lines == session.truncated_lines == 1
    assert fed.session.normalizer.bytes_in == session.normalizer.bytes_in > 0
    assert [(t.template, t.count) for t in fed.templates] == [(t.template, t.count) for t in session.templates()]


def test_one_path_is_one_log_and_a_folder_is_one_job(tmp_path, engine: Engine):
    _write_job(tmp_path / "job", seed=5)
    one = tmp_path / "job" / "node-01.kern.log"
    with open_job([str(one)], engine.settings.input) as job:
        alone: Diagnosed = diagnose_job(engine, job)
    with open_job([str(tmp_path / "job")], engine.settings.input) as job:
        whole = diagnose_job(engine, job)
    assert alone.report.compression.lines_in == 5
    assert whole.report.compression.lines_in > 600
    assert any(n.startswith("4 files read as one job") for n in whole.report.notes)
    root = whole.report.root_cause
    assert root is not None and root.host == "node-01"
    # The root line's number counts the merged lines; the note says which file's line it is.
    own = tmp_path / "job" / "node-01.log"
    at = own.read_text().splitlines().index(root.text) + 1
    assert f"line numbers count the merged lines: the root line {root.line_no} is {own} line {at}" in whole.report.notes
    assert root.line_no > at


def test_the_job_reading_is_the_cores_and_no_face_reaches_into_another_for_it():
    graph = import_graph()
    faces = ("logdx.cli", "logdx.run", "logdx.api", "logdx.agent", "logdx.faces")
    reading = {m: t for m, t in graph.items() if m.startswith("logdx.jobinput")}
    assert reading and not [(m, t) for m, ts in reading.items() for t in ts if t.startswith(faces)]
    assert not [t for m, ts in graph.items() if m.startswith("logdx.agent") for t in ts if t.startswith("logdx.cli")]
    users = {m for m, ts in graph.items() for t in ts if t.startswith("logdx.jobinput") and not m.startswith("logdx.jobinput")}
    assert {"logdx.cli.diagnose", "logdx.agent.tools", "logdx.evaluate.runner"} <= users
