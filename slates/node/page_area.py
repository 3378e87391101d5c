"""Page buffers in the checkpoint segment: the free map, the pieces, copy on write.

Theory of operation: a shard's private page buffers live in the page area
of its checkpoint segment (slates.node.checkpoints), not in its heap, so
a written byte is copied once into shared memory (plus its journal frame)
and a checkpoint names the bytes where they already are instead of
copying them.  This module owns that area:

- `PageArea`: the free map over the area, sorted disjoint page-aligned
  free ranges (take, take_whole, give).
- `SegmentBuffer`: one page buffer, a list of pieces.  A piece is one
  range of the area taken at once (`capacity` bytes, a page multiple of
  at most PIECE_BYTES) holding `length` bytes of the buffer, in order.
  `frozen` is how many of its first bytes the published checkpoint reads:
  they are never written in place.  A write that reaches into them first
  takes fresh space for the piece (its other bytes copied from the old
  place, then the new ones written): copy on write per piece.  Bytes at or
  past `frozen` (a piece nobody published, or a published piece's tail
  grown since) are written in place.  `crc` is the CRC32 of the piece's
  bytes, or None once they changed (the next checkpoint computes it).
- `SegmentPages`: the shard host's PageMemory (slates.core.host).  It
  knows the pieces live buffers use (`_live`) and the ranges the published
  checkpoint references (`_published`, offset -> capacity): a range is free
  once neither holds it, and its pages then go back (MADV_REMOVE).  Before
  the published checkpoint is read (`ready`), nothing may be taken.

The checkpoint side: `place` (a buffer's pieces as the document names
them, CRCs computed for those written since), `publish` (the new
checkpoint is the published one: its pieces are frozen at their lengths,
and ranges only the old one referenced are freed), `adopt` (a loaded
checkpoint's pieces become a live buffer, frozen as published).

Invariants: a range the published checkpoint references is never written
below its published length; every taken range is held by a live piece,
the published checkpoint, or a document Checkpoints is writing; the
area's exhaustion is CapacityExhausted before any byte changes (the
volume asks `ensure` for what a record takes, slates.core.volume).
"""

from __future__ import annotations

import bisect
import dataclasses
import zlib
from collections.abc import Sequence

from slates.core.host import Bytes, PageBuffer
from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node.journal import PAGE as _PAGE
from slates.node.journal import Segment

__all__ = ["PIECE_BYTES", "PageArea", "Piece", "SegmentBuffer", "SegmentPages"]

# A buffer's bytes are held in pieces of at most this: a copy on write copies at most
# one piece per end of the range written.
PIECE_BYTES = 1 << 20
# Fresh space for a copy at least this large is faulted in with one call first.
_POPULATE_BYTES = 64 << 10
# A buffer this large that grows is given room beyond what it needs (see extend).
_GROWING_BYTES = 64 << 10


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
                "the checkpoint segment's page area is full", at_least=nbytes, room=nbytes - need
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


@dataclasses.dataclass(slots=True, eq=False)
class Piece:
    at: int  # area offset of the range taken
    capacity: int  # bytes taken (page multiple, at most PIECE_BYTES)
    length: int  # buffer bytes it holds
    frozen: int  # its first bytes the published checkpoint reads
    crc: int | None  # crc32 of its `length` bytes; None once they changed


