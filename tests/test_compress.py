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


def test_a_nan_loss_is_kept_at_once_and_the_spike_before_it_is_where_the_divergence_began():
    lines = [progress(i, 0) for i in range(100)]
    lines.append("[rank0]: iteration 101/100000 | loss 95.0000 | lr 1.0e-04 | grad norm 9.9 | 140.0 ms")
    lines.append("[rank0]: iteration 102/100000 | loss nan | lr 1.0e-04 | grad norm nan | 140.0 ms")
    c, kept = _feed(lines)
    reasons = {k.record.line_no: k.reason for k in kept}
    assert 101 not in reasons  # a spike alone may come back
    assert reasons[102] in ("loss", "error")
    (began,) = c.finish_timeline()
    assert began.record.line_no == 101 and began.divergence is not None and began.divergence.step == 101
    assert began.divergence.loss_before is not None and 2.0 < began.divergence.loss_before < 3.0


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


def _raw_feed(texts, config=None):
    from logdx.model import Record

    c = Compressor(config or CompressConfig())
    kept = []
    for i, text in enumerate(texts, 1):
        kept.extend(c.add(Record(line_no=i, raw=text, text=text)))
    return c, kept


def test_a_date_inside_a_message_is_one_variable():
    # Otherwise its month and weekday stay words, and a position of few words tells events apart.
    assert mask("connection from 1.2.3.4 () at Fri Jul  1 07:57:30 2005") == "connection from <*> () at <*>"
    assert mask("saved at 2024-01-02T03:04:05.123Z, next 2024-01-02") == "saved at <*>, next <*>"
    assert mask("Jun 14 15:16:01 sshd started") == "<*> sshd started"
    assert mask("Mon Jan is a name, May 5 too") == "Mon Jan is a name, May <*> too"


def test_merged_ids_join_templates_that_differ_only_at_wildcards():
    # Drain's tree sends each first-word-after-"job" down its own branch, so the two specific templates
    # and the general one (a number, masked) are three clusters it never joins.
    texts = ["job alpha finished step one", "job beta finished step one", "job 42 finished step one",
             "job 43 finished step one", "disk sda full now"]
    c, _ = _raw_feed(texts)
    assert len(list(c.miner.drain.clusters)) == 4
    merged = c.merged_ids()
    assert len({merged[cl.cluster_id] for cl in c.miner.drain.clusters}) == 2
    job = {c.template_id_of(t) for t in texts[:4]}
    assert len(job) == 1 and c.template_id_of(texts[4]) not in job
    stats = {t.template_id: t for t in c.templates()}
    assert len(stats) == 2
    (tid,) = job
    assert stats[tid].count == 4 and stats[tid].first_line == 1 and stats[tid].last_line == 4
    assert stats[tid].template == "job <*> finished step one"
    assert sum(s.count for s in c.miner.stats.values()) == 5  # the live statistics stay per variant


def _vm_events(n_instances=20):
    events = ["Paused", "Resumed", "Started", "Stopped"]
    return [f"[instance: {i:08x}-1111-2222-3333-444455556666] VM {e} (Lifecycle Event)"
            for i in range(n_instances) for e in events]


def test_a_position_with_a_few_recurring_words_tells_events_apart():
    texts = _vm_events() + ["unrelated line here"]
    c, kept = _raw_feed(texts)
    by_text = {t.template: t for t in c.templates()}
    for event in ("Paused", "Resumed", "Started", "Stopped"):
        t = by_text[f"[instance: <*>] VM {event} (Lifecycle Event)"]
        assert t.count == 20
        assert c.template_id_of(f"[instance: 00000001-1111-2222-3333-444455556666] VM {event} (Lifecycle Event)") == t.template_id
    assert len(by_text) == 5 and c.summary().templates == 5
    # Every kept line's template is one that is reported, or a variant of one.
    reported = {t.template_id for t in c.templates()}
    assert {c.group_ids().get(k.template_id, k.template_id) for k in kept} <= reported


def test_a_position_with_many_words_stays_a_variable():
    users = ["alice", "bob", "carol", "dave", "erin", "frank", "grace"]
    texts = [f"session opened for user {users[i % len(users)]} by uid {i}" for i in range(70)]
    c, _ = _raw_feed(texts)
    (t,) = c.templates()
    assert t.template == "session opened for user <*> by uid <*>" and t.count == 70


def test_a_word_seen_once_does_not_make_a_template():
    texts = [f"task {i} was started by worker {w}" for i, w in enumerate(["alpha"] * 30 + ["beta"])]
    c, _ = _raw_feed(texts)
    assert [t.count for t in c.templates()] == [31]
    c, _ = _raw_feed(texts + ["task 99 was started by worker beta"])
    assert sorted(t.count for t in c.templates()) == [2, 30]


def test_telling_words_apart_can_be_turned_off():
    c, _ = _raw_feed(_vm_events(), CompressConfig(split_max_words=0))
    (t,) = c.templates()
    assert t.template == "[instance: <*>] VM <*> (Lifecycle Event)" and t.count == 80


def test_a_template_with_too_many_variants_is_never_split():
    # Two positions of a few words each: 4 x 4 variants, over a cap of 8.
    texts = [f"op {i} done: {a} on {b}" for i in range(64) for a, b in [(["read", "write", "sync", "trim"][i % 4],
                                                                        ["disk", "tape", "net", "mem"][i // 16])]]
    c, _ = _raw_feed(texts, CompressConfig(max_variants_per_template=8))
    (t,) = c.templates()
    assert t.count == 64
    c, _ = _raw_feed(texts)
    assert len(c.templates()) == 16


def test_merged_ids_keep_templates_that_differ_in_a_word():
    from logdx.mining import _covers

    assert _covers(["VM", "<*>", "(Lifecycle", "Event)"], ["VM", "Paused", "(Lifecycle", "Event)"])
    assert not _covers(["VM", "Resumed", "<*>"], ["VM", "Paused", "<*>"])


def test_lines_that_name_a_rank_and_its_host_in_words_map_the_rank():
    lines = [
        "2047: MPICH ERROR [Rank 2047] [job id 57638547.0] [Fri Aug 28 22:45:13 2026] [nid004069] - Abort(1)",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2024-05-01_12:30:09",
        "  host      : gpu-node-07",
        "  rank      : 12 (local_rank: 4)",
        "  exitcode  : -9 (pid: 1234)",
    ]
    c, _ = _feed(lines)
    assert c.summary().rank_hosts == {2047: "nid004069", 12: "gpu-node-07"}
