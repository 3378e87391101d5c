"""What a work volume submits: its changes, less what stays private, with rewrites refined.

Theory of operation (DESIGN.md section 5a).  `merge.tree.diff` gives every
change a work volume made since its base version.  Agents work with git,
compilers and editors, so before those changes are mapped onto the head
`prepare` turns them into what the agent meant to share:

1. Saves through a temporary file.  `sed -i`, vim and IDEs write a new file
   and rename it over the old name; the diff sees the old object removed
   and a new one added at its name.  A regular file replaced by a regular
   file at the same name is new content for the *old* object (an Edit
   replacing its whole base), so it merges like any other edit.  The old
   mode stays unless the new file adds permissions the old one lacked
   (`mkstemp` makes 0600 files; a tool that sets 0755 means it).  A green
   that keeps rewrites exact keeps the removal and the add.
2. Private paths (slates.merge.private): `.git/` and what the green's rule
   ignores are never submitted.  A change is private when its path is (for
   a move: both of its ends).  Private changes stay in the work volume:
   the caller re-applies them when the work volume moves onto a new version.
3. Rewrites.  A public Edit whose recorded edits replace most of its base
   (`refine.worth_refining`) is submitted as `refine.refine(base, new)`,
   marked `rewrite`, unless the green keeps rewrites exact; content too big
   to diff stays a literal replacement and is reported.

Pure: changes in, changes out; file bytes come from the read callbacks the
caller passes (the base version's and the work volume's).  Called by
slates.node.service at submit, dry-run submit and rebase.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from slates.core.records import Kind
from slates.errors import InvalidArgument
from slates.merge import refine as refining
from slates.merge.changes import Add, Change, Edit, Link, Meta, Move, Remove
from slates.merge.private import PrivateMatcher, PrivatePolicy
from slates.merge.ranges import Replace

__all__ = ["GreenPolicy", "Submission", "prepare", "REWRITES"]

REWRITES = ("refine", "exact")
DEFAULT_KEEP = 100
ReadWhole = Callable[[int], bytes]  # ino -> the whole content of that file


@dataclasses.dataclass(frozen=True, slots=True)
class GreenPolicy:
    """A green volume's rules for what its work volumes submit, fixed at `green create`."""

    private: PrivatePolicy = dataclasses.field(default_factory=PrivatePolicy)
    rewrites: str = "refine"  # "exact": a rewrite stays one replacement of the whole file
    keep: int = DEFAULT_KEEP  # versions kept whole (content and edits) behind the head

    def __post_init__(self) -> None:
        if self.rewrites not in REWRITES:
            raise InvalidArgument("rewrites is refine or exact", rewrites=self.rewrites)
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise InvalidArgument("keep is a positive number of versions", keep=str(self.keep))

    def to_wire(self) -> list[Any]:
        return [self.private.to_wire(), self.rewrites, self.keep]

    @classmethod
    def from_wire(cls, raw: Any) -> GreenPolicy:
        match raw:
            case [private, str(rewrites), int(keep)]:
                return cls(PrivatePolicy.from_wire(private), rewrites, keep)
            case _:
                raise InvalidArgument("a malformed green policy", policy=repr(raw)[:200])


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    public: tuple[Change, ...]  # what is submitted
    private: tuple[Change, ...]  # what stays in the work volume
    refined: tuple[str, ...]  # paths whose rewrite was refined into smaller edits
    literal: tuple[str, ...]  # paths whose rewrite was too large to refine

    @property
    def private_paths(self) -> int:
        return len({_path_of(change) for change in self.private})


def _path_of(change: Change) -> str:
    return change.path


def _mode_after_save(old_mode: int, new_mode: int) -> int:
    """The mode of a file saved through a temporary file: the old one, unless the new
    file adds permissions (a tool that means 0755) instead of a temporary file's 0600."""
    return new_mode if new_mode & ~old_mode else old_mode


