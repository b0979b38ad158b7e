"""The timeline: per-rank progress read from the frameworks' own progress lines (and learned from the
log when no form knows them), where the job stopped, which rank stopped first, the loss's course and
its divergences, in one streaming pass."""

from __future__ import annotations

import pytest

from logdx.compress import Compressor
from logdx.normalize import Normalizer
from logdx.pipeline import Engine
from logdx.timeline import checkpoint_step_of, forms, progress_shape_of


def feed(engine: Engine, lines: list[str], exit_code: int | None = None):
    session = engine.new_session()
    session.feed_lines(lines)
    return session, session.report(exit_code=exit_code)


def megatron(step: int, loss: float, rank: int = 63, host: str = "gpu-node-08", ms: float = 1412.3,
             skipped: int = 0, nan: int = 0) -> str:
    return (f"{host}: [rank{rank}]:  iteration {step:8d}/  500000 | consumed samples: {step * 512:12d} | elapsed time per "
            f"iteration (ms): {ms:.1f} | learning rate: 1.500E-04 | global batch size:   512 | lm loss: {loss:.6E} | "
            f"loss scale: 1.0 | grad norm: 0.{300 + step % 97:03d} | number of skipped iterations: {skipped:3d} | number "
            f"of nan iterations: {nan:3d} |")


@pytest.mark.parametrize(("line", "fields"), [
    (" iteration      100/  500000 | consumed samples: 3200 | elapsed time per iteration (ms): 1234.5 | learning rate: "
     "1.000E-04 | global batch size: 32 | lm loss: 6.412345E+00 | loss scale: 65536.0 | grad norm: 1.234 | number of "
     "skipped iterations:   0 | number of nan iterations:   0 |",
     {"step": 100, "total": 500000, "loss": 6.412345, "step_time_ms": 1234.5, "grad_norm": 1.234, "nan_iters": 0}),
    ("[2025-05-15 13:56:55,674] [INFO] [logging.py:96:log_dist] [Rank 0] step=62010, skipped=3, lr=[0.00029745], "
     "mom=[(0.9, 0.95)]", {"step": 62010, "skipped_total": 3, "lr": 0.00029745}),
    ("{'loss': 2.3456, 'grad_norm': 1.23, 'learning_rate': 4.9e-05, 'epoch': 0.01}",
     {"loss": 2.3456, "grad_norm": 1.23, "epoch": 0.01}),
    ("Epoch 3:  45%|████▌     | 450/1000 [00:10<00:12, 40.1it/s, loss=2.31, v_num=0]",
     {"step": 450, "epoch": 3, "total": 1000, "loss": 2.31, "it_per_s": 40.1}),
    ("step:  10  loss:  9.1234  memory: 12.3GiB(15.2%)  tps: 1,234  mfu: 30.1%", {"step": 10, "loss": 9.1234}),
])
def test_progress_forms_read_the_fields_of_each_framework(line: str, fields: dict[str, float]) -> None:
    shape = progress_shape_of(line)
    assert shape is not None
    import re

    numbers = re.findall(r"(?<![\w.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", line)
    got = {name: float(numbers[i]) for name, i in shape.fields}
    for name, value in fields.items():
        assert got[name] == pytest.approx(value), (name, got)


@pytest.mark.parametrize("line", [
    "Total optimization steps = 1,000,000", "  gradient_accumulation_steps ... 8", "steps_per_print ............... 10",
    "NCCL INFO Channel 00/0 : 6[6] -> 7[7] via P2P/IPC",
])
def test_configuration_lines_are_not_progress(line: str) -> None:
    assert progress_shape_of(line) is None


def test_checkpoint_saves_say_their_step() -> None:
    assert checkpoint_step_of("  successfully saved checkpoint at iteration    4000 to /ckpt/gpt") == 4000
    assert checkpoint_step_of("Saving model checkpoint to /out/checkpoint-1500") == 1500
    assert checkpoint_step_of("iteration 12 | lm loss: 2.0") is None


def test_the_forms_file_is_data_validated_at_load(tmp_path) -> None:
    from logdx.timeline import TimelineError

    bad = tmp_path / "timeline.yaml"
    bad.write_text("fields:\n  step:\n    - 'iteration (\\d+)'\ncheckpoints: []\n", encoding="utf-8")
    with pytest.raises(TimelineError, match=r"timeline.yaml:3: a pattern needs exactly one \{n\}"):
        forms.__wrapped__(bad)


