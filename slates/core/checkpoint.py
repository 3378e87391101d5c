"""Checkpoints: a shard's volumes and snapshots as one blob, and back.

Theory of operation
-------------------
A daemon shard journals every applied record to anchor-owned shared memory.
To bound replay it periodically writes a checkpoint: `dump_state` turns the
complete state of its volumes and snapshots into bytes, and a replacement
process calls `load_state` to rebuild them exactly, then replays the journal
written after the checkpoint.  Sealed chunk bytes are not in the blob: they
stay in the host's chunk store (a shared-memory arena in the daemon), so
extents name them by id.  Private page buffers are in the blob byte for
byte, since nothing else holds them: after the msgpack document, in the
order it lists them, so `dump_state_pieces` hands them to the writer as
they are, without copying them into one big bytes object first (a
checkpoint of 400 MiB of private pages would otherwise hold them twice
more in the heap while it is written).  Base readers are not data: the blob
keeps `base_key(reader)` and loading calls `open_base(key)` once per key.

Placed pages.  A writer whose page buffers already live in a store of its
own (the shard's checkpoint segment is the host's PageMemory there,
slates.node.page_area) passes a PageStore: `dump_placed` asks it where
each buffer is (`place`: nothing is copied), and the document records
each buffer's location instead of its bytes.  Keeping those locations
intact until the next checkpoint is published is the store's business
(copy on write).  `load_state(..., pages=store)` takes each buffer from
its location (`fetch`: the volume then uses the stored bytes themselves);
a blob with the bytes after it makes each buffer in the host's
PageMemory.

Sharing.  Roots share Inode objects (a volume with its snapshots and
clones).  The blob keeps that sharing instead of multiplying it:
- an inode table holds each distinct Inode object once (by identity);
- a root table holds each distinct Root object once.  A root is written as
  its difference from an earlier root (the one holding most of its inode
  objects) when that is shorter than listing every inode, so N similar
  snapshots cost one tree plus N small differences;
- a directory's entries are written as their difference from the same
  directory in that earlier root, when shorter;
- chunk ids are written once, in a chunk table.
Loading replays each difference onto the earlier map (`Map.mutate`), so
the rebuilt roots share Inode objects, and HAMT nodes, as the originals did.

Loading runs in three phases, so that a bad blob changes nothing:
1. decode and validate everything: types, ranges, references, and the
   invariants the volume code indexes by (extent order, page buffers,
   directory entries naming inodes of the same root).  Any fault raises
   InvalidArgument: the blob is malformed (hostile input never gets another
   exception type out of here).
2. check the environment without changing it: open each base once (a
   SlatesError that `open_base` raises fails the volumes and snapshots over
   that base) and check that the host's store holds every chunk each root
   refers to (MissingContent otherwise).  Failed names are reported in
   `LoadedState.failures`; every other volume and snapshot still loads.
3. build: register each volume with the host, restore its private fields,
   charge its page, metadata and in-flight bytes to `host.private_bytes`,
   and add the blob's snapshot metadata bytes to the host.  A bounded
   volume is not re-admitted: its quota was reserved when it was created,
   and refusing it now would lose admitted work.

Names are str decoded with surrogateescape (POSIX names are bytes) and
travel that way.  Dumps are deterministic: the same state gives the same
bytes.  Pure: no I/O, clock or randomness.
"""

from __future__ import annotations

import dataclasses
import struct
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NoReturn, Protocol, TypeVar

import immutables
import msgpack

from slates.core.extents import PAGE, BaseSpan, ChunkSpan, Extent, PageSpan
from slates.core.host import Host, PageBuffer
from slates.core.origin import NEW
from slates.core.records import Fingerprint, Kind
from slates.core.volume import (
    MAX_FILE_SIZE,
    NO_INO_LIMIT,
    ROOT_INO,
    BaseReader,
    Capacity,
    DeviceBody,
    DirBody,
    Entry,
    FileBody,
    Inode,
    Root,
    Snapshot,
    SymlinkBody,
    Volume,
)
from slates.errors import InvalidArgument, MissingContent, SlatesError

__all__ = [
    "FORMAT",
    "VERSION",
    "LoadedState",
    "PageStore",
    "dump_placed",
    "dump_state",
    "dump_state_pieces",
    "load_state",
]

