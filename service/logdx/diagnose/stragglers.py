"""A slow node, from the log alone: a host whose ranks step slower than the other hosts', or whose step time
jumped up and stayed there, joined with what its kernel and NIC said in that window. Advice, never an action:
a slow node is worth a look (and leaving out of the next allocation when it persists), never a cordon on its
pace alone.

What it reads is what the timeline already keeps per source (a rank, else a host): its pace from its first to
its last timed step, and its (time, step) course over the whole run, decimated (timeline.py). Nothing here runs
per line.

- `lagging`: the host's ranks (the median of them) run clearly below the median of the other hosts' paces, over
  a window long enough to judge. Where ranks step in lockstep (synchronous data parallel: every rank waits for
  the slowest at each all-reduce) no host lags; where the log shows each rank's own pace (ranks logging their
  own clock, pipeline stages, loosely coupled workers) the slow one does.
- `slowed`: the host's ranks' step time jumped up mid-run and stayed up while the other hosts' did not; or the
  whole job slowed at once (lockstep) and exactly one host's kernel logged a slowing sign (PCIe AER, thermal
  throttling, corrected ECC, a link flap) around that moment: that host is what the others wait for.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from logdx.model import CompressionSummary, Event, SourceProgress, Straggler

__all__ = ["stragglers_of"]

# A pace is judged over at least this much of a source's own clock and this many advances: the first steps
# (compilation, warm-up, the data loader filling) and a checkpoint save's pause average out over a minute.
_MIN_SPAN_S = 60.0
_MIN_ADVANCES = 8
# A host is lagging when its pace is this far below the other hosts' median. Healthy hosts of one job differ
# by a few percent (clock skew between nodes, when each one's lines reach the log); 15% is well outside that
# and well inside the 20-50% a throttled GPU, a degraded PCIe link or a flapping NIC costs.
_LAG = 0.15
# A source slowed when its pace after some point is this far below its pace before, on both halves of the
# part after (it stayed slow: an evaluation or a checkpoint save slows a stretch, then the pace comes back).
_JUMP = 0.25
_SIDE_POINTS = 4  # course points on each side of a jump, at least
# The whole job slowed at once when most hosts' jumps fall within this much of the median jump time.
_TOGETHER_S = 120.0
# A kernel line this long before the slowdown still counts as its cause (a throttle logged, the pace falls at
# the next logging interval).
_LEAD_S = 120.0
_MAX_EVIDENCE = 6

# Signs in a node's kernel/NIC lines that make a GPU node slow without stopping it. The shipped rules name the
# fatal forms (an uncorrected AER, an HCA's catastrophic error: rules/node.yaml, rules/nccl.yaml) and leave
# these out on purpose (a corrected AER is the AER rule's counterexample): they end no job, they slow one.
_SIGNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("PCIe AER", re.compile(r"\bAER: |PCIe Bus Error")),
    ("thermal throttling", re.compile(
        r"(?i)temperature above threshold|clock throttled|thermal (?:event|throttl|slowdown)|\bHW Slowdown|"
        r"\bSW Thermal Slowdown|\bpower brake")),
    ("corrected ECC", re.compile(
        r"(?i)\bEDAC \w+: \d+ CE\b|\bcorrected (?:memory |ECC )?errors?\b|single-bit ECC|"
        r"Xid \([^)]*\): (?:92|63|64)\b|\bXid=92\b")),
    ("link flap", re.compile(
        r"(?i)\blink (?:is )?(?:down|up)\b|\blost carrier\b|\bport (?:state change|error)|Got async event|"
        r"NETDEV WATCHDOG|\blink flap")),
)


@dataclass(slots=True)
class _Pace:
    """One source's pace: over its whole timed run, and where it jumped (if it did)."""

    source: SourceProgress
    rate: float
    jump: tuple[float, float, float, float] | None = None  # (time, step, pace before, pace after)


