"""The chunk arena (slates.node.arena): a state machine against a dict, on a real memfd.

Chunks are stored and deleted in random order and the arena is re-attached
(as a restarted shard does) at random points.  After every step: it reads
as the model; its live and free entries tile the committed part exactly;
free space is reused (the committed part never exceeds what the live
chunks need plus the free space left between them); and a full arena
refuses new chunks while reads and deletions go on.  Deleted chunks give
their pages back to the host: the memfd's allocated blocks shrink.
"""

from __future__ import annotations

import os

import blake3
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.errors import CapacityExhausted
from slates.node.arena import _ARENA_START, _CHUNK, ArenaChunks, _stride
from slates.node.journal import Segment, create_segment

SIZE = 1 << 20


def chunk(seed: int, length: int) -> tuple[bytes, bytes]:
    data = bytes([seed % 251]) * length
    return blake3.blake3(data + seed.to_bytes(4, "little")).digest(), data


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fd = create_segment("slates-test-arena", SIZE)
        self.arena = ArenaChunks(Segment(self.fd))
        self.model: dict[bytes, bytes] = {}

    @rule(seed=st.integers(0, 10_000), length=st.sampled_from([0, 1, 7, 8, 100, 4096, 70_000]))
    def store(self, seed: int, length: int) -> None:
        chunk_id, data = chunk(seed, length)
        try:
            self.arena[chunk_id] = data
        except CapacityExhausted:
            assert chunk_id not in self.model
            assert self.arena.used_bytes + _stride(length) + _ARENA_START > SIZE
            return
        self.model[chunk_id] = data

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        if not self.model:
            return
        chunk_id = data.draw(st.sampled_from(sorted(self.model)))
        del self.arena[chunk_id]
        del self.model[chunk_id]

    @rule()
    def reattach(self) -> None:
        self.arena = ArenaChunks(Segment(self.fd))

    @invariant()
    def reads_as_the_model(self) -> None:
        assert set(self.arena) == set(self.model)
        for chunk_id, data in self.model.items():
            assert self.arena[chunk_id] == data
            self.arena.verify(chunk_id)

    @invariant()
    def entries_tile_the_committed_part(self) -> None:
        spans = [
            (start - _CHUNK.size, _stride(length)) for start, length in self.arena._index.values()
        ]
        spans += self.arena._free
        spans.sort()
        at = _ARENA_START
        for start, stride in spans:
            assert start == at, (start, at)
            at += stride
        assert at == _ARENA_START + self.arena.used_bytes
        # Free space never sits at the end: the committed part shrinks instead.
        assert not self.arena._free or sum(self.arena._free[-1]) < at

    def teardown(self) -> None:
        self.arena.segment.close()
        os.close(self.fd)


TestArena = ArenaMachine.TestCase
TestArena.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_deleted_chunks_give_their_pages_back_and_their_space_is_reused() -> None:
    fd = create_segment("slates-test-arena", 64 << 20)
    try:
        arena = ArenaChunks(Segment(fd))
        ids = []
        for seed in range(64):
            chunk_id, data = chunk(seed, 256 << 10)
            arena[chunk_id] = data
            ids.append(chunk_id)
        full = os.fstat(fd).st_blocks
        for chunk_id in ids[:-1]:  # all but the last: the end does not move back
            del arena[chunk_id]
        assert os.fstat(fd).st_blocks < full // 8  # the pages went back to the host
        committed = arena.used_bytes
        for seed in range(100, 150):
            chunk_id, data = chunk(seed, 256 << 10)
            arena[chunk_id] = data
        assert arena.used_bytes == committed  # stored in the freed space, not appended
    finally:
        os.close(fd)


def test_a_full_arena_refuses_new_chunks_but_reads_and_deletes() -> None:
    fd = create_segment("slates-test-arena", SIZE)
    try:
        arena = ArenaChunks(Segment(fd))
        stored = []
        with pytest.raises(CapacityExhausted):
            for seed in range(100):
                chunk_id, data = chunk(seed, 100_000)
                arena[chunk_id] = data
                stored.append((chunk_id, data))
        assert all(arena[chunk_id] == data for chunk_id, data in stored)
        del arena[stored[0][0]]  # deleting needs no space
        chunk_id, data = chunk(1000, 100_000)
        arena[chunk_id] = data  # and makes room
        assert arena[chunk_id] == data
    finally:
        os.close(fd)
