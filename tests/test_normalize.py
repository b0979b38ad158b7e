"""Stage 1: prefixes become fields, and no line can crash the reader."""

from __future__ import annotations

import gzip
import io
import tracemalloc

import pytest

from logdx.normalize import InputError, Normalizer, Source, iter_lines, open_input, sanitize


@pytest.mark.parametrize(
    ("line", "rank", "local_rank", "host", "text"),
    [
        ("[default3]:[rank27]:iteration 10", 27, 3, None, "iteration 10"),
        ("[rank5]: Traceback (most recent call last):", 5, None, None, "Traceback (most recent call last):"),
        ("12: [rank12]: loss 2.0", 12, None, None, "loss 2.0"),
        ("  7: step 3", 7, None, None, "step 3"),
        ("node-03: RuntimeError: boom", None, None, "node-03", "RuntimeError: boom"),
        ("gpu-a100-017:4567:4590 [2] NCCL WARN NET/IB : Got completion", None, 2, "gpu-a100-017",
         "NCCL WARN NET/IB : Got completion"),
        ("Mon Nov 27 10:39:24 2017[1,17]<stderr>:NameError: x", 17, None, None, "NameError: x"),
        ("nid005143:3 err: oops", 3, None, "nid005143", "oops"),
    ],
)
def test_prefixes_become_fields(line, rank, local_rank, host, text):
    rec = Normalizer().normalize(line)
    assert (rec.rank, rec.local_rank, rec.host) == (rank, local_rank, host)
    assert rec.text == text
    assert rec.raw == line


def test_exception_names_are_not_mistaken_for_hosts():
    n = Normalizer()
    for line in ("RuntimeError: CUDA error", "Epoch 3: done", "ERROR: bus error", "KeyError: 'x'"):
        rec = n.normalize(line)
        assert rec.host is None and rec.text == line


def test_timestamps_are_parsed_from_common_formats():
    n = Normalizer()
    iso = n.normalize("2024-05-01 12:00:03,250 - INFO - started")
    assert iso.ts == pytest.approx(1714564803.25)
    assert iso.text == "- INFO - started"
    bracketed = n.normalize("[2024-05-01T12:00:04.5Z] [INFO] step")
    assert bracketed.ts == pytest.approx(1714564804.5)
    kernel = n.normalize("[Wed May  1 12:00:05 2024] NVRM: Xid (PCI:0000:8a:00): 79, pid=1")
    assert kernel.ts == pytest.approx(1714564805.0) and kernel.text.startswith("NVRM: Xid")
    c10 = n.normalize("[rank1]:[E501 12:00:06.100 ProcessGroupNCCL.cpp:1515] watchdog")
    assert c10.rank == 1 and c10.ts == pytest.approx(1714564806.1)


def test_syslog_line_names_host_and_strips_kernel_prefix():
    rec = Normalizer().normalize("May  1 12:00:03 node-07 kernel: [12345.678901] NVRM: Xid (PCI:0000:8a:00): 48, pid=9")
    assert rec.host == "node-07"
    assert rec.text.startswith("NVRM: Xid")


def test_shell_prompt_names_the_host_of_what_follows():
    n = Normalizer()
    n.normalize("alice@cn-234 ~ % nvidia-smi")
    assert n.normalize("Unable to determine the device handle for GPU0000:03:00.0").host == "cn-234"


def test_transport_source_fills_only_what_the_line_lacks():
    n = Normalizer()
    rec = n.normalize("[rank3]: hi", Source(rank=9, host="node-1", ts=5.0))
    assert (rec.rank, rec.host, rec.ts) == (3, "node-1", 5.0)


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe\xfa invalid", b"nul\x00in\x00side", b"\x1b[31mred\x1b[0m text", b"progress 10%\rprogress 100%\r\n",
     b"", b"\r\n", "caf\u00e9".encode("latin-1"), b"\x1b]0;title\x07after"],
)
def test_bad_bytes_never_crash(raw):
    rec = Normalizer().normalize(raw)
    assert "\x00" not in rec.text and "\x1b" not in rec.text and "\r" not in rec.text


def test_cr_progress_keeps_last_segment_and_ansi_is_stripped():
    assert sanitize(b"\x1b[32mok\x1b[0m 10%\rok 100%\n")[0] == "ok 100%"


