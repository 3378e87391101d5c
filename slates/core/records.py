"""Records: one frozen dataclass per volume operation, and their msgpack form.

Theory of operation: a volume changes only by applying records
(`Volume.apply`).  A record is plain data: which inode or name it touches,
its arguments, and the facts the operation depends on that come from
outside the volume: the time (`time_ns`), the caller's uid/gid, and, for a
name found in a live base directory, the base entry as it was observed
(`BindBase.entry`).  Because those facts travel inside the record, applying
the same records to the same state gives the same state and results, which
is what journal replay, replication and merging rely on (DESIGN.md
section 3).  Nothing here does I/O; `encode`/`decode` turn records into
msgpack bytes at the edges.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack

from slates.errors import InvalidArgument
from slates.packing import bin_header

__all__ = [
    "Kind",
    "Fingerprint",
    "BaseEntry",
    "Attr",
    "DirItem",
    "Record",
    "BindBase",
    "Create",
    "Mkdir",
    "Symlink",
    "Mknod",
    "Link",
    "Unlink",
    "Rmdir",
    "Rename",
    "Write",
    "Truncate",
    "PunchHole",
    "Splice",
    "ShareRange",
    "SetAttr",
    "SetXattr",
    "RemoveXattr",
    "Retain",
    "Forget",
    "Seal",
    "TakeSnapshot",
    "RENAME_NOREPLACE",
    "RENAME_EXCHANGE",
    "XATTR_CREATE",
    "XATTR_REPLACE",
    "encode",
    "encoded_parts",
    "decode",
]

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE = 1
XATTR_REPLACE = 2


class Kind(enum.IntEnum):
    FILE = 1
    DIR = 2
    SYMLINK = 3
    FIFO = 4
    SOCKET = 5
    CHAR_DEVICE = 6
    BLOCK_DEVICE = 7


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """Identity of a base file's content as observed: if any field differs, it drifted."""

    device: int
    inode: int
    size: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class BaseEntry:
    """What a live base directory held at one path when it was looked at."""

    path: str
    kind: Kind
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    fingerprint: Fingerprint
    target: str = ""  # symlink target
    nlink: int = 1  # the base's link count (other names may lie outside what was looked up)


@dataclasses.dataclass(frozen=True, slots=True)
class Attr:
    """The attributes a stat of an inode reports."""

    ino: int
    kind: Kind
    mode: int  # permission bits only (07777)
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int  # 512-byte units of content that is not a hole
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    st_ino: int = 0  # what stat reports (the base's number for base files)


@dataclasses.dataclass(frozen=True, slots=True)
class DirItem:
    name: str
    kind: Kind
    ino: int  # 0 while the entry is an unbound name in the base directory


class Record:
    """Base of all records; a record's wire tag is its class name."""

    __slots__ = ()


_DATA: dict[str, type[Any]] = {"Fingerprint": Fingerprint, "BaseEntry": BaseEntry, "Attr": Attr}


@dataclasses.dataclass(frozen=True, slots=True)
class BindBase(Record):
    """Give an inode to a name that the base directory holds (first lookup)."""

    parent: int
    name: str
    entry: BaseEntry


@dataclasses.dataclass(frozen=True, slots=True)
class Create(Record):
    parent: int
    name: str
    mode: int
    uid: int
    gid: int
    time_ns: int
    ino: int = 0  # the number to give the new inode (0: the next free one)


@dataclasses.dataclass(frozen=True, slots=True)
class Mkdir(Record):
    parent: int
    name: str
    mode: int
    uid: int
    gid: int
    time_ns: int
    ino: int = 0  # the number to give the new inode (0: the next free one)


@dataclasses.dataclass(frozen=True, slots=True)
class Symlink(Record):
    parent: int
    name: str
    target: str
    uid: int
    gid: int
    time_ns: int
    ino: int = 0  # the number to give the new inode (0: the next free one)


@dataclasses.dataclass(frozen=True, slots=True)
class Mknod(Record):
    parent: int
    name: str
    kind: Kind
    mode: int
    rdev: int
    uid: int
    gid: int
    time_ns: int
    ino: int = 0  # the number to give the new inode (0: the next free one)


