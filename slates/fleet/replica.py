"""Versions of a real green as ledger values: export trees, replay plans, successors.

Theory of operation (DESIGN.md section 7, "Replication" and "Failover").
The pure ledger machines (`holder.Holder`, `recovery`, `copies.Copies`)
replicate a green whose content is one byte string.  A real green is a
tree of files, so the fleet link (slates.fleet.link_replicate) gives them
one: the content of a version is its *tree record* (`encode_tree`), a
msgpack list of `TreeEntry` (path, kind, mode, symlink target, for a
file the BLAKE3 ids and sizes of its bytes in pieces of at most
CHUNK_BYTES, and its owner, group and modification time; format 1 records,
written before those, read as uid 0, gid 0, time 0).  The file bytes are
chunks by those ids, the tree record is a chunk too, so a version
exported by the owner is self-contained: its tree record plus every chunk
it names, each verified by its BLAKE3 id at the holder (`ledger.ChunkStore.put`).

Version v of the green is ledger position v + 1 (position 0 is the
ledger's empty genesis): `version_value` makes the position's `Value`
with `ledger.make_value`, one Replace of the whole previous tree record by
the new one, so `recovery.verify` recomputes the chain of tree records and
checks each root.  `place_manifest` is what a holder must hold before it
acknowledges placement: the tree record's chunk and every file chunk (the
Value's own manifest names only the tree record; the file chunks travel
with it).

`replay_plan(old, new)` is the successor's side: the shard requests that
turn a work volume holding tree `old` into tree `new` (removals deepest
first, then directories shallowest first, then files and symlinks), so
each adopted version is submitted as one version of the successor's
local green and the numbering stays the same.

`choose_successor` picks, from a green's holder candidates, the host that
takes over when its owner's host is declared dead: the first candidate
host (by host id) that serf sees alive, other than the dead one; every
link computes the same answer from the same verdicts, and etcd's
transaction (compare the old epoch) decides anyway.  `successor_config` is
the configuration it commits.  Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

import msgpack

from slates.errors import InvalidArgument, VerificationFailed
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.ledger import RequestId, Value, chunk_id, make_value
from slates.merge.ranges import Replace

__all__ = [
    "CHUNK_BYTES",
    "Kind",
    "ShardOp",
    "TreeEntry",
    "choose_successor",
    "decode_tree",
    "encode_tree",
    "file_chunks",
    "place_manifest",
    "position_of",
    "replay_plan",
    "successor_config",
    "version_value",
]

CHUNK_BYTES: Final = 4 << 20  # a file's bytes travel in pieces of this size at most
TREE_FORMAT: Final = 2  # 1: the same rows without uid, gid and mtime_ns (still read)
MAX_TREE_ENTRIES: Final = 1 << 20
EXPORT_CLIENT: Final = "fleet-export"
Kind = Literal["file", "dir", "symlink"]
KINDS: Final = frozenset({"file", "dir", "symlink"})


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class TreeEntry:
    path: str  # relative, "/"-separated, never empty
    kind: str
    mode: int
    target: str = ""  # a symlink's target
    chunks: tuple[tuple[bytes, int], ...] = ()  # a file's pieces: (BLAKE3 id, size)
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument("a tree entry is a file, dir or symlink", kind=self.kind)
        parts = self.path.split("/")
        if not self.path or any(p in ("", ".", "..") for p in parts):
            raise InvalidArgument("a tree path is relative and normal", path=self.path)
        if self.kind != "file" and self.chunks:
            raise InvalidArgument("only files have bytes", path=self.path)
        if min(self.uid, self.gid, self.mtime_ns) < 0:
            raise InvalidArgument("owner, group and time are not negative", path=self.path)

    @property
    def size(self) -> int:
        return sum(size for _, size in self.chunks)

    def same_content(self, other: TreeEntry | None) -> bool:
        """The same path, kind, mode, target and bytes (owner and time aside)."""
        return (
            other is not None
            and dataclasses.replace(other, uid=self.uid, gid=self.gid, mtime_ns=self.mtime_ns)
            == self
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ShardOp:
    """One request of a replay: `op` with `args` on the work volume."""

    op: str
    args: dict[str, Any]


def position_of(version: int) -> int:
    """The ledger position of green version `version` (module doc)."""
    if version < 0:
        raise InvalidArgument("versions start at 0", version=version)
    return version + 1


def file_chunks(data: bytes) -> tuple[tuple[tuple[bytes, int], ...], dict[bytes, bytes]]:
    """A file's pieces (ids and sizes) and the chunks by id."""
    pieces: list[tuple[bytes, int]] = []
    chunks: dict[bytes, bytes] = {}
    for at in range(0, len(data), CHUNK_BYTES):
        piece = data[at : at + CHUNK_BYTES]
        digest = chunk_id(piece)
        pieces.append((digest, len(piece)))
        chunks[digest] = piece
    return tuple(pieces), chunks


def encode_tree(entries: Iterable[TreeEntry]) -> bytes:
    """The tree record: entries sorted by path, one msgpack list with a format number."""
    ordered = sorted(entries, key=lambda e: e.path)
    paths = [e.path for e in ordered]
    if len(set(paths)) != len(paths):
        raise InvalidArgument("a tree names each path once")
    rows = [
        [e.path, e.kind, e.mode, e.target, [list(c) for c in e.chunks], e.uid, e.gid, e.mtime_ns]
        for e in ordered
    ]
    return bytes(msgpack.packb([TREE_FORMAT, rows], use_bin_type=True))


