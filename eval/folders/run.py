#!/usr/bin/env python3
"""Job folders, as users send them: per-node files, diagnosed by the CLI and by the HTTP service, in any order.

    .venv/bin/python eval/folders/run.py [--cases 40] [--orders 4] [--seed 1] [--only xid79] [--no-http] [--json F]

Each case is a generated multi-node job (logdx.synth.folders: every layout of file names, every kernel clock:
dmesg -T, raw dmesg seconds since boot, syslog, syslog with the boot clock, journalctl) written as a folder.
It is diagnosed:

- by the CLI, `diagnose DIR` (files in the folder's order) and with the files named in shuffled orders;
- by the service (the real app on loopback through uvicorn), each file posted to /v1/jobs/{id}/logs with
  its host in `X-Logdx-Host` (as a shipper sends it), in chunks, in shuffled orders: whole files one after
  the other, and chunks of all files interleaved.

Printed: accuracy against the generator's truth (status, failure type, action, culprit host, culprit rank)
per face, any culprit host that is not one of the job's hosts, and the permutation property: every order
gives the same status, failure type, action and culprit (hosts and ranks), CLI and HTTP alike.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


SCENARIOS = ("xid79", "ecc", "nvlink", "ib_error", "node_lost", "cuda_oom", "host_oom", "disk_full", "key_error",
             "nccl_hang", "healthy")


def verdict(report: dict[str, Any]) -> tuple:
    c = report.get("culprits") or {}
    return (report.get("status"), report.get("failure_type"), report.get("action"),
            tuple(sorted(c.get("hosts") or [])), tuple(sorted(c.get("ranks") or [])))


def cases(n: int, seed: int, only: str | None) -> list[dict[str, Any]]:
    from logdx.synth.folders import KERNEL_CLOCKS, LAYOUTS

    rng = random.Random(seed)
    scenarios = [s for s in SCENARIOS if only is None or only in s]
    out = []
    for i in range(n):
        out.append(dict(scenario=scenarios[i % len(scenarios)], seed=seed * 1000 + i,
                        layout=rng.choice(sorted(LAYOUTS)), kernel_clock=rng.choice(KERNEL_CLOCKS),
                        ranks=rng.choice((16, 16, 24, 32)), lines=rng.choice((3000, 6000)),
                        # recent, as a job whose logs stream in is (its stamps without a year are this year's)
                        start=time.time() - rng.uniform(2, 20) * 86400))
    return out


# -- the CLI ------------------------------------------------------------------------------------------------


def cli_reports(engine: Any, folder: Path, ft: Any, orders: int, rng: random.Random) -> list[dict]:
    from logdx.jobinput import collect, diagnose_files

    settings = engine.settings.input
    reports = [diagnose_files(engine, collect([str(folder)], settings), "auto").report.model_dump(mode="json")]
    paths = [str(folder / f.path) for f in ft.files]
    for _ in range(orders):
        rng.shuffle(paths)
        reports.append(diagnose_files(engine, collect(paths, settings), "auto").report.model_dump(mode="json"))
    return reports


# -- the service --------------------------------------------------------------------------------------------


class Service:
    """The real app (logdx.api) on a loopback port, served by uvicorn in a thread."""

    def __init__(self, data_dir: Path) -> None:
        import uvicorn
        import yaml

        from logdx.api.app import create_app
        from logdx.config import load_settings
        from logdx.testing import free_port

        data_dir.mkdir(parents=True, exist_ok=True)
        config = data_dir / "config.yaml"
        config.write_text(yaml.safe_dump({
            "data_dir": str(data_dir), "llm": {"enabled": False}, "retrieval": {"enabled": False},
            "server": {"local_operator": True}}))
        settings = load_settings(config, env={})
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Service:
        import httpx

        self.thread.start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the service did not start")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def diagnose(self, job: str, posts: list[tuple[str, list[str]]]) -> dict:
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300) as c:
            for host, lines in posts:
                r = c.post(f"/v1/jobs/{job}/logs", content="".join(x + "\n" for x in lines).encode(),
                           headers={"content-type": "text/plain", "x-logdx-host": host})
                r.raise_for_status()
            r = c.post(f"/v1/jobs/{job}/end", json={})
            r.raise_for_status()
            return r.json()


def upload_orders(ft: Any, orders: int, rng: random.Random, chunk: int = 400) -> list[list[tuple[str, list[str]]]]:
    """Shuffled upload orders: whole files one after another, and chunks of every file interleaved."""
    chunks = [[(f.host, list(f.lines[i:i + chunk])) for i in range(0, len(f.lines), chunk)] for f in ft.files if f.lines]
    out: list[list[tuple[str, list[str]]]] = []
    for k in range(orders):
        files = chunks[:]
        rng.shuffle(files)
        if k % 2 == 0:
            out.append([c for f in files for c in f])
        else:  # interleaved: each file's chunks in its own order, the files' turns at random
            queues = [list(f) for f in files]
            seq: list[tuple[str, list[str]]] = []
            while any(queues):
                q = rng.choice([q for q in queues if q])
                seq.append(q.pop(0))
            out.append(seq)
    return out


# -- scoring ------------------------------------------------------------------------------------------------


def score(truth: Any, report: dict) -> dict[str, bool | None]:
    c = report.get("culprits") or {}
    want_hosts, want_ranks = set(truth.culprit_hosts), set(truth.culprit_ranks)
    return {
        "status": report.get("status") == truth.status,
        "failure_type": report.get("failure_type") == truth.failure_type,
        "action": report.get("action") == truth.action,
        "culprit_host": (bool(set(c.get("hosts") or []) & want_hosts)) if want_hosts else None,
        "culprit_rank": (bool(set(c.get("ranks") or []) & want_ranks)) if want_ranks else None,
        "foreign_host": bool(set(c.get("hosts") or []) - set(truth.hosts)),
    }


def _folders(args: argparse.Namespace, root: Path) -> Iterator[tuple[Path, Any, str]]:
    """(folder, its truth, its name) of every case: generated (and kept), or read back from --cases-from."""
    if args.cases_from:
        for entry in json.loads((Path(args.cases_from) / "cases.json").read_text()):
            folder = Path(args.cases_from) / entry["folder"]
            files = [_File(f["path"], f["host"], tuple((folder / f["path"]).read_text().splitlines()))
                     for f in entry["files"]]
            yield folder, _Truth(entry["truth"], files), entry["name"]
        return
    from logdx.synth.folders import write_job_folder

    kept = []
    for i, case in enumerate(cases(args.cases, args.seed, args.only)):
        folder = root / f"case{i:03d}"
        ft = write_job_folder(folder, **case)
        name = f"{case['scenario']}/{case['layout']}/{case['kernel_clock']}/s{case['seed']}"
        kept.append({"folder": folder.name, "name": name, "truth": ft.truth.to_dict(),
                     "files": [{"path": f.path, "host": f.host} for f in ft.files]})
        yield folder, ft, name
    if args.keep:
        (root / "cases.json").write_text(json.dumps(kept, indent=1))


class _File:
    def __init__(self, path: str, host: str, lines: tuple[str, ...]) -> None:
        self.path, self.host, self.lines = path, host, lines


class _Truth:
    """A kept case read back: its generator's truth (attributes) and files."""

    def __init__(self, truth: dict[str, Any], files: list[_File]) -> None:
        self.truth = type("Truth", (), truth)()
        self.files = files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=33)
    p.add_argument("--orders", type=int, default=3, help="shuffled orders per face and case")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", default=None, help="scenarios whose name contains this")
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--keep", default=None, metavar="DIR", help="write the cases' folders here (and cases.json)")
    p.add_argument("--cases-from", default=None, metavar="DIR",
                   help="diagnose the folders --keep wrote instead of generating them (another logdx on PYTHONPATH "
                        "measures the same cases)")
    args = p.parse_args(argv)

    from logdx.testing import rules_engine

    engine = rules_engine()
    rng = random.Random(args.seed)
    totals: dict[str, Counter] = {"cli": Counter(), "http": Counter()}
    unstable: list[str] = []
    misses: list[str] = []
    records = []
    with tempfile.TemporaryDirectory() as tmp, (Service(Path(tmp) / "svc") if not args.no_http else _Null()) as svc:
        for i, (folder, ft, name) in enumerate(_folders(args, Path(args.keep or tmp))):
            faces = {"cli": cli_reports(engine, folder, ft, args.orders, rng)}
            if not args.no_http:
                faces["http"] = [svc.diagnose(f"case{i:03d}-o{k}", posts)
                                 for k, posts in enumerate(upload_orders(ft, args.orders + 1, rng))]
            verdicts = {face: [verdict(r) for r in reps] for face, reps in faces.items()}
            every = [v for vs in verdicts.values() for v in vs]
            if len(set(every)) > 1:
                unstable.append(f"{name}: " + "; ".join(f"{face}: {sorted(Counter(vs).items())}" for face, vs in verdicts.items()))
            for face, reps in faces.items():
                s = score(ft.truth, reps[0])
                t = totals[face]
                for k, ok in s.items():
                    if ok is None:
                        continue
                    t[k + "_n"] += 1
                    t[k] += bool(ok)
                wrong = [k for k, ok in s.items() if ok is False and k != "foreign_host"] + (["foreign_host"] if s["foreign_host"] else [])
                if wrong:
                    misses.append(f"{face} {name}: {','.join(wrong)}: want {ft.truth.failure_type}/{ft.truth.action} "
                                  f"{ft.truth.culprit_hosts} {ft.truth.culprit_ranks[:4]}; got {verdict(reps[0])}")
            records.append({"case": name, "verdicts": {f: [list(v) for v in vs] for f, vs in verdicts.items()}})
            print(f"  {name}: " + " | ".join(f"{f} {verdicts[f][0][1]}/{verdicts[f][0][2]} {list(verdicts[f][0][3])}"
                                            for f in verdicts), flush=True)
    n = len(records)
    print(f"\n== job folders: {n} cases, {args.orders + 1} orders per face")
    for face, t in totals.items():
        if not t:
            continue
        cols = []
        for k in ("status", "failure_type", "action", "culprit_host", "culprit_rank"):
            if t[k + "_n"]:
                cols.append(f"{k} {t[k] / t[k + '_n']:.2f} ({t[k]}/{t[k + '_n']})")
        print(f"  {face:5} " + "  ".join(cols) + f"  foreign culprit host {t['foreign_host']}")
    print(f"  same verdict in every order, CLI and HTTP alike: {n - len(unstable)}/{n}")
    for u in unstable:
        print("    unstable " + u)
    for m in misses:
        print("    miss " + m)
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records, "unstable": unstable, "misses": misses}, indent=1))
    return 0


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
