"""Choosing the root cause across ranks: symptoms never win, the earliest cause does, with the
exceptions that make that rule right (graver faults, survived errors, silent ranks)."""

from __future__ import annotations

import pytest

from logdx.act.render import action_words
from logdx.testing import diagnose_lines


def progress(rank: int, i: int, t: str = "12:00:00") -> str:
    return f"[rank{rank}]:2024-05-01 {t},000 - INFO - iteration {i} | loss 2.{i % 10} | lr 1e-4"


def watchdog(rank: int, seq: int = 42, t: str = "12:30:00") -> str:
    return (f"[rank{rank}]:[E501 {t}.000 ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught collective "
            f"operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800004 milliseconds before timing out.")


def test_symptoms_only_name_the_silent_rank_as_a_hang(engine):
    lines = [progress(r, 1) for r in range(16)] + [watchdog(r) for r in range(16) if r != 5]
    report = diagnose_lines(engine, lines)
    # A hang, with its culprit; no host is named anywhere, so nothing to cordon: a restart.
    assert (report.category, report.failure_type, report.action) == ("infrastructure", "hang", "restart")
    assert report.culprits.ranks == [5]
    # One signal (missing from the watchdogs' reports): the rank is named, not corroborated.
    assert report.confidence < 0.8 and not report.culprits.corroborated


def on_host(line: str, rank: int) -> str:
    return f"node-{rank // 8:02d}: {line}"


def test_a_silent_rank_two_signals_agree_on_is_corroborated_and_its_node_cordoned(engine):
    lines = [on_host(progress(r, i), r) for i in range(1, 5) for r in range(16) if not (r == 5 and i == 4)]
    lines += [on_host(watchdog(r), r) for r in range(16) if r != 5]
    report = diagnose_lines(engine, lines)
    # Missing from the watchdogs' reports, and its progress stopped a step before the others'.
    assert (report.failure_type, report.culprits.ranks, report.culprits.hosts) == ("hang", [5], ["node-00"])
    assert report.culprits.corroborated and report.confidence >= 0.85
    assert report.action == "cordon_and_restart"
    # The same with only one of the two signals: the rank is named, its node is not cordoned.
    one = [on_host(progress(r, i), r) for i in range(1, 5) for r in range(16)]
    one += [on_host(watchdog(r), r) for r in range(16) if r != 5]
    report = diagnose_lines(engine, one)
    assert (report.culprits.ranks, report.action) == ([5], "restart")
    assert not report.culprits.corroborated and report.confidence < 0.85


def test_timeouts_with_no_rank_to_point_at_stay_a_collective_timeout(engine):
    lines = [progress(r, 1) for r in range(16)] + [watchdog(r) for r in range(16)]
    report = diagnose_lines(engine, lines)
    assert (report.category, report.failure_type, report.action) == ("infrastructure", "nccl_timeout", "restart")
    assert report.culprits.ranks == []


def test_symptoms_only_name_the_rank_lagging_in_collective_sequence(engine):
    lines = [progress(r, 1) for r in range(8)] + [watchdog(r, seq=100) for r in range(8) if r != 3] + [watchdog(3, seq=99)]
    assert diagnose_lines(engine, lines).culprits.ranks == [3]


