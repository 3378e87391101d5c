"""Page buffers in the checkpoint segment's page area (slates.node.page_area), against
a model: every buffer reads as the model says; a piece the published checkpoint names
is never changed (a fresh process reading the segment, as after a SIGKILL, finds the
published buffers exactly); space is freed once nothing holds it; and a full area is
CapacityExhausted with nothing changed.  Then volumes over that page memory: the same
state as on the heap, and a write that does not fit changes nothing."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slates.core import ROOT_INO, Host, Volume
from slates.core.checkpoint import dump_placed, dump_state, load_state
from slates.core.extents import PAGE
from slates.core.records import Splice
from slates.errors import CapacityExhausted
from slates.node.checkpoints import Checkpoints
from slates.node.journal import Segment, create_segment
from slates.node.memory import segment_bytes
from slates.node.page_area import PIECE_BYTES, SegmentBuffer
from tests.volume_check import check_invariants, tree

MiB = 1 << 20
AREA = 3 * MiB  # small enough to fill, large enough for several pieces per buffer
WARM = 512 << 10  # freed space kept resident, at most (a sixth of the area)


class _Area:
    """A checkpoint segment and one process's view of it."""

    def __init__(self, area_bytes: int = AREA) -> None:
        self.fd = create_segment("test-pages", PAGE + area_bytes)
        self.segment = Segment(self.fd)
        self.checkpoints = Checkpoints(self.segment)

    def reopen(self) -> Checkpoints:
        """A fresh process's Checkpoints over the same segment (the old one is dead)."""
        self.checkpoints = Checkpoints(self.segment)
        return self.checkpoints

    def close(self) -> None:
        self.segment.close()
        os.close(self.fd)


_sizes = st.sampled_from([1, 100, PAGE - 1, PAGE, 3 * PAGE + 7, 300_000, PIECE_BYTES + 5])


