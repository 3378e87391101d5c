"""The chunk arena: sealed content in an anchor-owned segment, its space reused.

Theory of operation (DESIGN.md section 4a).  The arena is a sequence of
entries [id 32][length u32][crc32 u32][data, padded to 8 bytes] from
_ARENA_START up to the header's `committed` offset, so a shard that
attaches rebuilds its index by one scan.  An entry whose id is all zeros
is free space of that stride (the old format's tombstones are read too).

- Storing a chunk takes the first free entry it fits (its rest stays a
  free entry, or the chunk goes elsewhere when the rest is too small for a
  header), else appends and then moves `committed` (one aligned 8-byte
  store, after the bytes are in place).  The data is written before the
  header names it, so a shard killed mid-store leaves at worst an entry
  whose checksum fails and that nothing references; collection frees it.
- Deleting a chunk needs no space: its header becomes free in place, its
  pages go back to the host (MADV_REMOVE punches the memfd), and it merges
  with free neighbours; free space at the end lowers `committed`.
- A full arena is CapacityExhausted for new content only: reads and
  deletions go on.

Used by slates.core.host through the MutableMapping interface (the shard
builds it on the anchor's segment); slates.node.journal owns the segment.
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections.abc import Iterator, MutableMapping

from slates.errors import CapacityExhausted, MissingContent, VerificationFailed
from slates.node.journal import PAGE, Segment

__all__ = ["ArenaChunks"]

_ARENA_HEADER = struct.Struct("<8sIIQ")  # magic, version, pad, committed
_ARENA_MAGIC = b"SLARENA1"
_CHUNK = struct.Struct("<32sII")  # id, length, crc32
_TOMBSTONE = 0xFFFFFFFF  # the old format's deletion records: a bare header
_FREE_ID = bytes(32)
_ARENA_START = PAGE
_MAX_FREE = 1 << 31  # a free entry's length field is 32 bits: merged extents stop here


def _stride(length: int) -> int:
    return _CHUNK.size + -(-length // 8) * 8


class ArenaChunks(MutableMapping[bytes, bytes]):
    """The host's chunk store, kept in an anchor-owned segment."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._index: dict[bytes, tuple[int, int]] = {}
        self._free: list[tuple[int, int]] = []  # (entry offset, stride), by offset
        magic, version, _pad, committed = _ARENA_HEADER.unpack_from(segment.map, 0)
        if magic == bytes(8):
            _ARENA_HEADER.pack_into(segment.map, 0, _ARENA_MAGIC, 1, 0, 0)
            return
        if magic != _ARENA_MAGIC or version != 1 or committed > segment.size - _ARENA_START:
            raise VerificationFailed("the arena segment is not a Slates arena")
        at, end = _ARENA_START, _ARENA_START + committed
        while at < end:
            chunk_id, length, _crc = _CHUNK.unpack_from(segment.map, at)
            if length == _TOMBSTONE:
                self._index.pop(chunk_id, None)
                at += _CHUNK.size
                continue
            stride = _stride(length)
            if at + stride > end:
                raise VerificationFailed("an arena entry runs past the committed end", at=at)
            if chunk_id == _FREE_ID:
                self._free.append((at, stride))
            else:
                self._index[chunk_id] = (at + _CHUNK.size, length)
            at += stride

    # -- space ----------------------------------------------------------------

    @property
    def _committed(self) -> int:
        value: int = _ARENA_HEADER.unpack_from(self.segment.map, 0)[3]
        return value

    def _set_committed(self, committed: int) -> None:
        struct.pack_into("<Q", self.segment.map, 16, committed)

    @property
    def free_bytes(self) -> int:
        """Bytes inside the committed part that are free for new chunks."""
        return sum(stride for _at, stride in self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes of the segment the arena's entries span (free ones included)."""
        return self._committed

    def _take(self, need: int) -> int | None:
        """Where a new entry of `need` bytes goes among the free ones (or None)."""
        for position, (at, stride) in enumerate(self._free):
            rest = stride - need
            if rest == 0:
                del self._free[position]
                return at
            if rest >= _CHUNK.size:
                _CHUNK.pack_into(self.segment.map, at + need, _FREE_ID, rest - _CHUNK.size, 0)
                self._free[position] = (at + need, rest)
                return at
        return None

    def _store(self, chunk_id: bytes, data: bytes | bytearray) -> int:
        need = _stride(len(data))
        at = self._take(need)
        mm = self.segment.map
        if at is None:
            committed = self._committed
            at = _ARENA_START + committed
            if at + need > self.segment.size:
                raise CapacityExhausted("the content arena is full", needed=need)
            mm[at + _CHUNK.size : at + _CHUNK.size + len(data)] = data
            _CHUNK.pack_into(mm, at, chunk_id, len(data), zlib.crc32(data))
            self._set_committed(committed + need)
        else:
            mm[at + _CHUNK.size : at + _CHUNK.size + len(data)] = data
            _CHUNK.pack_into(mm, at, chunk_id, len(data), zlib.crc32(data))
        return at + _CHUNK.size

    def _release(self, at: int, stride: int) -> None:
        """Make [at, at + stride) free: merged with free neighbours, its pages returned,
        and the committed end lowered when the free space reaches it."""
        position = bisect.bisect_left(self._free, (at, 0))
        if position and sum(self._free[position - 1]) == at:
            before, before_stride = self._free[position - 1]
            if before_stride + stride <= _MAX_FREE:
                position -= 1
                del self._free[position]
                at, stride = before, before_stride + stride
        if position < len(self._free) and at + stride == self._free[position][0]:
            _after, after_stride = self._free[position]
            if stride + after_stride <= _MAX_FREE:
                del self._free[position]
                stride += after_stride
        if at + stride == _ARENA_START + self._committed:
            self._set_committed(at - _ARENA_START)  # the end moves back: no header needed
            self.segment.release(at, at + stride)
            return
        _CHUNK.pack_into(self.segment.map, at, _FREE_ID, stride - _CHUNK.size, 0)
        self.segment.release(at + _CHUNK.size, at + stride)
        self._free.insert(position, (at, stride))

    # -- the mapping ------------------------------------------------------------

    def __getitem__(self, chunk_id: bytes) -> bytes:
        where = self._index.get(chunk_id)
        if where is None:
            raise KeyError(chunk_id)
        start, length = where
        return bytes(self.segment.map[start : start + length])

    def verify(self, chunk_id: bytes) -> None:
        """Check a chunk's bytes against its checksum (MissingContent if damaged)."""
        start, length = self._index[chunk_id]
        _id, _length, crc = _CHUNK.unpack_from(self.segment.map, start - _CHUNK.size)
        if zlib.crc32(self.segment.map[start : start + length]) != crc:
            raise MissingContent("a chunk in the arena is damaged", chunk=chunk_id.hex())

    def __setitem__(self, chunk_id: bytes, data: bytes) -> None:
        if chunk_id in self._index:
            return
        if chunk_id == _FREE_ID:
            raise VerificationFailed("a chunk id of all zeros is reserved")
        start = self._store(chunk_id, data)
        self._index[chunk_id] = (start, len(data))

    def __delitem__(self, chunk_id: bytes) -> None:
        if chunk_id not in self._index:
            raise KeyError(chunk_id)
        start, length = self._index.pop(chunk_id)
        self._release(start - _CHUNK.size, _stride(length))

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._index
