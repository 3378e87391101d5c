"""The volume: a deterministic state machine over records.

Theory of operation (DESIGN.md sections 3 and 4)
-------------------------------------------------
A volume is an immutable `Root` (a persistent map of inodes, built on
immutables.Map for structural sharing) plus the few things a live volume
owns privately: mutable page buffers, open-handle counts, and counters.
`Volume.apply(record)` is the only way anything changes, and it is a
`match` over the record types: anything else is InvalidArgument.

Each apply works on a transaction (`_Txn`): it validates and stages every
inode change on a map mutation, asks the host for capacity, and only then
publishes the new root, writes page bytes and updates counters.  A record
that fails (bad input, no capacity, base drift) therefore leaves no effect.

Names and the base.  A directory inode holds its private entries (names
bound to inodes), whiteouts (base names hidden by an unlink or rename) and,
when it merges a base directory, that directory's base path.  A renamed
base directory keeps its original base path: that is the redirect, and
nothing under it is copied.  A base name gets an inode the first time it is
looked up (the `BindBase` record carries the base entry as observed), so
its inode number is stable from then on and its fingerprint is pinned;
merely looking at a file copies none of its content.  That number is
BASE_INO_START + the base inode number when it is free (`base_ino`), so a
mount bridge can name a base entry the volume has not bound yet.

Records assume the names they touch are settled: a name the base directory
holds has been bound first, and a directory being removed has no visible
base entries.  The operation methods (`create`, `unlink`, `rename`, ...)
settle names by consulting the injected base reader and then apply the
record, so a stream of records replays without the base.  Reading base
content (`read`, and filling the edges of a page on copy-on-write) goes
through the reader with the pinned fingerprint; a changed base file raises
BaseDrift for that content only.

Content is an extent map (slates.core.extents).  A write into shared
content copies only the touched page-multiple range into a private page
buffer; later writes into that range update the buffer in place.  `Seal`
turns page buffers into immutable BLAKE3-named chunks in the host store.
`TakeSnapshot` seals and publishes the root; `Volume.clone` starts a new
volume from a snapshot's root in O(1).

Page memory.  Page buffers live where the host's `pages` (a PageMemory,
slates.core.host) keeps them: the heap in-process, a shard's checkpoint
segment in a daemon, where a buffer the published checkpoint holds is
copied on write.  Every record asks `pages.ensure` for all the fresh space
it will take (new pages, copies on write, split buffers) after its other
checks and before its first effect, so a full page area refuses the
record whole (CapacityExhausted) and never half-applies it.  A buffer no
extent names any more is freed through `pages.free` when the record
commits (and all of them when the volume closes).

No I/O, clock, threads or randomness here: time, uids and base facts come
in records, base bytes through the injected reader.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Protocol

import immutables

from slates.core.extents import (
    PAGE,
    BaseSpan,
    ChunkSpan,
    Extent,
    PageSpan,
    allocated_length,
    overlapping,
    page_ceil,
    page_floor,
    splice,
    stored_length,
    trim,
    uncovered,
)
from slates.core.host import UNLIMITED, Host, PageBuffer
from slates.core.origin import Pieces, identity, replace_span
from slates.core.records import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    XATTR_CREATE,
    XATTR_REPLACE,
    Attr,
    BaseEntry,
    BindBase,
    Create,
    DirItem,
    Fingerprint,
    Forget,
    Kind,
    Link,
    Mkdir,
    Mknod,
    PunchHole,
    Record,
    RemoveXattr,
    Rename,
    Retain,
    Rmdir,
    Seal,
    SetAttr,
    SetXattr,
    ShareRange,
    Splice,
    Symlink,
    TakeSnapshot,
    Truncate,
    Unlink,
    Write,
)
from slates.errors import (
    AlreadyExists,
    BaseDrift,
    CapacityExhausted,
    DirectoryNotEmpty,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoSuchAttribute,
    NoSuchOffset,
    NotADirectory,
    NotFound,
    NotPermitted,
    NotSupported,
    OutOfRange,
    TooBig,
)

__all__ = [
    "ROOT_INO",
    "content_tally",
    "PRIVATE_ST_INO",
    "BASE_INO_START",
    "BASE_INO_SPAN",
    "base_ino",
    "CHUNK_SIZE",
    "INODE_COST",
    "MAX_FILE_SIZE",
    "BaseReader",
    "Capacity",
    "Counters",
    "DirInfo",
    "SealReport",
    "Snapshot",
    "Root",
    "Inode",
    "FileBody",
    "DirBody",
    "SymlinkBody",
    "DeviceBody",
    "Entry",
    "Volume",
    "chunk_ids",
    "Held",
    "held",
]

ROOT_INO = 1
# Inode numbers stat reports for inodes with no base inode number of their own:
# tagged above any base file system's numbers, so the two never collide.
PRIVATE_ST_INO = 1 << 56
NO_INO_LIMIT = 1 << 52  # volume inode numbers stay below this (st_ino tags lie above)
# A base entry is bound at BASE_INO_START + its base inode number when that number is
# free, so a mount bridge that answers a base entry itself, without asking, names it as
# the volume will when it binds it (native/bridge_meta.c).  The counter and the work
# volumes' ranges (ledger.WORK_INO_SHIFT) never reach this far in practice.
BASE_INO_SPAN = 1 << 40
BASE_INO_START = NO_INO_LIMIT - BASE_INO_SPAN


def base_ino(st_ino: int) -> int:
    """The number a base entry with this base inode number is bound at if free (0: none)."""
    return BASE_INO_START + st_ino if 0 < st_ino < BASE_INO_SPAN else 0


CHUNK_SIZE = 64 * 1024
INODE_COST = 512  # metadata bytes charged per inode a volume creates
MAX_NAME_BYTES = 255
MAX_SYMLINK_BYTES = 4095
MAX_XATTR_NAME = 255
MAX_XATTR_VALUE = 64 * 1024
MAX_FILE_SIZE = 1 << 43
XATTR_NAMESPACES = frozenset({"user", "trusted", "security", "system"})
# POSIX ACLs live in the mode bits here: storing these as plain xattrs would let a
# tool (sed -i, cp -p) believe it set permissions that the mode never got, so they
# are refused (EOPNOTSUPP) and tools fall back to chmod.
ACL_XATTRS = frozenset({"system.posix_acl_access", "system.posix_acl_default"})


class BaseReader(Protocol):
    """Read access to a live base directory (slates.base provides one)."""

    def stat(self, path: str) -> BaseEntry | None: ...

    def list(self, path: str) -> list[tuple[str, Kind]]: ...

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    name: str  # as created (the key may be case-folded)
    ino: int


@dataclasses.dataclass(frozen=True, slots=True)
class FileBody:
    size: int
    extents: tuple[Extent, ...]
    base_path: str | None  # where BaseSpan bytes come from
    fingerprint: Fingerprint | None
    # (recording generation, pieces): where the bytes came from since the
    # volume started recording (slates.core.origin); stale or None = unchanged.
    origin: tuple[int, Pieces] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DirBody:
    parent: int
    entries: immutables.Map[str, Entry]
    whiteouts: frozenset[str]
    base_path: str | None  # the base directory merged here (a redirect once renamed)


@dataclasses.dataclass(frozen=True, slots=True)
class SymlinkBody:
    target: str


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceBody:
    rdev: int


Body = FileBody | DirBody | SymlinkBody | DeviceBody


@dataclasses.dataclass(frozen=True, slots=True)
class Inode:
    ino: int
    kind: Kind
    mode: int
    uid: int
    gid: int
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    xattrs: immutables.Map[str, bytes]
    body: Body
    # The inode number stat reports when not our own: the base file's, so tools
    # that remember inode numbers (git's index) see the files they knew.
    st_ino: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Root:
    inodes: immutables.Map[int, Inode]
    next_ino: int
    base_identities: immutables.Map[tuple[int, int], int]  # (device, inode) -> ino
    referenced_bytes: int
    case_insensitive: bool
    # Content sealed at this epoch is the volume's own; a snapshot keeps the
    # epoch and the volume (and every clone) moves past it.
    epoch: int = 0
    # Origins recorded under an older generation are stale: every clone starts
    # recording afresh relative to the snapshot it came from.
    record_gen: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    snapshot_id: str
    root: Root
    base: BaseReader | None


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    bounded: bool
    limit: int

    @classmethod
    def reserved(cls, size: int) -> Capacity:
        if size <= 0:
            raise InvalidArgument("a bounded size must be positive", size=size)
        return cls(True, size)

    @classmethod
    def dynamic(cls, maximum: int = UNLIMITED) -> Capacity:
        if maximum <= 0:
            raise InvalidArgument("a dynamic maximum must be positive", maximum=maximum)
        return cls(False, maximum)


@dataclasses.dataclass(frozen=True, slots=True)
class DirInfo:
    """How a directory is composed: the base directory it merges, and hidden base names.

    `base_path` differs from the directory's own path after a rename: that
    is the redirect.  None means the directory is private (or opaque).
    """

    base_path: str | None
    whiteouts: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """A volume's counters (product description, "Memory Limits and Shared Content").

    referenced_bytes: file content Slates holds that the volume can read
      (sealed chunks and private pages, each file's bytes counted once
      however many volumes share them).  Bytes still read through from a
      live base directory are not counted: counting them would need the
      scan that creating a volume must not do.
    unique_bytes: content created since the clone origin or latest
      snapshot, in whole private pages until sealed.
    """

    referenced_bytes: int
    unique_bytes: int
    metadata_bytes: int
    inflight_bytes: int
    charged_bytes: int  # what counts against the quota
    limit_bytes: int
    bounded: bool
    host_physical_bytes: int  # what the host holds, shared chunks once
    host_capacity_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class SealReport:
    files: int
    chunks_new: int
    chunks_shared: int
    bytes_sealed: int


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """What a collection found the live volumes and snapshots hold."""

    chunk_ids: frozenset[bytes]
    # Metadata of the inodes no volume counts as its own: snapshots' trees, and
    # inodes volumes inherited from the snapshot they were cloned from.
    shared_metadata: int


def held(volumes: Iterable[Volume], snapshot_roots: Iterable[Root]) -> Held:
    """Walk every distinct inode object once: the chunks named, and the metadata the
    volumes' own counters leave out (what `Host.hand_over_metadata` handed over, less
    what deleted snapshots let go)."""
    seen: set[int] = set()
    chunks: set[bytes] = set()
    shared = 0
    for owner, root in [(v, v.root) for v in volumes] + [(None, r) for r in snapshot_roots]:
        for inode in root.inodes.values():
            if id(inode) in seen:
                continue
            seen.add(id(inode))
            if owner is None or not owner._is_own(inode.ino):
                shared += _metadata(inode)
            if isinstance(inode.body, FileBody):
                chunks.update(e.chunk_id for e in inode.body.extents if isinstance(e, ChunkSpan))
    return Held(frozenset(chunks), shared)


def chunk_ids(*roots: Root) -> Iterator[bytes]:
    """Every chunk the roots refer to, each distinct inode object walked once (`held`)."""
    yield from held((), roots).chunk_ids


_EMPTY_ENTRIES: immutables.Map[str, Entry] = immutables.Map()
_EMPTY_XATTRS: immutables.Map[str, bytes] = immutables.Map()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise InvalidArgument("invalid file name", name=str(name))
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise NameTooLong("file name is too long", name=name[:64])


def _layered(
    lo: int, hi: int, layers: Iterable[tuple[int, memoryview]]
) -> list[bytes | memoryview]:
    """The bytes of [lo, hi) as pieces: each layer (file offset, bytes; in order, not
    overlapping) where it lies, zeros between."""
    pieces: list[bytes | memoryview] = []
    at = lo
    for start, view in layers:
        top = min(hi, start + len(view))
        if top <= max(at, start):
            continue
        if start > at:
            pieces.append(bytes(start - at))
            at = start
        pieces.append(view[at - start : top - start])
        at = top
    if at < hi:
        pieces.append(bytes(hi - at))
    return pieces


def _outside(lo: int, hi: int, gaps: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of [lo, hi) that no gap (sorted, disjoint) covers."""
    for start, end in gaps:
        if start >= hi:
            break
        if start > lo:
            yield lo, start
        lo = max(lo, end)
        if lo >= hi:
            return
    if lo < hi:
        yield lo, hi


