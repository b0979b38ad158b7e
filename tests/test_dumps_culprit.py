"""The hung rank of a collection of every node's stack dumps (py-spy run on each node of a hung job, the
outputs put together under each node's name): its host from the collection's header when that host is one of
the job's, and its rank through its pid on that host (pids repeat across nodes); never a file's name as a host.
"""

from __future__ import annotations

import pytest

from logdx.pipeline import Engine
from logdx.testing import diagnose_lines

HOSTS = ("gpu-node-01", "gpu-node-02")
PER_NODE = 4
# Each node's launcher started its workers alike: the same pids on both nodes.
PIDS = {r: 31870 + r % PER_NODE for r in range(PER_NODE * len(HOSTS))}
BUS = ("1b000", "3b000", "5d000", "8a000")

COLLECTIVE = ["    all_reduce (torch/distributed/distributed_c10d.py:2050)",
              "    wrapper (torch/distributed/c10d_logger.py:75)",
              "    reduce_grads (megatron/core/distributed/finalize_model_grads.py:120)",
              "    train_step (megatron/training/training.py:600)",
              "    train (megatron/training/training.py:1212)",
              "    <module> (pretrain_gpt.py:240)"]
DATALOADER = ["    wait (threading.py:324)", "    get (queue.py:180)",
              "    _try_get_data (torch/utils/data/dataloader.py:1133)",
              "    _get_data (torch/utils/data/dataloader.py:1294)",
              "    __next__ (torch/utils/data/dataloader.py:631)",
              "    get_batch (pretrain_gpt.py:88)",
              "    train (megatron/training/training.py:1190)",
              "    <module> (pretrain_gpt.py:240)"]


