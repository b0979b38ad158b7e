"""Flight-recorder dumps: reading them safely, finding the silent rank and the desync, and torch's
own analyser's text.

Real dumps: tests/fixtures/flightrec/gloo/<scenario>/ were written by torch 2.13's flight recorder
in real 8-rank gloo jobs (tests/fixtures/flightrec/gloo_job.py; the slow test at the end runs one
again and checks it says the same). Dumps of NCCL jobs, whose recorder needs GPUs, come from
`FakeJob`, in torch's layout; the integration tests have torch's own `fr_trace` read them."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from logdx.flightrec import (
    DumpSet,
    FrDumpError,
    FrLimits,
    analyse,
    load_dump_bytes,
    load_dump_file,
    load_dumps,
    parse_fr_trace_text,
)
from logdx.flightrec.__main__ import main
from logdx.flightrec.load import rank_of
from logdx.flightrec.model import rank_ranges
from logdx.flightrec.synth import FakeJob

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "flightrec"
GLOO = FIXTURES / "gloo"


def group(findings, name):
    return next(g for g in findings.groups if g.pg_name == name)


def training(world: int = 8, steps: int = 5, **kw) -> FakeJob:
    """A job with a TP group per half and a DP group per pair, a few steps in."""
    job = FakeJob(world, **kw)
    half = world // 2
    job.group("1", "tp", range(half))
    job.group("2", "tp", range(half, world))
    for i in range(half):
        job.group(str(3 + i), "dp", [i, i + half])
    for _ in range(steps):
        for tp in ("1", "2"):
            job.collective("_all_gather_base", [[256]], pg=tp, out_sizes=[[256 * half]], dtype="BFloat16")
        for i in range(half):
            job.collective("all_reduce", [[4096]], pg=str(3 + i))
        job.collective("all_reduce", [[1]])
    return job


# --- real dumps of real gloo jobs ------------------------------------------------------------------

def test_real_gloo_hang_names_the_rank_outside_every_collective():
    traces = load_dumps(GLOO / "hang")
    assert [t.rank for t in traces] == list(range(8))
    assert {t.version for t in traces} == {"2.10"} and {t.fmt for t in traces} == {"pickle"}
    f = analyse(traces)
    assert f.culprit_ranks == (5,)
    pg0 = f.groups[0]
    assert (pg0.pg_name, pg0.pg_desc, pg0.seq, pg0.stuck_op) == ("0", "default_pg", 5, "gloo:all_reduce")
    assert pg0.ranks == tuple(range(8))
    assert pg0.missing_ranks == (5,)
    assert pg0.waiting_ranks == (0, 1, 2, 3, 4, 6, 7)
    assert pg0.input_sizes == ((64,),)
    last = pg0.last_of_missing[5]
    assert (last.seq, last.op, last.done) == (4, "gloo:barrier", True)
    assert pg0.stack and pg0.stack[-1].filename.endswith("gloo_job.py")
    assert pg0.summary() == ("pg 0 (default_pg): ranks 0-4,6-7 wait in gloo:all_reduce #5; rank 5 never entered it "
                             "(its last: gloo:barrier #4 completed)")
    assert f.summary().splitlines()[0].startswith("rank 5 outside every collective")
    # the TP and DP groups all finished their last collective: nothing stuck there
    assert [g.pg_name for g in f.stuck_groups] == ["0"]


def test_real_gloo_hang_in_a_subgroup_follows_the_chain_to_the_one_silent_rank():
    f = analyse(load_dumps(GLOO / "tp-hang"))
    assert f.culprit_ranks == (6,)
    tp = f.groups[0]
    assert (tp.pg_desc, tp.ranks, tp.missing_ranks, tp.waiting_ranks) == ("tp", (4, 5, 6, 7), (6,), (4, 5, 7))
    assert tp.members_known is False  # gloo's recorder leaves pg_config empty in torch 2.13
    # rank 2 waits in its DP all_reduce for rank 6; ranks 4, 5, 7 are missing from their DP
    # all_reduces only because they wait in the TP all_gather: not culprits
    dp = {g.ranks: g for g in f.groups if g.pg_desc == "dp"}
    assert dp[(2, 6)].missing_ranks == (6,) and dp[(2, 6)].waiting_ranks == (2,)
    assert dp[(0, 4)].missing_ranks == (4,)
    assert f.groups[1].ranks == (2, 6)  # the groups that blame the culprit come first
    assert any("membership not in the dumps' pg_config" in n for n in f.notes)


def test_real_gloo_silent_desync_of_sizes_and_dtypes():
    f = analyse(load_dumps(GLOO / "mismatch"))
    g = group(f, "0")
    assert (g.mismatch_seq, g.mismatch_ranks) == (5, (3,))
    assert g.mismatch == "at #5 gloo:all_reduce: rank 3 with input sizes [[32]], the other 7 ranks [[64]]"
    assert f.desync_ranks == (3,)
    assert g.seq == 6 and not g.missing_ranks  # the job went on past it: same bytes, no error


def test_real_gloo_different_collective_at_the_same_step():
    f = analyse(load_dumps(GLOO / "op-mismatch"))
    g = group(f, "0")
    assert g.mismatch == "at #5: rank 3 called gloo:broadcast, the other 7 ranks gloo:all_reduce"
    assert g.summary().startswith("pg 0 (default_pg): ranks 0-2,4-7 wait in gloo:all_reduce #5; mismatch at #5")


# --- NCCL-shaped dumps ----------------------------------------------------------------------------

def test_eight_rank_nccl_hang_one_rank_missing(tmp_path):
    job = training(8)
    job.collective("all_reduce", [[4096]], skip={5}, state="started")
    job.write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    assert f.culprit_ranks == (5,)
    g = f.groups[0]
    assert (g.pg_name, g.seq, g.stuck_op, g.missing_ranks) == ("0", 6, "nccl:all_reduce", (5,))
    assert g.waiting_ranks == (0, 1, 2, 3, 4, 6, 7) and g.members_known
    assert g.summary() == ("pg 0 (default_pg): ranks 0-4,6-7 wait in nccl:all_reduce #6; rank 5 never entered it "
                           "(its last: nccl:all_reduce #5 completed)")
    assert [x.pg_name for x in f.stuck_groups] == ["0"]
    assert f.to_dict()["groups"][0]["missing_ranks"] == [5]
    json.dumps(f.to_dict())


def test_ranks_that_ran_ahead_are_not_missing(tmp_path):
    """NCCL is asynchronous: the CPUs enqueue collectives past the one the GPUs are stuck in, some
    further than others. The stuck one is the first that not every rank entered."""
    job = training(8)
    job.collective("all_reduce", [[4096]], skip={5}, state="started")          # #6: rank 5 never comes
    job.collective("all_reduce", [[8]], skip={5}, state="scheduled")           # #7, queued behind it
    job.collective("all_reduce", [[8]], skip={5, 3}, state="scheduled")        # #8, rank 3 not that far
    job.write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    g = group(f, "0")
    assert (g.seq, g.max_seq, g.stuck_op, g.input_sizes) == (6, 8, "nccl:all_reduce", ((4096,),))
    assert g.missing_ranks == (5,) and g.waiting_ranks == (0, 1, 2, 3, 4, 6, 7)
    assert f.culprit_ranks == (5,)


def test_dumps_of_only_the_active_entries(tmp_path):
    """TORCH_INCLUDE_ONLY_ACTIVE=1: each dump holds only what had not finished; the silent rank's is
    empty of the group."""
    job = training(8)
    job.collective("all_reduce", [[4096]], skip={5}, state="started")
    for r in range(8):
        dump = job.dump(r)
        dump["entries"] = [e for e in dump["entries"] if e["state"] != "completed"]
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2))
    f = analyse(load_dumps(tmp_path))
    g = group(f, "0")
    assert (g.seq, g.missing_ranks, g.waiting_ranks) == (6, (5,), (0, 1, 2, 3, 4, 6, 7))
    assert "rank 5 never entered it (its last: no record of this group in its dump)" in g.summary()
    assert f.culprit_ranks == (5,)


def test_pickle_and_json_dumps_say_the_same(tmp_path):
    job = training(8)
    job.collective("_all_gather_base", [[256]], pg="2", out_sizes=[[1024]], skip={6}, state="started")
    job.write(tmp_path / "p")
    job.write(tmp_path / "j", fmt="json")
    p, j = load_dumps(tmp_path / "p"), load_dumps(tmp_path / "j")
    assert {t.fmt for t in j} == {"json"}
    assert [e.time_started_ns for e in j[0].entries] == [e.time_started_ns for e in p[0].entries]
    assert analyse(p).summary() == analyse(j).summary()
    assert analyse(j).culprit_ranks == (6,)


def test_type_size_and_dtype_mismatches(tmp_path):
    cases = {
        "type": ({2: {"op": "all_gather", "out_sizes": [[4096 * 4]]}}, "at #4: rank 2 called nccl:all_gather, "
                                                                        "the other 3 ranks nccl:all_reduce"),
        "size": ({1: {"sizes": [[2048]], "out_sizes": [[2048]]}}, "at #4 nccl:all_reduce: rank 1 with input sizes "
                                                                   "[[2048]], the other 3 ranks [[4096]]"),
        "dtype": ({3: {"dtype": "Half"}}, "at #4 nccl:all_reduce: rank 3 with dtypes Half, the other 3 ranks Float"),
    }
    for name, (by_rank, expected) in cases.items():
        job = FakeJob(4)
        for _ in range(3):
            job.collective("all_reduce", [[4096]])
        job.collective("all_reduce", [[4096]], by_rank=by_rank, state="started")
        job.write(tmp_path / name)
        g = analyse(load_dumps(tmp_path / name)).groups[0]
        assert g.mismatch == expected, name
        assert g.mismatch_seq == 4 and g.mismatch_ranks == tuple(by_rank)


def test_sizes_that_legitimately_differ_are_no_mismatch(tmp_path):
    job = FakeJob(4)
    # all_to_all with uneven splits, gather with outputs on the root only, an all_gather whose
    # output is world times its input
    job.collective("all_to_all", [[10]], by_rank={r: {"sizes": [[10 + r]], "out_sizes": [[13 - r]]} for r in range(4)})
    job.collective("gather", [[8]], out_sizes=[], by_rank={0: {"out_sizes": [[8]] * 4}})
    job.collective("_all_gather_base", [[8]], out_sizes=[[32]])
    job.write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    assert f.groups[0].mismatch is None and not f.stuck_groups


def test_earliest_mismatch_wins_and_a_tie_names_both_sides(tmp_path):
    job = FakeJob(2)
    job.collective("all_reduce", [[8]])
    job.collective("all_reduce", [[8]], by_rank={1: {"op": "broadcast"}})
    job.collective("all_reduce", [[8]], by_rank={1: {"sizes": [[4]], "out_sizes": [[4]]}}, state="started")
    job.write(tmp_path)
    g = analyse(load_dumps(tmp_path)).groups[0]
    assert g.mismatch == "at #2: rank 1 called nccl:broadcast, rank 0 nccl:all_reduce"


def test_several_process_groups_only_the_stuck_one_is_reported(tmp_path):
    job = training(8)
    job.collective("all_reduce", [[4096]], pg="4", skip={1}, state="started")   # dp group of ranks 1 and 5
    job.write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    assert len(f.groups) == 7
    assert [(g.pg_name, g.pg_desc, g.missing_ranks, g.waiting_ranks) for g in f.stuck_groups] == [("4", "dp", (1,), (5,))]
    assert f.culprit_ranks == (1,)
    healthy = group(f, "1")
    assert healthy.summary() == "pg 1 (tp): all 4 ranks with a dump completed nccl:_all_gather_base #5"
    assert f.summary().splitlines() == [
        "rank 1 outside every collective while the others wait: the silent rank of the hang",
        "pg 4 (dp): rank 5 waits in nccl:all_reduce #6; rank 1 never entered it (its last: nccl:all_reduce #5 completed)",
    ]


def test_nothing_stuck(tmp_path):
    training(4).write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    assert not f.stuck_groups and f.culprit_ranks == ()
    assert f.summary() == "no process group is stuck in these dumps (5 groups, 4 ranks)"


def test_a_rank_without_a_dump_while_everyone_else_waits(tmp_path):
    job = training(8)
    job.collective("all_reduce", [[4096]], skip={3}, state="started")
    job.write(tmp_path, ranks=[r for r in range(8) if r != 3])
    f = analyse(load_dumps(tmp_path))
    g = group(f, "0")
    assert g.no_dump_ranks == (3,) and g.missing_ranks == () and g.waiting_ranks == (0, 1, 2, 4, 5, 6, 7)
    assert f.culprit_ranks == ()
    assert "rank 3 left no dump while every rank with one waits: look there first" in f.summary()
    assert "rank 3 left no dump" in g.summary()


def test_all_entered_but_the_kernel_never_started_on_one(tmp_path):
    job = FakeJob(4)
    for _ in range(3):
        job.collective("all_reduce", [[64]])
    job.collective("all_reduce", [[64]], state="started", states={2: "scheduled"})
    job.collective("broadcast", [[64]], state="scheduled")   # queued behind it on every rank
    job.write(tmp_path)
    g = analyse(load_dumps(tmp_path)).groups[0]
    assert (g.seq, g.max_seq, g.stuck_op) == (4, 5, "nccl:all_reduce")
    assert g.missing_ranks == () and g.waiting_ranks == (0, 1, 2, 3) and g.not_started_ranks == (2,)
    assert "it never started on rank 2" in g.summary()


def test_pipeline_p2p_waits(tmp_path):
    job = FakeJob(4)
    pp = job.group("1", "pp", [0, 1, 2, 3])
    for _ in range(3):
        for r in range(3):
            job.p2p(r, r + 1, [[16, 1024]], pg=pp)
    job.p2p(1, 2, [[16, 1024]], pg=pp, state="started", recv_state="started")
    job.write(tmp_path)
    g = group(analyse(load_dumps(tmp_path)), "1")
    assert g.seq is None and g.p2p_waiting == {1: "nccl:send 1->2 (p2p #7)", 2: "nccl:recv 2<-1 (p2p #7)"}
    assert g.stuck and "p2p waits: rank 1 in nccl:send 1->2 (p2p #7)" in g.summary()


def test_ring_buffer_that_dropped_the_start(tmp_path):
    job = FakeJob(4, buffer_size=16)
    for _ in range(40):
        job.collective("all_reduce", [[64]])
    job.collective("all_reduce", [[64]], skip={0}, state="started")
    job.write(tmp_path)
    traces = load_dumps(tmp_path)
    assert traces[0].entries[0].record_id == 24 and traces[1].entries[0].record_id == 25
    g = analyse(traces).groups[0]
    assert (g.seq, g.missing_ranks, g.mismatch) == (41, (0,), None)


def test_split_groups_reusing_a_name_are_told_apart(tmp_path):
    job = FakeJob(4)
    job.group("7", "split", [0, 1])
    for _ in range(2):
        job.collective("all_reduce", [[8]], pg="7")
    job.write(tmp_path / "a", ranks=[0, 1])
    job2 = FakeJob(4)
    job2.group("7", "split", [2, 3])
    job2.collective("all_reduce", [[8]], pg="7")
    job2.collective("all_reduce", [[8]], pg="7", skip={3}, state="started")
    job2.write(tmp_path / "a", ranks=[2, 3])
    f = analyse(load_dumps(tmp_path / "a"))
    splits = sorted((g.ranks, g.missing_ranks) for g in f.groups if g.pg_name == "7")
    assert splits == [((0, 1), ()), ((2, 3), (3,))]


@pytest.mark.parametrize("version", ["2.0", "2.2", "2.3", "2.4", "2.7", "2.9", "2.10", "1.5"])
def test_every_format_version_reads_the_same(tmp_path, version):
    job = training(8, version=version)
    job.collective("all_reduce", [[4096]], skip={5}, state="started")
    job.write(tmp_path)
    traces = load_dumps(tmp_path)
    assert {t.version for t in traces} == {version}
    raw = pickle.loads((tmp_path / "nccl_trace_rank_0").read_bytes())
    assert ("seq_id" in raw["entries"][0]) == version.startswith("1.")
    f = analyse(traces)
    assert f.culprit_ranks == (5,) and group(f, "0").missing_ranks == (5,) and group(f, "0").seq == 6


def test_a_newer_format_is_read_by_name_with_a_note(tmp_path):
    job = FakeJob(2, version="3.1")
    job.collective("all_reduce", [[8]])
    job.write(tmp_path)
    f = analyse(load_dumps(tmp_path))
    assert any("3.1 is newer" in n for n in f.notes)
    assert group(f, "0").seq == 1


# --- hostile and broken files -----------------------------------------------------------------------

class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_a_pickle_with_a_reduce_payload_is_refused_without_running(tmp_path):
    target = tmp_path / "pwned"
    dump = FakeJob(2).dump(0)
    dump["entries"] = [_Payload(target)]
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(dump, protocol=2))
    with pytest.raises(FrDumpError, match=r"nccl_trace_rank_0: refused: it asks for io\.open"):
        load_dumps(tmp_path / "nccl_trace_rank_0")
    assert not target.exists()
    for payload in (pickle.dumps(_Payload(target)), b"cos\nsystem\n(S'touch " + str(target).encode() + b"'\ntR.",
                    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94."):
        (tmp_path / "x_rank_1").write_bytes(payload)
        with pytest.raises(FrDumpError, match="x_rank_1"):
            load_dump_file(tmp_path / "x_rank_1", 1)
    assert not target.exists()


def test_a_hostile_dump_among_good_ones_is_skipped_and_named(tmp_path):
    job = training(4)
    job.collective("all_reduce", [[4096]], skip={2}, state="started")
    job.write(tmp_path)
    (tmp_path / "nccl_trace_rank_3").write_bytes(pickle.dumps({"entries": [_Payload(tmp_path / "pwned")]}))
    traces = load_dumps(tmp_path)
    assert [t.rank for t in traces] == [0, 1, 2]
    assert [(s.rank, "refused" in s.reason) for s in traces.skipped] == [(3, True)]
    f = analyse(traces)
    assert any("nccl_trace_rank_3: refused" in n for n in f.notes)
    g = group(f, "0")
    assert g.no_dump_ranks == (3,) and g.missing_ranks == (2,)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_mangled_dumps_never_crash_the_reader_or_the_analysis(tmp_path):
    """Any field of any entry, or the top-level keys, replaced by anything plain data can hold: the
    reader skips the file with a reason or reads it, and the analysis always answers."""
    import random

    rng = random.Random(19)
    values = [None, -1, 0, 10**30, -(10**18), "x", "", [], {}, [[1, "a"]], [[-5, 2**40]], 3.5, True, b"raw", ("a",),
              [["x"]], {"a": 1}, ["nccl:all_reduce"], ("0",), ("0", "default_pg", "extra"), "[0, 1, 2, 99999999]"]
    job = training(4, steps=3)
    job.collective("all_reduce", [[4096]], skip={1}, state="started")
    answered = skipped = 0
    for i in range(250):
        d = tmp_path / str(i)
        d.mkdir()
        for r in range(4):
            dump = job.dump(r)
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.2:
                    dump[rng.choice(["entries", "pg_config", "pg_status", "version", "comm_lib_version"])] = rng.choice(values)
                elif isinstance(dump.get("entries"), list) and dump["entries"]:
                    entry = rng.choice(dump["entries"])
                    entry = dict(entry) if isinstance(entry, dict) and entry else {"profiling_name": entry}
                    key = rng.choice(sorted(entry))
                    if rng.random() < 0.3:
                        del entry[key]
                    else:
                        entry[key] = rng.choice(values)
                    dump["entries"] = [*dump["entries"][:-1], entry] if rng.random() < 0.5 else [entry, *dump["entries"]]
            (d / f"nccl_trace_rank_{rng.choice([r, r, r, 10**8 + r])}").write_bytes(pickle.dumps(dump, protocol=2))
        try:
            traces = load_dumps(d)
        except FrDumpError as e:
            assert str(d) in str(e)
            skipped += 1
            continue
        f = analyse(traces)
        assert isinstance(f.summary(), str)
        json.dumps(f.to_dict())
        answered += 1
    assert answered > 100 and skipped > 0


def _good(tmp_path: Path) -> bytes:
    job = FakeJob(2)
    job.collective("all_reduce", [[8]])
    return pickle.dumps(job.dump(0), protocol=2)


def test_broken_files_give_a_clear_error_naming_the_file(tmp_path):
    good = _good(tmp_path)
    entry = FakeJob(2).dump(0)
    bad_entries = {
        "truncated": good[: len(good) // 2],
        "random": b"\x80" + os.urandom(300),
        "empty": b"",
        "text": b"hello, this is a log\n",
        "zip": b"PK\x03\x04" + b"\0" * 40,
        "json-broken": b'{"entries": [',
        "json-deep": b"[" * 200_000,
        "json-list": b"[1, 2]",
        "json-bigint": b'{"entries": [], "version": ' + b"9" * 5000 + b"}",
        "list": pickle.dumps([1, 2, 3]),
        "dict-of-nothing": pickle.dumps({"hello": 1}),
        "entry-not-dict": pickle.dumps({**entry, "entries": ["nccl:all_reduce"]}),
        "sizes-not-list": pickle.dumps({**entry, "entries": [{"profiling_name": "nccl:all_reduce", "collective_seq_id": 1,
                                                              "process_group": ("0", "default_pg"), "input_sizes": "64"}]}),
        "no-seq": pickle.dumps({**entry, "entries": [{"profiling_name": "nccl:all_reduce",
                                                      "process_group": ("0", "default_pg")}]}),
        "gzip-broken": b"\x1f\x8b\x08\x00" + b"\xff" * 50,
    }
    for name, data in bad_entries.items():
        p = tmp_path / f"{name}_rank_0"
        p.write_bytes(data)
        with pytest.raises(FrDumpError) as e:
            load_dumps(p)
        assert str(e.value).startswith(str(p) + ":"), name
        assert "\n" not in str(e.value), name


def test_size_bounds(tmp_path):
    job = FakeJob(2)
    for _ in range(50):
        job.collective("all_reduce", [[8]])
    data = pickle.dumps(job.dump(0), protocol=2)
    (tmp_path / "a_rank_0").write_bytes(data)
    with pytest.raises(FrDumpError, match="larger than"):
        load_dumps(tmp_path / "a_rank_0", FrLimits(max_file_bytes=len(data) - 1))
    # a gzip bomb: a few KB that inflate past the bound
    (tmp_path / "bomb_rank_0.gz").write_bytes(gzip.compress(b"\x80\x02" + b"N" * (8 << 20)))
    assert (tmp_path / "bomb_rank_0.gz").stat().st_size < 64 << 10
    with pytest.raises(FrDumpError, match="larger than 1 MiB"):
        load_dumps(tmp_path / "bomb_rank_0.gz", FrLimits(max_file_bytes=1 << 20))
    with pytest.raises(FrDumpError, match="50 entries, more than the 10"):
        load_dumps(tmp_path / "a_rank_0", FrLimits(max_entries_per_file=10))
    kept = load_dumps(tmp_path / "a_rank_0", FrLimits(keep_entries_per_rank=20))[0]
    assert len(kept.entries) == 20 and kept.entries_dropped == 30 and kept.entries[-1].seq == 50
    job.write(tmp_path / "dir")
    with pytest.raises(FrDumpError, match="2 dump files, more than the 1"):
        load_dumps(tmp_path / "dir", FrLimits(max_files=1))
    with pytest.raises(FrDumpError, match="MiB of dumps"):
        load_dumps(tmp_path / "dir", FrLimits(max_total_bytes=100))
    for r in range(2):  # small files, large dumps
        (tmp_path / "gz" / f"nccl_trace_rank_{r}.gz").parent.mkdir(exist_ok=True)
        (tmp_path / "gz" / f"nccl_trace_rank_{r}.gz").write_bytes(gzip.compress(data))
    with pytest.raises(FrDumpError, match="MiB of dumps once gunzipped"):
        load_dumps(tmp_path / "gz", FrLimits(max_total_bytes=len(data) + 10))
    dropped = load_dumps(tmp_path / "dir", FrLimits(keep_entries_per_rank=16))
    assert any("newest 16 entries" in n for n in dropped.notes)
    # shared references: a small pickle whose lists point at one list many times stays small in work
    big = {"version": "2.10", "pg_config": {}, "entries": [{"profiling_name": "nccl:all_reduce", "collective_seq_id": 1,
           "process_group": ("0", "default_pg"), "input_sizes": [[1] * 10_000] * 10_000,
           "frames": [{"name": "f", "filename": "x.py", "line": 1}] * 100_000}] * 1000}
    (tmp_path / "shared_rank_0").write_bytes(pickle.dumps(big, protocol=2))
    t = load_dumps(tmp_path / "shared_rank_0")[0]
    assert len(t.entries[0].frames) == 64 and len(t.entries[0].input_sizes) == 256
    assert len(t.entries[0].input_sizes[0]) == 16


def test_directory_layouts(tmp_path):
    job = training(4)
    job.collective("all_reduce", [[4096]], skip={1}, state="started")
    # per-node subdirectories, gzipped, with a README and torch's own report beside them
    for r in range(4):
        sub = tmp_path / "dumps" / f"node-{r // 2}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"nccl_trace_rank_{r}.gz").write_bytes(gzip.compress(pickle.dumps(job.dump(r), protocol=2)))
    (tmp_path / "dumps" / "README").write_text("dumps of job 4711\n")
    (tmp_path / "dumps" / "fr_trace_out.txt").write_text("...\n")
    (tmp_path / "dumps" / ".hidden_rank_9").write_bytes(b"junk")
    traces = load_dumps(tmp_path / "dumps")
    assert [t.rank for t in traces] == [0, 1, 2, 3]
    assert traces.notes == [f"2 other files under {tmp_path / 'dumps'} ignored (dumps read: nccl_trace_rank_*)"]
    assert analyse(traces).culprit_ranks == (1,)
    # the same rank twice: two jobs' dumps mixed
    (tmp_path / "dumps" / "node-1" / "nccl_trace_rank_0.gz").write_bytes(b"x")
    with pytest.raises(FrDumpError, match="two dumps for rank 0"):
        load_dumps(tmp_path / "dumps")
    with pytest.raises(FrDumpError, match="no such file"):
        load_dumps(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(FrDumpError, match="no flight-recorder dumps"):
        load_dumps(tmp_path / "empty")
    (tmp_path / "trace.pkl").write_bytes(pickle.dumps(job.dump(0), protocol=2))
    with pytest.raises(FrDumpError, match="cannot tell the rank"):
        load_dumps(tmp_path / "trace.pkl")
    bad_only = tmp_path / "bad"
    bad_only.mkdir()
    (bad_only / "nccl_trace_rank_0").write_bytes(b"\x80\x02garbage")
    with pytest.raises(FrDumpError, match="none of the 1 dump files could be read"):
        load_dumps(bad_only)


def test_uploaded_dumps_read_from_bytes(tmp_path):
    job = training(4)
    job.collective("all_reduce", [[4096]], skip={2}, state="started")
    uploads = [(f"fr/nccl_trace_rank_{r}.gz", gzip.compress(pickle.dumps(job.dump(r), protocol=2))) for r in range(4)]
    f = analyse(DumpSet(load_dump_bytes(name, data) for name, data in uploads))
    assert f.culprit_ranks == (2,)
    assert load_dump_bytes("upload", json.dumps(job.dump_json(3)).encode(), rank=3).rank == 3
    with pytest.raises(FrDumpError, match="^upload: cannot tell the rank"):
        load_dump_bytes("upload", uploads[0][1])
    with pytest.raises(FrDumpError, match=r"^evil_rank_0: refused"):
        load_dump_bytes("evil_rank_0", pickle.dumps({"entries": [_Payload(tmp_path / "pwned")]}))
    with pytest.raises(FrDumpError, match="^big_rank_0: larger than"):
        load_dump_bytes("big_rank_0", uploads[0][1], FrLimits(max_file_bytes=1000))
    with pytest.raises(FrDumpError, match="^e_rank_0: empty"):
        load_dump_bytes("e_rank_0", b"")
    assert not (tmp_path / "pwned").exists()


def test_rank_of_and_ranges():
    assert rank_of("nccl_trace_rank_17") == ("nccl_trace_rank_", 17)
    assert rank_of("fr_rank_3.json.gz") == ("fr_rank_", 3)
    assert rank_of("trace12.pkl") == ("trace", 12)
    assert rank_of("README") is None
    assert rank_ranges([7, 0, 1, 2, 3, 5, 8]) == "0-3,5,7-8"
    assert rank_ranges([]) == ""


# --- torch's fr_trace text ----------------------------------------------------------------------------

def test_fr_trace_text_of_torch_2_13():
    text = (FIXTURES / "fr_trace_torch2.13.txt").read_text()
    f = parse_fr_trace_text(text)
    assert f.source == "fr_trace" and f.culprit_ranks == (9,)
    tp3, tp1 = group(f, "3"), group(f, "1")
    assert (tp3.pg_desc, tp3.seq, tp3.stuck_op, tp3.missing_ranks) == ("tp", 7, "nccl:_all_gather_base", (9,))
    assert tp3.ranks == (8, 9, 10, 11) and tp3.waiting_ranks == (8, 10, 11)
    assert tp3.input_sizes == ((512,),) and tp3.output_sizes == ((2048,),)
    assert tp3.stack[0].name == "all_gather_into_tensor" and tp3.stack[-1].name == "<module>"
    assert tp1.mismatch_ranks == (2,) and tp1.mismatch_seq == 7
    assert tp1.mismatch.startswith("at #7 nccl:_all_gather_base: rank 2 (COLLECTIVE_TYPE_MISMATCH): Expected collective")
    assert tp3.summary() == "pg 3 (tp): ranks 8,10-11 wait in nccl:_all_gather_base #7; rank 9 never entered it"


def test_fr_trace_text_inside_a_log_with_prefixes():
    text = (FIXTURES / "fr_trace_torch2.13.txt").read_text()
    log = "\n".join(["[2025-01-07 03:12:44] job 4711 hung, running torchfrtrace",
                     *(f"node-3 [rank0]: {line}" for line in text.splitlines()),
                     "[2025-01-07 03:13:02] done"])
    assert parse_fr_trace_text(log).summary() == parse_fr_trace_text(text).summary()
    assert parse_fr_trace_text(iter(log.splitlines())).summary() == parse_fr_trace_text(text).summary()


def test_fr_trace_text_of_older_torch():
    torch_2_5 = """\
