"""A remote green version as a volume's base: its tree record here, its bytes on demand.

Theory of operation (DESIGN.md section 7, "Remote reads").  A work volume
made on this host of a green owned on another host is an ordinary local
volume whose *base* is a `RemoteBase`: the version's tree record
(slates.fleet.replica: paths, kinds, modes, symlink targets, and per file
the BLAKE3 ids and sizes of its pieces), kept as one chunk of this shard's
chunk store.  The volume reads its base through the ordinary base-reader
protocol (slates.core.volume.BaseReader), so every rule of a volume over
a live base holds unchanged: unchanged names bind on first lookup, a write
copies only the touched pages, and the extents of untouched content stay
BaseSpans that name this base.

`read` answers from the pieces this shard's chunk store already holds.
When a piece a read needs is not there it raises MissingContent with
`remote` (the base key) and `chunks` (the hex ids it lacks, the read's own
pieces first and then the file's following pieces, up to READ_AHEAD_BYTES
in all): the caller (slates.node.remote_ops) fetches them off the shard's
loop, stores them, and runs the request again.  Nothing here waits for
the network, and nothing is stored here.

The base key names everything a restart needs to reopen the base:
`fleet:<green fleet name>:<version>:<tree id hex>` (`RemoteKey`); the tree
record is read back from the chunk store by its id.  Fingerprints never
drift: a piece is immutable, so a file's fingerprint is (0, its number in
the tree, its size, 0), unique per path.  A base entry has the owner, group
and mode its tree entry records, and its modification time as all three
times (a format 1 record, from before they were kept, reads 0).  Pure.
"""

from __future__ import annotations

import builtins
import dataclasses
import posixpath
from collections.abc import Callable, Iterator
from typing import Final

import blake3

from slates.core.records import BaseEntry, Fingerprint, Kind
from slates.errors import BaseDrift, InvalidArgument, MissingContent, VerificationFailed
from slates.fleet.replica import TreeEntry, decode_tree

__all__ = ["KEY_PREFIX", "READ_AHEAD_BYTES", "RemoteBase", "RemoteKey", "remote_key"]

KEY_PREFIX: Final = "fleet:"
READ_AHEAD_BYTES: Final = 16 << 20  # what one fetch asks for at most (whole pieces)
_KINDS: Final = {"file": Kind.FILE, "dir": Kind.DIR, "symlink": Kind.SYMLINK}
ROOT_MODE: Final = 0o755


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteKey:
    """Which green version a remote base is, and its tree record's id."""

    green: str  # the fleet name, "<id>@<host>"
    version: int
    tree: bytes  # BLAKE3 id of the tree record

    def text(self) -> str:
        return f"{KEY_PREFIX}{self.green}:{self.version}:{self.tree.hex()}"


def remote_key(key: str) -> RemoteKey | None:
    """The RemoteKey a base key names, None for any other base (a directory path)."""
    if not key.startswith(KEY_PREFIX):
        return None
    try:
        green, version, tree = key[len(KEY_PREFIX) :].rsplit(":", 2)
        parsed = RemoteKey(green, int(version), bytes.fromhex(tree))
    except ValueError:
        raise InvalidArgument("a malformed remote base key", key=key) from None
    if "@" not in green or parsed.version < 0 or len(parsed.tree) != 32:
        raise InvalidArgument("a malformed remote base key", key=key)
    return parsed


ChunkLookup = Callable[[bytes], "bytes | None"]


