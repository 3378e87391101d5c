"""Page buffers in the checkpoint segment (issue 14): a written byte is copied once into
the page area and a checkpoint copies none; a piece the published checkpoint names is
copied on write; the published one survives a shard killed mid-write; and restarts
after many checkpoints restore exact content."""

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

from slates.errors import CapacityExhausted, InvalidArgument, VerificationFailed
from slates.node import shard as shard_module
from slates.node.checkpoints import PIECE_BYTES, Checkpoints, PageArea
from slates.node.events import ReplySaved
from slates.node.journal import PAGE, Segment, create_segment
from slates.node.memory import segment_bytes
from slates.node.protocol import Hello, pack, unpack
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


def test_a_write_is_copied_once_and_a_checkpoint_copies_nothing(segments: Segments) -> None:
    shard = segments.shard()
    pages = shard.checkpoints.pages
    vid = call(shard, 1, "volume.create", name="v")["id"]
    seq = 1
    for index in range(6):
        seq += 1
        call(shard, seq, "write", volume=vid, path=f"/f{index}", data=os.urandom(64 << 10))
    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=os.urandom(3 * MiB + 5))
    held = sum(_buffer_lengths(shard, vid).values())
    assert pages.written_bytes == held and pages.copied_bytes == 0  # once, into place
    assert (
        pages.live_bytes
        == held
        == shard.host.private_bytes - shard.service.volumes[vid].metadata_bytes
    )

    shard.checkpoint()
    shard.checkpoint()  # nothing is copied by a checkpoint, changed or not
    assert (pages.written_bytes, pages.copied_bytes) == (held, 0)

    seq += 1
    call(shard, seq, "write", volume=vid, path="/f3", data=b"small change", offset=100)
    assert pages.copied_bytes == 64 << 10  # its published piece, copied on write
    seq += 1
    call(shard, seq, "write", volume=vid, path="/f3", data=b"again", offset=300)
    assert pages.copied_bytes == 64 << 10  # the copy is nobody's but ours: in place

    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=b"edit", offset=2 * MiB + 7)
    assert pages.copied_bytes == (64 << 10) + PIECE_BYTES  # one piece of it
    shard.checkpoint()

    before = pages.copied_bytes
    seq += 1
    call(shard, seq, "write", volume=vid, path="/big", data=b"+" * 10, offset=3 * MiB + 5)
    assert pages.copied_bytes - before == PAGE  # an append copies its last page only

    # What the host counts is what the segments hold: each page once (as private
    # bytes), the published copies and the journal as the shard's overhead.
    journal_fd, checkpoint_fd, _arena_fd = segments.fds
    volume = shard.service.volumes[vid]
    host = shard.host
    assert host.held_bytes == (
        segment_bytes(journal_fd)
        + segment_bytes(checkpoint_fd)
        + host.chunk_bytes
        + host.snapshot_metadata_bytes
        + volume.metadata_bytes
        + volume.inflight_bytes
    )

    restarted = segments.shard()  # the checkpoint, and the journal after it
    assert restarted.service.volumes[vid]._buffers == shard.service.volumes[vid]._buffers
    assert restarted.checkpoints.pages.live_bytes == held


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
    (buffer,) = shard.service.volumes[vid]._buffers.values()
    where, _pieces = shard.checkpoints.pages.place(buffer)
    segment = Segment(segments.fds[1])
    try:
        segment.map[where[0] + 5] ^= 0xFF
        with pytest.raises(VerificationFailed, match="checksum"):
            segments.shard()
        segment.map[where[0] + 5] ^= 0xFF  # undamaged, it loads again
        assert call(segments.shard(), 3, "read", volume=vid, path="/f") == b"precious" * 1000
    finally:
        segment.close()


def test_a_full_page_area_refuses_the_write_and_changes_nothing() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * MiB)
    try:
        shard = segments.shard()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        call(shard, 2, "write", volume=vid, path="/a", data=b"a" * (5 * MiB))
        call(shard, 3, "write", volume=vid, path="/b", data=b"")
        free = shard.checkpoints.area.free_bytes
        with pytest.raises(AssertionError, match="CapacityExhausted"):
            call(shard, 4, "write", volume=vid, path="/b", data=b"b" * (8 * MiB))
        assert shard.checkpoints.area.free_bytes == free
        assert call(shard, 5, "read", volume=vid, path="/b") == b""
        assert call(segments.shard(), 6, "read", volume=vid, path="/a") == b"a" * (5 * MiB)
    finally:
        segments.close()