def training(*, nccl: bool = True) -> list[str]:
    """A 2-node x 4-GPU job as pdsh tees it: NCCL's init lines (host, pid, rank), then progress, then nothing:
    the job hangs (NCCL's timeout set to hours), and the operator pastes every node's py-spy dump after it."""
    ranks = range(PER_NODE * len(HOSTS))
    out = []
    for r in ranks:
        h, local = HOSTS[r // PER_NODE], r % PER_NODE
        if nccl:
            out.append(f"{h}:{PIDS[r]}:{PIDS[r]} [{local}] NCCL INFO Bootstrap : Using eth0:10.0.0.{11 + r // PER_NODE}<0>")
            out.append(f"{h}:{PIDS[r]}:{PIDS[r] + 9} [{local}] NCCL INFO comm 0x55d0a8c0 rank {r} nranks {len(ranks)} "
                       f"cudaDev {local} busId {BUS[local]} commId 0x9f3c - Init COMPLETE")
        else:
            out.append(f"{h}: [rank{r}]: > initialized tensor model parallel with size 4 on local rank {local}")
    for it in range(1, 30):
        out.append(f"{HOSTS[-1]}: [rank{ranks[-1]}]: iteration {it:>6}/ 10000 | consumed samples: {it * 512} | "
                   f"elapsed time per iteration (ms): 1402.{it} | lm loss: {7 - it * 0.01:.6E} | grad norm: 1.2{it % 10} |")
    return out


def node_dumps(host_index: int, hung: int | None) -> list[str]:
    """One node's `pgrep -P $(pgrep -o python) | xargs -I {} py-spy dump --pid {}`: every worker's threads."""
    out = []
    for local in range(PER_NODE):
        r = host_index * PER_NODE + local
        pid = PIDS[r]
        out += [f"Process {pid}: /usr/bin/python3 -u pretrain_gpt.py --tensor-model-parallel-size 4 --micro-batch-size 1",
                "Python v3.10.12 (/usr/bin/python3.10)", "", f'Thread {pid} (active): "MainThread"']
        out += DATALOADER if r == hung else COLLECTIVE
        out += [f'Thread {pid + 214} (idle): "pt_autograd_0"',
                "    wait (threading.py:320)", "    run (threading.py:953)", "    _bootstrap_inner (threading.py:1016)",
                f'Thread {pid + 233} (idle): "Thread-3 (_pin_memory_loop)"',
                "    get (multiprocessing/queues.py:113)", "    do_one_step (torch/utils/data/_utils/pin_memory.py:31)",
                "    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:54)", "    run (threading.py:953)", ""]
    return out


def collection(header, hung: int) -> list[str]:
    out = []
    for i, h in enumerate(HOSTS):
        out += header(h) + node_dumps(i, hung)
    return out


HEADERS = {
    "tail -n +1 trace-*.out": lambda h: [f"==> trace-{h}.out <=="],
    "for f in trace-*; do echo $f; cat $f; done": lambda h: [f"trace-{h}"],
    "a host name alone": lambda h: ["", f"{h}:"],
    "a markdown note": lambda h: ["", f"### {h}", "", "```"],
}


@pytest.mark.parametrize("form", HEADERS)
def test_the_hung_rank_of_a_collection_is_its_nodes_pid(engine: Engine, form: str) -> None:
    """The pid alone names two processes (one per node): the header says which node's dump it is."""
    report = diagnose_lines(engine, training() + collection(HEADERS[form], hung=6), exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["gpu-node-02"], [6])
    assert "section header" in report.culprits.basis
    assert "_try_get_data" in report.root_cause.text


def test_a_summary_of_frame_names_under_a_header_keeps_the_dumps_under_it(engine: Engine) -> None:
    # The operator first greps each node's dumps for the frame that matters (`grep -o '^ *[a-z_]*' | sort`),
    # indented names under each node's header, then pastes the full dumps: those are still the last node's.
    def header(h: str) -> list[str]:
        return [f"trace-{h}", *[f"    {name}" for name in ("all_reduce", "all_reduce", "broadcast", "wait") * 3]]
    report = diagnose_lines(engine, training() + collection(header, hung=6), exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["gpu-node-02"], [6])


def test_a_header_without_a_pid_map_names_the_host_only(engine: Engine) -> None:
    report = diagnose_lines(engine, training(nccl=False) + collection(HEADERS["tail -n +1 trace-*.out"], hung=1),
                            exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["gpu-node-01"], [])
    assert "section header" in report.culprits.basis


def failure_box(host_index: int) -> list[str]:
    """torchrun's summary once the operator ended the hung job (scancel: SIGTERM to every worker): each rank's
    entry names its host, rank and pid."""
    host, ranks = HOSTS[host_index], [host_index * PER_NODE + local for local in range(PER_NODE)]

    def entry(index: int, r: int) -> list[str]:
        return [f"[{index}]:", "  time      : 2025-12-03_04:40:11", f"  host      : {host}",
                f"  rank      : {r} (local_rank: {r % PER_NODE})", f"  exitcode  : -15 (pid: {PIDS[r]})",
                "  error_file: <N/A>", f"  traceback : Signal 15 (SIGTERM) received by PID {PIDS[r]}"]

    out = ["=" * 60, "pretrain_gpt.py FAILED", "-" * 60, "Failures:"]
    for i, r in enumerate(ranks[1:], start=1):
        out += entry(i, r)
    return out + ["-" * 60, "Root Cause (first observed failure):", *entry(0, ranks[0]), "=" * 60]


def deepspeed_launch(host_index: int) -> list[str]:
    """DeepSpeed's launcher on one node (as pdsh prefixes it): the node's rank, then each worker's pid."""
    host = HOSTS[host_index]
    p = f"{host}: [2025-12-03 03:01:0{host_index},112] [INFO] [launch.py:"
    out = [f"{p}146:main] WORLD INFO DICT: {{'gpu-node-01': [0, 1, 2, 3], 'gpu-node-02': [0, 1, 2, 3]}}",
           f"{p}152:main] nnodes=2, num_local_procs={PER_NODE}, node_rank={host_index}",
           f"{p}164:main] dist_world_size={PER_NODE * len(HOSTS)}", f"{p}168:main] Setting CUDA_VISIBLE_DEVICES=0,1,2,3"]
    return out + [f"{p}256:main] process {PIDS[host_index * PER_NODE + local]} spawned with command: ['/usr/bin/python3', "
                  f"'-u', 'pretrain_gpt.py', '--local_rank={local}', '--deepspeed', '--deepspeed_config', 'ds_config.json']"
                  for local in range(PER_NODE)]


def test_the_launchers_own_lines_tie_a_pid_to_its_rank(engine: Engine) -> None:
    """No NCCL lines: torchrun's failure summary (rank, host, pid of each worker) or DeepSpeed's launcher (a node's
    rank, each worker's pid and local rank) say whose the hung pid is."""
    dumps = collection(HEADERS["tail -n +1 trace-*.out"], hung=6)
    killed = diagnose_lines(engine, training(nccl=False) + dumps + failure_box(0) + failure_box(1), exit_code=1)
    launched = diagnose_lines(engine, deepspeed_launch(0) + deepspeed_launch(1) + training(nccl=False) + dumps,
                              exit_code=None)
    for report in (killed, launched):
        assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["gpu-node-02"], [6])


