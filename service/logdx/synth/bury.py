"""Bury real failure lines in a long, healthy multi-rank job, followed by its cascade.

    from logdx.synth.bury import bury
    with open("buried.log", "w", encoding="utf-8", errors="surrogateescape") as out:
        truth = bury(real_lines, out, seed=1, ranks=64, lines=30000, style="torchrun")
    truth.root_line_no_for("OSError: [Errno 28] No space left on device")  # -> 1-based line number

or ``python -m logdx.synth.bury real.log -o buried.log --seed 1 [--style srun] [--truth t.json]``.

Real failure excerpts (a few lines pasted in an issue thread) are short; real jobs bury such lines
under tens of thousands of others from many ranks, then under the symptoms of the rest of the job.
``bury`` writes exactly that, reusing the generator's machinery:

1. a healthy job (``make_job``, launcher start-up, framework banner, NCCL init, training steps with
   harmless noise) of about ``lines`` lines in total;
2. the failure window: the real lines, in their order, as one rank (``culprit_rank``) prints them,
   while the other ranks print their progress line of the step in progress and the odd warning,
   so that the real lines (a traceback...) are interleaved line by line with other ranks' lines;
3. with ``cascade``, the cascade (``cascade.py``): sometimes (from the seed) the culprit's NCCL ring
   neighbours on other nodes notice within seconds that it is gone (``NCCL WARN socketProgress:
   Connection closed by remote peer``, then their watchdog aborts on ``ncclRemoteError``); the other
   ranks' NCCL watchdog timeouts, some seconds to minutes after the failure; then the launchers'
   reaction (torchrun's ``Sending process N closing signal SIGTERM`` and ``ChildFailedError`` box,
   DeepSpeed/pdsh or srun messages such as ``srun: error: ...: Terminated``). Every cascade line is
   stamped after the first real line; the culprit's host launcher may already react while the real
   lines are still being written;
4. sometimes (from the seed) a few harmless lines after all that (wandb finishing its upload).

``realism=True`` adds what real multi-node jobs print and run past (``noise.Realism``: the c10d store's
connect-refused retries at start-up, retried downloads, IB port flaps, fp16 overflow skips...);
``phase`` buries the lines where the failure happens: ``launch`` right after the launchers and the
rendezvous (import, syntax, argument errors), ``startup`` after the framework's banner (environment,
version errors), both before NCCL and training and without watchdog timeouts (nobody is in a
collective yet); ``training`` (the default) after hours of training;
``healthy=True`` is for excerpts of runs that went on: no cascade, training resumes after the real
lines and the job ends well (``BuriedTruth.exit_code`` 0).

Prefixes of the real lines (``prefix_real``; when False every real line is written bare)
    * a line that already starts with a torchrun prefix (``[rank12]:``, ``[default0]:[rank12]:``) keeps
      it and only gets the outer, node-level part of the style's prefix (``1: `` for srun_torchrun,
      ``node-03: `` for pdsh styles, `` 12: `` for srun; nothing for torchrun / torchrun_tee);
    * kernel and Slurm / pdsh lines stay bare, as collected (``NVRM:``, ``... kernel: ...``, dmesg
      ``[  123.4]`` / ``[Mon ...]`` stamps, ``slurmstepd:``, ``srun:``, ``pdsh@``, ``salloc:``);
    * launcher lines (torch.distributed.elastic, ``Sending process N closing signal``,
      ``ChildFailedError``, DeepSpeed ``launch.py`` / ``runner.py``) get the launcher prefix of the
      culprit's node (none for torchrun, ``1: `` for srun_torchrun, ``node-03: `` for pdsh styles);
    * every other line gets the culprit rank's full prefix in the chosen style.
    Classification is per line (a launcher's multi-line traceback gets the rank prefix after its first
    line); keep it simple, it is a test harness. The text after the prefix is the real line, unchanged.

Time
    When the real lines carry a dated timestamp (ISO ``2023-04-29 06:01:12``, ctime ``Mon Nov 27
    10:39:24 2017``, or a year-less torch C++ / glog / syslog stamp), the whole job is shifted so that
    the failure happens at that moment (the healthy part before it, the cascade after it); real lines
    with later stamps are placed at their stamp (up to 6 hours after the first). Otherwise the job
    keeps its own date.

Culprit
    ``culprit_rank`` when given; else the rank named by the first torchrun prefix in the real lines
    (``[rank12]:``) if it exists in the job; else one chosen from the seed.

Everything is deterministic in the arguments: same arguments, same bytes.
"""