class RemoteBase:
    """A BaseReader over a tree record; piece bytes come from `lookup` (module doc)."""

    def __init__(self, key: RemoteKey, tree: bytes, lookup: ChunkLookup) -> None:
        if blake3.blake3(tree).digest() != key.tree:
            raise VerificationFailed("the tree record does not match its id", key=key.text())
        self.key = key
        self.root = key.text()  # what a checkpoint keeps to reopen it
        self._lookup = lookup
        self.entries: dict[str, TreeEntry] = {}
        self.numbers: dict[str, int] = {}
        self.children: dict[str, list[tuple[str, Kind]]] = {"/": []}
        for number, entry in enumerate(decode_tree(tree), start=2):
            path = "/" + entry.path
            parent, name = posixpath.split(path)
            if parent not in self.children:
                raise VerificationFailed("a tree entry's directory is not in the tree", path=path)
            self.entries[path] = entry
            self.numbers[path] = number
            self.children[parent].append((name, _KINDS[entry.kind]))
            if entry.kind == "dir":
                self.children[path] = []

    # -- the BaseReader protocol

    def stat(self, path: str) -> BaseEntry | None:
        if path == "/":
            return BaseEntry("/", Kind.DIR, ROOT_MODE, 0, 0, 0, 0, 0, 0, 0, Fingerprint(0, 1, 0, 0))
        entry = self.entries.get(path)
        if entry is None:
            return None
        size = entry.size if entry.kind == "file" else 0
        return BaseEntry(
            path=path,
            kind=_KINDS[entry.kind],
            mode=entry.mode & 0o7777,
            uid=entry.uid,
            gid=entry.gid,
            size=size,
            atime_ns=entry.mtime_ns,  # the record keeps one time: its modification
            mtime_ns=entry.mtime_ns,
            ctime_ns=entry.mtime_ns,
            rdev=0,
            fingerprint=self.fingerprint(path),
            target=entry.target,
        )

    def list(self, path: str) -> list[tuple[str, Kind]]:
        return list(self.children.get(path, ()))

    def read(self, path: str, fingerprint: Fingerprint, offset: int, size: int) -> bytes:
        entry = self.entries.get(path)
        if entry is None or entry.kind != "file" or fingerprint != self.fingerprint(path):
            raise BaseDrift("not a file of this remote version", path=path)
        pieces = list(_overlapping(entry, offset, size))
        missing: builtins.list[bytes] = [
            chunk for chunk, _start, _size in pieces if self._lookup(chunk) is None
        ]
        if missing:
            raise MissingContent(
                "the remote version's content is not on this host yet",
                remote=self.root,
                chunks=[c.hex() for c in self._with_read_ahead(entry, missing)],
            )
        out = bytearray()
        for chunk, start, piece_size in pieces:
            data = self._lookup(chunk)
            if data is None or len(data) != piece_size:
                raise MissingContent("a fetched piece went away", chunk=chunk.hex())
            lo = max(offset, start) - start
            hi = min(offset + size, start + piece_size) - start
            out += data[lo:hi]
        return bytes(out)

    # -- for the fetching side

    def fingerprint(self, path: str) -> Fingerprint:
        entry = self.entries[path]
        return Fingerprint(0, self.numbers[path], entry.size if entry.kind == "file" else 0, 0)

    def sizes(self) -> dict[bytes, int]:
        """Every piece this version names, with its size."""
        return {c: s for e in self.entries.values() for c, s in e.chunks}

    def chunk_ids(self) -> set[bytes]:
        """What this base keeps alive in the chunk store: its tree and its pieces."""
        return {self.key.tree, *self.sizes()}

    def _with_read_ahead(
        self, entry: TreeEntry, missing: builtins.list[bytes]
    ) -> builtins.list[bytes]:
        sizes = dict(entry.chunks)
        wanted: dict[bytes, None] = {}
        total = 0
        for chunk in missing:  # the read's own pieces, as many as one fetch carries
            if wanted and total + sizes[chunk] > READ_AHEAD_BYTES:
                return list(wanted)  # the read asks again for the rest
            wanted[chunk] = None
            total += sizes[chunk]
        first = next(i for i, (c, _s) in enumerate(entry.chunks) if c in wanted)
        for chunk, piece_size in entry.chunks[first:]:
            if total + piece_size > READ_AHEAD_BYTES:
                break
            if chunk not in wanted and self._lookup(chunk) is None:
                wanted[chunk] = None
                total += piece_size
        return list(wanted)


def _overlapping(entry: TreeEntry, offset: int, size: int) -> Iterator[tuple[bytes, int, int]]:
    """(id, start, size) of the pieces of `entry` that [offset, offset+size) touches."""
    start = 0
    for chunk, piece_size in entry.chunks:
        if start < offset + size and offset < start + piece_size:
            yield chunk, start, piece_size
        start += piece_size
