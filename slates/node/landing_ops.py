"""The landing operations of a shard: plans, manifests, grants and applying them.

Theory of operation (DESIGN.md section 6).  `LandingOps.run` answers the
`land.*` requests for one shard's service: a plan compares a green version
(or a snapshot of a work volume) with the green's version 0 (the witness)
and registers its manifest with the service's `LandingDesk`, which holds
manifests and grants and applies a granted landing to disk.  Everything it
changes goes through the service's journal (`_emit`).  Called by
slates.node.service for every `land.*` operation.
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING, Any

from slates.core.records import Kind
from slates.core.volume import Volume
from slates.errors import InvalidArgument, MissingContent, NotFound
from slates.land.manifest import Manifest, check_relative
from slates.node.args import int_arg as _int_arg
from slates.node.args import str_arg as _str_arg
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
        return {
            "manifest": self._manifest_ref(manifest.manifest_id),
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

    def _reader(self, root: Any) -> Volume:
        return Volume(self.service.host, root)

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
            case "land.rewitness":
                manifest = self._manifest_arg(args)
                paths = args.get("paths")
                if paths is not None and not (
                    isinstance(paths, list) and all(isinstance(p, str) for p in paths)
                ):
                    raise InvalidArgument("paths must be a list of paths")
                observed = self.service.desk.observe(manifest, paths)
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
                manifest = self._manifest_arg(args)
                result = self.service.desk.land(
                    manifest,
                    _str_arg(args, "grant"),
                    lambda path: self._proposed_content(manifest, path),
                    self.service._emit,
                )
                result["manifest"] = self._manifest_ref(manifest.manifest_id)
                return result
            case _:
                raise InvalidArgument("unknown operation", op=op)

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
        source_dir = self.service.green_sources.get(green)
        if source_dir is not None and os.path.realpath(target) != source_dir:
            raise InvalidArgument(
                "a green volume lands only into the directory it was captured from",
                target=target,
                directory=source_dir,
            )
        self.service._check_unprotected(target, "target")
        if vid in self.service.greens:
            ledger = self.service.greens[vid]
            version = _int_arg(args, "version", len(ledger) - 1)
            if version >= len(ledger):
                raise NotFound("no such version", green=vid, version=version)
            source, witness = ledger[version].snapshot_id, ledger[0].snapshot_id
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
                reader = readers[id(root)] = self._reader(root)
            return reader.read(ino, 0, reader.getattr(ino).size)

        try:
            manifest = LandingDesk.plan(
                self.service.snapshots[witness].root,
                self.service.snapshots[source].root,
                source,
                posixpath.normpath(target),
                read,
                [str(p) for p in paths] if paths else None,
            )
        finally:
            for reader in readers.values():
                reader.close()
        return self.service.desk.register(manifest, self.service._emit)

    def _proposed_content(self, manifest: Manifest, path: str) -> bytes | None:
        snapshot = self.service.snapshots.get(manifest.source)
        if snapshot is None:
            raise MissingContent("the landing's snapshot is gone", snapshot=manifest.source)
        reader = self._reader(snapshot.root)
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
