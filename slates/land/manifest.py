"""Landing manifests: exactly what a landing would change on disk, and the three-way rule.

Theory of operation (DESIGN.md section 6, product description "Writing
Approved Changes to Disk").  A manifest binds a proposal (a snapshot id),
a target directory (with the (st_dev, st_ino) the planner opened there:
landing then refuses any other directory found at that path) and one
entry per path: the state *witnessed* (what the agents started from, or
what `rewitness` recorded after review) and the state *proposed*.  A
state is (kind, BLAKE3 of the content, mode) or None for "absent".  The
manifest's id is the BLAKE3 of its canonical msgpack encoding, so
changing the selection, a witness, a proposal or the target's identity
changes the id, and a grant bound to one id approves nothing else.

`decide(witnessed, disk, proposed)` is the product's table:

    disk == proposed               identical (nothing to write)
    disk == witnessed              apply (write the proposal)
    anything else                  conflict (leave the disk entry alone)

`explain` gives the same decision and, for a conflict, why: the disk
entry vanished, appeared, is of another kind, changed its content
(BLAKE3 on disk and witnessed) or its mode.  The approval screen, every
landing outcome and `rewitness --merge` use its words.

Modes: a state's mode is its permission bits, setuid, setgid and sticky
included (0o7777).  Those three land only when the proposed mode carries
them (`landed_mode`), and `special_bits` names them so the approval
screen highlights every entry that asks for them before a human approves.

Entries are checked as relative paths with no "." or ".." components, so
a manifest can never name anything outside its target.  Pure: no I/O;
slates.land.disk performs what this decides; slates.node.service builds
manifests from volume roots.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any

import blake3
import msgpack

from slates.errors import InvalidArgument

__all__ = [
    "State",
    "Entry",
    "Manifest",
    "Decision",
    "decide",
    "explain",
    "check_relative",
    "manifest_from_wire",
    "order_for_apply",
    "landed_mode",
    "special_bits",
    "SPECIAL_BITS",
]

KINDS = ("file", "dir", "symlink")
MAX_ENTRIES = 100_000
SPECIAL_BITS = 0o7000
_SPECIAL_NAMES = ((0o4000, "setuid"), (0o2000, "setgid"), (0o1000, "sticky"))


@dataclasses.dataclass(frozen=True, slots=True)
class State:
    """One path's state: kind, content hash (None for a directory) and permission bits."""

    kind: str
    digest: str | None
    mode: int

    def to_wire(self) -> list[Any]:
        return [self.kind, self.digest, self.mode]

    @classmethod
    def from_wire(cls, raw: Any) -> State | None:
        if raw is None:
            return None
        if not (isinstance(raw, list) and len(raw) == 3 and raw[0] in KINDS):
            raise InvalidArgument("a malformed state in a manifest")
        kind, digest, mode = raw
        if (digest is None) != (kind == "dir") or (
            digest is not None and not (isinstance(digest, str) and len(digest) == 64)
        ):
            raise InvalidArgument("a malformed content hash in a manifest")
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
            raise InvalidArgument("a malformed mode in a manifest")
        return cls(kind, digest, mode)


def special_bits(state: State | None) -> list[str]:
    """The setuid, setgid and sticky bits a state's mode carries, by name (a link has none)."""
    if state is None or state.kind == "symlink":
        return []
    return [name for bit, name in _SPECIAL_NAMES if state.mode & bit]


def landed_mode(state: State) -> int:
    """The mode landing gives a proposal: its permission bits, and setuid, setgid and
    sticky only as the proposed mode carries them (nothing of the disk's or the umask's)."""
    allowed = 0o777 | (state.mode & SPECIAL_BITS if special_bits(state) else 0)
    return state.mode & allowed


