"""Extent maps: a file's content as ordered, non-overlapping byte ranges.

Theory of operation: a file's bytes [0, size) are described by a sorted
tuple of extents.  Each extent says where its bytes come from: the base file
(`BaseSpan`, read on demand and fingerprint-checked), a sealed chunk
(`ChunkSpan`, immutable and shared), or private mutable pages owned by one
live volume (`PageSpan`, one bytearray per extent).  A gap between extents
is a hole and reads as zeros without storing anything.

Invariants the volume keeps (checked by tests, relied on here):
- extents are sorted by start and never overlap;
- a PageSpan starts and ends on a PAGE boundary and owns its whole buffer
  (buffer length == extent length), so writes can update it in place;
- bytes of a page buffer at or beyond the file size are zero;
- BaseSpan and ChunkSpan extents lie inside [0, size).

These functions are pure: they take tuples and return new tuples.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Iterator

__all__ = [
    "PAGE",
    "BaseSpan",
    "ChunkSpan",
    "PageSpan",
    "Extent",
    "page_floor",
    "page_ceil",
    "overlapping",
    "uncovered",
    "trim",
    "splice",
    "stored_length",
    "allocated_length",
]

PAGE = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class BaseSpan:
    start: int
    length: int
    base_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkSpan:
    start: int
    length: int
    chunk_id: bytes
    chunk_offset: int
    epoch: int = 0  # the volume epoch that sealed it: unique to a volume sealing at that epoch


@dataclasses.dataclass(frozen=True, slots=True)
class PageSpan:
    start: int
    length: int
    buffer_id: int


Extent = BaseSpan | ChunkSpan | PageSpan


def page_floor(offset: int) -> int:
    return offset - offset % PAGE


def page_ceil(offset: int) -> int:
    return -(-offset // PAGE) * PAGE


_START = operator.attrgetter("start")  # bisect's key, in C: this runs several times a write


def _first_overlap(extents: tuple[Extent, ...], start: int) -> int:
    """Index of the first extent whose end is beyond `start`."""
    i = bisect.bisect_right(extents, start, key=_START)
    if i > 0 and extents[i - 1].start + extents[i - 1].length > start:
        return i - 1
    return i


def overlapping(extents: tuple[Extent, ...], start: int, end: int) -> Iterator[Extent]:
    """Extents that share at least one byte with [start, end), in order."""
    for i in range(_first_overlap(extents, start), len(extents)):
        extent = extents[i]
        if extent.start >= end:
            return
        yield extent


def uncovered(extents: tuple[Extent, ...], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) that no PageSpan covers, as (start, end) pairs."""
    gaps: list[tuple[int, int]] = []
    cursor = start
    # `overlapping`, inlined: every write asks this several times.
    for i in range(_first_overlap(extents, start), len(extents)):
        extent = extents[i]
        if extent.start >= end:
            break
        if not isinstance(extent, PageSpan):
            continue
        if extent.start > cursor:
            gaps.append((cursor, extent.start))
        cursor = max(cursor, extent.start + extent.length)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


def trim(extent: Extent, start: int, end: int) -> Extent | None:
    """The part of a base or chunk extent inside [start, end), or None."""
    lo = max(extent.start, start)
    hi = min(extent.start + extent.length, end)
    if lo >= hi:
        return None
    shift = lo - extent.start
    if isinstance(extent, BaseSpan):
        return BaseSpan(lo, hi - lo, extent.base_offset + shift)
    if isinstance(extent, ChunkSpan):
        return ChunkSpan(lo, hi - lo, extent.chunk_id, extent.chunk_offset + shift, extent.epoch)
    raise ValueError("page extents are resized with their buffers, not trimmed")


def splice(
    extents: tuple[Extent, ...], start: int, end: int, inserted: list[Extent]
) -> tuple[Extent, ...]:
    """Replace whatever covers [start, end) with `inserted` (which lies inside it).

    Base and chunk extents that straddle the edges are trimmed; the caller
    guarantees that no PageSpan straddles an edge.
    """
    first = _first_overlap(extents, start)
    last = first
    head: list[Extent] = []
    tail: list[Extent] = []
    while last < len(extents) and extents[last].start < end:
        extent = extents[last]
        if extent.start < start:
            kept = trim(extent, extent.start, start)
            if kept is not None:
                head.append(kept)
        if extent.start + extent.length > end:
            kept = trim(extent, end, extent.start + extent.length)
            if kept is not None:
                tail.append(kept)
        last += 1
    return (*extents[:first], *head, *inserted, *tail, *extents[last:])


def stored_length(extents: tuple[Extent, ...], size: int) -> int:
    """Bytes of the file [0, size) held by Slates (chunks and pages, not base or holes)."""
    total = 0
    for extent in extents:
        if isinstance(extent, BaseSpan) or extent.start >= size:
            continue
        total += min(extent.start + extent.length, size) - extent.start
    return total


def allocated_length(extents: tuple[Extent, ...], size: int) -> int:
    """Bytes of [0, size) that are not holes (what st_blocks reports)."""
    total = 0
    for extent in extents:
        if extent.start < size:
            total += min(extent.start + extent.length, size) - extent.start
    return total
