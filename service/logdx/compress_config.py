"""The compressor's knobs (`CompressConfig`), read by each of its parts: template mining (`mining.py`), the keep
policy (`keep_policy.py`), the topology (`topology.py`) and the orchestration over them (`compress.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from logdx.config import CompressSettings


def _setting(name: str) -> Any:
    """The default of a knob that is also a setting: declared once, in config.CompressSettings."""
    return CompressSettings.model_fields[name].default


@dataclass(slots=True)
class CompressConfig:
    # Drain's prefix-tree depth and similarity threshold. On loghub-2k (bench/bench_compress.py) depth 5 /
    # 0.75 with `drain_match_params` groups best: average GA 0.87, against 0.75 at drain3's 4 / 0.4.
    # (Knobs that are settings take their defaults from config.CompressSettings.)
    drain_depth: int = _setting("drain_depth")
    drain_sim_th: float = _setting("drain_sim_th")
    drain_max_children: int = 100
    # Count a template's wildcards as matching when comparing a line with it (drain3's `include_params`,
    # which its own `match()` uses). Without it a line whose variables were masked scores low against
    # its own template (each <*> counts as a mismatch), so masking splits templates. With it every
    # similarity is higher, so it only suits a strict threshold: None (default) turns it on when
    # drain_sim_th >= 0.6 (a permissive threshold would then merge templates that differ in a word).
    drain_match_params: bool | None = None
    max_templates: int = _setting("max_templates")  # beyond this, new templates share one overflow bucket
    max_kept_lines: int = _setting("max_kept_lines")  # hard budget for lines kept in full
    kept_per_error_template: int = _setting("kept_per_error_template")
    first_lines_per_template: int = 2
    tail_lines_per_source: int = _setting("tail_lines_per_source")
    max_sources: int = 8192
    max_traceback_lines: int = 400  # per source, per traceback
    max_block_lines: int = 400  # per source, per block (a py-spy dump of one process and its threads, an fr_trace report)
    mask_cache_size: int = 200_000
    max_ids_per_template: int = 4096  # ranks / hosts remembered per template
    max_merged_templates: int = 2000  # above this many templates, merged_ids() leaves them apart
    # A position of a template that only ever held a few words, each on more than one line, is a constant
    # that tells events apart ("VM Paused" / "VM Resumed", "stored as bytes" / "stored as values"), not a
    # variable: its lines are reported as one template per word. Drain cannot see this: it widens a
    # position to <*> at its second value. 0 turns it off.
    split_max_words: int = _setting("split_max_words")
    split_min_lines: int = 2
    max_variants_per_template: int = 32  # beyond this, a template's new lines share one and it is not split
    # Bounds on what one new line may cost (random text must not make mining quadratic): Drain sees the
    # first `max_tokens` words (the rest is one word); a leaf of Drain's tree holds at most
    # `max_leaf_templates` templates (a line that matches none of a full leaf's goes to the "unique lines"
    # template); and once `novelty_min_templates` exist, a window of `novelty_window` new shapes of which more
    # than `novelty_share` made a new template means lines that never repeat: new shapes then skip Drain
    # (the "unique lines" template) except one in `novelty_probe`, which decides when the flood is over.
    max_tokens: int = 64
    max_leaf_templates: int = 1024
    novelty_min_templates: int = 1000
    novelty_window: int = 1024
    novelty_share: float = 0.5
    novelty_probe: int = 16

    @property
    def match_params(self) -> bool:
        return self.drain_sim_th >= 0.6 if self.drain_match_params is None else self.drain_match_params

