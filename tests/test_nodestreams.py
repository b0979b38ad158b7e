"""Node streams joined to jobs (issue 21): a job's pods' output goes to logdx through one route, its
nodes' kernel logs through another (a Fluent Bit DaemonSet's msgpack, syslog-ng per node); the Xid in
the kernel log is the root, its host the culprit, whether the kernel line comes before the job's lines,
after them, or after the job's end (a follow-up alert). A node event of another job's host, or outside
the job's time, changes nothing for it.

The shippers are emulated as the existing shipper tests do (tests/test_shippers.py): Fluent Bit's msgpack
framing (`[time, record]` events, the `kubernetes` filter's fields, a `kmsg` input's record with the
DaemonSet's `hostname` added by a `record_modifier`), syslog-ng's `http()` destination posting
`format-json` NDJSON with `$HOST` and `$ISODATE`.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import msgpack
import pytest

from api_server import Receiver, Server, exited, needs_syslog_ng, running_syslog_ng, start_receiver
from logdx.api.ingest import runs_by_job
from logdx.config import NodeStreamSettings
from logdx.formats import Batch
from logdx.formats.fields import NO_JOB
from logdx.jobs.nodestreams import NodeStreams
from logdx.normalize import Source
from logdx.store import Database
from logdx.testing import wait_until

RANKS, STEPS, CULPRIT = 16, 20, 5
T0 = 1714564800.0
T_FAIL = T0 + 10 * STEPS + 5  # the GPU falls off the bus; the others time out 10 minutes later
XID = "NVRM: Xid (PCI:0000:4e:00): 79, pid=4711, GPU has fallen off the bus."
HARMLESS_KERNEL = ["IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
                   "nvidia-peermem: module loaded", "audit: type=1400 audit(1714564800.123:42): apparmor=\"STATUS\""]
EXPECTED = {"status": "failed", "category": "infrastructure", "failure_type": "gpu_fell_off_bus",
            "action": "cordon_and_restart"}


def host_of(rank: int, base: int = 0) -> str:
    return f"gpu-node-{base + rank // 8:02d}"


def pod_lines(rank: int, t0: float = T0) -> list[tuple[float, str]]:
    """What a rank's pod prints: progress, then (every rank but the culprit, whose GPU is gone) the NCCL
    watchdog's timeout. No kernel line: that is in the node's log."""
    out = [(t0 + 10 * s, f"[rank{rank}]: iteration {s + 1:6d}/  100000 | consumed samples: {(s + 1) * 512:9d} | "
                         f"elapsed time per iteration (ms): {1000 + rank}.0 | lm loss: 2.{s:02d}E+00 |")
           for s in range(STEPS)]
    if rank != CULPRIT:
        out.append((t0 + 10 * STEPS + 605,
                    f"[rank{rank}]:[E501 12:10:00.000000000 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
                    "collective operation timeout: WorkNCCL(SeqNum=4242, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                    "Timeout(ms)=600000) ran for 600094 milliseconds before timing out."))
    return out


def _event_time(ts: float) -> msgpack.ExtType:
    return msgpack.ExtType(0, struct.pack(">II", int(ts), int(round((ts % 1) * 1e9))))


def fluent_bit_pods(job_id: str, base: int = 0, t0: float = T0) -> list[bytes]:
    """Fluent Bit's `http` output, msgpack: one body per node, the job from the pod's `job-name` label and
    the host from the `kubernetes` filter."""
    bodies = []
    for node in range(RANKS // 8):
        events = []
        for rank in range(node * 8, node * 8 + 8):
            for ts, line in pod_lines(rank, t0):
                record = {"log": line + "\n", "stream": "stderr",
                          "kubernetes": {"pod_name": f"{job_id}-{rank}", "host": host_of(rank, base),
                                         "labels": {"job-name": job_id}}}
                events.append(msgpack.packb([_event_time(ts), record]))
        bodies.append(b"".join(events))
    return bodies


def fluent_bit_kmsg(host: str, lines: list[tuple[float, str]]) -> bytes:
    """The same DaemonSet's `kmsg` input (`priority`, `sequence`, `sec`, `usec`, `msg`), the node's name
    added by a `record_modifier` (`Record hostname ${NODE_NAME}`): no job."""
    return b"".join(msgpack.packb([_event_time(ts), {"priority": 3, "sequence": i, "sec": int(ts), "usec": 0,
                                                     "msg": text, "hostname": host}])
                    for i, (ts, text) in enumerate(lines))


def syslog_ng_kernel(host: str, lines: list[tuple[float, str]]) -> bytes:
    """syslog-ng per node: `body("$(format-json --scope none message=$MSG host=$HOST program=$PROGRAM
    ts=$ISODATE)")`, NDJSON batches, no job header (the README's node recipe)."""
    return b"".join(json.dumps({"message": text, "host": host, "program": "kernel",
                                "ts": datetime.fromtimestamp(ts, UTC).isoformat()}).encode() + b"\n"
                    for ts, text in lines)


MSGPACK = {"content-type": "application/msgpack", "user-agent": "Fluent-Bit"}
NDJSON = {"content-type": "application/x-ndjson"}


@pytest.fixture(scope="module")
def hooks() -> Iterator[Receiver]:
    r = start_receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, hooks: Receiver) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("nodestreams"), receiver=hooks,
                 server={"early_diagnosis_delay_s": 0.2}).start()
    yield srv
    srv.stop()