@dataclasses.dataclass(frozen=True, slots=True)
class Link(Record):
    ino: int
    parent: int
    name: str
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unlink(Record):
    parent: int
    name: str
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Rmdir(Record):
    parent: int
    name: str
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Rename(Record):
    parent: int
    name: str
    new_parent: int
    new_name: str
    flags: int
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Write(Record):
    """Write `data` at `offset`.

    `head` and `tail` are the file's current bytes in the partial pages
    around the write ([page start, offset) and [end, page end), clipped to
    the size): copy-on-write needs them, and carrying them here means
    applying the record never reads the base.
    """

    ino: int
    offset: int
    data: bytes
    time_ns: int
    head: bytes = b""
    tail: bytes = b""


@dataclasses.dataclass(frozen=True, slots=True)
class Truncate(Record):
    ino: int
    size: int
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Splice(Record):
    """Replace bytes [start, end) with `data`, moving what follows: an edit, not a write."""

    ino: int
    start: int
    end: int
    data: bytes
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class PunchHole(Record):
    """Drop the content of whole pages [offset, offset+length): they read as zeros."""

    ino: int
    offset: int
    length: int
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class ShareRange(Record):
    """Make [dst_offset, +length) of one file refer to another's sealed chunks (no copy)."""

    src_ino: int
    src_offset: int
    dst_ino: int
    dst_offset: int
    length: int
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class SetAttr(Record):
    ino: int
    time_ns: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    st_ino: int | None = None  # capture only: the inode number the source reported


@dataclasses.dataclass(frozen=True, slots=True)
class SetXattr(Record):
    ino: int
    name: str
    value: bytes
    flags: int
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class RemoveXattr(Record):
    ino: int
    name: str
    time_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Retain(Record):
    """An open handle (or a kernel lookup reference) now refers to the inode."""

    ino: int
    count: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Forget(Record):
    """Drop references taken by Retain; an unlinked inode dies with the last one."""

    ino: int
    count: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Seal(Record):
    """Turn the volume's mutable pages into immutable BLAKE3-named chunks."""


@dataclasses.dataclass(frozen=True, slots=True)
class TakeSnapshot(Record):
    """Seal, then publish the current root as an immutable snapshot."""

    snapshot_id: str


_RECORDS: dict[str, type[Record]] = {cls.__name__: cls for cls in Record.__subclasses__()}

_EXT_RECORD = 1
_EXT_DATA = 2


# Each record type's field names, in order, looked up once (dataclasses.fields is slow).
_FIELD_NAMES: dict[type[Record], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    for cls in _RECORDS.values()
}


def _values(record: Record) -> list[Any]:
    return [getattr(record, name) for name in _FIELD_NAMES[type(record)]]


def _default(obj: Any) -> Any:
    if isinstance(obj, Record):
        return msgpack.ExtType(_EXT_RECORD, _pack([type(obj).__name__, *_values(obj)]))
    name = type(obj).__name__
    if name in _DATA and dataclasses.is_dataclass(obj):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return msgpack.ExtType(_EXT_DATA, _pack([name, *values]))
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _pack(value: Any) -> bytes:
    # Names are str decoded with surrogateescape (POSIX names are bytes).
    out: bytes = msgpack.packb(
        value, default=_default, use_bin_type=True, unicode_errors="surrogateescape"
    )
    return out


_MAX_DEPTH = 3  # Record > BaseEntry > Fingerprint


def _raw_unpack(payload: bytes) -> Any:
    # No ext_hook: nested extensions come back as ExtType and are converted
    # below in Python, bounded in depth (a re-entrant unpackb per level would
    # let a small hostile payload exhaust the C stack).
    return msgpack.unpackb(payload, use_list=False, raw=False, unicode_errors="surrogateescape")


