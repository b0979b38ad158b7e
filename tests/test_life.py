"""Reading the life of a job: what the job went on making progress after is not its cause, whatever it
said; the root is chosen where progress ended; a warning gives way to the error that ended the job."""

from __future__ import annotations

import pytest

from logdx.pipeline import Engine
from logdx.testing import diagnose_lines

RANKS = 16


def host(r: int) -> str:
    return f"gpu-node-{r // 8 + 1:02d}"


def startup() -> list[str]:
    """What a two-node torchrun job prints while its store comes up: the c10d client retries."""
    out = []
    for r in range(RANKS):
        out.append(f"{host(r)}: [rank{r}]:[W1121 09:00:0{r % 10}.{r:03d}000 socket.cpp:755] [c10d] The client socket has "
                   f"failed to connect to [gpu-node-01]:29500 (errno: 111 - Connection refused).")
    for r in range(RANKS):
        out.append(f"{host(r)}: [rank{r}]:{host(r)}:{3000 + r}:{3000 + r} [{r % 8}] NCCL INFO comm 0x7f{r:04x} rank {r} "
                   f"nranks {RANKS} cudaDev {r % 8} busId {r % 8 + 1}a000 - Init COMPLETE")
    return out


def steps(first: int, last: int, *, skip_rank: int | None = None) -> list[str]:
    out = []
    for s in range(first, last + 1):
        for r in range(RANKS):
            if r == skip_rank:
                continue
            if r == RANKS - 1:
                out.append(f"{host(r)}: [rank{r}]:  iteration {s * 10:8d}/  100000 | consumed samples: {s * 5120:10d} | "
                           f"elapsed time per iteration (ms): 1501.{s % 10} | learning rate: 1.5E-04 | lm loss: "
                           f"{3.0 - s * 0.001:.6E} | loss scale: 1.0 | grad norm: 0.31 | number of skipped iterations:   0 |"
                           " number of nan iterations:   0 |")
    return out


def keyerror(r: int) -> list[str]:
    return [f"{host(r)}: [rank{r}]: {x}" for x in (
        "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 412, in <module>',
        "    main()",
        '  File "/workspace/data/mixture.py", line 88, in __getitem__',
        "    weights = self.weights[name]",
        "KeyError: 'c4_en'",
    )]


def cascade(r_dead: int) -> list[str]:
    out = [f"{host(r)}: [rank{r}]:[E1121 10:30:00.000 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective "
           "operation timeout: WorkNCCL(SeqNum=4101, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
           "for 600042 milliseconds before timing out." for r in range(RANKS) if r != r_dead]
    out.append(f"{host(r_dead)}: [2024-11-21 10:30:05,000] torch.distributed.elastic.multiprocessing.api: [ERROR] "
               f"failed (exitcode: 1) local_rank: {r_dead % 8} (pid: 4{r_dead:03d}) of binary: /usr/bin/python3")
    return out


def test_a_start_up_retry_the_job_trained_past_is_not_the_root(engine: Engine) -> None:
    report = diagnose_lines(engine, startup() + steps(1, 40) + keyerror(6) + cascade(6))
    assert (report.category, report.failure_type, report.action) == ("script", "key_error", "no_restart")
    assert "KeyError: 'c4_en'" in report.root_cause.text
    assert any("failed to connect" in r.text for r in report.recovered)  # a note, not the cause


def test_a_healthy_run_with_start_up_retries_is_healthy(engine: Engine) -> None:
    report = diagnose_lines(engine, startup() + steps(1, 60))
    assert report.status == "healthy" and report.recovered
    assert diagnose_lines(engine, startup() + steps(1, 60), exit_code=0).status == "healthy"


def test_a_failure_before_training_started_beats_the_retries_before_it(engine: Engine) -> None:
    report = diagnose_lines(engine, startup() + keyerror(3) + cascade(3))
    assert report.failure_type == "key_error" and "KeyError" in report.root_cause.text


