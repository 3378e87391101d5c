"""Incremental checkpoints (issue 14): a checkpoint copies only the page buffers that
changed since the last one; the published one survives a shard killed mid-write; and
restarts after many incremental checkpoints restore exact content."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from slates.errors import CapacityExhausted, VerificationFailed
from slates.node import shard as shard_module
from slates.node.checkpoints import PIECE_BYTES, Checkpoints, PageArea
from slates.node.journal import PAGE, Segment, create_segment
from tests.test_shard_recovery import call

MiB = 1 << 20


class Segments:
    """One shard's three segments; `shard()` is a fresh process's view of them."""

    def __init__(self, checkpoint_bytes: int = 64 << 20) -> None:
        self.fds = (
            create_segment("journal", 32 << 20),
            create_segment("checkpoint", checkpoint_bytes),
            create_segment("arena", 64 << 20),
        )

    def shard(self) -> shard_module.Shard:
        shard = shard_module.Shard(0, *self.fds, capacity=1 << 30)
        shard.recover()
        return shard

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def segments() -> Any:
    made = Segments()
    yield made
    made.close()


def _buffer_lengths(shard: shard_module.Shard, vid: str) -> dict[int, int]:
    return {bid: len(b) for bid, b in shard.service.volumes[vid]._buffers.items()}


def test_a_checkpoint_copies_only_what_changed(segments: Segments) -> None:
    shard = segments.shard()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    seq = 1
    for index in range(6):
        seq += 1
        call(shard, seq, "write", volume=vid, path=f"/f{index}", data=os.urandom(64 << 10))
    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=os.urandom(3 * MiB + 5))
    shard.checkpoint()
    first = shard.checkpoints.copied_bytes
    assert first == sum(_buffer_lengths(shard, vid).values())  # all of it, once

    shard.checkpoint()  # nothing changed: nothing copied
    assert shard.checkpoints.copied_bytes == first

    seq += 1
    call(shard, seq, "write", volume=vid, path="/f3", data=b"small change", offset=100)
    shard.checkpoint()
    assert shard.checkpoints.copied_bytes - first == 64 << 10  # that one buffer

    before = shard.checkpoints.copied_bytes
    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=b"edit", offset=2 * MiB + 7)
    shard.checkpoint()
    assert shard.checkpoints.copied_bytes - before == PIECE_BYTES  # one piece of it

    before = shard.checkpoints.copied_bytes
    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=b"+" * 10, offset=3 * MiB + 5)
    shard.checkpoint()  # an append rewrites the last piece only
    assert shard.checkpoints.copied_bytes - before == PAGE

    restarted = segments.shard()
    assert restarted.service.volumes[vid]._buffers == shard.service.volumes[vid]._buffers


def test_a_deleted_file_gives_its_checkpoint_pages_back(segments: Segments) -> None:
    shard = segments.shard()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    call(shard, 2, "write", volume=vid, path="/f", data=os.urandom(8 * MiB))
    shard.checkpoint()
    free = shard.checkpoints.area.free_bytes
    call(shard, 3, "unlink", volume=vid, path="/f")
    shard.checkpoint()
    assert shard.checkpoints.area.free_bytes >= free + 8 * MiB
    assert segments.shard().checkpoints.area.free_bytes == shard.checkpoints.area.free_bytes


def test_damaged_page_bytes_raise_verification_failed(segments: Segments) -> None:
    shard = segments.shard()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    call(shard, 2, "write", volume=vid, path="/f", data=b"precious" * 1000)
    shard.checkpoint()
    (where,) = shard.service.volumes[vid]._placed.values()
    assert isinstance(where, list)
    segment = Segment(segments.fds[1])
    try:
        segment.map[where[0] + 5] ^= 0xFF
        with pytest.raises(VerificationFailed, match="checksum"):
            segments.shard()
        segment.map[where[0] + 5] ^= 0xFF  # undamaged, it loads again
        assert call(segments.shard(), 3, "read", volume=vid, path="/f") == b"precious" * 1000
    finally:
        segment.close()


def test_a_full_segment_skips_the_checkpoint_and_keeps_the_published_one() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * MiB)
    try:
        shard = segments.shard()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        call(shard, 2, "write", volume=vid, path="/a", data=b"a" * (5 * MiB))
        shard.checkpoint()
        generation = shard.journal.generation
        call(shard, 3, "write", volume=vid, path="/b", data=b"b" * (8 * MiB))
        shard.checkpoint()  # does not fit: logged, skipped
        assert shard.journal.generation == generation
        restarted = segments.shard()
        assert call(restarted, 4, "read", volume=vid, path="/b") == b"b" * (8 * MiB)
        assert call(restarted, 5, "read", volume=vid, path="/a") == b"a" * (5 * MiB)
        with pytest.raises(CapacityExhausted):
            restarted.checkpoints.area.take(13 * MiB)
    finally:
        segments.close()


# -- a shard SIGKILLed while it writes a checkpoint -------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from slates.node import checkpoints, shard as shard_module
    from tests.test_shard_recovery import call

    fds = tuple(int(v) for v in sys.argv[1:4])
    kill_after = int(sys.argv[4])
    shard = shard_module.Shard(0, *fds, capacity=1 << 30)
    shard.recover()
    copy = checkpoints.Checkpoints._copy
    copies = 0

    def dying_copy(self, view, lo, hi, out):
        global copies
        copies += 1
        if copies > kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        copy(self, view, lo, hi, out)

    checkpoints.Checkpoints._copy = dying_copy
    shard.checkpoint()
    os.kill(os.getpid(), signal.SIGKILL)  # after the publish, before the journal's turn
    """
)


