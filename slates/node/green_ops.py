"""A shard's green and work volume operations: create, submit, rebase, versions.

Theory of operation (DESIGN.md section 5).  The ledger (slates.node.ledger)
knows the versions and the work volumes' roles; this module does the part
that reads and rebuilds volumes, and emits the ledger's events through the
service (which applies each one before journaling it).

- `submit`: the work volume is sealed, its changes since its base are
  prepared (private paths kept back, rewrites refined: slates.merge.
  submission), mapped through every version accepted since its base
  (Ledger.map_to_head), and applied to a fresh clone of the head; only if
  all of that succeeds does the green restart as that clone and a
  VersionMade follow.  The work volume then moves onto its version
  (WorkRebased), or, with no room to move, keeps its base (WorkHeld).
  On a fleet host a submission (not a dry run) first asks the fleet link's
  fence table (ShardService.fence, slates.fleet.link_fence): a host that
  cannot prove it still owns the green refuses it (EpochFenced, or NotOwner
  naming the committed owner) before anything is sealed.
- `rebase`: the same mapping onto the head, without making a version.
- Restarts (`restart_as`) keep a volume's numbering, handles and kernel
  references, so a mount goes on; the entries that changed under a mounted
  volume are queued for the driver (ShardService.moved).
- Conflicts go back with the base bytes of their range and the smallest
  differing region (slates.merge.report); files are read only then.

Called by ShardService for the ops in OPS; reads the service's volumes,
snapshots and ledger, like slates.node.landing_ops.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from slates.core.records import Kind
from slates.core.volume import Capacity, Volume
from slates.errors import InvalidArgument, SlatesError
from slates.merge import changes as merge_changes
from slates.merge import report as merge_report
from slates.merge import tree as merge_tree
from slates.merge.private import PrivateMatcher, PrivatePolicy
from slates.merge.submission import DEFAULT_KEEP, GreenPolicy, Submission, prepare
from slates.node.args import int_arg as _int_arg
from slates.node.args import str_arg as _str_arg
from slates.node.events import (
    Changes,
    GreenMade,
    VersionMade,
    VersionsPruned,
    VolumeReset,
    WorkHeld,
    WorkMade,
    WorkRebased,
)
from slates.node.jobs import JobBody
from slates.node.ledger import Held, Version

if TYPE_CHECKING:
    from slates.node.service import ShardService

__all__ = ["GreenOps", "OPS", "bool_arg"]

OPS = frozenset({"green.create", "work.create", "submit", "rebase", "versions", "changed_since"})
MAX_IGNORE_FILE = 1 << 20  # a .gitignore read for private paths (bigger ones are skipped)
MAX_REPORTED_FILE = 64 << 20  # a conflict's region is found in files up to this size
MAX_PATH_INDEXES = 16  # versions whose path index is kept for reporting
_NOTHING = Submission((), (), (), ())


def bool_arg(args: dict[str, Any], key: str) -> bool:
    """A true/false argument, false when absent (slates.node.args has the others)."""
    value = args.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{key} is true or false", value=str(value))
    return value


def _green_policy(args: dict[str, Any]) -> GreenPolicy:
    """A green's policy from `green create`'s arguments (InvalidArgument on bad patterns)."""
    patterns = args.get("private", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise InvalidArgument("private is a list of gitignore patterns")
    rewrites = args.get("rewrites", "refine")
    if not isinstance(rewrites, str):
        raise InvalidArgument("rewrites is refine or exact")
    private = PrivatePolicy(tuple(patterns), bool_arg(args, "submit_ignored"))
    keep = args.get("keep", DEFAULT_KEEP)
    return GreenPolicy.from_wire(GreenPolicy(private, rewrites, keep).to_wire())  # checks it


def _small_file(volume: Volume, path: str) -> bytes | None:
    """A small regular file's bytes (an ignore file), or None."""
    try:
        attr = volume.getattr(volume.resolve(path))
    except SlatesError:
        return None
    if attr.kind != Kind.FILE or attr.size > MAX_IGNORE_FILE:
        return None
    return volume.read(attr.ino, 0, attr.size)


