"""From volumes to changes and back: what a work volume changed, and applying changes.

Theory of operation (DESIGN.md section 5).  A work volume is a clone of a
green version, so its inode map shares every untouched inode object with
that version's root.  `diff` finds the changed inodes by identity (one
pass of pointer comparisons, no content read), compares the entries of the
changed directories to find adds, moves, links and removes, and reads each
changed file's byte ranges off its recorded origin (slates.core.origin):
only the bytes of the changed ranges are read, never a whole file unless
the whole file is what changed.

`apply` performs changes on a volume (a fresh clone of the head) through
the volume's ordinary operations, so they are journaled records like any
other, and returns them as an increment in the volume's own numbers.  A new
object keeps the number its author gave it (its key is minus that number):
work volumes number in ranges of their own, so numbers never collide, and
a mount keeps every inode number it holds when its volume moves onto the
version it made.
Order matters for names: removals and moves out of the way first, new
directories parent-first, then moves into place, new files and links,
and finally content and attributes.

Pure except for the volume and read callback it is handed; called by
slates.node.service.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import immutables

from slates.core.origin import edit_spans
from slates.core.records import Kind
from slates.core.volume import (
    ROOT_INO,
    DeviceBody,
    DirBody,
    Entry,
    FileBody,
    Inode,
    Root,
    SymlinkBody,
    Volume,
)
from slates.errors import InvalidArgument, NotFound, NotSupported
from slates.merge.changes import Add, Change, Conflict, Edit, Link, Meta, Move, Remove
from slates.merge.ranges import Replace

__all__ = [
    "diff",
    "apply",
    "changed_since",
    "changed_entries",
    "path_index",
    "Reader",
    "ApplyConflict",
]

Reader = Callable[[int, int, int], bytes]  # (ino, offset, size) -> bytes of the work volume
_NO_ENTRIES: immutables.Map[str, Entry] = immutables.Map()
_TEMP_PREFIX = ".slates-merge-"


class ApplyConflict(Exception):
    """A conflict found only on the head: a move making a cycle, or an object that
    separate versions removed name by name (each left the other link) changed."""

    def __init__(self, conflict: Conflict) -> None:
        super().__init__(conflict.path)
        self.conflict = conflict


def changed_since(earlier: Root, later: Root) -> bool:
    """Whether `later` (the same volume, afterwards) differs in any linked inode."""
    for ino, inode in later.inodes.items():
        if earlier.inodes.get(ino) is not inode and inode.nlink > 0:
            return True
    return any(ino not in later.inodes for ino in earlier.inodes)


def changed_entries(earlier: Root, later: Root) -> list[list[object]]:
    """What a kernel caching `earlier` must forget to see `later` (one pass of pointer
    comparisons): ["file", ino] for every regular file that differs (its size may have
    changed: slates.node.shard.invalidations), ["inode", ino] for every other inode that
    differs, ["entry", dir, name] for every directory entry that differs."""
    notes: list[list[object]] = []
    changed = [ino for ino, inode in later.inodes.items() if earlier.inodes.get(ino) is not inode]
    changed += [ino for ino in earlier.inodes if ino not in later.inodes]
    for ino in changed:
        was_inode, now_inode = earlier.inodes.get(ino), later.inodes.get(ino)
        is_file = any(
            inode is not None and isinstance(inode.body, FileBody)
            for inode in (was_inode, now_inode)
        )
        notes.append(["file" if is_file else "inode", ino])
        old, new = _entries(was_inode), _entries(now_inode)
        if old is new:
            continue
        for key in set(old.keys()) | set(new.keys()):
            was, now = old.get(key), new.get(key)
            if was != now:
                notes.append(["entry", ino, (was or now).name])  # type: ignore[union-attr]
    return notes


def path_index(root: Root) -> dict[int, str]:
    """Every linked object's path (the first one found for hard links)."""
    paths = {ROOT_INO: "/"}
    stack = [ROOT_INO]
    while stack:
        ino = stack.pop()
        body = root.inodes[ino].body
        if not isinstance(body, DirBody):
            continue
        prefix = paths[ino].rstrip("/")
        for entry in body.entries.values():
            if entry.ino not in paths:
                paths[entry.ino] = f"{prefix}/{entry.name}"
                stack.append(entry.ino)
    return paths