def _post(c: httpx.Client, bodies: list[bytes], headers: dict[str, str]) -> list[dict]:
    answers = []
    for body in bodies:
        r = c.post("/v1/logs", content=body, headers=headers)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    return answers


def _send_pods(c: httpx.Client, job_id: str, base: int = 0, t0: float = T0) -> None:
    for answer in _post(c, fluent_bit_pods(job_id, base, t0), MSGPACK):
        assert answer["refused"] == {} and answer["node_lines"] == 0 and list(answer["jobs"]) == [job_id]


def _send_kernel(c: httpx.Client, host: str, lines: list[tuple[float, str]], how: str = "syslog-ng") -> None:
    body, headers = ((syslog_ng_kernel(host, lines), NDJSON) if how == "syslog-ng"
                     else (fluent_bit_kmsg(host, lines), MSGPACK))
    answer = _post(c, [body], headers)[0]
    assert answer["node_lines"] == len(lines) and answer["accepted_lines"] == 0 and answer["refused"] == {}, answer


def _kernel_of_culprit(at: float = T_FAIL) -> list[tuple[float, str]]:
    return [(T0 - 30, HARMLESS_KERNEL[0]), (T0 + 1, HARMLESS_KERNEL[1]), (at, XID)]


def _wait_for_the_xid(c: httpx.Client, job_id: str, what: str) -> dict:
    """The job's current report, once it names the Xid's failure (an early one while the job is open)."""
    def named() -> dict | None:
        report = c.get(f"/v1/jobs/{job_id}").json()["report"]
        return report if report and report["failure_type"] == "gpu_fell_off_bus" else None

    return wait_until(named, what)


def _diagnosis(report: dict) -> dict:
    return {k: report[k] for k in EXPECTED}


# --- the two routes, one job ------------------------------------------------------------------------------


@pytest.mark.integration
def test_kernel_log_after_the_pods_lines_is_the_root(server: Server) -> None:
    """Pods through the Fluent Bit DaemonSet's msgpack, the culprit node's kernel log through syslog-ng
    while the job runs: the Xid joins the job's timeline (its early diagnosis already), root and host."""
    job_id = "nodes-after-1"
    with server.client() as c:
        _send_pods(c, job_id)
        _send_kernel(c, host_of(CULPRIT), _kernel_of_culprit())
        _send_kernel(c, host_of(8), [(T0 + 5, HARMLESS_KERNEL[2])])

        _wait_for_the_xid(c, job_id, "the early diagnosis with the node's Xid")
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == [host_of(CULPRIT)]
    assert report["root_cause"]["text"] == XID and report["root_cause"]["host"] == host_of(CULPRIT)


