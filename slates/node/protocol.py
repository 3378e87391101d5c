"""The wire protocol between clients and daemon shards.

Theory of operation: every message is one msgpack map.  On the unix socket
a message travels as a frame (4-byte big-endian length, then the map);
over a ring pair it is one ring message.  A connection starts with a
hello on the socket naming the client; the shard checks the peer's
credentials, answers, and (when asked) passes the four fds of a ring pair
with its answer; requests then flow over the rings while the socket stays
open only to tell each side that the other is alive.

Request identity is (client id, sequence number), never the connection: a
client that reconnects sends the same id and retries its unanswered
sequence numbers, and the shard answers from its saved results.  Each
request carries `ack`, the highest sequence number below which the client
has every reply; the shard then forgets those results, and a later retry
of one of them gets RequestExpired.

The framing, packing and reply checks a client needs too live in slates.wire
(re-exported here), so a command need not import the shard's records.
Everything read from a peer is validated here; a malformed message is an
InvalidArgument, never a crash.  Sizes are bounded (MAX_FRAME).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slates.errors import InvalidArgument, SlatesError
from slates.wire import (
    MAX_FRAME,
    Budget,
    FrameReader,
    check_ok,
    frame,
    pack,
    reply_parts,
    shard_of,
    unpack,
    unpack_parts,
    unpack_request,
)

__all__ = [
    "shard_of",
    "MAX_FRAME",
    "MAX_CLIENT_ID",
    "Hello",
    "Request",
    "Reply",
    "pack",
    "unpack",
    "unpack_parts",
    "unpack_request",
    "frame",
    "FrameReader",
    "Budget",
    "parse_hello",
    "parse_request",
    "parse_reply",
    "ok_reply",
    "check_ok",
    "error_reply",
]

MAX_CLIENT_ID = 128
MAX_TOKEN = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    client: str
    rings: bool
    watch: str | None = None  # a volume whose changes by other clients this connection hears
    mount: str | None = None  # the volume a mount bridge serves (its references end with it)
    token: str | None = None  # an agent's credential (none: the operator's own user)
    principal: str = ""  # who the shard found the peer to be ("" the operator, else an agent)


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    seq: int
    ack: int
    op: str
    args: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    seq: int
    ok: bool
    result: Any
    error: SlatesError | None


def _field(message: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = message.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise InvalidArgument("malformed message field", field=key)
    return value


def parse_hello(message: dict[str, Any]) -> Hello:
    client = _field(message, "client", str)
    if not client or len(client) > MAX_CLIENT_ID:
        raise InvalidArgument("a client id is 1 to 128 characters")
    watch, mount, token = message.get("watch"), message.get("mount"), message.get("token")
    if any(value is not None and not isinstance(value, str) for value in (watch, mount)):
        raise InvalidArgument("watch and mount name a volume id")
    if token is not None and (not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN):
        raise InvalidArgument("a token is a string of 1 to 256 characters")
    return Hello(client, bool(message.get("rings", False)), watch, mount, token)


def parse_request(message: dict[str, Any]) -> Request:
    seq = _field(message, "seq", int)
    ack = _field(message, "ack", int)
    if seq < 1 or not 0 <= ack < seq:
        raise InvalidArgument("sequence numbers start at 1 and ack lies below seq")
    return Request(seq, ack, _field(message, "op", str), _field(message, "args", dict))


def parse_reply(message: dict[str, Any]) -> Reply:
    seq, result, error = reply_parts(message)
    return Reply(seq, error is None, result, error)


def ok_reply(seq: int, result: Any) -> dict[str, Any]:
    return {"seq": seq, "ok": True, "result": result}


def error_reply(seq: int, error: SlatesError) -> dict[str, Any]:
    return {"seq": seq, "ok": False, "error": error.to_wire()}