def stragglers_of(summary: CompressionSummary, events: Sequence[Event]) -> list[Straggler]:
    hosts = _paces_by_host(summary)
    if len(hosts) < 2:
        return []
    rates = {h: statistics.median(p.rate for p in paces) for h, paces in hosts.items()}
    jumps = {h: j for h, paces in hosts.items() if (j := _host_jump(paces)) is not None}
    together = _slowed_together(jumps, len(hosts))
    out = []
    for host, paces in sorted(hosts.items()):
        others = statistics.median(r for h, r in rates.items() if h != host)
        found = _straggler(host, paces, rates[host], others, jumps.get(host), together, summary, events)
        if found is not None:
            out.append(found)
    if together and len(out) > 1:
        return [s for s in out if s.kind == "lagging"]  # several hosts' kernels spoke as the job slowed: none stands out
    return out


def _paces_by_host(summary: CompressionSummary) -> dict[str, list[_Pace]]:
    trusted = summary.trusted_hosts
    hosts: dict[str, list[_Pace]] = {}
    for src in summary.progress.sources:
        host = src.host or (summary.rank_hosts.get(src.rank) if src.rank is not None else None)
        if not host or (trusted is not None and host not in trusted):
            continue
        rate = _judged_rate(src)
        if rate is not None:
            hosts.setdefault(host, []).append(_Pace(src, rate, _jump_of(src.course)))
    return hosts


def _judged_rate(src: SourceProgress) -> float | None:
    if src.steps_per_s is None or src.steps_per_s <= 0 or src.advances < _MIN_ADVANCES:
        return None
    if src.first_ts is None or src.last_ts is None or src.last_ts - src.first_ts < _MIN_SPAN_S:
        return None
    return src.steps_per_s


def _jump_of(course: Sequence[tuple[float, float]]) -> tuple[float, float, float, float] | None:
    """Where the step time jumped up and stayed up: (time, step, pace before, pace after), or None. The jump is
    where two levels fit the step times between course points best (least squares, a pause clipped to twice
    the usual step time so that a checkpoint save does not pull the split to itself); the levels on each side
    are medians (a pause is one slow interval among many)."""
    cuts = [(t0, s0, (t1 - t0) / (s1 - s0)) for (t0, s0), (t1, s1) in zip(course, course[1:], strict=False)
            if s1 > s0 and t1 > t0]
    if len(cuts) < 2 * _SIDE_POINTS:
        return None
    typical = statistics.median(c[2] for c in cuts)
    x = [min(c[2], 2 * typical) for c in cuts]
    k = _best_split(x)
    before, after = statistics.median(x[:k]), statistics.median(x[k:])
    slow = before / (1 - _JUMP)  # the step time a pace `_JUMP` below the one before means
    if after <= slow or course[-1][0] - cuts[k][0] < _MIN_SPAN_S:
        return None
    mid = k + (len(x) - k) // 2
    if statistics.median(x[k:mid]) <= slow or statistics.median(x[mid:]) <= slow:
        return None  # the pace came back: a pause (an evaluation, a checkpoint save), not a slower node
    return cuts[k][0], cuts[k][1], 1 / before, 1 / after


def _best_split(x: list[float]) -> int:
    """The k (at least `_SIDE_POINTS` from either end) whose two means, x[:k] and x[k:], fit x best."""
    total, n = sum(x), len(x)
    left, best, best_k = 0.0, -1.0, _SIDE_POINTS
    for k in range(1, n - _SIDE_POINTS + 1):
        left += x[k - 1]
        if k < _SIDE_POINTS:
            continue
        right = total - left
        gain = left * left / k + right * right / (n - k)  # maximising it minimises the two sides' squared error
        if gain > best:
            best, best_k = gain, k
    return best_k


def _host_jump(paces: list[_Pace]) -> tuple[float, float, float, float] | None:
    """The host's jump when most of its ranks jumped (one rank's pause is not its node's)."""
    jumps = [p.jump for p in paces if p.jump is not None]
    if len(jumps) * 2 <= len(paces):
        return None
    return (statistics.median(j[0] for j in jumps), statistics.median(j[1] for j in jumps),
            statistics.median(j[2] for j in jumps), statistics.median(j[3] for j in jumps))


