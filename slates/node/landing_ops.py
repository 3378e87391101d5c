"""The landing operations of a shard: plans, manifests, grants and applying them.

Theory of operation (DESIGN.md section 6).  `LandingOps.run` answers the
`land.*` requests for one shard's service: a plan compares a green version
(or a snapshot of a work volume) with the green's version 0 (the witness)
and registers its manifest with the service's `LandingDesk`, which holds
manifests and grants and applies a granted landing to disk.  Everything it
changes goes through the service's journal (`_emit`).  Called by
slates.node.service for every `land.*` operation.

- `land.check` tells, for the approval screen, what each entry would do
  if landed now and why a conflict would be one (reads the disk only).
- `land.rewitness` with merge (slates.land.merge) merges the developer's
  outside edit of a file into the proposal when the two do not overlap:
  the new manifest witnesses the disk and proposes the merged bytes, which
  the desk holds (no snapshot has them); `_proposed_content` and
  `_witness_content` look there first, then in the snapshots.
- Private paths (`.git/`, ignored files) are never planned: `_private`
  is the one place a plan asks which paths those are.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import posixpath
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import blake3

from slates.core.records import Kind
from slates.core.volume import Volume
from slates.errors import InvalidArgument, MissingContent, NotFound, SlatesError
from slates.land.manifest import Entry, Manifest, State, check_relative
from slates.land.merge import Merged, Unmerged, merge_entry, needs_merge
from slates.node.args import int_arg as _int_arg
from slates.node.args import str_arg as _str_arg
from slates.node.jobs import JobBody
from slates.node.landing import LandingDesk

if TYPE_CHECKING:
    from slates.node.service import ShardService

__all__ = ["LandingOps"]


class LandingOps:
    def __init__(self, service: ShardService) -> None:
        self.service = service

    def _manifest_ref(self, manifest_id: str) -> str:
        return f"man-{self.service.index}-{manifest_id}"

    def _manifest_arg(self, args: dict[str, Any]) -> Manifest:
        ref = _str_arg(args, "manifest")
        parts = ref.split("-")
        if len(parts) != 3 or parts[0] != "man" or parts[1] != str(self.service.index):
            raise InvalidArgument("malformed manifest id for this shard", manifest=ref)
        return self.service.desk.manifest(parts[2])

    def _manifest_view(self, manifest: Manifest) -> dict[str, Any]:
        identity = manifest.target_identity
        return {
            "manifest": self._manifest_ref(manifest.manifest_id),
            "target_identity": None if identity is None else list(identity),
            "id": manifest.manifest_id,
            "source": manifest.source,
            "target": manifest.target,
            "entries": [
                {
                    "path": e.path,
                    "witnessed": None if e.witnessed is None else e.witnessed.to_wire(),
                    "proposed": None if e.proposed is None else e.proposed.to_wire(),
                }
                for e in manifest.entries
            ],
        }

    def run(self, op: str, args: dict[str, Any]) -> Any:
        match op:
            case "land.plan":
                return self._manifest_view(self._plan(args))
            case "land.show":
                return self._manifest_view(self._manifest_arg(args))
            case "land.read_base":
                manifest = self._manifest_arg(args)
                return self.service.desk.read_base(manifest, _str_arg(args, "path"))
            case "land.content":
                manifest = self._manifest_arg(args)
                path = _str_arg(args, "path").strip("/")
                return {
                    "proposed": self._proposed_content(manifest, path),
                    "disk": self.service.desk.read_base(manifest, path),
                }
            case "land.check":
                manifest = self._manifest_arg(args)
                return {
                    "manifest": self._manifest_ref(manifest.manifest_id),
                    "target": manifest.target,
                    "entries": self.service.desk.check(manifest),
                }
            case "land.rewitness":
                manifest = self._manifest_arg(args)
                paths = args.get("paths")
                if paths is not None and not (
                    isinstance(paths, list) and all(isinstance(p, str) for p in paths)
                ):
                    raise InvalidArgument("paths must be a list of paths")
                merge = args.get("merge", False)
                if not isinstance(merge, bool):
                    raise InvalidArgument("merge is true or false")
                if merge:
                    return self._rewitness_merging(manifest, paths)
                observed = self.service.desk.observe(manifest, paths)
                # Held content it still names (a merged proposal) stays held for it.
                renewed = self.service.desk.register(
                    manifest.rewitnessed(observed), self.service._emit
                )
                return self._manifest_view(renewed)
            case "land.grant":
                manifest = self._manifest_arg(args)
                token = self.service.desk.grant(
                    manifest.manifest_id,
                    args.get("credential"),
                    args.get("nonce"),
                    self.service._emit,
                )
                return {"grant": token, "manifest": self._manifest_ref(manifest.manifest_id)}
            case "land.apply":
                return self._apply(self._manifest_arg(args), _str_arg(args, "grant"))
            case _:
                raise InvalidArgument("unknown operation", op=op)

    def _apply(self, manifest: Manifest, grant: str) -> JobBody:
        """A landing, as a job: its disk writes run off the shard's loop (LandingDesk.land)."""
        result: dict[str, Any] = yield from self.service.desk.land(
            manifest,
            grant,
            lambda path: self._proposed_content(manifest, path),
            self.service._emit,
        )
        result["manifest"] = self._manifest_ref(manifest.manifest_id)
        if result["complete"]:
            self._note_landed(manifest.source)
        return result

    def _note_landed(self, source: str) -> None:
        """A green version landed whole: the green no longer holds unlanded work up to it."""
        for green, ledger in self.service.greens.items():
            for version in ledger:
                if version.snapshot_id == source:
                    self.service._emit(["landed", green, version.number])
                    return

    def _rewitness_merging(self, manifest: Manifest, paths: list[str] | None) -> dict[str, Any]:
        """`rewitness --merge`: every selected entry that would conflict because of an
        outside edit of a file gets the disk as its witness and, when the edit does not
        overlap the proposal, the two merged as its proposal; the rest stay as they are."""
        chosen = {e.path for e in (manifest.select(paths) if paths else manifest).entries}
        if paths and not chosen:
            raise InvalidArgument("no entry of the manifest is at these paths", paths=paths[:8])
        desk = self.service.desk
        disk_states = desk.disk_states(manifest, chosen)
        held: dict[str, bytes] = {}  # the merged proposals and the disk bytes they witness
        entries: list[Entry] = []
        merged: list[str] = []
        unmerged: list[dict[str, str]] = []
        for entry in manifest.entries:
            disk_state = disk_states.get(entry.path)
            if entry.path not in chosen or not needs_merge(entry, disk_state):
                entries.append(entry)
                continue
            result = self._merge_one(manifest, entry, disk_state)
            match result:
                case Merged():
                    entries.append(result.entry)
                    merged.append(entry.path)
                    proposed, witnessed = result.entry.proposed, result.entry.witnessed
                    if proposed is not None and proposed.digest is not None:
                        held[proposed.digest] = result.content
                    if witnessed is not None and witnessed.digest is not None:
                        held[witnessed.digest] = result.disk
                case Unmerged():
                    entries.append(entry)
                    unmerged.append({"path": result.path, "reason": result.reason})
        renewed = dataclasses.replace(manifest, entries=tuple(entries))
        desk.register(renewed, self.service._emit, held)
        view = self._manifest_view(renewed)
        view["merged"] = merged
        view["unmerged"] = unmerged
        return view

    def _merge_one(
        self, manifest: Manifest, entry: Entry, disk_state: State | None
    ) -> Merged | Unmerged:
        mergeable = all(
            s is not None and s.kind == "file"
            for s in (entry.witnessed, entry.proposed, disk_state)
        )
        witness = disk = proposal = None
        if mergeable:
            try:
                witness = self._witness_content(manifest, entry)
                disk = self.service.desk.read_base(manifest, entry.path)
                proposal = self._proposed_content(manifest, entry.path)
            except SlatesError as exc:
                return Unmerged(entry.path, f"cannot read it to merge: {exc}")
        return merge_entry(entry, disk_state, witness, disk, proposal)

    def _witness_content(self, manifest: Manifest, entry: Entry) -> bytes | None:
        """The witnessed bytes of a file entry: held by the desk (a merge's base), or in
        version 0 of a green volume (captured from the target), checked by BLAKE3."""
        state = entry.witnessed
        if state is None or state.kind != "file":
            return None
        held = self.service.desk.content(state)
        if held is not None:
            return held
        target = os.path.realpath(manifest.target)
        greens = sorted(
            self.service.greens,
            key=lambda g: self.service.green_sources.get(g) != target,  # the target's first
        )
        for green in greens:
            snapshot = self.service.snapshots.get(self.service.greens[green][0].snapshot_id)
            if snapshot is None:
                continue
            data = self._file_in(snapshot.root, entry.path)
            if data is not None and blake3.blake3(data).hexdigest() == state.digest:
                return data
        return None

    def _file_in(self, root: Any, path: str) -> bytes | None:
        reader = self.service._reader(root)
        try:
            try:
                ino = reader.resolve("/" + path)
            except NotFound:
                return None
            attr = reader.getattr(ino)
            return reader.read(ino, 0, attr.size) if attr.kind == Kind.FILE else None
        finally:
            reader.close()

    def _private(self, green: str, source: str) -> Callable[[str, bool], bool]:
        """Which paths of the proposal are private to work volumes (never landed), asked
        with a manifest path (relative) and whether it is a directory: the green's rule,
        with the ignore files the proposal holds."""
        matcher = self.service.private_matcher(green, self.service.snapshots[source].root)

        def private(path: str, is_dir: bool) -> bool:
            return matcher.is_private("/" + path, is_dir)  # volume paths are absolute

        return private

    def _plan(self, args: dict[str, Any]) -> Manifest:
        vid, volume = self.service._volume(args)
        target = _str_arg(args, "target")
        if not target.startswith("/"):
            raise InvalidArgument("the target is an absolute directory path", target=target)
        paths = args.get("paths")
        if paths is not None and not (
            isinstance(paths, list) and all(isinstance(p, str) for p in paths)
        ):
            raise InvalidArgument("paths must be a list of paths")
        for path in paths or ():
            if path.strip("/"):
                check_relative(path.strip("/"))
        green = vid if vid in self.service.greens else self.service.works.get(vid, ("", 0))[0]
        identity = self.service._check_unprotected(  # before any realpath
            target, "target", agents_allowed_roots=vid not in self.service.greens
        )
        source_dir = self.service.green_sources.get(green)
        if source_dir is not None and os.path.realpath(target) != source_dir:
            raise InvalidArgument(
                "a green volume lands only into the directory it was captured from",
                target=target,
                directory=source_dir,
            )
        if vid in self.service.greens:
            ledger = self.service.greens[vid]
            version = _int_arg(args, "version", len(ledger) - 1)
            if version >= len(ledger):
                raise NotFound("no such version", green=vid, version=version)
            source, witness = ledger[version].snapshot_id, ledger[0].snapshot_id
            if not source:
                raise NotFound("that version was pruned (green create --keep)", version=version)
        elif vid in self.service.works and self.service.works[vid][0] in self.service.greens:
            source = volume.snapshot(self.service._new_id("snap")).snapshot_id
            witness = self.service.greens[self.service.works[vid][0]][0].snapshot_id
        else:
            raise InvalidArgument(
                "a landing plan needs a green or work volume (its version 0 is the witness)",
                volume=vid,
            )
        readers: dict[int, Volume] = {}

        def read(root: Any, ino: int) -> bytes:
            reader = readers.get(id(root))
            if reader is None:
                reader = readers[id(root)] = self.service._reader(root)
            return reader.read(ino, 0, reader.getattr(ino).size)

        try:
            manifest = LandingDesk.plan(
                self.service.snapshots[witness].root,
                self.service.snapshots[source].root,
                source,
                posixpath.normpath(target),
                read,
                [str(p) for p in paths] if paths else None,
                self._private(green, source),
                identity,
            )
        finally:
            for reader in readers.values():
                reader.close()
        return self.service.desk.register(manifest, self.service._emit)

    def _proposed_content(self, manifest: Manifest, path: str) -> bytes | None:
        """The proposed bytes at `path`: held by the desk (a merged proposal), or read
        from the proposal's snapshot."""
        at = bisect.bisect_left(manifest.entries, path, key=lambda e: e.path)  # sorted
        if at < len(manifest.entries) and manifest.entries[at].path == path:
            held = self.service.desk.content(manifest.entries[at].proposed)
            if held is not None:
                return held
        snapshot = self.service.snapshots.get(manifest.source)
        if snapshot is None:
            raise MissingContent("the landing's snapshot is gone", snapshot=manifest.source)
        reader = self.service._reader(snapshot.root)
        try:
            try:
                ino = reader.resolve("/" + path)
            except NotFound:
                return None
            attr = reader.getattr(ino)
            if attr.kind == Kind.SYMLINK:
                return reader.readlink(ino).encode("utf-8", "surrogateescape")
            if attr.kind == Kind.DIR:
                return None
            return reader.read(ino, 0, attr.size)
        finally:
            reader.close()