def test_an_error_in_the_last_step_in_flight_is_fatal_even_if_others_print_that_step(engine: Engine) -> None:
    lines = startup() + steps(1, 30)
    lines += [f"{host(4)}: [rank4]:[2024-11-21 10:00:00,000] ERROR RuntimeError: CUDA error: an illegal memory "
              "access was encountered"]
    lines += steps(31, 31)  # the ranks still finishing the step in flight print it
    report = diagnose_lines(engine, lines + cascade(4))
    assert report.failure_type == "cuda_error" and report.culprits.ranks == [4]


def test_a_retried_upload_the_job_went_on_after_stays_a_note(engine: Engine) -> None:
    lines = startup() + steps(1, 20)
    lines.append(f"{host(15)}: [rank15]:wandb: ERROR Error while calling W&B API: An internal error occurred. "
                 "Please contact support. (<Response [500]>)")
    lines += steps(21, 80)
    assert diagnose_lines(engine, lines).status == "healthy"


def test_exit_code_0_is_healthy_even_with_scary_lines_after_training(engine: Engine) -> None:
    lines = steps(1, 50) + [f"{host(0)}: [rank0]:[W1121 12:00:00.000 ProcessGroupNCCL.cpp:1250] Warning: WARNING: "
                            "process group has NOT been destroyed before we destruct ProcessGroupNCCL."]
    assert diagnose_lines(engine, lines, exit_code=0).status == "healthy"


def port_error(node_ranks: range) -> list[str]:
    """NCCL's IB async thread of every rank on one node (transport/net_ib.cc)."""
    return [f"{host(r)}: [rank{r}]:{host(r)}:{3000 + r}:{3071 + r} [{r % 8}] transport/net_ib.cc:101 NCCL WARN "
            f"NET/IB : mlx5_2:1 Got async event : port error" for r in node_ranks]


def test_an_async_event_in_the_last_step_of_a_job_that_exited_0_is_a_note(engine: Engine) -> None:
    lines = startup() + steps(1, 50) + port_error(range(8))
    report = diagnose_lines(engine, lines, exit_code=0)
    assert report.status == "healthy"
    assert report.recovered  # kept as a note
    # Without the exit code or a word that training ended, the same log is a failure on that node.
    unknown = diagnose_lines(engine, lines)
    assert unknown.status == "failed" and unknown.culprits.hosts == [host(0)]


@pytest.mark.parametrize("ending", [
    "{'train_runtime': 83302.2172, 'train_samples_per_second': 26.857, 'train_loss': 4.1836, 'epoch': 1.0}",
    "[after training is done] datetime: 2024-11-21 12:00:00",
    "`Trainer.fit` stopped: `max_steps=500` reached.",
])
def test_an_async_event_before_training_says_it_completed_is_a_note(engine: Engine, ending: str) -> None:
    lines = startup() + steps(1, 50) + port_error(range(8)) + [f"{host(0)}: [rank0]:{ending}"]
    assert diagnose_lines(engine, lines).status == "healthy"
    # The job's own failure code outweighs its words: the event is then what the diagnosis has.
    assert diagnose_lines(engine, lines, exit_code=1).status == "failed"


def test_a_traceback_after_training_completed_still_fails_the_job(engine: Engine) -> None:
    lines = startup() + steps(1, 50) + [f"{host(0)}: [rank0]:Training completed. Saving model to /ckpt/final"]
    lines += keyerror(0)
    assert diagnose_lines(engine, lines).status == "failed"


def test_a_port_error_its_port_came_back_from_is_a_note_even_with_no_step_after(engine: Engine) -> None:
    back = [line.replace("port error", "port active") for line in port_error(range(8))]
    lines = startup() + steps(1, 50) + port_error(range(8)) + back
    report = diagnose_lines(engine, lines)
    assert report.status == "healthy" and report.recovered
    # The port that stays down is what the job has, on that node.
    down = diagnose_lines(engine, startup() + steps(1, 50) + port_error(range(8)))
    assert (down.status, down.failure_type, down.culprits.hosts) == ("failed", "network_error", [host(0)])
