"""Hostile YAML and config files: an alias bomb or absurd nesting is refused fast, with file and line,
by the rule loader, the taxonomy and the config reader; a config file that is not UTF-8 is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from logdx import yamlsafe
from logdx.config import ConfigError, load_settings
from logdx.diagnose.rules import RuleError, load_rules
from logdx.taxonomy import TaxonomyError, load_taxonomy
from logdx.testing import cpu_seconds
from logdx.yamlsafe import YamlError

REPO = Path(__file__).resolve().parents[1]


def alias_bomb(levels: int = 9, fanout: int = 9, key: str = "l") -> str:
    """"Billion laughs": each level names the previous one `fanout` times (9**9 = 387M nodes walked)."""
    lines = [f"{key}0: &{key}0 [" + ", ".join(["lol"] * fanout) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"{key}{i}: &{key}{i} [" + ", ".join([f"*{key}{i - 1}"] * fanout) + "]")
    return "\n".join(lines) + "\n"


def test_shipped_files_load_as_before() -> None:
    for path in [*sorted((REPO / "rules").glob("*.yaml")), REPO / "service" / "logdx" / "taxonomy.yaml"]:
        text = path.read_text(encoding="utf-8")
        assert yamlsafe.load(text, str(path)) == yaml.safe_load(text), path


def test_alias_bomb_is_refused_fast_with_its_line() -> None:
    with cpu_seconds() as cpu, pytest.raises(YamlError) as exc:
        yamlsafe.load(alias_bomb(), "pack.yaml")
    assert cpu.seconds < 0.5  # ~10 ms: refused on the event stream; expanding it would take minutes
    assert exc.value.kind == "nodes"
    # levels 0..6 expand to 9**7 ≈ 4.8M nodes: the 7th level's line is where it stops
    assert str(exc.value) == "pack.yaml:7: more than 1,000,000 nodes once aliases are expanded (an alias bomb?)"


def test_moderate_use_of_anchors_still_works() -> None:
    text = "base: &b {category: script, failure_type: key_error}\nrules:\n" + "".join(
        f"  - {{<<: *b, id: r{i}}}\n" for i in range(50))
    data = yamlsafe.load(text, "ok.yaml")
    assert len(data["rules"]) == 50 and data["rules"][7] == {"category": "script", "failure_type": "key_error",
                                                            "id": "r7"}


@pytest.mark.parametrize(("text", "line", "kind", "problem"), [
    # deeper than PyYAML's own limit too (libyaml's scanner stops at 1,000 levels): ours speaks first
    ("x:\n  y: " + "[" * 100_000 + "]" * 100_000, 2, "depth", f"nested more than {yamlsafe.MAX_DEPTH} levels deep"),
    ("x: " + "{a: " * 200 + "1" + "}" * 200 + "\n", 1, "depth", f"nested more than {yamlsafe.MAX_DEPTH} levels deep"),
    ("a: &a [1, *a]\n", 1, "recursive_alias", "alias *a refers to a node that contains it"),
    ("a: 1\nb: " + ", ".join(["*x"] * 5) + "\n", 2, "syntax", "invalid YAML"),
    ("x: &x 1\ny: [" + ", ".join(["*x"] * (yamlsafe.MAX_ALIASES + 1)) + "]\n", 2, "aliases",
     f"more than {yamlsafe.MAX_ALIASES} aliases"),
    ("a: [1, 2\nb: 3\n", 2, "syntax", "invalid YAML"),
    ("- a\n---\n- b\n", 2, "documents", "more than one YAML document"),
])
def test_refusals_name_file_and_line(text: str, line: int, kind: str, problem: str) -> None:
    with cpu_seconds() as cpu, pytest.raises(YamlError) as exc:
        yamlsafe.load(text, "f.yaml")
    assert cpu.seconds < 1.0  # each is refused within the first few KiB it reads
    assert (exc.value.kind, exc.value.line) == (kind, line), str(exc.value)
    assert exc.value.problem.startswith(problem), str(exc.value)
    assert str(exc.value).startswith(f"f.yaml:{line}: ") and "\n" not in str(exc.value)


def test_rule_pack_alias_bomb_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text("pack: bomb\ndescription: x\n" + alias_bomb() + "rules: []\n")
    with cpu_seconds() as cpu, pytest.raises(RuleError) as exc:
        load_rules([tmp_path])
    assert cpu.seconds < 2.0  # the shipped packs load in ~0.3 s; the bomb adds next to nothing
    assert "bomb.yaml:9: more than 1,000,000 nodes once aliases are expanded" in str(exc.value)


def test_taxonomy_alias_bomb_is_a_taxonomy_error(tmp_path: Path) -> None:
    path = tmp_path / "taxonomy.yaml"
    path.write_text(alias_bomb())
    with pytest.raises(TaxonomyError) as exc:
        load_taxonomy(path)
    assert str(exc.value) == f"{path}:7: more than 1,000,000 nodes once aliases are expanded (an alias bomb?)"


@pytest.mark.parametrize(("name", "body", "expected"), [
    ("latin1.yaml", b"llm:\n  model: caf\xe9\n", "latin1.yaml:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    ("bomb.yaml", alias_bomb().encode(), "bomb.yaml:7: more than 1,000,000 nodes once aliases are expanded"),
    ("deep.yaml", b"llm: " + b"[" * 50_000, "deep.yaml:1: nested more than"),
    ("broken.yaml", b"llm:\n  model: [x\n", "broken.yaml:3: invalid YAML"),
    ("broken.toml", b"[llm]\nmodel = \n", "broken.toml: not valid TOML: "),
])
def test_config_file_problems_are_one_line(tmp_path: Path, name: str, body: bytes, expected: str) -> None:
    path = tmp_path / name
    path.write_bytes(body)
    with pytest.raises(ConfigError) as exc:
        load_settings(path, env={})
    assert expected in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_config_with_bom_and_anchors_loads(tmp_path: Path) -> None:
    path = tmp_path / "logdx.yaml"
    path.write_bytes("\ufeffllm: &off {enabled: false}\nretrieval: {enabled: false}\n".encode())
    assert load_settings(path, env={}).llm.enabled is False


def test_config_that_is_not_a_file_of_settings(tmp_path: Path) -> None:
    big = tmp_path / "job.log"
    big.write_bytes(b"x" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_settings(big, env={})


@pytest.mark.integration
def test_cli_non_utf8_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "logdx.yaml"
    config.write_bytes(b"llm:\n  model: caf\xe9\n")
    log = tmp_path / "job.log"
    log.write_text("hello\n")
    out = subprocess.run([sys.executable, "-m", "logdx", "diagnose", str(log), "--config", str(config)],
                         capture_output=True, timeout=120, cwd=tmp_path)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, err
    assert err.splitlines() == [f"logdx: error: {config}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"]