@pytest.mark.integration
def test_kernel_log_before_the_pods_lines_is_the_root(server: Server) -> None:
    """The kernel log shipped first (Fluent Bit's kmsg input, same DaemonSet): held in the node's stream
    and joined when the job's lines from that node arrive."""
    job_id, t0 = "nodes-before-1", T0 + 86400
    with server.client() as c:
        _send_kernel(c, "gpu-node-20", [(t0 - 30, HARMLESS_KERNEL[0]), (t0 + 10 * STEPS + 5, XID)], how="kmsg")
        _send_pods(c, job_id, base=20, t0=t0)
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-20"] and report["root_cause"]["text"] == XID


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_real_otel_sdk_and_loki_clients_ship_node_lines(server: Server) -> None:
    """The OpenTelemetry SDK's OTLP exporter (the node in the resource's `host.name`, no job attribute) and
    python-logging-loki (the node as Loki's `node` label, no job label) send node lines, stamped now by the
    clients themselves; the job's pods (Fluent Bit msgpack) ran until a moment ago."""
    import logging

    import logging_loki
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    job_id, t0 = "nodes-clients-1", time.time() - 10 * STEPS - 700
    with server.client() as c:
        _send_pods(c, job_id, base=80, t0=t0)
    provider = LoggerProvider(resource=Resource.create({"service.name": "kernel", "host.name": "gpu-node-81"}))
    provider.add_log_record_processor(BatchLogRecordProcessor(
        OTLPLogExporter(endpoint=server.url + "/v1/logs", timeout=10), schedule_delay_millis=200))
    for name, handler, line in (
            ("otel", LoggingHandler(logger_provider=provider), HARMLESS_KERNEL[0]),
            ("loki", logging_loki.LokiHandler(url=server.url + "/loki/api/v1/push", version="1",
                                              tags={"node": "gpu-node-80", "app": "kernel"}), XID)):
        logger = logging.getLogger(f"logdx-test.nodes.{name}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.warning(line)
        logger.removeHandler(handler)
    assert provider.force_flush(20_000)
    provider.shutdown()
    with server.client() as c:
        kept = c.get("/v1/nodes/gpu-node-81/logs").json()["lines"]
        assert [(line["text"], line["notable"]) for line in kept] == [(HARMLESS_KERNEL[0], False)], kept
        _wait_for_the_xid(c, job_id, "the job's diagnosis with the Xid the Loki client shipped")
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-80"] and report["root_cause"]["text"] == XID


@pytest.mark.integration
def test_hosts_named_by_the_lines_own_prefixes_join_at_the_end(server: Server) -> None:
    """A job's text lines with pdsh-style `host: ` prefixes and no times, the node's kernel line sent to
    `/v1/nodes/{host}/logs` without a time either: the job's hosts and its life by the clock join them."""
    job_id = "nodes-prefixes-1"
    lines = [f"gpu-node-70: {line.replace('[E501 12:10:00.000000000 ProcessGroupNCCL.cpp:616] ', '')}"
             for rank in range(8) for _, line in pod_lines(rank)]  # (a glog stamp would be a time)
    with server.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/logs", content="\n".join(lines) + "\n", headers={"content-type": "text/plain"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == len(lines), r.text
        r = c.post("/v1/nodes/gpu-node-70/logs", content=f"{HARMLESS_KERNEL[0]}\n{XID}\n",
                   headers={"content-type": "text/plain"})
        assert r.status_code == 200 and r.json()["node_lines"] == 2, r.text
        r = c.post("/v1/nodes/gpu-node-71/logs", content=f"{XID}\n", headers={"content-type": "text/plain"})
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-70"] and report["root_cause"]["text"] == XID


@pytest.mark.integration
def test_late_kernel_line_reopens_the_diagnosis_with_a_follow_up(server: Server, hooks: Receiver) -> None:
    """The kernel line arrives after the job's end, within `nodes.reopen_grace_s`: the diagnosis is made
    again with it, stored, and a second alert says what changed."""
    job_id, t0 = "nodes-late-1", T0 + 2 * 86400
    with server.client() as c:
        _send_pods(c, job_id, base=30, t0=t0)
        first = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
        assert first["failure_type"] != "gpu_fell_off_bus" and XID not in json.dumps(first)
        wait_until(lambda: [h for h in hooks.of("/hook") if h.json()["data"]["job_id"] == job_id],
                   "the first alert")
        _send_kernel(c, "gpu-node-30", [(t0 + 10 * STEPS + 5, XID)], how="kmsg")
        detail = c.get(f"/v1/jobs/{job_id}").json()
    report = detail["report"]
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-30"] and report["root_cause"]["text"] == XID
    assert [r["kind"] for r in detail["reports"]][-1] == "followup"
    alerts = wait_until(lambda: [h.json()["data"] for h in hooks.of("/hook") if h.json()["data"]["job_id"] == job_id
                                 and h.json()["data"]["report"]["failure_type"] == "gpu_fell_off_bus"] or None,
                        "the follow-up alert")
    note = alerts[0]["report"]["notes"][0]
    assert note.startswith("follow-up") and first["failure_type"] in note and "gpu_fell_off_bus" in note
    # The same event again (a shipper's retry) is one alert: the diagnosis did not change.
    with server.client() as c:
        _send_kernel(c, "gpu-node-30", [(t0 + 10 * STEPS + 5, XID)], how="kmsg")
        assert len(c.get(f"/v1/jobs/{job_id}").json()["reports"]) == len(detail["reports"])


@pytest.mark.integration
@needs_syslog_ng
def test_real_syslog_ng_ships_the_nodes_kernel_logs(server: Server, tmp_path: Path) -> None:
    """Debian's syslog-ng on each node reading its kernel log (RFC 5424 records) and posting them with the
    README's node destination: no job header, the host is syslog-ng's own $HOST, the time its $ISODATE.
    The pods' lines come through Fluent Bit's msgpack: the Xid is the root, its node the culprit."""
    job_id, t0 = "nodes-syslogng-1", T0 + 4 * 86400
    with server.client() as c:
        _send_pods(c, job_id, base=50, t0=t0)
    sources = []
    for n, (host, lines) in enumerate([("gpu-node-50", [(t0 - 30, HARMLESS_KERNEL[0]), (t0 + 10 * STEPS + 5, XID)]),
                                       ("gpu-node-51", [(t0 + 2, HARMLESS_KERNEL[1])])]):
        path = tmp_path / f"{host}-kern.log"
        path.write_text("".join(f"<3>1 {datetime.fromtimestamp(ts, UTC).isoformat()} {host} kernel - - - {text}\n"
                                for ts, text in lines))
        # one machine plays both nodes: each record keeps the host it names (on a node, $HOST is the node)
        sources.append(f'source s{n} {{ file("{path}" flags(syslog-protocol) keep-hostname(yes) follow-freq(0.2)); }};')
    conf = f"""@version: current
{chr(10).join(sources)}
destination d_logdx_nodes {{
    http(url("{server.url}/v1/logs") method("POST")
         headers("Content-Type: application/x-ndjson", "X-Requested-With: syslog-ng")
         body("$(format-json --scope none message=$MSG host=$HOST program=$PROGRAM ts=$ISODATE)")
         batch-lines(500) batch-timeout(200) workers(1));
}};
log {{ source(s0); source(s1); destination(d_logdx_nodes); }};
"""
    with running_syslog_ng(tmp_path, conf) as proc, server.client() as c:
        def joined() -> dict | None:
            if proc.poll() is not None:
                raise exited(proc, "syslog-ng")
            report = c.get(f"/v1/jobs/{job_id}").json()["report"]
            return report if report and report["failure_type"] == "gpu_fell_off_bus" else None

        wait_until(joined, "the kernel's Xid, shipped by syslog-ng, in the job's diagnosis")
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert _diagnosis(report) == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-50"] and report["root_cause"]["text"] == XID


# --- safety: only this job's hosts, only its time ---------------------------------------------------------


@pytest.mark.integration
def test_node_events_of_other_hosts_or_times_change_nothing(server: Server) -> None:
    """An Xid on a host of ANOTHER job, in this job's time, and one on this job's host hours before it
    started or after it ended: this job's diagnosis is what its own lines say. The other job, whose host
    it is, does take it (the event was not lost)."""
    mine, theirs, t0 = "nodes-safe-a", "nodes-safe-b", T0 + 3 * 86400
    with server.client() as c:
        _send_pods(c, mine, base=40, t0=t0)
        alone = c.post(f"/v1/jobs/{mine}/end", json={"exit_code": 1}).json()  # the reference: no node event

        mine = "nodes-safe-a2"
        _send_pods(c, mine, base=40, t0=t0)
        _send_pods(c, theirs, base=42, t0=t0)
        _send_kernel(c, "gpu-node-42", [(t0 + 10 * STEPS + 5, XID)])  # theirs, in my time
        _send_kernel(c, "gpu-node-40", [(t0 - 3 * 3600, XID)])  # my host, 3 h before I started
        mine_report = c.post(f"/v1/jobs/{mine}/end", json={"exit_code": 1}).json()
        before = c.get(f"/v1/jobs/{mine}").json()["reports"]
        _send_kernel(c, "gpu-node-41", [(t0 + 10 * STEPS + 605 + 3600, XID)])  # my host, an hour after my end
        after = c.get(f"/v1/jobs/{mine}").json()
        theirs_report = c.post(f"/v1/jobs/{theirs}/end", json={"exit_code": 1}).json()
    for key in ("status", "category", "failure_type", "action", "culprits"):
        assert mine_report[key] == alone[key], (key, mine_report, alone)
    assert XID not in json.dumps(mine_report) and "gpu-node-42" not in json.dumps(mine_report)
    assert after["reports"] == before and before[-1]["kind"] == "final"
    assert after["report"]["failure_type"] == alone["failure_type"]
    assert _diagnosis(theirs_report) == EXPECTED and theirs_report["culprits"]["hosts"] == ["gpu-node-42"]


# --- the node endpoint and refusals -------------------------------------------------------------------------


@pytest.mark.integration
def test_node_endpoint_and_what_is_refused(server: Server) -> None:
    """`POST /v1/nodes/{host}/logs` keeps every line as the host's; without a job a record naming no host
    either is refused (422 when nothing else was usable), never answered 2xx and dropped."""
    with server.client() as c:
        r = c.post("/v1/nodes/gpu-node-77/logs", content="kernel: one\n  \nkernel: NVRM: Xid 79\n",
                   headers={"content-type": "text/plain"})
        assert r.status_code == 200 and r.json()["node_lines"] == 2 and r.json()["host"] == "gpu-node-77", r.text
        assert r.json()["refused"] == {"empty": 1}
        r = c.post("/v1/nodes/gpu-node-77/logs", content=b'{"message": "x", "job_id": "not-mine"}\n',
                   headers=NDJSON)
        assert r.status_code == 200 and r.json()["node_lines"] == 1, r.text  # job fields are ignored there
        assert c.get("/v1/jobs/not-mine").status_code == 404
        r = c.post("/v1/nodes/gpu-node-[1-3]/logs", content="x\n")
        assert r.status_code == 422 and r.json()["error"]["code"] == "bad_host"
        r = c.post("/v1/logs", content=b'{"message": "kernel: who am I"}\n', headers=NDJSON)
        assert r.status_code == 422 and r.json()["error"]["refused"] == {"no_job": 1}, r.text
        r = c.post("/v1/logs", content=b'{"message": "a", "host": "gpu-node-78"}\n{"message": "b"}\n',
                   headers=NDJSON)
        assert r.status_code == 200 and r.json()["partial"] and r.json()["node_lines"] == 1 and r.json()["refused"] == {"no_job": 1}
        assert r.json()["partial"] is True  # the issue 29 batch: a record with neither job nor host was refused


# --- unit: the split and the bounds ------------------------------------------------------------------------


def test_lines_without_a_job_go_to_their_host_or_are_refused() -> None:
    batch = Batch()
    batch.add("job-1", Source(host="gpu-node-01"), b"a job line")
    batch.add(NO_JOB, Source(host="gpu-node-02", ts=T0), b"kernel: a node line")
    batch.add(NO_JOB, Source(), b"nobody's")
    batch.add(None, Source(host="gpu-node-03"), b"a text line without a job")
    refused: dict[str, int] = {}
    node_runs: list = []
    by_job = runs_by_job(batch, refused, node_runs)
    assert list(by_job) == ["job-1"] and refused == {"no_job": 1}
    assert [(s.host, lines) for s, lines in node_runs] == [("gpu-node-02", [b"kernel: a node line"]),
                                                          ("gpu-node-03", [b"a text line without a job"])]
    refused = {}
    runs_by_job(batch, refused)  # a caller that keeps no node lines refuses them all
    assert refused == {"no_job": 3}


def test_a_gpu_health_event_is_a_node_line() -> None:
    """An NVSentinel-style health event (its JSON: `nodeName`, `message`, `generatedTimestamp`, no job) is
    a line of its node, at its time."""
    from logdx import formats
    from logdx.formats import Meta

    event = {"version": 1, "agent": "syslog-health-monitor", "componentClass": "GPU", "checkName": "SysLogsXIDError",
             "isFatal": True, "isHealthy": False, "message": XID, "recommendedAction": "RESTART_BM",
             "errorCode": ["79"], "nodeName": "gpu-node-90", "generatedTimestamp": "2024-05-01T12:03:25Z"}
    _, parser = formats.choose(Meta(), name="ndjson", http=False)
    batch = parser.feed(json.dumps(event).encode() + b"\n").merge(parser.finish())
    node_runs: list = []
    assert runs_by_job(batch, {}, node_runs) == {}
    assert [(s.host, s.ts, lines) for s, lines in node_runs] == [("gpu-node-90", T0 + 205, [XID.encode()])]


def test_a_hosts_stream_is_bounded(backend_db: Database) -> None:
    streams = NodeStreams(NodeStreamSettings(max_events_per_host=100, retain_s=3600), backend_db)
    now = time.time()
    for i in range(3):
        streams.keep("gpu-node-01", [(T0 + j, f"line {i}-{j}", j == 0) for j in range(60)], now + i)
    streams.keep("gpu-node-02", [(T0, "other host", True)], now)
    kept = streams.lines_of("gpu-node-01", 1000)
    assert len(kept) <= 100 and {k["text"] for k in kept} >= {f"line 2-{j}" for j in range(60)}
    assert len(streams.lines_of("gpu-node-02", 10)) == 1
    streams.keep("gpu-node-02", [(T0, "much later", False)], now + 7200)  # the first is past retain_s
    assert [k["text"] for k in streams.lines_of("gpu-node-02", 10)] == ["much later"]
    notable = streams.notable_between("gpu-node-01", T0, None, 10)
    assert [e.text for e in notable] == ["line 2-0"]
    streams.keep("gpu-node-03", [(T0 + j, f"big {j}", False) for j in range(250)], now)  # one batch past the bound
    assert [k["text"] for k in streams.lines_of("gpu-node-03", 1000)] == [f"big {j}" for j in range(249, 149, -1)]


def test_spans_grow_and_each_event_joins_a_job_once(backend_db: Database) -> None:
    streams = NodeStreams(NodeStreamSettings(), backend_db)
    assert streams.note_span("job-1", "gpu-node-01", T0 + 10, T0 + 20) is True
    assert streams.note_span("job-1", "gpu-node-01", T0, T0 + 15) is False
    assert streams.note_span("job-1", "gpu-node-01", T0 + 5, T0 + 30) is False
    assert streams.spans("job-1") == {"gpu-node-01": (T0, T0 + 30)} and streams.job_end_ts("job-1") == T0 + 30
    events = streams.keep("gpu-node-01", [(T0 + 1, "NVRM: Xid 79", True), (T0 + 2, "NVRM: Xid 48", True)], time.time())
    assert streams.claim("job-1", events) == events
    assert streams.claim("job-1", events) == [] and streams.claim("job-2", events[:1]) == events[:1]
    streams.unclaim("job-1", events[1:])
    assert streams.claim("job-1", events) == events[1:] and streams.joined_count("job-1") == 2
    assert streams.notable_between("gpu-node-01", T0, None, 1, unjoined_to="job-2") == events[1:]
    assert streams.notable_between("gpu-node-01", T0, T0 + 1, 10) == events[:1]


# --- several replicas -------------------------------------------------------------------------------------


@pytest.fixture
def nats_prefix() -> Iterator[str]:
    from conftest import nats_unreachable

    why = nats_unreachable()
    if why:
        pytest.skip(why)
    import asyncio
    import uuid

    prefix = "t" + uuid.uuid4().hex[:10]
    yield prefix

    async def delete_stream() -> None:
        import nats

        from conftest import NATS_URL

        nc = await nats.connect(NATS_URL)
        try:
            await nc.jetstream().delete_stream(f"{prefix}-lines")
        except Exception:
            pass
        await nc.close()

    asyncio.run(delete_stream())


@pytest.mark.integration
def test_an_ingest_and_a_worker_replica_join_node_streams(tmp_path: Path, pg_url: str, nats_prefix: str) -> None:
    """Cluster mode: the ingest replica keeps the node lines (PostgreSQL) and hands those of an open job to
    its owner through the line bus; a late one, which the ingest replica does not act on, re-opens the
    ended job's diagnosis on the worker, which alerts. A worker refuses uploads, node lines too."""
    from conftest import NATS_URL

    hooks = start_receiver()
    extra = {"store": {"url": pg_url},
             "bus": {"url": NATS_URL, "prefix": nats_prefix, "partitions": 2, "lease_s": 3.0}}
    ingest = Server(tmp_path / "ingest", extra=extra, server={"replica_id": "ingest-0", "role": "ingest"})
    worker = Server(tmp_path / "worker", receiver=hooks, extra=extra,
                    server={"replica_id": "worker-0", "role": "worker", "early_diagnosis_delay_s": 0.2})
    try:
        ingest.start(timeout=120)
        worker.start(timeout=120)
        with ingest.client() as c:
            wait_until(lambda: {p["owner"] for p in c.get("/v1/cluster").json()["partitions"]} == {"worker-0"},
                       "the worker owns every partition")
            t0 = T0 + 5 * 86400
            _send_pods(c, "c-nodes-1", base=60, t0=t0)
            _send_kernel(c, "gpu-node-60", [(t0 + 10 * STEPS + 5, XID)])

            _wait_for_the_xid(c, "c-nodes-1", "the owner's early diagnosis with the node's Xid")
            report = c.post("/v1/jobs/c-nodes-1/end", json={"exit_code": 1}, timeout=60).json()
            assert _diagnosis(report) == EXPECTED and report["culprits"]["hosts"] == ["gpu-node-60"], report

            _send_pods(c, "c-nodes-2", base=62, t0=t0)
            first = c.post("/v1/jobs/c-nodes-2/end", json={"exit_code": 1}, timeout=60).json()
            assert first["failure_type"] != "gpu_fell_off_bus"
            _send_kernel(c, "gpu-node-62", [(t0 + 10 * STEPS + 5, XID)], how="kmsg")

            def reopened() -> dict | None:
                detail = c.get("/v1/jobs/c-nodes-2").json()
                return detail if detail["report"]["failure_type"] == "gpu_fell_off_bus" else None

            detail = wait_until(reopened, "the worker re-opening the ended job's diagnosis")
        assert detail["reports"][-1]["kind"] == "followup" and detail["report"]["culprits"]["hosts"] == ["gpu-node-62"]
        wait_until(lambda: [h for h in hooks.of("/hook") if h.json()["data"]["job_id"] == "c-nodes-2"
                            and h.json()["data"]["report"]["failure_type"] == "gpu_fell_off_bus"],
                   "the follow-up alert from the worker")
        with worker.client() as w:
            r = w.post("/v1/logs", content=syslog_ng_kernel("gpu-node-64", [(t0, XID)]), headers=NDJSON)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ingest", r.text
    finally:
        ingest.stop()
        worker.stop()
        hooks.close()
