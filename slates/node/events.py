"""Journal events: one frozen dataclass per kind of change to a shard's state.

Theory of operation: a shard changes state only by applying events
(slates.node.state, ShardState._apply_event); the driver commits each request's
events to the journal as one frame before it replies, and recovery applies
the committed ones again.  An event is plain data: everything it needs from
outside (base facts, times, a record's bytes) is inside it, so applying the
same events to the same state gives the same state.

Each class has one wire tag (its `tag`); its wire form is the list
`[tag, field, ...]` in field order, which is what a journal frame holds
(`to_wire`/`from_wire`; `encode`/`decode` give the msgpack bytes of one
event; `frame_parts` packs a frame's events in parts, a record's large data
a part of its own, never copied into a packed message); the layout is the
one journals held before the events were typed, so their frames replay as
they are.  Decoded input is untrusted: an unknown tag, a wrong number of
fields or a field of the wrong type raises VerificationFailed, so a replay
never applies something it cannot read.  Nothing here does I/O.

Who emits what: slates.node.service (volumes, clients, saved replies),
slates.node.green_ops (green and work volumes, versions; applied by
slates.node.ledger), slates.node.landing (plans and grants, in the desk's
own list form: `from_wire` takes those in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeAlias

import msgpack

from slates.errors import InvalidArgument, SlatesError, VerificationFailed
from slates.merge.changes import Change, changes_from_wire, changes_to_wire
from slates.merge.submission import GreenPolicy
from slates.packing import bin_header

__all__ = [
    "Event",
    "VolumeMade",
    "RecordApplied",
    "VolumeCloned",
    "VolumeDropped",
    "VolumeReset",
    "ReplySaved",
    "RepliesAcked",
    "ClientEnded",
    "ClientBound",
    "OwnerSet",
    "SnapshotDeleted",
    "GreenMade",
    "WorkMade",
    "VersionMade",
    "WorkRebased",
    "WorkHeld",
    "VersionLanded",
    "VersionsPruned",
    "PlanRegistered",
    "GrantIssued",
    "GrantUsed",
    "EVENT_TYPES",
    "to_wire",
    "from_wire",
    "encode",
    "decode",
    "frame_parts",
]

Changes: TypeAlias = tuple[Change, ...]


class Event:
    """Base of all journal events; `tag` names the kind on the wire."""

    __slots__ = ()
    tag: ClassVar[str]


# -- volumes and snapshots -------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class VolumeMade(Event):
    """A new volume, empty or over a live base directory (its root's facts inside)."""

    tag: ClassVar[str] = "new"
    vid: str
    name: str
    base_key: str | None
    bounded: bool
    limit: int
    case_insensitive: bool
    mode: int
    uid: int
    gid: int
    time_ns: int
    base_identity: tuple[int, ...] = ()  # the base directory's (dev, ino) when it was made


@dataclasses.dataclass(frozen=True, slots=True)
class RecordApplied(Event):
    """A record (slates.core.records, encoded) applied to a volume.

    `record` is the encoding's bytes (what `from_wire` gives), or, for a record the
    shard made itself, the encoding in parts whose join it is (records.encoded_parts: a
    large write's data a part of its own, the very `Write.data` object), so a commit
    copies that data once, into the journal (`frame_parts`), and never joins it.  Its
    wire form is the same either way; only the in-memory form differs (the two compare
    unequal)."""

    tag: ClassVar[str] = "rec"
    vid: str
    record: bytes | tuple[bytes, ...]

    @property
    def encoded(self) -> bytes:
        """The record's encoding, joined (a copy when it is held in parts)."""
        return _joined(self.record)


@dataclasses.dataclass(frozen=True, slots=True)
class VolumeCloned(Event):
    tag: ClassVar[str] = "clone"
    vid: str
    name: str
    snapshot_id: str
    bounded: bool
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class VolumeDropped(Event):
    """A volume deleted (with whatever role it had)."""

    tag: ClassVar[str] = "drop"
    vid: str


@dataclasses.dataclass(frozen=True, slots=True)
class VolumeReset(Event):
    """The volume restarts as a clone of the snapshot, keeping its numbering, handles
    and kernel references (those on `remade` objects are retained by the records after)."""

    tag: ClassVar[str] = "reset"
    vid: str
    snapshot_id: str
    remade: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotDeleted(Event):
    tag: ClassVar[str] = "unsnap"
    snapshot_id: str


# -- clients ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ReplySaved(Event):
    """The saved reply of a mutating request (client, seq)."""

    tag: ClassVar[str] = "done"
    client: str
    seq: int
    reply: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class RepliesAcked(Event):
    """The client has received its replies up to `upto`."""

    tag: ClassVar[str] = "ack"
    client: str
    upto: int


@dataclasses.dataclass(frozen=True, slots=True)
class ClientEnded(Event):
    """The client will not use its id again (bye)."""

    tag: ClassVar[str] = "bye"
    client: str


@dataclasses.dataclass(frozen=True, slots=True)
class ClientBound(Event):
    """A client id's first use binds it to its principal."""

    tag: ClassVar[str] = "client"
    client: str
    principal: str


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerSet(Event):
    """An agent made this volume."""

    tag: ClassVar[str] = "owner"
    vid: str
    principal: str


# -- green and work volumes (slates.node.ledger) -------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class GreenMade(Event):
    """A volume becomes green; the snapshot is its version 0."""

    tag: ClassVar[str] = "green"
    vid: str
    snapshot_id: str
    source: str | None  # the directory it captured
    policy: GreenPolicy


@dataclasses.dataclass(frozen=True, slots=True)
class WorkMade(Event):
    """A volume is work on a green version, numbering its new inodes in [start, limit)."""

    tag: ClassVar[str] = "work"
    vid: str
    green: str
    version: int
    start: int
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class VersionMade(Event):
    """A submission accepted: the green's next version."""

    tag: ClassVar[str] = "version"
    green: str
    snapshot_id: str
    base: int
    work: str
    increment: Changes  # relative to the previous version
    originals: Changes  # the submission's own edits, relative to `base`


@dataclasses.dataclass(frozen=True, slots=True)
class WorkRebased(Event):
    """A work volume moved onto the version."""

    tag: ClassVar[str] = "based"
    vid: str
    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class WorkHeld(Event):
    """Accepted as `version`, but no room to move: it keeps its base; `snapshot_id`
    is what it held then."""

    tag: ClassVar[str] = "held"
    vid: str
    version: int
    snapshot_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class VersionLanded(Event):
    tag: ClassVar[str] = "landed"
    green: str
    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class VersionsPruned(Event):
    """Those versions' content and edits are dropped."""

    tag: ClassVar[str] = "prune"
    green: str
    numbers: tuple[int, ...]


# -- landing (slates.node.landing owns their content) -------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PlanRegistered(Event):
    """A landing plan (a manifest's wire form) with the merged content it holds."""

    tag: ClassVar[str] = "plan"
    manifest: list[Any]
    held: dict[str, bytes] | None  # None: the plain form, holding nothing


@dataclasses.dataclass(frozen=True, slots=True)
class GrantIssued(Event):
    tag: ClassVar[str] = "grant"
    token: str
    manifest_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class GrantUsed(Event):
    tag: ClassVar[str] = "grant_used"
    token: str


# Listed, not found by __subclasses__(): slots=True makes each class anew.
EVENT_TYPES: tuple[type[Event], ...] = (
    VolumeMade,
    RecordApplied,
    VolumeCloned,
    VolumeDropped,
    VolumeReset,
    SnapshotDeleted,
    ReplySaved,
    RepliesAcked,
    ClientEnded,
    ClientBound,
    OwnerSet,
    GreenMade,
    WorkMade,
    VersionMade,
    WorkRebased,
    WorkHeld,
    VersionLanded,
    VersionsPruned,
    PlanRegistered,
    GrantIssued,
    GrantUsed,
)
_BY_TAG: dict[str, type[Event]] = {cls.tag: cls for cls in EVENT_TYPES}
if len(_BY_TAG) != len(EVENT_TYPES):  # pragma: no cover - a programming error
    raise RuntimeError("two journal event types share a tag")


# -- wire form -------------------------------------------------------------------


def _ints(value: Any) -> tuple[int, ...]:
    if type(value) is not list or any(type(item) is not int for item in value):
        raise InvalidArgument("expected a list of numbers")
    return tuple(value)


def _held(value: Any) -> dict[str, bytes] | None:
    if value is None:
        return None
    if type(value) is not dict or not all(
        type(k) is str and type(v) is bytes for k, v in value.items()
    ):
        raise InvalidArgument("expected held content by digest")
    return value


# By field annotation (annotations are strings here): the exact types a decoded
# value may have (msgpack gives exact types; a bool is no int), or how to convert it.
_TYPES: dict[str, frozenset[type]] = {
    "bytes | tuple[bytes, ...]": frozenset({bytes}),  # decoded: always the joined form
    "str": frozenset({str}),
    "int": frozenset({int}),
    "bool": frozenset({bool}),
    "bytes": frozenset({bytes}),
    "str | None": frozenset({str, type(None)}),
    "dict[str, Any]": frozenset({dict}),
    "list[Any]": frozenset({list}),
}
_DECODE: dict[str, Callable[[Any], Any]] = {
    "tuple[int, ...]": _ints,
    "dict[str, bytes] | None": _held,
    "GreenPolicy": GreenPolicy.from_wire,
    "Changes": changes_from_wire,
}


def _joined(record: bytes | tuple[bytes, ...]) -> bytes:
    return record if isinstance(record, bytes) else b"".join(record)


_ENCODE: dict[str, Callable[[Any], Any]] = {
    "bytes | tuple[bytes, ...]": _joined,
    "tuple[int, ...]": list,
    "GreenPolicy": GreenPolicy.to_wire,
    "Changes": changes_to_wire,
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Codec:
    """One event class's wire form, worked out once: this runs for every event."""

    names: tuple[str, ...]
    types: tuple[frozenset[type] | None, ...]  # None: the field is converted
    decoders: tuple[tuple[int, Callable[[Any], Any]], ...]  # (field index, decoder)
    encoders: tuple[tuple[int, Callable[[Any], Any]], ...]

    @classmethod
    def of(cls, event_type: type[Event]) -> _Codec:
        fields = dataclasses.fields(event_type)  # type: ignore[arg-type]
        kinds = [str(field.type) for field in fields]
        for field, kind in zip(fields, kinds, strict=True):
            if kind not in _TYPES and kind not in _DECODE:  # pragma: no cover - a bug
                raise RuntimeError(f"no decoder for {event_type.__name__}.{field.name}")
        return cls(
            tuple(field.name for field in fields),
            tuple(_TYPES.get(kind) for kind in kinds),
            tuple((at, _DECODE[kind]) for at, kind in enumerate(kinds) if kind in _DECODE),
            tuple((at, _ENCODE[kind]) for at, kind in enumerate(kinds) if kind in _ENCODE),
        )


_CODECS: dict[type[Event], _Codec] = {cls: _Codec.of(cls) for cls in EVENT_TYPES}


def to_wire(event: Event) -> list[Any]:
    """The event as the journal holds it: [tag, field, ...]."""
    if isinstance(event, PlanRegistered):  # the desk's two forms
        if event.held is None:
            return [event.tag, event.manifest]
        return [event.tag, {"manifest": event.manifest, "held": event.held}]
    codec = _CODECS[type(event)]
    out = [event.tag, *[getattr(event, name) for name in codec.names]]
    for at, encoder in codec.encoders:
        out[at + 1] = encoder(out[at + 1])
    return out


def from_wire(raw: Any) -> Event:
    """An event from its wire form; VerificationFailed if it is not one."""
    if type(raw) is not list or not raw or type(raw[0]) is not str:
        raise VerificationFailed("malformed journal event", event=repr(raw)[:80])
    cls = _BY_TAG.get(raw[0])
    if cls is None:
        raise VerificationFailed("unknown journal event", event=repr(raw)[:80])
    values = raw[1:]
    if cls is PlanRegistered and len(values) == 1:
        plan = values[0]
        match plan:
            case {"manifest": manifest, "held": held} if len(plan) == 2:
                values = [manifest, held]
            case _:
                values = [plan, None]
    codec = _CODECS[cls]
    if len(values) != len(codec.names):
        raise VerificationFailed(
            "malformed journal event", tag=cls.tag, fields=len(values), expected=len(codec.names)
        )
    for name, value, allowed in zip(codec.names, values, codec.types, strict=True):
        if allowed is not None and type(value) not in allowed:
            raise VerificationFailed("malformed journal event field", tag=cls.tag, field=name)
    try:
        for at, decoder in codec.decoders:
            values[at] = decoder(values[at])
    except (SlatesError, TypeError, ValueError) as exc:
        raise VerificationFailed("malformed journal event", tag=cls.tag, reason=str(exc)) from None
    return cls(*values)


def encode(event: Event) -> bytes:
    out: bytes = msgpack.packb(to_wire(event), use_bin_type=True, unicode_errors="surrogateescape")
    return out


def decode(payload: bytes) -> Event:
    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise VerificationFailed("undecodable journal event", reason=str(exc)) from None
    return from_wire(raw)


def frame_parts(events: Sequence[Event]) -> list[bytes]:
    """The msgpack of a journal frame's message, {"events": [to_wire(e), ...]}, in parts
    whose join it is: a RecordApplied held in parts keeps them as parts of their own
    (its large data not copied, the same object, so a caller that knows that object's
    checksum finds it by identity); everything else is packed into the parts between."""
    packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape", autoreset=False)
    packer.pack_map_header(1)
    packer.pack("events")
    packer.pack_array_header(len(events))
    out: list[bytes] = []
    for event in events:
        if type(event) is RecordApplied and type(event.record) is tuple:
            record = event.record
            packer.pack_array_header(3)
            packer.pack(event.tag)
            packer.pack(event.vid)
            out.append(packer.bytes() + bin_header(sum(map(len, record))))
            packer.reset()
            out += record
        else:
            packer.pack(to_wire(event))
    out.append(packer.bytes())
    return out
