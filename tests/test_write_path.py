"""The write path's copies and checksums (issue 14, lever 3): a journal frame takes a
part's CRC as given (Checksummed) and still reads back exactly, or fails its check when
the CRC is wrong; a record encodes in parts whose join is its encoding, its large data a
part of its own; frame_parts leaves no reference cycle holding a commit's data; freed
page space stays warm within its bound and is taken again first; an append's CRC is
remembered for its frame; and a shard that journals writes that way recovers them."""

from __future__ import annotations

import gc
import os
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core.records import Splice, Write, decode, encode, encoded_parts
from slates.errors import VerificationFailed
from slates.node import shard as shard_module
from slates.node.checkpoints import Checkpoints
from slates.node.events import RecordApplied, frame_parts, to_wire
from slates.node.journal import PAGE, Checksummed, Journal, Segment, combine_crc, create_segment
from slates.node.memory import heap_free_bytes, keep_heap, segment_bytes
from slates.node.page_area import MAX_REMEMBERED_CRCS, REMEMBERED_CRC_BYTES, SegmentBuffer
from slates.node.protocol import Hello, pack, unpack
from tests.test_shard_recovery import call

MiB = 1 << 20
LARGE = 64 << 10


@pytest.fixture
def journal() -> Iterator[Journal]:
    fd = create_segment("test-journal", 8 * MiB)
    segment = Segment(fd)
    yield Journal(segment)
    segment.close()
    os.close(fd)


# -- the journal's given checksums -------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.tuples(st.binary(max_size=3000), st.booleans()), min_size=1, max_size=6))
def test_a_frame_with_given_checksums_reads_back_as_its_parts_joined(
    parts: list[tuple[bytes, bool]],
) -> None:
    fd = create_segment("test-journal", 1 * MiB)
    segment = Segment(fd)
    try:
        journal = Journal(segment)
        given_parts = [Checksummed(p, zlib.crc32(p)) if known else p for p, known in parts]
        journal.append(given_parts)
        journal.append(b"after")
        assert list(journal.entries()) == [b"".join(p for p, _ in parts), b"after"]
    finally:
        segment.close()
        os.close(fd)


def test_a_wrong_given_checksum_fails_the_frame_at_read(journal: Journal) -> None:
    data = os.urandom(LARGE)
    journal.append([b"head", Checksummed(data, zlib.crc32(data) ^ 1), b"tail"])
    with pytest.raises(VerificationFailed):
        list(journal.entries())


