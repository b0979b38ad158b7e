"""What `diagnose` is handed in real deployments: a job's per-node files or a folder of them (hosts
from the file names, lines merged in time order), a saved shipper body (OTLP protobuf from the real
OpenTelemetry exporter), and rules-only runs whose reports must be stored like any other (feedback,
`logdx nodes`)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from logdx.config import ConfigError, InputSettings, load_settings
from logdx.jobinput import LineMap, LogFile, collect, merged_lines, name_of
from logdx.normalize import InputError, Source

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
RULES_ONLY = ("--no-llm", "--no-retrieval")


def logdx(*args: str, data_dir: Path, config: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOGDX_DATA_DIR": str(data_dir), "NO_COLOR": "1"}
    if config is not None:
        env["LOGDX_CONFIG"] = str(config)
    return subprocess.run([sys.executable, "-m", "logdx", *args], capture_output=True, text=True, env=env, timeout=300)


def _stamp(second: int) -> str:
    return f"2024-05-01 12:{second // 60:02d}:{second % 60:02d},{(second * 37) % 1000:03d}"


def node_files(tmp_path: Path, names: dict[str, str]) -> Path:
    """A two-node job of 8 ranks, one file per node (written under the names given for `train-01`,
    `train-02`, `kernel-02`), no host in any line: ranks 0-3 on node-01, 4-7 on node-02. Node-02's GPU
    falls off the bus at 12:00:31 (its kernel log, dmesg -T style); ten minutes later every other
    rank's NCCL watchdog fires."""
    folder = tmp_path / "job"
    folder.mkdir()
    train: dict[str, list[str]] = {"train-01": [], "train-02": []}
    for second in range(0, 32):
        for rank in range(8):
            node = "train-01" if rank < 4 else "train-02"
            train[node].append(f"[{_stamp(second)}] [INFO] [rank{rank}] iteration {second + 100:>6}/ 10000 | "
                               f"lm loss: {2.5 - second / 100:.4E} | grad norm: 1.02 |")
    for rank in range(8):
        if rank == 6:
            continue
        node = "train-01" if rank < 4 else "train-02"
        train[node].append(f"[rank{rank}]:[E501 12:10:31.{rank:03d} ProcessGroupNCCL.cpp:1515] [PG 0 Rank {rank}] "
                           "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=77, OpType=ALLREDUCE) ran "
                           "for 600012 milliseconds before timing out.")
    kernel = ["[Wed May  1 11:58:02 2024] nvidia-nvlink: Nvlink Core is being initialized",
              f"[Wed May  1 12:00:31 2024] {XID}",
              "[Wed May  1 12:00:31 2024] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."]
    for key, lines in (*train.items(), ("kernel-02", kernel)):
        path = folder / names[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return folder


# --- names, merging: in-process ----------------------------------------------------------------------


def test_a_files_name_without_its_extensions() -> None:
    assert name_of("node-01.log") == "node-01"
    assert name_of("node-01.stdout.log.gz") == "node-01"
    assert name_of("node-01.dmesg.txt.1") == "node-01"
    assert name_of("host=login.log") == "host=login"
    assert name_of("plain") == "plain"


def test_default_patterns_take_hosts_and_ranks_but_not_a_jobs_usual_file_names(tmp_path) -> None:
    names = ["node-01.log", "gpu07.stdout.log.gz", "host=login-a.log", "rank-3.log", "worker_12.out",
             "slurm-123456.out", "job-7.log", "train.log", "llama-7b.log", "stdout-0.log", "dgx-a100-3.err"]
    for name in names:
        (tmp_path / name).write_text("x\n")
    (tmp_path / "n" / "nid001234").mkdir(parents=True)
    (tmp_path / "n" / "nid001234" / "stdout.log").write_text("x\n")
    (tmp_path / ".hidden.log").write_text("x\n")
    got = {Path(f.shown).name if "nid" not in f.shown else f.shown[len(str(tmp_path)) + 1:]: (f.host, f.rank)
           for f in collect([str(tmp_path)], InputSettings())}
    assert got == {
        "node-01.log": ("node-01", None), "gpu07.stdout.log.gz": ("gpu07", None),
        "host=login-a.log": ("login-a", None), "rank-3.log": (None, 3), "worker_12.out": (None, 12),
        "slurm-123456.out": (None, None), "job-7.log": (None, None), "train.log": (None, None),
        "llama-7b.log": (None, None), "stdout-0.log": (None, None), "dgx-a100-3.err": ("dgx-a100-3", None),
        "n/nid001234/stdout.log": ("nid001234", None),  # the folder names the node
    }
    custom = InputSettings(name_patterns=[r"^(?P<host>[a-z]+)-console$"])
    (tmp_path / "gpubox-console.log").write_text("x\n")
    assert [(f.host, f.rank) for f in collect([str(tmp_path / "gpubox-console.log")], custom)] == [("gpubox", None)]


def test_name_patterns_are_checked_when_the_settings_load(tmp_path) -> None:
    for bad, says in ((r"^(?P<host>[a-z+$", "not a regular expression"), (r"^node-\d+$", "no (?P<host>")):
        path = tmp_path / "logdx.yaml"
        path.write_text(json.dumps({"input": {"name_patterns": [bad]}}))
        with pytest.raises(ConfigError) as e:
            load_settings(path)
        assert "input.name_patterns" in str(e.value) and says in str(e.value)


def test_collect_refuses_stdin_among_files_too_many_files_and_empty_folders(tmp_path) -> None:
    for i in range(4):
        (tmp_path / f"node-{i}.log").write_text("x\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError):
        collect(["-", str(tmp_path / "node-0.log")], InputSettings())
    with pytest.raises(InputError, match="input.max_files"):
        collect([str(tmp_path)], InputSettings(max_files=3))
    with pytest.raises(InputError, match="no log files"):
        collect([str(tmp_path / "empty")], InputSettings())
    with pytest.raises(InputError, match="no such file"):
        collect([str(tmp_path / "node-9.log")], InputSettings())
    # The same file named twice (or inside a folder also named) is read once.
    assert len(collect([str(tmp_path / "node-0.log"), str(tmp_path)], InputSettings())) == 4


def test_lines_merge_in_time_order_and_lines_without_a_stamp_stay_with_their_neighbours() -> None:
    a = [b"2024-05-01T12:00:01Z a1", b"  a1 continued (no stamp)", b"2024-05-01T12:00:05Z a5"]
    b = [b"no stamp yet: takes the first stamp's time", b"2024-05-01T12:00:03Z b3", b"2024-05-01T12:00:02Z b2, a late writer"]
    c = [b"c: never a stamp", b"c: still none"]
    src = Source(host="node-b")
    merged = list(merged_lines([iter((x, None) for x in a), iter((x, src) for x in b), iter((x, None) for x in c)],
                               65536))
    assert [line for _, line, _ in merged] == [
        *c,  # no time at all: first, whole
        a[0], a[1],  # the line without a stamp stays with its neighbour
        *b,  # before its first stamp a line takes that stamp's time; a late writer's stamp never goes back
        a[2]]
    assert [i for i, _, _ in merged] == [2, 2, 0, 0, 1, 1, 1, 0]
    assert all(s is src for i, _, s in merged if i == 1)


def test_line_map_finds_the_file_and_line_of_a_merged_line() -> None:
    files = [LogFile(Path("a.log"), "a.log"), LogFile(Path("b.log"), "b.log")]
    where = LineMap(files)
    for merged, (index, line) in enumerate([(0, 1), (0, 2), (1, 1), (0, 3), (1, 2), (1, 3)], start=1):
        where.note(merged, index, line)
    assert [(f.shown, n) for f, n in (where.locate(m) for m in range(1, 7))] == [
        ("a.log", 1), ("a.log", 2), ("b.log", 1), ("a.log", 3), ("b.log", 2), ("b.log", 3)]


def test_a_shippers_records_file_merges_by_its_records_times(tmp_path) -> None:
    """A node's kernel log saved by a shipper as NDJSON beside another node's text log: each record
    keeps its own time and fields, the file's name gives its host."""
    from logdx.faces import build_engine
    from logdx.jobinput import diagnose_files

    (tmp_path / "node-01.log").write_text("[2024-05-01 12:00:01,000] [INFO] iteration 1/100 | lm loss: 2.0\n"
                                          "[2024-05-01 12:00:05,000] [INFO] iteration 2/100 | lm loss: 2.0\n")
    (tmp_path / "node-02.json").write_text(
        json.dumps({"message": XID, "ts": "2024-05-01T12:00:03Z", "_transport": "kernel"}) + "\n"
        + json.dumps({"priority": "6"}) + "\n")  # a record without a line: counted, not lost
    settings = load_settings(env={"LOGDX_DATA_DIR": str(tmp_path / "d")})
    settings.llm.enabled = settings.retrieval.enabled = False
    diagnosed = diagnose_files(build_engine(settings), collect([str(tmp_path)], settings.input), "auto")
    report = diagnosed.report
    assert report.failure_type == "gpu_fell_off_bus" and report.culprits.hosts == ["node-02"]
    assert report.root_cause is not None and report.root_cause.line_no == 2  # between 12:00:01 and 12:00:05
    assert "records without a line, skipped: 1 no_message" in report.notes
    assert diagnosed.hosts == ["node-01", "node-02"]


# --- the command, as users run it ------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("names", [
    {"train-01": "node-01.log", "train-02": "node-02.stdout.log.gz", "kernel-02": "node-02.dmesg.log"},
    {"train-01": "host=node-01.log", "train-02": "host=node-02.log", "kernel-02": "host=node-02.kernel.txt"},
    {"train-01": "node-01/stdout.log", "train-02": "node-02/stdout.log", "kernel-02": "node-02/kern.log"},
], ids=["node-N.log", "host=", "per-node folders"])
def test_a_folder_of_per_node_files_is_one_job_with_hosts_from_the_names(tmp_path, names) -> None:
    folder = node_files(tmp_path, names)
    out = logdx("diagnose", str(folder), "--json", *RULES_ONLY, data_dir=tmp_path / "data")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["failure_type"], report["action"]) == ("gpu_fell_off_bus", "cordon_and_restart")
    assert report["culprits"]["hosts"] == ["node-02"]
    assert report["root_cause"]["host"] == "node-02" and report["root_cause"]["text"].endswith(XID)
    assert report["compression"]["lines_in"] == 32 * 8 + 7 + 3
    # In time order: the Xid (12:00:31) comes after the 31st second's 8 lines, before the 32nd's.
    assert 31 * 8 < report["root_cause"]["line_no"] <= 31 * 8 + 3
    kernel = str(folder / names["kernel-02"])
    assert any(f"is {kernel} line 2" in n for n in report["notes"]), report["notes"]
    assert any("3 files read as one job" in n and "node-01" in n for n in report["notes"])
    # Several files named one by one are the same job.
    files = sorted(str(p) for p in folder.rglob("*") if p.is_file())
    again = json.loads(logdx("diagnose", *files, "--json", *RULES_ONLY, data_dir=tmp_path / "data").stdout)
    assert again["culprits"]["hosts"] == ["node-02"] and again["root_cause"]["line_no"] == report["root_cause"]["line_no"]


