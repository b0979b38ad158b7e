"""Reading a log record (a JSON object, a msgpack map, OTLP attributes, Loki labels) the way the
common shippers shape it: which field is the line, the host, the rank, the time, the job.

- line: the first *string* among `message`, `log`, `msg`, `MESSAGE` (journald), `short_message`
  (GELF), `line`; so ECS's `log` object never hides `message`;
- host: `host`, `hostname`, `_HOSTNAME` (journald; `_hostname` when Fluent Bit's systemd input
  lowercases keys), ECS `host.name`, `kubernetes.host`,
  `kubernetes.pod_node_name`, OpenTelemetry `host.name` / `k8s.node.name`; always a plain host name
  (`logdx.hosts.clean_hostname`): a range or a list is no host;
- rank: `rank`, `RANK`; a pod name's ordinal only when configured;
- time: epoch seconds, ms, us or ns (told apart by size) or RFC 3339 text, from `ts`, `timestamp`,
  `date`, `time`, `@timestamp`, `__REALTIME_TIMESTAMP` (journald; lowercased too);
- job: the request's, else the first of `Meta.job_keys` the record has.

A dotted key is looked up flat first ("k8s.job.name" as OTLP writes it), then as a path into nested
objects ({"host": {"name": ...}} as ECS writes it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from logdx.formats.base import Batch, Meta
from logdx.hosts import clean_hostname
from logdx.normalize import Source
from logdx.tenancy import MAX_JOB_ID

MAX_RANK = 1 << 24
MESSAGE_KEYS = ("message", "log", "msg", "MESSAGE", "short_message", "line")
HOST_KEYS = ("host", "hostname", "_HOSTNAME", "_hostname", "host.name", "k8s.node.name", "kubernetes.host",
             "kubernetes.pod_node_name", "nodeName")  # nodeName: NVSentinel's health events
RANK_KEYS = ("rank", "RANK")
TS_KEYS = ("ts", "timestamp", "date", "time", "@timestamp", "__REALTIME_TIMESTAMP", "__realtime_timestamp",
           "generatedTimestamp")
POD_KEYS = ("kubernetes.pod_name", "k8s.pod.name")
_ORDINAL = re.compile(r"-(\d{1,6})$")


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """`record[key]`, or the value at the dotted path `key` through nested mappings."""
    value = record.get(key)
    if value is not None:
        return value
    dot = key.find(".")
    while dot > 0:
        head = record.get(key[:dot])
        if isinstance(head, Mapping):
            value = lookup(head, key[dot + 1:])
            if value is not None:
                return value
        dot = key.find(".", dot + 1)
    return None


def message_of(record: Mapping[str, Any]) -> str | None:
    """The line: the first string message field, else the first message field rendered as JSON."""
    fallback: Any = None
    for key in MESSAGE_KEYS:
        value = record.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if value is not None and fallback is None:
            fallback = value
    if fallback is None:
        return None
    return json.dumps(fallback, ensure_ascii=False, default=str)


def parse_rank(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < MAX_RANK else None
    if isinstance(value, float) and value.is_integer():
        return parse_rank(int(value))
    if isinstance(value, (str, bytes)):
        text = value.strip()
        if text.isdigit() and len(text) < 9:
            return parse_rank(int(text))
    return None


def parse_ts(value: Any) -> float | None:
    """Epoch seconds (or ms/us/ns, told apart by size), or ISO 8601 / RFC 3339 text."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        ts = float(value)
        if not math.isfinite(ts) or ts <= 0:
            return None
        while ts > 1e11:  # ms, us, ns since the epoch
            ts /= 1000.0
        return ts
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str):
        text = value.strip()
        if not text or len(text) > 64:
            return None
        try:
            return parse_ts(float(text))
        except ValueError:
            pass
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    return None


def host_of(record: Mapping[str, Any]) -> str | None:
    for key in HOST_KEYS:
        value = lookup(record, key)
        if value is not None:
            host = clean_hostname(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
            if host is not None:
                return host
    return None


def rank_of(record: Mapping[str, Any], meta: Meta) -> int | None:
    for key in RANK_KEYS:
        value = record.get(key)
        if value is not None:
            rank = parse_rank(value)
            if rank is not None:
                return rank
    if meta.rank_from_pod_ordinal:
        for key in POD_KEYS:
            pod = lookup(record, key)
            if isinstance(pod, str) and (m := _ORDINAL.search(pod)) is not None:
                return parse_rank(m.group(1))
    return None


def ts_of(record: Mapping[str, Any]) -> float | None:
    for key in TS_KEYS:
        if key in record:
            ts = parse_ts(record[key])
            if ts is not None:
                return ts
    return None


def job_of(record: Mapping[str, Any], meta: Meta) -> str | None:
    """The request's job, else the first job key the record names (checked later, by the service)."""
    if meta.job is not None:
        return meta.job
    for key in meta.job_keys:
        value = lookup(record, key)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()[:MAX_JOB_ID + 1]
    return None


def source_of(record: Mapping[str, Any], meta: Meta, ts: float | None = None) -> Source:
    """What the record says about its line, the request's headers filling the gaps."""
    d = meta.source
    rank = rank_of(record, meta)
    host = host_of(record)
    if ts is None:
        ts = ts_of(record)
    stream = record.get("stream")
    return Source(
        rank=rank if rank is not None else d.rank,
        host=host or d.host,
        ts=ts if ts is not None else d.ts,
        stream=stream if stream in ("stdout", "stderr") else d.stream,
    )


def split_message(message: str, cap: int) -> list[bytes]:
    """A message as lines (a multi-line message is several log lines), each cut at `cap` bytes."""
    if message.endswith("\n"):
        message = message[:-1]
    return [b if len(b) <= cap else b[:cap]
            for b in (part.encode("utf-8", "replace") for part in message.split("\n"))]


NO_JOB = ""  # a record that names no job: a node's line when it names a host (`logdx serve` keeps it)


def routed_job(message: object, fields: Mapping[str, Any], meta: Meta, batch: Batch) -> str | None:
    """The job a record's line goes to, `NO_JOB` when it names none (the service keeps it in its host's
    node stream, or refuses it as `no_job` when it names no host either); None when the record has no
    line (a string) or an empty one, the refusal then counted in `batch` by reason, never silently dropped."""
    if not isinstance(message, str):
        batch.refuse("no_message")
        return None
    if not message or message.isspace():
        batch.refuse("empty")  # a shipper's heartbeat, or a bomb of empty records: no line either way
        return None
    job = job_of(fields, meta)
    return NO_JOB if job is None else job