def check_relative(path: str) -> str:
    """A manifest path: relative, normalized, never leaving the target."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise InvalidArgument("a manifest path must be relative", path=str(path)[:200])
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidArgument("a manifest path must not leave its target", path=path[:200])
    return path


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    path: str
    witnessed: State | None
    proposed: State | None  # None: delete

    def to_wire(self) -> list[Any]:
        return [
            self.path,
            None if self.witnessed is None else self.witnessed.to_wire(),
            None if self.proposed is None else self.proposed.to_wire(),
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    source: str  # the snapshot holding the proposed content
    target: str  # absolute target directory
    entries: tuple[Entry, ...]  # sorted by path, unique
    # (st_dev, st_ino) of the target directory opened at plan time: every later
    # access must find that very directory (part of the id: a grant approves it).
    target_identity: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.target.startswith("/"):
            raise InvalidArgument("the target must be an absolute directory", target=self.target)
        if len(self.entries) > MAX_ENTRIES:
            raise InvalidArgument("too many entries for one landing", limit=MAX_ENTRIES)
        previous = ""
        for entry in self.entries:
            check_relative(entry.path)
            if entry.path <= previous:
                raise InvalidArgument("manifest entries must be sorted and unique")
            if entry.witnessed is None and entry.proposed is None:
                raise InvalidArgument("an entry must change something", path=entry.path)
            previous = entry.path
        identity = self.target_identity
        if identity is not None and not (
            isinstance(identity, tuple)
            and len(identity) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in identity)
        ):
            raise InvalidArgument("a malformed target identity in a manifest")

    def to_wire(self) -> list[Any]:
        entries = [entry.to_wire() for entry in self.entries]
        if self.target_identity is None:
            return [1, self.source, self.target, entries]  # as before identities existed
        return [2, self.source, self.target, entries, list(self.target_identity)]

    def encode(self) -> bytes:
        """The canonical encoding: the same manifest always gives the same bytes."""
        out: bytes = msgpack.packb(
            self.to_wire(), use_bin_type=True, unicode_errors="surrogateescape"
        )
        return out

    @property
    def manifest_id(self) -> str:
        return blake3.blake3(self.encode()).hexdigest()

    def select(self, paths: Iterable[str]) -> Manifest:
        """The entries at or below the selected paths."""
        chosen = [p.strip("/") for p in paths]
        if "" in chosen:
            return self  # the whole target
        chosen = [check_relative(p) for p in chosen]
        picked = {
            e.path
            for e in self.entries
            if any(e.path == p or e.path.startswith(p + "/") for p in chosen)
        }
        # A chosen entry inside a directory this landing creates needs that directory too.
        new_dirs = {
            e.path
            for e in self.entries
            if e.proposed is not None
            and e.proposed.kind == "dir"
            and (e.witnessed is None or e.witnessed.kind != "dir")
        }
        for path in list(picked):
            parts = path.split("/")
            picked |= {"/".join(parts[:i]) for i in range(1, len(parts))} & new_dirs
        return dataclasses.replace(self, entries=tuple(e for e in self.entries if e.path in picked))

    def rewitnessed(self, observed: dict[str, State | None]) -> Manifest:
        """The same proposal with new witnesses for some paths (a new manifest, a new id)."""
        entries = []
        for entry in self.entries:
            if entry.path in observed:
                entry = dataclasses.replace(entry, witnessed=observed[entry.path])
            if entry.witnessed is not None or entry.proposed is not None:
                entries.append(entry)
        return dataclasses.replace(self, entries=tuple(entries))


def manifest_from_wire(raw: Any) -> Manifest:
    identity: tuple[int, int] | None = None
    if isinstance(raw, list) and len(raw) == 5 and raw[0] == 2:
        if not (isinstance(raw[4], list) and len(raw[4]) == 2):
            raise InvalidArgument("a malformed target identity in a manifest")
        identity = (raw[4][0], raw[4][1])
        raw = [1, *raw[1:4]]
    if not (isinstance(raw, list) and len(raw) == 4 and raw[0] == 1):
        raise InvalidArgument("a malformed manifest")
    _version, source, target, entries = raw
    if not isinstance(source, str) or not isinstance(target, str) or not isinstance(entries, list):
        raise InvalidArgument("a malformed manifest")
    parsed = []
    for item in entries:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise InvalidArgument("a malformed manifest entry")
        parsed.append(Entry(item[0], State.from_wire(item[1]), State.from_wire(item[2])))
    return Manifest(source, target, tuple(parsed), identity)


class Decision(enum.Enum):
    APPLY = "apply"
    IDENTICAL = "identical"
    CONFLICT = "conflict"


def decide(witnessed: State | None, disk: State | None, proposed: State | None) -> Decision:
    """The three-way rule for one entry (the product description's table)."""
    if disk == proposed:
        return Decision.IDENTICAL
    if disk == witnessed:
        return Decision.APPLY
    return Decision.CONFLICT


_KIND_WORDS = {"file": "a file", "dir": "a directory", "symlink": "a symlink"}


def _kind_word(state: State | None) -> str:
    if state is None:
        return "nothing"
    return _KIND_WORDS.get(state.kind, "a fifo, device or socket")


def explain(
    witnessed: State | None, disk: State | None, proposed: State | None
) -> tuple[Decision, str | None]:
    """`decide`'s decision and, for a conflict, why the disk no longer matches the witness."""
    decision = decide(witnessed, disk, proposed)
    if decision is not Decision.CONFLICT:
        return decision, None
    if disk is None:
        return decision, "the disk entry vanished (removed since the witness)"
    if disk.kind not in KINDS:
        return decision, "the disk holds a fifo, device or socket here"
    if witnessed is None:
        return decision, (
            f"the disk has {_kind_word(disk)} here where the witness had nothing"
            f" (the proposal is {_kind_word(proposed)})"
        )
    if disk.kind != witnessed.kind:
        proposal = "a delete" if proposed is None else _kind_word(proposed)
        return decision, (
            f"the disk is {_kind_word(disk)}, the witness {_kind_word(witnessed)}"
            f" and the proposal {proposal}"
        )
    if disk.digest != witnessed.digest:
        what = "link target" if disk.kind == "symlink" else "content"
        return decision, (
            f"the disk's {what} changed since the witness (BLAKE3 {str(disk.digest)[:12]}"
            f" on disk, {str(witnessed.digest)[:12]} witnessed)"
        )
    return decision, (
        f"the disk's mode changed since the witness ({disk.mode:o} on disk,"
        f" {witnessed.mode:o} witnessed)"
    )


def order_for_apply(entries: Sequence[Entry]) -> list[Entry]:
    """New directories parent-first, then files and links, removals deepest-first, and
    last the entries that replace a directory by something else (its contents go first).
    """

    def phase(entry: Entry) -> tuple[int, int, str]:
        was_dir = entry.witnessed is not None and entry.witnessed.kind == "dir"
        if entry.proposed is None:
            return (2, -entry.path.count("/"), entry.path)
        if was_dir and entry.proposed.kind != "dir":
            return (3, 0, entry.path)
        return (0 if entry.proposed.kind == "dir" else 1, 0, entry.path)

    return sorted(entries, key=phase)
