"""Healthy is earned (issue 28): a job is healthy when its log shows it (the run's end marker, exit 0 with
nothing fatal, training that went on after every error), failed when a process's own last words say so
whatever the exit code, and `unknown` when the log shows neither; what a job prints after its end cannot
fail it."""

from __future__ import annotations

import pytest

from logdx.diagnose.health import RunEnd, after_the_end
from logdx.model import Event, EventKind, Record
from logdx.pipeline import Engine
from logdx.testing import diagnose_lines

HOST = "gpu-node-03"


def steps(first: int, last: int, *, every: int = 10) -> list[str]:
    return [f"step {s * every} | loss = {3.2 - s * 0.01:.4f} | lr 3.0e-04 | 301.2 ms/step" for s in range(first, last + 1)]


def oom_traceback(prefix: str = "") -> list[str]:
    return [prefix + x for x in (
        "Traceback (most recent call last):",
        '  File "/home/ml/proj/finetune.py", line 311, in <module>',
        "    trainer.train()",
        '  File "/usr/local/lib/python3.10/dist-packages/transformers/trainer.py", line 1938, in train',
        "    return inner_training_loop(",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.",
    )]


HF_STARTUP = ["[INFO|trainer.py:2134] 2024-05-01 10:00:01,000 >> ***** Running training *****",
              "[INFO|trainer.py:2135] 2024-05-01 10:00:01,000 >>   Num examples = 52,002",
              "Loading checkpoint shards:  50%|█████     | 1/2 [00:02<00:02,  2.61s/it]",
              "Loading checkpoint shards: 100%|██████████| 2/2 [00:05<00:00,  2.61s/it]"]


# -- a process's own last words ----------------------------------------------------------------------


def test_a_nan_abort_outranks_an_exit_code_of_0(engine: Engine) -> None:
    lines = steps(1, 20) + ["step 210 | loss = nan | lr 3.0e-04 | 301.2 ms/step", "NaN detected in loss, aborting."]
    for exit_code in (None, 0):
        report = diagnose_lines(engine, lines, exit_code=exit_code)
        assert (report.status, report.failure_type) == ("failed", "nan_loss"), exit_code
        assert report.root_cause is not None and report.root_cause.line_no in (21, 22)


@pytest.mark.parametrize("exit_code", [None, 0])
def test_a_traceback_pasted_before_the_start_up_lines_is_the_failure(engine: Engine, exit_code: int | None) -> None:
    """The checkpoint-loading bar after it is no training going on: the exception was the process's last words."""
    report = diagnose_lines(engine, oom_traceback() + HF_STARTUP, exit_code=exit_code)
    assert (report.status, report.failure_type) == ("failed", "cuda_oom")
    assert report.root_cause is not None and report.root_cause.line_no == 6


def test_a_syntax_error_of_the_main_script_has_no_traceback_header_and_fails(engine: Engine) -> None:
    lines = ['  File "/home/ml/proj/train.py", line 88', '    print(f"loss {loss:.3f")', "                       ^",
             "SyntaxError: f-string: expecting '}'"]
    report = diagnose_lines(engine, lines)
    assert (report.status, report.category, report.failure_type) == ("failed", "script", "syntax_error")


def test_a_cuda_error_that_ends_the_output_fails_even_with_exit_0(engine: Engine) -> None:
    lines = ["[rank0]: step 100 | loss = 2.1000", "[rank0]: step 110 | loss = 2.0900",
             "[rank0]: terminate called after throwing an instance of 'c10::Error'",
             "[rank0]:   what():  CUDA error: an illegal memory access was encountered",
             "[rank0]: CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
             "below might be incorrect.", "Aborted (core dumped)"]
    for exit_code in (None, 0):
        report = diagnose_lines(engine, lines, exit_code=exit_code)
        assert (report.status, report.failure_type) == ("failed", "cuda_error"), exit_code


# -- the end of the run ----------------------------------------------------------------------------------

