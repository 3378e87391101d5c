"""A shard's green/work ledger: versions, work-volume roles, pruning, landed marks.

Theory of operation: a green volume has a ledger of versions (v0 is the
snapshot it started as, each later one a submission accepted); a work
volume is made on one of its versions and has a role:

    Based(version)                  its content is that version plus its own changes
    Held(base, version, snapshot)   its changes were accepted as `version`, but it had
                                    no room to move onto it: it stays on `base`, and
                                    `snapshot` is what it held then (anything it
                                    changes after cannot be told from what was accepted)

Roles change only by the events in TRANSITIONS, a table (role, event) ->
role; any other pair raises VerificationFailed.  The Ledger applies the
ledger's journal events (slates.node.events: GreenMade, WorkMade,
VersionMade, WorkRebased, WorkHeld, VersionLanded, VersionsPruned) and
answers the questions submissions, pruning and deletion ask.  It holds
ids and changes only: no volumes, no I/O.  ShardState (slates.node.state)
owns one and applies events to it; slates.node.green_ops runs the
operations that read volumes (submit, rebase) and emits the events.

Invariants: a ledger is never empty (v0) and version n sits at index n; a
pruned version keeps its place with no snapshot and no changes; a work
volume's base is a version of its green (unless the green was deleted
with --force: then its requests answer NotFound).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

from slates.core.volume import NO_INO_LIMIT
from slates.errors import CapacityExhausted, InvalidArgument, NotFound, VerificationFailed
from slates.merge import changes as merge_changes
from slates.merge.submission import GreenPolicy
from slates.node.events import (
    Changes,
    GreenMade,
    VersionLanded,
    VersionMade,
    VersionsPruned,
    WorkHeld,
    WorkMade,
    WorkRebased,
)

__all__ = [
    "Version",
    "Based",
    "Held",
    "Role",
    "WorkVolume",
    "TRANSITIONS",
    "step",
    "Ledger",
    "WORK_INO_SHIFT",
]

# Work volume n of a green numbers its new inodes in [n << 32, (n + 1) << 32): the
# green adopts those numbers, so no two work volumes' objects ever share one.
WORK_INO_SHIFT = 32


@dataclasses.dataclass(frozen=True, slots=True)
class Version:
    """One entry of a green volume's ledger."""

    number: int
    snapshot_id: str  # "" once pruned
    base: int  # the version the submission started from (-1 for v0)
    work: str  # the submitting work volume ("" for v0)
    increment: Changes  # relative to version number - 1
    # The submission's own byte-range edits, relative to `base` (before mapping).
    originals: Changes = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Based:
    version: int

    @property
    def base(self) -> int:
        return self.version


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    base: int
    version: int
    snapshot_id: str


Role: TypeAlias = Based | Held
RoleEvent: TypeAlias = WorkMade | WorkRebased | WorkHeld

# A held volume is never held again: its submissions answer "nothing" or are refused
# (green_ops: _unchanged_since_held) until a rebase makes it Based.
TRANSITIONS: dict[tuple[type[Role] | None, type[RoleEvent]], Callable[[Any, Any], Role]] = {
    (None, WorkMade): lambda _role, event: Based(event.version),
    (Based, WorkRebased): lambda _role, event: Based(event.version),
    (Held, WorkRebased): lambda _role, event: Based(event.version),
    (Based, WorkHeld): lambda role, event: Held(role.version, event.version, event.snapshot_id),
}


def step(role: Role | None, event: RoleEvent) -> Role:
    """The role after `event`; VerificationFailed for a pair the table does not hold."""
    transition = TRANSITIONS.get((None if role is None else type(role), type(event)))
    if transition is None:
        raise VerificationFailed(
            "no such work volume role transition",
            role=type(role).__name__ if role is not None else "none",
            event=event.tag,
        )
    return transition(role, event)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkVolume:
    green: str
    role: Role