def test_a_counter_no_form_knows_is_learned_from_the_log() -> None:
    n, c = Normalizer(), Compressor()
    for i in range(1, 30):
        c.add(n.normalize(f"[rank0]: trainer: processed batch {i * 8} of shard, 1.2 GB/s"))
    (src,) = c.summary().progress.sources
    assert src.last_step == 29 * 8 and src.advances >= 20


def test_per_rank_progress_and_the_rank_that_stopped_first(engine: Engine) -> None:
    lines = []
    for step in range(1, 40):
        for r in range(16):
            if r == 9 and step > 30:
                continue  # rank 9 stops advancing at step 30
            lines.append(f"node-{r // 8}: [rank{r}]: [2024-05-01 12:{step // 60:02d}:{step % 60:02d},000] [INFO] "
                         f"[timer.py:260:stop] epoch=0/micro_step={step * 8}/global_step={step}, "
                         f"RunningAvgSamplesPerSec=86.29")
    lines += [f"node-{r // 8}: [rank{r}]:[E501 12:40:00.000 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
              f"collective operation timeout: WorkNCCL(SeqNum=99, OpType=ALLREDUCE, Timeout(ms)=600000) ran for "
              f"600004 milliseconds before timing out." for r in range(16) if r != 9]
    _, report = feed(engine, lines)
    p = report.progress
    assert p is not None and p.last_step == 39 and p.ranks == 16
    assert p.first_stopped is not None and p.first_stopped.ranks == [9] and p.first_stopped.hosts == ["node-1"]
    assert (report.failure_type, report.culprits.ranks, report.culprits.hosts) == ("hang", [9], ["node-1"])
    assert report.action == "cordon_and_restart" and report.culprits.corroborated


def test_a_loss_that_jumps_and_never_comes_back_is_a_divergence_with_its_rollback(engine: Engine) -> None:
    lines = [megatron(s * 10, 6.5 - s * 0.01) for s in range(1, 60)]
    lines.insert(20, "gpu-node-08: [rank63]:  successfully saved checkpoint at iteration     200 to /ckpt/run")
    lines += [megatron(s * 10, 14.0 + (s % 3) * 0.1) for s in range(60, 90)]
    _, report = feed(engine, lines)
    assert (report.status, report.category, report.failure_type, report.action) == (
        "failed", "framework", "nan_loss", "no_restart")
    d = report.progress.divergence
    assert d is not None and d.step == 600 and d.rollback_to_step == 200 and d.loss_after > 13
    assert "iteration      600/" in report.root_cause.text


