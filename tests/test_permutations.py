"""The same evidence gives the same verdict, whatever order it arrives in (issue 28). A multi-node job is
collected as users collect it (per-node stdout files, each node's kernel log beside them in one of the common
namings and clocks: `logdx.synth.folders`) and diagnosed by the CLI with its files named in shuffled orders,
and by the real service on loopback with each file uploaded (with its host, as a shipper sends it) in shuffled
orders, whole files one after another or chunks of all of them interleaved. Status, failure type, action and
culprit must be the same every time, and the culprit one of the job's hosts."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import LoopbackApp
from logdx.config import Settings
from logdx.jobinput import collect, diagnose_files
from logdx.pipeline import Engine
from logdx.synth.folders import FolderTruth, write_job_folder

pytestmark = pytest.mark.integration

# (scenario, layout, kernel clock): a fatal Xid whose kernel log arrives before the training lines it cut
# short, in a raw dmesg whose clock is the boot's; a file named dmesg-<host>; a silent rank's hang; a host OOM
# whose kernel line names the killed process.
CASES = [("nvlink", "flat", "syslog"), ("xid79", "dmesg_prefix", "raw"), ("ecc", "kern_suffix", "journal_iso"),
         ("nccl_hang", "per_host_dirs", "dmesg_T"), ("host_oom", "epilog", "syslog_raw")]


def _verdict(report: dict[str, Any]) -> tuple:
    c = report["culprits"]
    return report["status"], report["failure_type"], report["action"], tuple(c["hosts"]), tuple(c["ranks"])


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApp]:
    settings = Settings.model_validate({
        "data_dir": str(tmp_path_factory.mktemp("perm")), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 3600, "local_operator": True}})
    with LoopbackApp(settings, Engine.create(settings)) as a:
        yield a


def _uploads(ft: FolderTruth, rng: random.Random, interleaved: bool, chunk: int = 300) -> list[tuple[str, list[str]]]:
    files = [[(f.host, list(f.lines[i:i + chunk])) for i in range(0, len(f.lines), chunk)] for f in ft.files if f.lines]
    rng.shuffle(files)
    if not interleaved:
        return [c for f in files for c in f]
    out: list[tuple[str, list[str]]] = []
    while any(files):
        queue = rng.choice([f for f in files if f])
        out.append(queue.pop(0))
    return out


@pytest.mark.parametrize("scenario,layout,clock", CASES, ids=[f"{s}-{lay}-{c}" for s, lay, c in CASES])
def test_every_order_of_a_jobs_files_gives_the_same_verdict(tmp_path: Path, app: LoopbackApp, engine: Engine,
                                                             scenario: str, layout: str, clock: str) -> None:
    rng = random.Random(f"{scenario}-{layout}-{clock}")
    # A job of a few days ago, as a live service would receive it: stamps without a year are this year's.
    ft = write_job_folder(tmp_path / "job", scenario=scenario, seed=11, ranks=16, lines=3000, layout=layout,
                          kernel_clock=clock, start=time.time() - 3 * 86400)
    paths = [str(tmp_path / "job" / f.path) for f in ft.files]
    verdicts = {"cli, the folder": _verdict(diagnose_files(engine, collect([str(tmp_path / "job")], engine.settings.input),
                                                           "auto").report.model_dump(mode="json"))}
    for k in range(3):
        rng.shuffle(paths)
        report = diagnose_files(engine, collect(paths, engine.settings.input), "auto").report
        verdicts[f"cli, files in order {k}"] = _verdict(report.model_dump(mode="json"))
    with httpx.Client(base_url=app.url, timeout=300, headers={"x-requested-with": "t"}) as c:
        for k, interleaved in enumerate((False, True, False, True)):
            job = f"{scenario}-{layout}-{clock}-{k}"
            for host, lines in _uploads(ft, rng, interleaved):
                r = c.post(f"/v1/jobs/{job}/logs", content="".join(x + "\n" for x in lines).encode(),
                           headers={"content-type": "text/plain", "x-logdx-host": host})
                assert r.status_code == 200, r.text
            r = c.post(f"/v1/jobs/{job}/end", json={})
            assert r.status_code == 200, r.text
            verdicts[f"http, {'interleaved' if interleaved else 'file by file'} {k}"] = _verdict(r.json())
    assert len(set(verdicts.values())) == 1, verdicts
    status, failure_type, action, hosts, ranks = next(iter(verdicts.values()))
    truth = ft.truth
    assert (status, failure_type, action) == (truth.status, truth.failure_type, truth.action)
    assert set(hosts) <= set(truth.hosts) and set(hosts) & set(truth.culprit_hosts)  # one of the job's, the right one
