"""Re-create an evaluation set's .log files from git mirrors of their public sources (stdlib only).

The logs of eval/heldout/real and eval/wholejobs are third-party text and are not committed: each label carries
its source as a GitHub URL at a fixed commit (`https://github.com/OWNER/NAME/blob/COMMIT/PATH[#anchor]`), and a
set's fetch.py holds, per case, how its log was cut from that file (a `Recipe`). This module does the cutting:

  whole file          a job's own output file (.out, .log, .txt): the file's bytes, unchanged
  markdown section    `PATH.md#anchor`: the fenced code blocks of that section (GitHub's anchor of a heading, the
                      section running to the next heading of the same or a higher level), concatenated without
                      the prose between them; by default the blocks holding the root line or one of its
                      alternatives, else the blocks the recipe names (0-based, in the section's order)
  markdown file       `PATH.md` without an anchor: the same, over the whole file
  reStructuredText    `PATH.rst`: the indented bodies of its `.. code-block::` / `.. code::` directives

A recipe may keep a block's *captions*: the short lines just above it (py-spy dumps grouped under "Node 48:",
"4 in:"), which name the node and the process group a dump belongs to.

Every log written is checked against its label: the root line must be exactly line `root_line_no` (1-based).

A mirror is any git directory holding the commit: the `fetch` tool's `MIRRORS/OWNER+NAME/repo`, or a clone at
`MIRRORS/OWNER+NAME`, `MIRRORS/OWNER/NAME` or `MIRRORS/NAME` (a partial clone, `git clone --filter=blob:none
--no-checkout`, is enough: `git show COMMIT:PATH` fetches the one blob).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ENCODING = "utf-8"
ERRORS = "surrogateescape"          # keep any byte that is not UTF-8 as it was
CAPTION_MAX = 20                    # "Node 48:", "4 in:": a caption is a short line, never a sentence of prose

BLOB_URL = re.compile(r"^https://github\.com/(?P<owner>[^/]+)/(?P<name>[^/]+)/blob/(?P<commit>[0-9a-f]{40})/"
                      r"(?P<path>[^#]+)(?:#(?P<anchor>.+))?$")
THREAD_URL = re.compile(r"^https://github\.com/[^/]+/[^/]+/(?:issues|pull|discussions)/\d+")
MD_HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
MD_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
RST_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\.[ \t]+(?:code-block|code|sourcecode)::")


@dataclass(frozen=True)
class Source:
    """One file of a public repository at a fixed commit, and optionally a section of it."""

    owner: str
    name: str
    commit: str
    path: str
    anchor: str | None = None

    @property
    def repo(self) -> str:
        return f"{self.owner}/{self.name}"

    @property
    def url(self) -> str:
        tail = f"#{self.anchor}" if self.anchor else ""
        return f"https://github.com/{self.repo}/blob/{self.commit}/{self.path}{tail}"


@dataclass(frozen=True)
class Recipe:
    """How one case's log is cut from its source (the defaults fit most cases)."""

    blocks: tuple[int, ...] | None = None   # code blocks to keep, 0-based; None: those holding the root line
    captions: bool = False                  # keep the short caption lines above each kept block
    commit: str | None = None               # read the file at this commit instead of the label's (why: a comment)
    why: str = ""                           # one line for the report: what the cut is and why it is unambiguous


@dataclass
class Block:
    """A code block: its lines (dedented for reStructuredText) and the caption lines just above it."""

    lines: list[str]
    captions: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    case: str
    state: str          # written | no-mirror | not-recreatable | mismatch | error
    detail: str = ""


class CutError(Exception):
    """The source cannot be cut as the recipe says (no such section, block, commit...)."""


# -- sources and mirrors ---------------------------------------------------------------------------------------

def parse_source(url: str) -> Source | None:
    """The file a label cites, or None when it cites something no git mirror holds (an issue thread)."""
    m = BLOB_URL.match(url)
    if not m:
        return None
    return Source(m["owner"], m["name"], m["commit"], m["path"], m["anchor"])


def mirror_candidates(mirrors: Path, src: Source) -> list[Path]:
    both = f"{src.owner}+{src.name}"
    return [mirrors / both / "repo", mirrors / both, mirrors / src.owner / src.name, mirrors / src.name]


def find_mirror(mirrors: Path, src: Source) -> Path | None:
    for cand in mirror_candidates(mirrors, src):
        if (cand / "objects").is_dir() or (cand / ".git").exists():
            return cand
    return None