def test_a_document_that_does_not_fit_skips_the_checkpoint_and_keeps_the_published_one() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * MiB)
    try:
        shard = segments.shard()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        call(shard, 2, "write", volume=vid, path="/a", data=b"a" * (5 * MiB))
        shard.checkpoint()
        generation = shard.journal.generation
        # Every piece of /a copied on write: the published checkpoint keeps the old ones.
        call(shard, 3, "write", volume=vid, path="/a", data=b"A" * (5 * MiB))
        rest = shard.checkpoints.area.free_bytes
        call(shard, 4, "write", volume=vid, path="/c", data=b"c" * rest)  # fills the area
        assert shard.checkpoints.area.free_bytes == 0
        shard.checkpoint()  # its document does not fit: logged, skipped
        assert shard.journal.generation == generation
        restarted = segments.shard()  # the old checkpoint and the journal after it
        assert call(restarted, 5, "read", volume=vid, path="/a") == b"A" * (5 * MiB)
        assert call(restarted, 6, "read", volume=vid, path="/c") == b"c" * rest
        call(restarted, 7, "unlink", volume=vid, path="/c")
        restarted.checkpoint()  # fits now, and frees the old copy of /a
        assert restarted.journal.generation == generation + 1
        assert restarted.checkpoints.area.free_bytes >= 12 * MiB - 5 * MiB - 2 * PAGE
        assert call(segments.shard(), 8, "read", volume=vid, path="/a") == b"A" * (5 * MiB)
    finally:
        segments.close()


def test_published_copies_are_freed_before_they_crowd_out_new_pages() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * MiB)
    try:
        shard = segments.shard()
        vid = call(shard, 1, "volume.create", name="v")["id"]
        call(shard, 2, "write", volume=vid, path="/a", data=b"a" * (5 * MiB))
        shard.checkpoint()
        generation = shard.journal.generation
        call(shard, 3, "write", volume=vid, path="/a", data=b"A" * (5 * MiB))  # all copied
        assert shard.checkpoints.pages.stale_bytes == 5 * MiB
        call(shard, 4, "write", volume=vid, path="/c", data=b"c" * MiB)  # the area runs low
        # The next request checkpoints first: the old copy of /a goes, /d fits.
        call(shard, 5, "write", volume=vid, path="/d", data=b"d" * (4 * MiB))
        assert shard.journal.generation == generation + 1
        assert shard.checkpoints.pages.stale_bytes == 0
        restarted = segments.shard()
        assert call(restarted, 6, "read", volume=vid, path="/a") == b"A" * (5 * MiB)
        assert call(restarted, 7, "read", volume=vid, path="/d") == b"d" * (4 * MiB)
    finally:
        segments.close()


UNIT = 16 * PAGE  # small sizes: the page area's free map works in pages


def _stale_area(segments: Segments) -> tuple[shard_module.Shard, str]:
    """A shard whose page area holds /a twice: its published copy (stale, freed by the
    next checkpoint) and its rewritten one; about 2 units free, too much to be due."""
    shard = segments.shard()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    call(shard, 2, "write", volume=vid, path="/a", data=b"a" * (5 * UNIT))
    shard.checkpoint()
    call(shard, 3, "write", volume=vid, path="/a", data=b"A" * (5 * UNIT))  # all copied
    assert shard.checkpoints.pages.stale_bytes == 5 * UNIT
    assert UNIT < shard.checkpoints.area.free_bytes < 4 * UNIT
    assert not shard._checkpoint_due()  # no trigger before the request runs
    return shard, vid


def _reply(shard: shard_module.Shard, seq: int, op: str, **args: Any) -> dict[str, Any]:
    answered = shard.handle(
        Hello("c", False), pack({"seq": seq, "ack": seq - 1, "op": op, "args": args})
    )
    assert isinstance(answered, bytes)
    reply: dict[str, Any] = unpack(answered)
    return reply


def test_a_write_refused_for_stale_copies_checkpoints_and_runs_again() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * UNIT)
    try:
        shard, vid = _stale_area(segments)
        generation = shard.journal.generation
        # Larger than the free space, smaller than it once the stale copy of /a goes.
        call(shard, 4, "write", volume=vid, path="/d", data=b"d" * (4 * UNIT))
        assert shard.journal.generation == generation + 1  # the checkpoint it took
        assert shard.checkpoints.pages.stale_bytes == 0
        # Its one saved reply is the success: the withdrawn refusal was never journaled.
        assert shard.service.results["c"][4]["ok"]
        saved = [
            event
            for payload in shard.journal.entries()
            for event in shard_module.unpack_events(payload)
            if isinstance(event, ReplySaved) and event.seq == 4
        ]
        assert [event.reply["ok"] for event in saved] == [True]
        assert call(shard, 5, "read", volume=vid, path="/d") == b"d" * (4 * UNIT)
        restarted = segments.shard()
        assert call(restarted, 6, "read", volume=vid, path="/a") == b"A" * (5 * UNIT)
        assert call(restarted, 7, "read", volume=vid, path="/d") == b"d" * (4 * UNIT)
    finally:
        segments.close()