from __future__ import annotations

import argparse
import calendar
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TextIO

from logdx.synth.cascade import Fate, end_job, time_out_survivors, watchdog_abort
from logdx.synth.generate import check_job_shape, make_job
from logdx.synth.job import Job
from logdx.synth.longjob import expected_steps
from logdx.synth.noise import new_realism
from logdx.synth.scenarios import _NCCL_ERROR_FRAMES
from logdx.synth.sink import Burst
from logdx.synth.styles import STYLES
from logdx.synth.training import (
    NCCL_VERSION,
    finish_healthy,
    framework_startup,
    launcher_startup,
    nccl_init,
    noise_lines,
    train_until,
)

# -- classifying the real lines ---------------------------------------------------------------------

RANK = "rank"  # printed by the culprit rank: full rank prefix
PREFIXED = "prefixed"  # already carries a torchrun prefix: only the style's outer, node-level prefix
AGENT = "agent"  # printed by the node's launcher: the launcher prefix of the culprit's node
BARE = "bare"  # kernel, Slurm, pdsh: no prefix

_TORCHRUN_PREFIX = re.compile(r"^(?:\[default\d+\]:)?\[rank(\d+)\]:|^\[default\d+\]:")
_BARE = re.compile(
    r"NVRM: |^\w{3} [ \d]\d \d\d:\d\d:\d\d \S+ kernel: |^\S+ kernel: |^\[\s*\+?\d+\.\d+\] |"
    r"^\[\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\] |^(?:slurmstepd|srun|salloc|sbatch)(?:\[\d+\])?: |^pdsh@"
)
_AGENT = re.compile(
    r"torch\.distributed\.elastic|torch/distributed/elastic/|Sending process \d+ closing signal|ChildFailedError|"
    r"\[launch\.py:\d+|\[runner\.py:\d+|deepspeed\.launcher"
)


def classify(line: str) -> str:
    """Who would have printed ``line`` in a merged multi-rank log (see the module docstring)."""
    if _TORCHRUN_PREFIX.match(line):
        return PREFIXED
    if _BARE.search(line):
        return BARE
    if _AGENT.search(line):
        return AGENT
    return RANK


def _culprit_from_prefixes(lines: list[str], world_size: int) -> int | None:
    for line in lines:
        m = _TORCHRUN_PREFIX.match(line)
        if m and m.group(1) is not None and int(m.group(1)) < world_size:
            return int(m.group(1))
    return None


def _outer_prefix(job: Job, rank: int) -> str:
    """The node-level part of the style's prefix (what wraps a line torchrun already prefixed)."""
    style = job.style.name
    if style in ("torchrun", "torchrun_tee"):
        return ""
    if style in ("srun", "pdsh", "mpirun"):
        return job.prefixes[rank]
    return job.agent_prefixes[job.cluster.host_index(rank)]  # srun_torchrun, pdsh_torchrun


# -- timestamps in the real lines ----------------------------------------------------------------------

_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                                       "Dec"), start=1)}
_ISO = re.compile(r"(?<!\d)(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
_CTIME = re.compile(r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d{1,2}) "
                    r"(\d\d):(\d\d):(\d\d) (\d{4})")
_C10 = re.compile(r"(?:^|\[|\]:)[EWIF](\d{3,4}) (\d\d):(\d\d):(\d\d)\.(\d{6,9})")
_SYSLOG = re.compile(r"^(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d{1,2}) (\d\d):(\d\d):(\d\d) ")


def _epoch(year: int, month: int, day: int, hh: int, mm: int, ss: int, frac: str | None = None) -> float | None:
    try:
        t = calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0))
        time.gmtime(t)
    except (ValueError, OverflowError):
        return None
    if not (1 <= month <= 12 and 1 <= day <= 31 and hh < 24 and mm < 60 and ss < 61):
        return None
    return t + (int(frac) / 10 ** len(frac) if frac else 0.0)


def line_time(line: str, year: int) -> float | None:
    """The epoch of the first recognised timestamp in ``line`` (``year`` for year-less stamps)."""
    if m := _ISO.search(line):
        y, mo, d, hh, mi, ss = (int(g) for g in m.groups()[:6])
        return _epoch(y, mo, d, hh, mi, ss, m.group(7))
    if m := _CTIME.search(line):
        return _epoch(int(m.group(6)), _MONTHS[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)),
                      int(m.group(5)))
    if m := _C10.search(line):
        md = m.group(1)
        return _epoch(year, int(md[:-2]), int(md[-2:]), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                      m.group(5))
    if m := _SYSLOG.match(line):
        return _epoch(year, _MONTHS[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)))
    return None


