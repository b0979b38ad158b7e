"""Why a collective timed out (issue 31, items 1-2): the report's `timeout` section and the action it implies.

Jobs are generated from the strings torch and NCCL print (ProcessGroupNCCL's watchdog, its desync report,
ProcessGroupWrapper's "Detected mismatch between collectives", NCCL's net_ib WARNs, mlx5's link lines),
8 to 64 ranks on 8-GPU hosts, with start-up noise (torchrun's banner, NCCL INFO, warnings) and per-rank
progress lines, then one cause per class:

- cpu_side: one rank goes on doing its own work (an evaluation on that rank only, a retry loop around a
  caught error, a recompilation) while the others wait in the next collective until their watchdogs fire;
- misconfig: at the same sequence number the ranks run different collectives or the same with different
  sizes, or TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper reports the mismatch;
- gpu_hang: one rank's work was enqueued and never completed while the others completed it (its own
  watchdog on the lower SeqNum, the desync report's "joined but didn't finish");
- network: an InfiniBand completion error, port error or link down on one host before the timeouts;
- unknown: every rank times out on the same collective and nothing else is said.

What must hold: the class, and that cpu_side and misconfig never restart or cordon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

import pytest

from logdx.pipeline import Engine

GPUS_PER_HOST = 8
TIMEOUT_MS = 600_000
_OPS = (("ALLREDUCE", 1.0), ("_REDUCE_SCATTER_BASE", 1 / 8), ("_ALLGATHER_BASE", 8.0), ("BROADCAST", 1.0))


def host(r: int) -> str:
    return f"gpu-{r // GPUS_PER_HOST + 1:03d}"


@dataclass
class Job:
    ranks: int
    culprit: int | None
    expected: str
    lines: list[str] = field(default_factory=list)
    clock: float = 14 * 3600.0  # seconds since midnight

    def tick(self, s: float) -> None:
        self.clock += s

    def hms(self) -> str:
        c = int(self.clock)
        return f"{c // 3600 % 24:02d}:{c // 60 % 60:02d}:{c % 60:02d}"

    def glog(self, level: str, where: str) -> str:
        """torch's c10 log prefix: `[E1202 14:35:12.123456 ProcessGroupNCCL.cpp:632]`."""
        return f"[{level}1202 {self.hms()}.{int(self.clock * 1e6) % 1_000_000:06d} {where}]"

    def rank_line(self, r: int, text: str) -> None:
        self.lines.append(f"{host(r)}: [rank{r}]:{text}")

    def agent_line(self, h: str, text: str) -> None:
        self.lines.append(f"{h}: {text}")


def start_up(job: Job, rng: Random) -> None:
    hosts = sorted({host(r) for r in range(job.ranks)})
    for h in hosts:
        job.agent_line(h, "W1202 14:00:01.412000 2811 torch/distributed/run.py:793] ")
        job.agent_line(h, "W1202 14:00:01.412000 2811 torch/distributed/run.py:793] *****************************************")
        job.agent_line(h, "W1202 14:00:01.412000 2811 torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment "
                          "variable for each process to be 1 in default, to avoid your system being overloaded, please "
                          "further tune the variable for optimal performance in your application as needed.")
    for r in range(job.ranks):
        h, pid, d = host(r), 7000 + r, r % GPUS_PER_HOST
        ip = f"10.1.{r // GPUS_PER_HOST}.{11 + r // GPUS_PER_HOST}"
        job.rank_line(r, f"{h}:{pid}:{pid} [{d}] NCCL INFO Bootstrap : Using ib0:{ip}<0>")
        job.rank_line(r, f"{h}:{pid}:{pid} [{d}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:{ip}<0>")
        job.rank_line(r, f"{h}:{pid}:{pid} [{d}] NCCL INFO comm 0x7f{r:04x}c0 rank {r} nranks {job.ranks} cudaDev {d} "
                         f"busId {d + 1:x}a000 commId 0x5c1e2f8a9b7d3e10 - Init COMPLETE")
    for r in rng.sample(range(job.ranks), k=min(4, job.ranks)):
        job.rank_line(r, "/opt/conda/lib/python3.10/site-packages/torch/utils/checkpoint.py:91: UserWarning: None of "
                         "the inputs have requires_grad=True. Gradients will be None")
    job.rank_line(0, "wandb: Tracking run with wandb version 0.16.6")


