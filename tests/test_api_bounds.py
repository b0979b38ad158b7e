"""Bounded work per request, and exactly-once uploads, against a real server (issue 14, points 2 and 5).

The memory and CPU figures are the server process's own, read from /proc by the test.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server import Server
from logdx.testing import cpu_budget

XID = "May  1 12:10:05 gpu-node-01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=14487, name=python, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The cap is three times the flood's own bound (4 CPU-s on the machine the bounds were written on, more
    # on a slower one): a neighbour's burst during the flood must not cut it, and the 55 MB request below
    # still costs many times the cap. What bounds the flood is asserted on its own measured CPU.
    srv = Server(tmp_path_factory.mktemp("bounds"), server={"max_request_cpu_s": round(cpu_budget(12.0), 1)}).start()
    yield srv
    srv.stop()


def _status(server: Server, field: str) -> int:
    """A /proc/<pid>/status figure of the server, in kB."""
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _cpu_s(server: Server) -> float:
    assert server.proc is not None
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _flood(n_lines: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(50_000)]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "\n"
                   for _ in range(n_lines)).encode()


def test_zip_bomb_keeps_memory_bounded(server: Server) -> None:
    """1 MB of gzip that inflates to 1 GB of newlines: refused (413), the server's peak RSS stays small."""
    bomb = gzip.compress(b"\n" * (1 << 30), 9)
    assert len(bomb) < 1_100_000
    before = _status(server, "VmHWM")
    cpu0 = _cpu_s(server)
    with server.client() as c:
        r = c.post("/v1/jobs/bomb/logs", content=bomb,
                   headers={"content-encoding": "gzip", "content-type": "text/plain", "x-logdx-host": "gpu-node-01"})
        cpu = _cpu_s(server) - cpu0
        assert r.status_code == 413 and r.json()["error"]["code"] == "inflate_limit", r.text
        assert r.json()["error"]["accepted_lines"] == 0
        assert c.get("/v1/jobs/bomb").status_code == 404  # nothing of it was applied: the job it made is gone
    peak = _status(server, "VmHWM")
    print(f"zip bomb: server peak RSS {before / 1024:.0f} MB -> {peak / 1024:.0f} MB, {cpu:.2f} s of server CPU")
    assert peak < 400 * 1024 and peak - before < 150 * 1024


def test_random_word_flood_is_bounded_and_the_error_still_found(server: Server) -> None:
    """2 MB of random-word lines (72 s of CPU before) then the failure: bounded CPU, the right diagnosis."""
    flood = _flood(30_000, seed=1)
    assert len(flood) > 2_000_000
    cpu0 = _cpu_s(server)
    with server.client(timeout=120) as c:
        r = c.post("/v1/jobs/flood/logs", content=flood + (XID + "\n").encode(),
                   headers={"content-type": "text/plain", "x-logdx-job": "flood"})
        assert r.status_code == 200, r.text
        assert r.json()["accepted_lines"] == 30_001
        cpu = _cpu_s(server) - cpu0
        report = c.post("/v1/jobs/flood/end", json={"exit_code": 1}).json()
    print(f"random-word flood: {cpu:.1f} s of server CPU for {len(flood) / 1e6:.1f} MB")
    assert cpu < cpu_budget(4.0)
    assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-01"]


@pytest.mark.slow
def test_a_costly_request_is_cut_with_429(server: Server) -> None:
    """Past server.max_request_cpu_s (12 s here, on the reference machine) a request is cut: 429 cpu_limit, the applied lines said."""
    flood = _flood(400_000, seed=2) * 2  # ~55 MB
    with server.client(timeout=300) as c:
        r = c.post("/v1/jobs/costly/logs", content=flood, headers={"content-type": "text/plain", "x-logdx-job": "c"})
        assert r.status_code == 429, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "cpu_limit" and "Retry-After" in r.headers
        assert c.get("/v1/jobs/costly").json()["lines"] == err["accepted_lines"] < 800_000


def _drop_mid_upload(server: Server, path: str, body: bytes, key: str) -> None:
    """Send the headers and half the body, then vanish (a shipper killed mid-request)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/x-ndjson\r\n"
            f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + body[: len(body) // 2])
        time.sleep(0.5)  # the server has read and spooled what came


def test_dropped_then_retried_upload_counts_once(server: Server) -> None:
    lines = [json.dumps({"log": f"[rank{i % 8}]: iteration {i} | lm loss: 2.0", "host": "gpu-node-01"})
             for i in range(2000)]
    body = ("\n".join(lines) + "\n").encode()
    _drop_mid_upload(server, "/v1/jobs/retry/logs", body, "batch-0001")
    time.sleep(0.5)
    with server.client() as c:
        assert c.get("/v1/jobs/retry").status_code == 404  # the dropped half was not applied: no job left
        r = c.post("/v1/jobs/retry/logs", content=body,
                   headers={"content-type": "application/x-ndjson", "idempotency-key": "batch-0001"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == 2000 and not r.json()["duplicate"], r.text
        again = c.post("/v1/jobs/retry/logs", content=body,
                       headers={"content-type": "application/x-ndjson", "idempotency-key": "batch-0001"})
        assert again.status_code == 200 and again.json()["duplicate"] is True
        assert c.get("/v1/jobs/retry").json()["lines"] == 2000
    # and after a restart (the spool replayed), still once
    server.stop()
    server.start()
    with server.client() as c:
        assert c.get("/v1/jobs/retry").json()["lines"] == 2000
        dup = c.post("/v1/jobs/retry/logs", content=body,
                     headers={"content-type": "application/x-ndjson", "idempotency-key": "batch-0001"})
        assert dup.json()["duplicate"] is True and c.get("/v1/jobs/retry").json()["lines"] == 2000
