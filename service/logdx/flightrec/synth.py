"""Flight-recorder dumps of a simulated job, laid out exactly as torch's writer lays them out
(`FlightRecorderDetail.hpp`: `getCollectiveTrace`, `getPgConfig`, `getPgStatus`, `dump`/`dump_json`),
for tests of code that reads dumps (ours, and torch's own `fr_trace`, which reads these files).

    job = FakeJob(8)
    tp = job.group("1", "tp", [0, 1, 2, 3])
    for step in range(100):
        job.collective("all_reduce", [[4096]])
    job.collective("all_reduce", [[4096]], skip={5}, state="started")   # rank 5 never comes
    job.write(tmp_path)                                                   # nccl_trace_rank_0..7

The GPU backends only can be imitated here (their "started"/"completed" states come from CUDA
events); real gloo dumps come from running a gloo job with `TORCH_FR_BUFFER_SIZE` set and calling
`torch._C._distributed_c10d._dump_fr_trace()` on each rank.

Layouts by format version: "2.10" is torch 2.13's. Older versions drop the fields added after
them, as far as this module knows their history (dtypes, `is_p2p`/`timeout_ms`, thread fields,
`nccl_version` before `comm_lib_version`); a 1.x version writes the pre-2.0 entry (`seq_id`)."""

from __future__ import annotations

import json
import pickle
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FakeJob"]

_C10D = "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
_LOGGER = "/usr/local/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
_API = {"all_reduce": ("all_reduce", 2951), "broadcast": ("broadcast", 2851), "all_gather": ("all_gather", 3778),
        "_all_gather_base": ("all_gather_into_tensor", 4006), "_reduce_scatter_base": ("reduce_scatter_tensor", 4521),
        "reduce_scatter": ("reduce_scatter", 4418), "all_to_all": ("all_to_all_single", 4815),
        "send": ("send", 2512), "recv": ("recv", 2580), "barrier": ("barrier", 4993)}


def _version(v: str) -> tuple[int, int]:
    major, _, minor = v.partition(".")
    return int(major), int(minor or 0)


@dataclass
class _Pg:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass
class _RankPg:
    uid: int
    coll_seq: int = 0
    p2p_seq: int = 0
    op_id: int = 0
    last_enqueued: int = -1
    last_started: int = -1
    last_completed: int = -1


@dataclass
class _Rank:
    rank: int
    buffer: deque[dict[str, Any]]
    record_id: int = 0
    pgs: dict[str, _RankPg] = field(default_factory=dict)


