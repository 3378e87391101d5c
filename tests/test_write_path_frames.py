"""The write path's frames after issue 14's second pass: a record is journaled from its
encoded parts (events.frame_parts), its large data the very Write.data object, marked
with the page area's CRC by identity (no join, no compare); the fast CRC gives zlib's
numbers; the segments' allocated bytes are read again only when they may have changed,
and still equal fstat's figures after every request; and through a real mount, 64 MiB
written in 1 MiB writes and fsync'd survive a SIGKILL of their shard byte for byte."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates import Client
from slates.core.records import Write, encode, encoded_parts
from slates.node import events
from slates.node import shard as shard_module
from slates.node.events import RecordApplied, RepliesAcked, ReplySaved
from slates.node.journal import FAST_CRC_BYTES, Checksummed, Journal, crc32, create_segment
from slates.node.memory import segment_bytes
from slates.node.protocol import shard_of
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_shard_recovery import call
from tests.test_write_path import _segments

__all__ = ["service"]

MiB = 1 << 20


# -- the fast CRC ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3 * FAST_CRC_BYTES),
    start=st.integers(0, (1 << 32) - 1),
    cut=st.integers(0, 64),
)
def test_the_fast_crc_gives_zlibs_numbers_for_bytes_and_mapped_views(
    data: bytes, start: int, cut: int
) -> None:
    assert crc32(data, start) == zlib.crc32(data, start)
    mapped = bytearray(data)  # a writable buffer, as a segment's view
    view = memoryview(mapped)[min(cut, len(data)) :]
    assert crc32(view, start) == zlib.crc32(view, start)
    assert crc32(memoryview(data)) == zlib.crc32(data)  # read only: zlib's own


# -- frames in parts ---------------------------------------------------------------------


def _record_events(size: int) -> tuple[list[events.Event], bytes]:
    data = os.urandom(size)
    record = Write(3, 1 << 20, data, 7, b"", b"")
    parts = encoded_parts(record)
    held = parts[0] if len(parts) == 1 else tuple(parts)
    return [
        RepliesAcked("c", 4),
        RecordApplied("vol-0-1", held),
        ReplySaved("c", 5, {"ok": True, "seq": 5, "result": {"written": size}}),
    ], data


@settings(max_examples=30, deadline=None)
@given(size=st.sampled_from([0, 10, (64 << 10) - 1, 64 << 10, MiB + 3]))
def test_a_frame_in_parts_joins_to_the_packed_wire_message(size: int) -> None:
    frame_events, data = _record_events(size)
    parts = events.frame_parts(frame_events)
    wire = {"events": [events.to_wire(event) for event in frame_events]}
    assert b"".join(parts) == msgpack.packb(wire, use_bin_type=True)
    assert any(part is data for part in parts) == (size >= 64 << 10)  # never a copy
    # Read back, the record is one bytes value, its encoding, as journals always held it.
    back = [events.from_wire(raw) for raw in msgpack.unpackb(b"".join(parts))["events"]]
    applied = back[1]
    assert isinstance(applied, RecordApplied)
    assert applied.record == applied.encoded == encode(Write(3, 1 << 20, data, 7, b"", b""))


def test_a_record_held_in_parts_has_the_wire_form_of_its_encoding() -> None:
    held = _record_events(MiB)[0][1]
    assert isinstance(held, RecordApplied) and type(held.record) is tuple
    joined = RecordApplied(held.vid, held.encoded)
    assert events.to_wire(held) == events.to_wire(joined)
    assert events.decode(events.encode(held)) == joined


def test_the_shard_marks_a_writes_data_checksummed_by_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fds = _segments()
    try:
        shard = shard_module.Shard(0, *fds, capacity=1 << 30)
        shard.recover()
        frames: list[list[Any]] = []
        append = Journal.append

        def spy(self: Journal, payload: Any) -> None:
            frames.append([payload] if isinstance(payload, bytes) else list(payload))
            append(self, payload)

        monkeypatch.setattr(Journal, "append", spy)
        vid = call(shard, 1, "volume.create", name="v")["id"]
        made = call(shard, 2, "fs.create", volume=vid, parent=1, name="f", mode=0o644, uid=0, gid=0)
        ino = made["ino"]
        data = os.urandom(MiB)
        call(shard, 3, "fs.write", volume=vid, ino=ino, offset=0, data=data)
        given = [part for part in frames[-1] if isinstance(part, Checksummed)]
        assert len(given) == 1 and type(given[0].data) is bytes  # the record's data itself
        assert given[0].data == data and given[0].crc == zlib.crc32(data)
        assert b"".join(
            bytes(p.data) if isinstance(p, Checksummed) else p for p in frames[-1]
        ) == next(reversed(list(shard.journal.entries())))
    finally:
        for fd in fds:
            os.close(fd)


# -- segment accounting ------------------------------------------------------------------


def test_the_host_counts_the_segments_fstat_figures_after_every_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The allocated bytes are read only when a segment's resident pages may have
    changed; after each request of a random mix (appends, edits in place, copies on
    write, truncations, deletions, checkpoints), what the host counts is still exactly
    what fstat says the segments hold."""
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"accounting seed {seed}")
    rng = random.Random(seed)
    fds = (
        create_segment("journal", 64 * MiB),
        create_segment("checkpoint", 128 * MiB),
        create_segment("arena", 8 * MiB),
    )
    try:
        shard = shard_module.Shard(0, *fds, capacity=1 << 30)
        shard.recover()
        seq = 1
        vid = call(shard, seq, "volume.create", name="v")["id"]
        reads = 0

        def counting(fd: int) -> int:
            nonlocal reads
            reads += 1
            return segment_bytes(fd)

        monkeypatch.setattr(shard_module, "segment_bytes", counting)
        files: set[str] = set()
        for _step in range(120):
            seq += 1
            path = f"/f{rng.randrange(4)}"
            action = rng.random()
            if action < 0.45 or path not in files:
                size = rng.choice([100, 5000, 70_000, 300_000])
                data, offset = os.urandom(size), rng.randrange(200_000)
                call(shard, seq, "write", volume=vid, path=path, data=data, offset=offset)
                files.add(path)
            elif action < 0.6:
                call(shard, seq, "truncate", volume=vid, path=path, size=rng.randrange(9000))
            elif action < 0.7:
                call(shard, seq, "unlink", volume=vid, path=path)
                files.discard(path)
            elif action < 0.8:
                shard.checkpoint()
            else:
                call(shard, seq, "stat", volume=vid, path="/")  # changes no page
            journal_fd, checkpoint_fd, _arena = fds
            held = segment_bytes(checkpoint_fd) - shard.checkpoints.pages.live_bytes
            assert shard.host.overhead_bytes == segment_bytes(journal_fd) + max(0, held)
        assert reads < 2 * 120  # not two fstats after every request
    finally:
        for fd in fds:
            os.close(fd)


