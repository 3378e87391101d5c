"""The pure side of placed checkpoints: a document naming each page buffer by its
location round-trips, blobs load into the host's page memory, and the one-copy
packers give msgpack's exact bytes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slates.core import ROOT_INO, Host, Volume
from slates.core.checkpoint import dump_placed, dump_state, load_state
from slates.core.extents import PAGE
from slates.core.host import HeapBuffer, PageBuffer
from slates.core.records import Splice, Write, _pack, decode, encode
from slates.errors import InvalidArgument


class ModelStore:
    """A PageStore in a dict: each buffer placed is kept as the bytes it held, and
    fetched back as a heap buffer of exactly those bytes."""

    def __init__(self) -> None:
        self.stored: dict[int, bytes] = {}
        self.next = 1

    def place(self, buffer: PageBuffer) -> Any:
        at, self.next = self.next, self.next + 1
        self.stored[at] = bytes(buffer[0 : len(buffer)])
        return at

    def fetch(self, where: Any, length: int) -> PageBuffer:
        if type(where) is not int or where not in self.stored:
            raise InvalidArgument("no such placed buffer")
        data = self.stored[where]
        if len(data) != length:
            raise InvalidArgument("a placed buffer's length differs")
        return HeapBuffer(data)


class PlacedRoundTrip(RuleBasedStateMachine):
    """Random edits between placed checkpoints: each checkpoint names every buffer by
    its location, and loads back to the same state as the plain blob does."""

    def __init__(self) -> None:
        super().__init__()
        self.host = Host()
        self.volume = Volume.new(self.host)
        self.store = ModelStore()
        self.files: dict[str, int] = {}

    @property
    def inos(self) -> list[int]:
        return [self.files[name] for name in sorted(self.files)]

    @rule(name=st.sampled_from("abc"))
    def create(self, name: str) -> None:
        if name not in self.files:
            self.files[name] = self.volume.create(ROOT_INO, name).ino

    @precondition(lambda self: self.inos)
    @rule(
        pick=st.integers(0, 5),
        offset=st.sampled_from([0, 7, PAGE - 1, PAGE, 2 * PAGE + 3, 9 * PAGE]),
        data=st.binary(min_size=1, max_size=3 * PAGE),
    )
    def write(self, pick: int, offset: int, data: bytes) -> None:
        self.volume.write(self.inos[pick % len(self.inos)], offset, data)

    @precondition(lambda self: self.inos)
    @rule(pick=st.integers(0, 5), size=st.sampled_from([0, 5, PAGE, PAGE + 9, 4 * PAGE]))
    def truncate(self, pick: int, size: int) -> None:
        self.volume.truncate(self.inos[pick % len(self.inos)], size)

    @precondition(lambda self: self.inos)
    @rule(pick=st.integers(0, 5), page=st.integers(0, 4), pages=st.integers(1, 3))
    def punch(self, pick: int, page: int, pages: int) -> None:
        self.volume.punch_hole(self.inos[pick % len(self.inos)], page * PAGE, pages * PAGE)

    @precondition(lambda self: self.inos)
    @rule(pick=st.integers(0, 5), data=st.binary(max_size=100))
    def splice(self, pick: int, data: bytes) -> None:
        ino = self.inos[pick % len(self.inos)]
        size = self.volume.getattr(ino).size
        self.volume.apply(Splice(ino, size // 3, size // 2, data, 0))

    @rule()
    def seal(self) -> None:
        self.volume.seal()

    @precondition(lambda self: self.inos)
    @rule(pick=st.integers(0, 5))
    def unlink(self, pick: int) -> None:
        name = sorted(self.files)[pick % len(self.files)]
        del self.files[name]
        self.volume.unlink(ROOT_INO, name)

    @rule()
    def checkpoint(self) -> None:
        blob = dump_placed({"v": self.volume}, {}, _no_base, self.store)
        assert len(self.store.stored) >= len(self.volume._buffers)
        loaded = load_state(blob, Host(chunks=dict(self.host._chunks)), _no_open, pages=self.store)
        again = loaded.volumes["v"]
        assert again._buffers == self.volume._buffers
        plain = dump_state({"v": self.volume}, {}, _no_base)
        assert dump_state({"v": again}, {}, _no_base) == plain

    @invariant()
    def buffers_are_the_hosts_heap_buffers(self) -> None:
        assert all(isinstance(b, HeapBuffer) for b in self.volume._buffers.values())


def _no_base(_reader: object) -> str:
    raise AssertionError("these volumes have no base")


def _no_open(_key: str) -> Any:
    raise AssertionError("these volumes have no base")


TestPlacedRoundTrip = PlacedRoundTrip.TestCase
TestPlacedRoundTrip.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_blob_with_page_bytes_loads_them_into_the_hosts_page_memory() -> None:
    volume = Volume.new(Host())
    ino = volume.create(ROOT_INO, "a").ino
    volume.write(ino, 0, b"x" * (5 * PAGE))
    loaded = load_state(dump_state({"v": volume}, {}, _no_base), Host(), _no_open)
    (buffer,) = loaded.volumes["v"]._buffers.values()
    assert isinstance(buffer, HeapBuffer) and bytes(buffer) == b"x" * (5 * PAGE)


# -- one-copy packing gives msgpack's bytes ---------------------------------------------

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)
_large = st.builds(
    lambda n, fill: bytes([fill]) * n,
    st.sampled_from([0, 1, 65535, 65536, 70000]),
    st.integers(0, 255),
)


@settings(max_examples=60, deadline=None)
@given(
    data=_large,
    head=st.binary(max_size=70) | _large,
    offset=st.integers(0, 2**43),
)
def test_encode_of_a_large_write_is_msgpacks_and_decodes(
    data: bytes, head: bytes, offset: int
) -> None:
    record = Write(3, offset, data, 12345, head, b"t")
    assert encode(record) == _pack(record)
    assert decode(encode(record)) == record
