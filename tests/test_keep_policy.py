"""The keep policy is a seam (keep_policy.py): another policy changes which lines are kept whole, through the
Compressor or the Engine, without touching compress.py; the compressor asks it only about lines that may be kept."""

from __future__ import annotations

from pathlib import Path

from logdx.compress import CompressConfig, Compressor, DefaultKeepPolicy
from logdx.config import Settings
from logdx.keep_policy import SourceState
from logdx.mining import Shape
from logdx.model import Record, TemplateStats
from logdx.normalize import Normalizer
from logdx.pipeline import Engine, Session


def _job(steps: int = 3000, ranks: int = 8) -> list[str]:
    """Progress from every rank, NCCL init, a warning, and rank 3's traceback near the end."""
    lines = [f"node-{r // 4}: [rank{r}]: NCCL INFO comm 0x{r:x}ab rank {r} nranks {ranks} cudaDev {r % 4} busId {r}0"
             for r in range(ranks)]
    for i in range(steps):
        r = i % ranks
        lines.append(f"node-{r // 4}: [rank{r}]: iteration {i}/100000 | loss {2.5 - i * 1e-4:.4f} | "
                     f"lr 1.0e-04 | {140 + i % 9}.{i % 10} ms")
        if i == steps // 2:
            lines.append(f"node-{r // 4}: [rank{r}]: UserWarning: torch.cuda.amp.GradScaler is deprecated")
    lines += ["node-0: [rank3]: Traceback (most recent call last):",
              'node-0: [rank3]:   File "/w/train.py", line 88, in <module>',
              "node-0: [rank3]:     loss.backward()",
              "node-0: [rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"]
    return lines


class Counting(DefaultKeepPolicy):
    """logdx's policy, counting how often it is asked."""

    __slots__ = ("asked",)

    def __init__(self, config: CompressConfig) -> None:
        super().__init__(config)
        self.asked = 0

    def reason(self, rec: Record, shape: Shape, stats: TemplateStats, src: SourceState, loss_anomaly: bool,
               kept: int) -> str | None:
        self.asked += 1
        return DefaultKeepPolicy.reason(self, rec, shape, stats, src, loss_anomaly, kept)


class NoFirstLines(DefaultKeepPolicy):
    """Keeps what logdx keeps except a template's first lines, and no tails: a site that wants only the errors."""

    __slots__ = ()

    @property
    def tail_lines(self) -> int:
        return 0

    def reason(self, rec: Record, shape: Shape, stats: TemplateStats, src: SourceState, loss_anomaly: bool,
               kept: int) -> str | None:
        why = DefaultKeepPolicy.reason(self, rec, shape, stats, src, loss_anomaly, kept)
        return None if why == "new_template" else why


def _compress(lines: list[str], compressor: Compressor) -> list[tuple[int, str]]:
    n = Normalizer()
    kept = [k for line in lines for k in compressor.add(n.normalize(line))] + compressor.flush_tails()
    return [(k.record.line_no, k.reason) for k in kept]


def test_the_policy_is_asked_only_about_lines_that_may_be_kept_and_the_default_is_the_same() -> None:
    lines = _job()
    policy = Counting(CompressConfig())
    counted = _compress(lines, Compressor(CompressConfig(), keep_policy=policy))
    assert counted == _compress(lines, Compressor(CompressConfig()))
    reasons = {why for _, why in counted}
    assert {"new_template", "error", "traceback", "tail"} <= reasons
    # 3000 progress lines of one template: asked about its first lines, the init lines', the warning and the
    # lines after it (an exception's message may go on), the traceback.
    assert len(lines) > 3000 and 0 < policy.asked <= 12


def test_another_policy_changes_what_is_kept_and_nothing_else() -> None:
    lines = _job()
    default, other = Compressor(CompressConfig()), Compressor(CompressConfig(), keep_policy=NoFirstLines(CompressConfig()))
    kept_default, kept_other = _compress(lines, default), _compress(lines, other)
    assert {why for _, why in kept_other} == {"error", "traceback"}
    assert set(kept_other) < set(kept_default)
    assert [(t.template, t.count, t.ranks) for t in default.templates()] == [
        (t.template, t.count, t.ranks) for t in other.templates()]
    assert default.summary().rank_hosts == other.summary().rank_hosts == {r: f"node-{r // 4}" for r in range(8)}


def _settings(tmp: Path) -> Settings:
    return Settings.model_validate({"data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False}})


def _session_kept(session: Session, lines: list[str]) -> dict[str, int]:
    session.feed_lines(lines)
    session.finish()
    return {t.template: t.kept for t in session.templates() if t.kept}


def test_an_engine_gives_its_sessions_its_policy_and_a_snapshot_keeps_it(tmp_path: Path) -> None:
    lines = _job()
    plain = _session_kept(Engine.create(_settings(tmp_path)).new_session(), lines)
    engine = Engine.create(_settings(tmp_path), keep_policy=NoFirstLines)
    session = engine.new_session()
    session.feed_lines(lines[:100])
    restored = Session.restore(engine, session.snapshot())
    assert isinstance(restored.compressor.policy, NoFirstLines)
    swapped = _session_kept(restored, lines[100:])
    nccl, progress = (next(t for t in plain if word in t) for word in ("NCCL INFO comm", "iteration"))
    assert plain[nccl] == plain[progress] - 3 == 2  # the first two lines, and the three after the warning
    assert nccl not in swapped and swapped[progress] == 3
    assert {t: k for t, k in plain.items() if t not in (nccl, progress)} == {
        t: k for t, k in swapped.items() if t != progress}