END_MARKERS = [
    "[2024-05-01 12:00:00,000] torch.distributed.elastic.agent.server.api: [INFO] [default] worker group successfully "
    "finished. Waiting 300 seconds for other agents to finish.",
    ':::MLLOG {"namespace": "", "time_ms": 1714564800000, "event_type": "INTERVAL_END", "key": "run_stop", "value": '
    'null, "metadata": {"file": "/workspace/train.py", "lineno": 412, "status": "success"}}',
    "Training done.",
    "| done training in 51234.5 seconds",
    "{'train_runtime': 11868.7058, 'train_samples_per_second': 69.022, 'train_steps_per_second': 0.27, 'train_loss': 0.21}",
    "`Trainer.fit` stopped: `max_steps=210` reached.",
    "[2024-05-01 12:00:01,000] [INFO] [launch.py:351:main] Process 4242 exits successfully.",
]
TEARDOWN = [
    f"{HOST}:4242:4300 [0] include/alloc.h:243 NCCL WARN Cuda failure 'driver shutting down'",
    f"{HOST}:4242:4300 [0] proxy.cc:1519 NCCL WARN [Service thread] Error encountered progressing operation=Connect, "
    "res=3, closing connection",
    "slurmstepd: error: _is_a_lwp: open() /proc/27543/status failed: No such file or directory",
    "slurmstepd: error: Exceeded step memory limit at some point.",
    f"{HOST}: [Wed May  1 12:02:10 2024] NVRM: Xid (PCI:0000:07:00): 79, pid='<unknown>', name=<unknown>, GPU has "
    "fallen off the bus.",
]


@pytest.mark.parametrize("marker", END_MARKERS)
def test_what_a_job_prints_after_its_end_marker_cannot_fail_it(engine: Engine, marker: str) -> None:
    without = diagnose_lines(engine, steps(1, 21) + TEARDOWN)
    assert without.status == "failed"  # the same teardown with no end before it is a failure
    report = diagnose_lines(engine, steps(1, 21) + [marker] + TEARDOWN)
    assert (report.status, report.action, report.root_cause) == ("healthy", "none", None)
    # The node's fault after the end is the node's: said, never acted on through this job.
    assert any(HOST in n and "after the run had finished" in n for n in report.notes)


def test_an_exception_after_the_run_said_it_was_done_still_fails_it(engine: Engine) -> None:
    lines = steps(1, 21) + ["Training completed. Do not forget to share your model on huggingface.co/models =)",
                            "Traceback (most recent call last):", '  File "/home/ml/proj/train.py", line 330, in <module>',
                            "    trainer.save_model(args.output_dir)",
                            "OSError: [Errno 28] No space left on device: '/ckpt/final/model-00001-of-00004.safetensors'"]
    report = diagnose_lines(engine, lines)
    assert report.status == "failed" and report.root_cause is not None and report.root_cause.line_no == 26


def test_a_bar_refreshed_after_the_end_marker_does_not_take_it_back(engine: Engine) -> None:
    lines = [f"Epoch 2: : {n}it [1:05:34,  4.49it/s, loss=2.15]" for n in range(100, 2200, 100)]
    lines += ["`Trainer.fit` stopped: `max_steps=2100` reached.", "Epoch 2: : 2100it [1:05:40,  4.49it/s, loss=2.1]"]
    lines += TEARDOWN[:2]
    assert diagnose_lines(engine, lines).status == "healthy"


def test_a_quiet_after_the_end_is_no_hang(engine: Engine) -> None:
    """Kernel lines minutes past the end of a timed log: the stall they measure is the run being over."""
    lines = [f"2024-05-01 10:{m:02d}:00,000 - INFO - step {m * 100} | loss = {3 - m * 0.01:.3f}" for m in range(1, 40)]
    lines += ["2024-05-01 10:40:00,000 - INFO - Training completed",
              f"{HOST}: [Wed May  1 11:30:00 2024] NVRM: Xid (PCI:0000:07:00): 45, pid=4242, name=python, Ch 0000000e"]
    report = diagnose_lines(engine, lines)
    assert report.status == "healthy"
    hung = diagnose_lines(engine, lines[:-2] + lines[-1:])
    assert hung.status == "failed"  # the same quiet without the end marker


def test_after_the_end_is_judged_by_the_lines_clocks_when_both_say_one() -> None:
    end = RunEnd(line_no=500, ts=1000.0)

    def event(line_no: int, ts: float | None) -> Event:
        return Event(kind=EventKind.XID, anchor=Record(line_no=line_no, raw="", text="", ts=ts))

    assert after_the_end(event(40, 1090.0), end)  # a node's kernel file that arrived first
    assert not after_the_end(event(900, 990.0), end)
    assert after_the_end(event(900, None), end) and not after_the_end(event(40, None), end)


# -- neither shown: unknown --------------------------------------------------------------------------------


