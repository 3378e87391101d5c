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

Called by the CLI and SDK for `volume create --capture`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Sequence

from slates.base.beneath import Anchored
from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.core.records import BaseEntry, Kind
from slates.core.volume import ROOT_INO, Capacity, Snapshot, Volume
from slates.errors import BaseDrift, ConsistentBaseUnavailable, InvalidArgument

__all__ = ["capture", "capture_into", "READ_SIZE"]

READ_SIZE = 1 << 20


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
    if volume.base is not None or volume.readdir(ROOT_INO):
        raise InvalidArgument("capture needs an empty volume without a base")
    live = LiveDirectory(source, protected=protected)
    try:
        return _capture(live, volume, snapshot_id)
    finally:
        if not isinstance(source, Anchored):
            live.close()


def _capture(live: LiveDirectory, volume: Volume, snapshot_id: str) -> Snapshot:
    source = live.root
    top = live.stat("/")
    if top is None:
        raise ConsistentBaseUnavailable("the source vanished", path=source)
    volume.setattr(
        ROOT_INO,
        time_ns=top.ctime_ns,
        mode=top.mode,
        uid=top.uid,
        gid=top.gid,
        st_ino=top.fingerprint.inode,
    )
    first: dict[str, tuple[object, ...]] = {"/": _observed(top)}
    inos: dict[str, int] = {"/": ROOT_INO}
    linked: dict[tuple[int, int], int] = {}
    dirs: list[BaseEntry] = [top]
    for entry in _walk(live, "/"):
        first[entry.path] = _observed(entry)
        parent = inos[posixpath.dirname(entry.path)]
        name = posixpath.basename(entry.path)
        identity = (entry.fingerprint.device, entry.fingerprint.inode)
        if entry.kind == Kind.FILE and identity in linked:
            volume.link(linked[identity], parent, name, time_ns=entry.ctime_ns)
            continue
        match entry.kind:
            case Kind.DIR:
                attr = volume.mkdir(parent, name, entry.mode, uid=entry.uid, gid=entry.gid)
                dirs.append(entry)
            case Kind.FILE:
                attr = volume.create(parent, name, entry.mode, uid=entry.uid, gid=entry.gid)
                _copy_file(live, volume, entry, attr.ino)
                linked[identity] = attr.ino
            case Kind.SYMLINK:
                attr = volume.symlink(parent, name, entry.target, uid=entry.uid, gid=entry.gid)
            case _:
                attr = volume.mknod(
                    parent, name, entry.kind, entry.mode, entry.rdev, uid=entry.uid, gid=entry.gid
                )
        inos[entry.path] = attr.ino
        volume.setattr(
            attr.ino,
            time_ns=entry.ctime_ns,
            atime_ns=entry.atime_ns,
            mtime_ns=entry.mtime_ns,
            st_ino=entry.fingerprint.inode,
        )
    for entry in reversed(dirs):  # children changed their parents' times
        volume.setattr(
            inos[entry.path],
            time_ns=entry.ctime_ns,
            atime_ns=entry.atime_ns,
            mtime_ns=entry.mtime_ns,
        )
    top_again = live.stat("/")
    second = {"/": _observed(top_again)} if top_again else {}
    second.update((entry.path, _observed(entry)) for entry in _walk(live, "/"))
    if second != first:
        changed = sorted(p for p in first.keys() | second.keys() if first.get(p) != second.get(p))
        raise ConsistentBaseUnavailable(
            "the source changed during the capture; stop its writers or capture an immutable view",
            path=source,
            changed=changed[:20],
        )
    return volume.snapshot(snapshot_id)


def _copy_file(live: LiveDirectory, volume: Volume, entry: BaseEntry, ino: int) -> None:
    try:
        for offset in range(0, entry.size, READ_SIZE):
            data = live.read(
                entry.path, entry.fingerprint, offset, min(READ_SIZE, entry.size - offset)
            )
            volume.write(ino, offset, data)
    except BaseDrift as exc:
        raise ConsistentBaseUnavailable(
            "a file changed while it was read", path=entry.path
        ) from exc