def test_faulthandler_dumps_of_a_nodes_processes_one_after_another(engine: Engine) -> None:
    """Each worker's dump_traceback_later output (no thread marked current, a pin-memory thread first), the
    node's workers one after another in the node's file: each process is the one thread at the script's top
    level. faulthandler prints no pid: the node is named, not the rank."""
    site = "/usr/local/lib/python3.10/dist-packages"
    lines = training()
    for i, host in enumerate(HOSTS):
        lines.append(f"==> faulthandler-{host}.log <==")
        for local in range(PER_NODE):
            r = i * PER_NODE + local
            lines += ["Timeout (0:10:00)!", f"Thread 0x00007f577dff06{r:02d} (most recent call first):",
                      '  File "/usr/lib/python3.10/multiprocessing/queues.py", line 113 in get',
                      f'  File "{site}/torch/utils/data/_utils/pin_memory.py", line 31 in do_one_step',
                      '  File "/usr/lib/python3.10/threading.py", line 953 in run',
                      '  File "/usr/lib/python3.10/threading.py", line 1016 in _bootstrap_inner', "",
                      f"Thread 0x00007f577e0007{r:02d} (most recent call first):"]
            if r == 5:
                lines += ['  File "/usr/lib/python3.10/threading.py", line 324 in wait',
                          f'  File "{site}/torch/utils/data/dataloader.py", line 1133 in _try_get_data']
            else:
                lines += [f'  File "{site}/torch/distributed/distributed_c10d.py", line 2501 in all_reduce']
            lines += ['  File "/workspace/pretrain_gpt.py", line 240 in <module>', ""]
    report = diagnose_lines(engine, lines, exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["gpu-node-02"], [])
    assert "_try_get_data" in report.root_cause.text


def test_a_header_naming_no_host_of_the_job_gives_no_host(engine: Engine) -> None:
    """A collection gathered on other machines' names (a login node's copy, a renamed file): never a culprit.
    (A guard: before collections were read, no header was taken as a host either.)"""
    lines = training()
    for i, name in enumerate(("login-01", "login-02")):
        lines += [f"==> /scratch/hang-dumps/{name}.txt <=="] + node_dumps(i, hung=6 if i else None)
    report = diagnose_lines(engine, lines, exit_code=None)
    assert report.failure_type == "framework_hang"
    assert report.culprits.hosts == [] and report.culprits.ranks == []


