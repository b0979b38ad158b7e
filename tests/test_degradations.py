"""What a job's start-up says will make it slow (logdx/diagnose/degradations.py): a host whose NCCL fell back to
TCP sockets while the others use InfiniBand, GPU Direct RDMA off on one host; never on a clean start-up, never
an action; the same in the CLI and the service."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from api_server import Receiver, Server, start_receiver
from logdx.synth.startup import startup_job
from logdx.testing import diagnose_lines, wait_until

HOSTS = ("gpu-a100-011", "gpu-a100-012", "gpu-a100-013", "gpu-a100-014")
PER_HOST = 4


def startup(*, socket_on: tuple[str, ...] = (), gdr_off_on: tuple[str, ...] = (), fabric: str = "IB",
            p2p_off_on: tuple[str, ...] = ()) -> list[str]:
    """NCCL_DEBUG=INFO start-up of a 4-node x 4-GPU job as pdsh tees it: every rank's bootstrap, network and
    GDR lines (NCCL 2.18's wording), in the order ranks print them, then the ring and some training."""
    out = []
    for local in range(PER_HOST):
        for i, host in enumerate(HOSTS):
            pid = 21400 + 100 * i + local
            rank = i * PER_HOST + local
            p = f"{host}:{pid}:{pid + 61} [{local}] NCCL INFO"
            out.append(f"{host}:{pid}:{pid} [{local}] NCCL INFO Bootstrap : Using ib0:10.40.{i}.{10 + local}<0>")
            if host in p2p_off_on:
                out.append(f"{host}:{pid}:{pid} [{local}] NCCL INFO NCCL_P2P_DISABLE set by environment to 1")
            if host in socket_on or fabric == "Socket":
                out += [f"{p} NET/IB : No device found.", f"{p} NET/Socket : Using [0]eth0:10.50.{i}.{10 + local}<0>",
                        f"{p} Using network Socket"]
            else:
                out += [f"{p} NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.40.{i}.{10 + local}<0>",
                        f"{p} Using network IB",
                        f"{p} NET/IB : GPU Direct RDMA {'Disabled' if host in gdr_off_on else 'Enabled'} for HCA 0 'mlx5_0'"]
            out.append(f"{p} comm 0x55d0a8c0 rank {rank} nranks {PER_HOST * len(HOSTS)} cudaDev {local} busId "
                       f"{('1b000', '3b000', '5d000', '8a000')[local]} commId 0x9f3c - Init COMPLETE")
    for step in range(1, 40):
        for i, host in enumerate(HOSTS):
            out.append(f"{host}: [rank{i * PER_HOST}]: iteration {step:>5}/ 1000 | lm loss: {6 - step * 0.01:.4f} | "
                       "elapsed time per iteration (ms): 1402.1")
    return out


def test_a_host_on_sockets_while_the_others_use_infiniband_is_named(engine) -> None:
    report = diagnose_lines(engine, startup(socket_on=("gpu-a100-013",)), None)
    assert [(g.kind, g.host) for g in report.degradations] == [("network_fallback", "gpu-a100-013")]
    g = report.degradations[0]
    assert g.text.endswith("NCCL INFO Using network Socket") and "IB" in g.effect
    assert report.status != "failed" and report.action == "none"  # advice, never an action


def test_gpu_direct_rdma_off_on_one_host_is_named(engine) -> None:
    report = diagnose_lines(engine, startup(gdr_off_on=("gpu-a100-012",)), None)
    assert [(g.kind, g.host) for g in report.degradations] == [("gdr_disabled", "gpu-a100-012")]


def test_p2p_disabled_is_named_on_each_host_it_is_set_on(engine) -> None:
    report = diagnose_lines(engine, startup(p2p_off_on=("gpu-a100-011", "gpu-a100-014")), None)
    assert [(g.kind, g.host) for g in report.degradations] == [("p2p_disabled", "gpu-a100-011"),
                                                                ("p2p_disabled", "gpu-a100-014")]
    assert "NVLink" in report.degradations[0].effect


@pytest.mark.parametrize("fabric", ["IB", "Socket"])
def test_a_clean_start_up_says_nothing(engine, fabric: str) -> None:
    # Every host on InfiniBand with GDR, or every host on sockets (a cluster that has nothing else): no host differs.
    assert diagnose_lines(engine, startup(fabric=fabric), None).degradations == []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("degradations")).start()
    yield srv
    srv.stop()


def test_the_service_names_it_in_a_job_uploaded_per_node(server: Server) -> None:
    lines = startup(socket_on=("gpu-a100-014",))
    with server.client() as c:
        for host in HOSTS:  # one upload per node, as a shipper per node sends them
            body = "".join(line + "\n" for line in lines if line.startswith(host)).encode()
            assert c.post("/v1/jobs/slow-start/logs", content=body).status_code == 200
        report = c.post("/v1/jobs/slow-start/end", json={"exit_code": 0}).json()
    assert [(g["kind"], g["host"]) for g in report["degradations"]] == [("network_fallback", "gpu-a100-014")]
    assert report["status"] == "healthy"


def test_the_job_page_names_the_degraded_host_as_advice(engine) -> None:
    from logdx.web.render import Done, render_job_page
    from logdx.web.view import build_view

    session = engine.new_session()
    session.feed_lines(startup(socket_on=("gpu-a100-013",)))
    html = render_job_page(build_view("slow-start", session.report(), session), Done(served=False), inline=True)
    part = html[html.index('<section id="degradations"'):]
    part = part[:part.index("</section>")]
    assert "gpu-a100-013" in part and "network_fallback" in part and "Using network Socket" in part
    clean = engine.new_session()
    clean.feed_lines(startup())
    page = render_job_page(build_view("clean", clean.report(), clean), Done(served=False), inline=True)
    assert '<section id="degradations"' not in page


