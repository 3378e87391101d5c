"""The fleet link's view of a shard's green as trees: export a version, import a chain.

Theory of operation (slates.fleet.link_replicate is the caller; its
docstring says why).  `ShardTrees` speaks only ordinary shard requests,
through the link's own client (one at a time):

- `export(shard, green, version)`: the version's snapshot is cloned into a
  scratch volume (`fleet-export-*`), walked (`list`, `stat`, `readlink`,
  `read` in READ_PIECE pieces) into `replica.TreeEntry` records and chunks,
  and the clone is deleted (also when the walk fails);
- `import_green(name, trees, store)`: a chain of tree records becomes a new
  local green on shard 0: version 0 captured from a directory written in
  TMPDIR/slates-fleet-import-<uuid>, mode 0700 (removed afterwards; the
  capture holds the bytes; not the runtime directory, where a shard refuses
  to capture),
  each later version one submission of a scratch work volume
  (`fleet-replay-*`, deleted after) replaying `replica.replay_plan`, whose
  number must be the version's (VerificationFailed otherwise).  While it
  runs, the green's local name is in `importing`, so the link's
  registration does not register it as a green of this host.

Bounds: MAX_WALK_ENTRIES entries and MAX_EXPORT_BYTES bytes per export
(CapacityExhausted).  Chunks are checked against their BLAKE3 ids before
they are written.  Known gap: a directory's mode change is not replayed,
and every export walks the whole tree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import trio

from slates.errors import CapacityExhausted, NotFound, SlatesError, VerificationFailed
from slates.fleet.ledger import ChunkStore, chunk_id
from slates.fleet.replica import TreeEntry, decode_tree, encode_tree, file_chunks, replay_plan

__all__ = ["IMPORT_DIR", "MAX_EXPORT_BYTES", "ShardTrees"]

MAX_EXPORT_BYTES: Final = 256 << 20
MAX_WALK_ENTRIES: Final = 1 << 16
READ_PIECE: Final = 8 << 20
IMPORT_DIR: Final = "slates-fleet-import"  # a fresh TMPDIR/slates-fleet-import-<uuid> each
VERSION_SLACK: Final = 16  # versions read beyond the one looked for (new ones may arrive)
VERSION_READS: Final = 3

ShardCall = Callable[[int, str, dict[str, Any]], Awaitable[Any]]


class ShardTrees:
    def __init__(
        self, shard_call: ShardCall, runtime_dir: Path, log: Callable[[str], None]
    ) -> None:
        self._shard = shard_call
        self.runtime_dir = runtime_dir
        self._log = log
        self.importing: set[str] = set()  # local names of greens being imported

    async def _walk(
        self,
        shard: int,
        volume: str,
        path: str,
        entries: list[TreeEntry],
        chunks: dict[bytes, bytes],
    ) -> None:
        listing = await self._shard(shard, "list", {"volume": volume, "path": "/" + path})
        if not isinstance(listing, list):
            raise VerificationFailed("list answered something other than a list")
        for item in listing:
            name, kind = str(item["name"]), str(item["kind"])
            child = f"{path}/{name}" if path else name
            if len(entries) >= MAX_WALK_ENTRIES:
                raise CapacityExhausted("a green too large to export", limit=MAX_WALK_ENTRIES)
            stat = await self._shard(shard, "stat", {"volume": volume, "path": "/" + child})
            mode = int(stat["mode"]) & 0o7777
            uid, gid, mtime_ns = int(stat["uid"]), int(stat["gid"]), int(stat["mtime_ns"])
            match kind:
                case "dir":
                    entries.append(
                        TreeEntry(child, "dir", mode, uid=uid, gid=gid, mtime_ns=mtime_ns)
                    )
                    await self._walk(shard, volume, child, entries, chunks)
                case "symlink":
                    target = await self._shard(
                        shard, "readlink", {"volume": volume, "path": "/" + child}
                    )
                    entries.append(
                        TreeEntry(child, "symlink", mode, str(target), (), uid, gid, mtime_ns)
                    )
                case "file":
                    data = bytearray()
                    size = int(stat["size"])
                    while len(data) < size:
                        piece = await self._shard(
                            shard,
                            "read",
                            {
                                "volume": volume,
                                "path": "/" + child,
                                "offset": len(data),
                                "size": min(READ_PIECE, size - len(data)),
                            },
                        )
                        if not isinstance(piece, bytes) or not piece:
                            break  # the file shrank: what we read is the file
                        data += piece
                    pieces, found = file_chunks(bytes(data))
                    chunks.update(found)
                    if sum(len(c) for c in chunks.values()) > MAX_EXPORT_BYTES:
                        raise CapacityExhausted("a version too large to export here")
                    entries.append(TreeEntry(child, "file", mode, "", pieces, uid, gid, mtime_ns))
                case _:
                    raise VerificationFailed("an entry that is no file, dir or symlink", path=child)

    async def _version(self, shard: int, green: str, version: int) -> dict[str, Any]:
        """The ledger's entry for `version` (the head may move on between two reads)."""
        slack = VERSION_SLACK
        for _ in range(VERSION_READS):
            view = await self._shard(shard, "versions", {"green": green, "limit": 1})
            head = int(view["head"])
            if version > head:
                raise NotFound("no such version yet", version=version, head=head)
            limit = head - version + 1 + slack
            view = await self._shard(shard, "versions", {"green": green, "limit": limit})
            for entry in view["versions"]:
                if entry["version"] == version:
                    return dict(entry)
            slack *= 4  # submissions came in meanwhile: look further back
        raise NotFound("the version is no longer in the green's ledger", version=version)

    async def export(
        self, shard: int, green: str, version: int
    ) -> tuple[bytes, dict[bytes, bytes]]:
        """Version `version` of local green `green`: its tree record and chunks."""
        found = await self._version(shard, green, version)
        if found["pruned"]:
            raise NotFound("the version's snapshot is pruned", version=version)
        scratch = f"fleet-export-{uuid.uuid4().hex[:12]}"
        clone = await self._shard(shard, "clone", {"snapshot": found["snapshot"], "name": scratch})
        entries: list[TreeEntry] = []
        chunks: dict[bytes, bytes] = {}
        try:
            await self._walk(shard, str(clone["id"]), "", entries, chunks)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._shard(
                        shard, "volume.delete", {"volume": clone["id"], "force": True}
                    )
                except SlatesError as exc:
                    self._log(f"could not delete the export clone {clone['id']}: {exc.message}")
        return encode_tree(entries), chunks

    async def import_green(
        self, green: str, trees: list[bytes], store: ChunkStore
    ) -> tuple[int, str]:
        """Replay the adopted versions into a new local green (module doc)."""
        if not trees:
            raise VerificationFailed("an adopted green without version 0", green=green)
        shard = 0
        contents = {c: store.get(c) for c in store.raw()}
        name = f"{green} adopted {uuid.uuid4().hex[:8]}"
        self.importing.add(name)
        # Not under the runtime directory: a shard refuses to capture a base there.
        base_dir = Path(tempfile.gettempdir()) / f"{IMPORT_DIR}-{uuid.uuid4().hex}"
        try:
            first = decode_tree(trees[0])
            args: dict[str, Any] = {"name": name, "submit_ignored": True}
            if first:
                await trio.to_thread.run_sync(_write_tree, base_dir, first, contents)
                args["base"] = str(base_dir)
            made = await self._shard(shard, "green.create", args)
            local = str(made["id"])
            for version in range(1, len(trees)):
                await self._replay(shard, local, version, trees, contents)
            return shard, local
        finally:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(base_dir, ignore_errors=True))
            self.importing.discard(name)

    async def _replay(
        self, shard: int, local: str, version: int, trees: list[bytes], contents: dict[bytes, bytes]
    ) -> None:
        work = await self._shard(
            shard, "work.create", {"green": local, "name": f"fleet-replay-{uuid.uuid4().hex[:12]}"}
        )
        wid = str(work["id"])
        try:
            plan = replay_plan(
                decode_tree(trees[version - 1]), decode_tree(trees[version]), contents
            )
            for op in plan:
                await self._shard(shard, op.op, {"volume": wid, **op.args})
            reply = await self._shard(shard, "submit", {"volume": wid})
            if reply.get("version") != version:
                raise VerificationFailed(
                    "a replayed version got another number",
                    wanted=version,
                    got=reply.get("version"),
                )
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._shard(shard, "volume.delete", {"volume": wid, "force": True})
                except SlatesError as exc:
                    self._log(f"could not delete the replay volume {wid}: {exc.message}")


def _write_tree(root: Path, entries: tuple[TreeEntry, ...], contents: dict[bytes, bytes]) -> None:
    """Version 0's tree as files under `root` (directories' modes set last)."""
    root.mkdir(parents=True, mode=0o700)
    for entry in entries:
        path = root / entry.path
        match entry.kind:
            case "dir":
                path.mkdir(mode=0o700)
            case "symlink":
                os.symlink(entry.target, path)
            case _:
                with path.open("wb") as out:
                    for chunk, _ in entry.chunks:
                        data = contents[chunk]
                        if chunk_id(data) != chunk:
                            raise VerificationFailed("a chunk does not match its id")
                        out.write(data)
                os.chmod(path, entry.mode)
        os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
    for entry in sorted(entries, key=lambda e: -e.path.count("/")):
        if entry.kind == "dir":  # after their content, which changed their times
            os.chmod(root / entry.path, entry.mode)
            os.utime(root / entry.path, ns=(entry.mtime_ns, entry.mtime_ns))
