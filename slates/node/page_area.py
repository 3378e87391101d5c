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
  bytes, or None once they changed in place (the next checkpoint computes
  it).  An append keeps it: the CRC of the bytes it copies is computed from
  their new place, right after the copy (journal.crc32, libdeflate's where
  it is installed), and combined into the piece's (crc32_combine), and the
  CRC of all the data, remembered for the write's journal frame
  (`remember_crc`, `take_crcs`: the shard finds the data among the frame's
  parts by identity), so an appended byte is read for a CRC once, not once
  for the journal and again at the checkpoint.  Writing pages that may
  not have been resident marks the segment (`fill`: Segment.touched or
  populate), so the shard reads the segment's allocated bytes only then.
- `SegmentPages`: the shard host's PageMemory (slates.core.host).  It
  knows the pieces live buffers use (`_live`) and the ranges the published
  checkpoint references (`_published`, offset -> capacity): a range is free
  once neither holds it.  Freed space stays warm (its pages resident, taken
  before cold space: a write into it faults no fresh zeroed page in) while
  the warm space is within `warm_limit` (the shard sets at most WARM_BYTES);
  past that its pages go back (MADV_REMOVE).  Warm pages are allocated
  pages of the segment, so the shard's memory figures (segment_bytes) and
  the host's overhead count them.  Before the published checkpoint is read
  (`ready`), nothing may be taken.

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
import itertools
from collections.abc import Sequence

from slates.core.host import Bytes, PageBuffer
from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node.journal import PAGE as _PAGE
from slates.node.journal import Segment, combine_crc, crc32

__all__ = [
    "MAX_REMEMBERED_CRCS",
    "PIECE_BYTES",
    "REMEMBERED_CRC_BYTES",
    "WARM_BYTES",
    "PageArea",
    "Piece",
    "SegmentBuffer",
    "SegmentPages",
]

# A buffer's bytes are held in pieces of at most this: a copy on write copies at most
# one piece per end of the range written.
PIECE_BYTES = 1 << 20
# Fresh space for a copy at least this large is faulted in with one call first.
_POPULATE_BYTES = 64 << 10
# A buffer this large that grows is given room beyond what it needs (see extend).
_GROWING_BYTES = 64 << 10
# Freed page space a shard keeps resident for reuse, at most (SegmentPages.warm_limit;
# the shard also caps it at a sixteenth of its host): a new file's pages taken from it
# fault no fresh zeroed page in.  Its pages count in the segment's allocated bytes.
WARM_BYTES = 64 << 20
# Data whose CRC an extend remembers for its journal frame: at least this large, and at
# most this many between two commits (one request writes one data).
REMEMBERED_CRC_BYTES = 64 << 10
MAX_REMEMBERED_CRCS = 16


def _pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


class _Ranges:
    """Sorted disjoint page-aligned ranges, [start, end) each, and their total."""

    __slots__ = ("ends", "starts", "total")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0

    def overlaps(self, start: int, end: int) -> bool:
        at = bisect.bisect_right(self.starts, start)
        return (at > 0 and self.ends[at - 1] > start) or (
            at < len(self.starts) and self.starts[at] < end
        )

    def take(self, nbytes: int) -> list[tuple[int, int]]:
        """Up to `nbytes` as (offset, length) ranges, lowest first (less if it has less)."""
        got: list[tuple[int, int]] = []
        need, used = nbytes, 0
        while need and used < len(self.starts):
            start, end = self.starts[used], self.ends[used]
            length = min(end - start, need)
            got.append((start, length))
            need -= length
            if start + length == end:
                used += 1
            else:
                self.starts[used] = start + length
        del self.starts[:used]
        del self.ends[:used]
        self.total -= nbytes - need
        return got

    def take_whole(self, nbytes: int) -> int | None:
        for index, (start, end) in enumerate(zip(self.starts, self.ends, strict=True)):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self.starts[index]
                    del self.ends[index]
                else:
                    self.starts[index] = start + nbytes
                self.total -= nbytes
                return start
        return None

    def carve(self, start: int, end: int) -> None:
        """Remove [start, end) from the ranges, wherever they cover it."""
        at = max(0, bisect.bisect_right(self.starts, start) - 1)
        while at < len(self.starts) and self.starts[at] < end:
            lo, hi = self.starts[at], self.ends[at]
            if hi <= start:
                at += 1
                continue
            cut_lo, cut_hi = max(lo, start), min(hi, end)
            self.total -= cut_hi - cut_lo
            keep = [(a, b) for a, b in ((lo, cut_lo), (cut_hi, hi)) if b > a]
            self.starts[at : at + 1] = [a for a, _b in keep]
            self.ends[at : at + 1] = [b for _a, b in keep]
            at += len(keep)

    def give(self, start: int, end: int) -> None:
        """Add [start, end) (not overlapping any range), joining its neighbours."""
        at = bisect.bisect_right(self.starts, start)
        joins_left = at > 0 and self.ends[at - 1] == start
        joins_right = at < len(self.starts) and self.starts[at] == end
        if joins_left and joins_right:
            self.ends[at - 1] = self.ends[at]
            del self.starts[at]
            del self.ends[at]
        elif joins_left:
            self.ends[at - 1] = end
        elif joins_right:
            self.starts[at] = start
        else:
            self.starts.insert(at, start)
            self.ends.insert(at, end)
        self.total += end - start


