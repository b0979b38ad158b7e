"""Stage 3: kept lines become events: one traceback per rank, Xids, NCCL, exits, NaN, stalls."""

from __future__ import annotations

from logdx.compress import Compressor
from logdx.detect import Detector
from logdx.normalize import Normalizer


def _events(lines):
    n, c, d = Normalizer(), Compressor(), Detector()
    events = []
    for line in lines:
        for kept in c.add(n.normalize(line)):
            events.extend(d.feed(kept))
    for kept in c.flush_tails():
        events.extend(d.feed(kept))
    events.extend(d.finish(c.summary(), c.last_progress))
    return events


TB = [
    "Traceback (most recent call last):",
    '  File "/workspace/train.py", line 88, in <module>',
    "    main()",
    '  File "/opt/conda/lib/python3.10/site-packages/torch/nn/modules/module.py", line 1130, in __getattr__',
    "    raise AttributeError(",
    "AttributeError: 'DistributedDataParallel' object has no attribute 'generate'",
]


def test_interleaved_tracebacks_become_one_event_per_rank():
    lines = []
    for step in TB:
        lines += [f"[rank{r}]: {step}" for r in range(8)]
    tbs = [e for e in _events(lines) if e.kind == "traceback"]
    assert len(tbs) == 8
    for ev in tbs:
        assert ev.exception_type == "AttributeError"
        assert "no attribute 'generate'" in ev.exception_message
        assert [f.function for f in ev.frames] == ["<module>", "__getattr__"]
        assert ev.frames[0].code == "main()"
        assert ev.anchor.text == TB[-1]
        assert {r.rank for r in ev.lines} == {ev.anchor.rank}


def test_multiline_exception_message_is_joined():
    lines = TB[:-1] + ["AssertionError: Check batch related parameters. train_batch_size is not",
                       "equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 4 *", "8 * 1"]
    (ev,) = [e for e in _events(lines) if e.kind == "traceback"]
    assert ev.exception_type == "AssertionError"
    assert ev.exception_message.endswith("64 != 4 * 8 * 1")
    assert ev.anchor.line_no == 6


def test_rich_traceback_frames_are_parsed():
    lines = ["╭───── Traceback (most recent call last) ─────╮",
             "│ /opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py: │",
             "│ 891 in _batch_assertion                                     │",
             "╰─────────────────────────────────────────────╯",
             "AssertionError: Check batch related parameters."]
    (ev,) = [e for e in _events(lines) if e.kind == "traceback"]
    assert ev.frames[0].path.endswith("deepspeed/runtime/config.py")
    assert (ev.frames[0].line, ev.frames[0].function) == (891, "_batch_assertion")