def _convert(value: Any, depth: int) -> Any:
    if not isinstance(value, msgpack.ExtType):
        return value
    if depth >= _MAX_DEPTH:
        raise InvalidArgument("record nesting is too deep")
    table = _RECORDS if value.code == _EXT_RECORD else _DATA if value.code == _EXT_DATA else None
    fields = _raw_unpack(value.data)
    if table is None or not isinstance(fields, tuple) or not fields:
        raise InvalidArgument("malformed record", ext=value.code)
    tag = fields[0]
    if not isinstance(tag, str) or tag not in table:
        raise InvalidArgument("unknown record type", tag=str(tag)[:40], ext=value.code)
    cls = table[tag]
    try:
        obj = cls(*(_convert(field, depth + 1) for field in fields[1:]))
    except TypeError as exc:
        raise InvalidArgument("malformed record", tag=tag, reason=str(exc)) from None
    _check_types(obj)
    return obj


def _check_types(obj: Any) -> None:
    # Decoded input is untrusted: each field must have the type its
    # annotation names, so the state machine never sees a str for an int.
    for field in dataclasses.fields(obj):
        value: Any = getattr(obj, field.name)
        allowed = _ALLOWED[str(field.type)]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise InvalidArgument(
                "malformed record field", field=field.name, expected=str(field.type)
            )
        if field.type == "Kind":
            if value not in _KIND_VALUES:
                raise InvalidArgument("unknown file kind", field=field.name, value=value)
            object.__setattr__(obj, field.name, Kind(value))


_KIND_VALUES = {int(kind) for kind in Kind}

_ALLOWED: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bytes": (bytes,),
    "Kind": (int,),
    "int | None": (int, type(None)),
    "Fingerprint": (Fingerprint,),
    "BaseEntry": (BaseEntry,),
}


# A write or splice with data this large is packed by `_large_parts`: the same bytes
# as _pack, with the data copied once (by the join, or by whoever copies the parts).
_LARGE_FIELD = 64 << 10


def _ext_header(length: int) -> bytes:
    """msgpack's header of an extension of `length` bytes and type _EXT_RECORD (the form
    msgpack itself picks: fixext for 1, 2, 4, 8 or 16 bytes, else ext 8/16/32)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(length)
    if fixed is not None:
        return bytes((fixed, _EXT_RECORD))
    if length <= 0xFF:
        return bytes((0xC7, length, _EXT_RECORD))
    if length <= 0xFFFF:
        return b"\xc8" + length.to_bytes(2, "big") + bytes((_EXT_RECORD,))
    return b"\xc9" + length.to_bytes(4, "big") + bytes((_EXT_RECORD,))


def _large_parts(record: Record, values: list[Any]) -> list[bytes]:
    """_pack(record) for a record with a large bytes field, in parts: the fields are
    packed around it, and the field itself is a part (not copied)."""
    packer = msgpack.Packer(
        default=_default, use_bin_type=True, unicode_errors="surrogateescape", autoreset=False
    )
    parts: list[bytes] = []
    packer.pack_array_header(len(values) + 1)
    packer.pack(type(record).__name__)
    for value in values:
        if type(value) is bytes and len(value) >= _LARGE_FIELD:
            parts += (packer.bytes(), bin_header(len(value)), value)
            packer.reset()
        else:
            packer.pack(value)
    parts.append(packer.bytes())
    return [_ext_header(sum(map(len, parts))), *parts]


def encoded_parts(record: Record) -> list[bytes]:
    """`encode(record)` in parts whose join it is: a Write's or Splice's large data is a
    part of its own, the very `record.data` object (a caller copying the parts copies
    it once; one that knows its checksum need not read it again)."""
    values = _values(record)
    if isinstance(record, Write | Splice) and len(record.data) >= _LARGE_FIELD:
        return _large_parts(record, values)
    # The extension by hand around its packed fields: the bytes msgpack makes of the
    # record (see _default), in one packb call instead of two.
    fields = _pack([type(record).__name__, *values])
    return [_ext_header(len(fields)) + fields]


def encode(record: Record) -> bytes:
    parts = encoded_parts(record)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def decode(payload: bytes) -> Record:
    try:
        value = _convert(_raw_unpack(payload), 0)
    except InvalidArgument:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidArgument("undecodable record", reason=str(exc)) from None
    if not isinstance(value, Record):
        raise InvalidArgument("payload is not a record")
    return value
