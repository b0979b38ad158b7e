"""Hangs from what the log shows: the process outside the collective in stack dumps (py-spy, faulthandler,
gdb, grouped dumps), the ranks a flight recorder finds missing (dumps or fr_trace's own text), the rank a
desync report names; the category by who owns the code a process waits in; a cordon only for a named,
corroborated node."""

from __future__ import annotations

from pathlib import Path

from logdx.flightrec import analyse, load_dumps
from logdx.pipeline import Engine

FR = Path(__file__).parent / "fixtures" / "flightrec" / "gloo"


def diagnose(engine: Engine, lines: list[str], fr=None):
    session = engine.new_session()
    session.feed_lines(lines)
    if fr is not None:
        session.add_flight_recorder(fr)
    return session.report()


def host(r: int) -> str:
    return f"gpu-node-{r // 8 + 1:02d}"


def training(ranks: int = 16, steps: int = 30) -> list[str]:
    out = [f"{host(r)}: [rank{r}]:{host(r)}:{7000 + r}:{7000 + r} [{r % 8}] NCCL INFO comm 0x7f{r:04x} rank {r} nranks "
           f"{ranks} cudaDev {r % 8} busId {r % 8 + 1}a000 - Init COMPLETE" for r in range(ranks)]
    out += [f"{host(ranks - 1)}: [rank{ranks - 1}]:  iteration {s * 10:8d}/  100000 | lm loss: {2.5 - s * 0.001:.6E} |"
            f" elapsed time per iteration (ms): 1402.1 |" for s in range(1, steps)]
    return out


PYSPY_COLLECTIVE = ["    all_reduce (torch/distributed/distributed_c10d.py:2050)",
                    "    wrapper (torch/distributed/c10d_logger.py:75)",
                    "    reduce_grads (megatron/core/distributed/finalize_model_grads.py:120)",
                    "    train_step (megatron/training/training.py:600)",
                    "    <module> (pretrain_gpt.py:240)"]
PYSPY_DATALOADER = ["    wait (threading.py:324)", "    get (queue.py:180)",
                    "    _try_get_data (torch/utils/data/dataloader.py:1133)",
                    "    __next__ (torch/utils/data/dataloader.py:631)",
                    "    get_batch (pretrain_gpt.py:88)", "    <module> (pretrain_gpt.py:240)"]
PYSPY_USER = ["    wait (threading.py:324)", "    acquire_shard (data/shard_lock.py:41)",
              "    get_batch (pretrain_gpt.py:88)", "    <module> (pretrain_gpt.py:240)"]


def pyspy(ranks: int, odd: int, odd_stack: list[str]) -> list[str]:
    out = []
    for r in range(ranks):
        h, pid = host(r), 7000 + r
        out += [f"{h}: Process {pid}: /usr/bin/python3 -u pretrain_gpt.py", f"{h}: Python v3.10.12 (/usr/bin/python3.10)",
                f'{h}: Thread {pid} (active): "MainThread"']
        out += [f"{h}: {f}" for f in (odd_stack if r == odd else PYSPY_COLLECTIVE)]
        out += [f'{h}: Thread {pid + 100} (idle): "Thread-1"', f"{h}:     wait (threading.py:320)"]
    return out


def test_the_process_outside_the_collective_is_the_root_and_the_library_it_waits_in_the_category(engine) -> None:
    report = diagnose(engine, training() + pyspy(16, 11, PYSPY_DATALOADER))
    assert (report.category, report.failure_type, report.action) == ("framework", "framework_hang", "no_restart")
    assert "_try_get_data (torch/utils/data/dataloader.py:1133)" in report.root_cause.text
    assert report.culprits.hosts == ["gpu-node-02"] and report.culprits.ranks == [11]


def test_stuck_in_the_users_own_code_is_a_script_hang(engine) -> None:
    report = diagnose(engine, training() + pyspy(16, 3, PYSPY_USER))
    assert (report.category, report.failure_type) == ("script", "script_hang")
    assert "acquire_shard (data/shard_lock.py:41)" in report.root_cause.text


def test_faulthandler_dumps_per_rank_are_read_alike(engine) -> None:
    lines = training(8)
    for r in range(8):
        lines.append(f"[rank{r}]:Current thread 0x00007f1a2b3c57{r:02d} (most recent call first):")
        if r == 2:
            lines += [f'[rank{r}]:  File "/usr/lib/python3.10/multiprocessing/connection.py", line 379 in _recv',
                      f'[rank{r}]:  File "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py", '
                      'line 1133 in _try_get_data',
                      f'[rank{r}]:  File "/workspace/train.py", line 88 in <module>']
        else:
            lines += [f'[rank{r}]:  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/'
                      'distributed_c10d.py", line 3439 in barrier', f'[rank{r}]:  File "/workspace/train.py", line 90 in <module>']
    report = diagnose(engine, lines)
    assert report.failure_type == "framework_hang" and report.culprits.ranks == [2]