def test_a_shard_killed_while_writing_a_checkpoint_leaves_the_old_one(segments: Segments) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"kill seed {seed}")
    rng = random.Random(seed)
    shard = segments.shard()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    files = {f"/f{i}": rng.randbytes(rng.randrange(1, 300_000)) for i in range(8)}
    seq = 1
    for path, data in files.items():
        seq += 1
        call(shard, seq, "write", volume=vid, path=path, data=data)
    shard.checkpoint()
    for path in rng.sample(sorted(files), 4):  # changed after the checkpoint: in the journal
        seq += 1
        data = rng.randbytes(rng.randrange(1, 300_000))
        call(shard, seq, "write", volume=vid, path=path, data=data)
        files[path] = data + files[path][len(data) :]  # a write does not truncate
    for kill_after in (0, rng.randrange(1, 4), 1000):
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, *map(str, segments.fds), str(kill_after)],
            pass_fds=segments.fds,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            timeout=120,
        )
        assert child.returncode == -signal.SIGKILL, f"seed {seed}: {child.stderr.decode()}"
        restarted = segments.shard()
        for number, (path, data) in enumerate(sorted(files.items())):
            got = call(
                restarted, number + 1, "read", f"checker-{kill_after}", volume=vid, path=path
            )
            assert got == data, f"seed {seed}, killed after {kill_after} copies: {path}"


# -- restarts after incremental checkpoints, against a model ---------------------------


class IncrementalCheckpoints(RuleBasedStateMachine):
    """Writes, truncates, deletes, seals, checkpoints and restarts (a fresh shard over
    the same segments, as after a SIGKILL): every file reads as the model says."""

    @initialize()
    def start(self) -> None:
        self.segments = Segments()
        self.shard = self.segments.shard()
        self.seq = 1
        self.vid = call(self.shard, self.seq, "volume.create", name="v")["id"]
        self.files: dict[str, bytes] = {}
        self.client = 0

    def teardown(self) -> None:
        if hasattr(self, "segments"):
            self.segments.close()

    def _call(self, op: str, **args: Any) -> Any:
        self.seq += 1
        return call(self.shard, self.seq, op, f"c{self.client}", volume=self.vid, **args)

    @rule(
        name=st.sampled_from(["/a", "/b", "/c"]),
        offset=st.sampled_from([0, 1, PAGE - 3, PAGE, 3 * PAGE + 1, 300_000]),
        size=st.sampled_from([1, 100, PAGE, 2 * PAGE + 5, 70_000]),
        fill=st.integers(0, 255),
    )
    def write(self, name: str, offset: int, size: int, fill: int) -> None:
        data = bytes([fill]) * size
        self._call("write", path=name, data=data, offset=offset)
        old = bytearray(self.files.get(name, b""))
        old.extend(bytes(max(0, offset - len(old))))
        old[offset : offset + size] = data
        self.files[name] = bytes(old)

    @rule(name=st.sampled_from(["/a", "/b", "/c"]), size=st.sampled_from([0, 10, PAGE + 1]))
    def truncate(self, name: str, size: int) -> None:
        if name not in self.files:
            return
        self._call("truncate", path=name, size=size)
        old = self.files[name]
        self.files[name] = old[:size] + bytes(max(0, size - len(old)))

    @rule(name=st.sampled_from(["/a", "/b", "/c"]))
    def delete(self, name: str) -> None:
        if name in self.files:
            self._call("unlink", path=name)
            del self.files[name]

    @rule()
    def seal(self) -> None:
        self._call("seal")

    @rule()
    def checkpoint(self) -> None:
        self.shard.checkpoint()

    @rule()
    def restart(self) -> None:
        self.shard = self.segments.shard()
        self.client += 1
        self.seq = 0

    @invariant()
    def files_read_as_the_model_says(self) -> None:
        if not hasattr(self, "shard"):
            return
        listed = sorted(e["name"] for e in self._call("list", path="/"))
        assert listed == sorted(name[1:] for name in self.files)
        for name, data in self.files.items():
            assert self._call("read", path=name) == data, name