def test_overlong_line_is_truncated_with_marker_and_counted():
    n = Normalizer(max_line_bytes=1000)
    rec = n.normalize("x" * 50_000)
    assert rec.truncated and rec.text.endswith("[truncated]") and len(rec.text) < 1100
    assert n.truncated == 1


def test_reader_streams_a_huge_line_in_bounded_memory():
    big = b"a" * (10 * 1024 * 1024) + b"\nnext line\n"
    tracemalloc.start()
    lines = list(iter_lines(io.BufferedReader(io.BytesIO(big)), max_line_bytes=64 * 1024))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(lines) == 2 and lines[1] == b"next line\n"
    assert len(lines[0]) == 64 * 1024 + 1
    assert peak < 4 * 1024 * 1024


def test_open_input_reads_gzip_transparently(tmp_path):
    p = tmp_path / "job.log.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"[rank0]: hello\n[rank1]: world\n")
    with open_input(p) as f:
        assert list(iter_lines(f)) == [b"[rank0]: hello\n", b"[rank1]: world\n"]


def test_open_input_errors_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        open_input(tmp_path / "missing.log")
    with pytest.raises(InputError, match="directory"):
        open_input(tmp_path)


def test_srun_task_labels_are_not_ranks_once_torchrun_ranks_appear_inside_them():
    n = Normalizer()
    assert n.normalize("3: iteration 1").rank == 3  # plain `srun -l python train.py`: the task is the rank
    assert n.normalize("5: [rank44]: iteration 3").rank == 44  # `srun -l torchrun ...`: one task per node
    agent = n.normalize("5: W0419 12:00:01.000000 77 api.py:704] Sending process 1 closing signal SIGTERM")
    assert agent.rank is None and agent.text.startswith("W0419")


def test_more_launcher_prefixes_name_rank_host_and_pid():
    n = Normalizer()
    r = n.normalize(b"2019-06-02T16:13:44.884Z: [1,12]<stdout>:node-7:815:864 [0] NCCL WARN NET/IB : port error")
    assert (r.rank, r.host, r.stream, r.pid) == (12, "node-7", "stdout", 815) and r.ts is not None
    r = n.normalize(b"slurmstepd-nid001234: error: Detected 1 oom_kill event in StepId=1.0")
    assert r.host == "nid001234" and r.text.startswith("slurmstepd-nid001234: error:")
    r = n.normalize(b"(RayTrainWorker pid=2345, ip=10.0.0.12) [rank1]: RuntimeError: boom")
    assert (r.pid, r.host, r.rank, r.text) == (2345, "10.0.0.12", 1, "RuntimeError: boom")


def test_a_stamp_without_a_year_takes_the_year_nearest_the_last_full_stamp():
    n = Normalizer()
    n.normalize(b"2025-01-01 00:00:05,000 - INFO - iteration 1")
    dec = n.normalize(b"Dec 31 23:59:50 node-1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    jan = n.normalize(b"Jan  1 00:00:09 node-1 kernel: NVRM: GPU has fallen off the bus.")
    assert 0 < jan.ts - dec.ts < 60  # not a year apart: no invented stall


@pytest.mark.parametrize(("line", "host", "text"), [
    ("nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 24007, Fatal, Link 32", None,
     "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 24007, Fatal, Link 32"),
    ("Nov 13 10:00:01 gpu-node-7 kernel: nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal", "gpu-node-7",
     "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal"),
    ("nvidia-nvswitch-host3: RuntimeError: boom", "nvidia-nvswitch-host3", "RuntimeError: boom"),
])
def test_a_kernel_driver_device_name_is_no_host(line, host, text):
    """The NVSwitch driver prefixes its messages with the switch's name: the rules need it in the text."""
    rec = Normalizer().normalize(line)
    assert (rec.host, rec.text) == (host, text)


def test_every_launcher_prefix_row_gives_known_fields_only():
    from logdx.normalize import LAUNCHER_PREFIXES, LauncherPrefix, _compile_prefix

    assert [p.row for p in map(_compile_prefix, LAUNCHER_PREFIXES)] == list(LAUNCHER_PREFIXES)
    with pytest.raises(ValueError, match="hots"):
        _compile_prefix(LauncherPrefix("typo", ("alpha",), r"(?P<hots>[a-z]+\d+): "))