Not all ranks joining collective 5 at entry 4
group info: 0:default_pg
collective: nccl:all_reduce
missing ranks: {1}
input sizes: [[3, 4]]
output sizes: [[3, 4]]
expected ranks: 2
collective state: scheduled
collective stack trace:
 all_reduce at /opt/conda/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py:2288
wrapper at /opt/conda/lib/python3.10/site-packages/torch/distributed/c10d_logger.py:79
<module> at /home/me/crash.py:44
Collective 12 at entry 40 errors
group info: 2:mesh_tp
collective: nccl:broadcast
input sizes: [[1024]]
output sizes: [[1024]]
expected ranks: 4
collective state: scheduled
error message: Culprit rank 6; MatchState.SIZE_OR_SYNTAX_MISMATCH
collective stack trace:
"""
    f = parse_fr_trace_text(torch_2_5)
    g0, g2 = group(f, "0"), group(f, "2")
    assert (g0.seq, g0.missing_ranks, g0.stuck_op, g0.input_sizes) == (5, (1,), "nccl:all_reduce", ((3, 4),))
    assert g0.stack[-1].filename == "/home/me/crash.py"
    assert g2.pg_desc == "mesh_tp" and g2.mismatch_ranks == (6,) and "SIZE_OR_SYNTAX_MISMATCH" in g2.mismatch
    first = ("Not all ranks joining collective for group 0:default_pg collective nccl:all_reduce "
             "Missing ranks are {3, 7} [[1024]] [[1024]] 8 scheduled \n"
             "Collective errors for group 1:tp collective nccl:all_gather Found errors: COLLECTIVE_TYPE_MISMATCH\n")
    f = parse_fr_trace_text(first)
    assert group(f, "0").missing_ranks == (3, 7) and group(f, "0").input_sizes == ((1024,),)
    assert "COLLECTIVE_TYPE_MISMATCH" in group(f, "1").mismatch


def test_fr_trace_state_mismatch_and_missing_dumps():
    text = """\