TestIncrementalCheckpoints = IncrementalCheckpoints.TestCase
TestIncrementalCheckpoints.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)


# -- the free map, against a set of pages -----------------------------------------------


class FreeMap(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.area = PageArea(PAGE, 65 * PAGE)
        self.free = set(range(1, 65))
        self.taken: list[tuple[int, int]] = []

    @rule(pages=st.integers(1, 20))
    def take(self, pages: int) -> None:
        if pages > len(self.free):
            with pytest.raises(CapacityExhausted):
                self.area.take(pages * PAGE)
            return
        got = self.area.take(pages * PAGE)
        assert sum(length for _at, length in got) == pages * PAGE
        for at, length in got:
            span = set(range(at // PAGE, (at + length) // PAGE))
            assert span <= self.free
            self.free -= span
            self.taken.append((at, length))

    @rule(pages=st.integers(1, 20))
    def take_whole(self, pages: int) -> None:
        try:
            at = self.area.take_whole(pages * PAGE)
        except CapacityExhausted:
            runs = [g for g in self.area.gaps() if g[1] - g[0] >= pages * PAGE]
            assert not runs
            return
        span = set(range(at // PAGE, at // PAGE + pages))
        assert span <= self.free
        self.free -= span
        self.taken.append((at, pages * PAGE))

    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        if not self.taken:
            return
        at, length = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
        self.area.give(at, length)
        self.free |= set(range(at // PAGE, (at + length) // PAGE))

    @invariant()
    def gaps_are_the_free_pages_joined(self) -> None:
        gaps = self.area.gaps()
        assert {p for lo, hi in gaps for p in range(lo // PAGE, hi // PAGE)} == self.free
        assert all(a[1] < b[0] for a, b in itertools.pairwise(gaps))


TestFreeMap = FreeMap.TestCase


# -- a fragmented page area -------------------------------------------------------------


def test_a_document_scatters_over_a_fragmented_area_and_reads_back() -> None:
    fd = create_segment("test-checkpoint", PAGE + 64 * PAGE)
    segment = Segment(fd)
    try:
        checkpoints = Checkpoints(segment)
        assert checkpoints.read() is None
        buffers = [bytearray([i]) * PAGE for i in range(60)]
        where: list[Any] = [None] * len(buffers)

        def build(document: bytes) -> Any:
            def make(store: Checkpoints) -> tuple[bytes, Callable[[], None]]:
                placed = [store.place(b, at, None) for b, at in zip(buffers, where, strict=True)]

                def published() -> None:
                    where[:] = placed

                return document, published

            return make

        checkpoints.write(1, build(b"d" * 10))
        del buffers[::2], where[::2]  # every other page of the area comes free
        checkpoints.write(2, build(b"e" * 10))
        assert max(hi - lo for lo, hi in checkpoints.area.gaps()) < 12 * PAGE
        document = os.urandom(12 * PAGE)  # larger than any free range
        checkpoints.write(3, build(document))
        assert len(checkpoints._document) > 1  # it lies in several ranges
        assert Checkpoints(segment).read() == (3, document)
        fresh = Checkpoints(segment)
        fresh.read()
        assert [fresh.fetch(at, PAGE) for at in where] == buffers
        fresh.loaded()
        assert fresh.area.free_bytes == checkpoints.area.free_bytes
    finally:
        segment.close()
        os.close(fd)