# -- ground truth -------------------------------------------------------------------------------------


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@dataclass(slots=True)
class BuriedTruth:
    """Where the real lines landed and how the job around them was made."""

    line_map: dict[int, int]  # original line index (0-based) -> line number in the output (1-based)
    prefixes: dict[int, str]  # original line index -> the prefix written in front of it ("" for none)
    real_lines: list[str]  # the real lines as given
    culprit_rank: int
    culprit_host: str
    style: str
    flavour: str
    seed: int
    ranks: int
    hosts: list[str] = field(default_factory=list)
    prefix_real: bool = True
    cascade: bool = True
    lines_written: int = 0
    failure_time: float = 0.0  # epoch seconds of the first real line
    anchored: bool = False  # the job's clock was set from a timestamp in the real lines
    window_lines: int = 0  # lines of other ranks / launchers written from the failure on (cascade included)
    exit_code: int | None = None  # what the launcher returned: 0 for a healthy burial, else 1
    families: list[str] = field(default_factory=list)  # the harmless noise families of ``realism``

    @property
    def failure_line_no(self) -> int:
        """Line number of the first real line."""
        return self.line_map[0]

    def original_indices_for(self, text: str) -> list[int]:
        """Indices of the real lines that ``text`` names: equal lines, else equal after squashing
        whitespace, else lines containing it (labels sometimes quote part of a line)."""
        want = _squash(text)
        if not want:
            return []
        for same in (lambda line: line == text, lambda line: _squash(line) == want, lambda line: want in _squash(line)):
            found = [i for i, line in enumerate(self.real_lines) if same(line)]
            if found:
                return found
        return []

    def root_line_nos_for(self, original_root_text: str) -> list[int]:
        """Output line numbers of every buried copy of the line ``original_root_text`` names."""
        return [self.line_map[i] for i in self.original_indices_for(original_root_text)]

    def root_line_no_for(self, original_root_text: str) -> int | None:
        """Output line number of the first buried copy of that line; None when no real line matches."""
        nos = self.root_line_nos_for(original_root_text)
        return nos[0] if nos else None

    def original_index_at(self, line_no: int) -> int | None:
        """The real line written at output line ``line_no``, if one was."""
        for i, no in self.line_map.items():
            if no == line_no:
                return i
        return None

    def strip_prefix(self, line_no: int, text: str) -> str:
        """``text`` (a line of the output, or what a report quotes of it) without the prefix that
        ``bury`` added at ``line_no``; unchanged when that line is not a real one."""
        i = self.original_index_at(line_no)
        if i is not None and self.prefixes[i] and text.startswith(self.prefixes[i]):
            return text[len(self.prefixes[i]):]
        return text

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["line_map"] = {str(k): v for k, v in self.line_map.items()}
        d["prefixes"] = {str(k): v for k, v in self.prefixes.items()}
        return d


# -- writing --------------------------------------------------------------------------------------------


class _Null:
    def write(self, _text: str) -> int:
        return 0


_SALT = "bury"
_MAX_STAMP_SPAN_S = 6 * 3600.0


def _check_bury_args(real_lines: list[str], phase: str, style: str, flavour: str, ranks: int, gpus_per_host: int,
                     culprit_rank: int | None) -> None:
    if phase not in ("training", "startup", "launch"):
        raise ValueError("phase must be 'training', 'startup' or 'launch'")
    if not real_lines:
        raise ValueError("nothing to bury: real_lines is empty")
    if any("\n" in line for line in real_lines):
        raise ValueError("real_lines must be single lines (no '\\n')")
    check_job_shape(style, flavour, ranks, gpus_per_host)
    if culprit_rank is not None and not 0 <= culprit_rank < ranks:
        raise ValueError(f"culprit_rank must be in [0, {ranks})")