def test_a_log_that_shows_neither_a_failure_nor_health_is_unknown(engine: Engine) -> None:
    lines = ["/usr/local/lib/python3.10/dist-packages/torch/optim/lr_scheduler.py:139: UserWarning: Detected call of "
             "`lr_scheduler.step()` before `optimizer.step()`."]
    report = diagnose_lines(engine, lines)
    assert (report.status, report.category, report.failure_type, report.action) == ("unknown", None, None, "none")
    assert "no training progress" in report.explanation and report.hint
    # Told how the job ended, the same line is a healthy job's.
    assert diagnose_lines(engine, lines, exit_code=0).status == "healthy"


def test_training_that_went_on_past_every_error_shows_health(engine: Engine) -> None:
    warn = ["[W reducer.cpp:1303] Warning: find_unused_parameters=True was specified in DDP constructor, but did not "
            "find any unused parameters in the forward pass."]
    report = diagnose_lines(engine, warn + steps(1, 30))
    assert report.status == "healthy"
    # Cut right after a line that says something went wrong, and never before: nothing shows the job went on.
    cut = diagnose_lines(engine, steps(1, 30) + [f"{HOST}:4242:4300 [0] NCCL WARN NET/IB : mlx5_0:1 Got async "
                                                 "event : GID table change"])
    assert cut.status in ("unknown", "failed") and cut.status != "healthy"


def test_a_line_the_job_ran_past_before_does_not_withhold_health_at_the_end(engine: Engine) -> None:
    warn = ("Token indices sequence length is longer than the specified maximum sequence length for this model "
            "({n} > 8192). Running this sequence through the model will result in indexing errors")
    lines = steps(1, 10) + [warn.format(n=9001)] + steps(11, 30) + [warn.format(n=12544)]
    assert diagnose_lines(engine, lines).status == "healthy"


# -- what every face does with `unknown` ------------------------------------------------------------------


def test_an_unknown_report_acts_on_nothing_and_says_so(engine: Engine) -> None:
    """The report of a log that shows nothing: no cordon (even with a culprit host on it), no restart of a
    `logdx run` attempt for it, and `unknown` in `logdx run`'s history."""
    from logdx.act.policy import cordon_refusal
    from logdx.config import ActionsSettings
    from logdx.run.options import Attempt, RunOptions
    from logdx.run.restart import restart_decision
    from logdx.run.supervisor import history_table
    from logdx.testing import failed_report

    report = diagnose_lines(engine, ["Loading config from /etc/train.yaml", "Building model: 7B parameters"])
    assert report.status == "unknown"
    unknown = failed_report(status="unknown")  # a culprit host and a cordon action left on it: still nothing
    assert cordon_refusal(unknown, ActionsSettings()) is not None
    assert cordon_refusal(failed_report(), ActionsSettings()) is None
    attempt = Attempt(number=1, argv=["train.py"], started_at=0.0, exit_code=1, report=report)
    restart, why = restart_decision(attempt, RunOptions(command=["train.py"], job_id="j"), ActionsSettings())
    assert not restart and "restart-on" in why
    assert "unknown" in history_table([attempt]).splitlines()[1]


def megatron(it: int, loss: float) -> str:
    return (f" iteration {it:>8}/  159576 | consumed samples: {it * 96:>12} | elapsed time per iteration (ms): 18706.1 "
            f"| learning rate: 6.000E-05 | global batch size:    96 | lm loss: {loss:.6E} | loss scale: 2048.0 | "
            "grad norm: 98258.265 | number of skipped iterations:   0 | number of nan iterations:   0 |")


@pytest.mark.parametrize("last", [7.4, 8.3])
def test_a_loss_blow_up_in_a_course_too_short_to_judge_shows_no_health(engine: Engine, last: float) -> None:
    """A few logging intervals pasted: the loss jumps half as high again and has not come back when the log ends.
    Three points cannot tell a spike it got over from a divergence: neither health nor a fault is shown."""
    report = diagnose_lines(engine, [megatron(7000, 6.44), megatron(7010, 11.42), megatron(7020, last)], exit_code=None)
    assert report.status == "unknown"
    assert "loss jumped from 6.44 to 11.4" in report.explanation


@pytest.mark.parametrize("losses", [(6.44, 11.42, 6.41), (6.44, 6.9, 6.2, 6.6), (9.8, 7.1, 6.4, 6.45)])
def test_a_short_loss_course_back_on_its_level_or_only_wobbling_shows_health(engine: Engine, losses: tuple[float, ...]) -> None:
    report = diagnose_lines(engine, [megatron(7000 + 10 * i, v) for i, v in enumerate(losses)], exit_code=None)
    assert report.status == "healthy"