LedgerEvent: TypeAlias = (
    GreenMade | WorkMade | VersionMade | WorkRebased | WorkHeld | VersionLanded | VersionsPruned
)


class Ledger:
    def __init__(self) -> None:
        self.greens: dict[str, list[Version]] = {}  # green volume id -> its versions
        self.policies: dict[str, GreenPolicy] = {}
        self.sources: dict[str, str | None] = {}  # the directory a green captured
        self.landed: dict[str, int] = {}  # green -> the newest version a landing completed
        self.work_counts: dict[str, int] = {}  # green -> work volumes made (numbering)
        self.works: dict[str, WorkVolume] = {}

    # -- events ---------------------------------------------------------------

    def apply(self, event: LedgerEvent) -> tuple[str, ...]:
        """Apply one ledger event; returns the snapshots it lets go (pruned versions')."""
        match event:
            case GreenMade():
                if event.vid in self.greens or event.vid in self.works:
                    raise VerificationFailed("the volume has a role already", volume=event.vid)
                self.greens[event.vid] = [Version(0, event.snapshot_id, -1, "", ())]
                self.sources[event.vid] = event.source
                self.policies[event.vid] = event.policy
            case WorkMade():
                if event.vid in self.greens:
                    raise VerificationFailed("a green volume is not work", volume=event.vid)
                self.works[event.vid] = WorkVolume(event.green, step(self._role(event.vid), event))
                serial = event.start >> WORK_INO_SHIFT
                self.work_counts[event.green] = max(self.work_counts.get(event.green, 0), serial)
            case WorkRebased() | WorkHeld():
                work = self.works.get(event.vid)
                if work is None:
                    raise VerificationFailed("not a work volume", volume=event.vid, event=event.tag)
                self.works[event.vid] = WorkVolume(work.green, step(work.role, event))
            case VersionMade():
                ledger = self.versions_of(event.green)
                ledger.append(
                    Version(
                        len(ledger),
                        event.snapshot_id,
                        event.base,
                        event.work,
                        event.increment,
                        event.originals,
                    )
                )
            case VersionLanded():
                self.versions_of(event.green)
                self.landed[event.green] = max(self.landed.get(event.green, 0), event.version)
            case VersionsPruned():
                ledger = self.versions_of(event.green)
                released = []
                for number in event.numbers:
                    if not 0 < number < len(ledger):
                        raise VerificationFailed("no such version to prune", version=number)
                    gone = ledger[number]
                    released.append(gone.snapshot_id)
                    ledger[number] = Version(number, "", gone.base, gone.work, (), ())
                return tuple(released)
            case _:
                raise VerificationFailed("not a ledger event", event=repr(event)[:80])
        return ()

    def drop(self, vid: str) -> None:
        """A volume is deleted: whatever role it had ends with it.  (Its source stays:
        a work volume of a green deleted with --force still names it for landing.)"""
        self.greens.pop(vid, None)
        self.policies.pop(vid, None)
        self.landed.pop(vid, None)
        self.work_counts.pop(vid, None)
        self.works.pop(vid, None)

    def _role(self, vid: str) -> Role | None:
        work = self.works.get(vid)
        return None if work is None else work.role

    # -- questions ------------------------------------------------------------

    def versions_of(self, green: str) -> list[Version]:
        ledger = self.greens.get(green)
        if ledger is None:
            raise VerificationFailed("no such green volume in the ledger", green=green)
        return ledger

    def green_arg(self, green: str, is_volume: bool) -> list[Version]:
        """A requested green's versions (InvalidArgument or NotFound for the caller)."""
        ledger = self.greens.get(green)
        if ledger is None:
            if is_volume:
                raise InvalidArgument("not a green volume", volume=green)
            raise NotFound("no such green volume", green=green)
        return ledger

    def policy(self, green: str) -> GreenPolicy:
        return self.policies.get(green, GreenPolicy())

    def live_version(self, green: str, number: int) -> Version:
        """A version that holds its content (NotFound if it never was, or was pruned)."""
        ledger = self.greens[green]
        if number >= len(ledger):
            raise NotFound("no such version", green=green, version=number)
        if not ledger[number].snapshot_id:
            raise NotFound("that version was pruned (green create --keep)", version=number)
        return ledger[number]

    def next_numbering(self, green: str) -> tuple[int, int]:
        """The inode numbers [start, limit) of the green's next work volume."""
        serial = self.work_counts.get(green, 0) + 1
        start, limit = serial << WORK_INO_SHIFT, (serial + 1) << WORK_INO_SHIFT
        if limit > NO_INO_LIMIT:
            raise CapacityExhausted("this green volume has made all the work volumes it can")
        return start, limit

    def work_arg(self, vid: str) -> WorkVolume:
        """A requested work volume (InvalidArgument, or NotFound if its green is gone)."""
        work = self.works.get(vid)
        if work is None:
            raise InvalidArgument("not a work volume", volume=vid)
        if work.green not in self.greens:
            raise NotFound("the work volume's green volume is gone", green=work.green)
        return work

    def role_view(self, vid: str) -> tuple[str, str | None, int | None]:
        """(role, green, version) as volume views show them."""
        if vid in self.greens:
            return "green", None, len(self.greens[vid]) - 1
        work = self.works.get(vid)
        if work is not None:
            return "work", work.green, work.role.base
        return "volume", None, None

    def works_of(self, green: str) -> list[str]:
        return sorted(vid for vid, work in self.works.items() if work.green == green)

    def check_deletable(self, vid: str) -> None:
        """A green with live work volumes or unlanded versions is not deleted (--force)."""
        if vid not in self.greens:
            return
        works = self.works_of(vid)
        if works:
            raise InvalidArgument(
                f"the green volume has {len(works)} work volumes: delete them first "
                "(or delete with --force)",
                volume=vid,
                works=works[:10],
            )
        head = len(self.greens[vid]) - 1
        landed = self.landed.get(vid, 0)
        if head > landed:
            raise InvalidArgument(
                f"versions {landed + 1} to {head} of this green volume were never landed: "
                "land them, or delete with --force",
                volume=vid,
            )

    def green_holding(self, snapshot_id: str) -> str | None:
        """The green one of whose versions the snapshot is."""
        for green, ledger in self.greens.items():
            if any(v.snapshot_id == snapshot_id for v in ledger):
                return green
        return None

    def prunable(self, green: str, planned: set[str] | frozenset[str]) -> list[int]:
        """Versions nothing needs any more: not v0 (the landing witness), not the last
        `keep`, not one a live work volume starts from or comes after (submissions map
        through them), not one a plan lands (`planned` snapshots)."""
        ledger = self.greens[green]
        keep = self.policy(green).keep
        bases = [work.role.base for work in self.works.values() if work.green == green]
        # Below 1 while the green has fewer than `keep` versions: a negative slice end
        # would count from the end and prune live bases, so nothing is pruned then.
        limit = max(1, min([len(ledger) - keep, *bases]))
        return [v.number for v in ledger[1:limit] if v.snapshot_id and v.snapshot_id not in planned]

    def changed_since(self, green: str, since: int) -> list[str]:
        ledger = self.greens[green]
        if since >= len(ledger):
            raise NotFound("no such version", green=green, version=since)
        paths: set[str] = set()
        for version in ledger[since + 1 :]:
            if not version.snapshot_id:
                raise InvalidArgument(
                    "versions after that one were pruned: ask since a later one",
                    version=version.number,
                )
            paths |= merge_changes.changed_paths(version.increment)
        return sorted(paths)

    def versions_view(self, green: str, limit: int) -> dict[str, Any]:
        ledger = self.greens[green]
        return {
            "green": green,
            "head": len(ledger) - 1,
            "versions": [
                {
                    "version": v.number,
                    "snapshot": v.snapshot_id,
                    "base": v.base,
                    "work": v.work,
                    "paths": sorted(merge_changes.changed_paths(v.increment)),
                    "pruned": not v.snapshot_id,
                }
                for v in ledger[-limit:]
                if limit
            ],
        }

    def map_to_head(
        self, green: str, base: int, changes: Changes
    ) -> tuple[Changes, list[tuple[merge_changes.Conflict, Version]]]:
        """Changes made since `base`, mapped to the green's head, or the conflicts, each
        with the version it conflicts with (a range in the author's own coordinates)."""
        ledger = self.greens[green]
        originals = tuple(c for c in changes if isinstance(c, merge_changes.Edit))
        later = ledger[base + 1 :]
        found: list[tuple[merge_changes.Conflict, Version]] = []
        same_base = all(version.base == base for version in later)
        for version in later:
            # Names and objects version by version; bytes too when bases differ.
            changes, conflicts = merge_changes.map_through(
                changes, version.increment, map_edits=not same_base
            )
            found += [(_in_base(c, originals), version) for c in conflicts]
        if same_base:
            # Every accepted submission since started from this base too: bytes
            # are checked against their own edits, all in the base's coordinates.
            changes, conflicts = merge_changes.map_edits_pairwise(
                changes, [version.originals for version in later]
            )
            found += [(c, ledger[-1]) for c in conflicts]
        return ((), found) if found else (changes, [])

    # -- checkpoints ----------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The ledger's part of a checkpoint's meta (the keys the service had)."""
        return {
            "greens": {
                green: [
                    [
                        v.snapshot_id,
                        v.base,
                        v.work,
                        merge_changes.changes_to_wire(v.increment),
                        merge_changes.changes_to_wire(v.originals),
                    ]
                    for v in ledger
                ]
                for green, ledger in self.greens.items()
            },
            "works": {vid: [w.green, w.role.base] for vid, w in self.works.items()},
            "green_policies": {g: p.to_wire() for g, p in self.policies.items()},
            "landed": self.landed,
            "work_counts": self.work_counts,
            "green_sources": self.sources,
            "held": {
                vid: [w.role.version, w.role.snapshot_id]
                for vid, w in self.works.items()
                if isinstance(w.role, Held)
            },
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> Ledger:
        """A ledger from a checkpoint's meta (KeyError, TypeError, ValueError or
        InvalidArgument when it is malformed)."""
        out = cls()
        out.greens = {
            str(green): [
                Version(
                    n,
                    str(snap),
                    int(base),
                    str(work),
                    merge_changes.changes_from_wire(raw),
                    merge_changes.changes_from_wire(own),
                )
                for n, (snap, base, work, raw, own) in enumerate(entries)
            ]
            for green, entries in meta["greens"].items()
        }
        held = {str(vid): (int(v), str(s)) for vid, (v, s) in meta["held"].items()}
        for vid, (green, base) in meta["works"].items():
            role: Role = Based(int(base))
            if vid in held:
                role = Held(int(base), *held.pop(vid))
            out.works[str(vid)] = WorkVolume(str(green), role)
        if held:
            raise ValueError(f"held volumes that are not work volumes: {sorted(held)[:4]}")
        out.sources = dict(meta["green_sources"])
        out.policies = {str(g): GreenPolicy.from_wire(p) for g, p in meta["green_policies"].items()}
        out.work_counts = {str(g): int(n) for g, n in meta["work_counts"].items()}
        out.landed = {str(g): int(n) for g, n in meta["landed"].items()}
        return out


def _in_base(conflict: merge_changes.Conflict, originals: Changes) -> merge_changes.Conflict:
    """A range conflict found after mapping, with the range of the author's own edit."""
    if conflict.base is None:
        return conflict
    for change in originals:
        if isinstance(change, merge_changes.Edit) and change.ino == conflict.ino:
            for edit in change.edits:
                if edit.data == conflict.proposed:
                    return dataclasses.replace(conflict, base=(edit.start, edit.end))
    return conflict