@pytest.mark.parametrize(("kind", "broken"), [
    # The loss scaler finds no finite scale any more: every interval skips, the loss stays where it was.
    ("skipped", lambda s: {"skipped": min(10, 1 + 2 * (s - 41))}),
    # Megatron leaves NaN iterations out of the loss it prints: finite and flat, the count says it broke.
    ("nan_iterations", lambda s: {"nan": min(10, 1 + (s - 41) // 2)}),
])
def test_skipped_or_nan_iterations_in_every_interval_are_a_divergence_from_where_they_began(
        engine: Engine, kind: str, broken) -> None:
    # Confirmed intervals later, it began (and is rolled back to a checkpoint before) where the run of
    # broken intervals began; the flat loss they print does not make it a spike that came back.
    lines = [megatron(s * 10, 6.5 - s * 0.01) for s in range(1, 41)]
    lines.insert(30, "gpu-node-08: [rank63]:  successfully saved checkpoint at iteration     300 to /ckpt/run")
    lines += [megatron(s * 10, 6.1, **broken(s)) for s in range(41, 70)]
    _, report = feed(engine, lines)
    assert (report.status, report.failure_type) == ("failed", "nan_loss")
    d = report.progress.divergence
    assert d is not None and d.kind == kind and d.step == 410 and d.rollback_to_step == 300
    assert "iteration      410/" in report.root_cause.text


def test_one_interval_with_a_nan_iteration_that_training_runs_past_is_no_divergence(engine: Engine) -> None:
    lines = [megatron(s * 10, 6.5 - s * 0.01, nan=1 if s == 45 else 0) for s in range(1, 90)]
    _, report = feed(engine, lines, exit_code=0)
    assert report.status == "healthy" and report.progress.divergence is None


def test_a_spike_that_comes_back_is_a_note_and_the_run_is_healthy(engine: Engine) -> None:
    losses = [6.5 - s * 0.01 for s in range(1, 80)]
    losses[40:44] = [11.0, 9.0, 7.5, 6.1]
    _, report = feed(engine, [megatron((i + 1) * 10, x) for i, x in enumerate(losses)])
    assert report.status == "healthy"
    assert report.progress.divergence is None and len(report.progress.recovered_spikes) == 1
    assert report.progress.recovered_spikes[0].step == 410


def test_a_steady_climb_is_a_divergence_too(engine: Engine) -> None:
    losses = [3.0 - s * 0.002 for s in range(60)] + [3.0 + s * 0.15 for s in range(1, 30)]
    _, report = feed(engine, [megatron((i + 1) * 10, x) for i, x in enumerate(losses)])
    assert report.failure_type == "nan_loss" and report.progress.divergence is not None


def test_a_noisy_per_step_loss_is_not_a_divergence(engine: Engine) -> None:
    import random

    rnd = random.Random(3)
    lines = [f"[rank0]: iter {i}: loss {1.6 + rnd.uniform(-0.5, 0.9):.4f}, time: 6200.00ms" for i in range(1, 400)]
    _, report = feed(engine, lines)
    assert report.status == "healthy" and report.progress.divergence is None


@pytest.mark.slow
def test_memory_of_the_timeline_is_bounded(engine: Engine) -> None:
    session = engine.new_session()
    for i in range(1, 200_001):
        session.feed(megatron(i, 2.0 + (i % 7) * 0.001))
    p = session.summary().progress
    assert p.lines == 200_000 and len(p.loss) <= 1024 and len(p.step_time_s) <= 1024


def test_a_diverged_loss_blames_no_node_and_is_dated_from_the_gradient_that_blew_up_first(engine: Engine) -> None:
    # HF Trainer dict lines from rank 0 on its host (counted in fractions of an epoch), beside a tqdm bar
    # that counts steps: the gradient norm blows up one logging interval before the loss follows.
    def hf(step: int, loss: float, grad: float) -> list[str]:
        return [f"node-40: [rank0]:{{'loss': {loss:.4f}, 'grad_norm': {grad:.4f}, 'learning_rate': 3e-04, "
                f"'epoch': {step / 30000:.2f}}}",
                f"node-40: [rank0]: {step * 100 // 30000}%|##   | {step}/30000 [1:02:03<9:00:00,  1.92s/it]"]
    lines: list[str] = []
    for s in range(1, 80):
        lines += hf(s * 50, 2.6 - s * 0.002, 0.8 + (s % 3) * 0.05)
    lines += hf(80 * 50, 2.44, 14.0)  # the norm first
    for s in range(81, 120):
        lines += hf(s * 50, 5.1 + (s % 2) * 0.05, 1.2e5)
    _, report = feed(engine, lines)
    assert (report.status, report.failure_type, report.action) == ("failed", "nan_loss", "no_restart")
    assert "'grad_norm': 14.0000" in report.root_cause.text
    assert report.progress.divergence is not None and report.progress.divergence.step >= 3000  # steps, not epochs
    assert report.culprits.hosts == [] and report.culprits.ranks == []


def test_a_tqdm_bar_whose_glyphs_and_clock_change_shape_keeps_counting_the_steps(engine: Engine) -> None:
    # The bar grows a block every percent (▏▎▍...) and its elapsed time gains an hour field: each is a
    # new line shape; the step is still the one count.
    glyphs = " ▏▎▍▌▋▊▉█"
    lines = []
    for step in range(1, 3001):
        pct = step * 100 // 3000
        bar = "█" * (pct // 10) + glyphs[pct % 9]
        elapsed = f"{step // 3600}:{step % 3600 // 60:02d}:{step % 60:02d}" if step >= 3600 // 2 else \
            f"{step // 60:02d}:{step % 60:02d}"
        lines.append(f"[rank0]: {pct:3d}%|{bar:<10}| {step}/3000 [{elapsed}<1:00:00,  0.50s/it]")
    _, report = feed(engine, lines)
    assert report.progress is not None and report.progress.last_step == 3000
