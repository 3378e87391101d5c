"""The small request's fast paths (issue 14) change nothing but their cost: a volume
whose appends take `Volume._append_pages` ends in the very state, counters, records and
results of one where every write takes the general path (a hypothesis run of writes,
truncates, creates and unlinks); an inode or root built directly equals what
dataclasses.replace makes of it; a record's single-call encoding is msgpack's own form
of it and decodes back; a page buffer grown by appends keeps the index a fresh one
computes; and a shard's appends recover to the same files."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import immutables
import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core import ROOT_INO, Host, Kind, Volume
from slates.core.extents import PAGE, PageSpan, uncovered
from slates.core.records import Create, Record, Unlink, Write, _default, decode, encode
from slates.core.volume import FileBody, Inode, _rebodied, _retimed
from slates.node.journal import Segment, create_segment
from slates.node.page_area import PageArea, SegmentBuffer, SegmentPages
from tests.test_shard_recovery import Segments, call
from tests.volume_check import check_invariants

# -- the append fast path against the general path -----------------------------------------

_OPS = st.lists(
    st.one_of(
        # An append at the end (aligned or not), of a few bytes to a few pages.
        st.tuples(st.just("append"), st.integers(1, 3 * PAGE + 7)),
        # A write anywhere near the file.
        st.tuples(st.just("write"), st.integers(0, 6 * PAGE), st.integers(1, 2 * PAGE)),
        st.tuples(st.just("truncate"), st.integers(0, 6 * PAGE)),
        st.tuples(st.just("create")),
        st.tuples(st.just("unlink")),
    ),
    max_size=25,
)


def _run(ops: list[tuple[Any, ...]], fast: bool) -> tuple[Volume, list[Any], Host]:
    host = Host()
    volume = Volume.new(host)
    if not fast:
        volume._append_pages = lambda *args: None  # type: ignore[method-assign]
    seen: list[Any] = []
    volume.on_applied = lambda record, result: seen.append((record, result))
    ino = volume.create(ROOT_INO, "f", time_ns=1).ino
    made = 0
    for step, op in enumerate(ops):
        data = bytes([step % 251 + 1]) * (op[-1] if op[0] in ("append", "write") else 0)
        match op:
            case ("append", _n):
                size = volume.getattr(ino).size
                seen.append(volume.write(ino, size, data, time_ns=step))
            case ("write", offset, _n):
                seen.append(volume.write(ino, offset, data, time_ns=step))
            case ("truncate", size):
                volume.truncate(ino, size, time_ns=step)
            case ("create",):
                made += 1
                seen.append(volume.create(ROOT_INO, f"n{made}", time_ns=step))
            case ("unlink",) if made:
                volume.unlink(ROOT_INO, f"n{made}", time_ns=step)
                made -= 1
            case _:
                pass
        check_invariants(volume)
    return volume, seen, host


@settings(max_examples=120, deadline=None)
@given(ops=_OPS)
def test_appends_on_the_fast_path_leave_what_the_general_path_leaves(
    ops: list[tuple[Any, ...]],
) -> None:
    fast, fast_seen, fast_host = _run(ops, fast=True)
    slow, slow_seen, slow_host = _run(ops, fast=False)
    assert fast.root == slow.root
    assert fast_seen == slow_seen  # records, results and write lengths
    assert (fast.unique_bytes, fast.metadata_bytes) == (slow.unique_bytes, slow.metadata_bytes)
    assert fast_host.private_bytes == slow_host.private_bytes
    assert fast_host.held_bytes == slow_host.held_bytes
    assert fast.charged_bytes == slow.charged_bytes
    assert dict(fast._buffers) == dict(slow._buffers)
    for ino in fast.root.inodes:
        if fast.root.inodes[ino].kind == Kind.FILE:
            size = fast.getattr(ino).size
            assert fast.read(ino, 0, size) == slow.read(ino, 0, size)


def test_an_append_grows_the_last_page_run_in_place() -> None:
    volume = Volume.new(Host())
    ino = volume.create(ROOT_INO, "f").ino
    taken = []
    append_pages = volume._append_pages

    def spy(*args: Any) -> int | None:
        taken.append(append_pages(*args))
        return taken[-1]

    volume._append_pages = spy  # type: ignore[method-assign, assignment]
    for i in range(5):
        volume.write(ino, i * PAGE, b"a" * PAGE)
    assert taken == [None, PAGE, PAGE, PAGE, PAGE]  # the first makes the run
    body = volume.root.inodes[ino].body
    assert isinstance(body, FileBody)
    assert len(body.extents) == 1 and isinstance(body.extents[0], PageSpan)
    assert body.extents[0].length == 5 * PAGE


@given(extents_end=st.integers(0, 8 * PAGE), at=st.integers(0, 8 * PAGE))
def test_an_empty_range_is_never_uncovered(extents_end: int, at: int) -> None:
    extents = (PageSpan(0, extents_end, 0),) if extents_end else ()
    assert uncovered(extents, at, at) == []  # what Volume.write's edge checks skip


# -- records built directly ------------------------------------------------------------------

_INODES = st.builds(
    Inode,
    ino=st.integers(1, 1 << 40),
    kind=st.sampled_from(list(Kind)),
    mode=st.integers(0, 0o7777),
    uid=st.integers(0, 1 << 31),
    gid=st.integers(0, 1 << 31),
    nlink=st.integers(0, 9),
    atime_ns=st.integers(0, 1 << 62),
    mtime_ns=st.integers(0, 1 << 62),
    ctime_ns=st.integers(0, 1 << 62),
    xattrs=st.dictionaries(st.text(max_size=4), st.binary(max_size=4)).map(immutables.Map),
    body=st.builds(FileBody, st.integers(0, 1 << 30), st.just(()), st.none(), st.none()),
    st_ino=st.integers(0, 1 << 40),
)


@given(inode=_INODES, time_ns=st.integers(0, 1 << 62), nlink=st.none() | st.integers(0, 9))
def test_inodes_built_directly_are_what_replace_makes(
    inode: Inode, time_ns: int, nlink: int | None
) -> None:
    body = FileBody(7, (), "p", None)
    changes: dict[str, Any] = {"body": body, "mtime_ns": time_ns, "ctime_ns": time_ns}
    if nlink is not None:
        changes["nlink"] = nlink
    assert _retimed(inode, body, time_ns, nlink) == dataclasses.replace(inode, **changes)
    assert _rebodied(inode, body) == dataclasses.replace(inode, body=body)
    # Every field is named: a field added to Inode must be added to both.
    assert [f.name for f in dataclasses.fields(Inode)][-2:] == ["body", "st_ino"]
    assert len(dataclasses.fields(Inode)) == 12


def _msgpack_form(record: Record) -> bytes:
    out: bytes = msgpack.packb(
        record, default=_default, use_bin_type=True, unicode_errors="surrogateescape"
    )
    return out


_RECORDS = st.one_of(
    st.builds(
        Write,
        st.integers(0, 1 << 40),
        st.integers(0, 1 << 40),
        st.binary(max_size=70_000),
        st.integers(0, 1 << 62),
        st.binary(max_size=300),
        st.binary(max_size=300),
    ),
    st.builds(
        Create,
        st.integers(0, 1 << 40),
        st.text(min_size=1, max_size=300),
        st.integers(0, 0o7777),
        st.integers(0, 1 << 31),
        st.integers(0, 1 << 31),
        st.integers(0, 1 << 62),
    ),
    st.builds(Unlink, st.integers(0, 1 << 40), st.text(min_size=1), st.integers(0, 1 << 62)),
)


@settings(max_examples=200, deadline=None)
@given(record=_RECORDS)
def test_a_record_encodes_in_one_call_as_msgpack_would(record: Record) -> None:
    assert encode(record) == _msgpack_form(record)
    assert decode(encode(record)) == record


# -- the page buffer's index as it grows -------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=12))
def test_an_extended_buffer_keeps_the_index_a_fresh_one_computes(sizes: list[int]) -> None:
    fd = create_segment("test-pages", 16 << 20)
    segment = Segment(fd)
    try:
        pages = SegmentPages(segment, PageArea(0, 16 << 20))
        pages.ready = True
        buffer = pages.new([])
        expected = b""
        for step, size in enumerate(sizes):
            data = bytes([step + 1]) * size
            buffer.extend(data)
            expected += data
            grown = (list(buffer._offsets), len(buffer))
            buffer._reindex()
            assert grown == (list(buffer._offsets), len(buffer))
            assert buffer[0 : len(buffer)] == expected
        assert isinstance(buffer, SegmentBuffer)
    finally:
        segment.close()
        os.close(fd)


# -- a shard's appends, recovered ---------------------------------------------------------------


def test_a_shards_small_appends_recover_to_the_same_file() -> None:
    segments = Segments()
    shard = segments.shard()
    shard.recover()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    made = call(
        shard, 2, "fs.create", volume=vid, parent=1, name="f", mode=0o644, flags=0, uid=0, gid=0
    )
    ino = made["attr"]["ino"] if "attr" in made else made["ino"]
    expected = b""
    for i in range(40):
        data = bytes([i + 1]) * (PAGE if i % 3 else 100 + i)
        call(shard, 3 + i, "fs.write", volume=vid, ino=ino, offset=len(expected), data=data, fh=0)
        expected += data
    again = segments.shard()
    again.recover()
    assert again.service.volumes[vid].read(ino, 0, len(expected) + 10) == expected
    assert again.service.volumes[vid].root == shard.service.volumes[vid].root