# Blob layout, version 1 (msgpack; enums are ints, bytes are bin; `idx` is a
# position in a table; tables only refer to earlier entries of themselves):
#
#   {"format": "slates.checkpoint", "version": 1,
#    "chunks": [chunk id, ...],
#    "inodes": [inode, ...], "roots": [root, ...],
#    "volumes": [volume, ...], "snapshots": [snapshot, ...],
#    "snapshot_metadata_bytes": int}
#   inode = [ino, kind, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns,
#            {xattr name: value}, body, st_ino]     body layout set by kind:
#     FILE    [size, [extent, ...], base_path|nil, [device, inode, size, mtime_ns]|nil,
#              [record generation, [source, length, ...]]|nil (origin)]
#             extent = [0, start, length, base_offset]                     (base)
#                    | [1, start, length, chunk idx, chunk_offset, epoch]  (chunk)
#                    | [2, start, length, buffer_id]                       (page)
#     DIR     [parent, from inode idx|nil, [removed key, ...],
#              [[key, name|nil (= key), ino], ...], [whiteout, ...], base_path|nil]
#     SYMLINK [target]
#     other   [rdev]
#   root = [from root idx|nil, [removed ino, ...], [inode idx, ...],
#           [[device, inode], ...] removed base ids, [[device, inode, ino], ...],
#           next_ino, referenced_bytes, case_insensitive, epoch, record_gen]
#   volume = {"name", "root", "base", "bounded", "limit", "closed",
#             "unique_bytes", "inflight_bytes", "metadata_bytes", "own_mark",
#             "own_limit", "own_numbers": [ino],
#             "buffers": [[buffer_id, length, location|nil]],
#                  (nil: the bytes follow the document; else the PageStore's location)
#             "next_buffer", "handles": [[ino, count]], "dirty": [ino]}
#   snapshot = {"name", "id", "root", "base"}

# blob = [document length: u64 little-endian][msgpack document][page buffers' bytes]
FORMAT = "slates.checkpoint"
VERSION = 3
_LENGTH = struct.Struct("<Q")

_BASE_SPAN, _CHUNK_SPAN, _PAGE_SPAN = 0, 1, 2
_KINDS = {int(kind): kind for kind in Kind}
_BODY_OF_KIND: dict[Kind, type] = {
    Kind.FILE: FileBody,
    Kind.DIR: DirBody,
    Kind.SYMLINK: SymlinkBody,
}
_VOLUME_KEYS = frozenset(
    {
        "name",
        "root",
        "base",
        "bounded",
        "limit",
        "closed",
        "unique_bytes",
        "inflight_bytes",
        "metadata_bytes",
        "own_mark",
        "own_limit",
        "own_numbers",
        "buffers",
        "next_buffer",
        "handles",
        "dirty",
    }
)
_SNAPSHOT_KEYS = frozenset({"name", "id", "root", "base"})
_TOP_KEYS = frozenset(
    {
        "format",
        "version",
        "chunks",
        "inodes",
        "roots",
        "volumes",
        "snapshots",
        "snapshot_metadata_bytes",
    }
)