def test_faulthandler_timeout_dumps_find_the_main_thread_it_does_not_mark(engine) -> None:
    """dump_traceback_later lists every thread as "Thread 0x..." (none marked current), newest first: a
    DataLoader pin-memory thread, then the main thread, whose outermost frame need not be <module>."""
    lines = training(8)
    site = "/usr/local/lib/python3.10/dist-packages"
    for r in range(8):
        p = f"[rank{r}]:"
        lines += [f"{p}Timeout (0:05:00)!", f"{p}Thread 0x00007f577dff06{r:02d} (most recent call first):",
                  f'{p}  File "/usr/lib/python3.10/multiprocessing/queues.py", line 113 in get',
                  f'{p}  File "{site}/torch/utils/data/_utils/pin_memory.py", line 31 in do_one_step',
                  f'{p}  File "/usr/lib/python3.10/threading.py", line 953 in run',
                  f'{p}  File "/usr/lib/python3.10/threading.py", line 1016 in _bootstrap_inner', p,
                  f"{p}Thread 0x00007f577e0007{r:02d} (most recent call first):"]
        if r == 6:
            lines += [f'{p}  File "/usr/lib/python3.10/threading.py", line 324 in wait',
                      f'{p}  File "{site}/torch/utils/data/dataloader.py", line 1133 in _try_get_data']
        else:
            lines += [f'{p}  File "{site}/torch/distributed/distributed_c10d.py", line 2501 in all_reduce']
        lines += [f'{p}  File "{site}/lightning/pytorch/trainer/trainer.py", line 538 in fit',
                  f'{p}  File "/opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py", line 42 in main']
    report = diagnose(engine, lines)
    assert report.failure_type == "framework_hang" and report.culprits.ranks == [6]
    assert "_try_get_data" in report.root_cause.text


def test_a_path_py_spy_shortened_inside_a_known_library_is_that_librarys(engine) -> None:
    numpy_read = ["    _read_bytes (numpy/lib/format.py:966)", "    read_array (numpy/lib/format.py:831)",
                  "    load (numpy/lib/npyio.py:456)", "    __getitem__ (project/data/shards.py:88)",
                  "    <module> (pretrain_gpt.py:240)"]
    report = diagnose(engine, training() + pyspy(16, 9, numpy_read))
    assert (report.category, report.failure_type, report.culprits.ranks) == ("framework", "framework_hang", [9])


def test_a_grouped_dump_counts_each_main_thread_as_a_process(engine) -> None:
    lines = ["4 in:"] + [f'Thread {p} (active): "MainThread"' for p in (101, 102, 103, 104)] + PYSPY_COLLECTIVE
    lines += ["1 in:", 'Thread 105 (idle): "MainThread"'] + PYSPY_DATALOADER
    lines += ["3 in:"] + [f'Thread {p} (active): "MainThread"' for p in (106, 107, 108)] + PYSPY_COLLECTIVE
    report = diagnose(engine, lines)
    assert report.failure_type == "framework_hang" and "_try_get_data" in report.root_cause.text
    assert "1 of 8 processes" in report.explanation


def test_a_gdb_thread_dump_stuck_in_a_library_is_that_librarys(engine) -> None:
    lines = ["Thread 9 (Thread 0x1554539fc700 (LWP 153338)):",
             "#0  0x0000155520c47cdc in ?? () from lib/libcudart.so.11.0",
             "#1  0x0000155509794008 in c10d::ProcessGroupNCCL::WorkNCCL::isCompleted() () from "
             "lib/python3.8/site-packages/torch/lib/libtorch_cuda.so",
             "#2  0x00001555554f5609 in start_thread (arg=<optimized out>) at pthread_create.c:477"]
    report = diagnose(engine, lines)
    assert report.failure_type == "framework_hang" and "isCompleted" in report.root_cause.text


def test_flight_recorder_dumps_name_the_silent_rank(engine) -> None:
    fr = analyse(load_dumps(FR / "hang"))
    lines = training(8) + [f"{host(r)}: [rank{r}]:[E1121 10:30:00.000 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog "
                           "caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) "
                           "ran for 600042 milliseconds before timing out." for r in range(8) if r != 5]
    report = diagnose(engine, lines, fr)
    assert (report.failure_type, report.culprits.ranks, report.culprits.hosts) == ("hang", [5], ["gpu-node-01"])
    assert report.culprits.corroborated and report.action == "cordon_and_restart"


def test_a_hang_whose_rank_has_no_named_host_restarts(engine) -> None:
    fr = analyse(load_dumps(FR / "hang"))
    report = diagnose(engine, [f"[rank{r}]: step={s}, loss=2.0" for s in range(3) for r in range(8)], fr)
    assert (report.failure_type, report.culprits.ranks, report.action) == ("hang", [5], "restart")


def test_fr_trace_text_in_the_log_is_read(engine) -> None:
    text = (Path(__file__).parent / "fixtures" / "flightrec" / "fr_trace_torch2.13.txt").read_text(encoding="utf-8")
    report = diagnose(engine, training(8) + text.splitlines())
    assert report.failure_type in ("hang", "script_hang", "framework_hang") and report.culprits.ranks


def test_the_desync_report_names_the_lagging_rank(engine) -> None:
    lines = ["[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: "
             "WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=8000) ran for 8097 milliseconds",
             "[rank0]: - [0] Timeout at collective: ALLREDUCE, #3",
             "[rank0]: - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
             "[rank0]:     [1] finished collective #2, but didn't join collective #3 (count from 1)"]
    report = diagnose(engine, lines)
    assert (report.failure_type, report.culprits.ranks) == ("hang", [1])
