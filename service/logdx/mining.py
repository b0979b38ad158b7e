"""Template mining: lines -> templates, as drain3's `Drain` does it, bounded, with the shapes cache and variants.

The compressor (`compress.py`) asks this module which template a new shape of line is counted in
(`TemplateMiner.variant_for`) and remembers the shape (`TemplateMiner.remember`); it counts each line itself,
in the statistics the shape points at (`Shape.stats`). Everything reported about templates comes from here:
`templates()`, `group_ids()`, `merged_ids()`. This module keeps no line and knows no host: what is kept is the
keep policy's (`keep_policy.py`), who ran where the topology's (`topology.py`) - drain3's split of its
algorithm (`drain.py`) from its orchestration (`template_miner.py`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from drain3.drain import Drain, LogCluster, Node

from logdx.compress_config import CompressConfig
from logdx.model import TemplateStats
from logdx.patterns import PARAM
from logdx.procs import PsColumns
from logdx.timeline import ProgressShape


class _Drain(Drain):
    """drain3's Drain core; optionally counting a template's wildcards as matching in `add_log_message`;
    with bounded work per line (`add_bounded`)."""

    def __init__(self, *, match_params: bool = False, max_tokens: int = 64, max_leaf: int = 1024,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.match_params = match_params
        self.max_tokens = max_tokens
        self.max_leaf = max_leaf

    def tree_search(self, root_node: Node, tokens: Sequence[str], sim_th: float,
                    include_params: bool) -> LogCluster | None:
        return super().tree_search(root_node, tokens, sim_th, include_params or self.match_params)

    def get_content_as_tokens(self, content: str) -> list[str]:
        return split_tokens(content, self.max_tokens)

    def add_bounded(self, content: str) -> LogCluster | None:
        """`add_log_message`, except that a line matching no template of a full leaf makes none (None)."""
        tokens = self.get_content_as_tokens(content)
        leaf = self._leaf(tokens)
        match = None
        if leaf is not None:
            match = self.fast_match(leaf.cluster_ids, tokens, self.sim_th, self.match_params)
        if match is None:
            if leaf is not None and len(leaf.cluster_ids) >= self.max_leaf:
                return None
            return self.add_log_message(content)[0]
        template = tuple(self.create_template(tokens, match.log_template_tokens))
        if template != match.log_template_tokens:
            match.log_template_tokens = template
        match.size += 1
        return match

    def _leaf(self, tokens: list[str]) -> Node | None:
        """The leaf `tree_search` would search for these tokens (drain3's descent), or None."""
        node = self.root_node.key_to_child_node.get(str(len(tokens)))
        if node is None or not tokens:
            return node
        depth = 1
        for token in tokens:
            if depth >= self.max_node_depth or depth == len(tokens):
                break
            children = node.key_to_child_node
            node = children.get(token) or children.get(self.param_str)
            if node is None:
                return None
            depth += 1
        return node


def split_tokens(text: str, max_tokens: int) -> list[str]:
    """Words as Drain splits them, the words past `max_tokens` kept together as one."""
    return text.strip().split(None, max_tokens)


@dataclass(slots=True)
class _Novelty:
    """Whether new shapes are lines that never repeat (see CompressConfig.novelty_*)."""

    window: int
    share: float
    min_templates: int
    probe: int
    seen: int = 0
    novel: int = 0
    flooding: bool = False
    tick: int = 0

    def skip(self) -> bool:
        """True for a new shape that should not be mined (a flood, and not a probe)."""
        if not self.flooding:
            return False
        self.tick += 1
        return self.tick % self.probe != 0

    def note(self, created: bool, templates: int) -> None:
        self.seen += 1
        self.novel += created
        if self.seen >= (max(1, self.window // self.probe) if self.flooding else self.window):
            self.flooding = templates >= self.min_templates and self.novel > self.share * self.seen
            self.seen = self.novel = 0


# What counts as a word when telling events apart by one (see CompressConfig.split_max_words).
_WORD = re.compile(r"[A-Za-z][A-Za-z_-]*")


@dataclass(slots=True)
class _Cluster:
    """One Drain cluster's lines, as variants: lines with the same words at the positions that, so far,
    only ever held a few words (`words`) share a variant, and each variant has its own statistics. Whether
    such a position tells events apart is decided when templates are reported (`TemplateMiner._grouping`)."""

    words: list[set[str] | None]  # per position, the words seen there; None once it held a non-word or too many
    variants: dict[tuple[str | None, ...], TemplateStats] = field(default_factory=dict)
    closed: bool = False  # it reached max_variants_per_template: never split

    def variant_key(self, tokens: list[str], max_words: int) -> tuple[str | None, ...]:
        key: list[str | None] = []
        for p, token in enumerate(tokens):
            seen = self.words[p]
            if seen is not None and token not in seen:
                if len(seen) >= max_words or not _WORD.fullmatch(token):
                    seen = self.words[p] = None
                else:
                    seen.add(token)
            key.append(None if seen is None else token)
        return tuple(key)


@dataclass(slots=True)
class Shape:
    """What is known about one distinct masked line (the fast-path cache entry)."""

    template_id: int  # of the variant its lines are counted in (TemplateMiner.stats)
    error: bool
    progress: ProgressShape | None  # how to read a progress line's step, loss... (None: not progress)
    quiet: int = 0  # 1 when the line has no error word (a count, added per line)
    topology: bool = False  # an NCCL init line: which rank drives which GPU
    stats: TemplateStats | None = None  # the template's statistics (saves a lookup per line)
    # Whether the line's text can hold these words at all, known from the shape: a word without digits
    # that is in the text is in its digit-free key too, so a key without it rules the word out.
    loss: bool = True  # "loss" / "Loss": where a loss value is read
    traceback: bool = True  # TRACEBACK_START
    # A line the timeline looks at besides progress: a checkpoint save, or a repeated line that may
    # turn out to be progress (its counter rises: see timeline.Learner). Cleared once decided.
    watch: bool = False
    checkpoint: bool = False
    completion: bool = False  # the run says its training is over (timeline.yaml `completions`)
    # Starts a block kept whole although its lines carry no error word: "stack" (a py-spy / faulthandler /
    # gdb dump), "fr" (a report of torch's flight-recorder analyser). None: not one.
    block: str | None = None
    section: bool = False  # may name the stack dumps that follow it (stacks.section_name)
    ps_header: PsColumns | None = None  # a `ps` header: the rows after it are read by its columns (procs.py)
    ps_row: int = 0  # a `ps aux` row: 1, one in uninterruptible sleep (state D): 2
    collected: bool = False  # any of the three above: a line of what an operator collected from the nodes
    work: bool = False  # no error word, no traceback, no dump: a line of the process's own work (timeouts.py)


@dataclass
class TemplateMiner:
    """Drain's tree, the shapes cache and the variants: which template a line of a new shape is counted in, and the
    templates as reported. What is reported depends on the counts (`_telling_positions`), so the reporting
    methods take a `stamp` (the compressor's line count): their result is cached until it changes."""

    config: CompressConfig = field(default_factory=CompressConfig)

    def __post_init__(self) -> None:
        c = self.config
        self.drain = _Drain(depth=c.drain_depth, sim_th=c.drain_sim_th, max_children=c.drain_max_children,
                            match_params=c.match_params, max_tokens=c.max_tokens, max_leaf=c.max_leaf_templates)
        self._novelty = _Novelty(c.novelty_window, c.novelty_share, c.novelty_min_templates, c.novelty_probe)
        # Digit-free line -> its shape. The compressor reads it directly on every line (a dict lookup, no call).
        self.shapes: dict[bytes, Shape] = {}
        self.stats: dict[int, TemplateStats] = {}  # per variant (see _Cluster), by its own id
        self.clusters: dict[int, _Cluster] = {}  # by Drain cluster id
        self._next_variant_id = 1
        self._merged: tuple[int, dict[int, int]] | None = None  # (stamp when computed, merged_ids())
        self._groups: tuple[int, dict[int, int], dict[int, str]] | None = None  # (stamp, _grouping())

    def remember(self, key: bytes, shape: Shape) -> None:
        """Cache a new shape (the whole cache is dropped when full: shapes seen again are simply made again)."""
        if len(self.shapes) >= self.config.mask_cache_size:
            self.shapes.clear()
        self.shapes[key] = shape

    def variant_for(self, masked: str) -> TemplateStats:
        """The statistics a new shape's lines are counted in: its Drain cluster's variant."""
        if len(self.stats) >= self.config.max_templates:
            overflow = self.stats.get(-1)
            if overflow is None:
                overflow = self.stats[-1] = TemplateStats(template_id=-1, template="<overflow: too many templates>")
            return overflow
        if self._novelty.skip():
            return self.unique()
        known = self.drain.clusters_counter
        cluster = self.drain.add_bounded(masked)
        if cluster is None:
            return self.unique()
        self._novelty.note(self.drain.clusters_counter != known, len(self.stats))
        cid = cluster.cluster_id
        tokens = split_tokens(masked, self.config.max_tokens)  # as Drain splits it
        state = self.clusters.get(cid)
        if state is None:
            state = self.clusters[cid] = _Cluster(words=[set() for _ in tokens])
        key = state.variant_key(tokens, self.config.split_max_words)
        stats = state.variants.get(key)
        if stats is None and len(state.variants) >= self.config.max_variants_per_template:
            state.closed = True
            key = (None,) * len(tokens)
            stats = state.variants.get(key)
        if stats is None:
            stats = TemplateStats(template_id=self._next_variant_id, template=cluster.get_template())
            self._next_variant_id += 1
            state.variants[key] = stats
            self.stats[stats.template_id] = stats
        return stats

    def unique(self) -> TemplateStats:
        """Where lines that never repeat are counted, once they flood (see CompressConfig.novelty_*)."""
        stats = self.stats.get(-3)
        if stats is None:
            stats = self.stats[-3] = TemplateStats(template_id=-3, template="<lines that never repeat>")
        return stats

    @property
    def cap_reached(self) -> bool:
        """New templates now go to the overflow template (CompressConfig.max_templates)."""
        return len(self.stats) >= self.config.max_templates

    def templates(self, stamp: int) -> list[TemplateStats]:
        """Per-template statistics, as reported: the variants of one group (`group_ids()`) summed under
        the group's id (its lowest variant id), with the group's template text."""
        ids, texts = self._grouping(stamp)
        out: dict[int, TemplateStats] = {}
        for vid in sorted(self.stats):
            stats = self.stats[vid]
            gid = ids.get(vid, vid)
            if gid == vid:
                stats.template = texts.get(gid, stats.template)
                out[gid] = stats
                continue
            into = out.get(gid)
            if into is None:  # the group's lowest id comes first: should not happen
                out[vid] = stats
                continue
            if into is self.stats.get(gid):  # copy before summing: the live statistics stay per variant
                into = out[gid] = TemplateStats(
                    template_id=gid, template=into.template, count=into.count, first_line=into.first_line,
                    last_line=into.last_line, sample=into.sample, ranks=set(into.ranks), hosts=set(into.hosts),
                    kept=into.kept, error_bearing=into.error_bearing)
            if stats.count and (not into.count or stats.first_line < into.first_line):
                into.first_line, into.sample = stats.first_line, stats.sample
            into.count += stats.count
            into.last_line = max(into.last_line, stats.last_line)
            into.ranks |= stats.ranks
            into.hosts |= stats.hosts
            into.kept += stats.kept
            into.error_bearing |= stats.error_bearing
        return sorted(out.values(), key=lambda s: s.first_line)

    def group_ids(self, stamp: int) -> dict[int, int]:
        """Variant id (`KeptLine.template_id`) -> the id of the template it is reported in."""
        return self._grouping(stamp)[0]

    def _grouping(self, stamp: int) -> tuple[dict[int, int], dict[int, str]]:
        """(variant id -> group id, group id -> template text). A group is the variants of the Drain
        clusters `merged_ids()` joins that have the same words at the positions that tell events apart
        (`_telling_positions`). Computed when asked, not in `add()`; cached until the next line."""
        if self._groups is not None and self._groups[0] == stamp:
            return self._groups[1], self._groups[2]
        merged = self.merged_ids(stamp)
        members: dict[int, list[int]] = {}
        for cid in sorted(self.clusters):
            members.setdefault(merged.get(cid, cid), []).append(cid)
        ids: dict[int, int] = {}
        texts: dict[int, str] = {}
        for cids in members.values():
            states = [self.clusters[c] for c in cids]
            template = _common_template([self.drain.id_to_cluster[c].log_template_tokens for c in cids])
            telling = self._telling_positions(states, len(template))
            groups: dict[tuple[str | None, ...], list[int]] = {}
            for state in states:
                for key, stats in state.variants.items():
                    groups.setdefault(tuple(key[p] for p in telling), []).append(stats.template_id)
            for words, vids in groups.items():
                gid = min(vids)
                for vid in vids:
                    ids[vid] = gid
                tokens = list(template)
                for p, word in zip(telling, words):
                    tokens[p] = word or PARAM
                texts[gid] = " ".join(tokens)
        self._groups = (stamp, ids, texts)
        return ids, texts

    def _telling_positions(self, states: list[_Cluster], length: int) -> list[int]:
        """The positions that only ever held a few words, each on `split_min_lines` lines or more."""
        c = self.config
        if c.split_max_words < 2 or any(s.closed for s in states):
            return []
        telling = []
        for p in range(length):
            if any(s.words[p] is None for s in states):
                continue
            lines: dict[str | None, int] = {}
            for state in states:
                for key, stats in state.variants.items():
                    lines[key[p]] = lines.get(key[p], 0) + stats.count
            if 2 <= len(lines) <= c.split_max_words and min(lines.values()) >= c.split_min_lines:
                telling.append(p)
        return telling

    def merged_ids(self, stamp: int) -> dict[int, int]:
        """Cluster id -> the id of the group it is reported in. Drain never joins two clusters once
        made, so a cluster that became general (`a <*> c`) sits next to an earlier, more specific one
        (`a b c`) that its lines no longer reach. Templates of the same length that differ only in
        positions where one of them has `<*>` (or are equal) are one group (transitively; the lowest id names it).
        Computed when asked (templates(), template_id_of()), not in `add()`; cached until the next line."""
        if self._merged is not None and self._merged[0] == stamp:
            return self._merged[1]
        parent: dict[int, int] = {}
        if len(self.drain.clusters) > self.config.max_merged_templates:  # pairwise: bounded
            self._merged = (stamp, {})
            return self._merged[1]

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        by_length: dict[int, list[tuple[int, list[str]]]] = {}
        for cluster in sorted(self.drain.clusters, key=lambda c: c.cluster_id):
            cid = cluster.cluster_id
            parent[cid] = cid
            tokens = list(cluster.log_template_tokens)
            if PARAM not in tokens:
                continue  # nothing to widen: it can only be the specific side, found from the other
            by_length.setdefault(len(tokens), []).append((cid, tokens))
        for cluster in self.drain.clusters:
            tokens = cluster.log_template_tokens
            for cid, general in by_length.get(len(tokens), ()):
                if cid != cluster.cluster_id and _covers(general, tokens):
                    a, b = find(cid), find(cluster.cluster_id)
                    if a != b:
                        parent[max(a, b)] = min(a, b)
        merged = {cid: find(cid) for cid in parent}
        self._merged = (stamp, merged)
        return merged


def _common_template(templates: list[list[str]]) -> list[str]:
    """Templates of one length as one: their token where they all agree, <*> where they do not."""
    first = templates[0]
    return [t if all(other[p] == t for other in templates[1:]) else PARAM for p, t in enumerate(first)]


def _covers(general: list[str], tokens: list[str]) -> bool:
    """Whether two templates of one length differ only where one of them has a wildcard (or not at all)."""
    return all(g == t or PARAM in (g, t) for g, t in zip(general, tokens))


