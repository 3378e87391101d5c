"""Capture: read every byte of a live directory into a snapshot, or refuse.

Theory of operation: a captured base is pinned content, so a volume over it
never drifts.  Capture builds a fresh base-less volume by applying ordinary
records (mkdir, create, write, symlink, mknod, link, setattr), seals it and
takes a snapshot.  It cannot stop other writers, so it checks: each file's
fingerprint must hold while its bytes are read, and after the whole tree is
read a second walk must find every entry exactly as first observed
(including ctime, which no writer can set back) and no entry added or
removed.  Any difference raises ConsistentBaseUnavailable and nothing is
published.  What this cannot see is a change that was undone before the
second walk without touching ctime, which the kernel does not allow, or a
writer that keeps a file open and writes after the second walk: that
write belongs to a later version either way.

The source is opened once (slates.base.live.LiveDirectory over a
slates.base.beneath.Anchored directory): both walks and every read go
beneath that fd, so the capture reads the directory that was checked and
nothing a symlink swapped in later points at.

It comes in two halves so that a shard can read off its loop: a
`CaptureReader` does every read of the source (both walks and the bytes;
it runs in a worker thread) and hands over batches of `Step`s, bounded in
bytes; a `CaptureWriter` applies them to the volume (pure: records only)
and snapshots it.  `capture_into` runs the two in turn.

Called by slates.node.shard (a capture job, the reads in a worker thread),
and by tests and the demo through `capture`/`capture_into`.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterable, Iterator, Sequence

from slates.base.beneath import Anchored
from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.records import BaseEntry, Kind
from slates.core.volume import ROOT_INO, Capacity, Snapshot, Volume
from slates.errors import BaseDrift, ConsistentBaseUnavailable, InvalidArgument

__all__ = [
    "capture",
    "capture_into",
    "CaptureReader",
    "CaptureWriter",
    "Piece",
    "Step",
    "READ_SIZE",
    "BATCH_BYTES",
]

READ_SIZE = 1 << 20
BATCH_BYTES = 2 << 20  # bytes of file content handed over at a time (one step on the loop)
BATCH_ENTRIES = 512
MAX_ENTRIES = 4_000_000  # a walk's entries are held in memory until the second walk


def _observed(entry: BaseEntry) -> tuple[object, ...]:
    # atime is left out: reading a file during the capture changes it.
    return (
        entry.kind,
        entry.mode,
        entry.uid,
        entry.gid,
        entry.size,
        entry.mtime_ns,
        entry.ctime_ns,
        entry.fingerprint,
        entry.target,
    )


def _walk(live: LiveDirectory, path: str) -> Iterator[BaseEntry]:
    for name, _kind in sorted(live.list(path)):
        entry = live.stat(posixpath.join(path, name))
        if entry is None:
            raise ConsistentBaseUnavailable(
                "an entry vanished during the capture", path=posixpath.join(path, name)
            )
        yield entry
        if entry.kind == Kind.DIR:
            yield from _walk(live, entry.path)


def capture(
    source: str | Anchored,
    host: Host,
    *,
    snapshot_id: str,
    capacity: Capacity | None = None,
    case_insensitive: bool = False,
    protected: Sequence[str] = (),
) -> Snapshot:
    """Capture `source` into a snapshot held by `host`."""
    volume = Volume.new(host, capacity=capacity, case_insensitive=case_insensitive)
    try:
        return capture_into(source, volume, snapshot_id=snapshot_id, protected=protected)
    finally:
        volume.close()


def capture_into(
    source: str | Anchored, volume: Volume, *, snapshot_id: str, protected: Sequence[str] = ()
) -> Snapshot:
    """Fill an empty base-less volume with `source` through records, then snapshot it.

    `source`: a path (opened once here, refused if it reaches a `protected`
    directory or is on FUSE) or an Anchored directory the caller opened.
    """
    live = LiveDirectory(source, protected=protected)
    try:
        reader = CaptureReader(live)
        writer = CaptureWriter(volume, reader.top)
        for batch in reader.batches():
            writer.apply(batch)
        reader.verify()
        return writer.finish(snapshot_id)
    finally:
        if not isinstance(source, Anchored):
            live.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Bytes of a captured file at an offset (the file is the entry just before)."""

    path: str
    offset: int
    data: bytes


Step = BaseEntry | Piece


