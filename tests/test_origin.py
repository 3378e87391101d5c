"""Recorded byte ranges (slates.core.origin): pieces, edit spans, and volumes recording them."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core.extents import PAGE
from slates.core.host import Host
from slates.core.origin import NEW, Pieces, edit_spans, identity, replace_span
from slates.core.volume import ROOT_INO, FileBody, Volume
from slates.errors import InvalidArgument
from slates.merge.ranges import Replace, apply, compose
from tests.test_merge_ranges import base_and_ops

# -- examples --------------------------------------------------------------------


def spans(pieces: Pieces, original_size: int) -> list[tuple[int, int, int | None, int]]:
    """edit_spans, with no offset for a delete (`at` means nothing when no bytes are read)."""
    return [(s, e, at if n else None, n) for s, e, at, n in edit_spans(pieces, original_size)]


def test_identity() -> None:
    assert identity(0) == ()
    assert identity(7) == (0, 7)
    assert edit_spans(identity(7), 7) == []
    assert edit_spans((), 0) == []


def test_replace_span_examples() -> None:
    base = identity(21)  # quality=80\ncache=off\n
    assert replace_span(base, 8, 10, 2) == (0, 8, NEW, 2, 10, 11)
    assert replace_span(base, 0, 0, 12) == (NEW, 12, 0, 21)  # the format line
    assert replace_span(base, 21, 21, 3) == (0, 21, NEW, 3)  # an append
    assert replace_span(base, 0, 21, 0) == ()  # truncated to nothing
    assert replace_span(base, 3, 3, 0) == base  # an empty insert changes nothing
    # New runs next to each other merge, and so do contiguous original runs.
    twice = replace_span(replace_span(base, 8, 10, 2), 10, 10, 1)
    assert twice == (0, 8, NEW, 3, 10, 11)


def test_edit_spans_examples() -> None:
    assert edit_spans(replace_span(identity(21), 8, 10, 2), 21) == [(8, 10, 8, 2)]
    assert edit_spans(replace_span(identity(21), 0, 0, 12), 21) == [(0, 0, 0, 12)]
    assert spans(replace_span(identity(10), 2, 5, 0), 10) == [(2, 5, None, 0)]
    # Temporary content inserted and deleted again leaves nothing.
    temporary = replace_span(replace_span(identity(10), 3, 3, 9), 3, 12, 0)
    assert temporary == identity(10)
    assert edit_spans(temporary, 10) == []
    # A truncate-and-rewrite stays one whole replacement, even with the same size.
    rewrite = replace_span(replace_span(identity(10), 0, 10, 0), 0, 0, 10)
    assert edit_spans(rewrite, 10) == [(0, 10, 0, 10)]
    # A sparse write past the end: the hole is new bytes too.
    assert edit_spans(replace_span(identity(4), 4, 4, 6), 4) == [(4, 4, 4, 6)]
    # Several edits, each read off at its offset in the current file.
    pieces = replace_span(replace_span(identity(10), 8, 9, 3), 1, 2, 0)
    assert spans(pieces, 10) == [(1, 2, None, 0), (8, 9, 7, 3)]


@pytest.mark.parametrize(
    ("start", "end", "new_length"), [(-1, 2, 0), (3, 2, 0), (0, 6, 0), (6, 6, 1), (0, 1, -1)]
)
def test_replace_span_refuses_a_span_that_does_not_fit(
    start: int, end: int, new_length: int
) -> None:
    with pytest.raises(InvalidArgument):
        replace_span(identity(5), start, end, new_length)


def test_edit_spans_refuses_original_bytes_out_of_order() -> None:
    with pytest.raises(InvalidArgument):
        edit_spans((5, 2, 0, 2), 10)


# -- properties ------------------------------------------------------------------


def check_pieces(pieces: Pieces, size: int) -> None:
    """Pieces are (source, length) pairs, lengths positive, sources in order, runs merged."""
    assert len(pieces) % 2 == 0
    assert sum(pieces[1::2]) == size
    assert all(length > 0 for length in pieces[1::2])
    pairs = list(zip(pieces[::2], pieces[1::2], strict=True))
    for (s1, l1), (s2, _l2) in itertools.pairwise(pairs):
        assert not (s1 == NEW and s2 == NEW)
        if s1 != NEW and s2 != NEW:
            assert s1 + l1 < s2  # contiguous original runs would have merged
    sources = [s for s, _ in pairs if s != NEW]
    assert sources == sorted(sources)


@settings(max_examples=300, deadline=None)
@given(base_and_ops(max_base=30, max_ops=10))
def test_edit_spans_give_the_current_file_and_equal_compose(
    case: tuple[bytes, list[Replace]],
) -> None:
    base, ops = case
    current = base
    pieces = identity(len(base))
    for op in ops:
        current = apply(current, [op])
        pieces = replace_span(pieces, op.start, op.end, len(op.data))
        check_pieces(pieces, len(current))
    spans = edit_spans(pieces, len(base))
    edits = [Replace(start, end, current[at : at + length]) for start, end, at, length in spans]
    assert apply(base, edits) == current
    for start, end, _at, length in spans:
        assert start < end or length > 0  # never an empty edit
    for left, right in itertools.pairwise(edits):
        assert left.end < right.start  # sorted, separated
    assert tuple(edits) == compose(len(base), ops)
    # Where the unchanged bytes are, they are the base's bytes.
    offset = 0
    for source, length in zip(pieces[::2], pieces[1::2], strict=True):
        if source != NEW:
            assert current[offset : offset + length] == base[source : source + length]
        offset += length


# -- volumes record their files' origins -----------------------------------------

VolumeOp = Callable[[Volume, int, int], Replace]  # (volume, ino, size) -> the recorded replace


def write_op(offset: int, data: bytes) -> VolumeOp:
    def run(volume: Volume, ino: int, size: int) -> Replace:
        volume.write(ino, offset, data)
        start = min(offset, size)
        return Replace(start, min(offset + len(data), size), bytes(offset - start) + data)

    return run


def truncate_op(new_size: int) -> VolumeOp:
    def run(volume: Volume, ino: int, size: int) -> Replace:
        volume.truncate(ino, new_size)
        if new_size < size:
            return Replace(new_size, size, b"")
        return Replace(size, size, bytes(new_size - size))

    return run


def splice_op(start: int, end: int, data: bytes) -> VolumeOp:
    def run(volume: Volume, ino: int, size: int) -> Replace:
        start_, end_ = min(start, size), min(end, size)
        end_ = max(start_, end_)
        volume.splice(ino, start_, end_, data)
        return Replace(start_, end_, data)

    return run


def punch_op(offset: int, length: int) -> VolumeOp:
    def run(volume: Volume, ino: int, size: int) -> Replace:
        volume.punch_hole(ino, offset, length)
        lo, hi = min(offset, size), min(offset + length, size)
        return Replace(lo, hi, bytes(hi - lo))

    return run


def copy_op(offset: int, length: int) -> VolumeOp:
    """copy_file_range from the volume's /src file (PAGE bytes of b"s") into the file."""

    def run(volume: Volume, ino: int, size: int) -> Replace:
        src = volume.lookup(ROOT_INO, "src").ino
        volume.copy_range(src, 0, ino, offset, length)
        start = min(offset, size)
        data = bytes(offset - start) + b"s" * length
        return Replace(start, min(offset + length, size), data)

    return run