def test_grouped_dumps_under_a_notes_node_number(engine: Engine) -> None:
    """A hand-written note of the dumps (py-spy's stacks grouped, "4 in:", the node by its number): the node
    numbered 49 is the one host of the job whose name ends in 49."""
    hosts = ("jean-zay-iam48", "jean-zay-iam49")
    lines = []
    for r in range(8):
        h, local, pid = hosts[r // 4], r % 4, 688510 + r % 4
        lines.append(f"{h}:{pid}:{pid + 9} [{local}] NCCL INFO comm 0x7f3a40 rank {r} nranks 8 cudaDev {local} "
                     f"busId {BUS[local]} commId 0x51c2 - Init COMPLETE")
    lines += [f"{hosts[0]}: [rank0]:  iteration {it:8d}/  95367 | lm loss: {2.3 - it * 1e-4:.6E} |" for it in range(1, 20)]
    lines += ["", "Node 48:", "", "4 in:", "", "```"]
    lines += [f'Thread {688510 + i} (active): "MainThread"' for i in range(4)] + COLLECTIVE + ["```", ""]
    lines += ["Node 49", "", "3 in:", "```"]
    lines += [f'Thread {688510 + i} (active): "MainThread"' for i in (0, 1, 3)] + COLLECTIVE + ["```", "", "1 in:", "```"]
    lines += ['Thread 688512 (idle): "MainThread"'] + DATALOADER + ["```"]
    report = diagnose_lines(engine, lines, exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("framework_hang", ["jean-zay-iam49"], [6])


# -- a process in uninterruptible sleep, in `ps` printed into the hung job's log ---------------------------

def watchdogs(silent: set[int]) -> list[str]:
    return [f"{HOSTS[r // PER_NODE]}: [rank{r}]:[E1203 04:12:09.481516 {PIDS[r]} ProcessGroupNCCL.cpp:632] [Rank {r}] "
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88213, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
            for r in range(PER_NODE * len(HOSTS)) if r not in silent]


def ps_aux(host: str, stuck_local: int | None) -> list[str]:
    """`pdsh -w <node> 'ps aux | grep [p]ython'`: the header went with grep; a kernel thread in D state is noise."""
    rows = [f"{host}: root      1187  0.0  0.0      0     0 ?        D    Dec02   0:41 [jbd2/nvme0n1p1-8]"]
    for local in range(PER_NODE):
        pid, d = PIDS[local], local == stuck_local
        rows.append(f"{host}: alice    {pid} {'0.0' if d else '99.7'}  2.1 52345672 2834560 ?      {'Dl' if d else 'Rl'}   "
                    f"03:01 512:33 /usr/bin/python3 -u pretrain_gpt.py --tensor-model-parallel-size 4")
    return rows


def test_the_silent_ranks_process_stuck_in_the_kernel_corroborates_its_node(engine: Engine) -> None:
    """Rank 6 never reported the timeout the others did; ps on its node shows its process in D state."""
    lines = training() + watchdogs({6}) + ps_aux(HOSTS[0], None) + ps_aux(HOSTS[1], 2)
    report = diagnose_lines(engine, lines, exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("hang", ["gpu-node-02"], [6])
    assert report.culprits.corroborated and report.action == "cordon_and_restart"
    assert "uninterruptible sleep" in report.culprits.basis
    assert any(e.source == "detect:process_state" and f" {PIDS[6]} " in e.text for e in report.evidence)


def test_a_listing_of_a_node_names_the_process_no_dump_shows(engine: Engine) -> None:
    """Every dumped process waits in the collective; `ps -eo` on the other node, under its file's name, shows
    the one they wait for in D state inside NFS: its node and rank are named (one signal: no cordon)."""
    ps = ["==> ps-gpu-node-02.txt <==", "    PID STAT WCHAN                            COMMAND"]
    ps += [f" {PIDS[4 + local]} {'D ' if local == 2 else 'Rl'}   {'nfs_wait_bit_killable' if local == 2 else '-':32} "
           "/usr/bin/python3 -u pretrain_gpt.py --tensor-model-parallel-size 4" for local in range(PER_NODE)]
    lines = training() + ["==> trace-gpu-node-01.out <=="] + node_dumps(0, None) + ps
    report = diagnose_lines(engine, lines, exit_code=None)
    assert (report.failure_type, report.culprits.hosts, report.culprits.ranks) == ("hang", ["gpu-node-02"], [6])
    assert not report.culprits.corroborated and report.action == "restart"
    assert "nfs_wait_bit_killable" in report.explanation


def test_a_process_in_d_state_in_a_running_job_is_no_fault(engine: Engine) -> None:
    """A snapshot of a job that trains on: a worker reading its shard from disk is in D state for a moment."""
    lines = training() + ps_aux(HOSTS[1], 1) + training()[-5:]
    report = diagnose_lines(engine, lines, exit_code=0)
    assert report.status == "healthy"
    assert not report.culprits.hosts


# -- a rank in another collective than the others ----------------------------------------------------------

BARRIER = ["    barrier (torch/distributed/distributed_c10d.py:3439)",
           "    wrapper (torch/distributed/c10d_logger.py:75)",
           "    maybe_save (pretrain_gpt.py:201)",
           "    train (megatron/training/training.py:1251)",
           "    <module> (pretrain_gpt.py:240)"]


def test_the_rank_in_another_collective_is_the_desyncs_culprit(engine: Engine) -> None:
    """Seven ranks reduce gradients, one waits in a barrier the script's own code called (a save only it decided
    to do): the code that called it is the root frame, and that rank is the one the others wait for."""
    lines = training()
    for i, h in enumerate(HOSTS):
        lines += [f"==> trace-{h}.out <=="] + node_dumps(i, hung=None)
    odd = PIDS[3]
    at = lines.index(f'Thread {odd} (active): "MainThread"')
    lines[at + 1: at + 1 + len(COLLECTIVE)] = BARRIER
    report = diagnose_lines(engine, lines, exit_code=None)
    assert (report.category, report.failure_type) == ("script", "script_hang")
    assert (report.culprits.hosts, report.culprits.ranks) == (["gpu-node-01"], [3])
    assert "maybe_save (pretrain_gpt.py:201)" in report.root_cause.text
    assert "barrier" in report.explanation and "all_reduce" in report.explanation


def test_pipeline_stages_in_different_collectives_are_no_desync(engine: Engine) -> None:
    """Half the ranks receive activations, half reduce: stages by design, no few to blame (the job hangs in a
    collective for a process no dump shows)."""
    recv = ["    recv (torch/distributed/distributed_c10d.py:1002)", "    recv (deepspeed/runtime/pipe/p2p.py:83)",
            "    _exec_recv_activations (deepspeed/runtime/pipe/engine.py:1073)", "    <module> (pretrain_gpt.py:249)"]
    lines = training()
    for i, h in enumerate(HOSTS):
        block = node_dumps(i, hung=None)
        if i == 1:
            for pid in (PIDS[4 + local] for local in range(PER_NODE)):
                at = block.index(f'Thread {pid} (active): "MainThread"')
                block[at + 1: at + 1 + len(COLLECTIVE)] = recv
        lines += [f"==> trace-{h}.out <=="] + block
    report = diagnose_lines(engine, lines, exit_code=None)
    assert report.failure_type == "hang" and report.culprits.ranks == []


# -- an operator's session on the hung job's nodes ------------------------------------------------------------

def debugging_session(stuck_host: str, *, tool_fails: bool = True) -> list[str]:
    """The hung job's own prints (pids only), srun naming the nodes of the job it ran the dumps on (its tasks are
    not the job's ranks: one per node), one dump pasted, then the operator logs into a node and tries again: py-spy
    cannot attach, `ps` shows one worker in D state while its peers run."""
    pid0 = 41200
    out = [f"PID {pid0 + r % PER_NODE}:  {'Before' if r % 3 else 'After'} sync_gradients in _do_batch"
           for r in range(2 * PER_NODE)]
    out += ["srun --overlap --jobid=88123 --nodes=2 --tasks-per-node=1 --output=trace-%N.out bash -c 'py-spy dump --pid $(pgrep -o python)'",
            "srun: launch/slurm: _step_signal: Terminating StepId=88123.4"]
    out += [f"srun: error: {h}: task {i}: Terminated" for i, h in enumerate(HOSTS)]
    out += ["srun: Force Terminated StepId=88123.4", f'Thread {pid0 + 1} (active): "MainThread"',
            "    barrier (torch/distributed/distributed_c10d.py:2784)",
            "    wait_for_everyone (accelerate/utils/other.py:81)", f"ssh {stuck_host}",
            f"py-spy dump --pid {pid0}"]
    if tool_fails:
        out += ["Error: Failed to suspend process", "Reason: EPERM: Operation not permitted"]
    out += ["ps auxc | grep python", "USER         PID %CPU %MEM    VSZ   RSS TTY      STAT START   TIME COMMAND"]
    out += [f"trainer   {pid0 + local}  88.{local}  4.4 17508566232 23526964 ? {'Dl' if local == 0 else 'Rl'}  00:36 "
            f"217:5{local} python" for local in range(PER_NODE)]
    return out


@pytest.mark.parametrize("stuck_host", HOSTS)
def test_the_node_an_operator_logged_into_names_its_stuck_process(engine: Engine, stuck_host: str) -> None:
    """`ssh NODE` heads the output of the commands run on that node: the process `ps` shows in D state there,
    while the job hangs in a collective, names that node (srun named it as one of the job's); py-spy failing to
    attach is the tool's complaint, not the job's error."""
    report = diagnose_lines(engine, debugging_session(stuck_host), exit_code=None)
    assert (report.status, report.failure_type, report.culprits.hosts) == ("failed", "hang", [stuck_host])
    assert "Failed to suspend" not in report.root_cause.text
    assert report.action == "restart"  # one signal (a ps snapshot): the node is named, not cordoned


def test_an_ssh_to_a_node_the_job_never_ran_on_names_no_host(engine: Engine) -> None:
    report = diagnose_lines(engine, debugging_session("login-node-7"), exit_code=None)
    assert report.failure_type == "hang" and report.culprits.hosts == []
