"""Stage 2: repeated lines cost a count; what can matter is kept; memory stays bounded."""

from __future__ import annotations

from logdx.compress import CompressConfig, Compressor
from logdx.normalize import Normalizer
from logdx.patterns import mask


def _feed(lines, config=None):
    n, c = Normalizer(), Compressor(config or CompressConfig())
    kept = []
    for line in lines:
        kept.extend(c.add(n.normalize(line)))
    return c, kept


def progress(i, rank):
    return f"[rank{rank}]: iteration {i}/100000 | loss {2.5 - i * 1e-5:.4f} | lr 1.0e-04 | grad norm {0.3 + (i % 7) / 10:.2f} | 142.{i % 10} ms"


def test_mask_hides_numbers_ids_addresses_and_paths():
    assert mask("iteration 12/100 | loss 2.3456 | 141.5 ms") == "iteration <*>/<*> | loss <*> | <*> ms"
    assert mask("peer 10.1.2.3<4567> on /data/shards/part-001.bin") == "peer <*> on <*>"
    assert mask("NVRM: Xid (PCI:0000:8a:00.0): 79, pid=4242") == "NVRM: Xid (PCI:<*>): <*>, pid=<*>"
    assert mask("ptr 0x7f3a12bc uuid 123e4567-e89b-12d3-a456-426614174000") == "ptr <*> uuid <*>"
    assert mask("took 12ms, 3.5GiB free") == "took <*>, <*> free"
    assert mask("cuda:0 rank3 ProcessGroupNCCL.cpp:1515") == "cuda:<*> rank3 ProcessGroupNCCL.cpp:<*>"


def test_progress_lines_collapse_to_one_template_per_shape():
    lines = [progress(i, i % 8) for i in range(5000)]
    c, kept = _feed(lines)
    assert c.lines_in == 5000
    templates = c.templates()
    assert len(templates) == 1
    t = templates[0]
    assert t.count == 5000 and t.ranks == set(range(8)) and t.first_line == 1 and t.last_line == 5000
    assert len(kept) <= CompressConfig().first_lines_per_template


def test_error_lines_are_kept_up_to_a_per_template_cap():
    lines = [progress(i, 0) for i in range(100)]
    lines += [f"[rank{r}]: [E501 12:00:00.1 ProcessGroupNCCL.cpp:1515] Watchdog caught collective operation timeout: "
              f"WorkNCCL(SeqNum=42, OpType=ALLREDUCE) ran for 600012 milliseconds" for r in range(200)]
    c, kept = _feed(lines, CompressConfig(kept_per_error_template=16))
    errors = [k for k in kept if k.reason == "error"]
    assert len(errors) == 16
    watchdog = next(t for t in c.templates() if "Watchdog" in t.template)
    assert watchdog.count == 200 and len(watchdog.ranks) == 200 and watchdog.error_bearing


def test_interleaved_tracebacks_are_kept_whole_per_rank():
    tb = ['Traceback (most recent call last):', '  File "/w/train.py", line 3, in <module>', "    main()",
          '  File "/w/train.py", line 2, in main', "    import foo", "ModuleNotFoundError: No module named 'foo'"]
    lines = [progress(i, i % 4) for i in range(50)]
    for step in range(len(tb)):  # four ranks print the same traceback, line by line interleaved
        lines += [f"[rank{r}]: {tb[step]}" for r in range(4)]
        lines += [progress(50 + step, 7)]
    _, kept = _feed(lines)
    for r in range(4):
        mine = [k.record.text for k in kept if k.reason == "traceback" and k.record.rank == r]
        assert mine == tb


def test_rich_traceback_box_and_multiline_message_are_kept():
    lines = ["╭──── Traceback (most recent call last) ────╮", "│ /opt/x/site-packages/ds/config.py:891 in check │",
             "│   888 │   assert a == b                  │", "╰───────────────────────────────────────────╯",
             "AssertionError: Check batch related parameters. train_batch_size is not", "equal to 64 != 4 *", "8 * 1"]
    _, kept = _feed(["epoch 1 done"] + lines)
    assert [k.record.text for k in kept if k.reason == "traceback"] == lines