def _cascade(job: Job, burst: Burst, real_lines: list[str], culprit_rank: int, t0: float, t_end: float,
             phase: str) -> None:
    """What follows the culprit's failure: peers notice, the survivors time out, the launchers reap."""
    rng = job.rng
    fates = {culprit_rank: Fate(t_end + rng.uniform(0.01, 0.3), _exitcode(real_lines))}
    if phase == "training":  # at start-up nobody is in a collective yet: the launchers just reap
        if rng.random() < 0.5:
            _peers_notice(job, burst, fates, culprit_rank)
        timeout_s = job.nccl_timeout_ms / 1000.0
        if rng.random() < 0.5:  # the others have waited in the collective for a while already
            t_stuck = t0 - rng.uniform(0.0, 0.97) * timeout_s
        else:  # they enter the collective the culprit never joins just after it fails
            t_stuck = t0 + rng.uniform(0.0, 0.5)
        time_out_survivors(job, burst, fates, t_stuck, job.seq + 1)
    end_job(job, burst, fates)


def bury(
    real_lines: list[str],
    out: TextIO,
    *,
    seed: int,
    ranks: int = 64,
    lines: int = 30000,
    style: str = "torchrun",
    culprit_rank: int | None = None,
    prefix_real: bool = True,
    cascade: bool = True,
    gpus_per_host: int = 8,
    flavour: str = "auto",
    noise: float = 1.0,
    realism: bool = False,
    phase: str = "training",
    healthy: bool = False,
    nccl_debug: bool = True,
    without: frozenset[str] = frozenset(),
) -> BuriedTruth:
    """Write a healthy ``ranks``-rank job of about ``lines`` lines to ``out`` with ``real_lines`` as its
    failure (see the module docstring); return where every real line landed.

    ``realism`` adds the harmless output of real multi-node jobs (``noise.Realism``: c10d store retries
    at start-up, retried downloads, IB port flaps, overflow skips...). ``phase="startup"`` buries the
    lines where start-up failures happen (after the launchers and the rendezvous, before training).
    ``healthy`` is for excerpts of runs that went on: no cascade; training resumes after the real lines
    and the job ends well (exit code 0). ``nccl_debug=False`` leaves out the NCCL INFO init lines;
    ``without`` leaves the named noise families out (to measure what one of them costs)."""
    _check_bury_args(real_lines, phase, style, flavour, ranks, gpus_per_host, culprit_rank)
    if healthy:
        cascade = False
    real_lines = list(real_lines)
    kinds = [classify(line) if prefix_real else BARE for line in real_lines]
    args = dict(name=_SALT, seed=seed, ranks=ranks, gpus_per_host=gpus_per_host, lines=lines, style=style,
                noise=noise, flavour=flavour)
    budget = lines - len(real_lines) - (_cascade_estimate(ranks, gpus_per_host) if cascade else 0)
    if healthy:
        budget = int(budget * 0.6)  # the run goes on after the real lines
    part = dict(realism=realism, phase=phase, nccl_debug=nccl_debug, lines=lines, without=without)

    # Pass 1 (no output): when does the failure strike on the job's own clock? Then shift the clock
    # so that it strikes when the real lines say. Both passes draw the same random numbers.
    probe = make_job(_Null(), **args)  # type: ignore[arg-type]
    t0_own = _healthy_part(probe, budget, **part)  # type: ignore[arg-type]
    year = time.gmtime(t0_own).tm_year
    stamps = [line_time(line, year) for line in real_lines]
    anchor = next((s for s in stamps if s is not None), None)
    shift = anchor - t0_own if anchor is not None else 0.0

    job = make_job(out, **args)  # type: ignore[arg-type]
    job.now += shift
    t0 = _healthy_part(job, budget, **part)  # type: ignore[arg-type]
    c = job.cluster
    if culprit_rank is None:
        culprit_rank = _culprit_from_prefixes(real_lines, c.world_size)
    if culprit_rank is None:
        culprit_rank = job.rng.randrange(c.world_size)
    rng = job.rng
    lines_before = job.sink.count

    burst = job.burst()
    # The real lines, on one monotone clock: a traceback pours out in milliseconds; some ranks print
    # their error blocks over seconds (and then the launcher reacts while they still print).
    slow = rng.random() < 0.3
    p = job.rank_proc(burst, culprit_rank, t0)
    p.t = t0
    prefixes: dict[int, str] = {}
    t_prev = t0
    for i, (line, kind) in enumerate(zip(real_lines, kinds, strict=True)):
        if i:
            gap = rng.uniform(0.005, 0.2) if slow else rng.uniform(0.0003, 0.002)
            if slow and not line.strip():
                gap += rng.uniform(0.0, 2.0)
            t_prev = p.tick(gap)
        if anchor is not None and (stamp := stamps[i]) is not None and 0.0 <= stamp - anchor <= _MAX_STAMP_SPAN_S:
            p.t = t_prev = max(t_prev, t0 + stamp - anchor)
        prefix = {RANK: job.prefixes[culprit_rank], PREFIXED: _outer_prefix(job, culprit_rank),
                  AGENT: job.agent_prefixes[c.host_index(culprit_rank)], BARE: ""}[kind]
        prefixes[i] = prefix
        burst.add(t_prev, prefix + line, tag=i)
    t_end = t_prev

    # The rest of the job meanwhile: the other ranks print their progress line of the step in
    # progress (the culprit never gets there) and the odd warning, interleaving with the real lines.
    if phase == "training":  # (at start-up or launch nobody prints progress yet)
        job.begin_step()
        for rank in range(c.world_size) if job.flavour.per_rank_lines else ():
            if rank != culprit_rank and rng.random() < 0.85:
                t = t0 + rng.uniform(-0.01, 0.05) + 0.2 * rng.random() ** 2
                burst.add(t, job.prefixes[rank] + job.flavour.rank_line(job, rank, t))
    for _ in range(rng.randint(0, 4) if noise > 0 else 0):
        rank = rng.randrange(c.world_size)
        if rank != culprit_rank:
            t = t0 + rng.uniform(0.0, max(0.05, t_end - t0))
            q = job.rank_proc(burst, rank, t)
            for text in noise_lines(job, rank, q.t):
                q.say(text)

    if cascade:
        _cascade(job, burst, real_lines, culprit_rank, t0, t_end, phase)
    marks: dict[object, int] = {}
    job.now = burst.drain(job.sink, marks)
    if healthy:
        train_until(job, lines - 3 * ranks - 2 * c.n_hosts - 40)
        finish_healthy(job)
        if job.realism is not None:
            job.realism.at_finish(job)
    elif rng.random() < 0.5 and phase != "launch":  # wandb only runs once the script got going
        _epilogue(job)
    job.sink.flush()

    line_map = {i: marks[i] for i in range(len(real_lines))}
    return BuriedTruth(
        line_map=line_map,
        prefixes=prefixes,
        real_lines=real_lines,
        culprit_rank=culprit_rank,
        culprit_host=c.host(culprit_rank),
        style=style,
        flavour=job.flavour.name,
        seed=seed,
        ranks=ranks,
        hosts=list(c.hosts),
        prefix_real=prefix_real,
        cascade=cascade,
        lines_written=job.sink.count,
        failure_time=t0,
        anchored=anchor is not None,
        window_lines=job.sink.count - lines_before - len(real_lines),
        exit_code=0 if healthy else 1,
        families=sorted(job.realism.families) if job.realism is not None else [],
    )