class FakeJob:
    """A job whose ranks run collectives; `dump(rank)` is what torch's flight recorder would hold."""

    def __init__(self, world_size: int, *, backend: str = "nccl", version: str = "2.10", buffer_size: int = 2000,
                 start_ns: int = 1_700_000_000_000_000_000, step_ns: int = 2_000_000, timeout_ms: int = 600_000,
                 script: str = "/workspace/train.py", comm_lib_version: str = "2.21.5") -> None:
        self.world_size = world_size
        self.backend = backend
        self.version = version
        self.now = start_ns
        self.step_ns = step_ns
        self.timeout_ms = timeout_ms
        self.script = script
        self.comm_lib_version = comm_lib_version
        self.pgs: dict[str, _Pg] = {}
        self.ranks = [_Rank(r, deque(maxlen=buffer_size)) for r in range(world_size)]
        self._frames: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.group("0", "default_pg", range(world_size))

    def group(self, name: str, desc: str, ranks: Iterable[int]) -> str:
        """A process group (torch names them "0", "1", ... in creation order); returns its name."""
        pg = _Pg(name, desc, tuple(sorted(ranks)))
        self.pgs[name] = pg
        for r in pg.ranks:
            state = self.ranks[r]
            state.pgs[name] = _RankPg(uid=len(state.pgs))
        return name

    def collective(self, op: str, sizes: list[list[int]], *, pg: str = "0", out_sizes: list[list[int]] | None = None,
                   dtype: str = "Float", skip: Iterable[int] = (), state: str = "completed",
                   states: dict[int, str] | None = None, by_rank: dict[int, dict[str, Any]] | None = None,
                   caller: str = "train_step") -> None:
        """Every member of `pg` except `skip` records `op` (e.g. "all_reduce") on tensors of `sizes`.
        `state`: "completed", "started" (kernel running, waiting for peers) or "scheduled";
        `states` overrides it per rank; `by_rank` overrides op/sizes/out_sizes/dtype per rank."""
        self.now += self.step_ns
        skipped = set(skip)
        for r in self.pgs[pg].ranks:
            if r in skipped:
                continue
            o: dict[str, Any] = dict(op=op, sizes=sizes,
 out_sizes=out_sizes if out_sizes is not None else sizes, dtype=dtype)
            o.update((by_rank or {}).get(r, {}))
            rs = self.ranks[r]
            rpg = rs.pgs[pg]
            rpg.coll_seq += 1
            rpg.op_id += 1
            self._record(rs, pg, rpg, f"{self.backend}:{o['op']}", o["sizes"], o["out_sizes"], o["dtype"],
                         (states or {}).get(r, state), is_p2p=False, caller=caller, api=o["op"])

    def p2p(self, src: int, dst: int, sizes: list[list[int]], *, pg: str = "0", dtype: str = "Float",
            state: str = "completed", recv_state: str | None = None, caller: str = "pipeline_step") -> None:
        """`src` sends to `dst` (global ranks): a send entry on `src`, a recv entry on `dst`."""
        self.now += self.step_ns
        members = self.pgs[pg].ranks
        s, d = members.index(src), members.index(dst)
        for r, name, api, st in ((src, f"send {s}->{d}", "send", state),
                                 (dst, f"recv {d}<-{s}", "recv", recv_state or state)):
            rs = self.ranks[r]
            rpg = rs.pgs[pg]
            rpg.p2p_seq += 1
            rpg.op_id += 1
            self._record(rs, pg, rpg, f"{self.backend}:{name}", sizes, sizes, dtype, st, is_p2p=True,
                         caller=caller, api=api)

    def _record(self, rs: _Rank, pg: str, rpg: _RankPg, profiling_name: str, sizes: list[list[int]],
                out_sizes: list[list[int]], dtype: str, state: str, *, is_p2p: bool, caller: str, api: str) -> None:
        created = self.now + rs.rank * 1_000
        started = created + 50_000 if state in ("started", "completed") else None
        completed = created + 900_000 if state == "completed" else None
        entry: dict[str, Any] = {
            "frames": self._stack(api, caller),
            "record_id": rs.record_id, "pg_id": rpg.uid, "process_group": (pg, self.pgs[pg].desc),
            "thread_name": "pt_main_thread", "thread_id": str(140_000_000_000_000 + rs.rank),
            "collective_seq_id": rpg.coll_seq, "p2p_seq_id": rpg.p2p_seq, "op_id": rpg.op_id,
            "profiling_name": profiling_name, "time_created_ns": created,
            "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes),
            "output_sizes": [list(s) for s in out_sizes], "output_dtypes": [dtype] * len(out_sizes),
            "state": state, "time_discovered_started_ns": started, "time_discovered_completed_ns": completed,
            "retired": state == "completed", "timeout_ms": self.timeout_ms, "is_p2p": is_p2p,
        }
        rs.buffer.append(entry)
        rs.record_id += 1
        if not is_p2p:
            rpg.last_enqueued = rpg.coll_seq
            if started is not None:
                rpg.last_started = rpg.coll_seq
            if completed is not None:
                rpg.last_completed = rpg.coll_seq

    def _stack(self, api: str, caller: str) -> list[dict[str, Any]]:
        key = (api, caller)
        if key not in self._frames:  # shared dicts, as torch's symbolizer shares frames (pickle memoizes them)
            func, line = _API.get(api, (api, 2000))
            self._frames[key] = [
                {"name": func, "filename": _C10D, "line": line}, {"name": "wrapper", "filename": _LOGGER, "line": 83},
                {"name": caller, "filename": self.script, "line": 212}, {"name": "main", "filename": self.script,
                                                                         "line": 388},
                {"name": "<module>", "filename": self.script, "line": 402}]
        return self._frames[key]

    def dump(self, rank: int) -> dict[str, Any]:
        """What `_dump_fr_trace()` pickles on `rank` (`FlightRecorder::dump`)."""
        rs = self.ranks[rank]
        major, minor = _version(self.version)
        out: dict[str, Any] = {"version": self.version, "pg_config": self._pg_config(rs)}
        if (major, minor) >= (2, 10):
            out["comm_lib_version"] = self.comm_lib_version
        elif (major, minor) >= (2, 4):
            out["nccl_version"] = self.comm_lib_version
        if major >= 2:
            out["pg_status"] = {str(p.uid): {"last_enqueued_collective": p.last_enqueued,
                                             "last_started_collective": p.last_started,
                                             "last_completed_collective": p.last_completed}
                                for p in rs.pgs.values()}
        out["entries"] = [self._layout(e, major, minor) for e in rs.buffer]
        return out

    def dump_json(self, rank: int) -> dict[str, Any]:
        """What `_dump_fr_trace_json()` returns on `rank` (`FlightRecorder::dump_json`): no frames,
        lists for tuples, 0 for unknown times, strings in pg_status, no "entries" when empty."""
        d = self.dump(rank)
        entries = []
        for e in d.pop("entries"):
            e = {k: v for k, v in e.items() if k != "frames"}
            e["process_group"] = list(e["process_group"])
            for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                if k in e and e[k] is None:
                    e[k] = 0
            entries.append(e)
        if "pg_status" in d:
            d["pg_status"] = {k: {n: str(v) for n, v in s.items()} for k, s in d["pg_status"].items()}
        if entries:
            d["entries"] = entries
        return d

    def _pg_config(self, rs: _Rank) -> dict[str, Any]:
        return {name: {"name": name, "desc": self.pgs[name].desc, "ranks": str(list(self.pgs[name].ranks))}
                for name in rs.pgs}

    @staticmethod
    def _layout(e: dict[str, Any], major: int, minor: int) -> dict[str, Any]:
        e = dict(e)
        if major < 2:  # one seq_id per group before 2.0
            e["seq_id"] = e.pop("p2p_seq_id") if e["is_p2p"] else e["collective_seq_id"]
            for k in ("collective_seq_id", "op_id", "is_p2p", "timeout_ms", "input_dtypes", "output_dtypes",
                      "thread_name", "thread_id", "p2p_seq_id"):
                e.pop(k, None)
            return e
        if minor < 9:
            e.pop("thread_name")
            e.pop("thread_id")
        if minor < 3:
            e.pop("is_p2p")
            e.pop("timeout_ms")
        if minor < 2:
            e.pop("input_dtypes")
            e.pop("output_dtypes")
        return e

    def write(self, directory: Path | str, *, prefix: str = "nccl_trace_rank_", fmt: str = "pickle",
              ranks: Iterable[int] | None = None) -> list[Path]:
        """One file per rank, `<directory>/<prefix><rank>`, as torch's DebugInfoWriter names them;
        `fmt` "json" writes the JSON dump instead. `ranks` limits which ranks leave a dump."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for r in (range(self.world_size) if ranks is None else ranks):
            p = out / f"{prefix}{r}"
            if fmt == "json":
                p.write_text(json.dumps(self.dump_json(r)), encoding="utf-8")
            else:
                p.write_bytes(pickle.dumps(self.dump(r), protocol=2))
            paths.append(p)
        return paths
