"""The messages of the ledger protocol, and their msgpack form.

Theory of operation (DESIGN.md section 7).  Every message is a frozen
slotted record naming its `sender` (a `Peer`: host and boot id, so a
reply from a host that lost its RAM is recognisably someone else) and its
green volume.  The machines (`holder.Holder`, `owner.Owner`) take messages
and return `Outgoing` records (destination host, message); the network
that carries them is not theirs.

Replication, owner -> holder -> owner:
    Place (content manifest) -> Fetch (missing chunk ids) -> Chunk (bytes)
    -> PlaceAck; then Propose (the version record) -> Accepted; Commit is
    the owner's notice that a position is committed.
Recovery, successor -> holder -> successor:
    Prepare -> Promise (everything accepted, the committed prefix);
    Gather -> Gathered (chunks the successor lacks).
Any refusal is Refused with an error code from slates.errors (EpochFenced
with the holder's promised epoch, MissingContent, CapacityExhausted, ...).
Clients: Submit -> SubmitReply; Read -> ReadReply.  To the configuration
group: TransferRequest (write-intent move) and JointReady (the new holder
set holds the committed prefix).

`encode`/`decode` carry any of these records (and the nested records they
contain) as msgpack, each record an extension type tagged by its class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from slates.errors import InvalidArgument
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.ledger import EditRef, RequestId, Value
from slates.merge.ranges import Replace

__all__ = [
    "Message",
    "Outgoing",
    "Entry",
    "Place",
    "PlaceAck",
    "Fetch",
    "Chunk",
    "Propose",
    "Accepted",
    "Commit",
    "Prepare",
    "Promise",
    "Gather",
    "Gathered",
    "Refused",
    "Submit",
    "SubmitReply",
    "Read",
    "ReadReply",
    "TransferRequest",
    "JointReady",
    "encode",
    "decode",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One accepted proposal, as a holder reports it in a Promise."""

    position: int
    epoch: int
    value: Value


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
    sender: Peer
    green: str
    epoch: int
    position: int
    manifest: tuple[tuple[bytes, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PlaceAck:
    sender: Peer
    green: str
    epoch: int
    position: int


@dataclasses.dataclass(frozen=True, slots=True)
class Fetch:
    sender: Peer
    green: str
    chunks: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    sender: Peer
    green: str
    chunk: bytes
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Propose:
    sender: Peer
    green: str
    epoch: int
    position: int
    value: Value
    committed: bool  # catch-up of a position the owner already committed


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    sender: Peer
    green: str
    epoch: int
    position: int
    digest: bytes
    prefix: int  # the holder's contiguous committed prefix after this acceptance


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    sender: Peer
    green: str
    epoch: int
    position: int
    digest: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Prepare:
    sender: Peer
    green: str
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class Promise:
    sender: Peer
    green: str
    epoch: int
    entries: tuple[Entry, ...]
    prefix: int


@dataclasses.dataclass(frozen=True, slots=True)
class Gather:
    sender: Peer
    green: str
    chunks: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Gathered:
    sender: Peer
    green: str
    chunk: bytes
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    sender: Peer
    green: str
    epoch: int  # the epoch of the refused message
    position: int
    code: str
    promised: int


@dataclasses.dataclass(frozen=True, slots=True)
class Submit:
    sender: Peer
    green: str
    request: RequestId
    acked_through: int
    base_version: int
    edits: tuple[Replace, ...]
    scope: str  # "restart" | "host" | "region"
    route: str  # the host the client is attached to (write intent counts these)


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitReply:
    sender: Peer
    green: str
    request: RequestId
    version: int  # 0 with an error
    error: str  # "" when ok
    redirect: str  # the owner host to follow on NotOwner ("" if unknown)
    scopes: tuple[str, ...]
    mirror_lag: int | None  # versions the mirror prefix trails the head; None: unknown


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    sender: Peer
    green: str
    position: int
    token: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReadReply:
    sender: Peer
    green: str
    position: int
    token: int
    data: bytes
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class TransferRequest:
    sender: Peer
    green: str
    epoch: int
    target: str


@dataclasses.dataclass(frozen=True, slots=True)
class JointReady:
    sender: Peer
    green: str
    revision: int


Message = (
    Place
    | PlaceAck
    | Fetch
    | Chunk
    | Propose
    | Accepted
    | Commit
    | Prepare
    | Promise
    | Gather
    | Gathered
    | Refused
    | Submit
    | SubmitReply
    | Read
    | ReadReply
    | TransferRequest
    | JointReady
)


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    dest: str  # a host name, a client name, or "council"
    message: Message


_RECORDS: tuple[type[Any], ...] = (
    Peer,
    Candidate,
    HolderSet,
    GreenConfig,
    RequestId,
    EditRef,
    Value,
    Replace,
    Entry,
    Place,
    PlaceAck,
    Fetch,
    Chunk,
    Propose,
    Accepted,
    Commit,
    Prepare,
    Promise,
    Gather,
    Gathered,
    Refused,
    Submit,
    SubmitReply,
    Read,
    ReadReply,
    TransferRequest,
    JointReady,
)
_TAG = {cls: index for index, cls in enumerate(_RECORDS)}
_EXT = 7


def _default(obj: Any) -> Any:
    tag = _TAG.get(type(obj))
    if tag is None:
        raise InvalidArgument("not a fleet record", type=type(obj).__name__)
    fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return msgpack.ExtType(_EXT, msgpack.packb([tag, *fields], default=_default))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT:
        raise InvalidArgument("unknown extension in a fleet message", code=code)
    tag, *fields = msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False)
    if not 0 <= tag < len(_RECORDS):
        raise InvalidArgument("unknown record tag in a fleet message", tag=tag)
    return _RECORDS[tag](*fields)


def encode(message: Message) -> bytes:
    return bytes(msgpack.packb(message, default=_default))


def decode(data: bytes) -> Message:
    try:
        message = msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise InvalidArgument("a malformed fleet message") from error
    if not isinstance(message, _RECORDS[9:]):
        raise InvalidArgument("not a fleet message", type=type(message).__name__)
    return message  # type: ignore[no-any-return]