def test_a_write_too_large_even_after_the_checkpoint_is_refused_once() -> None:
    segments = Segments(checkpoint_bytes=PAGE + 12 * UNIT)
    try:
        shard, vid = _stale_area(segments)
        generation = shard.journal.generation
        refused = _reply(shard, 4, "write", volume=vid, path="/e", data=b"e" * (9 * UNIT))
        assert not refused["ok"] and refused["error"]["code"] == "CapacityExhausted"
        assert shard.journal.generation == generation + 1  # one checkpoint, one retry
        free = shard.checkpoints.area.free_bytes
        # The refusal is the saved reply: the client's retry gets it and runs nothing.
        assert _reply(shard, 4, "write", volume=vid, path="/e", data=b"e" * (9 * UNIT)) == refused
        assert shard.journal.generation == generation + 1
        assert shard.checkpoints.area.free_bytes == free
        restarted = segments.shard()  # the saved refusal is journaled, as any reply
        assert _reply(restarted, 4, "write", volume=vid, path="/e", data=b"") == refused
        # Its file was made before the refusal, as by any refused write, and stays empty.
        assert call(restarted, 5, "read", volume=vid, path="/e") == b""
        assert call(restarted, 6, "read", volume=vid, path="/a") == b"A" * (5 * UNIT)
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
    place = checkpoints.Checkpoints.place
    places = 0

    def dying_place(self, buffer):
        global places
        places += 1
        if places > kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return place(self, buffer)

    checkpoints.Checkpoints.place = dying_place
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
            assert got == data, f"seed {seed}, killed after {kill_after} places: {path}"


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
        self.warm: set[int] = set()  # the free pages given back warm
        self.taken: list[tuple[int, int]] = []

    @rule(pages=st.integers(1, 20))
    def take(self, pages: int) -> None:
        if pages > len(self.free):
            with pytest.raises(CapacityExhausted):
                self.area.take(pages * PAGE)
            return
        got = self.area.take(pages * PAGE)
        assert sum(length for _at, length in got) == pages * PAGE
        taken: set[int] = set()
        for at, length in got:
            span = set(range(at // PAGE, (at + length) // PAGE))
            assert span <= self.free
            taken |= span
            self.free -= span
            self.taken.append((at, length))
        # Warm space first: cold pages only once every warm one is taken.
        assert taken <= self.warm or self.warm <= taken
        self.warm -= taken

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
        self.warm -= span
        self.taken.append((at, pages * PAGE))

    @rule(data=st.data(), warm=st.booleans())
    def give(self, data: st.DataObject, warm: bool) -> None:
        if not self.taken:
            return
        at, length = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
        self.area.give(at, length, warm=warm)
        span = set(range(at // PAGE, (at + length) // PAGE))
        self.free |= span
        if warm:
            self.warm |= span

    @rule()
    def cool(self) -> None:
        cooled = {p for lo, hi in self.area.cool() for p in range(lo // PAGE, hi // PAGE)}
        assert cooled == self.warm
        self.warm = set()

    @rule(pages=st.integers(0, 3))
    def give_free_space_again(self, pages: int) -> None:
        """Freeing what is free (warm or cold) is refused, the map unchanged."""
        if not self.free:
            return
        page = sorted(self.free)[pages % len(self.free)]
        before = self.area.gaps()
        with pytest.raises(InvalidArgument):
            self.area.give(page * PAGE, PAGE, warm=bool(pages % 2))
        assert self.area.gaps() == before

    @invariant()
    def gaps_are_the_free_pages_joined(self) -> None:
        gaps = self.area.gaps()
        assert {p for lo, hi in gaps for p in range(lo // PAGE, hi // PAGE)} == self.free
        assert all(a[1] < b[0] for a, b in itertools.pairwise(gaps))
        warm = self.area.warm_gaps()
        assert {p for lo, hi in warm for p in range(lo // PAGE, hi // PAGE)} == self.warm
        assert self.area.free_bytes == len(self.free) * PAGE
        assert self.area.warm_bytes == len(self.warm) * PAGE


TestFreeMap = FreeMap.TestCase


# -- a fragmented page area -------------------------------------------------------------


def test_a_document_scatters_over_a_fragmented_area_and_reads_back() -> None:
    fd = create_segment("test-checkpoint", PAGE + 64 * PAGE)
    segment = Segment(fd)
    try:
        checkpoints = Checkpoints(segment)
        assert checkpoints.read() is None
        buffers = [checkpoints.pages.new([bytes([i]) * PAGE]) for i in range(60)]
        where: list[Any] = []

        def build(document: bytes) -> Any:
            def make(store: Checkpoints) -> tuple[bytes, Callable[[], None]]:
                where[:] = [store.place(b) for b in buffers]
                return document, lambda: None

            return make

        checkpoints.write(1, build(b"d" * 10))
        for buffer in buffers[::2]:
            checkpoints.pages.free(buffer)
        del buffers[::2]  # every other page of the area comes free (once published)
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