class CaptureReader:
    """Every read of the source: the first walk, the files' bytes, the second walk.

    Touches only the source directory (through its anchored fds), never a
    volume, so it may run in a worker thread while the shard serves others.
    """

    def __init__(self, live: LiveDirectory) -> None:
        self.live = live
        top = live.stat("/")
        if top is None:
            raise ConsistentBaseUnavailable("the source vanished", path=live.root)
        self.top = top
        self.first: dict[str, tuple[object, ...]] = {"/": _observed(top)}

    def batches(
        self, batch_bytes: int = BATCH_BYTES, batch_entries: int = BATCH_ENTRIES
    ) -> Iterator[list[Step]]:
        """The walk's entries in order, each file followed by its bytes, in batches of
        at most `batch_bytes` of content (or `batch_entries` entries)."""
        batch: list[Step] = []
        size = 0
        seen: set[tuple[int, int]] = set()
        for entry in _walk(self.live, "/"):
            if len(self.first) >= MAX_ENTRIES:
                raise InvalidArgument(
                    "the source has too many entries to capture", limit=MAX_ENTRIES
                )
            self.first[entry.path] = _observed(entry)
            batch.append(entry)
            identity = (entry.fingerprint.device, entry.fingerprint.inode)
            if entry.kind == Kind.FILE and identity not in seen:  # a hard link's bytes: once
                seen.add(identity)
                for piece in self._pieces(entry):
                    batch.append(piece)
                    size += len(piece.data)
                    if size >= batch_bytes:
                        yield batch
                        batch, size = [], 0
            if len(batch) >= batch_entries:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _pieces(self, entry: BaseEntry) -> Iterator[Piece]:
        try:
            for offset in range(0, entry.size, READ_SIZE):
                size = min(READ_SIZE, entry.size - offset)
                yield Piece(
                    entry.path, offset, self.live.read(entry.path, entry.fingerprint, offset, size)
                )
        except BaseDrift as exc:
            raise ConsistentBaseUnavailable(
                "a file changed while it was read", path=entry.path
            ) from exc

    def verify(self) -> None:
        """The second walk: every entry exactly as first observed, none added or removed."""
        top_again = self.live.stat("/")
        second = {"/": _observed(top_again)} if top_again else {}
        second.update((entry.path, _observed(entry)) for entry in _walk(self.live, "/"))
        if second != self.first:
            first = self.first
            changed = sorted(
                p for p in first.keys() | second.keys() if first.get(p) != second.get(p)
            )
            raise ConsistentBaseUnavailable(
                "the source changed during the capture; "
                "stop its writers or capture an immutable view",
                path=self.live.root,
                changed=changed[:20],
            )


class CaptureWriter:
    """Applies a reader's steps to an empty base-less volume, then snapshots it (pure)."""

    def __init__(self, volume: Volume, top: BaseEntry) -> None:
        if volume.base is not None or volume.readdir(ROOT_INO):
            raise InvalidArgument("capture needs an empty volume without a base")
        self.volume = volume
        volume.setattr(
            ROOT_INO,
            time_ns=top.ctime_ns,
            mode=top.mode,
            uid=top.uid,
            gid=top.gid,
            st_ino=top.fingerprint.inode,
        )
        self.inos: dict[str, int] = {"/": ROOT_INO}
        self.linked: dict[tuple[int, int], int] = {}
        self.dirs: list[BaseEntry] = [top]
        self.file: tuple[BaseEntry, int] | None = None  # the file whose bytes come next

    def apply(self, steps: Iterable[Step]) -> None:
        for step in steps:
            if isinstance(step, Piece):
                if self.file is None or self.file[0].path != step.path:
                    raise InvalidArgument("file bytes out of order", path=step.path)
                self.volume.write(self.file[1], step.offset, step.data)
            else:
                self._close_file()
                self._entry(step)

    def _entry(self, entry: BaseEntry) -> None:
        volume = self.volume
        parent = self.inos[posixpath.dirname(entry.path)]
        name = posixpath.basename(entry.path)
        identity = (entry.fingerprint.device, entry.fingerprint.inode)
        if entry.kind == Kind.FILE and identity in self.linked:
            volume.link(self.linked[identity], parent, name, time_ns=entry.ctime_ns)
            return
        match entry.kind:
            case Kind.DIR:
                attr = volume.mkdir(parent, name, entry.mode, uid=entry.uid, gid=entry.gid)
                self.dirs.append(entry)
            case Kind.FILE:
                attr = volume.create(parent, name, entry.mode, uid=entry.uid, gid=entry.gid)
                self.linked[identity] = attr.ino
            case Kind.SYMLINK:
                attr = volume.symlink(parent, name, entry.target, uid=entry.uid, gid=entry.gid)
            case _:
                attr = volume.mknod(
                    parent, name, entry.kind, entry.mode, entry.rdev, uid=entry.uid, gid=entry.gid
                )
        self.inos[entry.path] = attr.ino
        if entry.kind == Kind.FILE:
            self.file = (entry, attr.ino)  # its times are set once its bytes are in
            return
        self._set_times(attr.ino, entry)

    def _close_file(self) -> None:
        if self.file is not None:
            entry, ino = self.file
            self.file = None
            self._set_times(ino, entry)

    def _set_times(self, ino: int, entry: BaseEntry) -> None:
        self.volume.setattr(
            ino,
            time_ns=entry.ctime_ns,
            atime_ns=entry.atime_ns,
            mtime_ns=entry.mtime_ns,
            st_ino=entry.fingerprint.inode,
        )

    def finish(self, snapshot_id: str) -> Snapshot:
        self._close_file()
        for entry in reversed(self.dirs):  # children changed their parents' times
            self.volume.setattr(
                self.inos[entry.path],
                time_ns=entry.ctime_ns,
                atime_ns=entry.atime_ns,
                mtime_ns=entry.mtime_ns,
            )
        return self.volume.snapshot(snapshot_id)
