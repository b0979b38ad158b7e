"""All configuration in one place: defaults that work out of the box, an optional file, env vars.

Precedence (later wins): built-in defaults < the file named by `--config` or `LOGDX_CONFIG`
(YAML or TOML) < environment variables `LOGDX_<SECTION>__<KEY>` (e.g. `LOGDX_LLM__BACKEND=openai`,
`LOGDX_SERVER__PORT=8080`). List values in env vars are comma-separated.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSettings(_Section):
    max_line_bytes: int = Field(64 * 1024, ge=256, description="longer lines are cut and marked")


class CompressSettings(_Section):
    drain_depth: int = Field(5, ge=3)
    drain_sim_th: float = Field(0.75, gt=0, le=1)
    max_templates: int = Field(20_000, ge=100)
    max_kept_lines: int = Field(100_000, ge=1000)
    kept_per_error_template: int = Field(64, ge=1)
    tail_lines_per_source: int = Field(20, ge=0)
    split_max_words: int = Field(
        4, ge=0, description="a template position holding at most this many words, each on 2+ lines, "
        "is reported as one template per word (\"VM Paused\" / \"VM Resumed\"); 0 turns it off")


class DetectSettings(_Section):
    stall_factor: float = Field(10.0, gt=1)
    stall_min_s: float = Field(300.0, ge=0)


class RulesSettings(_Section):
    dirs: list[Path] = Field(default_factory=list, description="extra rule packs, loaded after the built-in ones")


class RetrievalSettings(_Section):
    enabled: bool = True
    k: int = Field(5, ge=1, le=50)
    min_similarity: float = Field(0.55, ge=0, le=1)
    temperature: float = Field(0.05, gt=0, description="softmax temperature of the neighbour vote")
    root_weight: float = Field(0.7, ge=0, le=1, description="weight of the root template vs the whole context")
    exception_bonus: float = Field(0.1, ge=0, le=1, description="similarity bonus when exception classes match")
    index_path: Path | None = Field(None, description="FAISS index file; default beside the database")


class LLMSettings(_Section):
    enabled: bool = True
    backend: Literal["embedded", "openai"] = "embedded"
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "default"
    api_key: str = ""
    timeout_s: float = Field(30.0, gt=0)
    json_mode: bool = True
    cache_dir: Path = Field(Path.home() / ".cache" / "logdx", description="the converted model goes here")
    allow_convert: bool = True
    threads: int = Field(0, ge=0, description="torch threads; 0 = by load")
    max_candidates: int = Field(12, ge=2)
    max_examples: int = Field(3, ge=0)
    prompts_dir: Path | None = Field(None, description="default: the repository's prompts/")
    always: bool = Field(False, description="run the LLM even when a precise rule decided")


class FusionSettings(_Section):
    """Weights of the stages when their votes are fused (see logdx/diagnose/fusion.py)."""

    rules_precise: float = 1.0
    rules_fallback: float = 0.35
    retrieval: float = 0.6
    llm_arbiter: float = 0.5
    llm_advisor: float = 0.15
    split_margin: float = 0.2
    category_credit: float = 0.3
    dissent_penalty: float = 0.5
    min_support: float = 0.15
    max_confidence: float = 0.99


class StoreSettings(_Section):
    path: Path = Path.home() / ".local" / "share" / "logdx" / "logdx.db"


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8077, ge=1, le=65535)
    workers: int = Field(1, ge=1)
    token: str = ""
    max_request_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    public_url: str = ""
    rate_limit_lines_per_s: float = Field(
        100_000.0, ge=0, description="per job, sustained; 0 disables the limit (429 + Retry-After when exceeded)")
    rate_limit_burst_lines: int = Field(2_000_000, ge=1, description="per job: lines accepted at once before limiting")
    early_diagnosis_delay_s: float = Field(
        2.0, ge=0, description="debounce: diagnose this long after a root-cause line arrives, before the job ends")
    max_sessions: int = Field(256, ge=1, description="job sessions kept in memory; others are rebuilt from spool")
    spool_dir: Path | None = Field(None, description="per-job line spools; default: <store.path>.spool/")
    keep_spool: bool = Field(False, description="keep a job's spool after it ended (default: delete it)")
    access_log: bool = False


class SlackDestination(_Section):
    webhook_url: str


class WebhookDestination(_Section):
    url: str
    secret: str = Field("", description="Standard Webhooks secret (whsec_... base64) used to sign")


class AlertsSettings(_Section):
    slack: list[SlackDestination] = Field(default_factory=list)
    webhooks: list[WebhookDestination] = Field(default_factory=list)
    max_attempts: int = Field(8, ge=1)
    backoff_initial_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(300.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    min_confidence: float = Field(0.0, ge=0, le=1)


class ActionsSettings(_Section):
    dry_run: bool = True
    actuator: Literal["none", "kubernetes", "slurm"] = "none"
    kube_taint: bool = False
    kube_api: str = Field("", description="API server URL; empty: in-cluster or ~/.kube/config")
    kube_token: str = ""
    scontrol: str = "scontrol"
    restart_command: str = ""
    restart_webhook: str = ""
    max_cordons: int = Field(2, ge=0, description="at most this many nodes cordoned per window")
    window_s: float = Field(3600.0, gt=0)
    min_confidence: float = Field(0.8, ge=0, le=1)


class Settings(_Section):
    input: InputSettings = Field(default_factory=InputSettings)
    compress: CompressSettings = Field(default_factory=CompressSettings)
    detect: DetectSettings = Field(default_factory=DetectSettings)
    rules: RulesSettings = Field(default_factory=RulesSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    llm: LLMSettings = Field(default_factory=LLMSettings)
    fusion: FusionSettings = Field(default_factory=FusionSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    alerts: AlertsSettings = Field(default_factory=AlertsSettings)
    actions: ActionsSettings = Field(default_factory=ActionsSettings)


class ConfigError(Exception):
    """The configuration file or an environment variable is invalid; the message says which."""


def load_settings(path: str | Path | None = None, env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    data: dict[str, Any] = {}
    source = str(path or env.get("LOGDX_CONFIG") or "")
    if source:
        data = _read_file(Path(source))
    _merge(data, _from_env(env))
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        origin = f"{source}: " if source else ""
        raise ConfigError(f"{origin}invalid setting {where}: {first['msg']}") from None


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        loaded = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return loaded


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("LOGDX_") or "__" not in name:
            continue
        section, _, key = name[len("LOGDX_"):].lower().partition("__")
        field = Settings.model_fields.get(section)
        if field is None:
            continue
        sub_fields = field.annotation.model_fields if field.annotation else {}  # type: ignore[union-attr]
        parsed: Any = value
        sub = sub_fields.get(key)
        if sub is not None and "list" in str(sub.annotation):
            parsed = [v for v in value.split(",") if v]
        out.setdefault(section, {})[key] = parsed
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
