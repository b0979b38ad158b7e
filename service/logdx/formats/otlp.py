"""OpenTelemetry logs (OTLP/HTTP `POST /v1/logs`), protobuf (`application/x-protobuf`, the
opentelemetry-proto classes) or JSON (the OTLP JSON mapping: lowerCamelCase keys, snake_case
accepted too, 64-bit integers as strings, enums as integers, ids in hex).

A log record gives: the line, `body` (a string, or any other value rendered as JSON); the time,
`timeUnixNano`, else `observedTimeUnixNano`; the host, the resource's `host.name` (or
`k8s.node.name`); the rank, a `rank` attribute (else the line's own prefix); the stream,
`log.iostream`; the job, the request's or the first job key among the resource's and the record's
attributes (the record's win). The answer is an `ExportLogsServiceResponse` in the request's
content type, with `partial_success` when some records were refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from logdx.formats.base import Batch, Document, Format, FormatError, Meta, load_json_document
from logdx.formats.fields import routed_job, source_of, split_message
from logdx.formats.protowire import LEN, fields, spans

if TYPE_CHECKING:  # the protobuf classes load when an OTLP protobuf body is read, not with the format registry
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_NS = 1e-9


def _any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def _json_value(v: Any) -> Any:
    """An OTLP JSON AnyValue as a Python value."""
    if not isinstance(v, Mapping):
        return None
    for key in ("stringValue", "string_value"):
        if key in v:
            return v[key]
    for key in ("intValue", "int_value"):
        if key in v:
            try:
                return int(v[key])
            except (TypeError, ValueError):
                return None
    for key in ("boolValue", "bool_value", "doubleValue", "double_value", "bytesValue", "bytes_value"):
        if key in v:
            return v[key]
    for key in ("arrayValue", "array_value"):
        if key in v:
            values = v[key].get("values", []) if isinstance(v[key], Mapping) else []
            return [_json_value(x) for x in values] if isinstance(values, list) else None
    for key in ("kvlistValue", "kvlist_value"):
        if key in v:
            values = v[key].get("values", []) if isinstance(v[key], Mapping) else []
            return _json_attributes(values)
    return None


def _json_attributes(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(items, list):
        for kv in items:
            if isinstance(kv, Mapping) and isinstance(kv.get("key"), str):
                out[kv["key"]] = _json_value(kv.get("value"))
    return out


def _get(d: Mapping[str, Any], camel: str, snake: str) -> Any:
    value = d.get(camel)
    return d.get(snake) if value is None else value


def _list(d: Mapping[str, Any], camel: str, snake: str) -> list[Any]:
    value = _get(d, camel, snake)
    return value if isinstance(value, list) else []


def _nanos(value: Any) -> float | None:
    try:
        ns = int(value)
    except (TypeError, ValueError):
        return None
    return ns * _NS if ns > 0 else None


def _render(body: Any) -> str | None:
    if body is None:
        return None
    if isinstance(body, str):
        return body
    return json.dumps(body, ensure_ascii=False, default=str)


def add_log(body: Any, attrs: dict[str, Any], ts: float | None, meta: Meta, batch: Batch) -> None:
    message = _render(body)
    job = routed_job(message, attrs, meta, batch)
    if job is None:
        return
    assert message is not None  # routed_job gives a job only for a string
    stream = attrs.get("log.iostream")
    if stream in ("stdout", "stderr"):
        attrs = {**attrs, "stream": stream}
    batch.extend(job, source_of(attrs, meta, ts), split_message(message, meta.cap))


class OtlpProtobuf(Document):
    """Read field by field (`protowire`): one log record is parsed at a time, an empty one costs
    nothing, and the record count is bounded before any record is built."""

    def read(self, body: bytes) -> Batch:
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource

        batch = Batch()
        meta = self.meta
        for a, b in spans(body, 0, len(body), 1, _REQUEST):
            meta.count()
            resource, scopes = Resource(), []
            for n, wire, x, y in fields(body, a, b, _REQUEST):
                if wire != LEN:
                    continue
                if n == 1:
                    _merge(resource, body[x:y])
                elif n == 2:
                    meta.count()
                    scopes.append((x, y))
            attrs = {kv.key: _any_value(kv.value) for kv in resource.attributes}
            for x, y in scopes:
                self._scope(body, x, y, attrs, batch)
        return batch

    def _scope(self, body: bytes, start: int, end: int, resource: dict[str, Any], batch: Batch) -> None:
        from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

        meta = self.meta
        for a, b in spans(body, start, end, 2, _REQUEST):
            meta.count()
            if a == b:
                batch.refuse("empty")
                continue
            rec = LogRecord()
            _merge(rec, body[a:b])
            attrs = {**resource, **{kv.key: _any_value(kv.value) for kv in rec.attributes}}
            ts = _nanos(rec.time_unix_nano) or _nanos(rec.observed_time_unix_nano)
            add_log(_any_value(rec.body) if rec.HasField("body") else None, attrs, ts, meta, batch)


_REQUEST = "OTLP ExportLogsServiceRequest"


def _merge(message: Any, data: bytes) -> None:
    from google.protobuf.message import DecodeError

    try:
        message.MergeFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise FormatError("bad", "malformed_protobuf", f"not an OTLP ExportLogsServiceRequest: {e}") from None


class OtlpJson(Document):
    def read(self, body: bytes) -> Batch:
        doc = load_json_document(body, "OTLP JSON", self.meta)
        if not isinstance(doc, Mapping):
            raise FormatError("bad", "malformed_json", "an OTLP JSON body is an object with resourceLogs")
        batch = Batch()
        for rl in _records(_list(doc, "resourceLogs", "resource_logs"), self.meta, batch):
            resource_obj = rl.get("resource")
            resource = _json_attributes(resource_obj.get("attributes")) if isinstance(resource_obj, Mapping) else {}
            for sl in _records(_list(rl, "scopeLogs", "scope_logs"), self.meta, batch):
                for rec in _records(_list(sl, "logRecords", "log_records"), self.meta, batch):
                    attrs = {**resource, **_json_attributes(rec.get("attributes"))}
                    ts = _nanos(_get(rec, "timeUnixNano", "time_unix_nano")) or _nanos(
                        _get(rec, "observedTimeUnixNano", "observed_time_unix_nano"))
                    add_log(_json_value(rec.get("body")), attrs, ts, self.meta, batch)
        return batch


def _records(items: Iterable[Any], meta: Meta, batch: Batch) -> Iterator[Mapping[str, Any]]:
    """The objects of a list, each counted; anything else is refused as malformed."""
    for item in items:
        meta.count()
        if isinstance(item, Mapping):
            yield item
        else:
            batch.refuse("malformed")


def response(protobuf: bool, rejected: int = 0, message: str = "") -> tuple[bytes, str]:
    """The OTLP answer (body, content type): empty, or `partial_success` naming what was refused."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
        ExportLogsPartialSuccess,
        ExportLogsServiceResponse,
    )

    if protobuf:
        out = ExportLogsServiceResponse()
        if rejected or message:
            out.partial_success.CopyFrom(ExportLogsPartialSuccess(rejected_log_records=rejected, error_message=message))
        return out.SerializeToString(), "application/x-protobuf"
    doc: dict[str, Any] = {}
    if rejected or message:
        doc["partialSuccess"] = {"rejectedLogRecords": str(rejected), "errorMessage": message}
    return json.dumps(doc).encode(), "application/json"


def looks_otlp_json(head: bytes) -> bool:
    text = head.lstrip()[:64]
    return text.startswith(b"{") and (b'"resourceLogs"' in text or b'"resource_logs"' in text)


OTLP_PROTOBUF = Format(
    name="otlp",
    media_types=frozenset({"application/x-protobuf", "application/protobuf"}),
    parser=OtlpProtobuf,
    description="OpenTelemetry logs, protobuf (ExportLogsServiceRequest)",
)
OTLP_JSON = Format(
    name="otlp-json",
    media_types=frozenset({"application/json"}),
    parser=OtlpJson,
    sniff=looks_otlp_json,
    description="OpenTelemetry logs, the OTLP JSON mapping",
)