_EMPTY_INODES: immutables.Map[int, Inode] = immutables.Map()
_EMPTY_IDS: immutables.Map[tuple[int, int], int] = immutables.Map()
_EMPTY_ENTRIES: immutables.Map[str, Entry] = immutables.Map()
_ABSENT = object()

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PageStore(Protocol):
    """Where a checkpoint writer's page buffers are kept (the store that holds them)."""

    def place(self, buffer: PageBuffer) -> Any:
        """`buffer`'s location for the checkpoint being written (msgpack data); the
        store keeps what it names unchanged while that checkpoint may be loaded."""
        ...

    def fetch(self, where: Any, length: int) -> PageBuffer:
        """The `length`-byte buffer placed at `where` (checked: damage raises)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedState:
    """What `load_state` rebuilt, and what it could not (name -> error)."""

    volumes: dict[str, Volume]
    snapshots: dict[str, Snapshot]
    failures: dict[str, SlatesError]


def _body_type(kind: Kind) -> type:
    return _BODY_OF_KIND.get(kind, DeviceBody)


def _diff(
    old: immutables.Map[K, V], new: immutables.Map[K, V], *, identity: bool
) -> tuple[list[K], list[tuple[K, V]]]:
    """Keys of `old` missing from `new`, and the items of `new` that `old` lacks or differs in."""
    if old is new:
        return [], []
    changed: list[tuple[K, V]] = []
    for key, value in new.items():
        before: object = old.get(key, _ABSENT)
        if before is value or (not identity and before == value):
            continue
        changed.append((key, value))
    removed = [key for key in old if key not in new]
    return removed, changed


# -- dump ---------------------------------------------------------------------


class _Encoder:
    """Builds the chunk, inode and root tables, each distinct object once."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, int] = {}
        self.inodes: list[list[Any]] = []
        self.roots: list[list[Any]] = []
        self._inode_at: dict[int, int] = {}  # id(Inode) -> index
        self._root_at: dict[int, int] = {}  # id(Root) -> index
        self._root_objects: list[Root] = []  # keeps ids stable while dumping
        self._last_root: dict[int, int] = {}  # id(Inode) -> latest root index holding it

    def chunk(self, chunk_id: bytes) -> int:
        return self.chunks.setdefault(chunk_id, len(self.chunks))

    def root(self, root: Root) -> int:
        found = self._root_at.get(id(root))
        if found is not None:
            return found
        index = len(self.roots)
        origin = self._origin(root)
        prev_inodes, prev_ids = _EMPTY_INODES, _EMPTY_IDS
        if origin is not None:
            prev = self._root_objects[origin]
            removed, changed = _diff(prev.inodes, root.inodes, identity=True)
            if len(removed) + len(changed) < len(root.inodes):
                prev_inodes, prev_ids = prev.inodes, prev.base_identities
            else:
                origin = None
        if origin is None:
            removed, changed = _diff(_EMPTY_INODES, root.inodes, identity=True)
        added: list[int] = []
        for ino, inode in sorted(changed, key=lambda item: item[0]):
            if ino != inode.ino:
                raise InvalidArgument("a root holds an inode under another number", ino=ino)
            added.append(self.inode(inode, prev_inodes.get(ino)))
        ids_removed, ids_changed = _diff(prev_ids, root.base_identities, identity=False)
        self.roots.append(
            [
                origin,
                sorted(removed),
                added,
                [[device, inode] for device, inode in sorted(ids_removed)],
                [[device, inode, ino] for (device, inode), ino in sorted(ids_changed)],
                root.next_ino,
                root.referenced_bytes,
                root.case_insensitive,
                root.epoch,
                root.record_gen,
            ]
        )
        self._root_at[id(root)] = index
        self._root_objects.append(root)
        for inode in root.inodes.values():
            self._last_root[id(inode)] = index
        return index

    def _origin(self, root: Root) -> int | None:
        """The earlier root that most recently held the most of this root's inodes."""
        votes = Counter(
            at
            for at in (self._last_root.get(id(inode)) for inode in root.inodes.values())
            if at is not None
        )
        if not votes:
            return None
        return min(votes, key=lambda at: (-votes[at], at))

    def inode(self, inode: Inode, prev: Inode | None) -> int:
        """Index of `inode`, encoding it first; `prev` is its version in the origin root."""
        found = self._inode_at.get(id(inode))
        if found is not None:
            return found
        body = inode.body
        if type(body) is not _body_type(inode.kind):
            raise InvalidArgument("an inode's body does not match its kind", ino=inode.ino)
        fields: list[Any]
        if isinstance(body, FileBody):
            fp = body.fingerprint
            fields = [
                body.size,
                [self._extent(extent) for extent in body.extents],
                body.base_path,
                None if fp is None else [fp.device, fp.inode, fp.size, fp.mtime_ns],
                None if body.origin is None else [body.origin[0], list(body.origin[1])],
            ]
        elif isinstance(body, DirBody):
            origin: int | None = None
            if prev is not None and isinstance(prev.body, DirBody):
                origin = self._inode_at.get(id(prev))
            base = _EMPTY_ENTRIES
            if origin is not None:
                assert prev is not None and isinstance(prev.body, DirBody)
                base = prev.body.entries
            removed, changed = _diff(base, body.entries, identity=False)
            if origin is not None and len(removed) + len(changed) >= len(body.entries):
                origin = None
                removed, changed = _diff(_EMPTY_ENTRIES, body.entries, identity=False)
            fields = [
                body.parent,
                origin,
                sorted(removed),
                [
                    [key, None if entry.name == key else entry.name, entry.ino]
                    for key, entry in sorted(changed, key=lambda item: item[0])
                ],
                sorted(body.whiteouts),
                body.base_path,
            ]
        elif isinstance(body, SymlinkBody):
            fields = [body.target]
        else:
            fields = [body.rdev]
        index = len(self.inodes)
        self.inodes.append(
            [
                inode.ino,
                int(inode.kind),
                inode.mode,
                inode.uid,
                inode.gid,
                inode.nlink,
                inode.atime_ns,
                inode.mtime_ns,
                inode.ctime_ns,
                {name: inode.xattrs[name] for name in sorted(inode.xattrs)},
                fields,
                inode.st_ino,
            ]
        )
        self._inode_at[id(inode)] = index
        return index

    def _extent(self, extent: Extent) -> list[Any]:
        if isinstance(extent, BaseSpan):
            return [_BASE_SPAN, extent.start, extent.length, extent.base_offset]
        if isinstance(extent, ChunkSpan):
            chunk = self.chunk(extent.chunk_id)
            return [
                _CHUNK_SPAN,
                extent.start,
                extent.length,
                chunk,
                extent.chunk_offset,
                extent.epoch,
            ]
        return [_PAGE_SPAN, extent.start, extent.length, extent.buffer_id]


def dump_state(
    volumes: Mapping[str, Volume],
    snapshots: Mapping[str, Snapshot],
    base_key: Callable[[BaseReader], str],
    *,
    host: Host | None = None,
) -> bytes:
    """The checkpoint blob of `dump_state_pieces`, joined."""
    return b"".join(dump_state_pieces(volumes, snapshots, base_key, host=host))


def dump_state_pieces(
    volumes: Mapping[str, Volume],
    snapshots: Mapping[str, Snapshot],
    base_key: Callable[[BaseReader], str],
    *,
    host: Host | None = None,
) -> Iterator[bytes | bytearray]:
    """The complete state of `volumes` and `snapshots` as checkpoint bytes, in pieces:
    the document, then each page buffer itself (not a copy: consume the pieces
    before the volumes change).

    `base_key(reader)` names each base reader (called once per reader);
    `open_base(key)` reopens it on load.  The host's snapshot metadata
    bytes are carried too: the host is the volumes' one, or `host` when
    given (needed when there are only snapshots).  Names must be unique
    across volumes and snapshots (load reports failures by name).
    """
    head, pages = _document(volumes, snapshots, base_key, host, None)
    yield head
    for buffer in pages:
        # A heap buffer goes out as it is; one kept elsewhere is read out, one at a time.
        yield buffer if isinstance(buffer, bytearray) else buffer[0 : len(buffer)]