def _slowed_together(jumps: dict[str, tuple[float, float, float, float]], n_hosts: int) -> bool:
    """Most hosts slowed at about the same moment: ranks in lockstep, the whole job waits for one."""
    if len(jumps) * 2 <= n_hosts:
        return False
    when = statistics.median(j[0] for j in jumps.values())
    return sum(abs(j[0] - when) <= _TOGETHER_S for j in jumps.values()) * 2 > n_hosts


def _straggler(host: str, paces: list[_Pace], rate: float, others: float,
               jump: tuple[float, float, float, float] | None, together: bool,
               summary: CompressionSummary, events: Sequence[Event]) -> Straggler | None:
    ranks = tuple(sorted({p.source.rank for p in paces if p.source.rank is not None}
                         | {r for r, h in summary.rank_hosts.items() if h == host}))
    first_ts = min((p.source.first_ts for p in paces if p.source.first_ts is not None), default=None)
    last_ts = max((p.source.last_ts for p in paces if p.source.last_ts is not None), default=None)
    if jump is not None:
        evidence = _signs(host, events, jump[0] - _LEAD_S, last_ts)
        if together and not evidence:
            return None  # the whole job slowed and this host's kernel said nothing of it
        return Straggler(host=host, ranks=ranks, kind="slowed", steps_per_s=jump[3], others_steps_per_s=jump[2],
                         since_ts=jump[0], since_step=jump[1], since_line=None,
                         evidence=tuple((line_no, raw) for line_no, raw, _ in evidence),
                         effect=_slowed_effect(jump, together, evidence))
    if rate >= (1 - _LAG) * others:
        return None
    evidence = _signs(host, events, None if first_ts is None else first_ts - _LEAD_S, last_ts)
    first = min(paces, key=lambda p: p.source.first_line).source
    return Straggler(host=host, ranks=ranks, kind="lagging", steps_per_s=rate, others_steps_per_s=others,
                     since_ts=first_ts, since_step=first.first_step, since_line=first.first_line,
                     evidence=tuple((line_no, raw) for line_no, raw, _ in evidence),
                     effect=_lagging_effect(rate, others, evidence))


def _signs(host: str, events: Sequence[Event], start: float | None, end: float | None) -> list[tuple[int, str, str]]:
    """(line number, line, sign) of the host's kernel/NIC lines that slow a node, within [start, end] when both
    the window and the line have a time."""
    found: list[tuple[int, str, str]] = []
    for ev in events:
        rec = ev.anchor
        if rec.host != host:
            continue
        if rec.ts is not None and ((start is not None and rec.ts < start) or (end is not None and rec.ts > end)):
            continue
        sign = next((name for name, pattern in _SIGNS if pattern.search(rec.text)), None)
        if sign is not None:
            found.append((rec.line_no, rec.raw, sign))
            if len(found) >= _MAX_EVIDENCE:
                break
    return found


def _signs_said(evidence: list[tuple[int, str, str]]) -> str:
    kinds = sorted({sign for _, _, sign in evidence})
    return f"; its kernel logged {', '.join(kinds)} in that window (line {evidence[0][0]})" if kinds else ""


_CHECK = ("check it (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,ECC; lspci -vv for the PCIe link and AER counters; "
          "ibstat) and leave it out of the next allocation if it persists")


def _lagging_effect(rate: float, others: float, evidence: list[tuple[int, str, str]]) -> str:
    return (f"its ranks step at {rate:.3g}/s, {1 - rate / others:.0%} below the other hosts' {others:.3g}/s"
            f"{_signs_said(evidence)}: the job's collectives wait for it; {_CHECK}")


def _slowed_effect(jump: tuple[float, float, float, float], together: bool,
                   evidence: list[tuple[int, str, str]]) -> str:
    _, step, before, after = jump
    what = ("the whole job's step time" if together else "its ranks' step time")
    return (f"{what} rose from {1 / before:.3g} s to {1 / after:.3g} s at step {step:.0f} and stayed there"
            f"{'' if together else ' while the other hosts kept their pace'}{_signs_said(evidence)}"
            f"{': the others wait for it' if together else ''}; {_CHECK}")
