"""PyTorch flight-recorder dumps, read for hang diagnosis.

When a distributed job hangs, PyTorch's flight recorder holds, on every rank, the last collectives
it entered (a ring buffer of `TORCH_FR_BUFFER_SIZE`, formerly `TORCH_NCCL_TRACE_BUFFER_SIZE`,
entries). With `TORCH_NCCL_DUMP_ON_TIMEOUT=1` the NCCL watchdog writes it, on a collective timeout,
to `<prefix><rank>` (`TORCH_FR_DUMP_TEMP_FILE`, formerly `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`; default
`/tmp/nccl_trace_rank_`); `torch._C._distributed_c10d._dump_fr_trace()` returns the same bytes on
demand (any backend that records, gloo included), `_dump_fr_trace_json()` the JSON form (also served
by torch's debug server at `/fr_trace_json`). Dumps written with `TORCH_INCLUDE_ONLY_ACTIVE=1` hold
only unfinished entries: they read the same (a rank with nothing pending has no record there).

    from logdx.flightrec import analyse, load_dumps
    findings = analyse(load_dumps("/shared/fr-dumps/job-4711"))
    print(findings.summary())
    # rank 17 outside every collective while the others wait: the silent rank of the hang
    # pg 0 (default_pg): ranks 0-16,18-63 wait in nccl:all_reduce #7097; rank 17 never entered it
    #   (its last: nccl:all_reduce #7096 completed)

- `load_dumps(path)`: a directory of per-rank dumps (or one file), pickle or JSON, gzipped or not,
  any format version torch has written (1.x `seq_id` dumps through 2.10). Pickles are read by a
  refusing unpickler: a dump is plain data, and a pickle that asks for any callable (a
  `__reduce__` payload) is refused before anything runs. Sizes and counts are bounded (`FrLimits`).
  Unreadable files in a directory are skipped and listed (`DumpSet.skipped`); a bad single file, or
  a directory where nothing reads, raises `FrDumpError` with the file and the reason.
  `load_dump_bytes(name, data)` reads one uploaded dump the same way (assemble a `DumpSet`).
- `analyse(traces)` -> `FrFindings`: per process group (`PgFindings`) the collective it stands at
  (`seq`: the first that not every rank entered, since CPUs enqueue ahead of their GPUs; `max_seq`
  the highest any rank reached), its operation and sizes (`stuck_op`, `input_sizes`), the ranks
  that never entered it (`missing_ranks`, with each one's last collective), the ranks waiting in
  it, the earliest desync (`mismatch`: different operations, sizes or dtypes at one sequence
  number), pending point-to-point operations; over all groups, the ranks missing from a stuck
  collective that wait in none (`culprit_ranks`). `summary()` gives the lines to read.
- `parse_fr_trace_text(text)` -> `FrFindings`: the same findings from the text of torch's own
  analyser (`torchfrtrace` / `python -m torch.distributed.flight_recorder.fr_trace`), in all the
  shapes it has printed, when a user pastes its output into a log.
- `FakeJob` (`logdx.flightrec.synth`): dumps of a simulated job in torch's exact layout, for tests.

From a shell: `python -m logdx.flightrec DIR_OR_FILE [--json]` prints the findings; a file that is
not a dump is read as `fr_trace` output. Exit 0 with findings, 2 on input it cannot read."""

from __future__ import annotations

from logdx.flightrec.analyse import analyse
from logdx.flightrec.frtext import parse_fr_trace_text
from logdx.flightrec.load import load_dump_bytes, load_dump_file, load_dumps
from logdx.flightrec.model import (
    DumpSet,
    Frame,
    FrDumpError,
    FrEntry,
    FrFindings,
    FrLimits,
    PgConfig,
    PgFindings,
    RankTrace,
    Skipped,
)

__all__ = [
    "DumpSet", "FrDumpError", "FrEntry", "FrFindings", "FrLimits", "Frame", "PgConfig", "PgFindings", "RankTrace",
    "Skipped", "analyse", "load_dump_bytes", "load_dump_file", "load_dumps", "parse_fr_trace_text",
]