# -- the streaming service's advice (issue 31: alert once as advice, no action, while the job runs) -------------


@pytest.fixture(scope="module")
def advising(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Receiver]]:
    rx = start_receiver()
    srv = Server(tmp_path_factory.mktemp("advice"), receiver=rx).start()
    yield srv, rx
    srv.stop()
    rx.close()


def _advice(rx: Receiver) -> list[dict]:
    return [body for r in rx.of("/hook") if (body := json.loads(r.body))["type"] == "logdx.advice"]


def test_the_service_advises_once_per_kind_and_host_while_the_job_runs(advising: tuple[Server, Receiver]) -> None:
    srv, rx = advising
    buf = io.StringIO()
    truth = startup_job(buf, seed=5, flavour="megatron", style="pdsh_torchrun", ranks=32, lines=2500,
                        degradation="fewer_channels")
    lines = buf.getvalue().splitlines()
    cut = next(i for i, line in enumerate(lines) if "Init COMPLETE" in line) + 40 * 32  # the start-up, and a little
    with srv.client() as c:
        for part in (lines[:cut // 2], lines[cut // 2:cut]):  # two uploads while the job runs
            assert c.post("/v1/jobs/advice-job/logs", content="\n".join(part).encode() + b"\n").status_code == 200
        got = rx.wait_for("/hook")  # arrives while the job is still open: no end was sent
        advice = [b for b in _advice(rx) if b["data"]["job_id"] == "advice-job"]
        assert len(advice) == 1, [json.loads(r.body)["type"] for r in got]
        named = [(g["kind"], g["host"]) for g in advice[0]["data"]["degradations"]]
        assert named == [("fewer_channels", truth.variant["degraded_host"])]
        assert advice[0]["data"]["recommended"].startswith("none")
        # The same start-up again (a re-sent upload, a restarted shipper) and the rest of the job: no second advice.
        assert c.post("/v1/jobs/advice-job/logs", content="\n".join(lines[:cut]).encode() + b"\n").status_code == 200
        assert c.post("/v1/jobs/advice-job/logs", content="\n".join(lines[cut:]).encode() + b"\n").status_code == 200
        report = c.post("/v1/jobs/advice-job/end", json={"exit_code": 0}).json()
    assert report["status"] == "healthy" and report["action"] == "none"
    assert [(g["kind"], g["host"]) for g in report["degradations"]] == named
    assert len([b for b in _advice(rx) if b["data"]["job_id"] == "advice-job"]) == 1
    assert not [r for r in rx.of("/hook") if json.loads(r.body)["type"] == "logdx.diagnosis"
                and json.loads(r.body)["data"]["job_id"] == "advice-job"]


def test_a_clean_start_up_sends_no_advice(advising: tuple[Server, Receiver]) -> None:
    srv, rx = advising
    buf = io.StringIO()
    startup_job(buf, seed=6, flavour="plain", style="pdsh_torchrun", ranks=24, lines=1500, gpus_per_host=8)
    with srv.client() as c:
        assert c.post("/v1/jobs/clean-job/logs", content=buf.getvalue().encode()).status_code == 200
        c.post("/v1/jobs/clean-job/end", json={"exit_code": 0})
        # A job with a degradation after it: its advice arriving says the clean job's would have come by now.
        other = io.StringIO()
        startup_job(other, seed=7, flavour="plain", style="pdsh_torchrun", ranks=24, lines=1500,
                    degradation="nccl_version_differs")
        assert c.post("/v1/jobs/marker-job/logs", content=other.getvalue().encode()).status_code == 200
    wait_until(lambda: any(b["data"]["job_id"] == "marker-job" for b in _advice(rx)), "the marker job's advice")
    assert not [b for b in _advice(rx) if b["data"]["job_id"] == "clean-job"]


@pytest.mark.parametrize("kind", ["bootstrap_interface", "fewer_channels", "nccl_version_differs",
                                  "driver_version_differs"])
def test_one_host_that_differs_from_the_agreeing_others_is_named(engine, kind: str) -> None:
    buf = io.StringIO()
    truth = startup_job(buf, seed=21, flavour="plain", style="srun", ranks=32, lines=1800, degradation=kind,
                        gpus_per_host=8)
    report = diagnose_lines(engine, buf.getvalue().splitlines(), 0)
    assert [(g.kind, g.host) for g in report.degradations] == [(kind, truth.variant["degraded_host"])]
    assert report.status == "healthy" and report.action == "none"
    assert str(report.degradations[0].line_no) and report.degradations[0].text in buf.getvalue()


def test_two_hosts_that_disagree_name_neither() -> None:
    from logdx.diagnose.degradations import degradations_in

    def words(version: str, channels: str) -> dict[str, tuple[str, int, str]]:
        return {"version": (version, 1, f"NCCL INFO NCCL version {version}"),
                "channels": (channels, 2, f"NCCL INFO {channels} coll channels, ...")}

    assert degradations_in({"a": words("2.21.5+cuda12.4", "32"), "b": words("2.18.1+cuda12.1", "16")}) == []
    # Three hosts, two agreeing: the third is named; a host with more channels than the others is not a degradation.
    three = {"a": words("2.21.5+cuda12.4", "32"), "b": words("2.21.5+cuda12.4", "32"), "c": words("2.18.1+cuda12.1", "64")}
    assert [(g.kind, g.host) for g in degradations_in(three)] == [("nccl_version_differs", "c")]