# -- through a mount, across a SIGKILL ----------------------------------------------------


@pytest.fixture
def big_payload() -> Iterator[bytes]:
    yield random.Random(14).randbytes(64 * MiB)


def test_64_mib_written_through_a_mount_survive_a_sigkill_of_the_shard(
    service: Service, tmp_path: Path, big_payload: bytes
) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("big")["id"]
        index = shard_of(volume)
        with mounted(client, volume, tmp_path / "mnt") as mnt:
            with open(mnt / "new.bin", "xb", buffering=0) as f:
                for at in range(0, len(big_payload), MiB):
                    f.write(big_payload[at : at + MiB])
                os.fsync(f.fileno())
            with open(mnt / "edited.bin", "wb", buffering=0) as f:  # writes not appends
                f.write(big_payload[: 3 * MiB])
                f.seek(12345)
                f.write(big_payload[-MiB - 7 :])
            old = service.kill_shard(index)
            service.wait_restarted(index, old)
            assert (mnt / "new.bin").read_bytes() == big_payload  # after the bridge reconnects
            edited = bytearray(big_payload[: 3 * MiB])
            edited[12345 : 12345 + MiB + 7] = big_payload[-MiB - 7 :]
            assert (mnt / "edited.bin").read_bytes() == bytes(edited)
        assert client.read(volume, "/new.bin", offset=63 * MiB, size=MiB) == big_payload[-MiB:]
