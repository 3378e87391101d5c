"""The build path's fast paths against the plain paths they stand in for (issue 14).

A lua build sends its shard about 2,000 small requests, most of them writes;
their cost was cut by fast paths that must give exactly what the general
code gives:

- `content_tally` (slates.core.volume) counts in one pass what `_referenced`,
  `_buffer_ids` and the volume's per-inode unique and page counts (as they were,
  `_plain_unique` and `_plain_page_bytes` here) count in four, for any extent
  map, size and epoch;
- a volume reuses the tally of the inode its last record made (`_tallies`, at
  most KNOWN_TALLIES of them):
  after any sequence of writes, truncates, snapshots and unlinks its counters
  are what a fresh count of its inodes gives (the stateful model in
  tests/test_volume_model.py checks the same through volume_check);
- `uncovered` (slates.core.extents), which walks the extents itself, gives the
  gaps the walk over `overlapping` gave;
- `Journal.append` of one bytes payload (`_append_bytes`) leaves the segment
  byte for byte as the general path leaves it for the same payload as a
  one-part list, and the frames read back.
"""

from __future__ import annotations

import os

import immutables
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core.extents import BaseSpan, ChunkSpan, Extent, PageSpan, overlapping, uncovered
from slates.core.host import Host
from slates.core.records import Kind
from slates.core.volume import (
    KNOWN_TALLIES,
    ROOT_INO,
    FileBody,
    Inode,
    SymlinkBody,
    Volume,
    _buffer_ids,
    _referenced,
    content_tally,
)
from slates.node.journal import Journal, Segment


@st.composite
def extent_maps(draw: st.DrawFn) -> tuple[Extent, ...]:
    """Ordered, non-overlapping extents of every kind, with holes between some."""
    out: list[Extent] = []
    cursor = 0
    for _ in range(draw(st.integers(0, 12))):
        cursor += draw(st.sampled_from([0, 0, 1, 4096, 5000]))  # a hole, sometimes
        length = draw(st.integers(1, 3 * 4096))
        kind = draw(st.sampled_from(["base", "chunk", "page"]))
        if kind == "base":
            out.append(BaseSpan(cursor, length, draw(st.integers(0, 1 << 20))))
        elif kind == "chunk":
            epoch = draw(st.integers(0, 3))
            out.append(ChunkSpan(cursor, length, b"c" * 32, draw(st.integers(0, 100)), epoch))
        else:
            out.append(PageSpan(cursor, length, draw(st.integers(1, 6))))
        cursor += length
    return tuple(out)


def _file(extents: tuple[Extent, ...], size: int) -> Inode:
    body = FileBody(size, extents, None, None)
    return Inode(7, Kind.FILE, 0o644, 0, 0, 1, 0, 0, 0, immutables.Map(), body)


def _plain_unique(inode: Inode | None, epoch: int) -> int:
    """`Volume._unique` as it was: pages, and chunks sealed in `epoch`."""
    if inode is None or not isinstance(inode.body, FileBody):
        return 0
    total = 0
    for extent in inode.body.extents:
        if isinstance(extent, PageSpan) or (
            isinstance(extent, ChunkSpan) and extent.epoch == epoch
        ):
            total += extent.length
    return total


def _plain_page_bytes(inode: Inode | None) -> int:
    """`_page_bytes` as it was."""
    if inode is None or not isinstance(inode.body, FileBody):
        return 0
    return sum(e.length for e in inode.body.extents if type(e) is PageSpan)


def _plain_tally(inode: Inode | None, epoch: int) -> tuple[int, int, int, set[int]]:
    unique = _plain_unique(inode, epoch)
    return _referenced(inode), unique, _plain_page_bytes(inode), _buffer_ids(inode)


@settings(max_examples=300, deadline=None)
@given(extent_maps(), st.integers(0, 80_000), st.integers(0, 3))
def test_content_tally_is_the_four_counts_it_replaces(
    extents: tuple[Extent, ...], size: int, epoch: int
) -> None:
    inode = _file(extents, size)
    assert content_tally(inode, epoch) == _plain_tally(inode, epoch)