def volume_ops(sizes: int) -> st.SearchStrategy[VolumeOp]:
    offsets = st.integers(0, sizes)
    payload = st.binary(min_size=1, max_size=8)
    return st.one_of(
        st.builds(write_op, offsets, payload),
        st.builds(truncate_op, offsets),
        st.builds(splice_op, offsets, offsets, st.binary(max_size=8)),
        st.builds(punch_op, offsets, st.integers(1, 12)),
        st.builds(copy_op, offsets, st.integers(1, 12)),
    )


def origin_edits(volume: Volume, ino: int, original_size: int) -> tuple[Replace, ...]:
    body = volume.root.inodes[ino].body
    assert isinstance(body, FileBody)
    if body.origin is None or body.origin[0] != volume.root.record_gen:
        return ()
    return tuple(
        Replace(start, end, volume.read(ino, at, length))
        for start, end, at, length in edit_spans(body.origin[1], original_size)
    )


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=40),
    st.lists(volume_ops(48), max_size=8),
    st.lists(volume_ops(48), max_size=6),
)
def test_a_clone_records_its_changes_relative_to_the_snapshot(
    base: bytes, before: list[VolumeOp], after: list[VolumeOp]
) -> None:
    host = Host()
    volume = Volume.new(host)
    volume.write(volume.create(ROOT_INO, "src").ino, 0, b"s" * PAGE)
    ino = volume.create(ROOT_INO, "f").ino
    if base:
        volume.write(ino, 0, base)
    # Changes made before the snapshot are recorded in the volume's generation,
    # and are not a clone's changes.
    for op in before:
        op(volume, ino, volume.getattr(ino).size)
    original = volume.read(ino, 0, volume.getattr(ino).size)
    snapshot = volume.snapshot("snap-0-1")
    clone = Volume.clone(snapshot, host)
    assert clone.root.record_gen == snapshot.root.record_gen + 1
    assert origin_edits(clone, ino, len(original)) == ()
    replaces = []
    for op in after:
        replaces.append(op(clone, ino, clone.getattr(ino).size))
        if len(replaces) % 2:
            clone.seal()  # sealed or not, the record holds
    current = clone.read(ino, 0, clone.getattr(ino).size)
    expected = original
    for replace in replaces:
        expected = apply(expected, [replace])
    assert current == expected
    edits = origin_edits(clone, ino, len(original))
    assert apply(original, edits) == current  # so every changed byte is recorded
    # ...and nothing the operations did not touch: a write that lands on private
    # pages leaves out the bytes it rewrites unchanged (Volume.write), so the record
    # may be smaller than the operations' ranges, never larger.
    touched = compose(len(original), replaces)
    for edit in edits:
        assert any(t.start <= edit.start and edit.end <= t.end for t in touched), (edit, touched)
    # The snapshot's file is untouched by the clone's recording.
    reader = Volume.clone(snapshot, host)
    assert reader.read(ino, 0, len(original) + 1) == original
    assert origin_edits(reader, ino, len(original)) == ()


def test_shared_pages_and_punched_holes_are_recorded_as_new_bytes() -> None:
    host = Host()
    volume = Volume.new(host)
    src = volume.create(ROOT_INO, "src").ino
    volume.write(src, 0, b"s" * (2 * PAGE))
    ino = volume.create(ROOT_INO, "f").ino
    original = bytes(range(256)) * (3 * PAGE // 256)
    volume.write(ino, 0, original)
    clone = Volume.clone(volume.snapshot("snap-0-1"), host)
    clone.seal()
    assert clone.copy_range(src, 0, ino, PAGE, PAGE) == PAGE  # whole sealed pages: shared
    clone.punch_hole(ino, 2 * PAGE, PAGE)  # a whole page: a PunchHole record
    expected = original[:PAGE] + b"s" * PAGE + bytes(PAGE)
    assert clone.read(ino, 0, 3 * PAGE) == expected
    assert origin_edits(clone, ino, len(original)) == (Replace(PAGE, 3 * PAGE, expected[PAGE:]),)