def progress(job: Job, rng: Random, first: int, last: int, every: int = 10, skip: frozenset[int] = frozenset()) -> None:
    """Every rank prints its own step line every `every` steps (1.4 s a step)."""
    for step in range(first, last + 1, every):
        job.tick(every * 1.4)
        for r in range(job.ranks):
            if r in skip:
                continue
            loss = 2.6 - step / 20000 + rng.random() * 0.02
            job.rank_line(r, f" [2026-12-02 {job.hms()}] step {step} | loss {loss:.4f} | lr 3.00e-04 | "
                             f"grad_norm {0.8 + rng.random() * 0.2:.3f} | {1400 + rng.random() * 20:.1f} ms/step")


def watchdog(job: Job, r: int, seq: int, op: str, numel_in: int, numel_out: int, *, newer: bool,
             completed: int | None = None) -> None:
    """One rank's watchdog giving up, as ProcessGroupNCCL prints it (torch 2.1 style, or 2.4+ with PG ids)."""
    job.tick(0.05)
    done = seq - 1 if completed is None else completed
    who = f"[PG ID 0 PG GUID 0(default_pg) Rank {r}]" if newer else f"[Rank {r}]"
    work = (f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel_in}, NumelOut={numel_out}, "
            f"Timeout(ms)={TIMEOUT_MS}) ran for {TIMEOUT_MS + 13 + r} milliseconds before timing out.")
    job.rank_line(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:632')} {who} Watchdog caught collective operation timeout: {work}")
    if newer:
        job.rank_line(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:1664')} {who} Exception (either an error or timeout) "
                         f"detected by watchdog at work: {seq}, last enqueued NCCL work: {seq}, last completed NCCL "
                         f"work: {done}.")
        job.rank_line(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:1730')} {who} Timeout at NCCL work: {seq}, last "
                         f"enqueued NCCL work: {seq}, last completed NCCL work: {done}.")
    job.rank_line(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:577')} {who} Some NCCL operations have failed or timed out. "
                     "Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
                     "corrupted/incomplete data.")
    job.rank_line(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:583')} {who} To avoid data inconsistency, we are taking "
                     "the entire process down.")
    job.rank_line(r, f"{job.glog('F', 'ProcessGroupNCCL.cpp:1529')} {who} Process group watchdog thread terminated "
                     f"with exception: [Rank {r}] Watchdog caught collective operation timeout: {work}")


def teardown(job: Job, dead: list[int]) -> None:
    """torchrun's agents take the job down: SIGTERM to the rest, the failure of the first."""
    job.tick(2)
    for h in sorted({host(r) for r in range(job.ranks)}):
        for r in [r for r in range(job.ranks) if host(r) == h and r not in dead][:2]:
            job.agent_line(h, f"W1202 {job.hms()}.120000 2811 torch/distributed/elastic/multiprocessing/api.py:897] "
                              f"Sending process {7000 + r} closing signal SIGTERM")
    first = dead[0] if dead else 0
    job.agent_line(host(first), f"E1202 {job.hms()}.551000 2811 torch/distributed/elastic/multiprocessing/api.py:869] "
                                f"failed (exitcode: -6) local_rank: {first % GPUS_PER_HOST} (pid: {7000 + first}) of "
                                "binary: /usr/bin/python3")


def _shape(rng: Random, ranks: int) -> tuple[int, str, int, int, int]:
    """(step, op, numel_in, numel_out, seq) of the collective the job stops in."""
    step = rng.randrange(200, 900) * 10
    op, ratio = rng.choice(_OPS)
    numel_in = rng.choice((16777216, 4194304, 26214400, 1048576))
    numel_out = int(numel_in * (ranks if ratio > 1 else 1 / ranks if ratio < 1 else 1))
    return step, op, numel_in, numel_out, step * 3 + rng.randrange(1, 3)


def _job(seed: int, expected: str, culprit: bool = True) -> tuple[Job, Random]:
    rng = Random(f"{expected}-{seed}")
    ranks = rng.choice((8, 16, 32, 64))
    job = Job(ranks=ranks, culprit=rng.randrange(ranks) if culprit else None, expected=expected)
    start_up(job, rng)
    return job, rng


# -- cpu_side -------------------------------------------------------------------------------------

_CPU_SIDE_WORK = (
    # an evaluation only that rank runs (tqdm's bar, then the metric lines)
    lambda i: f"Evaluating:  {min(99, 4 * i):2d}%|{'█' * (i % 10):10s}| {12 * i}/250 [00:{i:02d}<04:10,  1.21it/s]",
    # a retry loop around an error it caught on its own batch
    lambda i: f"INFO:train: shard 17 batch {i}: re-reading 512 samples with a smaller micro-batch (attempt {i % 4 + 1} of 4)",
    # torch.compile recompiling for a new shape on that rank only (TORCH_LOGS=recompiles: three lines each)
    lambda i: f"V1202 14:{10 + i // 3:02d}:{i % 60:02d}.{i:06d} 7011 torch/_dynamo/guards.py:2169] [0/{i % 8 + 1}] "
              "[__recompiles] Recompiling function forward in /workspace/model.py:211\n"
              f"V1202 14:{10 + i // 3:02d}:{i % 60:02d}.{i:06d} 7011 torch/_dynamo/guards.py:2169] [0/{i % 8 + 1}] "
              "[__recompiles]     triggered by the following guard failure(s):\n"
              f"V1202 14:{10 + i // 3:02d}:{i % 60:02d}.{i:06d} 7011 torch/_dynamo/guards.py:2169] [0/{i % 8 + 1}] "
              f"[__recompiles]     - 0/{i % 8}: tensor 'L['x']' size mismatch at index 1. expected 512, actual {512 + 64 * i}",
)


def cpu_side(seed: int) -> Job:
    job, rng = _job(seed, "cpu_side")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    newer = rng.random() < 0.5
    progress(job, rng, step - 300, step)
    work = _CPU_SIDE_WORK[seed % len(_CPU_SIDE_WORK)]
    # The others wait in the next collective; the culprit goes on with its own work, for longer than the timeout.
    for i in range(1, 40):
        job.tick(20)
        for text in work(i).split("\n"):
            job.rank_line(c, f" {text}")
        if i == 31:
            for r in range(job.ranks):
                if r != c:
                    watchdog(job, r, seq, op, n_in, n_out, newer=newer)
            if seed % 2:  # TORCH_NCCL_DESYNC_DEBUG=1: the first rank to time out asks the store who is missing
                first = 0 if c else 1
                job.rank_line(first, f" - [{first}] Timeout at collective: {op}, #{seq}")
                job.rank_line(first, " - To our best knowledge, the lagging/dead/mismatched ranks that caused the "
                                     "desync are:")
                job.rank_line(first, f"     [{c}] finished collective #{seq - 1}, but didn't join collective #{seq} "
                                     "(count from 1)")
    teardown(job, [r for r in range(job.ranks) if r != c])
    return job


# -- misconfig ------------------------------------------------------------------------------------


def misconfig_sizes(seed: int) -> Job:
    """One rank calls the collective with another size or another op at the same SeqNum (an uneven shard, a
    branch that all-gathers where the others reduce-scatter): every rank waits, every watchdog fires."""
    job, rng = _job(seed, "misconfig")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    newer = rng.random() < 0.5
    progress(job, rng, step - 300, step)
    job.tick(TIMEOUT_MS / 1000)
    for r in rng.sample(range(job.ranks), job.ranks):
        if r != c:
            watchdog(job, r, seq, op, n_in, n_out, newer=newer)
        elif seed % 2:
            watchdog(job, r, seq, op, n_in - 4096 * (1 + seed % 5), n_out - 4096 * (1 + seed % 5), newer=newer)
        else:
            other = "_ALLGATHER_BASE" if op != "_ALLGATHER_BASE" else "_REDUCE_SCATTER_BASE"
            watchdog(job, r, seq, other, n_in, n_out, newer=newer)
    teardown(job, list(range(job.ranks)))
    return job


def misconfig_wrapper(seed: int) -> Job:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: ProcessGroupWrapper checks each collective's fingerprint first and
    raises on the ranks whose fingerprint differs; the others then time out."""
    job, rng = _job(seed, "misconfig")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    progress(job, rng, step - 300, step)
    job.tick(30)
    other = (c + 1) % job.ranks
    shape_c, shape_o = f"[{n_in // 1024}, 1024]", f"[{n_in // 1024 - 8}, 1024]"
    for r in (c, other):
        job.rank_line(r, "Traceback (most recent call last):")
        job.rank_line(r, '  File "/workspace/train.py", line 412, in <module>')
        job.rank_line(r, "    main()")
        job.rank_line(r, '  File "/workspace/train.py", line 388, in train_step')
        job.rank_line(r, "    dist.all_reduce(grads, group=dp_group)")
        job.rank_line(r, '  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", '
                         "line 2501, in all_reduce")
        job.rank_line(r, "    work = group.allreduce([tensor], opts)")
        job.rank_line(r, f"RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running "
                         f"collective: CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape="
                         f"{shape_c if r == c else shape_o}, TensorDtypes=Float, TensorDeviceTypes=TensorOptions("
                         "dtype=float (default), device=cuda, layout=strided (default), requires_grad=false (default), "
                         f"pinned_memory=false (default), memory_format=(nullopt))), but Rank {other if r == c else c} is "
                         f"running collective: CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape="
                         f"{shape_o if r == c else shape_c}, TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype="
                         "float (default), device=cuda, layout=strided (default), requires_grad=false (default), "
                         "pinned_memory=false (default), memory_format=(nullopt))).Collectives differ in the following "
                         f"aspects: \t Tensor Tensor shapes: {shape_c}vs {shape_o}")
    if seed % 2:
        job.tick(TIMEOUT_MS / 1000)
        for r in range(job.ranks):
            if r not in (c, other):
                watchdog(job, r, seq + 1, "ALLREDUCE", 1, 1, newer=True)
    teardown(job, [c, other])
    return job


# -- gpu_hang -------------------------------------------------------------------------------------


def gpu_hang(seed: int) -> Job:
    """The culprit's GPU never completes a collective the others completed: its own watchdog times out on it
    (enqueued, never completed), the others on the next one; the desync report (when enabled) says so."""
    job, rng = _job(seed, "gpu_hang")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    progress(job, rng, step - 300, step)
    job.tick(TIMEOUT_MS / 1000 - 3)
    watchdog(job, c, seq, op, n_in, n_out, newer=True)
    if seed % 2 == 0:  # TORCH_NCCL_DESYNC_DEBUG=1
        job.rank_line(c, f" - [{c}] Timeout at collective: {op}, #{seq}")
        job.rank_line(c, " - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:")
        job.rank_line(c, f"   - [{c}] joined but didn't finish collective #{seq} (count from 1)")
    job.tick(3)
    for r in range(job.ranks):
        if r != c:
            watchdog(job, r, seq + 1, op, n_in, n_out, newer=True)
    teardown(job, [c])
    return job


# -- network --------------------------------------------------------------------------------------


def network(seed: int) -> Job:
    """A link of the culprit's host fails in the middle of a collective: NCCL's IB transport, or the kernel,
    says so on that host; every rank then times out on the same SeqNum."""
    job, rng = _job(seed, "network")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    progress(job, rng, step - 300, step)
    job.tick(40)
    h, pid, d = host(c), 7000 + c, c % GPUS_PER_HOST
    peer = f"10.1.{(c // GPUS_PER_HOST + 1) % 8}.{12 + c // GPUS_PER_HOST}"
    kind = seed % 3
    if kind == 0:
        job.rank_line(c, f"{h}:{pid}:{pid + 61} [{d}] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from "
                         f"peer {peer}<43210> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid "
                         f"::ffff:10.1.0.11 remoteGids::ffff:{peer} hca mlx5_{d % 2}")
        job.rank_line(c, f"{h}:{pid}:{pid + 61} [{d}] NCCL INFO transport/net.cc:1134 -> 6")
    elif kind == 1:
        job.rank_line(c, f"{h}:{pid}:{pid + 59} [{d}] transport/net_ib.cc:101 NCCL WARN NET/IB : mlx5_{d % 2}:1 Got "
                         "async event : port error")
    else:
        job.agent_line(h, f"Dec  2 {job.hms()} {h} kernel: [812345.123456] mlx5_core 0000:5e:00.0 ib{d % 2}: Link down")
    job.tick(TIMEOUT_MS / 1000)
    for r in range(job.ranks):
        watchdog(job, r, seq, op, n_in, n_out, newer=seed % 2 == 0)
    teardown(job, [c])
    return job


# -- unknown --------------------------------------------------------------------------------------


def unknown(seed: int) -> Job:
    """Every rank times out on the same collective and nothing else tells why."""
    job, rng = _job(seed, "unknown", culprit=False)
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    progress(job, rng, step - 300, step)
    job.tick(TIMEOUT_MS / 1000)
    for r in rng.sample(range(job.ranks), job.ranks):
        watchdog(job, r, seq, op, n_in, n_out, newer=seed % 2 == 1)
    teardown(job, list(range(job.ranks)))
    return job


def stopped_first(seed: int) -> Job:
    """Not cpu_side: the rank behind stopped printing before the others did (stuck on its GPU, or dead without a
    word); nothing tells which, so the class is unknown and the hang's verdict stands."""
    job, rng = _job(seed, "unknown")
    c = job.culprit
    assert c is not None
    step, op, n_in, n_out, seq = _shape(rng, job.ranks)
    progress(job, rng, step - 300, step - 20)
    progress(job, rng, step - 10, step, skip=frozenset({c}))
    job.tick(TIMEOUT_MS / 1000)
    for r in range(job.ranks):
        if r != c:
            watchdog(job, r, seq, op, n_in, n_out, newer=seed % 2 == 0)
    teardown(job, [r for r in range(job.ranks) if r != c])
    return job


SCENARIOS: dict[str, Callable[[int], Job]] = {
    "cpu_side": cpu_side, "misconfig_sizes": misconfig_sizes, "misconfig_wrapper": misconfig_wrapper,
    "gpu_hang": gpu_hang, "network": network, "unknown": unknown, "stopped_first": stopped_first,
}
SEEDS = range(6)


def diagnose(engine: Engine, lines: list[str]):
    session = engine.new_session()
    session.feed_lines(lines)
    return session.report()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_timeout_class_is_read_from_the_log(engine: Engine, name: str) -> None:
    for seed in SEEDS:
        job = SCENARIOS[name](seed)
        report = diagnose(engine, job.lines)
        assert report.timeout is not None, (name, seed)
        assert report.timeout.cause == job.expected, (name, seed, report.timeout)
        assert report.timeout.evidence, (name, seed)
        if job.expected in ("cpu_side", "misconfig", "gpu_hang"):
            assert job.culprit in report.timeout.culprit_ranks, (name, seed, report.timeout)
        elif job.expected == "network":  # a kernel line names its host, not a rank
            assert host(job.culprit or 0) in report.timeout.culprit_hosts, (name, seed, report.timeout)


@pytest.mark.parametrize("name", ["cpu_side", "misconfig_sizes", "misconfig_wrapper"])
def test_code_or_config_is_never_restarted_nor_cordoned(engine: Engine, name: str) -> None:
    for seed in SEEDS:
        report = diagnose(engine, SCENARIOS[name](seed).lines)
        assert report.action == "no_restart", (name, seed, report.action, report.failure_type)
        assert report.category in ("script", "framework"), (name, seed, report.category)


def test_the_hint_says_what_the_culprit_did_while_the_others_waited(engine: Engine) -> None:
    job = cpu_side(0)
    report = diagnose(engine, job.lines)
    assert f"rank {job.culprit} " in report.hint and "SeqNum" in report.hint, report.hint
    assert "still printing" in report.hint, report.hint


def test_a_gpu_hang_restarts_and_cordons_only_on_the_existing_evidence(engine: Engine) -> None:
    for seed in SEEDS:
        report = diagnose(engine, gpu_hang(seed).lines)
        assert report.action in ("restart", "cordon_and_restart"), (seed, report.action)
        if report.action == "cordon_and_restart":
            assert report.culprits.corroborated and len(report.culprits.hosts) == 1


def test_a_network_timeout_keeps_the_network_verdict(engine: Engine) -> None:
    for seed in SEEDS:
        job = network(seed)
        report = diagnose(engine, job.lines)
        assert (report.category, report.failure_type) == ("infrastructure", "network_error"), (seed, report)
        assert report.action in ("restart", "cordon_and_restart")
        assert report.timeout is not None and host(job.culprit or 0) in report.timeout.culprit_hosts


def test_a_rank_that_stopped_first_keeps_the_hang_verdict(engine: Engine) -> None:
    for seed in SEEDS:
        job = stopped_first(seed)
        report = diagnose(engine, job.lines)
        assert (report.category, report.failure_type) == ("infrastructure", "hang"), (seed, report.failure_type)
        assert report.culprits.ranks == [job.culprit], seed


def test_unknown_says_what_is_missing(engine: Engine) -> None:
    report = diagnose(engine, unknown(1).lines)
    assert report.timeout is not None and report.timeout.cause == "unknown"
    assert any("TORCH_NCCL" in m or "flight recorder" in m for m in report.timeout.missing), report.timeout.missing


def test_a_job_without_collective_timeouts_has_no_timeout_section(engine: Engine) -> None:
    job, rng = _job(0, "none")
    progress(job, rng, 10, 400)
    job.rank_line(0, "Traceback (most recent call last):")
    job.rank_line(0, '  File "/workspace/train.py", line 88, in <module>')
    job.rank_line(0, "KeyError: 'input_ids'")
    assert diagnose(engine, job.lines).timeout is None