@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000))
def test_combined_checksums_are_the_checksum_of_the_join(a: bytes, b: bytes) -> None:
    assert combine_crc(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


# -- records in parts --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([0, 1, LARGE - 1, LARGE, LARGE + 3, 2 * LARGE]), splice=st.booleans())
def test_a_record_in_parts_joins_to_its_encoding(size: int, splice: bool) -> None:
    data = os.urandom(size)
    record = Splice(3, 5, 9, data, 11) if splice else Write(3, 1 << 40, data, 7, b"h", b"t")
    parts = encoded_parts(record)
    encoded = encode(record)
    assert b"".join(parts) == encoded and decode(encoded) == record
    # Large data is a part of its own, the data itself (not a copy); small data is not.
    assert any(part is data for part in parts) == (size >= LARGE)


def test_frame_parts_leave_no_cycle_holding_the_data() -> None:
    data = os.urandom(MiB)
    record = Write(ino=2, offset=0, data=data, time_ns=1)
    gc.disable()
    try:
        before = sys.getrefcount(data)
        event = RecordApplied("vol-0-1", tuple(encoded_parts(record)))
        parts = frame_parts([event])
        assert b"".join(parts) == pack({"events": [to_wire(event)]})
        assert any(part is data for part in parts)
        del parts, event
        assert sys.getrefcount(data) == before  # freed at once, not by the collector
    finally:
        gc.enable()


# -- warm page space ---------------------------------------------------------------------


class _Pages:
    def __init__(self, area_bytes: int, warm_limit: int) -> None:
        self.fd = create_segment("test-pages", PAGE + area_bytes)
        self.segment = Segment(self.fd)
        self.checkpoints = Checkpoints(self.segment)
        assert self.checkpoints.read() is None
        self.pages = self.checkpoints.pages
        self.pages.warm_limit = warm_limit

    def close(self) -> None:
        self.segment.close()
        os.close(self.fd)


def _offsets(buffer: SegmentBuffer) -> set[int]:
    return {piece.at for piece in buffer._pieces}


def test_freed_space_stays_warm_within_its_bound_and_is_taken_first() -> None:
    made = _Pages(16 * MiB, warm_limit=4 * MiB)
    try:
        pages = made.pages
        data = os.urandom(3 * MiB)
        first = pages.new([data])
        held = segment_bytes(made.fd)
        where = _offsets(first)
        pages.free(first)
        # Within the bound: the pages stay (warm), counted in the segment's bytes.
        assert pages.area.warm_bytes == 3 * MiB and segment_bytes(made.fd) == held
        second = pages.new([os.urandom(3 * MiB)])
        assert _offsets(second) == where and pages.area.warm_bytes == 0
        assert segment_bytes(made.fd) == held  # no fresh page faulted in
        # Past the bound: what does not fit the warm space goes back to the host.
        third = pages.new([os.urandom(3 * MiB)])
        pages.free(second)
        pages.free(third)
        assert pages.area.warm_bytes <= 4 * MiB
        assert segment_bytes(made.fd) <= pages.area.warm_bytes + 2 * PAGE
    finally:
        made.close()


def test_an_append_remembers_its_datas_checksum_for_the_frame() -> None:
    made = _Pages(16 * MiB, warm_limit=0)
    try:
        pages = made.pages
        data = os.urandom(MiB + 5)
        buffer = pages.new([os.urandom(100)])
        buffer.extend(memoryview(data))  # the whole object, as a volume's view of it
        small = os.urandom(REMEMBERED_CRC_BYTES - 1)
        buffer.extend(small)
        part = os.urandom(4 * LARGE)
        buffer.extend(memoryview(part)[1:])  # a part of an object: no CRC of the whole
        crcs = pages.take_crcs()
        assert crcs == {id(data): (data, zlib.crc32(data))}
        assert pages.take_crcs() == {}
        mm = made.segment.map
        for piece in buffer._pieces:
            assert piece.crc is None or piece.crc == zlib.crc32(
                mm[piece.at : piece.at + piece.length]
            )
        many = [os.urandom(REMEMBERED_CRC_BYTES) for _ in range(MAX_REMEMBERED_CRCS + 3)]
        for item in many:
            buffer.extend(item)
        assert len(pages.take_crcs()) == MAX_REMEMBERED_CRCS  # bounded
    finally:
        made.close()


# -- a shard's frames --------------------------------------------------------------------


def _segments() -> tuple[int, int, int]:
    return (
        create_segment("journal", 64 * MiB),
        create_segment("checkpoint", 64 * MiB),
        create_segment("arena", 8 * MiB),
    )


def test_a_shard_journals_an_appended_write_with_its_page_checksum_and_recovers_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fds = _segments()
    try:
        shard = shard_module.Shard(0, *fds, capacity=1 << 30)
        shard.recover()
        frames: list[list[Any]] = []
        append = Journal.append

        def spy(self: Journal, payload: Any) -> None:
            frames.append(list(payload))
            append(self, payload)

        monkeypatch.setattr(Journal, "append", spy)
        vid = call(shard, 1, "volume.create", name="v")["id"]
        data = [os.urandom(MiB) for _ in range(3)]
        for index, piece in enumerate(data):
            call(shard, 2 + index, "write", volume=vid, path="/f", data=piece, offset=index * MiB)
        given = [p for frame in frames for p in frame if isinstance(p, Checksummed)]
        assert [bytes(p.data) for p in given] == data
        assert all(p.crc == zlib.crc32(p.data) for p in given)
        # A fresh process over the same segments (as after a SIGKILL) replays the frames,
        # each checked against its CRC, and reads every byte back.
        again = shard_module.Shard(0, *fds, capacity=1 << 30)
        assert again.recover() > 0
        read = call(again, 10, "read", volume=vid, path="/f", offset=0, size=3 * MiB)
        assert read == b"".join(data)
    finally:
        for fd in fds:
            os.close(fd)


def test_the_shards_memory_names_its_warm_part_within_the_total() -> None:
    fds = _segments()
    try:
        shard = shard_module.Shard(0, *fds, capacity=1 << 30)
        shard.recover()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        call(shard, 2, "write", volume=vid, path="/f", data=os.urandom(2 * MiB))
        call(shard, 3, "unlink", volume=vid, path="/f")
        memory = shard.memory()
        parts = ("arena", "journal", "checkpoints", "heap")
        assert memory["total"] == sum(memory[key] for key in parts)
        warm = shard.checkpoints.pages.area.warm_bytes
        assert warm == 2 * MiB  # the freed file's space, kept for the next one
        assert warm <= memory["warm"] <= memory["journal"] + memory["checkpoints"]
        assert shard.checkpoints.pages.warm_limit == (1 << 30) // 16
    finally:
        for fd in fds:
            os.close(fd)


def test_the_heap_keeps_its_free_top() -> None:
    assert keep_heap()  # glibc (Debian, as the shards run)
    free = heap_free_bytes()
    assert free is not None and free >= 0


def test_a_full_host_takes_a_deleted_files_size_again_though_its_space_is_warm() -> None:
    """Warm space counts against the host (its pages are resident): a host filled, then
    a file deleted, must still take a file of that size (the refused request runs again
    after a checkpoint, the warm pages given back), as when freed pages went back at once."""
    fds = (
        create_segment("journal", 64 * MiB),
        create_segment("checkpoint", 256 * MiB),
        create_segment("arena", 8 * MiB),
    )
    try:
        shard = shard_module.Shard(0, *fds, capacity=96 * MiB)
        shard.recover()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        seq = 1

        def write(path: str) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            message = {"volume": vid, "path": path, "data": os.urandom(4 * MiB)}
            answer = shard.handle(
                Hello("c", False),
                pack({"seq": seq, "ack": seq - 1, "op": "write", "args": message}),
            )
            assert isinstance(answer, bytes)
            reply: dict[str, Any] = unpack(answer)
            return reply

        files = 0
        while (reply := write(f"/f{files}"))["ok"]:
            files += 1
            assert files < 100
        assert reply["error"]["code"] == "CapacityExhausted" and files > 2
        seq += 1
        call(shard, seq, "unlink", volume=vid, path="/f0")
        assert shard.checkpoints.pages.area.warm_bytes > 0
        assert write("/again")["ok"]
        seq += 1
        assert len(call(shard, seq, "read", volume=vid, path="/again")) == 4 * MiB
    finally:
        for fd in fds:
            os.close(fd)
