"""Checkpoints: a shard's published state in anchor-owned shared memory.

Theory of operation: one memfd segment (slates.node.journal's Segment).
Its first page is the header: two document slots, each (journal generation
the checkpoint covers, document length, CRC, and the ranges of the area
that hold the document: one, or up to MAX_DOCUMENT_RANGES in a fragmented
area), and the index of the active one.  The rest is the page area, split
by a free map (PageArea) into page-aligned ranges.  A checkpoint is a
document (ShardState's) naming, for every private page buffer, the pieces
of the area that hold its bytes, in order, each with its CRC.

Writing one (`write`): the shard's state places each buffer through this
object, which is its slates.core.checkpoint.PageStore.  A buffer that did
not change since the published checkpoint keeps its pieces: nothing is
copied.  A changed one keeps the pieces its changed range does not touch
and gets fresh space for the rest (pieces of at most PIECE_BYTES, so an
edit in a large buffer rewrites little).  Fresh space never overlaps a
range the published checkpoint references, so a shard killed before the
publish leaves that checkpoint whole.  Then the document is written into
fresh space, its slot filled, and it is published by one aligned 4-byte
store of the active index.  Only then are the ranges that only the old
checkpoint referenced freed, and their pages given back (MADV_REMOVE).  A
checkpoint that does not fit raises CapacityExhausted, frees what it took,
and the published one stays as it was.  A checkpoint's cost is thus the
bytes that changed since the last one (and its document), not the
shard's whole private state.

Reading one back: `read` (the document, CRC-checked), then the state loads
it and fetches each buffer (`fetch`: bounds and each piece's CRC checked;
damage raises VerificationFailed), and `loaded` rebuilds the free map from
the references just fetched, giving back the pages of everything else
(space a killed checkpoint had written into).  The states: UNREAD ->
(read) LOADING -> (loaded) READY; a segment with nothing published is
READY once read.  Writing needs READY.

The shard (slates.node.shard) drives it; ShardState makes and loads the
document.
"""

from __future__ import annotations

import bisect
import enum
import struct
import zlib
from collections.abc import Callable
from typing import Any

from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node.journal import PAGE as _PAGE
from slates.node.journal import Segment

__all__ = ["PIECE_BYTES", "Checkpoints", "PageArea"]

_HEADER = struct.Struct("<8sII")  # magic, version, active slot (0, 1, or 2 = none)
# A document slot: generation, document length, crc32, range count; then the ranges of
# the area holding the document, in order, each (offset, length).  Slot i lies at
# _SLOTS_AT + i * _SLOT_BYTES in the header page.
_SLOT = struct.Struct("<QQII")
_RANGE = struct.Struct("<QQ")
_SLOTS_AT = 64
_SLOT_BYTES = (_PAGE - _SLOTS_AT) // 2 // _RANGE.size * _RANGE.size
MAX_DOCUMENT_RANGES = (_SLOT_BYTES - _SLOT.size) // _RANGE.size
_MAGIC = b"SLCKPT02"
_VERSION = 2
_NO_SLOT = 2
_ACTIVE_AT = 12  # the active index's offset in the header (4-aligned)
# A changed buffer is rewritten in pieces of at most this, aligned in buffer offsets.
PIECE_BYTES = 1 << 20

# What a checkpoint's document build returns: its bytes and what to call once published.
Build = Callable[[Any], tuple[bytes, Callable[[], None]]]


def _pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