def decode_tree(data: bytes) -> tuple[TreeEntry, ...]:
    """The entries of a tree record (VerificationFailed if it is not one)."""
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=True)
        fmt, rows = raw
        if fmt not in (1, TREE_FORMAT) or not isinstance(rows, list):
            raise ValueError("format")
        if len(rows) > MAX_TREE_ENTRIES:
            raise ValueError("too many entries")
        width = 5 if fmt == 1 else 8
        if any(not isinstance(row, list) or len(row) != width for row in rows):
            raise ValueError("a row of another format")
        entries = tuple(
            TreeEntry(
                str(row[0]),
                str(row[1]),
                int(row[2]),
                str(row[3]),
                tuple((bytes(c), int(s)) for c, s in row[4]),
                *(int(v) for v in row[5:]),
            )
            for row in rows
        )
    except (ValueError, TypeError, msgpack.UnpackException, InvalidArgument) as error:
        raise VerificationFailed("a tree record does not decode") from error
    if [e.path for e in entries] != sorted({e.path for e in entries}):
        raise VerificationFailed("a tree record's paths are not sorted and unique")
    return entries


def version_value(
    owner_host: str,
    version: int,
    previous_tree: bytes,
    tree: bytes,
    request: RequestId | None = None,
) -> tuple[Value, bytes]:
    """The ledger value of green version `version` and its tree chunk's id.

    `request` is the identity of the remote submission that made the version
    (slates.fleet.link_identity), so a successor answers its retry with this
    version; without one the request id names the owner host and the position
    (a local client's submission: its shard keeps saved replies itself)."""
    position = position_of(version)
    if request is None:
        request = RequestId(owner_host, EXPORT_CLIENT, position)
    value, _chunks, content = make_value(
        request, 0, position - 1, previous_tree, [Replace(0, len(previous_tree), tree)]
    )
    if content != tree:
        raise VerificationFailed("a version's value does not rebuild its tree")
    return value, chunk_id(tree)


def place_manifest(tree: bytes) -> tuple[tuple[bytes, int], ...]:
    """Every chunk a holder needs for a version: its tree record's, then its files'."""
    seen: dict[bytes, int] = {chunk_id(tree): len(tree)}
    for entry in decode_tree(tree):
        for chunk, size in entry.chunks:
            seen.setdefault(chunk, size)
    return tuple(seen.items())


def replay_plan(
    old: Sequence[TreeEntry], new: Sequence[TreeEntry], contents: Mapping[bytes, bytes]
) -> list[ShardOp]:
    """The requests that turn tree `old` into tree `new` on a work volume (module doc).

    `contents` has the bytes of every chunk a new or changed file names (one
    that is absent or of another size is VerificationFailed).  A directory's
    mode change is not replayed (known gap)."""
    before = {e.path: e for e in old}
    after = {e.path: e for e in new}
    gone = [e for p, e in before.items() if p not in after or after[p].kind != e.kind]
    ops: list[ShardOp] = []
    for entry in sorted(gone, key=lambda e: (-e.path.count("/"), e.path)):
        op = "rmdir" if entry.kind == "dir" else "unlink"
        ops.append(ShardOp(op, {"path": "/" + entry.path}))
    removed = {e.path for e in gone}
    for entry in sorted(new, key=lambda e: (e.path.count("/"), e.path)):
        previous = None if entry.path in removed else before.get(entry.path)
        path = "/" + entry.path
        match entry.kind:
            case "dir":
                if previous is None:
                    ops.append(ShardOp("mkdir", {"path": path, "mode": entry.mode}))
            case "symlink":
                if entry.same_content(previous):
                    continue
                if previous is not None:
                    ops.append(ShardOp("unlink", {"path": path}))
                ops.append(ShardOp("symlink", {"path": path, "target": entry.target}))
            case _:
                if not entry.same_content(previous):
                    ops.extend(_file_ops(path, entry, contents))
    return ops


def _file_ops(path: str, entry: TreeEntry, contents: Mapping[bytes, bytes]) -> list[ShardOp]:
    ops: list[ShardOp] = []
    offset = 0
    for index, (chunk, size) in enumerate(entry.chunks):
        data = contents.get(chunk)
        if data is None or len(data) != size:
            raise VerificationFailed("a replayed file's chunk is not held", path=path)
        args: dict[str, Any] = {"path": path, "data": data, "offset": offset, "mode": entry.mode}
        if index == 0:
            args["truncate"] = True
        ops.append(ShardOp("write", args))
        offset += size
    if not entry.chunks:
        ops.append(
            ShardOp("write", {"path": path, "data": b"", "truncate": True, "mode": entry.mode})
        )
    return ops


def choose_successor(config: GreenConfig, dead_host: str, alive_hosts: Iterable[str]) -> str | None:
    """The holder candidate that takes over `config`'s green (module doc), or None."""
    if config.owner.host != dead_host:
        return None
    alive = set(alive_hosts) - {dead_host}
    hosts = sorted(c.peer.host for s in config.sets() for c in s.candidates)
    return next((h for h in hosts if h in alive), None)


def successor_config(config: GreenConfig, me: Peer) -> GreenConfig:
    """`config` owned by `me` at the next epoch (the same holder sets)."""
    return dataclasses.replace(config, epoch=config.epoch + 1, owner=me)
