"""Loki's push API (`POST /loki/api/v1/push`), as Promtail, Grafana Alloy, the Docker driver and
`python-logging-loki` send it:

- JSON: `{"streams": [{"stream": {labels}, "values": [["<unix ns>", "<line>", {metadata}?], ...]}]}`;
- protobuf, snappy-compressed (block format): `logproto.PushRequest`, whose streams carry their labels
  as one string in Prometheus form (`{job_id="run-42", host="node-7"}`).

Labels and structured metadata are read like a record's fields: the job from `job_id` (or any job
key), the host from `host`, `hostname` or `node`, the rank from `rank`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from logdx.formats.base import Batch, Document, Format, FormatError, Meta, load_json_document
from logdx.formats.fields import parse_ts, routed_job, source_of, split_message
from logdx.formats.protowire import LEN, fields, spans
from logdx.hosts import clean_hostname

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_labels(text: str) -> dict[str, str]:
    """`{a="1", b="x\\"y"}` as a dict; what is not a label is ignored."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    return {m.group(1): re.sub(r'\\[\\"n]', lambda e: _ESCAPES[e.group(0)], m.group(2))
            for m in _LABEL.finditer(body)}


def _push_request_class() -> Any:
    """logproto.PushRequest, built from its field list (Loki ships no Python package)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="logdx_logproto_push.proto", package="logproto", syntax="proto3")
    f.dependency.append("google/protobuf/timestamp.proto")
    T = descriptor_pb2.FieldDescriptorProto
    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED

    def message(name: str, fields: list[tuple[str, int, int, int, str]]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name

    message("LabelPairAdapter", [("name", 1, T.TYPE_STRING, opt, ""), ("value", 2, T.TYPE_STRING, opt, "")])
    message("EntryAdapter", [("timestamp", 1, T.TYPE_MESSAGE, opt, ".google.protobuf.Timestamp"),
                             ("line", 2, T.TYPE_STRING, opt, ""),
                             ("structuredMetadata", 3, T.TYPE_MESSAGE, rep, ".logproto.LabelPairAdapter")])
    message("StreamAdapter", [("labels", 1, T.TYPE_STRING, opt, ""),
                              ("entries", 2, T.TYPE_MESSAGE, rep, ".logproto.EntryAdapter"),
                              ("hash", 3, T.TYPE_UINT64, opt, "")])
    message("PushRequest", [("streams", 1, T.TYPE_MESSAGE, rep, ".logproto.StreamAdapter")])
    pool = descriptor_pool.DescriptorPool()
    from google.protobuf import timestamp_pb2

    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("logproto.PushRequest"))


@functools.cache
def _classes() -> tuple[Any, Any]:
    """(PushRequest, EntryAdapter), built on first use: protobuf loads only when a Loki body is read."""
    from google.protobuf import message_factory

    push = _push_request_class()
    entry = message_factory.GetMessageClass(  # built at run time: the stubs know none of its fields
        push.DESCRIPTOR.fields_by_name["streams"].message_type.fields_by_name["entries"].message_type)
    return push, entry


def __getattr__(name: str) -> Any:
    """`PushRequest` and `EntryAdapter` as module attributes, built when first asked for."""
    if name == "PushRequest":
        return _classes()[0]
    if name == "EntryAdapter":
        return _classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _host(labels: Mapping[str, Any]) -> Mapping[str, Any]:
    """Loki agents name the node `node` (Kubernetes discovery) where others say `host`."""
    if "host" not in labels and "hostname" not in labels and clean_hostname(labels.get("node")):
        return {**labels, "host": labels["node"]}
    return labels


def add_entry(labels: Mapping[str, Any], ts: float | None, line: Any, meta: Meta, batch: Batch) -> None:
    job = routed_job(line, labels, meta, batch)
    if job is None:
        return
    batch.extend(job, source_of(labels, meta, ts), split_message(line, meta.cap))


class LokiJson(Document):
    def read(self, body: bytes) -> Batch:
        doc = load_json_document(body, "Loki push", self.meta)
        streams = doc.get("streams") if isinstance(doc, Mapping) else None
        if not isinstance(streams, list):
            raise FormatError("bad", "malformed_json", 'a Loki push body is {"streams": [...]}')
        batch = Batch()
        for stream in streams:
            self.meta.count()
            if not isinstance(stream, Mapping):
                batch.refuse("malformed")
                continue
            raw_labels = stream.get("stream") or stream.get("labels") or {}
            if isinstance(raw_labels, str):
                raw_labels = parse_labels(raw_labels)
            labels = _host({str(k): v for k, v in raw_labels.items()} if isinstance(raw_labels, Mapping) else {})
            values = stream.get("values") or ()
            for value in values if isinstance(values, list) else ():
                self.meta.count()
                if not isinstance(value, list) or len(value) < 2:
                    batch.refuse("malformed")
                    continue
                entry = labels
                if len(value) > 2 and isinstance(value[2], Mapping):
                    entry = {**labels, **value[2]}
                add_entry(entry, parse_ts(value[0]), value[1], self.meta, batch)
        return batch


class LokiProtobuf(Document):
    """Snappy (block format) is inflated into a buffer of the size its header declares, once that
    size is known to be within `Meta.max_document_bytes`; the PushRequest is then read field by field
    (`protowire`), one entry parsed at a time."""

    def read(self, body: bytes) -> Batch:
        from google.protobuf.message import DecodeError

        raw = snappy_block(body, self.meta.max_document_bytes, "a Loki protobuf body")
        entry_class = _classes()[1]
        batch = Batch()
        meta = self.meta
        for a, b in spans(raw, 0, len(raw), 1, _PUSH):
            meta.count()
            labels_text, entries = "", []
            for n, wire, x, y in fields(raw, a, b, _PUSH):
                if wire != LEN:
                    continue
                if n == 1:
                    labels_text = raw[x:y].decode("utf-8", "replace")
                elif n == 2:
                    meta.count()
                    entries.append((x, y))
            labels = _host(parse_labels(labels_text))
            for x, y in entries:
                if x == y:
                    batch.refuse("empty")
                    continue
                entry = entry_class()
                try:
                    entry.MergeFromString(raw[x:y])
                except (DecodeError, RuntimeError, ValueError) as e:
                    raise FormatError("bad", "malformed_protobuf", f"not a Loki PushRequest: {e}") from None
                fields_: Mapping[str, Any] = labels
                if entry.structuredMetadata:
                    fields_ = {**labels, **{p.name: p.value for p in entry.structuredMetadata}}
                ts = entry.timestamp.seconds + entry.timestamp.nanos * 1e-9 if entry.HasField("timestamp") else None
                add_entry(fields_, ts or None, entry.line, meta, batch)
        return batch


_PUSH = "Loki PushRequest"


def snappy_block(body: bytes, limit: int, what: str) -> bytearray:
    """Snappy's block format, inflated only when the size its header declares is within `limit`
    (a 2 MB body may declare 4 GB); cramjam then refuses data that does not make exactly that size."""
    import cramjam

    try:
        size = cramjam.snappy.decompress_raw_len(body)
    except cramjam.DecompressionError as e:
        raise FormatError("bad", "bad_encoding", f"{what} is snappy-compressed (block format): {e}") from None
    if size > limit:
        raise FormatError("too_large", "document_too_large",
                          f"{what} inflates to {size} bytes; at most {limit} are read (input.max_document_bytes)")
    out = bytearray(size)
    try:
        written = cramjam.snappy.decompress_raw_into(body, out)
    except cramjam.DecompressionError as e:
        raise FormatError("bad", "bad_encoding", f"{what} is snappy-compressed (block format): {e}") from None
    if written != size:
        del out[written:]
    return out  # no copy: the document is read field by field from this buffer


def looks_loki_json(head: bytes) -> bool:
    text = head.lstrip()[:32]
    return text.startswith(b"{") and b'"streams"' in text


LOKI_JSON = Format(
    name="loki-json",
    media_types=frozenset({"application/json"}),
    parser=LokiJson,
    sniff=looks_loki_json,
    description="Loki push, JSON",
)
LOKI_PROTOBUF = Format(
    name="loki",
    media_types=frozenset({"application/x-protobuf", "application/protobuf"}),
    parser=LokiProtobuf,
    description="Loki push, snappy-compressed protobuf (logproto.PushRequest)",
)