def _cascade_estimate(ranks: int, gpus_per_host: int) -> int:
    """About how many lines the failure window and cascade take (to land near ``lines`` in total)."""
    return 30 * ranks + 30 * -(-ranks // gpus_per_host)


def _healthy_part(job: Job, budget: int, *, realism: bool = False, phase: str = "training", nccl_debug: bool = True,
                  lines: int = 0, without: frozenset[str] = frozenset()) -> float:
    """Start-up and training until about ``budget`` lines; returns when the failure strikes.
    Both passes of ``bury`` run it on identically seeded jobs: it must draw the same numbers."""
    job.nccl_debug = nccl_debug
    profile = new_realism(job, steps=expected_steps(job, lines), exclude=without) if realism else None
    if profile is not None:
        profile.at_begin(job)
    launcher_startup(job)
    if profile is not None:
        profile.at_launch(job)
    if phase == "launch":  # an import, syntax or argument error: the workers die as they start
        return job.now + job.rng.uniform(1.0, 20.0)
    framework_startup(job)
    if profile is not None:
        profile.at_startup(job)
    if phase == "startup":  # an environment or version error: after the banner, before NCCL and training
        return job.now + job.rng.uniform(1.0, 20.0)
    if nccl_debug:
        nccl_init(job)
    train_until(job, budget)
    # inside the next step, about when the other ranks print its progress line
    return job.now + job.step_ms * job.flavour.iters_per_step / 1000.0 * job.rng.uniform(0.9, 1.0)


def _peers_notice(job: Job, burst: Burst, fates: dict[int, Fate], culprit: int) -> None:
    """The culprit's NCCL neighbours on other nodes see its connections close and abort at once."""
    c, rng = job.cluster, job.rng
    n = c.world_size
    t_exit = fates[culprit].t
    peers = sorted({(culprit + d) % n for d in (-1, 1, rng.choice((-8, 8, 2, -2)))} - {culprit})
    for rank in peers:
        if c.host_index(rank) == c.host_index(culprit):
            continue  # local peers are the launcher's to kill
        p = job.rank_proc(burst, rank, t_exit + rng.uniform(0.2, 5.0))
        tid = job.nccl_tids[rank] + rng.randrange(40, 900)  # NCCL's proxy thread
        head = f"{c.host(rank)}:{c.worker_pids[rank]}:{tid} [{c.local_rank(rank)}]"
        closed = f"socketProgress: Connection closed by remote peer {c.host(culprit)}<{rng.randrange(32768, 61000)}>"
        p.say(f"{head} misc/socket.cc:49 NCCL WARN {closed}")
        p.say(f"{head} NCCL INFO misc/socket.cc:749 -> 6")
        p.say("")
        pg = f"[PG 0 (default_pg) Rank {rank}]" if job.new_torch else f"[Rank {rank}]"
        version = NCCL_VERSION.split("+")[0]
        what = [f"NCCL error: remote process exited or there was a network error, NCCL version {version}",
                "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
                "prematurely.", "Last error:", closed]
        p.tick(rng.uniform(0.1, 2.0))
        watchdog_abort(job, p, pg, what, "checkForNCCLErrorsInternal at ../torch/csrc/distributed/c10d/"
                       "ProcessGroupNCCL.cpp:1972", _NCCL_ERROR_FRAMES)
        fates[rank] = Fate(p.tick(0.05), -6)


def _exitcode(real_lines: list[str]) -> int:
    """How the culprit's process ended, as far as its lines tell (torchrun/srun print it)."""
    text = "\n".join(real_lines)
    if re.search(r"oom_kill|OOM Killed|Out of memory: Killed process", text):
        return -9
    if re.search(r"terminate called|Aborted|core dumped|watchdog thread terminated", text):
        return -6
    return 1


def _epilogue(job: Job) -> None:
    """Harmless lines after the job has died: wandb finishing its upload from rank 0's process."""
    rng = job.rng
    run_id = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
    prefix = job.prefixes[0]
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(job.now))
    for text in ("wandb: Waiting for W&B process to finish... (failed 1). Press Control-C to abort syncing.",
                 f"wandb: - {rng.uniform(0.01, 0.5):.3f} MB of {rng.uniform(0.5, 1.0):.3f} MB uploaded",
                 "wandb: Run summary:",
                 f"wandb:   train/loss {job.loss:.4f}",
                 f"wandb: View run {job.run_name} at: https://wandb.ai/team/{job.run_name.split('-')[0]}/runs/{run_id}",
                 f"wandb: Find logs at: ./wandb/run-{stamp}-{run_id}/logs")[: rng.randint(2, 6)]:
        job.sink.emit(prefix + text)