@pytest.mark.integration
def test_a_binary_file_in_a_folder_is_skipped_one_named_is_refused(tmp_path) -> None:
    folder = node_files(tmp_path, {"train-01": "node-01.log", "train-02": "node-02.log", "kernel-02": "node-02.dmesg"})
    (folder / "core.bin").write_bytes(bytes(range(256)) * 8)
    out = logdx("diagnose", str(folder), "--json", *RULES_ONLY, data_dir=tmp_path / "data")
    assert out.returncode == 0, out.stderr
    assert any("skipped 1 file(s)" in n and "core.bin" in n for n in json.loads(out.stdout)["notes"])
    bad = logdx("diagnose", str(folder / "node-01.log"), str(folder / "core.bin"), *RULES_ONLY, data_dir=tmp_path / "d")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "core.bin" in bad.stderr


@pytest.mark.integration
def test_rules_only_reports_are_stored_for_feedback_and_feed_the_node_history(tmp_path) -> None:
    folder = node_files(tmp_path, {"train-01": "node-01.log", "train-02": "node-02.log", "kernel-02": "node-02.dmesg"})
    data = tmp_path / "data"
    out = logdx("diagnose", str(folder), "--json", "--job-id", "llama-run-7", *RULES_ONLY, data_dir=data)
    assert out.returncode == 0, out.stderr
    report_id = json.loads(out.stdout)["id"]
    fb = logdx("feedback", report_id, "--category", "infrastructure", "--failure-type", "gpu_fell_off_bus",
               "--note", "GPU reseated", data_dir=data)
    assert fb.returncode == 0, fb.stderr
    assert report_id in fb.stdout
    nodes = {n["node"]: n for n in json.loads(logdx("nodes", "--json", data_dir=data).stdout)}
    assert set(nodes) == {"node-01", "node-02"}
    assert nodes["node-02"]["jobs"] == ["llama-run-7"] and nodes["node-02"]["failure_types"] == {"gpu_fell_off_bus": 1}
    assert nodes["node-01"]["events"] == 0  # seen, never blamed
    shown = json.loads(logdx("nodes", "show", "node-02", data_dir=data).stdout)
    assert shown["recent"][0]["xid"] == 79 and shown["recent"][0]["report_id"] == report_id
    # The same log diagnosed again is the same event, not a second one.
    logdx("diagnose", str(folder), "--job-id", "llama-run-7", *RULES_ONLY, data_dir=data)
    assert json.loads(logdx("nodes", "show", "node-02", data_dir=data).stdout)["events"] == 1
    # --no-store: nothing kept, so feedback on it is refused.
    other = tmp_path / "other"
    out = logdx("diagnose", str(folder), "--json", "--no-store", *RULES_ONLY, data_dir=other)
    fb = logdx("feedback", json.loads(out.stdout)["id"], "--category", "infrastructure",
               "--failure-type", "gpu_fell_off_bus", data_dir=other)
    assert fb.returncode == 2 and len(fb.stderr.strip().splitlines()) == 1
    assert json.loads(logdx("nodes", "--json", data_dir=other).stdout) == []