def test_dotted_exception_types():
    lines = ['Traceback (most recent call last):', '  File "/w/t.py", line 1, in <module>',
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."]
    (ev,) = [e for e in _events(lines) if e.kind == "traceback"]
    assert ev.exception_type == "torch.OutOfMemoryError"


def test_line_events_classify_xid_nccl_exit_and_child_failed():
    lines = [
        "[Wed May  1 12:00:05 2024] NVRM: Xid (PCI:0000:8a:00): 79, pid=1911, GPU has fallen off the bus.",
        "node-2:123:456 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<45> with status=12",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 3 (pid: 77)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]
    kinds = {e.kind: e for e in _events(lines)}
    assert kinds["xid"].attrs["xid"] == 79 and kinds["xid"].gpu == "0000:8a:00"
    assert kinds["nccl"].anchor.host == "node-2"
    assert kinds["signal_exit"].attrs["exitcode"] == -9
    assert "child_failed" in kinds


def test_nan_loss_becomes_an_event():
    lines = [f"[rank0]: iteration {i} | loss {2.0 - i / 1000:.3f}" for i in range(50)] + ["[rank0]: iteration 50 | loss nan"]
    evs = [e for e in _events(lines) if e.kind == "loss_nan"]
    assert evs and evs[0].anchor.line_no == 51


def test_stall_is_detected_from_timestamps():
    lines = [f"2024-05-01 12:{i // 60:02d}:{i % 60:02d},000 INFO iteration {i} | loss 2.0" for i in range(0, 600, 2)]
    lines.append("2024-05-01 13:30:00,000 INFO heartbeat from watchdog")
    (stall,) = [e for e in _events(lines) if e.kind == "stall"]
    assert stall.attrs["stalled_s"] > 3000
    assert "iteration 598" in stall.anchor.text


def test_healthy_progress_makes_no_events():
    lines = [f"2024-05-01 12:00:{i % 60:02d},000 INFO iteration {i} | loss 2.0" for i in range(200)]
    assert _events(lines) == []


def test_logger_prefix_on_every_traceback_line_is_seen_through():
    p = "2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] [09c561ee] "
    lines = [p + "Traceback (most recent call last):", p + '  File "/opt/lib/site-packages/torch/serialization.py", line 379, in save',
             p + "    _save(obj)", p + "OSError: [Errno 28] No space left on device"]
    (ev,) = [e for e in _events(lines) if e.kind == "traceback"]
    assert ev.exception_type == "OSError" and ev.anchor.line_no == 4
    assert ev.frames[0].function == "save"


def test_exception_whose_message_is_a_traceback():
    lines = ["IndexError: Traceback (most recent call last):", '  File "/w/dataset.py", line 46, in __getitem__',
             "    x = self.items[idx]", "IndexError: list index out of range"]
    (ev,) = [e for e in _events(lines) if e.kind == "traceback"]
    assert ev.exception_type == "IndexError" and ev.anchor.line_no == 4


# -- any exception, and which exception wraps which ----------------------------------------------------


def test_any_class_name_closes_a_traceback():
    for line in ("BackendCompilerFailed: backend='inductor' raised:",
                 "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 135200",
                 "deepspeed.runtime.zero.utils.ZeRORuntimeException: Parameter is not available"):
        tb = [e for e in _events([*TB[:-1], line]) if e.kind == "traceback"]
        assert tb and tb[0].exception_type == line.split(":")[0], line


def test_a_module_qualified_exception_on_its_own_line_is_one():
    events = _events(["pyarrow.lib.ArrowInvalid: JSON parse error: Column() changed from object to array in row 0"])
    assert [e.exception_type for e in events] == ["pyarrow.lib.ArrowInvalid"]


def test_logger_names_and_levels_are_not_exceptions():
    for line in ("INFO:root:step 10 done", "transformers.trainer: saving model checkpoint to out/"):
        assert not any(e.exception_type for e in _events([*TB[:3], line])), line


def test_a_dataloader_reraise_wraps_the_original_traceback():
    lines = [
        "KeyError: Caught KeyError in DataLoader worker process 0.",
        "Original Traceback (most recent call last):",
        '  File "/env/lib/python3.8/site-packages/torch/utils/data/_utils/worker.py", line 308, in _worker_loop',
        "    data = fetcher.fetch(index)",
        '  File "/home/me/proj/datasets.py", line 216, in __getitem__',
        "    index = self.ex2emb_idx[name]",
        "KeyError: 'metro_station_07'",
    ]
    events = [e for e in _events(lines) if e.exception_type]
    wrapper = next(e for e in events if "Caught" in (e.exception_message or ""))
    inner = wrapper.attrs["wraps"]
    assert inner.exception_message == "'metro_station_07'" and inner.attrs["wrapped_by"] is wrapper


def test_chained_tracebacks_are_linked_in_order():
    lines = [*TB[:-1], "OSError: [Errno 28] No space left on device", "",
             "During handling of the above exception, another exception occurred:", "",
             *TB[:-1], "RuntimeError: could not save the checkpoint"]
    first, second = [e for e in _events(lines) if e.kind == "traceback"]
    assert first.attrs["chained_to"] is second and second.attrs["chained_from"] is first


def test_an_exception_that_says_raised_wraps_the_next_one():
    lines = ["torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
             "ImportError: cannot import name 'triton_key' from 'triton.compiler.compiler'"]
    outer, inner = [e for e in _events(lines) if e.exception_type]
    assert outer.attrs["wraps"] is inner
    # after a traceback, and whatever the wrapped class is called (triton's OutOfResources)
    tb = [*TB[:-1], "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
          "OutOfResources: out of resource: shared memory, Required: 135200, Hardware limit: 101376."]
    outer, inner = [e for e in _events(tb) if e.exception_type]
    assert outer.attrs["wraps"] is inner and inner.exception_type == "OutOfResources"
    assert outer.exception_message == "backend='inductor' raised:"


def test_launcher_exit_lines_carry_the_pid():
    ev = _events(["E0603 10:30:09.123 api.py:869] failed (exitcode: -9) local_rank: 3 (pid: 14403) of binary: python"])
    assert ev[0].kind == "signal_exit" and ev[0].attrs == {"exitcode": -9, "pid": 14403}


def test_a_line_with_its_own_timestamp_is_not_the_message_going_on():
    lines = [*TB[:-1], "wandb.errors.Error: You must call wandb.init() before wandb.plot_table()",
             "Epoch 1/462, Steps:   0%|          | 1/6000 [00:11<15:45:28,  9.46s/it]",
             "[2024-02-08 09:58:41,845] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1)"]
    tb = next(e for e in _events(lines) if e.kind == "traceback")
    assert tb.exception_message == "You must call wandb.init() before wandb.plot_table()"
    assert not any("exitcode" in r.text or "%|" in r.text for r in tb.lines)


def test_an_exception_class_glued_to_another_writers_line_is_read_with_its_message():
    """Two ranks writing one stream unbuffered: the closing line's class ends up glued to the end
    of the other rank's line, and its ": message" starts the next line."""
    lines = [
        "Traceback (most recent call last):",
        '  File "/app/src/train.py", line 23, in <module>',
        "    launch()",
        '  File "/app/src/data/parser.py", line 107, in get_dataset_list',
        'raise ValueError("Undefined dataset {} in {}.".format(name, DATA_CONFIG))ValueError',
        ": Undefined dataset alpaca_en_demo.json in dataset_info.json.ValueError",
        ": Undefined dataset alpaca_en_demo.json in dataset_info.json.",
    ]
    tb = [e for e in _events(lines) if e.kind == "traceback"]
    assert len(tb) == 1
    assert tb[0].exception_type == "ValueError"
    assert tb[0].exception_message == "Undefined dataset alpaca_en_demo.json in dataset_info.json."
    assert tb[0].anchor.text.startswith(": Undefined dataset")
    # a glued class with no ": message" after it is still the exception, anchored where it was read
    cut = [e for e in _events(lines[:5] + ["[rank0] step 12 loss 1.23"]) if e.kind == "traceback"]
    assert cut[0].exception_type == "ValueError" and cut[0].anchor.text.startswith("raise ValueError")
    ended = [e for e in _events(lines[:5]) if e.kind == "traceback"]
    assert ended[0].exception_type == "ValueError"


def test_a_stray_exception_lines_message_goes_on_over_wrapped_lines():
    """An exception printed without its traceback (a log excerpt, a terminal that wrapped it): the
    next plain lines are its message, until a logger's own record starts."""
    lines = [
        "ImportError: /env/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined",
        "symbol: _ZN3c104cuda9SetDeviceEi",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 1274) of binary: /env/bin/python",
    ]
    events = _events(lines)
    [exc] = [e for e in events if e.exception_type == "ImportError"]
    assert exc.exception_message.endswith("undefined symbol: _ZN3c104cuda9SetDeviceEi")
    assert any(e.kind == "signal_exit" for e in events)  # the launcher's line is its own event


def test_a_traceback_cut_off_at_its_raise_statement_names_the_exception():
    """The log stops at 'raise ChildFailedError(' (an excerpt, a truncated file): the class is known."""
    lines = [*TB[:-2], "    raise ChildFailedError(", "[rank0] step 12 loss 1.23"]
    [tb] = [e for e in _events(lines) if e.kind == "traceback"]
    assert tb.exception_type == "ChildFailedError" and tb.exception_message == ""
    [ended] = [e for e in _events(lines[:-1]) if e.kind == "traceback"]
    assert ended.exception_type == "ChildFailedError"
    plain = [e for e in _events([*TB[:-2], "    main()", "[rank0] step 12 loss 1.23"]) if e.kind == "traceback"]
    assert plain[0].exception_type is None
