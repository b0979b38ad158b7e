"""Loghub-2k: the 16 labelled system logs, their message parts, and grouping accuracy.

The message part of a raw line is cut out with the header regex built from `formats.json` the way
logparser does it (`generate_logformat_regex`: each `<Field>` becomes a lazy named group, runs of
spaces become `\\s+`, the whole line is anchored and stripped first).
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

DATASETS = (
    "HDFS", "Hadoop", "Spark", "Zookeeper", "BGL", "HPC", "Thunderbird", "Windows",
    "Linux", "Android", "HealthApp", "Apache", "Proxifier", "OpenSSH", "OpenStack", "Mac",
)


@dataclass
class Dataset:
    name: str
    raw: list[str]  # the raw lines, as in NAME_2k.log
    content: list[str]  # the message part of each line (what a template miner sees)
    truth: list[str]  # ground-truth EventId of each line
    header_misses: int  # lines the header regex did not match (the labelled Content was used)
    content_diffs: int  # lines where the header regex's message differs from the labelled Content


def logformat_regex(logformat: str) -> re.Pattern[str]:
    """logparser's `generate_logformat_regex`."""
    regex = ""
    for k, part in enumerate(re.split(r"(<[^<>]+>)", logformat)):
        if k % 2 == 0:
            regex += re.sub(" +", r"\\s+", part)
        else:
            regex += f"(?P<{part.strip('<').strip('>')}>.*?)"
    return re.compile("^" + regex + "$")


def load(root: Path, name: str) -> Dataset:
    formats = json.loads((root / "formats.json").read_text())
    header = logformat_regex(formats[name])
    raw = (root / name / f"{name}_2k.log").read_text(encoding="utf-8", errors="replace").splitlines()
    with open(root / name / f"{name}_2k.log_structured.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if len(rows) != len(raw):
        raise ValueError(f"{name}: {len(raw)} lines but {len(rows)} labelled rows")
    content, misses, diffs = [], 0, 0
    for line, row in zip(raw, rows):
        m = header.search(line.strip())
        if m is None:
            misses += 1
            content.append(row["Content"])
            continue
        content.append(m.group("Content"))
        diffs += m.group("Content") != row["Content"]
    return Dataset(name, raw, content, [row["EventId"] for row in rows], misses, diffs)


def grouping_accuracy(truth: Sequence[Hashable], predicted: Sequence[Hashable]) -> float:
    """GA (Zhu et al., ICSE-SEIP 2019): a line is right iff the set of lines in its predicted group
    is exactly the set of lines in its ground-truth group."""
    if len(truth) != len(predicted):
        raise ValueError("truth and prediction differ in length")
    truth_size = Counter(truth)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, p in enumerate(predicted):
        members[p].append(i)
    right = 0
    for lines in members.values():
        events = {truth[i] for i in lines}
        if len(events) == 1 and truth_size[next(iter(events))] == len(lines):
            right += len(lines)
    return right / len(truth) if truth else 1.0
