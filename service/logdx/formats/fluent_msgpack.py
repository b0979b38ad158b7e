"""Fluent Bit's default HTTP body (`format msgpack`): concatenated msgpack events, in either form
Fluent Bit writes them:

- `[time, record]` (Fluent Bit before 2.1, Fluentd's forward "message" mode);
- `[[time, metadata], record]` (Fluent Bit 2.1 and later);

where `time` is an EventTime (msgpack extension 0: seconds and nanoseconds, big-endian uint32 each),
an integer or a float. The record is read like a JSON record (`records.add_record`).
"""

from __future__ import annotations

import struct
from typing import Any

from logdx.formats.base import Batch, Format, FormatError, Meta
from logdx.formats.fields import parse_ts
from logdx.formats.records import add_record

_EVENT_TIME = struct.Struct(">II")
_MAX_ITEMS = 1 << 16
_INTS = frozenset({0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xCA, 0xCB})


class EventTime(float):
    """Fluent's EventTime, as epoch seconds."""


def _ext_hook(code: int, data: bytes) -> Any:
    import msgpack  # (msgpack loads with the first msgpack body, not with the format registry)

    if code == 0 and len(data) == 8:
        sec, nsec = _EVENT_TIME.unpack(data)
        return EventTime(sec + nsec / 1e9)
    return msgpack.ExtType(code, data)


def looks_fluent(head: bytes) -> bool:
    """A fixarray of 2 whose first item is a time or a [time, metadata] pair."""
    if len(head) < 2 or head[0] != 0x92:
        return False
    second = head[1]
    return second in (0xD7, 0x92) or second in _INTS or second < 0x80


class FluentParser:
    def __init__(self, meta: Meta) -> None:
        import msgpack

        self.meta = meta
        self.events = 0
        limit = meta.max_record_bytes
        self._slice = limit
        self._fed = 0
        # One container of an event never holds more than this many items (a record is a small map).
        self._unpacker = msgpack.Unpacker(raw=False, unicode_errors="replace", ext_hook=_ext_hook,
                                          max_buffer_size=2 * limit, strict_map_key=False,
                                          max_array_len=_MAX_ITEMS, max_map_len=_MAX_ITEMS)

    def feed(self, data: bytes) -> Batch:
        import msgpack

        batch = Batch()
        for i in range(0, len(data), self._slice):
            piece = data[i:i + self._slice]
            self._fed += len(piece)
            try:
                self._unpacker.feed(piece)
            except msgpack.BufferFull:
                raise FormatError("too_large", "record_too_large",
                                  f"a msgpack event is larger than {self.meta.max_record_bytes} bytes") from None
            self._drain(batch)
        return batch

    def finish(self) -> Batch:
        batch = Batch()
        self._drain(batch)
        if self._unpacker.tell() != self._fed:
            raise FormatError("bad", "malformed_msgpack",
                              f"the body ends inside msgpack event {self.events + 1}")
        return batch

    def _drain(self, batch: Batch) -> None:
        import msgpack

        try:
            for event in self._unpacker:
                self.events += 1
                self.meta.count()
                self._add_event(event, batch)
        # TypeError: a map whose key is a list or a map (unhashable), which no shipper sends
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError,
                OverflowError) as e:
            raise FormatError("bad", "malformed_msgpack",
                              f"msgpack event {self.events + 1} is not valid: {e}") from None

    def _add_event(self, event: Any, batch: Batch) -> None:
        if not (isinstance(event, (list, tuple)) and len(event) == 2 and isinstance(event[1], dict)):
            raise FormatError("bad", "malformed_msgpack",
                              f"msgpack event {self.events} is not [time, record] or [[time, metadata], record]")
        head, record = event
        if isinstance(head, (list, tuple)) and head:
            head = head[0]
        add_record(record, self.meta, batch, ts=parse_ts(head))


FLUENT_MSGPACK = Format(
    name="msgpack",
    media_types=frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"}),
    parser=FluentParser,
    sniff=looks_fluent,
    description="Fluent Bit's msgpack events ([time, record] and [[time, metadata], record])",
)
