"""The rule engine (logdx.diagnose.rules) and the shipped rule packs (rules/*.yaml)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from logdx.diagnose.hangs import hang_label
from logdx.diagnose.occupied import taken_label
from logdx.diagnose.rules import (
    RuleError,
    RuleSet,
    check_examples,
    classify_origin,
    default_rules_dir,
    load_rules,
)
from logdx.model import Action, Category, Event, Frame, Record, Role
from logdx.taxonomy import taxonomy

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> RuleSet:
    return load_rules([default_rules_dir()])


def rec(text: str, line_no: int = 1, rank: int | None = None, host: str | None = None) -> Record:
    return Record(line_no=line_no, raw=text, text=text, rank=rank, host=host)


def line_event(text: str, kind: str = "line", **kw: object) -> Event:
    r = rec(text, **kw)  # type: ignore[arg-type]
    return Event(kind=kind, anchor=r, lines=[r])


def traceback_event(
    exc_type: str, message: str, frames: list[tuple[str, str]], rank: int | None = None, extra: list[str] = ()
) -> Event:
    """A traceback as detect builds it: header, frame lines (+ source), the exception line."""
    lines = [rec("Traceback (most recent call last):", 1, rank)]
    fr = []
    for i, (path, func) in enumerate(frames):
        lines.append(rec(f'  File "{path}", line {10 + i}, in {func}', len(lines) + 1, rank))
        lines.append(rec("    do_something()", len(lines) + 1, rank))
        fr.append(Frame(path=path, line=10 + i, function=func))
    first = message.split("\n")[0]
    anchor = rec(f"{exc_type}: {first}" if message else exc_type, len(lines) + 1, rank)
    lines.append(anchor)
    lines.extend(rec(t, len(lines) + 1, rank) for t in [*message.split("\n")[1:], *extra])
    return Event(
        kind="traceback", anchor=anchor, lines=lines, exception_type=exc_type, exception_message=message, frames=fr
    )


def write_pack(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip("\n"), encoding="utf-8")
    return path


GOOD_RULE = """
pack: test
description: a test pack
rules:
  - id: good-rule
    title: A good rule
    role: root_cause
    category: infrastructure
    failure_type: disk_full
    confidence: 0.9
    match:
      patterns: ['No space left on device']
    examples:
      - 'OSError: [Errno 28] No space left on device'