class _Paths:
    """Paths of directory entries in one root, found through directories' parent links."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.dirs: dict[int, str] = {ROOT_INO: ""}

    def of_dir(self, ino: int) -> str:
        found = self.dirs.get(ino)
        if found is not None:
            return found
        body = self.root.inodes[ino].body
        if not isinstance(body, DirBody):
            raise InvalidArgument("not a directory", ino=ino)
        parent = self.root.inodes[body.parent].body
        assert isinstance(parent, DirBody)
        name = next((e.name for e in parent.entries.values() if e.ino == ino), f"#{ino}")
        path = f"{self.of_dir(body.parent)}/{name}"
        self.dirs[ino] = path
        return path

    def of(self, parent: int, name: str) -> str:
        return f"{self.of_dir(parent)}/{name}"


def _entries(inode: Inode | None) -> immutables.Map[str, Entry]:
    if inode is None or not isinstance(inode.body, DirBody) or inode.nlink == 0:
        return _NO_ENTRIES
    return inode.body.entries


def _content(inode: Inode, read: Reader) -> bytes:
    body = inode.body
    if isinstance(body, FileBody):
        return read(inode.ino, 0, body.size)
    if isinstance(body, SymlinkBody):
        return body.target.encode("utf-8", "surrogateescape")
    if isinstance(body, DeviceBody) and body.rdev:
        raise NotSupported("devices cannot be submitted", ino=inode.ino)
    return b""


def _xattr_changes(old: Inode, new: Inode) -> tuple[tuple[str, bytes | None], ...]:
    changes: list[tuple[str, bytes | None]] = []
    for name, value in sorted(new.xattrs.items()):
        if old.xattrs.get(name) != value:
            changes.append((name, value))
    changes += [(name, None) for name in sorted(old.xattrs.keys()) if name not in new.xattrs]
    return tuple(changes)


def diff(
    base: Root, work: Root, read: Reader, base_path: Callable[[int], str]
) -> tuple[Change, ...]:
    """The changes that take `base` (a green version) to `work` (a clone of it)."""
    changed = [ino for ino, inode in work.inodes.items() if base.inodes.get(ino) is not inode]
    changed += [ino for ino in base.inodes if ino not in work.inodes]
    removed_at: dict[int, list[tuple[int, str]]] = {}
    added_at: dict[int, list[tuple[int, str]]] = {}
    for ino in changed:
        old, new = _entries(base.inodes.get(ino)), _entries(work.inodes.get(ino))
        for key in set(old.keys()) | set(new.keys()):
            was, now = old.get(key), new.get(key)
            if was is not None and (now is None or now.ino != was.ino):
                removed_at.setdefault(was.ino, []).append((ino, was.name))
            if now is not None and (was is None or now.ino != was.ino):
                added_at.setdefault(now.ino, []).append((ino, now.name))

    def ref(ino: int) -> int:
        return ino if ino in base.inodes else -ino

    base_paths, work_paths = _Paths(base), _Paths(work)
    moved_to: dict[int, str] = {}
    adds: list[Add] = []
    names: list[Change] = []
    for ino in sorted(set(removed_at) | set(added_at)):
        gone = removed_at.get(ino, [])
        came = added_at.get(ino, [])
        if ino not in base.inodes:
            inode = work.inodes[ino]
            (parent, name), *others = came
            adds.append(
                Add(
                    -ino,
                    ref(parent),
                    name,
                    work_paths.of(parent, name),
                    inode.kind,
                    inode.mode & 0o7777,
                    _content(inode, read),
                    tuple(sorted(inode.xattrs.items())),
                )
            )
            names += [Link(-ino, ref(p), n, work_paths.of(p, n)) for p, n in others]
            continue
        kind = base.inodes[ino].kind
        for (p, n), (q, m) in zip(gone, came, strict=False):
            to_path = work_paths.of(q, m)
            moved_to[ino] = to_path
            names.append(Move(ino, p, n, base_paths.of(p, n), ref(q), m, to_path))
        names += [Link(ino, ref(q), m, work_paths.of(q, m)) for q, m in came[len(gone) :]]
        still = work.inodes.get(ino)
        last = still is None or still.nlink == 0
        names += [Remove(ino, p, n, base_paths.of(p, n), kind, last) for p, n in gone[len(came) :]]
    adds.sort(key=lambda add: add.path.count("/"))

    contents: list[Change] = []
    for ino in changed:
        old_inode, new_inode = base.inodes.get(ino), work.inodes.get(ino)
        if old_inode is None or new_inode is None or new_inode.nlink == 0:
            continue
        path = moved_to.get(ino) or base_path(ino)
        old_body, new_body = old_inode.body, new_inode.body
        if isinstance(old_body, FileBody) and isinstance(new_body, FileBody):
            origin = new_body.origin
            if origin is not None and origin[0] == work.record_gen:
                edits = tuple(
                    Replace(start, end, read(ino, at, length))
                    for start, end, at, length in edit_spans(origin[1], old_body.size)
                )
                if edits:
                    contents.append(Edit(ino, path, edits))
        mode = new_inode.mode & 0o7777
        xattrs = _xattr_changes(old_inode, new_inode)
        owner = (new_inode.uid, new_inode.gid)
        owner_changed = owner != (old_inode.uid, old_inode.gid)
        if mode != old_inode.mode & 0o7777 or xattrs or owner_changed:
            contents.append(
                Meta(
                    ino,
                    path,
                    None if mode == old_inode.mode & 0o7777 else mode,
                    xattrs,
                    owner if owner_changed else None,
                )
            )
    return (*names, *adds, *contents)


def _staging_names(volume: Volume, count: int) -> list[str]:
    """Names in the root for moves in flight: one per move (two links of one file
    may both move), none of them taken by a file of the volume."""
    names: list[str] = []
    number = 0
    while len(names) < count:
        name = f"{_TEMP_PREFIX}{number}"
        number += 1
        try:
            volume.lookup(ROOT_INO, name)
        except NotFound:
            names.append(name)
    return names


def apply(
    volume: Volume,
    changes: Iterable[Change],
    time_ns: int,
    times: Callable[[int], tuple[int, int] | None] | None = None,
) -> tuple[Change, ...]:
    """Perform `changes` on `volume`; returns them in the volume's own inode numbers.

    `times(ino)` gives (atime, mtime) for an object whose times are kept (a work
    volume's private build outputs when it moves onto a new version, so make's
    view of them stays true); everything else is stamped `time_ns`.  Raises
    (and the caller discards the volume) if any step fails: a refused quota, or
    ApplyConflict for what only the head can show.
    """
    changes = list(changes)
    created: dict[int, int] = {}

    def real(ref: int) -> int:
        # A new object made by an earlier apply (a work volume's public changes
        # accepted before its private ones are put back) kept its author's number.
        return created.get(ref, -ref) if ref < 0 else ref

    def require(ino: int, path: str, kind: str) -> None:
        inode = volume.root.inodes.get(ino)
        if inode is None or inode.nlink == 0:
            raise ApplyConflict(Conflict(path=path, kind=kind, ino=ino))

    removes = [c for c in changes if isinstance(c, Remove)]
    moves = [c for c in changes if isinstance(c, Move)]
    adds = [c for c in changes if isinstance(c, Add)]
    for removal in removes:
        if removal.kind != Kind.DIR:
            with contextlib.suppress(NotFound):  # that name is gone already
                volume.unlink(removal.parent, removal.name, time_ns=time_ns)
    staged = _staging_names(volume, len(moves))
    for move, temp in zip(moves, staged, strict=True):  # out of the way: moves may swap names
        try:
            volume.rename(move.parent, move.name, ROOT_INO, temp, time_ns=time_ns)
        except NotFound:
            raise ApplyConflict(
                Conflict(path=move.path, kind="rename vs delete", ino=move.ino)
            ) from None
    for removal in sorted(
        (c for c in removes if c.kind == Kind.DIR), key=lambda c: -c.path.count("/")
    ):
        volume.rmdir(removal.parent, removal.name, time_ns=time_ns)
    applied: list[Change] = []
    for add in adds:
        if add.kind == Kind.DIR:
            attr = volume.mkdir(real(add.parent), add.name, add.mode, time_ns=time_ns, ino=-add.key)
            created[add.key] = attr.ino
    for move, temp in zip(moves, staged, strict=True):
        try:
            volume.rename(
                ROOT_INO,
                temp,
                real(move.to_parent),
                move.to_name,
                time_ns=time_ns,
            )
        except InvalidArgument as exc:
            if volume.getattr(move.ino).kind != Kind.DIR:
                raise
            # Another version moved the destination inside this directory: the two
            # moves together would make a cycle.
            raise ApplyConflict(
                Conflict(path=move.path, kind="rename vs rename", ino=move.ino)
            ) from exc
        applied.append(dataclasses.replace(move, to_parent=real(move.to_parent)))
    for add in adds:
        parent = real(add.parent)
        match add.kind:
            case Kind.DIR:
                pass
            case Kind.FILE:
                ino = volume.create(parent, add.name, add.mode, time_ns=time_ns, ino=-add.key).ino
                if add.data:
                    volume.write(ino, 0, add.data, time_ns=time_ns)
                created[add.key] = ino
            case Kind.SYMLINK:
                target = add.data.decode("utf-8", "surrogateescape")
                created[add.key] = volume.symlink(
                    parent, add.name, target, time_ns=time_ns, ino=-add.key
                ).ino
            case _:
                created[add.key] = volume.mknod(
                    parent, add.name, add.kind, add.mode, time_ns=time_ns, ino=-add.key
                ).ino
        for name, value in add.xattrs:
            volume.setxattr(created[add.key], name, value, time_ns=time_ns)
        applied.append(dataclasses.replace(add, key=created[add.key], parent=parent))
    for change in changes:
        match change:
            case Link():
                if change.ino > 0:
                    require(change.ino, change.path, "modify vs delete")
                volume.link(real(change.ino), real(change.parent), change.name, time_ns=time_ns)
                applied.append(
                    dataclasses.replace(change, ino=real(change.ino), parent=real(change.parent))
                )
            case Edit():
                require(change.ino, change.path, "modify vs delete")
                for edit in reversed(change.edits):  # later offsets first: earlier ones stay put
                    volume.splice(change.ino, edit.start, edit.end, edit.data, time_ns=time_ns)
                applied.append(change)
            case Meta():
                require(change.ino, change.path, "modify vs delete")
                if change.mode is not None:
                    volume.setattr(change.ino, mode=change.mode, time_ns=time_ns)
                if change.owner is not None:
                    uid, gid = change.owner
                    volume.setattr(change.ino, uid=uid, gid=gid, time_ns=time_ns)
                for xattr, setting in change.xattrs:
                    if setting is None:
                        volume.removexattr(change.ino, xattr, time_ns=time_ns)
                    else:
                        volume.setxattr(change.ino, xattr, setting, time_ns=time_ns)
                applied.append(change)
            case Remove():
                applied.append(change)
    if times is not None:
        for change in applied:
            ino = change.key if isinstance(change, Add) else change.ino
            kept = times(ino) if isinstance(change, Add | Edit | Meta) else None
            if kept is not None:
                volume.setattr(ino, atime_ns=kept[0], mtime_ns=kept[1], time_ns=time_ns)
    return tuple(applied)
