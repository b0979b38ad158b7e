"""A slow node, from the log alone (logdx/diagnose/stragglers.py): a host whose ranks step ~30% slower than the
other hosts', or whose step time jumps up mid-run with a PCIe AER or thermal line from its kernel, is named with
its ranks; clean jobs with the jitter, checkpoint pauses and start-up noise of real runs name none; it is advice:
the verdict and its action are the same as for the same job without the slow host."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from api_server import Server
from logdx.act.render import render_text
from logdx.act.report import Report
from logdx.pipeline import Session
from logdx.testing import diagnose_lines
from logdx.web.render import Done, render_job_page
from logdx.web.view import build_view

T0 = 1_795_000_000.0  # 2026-11-18, a Wednesday morning


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _syslog(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%b %d %H:%M:%S")


@dataclass
class Job:
    """A Megatron-style job of `hosts` x `per_host` ranks as the cluster's collector ships it: every rank's
    start-up (NCCL INFO, warnings), then its own `iteration` line every `interval` steps with its own step time,
    a checkpoint save every 150 steps (every rank pauses), node kernel lines in syslog form."""

    hosts: int = 4
    per_host: int = 4
    steps: int = 400
    interval: int = 5
    step_s: float = 1.2
    seed: int = 0
    jitter: float = 0.04  # each step's time wobbles this much (data loading, GC, the network)
    host_spread: float = 0.03  # and each host is up to this much faster or slower than nominal
    slow_host: int | None = None  # this host's ranks take `slow` times as long per step
    slow: float = 1.3
    jump_host: int | None = None  # this host's step time is multiplied by `jump` after step `jump_at`
    jump_at: int = 200
    jump: float = 1.5
    lockstep: bool = False  # synchronous: every rank's step takes as long as the slowest host's
    kernel: tuple[int, int, str] | None = None  # (host, at step, kernel line) of one host's kernel
    crash: str | None = None  # the last line of rank 3, when the job dies

    @property
    def names(self) -> list[str]:
        return [f"gpu-h100-{101 + i:03d}" for i in range(self.hosts)]

    def ranks_of(self, host: int) -> list[int]:
        return list(range(host * self.per_host, (host + 1) * self.per_host))

    def lines(self) -> list[str]:
        rnd = random.Random(self.seed)
        names, world = self.names, self.hosts * self.per_host
        out: list[tuple[float, str]] = []
        for r in range(world):
            h, local = divmod(r, self.per_host)
            t = T0 + rnd.uniform(0, 3)
            pid = 40000 + r
            out += [(t, f"{_iso(t)} {names[h]}: [rank{r}]: > initializing torch distributed with world size {world}"),
                    (t + 1, f"{_iso(t + 1)} {names[h]}: {names[h]}:{pid}:{pid} [{local}] NCCL INFO Using network IB"),
                    (t + 2, f"{_iso(t + 2)} {names[h]}: [rank{r}]: UserWarning: TypedStorage is deprecated")]
        pace = [1 + rnd.uniform(-self.host_spread, self.host_spread) for _ in range(self.hosts)]
        clocks = [T0 + 30 + rnd.uniform(0, 1) for _ in range(world)]
        for step in range(1, self.steps + 1):
            took = [self._step_time(h, step, pace, rnd) for h in range(self.hosts)]
            if self.lockstep:
                took = [max(took)] * self.hosts
            for r in range(world):
                h = r // self.per_host
                dt = took[h] * (1 + rnd.gauss(0, 0.005))
                if step % 150 == 0:
                    dt += 25 + rnd.uniform(0, 1)  # a checkpoint save: every rank waits for its shard to be written
                clocks[r] += dt
                if step % self.interval == 0:
                    loss = 7.2 - 1.5 * step / self.steps + rnd.uniform(-0.05, 0.05)
                    out.append((clocks[r], f"{_iso(clocks[r])} {self.names[h]}: [rank{r}]:  iteration {step:>8}/  "
                                f"100000 | consumed samples: {step * 512:>10} | elapsed time per iteration (ms): "
                                f"{dt * 1000:.1f} | learning rate: 3.000E-04 | lm loss: {loss:.6E} | loss scale: "
                                "65536.0 | grad norm: 1.215 | number of skipped iterations:   0 |"))
                if step % 150 == 0 and r == 0:
                    out.append((clocks[r] + 0.1, f"{_iso(clocks[r] + 0.1)} {names[h]}: [rank0]:   successfully saved "
                                f"checkpoint at iteration {step:>7} to /ckpt/run7"))
        if self.kernel is not None:
            host, at_step, text = self.kernel
            t = clocks[0] - (self.steps - at_step) * self.step_s * 1.5 if self.lockstep else self._time_at(at_step)
            out.append((t, f"{_syslog(t)} {names[host]} kernel: [{t - T0 + 3000:.6f}] {text}"))
        end = max(clocks)
        if self.crash is None:
            out.append((end + 1, f"{_iso(end + 1)} {names[0]}: [rank0]: [after training is done] datetime: 2026-11-18"))
        else:
            h = 3 // self.per_host
            out.append((end + 1, f"{_iso(end + 1)} {names[h]}: [rank3]: Traceback (most recent call last):"))
            out.append((end + 1, f"{_iso(end + 1)} {names[h]}: [rank3]: {self.crash}"))
        out.sort(key=lambda x: x[0])
        return [line for _, line in out]

    def _step_time(self, host: int, step: int, pace: list[float], rnd: random.Random) -> float:
        dt = self.step_s * pace[host] * (1 + rnd.gauss(0, self.jitter))
        if host == self.slow_host:
            dt *= self.slow
        if step > self.jump_at and (host == self.jump_host or (self.lockstep and self.jump_host is not None
                                                               and host == self.jump_host)):
            dt *= self.jump
        return dt

    def _time_at(self, step: int) -> float:
        return T0 + 30 + step * self.step_s + 25 * (step // 150)


AER = "pcieport 0000:00:03.0: AER: Corrected error received: 0000:3b:00.0"
THERMAL = "CPU32: Package temperature above threshold, cpu clock throttled (total events = 1)"
ECC = "EDAC MC1: 4 CE memory read error on CPU_SrcID#1_Ha#0_Chan#2_DIMM#0 (channel:2 slot:0 page:0x5c1f3a)"
FLAP = "mlx5_core 0000:c1:00.0 ibp193s0: lost carrier"


def _named(report: Report) -> list[tuple[str, str, list[int]]]:
    return [(s.host, s.kind, s.ranks) for s in report.stragglers]


@pytest.mark.parametrize(("hosts", "per_host", "seed"), [(2, 4, 1), (4, 4, 2), (4, 8, 3), (8, 8, 4)])
def test_a_host_running_30_percent_slower_is_named_with_its_ranks(engine, hosts: int, per_host: int, seed: int) -> None:
    job = Job(hosts=hosts, per_host=per_host, seed=seed, slow_host=hosts - 1, steps=300 if hosts * per_host > 32 else 400)
    report = diagnose_lines(engine, job.lines(), 0)
    assert _named(report) == [(job.names[-1], "lagging", job.ranks_of(hosts - 1))]
    s = report.stragglers[0]
    assert 0.2 < 1 - s.steps_per_s / s.others_steps_per_s < 0.35
    assert s.since_line is not None and s.since_ts is not None
    assert report.status == "healthy" and report.action == "none"  # advice, never an action


@pytest.mark.parametrize(("kernel", "sign"), [(AER, "PCIe AER"), (THERMAL, "thermal throttling"),
                                             (ECC, "corrected ECC"), (FLAP, "link flap")])
def test_a_step_time_jump_with_a_kernel_line_on_that_host_is_joined(engine, kernel: str, sign: str) -> None:
    job = Job(hosts=4, per_host=4, seed=5, jump_host=1, kernel=(1, 196, kernel))
    report = diagnose_lines(engine, job.lines(), 0)
    assert _named(report) == [(job.names[1], "slowed", job.ranks_of(1))]
    s = report.stragglers[0]
    assert s.since_step is not None and 190 <= s.since_step <= 215
    assert s.steps_per_s < 0.75 * s.others_steps_per_s
    assert [e.text.endswith(kernel) for e in s.evidence] == [True]
    assert sign in s.effect
    assert report.status == "healthy" and report.action == "none"


def test_a_kernel_line_on_another_host_is_not_joined(engine) -> None:
    job = Job(hosts=4, per_host=4, seed=6, jump_host=1, kernel=(2, 196, AER))
    report = diagnose_lines(engine, job.lines(), 0)
    assert _named(report) == [(job.names[1], "slowed", job.ranks_of(1))]
    assert report.stragglers[0].evidence == []


def test_in_lockstep_the_host_whose_kernel_spoke_when_the_whole_job_slowed_is_named(engine) -> None:
    # Synchronous training: every rank waits for the slowest at each all-reduce, so every host's pace falls at
    # once; only the thermal line says which host the others wait for.
    job = Job(hosts=4, per_host=8, seed=7, lockstep=True, jump_host=2, kernel=(2, 198, THERMAL))
    report = diagnose_lines(engine, job.lines(), 0)
    assert _named(report) == [(job.names[2], "slowed", job.ranks_of(2))]
    assert "whole job" in report.stragglers[0].effect


def test_in_lockstep_a_slowdown_no_kernel_line_explains_names_no_host(engine) -> None:
    job = Job(hosts=4, per_host=8, seed=8, lockstep=True, jump_host=2)
    assert diagnose_lines(engine, job.lines(), 0).stragglers == []


@pytest.mark.parametrize("seed", range(10, 16))
@pytest.mark.parametrize(("hosts", "per_host", "lockstep"), [(2, 4, False), (4, 4, False), (8, 8, True), (4, 16, False)])
def test_clean_jobs_name_no_straggler(engine, hosts: int, per_host: int, lockstep: bool, seed: int) -> None:
    # Every other seed, a host's kernel logs a corrected AER or a throttle anyway: a kernel line alone is no straggler.
    kernel = (1, 120, (AER, THERMAL)[seed % 4 // 2]) if seed % 2 else None
    job = Job(hosts=hosts, per_host=per_host, seed=seed, lockstep=lockstep, steps=300 if hosts * per_host > 32 else 400,
              kernel=kernel)
    report = diagnose_lines(engine, job.lines(), 0)
    assert report.stragglers == []
    assert report.status == "healthy"


def test_a_straggler_leaves_a_healthy_job_healthy_and_a_failed_job_s_action_as_it_was(engine) -> None:
    crash = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.10 GiB"
    for kw in ({}, {"crash": crash}):
        clean = diagnose_lines(engine, Job(seed=9, **kw).lines(), 0 if not kw else 1)  # type: ignore[arg-type]
        slow = diagnose_lines(engine, Job(seed=9, slow_host=2, jump_host=2, kernel=(2, 196, AER), **kw).lines(),  # type: ignore[arg-type]
                              0 if not kw else 1)
        assert clean.stragglers == [] and [s.host for s in slow.stragglers] == ["gpu-h100-103"]
        assert (slow.status, slow.category, slow.failure_type, slow.action, slow.culprits.hosts) == \
               (clean.status, clean.category, clean.failure_type, clean.action, clean.culprits.hosts)
    assert clean.status == "failed" and clean.action != "cordon_and_restart"


def test_the_cli_text_shows_the_slow_host_its_ranks_and_its_kernel_line(engine) -> None:
    job = Job(hosts=4, per_host=4, seed=5, jump_host=1, kernel=(1, 196, AER))
    text = render_text(diagnose_lines(engine, job.lines(), 0), color=False)
    line = next(ln for ln in text.splitlines() if ln.startswith("slow: "))
    assert line.startswith(f"slow: {job.names[1]} (ranks 4-7) since step ")
    assert AER in text


def test_the_job_page_shows_the_slow_host_with_its_kernel_line(engine) -> None:
    job = Job(hosts=4, per_host=4, seed=5, jump_host=1, kernel=(1, 196, AER))
    session = engine.new_session()
    session.feed_lines(job.lines())
    report = session.report(exit_code=0)
    html = render_job_page(build_view("slow-1", report, session), Done(served=False), inline=True)
    section = html[html.index('<section id="stragglers"'):]
    section = section[:section.index("</section>")]
    assert job.names[1] in section and "ranks 4, 5, 6, 7" in section and "slowed" in section
    assert AER in section


def test_the_job_page_of_a_clean_job_has_no_slow_nodes_section(engine) -> None:
    session = engine.new_session()
    session.feed_lines(Job(seed=11).lines())
    report = session.report(exit_code=0)
    assert 'id="stragglers"' not in render_job_page(build_view("clean-1", report, session), Done(served=False), inline=True)


def test_a_session_moved_mid_job_to_another_process_names_the_same_straggler(engine) -> None:
    job = Job(hosts=4, per_host=4, seed=5, jump_host=1, kernel=(1, 196, AER))
    lines = job.lines()
    whole = diagnose_lines(engine, lines, 0)
    first = engine.new_session()
    first.feed_lines(lines[:len(lines) // 2])
    moved = Session.restore(engine, first.snapshot())
    moved.feed_lines(lines[len(lines) // 2:])
    assert moved.report(exit_code=0).stragglers == whole.stragglers != []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("stragglers")).start()
    yield srv
    srv.stop()


def test_the_service_names_it_in_a_job_uploaded_per_node(server: Server) -> None:
    job = Job(hosts=4, per_host=4, seed=5, jump_host=1, kernel=(1, 196, THERMAL))
    lines = job.lines()
    with server.client() as c:
        for host in job.names:  # one upload per node (its ranks' lines and its kernel's), as a shipper per node sends
            body = "".join(line + "\n" for line in lines if f" {host}" in line).encode()
            assert c.post("/v1/jobs/slow-node/logs", content=body).status_code == 200
        report = c.post("/v1/jobs/slow-node/end", json={"exit_code": 0}).json()
    assert [(s["host"], s["kind"], s["ranks"]) for s in report["stragglers"]] == [(job.names[1], "slowed", [4, 5, 6, 7])]
    assert report["stragglers"][0]["evidence"][0]["text"].endswith(THERMAL)
    assert report["status"] == "healthy" and report["action"] == "none"


def test_the_same_lines_in_another_order_name_the_same_straggler(engine) -> None:
    job = Job(hosts=4, per_host=4, seed=12, slow_host=0)
    lines = job.lines()
    by_host = [line for host in reversed(job.names) for line in lines if f" {host}" in line]  # node by node, last first
    assert len(by_host) == len(lines)
    def judged(report: Report) -> list[dict[str, object]]:  # line numbers are where each order put the lines
        return [s.model_dump(exclude={"since_line", "effect", "evidence"}) for s in report.stragglers]

    assert judged(diagnose_lines(engine, by_host, 0)) == judged(diagnose_lines(engine, lines, 0)) != []