Collective sequence number: 4 has errors
internal record id: 3
group info: 0:default_pg
collective: nccl:all_reduce
world size: 4
expected ranks: {0, 1, 2, 3}
collective state: started
error msg: Culprit rank 2; Error type: COLLECTIVE_STATE_MISMATCH, Expected state: 'started' does not match found state: 'scheduled'
We cannot decide what's wrong with this collective entry because we missed FR dumps from ranks ({6, 7}) so we don't have enough information.
"""
    f = parse_fr_trace_text(text)
    g = f.groups[0]
    assert g.not_started_ranks == (2,) and g.mismatch is None and g.stuck
    assert "fr_trace had no dumps from ranks 6-7" in f.notes
    assert parse_fr_trace_text("an ordinary log line\ncollective: nccl:all_reduce\n").groups == []


# --- the command -----------------------------------------------------------------------------------------

def test_command_on_dumps_text_and_bad_input(tmp_path, capsys, monkeypatch):
    assert main([str(GLOO / "hang")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 5 outside every collective")
    assert main([str(GLOO / "hang"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit_ranks"] == [5]
    assert main([str(FIXTURES / "fr_trace_torch2.13.txt")]) == 0
    assert "rank 9 never entered it" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO((FIXTURES / "fr_trace_torch2.13.txt").read_text()))
    assert main(["-"]) == 0
    assert "rank 9" in capsys.readouterr().out
    (tmp_path / "job.log").write_text("step 10 loss 2.3\n")
    (tmp_path / "evil_rank_0").write_bytes(pickle.dumps({"entries": [_Payload(tmp_path / "pwned")]}))
    for bad in (tmp_path / "job.log", tmp_path / "evil_rank_0", tmp_path / "missing"):
        assert main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("logdx.flightrec: ") and err.count("\n") == 1 and str(bad) in err
    assert not (tmp_path / "pwned").exists()


# --- torch itself ----------------------------------------------------------------------------------------

TORCHFRTRACE = Path(sys.executable).with_name("torchfrtrace")


def _torch_fr_trace(d: Path) -> str:
    r = subprocess.run([str(TORCHFRTRACE), str(d)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stderr + r.stdout


@pytest.mark.integration
def test_torch_fr_trace_reads_our_dumps_and_agrees(tmp_path):
    scenarios = {}
    job = training(8)
    job.collective("_all_gather_base", [[256]], pg="2", out_sizes=[[1024]], dtype="BFloat16", skip={6}, state="started")
    scenarios["hang"] = job
    job = training(4)
    job.collective("all_reduce", [[4096]], by_rank={2: {"op": "all_gather", "out_sizes": [[16384]]}}, state="started")
    scenarios["type"] = job
    job = training(4)
    job.collective("all_reduce", [[4096]], by_rank={1: {"sizes": [[8]], "out_sizes": [[8]]}}, state="started")
    scenarios["size"] = job
    job = training(8)
    job.collective("all_reduce", [[4096]], skip={5}, state="started")
    job.collective("all_reduce", [[8]], skip={5, 3}, state="scheduled")
    scenarios["run-ahead"] = job
    for name, job in scenarios.items():
        job.write(tmp_path / name)
        ours = analyse(load_dumps(tmp_path / name))
        theirs = parse_fr_trace_text(_torch_fr_trace(tmp_path / name))
        assert theirs.groups, name
        for g in theirs.groups:
            mine = next(x for x in ours.groups if x.pg_name == g.pg_name)
            assert (g.seq, g.missing_ranks) == (mine.seq, mine.missing_ranks), name
            assert g.mismatch_ranks == mine.mismatch_ranks, name
        assert theirs.culprit_ranks == ours.culprit_ranks, name
    json_dir = tmp_path / "json"
    scenarios["hang"].write(json_dir, fmt="json")
    assert analyse(load_dumps(json_dir)).culprit_ranks == (6,)


@pytest.mark.integration
@pytest.mark.slow
def test_a_live_gloo_job_hangs_and_its_dumps_name_the_rank(tmp_path):
    """Runs the 8-rank gloo job that made the fixtures: what torch writes today reads as they do."""
    out = tmp_path / "hang"
    r = subprocess.run([sys.executable, str(FIXTURES / "gloo_job.py"), "hang", "8", str(out)], timeout=900)
    assert r.returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [f"nccl_trace_rank_{i}" for i in range(8)]
    live, fixture = analyse(load_dumps(out)), analyse(load_dumps(GLOO / "hang"))
    assert live.culprit_ranks == (5,)
    assert sorted(g.summary() for g in live.groups) == sorted(g.summary() for g in fixture.groups)
    shutil.rmtree(out)