def _saves(
    changes: Sequence[Change], base_size: Callable[[int], int], base_mode: Callable[[int], int]
) -> tuple[list[Change], dict[int, bytes]]:
    """Fold each (remove regular file, add regular file at its name) into new content of
    the old object.  Returns the changes and, per folded object, its new whole content."""
    referenced: set[int] = set()
    for change in changes:
        match change:
            case Link(ino=ino, parent=parent):
                referenced |= {ino, parent}
            case Add(parent=parent) | Move(to_parent=parent):
                referenced.add(parent)
    removed = {
        (c.parent, c.name): c
        for c in changes
        if isinstance(c, Remove) and c.kind == Kind.FILE and c.last
    }
    out: list[Change] = []
    folded: dict[int, bytes] = {}
    gone: set[tuple[int, str]] = set()
    for change in changes:
        if (
            isinstance(change, Add)
            and change.kind == Kind.FILE
            and change.key not in referenced
            and (change.parent, change.name) in removed
        ):
            old = removed[(change.parent, change.name)]
            gone.add((change.parent, change.name))
            folded[old.ino] = change.data
            out.append(Edit(old.ino, change.path, (Replace(0, base_size(old.ino), change.data),)))
            old_mode = base_mode(old.ino)
            mode = _mode_after_save(old_mode, change.mode)
            if mode != old_mode:
                out.append(Meta(old.ino, change.path, mode, ()))
            continue
        out.append(change)
    return [c for c in out if not (isinstance(c, Remove) and (c.parent, c.name) in gone)], folded


def _is_private(change: Change, matcher: PrivateMatcher, is_dir: Callable[[int], bool]) -> bool:
    match change:
        case Add(kind=kind, path=path):
            return matcher.is_private(path, kind == Kind.DIR)
        case Remove(kind=kind, path=path):
            return matcher.is_private(path, kind == Kind.DIR)
        case Move(ino=ino, path=path, to_path=to_path):
            directory = is_dir(ino)
            return matcher.is_private(path, directory) and matcher.is_private(to_path, directory)
        case Meta(ino=ino, path=path):
            return matcher.is_private(path, is_dir(ino))
        case Edit(path=path) | Link(path=path):
            return matcher.is_private(path)
    raise InvalidArgument("an unknown change", change=repr(change)[:80])


def prepare(
    changes: Sequence[Change],
    policy: GreenPolicy,
    matcher: PrivateMatcher,
    *,
    base_whole: ReadWhole,
    work_whole: ReadWhole,
    base_size: Callable[[int], int],
    base_mode: Callable[[int], int],
    is_dir: Callable[[int], bool],
) -> Submission:
    """The submission a work volume's `changes` (from merge.tree.diff) amount to."""
    changes = list(changes)
    folded: dict[int, bytes] = {}
    if policy.rewrites == "refine":  # exact: a save stays the removal and the add it was
        changes, folded = _saves(changes, base_size, base_mode)
    public: list[Change] = []
    private: list[Change] = []
    dropped: set[int] = set()  # keys of new objects that stay private
    for change in changes:
        inside_dropped = (isinstance(change, Add) and change.parent in dropped) or (
            isinstance(change, Link) and {change.ino, change.parent} & dropped
        )
        if inside_dropped or _is_private(change, matcher, is_dir):
            private.append(change)
            if isinstance(change, Add):
                dropped.add(change.key)
            continue
        if isinstance(change, Move) and (
            change.to_parent in dropped or matcher.is_private(change.to_path, is_dir(change.ino))
        ):
            # Out of the shared tree into a private place: for the others, it is gone.
            if is_dir(change.ino):
                raise InvalidArgument(
                    "a directory moved into a private path cannot be submitted: "
                    "move it back, or remove it",
                    path=change.path,
                    to=change.to_path,
                )
            public.append(
                Remove(change.ino, change.parent, change.name, change.path, Kind.FILE, True)
            )
            private.append(change)
            continue
        public.append(change)
    refined: list[str] = []
    literal: list[str] = []
    out: list[Change] = []
    for change in public:
        if not isinstance(change, Edit):
            out.append(change)
            continue
        size = base_size(change.ino)
        if policy.rewrites == "exact" or not refining.worth_refining(size, change.edits):
            out.append(change)
            continue
        new = folded.get(change.ino)
        smaller = refining.refine(
            base_whole(change.ino),
            work_whole(change.ino) if new is None else new,
            limit=refining.REFINE_LIMIT,
        )
        if smaller is None:
            literal.append(change.path)
            out.append(change)
        elif smaller:
            refined.append(change.path)
            out.append(dataclasses.replace(change, edits=smaller, rewrite=True))
        # else: the rewrite wrote back the same bytes: nothing changed
    return Submission(tuple(out), tuple(private), tuple(refined), tuple(literal))