# Inodes of the request path are built directly: dataclasses.replace costs several
# times a constructor, and these run for every write, create and unlink.


def _rebuilt(inode: Inode, body: Body, mtime_ns: int, ctime_ns: int, nlink: int) -> Inode:
    """`inode` with `body`, these times and this link count, its other fields kept."""
    return Inode(
        inode.ino,
        inode.kind,
        inode.mode,
        inode.uid,
        inode.gid,
        nlink,
        inode.atime_ns,
        mtime_ns,
        ctime_ns,
        inode.xattrs,
        body,
        inode.st_ino,
    )


def _retimed(inode: Inode, body: Body, time_ns: int, nlink: int | None = None) -> Inode:
    """`inode` with `body`, its mtime and ctime set to `time_ns` (and `nlink`, if given)."""
    return _rebuilt(inode, body, time_ns, time_ns, inode.nlink if nlink is None else nlink)


def _rebodied(inode: Inode, body: Body) -> Inode:
    """`inode` with `body`, its times unchanged."""
    return _rebuilt(inode, body, inode.mtime_ns, inode.ctime_ns, inode.nlink)


def _check_count(value: int, what: str) -> None:
    if not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer", value=value)


class _Inodes(Protocol):
    def __getitem__(self, ino: int, /) -> Inode: ...