def _whole(volume: Volume, ino: int) -> bytes:
    return volume.read(ino, 0, volume.getattr(ino).size)


class GreenOps:
    def __init__(self, service: ShardService) -> None:
        self.service = service
        self._path_indexes: dict[str, dict[int, str]] = {}  # snapshot id -> path index

    def run(self, op: str, args: dict[str, Any], now: int) -> Any:
        ledger = self.service.ledger
        match op:
            case "green.create":
                return self._create_green(args, now)
            case "work.create":
                return self._create_work(args)
            case "submit":
                return self._submit(args, now)
            case "rebase":
                return self._rebase(args, now)
            case "versions":
                return ledger.versions_view(self._green(args), _int_arg(args, "limit", 100))
            case "changed_since":
                return ledger.changed_since(self._green(args), _int_arg(args, "version"))
            case _:
                raise InvalidArgument("unknown operation", op=op)

    def _green(self, args: dict[str, Any]) -> str:
        green = _str_arg(args, "green")
        self.service.ledger.green_arg(green, green in self.service.volumes)
        return green

    def _create_green(self, args: dict[str, Any], now: int) -> JobBody:
        """A green volume: empty, or a captured copy of a base directory (never read live).

        A live base could change under the versions agents share, so a green
        volume's base is captured: every version holds its own bytes.  Its
        policy (private paths, rewrites) is checked before anything is made.
        A job (slates.node.jobs): the capture reads off the shard's loop.
        """
        if args.get("from") is not None:
            raise InvalidArgument("a green volume starts empty or from a base directory")
        policy = _green_policy(args)
        base = args.get("base")
        create = {**args, "capture": base is not None}
        service = self.service
        created = service._create_volume(create, now)
        vid = created["id"] if isinstance(created, dict) else (yield from created)["id"]
        snapshot = service.volumes[vid].snapshot(service._new_id("snap"))
        source = os.path.realpath(base) if isinstance(base, str) else None
        service._emit(GreenMade(vid, snapshot.snapshot_id, source, policy))
        return {**service.info(vid), "version": 0}

    def _create_work(self, args: dict[str, Any]) -> dict[str, Any]:
        green = self._green(args)
        ledger = self.service.ledger
        number = _int_arg(args, "version", len(ledger.greens[green]) - 1)
        version = ledger.live_version(green, number)
        start, limit = ledger.next_numbering(green)
        info = self.service._clone(
            {**args, "snapshot": version.snapshot_id, "name": _str_arg(args, "name")}
        )
        self.service._emit(WorkMade(info["id"], green, number, start, limit))
        return {**self.service.info(info["id"]), "base": number}

    def _work(self, args: dict[str, Any]) -> tuple[str, Volume, str, int]:
        vid, volume = self.service._volume(args)
        work = self.service.ledger.work_arg(vid)
        return vid, volume, work.green, work.role.base

    # -- what a work volume submits ----------------------------------------------

    def _path_index(self, snapshot_id: str) -> dict[int, str]:
        index = self._path_indexes.pop(snapshot_id, None)
        if index is None:
            index = merge_tree.path_index(self.service.snapshots[snapshot_id].root)
            while len(self._path_indexes) >= MAX_PATH_INDEXES:
                del self._path_indexes[next(iter(self._path_indexes))]
        self._path_indexes[snapshot_id] = index
        return index

    def private_matcher(self, green: str, root: Any) -> PrivateMatcher:
        """The green's private-path rule over the ignore files of `root` (a version or a
        work volume's snapshot): for landing plans."""

        def read_file(path: str) -> bytes | None:
            reader = self.service._reader(root)
            try:
                return _small_file(reader, path)
            finally:
                reader.close()

        return PrivateMatcher(self.service.ledger.policy(green).private, read_file)

    def _prepare(self, volume: Volume, green: str, base: int) -> Submission:
        """What the work volume submits from `base`: its changes less the private ones,
        saves folded and rewrites refined (slates.merge.submission)."""
        snapshot_id = self.service.ledger.greens[green][base].snapshot_id
        base_root = self.service.snapshots[snapshot_id].root
        paths = self._path_index(snapshot_id)
        changes = merge_tree.diff(
            base_root, volume.root, volume.read, lambda ino: paths.get(ino, f"#{ino}")
        )
        if not changes:
            return _NOTHING
        policy = self.service.ledger.policy(green)
        reader = self.service._reader(base_root)

        def is_dir(ino: int) -> bool:
            inode = volume.root.inodes.get(ino) or base_root.inodes.get(ino)
            return inode is not None and inode.kind == Kind.DIR

        try:
            return prepare(
                changes,
                policy,
                PrivateMatcher(policy.private, lambda path: _small_file(volume, path)),
                base_whole=lambda ino: _whole(reader, ino),
                work_whole=lambda ino: _whole(volume, ino),
                base_size=lambda ino: reader.getattr(ino).size,
                base_mode=lambda ino: reader.getattr(ino).mode & 0o7777,
                is_dir=is_dir,
            )
        finally:
            reader.close()

    def _mapped_changes(
        self, changes: Changes, green: str, base: int, work: Volume | None = None
    ) -> tuple[Changes, list[dict[str, Any]]]:
        """Changes made since `base`, mapped to the green head, or the conflicts' wire."""
        mapped, conflicts = self.service.ledger.map_to_head(green, base, changes)
        snapshot_id = self.service.ledger.greens[green][base].snapshot_id
        originals = tuple(c for c in changes if isinstance(c, merge_changes.Edit))
        found = [
            self._conflict_wire(conflict, snapshot_id, version, work, originals)
            for conflict, version in conflicts
        ]
        return mapped, found

    # -- conflicts as the wire carries them ---------------------------------------

    def _conflict_wire(
        self,
        conflict: merge_changes.Conflict,
        base_snapshot: str,
        version: Version,
        work: Volume | None = None,
        originals: Changes = (),
    ) -> dict[str, Any]:
        """A conflict as the wire carries it, with the base bytes of its range and, for
        byte ranges, the smallest region where the accepted and proposed bytes differ
        (slates.merge.report).  Files are read only here: a conflict is rare."""
        wire = merge_changes.conflict_to_wire(conflict)
        wire["version"] = version.number
        if conflict.base is None or not conflict.ino:
            return wire
        snapshots, host = self.service.snapshots, self.service.host
        base = Volume.clone(snapshots[base_snapshot], host)
        head = Volume.clone(snapshots[version.snapshot_id], host)
        try:
            start, end = conflict.base
            wire["base_bytes"] = base.read(conflict.ino, start, end - start)
        except SlatesError:
            wire["base_bytes"] = None
        try:
            wire["region"] = _region(conflict, base, head, work, originals)
        finally:
            base.close()
            head.close()
        return wire

    # -- moving volumes onto versions ----------------------------------------------

    def _restart_as(
        self, vid: str, snapshot_id: str, changes: Changes, now: int, private: Changes = ()
    ) -> tuple[Volume, Changes]:
        """Make `vid` a clone of the snapshot with `changes` applied, or change nothing.

        The new volume replaces the old one only if every change applied; its
        records are journaled after a VolumeReset, so replay rebuilds it the
        same way.  It keeps the old one's inode numbering, open handles and
        kernel references (an inode the snapshot lacks stays as an orphan), so
        a mount goes on; what changed under the mount is invalidated.  The
        `private` changes (a work volume's own, never submitted) are applied
        after `changes` and keep their times, so build tools see them as built.
        """
        service = self.service
        old = service.volumes[vid]
        mark = len(service._events)
        fresh = Volume.clone(
            service.snapshots[snapshot_id], service.host, Capacity(old.bounded, old.limit)
        )
        # Objects the changes make again keep their numbers; a kernel reference to
        # one is taken up once it exists (the others' before any record, as replay).
        remade = tuple(
            sorted(
                -c.key
                for c in (*changes, *private)
                if isinstance(c, merge_changes.Add) and c.key < 0 and old.handles(-c.key)
            )
        )
        # Kept, not applied: the volume is rebuilt here, as replay rebuilds it.
        service._events.append(VolumeReset(vid, snapshot_id, remade))
        fresh.number_from(*old.numbering)
        fresh.adopt_handles(old, remade)
        service._watch(vid, fresh)

        def kept_times(ino: int) -> tuple[int, int] | None:
            inode = old.root.inodes.get(ino)
            return None if inode is None else (inode.atime_ns, inode.mtime_ns)

        try:
            applied = merge_tree.apply(fresh, changes, now)
            merge_tree.apply(fresh, private, now, kept_times)
            for ino in remade:
                fresh.retain(ino, old.handles(ino))
        except BaseException:
            del service._events[mark:]
            fresh.close()
            raise
        if old.held_inodes():
            service.moved.setdefault(vid, []).extend(
                merge_tree.changed_entries(old.root, fresh.root)
            )
        service._retire(old)
        service.volumes[vid] = fresh
        return fresh, applied

    def _unchanged_since_held(self, vid: str, volume: Volume) -> bool:
        """For a work volume accepted but left on its base: True if nothing changed since.

        Its later changes cannot be told from the ones already accepted (it kept
        its base), so they are refused, never merged twice or dropped.
        """
        role = self.service.ledger.works[vid].role
        if not isinstance(role, Held):
            return False
        if merge_tree.changed_since(self.service.snapshots[role.snapshot_id].root, volume.root):
            raise InvalidArgument(
                "this work volume was accepted but could not move onto its version "
                "(no room) and has changed since; its new changes cannot be separated "
                "from the accepted ones: make them in a new work volume",
                volume=vid,
                version=role.version,
            )
        return True

    # -- submit and rebase -----------------------------------------------------------

    @staticmethod
    def _submit_reply(
        ledger: list[Version], submission: Submission, **fields: Any
    ) -> dict[str, Any]:
        reply: dict[str, Any] = {
            "ok": True,
            "version": len(ledger) - 1,
            "conflicts": [],
            "made_version": False,
            "nothing": False,
            "dry_run": False,
            "private": submission.private_paths,
            "paths": sorted(merge_changes.changed_paths(submission.public)),
            "refined": list(submission.refined),
            "literal": list(submission.literal),
        }
        reply.update(fields)
        return reply

    def _submit(self, args: dict[str, Any], now: int) -> dict[str, Any]:
        vid, volume, green, base = self._work(args)
        dry_run = bool_arg(args, "dry_run")
        service = self.service
        if not dry_run:  # a fleet host that cannot prove it owns the green makes no version
            service.fence.admit(service.index, green)
        ledger = service.ledger.greens[green]
        if self._unchanged_since_held(vid, volume):
            return self._submit_reply(ledger, _NOTHING, nothing=True, dry_run=dry_run)
        if not dry_run:
            volume.seal()
        submission = self._prepare(volume, green, base)
        if dry_run:  # what would be submitted, and whether it would conflict
            found = self._mapped_changes(submission.public, green, base, volume)[1]
            return self._submit_reply(
                ledger,
                submission,
                dry_run=True,
                nothing=not submission.public,
                ok=not found,
                conflicts=found,
            )
        if not submission.public:
            return self._submit_reply(ledger, submission, nothing=True)
        changes, conflicts = self._mapped_changes(submission.public, green, base, volume)
        if conflicts:
            return self._submit_reply(
                ledger, submission, ok=False, version=None, conflicts=conflicts
            )
        if not changes:  # only what the head holds already
            return self._submit_reply(ledger, submission, nothing=True)
        head = ledger[-1]
        try:
            fresh, applied = self._restart_as(green, head.snapshot_id, changes, now)
        except merge_tree.ApplyConflict as on_head:
            wire = self._conflict_wire(on_head.conflict, ledger[base].snapshot_id, head)
            return self._submit_reply(ledger, submission, ok=False, version=None, conflicts=[wire])
        snapshot = fresh.snapshot(service._new_id("snap"))
        originals = tuple(c for c in submission.public if isinstance(c, merge_changes.Edit))
        service._emit(VersionMade(green, snapshot.snapshot_id, base, vid, applied, originals))
        self.prune(green)
        # The work volume moves onto the version it made, with its private paths,
        # so its next submission holds only what it changes from now on.  A
        # mounted one keeps every inode number the kernel holds.
        try:
            self._restart_as(vid, snapshot.snapshot_id, (), now, submission.private)
        except (SlatesError, merge_tree.ApplyConflict) as failure:
            # No room for the move (a bounded volume), say: it keeps its base.
            held = volume.snapshot(service._new_id("snap"))
            service._emit(WorkHeld(vid, len(ledger) - 1, held.snapshot_id))
            return self._submit_reply(
                ledger, submission, made_version=True, rebased=False, kept_base=str(failure)
            )
        service._emit(WorkRebased(vid, len(ledger) - 1))
        return self._submit_reply(ledger, submission, made_version=True, rebased=True)

    def _rebase(self, args: dict[str, Any], now: int) -> dict[str, Any]:
        vid, volume, green, base = self._work(args)
        ledger = self.service.ledger.greens[green]
        if self._unchanged_since_held(vid, volume):
            # All of it is in the head already, but for its private paths.
            submission = self._prepare(volume, green, base)
            changes: Changes = ()
            conflicts: list[dict[str, Any]] = []
        else:
            volume.seal()  # sealed content can move onto the head as it is
            submission = self._prepare(volume, green, base)
            changes, conflicts = self._mapped_changes(submission.public, green, base, volume)
        if conflicts:
            return {"ok": False, "version": base, "conflicts": conflicts}
        try:
            self._restart_as(vid, ledger[-1].snapshot_id, changes, now, submission.private)
        except merge_tree.ApplyConflict as on_head:
            wire = self._conflict_wire(on_head.conflict, ledger[base].snapshot_id, ledger[-1])
            return {"ok": False, "version": base, "conflicts": [wire]}
        self.service._emit(WorkRebased(vid, len(ledger) - 1))
        return {"ok": True, "version": len(ledger) - 1, "conflicts": []}

    def prune(self, green: str) -> list[int]:
        """Drop the content and edits of versions nothing needs any more (Ledger.prunable;
        not one a landing plan lands)."""
        pruned = self.service.ledger.prunable(green, self.service.desk.sources())
        if pruned:
            self.service._emit(VersionsPruned(green, tuple(pruned)))
        return pruned


def _region(
    conflict: merge_changes.Conflict,
    base: Volume,
    head: Volume,
    work: Volume | None,
    originals: Changes,
) -> dict[str, Any] | None:
    own = next(
        (c.edits for c in originals if isinstance(c, merge_changes.Edit) and c.ino == conflict.ino),
        (),
    )
    at = merge_report.proposed_offset(own, conflict)
    if work is None or at is None:
        return None
    try:
        head_file, base_file = _whole(head, conflict.ino), _whole(base, conflict.ino)
        # A file saved over (sed -i) is another object in the work volume, at the path.
        inode = work.root.inodes.get(conflict.ino)
        mine = conflict.ino if inode is not None and inode.nlink else work.resolve(conflict.path)
        work_file = _whole(work, mine)
    except SlatesError:
        return None
    if max(len(head_file), len(work_file), len(base_file)) > MAX_REPORTED_FILE:
        return None
    region = merge_report.smallest_region(
        conflict, head_file=head_file, work_file=work_file, proposed_at=at, base_file=base_file
    )
    return None if region is None else merge_report.region_to_wire(region)