@pytest.mark.integration
def test_a_report_that_cannot_be_stored_is_still_printed_and_says_so(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "logdx.db").mkdir()  # the database path is a folder: cannot be opened
    log = tmp_path / "node-02.dmesg.log"
    log.write_text(f"node-02 kernel: {XID}\n")
    out = logdx("diagnose", str(log), "--json", *RULES_ONLY, data_dir=data)
    assert out.returncode == 0, out.stderr
    assert any(n.startswith("report not stored") for n in json.loads(out.stdout)["notes"])


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_a_saved_otlp_protobuf_body_is_read_as_otlp_without_format(tmp_path, receiver) -> None:
    """The body the real OpenTelemetry SDK exporter posts, saved to a file: once read as 35,757 lines
    of garbage text and called a plausible failure."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    with receiver.Receiver() as rx:
        provider = LoggerProvider(resource=Resource.create({"host.name": "gpu-node-05", "job.id": "otel-9"}))
        provider.add_log_record_processor(SimpleLogRecordProcessor(OTLPLogExporter(endpoint=rx.url + "/v1/logs")))
        logger = logging.getLogger("logdx-test.saved-otlp")
        logger.propagate = False
        handler = LoggingHandler(logger_provider=provider)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        for step in range(60):
            logger.info(f"[rank5]: iteration {step}/1000 | loss 2.{step:02d} | tokens/s 41000")
        logger.error(f"gpu-node-05 kernel: {XID}")
        logger.removeHandler(handler)
        provider.shutdown()
        bodies = [r.body for r in rx.wait_for(61)]
    assert len(bodies) == 61 and all(b[:1] == b"\n" for b in bodies)
    saved = tmp_path / "body.otlp"
    saved.write_bytes(bodies[-1])
    out = logdx("diagnose", str(saved), "--json", *RULES_ONLY, data_dir=tmp_path / "data")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["compression"]["lines_in"] == 1
    assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-05"]
    # A damaged body is refused (one line, exit 2), never read as text.
    damaged = tmp_path / "damaged.otlp"
    damaged.write_bytes(bodies[3][:-7])
    out = logdx("diagnose", str(damaged), *RULES_ONLY, data_dir=tmp_path / "data")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.integration
def test_the_exit_code_when_known_reaches_the_diagnosis(tmp_path) -> None:
    folder = tmp_path / "quiet"
    folder.mkdir()
    for node in ("node-01", "node-02"):
        (folder / f"{node}.log").write_text("".join(f"[{_stamp(s)}] [INFO] iteration {s}/100 | lm loss: 2.0\n"
                                                    for s in range(5)))
    status = {}
    for code in ("0", "1"):
        out = logdx("diagnose", str(folder), "--json", "--exit-code", code, "--no-store", *RULES_ONLY,
                    data_dir=tmp_path / "data")
        assert out.returncode == 0, out.stderr
        status[code] = json.loads(out.stdout)["status"]
    assert status == {"0": "healthy", "1": "failed"}  # a log that says nothing, a job that died anyway



@pytest.mark.integration
def test_a_false_alarm_takes_the_reports_blame_off_the_nodes_history(tmp_path) -> None:
    folder = node_files(tmp_path, {"train-01": "node-01.log", "train-02": "node-02.log", "kernel-02": "node-02.dmesg"})
    data = tmp_path / "data"
    out = logdx("diagnose", str(folder), "--json", "--job-id", "llama-run-8", *RULES_ONLY, data_dir=data)
    report_id = json.loads(out.stdout)["id"]
    assert json.loads(logdx("nodes", "show", "node-02", data_dir=data).stdout)["events"] == 1
    both = logdx("feedback", report_id, "--false-alarm", "--category", "infrastructure", data_dir=data)
    assert both.returncode == 2 and len(both.stderr.strip().splitlines()) == 1
    neither = logdx("feedback", report_id, data_dir=data)
    assert neither.returncode == 2 and "--false-alarm" in neither.stderr
    fb = logdx("feedback", report_id, "--false-alarm", "--note", "the node was being burned in", data_dir=data)
    assert fb.returncode == 0, fb.stderr
    assert "false alarm" in fb.stdout and "node-02" in fb.stdout
    assert json.loads(logdx("nodes", "show", "node-02", data_dir=data).stdout)["events"] == 0