def test_tail_lines_of_each_rank_are_flushed_at_the_end():
    lines = [progress(i, i % 2) for i in range(1000)]
    c, _ = _feed(lines, CompressConfig(tail_lines_per_source=5))
    tails = c.flush_tails()
    assert len(tails) == 10
    assert {k.record.rank for k in tails} == {0, 1}
    assert max(k.record.line_no for k in tails) == 1000


def test_nan_loss_and_spikes_are_kept():
    lines = [progress(i, 0) for i in range(100)]
    lines.append("[rank0]: iteration 101/100000 | loss 95.0000 | lr 1.0e-04 | grad norm 9.9 | 140.0 ms")
    lines.append("[rank0]: iteration 102/100000 | loss nan | lr 1.0e-04 | grad norm nan | 140.0 ms")
    _, kept = _feed(lines)
    reasons = {k.record.line_no: k.reason for k in kept}
    assert reasons[101] == "loss"
    assert reasons[102] in ("loss", "error")


def test_summary_counts_world_hosts_and_progress():
    lines = [f"node-{r // 8}: [rank{r}]: iteration 5 | loss 2.0" for r in range(16)]
    c, _ = _feed(lines)
    s = c.summary()
    assert s.world_size == 16 and s.hosts == ["node-0", "node-1"] and s.progress_lines == 16
    assert s.rank_hosts[9] == "node-1"


def test_template_count_is_bounded():
    lines = [f"unique message number{chr(65 + i % 26)}{i} word{i}x" for i in range(3000)]
    c, _ = _feed(lines, CompressConfig(max_templates=100))
    assert len(c.templates()) <= 101


def test_host_port_at_the_start_is_masked_like_an_ip():
    assert mask("proxy.example.com:5070 open through proxy proxy.example.com:5070 HTTPS") == (
        "<*> open through proxy proxy.example.com:<*> HTTPS")
    assert mask("10.0.0.1:80 open") == "<*> open"
    assert mask("state.clipTopAmount:0, i:1") == "state.clipTopAmount:<*>, i:<*>"  # a key, not a host


def test_merged_ids_join_templates_that_differ_only_at_wildcards():
    from drain3.drain import LogCluster

    from logdx.model import Record, TemplateStats

    c = Compressor(CompressConfig())
    c.add(Record(line_no=1, raw="job alpha finished step one", text="job alpha finished step one"))
    (specific,) = c._drain.clusters
    # A second, more general template of the same event, as Drain leaves one when lines of an event
    # reach different branches of its tree (it never joins clusters once made).
    c._drain.id_to_cluster[99] = LogCluster(["job", "<*>", "finished", "step", "one"], 99)
    c._stats[99] = TemplateStats(template_id=99, template="job <*> finished step one", count=3, first_line=10,
                                 last_line=12, sample="job x finished step one")
    c.add(Record(line_no=2, raw="disk sda full now", text="disk sda full now"))
    merged = c.merged_ids()
    assert merged[99] == merged[specific.cluster_id] == specific.cluster_id
    assert c.template_id_of("job alpha finished step one") == specific.cluster_id
    assert c.template_id_of("disk sda full now") != specific.cluster_id
    stats = {t.template_id: t for t in c.templates()}
    assert len(stats) == 2
    assert stats[specific.cluster_id].count == 1 + 3 and stats[specific.cluster_id].last_line == 12
    assert c._stats[specific.cluster_id].count == 1  # the live statistics stay per cluster


def test_merged_ids_keep_templates_that_differ_in_a_word():
    from logdx.compress import _covers

    assert _covers(["VM", "<*>", "(Lifecycle", "Event)"], ["VM", "Paused", "(Lifecycle", "Event)"])
    assert not _covers(["VM", "Resumed", "<*>"], ["VM", "Paused", "<*>"])
