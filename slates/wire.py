"""The wire's framing and packing, shared by the shards and the clients.

Theory of operation: every message is one msgpack map (`pack`, `unpack`,
with the options both sides use), or, on a ring, a split request whose raw
tail is its args.data (SPLIT_MARK; `unpack_request`, `unpack_parts`); on a
stream it travels as a frame, a 4-byte big-endian length then the map
(`frame`, `FrameReader`, bounded by MAX_FRAME and, for a shard, by the
principal's `Budget`); a reply is
{"seq", "ok", "result"} or {"seq", "ok": false, "error"} (`reply_parts`,
`check_ok`); an id names its shard (`shard_of`).  slates.node.protocol
holds the rest of the protocol (hello and request records, the shard's
side) and re-exports these.  Kept free of dataclasses and sockets so a
command's start-up pays only for msgpack.  Pure: no I/O.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import msgpack

from slates.errors import CapacityExhausted, InvalidArgument, SlatesError, error_from_wire

__all__ = [
    "MAX_FRAME",
    "Budget",
    "FrameReader",
    "check_ok",
    "frame",
    "pack",
    "reply_parts",
    "shard_of",
    "split_point",
    "unpack",
    "unpack_parts",
    "unpack_request",
]

MAX_FRAME = 64 << 20
_LENGTH = struct.Struct(">I")
# A split request (slates/fuse/PROTOCOL.md): SPLIT_MARK, a byte msgpack never uses,
# the msgpack head's length (SPLIT_PREFIX), the head, then the raw tail.
SPLIT_MARK = 0xC1
SPLIT_PREFIX = struct.Struct("<BI")


def pack(message: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(message, use_bin_type=True, unicode_errors="surrogateescape")
    return out


def unpack(payload: bytes | memoryview) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidArgument("undecodable message", reason=str(exc)) from None
    if not isinstance(message, dict):
        raise InvalidArgument("a message must be a map")
    return message


def split_point(prefix: bytes, size: int) -> int | None:
    """Where the head of a split request of `size` bytes that starts with `prefix`
    ends (its tail starts), or None when it is no well-formed split request: it
    then decodes as any other message would (and, starting with SPLIT_MARK, fails)."""
    if size < SPLIT_PREFIX.size or len(prefix) < SPLIT_PREFIX.size:
        return None
    mark, head_len = SPLIT_PREFIX.unpack(prefix[: SPLIT_PREFIX.size])
    if mark != SPLIT_MARK or head_len > size - SPLIT_PREFIX.size:
        return None
    split: int = SPLIT_PREFIX.size + head_len
    return split


def unpack_request(message: bytes | memoryview) -> dict[str, Any]:
    """`unpack` of a request as a ring carries it: a split request too."""
    split = split_point(bytes(message[: SPLIT_PREFIX.size]), len(message))
    if split is None:
        return unpack(message)
    return unpack_parts(bytes(message[SPLIT_PREFIX.size : split]), bytes(message[split:]))


def unpack_parts(head: bytes, tail: bytes) -> dict[str, Any]:
    """A split request (slates/fuse/PROTOCOL.md): its msgpack head, with the raw tail
    as args.data (the very bytes object: a large write's data is not copied again)."""
    message = unpack(head)
    args = message.get("args")
    if not isinstance(args, dict) or "data" in args:
        raise InvalidArgument("a split request's args must be a map without data")
    args["data"] = tail
    return message


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise InvalidArgument("message too large", size=len(payload), limit=MAX_FRAME)
    return _LENGTH.pack(len(payload)) + payload


class Budget:
    """Bytes that one principal's connections may hold in partial frames, together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, delta: int) -> None:
        if delta > 0 and self.used + delta > self.limit:
            raise CapacityExhausted(
                "this principal's connections hold too many unfinished frames",
                limit=self.limit,
            )
        self.used += delta


class FrameReader:
    """Reassembles frames from stream chunks; bounded by `limit` (MAX_FRAME), and the bytes
    of an unfinished frame charged to `budget` (the principal's) while they wait."""

    def __init__(self, limit: int = MAX_FRAME, budget: Budget | None = None) -> None:
        self._buffer = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self.limit = limit
        self.budget = budget

    def feed(self, data: bytes) -> None:
        if self.budget is not None:
            self.budget.charge(len(data))
        before = len(self._buffer)
        self._buffer += data
        try:
            while len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                if length > self.limit:
                    raise InvalidArgument("frame too large", size=length, limit=self.limit)
                if len(self._buffer) < _LENGTH.size + length:
                    break
                self._frames.append(bytes(self._buffer[_LENGTH.size : _LENGTH.size + length]))
                del self._buffer[: _LENGTH.size + length]
        finally:
            if self.budget is not None:
                self.budget.charge(len(self._buffer) - before - len(data))

    def charge_to(self, budget: Budget) -> None:
        """From now on, what waits here counts against `budget`."""
        budget.charge(len(self._buffer))
        self.budget = budget

    def release(self) -> None:
        """The connection ended: its unfinished frame no longer counts."""
        if self.budget is not None:
            self.budget.charge(-len(self._buffer))
            self.budget = None
        self._buffer.clear()

    def next_frame(self) -> bytes | None:
        return self._frames.popleft() if self._frames else None


def _seq(message: dict[str, Any]) -> int:
    value = message.get("seq")
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument("malformed message field", field="seq")
    return value


def reply_parts(message: dict[str, Any]) -> tuple[int, Any, SlatesError | None]:
    """A shard's reply as (seq, result, error): slates.node.protocol.parse_reply's Reply."""
    seq = _seq(message)
    if message.get("ok") is True:
        return seq, message.get("result"), None
    error = message.get("error")
    if not isinstance(error, dict):
        raise InvalidArgument("malformed error reply")
    return seq, None, error_from_wire(error)


def check_ok(message: dict[str, Any]) -> dict[str, Any]:
    """A hello answer or control reply, or the error it carries, raised."""
    if message.get("ok") is not True:
        error = message.get("error")
        raise error_from_wire(error if isinstance(error, dict) else {})
    return message


def shard_of(object_id: str) -> int:
    """The shard that owns a volume, snapshot or manifest id ("vol-<shard>-<n>", ...)."""
    parts = object_id.split("-")
    if len(parts) != 3 or parts[0] not in ("vol", "snap", "man") or not parts[1].isdigit():
        raise InvalidArgument("malformed volume, snapshot or manifest id", id=object_id)
    return int(parts[1])