class SegmentBuffer:
    """A page buffer in the page area (PageBuffer); made by SegmentPages."""

    __slots__ = ("_length", "_offsets", "_pages", "_pieces")

    def __init__(self, pages: SegmentPages, pieces: list[Piece]) -> None:
        self._pages = pages
        self._pieces = pieces
        self._offsets: list[int] = []  # buffer offset of each piece
        self._length = 0
        self._reindex()

    def _reindex(self) -> None:
        self._offsets = []
        cursor = 0
        for piece in self._pieces:
            self._offsets.append(cursor)
            cursor += piece.length
        self._length = cursor

    def __len__(self) -> int:
        return self._length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (SegmentBuffer, bytes, bytearray)):
            return NotImplemented
        return len(self) == len(other) and self[0 : len(self)] == other[0 : len(other)]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SegmentBuffer(length={self._length}, pieces={len(self._pieces)})"

    def _span(self, lo: int, hi: int) -> list[tuple[int, Piece, int, int, int]]:
        """(index, piece, lo, hi, piece start) for every piece [lo, hi) touches, lo and
        hi in piece offsets, the start in buffer offsets."""
        if not 0 <= lo <= hi <= self._length:
            raise InvalidArgument("a range outside the page buffer", lo=lo, hi=hi)
        out: list[tuple[int, Piece, int, int, int]] = []
        if lo == hi:
            return out
        index = bisect.bisect_right(self._offsets, lo) - 1
        while index < len(self._pieces) and self._offsets[index] < hi:
            start = self._offsets[index]
            piece = self._pieces[index]
            out.append(
                (index, piece, max(lo, start) - start, min(hi, start + piece.length) - start, start)
            )
            index += 1
        return out

    def __getitem__(self, index: slice, /) -> bytes:
        lo, hi, step = index.indices(self._length)
        if step != 1:
            raise InvalidArgument("page buffers are read in plain slices")
        hi = max(lo, hi)
        mm = self._pages.segment.map
        parts = [mm[p.at + a : p.at + b] for _i, p, a, b, _s in self._span(lo, hi)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def rewrite_cost(self, lo: int, hi: int) -> int:
        return sum(p.capacity for _i, p, a, _b, _s in self._span(lo, hi) if a < p.frozen)

    def write(self, offset: int, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        pages = self._pages
        mm = pages.segment.map
        copied = False
        # Last piece first: a piece copied on write may become several, which moves
        # only the indexes after it.
        for index, piece, a, b, start in reversed(self._span(offset, offset + len(view))):
            part = view[start + a - offset : start + b - offset]
            if a >= piece.frozen:
                mm[piece.at + a : piece.at + b] = part
                piece.crc = None
                pages.written_bytes += b - a
                continue
            # Copy on write: the published checkpoint reads this piece's bytes.
            fresh = pages.take_pieces(piece.length)
            lo = 0
            for new in fresh:
                hi = lo + new.length
                pages.fill(new, 0, new.length)
                if lo < a:  # the old bytes before the write
                    mm.move(new.at, piece.at + lo, min(hi, a) - lo)
                if hi > b:  # and after it
                    keep = max(lo, b)
                    mm.move(new.at + keep - lo, piece.at + keep, hi - keep)
                if max(lo, a) < min(hi, b):
                    mm[new.at + max(lo, a) - lo : new.at + min(hi, b) - lo] = part[
                        max(lo, a) - a : min(hi, b) - a
                    ]
                lo = hi
            pages.copied_bytes += piece.length
            self._pieces[index : index + 1] = fresh
            pages.drop(piece)
            copied = True
        if copied:
            self._reindex()

    def extend(self, data: Bytes, /) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        pages = self._pages
        mm = pages.segment.map
        done = 0
        if self._pieces:
            last = self._pieces[-1]
            room = last.capacity - last.length if last.length >= last.frozen else 0
            if room:
                done = min(room, len(view))
                pages.fill(last, last.length, last.length + done)
                mm[last.at + last.length : last.at + last.length + done] = view[:done]
                last.length += done
                last.crc = None
                pages.live_bytes += done
        if done < len(view):
            rest = len(view) - done
            # A buffer that keeps growing gets room to grow into (its last piece's
            # capacity doubles, up to a piece), so appends rarely start a new piece.
            grow = 0
            if self._pieces and self._length >= _GROWING_BYTES:
                grow = min(PIECE_BYTES, 2 * self._pieces[-1].capacity)
            for piece in pages.take_pieces(rest, grow):
                pages.fill(piece, 0, piece.length)
                mm[piece.at : piece.at + piece.length] = view[done : done + piece.length]
                done += piece.length
                self._pieces.append(piece)
        self._reindex()

    def shrink(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise InvalidArgument("shrinking a page buffer past its ends", length=length)
        pages = self._pages
        while self._pieces and self._offsets[-1] >= length:
            pages.drop(self._pieces.pop())
            self._offsets.pop()
        if self._pieces:
            last = self._pieces[-1]
            keep = length - self._offsets[-1]
            if keep < last.length:
                pages.live_bytes -= last.length - keep
                last.length = keep
                last.crc = None
                # Pages past what anyone reads go back now (space stays with the piece).
                pages.segment.release(
                    last.at + _pages(max(keep, last.frozen)), last.at + last.capacity
                )
        self._length = length

    def _release(self) -> list[Piece]:
        pieces, self._pieces, self._offsets, self._length = self._pieces, [], [], 0
        return pieces


class SegmentPages:
    """PageMemory in the checkpoint segment's page area (see the module docstring)."""

    def __init__(self, segment: Segment, area: PageArea) -> None:
        self.segment = segment
        self.area = area
        self.ready = False  # the free map is known (the published checkpoint was read)
        self._live: dict[int, Piece] = {}  # area offset -> the live piece there
        self._published: dict[int, int] = {}  # area offset -> capacity, published ranges
        self.live_bytes = 0  # bytes live buffers hold (the host counts them as private)
        self.stale_bytes = 0  # space only the published checkpoint holds (the next frees it)
        self.copied_bytes = 0  # bytes copied on write (a published piece written again)
        self.written_bytes = 0  # bytes written into fresh or private space

    # -- PageMemory ---------------------------------------------------------------

    def new(self, pieces: Sequence[Bytes]) -> SegmentBuffer:
        buffer = SegmentBuffer(self, [])
        for data in pieces:
            buffer.extend(data)
        return buffer

    def free(self, buffer: PageBuffer) -> None:
        if not isinstance(buffer, SegmentBuffer) or buffer._pages is not self:
            raise InvalidArgument("freeing a page buffer this segment did not make")
        for piece in buffer._release():
            self.drop(piece)

    def ensure(self, nbytes: int) -> None:
        if nbytes < 0:
            raise InvalidArgument("a negative page memory request", nbytes=nbytes)
        if not self.ready:
            raise InvalidArgument("the page area is not loaded yet")
        room = self.area.free_bytes
        if _pages(nbytes) > room:
            raise CapacityExhausted(
                "the checkpoint segment's page area is full", requested=nbytes, room=room
            )

    # -- pieces -------------------------------------------------------------------

    def take_pieces(self, nbytes: int, slack: int = 0) -> list[Piece]:
        """Fresh live pieces holding `nbytes` (lengths set, bytes not yet written); the
        last one with a capacity of `slack` bytes (at most a piece) when that is more
        than it needs and the area has it."""
        if not self.ready:
            raise InvalidArgument("the page area is not loaded yet")
        out: list[Piece] = []
        left = nbytes
        while left:
            size = min(PIECE_BYTES, max(_pages(left), slack))
            try:
                ranges = self.area.take(size)
            except CapacityExhausted:
                size = min(PIECE_BYTES, _pages(left))
                try:
                    ranges = self.area.take(size)
                except CapacityExhausted:
                    for piece in out:
                        self.drop(piece)
                    raise
            for at, capacity in ranges:
                length = min(capacity, left)
                piece = Piece(at, capacity, length, 0, None)
                if length == 0:  # more capacity than bytes: the range goes back
                    self.area.give(at, capacity)
                    continue
                out.append(piece)
                self._live[at] = piece
                self.live_bytes += length
                left -= length
        return out

    def fill(self, piece: Piece, lo: int, hi: int) -> None:
        """[lo, hi) of `piece` is about to be written: count it, fault large runs in."""
        self.written_bytes += hi - lo
        if hi - lo >= _POPULATE_BYTES:
            self.segment.populate(piece.at + lo, piece.at + hi)

    def drop(self, piece: Piece) -> None:
        """No live buffer holds `piece` now: its range is free unless published."""
        if self._live.pop(piece.at, None) is not piece:
            raise InvalidArgument("dropping a page piece that is not live", at=piece.at)
        self.live_bytes -= piece.length
        if piece.at in self._published:
            self.stale_bytes += self._published[piece.at]
        else:
            self._free(piece.at, piece.capacity)

    def _free(self, at: int, capacity: int) -> None:
        self.area.give(at, capacity)
        self.segment.release(at, at + capacity)

    # -- the checkpoint's side ----------------------------------------------------

    def place(self, buffer: PageBuffer) -> tuple[list[int], list[Piece]]:
        """`buffer`'s pieces as a checkpoint names them, [offset, length, crc, ...] (the
        CRCs of those written since computed now), and the pieces themselves."""
        if not isinstance(buffer, SegmentBuffer) or buffer._pages is not self:
            raise InvalidArgument("a page buffer outside the checkpoint segment")
        mm = memoryview(self.segment.map)
        out: list[int] = []
        for piece in buffer._pieces:
            if piece.crc is None:
                piece.crc = zlib.crc32(mm[piece.at : piece.at + piece.length])
            out += (piece.at, piece.length, piece.crc)
        return out, list(buffer._pieces)

    def publish(self, placed: Sequence[Piece]) -> None:
        """The checkpoint naming `placed` is published: freeze them, and free the ranges
        only the checkpoint before it referenced."""
        fresh = {piece.at: piece.capacity for piece in placed}
        for at, capacity in self._published.items():
            if at in fresh:
                continue
            live = self._live.get(at)
            if live is None:
                self._free(at, capacity)
            else:
                live.frozen = 0  # a buffer no checkpoint names (a reader volume's)
        for piece in placed:
            piece.frozen = piece.length
        self._published = fresh
        self.stale_bytes = 0

    def adopt(self, pieces: Sequence[tuple[int, int, int]]) -> SegmentBuffer:
        """A loaded checkpoint's buffer: its (offset, length, crc) pieces, checked, held
        in place as a live buffer (no byte copied), each frozen as published."""
        mm = memoryview(self.segment.map)
        made: list[Piece] = []
        for at, length, crc in pieces:
            if at in self._published:
                raise VerificationFailed("two page buffers share a piece", at=at)
            if zlib.crc32(mm[at : at + length]) != crc:
                raise VerificationFailed("checkpoint page bytes fail their checksum", at=at)
            made.append(Piece(at, _pages(length), length, length, crc))
        for piece in made:
            self._published[piece.at] = piece.capacity
            self._live[piece.at] = piece
            self.live_bytes += piece.length
        return SegmentBuffer(self, made)

    def published_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._published.items())