class _Txn:
    """Staged inode changes; `before` keeps each touched inode's original."""

    __slots__ = ("base_ids", "before", "inodes", "limit", "next_ino", "numbered_now")

    def __init__(self, root: Root, limit: int = 0) -> None:
        self.inodes = root.inodes.mutate()
        self.base_ids = root.base_identities.mutate()
        self.next_ino = root.next_ino
        self.limit = limit or NO_INO_LIMIT
        self.before: dict[int, Inode | None] = {}
        self.numbered_now: list[int] = []

    def get(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise NotFound("no such inode", ino=ino)
        return inode

    def dir(self, ino: int) -> Inode:
        inode = self.get(ino)
        if not isinstance(inode.body, DirBody):
            raise NotADirectory("not a directory", ino=ino)
        return inode

    def file(self, ino: int) -> Inode:
        inode = self.get(ino)
        if isinstance(inode.body, DirBody):
            raise IsADirectory("is a directory", ino=ino)
        if not isinstance(inode.body, FileBody):
            raise InvalidArgument("not a regular file", ino=ino)
        return inode

    def put(self, inode: Inode) -> None:
        if inode.ino not in self.before:
            self.before[inode.ino] = self.inodes.get(inode.ino)
        self.inodes[inode.ino] = inode

    def drop(self, ino: int) -> None:
        if ino not in self.before:
            self.before[ino] = self.inodes.get(ino)
        del self.inodes[ino]

    def new_ino(self) -> int:
        ino = self.next_ino
        if ino >= self.limit:
            raise CapacityExhausted("the volume's inode numbers are used up", limit=self.limit)
        if ino in self.inodes:
            raise InvalidArgument("the next inode number is taken", ino=ino)
        self.next_ino += 1
        return ino

    def numbered(self, ino: int) -> int:
        """A number chosen by the caller (a green adopting its submitter's numbers):
        never the root's, never one in use; the volume's own counter is unchanged."""
        _check_count(ino, "inode number")
        if ino <= ROOT_INO or ino in self.inodes:
            raise InvalidArgument("that inode number is taken", ino=ino)
        self.numbered_now.append(ino)
        return ino


def _buffer_ids(inode: Inode | None) -> set[int]:
    if inode is None or not isinstance(inode.body, FileBody):
        return set()
    return {e.buffer_id for e in inode.body.extents if isinstance(e, PageSpan)}


ContentTally = tuple[int, int, int, set[int]]  # referenced, unique, page bytes, buffer ids
KNOWN_TALLIES = 64  # files whose last tally a volume keeps (a few writers at a time)


def content_tally(inode: Inode | None, epoch: int) -> ContentTally:
    """An inode's referenced bytes (as `_referenced`), its bytes unique at `epoch` (its
    pages, and chunks sealed in `epoch`), its page bytes and its buffer ids (as
    `_buffer_ids`), in one pass over its extents: `Volume._commit` asks for all four of
    the old and the new inode of every record."""
    if inode is None or not isinstance(inode.body, FileBody):
        return 0, 0, 0, set()
    size = inode.body.size
    referenced = unique = pages = 0
    buffers: set[int] = set()
    for extent in inode.body.extents:
        if isinstance(extent, PageSpan):
            pages += extent.length
            unique += extent.length
            buffers.add(extent.buffer_id)
        elif isinstance(extent, ChunkSpan):
            if extent.epoch == epoch:
                unique += extent.length
        else:
            continue  # base content: neither stored here nor unique
        if extent.start < size:
            referenced += min(extent.start + extent.length, size) - extent.start
    return referenced, unique, pages, buffers


def _changed_span(current: bytes, data: bytes) -> tuple[int, int]:
    """The part [lo, hi) of `data` that must be written over `current` (the file's bytes
    where data starts; data may run past its end): never empty, so a write of
    unchanged bytes still writes one and sets the times."""
    n = len(current)
    lo, hi = 0, n  # the common prefix is data[:lo], by bisection (slices compare at memcmp speed)
    if data[:1] != current[:1]:
        hi = 0  # the usual case, new bytes: nothing to search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if data[:mid] == current[:mid]:
            lo = mid
        else:
            hi = mid - 1
    if len(data) > n:  # bytes past the end are all new
        return lo, len(data)
    if lo == n:
        return 0, min(1, len(data))
    shared, top = 0, n - lo  # the common suffix, within what differs
    if data[n - 1 : n] != current[n - 1 :]:
        top = 0
    while shared < top:
        mid = (shared + top + 1) // 2
        if data[n - mid : n] == current[n - mid :]:
            shared = mid
        else:
            top = mid - 1
    return lo, n - shared


def _edge_fits(body: FileBody, edge: bytes, start: int, end: int) -> bool:
    """A write's head or tail is the file's bytes in [start, end), or nothing when a
    private page already holds them (Volume.write leaves those out)."""
    return len(edge) == end - start or (not edge and not uncovered(body.extents, start, end))


def _metadata(inode: Inode | None) -> int:
    """Metadata bytes an inode costs: the inode, its xattrs, its link target."""
    if inode is None:
        return 0
    size = INODE_COST + sum(
        len(name.encode("utf-8", "surrogateescape")) + len(value)
        for name, value in inode.xattrs.items()
    )
    if isinstance(inode.body, SymlinkBody):
        size += len(inode.body.target.encode("utf-8", "surrogateescape"))
    return size


def _referenced(inode: Inode | None) -> int:
    if inode is None or not isinstance(inode.body, FileBody):
        return 0
    return stored_length(inode.body.extents, inode.body.size)


class Volume:
    """One volume's live state; change it only through `apply` or the operation methods."""

    def __init__(
        self,
        host: Host,
        root: Root,
        *,
        base: BaseReader | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        capacity = capacity or Capacity.dynamic()
        self.host = host
        self.base = base
        self.root = root
        self.bounded = capacity.bounded
        self.limit = capacity.limit
        self.unique_bytes = 0
        self.inflight_bytes = 0
        # Inodes numbered in [own_mark, own_limit) by the counter, or adopted with
        # a chosen number since the last snapshot (own_numbers), were created here.
        self._own_mark = root.next_ino
        self._own_limit = NO_INO_LIMIT
        self._own_numbers: set[int] = set()
        self.metadata_bytes = 0  # metadata of those inodes (inode, xattrs, link target)
        self._buffers: dict[int, PageBuffer] = {}
        self._next_buffer = 1
        self._handles: dict[int, int] = {}
        self._dirty: set[int] = set()
        self._fresh: set[int] = set()  # page buffers made by the record being applied
        # The content_tally of the files `_commit` changed last (the inode it made, the
        # epoch it was counted at, the tally), at most KNOWN_TALLIES of them, the most
        # recent last: inodes are immutable, so when the next record's old inode is that
        # very object its tally is known (a file written many times in a row is not
        # counted twice per write).
        self._tallies: dict[int, tuple[Inode, int, ContentTally]] = {}
        self._closed = False
        # Called after every applied record with its result: the journal's seam.
        self.on_applied: Callable[[Record, object], None] | None = None
        host.open_account(self)

    # -- construction ---------------------------------------------------------

    @classmethod
    def new(
        cls,
        host: Host,
        *,
        base: BaseReader | None = None,
        capacity: Capacity | None = None,
        case_insensitive: bool = False,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        time_ns: int = 0,
    ) -> Volume:
        """A new volume: empty, or over a live base directory (read on demand).

        The root's mode and owner default to the base directory's (one stat
        of the base root; pass them to avoid it, as journal replay does).
        """
        base_path = None
        if base is not None:
            base_path = "/"
            if mode is None or uid is None or gid is None:
                top = base.stat("/")
                if top is None or top.kind != Kind.DIR:
                    raise InvalidArgument("the base must be a directory")
                mode, uid, gid = top.mode, top.uid, top.gid
        mode = 0o755 if mode is None else mode
        uid = 0 if uid is None else uid
        gid = 0 if gid is None else gid
        root_dir = Inode(
            ROOT_INO,
            Kind.DIR,
            mode & 0o7777,
            uid,
            gid,
            2,
            time_ns,
            time_ns,
            time_ns,
            _EMPTY_XATTRS,
            DirBody(ROOT_INO, _EMPTY_ENTRIES, frozenset(), base_path),
        )
        root = Root(
            immutables.Map({ROOT_INO: root_dir}),
            ROOT_INO + 1,
            immutables.Map(),
            0,
            case_insensitive,
        )
        return cls(host, root, base=base, capacity=capacity)

    @classmethod
    def clone(cls, snapshot: Snapshot, host: Host, capacity: Capacity | None = None) -> Volume:
        """A new volume whose root is the snapshot's root: O(1), nothing copied."""
        root = dataclasses.replace(
            snapshot.root, epoch=snapshot.root.epoch + 1, record_gen=snapshot.root.record_gen + 1
        )
        return cls(host, root, base=snapshot.base, capacity=capacity)

    def number_from(self, next_ino: int, limit: int = NO_INO_LIMIT) -> None:
        """Number this volume's new inodes in [next_ino, limit) (before any record is applied).

        A work volume numbers in a range of its own, so its green can adopt
        the numbers of what it creates and a mount keeps them across a move
        onto a new version.  Numbers never go back (they are never reused),
        and each allocation checks that its number is free.
        """
        _check_count(next_ino, "inode number")
        if next_ino < self.root.next_ino or next_ino in self.root.inodes or limit <= next_ino:
            raise InvalidArgument("the inode numbering start is taken", next_ino=next_ino)
        self.root = dataclasses.replace(self.root, next_ino=next_ino)
        self._own_mark = next_ino
        self._own_limit = limit

    @property
    def numbering(self) -> tuple[int, int]:
        """The range this volume numbers its new inodes in: (next number, limit)."""
        return self.root.next_ino, self._own_limit

    def _is_own(self, ino: int) -> bool:
        # A base entry's number (base_ino) is own only if bound since the last snapshot.
        in_range = self._own_mark <= ino < min(self._own_limit, BASE_INO_START)
        return in_range or ino in self._own_numbers

    def adopt_handles(self, previous: Volume, later: Collection[int] = ()) -> None:
        """Carry the open handles and kernel references of the volume this one replaces.

        An inode the new root no longer has (another version removed it) stays
        as an unlinked orphan while it is held, as an unlinked-but-open file
        does: the kernel can still read it and its forget finds it.  Only a
        sealed inode can move (its content is shared chunks, base ranges or
        holes); an unsealed one (pages private to `previous`) is dropped.  Numbers
        in `later` are left alone: the caller makes those objects again and then
        retains them.
        """
        inodes = self.root.inodes.mutate()
        referenced = self.root.referenced_bytes
        for ino, count in previous._handles.items():
            if ino in later:
                continue
            if ino not in inodes:
                old = previous.root.inodes.get(ino)
                if old is None or _buffer_ids(old):
                    continue
                orphan = dataclasses.replace(old, nlink=0)
                if isinstance(old.body, DirBody):  # its children are not its any more
                    orphan = dataclasses.replace(
                        orphan,
                        body=DirBody(old.body.parent, _EMPTY_ENTRIES, frozenset(), None),
                    )
                inodes[ino] = orphan
                referenced += _referenced(orphan)
            self._handles[ino] = count
        self.root = dataclasses.replace(
            self.root, inodes=inodes.finish(), referenced_bytes=referenced
        )

    def close(self) -> None:
        """Release this volume's pages, metadata charge and quota reservation."""
        if self._closed:
            return
        self._closed = True
        freed = sum(len(b) for b in self._buffers.values())
        for buffer in self._buffers.values():
            self.host.pages.free(buffer)
        self._buffers.clear()
        self.host.charge(-(freed + self.metadata_bytes + self.inflight_bytes))
        self.inflight_bytes = 0
        self.metadata_bytes = 0
        self.host.close_account(self)

    # -- accounting -----------------------------------------------------------

    @property
    def charged_bytes(self) -> int:
        return self.unique_bytes + self.metadata_bytes + self.inflight_bytes

    def counters(self) -> Counters:
        return Counters(
            referenced_bytes=self.root.referenced_bytes,
            unique_bytes=self.unique_bytes,
            metadata_bytes=self.metadata_bytes,
            inflight_bytes=self.inflight_bytes,
            charged_bytes=self.charged_bytes,
            limit_bytes=self.limit,
            bounded=self.bounded,
            host_physical_bytes=self.host.physical_bytes,
            host_capacity_bytes=self.host.capacity,
        )

    def admit_inflight(self, nbytes: int) -> None:
        """Hold buffer space for a request still being received (released after apply)."""
        _check_count(nbytes, "in-flight size")
        self._require_open()
        self.host.admit(self, nbytes)
        self.inflight_bytes += nbytes
        self.host.charge(nbytes)

    def release_inflight(self, nbytes: int) -> None:
        _check_count(nbytes, "in-flight size")
        if nbytes > self.inflight_bytes:
            raise InvalidArgument("releasing more in-flight bytes than were admitted")
        self.inflight_bytes -= nbytes
        self.host.charge(-nbytes)

    # -- the state machine ----------------------------------------------------

    def apply(self, record: Record) -> object:
        """Apply one record; returns its result or raises with no effect."""
        self._require_open()
        txn = _Txn(self.root, self._own_limit)
        self._fresh.clear()
        match record:
            # The records a mount sends most (its writes, and a kernel reference for
            # every entry it is handed) first: the classes are disjoint, so the order
            # changes only the isinstance checks each record pays.
            case Write():
                result: object = self._write(txn, record)
            case Retain():
                result = None
                self._retain(txn, record)
            case BindBase():
                result = self._bind_base(txn, record)
            case Create():
                result = self._add_node(
                    txn,
                    record.parent,
                    record.name,
                    Kind.FILE,
                    record.mode,
                    record.uid,
                    record.gid,
                    record.time_ns,
                    FileBody(0, (), None, None),
                    record.ino,
                )
            case Mkdir():
                result = self._add_node(
                    txn,
                    record.parent,
                    record.name,
                    Kind.DIR,
                    record.mode,
                    record.uid,
                    record.gid,
                    record.time_ns,
                    DirBody(record.parent, _EMPTY_ENTRIES, frozenset(), None),
                    record.ino,
                )
            case Symlink():
                self._check_symlink(record.target)
                result = self._add_node(
                    txn,
                    record.parent,
                    record.name,
                    Kind.SYMLINK,
                    0o777,
                    record.uid,
                    record.gid,
                    record.time_ns,
                    SymlinkBody(record.target),
                    record.ino,
                )
            case Mknod():
                if record.kind not in (Kind.FIFO, Kind.SOCKET, Kind.CHAR_DEVICE, Kind.BLOCK_DEVICE):
                    raise InvalidArgument("mknod makes fifos, sockets and devices only")
                _check_count(record.rdev, "rdev")
                result = self._add_node(
                    txn,
                    record.parent,
                    record.name,
                    record.kind,
                    record.mode,
                    record.uid,
                    record.gid,
                    record.time_ns,
                    DeviceBody(record.rdev),
                    record.ino,
                )
            case Link():
                result = self._link(txn, record)
            case Unlink():
                result = None
                self._remove(txn, record.parent, record.name, record.time_ns, False)
            case Rmdir():
                result = None
                self._remove(txn, record.parent, record.name, record.time_ns, True)
            case Rename():
                result = None
                self._rename(txn, record)
            case Truncate():
                result = None
                self._truncate(txn, record)
            case PunchHole():
                result = None
                self._punch_hole(txn, record)
            case Splice():
                result = self._splice(txn, record)
            case ShareRange():
                result = self._share_range(txn, record)
            case SetAttr():
                result = self._setattr(txn, record)
            case SetXattr():
                result = None
                self._setxattr(txn, record)
            case RemoveXattr():
                result = None
                self._removexattr(txn, record)
            case Forget():
                result = None
                self._forget(txn, record)
            case Seal():
                result = self._seal()
            case TakeSnapshot():
                result = self._snapshot(record)
            case _:
                raise InvalidArgument("unknown record", record=type(record).__name__)
        if txn.before:
            self._commit(txn)
        if self.on_applied is not None:
            self.on_applied(record, result)
        return result

    def _require_open(self) -> None:
        if self._closed:
            raise InvalidArgument("the volume is closed")

    def _key(self, name: str) -> str:
        return name.casefold() if self.root.case_insensitive else name

    def _commit(self, txn: _Txn) -> None:
        """Publish staged changes and update every counter from (before, after) pairs."""
        referenced = self.root.referenced_bytes
        unique = self.unique_bytes
        self._own_numbers.update(txn.numbered_now)
        page_delta = 0
        meta_delta = 0
        dead_buffers: set[int] = set(self._fresh)
        live_buffers: set[int] = set()
        epoch = self.root.epoch
        tallies = self._tallies
        for ino, old in txn.before.items():
            new = txn.inodes.get(ino)
            new_tally = content_tally(new, epoch)
            known = tallies.get(ino)
            if known is not None and known[0] is old and known[1] == epoch:
                old_tally = known[2]  # this very inode's, worked out when it was made
            else:
                old_tally = content_tally(old, epoch)
            tallies.pop(ino, None)
            if new is not None and isinstance(new.body, FileBody):
                tallies[ino] = (new, epoch, new_tally)  # the most recent last
                if len(tallies) > KNOWN_TALLIES:
                    del tallies[next(iter(tallies))]
            new_referenced, new_unique, new_pages, new_buffers = new_tally
            old_referenced, old_unique, old_pages, old_buffers = old_tally
            referenced += new_referenced - old_referenced
            unique += new_unique - old_unique
            page_delta += new_pages - old_pages
            dead_buffers |= old_buffers
            live_buffers |= new_buffers
            if self._is_own(ino):
                meta_delta += _metadata(new) - _metadata(old)
            if new is not None and new_buffers:
                self._dirty.add(ino)
            else:
                self._dirty.discard(ino)
            if new is None:
                self._handles.pop(ino, None)
        for buffer_id in dead_buffers - live_buffers:
            self.host.pages.free(self._buffers.pop(buffer_id))
        self._fresh.clear()
        root = self.root
        self.root = Root(
            txn.inodes.finish(),
            txn.next_ino,
            txn.base_ids.finish(),
            referenced,
            root.case_insensitive,
            root.epoch,
            root.record_gen,
        )
        self.unique_bytes = unique
        self.metadata_bytes += meta_delta
        self.host.charge(page_delta + meta_delta)

    def _new_inode(
        self,
        txn: _Txn,
        kind: Kind,
        mode: int,
        uid: int,
        gid: int,
        time_ns: int,
        body: Body,
        ino: int = 0,
    ) -> Inode:
        nlink = 2 if kind == Kind.DIR else 1
        return Inode(
            txn.numbered(ino) if ino else txn.new_ino(),
            kind,
            mode & 0o7777,
            uid,
            gid,
            nlink,
            time_ns,
            time_ns,
            time_ns,
            _EMPTY_XATTRS,
            body,
        )

    @staticmethod
    def _touch_dir(txn: _Txn, ino: int, time_ns: int, nlink_delta: int = 0) -> None:
        d = txn.dir(ino)
        txn.put(_retimed(d, d.body, time_ns, d.nlink + nlink_delta))

    @staticmethod
    def _set_entry(
        txn: _Txn, parent: int, key: str, entry: Entry | None, whiteout: bool = False
    ) -> None:
        d = txn.dir(parent)
        assert isinstance(d.body, DirBody)
        entries = d.body.entries.set(key, entry) if entry else d.body.entries.delete(key)
        whiteouts = d.body.whiteouts | {key} if whiteout else d.body.whiteouts
        body = DirBody(d.body.parent, entries, whiteouts, d.body.base_path)
        txn.put(_rebodied(d, body))

    def _entry(self, txn: _Txn, parent: int, name: str) -> tuple[str, Entry]:
        _check_name(name)
        d = txn.dir(parent)
        assert isinstance(d.body, DirBody)
        key = self._key(name)
        entry = d.body.entries.get(key)
        if entry is None:
            raise NotFound("no such file or directory", name=name)
        return key, entry

    def _free_key(self, txn: _Txn, parent: int, name: str) -> str:
        _check_name(name)
        d = txn.dir(parent)
        assert isinstance(d.body, DirBody)
        if d.nlink == 0:
            raise NotFound("the directory was removed", ino=parent)
        key = self._key(name)
        if key in d.body.entries:
            raise AlreadyExists("file exists", name=name)
        return key

    def _bind_base(self, txn: _Txn, r: BindBase) -> int:
        key = self._free_key(txn, r.parent, r.name)
        d = txn.dir(r.parent)
        assert isinstance(d.body, DirBody)
        if d.body.base_path is None or key in d.body.whiteouts:
            raise InvalidArgument("the directory shows no base entry by that name", name=r.name)
        e = r.entry
        if e.path != posixpath.join(d.body.base_path, r.name):
            raise InvalidArgument("the base entry's path does not match its name", name=r.name)
        for value in (e.mode, e.uid, e.gid, e.size, e.rdev, e.nlink):
            _check_count(value, "base entry field")
        identity = (e.fingerprint.device, e.fingerprint.inode)
        existing = txn.base_ids.get(identity)
        aliased = txn.inodes.get(existing) if existing is not None else None
        if (
            e.kind == Kind.FILE
            and aliased is not None
            and isinstance(aliased.body, FileBody)
            and aliased.body.fingerprint == e.fingerprint
        ):
            # Another base name of the same file (a hard link): its nlink already
            # counts this name.  A reused inode number has another fingerprint.
            inode = aliased
        else:
            self.host.admit(self, INODE_COST)
            body: Body
            match e.kind:
                case Kind.FILE:
                    spans: tuple[Extent, ...] = (BaseSpan(0, e.size, 0),) if e.size else ()
                    body = FileBody(e.size, spans, e.path, e.fingerprint)
                case Kind.DIR:
                    body = DirBody(r.parent, _EMPTY_ENTRIES, frozenset(), e.path)
                case Kind.SYMLINK:
                    body = SymlinkBody(e.target)
                case _:
                    body = DeviceBody(e.rdev)
            derived = base_ino(e.fingerprint.inode)
            inode = Inode(
                txn.numbered(derived) if derived and derived not in txn.inodes else txn.new_ino(),
                e.kind,
                e.mode & 0o7777,
                e.uid,
                e.gid,
                2 if e.kind == Kind.DIR else max(1, e.nlink),
                e.atime_ns,
                e.mtime_ns,
                e.ctime_ns,
                _EMPTY_XATTRS,
                body,
                e.fingerprint.inode,
            )
            txn.put(inode)
            if e.kind == Kind.FILE:
                txn.base_ids[identity] = inode.ino
        self._set_entry(txn, r.parent, key, Entry(r.name, inode.ino))
        if e.kind == Kind.DIR:  # nlink counts bound subdirectories, so removing one balances
            parent = txn.get(r.parent)
            txn.put(dataclasses.replace(parent, nlink=parent.nlink + 1))
        return inode.ino

    def _add_node(
        self,
        txn: _Txn,
        parent: int,
        name: str,
        kind: Kind,
        mode: int,
        uid: int,
        gid: int,
        time_ns: int,
        body: Body,
        ino: int = 0,
    ) -> Attr:
        key = self._free_key(txn, parent, name)
        for value in (mode, uid, gid):
            _check_count(value, "mode and owner")
        inode = self._new_inode(txn, kind, mode, uid, gid, time_ns, body, ino)
        self.host.admit(self, _metadata(inode))
        txn.put(inode)
        self._set_entry(txn, parent, key, Entry(name, inode.ino))
        self._touch_dir(txn, parent, time_ns, 1 if kind == Kind.DIR else 0)
        return self._attr(inode)

    def _check_symlink(self, target: str) -> None:
        if not target:
            raise NotFound("a symbolic link needs a target")  # Linux: ENOENT
        if "\0" in target:
            raise InvalidArgument("invalid symlink target")
        if len(target.encode("utf-8", "surrogateescape")) > MAX_SYMLINK_BYTES:
            raise NameTooLong("symlink target is too long")

    def _link(self, txn: _Txn, r: Link) -> Attr:
        inode = txn.get(r.ino)
        if inode.kind == Kind.DIR:
            raise NotPermitted("cannot hard-link a directory", ino=r.ino)
        if inode.nlink == 0:
            raise NotFound("cannot link an unlinked inode", ino=r.ino)
        key = self._free_key(txn, r.parent, r.name)
        inode = dataclasses.replace(inode, nlink=inode.nlink + 1, ctime_ns=r.time_ns)
        txn.put(inode)
        self._set_entry(txn, r.parent, key, Entry(r.name, r.ino))
        self._touch_dir(txn, r.parent, r.time_ns)
        return self._attr(inode)

    def _unref(self, txn: _Txn, ino: int, time_ns: int) -> None:
        """One name less for `ino`; the inode dies when no name or handle remains."""
        inode = txn.get(ino)
        nlink = 0 if inode.kind == Kind.DIR else inode.nlink - 1
        if nlink == 0 and self._handles.get(ino, 0) == 0:
            self._destroy(txn, inode)
        else:
            txn.put(dataclasses.replace(inode, nlink=nlink, ctime_ns=time_ns))

    def _destroy(self, txn: _Txn, inode: Inode) -> None:
        txn.drop(inode.ino)
        if isinstance(inode.body, FileBody) and inode.body.fingerprint is not None:
            identity = (inode.body.fingerprint.device, inode.body.fingerprint.inode)
            if txn.base_ids.get(identity) == inode.ino:
                del txn.base_ids[identity]

    def _remove(self, txn: _Txn, parent: int, name: str, time_ns: int, is_dir: bool) -> None:
        key, entry = self._entry(txn, parent, name)
        target = txn.get(entry.ino)
        if is_dir:
            if not isinstance(target.body, DirBody):
                raise NotADirectory("not a directory", name=name)
            if target.body.entries:
                raise DirectoryNotEmpty("directory not empty", name=name)
        elif target.kind == Kind.DIR:
            raise IsADirectory("is a directory", name=name)
        d = txn.dir(parent)
        assert isinstance(d.body, DirBody)
        self._set_entry(txn, parent, key, None, whiteout=d.body.base_path is not None)
        self._touch_dir(txn, parent, time_ns, -1 if is_dir else 0)
        self._unref(txn, entry.ino, time_ns)

    @staticmethod
    def _is_within(inodes: _Inodes, ino: int, ancestor: int) -> bool:
        """Whether directory `ino` is `ancestor` or lies beneath it."""
        while ino != ancestor:
            if ino == ROOT_INO:
                return False
            body = inodes[ino].body
            if not isinstance(body, DirBody):
                raise NotADirectory("not a directory", ino=ino)
            ino = body.parent
        return True

    def _rename(self, txn: _Txn, r: Rename) -> None:
        if r.flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or r.flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise InvalidArgument("invalid rename flags", flags=r.flags)
        key, entry = self._entry(txn, r.parent, r.name)
        _check_name(r.new_name)
        dst = txn.dir(r.new_parent)
        assert isinstance(dst.body, DirBody)
        if dst.nlink == 0:
            raise NotFound("the target directory was removed", ino=r.new_parent)
        new_key = self._key(r.new_name)
        existing = dst.body.entries.get(new_key)
        exchange = bool(r.flags & RENAME_EXCHANGE)
        if exchange and existing is None:
            raise NotFound("nothing to exchange with", name=r.new_name)
        if existing is not None and existing.ino == entry.ino:
            if r.parent == r.new_parent and key == new_key and entry.name != r.new_name:
                self._set_entry(txn, r.parent, key, Entry(r.new_name, entry.ino))
                self._touch_dir(txn, r.parent, r.time_ns)
            elif r.flags & RENAME_NOREPLACE:
                raise AlreadyExists("file exists", name=r.new_name)
            return  # POSIX: renaming a name onto another link of the same file does nothing
        if existing is not None and r.flags & RENAME_NOREPLACE:
            raise AlreadyExists("file exists", name=r.new_name)
        moved = txn.get(entry.ino)
        if moved.kind == Kind.DIR and self._is_within(txn.inodes, r.new_parent, moved.ino):
            raise InvalidArgument("cannot move a directory inside itself", name=r.name)
        replaced = txn.get(existing.ino) if existing is not None else None
        if (
            exchange
            and replaced is not None
            and replaced.kind == Kind.DIR
            and self._is_within(txn.inodes, r.parent, replaced.ino)
        ):
            raise InvalidArgument("cannot move a directory inside itself", name=r.new_name)
        if replaced is not None and not exchange:
            if moved.kind == Kind.DIR:
                if not isinstance(replaced.body, DirBody):
                    raise NotADirectory("not a directory", name=r.new_name)
                if replaced.body.entries:
                    raise DirectoryNotEmpty("directory not empty", name=r.new_name)
            elif replaced.kind == Kind.DIR:
                raise IsADirectory("is a directory", name=r.new_name)
        src_dir = txn.dir(r.parent)
        assert isinstance(src_dir.body, DirBody)
        moved_dirs = (moved.kind == Kind.DIR) - (
            exchange and replaced is not None and replaced.kind == Kind.DIR
        )
        if exchange:
            assert existing is not None
            self._set_entry(txn, r.parent, key, Entry(r.name, existing.ino))
        else:
            self._set_entry(txn, r.parent, key, None, whiteout=src_dir.body.base_path is not None)
        self._set_entry(txn, r.new_parent, new_key, Entry(r.new_name, entry.ino))
        if r.parent != r.new_parent:
            self._touch_dir(txn, r.parent, r.time_ns, -moved_dirs)
            self._touch_dir(txn, r.new_parent, r.time_ns, moved_dirs)
        else:
            self._touch_dir(txn, r.parent, r.time_ns)
        self._reparent(txn, entry.ino, r.new_parent, r.time_ns)
        if replaced is not None:
            if exchange:
                self._reparent(txn, replaced.ino, r.parent, r.time_ns)
            else:
                if replaced.kind == Kind.DIR:
                    self._touch_dir(txn, r.new_parent, r.time_ns, -1)
                self._unref(txn, replaced.ino, r.time_ns)

    @staticmethod
    def _reparent(txn: _Txn, ino: int, parent: int, time_ns: int) -> None:
        inode = txn.get(ino)
        body = inode.body
        if isinstance(body, DirBody):
            body = dataclasses.replace(body, parent=parent)
        txn.put(dataclasses.replace(inode, body=body, ctime_ns=time_ns))

    # -- content --------------------------------------------------------------

    def _read_extents(self, inode: Inode, start: int, end: int) -> bytes:
        """Bytes [start, end) as the extents describe them (holes and tails read as zeros)."""
        body = inode.body
        assert isinstance(body, FileBody)
        out = bytearray(end - start)
        for extent in overlapping(body.extents, start, end):
            lo = max(extent.start, start)
            hi = min(extent.start + extent.length, end)
            skip = lo - extent.start
            if isinstance(extent, PageSpan):
                piece: bytes | bytearray = self._buffers[extent.buffer_id][skip : skip + hi - lo]
            elif isinstance(extent, ChunkSpan):
                chunk = self.host.get_chunk(extent.chunk_id)
                piece = chunk[extent.chunk_offset + skip : extent.chunk_offset + skip + hi - lo]
            else:
                piece = self._read_base(body, extent.base_offset + skip, hi - lo)
            out[lo - start : hi - start] = piece
        return bytes(out)

    def _read_base(self, body: FileBody, offset: int, size: int) -> bytes:
        if self.base is None or body.base_path is None or body.fingerprint is None:
            raise InvalidArgument("base content without a base reader")
        data = self.base.read(body.base_path, body.fingerprint, offset, size)
        if len(data) != size:
            raise BaseDrift("base file is shorter than when it was read", path=body.base_path)
        return data

    def _write(self, txn: _Txn, r: Write) -> int:
        inode = txn.file(r.ino)
        body = inode.body
        assert isinstance(body, FileBody)
        _check_count(r.offset, "offset")
        end = r.offset + len(r.data)
        if end > MAX_FILE_SIZE:
            raise FileTooLarge("write beyond the maximum file size", end=end)
        if not r.data:
            return 0
        appended = self._append_pages(txn, inode, body, r, end)
        if appended is not None:
            return appended
        first, last = page_floor(r.offset), page_ceil(end)
        head_end, tail_end = max(first, min(r.offset, body.size)), max(end, min(last, body.size))
        if not _edge_fits(body, r.head, first, head_end) or not _edge_fits(
            body, r.tail, end, tail_end
        ):
            raise InvalidArgument("the write's edge bytes do not match the file", ino=r.ino)
        gaps = uncovered(body.extents, first, last)
        fresh = sum(hi - lo for lo, hi in gaps)
        self.host.admit(self, fresh)
        in_place = [
            (extent, max(extent.start, lo), min(extent.start + extent.length, hi))
            for lo, hi in _outside(r.offset, end, gaps)
            for extent in overlapping(body.extents, lo, hi)
        ]
        self.host.pages.ensure(
            fresh
            + sum(
                self._page_buffer(extent).rewrite_cost(at - extent.start, to - extent.start)
                for extent, at, to in in_place
            )
        )
        # Every check has passed: from here on the write takes effect.
        # New pages are made from their final bytes (edges, data, zeros), each byte
        # copied once; pages already private get the data in place.
        extents = body.extents
        data = memoryview(r.data)
        layers = ((first, memoryview(r.head)), (r.offset, data), (end, memoryview(r.tail)))
        for lo, hi in gaps:
            extents = self._add_pages(extents, lo, _layered(lo, hi, layers))
        for extent, at, to in in_place:
            # Pages that were private before this write: their buffers are unchanged by
            # the gaps' growth above (a grown buffer keeps its offsets).
            self._page_buffer(extent).write(at - extent.start, data[at - r.offset : to - r.offset])
        start = min(r.offset, body.size)
        origin = self._recorded(body, start, min(end, body.size), end - start)
        # Built directly, not by dataclasses.replace: this runs for every write.
        body = FileBody(max(body.size, end), extents, body.base_path, body.fingerprint, origin)
        txn.put(_retimed(inode, body, r.time_ns))
        return len(r.data)

    def _append_pages(
        self, txn: _Txn, inode: Inode, body: FileBody, r: Write, end: int
    ) -> int | None:
        """`_write` of the usual small request, an append at a page-aligned end of file
        whose last page run ends there: the same effects (the run grows by the data and
        the zeros to its last page; no edges, no pages in place) without the general
        path's extent-map work.  None, changing nothing, for any other write."""
        extents = body.extents
        if r.offset != body.size or r.offset % PAGE or r.head or r.tail or not extents:
            return None
        prev = extents[-1]
        if type(prev) is not PageSpan or prev.start + prev.length != r.offset:
            return None
        last = page_ceil(end)
        fresh = last - r.offset
        self.host.admit(self, fresh)
        self.host.pages.ensure(fresh)
        # Every check has passed: from here on the write takes effect.
        buffer = self._buffers[prev.buffer_id]
        buffer.extend(r.data)
        if last > end:
            buffer.extend(bytes(last - end))
        grown = PageSpan(prev.start, prev.length + fresh, prev.buffer_id)
        origin = self._recorded(body, r.offset, r.offset, end - r.offset)
        body = FileBody(end, (*extents[:-1], grown), body.base_path, body.fingerprint, origin)
        txn.put(_retimed(inode, body, r.time_ns))
        return len(r.data)

    def _add_pages(
        self, extents: tuple[Extent, ...], start: int, pieces: list[bytes | memoryview]
    ) -> tuple[Extent, ...]:
        """Cover [start, start + their length) with private pages holding `pieces`, in
        order, growing a page run that ends there."""
        length = sum(len(piece) for piece in pieces)
        end = start + length
        before = [e for e in overlapping(extents, start - 1, start) if e.start + e.length == start]
        if before and isinstance(before[0], PageSpan):
            prev = before[0]
            buffer = self._buffers[prev.buffer_id]
            for piece in pieces:
                buffer.extend(piece)
            grown = PageSpan(prev.start, prev.length + length, prev.buffer_id)
            return splice(extents, prev.start, end, [grown])
        buffer_id = self._next_buffer
        self._next_buffer += 1
        self._fresh.add(buffer_id)
        self._buffers[buffer_id] = self.host.pages.new(pieces)
        return splice(extents, start, end, [PageSpan(start, length, buffer_id)])

    def _page_buffer(self, extent: Extent) -> PageBuffer:
        if not isinstance(extent, PageSpan):
            raise InvalidArgument("private pages expected", start=extent.start)
        return self._buffers[extent.buffer_id]

    def _ensure_splits(self, extents: tuple[Extent, ...], *ats: int) -> None:
        """Ask for the fresh space `_split_pages_at` will take at each of `ats`."""
        self.host.pages.ensure(
            sum(
                extent.start + extent.length - at
                for at in ats
                for extent in overlapping(extents, at, at + 1)
                if isinstance(extent, PageSpan) and extent.start < at
            )
        )

    def _split_pages_at(self, extents: tuple[Extent, ...], at: int) -> tuple[Extent, ...]:
        """Split the page extent that straddles the page boundary `at`, if any."""
        for extent in overlapping(extents, at, at + 1):
            if isinstance(extent, PageSpan) and extent.start < at:
                buffer = self._buffers[extent.buffer_id]
                right = self._next_buffer
                self._next_buffer += 1
                self._fresh.add(right)
                self._buffers[right] = self.host.pages.new([buffer[at - extent.start :]])
                buffer.shrink(at - extent.start)
                pieces: list[Extent] = [
                    PageSpan(extent.start, at - extent.start, extent.buffer_id),
                    PageSpan(at, extent.start + extent.length - at, right),
                ]
                return splice(extents, extent.start, extent.start + extent.length, pieces)
        return extents

    def _recorded(
        self, body: FileBody, start: int, end: int, new_length: int
    ) -> tuple[int, Pieces]:
        """The file's origin once [start, end) is replaced by `new_length` new bytes."""
        generation = self.root.record_gen
        pieces = identity(body.size)
        if body.origin is not None and body.origin[0] == generation:
            pieces = body.origin[1]
        return generation, replace_span(pieces, start, end, new_length)

    def _check_pages(self, *offsets: int) -> None:
        if any(offset % PAGE for offset in offsets):
            raise InvalidArgument("the range must lie on page boundaries")

    def _punch_hole(self, txn: _Txn, r: PunchHole) -> None:
        inode = txn.file(r.ino)
        body = inode.body
        assert isinstance(body, FileBody)
        _check_count(r.offset, "offset")
        _check_count(r.length, "length")
        end = r.offset + r.length
        self._check_pages(r.offset, end)
        self._ensure_splits(body.extents, r.offset, end)
        extents = self._split_pages_at(self._split_pages_at(body.extents, r.offset), end)
        extents = splice(extents, r.offset, end, [])
        lo, hi = min(r.offset, body.size), min(end, body.size)
        origin = self._recorded(body, lo, hi, hi - lo) if hi > lo else body.origin
        body = dataclasses.replace(body, extents=extents, origin=origin)
        txn.put(dataclasses.replace(inode, body=body, mtime_ns=r.time_ns, ctime_ns=r.time_ns))

    def _share_range(self, txn: _Txn, r: ShareRange) -> int:
        source = txn.file(r.src_ino)
        target = txn.file(r.dst_ino)
        src_body, dst_body = source.body, target.body
        assert isinstance(src_body, FileBody) and isinstance(dst_body, FileBody)
        for value in (r.src_offset, r.dst_offset, r.length):
            _check_count(value, "range")
        self._check_pages(r.src_offset, r.dst_offset, r.length)
        src_end, dst_end = r.src_offset + r.length, r.dst_offset + r.length
        if src_end > src_body.size or dst_end > MAX_FILE_SIZE:
            raise InvalidArgument("the range lies beyond the source file")
        if r.src_ino == r.dst_ino and r.src_offset < dst_end and r.dst_offset < src_end:
            raise InvalidArgument("source and destination ranges overlap")
        shared: list[Extent] = []
        for extent in overlapping(src_body.extents, r.src_offset, src_end):
            if not isinstance(extent, ChunkSpan):
                raise InvalidArgument("only sealed content can be shared", ino=r.src_ino)
            piece = trim(extent, r.src_offset, src_end)
            assert isinstance(piece, ChunkSpan)
            shift = r.dst_offset - r.src_offset
            shared.append(dataclasses.replace(piece, start=piece.start + shift))
        self._ensure_splits(dst_body.extents, r.dst_offset, dst_end)
        extents = self._split_pages_at(
            self._split_pages_at(dst_body.extents, r.dst_offset), dst_end
        )
        extents = splice(extents, r.dst_offset, dst_end, shared)
        start = min(r.dst_offset, dst_body.size)
        origin = self._recorded(dst_body, start, min(dst_end, dst_body.size), dst_end - start)
        dst_body = dataclasses.replace(
            dst_body, extents=extents, size=max(dst_body.size, dst_end), origin=origin
        )
        txn.put(dataclasses.replace(target, body=dst_body, mtime_ns=r.time_ns, ctime_ns=r.time_ns))
        return r.length

    def _truncate(self, txn: _Txn, r: Truncate) -> None:
        inode = txn.file(r.ino)
        body = inode.body
        assert isinstance(body, FileBody)
        _check_count(r.size, "size")
        if r.size > MAX_FILE_SIZE:
            raise FileTooLarge("size beyond the maximum file size", size=r.size)
        extents = body.extents
        if r.size < body.size:
            # The page the new end lies in is zeroed past it: a copy on write, maybe.
            self.host.pages.ensure(
                sum(
                    self._page_buffer(e).rewrite_cost(r.size - e.start, page_ceil(r.size) - e.start)
                    for e in overlapping(extents, r.size, r.size + 1)
                    if isinstance(e, PageSpan) and e.start < r.size
                )
            )
            kept: list[Extent] = []
            for extent in extents:
                if extent.start >= r.size:
                    continue
                if extent.start + extent.length <= r.size:
                    kept.append(extent)
                elif isinstance(extent, PageSpan):
                    # Keep whole pages, zero past the new end: bytes beyond size stay zero.
                    buffer = self._buffers[extent.buffer_id]
                    keep = page_ceil(r.size) - extent.start
                    buffer.shrink(keep)
                    buffer.write(r.size - extent.start, bytes(keep - (r.size - extent.start)))
                    kept.append(PageSpan(extent.start, keep, extent.buffer_id))
                else:
                    piece = trim(extent, extent.start, r.size)
                    assert piece is not None
                    kept.append(piece)
            extents = tuple(kept)
        lo, hi = min(r.size, body.size), max(r.size, body.size)
        origin = body.origin
        if r.size != body.size:
            origin = self._recorded(body, lo, body.size, hi - body.size if r.size > lo else 0)
        body = dataclasses.replace(body, size=r.size, extents=extents, origin=origin)
        txn.put(dataclasses.replace(inode, body=body, mtime_ns=r.time_ns, ctime_ns=r.time_ns))

    def _setattr(self, txn: _Txn, r: SetAttr) -> Attr:
        inode = txn.get(r.ino)
        changes: dict[str, int] = {"ctime_ns": r.time_ns}
        for name in ("mode", "uid", "gid", "atime_ns", "mtime_ns", "st_ino"):
            value = getattr(r, name)
            if value is not None:
                _check_count(value, name)
                changes[name] = value & 0o7777 if name == "mode" else value
        inode = dataclasses.replace(inode, **changes)  # type: ignore[arg-type]
        txn.put(inode)
        return self._attr(inode)

    def _setxattr(self, txn: _Txn, r: SetXattr) -> None:
        inode = txn.get(r.ino)
        if not r.name or len(r.name.encode("utf-8", "surrogateescape")) > MAX_XATTR_NAME:
            raise OutOfRange("invalid extended attribute name length")  # Linux: ERANGE
        if r.name.split(".", 1)[0] not in XATTR_NAMESPACES or "." not in r.name:
            raise NotSupported("unsupported extended attribute namespace", name=r.name)
        if r.name in ACL_XATTRS:
            raise NotSupported("POSIX ACLs are not supported: set the mode instead", name=r.name)
        if len(r.value) > MAX_XATTR_VALUE:
            raise TooBig("extended attribute value is too large")  # Linux: E2BIG
        if r.flags & ~(XATTR_CREATE | XATTR_REPLACE) or r.flags == XATTR_CREATE | XATTR_REPLACE:
            raise InvalidArgument("invalid extended attribute flags", flags=r.flags)
        present = r.name in inode.xattrs
        if r.flags & XATTR_CREATE and present:
            raise AlreadyExists("attribute exists", name=r.name)
        if r.flags & XATTR_REPLACE and not present:
            raise NoSuchAttribute("no such attribute", name=r.name)
        updated = dataclasses.replace(
            inode, xattrs=inode.xattrs.set(r.name, r.value), ctime_ns=r.time_ns
        )
        if self._is_own(r.ino):
            self.host.admit(self, _metadata(updated) - _metadata(inode))
        txn.put(updated)

    def _removexattr(self, txn: _Txn, r: RemoveXattr) -> None:
        inode = txn.get(r.ino)
        if r.name not in inode.xattrs:
            raise NoSuchAttribute("no such attribute", name=r.name)
        txn.put(dataclasses.replace(inode, xattrs=inode.xattrs.delete(r.name), ctime_ns=r.time_ns))

    def _retain(self, txn: _Txn, r: Retain) -> None:
        txn.get(r.ino)
        if not isinstance(r.count, int) or r.count < 1:
            raise InvalidArgument("retain count must be positive", count=r.count)
        self._handles[r.ino] = self._handles.get(r.ino, 0) + r.count

    def _forget(self, txn: _Txn, r: Forget) -> None:
        inode = txn.get(r.ino)
        held = self._handles.get(r.ino, 0)
        if not isinstance(r.count, int) or not 1 <= r.count <= held:
            raise InvalidArgument(
                "forget count exceeds the references held", count=r.count, held=held
            )
        if held == r.count:
            del self._handles[r.ino]
            if inode.nlink == 0:
                self._destroy(txn, inode)
        else:
            self._handles[r.ino] = held - r.count

    # -- seal, snapshot -------------------------------------------------------

    def _chunks_of(self, data: bytes | bytearray, start: int) -> tuple[list[ChunkSpan], int, int]:
        """`data` stored as chunks placed at file offset `start`: (spans, new, shared)."""
        spans: list[ChunkSpan] = []
        new_count = shared_count = 0
        for lo in range(0, len(data), CHUNK_SIZE):
            piece = data[lo : lo + CHUNK_SIZE]
            chunk_id, new = self.host.put_chunk(piece)
            new_count += new
            shared_count += not new
            spans.append(ChunkSpan(start + lo, len(piece), chunk_id, 0, self.root.epoch))
        return spans, new_count, shared_count

    def _sealed(self, body: FileBody) -> tuple[tuple[Extent, ...], int, int, int]:
        """The file's extents with every page span sealed: (extents, new, shared, bytes)."""
        extents: list[Extent] = []
        chunks_new = chunks_shared = sealed = 0
        for extent in body.extents:
            if not isinstance(extent, PageSpan):
                extents.append(extent)
                continue
            end = min(extent.start + extent.length, body.size)
            buffer = self._buffers[extent.buffer_id]
            spans, new, shared = self._chunks_of(buffer[: max(0, end - extent.start)], extent.start)
            extents += spans
            chunks_new, chunks_shared = chunks_new + new, chunks_shared + shared
            sealed += max(0, end - extent.start)
        return tuple(extents), chunks_new, chunks_shared, sealed

    def _seal(self) -> SealReport:
        txn = _Txn(self.root)
        files = chunks_new = chunks_shared = sealed = 0
        for ino in sorted(self._dirty):
            inode = txn.get(ino)
            body = inode.body
            assert isinstance(body, FileBody)
            extents, new, shared, nbytes = self._sealed(body)
            files += 1
            chunks_new, chunks_shared, sealed = (
                chunks_new + new,
                chunks_shared + shared,
                (sealed + nbytes),
            )
            txn.put(dataclasses.replace(inode, body=dataclasses.replace(body, extents=extents)))
        self._commit(txn)
        return SealReport(files, chunks_new, chunks_shared, sealed)

    def _splice(self, txn: _Txn, r: Splice) -> int:
        inode = txn.file(r.ino)
        body = inode.body
        assert isinstance(body, FileBody)
        _check_count(r.start, "start")
        _check_count(r.end, "end")
        if not r.start <= r.end <= body.size:
            raise InvalidArgument(
                "the range must lie in the file", start=r.start, end=r.end, size=body.size
            )
        delta = len(r.data) - (r.end - r.start)
        if body.size + delta > MAX_FILE_SIZE:
            raise FileTooLarge("the edit makes the file too large")
        # The new bytes are charged; the volume's own bytes the edit removes are freed.
        freed = sum(
            min(e.start + e.length, r.end) - max(e.start, r.start)
            for e in overlapping(body.extents, r.start, r.end)
            if isinstance(e, PageSpan) or (isinstance(e, ChunkSpan) and e.epoch == self.root.epoch)
        )
        self.host.admit(self, len(r.data) - freed)
        # Every check has passed.  Content after the edit moves by `delta`, which
        # page spans (page-aligned by invariant) cannot: the file is sealed first.
        extents, _new, _shared, _bytes = self._sealed(body)
        left = [piece for e in overlapping(extents, 0, r.start) if (piece := trim(e, 0, r.start))]
        right = [
            dataclasses.replace(piece, start=piece.start + delta)
            for e in overlapping(extents, r.end, body.size)
            if (piece := trim(e, r.end, body.size))
        ]
        middle, _new, _shared = self._chunks_of(r.data, r.start)
        body = dataclasses.replace(
            body,
            size=body.size + delta,
            extents=(*left, *middle, *right),
            origin=self._recorded(body, r.start, r.end, len(r.data)),
        )
        txn.put(dataclasses.replace(inode, body=body, mtime_ns=r.time_ns, ctime_ns=r.time_ns))
        return len(r.data)

    def _snapshot(self, r: TakeSnapshot) -> Snapshot:
        if not isinstance(r.snapshot_id, str) or not r.snapshot_id:
            raise InvalidArgument("a snapshot needs an id")
        self._seal()
        root = self.root
        inodes, base_ids, referenced = root.inodes, root.base_identities, root.referenced_bytes
        for ino in self._handles:
            inode = inodes.get(ino)
            if inode is not None and inode.nlink == 0:
                # Open but unlinked: not part of the tree the snapshot names.
                inodes = inodes.delete(ino)
                referenced -= _referenced(inode)
                body = inode.body
                if isinstance(body, FileBody) and body.fingerprint is not None:
                    identity = (body.fingerprint.device, body.fingerprint.inode)
                    if base_ids.get(identity) == ino:
                        base_ids = base_ids.delete(identity)
        frozen = dataclasses.replace(
            root, inodes=inodes, base_identities=base_ids, referenced_bytes=referenced
        )
        snapshot = Snapshot(r.snapshot_id, frozen, self.base)
        # What was created so far now belongs to the snapshot.
        self.host.hand_over_metadata(self.metadata_bytes)
        self.metadata_bytes = 0
        self._own_mark = root.next_ino
        self._own_numbers.clear()
        self.unique_bytes = 0
        self.root = dataclasses.replace(root, epoch=root.epoch + 1)
        return snapshot

    # -- queries --------------------------------------------------------------

    def _inode(self, ino: int) -> Inode:
        inode = self.root.inodes.get(ino)
        if inode is None:
            raise NotFound("no such inode", ino=ino)
        return inode

    def _dir_body(self, ino: int) -> DirBody:
        body = self._inode(ino).body
        if not isinstance(body, DirBody):
            raise NotADirectory("not a directory", ino=ino)
        return body

    def _attr(self, inode: Inode) -> Attr:
        body = inode.body
        size = blocks = rdev = 0
        nlink = inode.nlink
        if isinstance(body, FileBody):
            size = body.size
            blocks = -(-allocated_length(body.extents, body.size) // 512)
        elif isinstance(body, SymlinkBody):
            size = len(body.target.encode("utf-8", "surrogateescape"))
        elif isinstance(body, DeviceBody):
            rdev = body.rdev
        elif body.base_path is not None and nlink:
            nlink = 1  # merges a base directory: subdirectory count unknown (find(1) convention)
        return Attr(
            inode.ino,
            inode.kind,
            inode.mode,
            nlink,
            inode.uid,
            inode.gid,
            size,
            blocks,
            inode.atime_ns,
            inode.mtime_ns,
            inode.ctime_ns,
            rdev,
            inode.st_ino or PRIVATE_ST_INO | inode.ino,
        )

    def getattr(self, ino: int) -> Attr:
        return self._attr(self._inode(ino))

    def lookup(self, parent: int, name: str) -> Attr:
        """The inode `name` names in `parent`, binding a base entry on first sight."""
        return self.getattr(self._lookup_ino(parent, name))

    def _lookup_ino(self, parent: int, name: str) -> int:
        _check_name(name)
        body = self._dir_body(parent)
        key = self._key(name)
        entry = body.entries.get(key)
        if entry is not None:
            return entry.ino
        found = self._base_entry(body, name, key)
        if found is None:
            raise NotFound("no such file or directory", name=name)
        ino = self.apply(BindBase(parent, posixpath.basename(found.path), found))
        assert isinstance(ino, int)
        return ino

    def _base_entry(self, body: DirBody, name: str, key: str) -> BaseEntry | None:
        if self.base is None or body.base_path is None or key in body.whiteouts:
            return None
        found = self.base.stat(posixpath.join(body.base_path, name))
        if found is None and self.root.case_insensitive:
            for base_name, _kind in self.base.list(body.base_path):
                if base_name.casefold() == key:
                    return self.base.stat(posixpath.join(body.base_path, base_name))
        return found

    def readdir(self, ino: int) -> list[DirItem]:
        """The directory's visible names: private entries, then unhidden base names; sorted."""
        body = self._dir_body(ino)
        items = {
            key: DirItem(entry.name, self._inode(entry.ino).kind, entry.ino)
            for key, entry in body.entries.items()
        }
        if self.base is not None and body.base_path is not None:
            for name, kind in self.base.list(body.base_path):
                key = self._key(name)
                if key not in items and key not in body.whiteouts:
                    items[key] = DirItem(name, kind, 0)
        return sorted(items.values(), key=lambda item: item.name)

    def read(self, ino: int, offset: int, size: int) -> bytes:
        inode = self._inode(ino)
        if isinstance(inode.body, DirBody):
            raise IsADirectory("is a directory", ino=ino)
        if not isinstance(inode.body, FileBody):
            raise InvalidArgument("not a regular file", ino=ino)
        _check_count(offset, "offset")
        _check_count(size, "size")
        end = min(offset + size, inode.body.size)
        if offset >= end:
            return b""
        return self._read_extents(inode, offset, end)

    def parent_of(self, ino: int) -> int:
        return self._dir_body(ino).parent

    def held_inodes(self) -> list[int]:
        """Inodes that open handles or kernel lookups still hold."""
        return sorted(self._handles)

    def seek(self, ino: int, offset: int, whence: str) -> int:
        """SEEK_DATA ("data") or SEEK_HOLE ("hole") from `offset`."""
        inode = self._inode(ino)
        body = inode.body
        if not isinstance(body, FileBody):
            raise InvalidArgument("not a regular file", ino=ino)
        _check_count(offset, "offset")
        if offset >= body.size:
            raise NoSuchOffset("offset at or beyond the end of the file", offset=offset)
        cursor = offset
        for extent in overlapping(body.extents, offset, body.size):
            if whence == "data":
                return max(offset, extent.start)
            if extent.start > cursor:
                return cursor  # a gap before this extent
            cursor = extent.start + extent.length
        if whence == "data":
            raise NoSuchOffset("no data after the offset", offset=offset)
        if whence != "hole":
            raise InvalidArgument("whence is data or hole", whence=whence)
        return min(max(cursor, offset), body.size)

    def base_content(self, ino: int) -> tuple[str, Fingerprint] | None:
        """(base path, pinned fingerprint) when every byte of `ino` is its base file's, unchanged.

        That is a regular file of a volume with a base whose extents are one
        base span over the whole pinned size (no private pages, chunks or
        holes, not truncated or extended); anything else is None.  Such a
        file's `read` is exactly a read of the base file checked against the
        fingerprint, which is what lets a mount bridge serve it itself.
        """
        inode = self.root.inodes.get(ino)
        if self.base is None or inode is None or not isinstance(inode.body, FileBody):
            return None
        body = inode.body
        if body.base_path is None or body.fingerprint is None or body.size == 0:
            return None
        if body.size != body.fingerprint.size or body.extents != (BaseSpan(0, body.size, 0),):
            return None
        return body.base_path, body.fingerprint

    def dir_info(self, ino: int) -> DirInfo:
        body = self._dir_body(ino)
        return DirInfo(body.base_path, tuple(sorted(body.whiteouts)))

    def readlink(self, ino: int) -> str:
        body = self._inode(ino).body
        if not isinstance(body, SymlinkBody):
            raise InvalidArgument("not a symbolic link", ino=ino)
        return body.target

    def getxattr(self, ino: int, name: str) -> bytes:
        value = self._inode(ino).xattrs.get(name)
        if value is None:
            raise NoSuchAttribute("no such attribute", name=name)
        return value

    def listxattr(self, ino: int) -> list[str]:
        return sorted(self._inode(ino).xattrs.keys())

    def handles(self, ino: int) -> int:
        return self._handles.get(ino, 0)

    def resolve(self, path: str) -> int:
        """The inode at an absolute path (symlinks are not followed)."""
        if not path.startswith("/"):
            raise InvalidArgument("paths are absolute", path=path)
        ino = ROOT_INO
        for part in path.split("/"):
            if part:
                ino = self._lookup_ino(ino, part)
        return ino

    # -- operation methods: settle names against the base, then apply ---------

    def _require_absent(self, parent: int, name: str) -> None:
        try:
            self._lookup_ino(parent, name)
        except NotFound:
            return
        raise AlreadyExists("file exists", name=name)

    def _require_empty(self, ino: int) -> None:
        if self.readdir(ino):
            raise DirectoryNotEmpty("directory not empty", ino=ino)

    def create(
        self,
        parent: int,
        name: str,
        mode: int = 0o644,
        *,
        uid: int = 0,
        gid: int = 0,
        time_ns: int = 0,
        ino: int = 0,
    ) -> Attr:
        self._require_absent(parent, name)
        return self._attr_result(self.apply(Create(parent, name, mode, uid, gid, time_ns, ino)))

    def mkdir(
        self,
        parent: int,
        name: str,
        mode: int = 0o755,
        *,
        uid: int = 0,
        gid: int = 0,
        time_ns: int = 0,
        ino: int = 0,
    ) -> Attr:
        self._require_absent(parent, name)
        return self._attr_result(self.apply(Mkdir(parent, name, mode, uid, gid, time_ns, ino)))

    def symlink(
        self,
        parent: int,
        name: str,
        target: str,
        *,
        uid: int = 0,
        gid: int = 0,
        time_ns: int = 0,
        ino: int = 0,
    ) -> Attr:
        self._require_absent(parent, name)
        return self._attr_result(self.apply(Symlink(parent, name, target, uid, gid, time_ns, ino)))

    def mknod(
        self,
        parent: int,
        name: str,
        kind: Kind,
        mode: int = 0o644,
        rdev: int = 0,
        *,
        uid: int = 0,
        gid: int = 0,
        time_ns: int = 0,
        ino: int = 0,
    ) -> Attr:
        self._require_absent(parent, name)
        return self._attr_result(
            self.apply(Mknod(parent, name, kind, mode, rdev, uid, gid, time_ns, ino))
        )

    def link(self, ino: int, parent: int, name: str, *, time_ns: int = 0) -> Attr:
        self._require_absent(parent, name)
        return self._attr_result(self.apply(Link(ino, parent, name, time_ns)))

    def unlink(self, parent: int, name: str, *, time_ns: int = 0) -> None:
        self._lookup_ino(parent, name)
        self.apply(Unlink(parent, name, time_ns))

    def rmdir(self, parent: int, name: str, *, time_ns: int = 0) -> None:
        ino = self._lookup_ino(parent, name)
        if isinstance(self._inode(ino).body, DirBody):
            self._require_empty(ino)
        self.apply(Rmdir(parent, name, time_ns))

    def rename(
        self,
        parent: int,
        name: str,
        new_parent: int,
        new_name: str,
        flags: int = 0,
        *,
        time_ns: int = 0,
    ) -> None:
        moved = self._lookup_ino(parent, name)
        try:
            replaced = self._lookup_ino(new_parent, new_name)
        except NotFound:
            replaced = None
        if (
            replaced is not None
            and replaced != moved
            and not flags & RENAME_EXCHANGE
            and self._inode(moved).kind == Kind.DIR
            and isinstance(self._inode(replaced).body, DirBody)
            and not self._is_within(self.root.inodes, new_parent, moved)
        ):
            self._require_empty(replaced)  # the record checks cycles itself (EINVAL first)
        self.apply(Rename(parent, name, new_parent, new_name, flags, time_ns))

    def is_private(self, ino: int, start: int, end: int) -> bool:
        """Whether the file's bytes in [start, end) all lie on this volume's private pages:
        where a write records only the bytes it changes (`write`)."""
        body = self._inode(ino).body
        return isinstance(body, FileBody) and not uncovered(body.extents, start, end)

    def reads_base(self, ino: int, most_extents: int) -> bool:
        """Whether any of the file's bytes may still be read from the base (a write next
        to them would read its edge pages there, and could meet BaseDrift): true when
        one of its extents is, and, unlooked at, when it has more than `most_extents`."""
        body = self._inode(ino).body
        if not isinstance(body, FileBody):
            return False
        extents = body.extents
        return len(extents) > most_extents or any(isinstance(e, BaseSpan) for e in extents)

    def write(self, ino: int, offset: int, data: bytes, *, time_ns: int = 0) -> int:
        """Write, reading the partial edge pages first (this may read the base).

        The record carries the bytes that change, not the pages around them:
        where the write lands on private pages, leading and trailing bytes
        equal to what the file holds are left out (a writeback mount sends
        whole pages for a 100-byte change), and an edge page that is already
        private is not copied into the record.
        """
        _check_count(offset, "offset")
        self.read(ino, 0, 0)  # refuses non-files before any base read
        body = self._inode(ino).body
        extents = body.extents if isinstance(body, FileBody) else ()
        size = body.size if isinstance(body, FileBody) else 0
        length = len(data)
        overlap_end = min(offset + length, size)
        if offset < overlap_end and self.is_private(ino, offset, overlap_end):
            current = self.read(ino, offset, overlap_end - offset)
            lo, hi = _changed_span(current, data)
            offset, data = offset + lo, data[lo:hi]
        end = offset + len(data)
        first, last = page_floor(offset), page_ceil(end)
        head = tail = b""
        # (An empty range is covered: an aligned edge needs no look at the extents.)
        if data and first < offset and uncovered(extents, first, offset):
            head = self.read(ino, first, offset - first)
        if data and end < last and uncovered(extents, end, last):
            tail = self.read(ino, end, last - end)
        self.apply(Write(ino, offset, bytes(data), time_ns, head, tail))
        return length

    def truncate(self, ino: int, size: int, *, time_ns: int = 0) -> None:
        self.apply(Truncate(ino, size, time_ns))

    def splice(self, ino: int, start: int, end: int, data: bytes, *, time_ns: int = 0) -> int:
        """Replace [start, end) with `data`, moving what follows (insert, delete, replace)."""
        result = self.apply(Splice(ino, start, end, bytes(data), time_ns))
        assert isinstance(result, int)
        return result

    def punch_hole(self, ino: int, offset: int, length: int, *, time_ns: int = 0) -> None:
        """Make [offset, offset+length) read as zeros; whole pages stop being stored."""
        _check_count(offset, "offset")
        _check_count(length, "length")
        size = self.getattr(ino).size
        end = min(offset + length, size)
        if offset >= end:
            return
        first, last = page_ceil(offset), page_floor(end)
        if first >= last:
            self.write(ino, offset, bytes(end - offset), time_ns=time_ns)
            return
        if offset < first:
            self.write(ino, offset, bytes(first - offset), time_ns=time_ns)
        if last < end:
            self.write(ino, last, bytes(end - last), time_ns=time_ns)
        self.apply(PunchHole(ino, first, last - first, time_ns))

    def copy_range(
        self, src: int, src_offset: int, dst: int, dst_offset: int, length: int, *, time_ns: int = 0
    ) -> int:
        """copy_file_range: whole sealed pages are shared, not copied; the rest is copied."""
        for value in (src_offset, dst_offset, length):
            _check_count(value, "range")
        self.read(dst, 0, 0)  # both must be regular files
        size = self.getattr(src).size
        length = min(length, max(0, size - src_offset))
        if (
            src == dst
            and length
            and src_offset < dst_offset + length
            and (dst_offset < src_offset + length)
        ):
            raise InvalidArgument("source and destination ranges overlap")
        shareable = length // PAGE * PAGE if src_offset % PAGE == dst_offset % PAGE == 0 else 0
        source = self._inode(src).body
        assert isinstance(source, FileBody)
        if shareable and any(
            isinstance(e, BaseSpan)
            for e in overlapping(source.extents, src_offset, src_offset + shareable)
        ):
            shareable = 0  # base content is read through, not stored: copy it
        if shareable:
            if any(
                isinstance(e, PageSpan)
                for e in overlapping(source.extents, src_offset, src_offset + shareable)
            ):
                self.seal()
            self.apply(ShareRange(src, src_offset, dst, dst_offset, shareable, time_ns))
        done = shareable
        while done < length:
            piece = self.read(src, src_offset + done, min(1 << 20, length - done))
            self.write(dst, dst_offset + done, piece, time_ns=time_ns)
            done += len(piece)
        return done

    def setattr(
        self,
        ino: int,
        *,
        time_ns: int = 0,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        st_ino: int | None = None,
    ) -> Attr:
        return self._attr_result(
            self.apply(SetAttr(ino, time_ns, mode, uid, gid, atime_ns, mtime_ns, st_ino))
        )

    def setxattr(
        self, ino: int, name: str, value: bytes, flags: int = 0, *, time_ns: int = 0
    ) -> None:
        self.apply(SetXattr(ino, name, bytes(value), flags, time_ns))

    def removexattr(self, ino: int, name: str, *, time_ns: int = 0) -> None:
        self.apply(RemoveXattr(ino, name, time_ns))

    def retain(self, ino: int, count: int = 1) -> None:
        self.apply(Retain(ino, count))

    def forget(self, ino: int, count: int = 1) -> None:
        self.apply(Forget(ino, count))

    def seal(self) -> SealReport:
        report = self.apply(Seal())
        assert isinstance(report, SealReport)
        return report

    def snapshot(self, snapshot_id: str) -> Snapshot:
        snapshot = self.apply(TakeSnapshot(snapshot_id))
        assert isinstance(snapshot, Snapshot)
        return snapshot

    @staticmethod
    def _attr_result(result: object) -> Attr:
        assert isinstance(result, Attr)
        return result