# -- command line ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m logdx.synth.bury", description=__doc__.split("\n\n")[0])
    p.add_argument("real", help="a real failure excerpt (one log file)")
    p.add_argument("-o", "--output", default="-", help="the buried log; '-' for stdout (default)")
    p.add_argument("--truth", help="also write the BuriedTruth here as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--lines", type=int, default=30000)
    p.add_argument("--style", default="torchrun", choices=sorted(STYLES))
    p.add_argument("--culprit-rank", type=int)
    p.add_argument("--bare", action="store_true", help="write the real lines without any prefix")
    p.add_argument("--no-cascade", action="store_true")
    args = p.parse_args(argv)
    real = read_real_lines(args.real)
    kwargs = dict(seed=args.seed, ranks=args.ranks, lines=args.lines, style=args.style,
                  culprit_rank=args.culprit_rank, prefix_real=not args.bare, cascade=not args.no_cascade)
    if args.output == "-":
        truth = bury(real, sys.stdout, **kwargs)
    else:
        with open(args.output, "w", encoding="utf-8", errors="surrogateescape", newline="") as out:
            truth = bury(real, out, **kwargs)
    if args.truth:
        with open(args.truth, "w", encoding="utf-8") as f:
            json.dump(truth.to_dict(), f, indent=2)
    return 0


def read_real_lines(path: str) -> list[str]:
    """A log file's lines exactly (split on ``\\n`` only; CRs and odd bytes kept)."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        text = f.read()
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n")


if __name__ == "__main__":
    sys.exit(main())