class PageArea:
    """A free map over [start, end): sorted disjoint free ranges, page-aligned.

    Free space is of two kinds: cold (its pages were given back: they read as
    zeros and cost nothing until touched) and warm (freed, its pages kept
    resident for reuse, `give(warm=True)`).  Taking prefers warm space: a copy
    into it faults no fresh zeroed page in.  Which freed space stays warm, and
    how much, is the caller's choice (SegmentPages bounds it)."""

    def __init__(self, start: int, end: int, *, free: bool = True) -> None:
        self.start, self.end = start, end
        self._cold = _Ranges()
        self._warm = _Ranges()
        if free and end > start:
            self._cold.give(start, end)

    @property
    def free_bytes(self) -> int:
        return self._cold.total + self._warm.total

    @property
    def warm_bytes(self) -> int:
        """Free bytes whose pages are resident (the host counts them: they are held)."""
        return self._warm.total

    def gaps(self) -> list[tuple[int, int]]:
        """Every free range, warm or cold, neighbours joined, lowest first."""
        both = sorted(
            itertools.chain(
                zip(self._cold.starts, self._cold.ends, strict=True),
                zip(self._warm.starts, self._warm.ends, strict=True),
            )
        )
        out: list[tuple[int, int]] = []
        for start, end in both:
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        return out

    def warm_gaps(self) -> list[tuple[int, int]]:
        return list(zip(self._warm.starts, self._warm.ends, strict=True))

    def take(self, nbytes: int) -> list[tuple[int, int]]:
        """`nbytes` (a page multiple) of free space as (offset, length) ranges, warm
        first, then cold, each lowest first; CapacityExhausted (taking nothing) when
        the area has less free."""
        if nbytes > self.free_bytes:
            raise CapacityExhausted(
                "the checkpoint segment's page area is full",
                at_least=nbytes,
                room=self.free_bytes,
            )
        got = self._warm.take(nbytes)
        taken = sum(length for _at, length in got)
        if taken < nbytes:
            got += self._cold.take(nbytes - taken)
        return got

    def take_whole(self, nbytes: int) -> int:
        """One free range of `nbytes` (a page multiple): first fit in warm space, else in
        cold, else across neighbouring warm and cold ranges; CapacityExhausted if none."""
        at = self._warm.take_whole(nbytes)
        if at is None:
            at = self._cold.take_whole(nbytes)
        if at is None:
            at = next((lo for lo, hi in self.gaps() if hi - lo >= nbytes), None)
            if at is None:
                raise CapacityExhausted(
                    "the checkpoint document does not fit its segment", at_least=nbytes
                )
            self._warm.carve(at, at + nbytes)
            self._cold.carve(at, at + nbytes)
        return at

    def give(self, start: int, length: int, *, warm: bool = False) -> None:
        """Free [start, start+length), cold (its pages already given back) or warm (its
        pages resident), joining its free neighbours of the same kind."""
        end = start + length
        if (
            start < self.start
            or end > self.end
            or self._cold.overlaps(start, end)
            or self._warm.overlaps(start, end)
        ):
            raise InvalidArgument("freeing checkpoint space that is free", start=start)
        (self._warm if warm else self._cold).give(start, end)

    def cool(self) -> list[tuple[int, int]]:
        """Make all warm space cold; the ranges whose pages the caller now gives back."""
        ranges = self.warm_gaps()
        self._warm = _Ranges()
        for start, end in ranges:
            self._cold.give(start, end)
        return ranges


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
        # The CRC of each part copied is computed once, here: it extends its piece's
        # CRC (the checkpoint need not read the piece again) and makes the data's,
        # which the journal frame of this write takes as given (SegmentPages.take_crcs).
        whole: int | None = None
        if self._pieces:
            last = self._pieces[-1]
            room = last.capacity - last.length if last.length >= last.frozen else 0
            if room:
                done = min(room, len(view))
                part = view[:done]
                pages.fill(last, last.length, last.length + done)
                mm[last.at + last.length : last.at + last.length + done] = part
                whole = crc32(memoryview(mm)[last.at + last.length : last.at + last.length + done])
                last.crc = None if last.crc is None else combine_crc(last.crc, whole, done)
                last.length += done
                pages.live_bytes += done
                self._length += done  # the last piece grew: no offset moved
        if done < len(view):
            rest = len(view) - done
            # A buffer that keeps growing gets room to grow into (its last piece's
            # capacity doubles, up to a piece), so appends rarely start a new piece.
            grow = 0
            if self._pieces and self._length >= _GROWING_BYTES:
                grow = min(PIECE_BYTES, 2 * self._pieces[-1].capacity)
            for piece in pages.take_pieces(rest, grow):
                part = view[done : done + piece.length]
                pages.fill(piece, 0, piece.length)
                mm[piece.at : piece.at + piece.length] = part
                piece.crc = crc32(memoryview(mm)[piece.at : piece.at + piece.length])
                if not done:
                    whole = piece.crc
                elif whole is not None:
                    whole = combine_crc(whole, piece.crc, piece.length)
                done += piece.length
                self._pieces.append(piece)
                self._offsets.append(self._length)  # the index kept as it grows
                self._length += piece.length
        if whole is not None:
            pages.remember_crc(data, whole)

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

    def __init__(self, segment: Segment, area: PageArea, warm_limit: int = 0) -> None:
        self.segment = segment
        self.area = area
        # Freed space kept resident (warm) for reuse, at most: the rest's pages go back.
        self.warm_limit = warm_limit
        self.ready = False  # the free map is known (the published checkpoint was read)
        self._live: dict[int, Piece] = {}  # area offset -> the live piece there
        self._published: dict[int, int] = {}  # area offset -> capacity, published ranges
        self.live_bytes = 0  # bytes live buffers hold (the host counts them as private)
        self.stale_bytes = 0  # space only the published checkpoint holds (the next frees it)
        self.copied_bytes = 0  # bytes copied on write (a published piece written again)
        self.written_bytes = 0  # bytes written into fresh or private space
        self._crcs: dict[int, tuple[bytes, int]] = {}  # see remember_crc

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
                if length == 0:  # more capacity than bytes: the range goes back, cold
                    self.area.give(at, capacity)  # (it may have been warm: its pages too)
                    self.segment.release(at, at + capacity)
                    continue
                out.append(piece)
                self._live[at] = piece
                self.live_bytes += length
                left -= length
        return out

    def fill(self, piece: Piece, lo: int, hi: int) -> None:
        """[lo, hi) of `piece` is about to be written: count it, fault large runs in (the
        segment's resident pages may change either way)."""
        self.written_bytes += hi - lo
        if hi - lo >= _POPULATE_BYTES:
            self.segment.populate(piece.at + lo, piece.at + hi)
        else:
            self.segment.touched()

    def drop(self, piece: Piece) -> None:
        """No live buffer holds `piece` now: its range is free unless published."""
        if self._live.pop(piece.at, None) is not piece:
            raise InvalidArgument("dropping a page piece that is not live", at=piece.at)
        self.live_bytes -= piece.length
        if piece.at in self._published:
            self.stale_bytes += self._published[piece.at]
        else:
            self.give_back(piece.at, capacity=piece.capacity)

    def remember_crc(self, data: Bytes, crc: int) -> None:
        """`crc` is the CRC32 of all of `data`'s underlying bytes object, if `data` covers
        it whole (a write's data): kept, at most MAX_REMEMBERED_CRCS of them, for its
        journal frame (take_crcs); smaller data is not worth remembering."""
        base = data.obj if isinstance(data, memoryview) else data
        if (
            type(base) is bytes
            and len(base) == memoryview(data).nbytes
            and len(base) >= REMEMBERED_CRC_BYTES
            and len(self._crcs) < MAX_REMEMBERED_CRCS
        ):
            self._crcs[id(base)] = (base, crc)

    def take_crcs(self) -> dict[int, tuple[bytes, int]]:
        """The CRCs remembered since the last call, id(bytes) -> (those bytes, crc32), and
        forget them (the shard takes them at every commit)."""
        crcs, self._crcs = self._crcs, {}
        return crcs

    def cool(self) -> int:
        """Give the warm space's pages back to the host (it stays free, now cold): the
        host counts them, and a request refused for room gets theirs.  The bytes cooled."""
        ranges = self.area.cool()
        for start, end in ranges:
            self.segment.release(start, end)
        return sum(end - start for start, end in ranges)

    def give_back(self, at: int, capacity: int) -> None:
        """[at, at+capacity) is free: warm (its pages kept for the next taker) while the
        warm space stays within `warm_limit`, else cold (its pages go back now)."""
        if self.area.warm_bytes + capacity <= self.warm_limit:
            self.area.give(at, capacity, warm=True)
        else:
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
                piece.crc = crc32(mm[piece.at : piece.at + piece.length])
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
                self.give_back(at, capacity)
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
            if crc32(mm[at : at + length]) != crc:
                raise VerificationFailed("checkpoint page bytes fail their checksum", at=at)
            made.append(Piece(at, _pages(length), length, length, crc))
        for piece in made:
            self._published[piece.at] = piece.capacity
            self._live[piece.at] = piece
            self.live_bytes += piece.length
        return SegmentBuffer(self, made)

    def published_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._published.items())