def dump_placed(
    volumes: Mapping[str, Volume],
    snapshots: Mapping[str, Snapshot],
    base_key: Callable[[BaseReader], str],
    pages: PageStore,
    *,
    host: Host | None = None,
) -> bytes:
    """The checkpoint document of `volumes` and `snapshots`, each page buffer named by
    its location in `pages` (see `dump_state_pieces`): the blob, no page bytes after it."""
    head, _pages = _document(volumes, snapshots, base_key, host, pages)
    return head


def _document(
    volumes: Mapping[str, Volume],
    snapshots: Mapping[str, Snapshot],
    base_key: Callable[[BaseReader], str],
    host: Host | None,
    store: PageStore | None,
) -> tuple[bytes, list[PageBuffer]]:
    """[length][document], and the buffers to follow it (none when placed)."""
    both = volumes.keys() & snapshots.keys()
    if both:
        raise InvalidArgument("a name is both a volume and a snapshot", names=sorted(both)[:8])
    hosts = {id(volume.host): volume.host for volume in volumes.values()}
    if host is not None:
        hosts.setdefault(id(host), host)
    if len(hosts) > 1:
        raise InvalidArgument("the volumes of one checkpoint must share one host")
    metadata = next(iter(hosts.values())).snapshot_metadata_bytes if hosts else 0

    keys: dict[int, str] = {}

    def key_of(base: BaseReader | None) -> str | None:
        if base is None:
            return None
        key = keys.get(id(base))
        if key is None:
            key = base_key(base)
            if not isinstance(key, str):
                raise InvalidArgument("base_key must return a string")
            keys[id(base)] = key
        return key

    encoder = _Encoder()
    pages: list[PageBuffer] = []
    volume_docs: list[dict[str, Any]] = []
    for name, volume in volumes.items():
        buffer_ids = sorted(volume._buffers)
        if store is None:
            where: list[Any] = [None] * len(buffer_ids)
            pages += [volume._buffers[bid] for bid in buffer_ids]
        else:
            where = [store.place(volume._buffers[bid]) for bid in buffer_ids]
        volume_docs.append(
            {
                "name": name,
                "root": encoder.root(volume.root),
                "base": key_of(volume.base),
                "bounded": volume.bounded,
                "limit": volume.limit,
                "closed": volume._closed,
                "unique_bytes": volume.unique_bytes,
                "inflight_bytes": volume.inflight_bytes,
                "metadata_bytes": volume.metadata_bytes,
                "own_mark": volume._own_mark,
                "own_limit": volume._own_limit,
                "own_numbers": sorted(volume._own_numbers),
                "buffers": [
                    [bid, len(volume._buffers[bid]), at]
                    for bid, at in zip(buffer_ids, where, strict=True)
                ],
                "next_buffer": volume._next_buffer,
                "handles": [[ino, volume._handles[ino]] for ino in sorted(volume._handles)],
                "dirty": sorted(volume._dirty),
            }
        )
    snapshot_docs = [
        {
            "name": name,
            "id": snapshot.snapshot_id,
            "root": encoder.root(snapshot.root),
            "base": key_of(snapshot.base),
        }
        for name, snapshot in snapshots.items()
    ]
    document = {
        "format": FORMAT,
        "version": VERSION,
        "chunks": list(encoder.chunks),
        "inodes": encoder.inodes,
        "roots": encoder.roots,
        "volumes": volume_docs,
        "snapshots": snapshot_docs,
        "snapshot_metadata_bytes": metadata,
    }
    head: bytes = msgpack.packb(document, use_bin_type=True, unicode_errors="surrogateescape")
    return _LENGTH.pack(len(head)) + head, pages


# -- load: phase 1, decode and validate -----------------------------------------


def _bad(what: str, **details: Any) -> NoReturn:
    raise InvalidArgument(f"malformed checkpoint: {what}", **details)