class PageArea:
    """A free map over [start, end): sorted disjoint free ranges, page-aligned."""

    def __init__(self, start: int, end: int, *, free: bool = True) -> None:
        self.start, self.end = start, end
        self._starts: list[int] = []
        self._ends: list[int] = []
        if free and end > start:
            self._starts.append(start)
            self._ends.append(end)

    @property
    def free_bytes(self) -> int:
        return sum(self._ends) - sum(self._starts)

    def gaps(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def take(self, nbytes: int) -> list[tuple[int, int]]:
        """`nbytes` (a page multiple) of free space as (offset, length) ranges, lowest
        first; CapacityExhausted (taking nothing) when the area has less free."""
        got: list[tuple[int, int]] = []
        need, used = nbytes, 0
        while need and used < len(self._starts):
            start, end = self._starts[used], self._ends[used]
            length = min(end - start, need)
            got.append((start, length))
            need -= length
            if start + length == end:
                used += 1
            else:
                self._starts[used] = start + length
        del self._starts[:used]
        del self._ends[:used]
        if need:
            for start, length in got:
                self.give(start, length)
            raise CapacityExhausted(
                "the checkpoint does not fit its segment", at_least=nbytes, room=nbytes - need
            )
        return got

    def take_whole(self, nbytes: int) -> int:
        """One free range of `nbytes` (a page multiple), first fit; CapacityExhausted if none."""
        for index, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self._starts[index]
                    del self._ends[index]
                else:
                    self._starts[index] = start + nbytes
                return start
        raise CapacityExhausted("the checkpoint document does not fit its segment", at_least=nbytes)

    def give(self, start: int, length: int) -> None:
        """Free [start, start+length), joining its free neighbours."""
        end = start + length
        at = bisect.bisect_right(self._starts, start)
        if (
            start < self.start
            or end > self.end
            or (at and self._ends[at - 1] > start)
            or (at < len(self._starts) and self._starts[at] < end)
        ):
            raise InvalidArgument("freeing checkpoint space that is free", start=start)
        joins_left = at > 0 and self._ends[at - 1] == start
        joins_right = at < len(self._starts) and self._starts[at] == end
        if joins_left and joins_right:
            self._ends[at - 1] = self._ends[at]
            del self._starts[at]
            del self._ends[at]
        elif joins_left:
            self._ends[at - 1] = end
        elif joins_right:
            self._starts[at] = start
        else:
            self._starts.insert(at, start)
            self._ends.insert(at, end)


class _State(enum.Enum):
    UNREAD = "unread"
    LOADING = "loading"  # read: the state is fetching its buffers
    READY = "ready"


Piece = tuple[int, int, int]  # area offset, length, crc32


class Checkpoints:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        magic, version, active = _HEADER.unpack_from(segment.map, 0)
        if magic == bytes(8):
            _HEADER.pack_into(segment.map, 0, _MAGIC, _VERSION, _NO_SLOT)
        elif magic != _MAGIC or version != _VERSION or active > _NO_SLOT:
            raise VerificationFailed("the checkpoint segment is not a Slates checkpoint")
        self.area = PageArea(_PAGE, segment.size // _PAGE * _PAGE)
        self._state = _State.UNREAD
        # What the published checkpoint references: its pieces (offset -> length, crc)
        # and its document's range.
        self._published: dict[int, tuple[int, int]] = {}
        self._document: list[tuple[int, int]] = []  # its ranges, each (offset, pages' length)
        # The checkpoint being written: the pieces it references, the space it took.
        self._next: dict[int, tuple[int, int]] = {}
        self._taken: list[tuple[int, int]] = []
        self.copied_bytes = 0  # page bytes ever copied into the area (not documents)

    @property
    def area_bytes(self) -> int:
        return self.area.end - self.area.start

    def _active(self) -> int:
        value: int = _HEADER.unpack_from(self.segment.map, 0)[2]
        return value

    # -- reading ----------------------------------------------------------------

    def read(self) -> tuple[int, bytes] | None:
        """The published checkpoint as (journal generation it covers, document), if any.
        The first read of a segment with one published expects its buffers fetched
        next, then `loaded`."""
        active = self._active()
        if active == _NO_SLOT:
            match self._state:
                case _State.UNREAD:
                    self._state = _State.READY
                    self.segment.release(self.area.start, self.area.end)  # a killed one's
                case _State.READY:
                    pass
                case _:
                    raise InvalidArgument("the checkpoint is being loaded")
            return None
        mm = self.segment.map
        slot_at = _SLOTS_AT + active * _SLOT_BYTES
        generation, length, crc, count = _SLOT.unpack_from(mm, slot_at)
        if not 0 < count <= MAX_DOCUMENT_RANGES:
            raise VerificationFailed("the checkpoint document's range count is out of bounds")
        ranges = [
            _RANGE.unpack_from(mm, slot_at + _SLOT.size + i * _RANGE.size) for i in range(count)
        ]
        if any(
            at % _PAGE or size % _PAGE or at < self.area.start or at + size > self.area.end
            for at, size in ranges
        ) or not 0 < length <= sum(size for _at, size in ranges):
            raise VerificationFailed("the checkpoint document is out of bounds")
        document = b"".join(bytes(mm[at : at + size]) for at, size in ranges)[:length]
        if zlib.crc32(document) != crc:
            raise VerificationFailed("the checkpoint fails its checksum")
        match self._state:
            case _State.UNREAD:
                self._state = _State.LOADING
                self._document = ranges
                self._published = {}
            case _State.READY:
                pass
            case _:
                raise InvalidArgument("the checkpoint is being loaded")
        return generation, document

    def _pieces(self, where: Any, length: int | None) -> list[Piece]:
        """`where` as pieces, checked against the area (VerificationFailed if it is wrong)."""
        if (
            not isinstance(where, list)
            or len(where) % 3
            or not all(type(value) is int for value in where)
        ):
            raise VerificationFailed("a page buffer's location is malformed")
        pieces = [(where[i], where[i + 1], where[i + 2]) for i in range(0, len(where), 3)]
        for at, size, _crc in pieces:
            if at % _PAGE or at < self.area.start or size <= 0 or at + size > self.area.end:
                raise VerificationFailed("a page buffer's location is out of bounds", at=at)
        if length is not None and sum(size for _at, size, _crc in pieces) != length:
            raise VerificationFailed("a page buffer's pieces do not add up to its length")
        return pieces

    def fetch(self, where: Any, length: int) -> bytearray:
        """The page buffer placed at `where` (PageStore.fetch), its pieces' CRCs checked."""
        pieces = self._pieces(where, length)
        match self._state:
            case _State.LOADING:
                for at, size, crc in pieces:
                    if at in self._published:
                        raise VerificationFailed("two page buffers share a piece", at=at)
                    self._published[at] = (size, crc)
            case _State.READY:
                if any(self._published.get(at) != (size, crc) for at, size, crc in pieces):
                    raise VerificationFailed("a page buffer is not in the published checkpoint")
            case _:
                raise InvalidArgument("no checkpoint is being read")
        out = bytearray(length)
        view = memoryview(out)
        mm = self.segment.map
        done = 0
        for at, size, crc in pieces:
            view[done : done + size] = mm[at : at + size]
            if zlib.crc32(view[done : done + size]) != crc:
                raise VerificationFailed("checkpoint page bytes fail their checksum", at=at)
            done += size
        return out

    def loaded(self) -> None:
        """Every buffer of the document `read` returned was fetched: rebuild the free
        map from their references and give back the pages of the rest."""
        match self._state:
            case _State.LOADING:
                pass
            case _:
                raise InvalidArgument("no checkpoint is being loaded")
        used = sorted(
            [(at, _pages(size)) for at, (size, _crc) in self._published.items()] + self._document
        )
        area = PageArea(self.area.start, self.area.end, free=False)
        cursor = self.area.start
        for at, size in used:
            if at < cursor:
                raise VerificationFailed("the checkpoint's pieces overlap", at=at)
            if at > cursor:
                area.give(cursor, at - cursor)
            cursor = at + size
        if cursor < self.area.end:
            area.give(cursor, self.area.end - cursor)
        for start, end in area.gaps():
            self.segment.release(start, end)
        self.area = area
        self._state = _State.READY

    # -- writing ----------------------------------------------------------------

    def place(self, buffer: bytearray, where: Any, changed: tuple[int, int] | None) -> Any:
        """Store `buffer` for the checkpoint being written (PageStore.place)."""
        length = len(buffer)
        old = self._reusable(where)
        kept: list[tuple[int, Piece]] = []  # (buffer offset, piece) kept from `where`
        offset = 0
        for piece in old:
            end = offset + piece[1]
            untouched = changed is None or end <= changed[0] or offset >= changed[1]
            if end <= length and untouched:
                kept.append((offset, piece))
            offset = end
        out: list[int] = []
        cursor = 0
        view = memoryview(buffer)
        for offset, piece in kept:
            if offset > cursor:
                self._copy(view, cursor, offset, out)
            out += piece
            self._next[piece[0]] = (piece[1], piece[2])
            cursor = offset + piece[1]
        if cursor < length:
            self._copy(view, cursor, length, out)
        return out

    def _reusable(self, where: Any) -> list[Piece]:
        """The pieces of `where` the checkpoint being written may reference again: all of
        them when the published checkpoint holds each and no other buffer took it."""
        if where is None:
            return []
        try:
            pieces = self._pieces(where, None)
        except VerificationFailed:
            return []
        for at, size, crc in pieces:
            if self._published.get(at) != (size, crc) or at in self._next:
                return []
        return pieces

    def _copy(self, view: memoryview, lo: int, hi: int, out: list[int]) -> None:
        """Copy view[lo:hi] into fresh space, appending its pieces to `out`."""
        mm = self.segment.map
        while lo < hi:
            cut = min(hi, (lo // PIECE_BYTES + 1) * PIECE_BYTES)
            ranges = self.area.take(_pages(cut - lo))
            self._taken += ranges
            for at, room in ranges:
                self.segment.populate(at, at + room)
                size = min(room, cut - lo)
                data = view[lo : lo + size]
                mm[at : at + size] = data
                crc = zlib.crc32(data)
                out += (at, size, crc)
                self._next[at] = (size, crc)
                self.copied_bytes += size
                lo += size

    def write(self, generation: int, build: Build) -> None:
        """Write a checkpoint and publish it.  `build(self)` places the buffers and returns
        the document and what to call once it is published.  One that does not fit
        raises CapacityExhausted, and the published checkpoint stays as it was."""
        match self._state:
            case _State.READY:
                pass
            case _:
                raise InvalidArgument("the published checkpoint has not been read")
        self._next, self._taken = {}, []
        try:
            document, published = build(self)
            ranges = self._document_space(_pages(len(document)))
            mm = self.segment.map
            done = 0
            for at, size in ranges:
                mm[at : at + min(size, len(document) - done)] = document[done : done + size]
                done += size
            active = self._active()
            slot = 0 if active != 0 else 1
            slot_at = _SLOTS_AT + slot * _SLOT_BYTES
            _SLOT.pack_into(
                mm, slot_at, generation, len(document), zlib.crc32(document), len(ranges)
            )
            for index, (at, size) in enumerate(ranges):
                _RANGE.pack_into(mm, slot_at + _SLOT.size + index * _RANGE.size, at, size)
            struct.pack_into("<I", mm, _ACTIVE_AT, slot)  # the publish point
        except BaseException:
            for start, size in self._taken:
                self.area.give(start, size)
                self.segment.release(start, start + size)
            self._next, self._taken = {}, []
            raise
        # Published: what only the old checkpoint referenced is free now.
        for old_at, (size, _crc) in self._published.items():
            if old_at not in self._next:
                self._free(old_at, _pages(size))
        for at, size in self._document:
            self._free(at, size)
        self._published, self._document = self._next, ranges
        self._next, self._taken = {}, []
        published()

    def _document_space(self, nbytes: int) -> list[tuple[int, int]]:
        """Fresh space for a document: one range if one fits, else at most
        MAX_DOCUMENT_RANGES of them (a fragmented area), else CapacityExhausted."""
        try:
            ranges = [(self.area.take_whole(nbytes), nbytes)]
        except CapacityExhausted:
            ranges = self.area.take(nbytes)
        self._taken += ranges
        if len(ranges) > MAX_DOCUMENT_RANGES:
            raise CapacityExhausted(
                "the checkpoint document's space is too fragmented", ranges=len(ranges)
            )
        return ranges

    def _free(self, start: int, size: int) -> None:
        self.area.give(start, size)
        self.segment.release(start, start + size)
