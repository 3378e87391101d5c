"""A submission's changes, and checking them against accepted increments.

Theory of operation (DESIGN.md section 5).  A submission is a tuple of
change records, one per operation that remains relative to the version it
started from.  Existing objects are named by their inode number, which is
the same in every version of one green volume (numbers are never reused);
objects the submission creates are named by a negative key, so a change
can say "inside the directory I also created".  Locations are (parent,
name) pairs, which stay valid when an ancestor directory is renamed.
Paths travel along only to be reported.

`map_through(changes, accepted)` checks a submission against one accepted
increment (both relative to the same version) and returns the changes in
the coordinates of the version after it, or the conflicts.  Mapping across
several versions is repeated mapping; a change identical to an accepted
one is already there and maps to nothing.  Conflict kinds:

    overlap, insertion point deleted        byte ranges (slates.merge.ranges)
    modify vs delete, delete vs modify      edits or attributes of a removed object
    type replaced, object replaced          the object at the path was replaced
    rename vs rename, rename vs delete      moves of one object
    add vs add                              two different objects at one name
    directory removed while adding inside   either order
    attributes                              different modes or xattr values

Pure: records in, records out.  Called by slates.node.service (submit and
rebase) and the tests.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterable, Sequence
from typing import Any

from slates.core.records import Kind
from slates.errors import InvalidArgument
from slates.merge.ranges import (
    Replace,
    check_edits,
    lies_before,
    merge_adjacent,
    overlaps,
    rebase,
)

__all__ = [
    "Edit",
    "Meta",
    "Add",
    "Link",
    "Move",
    "Remove",
    "Change",
    "Conflict",
    "map_through",
    "changed_paths",
    "map_edits_pairwise",
    "changes_to_wire",
    "changes_from_wire",
    "conflict_to_wire",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Edit:
    """Byte-range edits of an existing regular file (an edit list, slates.merge.ranges)."""

    ino: int
    path: str
    edits: tuple[Replace, ...]
    # Refined from a whole-file rewrite (slates.merge.submission), not recorded as such.
    rewrite: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Meta:
    """Attribute changes of an existing object: a new mode, xattrs set (bytes) or
    removed (None), a new owner (uid, gid).  None: unchanged."""

    ino: int
    path: str
    mode: int | None
    xattrs: tuple[tuple[str, bytes | None], ...]
    owner: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Add:
    """A new object at (parent, name); `key` names it for later changes (negative until applied)."""

    key: int
    parent: int
    name: str
    path: str
    kind: Kind
    mode: int
    data: bytes  # file content, symlink target (utf-8, surrogateescape) or nothing
    xattrs: tuple[tuple[str, bytes], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """Another name for an object (existing ino or a new key)."""

    ino: int
    parent: int
    name: str
    path: str


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    ino: int
    parent: int  # where it was
    name: str
    path: str
    to_parent: int
    to_name: str
    to_path: str


@dataclasses.dataclass(frozen=True, slots=True)
class Remove:
    """The entry (parent, name) of `ino` is gone (the object too, unless other links remain)."""

    ino: int
    parent: int
    name: str
    path: str
    kind: Kind
    last: bool = True  # the object is gone (no other link remains)


Change = Edit | Meta | Add | Link | Move | Remove


@dataclasses.dataclass(frozen=True, slots=True)
class Conflict:
    """Why a change cannot be accepted: enough for its author to decide anew.

    `base` and `head` are byte ranges in the submission's base version and in
    the version that holds the accepted change; the bytes are the original,
    the accepted and the proposed content of the range (None where a kind
    has no bytes).  `base_bytes` is filled in by the caller, which can read
    the base version.
    """

    path: str
    kind: str
    base: tuple[int, int] | None = None
    head: tuple[int, int] | None = None
    accepted: bytes | None = None
    proposed: bytes | None = None
    base_bytes: bytes | None = None
    ino: int = 0
    rewrite: bool = False  # one side's edits were refined from a whole-file rewrite


# -- checking and mapping --------------------------------------------------------


@dataclasses.dataclass
class _Accepted:
    """One increment, indexed for the questions a submission asks of it."""

    edits: dict[int, Edit]
    meta: dict[int, Meta]
    removed: dict[int, Remove]
    moved: dict[int, Move]
    names: dict[tuple[int, str], Change]  # (parent, name) an increment filled
    filled_dirs: set[int]  # existing directories something was added into
    dir_moves: list[tuple[str, str]]
    unlinked: set[tuple[int, str]]  # every entry an increment removed or moved away

    @classmethod
    def of(cls, increment: Iterable[Change]) -> _Accepted:
        index = cls({}, {}, {}, {}, {}, set(), [], set())
        for change in increment:
            match change:
                case Edit():
                    index.edits[change.ino] = change
                case Meta():
                    index.meta[change.ino] = change
                case Remove():
                    index.unlinked.add((change.parent, change.name))
                    if change.last:  # only then is the object itself gone
                        index.removed[change.ino] = change
                case Move():
                    index.unlinked.add((change.parent, change.name))
                    index.moved[change.ino] = change
                    index.names[(change.to_parent, change.to_name)] = change
                    index.filled_dirs.add(change.to_parent)
                    index.dir_moves.append((change.path, change.to_path))
                case Add() | Link():
                    index.names[(change.parent, change.name)] = change
                    index.filled_dirs.add(change.parent)
        return index


def _replaced_kind(accepted: _Accepted, removal: Remove) -> str:
    """How an accepted increment took an object away: replaced at its name, or deleted."""
    other = accepted.names.get((removal.parent, removal.name))
    if isinstance(other, Add):
        return "type replaced" if other.kind != removal.kind else "object replaced"
    if isinstance(other, Move | Link):  # another existing object took its name
        return "object replaced"
    return "modify vs delete"


def _same_add(a: Add, b: Add) -> bool:
    return (a.kind, a.mode, a.data, a.xattrs) == (b.kind, b.mode, b.data, b.xattrs)


def map_through(
    changes: Sequence[Change], increment: Sequence[Change], *, map_edits: bool = True
) -> tuple[tuple[Change, ...], tuple[Conflict, ...]]:
    """Check `changes` against an accepted `increment` of the same version; map them past it.

    Returns the changes that map (those in conflict are left out) and the
    conflicts; the submission is accepted only if there are none.

    With map_edits false, byte ranges are left alone (the caller maps them
    through the composition of several increments at once, see
    `compose_accepted`); edits of removed objects still conflict.
    """
    accepted = _Accepted.of(increment)
    aliases: dict[int, int] = {}  # a new key -> the object an identical accepted add made
    mapped: list[Change] = []
    conflicts: list[Conflict] = []

    def conflict(path: str, kind: str, ino: int = 0, **fields: Any) -> None:
        conflicts.append(Conflict(path=path, kind=kind, ino=ino, **fields))

    def parent_of(ref: int) -> int:
        return aliases.get(ref, ref)

    def name_clash(parent: int, name: str, path: str, mine: Change) -> bool:
        other = accepted.names.get((parent, name))
        if other is None:
            return False
        if isinstance(mine, Add) and isinstance(other, Add) and _same_add(mine, other):
            aliases[mine.key] = other.key
            return True  # identical: already there
        if isinstance(mine, Move) and isinstance(other, Move) and other.ino == mine.ino:
            return True  # the same rename: already there
        kind = "rename vs rename" if isinstance(other, Move) else "add vs add"
        conflict(
            path, kind, proposed=getattr(mine, "data", None), accepted=getattr(other, "data", None)
        )
        return True

    # New objects first: an identical accepted add makes an alias that later
    # changes (a move into that directory) must see.
    ordered = [c for c in changes if isinstance(c, Add)] + [
        c for c in changes if not isinstance(c, Add)
    ]
    for change in ordered:
        if isinstance(change, Edit | Meta):
            gone = accepted.removed.get(change.ino)
            if gone is not None:  # they took away what this changes
                conflict(change.path, _replaced_kind(accepted, gone), change.ino)
                continue
        match change:
            case Edit():
                theirs = accepted.edits.get(change.ino)
                if theirs is None or not map_edits:
                    mapped.append(change)
                    continue
                edits, clashes = rebase(change.edits, theirs.edits)
                for clash in clashes:
                    conflict(
                        change.path,
                        clash.kind,
                        change.ino,
                        base=clash.base,
                        head=clash.head,
                        accepted=clash.accepted,
                        proposed=clash.proposed,
                        rewrite=change.rewrite or theirs.rewrite,
                    )
                if not clashes and edits:
                    mapped.append(dataclasses.replace(change, edits=edits))
            case Meta():
                theirs_meta = accepted.meta.get(change.ino)
                if theirs_meta is None:
                    mapped.append(change)
                    continue
                mine_x, theirs_x = dict(change.xattrs), dict(theirs_meta.xattrs)
                clash_mode = None not in (change.mode, theirs_meta.mode) and (
                    change.mode != theirs_meta.mode
                )
                clash_x = any(k in theirs_x and theirs_x[k] != v for k, v in mine_x.items())
                clash_owner = None not in (change.owner, theirs_meta.owner) and (
                    change.owner != theirs_meta.owner
                )
                if clash_mode or clash_x or clash_owner:
                    conflict(change.path, "attributes", change.ino)
                    continue
                mode = None if change.mode == theirs_meta.mode else change.mode
                owner = None if change.owner == theirs_meta.owner else change.owner
                rest = tuple((k, v) for k, v in change.xattrs if k not in theirs_x)
                if mode is not None or owner is not None or rest:
                    mapped.append(dataclasses.replace(change, mode=mode, xattrs=rest, owner=owner))
            case Remove():
                theirs_move = accepted.moved.get(change.ino)
                if theirs_move is not None and (theirs_move.parent, theirs_move.name) == (
                    change.parent,
                    change.name,
                ):
                    conflict(change.path, "rename vs delete", change.ino)
                elif (change.parent, change.name) in accepted.unlinked:
                    pass  # that name is gone already
                elif change.last and (change.ino in accepted.edits or change.ino in accepted.meta):
                    conflict(change.path, "delete vs modify", change.ino)
                elif change.kind == Kind.DIR and change.ino in accepted.filled_dirs:
                    conflict(change.path, "directory removed while adding inside", change.ino)
                else:
                    mapped.append(change)
            case Move():
                theirs_move = accepted.moved.get(change.ino)
                if change.ino in accepted.removed or (
                    (change.parent, change.name) in accepted.unlinked
                    and (
                        theirs_move is None
                        or (theirs_move.parent, theirs_move.name) != (change.parent, change.name)
                    )
                ):
                    conflict(change.path, "rename vs delete", change.ino)
                elif theirs_move is not None and (theirs_move.to_parent, theirs_move.to_name) != (
                    parent_of(change.to_parent),
                    change.to_name,
                ):
                    conflict(change.path, "rename vs rename", change.ino)
                elif theirs_move is not None:
                    pass  # the same rename
                elif _removed_dir(accepted, parent_of(change.to_parent)):
                    conflict(change.to_path, "directory removed while adding inside", change.ino)
                elif not name_clash(
                    parent_of(change.to_parent), change.to_name, change.to_path, change
                ):
                    mapped.append(
                        dataclasses.replace(change, to_parent=parent_of(change.to_parent))
                    )
            case Add() | Link():
                parent = parent_of(change.parent)
                if isinstance(change, Link) and change.ino in accepted.removed:
                    conflict(change.path, "modify vs delete", change.ino)
                elif _removed_dir(accepted, parent):
                    conflict(change.path, "directory removed while adding inside")
                elif not name_clash(parent, change.name, change.path, change):
                    if isinstance(change, Link):
                        mapped.append(
                            dataclasses.replace(change, parent=parent, ino=parent_of(change.ino))
                        )
                    else:
                        mapped.append(dataclasses.replace(change, parent=parent))
    # With conflicts, the rest is still mapped, so that later checks can report theirs too.
    return tuple(_moved_paths(c, accepted) for c in mapped), tuple(conflicts)


def _removed_dir(accepted: _Accepted, parent: int) -> bool:
    gone = accepted.removed.get(parent)
    return gone is not None and gone.kind == Kind.DIR


def _rewrite(path: str, moves: Sequence[tuple[str, str]]) -> str:
    """Where `path` went: the moves happened together, so the deepest one that holds it applies."""
    best: tuple[str, str] | None = None
    for old, new in moves:
        if (path == old or path.startswith(old.rstrip("/") + "/")) and (
            best is None or len(old) > len(best[0])
        ):
            best = (old, new)
    return path if best is None else best[1] + path[len(best[0]) :]


def _moved_paths(change: Change, accepted: _Accepted) -> Change:
    """Report paths in the version after `accepted` (the locations need no update)."""
    if not accepted.dir_moves:
        return change
    moves = accepted.dir_moves
    if isinstance(change, Move):
        return dataclasses.replace(
            change, path=_rewrite(change.path, moves), to_path=_rewrite(change.to_path, moves)
        )
    return dataclasses.replace(change, path=_rewrite(change.path, moves))


def map_edits_pairwise(
    changes: Sequence[Change], siblings: Sequence[Sequence[Change]]
) -> tuple[tuple[Change, ...], tuple[Conflict, ...]]:
    """Map byte-range edits past accepted submissions that started from the same base.

    Every edit here is in the base's coordinates, so the check is the plain
    one: an edit conflicts with an accepted edit it overlaps unless both are
    the same, and the head is the base with all of them applied.  Neither
    the verdict nor the result depends on the order in which the siblings
    were accepted (`siblings` holds each one's own edits, before mapping).
    """
    mapped: list[Change] = []
    conflicts: list[Conflict] = []
    for change in changes:
        if not isinstance(change, Edit):
            mapped.append(change)
            continue
        accepted_edits = [
            other
            for sibling in siblings
            for other in sibling
            if isinstance(other, Edit) and other.ino == change.ino
        ]
        theirs = sorted(
            {edit for other in accepted_edits for edit in other.edits},
            key=lambda e: (e.start, e.end),
        )
        rewrite = change.rewrite or any(other.rewrite for other in accepted_edits)
        if not theirs:
            mapped.append(change)
            continue
        mine: list[Replace] = []
        for edit in change.edits:
            clashing = [other for other in theirs if overlaps(edit, other)]
            if clashing == [edit]:
                continue  # the same edit was accepted already
            for other in clashing:
                head = _head_position(theirs, other)
                kind = "overlap"
                if edit.start == edit.end and other.start < edit.start < other.end:
                    kind = "insertion point deleted"
                conflicts.append(
                    Conflict(
                        path=change.path,
                        kind=kind,
                        base=(min(edit.start, other.start), max(edit.end, other.end)),
                        head=(head, head + len(other.data)),
                        accepted=other.data,
                        proposed=edit.data,
                        ino=change.ino,
                        rewrite=rewrite,
                    )
                )
            if not clashing:
                shift = _head_position(theirs, edit) - edit.start
                mine.append(Replace(edit.start + shift, edit.end + shift, edit.data))
        if mine:
            mapped.append(dataclasses.replace(change, edits=tuple(merge_adjacent(mine))))
    return tuple(mapped), tuple(conflicts)


def _head_position(accepted: Sequence[Replace], edit: Replace) -> int:
    """Where `edit`'s start lands once every accepted edit before it is applied."""
    return edit.start + sum(a.delta for a in accepted if a != edit and lies_before(a, edit))


def changed_paths(changes: Iterable[Change]) -> set[str]:
    paths: set[str] = set()
    for change in changes:
        paths.add(change.path)
        if isinstance(change, Move):
            paths.add(change.to_path)
    return paths


# -- wire form ------------------------------------------------------------------

_TAGS: dict[type, str] = {
    Edit: "edit",
    Meta: "meta",
    Add: "add",
    Link: "link",
    Move: "move",
    Remove: "remove",
}


def changes_to_wire(changes: Iterable[Change]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for change in changes:
        match change:
            case Edit():
                edits = [[e.start, e.end, e.data] for e in change.edits]
                out.append(["edit", change.ino, change.path, edits, change.rewrite])
            case Meta():
                out.append(
                    [
                        "meta",
                        change.ino,
                        change.path,
                        change.mode,
                        [list(x) for x in change.xattrs],
                        None if change.owner is None else list(change.owner),
                    ]
                )
            case Add():
                out.append(
                    [
                        "add",
                        change.key,
                        change.parent,
                        change.name,
                        change.path,
                        int(change.kind),
                        change.mode,
                        change.data,
                        [list(x) for x in change.xattrs],
                    ]
                )
            case Link():
                out.append(["link", change.ino, change.parent, change.name, change.path])
            case Move():
                out.append(
                    [
                        "move",
                        change.ino,
                        change.parent,
                        change.name,
                        change.path,
                        change.to_parent,
                        change.to_name,
                        change.to_path,
                    ]
                )
            case Remove():
                out.append(
                    [
                        "remove",
                        change.ino,
                        change.parent,
                        change.name,
                        change.path,
                        int(change.kind),
                        change.last,
                    ]
                )
    return out


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise InvalidArgument("a malformed name in a change", name=str(value)[:64])
    return value


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise InvalidArgument("a malformed path in a change", path=str(value)[:64])
    return posixpath.normpath(value)


def _number(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument("a malformed number in a change", value=str(value)[:32])
    return value


def _xattrs(value: Any, removable: bool) -> tuple[tuple[str, Any], ...]:
    if not isinstance(value, list):
        raise InvalidArgument("malformed xattrs in a change")
    out = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not (isinstance(item[1], bytes) or (removable and item[1] is None))
        ):
            raise InvalidArgument("a malformed xattr in a change")
        out.append((item[0], item[1]))
    return tuple(out)


def _kind(value: Any) -> Kind:
    try:
        return Kind(_number(value))
    except ValueError:
        raise InvalidArgument("an unknown kind in a change", kind=value) from None


def changes_from_wire(raw: Any) -> tuple[Change, ...]:
    """Decode and validate changes (from the journal or a checkpoint)."""
    if not isinstance(raw, list):
        raise InvalidArgument("changes must be a list")
    out: list[Change] = []
    for item in raw:
        match item:
            case ["edit", ino, path, list(edits), bool(rewrite)]:
                replaces = []
                for e in edits:
                    if not (isinstance(e, list) and len(e) == 3 and isinstance(e[2], bytes)):
                        raise InvalidArgument("a malformed edit in a change")
                    replaces.append(Replace(_number(e[0]), _number(e[1]), e[2]))
                check_edits(replaces)
                out.append(Edit(_number(ino), _path(path), tuple(replaces), rewrite))
            case ["meta", ino, path, mode, xattrs, owner]:
                if owner is not None and not (isinstance(owner, list) and len(owner) == 2):
                    raise InvalidArgument("a malformed owner in a change")
                out.append(
                    Meta(
                        _number(ino),
                        _path(path),
                        None if mode is None else _number(mode),
                        _xattrs(xattrs, removable=True),
                        None if owner is None else (_number(owner[0]), _number(owner[1])),
                    )
                )
            case ["add", key, parent, name, path, kind, mode, bytes(data), xattrs]:
                out.append(
                    Add(
                        _number(key),
                        _number(parent),
                        _name(name),
                        _path(path),
                        _kind(kind),
                        _number(mode),
                        data,
                        _xattrs(xattrs, removable=False),
                    )
                )
            case ["link", ino, parent, name, path]:
                out.append(Link(_number(ino), _number(parent), _name(name), _path(path)))
            case ["move", ino, parent, name, path, to_parent, to_name, to_path]:
                out.append(
                    Move(
                        _number(ino),
                        _number(parent),
                        _name(name),
                        _path(path),
                        _number(to_parent),
                        _name(to_name),
                        _path(to_path),
                    )
                )
            case ["remove", ino, parent, name, path, kind, bool(last)]:
                out.append(
                    Remove(
                        _number(ino), _number(parent), _name(name), _path(path), _kind(kind), last
                    )
                )
            case _:
                raise InvalidArgument("a malformed change", change=repr(item)[:80])
    return tuple(out)


def conflict_to_wire(conflict: Conflict) -> dict[str, Any]:
    return {
        "path": conflict.path,
        "kind": conflict.kind,
        "base": None if conflict.base is None else list(conflict.base),
        "head": None if conflict.head is None else list(conflict.head),
        "base_bytes": conflict.base_bytes,
        "accepted": conflict.accepted,
        "proposed": conflict.proposed,
        "rewrite": conflict.rewrite,
    }
