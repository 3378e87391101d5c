"""Version records of a green ledger, their content, and recomputing them.

Theory of operation (DESIGN.md section 7).  Position p of a green's ledger
holds a `Value`: the request that produced it (`RequestId`: authenticated
origin, client, sequence; plus the client's acknowledged sequence, so that
released results are released on every future owner too), the base version
(always p-1: the owner merged the submission onto its head), the increment
as edits whose bytes live in content-addressed chunks (`EditRef`: a range
and the BLAKE3 id of its replacement bytes), and the result root: the
BLAKE3 of the green's content after the increment.

A holder keeps the chunks (`ChunkStore`: id -> bytes, each verified on
arrival and again before use) and the values; `recompute` rebuilds a
version from its base content and retained inputs with the merge engine's
pure `apply` and compares the root, raising MissingContent when an input is
absent and VerificationFailed on any mismatch.  `make_value` is the
owner's side: it turns a merged increment into chunks and a value.

The content of a green is one byte string here (the simulator's stand-in
for a volume tree); version 0 is empty.  Pure: no clocks, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import blake3
import msgpack

from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    MissingContent,
    VerificationFailed,
)
from slates.merge.ranges import Replace, apply

__all__ = [
    "RequestId",
    "EditRef",
    "Value",
    "ChunkStore",
    "GENESIS_ROOT",
    "root_of",
    "chunk_id",
    "value_digest",
    "make_value",
    "recompute",
    "increment_of",
]


def root_of(content: bytes) -> bytes:
    return blake3.blake3(content).digest()


def chunk_id(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


GENESIS_ROOT = root_of(b"")


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class RequestId:
    origin: str  # the authenticated origin (the enrolled host the request entered through)
    client: str
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class EditRef:
    start: int
    end: int
    chunk: bytes
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Value:
    request: RequestId
    acked_through: int
    base_version: int
    edits: tuple[EditRef, ...]
    result_root: bytes

    def manifest(self) -> tuple[tuple[bytes, int], ...]:
        seen: dict[bytes, int] = {}
        for edit in self.edits:
            seen.setdefault(edit.chunk, edit.size)
        return tuple(seen.items())


def value_digest(value: Value) -> bytes:
    """The identity of a value: equal digests, equal values."""
    plain = (
        value.request.origin,
        value.request.client,
        value.request.seq,
        value.acked_through,
        value.base_version,
        [(e.start, e.end, e.chunk, e.size) for e in value.edits],
        value.result_root,
    )
    return blake3.blake3(msgpack.packb(plain)).digest()


class ChunkStore:
    """Verified chunks in a bounded number of bytes (a host's share for holding)."""

    __slots__ = ("_chunks", "capacity", "used")

    def __init__(self, capacity: int) -> None:
        self._chunks: dict[bytes, bytes] = {}
        self.capacity = capacity
        self.used = 0

    def __contains__(self, chunk: bytes) -> bool:
        return chunk in self._chunks

    def missing(self, manifest: Sequence[tuple[bytes, int]]) -> tuple[tuple[bytes, int], ...]:
        return tuple((c, s) for c, s in manifest if c not in self._chunks)

    def put(self, chunk: bytes, data: bytes) -> None:
        """Store `data` under `chunk` after checking its BLAKE3 id."""
        if chunk_id(data) != chunk:
            raise VerificationFailed("a chunk does not match its BLAKE3 id", chunk=chunk.hex())
        if chunk in self._chunks:
            return
        if self.used + len(data) > self.capacity:
            raise CapacityExhausted("the holder's chunk space is full", capacity=self.capacity)
        self._chunks[chunk] = data
        self.used += len(data)

    def get(self, chunk: bytes) -> bytes:
        """The chunk's bytes, verified again: RAM can rot between arrival and use."""
        data = self._chunks.get(chunk)
        if data is None:
            raise MissingContent("a chunk is not held here", chunk=chunk.hex())
        if chunk_id(data) != chunk:
            raise VerificationFailed("a held chunk no longer matches its id", chunk=chunk.hex())
        return data

    def raw(self) -> Mapping[bytes, bytes]:
        return self._chunks

    def corrupt(self, chunk: bytes) -> None:
        """Flip the bytes of one held chunk (the simulator's RAM fault)."""
        data = self._chunks[chunk]
        self._chunks[chunk] = bytes(b ^ 0xFF for b in data) if data else b"\x00"


def make_value(
    request: RequestId,
    acked_through: int,
    base_version: int,
    base_content: bytes,
    increment: Sequence[Replace],
) -> tuple[Value, dict[bytes, bytes], bytes]:
    """Seal a merged increment: its value, the chunks it needs, the new content."""
    content = apply(base_content, increment)
    chunks = {chunk_id(e.data): e.data for e in increment}
    edits = tuple(EditRef(e.start, e.end, chunk_id(e.data), len(e.data)) for e in increment)
    value = Value(request, acked_through, base_version, edits, root_of(content))
    return value, chunks, content


def increment_of(value: Value, chunks: ChunkStore) -> tuple[Replace, ...]:
    return tuple(Replace(e.start, e.end, chunks.get(e.chunk)) for e in value.edits)


def recompute(base_content: bytes, value: Value, chunks: ChunkStore) -> bytes:
    """The version's content from its base and retained inputs, root checked."""
    try:
        content = apply(base_content, increment_of(value, chunks))
    except InvalidArgument as error:
        raise VerificationFailed("the increment does not fit its base version") from error
    if root_of(content) != value.result_root:
        raise VerificationFailed(
            "the recomputed version does not match its result root",
            base_version=value.base_version,
        )
    return content