def test_a_graver_fault_just_after_explains_an_earlier_lesser_one(engine):
    lines = [progress(r, 1) for r in range(8)]
    lines.append("[rank1]:2024-05-01 12:00:05,000 - ERROR - torch.distributed.DistNetworkError: The client socket has "
                 "timed out after 600s while trying to connect to (node-0, 29500).")
    lines.append("slurmstepd: error: *** JOB 77 ON node-1 CANCELLED AT 2024-05-01T12:01:00 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    report = diagnose_lines(engine, lines)
    assert report.failure_type == "node_failure"
    assert report.culprits.hosts == ["node-1"]
    assert report.root_cause.line_no == 10


def test_the_earliest_root_cause_wins_over_later_ones(engine):
    lines = [progress(r, 1) for r in range(4)]
    lines.append("[rank2]:2024-05-01 12:00:07,000 - ERROR - RuntimeError: CUDA error: uncorrectable ECC error encountered")
    lines.append("[rank0]:2024-05-01 12:00:09,000 - ERROR - OSError: [Errno 28] No space left on device")
    report = diagnose_lines(engine, lines)
    assert report.failure_type == "ecc_error" and report.culprits.ranks == [2]


def test_an_error_the_rank_trained_past_is_not_the_root(engine):
    lines = ["[rank0]:2024-05-01 12:00:00,000 - WARNING - OSError: [Errno 28] No space left on device"]
    lines += [progress(0, i, f"12:{10 + i // 60:02d}:{i % 60:02d}") for i in range(0, 600, 5)]
    lines.append("[rank0]:2024-05-01 12:30:00,000 - ERROR - RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert diagnose_lines(engine, lines).failure_type == "ecc_error"


def test_exit_code_zero_forgives_what_training_survived(engine):
    lines = [progress(0, 1), "[rank0]: NVRM: Xid (PCI:0000:3b:00): 13, pid=77, Graphics SM Warp Exception", progress(0, 2)]
    assert diagnose_lines(engine, lines, exit_code=0).status == "healthy"
    assert diagnose_lines(engine, lines).status == "failed"


def test_failed_exit_with_nothing_recognised_is_unknown(engine):
    lines = [progress(0, 1), "[rank0]: frobnicator says: the flux capacitor is out of phase (code 7)"]
    report = diagnose_lines(engine, lines, exit_code=3)
    assert (report.status, report.category, report.failure_type) == ("failed", "unknown", "unknown")


def test_the_hint_names_the_culprit_resolved_from_other_lines(engine):
    lines = [f"node-4: node-4:9{r}:9{r} [{r}] NCCL INFO comm 0xab rank {8 + r} nranks 16 cudaDev {r} busId {r + 1}a000 - Init COMPLETE"
             for r in range(8)]
    lines.append("node-4: [Wed May  1 12:00:05 2024] NVRM: Xid (PCI:0000:3a:00): 79, pid=93, GPU has fallen off the bus.")
    report = diagnose_lines(engine, lines)
    assert report.failure_type == "gpu_fell_off_bus"
    assert (report.culprits.hosts, report.culprits.ranks) == (["node-4"], [10])
    assert "node-4" in report.hint and "?" not in report.hint


# -- the innermost failure, and errors no rule names --------------------------------------------------


def tb(path: str, exc: str, rank: int = 0) -> list[str]:
    return [f"[rank{rank}]: {x}" for x in (
        "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 88, in <module>',
        "    main()",
        f'  File "{path}", line 120, in run',
        "    raise_it()",
        exc,
    )]


def test_the_original_traceback_of_a_dataloader_reraise_is_the_root(engine):
    lines = [progress(0, 1), *[f"[rank0]: {x}" for x in (
        "KeyError: Caught KeyError in DataLoader worker process 0.",
        "Original Traceback (most recent call last):",
        '  File "/env/lib/python3.10/site-packages/torch/utils/data/_utils/worker.py", line 308, in _worker_loop',
        "    data = fetcher.fetch(index)",
        '  File "/home/me/proj/data.py", line 216, in __getitem__',
        "    index = self.ex2emb_idx[name]",
        "KeyError: 'metro_station_07'",
    )]]
    report = diagnose_lines(engine, lines, exit_code=1)
    assert (report.category, report.failure_type) == ("script", "key_error")
    assert report.root_cause.text.endswith("KeyError: 'metro_station_07'")


def test_the_first_link_of_a_chain_is_the_root(engine):
    lines = [*tb("/env/lib/python3.10/site-packages/torch/serialization.py", "OSError: [Errno 28] No space left on device"),
             "[rank0]: During handling of the above exception, another exception occurred:",
             *tb("/workspace/ckpt.py", "RuntimeError: could not save the checkpoint")]
    report = diagnose_lines(engine, lines, exit_code=1)
    assert report.failure_type == "disk_full"
    assert "No space left on device" in report.root_cause.text


@pytest.mark.parametrize(("path", "exc", "label"), [
    ("/env/lib/python3.10/site-packages/datasets/packaged_modules/json/json.py",
     "pyarrow.lib.ArrowInvalid: JSON parse error: Column() changed from object to array in row 0",
     ("framework", "dataset_loading_error")),
    ("/env/lib/python3.10/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py",
     "deepspeed.runtime.zero.utils.ZeRORuntimeException: param 3 has not been gathered",
     ("framework", "framework_error")),
    ("/env/lib/python3.10/site-packages/fsspec/asyn.py",
     "fsspec.exceptions.FSTimeoutError", ("infrastructure", "storage_error")),
    ("/home/me/proj/model.py", "MyOwnProblem: shapes do not line up", ("script", "script_error")),
])
def test_an_error_no_rule_names_is_classified_by_the_module_that_raised_it(engine, path, exc, label):
    report = diagnose_lines(engine, [progress(0, 1), *tb(path, exc)], exit_code=1)
    assert report.status == "failed"
    assert (report.category, report.failure_type) == label
    assert report.root_cause.text.endswith(exc)


def test_the_exception_line_is_the_root_and_its_named_echo_says_whose_it_was(engine):
    # The traceback comes through the launcher without a prefix; the watchdog line names the rank.
    lines = [x.replace("[rank1]: ", "") for x in tb("/env/lib/python3.10/site-packages/torch/cuda/__init__.py",
                                                   "RuntimeError: CUDA error: uncorrectable ECC error encountered", rank=1)]
    lines.append("[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with exception: "
                 "CUDA error: uncorrectable ECC error encountered")
    report = diagnose_lines(engine, lines, exit_code=1)
    assert report.failure_type == "ecc_error"
    assert report.root_cause.text == "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert report.culprits.ranks == [1]


def test_a_kill_before_the_timeouts_is_their_cause(engine):
    lines = [progress(r, 1) for r in range(8)]
    lines.append("[2024-05-01 12:01:00,000] [ERROR] [launch.py:320:sigkill_handler] ['/usr/bin/python', '-u', "
                 "'train.py', '--local_rank=3'] exits with return code = -9")
    lines += [watchdog(r) for r in range(8) if r != 3]
    report = diagnose_lines(engine, lines)
    assert report.failure_type == "host_oom"
    assert "return code = -9" in report.root_cause.text


def test_a_time_limit_after_the_timeouts_ends_a_hang_it_did_not_cause(engine):
    lines = [progress(r, 1) for r in range(8)] + [watchdog(r) for r in range(8) if r != 3]
    lines.append("slurmstepd: error: *** JOB 4242 ON node-3 CANCELLED AT 2024-05-01T14:00:00 DUE TO TIME LIMIT ***")
    report = diagnose_lines(engine, lines)
    assert report.failure_type == "hang" and report.culprits.ranks == [3]


def test_the_explanation_quotes_the_exception_and_the_users_file_and_line(engine):
    report = diagnose_lines(engine, [progress(0, 1), *tb("/workspace/model.py", "MyOwnProblem: shapes do not line up")], exit_code=1)
    assert "MyOwnProblem: shapes do not line up" in report.explanation
    assert "/workspace/model.py:120 (run)" in report.explanation


def test_a_missing_environment_variable_is_the_callers_mistake(engine):
    lines = [f"[rank0]: {x}" for x in (
        "Traceback (most recent call last):",
        '  File "/data1/proj/utils/distributed.py", line 29, in init_dist',
        "    rank = int(os.environ['RANK'])",
        '  File "/usr/local/miniconda3/lib/python3.6/os.py", line 669, in __getitem__',
        "    raise KeyError(key) from None",
        "KeyError: 'RANK'",
    )]
    report = diagnose_lines(engine, lines, exit_code=1)
    assert (report.category, report.failure_type) == ("script", "key_error")


def _illegal_access(rank: int, t: str = "12:20:01") -> list[str]:
    return [f"[rank{rank}]:2024-05-01 {t},000 - ERROR - Traceback (most recent call last):",
            f'[rank{rank}]:  File "/workspace/kernels/rope.py", line 88, in fused_rope',
            f"[rank{rank}]:    torch.cuda.synchronize()",
            f'[rank{rank}]:  File "/usr/local/lib/python3.10/dist-packages/torch/cuda/__init__.py", line 985, in synchronize',
            f"[rank{rank}]:    return torch._C._cuda_synchronize()",
            f"[rank{rank}]:RuntimeError: CUDA error: an illegal memory access was encountered"]


@pytest.mark.parametrize("xid_first", [True, False])
def test_a_cuda_fault_the_gpu_calls_the_applications_is_not_the_machines(engine, xid_first):
    """Xid 13 (out-of-range address) beside an illegal memory access: the kernel's bug, replayed by
    any restart. The application's own error line is the root line, whichever was printed first."""
    xid = ("node-02: [Wed May  1 12:20:00 2024] NVRM: Xid (PCI:0000:3b:00): 13, pid=88123, name=python, "
           "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address")
    fault = _illegal_access(3)
    lines = [progress(r, 1) for r in range(8)] + ([xid, *fault] if xid_first else [*fault, xid])
    lines += [watchdog(r, t="12:50:00") for r in range(8) if r != 3]
    report = diagnose_lines(engine, lines, exit_code=1)
    assert (report.category, report.action) == ("framework", "no_restart"), report.explanation
    assert "illegal memory access" in report.root_cause.text
    assert report.hint.startswith("Xid 13 on GPU 0000:3b:00")


def test_an_illegal_memory_access_alone_or_after_a_hardware_xid_stays_infrastructure(engine):
    alone = diagnose_lines(engine, [progress(r, 1) for r in range(8)] + _illegal_access(3), exit_code=1)
    assert (alone.category, alone.failure_type, alone.action) == ("infrastructure", "cuda_error", "restart")
    xid79 = "node-02: [Wed May  1 12:20:02 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=88123, name=python, GPU has fallen off the bus."
    bus = diagnose_lines(engine, [progress(r, 1) for r in range(8)] + _illegal_access(3) + [xid79], exit_code=1)
    assert (bus.category, bus.failure_type) == ("infrastructure", "gpu_fell_off_bus")


def test_a_log_that_ends_inside_a_traceback_is_a_failure_placed_by_its_frames(engine):
    """The stream was cut while the process printed its traceback: no exception line, but the
    frames say whose code it was. A traceback the process trained past is not one."""
    frames = ["[rank0]:2024-05-01 12:20:01,000 - ERROR - Traceback (most recent call last):",
              '[rank0]:  File "/workspace/train.py", line 88, in <module>',
              "[rank0]:    main()",
              '[rank0]:  File "/workspace/data/loader.py", line 41, in build',
              "[rank0]:    rows = parse(path)"]
    cut = diagnose_lines(engine, [progress(0, i) for i in range(5)] + frames, exit_code=None)
    assert (cut.status, cut.category, cut.action) == ("failed", "script", "no_restart")
    assert "Traceback" in cut.root_cause.text
    survived = diagnose_lines(engine, frames + [progress(0, i, t="12:30:00") for i in range(5, 40)], exit_code=0)
    assert survived.status == "healthy"


def _training(ranks: int, steps: int) -> list[str]:
    """A timestamped multi-node job (8 ranks a host) logging a step a minute from 12:01."""
    return [f"node-{r // 8}: [rank{r}]:2024-05-01 12:{i:02d}:00,000 - INFO - iteration {i} | loss 2.{i % 10} | lr 1e-4"
            for i in range(1, steps + 1) for r in range(ranks)]


def _scancel(at: str) -> list[str]:
    return ["srun: Job step aborted: Waiting up to 62 seconds for job step to finish.",
            "Main process received SIGTERM, exiting",
            f"slurmstepd: error: *** STEP 1809579.0 ON node-0 CANCELLED AT 2024-05-01T{at}:00 ***",
            f"slurmstepd: error: *** JOB 1809579 ON node-0 CANCELLED AT 2024-05-01T{at}:00 ***"]


def test_a_job_cancelled_while_it_trained_is_not_restarted_and_blames_no_node(engine):
    report = diagnose_lines(engine, _training(16, 39) + _scancel("12:40"))
    assert (report.status, report.category, report.failure_type, report.action) == (
        "failed", "infrastructure", "cancelled", "no_restart")
    assert report.culprits.hosts == [] and report.root_cause is not None
    assert "CANCELLED AT 2024-05-01T12:40:00 ***" in report.root_cause.text
    words, _ = action_words(report)
    assert words.startswith("DO NOT RESTART") and "owner must fix" not in words


def test_a_job_cancelled_hours_after_it_stopped_advancing_is_a_hang(engine):
    # The cancel is how somebody ended a stuck job: what the on-call needs is the hang.
    report = diagnose_lines(engine, _training(16, 39) + _scancel("15:40"))
    assert (report.category, report.failure_type) == ("infrastructure", "hang")
    assert report.action != "no_restart"


def test_a_warning_and_its_source_line_are_never_the_root_of_a_job_that_failed(engine):
    # Exit code 1 and nothing but a warning: Python prints the warning, then its source line. Neither says why
    # the job ended (an OOM kill, a scheduler's signal print nothing here): no root line, and the hint says so.
    lines = [*(f"[rank{r}]: step {s} | loss 2.{s} | lr 1e-4" for s in range(3) for r in range(2)),
             "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py:558: UserWarning: This DataLoader "
             "will create 16 worker processes in total. Our suggested max number of worker in current system is 8.",
             "  warnings.warn(_create_warning_msg(",
             *(f"[rank{r}]: step 3 | loss 2.3 | lr 1e-4" for r in range(2))]
    report = diagnose_lines(engine, lines, 1)
    assert (report.status, report.category, report.action) == ("failed", "unknown", "no_restart")
    assert report.root_cause is None
    assert report.hint.startswith("No line of the log says why it ended")
    # An error after the warning is still the root.
    report = diagnose_lines(engine, [*lines, "[rank1]: MyPipelineError: shard 4 is missing its index"], 1)
    assert report.root_cause is not None and report.root_cause.text.endswith("shard 4 is missing its index")


def test_a_time_limit_alone_is_told_as_the_schedulers_end_of_the_job(engine):
    lines = [*(f"[rank{r}]: step {s} | loss 2.{s} | lr 1e-4" for s in range(3) for r in range(2)),
             "slurmstepd: error: *** JOB 13967221 ON exa01 CANCELLED AT 2025-10-20T15:37:23 DUE TO TIME LIMIT ***"]
    report = diagnose_lines(engine, lines, None)
    assert report.failure_type == "time_limit"
    assert report.explanation.startswith("Slurm time limit reached, at line 7: the scheduler ended the job")
    assert "symptoms" not in report.explanation and "several" not in report.explanation
