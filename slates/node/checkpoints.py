"""Checkpoints: a shard's published state in anchor-owned shared memory.

Theory of operation: one memfd segment (slates.node.journal's Segment).
Its first page is the header: two document slots, each (journal generation
the checkpoint covers, document length, CRC, and the ranges of the area
that hold the document: one, or up to MAX_DOCUMENT_RANGES in a fragmented
area), and the index of the active one.  The rest is the page area, split
by a free map (slates.node.page_area's PageArea).  The shard's private
page buffers live there all the time, not only in checkpoints: `pages`
(SegmentPages) is the shard host's PageMemory, so a written byte is
copied once, into its piece of the area, and a piece the published
checkpoint names is copied on write (page_area's docstring).

Writing one (`write`): the shard's state asks this object, its
slates.core.checkpoint.PageStore, where each buffer is (`place`: its
pieces, each (offset, length, CRC), the CRCs computed only for pieces
written since the last checkpoint).  Nothing is copied.  Then the
document is written into fresh space, its slot filled, and it is
published by one aligned 4-byte store of the active index.  Only then
are the old document's ranges, and the pieces only the old checkpoint
referenced, freed and their pages given back (MADV_REMOVE), or kept warm
for the next taker within a bound (page_area's docstring); the pieces
the new one names are frozen (copy on write from now on).  A checkpoint
whose document does not fit raises CapacityExhausted, frees what it took,
and the published one stays as it was.  A checkpoint's cost is thus its
document and the CRCs of what changed, not the shard's private bytes.

A shard killed at any point leaves the published checkpoint whole: its
pieces are never written in place (frozen), so the replacement reads
exactly the bytes that checkpoint named and replays the journal after it.

Reading one back: `read` (the document, CRC-checked), then the state loads
it and fetches each buffer (`fetch`: bounds and each piece's CRC checked;
damage raises VerificationFailed; the buffer is the pieces where they lie,
frozen), and `loaded` rebuilds the free map from the pieces just fetched
and the document, giving back the pages of everything else (pieces a
killed shard wrote after that checkpoint, and its unpublished document).
The states: UNREAD -> (read) LOADING -> (loaded) READY; a segment with
nothing published is READY once read.  Writing, and taking page space,
need READY.

The shard (slates.node.shard) drives it; ShardState makes and loads the
document.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Any

from slates.core.host import HeapBuffer, PageBuffer
from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node.journal import PAGE as _PAGE
from slates.node.journal import Segment, crc32
from slates.node.page_area import PIECE_BYTES, PageArea, Piece, SegmentPages

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

# What a checkpoint's document build returns: its bytes and what to call once published.
Build = Callable[[Any], tuple[bytes, Callable[[], None]]]


def _pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


class _State(enum.Enum):
    UNREAD = "unread"
    LOADING = "loading"  # read: the state is fetching its buffers
    READY = "ready"


PieceRef = tuple[int, int, int]  # area offset, length, crc32


class Checkpoints:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        magic, version, active = _HEADER.unpack_from(segment.map, 0)
        if magic == bytes(8):
            _HEADER.pack_into(segment.map, 0, _MAGIC, _VERSION, _NO_SLOT)
        elif magic != _MAGIC or version != _VERSION or active > _NO_SLOT:
            raise VerificationFailed("the checkpoint segment is not a Slates checkpoint")
        # The shard host's page memory: the volumes' buffers live in the page area.
        self.pages = SegmentPages(segment, PageArea(_PAGE, segment.size // _PAGE * _PAGE))
        self._state = _State.UNREAD
        self._document: list[tuple[int, int]] = []  # its ranges, each (offset, pages' length)
        self._placing: list[Piece] = []  # the pieces the checkpoint being written names

    @property
    def area(self) -> PageArea:
        return self.pages.area

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
                    self.pages.ready = True
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
        if crc32(document) != crc:
            raise VerificationFailed("the checkpoint fails its checksum")
        match self._state:
            case _State.UNREAD:
                self._state = _State.LOADING
                self._document = ranges
            case _State.READY:
                pass
            case _:
                raise InvalidArgument("the checkpoint is being loaded")
        return generation, document

    def _pieces(self, where: Any, length: int | None) -> list[PieceRef]:
        """`where` as pieces, checked against the area (VerificationFailed if it is wrong)."""
        if (
            not isinstance(where, list)
            or len(where) % 3
            or not all(type(value) is int for value in where)
        ):
            raise VerificationFailed("a page buffer's location is malformed")
        pieces = [(where[i], where[i + 1], where[i + 2]) for i in range(0, len(where), 3)]
        for at, size, _crc in pieces:
            if (
                at % _PAGE
                or at < self.area.start
                or not 0 < size <= PIECE_BYTES
                or at + size > self.area.end
            ):
                raise VerificationFailed("a page buffer's location is out of bounds", at=at)
        if length is not None and sum(size for _at, size, _crc in pieces) != length:
            raise VerificationFailed("a page buffer's pieces do not add up to its length")
        return pieces

    def fetch(self, where: Any, length: int) -> PageBuffer:
        """The page buffer placed at `where` (PageStore.fetch), its pieces' CRCs checked.
        While loading, the buffer is the pieces themselves (the volume's from now on);
        once ready, a copy of a published buffer's bytes (tools and tests)."""
        pieces = self._pieces(where, length)
        match self._state:
            case _State.LOADING:
                return self.pages.adopt(pieces)
            case _State.READY:
                published = dict(self.pages.published_ranges())
                if any(at not in published for at, _size, _crc in pieces):
                    raise VerificationFailed("a page buffer is not in the published checkpoint")
            case _:
                raise InvalidArgument("no checkpoint is being read")
        out = HeapBuffer(length)
        view = memoryview(out)
        mm = self.segment.map
        done = 0
        for at, size, crc in pieces:
            view[done : done + size] = mm[at : at + size]
            if crc32(view[done : done + size]) != crc:
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
        used = sorted(self.pages.published_ranges() + self._document)
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
        self.pages.area = area
        self.pages.ready = True
        self._state = _State.READY

    # -- writing ----------------------------------------------------------------

    def place(self, buffer: PageBuffer) -> Any:
        """Where `buffer` is, for the checkpoint being written (PageStore.place): its
        pieces, as they lie in the page area; nothing is copied."""
        where, pieces = self.pages.place(buffer)
        self._placing += pieces
        return where

    def write(self, generation: int, build: Build) -> None:
        """Write a checkpoint and publish it.  `build(self)` places the buffers and returns
        the document and what to call once it is published.  One whose document does
        not fit raises CapacityExhausted, and the published checkpoint stays as it was."""
        match self._state:
            case _State.READY:
                pass
            case _:
                raise InvalidArgument("the published checkpoint has not been read")
        self._placing = []
        taken: list[tuple[int, int]] = []
        try:
            document, published = build(self)
            ranges = self._document_space(_pages(len(document)), taken)
            mm = self.segment.map
            done = 0
            for at, size in ranges:
                mm[at : at + min(size, len(document) - done)] = document[done : done + size]
                done += size
            self.segment.touched()
            active = self._active()
            slot = 0 if active != 0 else 1
            slot_at = _SLOTS_AT + slot * _SLOT_BYTES
            _SLOT.pack_into(mm, slot_at, generation, len(document), crc32(document), len(ranges))
            for index, (at, size) in enumerate(ranges):
                _RANGE.pack_into(mm, slot_at + _SLOT.size + index * _RANGE.size, at, size)
            struct.pack_into("<I", mm, _ACTIVE_AT, slot)  # the publish point
        except BaseException:
            for start, size in taken:
                self._free(start, size)
            self._placing = []
            raise
        # Published: what only the old checkpoint referenced is free now.
        for at, size in self._document:
            self._free(at, size)
        self._document = ranges
        self.pages.publish(self._placing)
        self._placing = []
        published()

    def _document_space(self, nbytes: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Fresh space for a document: one range if one fits, else at most
        MAX_DOCUMENT_RANGES of them (a fragmented area), else CapacityExhausted."""
        try:
            ranges = [(self.area.take_whole(nbytes), nbytes)]
        except CapacityExhausted:
            ranges = self.area.take(nbytes)
        taken += ranges
        if len(ranges) > MAX_DOCUMENT_RANGES:
            raise CapacityExhausted(
                "the checkpoint document's space is too fragmented", ranges=len(ranges)
            )
        return ranges

    def _free(self, start: int, size: int) -> None:
        self.pages.give_back(start, size)  # warm within the pages' bound, else given back
