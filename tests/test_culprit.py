"""Blame only what the log shows: who the culprit is, on what grounds, and when that is enough to
recommend cordoning a node (logdx/diagnose/culprit.py)."""

from __future__ import annotations

import pytest

from logdx.pipeline import Engine
from logdx.testing import diagnose_lines

HOSTS = ("gpu-node-01", "gpu-node-02")
PIDS = {r: 14400 + r for r in range(8)}  # each rank's process
BUS = ("1b000", "3b000", "5d000", "8a000")


def diagnose(engine: Engine, lines: list[str], exit_code: int | None = 1):
    return diagnose_lines(engine, lines, exit_code)


def job(failure: list[str], *, hosts: tuple[str, ...] = HOSTS, victims_abort: bool = True,
        dead: tuple[int, ...] = ()) -> list[str]:
    """A 2-node x 4-GPU torchrun job as pdsh/srun tee it: NCCL init naming host, pid and bus id of
    every rank, training progress, then the failure lines, then the cascade on the other ranks."""
    per = 4
    ranks = range(per * len(hosts))
    out = []
    for r in ranks:
        h, local = hosts[r // per], r % per
        out.append(f"{h}:{PIDS[r]}:{PIDS[r]} [{local}] NCCL INFO Bootstrap : Using eth0:10.0.0.{10 + r // per}<0>")
        out.append(f"{h}:{PIDS[r]}:{PIDS[r] + 7} [{local}] NCCL INFO comm 0x55d0a8c0 rank {r} nranks {len(ranks)} "
                   f"cudaDev {local} busId {BUS[local]} commId 0x9f3c - Init COMPLETE")
    for it in range(1, 40):
        for r in ranks:
            out.append(f"[rank{r}]:2025-06-03 09:{it // 60:02d}:{it % 60:02d},000 - INFO - iteration {it:>6}/ 10000 | "
                       f"lm loss: {7 - it * 0.01:.4f} | grad norm: 1.{r} | tokens/s: 51234")
        if it % 10 == 0:
            out.append("[rank0]:2025-06-03 09:00:30,000 - WARNING - torch/nn/parallel/distributed.py: grad strides do not match bucket view strides")
    out.extend(failure)
    for r in (r for r in ranks if r not in dead):  # a dead rank times out on nothing
        out.append(f"[rank{r}]:[E603 10:30:05.647482156 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
                   "operation timeout: WorkNCCL(SeqNum=7097, OpType=ALLREDUCE, NumelIn=33554432, NumelOut=33554432, "
                   "Timeout(ms)=1800000) ran for 1800063 milliseconds before timing out.")
    if victims_abort:
        for r in ranks:
            h, local = hosts[r // per], r % per
            out.append(f"{h}: E0603 10:30:09.123000 1900 torch/distributed/elastic/multiprocessing/api.py:869] failed "
                       f"(exitcode: -6) local_rank: {local} (pid: {PIDS[r]}) of binary: /usr/bin/python3")
    return out


XID_NO_HOST = "[Tue Jun  3 10:00:05 2025] NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=pt_main_thread, GPU has fallen off the bus."


def test_a_hostless_xid_in_a_multi_node_job_blames_no_node(engine):
    # The kernel line says neither host nor a pid of ours: every node has a GPU at 0000:3b:00, and the
    # launcher lines nearby only name victims that aborted.
    report = diagnose(engine, job([XID_NO_HOST.format(pid=99999)]))
    assert (report.category, report.failure_type) == ("infrastructure", "gpu_fell_off_bus")
    assert report.action == "restart"
    assert report.culprits.hosts == []
    assert any("restart, not cordon" in n for n in report.notes)


def test_the_same_pid_links_a_hostless_xid_to_one_node(engine):
    report = diagnose(engine, job([XID_NO_HOST.format(pid=PIDS[5])]))
    assert report.action == "cordon_and_restart"
    assert report.culprits.hosts == ["gpu-node-02"] and report.culprits.ranks == [5]
    assert "pid" in report.culprits.basis


def test_an_xid_printed_by_its_host_is_blamed_and_corroborated(engine):
    xid = ("Jun  3 10:00:05 gpu-node-02 kernel: [ 8812.123456] NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, "
           "name=python, GPU has fallen off the bus.")
    report = diagnose(engine, job([xid]))
    assert report.action == "cordon_and_restart"
    assert report.culprits.hosts == ["gpu-node-02"]
    assert report.culprits.ranks == [5]  # the rank on that host's GPU 3b:00, from NCCL's init lines
    assert report.culprits.corroborated


def test_another_nodes_line_inside_a_torchrun_failure_box_is_not_that_boxs_rank(engine):
    # Two nodes' streams interleave (a service fed by one shipper per node): gpu-node-02's kernel Xid
    # arrives while gpu-node-01's torchrun prints rank 2's entry of its failure summary. The Xid is
    # gpu-node-02's, not rank 2's: one node to cordon, not two.
    box = [f"gpu-node-01: {text}" for text in (
        "=" * 60, "train.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
        "Root Cause (first observed failure):", "[0]:", "  time      : 2025-06-03_10:30:09",
        "  host      : gpu-node-01", "  rank      : 2 (local_rank: 2)", "  exitcode  : -6 (pid: 14402)",
        "  error_file: <N/A>", "  traceback : Signal 6 (SIGABRT) received by PID 14402", "=" * 60)]
    xid = "gpu-node-02: [Tue Jun  3 10:00:05 2025] NVRM: Xid (PCI:0000:3b:00): 79, pid=14405, name=pt_main_thread, " \
          "GPU has fallen off the bus."
    report = diagnose(engine, job(box[:12] + [xid] + box[12:]))
    assert (report.failure_type, report.action) == ("gpu_fell_off_bus", "cordon_and_restart")
    assert report.culprits.hosts == ["gpu-node-02"] and report.culprits.ranks == [5]
    assert "failure summary" not in report.culprits.basis


@pytest.mark.parametrize("quoted_host, blamed", [("gpu-node-02", ["gpu-node-02"]), ("login-node-7", [])])
def test_a_kernel_line_a_health_checker_quotes_names_its_host_if_it_is_the_jobs(engine, quoted_host, blamed):
    """A health checker forwards the host's kernel line inside its own message: the quoted syslog header's host
    is the culprit, when the job ran there; it is a name in text, so it corroborates nothing by itself."""
    alert = (f"[health-check] Xid errors on instance: {quoted_host}, Error: Jun  3 10:00:05 {quoted_host} kernel: "
             "[ 8812.123456] NVRM: Xid (PCI:0000:3b:00): 63, pid=1911, Row Remapper: New row marked for remapping, "
             "reset gpu to activate")
    report = diagnose(engine, job([alert], victims_abort=False))
    assert report.failure_type == "ecc_error"
    assert report.culprits.hosts == blamed
    if blamed:
        assert report.culprits.basis.startswith("the kernel line the root line quotes")
        assert blamed[0] in report.hint and "?" not in report.hint
    else:
        assert any("not one of the job's hosts" in n for n in report.notes)


@pytest.mark.parametrize("line", [
    "srun: error: Node failure on gpu[001-512]",
    "srun: error: Node failure on gpu-node-01,gpu-node-02",
    "srun: error: Node failure on ALL",
])
def test_a_node_range_or_list_in_log_text_is_never_a_culprit(engine, line):
    report = diagnose(engine, job([line]))
    assert report.culprits.hosts == []
    assert report.action != "cordon_and_restart"


def test_a_host_named_in_text_must_be_one_of_the_jobs_hosts(engine):
    report = diagnose(engine, job(["srun: error: Node failure on login-node-7"]))
    assert "login-node-7" not in report.culprits.hosts
    assert any("not one of the job's hosts" in n for n in report.notes)


def test_a_single_node_log_blames_its_machine_without_naming_it(engine):
    lines = [f"[rank{r}]: iteration {i} | loss 2.{i}" for i in range(5) for r in range(4)]
    lines += [
        "[rank2]: Traceback (most recent call last):",
        '[rank2]:   File "/work/train.py", line 88, in <module>',
        "[rank2]:     model.to(device)",
        "[rank2]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "[rank0]: [W603 10:30:05 ProcessGroupNCCL.cpp:1168] Warning: process group has NOT been destroyed",
    ]
    report = diagnose(engine, lines)
    assert (report.failure_type, report.action) == ("ecc_error", "cordon_and_restart")
    assert report.culprits.hosts == [] and report.culprits.ranks == [2]


ECC_RANK5 = ("[rank5]:[E603 10:00:05 ProcessGroupNCCL.cpp:1515] [PG 0 Rank 5] Process group watchdog thread "
             "terminated with exception: CUDA error: uncorrectable ECC error encountered")


def test_the_rank_that_died_while_the_others_timed_out_is_corroborated(engine):
    report = diagnose(engine, job([ECC_RANK5], dead=(5,)))
    assert (report.failure_type, report.action) == ("ecc_error", "cordon_and_restart")
    assert report.culprits.ranks == [5]
    assert report.culprits.hosts == ["gpu-node-02"]  # rank 5's own NCCL lines name its host
    assert report.culprits.corroborated


def test_a_name_nothing_else_points_at_is_not_corroborated(engine):
    # Rank 5 is named, but it timed out like every other rank and stopped when they did: nothing
    # beside the line itself says its machine is the bad one. The report may recommend the cordon;
    # no actuator may carry it out on this alone.
    report = diagnose(engine, job([ECC_RANK5]))
    assert report.culprits.ranks == [5]
    assert not report.culprits.corroborated


PBS_MAIL = [
    "PBS Job Id: 81234.pbs-server.cluster.local",
    "Job Name:   llama-ft",
    "Exec host:  {exec_host}",
    "Aborted by PBS Server",
    "job preempted (node failure)",
]


def test_a_job_its_scheduler_ran_on_one_node_links_a_hostless_failure_to_it(engine):
    """PBS's mail names the job's allocation: one node, so "node failure" is that node's, named but
    not corroborated (the name comes from text: the cluster policy still asks for a second signal)."""
    r = diagnose(engine, [line.format(exec_host="gpu-2-17/5") for line in PBS_MAIL])
    assert (r.category, r.failure_type) == ("infrastructure", "node_failure")
    assert r.culprits.hosts == ["gpu-2-17"] and "allocated" in r.culprits.basis
    assert r.action == "cordon_and_restart" and not r.culprits.corroborated


@pytest.mark.parametrize("exec_host", ["gpu-2-17/0*8+gpu-2-18/0*8", "gpu-2-[17-18]", "$(reboot)/0"])
def test_an_allocation_of_several_nodes_or_no_plain_name_links_nothing(engine, exec_host):
    r = diagnose(engine, [line.format(exec_host=exec_host) for line in PBS_MAIL])
    assert r.failure_type == "node_failure" and r.culprits.hosts == []


@pytest.mark.parametrize("spec, hosts", [
    ("gpu-2-17/5", ["gpu-2-17"]),
    ("n1/0*8+n1/1*8+n2/0*8", ["n1", "n2"]),  # qstat -f exec_host: slots of a host count once
    ("node[01-03,07],login1", ["node01", "node02", "node03", "node07", "login1"]),  # Slurm hostlist
    ("<8*hostA>, <8*hostB>, in queue <normal>, as user <alice>", ["hostA", "hostB"]),  # LSF job report
    ("gpu[01-02]-ib[1,3],login1", ["gpu01-ib1", "gpu01-ib3", "gpu02-ib1", "gpu02-ib3", "login1"]),  # every group
    ("gpu[1-x]", []),
    ("n[0-99999999]", []),  # more nodes than an allocation holds: not expanded
    ("a[0-4095],b[0-3]", []),
    ("$(reboot)", []),
])
def test_allocation_specs_of_each_scheduler(spec, hosts):
    from logdx.topology import allocation_hosts

    assert allocation_hosts(spec) == hosts


ORTE_BOX = [
    "--------------------------------------------------------------------------",
    "ORTE has lost communication with its daemon located on node:",
    "",
    "  hostname:  {host}",
    "",
    "This is usually due to either a failure of the TCP network",
    "connection to the node, or possibly an internal failure of",
    "the daemon itself. We cannot recover from this failure, and",
    "therefore will terminate the job.",
    "--------------------------------------------------------------------------",
]


def test_a_message_whose_host_is_in_its_next_lines_names_it(engine):
    """Open MPI's box puts the node on a field line of its own, after "located on node:"."""
    lines = [f"iteration {i} | loss 2.{i} | lr 1e-4" for i in range(20)]
    r = diagnose(engine, lines + [line.format(host="gpu-node-02") for line in ORTE_BOX])
    assert (r.category, r.failure_type) == ("infrastructure", "node_failure")
    assert r.culprits.hosts == ["gpu-node-02"] and "host field" in r.culprits.basis
    assert not r.culprits.corroborated  # a name from text: enough to say, not to cordon alone
    # a "hostname:" field that no such message introduced names nothing
    far = lines + ORTE_BOX[:3] + [lines[0]] * 3 + ["  hostname:  gpu-node-02"]  # 4 lines on, unkept ones between
    assert diagnose(engine, far).culprits.hosts == []


@pytest.mark.parametrize("line", [
    "srun: error: Node failure on gpu[001-512]",
    "srun: error: Node failure on gpu-node-01,gpu-node-02",
    "srun: error: Node failure on gpu-*",
])
def test_a_refused_host_token_is_no_culprit_not_even_the_printers_host(engine, line):
    """Issue 20 point 4: the line arrives on a stream that names its host (X-Logdx-Host, a record's
    host field): the range is refused, and the host that printed the line is not blamed instead."""
    from logdx.normalize import Source

    session = engine.new_session()
    session.feed_lines(job([]))
    session.feed_runs([(Source(host="gpu-node-01"), [line.encode()])])
    report = session.report(exit_code=1)
    assert report.culprits.hosts == [] and report.culprits.ranks == [], report.culprits
    assert report.action != "cordon_and_restart"
    assert any("range, list or pattern" in n for n in report.notes), report.notes