def _int(value: Any, what: str, lo: int | None = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        _bad(f"{what} is not an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        _bad(f"{what} is out of range", value=value)
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        _bad(f"{what} is not a boolean")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        _bad(f"{what} is not a string")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    return None if value is None else _str(value, what)


def _bin(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes):
        _bad(f"{what} is not binary")
    return value


def _list(value: Any, what: str, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        _bad(f"{what} is not an array")
    if length is not None and len(value) != length:
        _bad(f"{what} has {len(value)} fields, not {length}")
    return value


def _map(value: Any, what: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        _bad(f"{what} is not a map")
    if value.keys() != keys:
        _bad(f"{what} has the wrong fields")
    return value


@dataclasses.dataclass(slots=True)
class _VolumeSpec:
    name: str
    root: Root
    base: str | None
    bounded: bool
    limit: int
    closed: bool
    unique_bytes: int
    inflight_bytes: int
    metadata_bytes: int
    own_mark: int
    own_limit: int
    own_numbers: set[int]
    buffers: dict[int, PageBuffer]
    next_buffer: int
    handles: dict[int, int]
    dirty: set[int]


@dataclasses.dataclass(slots=True)
class _SnapshotSpec:
    name: str
    snapshot_id: str
    root: Root
    base: str | None


class _Decoder:
    """Rebuilds the tables; every check raises InvalidArgument."""

    def __init__(
        self,
        document: dict[str, Any],
        page_bytes: memoryview,
        store: PageStore | None,
        host: Host,
    ) -> None:
        self._page_data = page_bytes  # the page buffers' bytes, taken in document order
        self._page_at = 0
        self._store = store
        self._host = host
        self.made: list[PageBuffer] = []  # buffers made so far: freed if the load fails
        self.chunks = [_bin(c, "chunk id") for c in _list(document["chunks"], "chunk table")]
        self.inodes: list[Inode] = []
        self.pages: dict[int, tuple[PageSpan, ...]] = {}  # id(Inode) -> its page extents
        self.chunk_refs: dict[int, tuple[bytes, ...]] = {}  # id(Inode) -> chunks it names
        for raw in _list(document["inodes"], "inode table"):
            self.inodes.append(self._inode(raw))
        self.roots: list[Root] = []
        for raw in _list(document["roots"], "root table"):
            root = self._root(raw)
            self._check_root(root)
            self.roots.append(root)

    def _page_buffer(self, length: int, where: Any) -> PageBuffer:
        """A page buffer: the store's, where it was placed there, else made in the host's
        page memory from the next bytes after the document (copied once)."""
        if (where is None) != (self._store is None):
            _bad("a page buffer's location does not match how the checkpoint is read")
        if self._store is not None:
            buffer = self._store.fetch(where, length)
        else:
            if length > self.pages_left:
                _bad("a page buffer runs past the checkpoint's end", length=length)
            start, self._page_at = self._page_at, self._page_at + length
            self._host.pages.ensure(length)
            buffer = self._host.pages.new([self._page_data[start : self._page_at]])
        self.made.append(buffer)
        return buffer

    @property
    def pages_left(self) -> int:
        return len(self._page_data) - self._page_at

    def _inode(self, raw: Any) -> Inode:
        f = _list(raw, "inode", 12)
        ino = _int(f[0], "ino", 1)
        kind = _KINDS.get(_int(f[1], "kind"))
        if kind is None:
            _bad("unknown file kind", value=f[1])
        xattrs = f[9]
        if not isinstance(xattrs, dict):
            _bad("xattrs is not a map")
        for name, value in xattrs.items():
            _str(name, "xattr name")
            _bin(value, "xattr value")
        body_type = _body_type(kind)
        body: FileBody | DirBody | SymlinkBody | DeviceBody
        if body_type is FileBody:
            body = self._file(f[10])
        elif body_type is DirBody:
            body = self._dir(f[10])
        elif body_type is SymlinkBody:
            body = SymlinkBody(_str(_list(f[10], "symlink body", 1)[0], "symlink target"))
        else:
            body = DeviceBody(_int(_list(f[10], "device body", 1)[0], "rdev"))
        inode = Inode(
            ino,
            kind,
            _int(f[2], "mode", 0, 0o7777),
            _int(f[3], "uid"),
            _int(f[4], "gid"),
            _int(f[5], "nlink"),
            _int(f[6], "atime_ns", None),
            _int(f[7], "mtime_ns", None),
            _int(f[8], "ctime_ns", None),
            immutables.Map(xattrs),
            body,
            _int(f[11], "st_ino"),
        )
        if isinstance(body, FileBody):
            pages = tuple(e for e in body.extents if isinstance(e, PageSpan))
            chunks = tuple(e.chunk_id for e in body.extents if isinstance(e, ChunkSpan))
            if pages:
                self.pages[id(inode)] = pages
            if chunks:
                self.chunk_refs[id(inode)] = chunks
        return inode

    def _file(self, raw: Any) -> FileBody:
        f = _list(raw, "file body", 5)
        size = _int(f[0], "file size", 0, MAX_FILE_SIZE)
        extents: list[Extent] = []
        end = 0
        for raw_extent in _list(f[1], "extent map"):
            e = _list(raw_extent, "extent")
            if not e:
                _bad("empty extent")
            tag = _int(e[0], "extent type")
            extent: Extent
            if tag == _BASE_SPAN:
                e = _list(e, "base extent", 4)
                extent = BaseSpan(
                    _int(e[1], "extent start"),
                    _int(e[2], "extent length", 1),
                    _int(e[3], "base offset"),
                )
            elif tag == _CHUNK_SPAN:
                e = _list(e, "chunk extent", 6)
                chunk = self.chunks[_int(e[3], "chunk index", 0, len(self.chunks) - 1)]
                extent = ChunkSpan(
                    _int(e[1], "extent start"),
                    _int(e[2], "extent length", 1),
                    chunk,
                    _int(e[4], "chunk offset"),
                    _int(e[5], "chunk epoch"),
                )
            elif tag == _PAGE_SPAN:
                e = _list(e, "page extent", 4)
                extent = PageSpan(
                    _int(e[1], "extent start"),
                    _int(e[2], "extent length", 1),
                    _int(e[3], "buffer id", 1),
                )
                if extent.start % PAGE or extent.length % PAGE:
                    _bad("page extent is not page-aligned", start=extent.start)
            else:
                _bad("unknown extent type", value=tag)
            if extent.start < end:
                _bad("extents overlap or are out of order", start=extent.start)
            end = extent.start + extent.length
            if not isinstance(extent, PageSpan) and end > size:
                _bad("a shared extent lies beyond the file size", start=extent.start)
            extents.append(extent)
        fingerprint = None
        if f[3] is not None:
            fp = _list(f[3], "fingerprint", 4)
            fingerprint = Fingerprint(
                _int(fp[0], "device"),
                _int(fp[1], "base inode"),
                _int(fp[2], "base size"),
                _int(fp[3], "base mtime_ns", None),
            )
        origin = None
        if f[4] is not None:
            raw_origin = _list(f[4], "origin", 2)
            pieces = tuple(_int(v, "origin piece", NEW) for v in _list(raw_origin[1], "pieces"))
            if len(pieces) % 2 or any(v <= 0 for v in pieces[1::2]):
                _bad("an origin has a malformed piece")
            origin = (_int(raw_origin[0], "record generation"), pieces)
        return FileBody(size, tuple(extents), _opt_str(f[2], "base path"), fingerprint, origin)

    def _dir(self, raw: Any) -> DirBody:
        f = _list(raw, "directory body", 6)
        parent = _int(f[0], "parent", 1)
        base = _EMPTY_ENTRIES
        if f[1] is not None:
            prev = self.inodes[_int(f[1], "entries origin", 0, len(self.inodes) - 1)]
            if not isinstance(prev.body, DirBody):
                _bad("entries origin is not a directory")
            base = prev.body.entries
        entries = base.mutate()
        for key in _list(f[2], "removed entries"):
            if _str(key, "entry key") not in entries:
                _bad("a removed entry does not exist")
            del entries[key]
        seen: set[str] = set()
        for raw_entry in _list(f[3], "entries"):
            e = _list(raw_entry, "entry", 3)
            key = _str(e[0], "entry key")
            if not key or key in seen:
                _bad("empty or repeated entry key")
            seen.add(key)
            name = key if e[1] is None else _str(e[1], "entry name")
            entries[key] = Entry(name, _int(e[2], "entry ino", 1))
        whiteouts = frozenset(_str(w, "whiteout") for w in _list(f[4], "whiteouts"))
        return DirBody(parent, entries.finish(), whiteouts, _opt_str(f[5], "base path"))

    def _root(self, raw: Any) -> Root:
        f = _list(raw, "root", 10)
        inodes, ids = _EMPTY_INODES, _EMPTY_IDS
        if f[0] is not None:
            prev = self.roots[_int(f[0], "root origin", 0, len(self.roots) - 1)]
            inodes, ids = prev.inodes, prev.base_identities
        inode_map = inodes.mutate()
        for value in _list(f[1], "removed inodes"):
            if _int(value, "removed ino") not in inode_map:
                _bad("a removed inode does not exist", ino=value)
            del inode_map[value]
        seen: set[int] = set()
        for value in _list(f[2], "root inodes"):
            inode = self.inodes[_int(value, "inode index", 0, len(self.inodes) - 1)]
            if inode.ino in seen:
                _bad("a root lists one inode number twice", ino=inode.ino)
            seen.add(inode.ino)
            inode_map[inode.ino] = inode
        id_map = ids.mutate()
        for value in _list(f[3], "removed base identities"):
            pair = _list(value, "base identity", 2)
            identity = (_int(pair[0], "device"), _int(pair[1], "base inode"))
            if identity not in id_map:
                _bad("a removed base identity does not exist")
            del id_map[identity]
        for value in _list(f[4], "base identities"):
            triple = _list(value, "base identity", 3)
            identity = (_int(triple[0], "device"), _int(triple[1], "base inode"))
            id_map[identity] = _int(triple[2], "bound ino", 1)
        return Root(
            inode_map.finish(),
            _int(f[5], "next_ino", ROOT_INO + 1),
            id_map.finish(),
            _int(f[6], "referenced bytes"),
            _bool(f[7], "case_insensitive"),
            _int(f[8], "epoch"),
            _int(f[9], "record generation"),
        )

    @staticmethod
    def _check_root(root: Root) -> None:
        top = root.inodes.get(ROOT_INO)
        if top is None or not isinstance(top.body, DirBody):
            _bad("a root has no root directory")
        if root.next_ino in root.inodes:
            _bad("the next inode number is taken", ino=root.next_ino)
        for inode in root.inodes.values():
            # Numbers above next_ino are adopted ones (a green's from its work volumes).
            if not ROOT_INO <= inode.ino < NO_INO_LIMIT:
                _bad("an inode number is out of range", ino=inode.ino)
            body = inode.body
            if not isinstance(body, DirBody):
                continue
            for entry in body.entries.values():
                if entry.ino not in root.inodes:
                    _bad("a directory entry names a missing inode", ino=entry.ino)
            if inode.nlink:
                parent = root.inodes.get(body.parent)
                if parent is None or not isinstance(parent.body, DirBody):
                    _bad("a directory's parent is missing", ino=inode.ino)

    def page_spans(self, root: Root) -> dict[int, tuple[PageSpan, ...]]:
        """ino -> page extents, for every inode of `root` that has any."""
        return {
            inode.ino: spans
            for inode in root.inodes.values()
            if (spans := self.pages.get(id(inode))) is not None
        }

    def root_at(self, value: Any) -> Root:
        return self.roots[_int(value, "root index", 0, len(self.roots) - 1)]

    def volume(self, raw: Any) -> _VolumeSpec:
        d = _map(raw, "volume", _VOLUME_KEYS)
        root = self.root_at(d["root"])
        buffers: dict[int, PageBuffer] = {}
        for value in _list(d["buffers"], "page buffers"):
            triple = _list(value, "page buffer", 3)
            buffer_id = _int(triple[0], "buffer id", 1)
            if buffer_id in buffers:
                _bad("a page buffer id repeats", buffer_id=buffer_id)
            length = _int(triple[1], "page buffer length")
            buffers[buffer_id] = self._page_buffer(length, triple[2])
        handles: dict[int, int] = {}
        for value in _list(d["handles"], "handles"):
            pair = _list(value, "handle", 2)
            ino = _int(pair[0], "handle ino", 1)
            if ino in handles or ino not in root.inodes:
                _bad("a handle repeats or names a missing inode", ino=ino)
            handles[ino] = _int(pair[1], "handle count", 1)
        spec = _VolumeSpec(
            name=_str(d["name"], "volume name"),
            root=root,
            base=_opt_str(d["base"], "base key"),
            bounded=_bool(d["bounded"], "bounded"),
            limit=_int(d["limit"], "limit", 1),
            closed=_bool(d["closed"], "closed"),
            unique_bytes=_int(d["unique_bytes"], "unique bytes"),
            inflight_bytes=_int(d["inflight_bytes"], "in-flight bytes"),
            metadata_bytes=_int(d["metadata_bytes"], "metadata bytes"),
            own_mark=_int(d["own_mark"], "own mark", ROOT_INO, root.next_ino),
            own_limit=_int(d["own_limit"], "own limit", root.next_ino, NO_INO_LIMIT),
            own_numbers={
                _int(ino, "own number", ROOT_INO + 1) for ino in _list(d["own_numbers"], "numbers")
            },
            buffers=buffers,
            next_buffer=_int(d["next_buffer"], "next buffer", max(buffers, default=0) + 1),
            handles=handles,
            dirty={_int(ino, "dirty ino", 1) for ino in _list(d["dirty"], "dirty inodes")},
        )
        if spec.closed:
            # close() drops the buffers (the root keeps its extents) and the charges.
            if buffers or spec.inflight_bytes or spec.metadata_bytes:
                _bad("a closed volume still holds pages or charges", volume=spec.name)
            return spec
        spans = self.page_spans(root)
        lengths = {
            span.buffer_id: span.length for ino_spans in spans.values() for span in ino_spans
        }
        if sum(map(len, spans.values())) != len(lengths) or lengths != {
            buffer_id: len(buffer) for buffer_id, buffer in buffers.items()
        }:
            _bad("page extents and page buffers disagree", volume=spec.name)
        if spec.dirty != spans.keys():
            _bad("dirty inodes and page extents disagree", volume=spec.name)
        return spec

    def snapshot(self, raw: Any) -> _SnapshotSpec:
        d = _map(raw, "snapshot", _SNAPSHOT_KEYS)
        spec = _SnapshotSpec(
            name=_str(d["name"], "snapshot name"),
            snapshot_id=_str(d["id"], "snapshot id"),
            root=self.root_at(d["root"]),
            base=_opt_str(d["base"], "base key"),
        )
        if not spec.snapshot_id:
            _bad("a snapshot has an empty id")
        if self.page_spans(spec.root):
            _bad("a snapshot root holds unsealed pages", snapshot=spec.name)
        return spec


def _decode(
    blob: bytes | memoryview, store: PageStore | None, host: Host
) -> tuple[list[_VolumeSpec], list[_SnapshotSpec], int, _Decoder]:
    view = memoryview(blob)
    if len(view) < _LENGTH.size:
        _bad("a checkpoint too short for its header")
    (length,) = _LENGTH.unpack_from(view, 0)
    if length > len(view) - _LENGTH.size:
        _bad("the checkpoint's document runs past its end", length=length)
    try:
        document = msgpack.unpackb(
            view[_LENGTH.size : _LENGTH.size + length],
            raw=False,
            strict_map_key=True,
            use_list=True,
            unicode_errors="surrogateescape",
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise InvalidArgument("undecodable checkpoint", reason=str(exc)[:200]) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        _bad("not a slates checkpoint")
    version = document.get("version")
    if type(version) is not int or version != VERSION:
        raise InvalidArgument("unsupported checkpoint version", version=repr(version)[:40])
    if document.keys() != _TOP_KEYS:
        _bad("wrong top-level fields")
    decoder = _Decoder(document, view[_LENGTH.size + length :], store, host)
    try:
        volumes = [decoder.volume(raw) for raw in _list(document["volumes"], "volumes")]
        if decoder.pages_left:
            _bad("page bytes follow that no page buffer names", extra=decoder.pages_left)
        snapshots = [decoder.snapshot(raw) for raw in _list(document["snapshots"], "snapshots")]
        names = [spec.name for spec in volumes] + [spec.name for spec in snapshots]
        if len(set(names)) != len(names):
            _bad("a volume or snapshot name repeats")
        metadata = _int(document["snapshot_metadata_bytes"], "snapshot metadata bytes")
    except BaseException:
        for buffer in decoder.made:  # a bad blob changes nothing, page memory included
            host.pages.free(buffer)
        raise
    return volumes, snapshots, metadata, decoder


# -- load: phases 2 and 3 -------------------------------------------------------


def load_state(
    blob: bytes | memoryview,
    host: Host,
    open_base: Callable[[str], BaseReader],
    *,
    pages: PageStore | None = None,
) -> LoadedState:
    """Rebuild the volumes and snapshots of a checkpoint on `host`.

    `open_base(key)` returns the reader for a key `base_key` gave, or
    raises a SlatesError: the volumes and snapshots over that base then
    fail (other exceptions propagate, before anything changes).  The host's
    chunk store must hold the sealed chunks; a volume or snapshot naming a
    missing chunk fails with MissingContent.  A malformed blob raises
    InvalidArgument and changes nothing.  `Volume.on_applied` is not state:
    reattach it.  A blob `dump_placed` wrote needs the `pages` store its buffers
    were placed in (whose damaged bytes raise what `PageStore.fetch` raises).
    """
    volumes, snapshots, metadata, decoder = _decode(blob, pages, host)

    # Phase 2: the environment, read but not changed.
    specs: list[_VolumeSpec | _SnapshotSpec] = [*volumes, *snapshots]
    bases: dict[str, BaseReader | SlatesError] = {}
    for spec in specs:
        if spec.base is not None and spec.base not in bases:
            try:
                bases[spec.base] = open_base(spec.base)
            except SlatesError as exc:
                bases[spec.base] = exc
    missing_of: dict[int, bytes | None] = {}  # id(Inode) -> first chunk the store lacks

    def missing(root: Root) -> tuple[int, bytes] | None:
        for inode in root.inodes.values():
            key = id(inode)
            if key not in missing_of:
                refs = decoder.chunk_refs.get(key, ())
                missing_of[key] = next((c for c in refs if not host.has_chunk(c)), None)
            chunk = missing_of[key]
            if chunk is not None:
                return inode.ino, chunk
        return None

    failures: dict[str, SlatesError] = {}
    for spec in specs:
        base = None if spec.base is None else bases[spec.base]
        if isinstance(base, SlatesError):
            failures[spec.name] = base
            continue
        lost = missing(spec.root)
        if lost is not None:
            failures[spec.name] = MissingContent(
                "a checkpointed chunk is not in the host's store",
                name=spec.name,
                ino=lost[0],
                chunk=lost[1].hex(),
            )

    # Phase 3: build and charge.
    def reader(key: str | None) -> BaseReader | None:
        if key is None:
            return None
        base = bases[key]
        assert not isinstance(base, SlatesError)
        return base

    loaded: dict[str, Volume] = {}
    for v in volumes:
        if v.name in failures:
            for buffer in v.buffers.values():
                host.pages.free(buffer)
            continue
        # Opened as dynamic so the host does not re-admit an already reserved quota.
        volume = Volume(host, v.root, base=reader(v.base), capacity=Capacity.dynamic(v.limit))
        volume.bounded = v.bounded
        volume.unique_bytes = v.unique_bytes
        volume.inflight_bytes = v.inflight_bytes
        volume.metadata_bytes = v.metadata_bytes
        volume._own_mark = v.own_mark
        volume._own_limit = v.own_limit
        volume._own_numbers = v.own_numbers
        volume._buffers = v.buffers
        volume._next_buffer = v.next_buffer
        volume._handles = v.handles
        volume._dirty = v.dirty
        page_bytes = sum(len(buffer) for buffer in v.buffers.values())
        host.charge(page_bytes + v.metadata_bytes + v.inflight_bytes)
        if v.closed:
            volume.close()
        loaded[v.name] = volume
    restored = {
        s.name: Snapshot(s.snapshot_id, s.root, reader(s.base))
        for s in snapshots
        if s.name not in failures
    }
    host.snapshot_metadata_bytes += metadata
    return LoadedState(loaded, restored, failures)