class PagesInTheSegment(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.area = _Area()
        self.checkpoints = self.area.checkpoints
        self.checkpoints.pages.warm_limit = WARM
        assert self.checkpoints.read() is None
        self.buffers: dict[str, SegmentBuffer] = {}
        self.model: dict[str, bytearray] = {}
        self.published: dict[str, bytes] = {}  # what the published checkpoint holds
        self.generation = 0

    def teardown(self) -> None:
        self.area.close()

    @property
    def pages(self) -> Any:
        return self.checkpoints.pages

    def _refused(self, nbytes: int) -> bool:
        """Ask for space as a volume does; a refusal must change nothing."""
        free = self.checkpoints.area.free_bytes
        try:
            self.pages.ensure(nbytes)
        except CapacityExhausted:
            assert self.checkpoints.area.free_bytes == free
            return True
        return False

    @rule(name=st.sampled_from("abcd"), size=_sizes, fill=st.integers(0, 255))
    def new(self, name: str, size: int, fill: int) -> None:
        if name in self.buffers or self._refused(size):
            return
        self.buffers[name] = self.pages.new([bytes([fill]) * size])
        self.model[name] = bytearray([fill]) * size

    @precondition(lambda self: self.buffers)
    @rule(data=st.data(), size=_sizes, fill=st.integers(0, 255))
    def write(self, data: st.DataObject, size: int, fill: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.buffers)))
        length = len(self.model[name])
        offset = data.draw(st.integers(0, length))
        size = min(size, length - offset)
        buffer = self.buffers[name]
        if self._refused(buffer.rewrite_cost(offset, offset + size)):
            return
        buffer.write(offset, bytes([fill]) * size)
        self.model[name][offset : offset + size] = bytes([fill]) * size

    @precondition(lambda self: self.buffers)
    @rule(data=st.data(), size=_sizes, fill=st.integers(0, 255))
    def extend(self, data: st.DataObject, size: int, fill: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.buffers)))
        if self._refused(size):
            return
        self.buffers[name].extend(bytes([fill]) * size)
        self.model[name] += bytes([fill]) * size

    @precondition(lambda self: self.buffers)
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.buffers)))
        length = data.draw(st.integers(0, len(self.model[name])))
        self.buffers[name].shrink(length)
        del self.model[name][length:]

    @precondition(lambda self: self.buffers)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.buffers)))
        self.pages.free(self.buffers.pop(name))
        del self.model[name]

    @rule()
    def checkpoint(self) -> None:
        def build(store: Checkpoints) -> tuple[bytes, Callable[[], None]]:
            where = {name: store.place(b) for name, b in sorted(self.buffers.items())}
            lengths = {name: len(b) for name, b in self.buffers.items()}
            return msgpack.packb([where, lengths]), lambda: None

        copied = self.pages.copied_bytes
        try:
            self.checkpoints.write(self.generation + 1, build)
        except CapacityExhausted:
            return  # the document did not fit: the published one stays
        assert self.pages.copied_bytes == copied  # a checkpoint copies no page
        self.generation += 1
        self.published = {name: bytes(data) for name, data in self.model.items()}

    @rule()
    def crash_and_load(self) -> None:
        """SIGKILL, then a fresh process: it finds the published buffers exactly."""
        fresh = self.area.reopen()
        fresh.pages.warm_limit = WARM
        found = fresh.read()
        buffers: dict[str, SegmentBuffer] = {}
        if found is not None:
            generation, document = found
            assert generation == self.generation
            where, lengths = msgpack.unpackb(document)
            for name, at in where.items():
                buffer = fresh.fetch(at, lengths[name])
                assert isinstance(buffer, SegmentBuffer)
                buffers[name] = buffer
            fresh.loaded()
        assert {name: b[0 : len(b)] for name, b in buffers.items()} == self.published
        self.checkpoints, self.buffers = fresh, buffers
        self.model = {name: bytearray(data) for name, data in self.published.items()}

    @invariant()
    def known_piece_checksums_are_their_bytes(self) -> None:
        """A piece's CRC, kept across appends (combined), is its bytes' CRC."""
        mm = self.area.segment.map
        for buffer in self.buffers.values():
            for piece in buffer._pieces:
                if piece.crc is not None:
                    assert piece.crc == zlib.crc32(mm[piece.at : piece.at + piece.length])

    @invariant()
    def buffers_read_as_the_model(self) -> None:
        assert {name: b[0 : len(b)] for name, b in self.buffers.items()} == self.model
        assert self.pages.live_bytes == sum(map(len, self.model.values()))

    @invariant()
    def the_published_checkpoint_is_intact(self) -> None:
        found = self.checkpoints.read()
        if found is None:
            return
        where, lengths = msgpack.unpackb(found[1])
        mm = self.area.segment.map
        for name, pieces in where.items():
            data = b"".join(
                mm[pieces[i] : pieces[i] + pieces[i + 1]] for i in range(0, len(pieces), 3)
            )
            assert data == self.published[name] and len(data) == lengths[name]
            for i in range(0, len(pieces), 3):
                assert zlib.crc32(mm[pieces[i] : pieces[i] + pieces[i + 1]]) == pieces[i + 2]

    @invariant()
    def taken_space_is_what_something_holds(self) -> None:
        held: set[int] = set()
        pieces = [p for b in self.buffers.values() for p in b._pieces]
        for piece in pieces:
            held |= set(range(piece.at // PAGE, (piece.at + piece.capacity) // PAGE))
        for at, capacity in self.pages.published_ranges():
            held |= set(range(at // PAGE, (at + capacity) // PAGE))
        for at, size in self.checkpoints._document:
            held |= set(range(at // PAGE, (at + size) // PAGE))
        free = {p for lo, hi in self.checkpoints.area.gaps() for p in range(lo // PAGE, hi // PAGE)}
        assert not held & free
        assert len(held) + len(free) == AREA // PAGE
        # Pages nothing holds are given back, but for the warm space (bounded): the
        # segment holds at most what is held and that.
        warm = self.checkpoints.area.warm_bytes
        assert warm <= WARM
        assert segment_bytes(self.area.fd) <= (len(held) + 1) * PAGE + warm


TestPagesInTheSegment = PagesInTheSegment.TestCase
TestPagesInTheSegment.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


# -- volumes over the page area --------------------------------------------------------


@pytest.fixture
def area() -> Iterator[_Area]:
    made = _Area()
    assert made.checkpoints.read() is None
    yield made
    made.close()


def _no_base(_reader: object) -> str:
    raise AssertionError("these volumes have no base")


def _no_open(_key: str) -> Any:
    raise AssertionError("these volumes have no base")


class SameAsTheHeap(RuleBasedStateMachine):
    """One volume on the heap, one in the page area, the same operations: the same files,
    and each checkpoint of the segment one loads (after a crash) to the state it had."""

    def __init__(self) -> None:
        super().__init__()
        self.area = _Area(8 * MiB)
        assert self.area.checkpoints.read() is None
        self.heap = Volume.new(Host())
        self.host = Host(pages=self.area.checkpoints.pages)
        self.placed = Volume.new(self.host)
        self.published: dict[str, Any] | None = None
        self.names: list[str] = []

    def teardown(self) -> None:
        self.area.close()

    def _both(self, act: Callable[[Volume], object]) -> None:
        """`act` on the page area's volume; if it fits there (it may not: the area is
        bounded, the heap is not), on the heap's too.  A refusal changes nothing."""
        before = tree(self.placed)
        try:
            act(self.placed)
        except CapacityExhausted:
            assert tree(self.placed) == before
            return
        act(self.heap)

    def _ino(self, volume: Volume, name: str) -> int:
        return volume.lookup(ROOT_INO, name).ino

    @rule(name=st.sampled_from("abc"))
    def create(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)
            self._both(lambda v: v.create(ROOT_INO, name))

    @precondition(lambda self: self.names)
    @rule(
        pick=st.integers(0, 5),
        offset=st.sampled_from([0, 7, PAGE - 1, PAGE, 2 * PAGE + 3, 9 * PAGE, MiB - 5]),
        data=st.binary(min_size=1, max_size=3 * PAGE) | st.just(b"z" * (MiB + 3)),
    )
    def write(self, pick: int, offset: int, data: bytes) -> None:
        name = self.names[pick % len(self.names)]
        self._both(lambda v: v.write(self._ino(v, name), offset, data))

    @precondition(lambda self: self.names)
    @rule(pick=st.integers(0, 5), size=st.sampled_from([0, 5, PAGE, PAGE + 9, 4 * PAGE]))
    def truncate(self, pick: int, size: int) -> None:
        name = self.names[pick % len(self.names)]
        self._both(lambda v: v.truncate(self._ino(v, name), size))

    @precondition(lambda self: self.names)
    @rule(pick=st.integers(0, 5), page=st.integers(0, 4), pages=st.integers(1, 3))
    def punch(self, pick: int, page: int, pages: int) -> None:
        name = self.names[pick % len(self.names)]
        self._both(lambda v: v.punch_hole(self._ino(v, name), page * PAGE, pages * PAGE))

    @precondition(lambda self: self.names)
    @rule(pick=st.integers(0, 5), data=st.binary(max_size=100))
    def splice(self, pick: int, data: bytes) -> None:
        name = self.names[pick % len(self.names)]

        def edit(v: Volume) -> None:
            ino = self._ino(v, name)
            size = v.getattr(ino).size
            v.apply(Splice(ino, size // 3, size // 2, data, 0))

        self._both(edit)

    @rule()
    def seal(self) -> None:
        self._both(lambda v: v.seal())

    @precondition(lambda self: self.names)
    @rule(pick=st.integers(0, 5))
    def unlink(self, pick: int) -> None:
        name = self.names.pop(pick % len(self.names))
        self._both(lambda v: v.unlink(ROOT_INO, name))

    @rule()
    def checkpoint(self) -> None:
        def build(store: Checkpoints) -> tuple[bytes, Callable[[], None]]:
            return dump_placed({"v": self.placed}, {}, _no_base, store), lambda: None

        self.area.checkpoints.write(1, build)
        self.published = tree(self.placed)
        self.published_chunks = dict(self.host._chunks)

    @precondition(lambda self: self.published is not None)
    @rule()
    def crash_and_load(self) -> None:
        fresh = self.area.reopen()
        fresh.pages.warm_limit = WARM
        found = fresh.read()
        assert found is not None
        host = Host(chunks=dict(self.published_chunks), pages=fresh.pages)
        loaded = load_state(found[1], host, _no_open, pages=fresh)
        fresh.loaded()
        self.placed, self.host = loaded.volumes["v"], host
        assert tree(self.placed) == self.published
        # The heap volume goes back to the same state: rebuilt from a plain dump.
        blob = dump_state({"v": self.placed}, {}, _no_base)
        self.heap = load_state(blob, Host(chunks=dict(self.host._chunks)), _no_open).volumes["v"]
        self.names = sorted(path.strip("/") for path in self.published if path != "/")

    @invariant()
    def the_same_files(self) -> None:
        check_invariants(self.placed)
        assert tree(self.placed) == tree(self.heap)
        pages = sum(len(b) for b in self.placed._buffers.values())
        assert self.area.checkpoints.pages.live_bytes == pages


TestSameAsTheHeap = SameAsTheHeap.TestCase
TestSameAsTheHeap.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def test_a_write_the_page_area_cannot_hold_changes_nothing(area: _Area) -> None:
    host = Host(pages=area.checkpoints.pages)
    volume = Volume.new(host)
    ino = volume.create(ROOT_INO, "f").ino
    volume.write(ino, 0, b"a" * (2 * MiB))
    before, private, free = tree(volume), host.private_bytes, area.checkpoints.area.free_bytes
    with pytest.raises(CapacityExhausted):
        volume.write(ino, 2 * MiB, b"b" * (2 * MiB))  # 3 MiB of area: 1 MiB left
    with pytest.raises(CapacityExhausted):
        volume.write(ino, 6 * MiB, b"c" * (2 * MiB))  # a new buffer: no room either
    assert tree(volume) == before and host.private_bytes == private
    assert area.checkpoints.area.free_bytes == free
    check_invariants(volume)
    volume.write(ino, 2 * MiB, b"b" * MiB)  # what fits is taken
    assert volume.read(ino, 0, 3 * MiB) == b"a" * (2 * MiB) + b"b" * MiB


def test_a_copy_on_write_that_does_not_fit_changes_nothing(area: _Area) -> None:
    host = Host(pages=area.checkpoints.pages)
    volume = Volume.new(host)
    ino = volume.create(ROOT_INO, "f").ino
    volume.write(ino, 0, b"a" * (3 * MiB // 2))  # pieces of 1 MiB and 1/2 MiB

    def build(store: Checkpoints) -> tuple[bytes, Callable[[], None]]:
        return dump_placed({"v": volume}, {}, _no_base, store), lambda: None

    area.checkpoints.write(1, build)  # every piece of f is published: copy on write
    volume.write(ino, 0, b"b" * PAGE)  # its first piece copied: 1 MiB of 3/2 MiB left
    before, free = tree(volume), area.checkpoints.area.free_bytes
    with pytest.raises(CapacityExhausted):
        volume.write(ino, MiB + 5, b"c")  # the other piece would need 1/2 MiB more
    assert tree(volume) == before and area.checkpoints.area.free_bytes == free
    assert volume.read(ino, 0, 2 * MiB) == b"b" * PAGE + b"a" * (3 * MiB // 2 - PAGE)
    volume.write(ino, 5, b"d")  # the copy is ours: written in place, no room needed
    check_invariants(volume)


class _Drawn:
    """Stands in for hypothesis's data object: hands out the given draws in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def test_space_taken_for_growth_but_not_used_goes_back_with_its_pages() -> None:
    """Found by the state machine: a growing buffer's extension took two warm ranges,
    used one and gave the other back as cold space with its pages still resident."""
    machine = PagesInTheSegment()
    try:
        machine.new("b", 1, 0)
        machine.new("a", 1, 0)
        machine.checkpoint()
        machine.new("c", 300_000, 0)
        machine.write(_Drawn("b", 0), 1, 0)
        machine.checkpoint()
        machine.extend(_Drawn("c"), PAGE - 1, 0)
        machine.taken_space_is_what_something_holds()
    finally:
        machine.teardown()