def test_content_tally_of_what_holds_no_content() -> None:
    link = Inode(8, Kind.SYMLINK, 0o777, 0, 0, 1, 0, 0, 0, immutables.Map(), SymlinkBody("x"))
    for inode in (None, link):
        assert content_tally(inode, 0) == _plain_tally(inode, 0) == (0, 0, 0, set())


def _plain_uncovered(extents: tuple[Extent, ...], start: int, end: int) -> list[tuple[int, int]]:
    """`uncovered` as it was, over the `overlapping` generator."""
    gaps: list[tuple[int, int]] = []
    cursor = start
    for extent in overlapping(extents, start, end):
        if not isinstance(extent, PageSpan):
            continue
        if extent.start > cursor:
            gaps.append((cursor, extent.start))
        cursor = max(cursor, extent.start + extent.length)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


@settings(max_examples=300, deadline=None)
@given(extent_maps(), st.integers(0, 60_000), st.integers(0, 20_000))
def test_uncovered_is_the_walk_over_overlapping(
    extents: tuple[Extent, ...], start: int, length: int
) -> None:
    assert uncovered(extents, start, start + length) == _plain_uncovered(
        extents, start, start + length
    )


def _recount(volume: Volume) -> tuple[int, int]:
    """(referenced, unique) bytes counted afresh from every inode of the volume."""
    referenced = unique = 0
    for inode in volume.root.inodes.values():
        tally = _plain_tally(inode, volume.root.epoch)
        referenced += tally[0]
        unique += tally[1]
    return referenced, unique


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("write"), st.integers(0, 3), st.integers(0, 40_000), st.integers(1, 9000)
        ),
        st.tuples(st.just("truncate"), st.integers(0, 3), st.integers(0, 30_000), st.just(0)),
        st.tuples(st.just("unlink"), st.integers(0, 3), st.just(0), st.just(0)),
        st.tuples(st.just("snapshot"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("seal"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_counters_after_reused_tallies_are_a_fresh_count(
    steps: list[tuple[str, int, int, int]],
) -> None:
    volume = Volume.new(Host(capacity=1 << 30))
    snapshots = 0
    for op, which, at, size in steps:
        name = f"f{which}"
        if op == "write":
            try:
                ino = volume.lookup(ROOT_INO, name).ino
            except Exception:
                ino = volume.create(ROOT_INO, name, 0o644).ino
            volume.write(ino, at, bytes([which + 1]) * size)
        elif op == "truncate":
            try:
                volume.truncate(volume.lookup(ROOT_INO, name).ino, at)
            except Exception:
                continue  # no such file yet
        elif op == "unlink":
            try:
                volume.unlink(ROOT_INO, name)
            except Exception:
                continue
        elif op == "snapshot":
            snapshots += 1
            volume.snapshot(f"snap-0-{snapshots}")
        else:
            volume.seal()
        referenced, unique = _recount(volume)
        assert volume.root.referenced_bytes == referenced
        assert volume.unique_bytes == unique


def test_the_known_tallies_are_bounded_and_the_counters_stay_right() -> None:
    volume = Volume.new(Host(capacity=1 << 30))
    files = [volume.create(ROOT_INO, f"f{n}", 0o644).ino for n in range(3 * KNOWN_TALLIES)]
    for round_number in range(2):
        for ino in files:
            volume.write(ino, round_number * 5000, b"x" * 3000)
            assert len(volume._tallies) <= KNOWN_TALLIES
    assert (volume.root.referenced_bytes, volume.unique_bytes) == _recount(volume)


@settings(max_examples=40, deadline=None)
@given(payloads=st.lists(st.binary(min_size=0, max_size=3000), max_size=20))
def test_a_bytes_frame_is_journaled_as_a_one_part_frame(payloads: list[bytes]) -> None:
    fds = []
    for name in ("fast", "plain"):
        fd = os.memfd_create(f"test-journal-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, 1 << 20)
        fds.append(fd)
    try:
        fast, plain = Journal(Segment(fds[0])), Journal(Segment(fds[1]))
        for payload in payloads:
            fast.append(payload)
            plain.append([payload])
        assert fast.committed == plain.committed
        assert fast.segment.map[:] == plain.segment.map[:]
        assert list(fast.entries()) == payloads
    finally:
        for fd in fds:
            os.close(fd)