def git_show(gitdir: Path, commit: str, path: str) -> bytes:
    proc = subprocess.run(["git", "-C", str(gitdir), "show", f"{commit}:{path}"], capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode(ENCODING, ERRORS).strip().splitlines()
        raise CutError(f"git show {commit[:10]}:{path} in {gitdir}: {err[-1] if err else 'failed'}")
    return proc.stdout


# -- markdown ----------------------------------------------------------------------------------------------------

def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def md_headings(lines: Sequence[str]) -> list[tuple[int, int, str]]:
    """(line index, level, anchor) of every ATX heading outside code fences; repeated anchors get -1, -2..."""
    found: list[tuple[int, int, str]] = []
    seen: dict[str, int] = {}
    fence: str | None = None
    for i, line in enumerate(lines):
        fm = MD_FENCE.match(line)
        if fm:
            fence = _fence_step(fence, fm)
            continue
        if fence is not None:
            continue
        hm = MD_HEADING.match(line)
        if hm:
            slug = github_anchor(hm[2])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.append((i, len(hm[1]), slug if n == 0 else f"{slug}-{n}"))
    return found


def _fence_step(fence: str | None, m: re.Match[str]) -> str | None:
    """The open fence after a fence line: opens one, closes the open one, or is text inside it."""
    marker, rest = m[1], m[2]
    if fence is None:
        return marker
    if marker[0] == fence[0] and len(marker) >= len(fence) and not rest.strip():
        return None
    return fence


def md_section(lines: Sequence[str], anchor: str) -> tuple[int, int]:
    """Line range [start, end) of the section under the heading with this anchor."""
    heads = md_headings(lines)
    for k, (i, level, slug) in enumerate(heads):
        if slug == anchor:
            end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
            return i, end
    raise CutError(f"no heading with anchor #{anchor}")


def md_blocks(lines: Sequence[str]) -> list[Block]:
    """The fenced code blocks of these lines, each with the short caption lines since the previous block."""
    blocks: list[Block] = []
    fence: str | None = None
    body: list[str] = []
    between: list[str] = []
    for line in lines:
        fm = MD_FENCE.match(line)
        if fm:
            was = fence
            fence = _fence_step(fence, fm)
            if was is None and fence is not None:
                body = []
            elif was is not None and fence is None:
                blocks.append(Block(body, [s.strip() for s in between if 0 < len(s.strip()) <= CAPTION_MAX]))
                between = []
            else:
                body.append(line)
            continue
        (body if fence is not None else between).append(line)
    return blocks


# -- reStructuredText --------------------------------------------------------------------------------------------

def rst_blocks(lines: Sequence[str]) -> list[Block]:
    """The bodies of `.. code-block::` / `.. code::` directives: the lines indented under them, dedented."""
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = RST_DIRECTIVE.match(lines[i])
        i += 1
        if not m:
            continue
        outer = len(m["indent"].expandtabs())
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > outer):
            body.append(lines[i])
            i += 1
        blocks.append(Block(_dedent(body)))
    return blocks


def _indent(line: str) -> int:
    return len(line.expandtabs()) - len(line.expandtabs().lstrip())


def _dedent(body: list[str]) -> list[str]:
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    cut = min((_indent(x) for x in body if x.strip()), default=0)
    return [x.expandtabs()[cut:] if x.strip() else "" for x in body]


# -- cutting -----------------------------------------------------------------------------------------------------

def wanted_lines(label: Mapping[str, object]) -> list[str]:
    """The root line and its alternatives: the lines a default cut must keep."""
    alts = label.get("root_line_alt") or []
    out = [label["root_line"]] if label.get("root_line") else []
    return [str(x) for x in [*out, *(alts if isinstance(alts, list) else [])] if x]


def choose_blocks(blocks: list[Block], recipe: Recipe, label: Mapping[str, object]) -> list[Block]:
    if recipe.blocks is not None:
        bad = [b for b in recipe.blocks if not 0 <= b < len(blocks)]
        if bad:
            raise CutError(f"block(s) {bad} out of range: the section has {len(blocks)}")
        return [blocks[b] for b in recipe.blocks]
    want = wanted_lines(label)
    chosen = [b for b in blocks if any(w in b.lines for w in want)]
    if not chosen:
        raise CutError("no code block holds the root line or an alternative: the recipe must name its blocks")
    return chosen


def join_blocks(blocks: list[Block], captions: bool) -> str:
    out: list[str] = []
    for b in blocks:
        if captions:
            out.extend(b.captions)
        out.extend(b.lines)
    return "\n".join(out) + "\n"