"""

SITE = "/opt/conda/lib/python3.10/site-packages"

# ---------------------------------------------------------------------------------------------
# the shipped packs
# ---------------------------------------------------------------------------------------------


def test_every_pack_loads(rules: RuleSet) -> None:
    packs = {r.pack for r in rules.rules}
    assert {"gpu", "nccl", "cuda", "storage", "node", "python", "framework", "symptoms"} <= packs
    assert len(rules) >= 150
    assert rules.origin.library_paths, "the python pack carries the origin section"


def test_every_rule_passes_its_examples(rules: RuleSet) -> None:
    assert check_examples(rules) == []


def test_every_canonical_failure_type_is_covered(rules: RuleSet) -> None:
    # Hangs told from stack dumps are labelled by who owns the code a process waits in (diagnose/hangs.py).
    covered = {(hang_label(owner).category, hang_label(owner).failure_type) for owner in ("user", "library", "native")}
    # So is an out-of-memory another process caused, from the numbers its message gives (diagnose/occupied.py).
    covered.add((taken_label().category, taken_label().failure_type))
    for r in rules.rules:
        labels = list(r.by_origin.values()) if r.by_origin else [r.label]
        covered |= {(lab.category, lab.failure_type) for lab in labels if lab is not None}
    missing = [
        (cat.value, ft) for cat, fts in taxonomy().by_category().items() if cat is not Category.UNKNOWN for ft in fts
        if (cat, ft) not in covered
    ]
    assert missing == []


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 46, 48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140])
def test_every_listed_xid_has_its_own_rule(rules: RuleSet, xid: int) -> None:
    ev = line_event(f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1234, name=python, something", kind="xid")
    best = rules.match(ev)[0]
    assert best.rule_id.startswith(f"xid-{xid}-"), best.rule_id
    assert best.groups["gpu"] == "0000:3b:00"


@pytest.mark.parametrize(
    ("xid", "failure_type", "action", "role"),
    [
        # NVIDIA: an application error (out-of-range access); a restart replays the same kernel
        (13, "framework_error", Action.NO_RESTART, Role.ROOT_CAUSE),
        (31, "framework_error", Action.NO_RESTART, Role.ROOT_CAUSE),
        (43, "cuda_error", Action.RESTART, Role.SYMPTOM),
        (45, "cuda_error", Action.RESTART, Role.SYMPTOM),
        (48, "ecc_error", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
        (63, "ecc_error", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
        (74, "nvlink_error", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
        (79, "gpu_fell_off_bus", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
        (94, "ecc_error", Action.RESTART, Role.ROOT_CAUSE),
        (95, "ecc_error", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
        (119, "gpu_hardware_error", Action.CORDON_AND_RESTART, Role.ROOT_CAUSE),
    ],
)
def test_xid_labels_follow_nvidia_actions(
    rules: RuleSet, xid: int, failure_type: str, action: Action, role: Role
) -> None:
    best = rules.match(line_event(f"NVRM: Xid (PCI:0000:8a:00): {xid}, pid=1, x", kind="xid"))[0]
    assert (best.label.failure_type, best.label.action, best.role) == (failure_type, action, role)


@pytest.mark.parametrize(
    ("text", "category", "failure_type"),
    [
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "infrastructure", "cuda_error"),
        ("RuntimeError: CUDA error: unspecified launch failure", "infrastructure", "cuda_error"),
        ("RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version", "framework", "environment_error"),
        ("Unable to determine the device handle for GPU0000:03:00.0: Unknown Error", "infrastructure", "gpu_hardware_error"),
        ("1c:00.0 VGA compatible controller: NVIDIA Corporation TU102GL [Quadro RTX 6000/8000] (rev ff)", "infrastructure", "gpu_fell_off_bus"),
        ("OSError: [Errno 28] No space left on device", "infrastructure", "disk_full"),
        ("slurmstepd: error: Detected 1 oom_kill event in StepId=1.0. Some of the step tasks have been OOM Killed.", "framework", "host_oom"),
        ("Out of memory: Killed process 31200 (python) total-vm:812000000kB", "framework", "host_oom"),
        ("RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.", "framework", "dataloader_killed"),
        ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).", "framework", "dataloader_killed"),
        ("NCCL WARN NET/IB : Got completion from peer 10.0.0.2<54862> with status=12 opcode=0 len=0 vendor err 129 (Recv)", "infrastructure", "network_error"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3", "infrastructure", "nccl_error"),
        ("CUDA_HOME does not exist, unable to compile CUDA op(s)", "framework", "environment_error"),
        ("RuntimeError: Error(s) in loading state_dict for GPT: size mismatch for wte.weight: copying a param with shape torch.Size([1]) from checkpoint", "framework", "checkpoint_error"),
        ("Loss is NaN, stopping training", "framework", "nan_loss"),
        ("train.py: error: unrecognized arguments: --foo", "script", "argument_error"),
        ("RuntimeError: CUDA error: device-side assert triggered", "script", "index_error"),
        ("ValueError: DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a `device_map`.", "framework", "config_error"),
    ],
)
def test_known_messages_get_their_label(rules: RuleSet, text: str, category: str, failure_type: str) -> None:
    from logdx.diagnose.rules import example_event

    hits = rules.match(example_event(text))
    assert hits, text
    assert (hits[0].label.category.value, hits[0].label.failure_type) == (category, failure_type)


def test_cuda_oom_is_framework_wherever_it_was_raised(rules: RuleSet) -> None:
    for frames in ([("train.py", "step")], [("train.py", "main"), (f"{SITE}/torch/nn/functional.py", "linear")]):
        ev = traceback_event("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB.", frames)
        best = rules.match(ev)[0]
        assert (best.label.category, best.label.failure_type) == (Category.FRAMEWORK, "cuda_oom")
        assert best.label.action is Action.NO_RESTART


# ---------------------------------------------------------------------------------------------
# ordering: root causes beat symptoms
# ---------------------------------------------------------------------------------------------


def test_ecc_beats_watchdog_symptom_on_the_same_line(rules: RuleSet) -> None:
    text = (
        "[PG 0 (default_pg) Rank 12] Process group watchdog thread terminated with exception: "
        "CUDA error: uncorrectable ECC error encountered"
    )
    hits = rules.match(line_event(text, rank=12, host="node-17"))
    best = hits[0]
    assert best.rule_id == "cuda-ecc-uncorrectable"
    assert best.role is Role.ROOT_CAUSE
    assert (best.label.failure_type, best.label.action) == ("ecc_error", Action.CORDON_AND_RESTART)
    assert "node-17" in best.hint and "12" in best.hint
    # The symptom rule stays out of a line that carries a root cause.
    assert "nccl-watchdog-terminated" not in [h.rule_id for h in hits]


def test_hits_are_ordered_root_cause_then_symptom(rules: RuleSet) -> None:
    ev = traceback_event(
        "RuntimeError",
        "NCCL communicator was aborted on rank 3. Original reason: CUDA error: an illegal memory access was encountered",
        [("train.py", "main")],
    )
    hits = rules.match(ev)
    roles = [h.role for h in hits]
    assert roles[0] is Role.ROOT_CAUSE and hits[0].rule_id == "cuda-illegal-memory-access"
    assert Role.SYMPTOM in roles
    assert roles == sorted(roles, key=[Role.ROOT_CAUSE, Role.FALLBACK, Role.SYMPTOM].index)


def test_watchdog_timeout_is_only_a_symptom(rules: RuleSet) -> None:
    text = (
        "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=86645, OpType=ALLREDUCE, "
        "Timeout(ms)=1800000) ran for 1805320 milliseconds before timing out."
    )
    hits = rules.match(line_event(text, rank=2))
    assert [h.rule_id for h in hits] == ["nccl-watchdog-timeout"]
    assert hits[0].role is Role.SYMPTOM and hits[0].label.failure_type == "nccl_timeout"
    assert "SeqNum=86645" in hits[0].groups["work"]


def test_fallback_is_dropped_when_a_precise_rule_hits(rules: RuleSet) -> None:
    child = traceback_event(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
        "",
        [(f"{SITE}/torch/distributed/run.py", "main")],
    )
    ids = [h.rule_id for h in rules.match(child)]
    assert ids == ["elastic-child-failed"]
    odd = traceback_event("RuntimeError", "something odd", [("train.py", "main")])
    hits = rules.match(odd)
    assert [h.rule_id for h in hits] == ["py-exception-fallback"]
    assert hits[0].role is Role.FALLBACK and hits[0].label.failure_type == "script_error"


def test_a_traceback_cut_off_before_its_exception_is_weak_evidence_placed_by_its_frames(rules: RuleSet) -> None:
    """A log that stops inside a traceback was printing a crash; the frames say whose code. Only a
    fallback: any precise rule, any exception wins."""
    lines = [rec("Traceback (most recent call last):", 1), rec('  File "train.py", line 3, in main', 2)]
    ev = Event(kind="traceback", anchor=lines[-1], lines=lines, frames=[Frame("train.py", 3, "main")])
    assert rules.match(ev) == []  # other lines cut into it: its exception may still come, among theirs
    ev.attrs["ends_log"] = True
    [hit] = rules.match(ev)
    assert (hit.rule_id, hit.role, hit.label.category) == ("py-traceback-cut-off", Role.FALLBACK, Category.SCRIPT)
    assert hit.confidence < 0.5
    assert not rules.could_match("2024-05-01 03:12:44,123 - INFO - step 100/1000 | loss 2.31")  # '-' is no name


# ---------------------------------------------------------------------------------------------
# where an exception was raised
# ---------------------------------------------------------------------------------------------


def test_by_origin_user_frame_is_script(rules: RuleSet) -> None:
    ev = traceback_event("KeyError", "'save_epoch'", [("train.py", "<module>"), ("train.py", "train_net")])
    best = rules.match(ev)[0]
    assert (best.rule_id, best.label.category, best.label.failure_type) == ("py-key-error", Category.SCRIPT, "key_error")


def test_by_origin_site_packages_frame_is_framework(rules: RuleSet) -> None:
    ev = traceback_event(
        "KeyError", "'llama'", [("train.py", "main"), (f"{SITE}/transformers/models/auto/configuration_auto.py", "__getitem__")]
    )
    best = rules.match(ev)[0]
    assert (best.label.category, best.label.failure_type) == (Category.FRAMEWORK, "framework_error")


def test_library_value_error_is_config_error(rules: RuleSet) -> None:
    ev = traceback_event("ValueError", "bad option", [("train.py", "main"), (f"{SITE}/deepspeed/runtime/config.py", "check")])
    assert rules.match(ev)[0].label.failure_type == "config_error"
    ev = traceback_event("ValueError", "bad option", [("train.py", "main")])
    assert rules.match(ev)[0].label.failure_type == "value_error"


def test_getattr_passthrough_counts_as_user(rules: RuleSet) -> None:
    frames = [
        ("train.py", "<module>"),
        ("train.py", "train"),
        ("/home/u/env/lib/python3.8/site-packages/torch/nn/modules/module.py", "__getattr__"),
    ]
    ev = traceback_event("AttributeError", "'Net' object has no attribute 'encoder'", frames)
    assert classify_origin(ev, rules.origin) == "user"
    best = rules.match(ev)[0]
    assert (best.rule_id, best.label.category, best.label.failure_type) == (
        "py-attribute-error", Category.SCRIPT, "attribute_error",
    )
    # The same error raised by a library function proper is the library's.
    frames[-1] = (f"{SITE}/torch/nn/modules/module.py", "load_state_dict")
    ev = traceback_event("AttributeError", "'Net' object has no attribute 'encoder'", frames)
    assert classify_origin(ev, rules.origin) == "library"
    assert rules.match(ev)[0].label.category is Category.FRAMEWORK


def test_stdlib_and_frozen_frames_pass_the_error_to_their_caller(rules: RuleSet) -> None:
    # Python's own library raises on behalf of whoever called it: the user's code, or a library.
    for path in ["/usr/lib/python3.11/json/decoder.py", "anaconda3/lib/python3.6/queue.py", "<frozen os>"]:
        ev = traceback_event("ValueError", "x", [("train.py", "main"), (path, "f")])
        assert classify_origin(ev, rules.origin) == "user", path
        ev = traceback_event("ValueError", "x", [("train.py", "main"), (f"{SITE}/datasets/load.py", "load"), (path, "f")])
        assert classify_origin(ev, rules.origin) == "library", path
        # With no caller shown (an excerpt that starts inside the standard library), library code raised it.
        ev = traceback_event("ValueError", "x", [(path, "f")])
        assert classify_origin(ev, rules.origin) == "library", path


def test_module_has_no_attribute_in_library_is_version_mismatch(rules: RuleSet) -> None:
    ev = traceback_event(
        "AttributeError", "module 'numpy' has no attribute 'float'", [("train.py", "main"), (f"{SITE}/old_lib/utils.py", "f")]
    )
    best = rules.match(ev)[0]
    assert (best.label.category, best.label.failure_type) == (Category.FRAMEWORK, "version_mismatch")
    ev = traceback_event("AttributeError", "module 'numpy' has no attribute 'float'", [("train.py", "main")])
    assert rules.match(ev)[0].label.failure_type == "attribute_error"


def test_no_frames_origin_depends_on_qualified_type(rules: RuleSet) -> None:
    bare = line_event("KeyError: 'x'")
    bare.exception_type, bare.exception_message = "KeyError", "'x'"
    assert classify_origin(bare, rules.origin) == "user"
    qual = line_event("deepspeed.runtime.zero.utils.ZeRORuntimeException: bad")
    qual.exception_type, qual.exception_message = "deepspeed.runtime.zero.utils.ZeRORuntimeException", "bad"
    assert classify_origin(qual, rules.origin) == "library"
    main = line_event("__main__.MyError: x")
    main.exception_type = "__main__.MyError"
    assert classify_origin(main, rules.origin) == "user"


def test_dataloader_worker_error_uses_the_original_traceback(rules: RuleSet) -> None:
    message = "\n".join(
        [
            "Caught KeyError in DataLoader worker process 0.",
            "Original Traceback (most recent call last):",
            f'  File "{SITE}/torch/utils/data/_utils/worker.py", line 308, in _worker_loop',
            '  File "/work/my_dataset.py", line 41, in __getitem__',
            "KeyError: 'label'",
        ]
    )
    ev = traceback_event(
        "KeyError", message, [("train.py", "main"), (f"{SITE}/torch/_utils.py", "reraise")]
    )
    assert classify_origin(ev, rules.origin) == "user"
    best = rules.match(ev)[0]
    assert (best.label.category, best.label.failure_type) == (Category.SCRIPT, "key_error")


def test_dataloader_reraise_in_the_main_process_is_the_users(rules: RuleSet) -> None:
    # detect may split the worker's "Original Traceback" into an event of its own: the main
    # process's half must not blame the DataLoader machinery.
    frames = [
        ("train.py", "main"),
        (f"{SITE}/torch/utils/data/dataloader.py", "__next__"),
        (f"{SITE}/torch/utils/data/dataloader.py", "_next_data"),
        (f"{SITE}/torch/utils/data/dataloader.py", "_process_data"),
        (f"{SITE}/torch/_utils.py", "reraise"),
    ]
    ev = traceback_event("KeyError", "Caught KeyError in DataLoader worker process 0.", frames)
    assert classify_origin(ev, rules.origin) == "user"
    assert rules.match(ev)[0].label.failure_type == "key_error"


def test_exceptions_compare_short_and_full_names(tmp_path: Path) -> None:
    write_pack(
        tmp_path,
        "p.yaml",
        """
        pack: p
        rules:
          - id: short
            title: short name
            role: root_cause
            category: framework
            failure_type: cuda_oom
            confidence: 0.9
            match: {exceptions: [OutOfMemoryError]}
            examples: ['torch.cuda.OutOfMemoryError: x']
          - id: full
            title: full name
            role: root_cause
            category: framework
            failure_type: cuda_oom
            confidence: 0.8
            match: {exceptions: [torch.OutOfMemoryError]}
            examples: ['torch.OutOfMemoryError: x', 'OutOfMemoryError: x']
            counterexamples: ['torch.cuda.OutOfMemoryError: x', 'foo.OutOfMemoryError: x']
        """,
    )
    rs = load_rules([tmp_path])
    ev = traceback_event("torch.OutOfMemoryError", "CUDA out of memory", [("t.py", "f")])
    assert [h.rule_id for h in rs.match(ev)] == ["short", "full"]


# ---------------------------------------------------------------------------------------------
# what patterns are matched against
# ---------------------------------------------------------------------------------------------


def test_multiline_exception_message_is_joined(rules: RuleSet) -> None:
    message = (
        "Check batch related parameters. train_batch_size is not\n"
        "equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 4 *\n8 * 1"
    )
    ev = traceback_event("AssertionError", message, [(f"{SITE}/deepspeed/runtime/config.py", "_batch_assertion")])
    best = rules.match(ev)[0]
    assert best.rule_id == "deepspeed-batch-size"
    assert best.line is ev.anchor
    assert best.label.failure_type == "config_error"


def test_source_lines_in_a_traceback_do_not_match(rules: RuleSet) -> None:
    lines = [
        rec("Traceback (most recent call last):", 1),
        rec('  File "train.py", line 3, in main', 2),
        rec("    raise RuntimeError('CUDA out of memory, try a smaller batch')", 3),
        rec("RuntimeError: bad thing", 4),
    ]
    ev = Event(
        kind="traceback", anchor=lines[-1], lines=lines, exception_type="RuntimeError",
        exception_message="bad thing", frames=[Frame("train.py", 3, "main")],
    )
    assert "cuda-oom" not in [h.rule_id for h in rules.match(ev)]


def test_hit_names_the_line_it_matched(rules: RuleSet) -> None:
    lines = [
        rec("node-3:1:2 [4] NCCL WARN NET/IB : Got completion from peer 10.0.0.9<1> with status=12 opcode=0", 7, host="node-3"),
        rec("node-3:1:2 [4] NCCL INFO transport/net.cc:1302 -> 6", 8, host="node-3"),
    ]
    ev = Event(kind="nccl", anchor=lines[1], lines=lines)
    best = rules.match(ev)[0]
    assert best.rule_id == "ib-completion-retry-exceeded"
    assert best.line.line_no == 7
    assert best.groups == {"peer": "10.0.0.9<1>"}
    assert "node-3" in best.hint and "10.0.0.9<1>" in best.hint


def test_named_groups_fill_the_hint_and_a_missing_host_reads_as_words(rules: RuleSet) -> None:
    ev = line_event("NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, GPU has fallen off the bus.", kind="xid", host="node-17")
    best = rules.match(ev)[0]
    assert best.rule_id == "xid-79-fell-off-bus"
    assert best.groups["gpu"] == "0000:3b:00"
    assert "0000:3b:00" in best.hint and "node-17" in best.hint
    unknown_host = rules.match(line_event("NVRM: Xid (PCI:0000:3b:00): 79, pid=1911", kind="xid"))[0]
    assert "of its node fell off" in unknown_host.hint and "?" not in unknown_host.hint


def test_slurm_node_failure_names_the_host(rules: RuleSet) -> None:
    text = "slurmstepd: error: *** JOB 4242 ON node-17 CANCELLED AT 2024-05-01T03:12:44 DUE TO NODE FAILURE ***"
    best = rules.match(line_event(text, host="login-1"))[0]
    assert best.groups["host"] == "node-17" and best.label.action is Action.CORDON_AND_RESTART
    assert best.host == "node-17"  # the named group wins over the line's own prefix
    assert "node-17" in best.hint
    assert best.source == "rule:slurm-node-failure"


def test_hit_culprit_falls_back_to_the_line_and_event(rules: RuleSet) -> None:
    ev = line_event("RuntimeError: CUDA error: uncorrectable ECC error encountered", rank=42, host="node-9")
    ev.gpu = "0000:8a:00.0"
    best = rules.match(ev)[0]
    assert (best.host, best.rank, best.gpu) == ("node-9", 42, "0000:8a:00.0")


def test_kinds_filter(tmp_path: Path) -> None:
    write_pack(
        tmp_path,
        "p.yaml",
        """
        pack: p
        rules:
          - id: xid-only
            title: only xid events
            role: root_cause
            category: infrastructure
            failure_type: gpu_hardware_error
            confidence: 0.5
            match: {patterns: ['Xid'], kinds: [xid]}
            examples: ['NVRM: Xid (PCI:0000:3b:00): 61']
        """,
    )
    rs = load_rules([tmp_path])
    assert rs.match(line_event("NVRM: Xid (PCI:0000:3b:00): 61", kind="xid"))
    assert rs.match(line_event("NVRM: Xid (PCI:0000:3b:00): 61", kind="line")) == []


# ---------------------------------------------------------------------------------------------
# the pre-filter
# ---------------------------------------------------------------------------------------------

ERROR_LINES = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, GPU has fallen off the bus.",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "OSError: [Errno 28] No space left on device",
    "KeyError: 'save_epoch'",
    "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 1805320 milliseconds before timing out.",
    "train.py: error: unrecognized arguments: --foo",
    "iteration 1200/100000 | lm loss: nan | loss scale: 1.0",
]
PROGRESS_LINES = [
    "iteration 100/1000 | loss 2.31 | lr 1e-4",
    "iteration      100/  500000 | consumed samples: 12800 | elapsed time per iteration (ms): 1234.5 | learning rate: "
    "1.000E-04 | global batch size: 128 | lm loss: 2.345E+00 | loss scale: 65536.0 | grad norm: 1.234 | "
    "number of skipped iterations: 0 | number of nan iterations: 0 |",
    "2024-05-01 03:12:44,123 - INFO - step 100/1000 | loss 2.31 | lr 1e-4 | tokens/s 123456",
    "node-3:1234:1290 [0] NCCL INFO Channel 00/08 :    0   1   2   3   4   5   6   7",
    "Epoch 1: 45%|████▌     | 450/1000 [01:23<01:42,  5.37it/s, loss=2.31, v_num=0]",
    "",
]


def test_prefilter_flags_error_lines_and_passes_progress_lines(rules: RuleSet) -> None:
    for text in ERROR_LINES:
        assert rules.could_match(text), text
    for text in PROGRESS_LINES:
        assert not rules.could_match(text), text


BENIGN_LINES = [
    "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.",
    "[W socket.cpp:601] [c10d] The IPv6 network addresses of (node-0, 29500) cannot be retrieved (gai error: -2 - Name or service not known).",
    "node-1:123:123 [0] NCCL INFO NET/Plugin : dlerror=libnccl-net.so: cannot open shared object file: No such file or directory No plugin found (libnccl-net.so), using internal implementation",
    "libibverbs: Warning: couldn't load driver 'libmlx4-rdmav34.so': libmlx4-rdmav34.so: cannot open shared object file: No such file or directory",
    "node-1:123:123 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>",
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
    "Some weights of the model checkpoint at bert-base-uncased were not used when initializing BertModel",
    "pcieport 0000:00:03.0: PCIe Bus Error: severity=Corrected, type=Data Link Layer, (Transmitter ID)",
    "EDAC MC1: 1 CE memory read error on CPU_SrcID#1_Ha#0_Chan#2_DIMM#0",
    "nfs: server filer01 OK",
    "mlx5_core 0000:1a:00.0 enp26s0np0: Link up",
    "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
    "UserWarning: FlashAttention requires torch>=2.1 for best performance",
    "WARNING:torch.distributed.run: Setting OMP_NUM_THREADS environment variable for each process to be 1 in default",
]


def test_benign_lines_are_no_root_cause(rules: RuleSet) -> None:
    from logdx.diagnose.rules import example_event

    for text in BENIGN_LINES:
        roots = [h.rule_id for h in rules.match(example_event(text)) if h.role is Role.ROOT_CAUSE]
        assert roots == [], (text, roots)


def test_prefilter_is_cheap_on_progress_lines(rules: RuleSet) -> None:
    from logdx.testing import cpu_seconds

    lines = PROGRESS_LINES * 2000
    with cpu_seconds() as cpu:
        flagged = sum(rules.could_match(t) for t in lines)
    assert flagged == 0
    assert cpu.seconds / len(lines) < 200e-6  # typically ~5-40 us of CPU a line


def test_every_example_line_is_error_bearing(rules: RuleSet) -> None:
    for r in rules.rules:
        if r.kinds and set(r.kinds) <= {"stall", "loss_spike"}:
            continue  # a stall is the absence of lines, not a line
        for ex in r.examples:
            assert rules.could_match(ex.split("\n")[0]) or not r.patterns, (r.id, ex)


# ---------------------------------------------------------------------------------------------
# load errors name file, line and rule
# ---------------------------------------------------------------------------------------------


def load_error(tmp_path: Path, body: str, name: str = "bad.yaml") -> str:
    write_pack(tmp_path, name, body)
    with pytest.raises(RuleError) as exc:
        load_rules([tmp_path])
    return str(exc.value)


def test_unknown_failure_type_names_file_line_rule(tmp_path: Path) -> None:
    msg = load_error(
        tmp_path,
        """
        pack: gpu
        rules:
          - id: xid-79
            title: fell off
            role: root_cause
            category: infrastructure
            failure_type: gpu_lost
            confidence: 0.9
            match: {patterns: ['Xid']}
        """,
    )
    assert "bad.yaml:7: rule 'xid-79': unknown failure_type 'gpu_lost'" in msg


def test_failure_type_of_another_category_is_rejected(tmp_path: Path) -> None:
    msg = load_error(
        tmp_path,
        GOOD_RULE.replace("category: infrastructure", "category: script"),
    )
    assert "bad.yaml:8: rule 'good-rule': unknown failure_type 'disk_full' for category script" in msg


def test_bad_regex(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("['No space left on device']", "['No space (left']"))
    assert "bad.yaml:11: rule 'good-rule': bad regex 'No space (left'" in msg


def test_unknown_key(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("    confidence: 0.9", "    confidence: 0.9\n    severty: high"))
    assert "bad.yaml:10: rule 'good-rule': unknown key 'severty'" in msg


def test_unknown_key_inside_match(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("      patterns:", "      patern: ['x']\n      patterns:"))
    assert "bad.yaml:11: rule 'good-rule': unknown key 'patern'" in msg


def test_missing_field(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("    title: A good rule\n", ""))
    assert "bad.yaml:4: rule 'good-rule': missing field 'title'" in msg


def test_bad_role_and_category(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("role: root_cause", "role: cause").replace("infrastructure", "hardware"))
    assert "bad.yaml:6: rule 'good-rule': role:" in msg
    assert "bad.yaml:7: rule 'good-rule': category:" in msg


def test_duplicate_id_across_packs(tmp_path: Path) -> None:
    write_pack(tmp_path, "a.yaml", GOOD_RULE)
    msg = load_error(tmp_path, GOOD_RULE.replace("pack: test", "pack: other"), name="b.yaml")
    assert "b.yaml:4: rule 'good-rule': duplicate rule id (first defined at" in msg
    assert "a.yaml:4" in msg


def test_duplicate_id_across_dirs(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    write_pack(tmp_path / "one", "a.yaml", GOOD_RULE)
    write_pack(tmp_path / "two", "a.yaml", GOOD_RULE)
    with pytest.raises(RuleError, match="duplicate rule id"):
        load_rules([tmp_path / "one", tmp_path / "two"])
    extra = GOOD_RULE.replace("id: good-rule", "id: extra-rule")
    write_pack(tmp_path / "two", "a.yaml", extra)
    assert [r.id for r in load_rules([tmp_path / "one", tmp_path / "two"]).rules] == ["good-rule", "extra-rule"]


def test_example_that_does_not_match(tmp_path: Path) -> None:
    msg = load_error(
        tmp_path, GOOD_RULE + "      - 'OSError: [Errno 5] Input/output error'\n"
    )
    assert "bad.yaml:14: rule 'good-rule': example does not match: 'OSError: [Errno 5] Input/output error'" in msg


def test_counterexample_that_matches(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE + "    counterexamples:\n      - 'No space left on device'\n")
    assert "bad.yaml:15: rule 'good-rule': counterexample matches: 'No space left on device'" in msg


def test_check_examples_lists_all_problems_without_stopping(tmp_path: Path) -> None:
    write_pack(tmp_path, "p.yaml", GOOD_RULE + "      - 'nope'\n    counterexamples: ['No space left on device']\n")
    rs = load_rules([tmp_path], verify=False)
    problems = check_examples(rs)
    assert len(problems) == 2
    assert problems[0].endswith("p.yaml:14: rule 'good-rule': example does not match: 'nope'")
    assert problems[1].endswith("p.yaml:15: rule 'good-rule': counterexample matches: 'No space left on device'")


def test_unknown_kind_bad_hint_and_by_origin_conflict(tmp_path: Path) -> None:
    msg = load_error(
        tmp_path,
        """
        pack: p
        rules:
          - id: r1
            title: t
            role: root_cause
            confidence: 0.5
            category: script
            failure_type: script_error
            by_origin:
              user: {category: script, failure_type: script_error}
              library: {category: framework, failure_type: framework_error}
            match: {patterns: ['x'], kinds: [xidd]}
            hint: "{host.name} {0}"
        """,
    )
    assert "rule 'r1': give either category/failure_type/action or by_origin" in msg
    assert "rule 'r1': unknown event kind 'xidd'" in msg
    assert "rule 'r1': hint field" in msg
    assert "rule 'r1': by_origin needs match.exceptions" in msg


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    msg = load_error(tmp_path, "pack: p\nrules:\n  - id: x\n    title: [unclosed\n")
    assert "bad.yaml:" in msg and "invalid YAML" in msg


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("    confidence: 0.9", "    confidence: 0.9\n    confidence: 0.8"))
    assert "bad.yaml:10: rule 'good-rule': duplicate key 'confidence'" in msg


def test_bad_passthrough_in_origin(tmp_path: Path) -> None:
    msg = load_error(tmp_path, GOOD_RULE.replace("rules:", "origin:\n  passthrough: ['no-function-part']\nrules:"))
    assert "bad.yaml:4: origin: passthrough must be 'file-regex:function-regex'" in msg


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="no such rules directory"):
        load_rules([tmp_path / "nope"])


def test_default_action_by_category(tmp_path: Path) -> None:
    write_pack(tmp_path, "p.yaml", GOOD_RULE)
    rs = load_rules([tmp_path])
    assert rs.rules[0].label is not None and rs.rules[0].label.action is Action.RESTART
    write_pack(tmp_path, "p.yaml", GOOD_RULE.replace("infrastructure", "framework").replace("disk_full", "config_error"))
    assert load_rules([tmp_path]).rules[0].label.action is Action.NO_RESTART  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# finding the rules
# ---------------------------------------------------------------------------------------------


def test_default_rules_dir_is_the_repo_folder() -> None:
    d = default_rules_dir()
    assert (d / "gpu.yaml").is_file()


def test_default_rules_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pack(tmp_path, "p.yaml", GOOD_RULE)
    monkeypatch.setenv("LOGDX_RULES_DIR", str(tmp_path))
    assert default_rules_dir() == tmp_path