def cut(raw: bytes, src: Source, recipe: Recipe, label: Mapping[str, object]) -> bytes:
    """The case's log from the raw bytes of its source file."""
    suffix = Path(src.path).suffix.lower()
    if suffix not in (".md", ".markdown", ".rst"):
        return raw
    lines = raw.decode(ENCODING, ERRORS).split("\n")
    lines = [x[:-1] if x.endswith("\r") else x for x in lines]
    if suffix == ".rst":
        blocks = rst_blocks(lines)
    else:
        start, end = md_section(lines, src.anchor) if src.anchor else (0, len(lines))
        blocks = md_blocks(lines[start + (1 if src.anchor else 0):end])
    return join_blocks(choose_blocks(blocks, recipe, label), recipe.captions).encode(ENCODING, ERRORS)


def check(log: bytes, label: Mapping[str, object]) -> str:
    """Empty when the log agrees with its label, else what disagrees."""
    lines = [x[:-1] if x.endswith("\r") else x for x in log.decode(ENCODING, ERRORS).split("\n")]
    root, no = label.get("root_line"), label.get("root_line_no")
    if root and isinstance(no, int):
        got = lines[no - 1] if 0 < no <= len(lines) else "<past the end>"
        if got != root:
            where = [i + 1 for i, x in enumerate(lines) if x == root]
            return f"line {no} is not the root line (it is at {where or 'no line'}): {got[:80]!r}"
    elif root and root not in lines:
        return "the root line is not a line of the log"
    missing = [a for a in wanted_lines(label)[1:] if a not in lines]
    return f"{len(missing)} root_line_alt not in the log: {missing[0][:60]!r}" if missing else ""


# -- a whole set -------------------------------------------------------------------------------------------------

def load_labels(path: Path) -> list[tuple[str, dict[str, object]]]:
    """Each label with its line as written (a copy of the labels is made of these lines, never re-serialised)."""
    with path.open(encoding=ENCODING) as f:
        return [(line, json.loads(line)) for line in f if line.strip()]


def recreate_one(label: Mapping[str, object], recipe: Recipe, mirrors: Path, out: Path) -> Outcome:
    case, url = str(label["id"]), str(label["source"])
    src = parse_source(url)
    if src is None:
        kind = "an issue/PR thread" if THREAD_URL.match(url) else "not a file at a fixed commit"
        return Outcome(case, "not-recreatable", f"{kind}: no git mirror holds its text ({url})")
    gitdir = find_mirror(mirrors, src)
    if gitdir is None:
        return Outcome(case, "no-mirror", f"no mirror of {src.repo} under {mirrors}")
    try:
        raw = git_show(gitdir, recipe.commit or src.commit, src.path)
        log = cut(raw, src, recipe, label)
    except CutError as e:
        return Outcome(case, "error", str(e))
    problem = check(log, label)
    if problem:
        return Outcome(case, "mismatch", problem)
    (out / f"{case}.log").write_bytes(log)
    n_lines = log.count(b"\n")
    return Outcome(case, "written", f"{n_lines} lines  {recipe.why}".rstrip())


def main(set_dir: Path, recipes: Mapping[str, Recipe], argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"Re-create the .log files of {set_dir.name}/ from git mirrors.")
    ap.add_argument("--mirrors", type=Path, required=True, help="directory of git mirrors (see eval/mirrorcut.py)")
    ap.add_argument("--out", type=Path, default=set_dir,
                    help="where to write NNN.log (default: beside labels.jsonl); another directory also gets a "
                         "labels.jsonl of the cases written, so eval/heldout/score.py can run on it as it is")
    ap.add_argument("--ids", default="", help="only these case ids, comma-separated")
    args = ap.parse_args(argv)
    labels = load_labels(set_dir / "labels.jsonl")
    only = {x.strip() for x in args.ids.split(",") if x.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = [recreate_one(lab, recipes.get(str(lab["id"]), Recipe()), args.mirrors, args.out)
                for _, lab in labels if not only or str(lab["id"]) in only]
    for o in outcomes:
        print(f"{o.case}  {o.state:<15} {o.detail}")
    written = {o.case for o in outcomes if o.state == "written"}
    if args.out.resolve() != set_dir.resolve():
        with (args.out / "labels.jsonl").open("w", encoding=ENCODING) as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line, lab in labels
                         if str(lab["id"]) in written)
    states = [o.state for o in outcomes]
    print(", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))), file=sys.stderr)
    return 1 if any(s in ("mismatch", "error") for s in states) else 0
