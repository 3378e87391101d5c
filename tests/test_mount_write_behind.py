"""Write-behind under the shard's grants (native/bridge_behind.c, slates.node.grants).

A write-through mount answers a write the shard granted as soon as it is in
the ring.  What a user relies on, checked with real anchors and mounts (root,
/dev/fuse): a file streamed in is read back exactly, through the mount and the
SDK, with reads and stats between the writes seeing every earlier write; a
shard killed with SIGKILL in the middle of a stream loses no write the writer
was answered (the bridge sends the unanswered ones again), nor does one
killed while a tool makes many small files, whose first writes are answered
early under the grant each create brought; a new file written in pieces, as
an assembler writes its object file, has every write answered early and
reads back whole; an SDK read or write asked for
while answered writes wait in the ring sees them and lands after them; a
bridge killed in
the middle leaves every answered write in the volume (the shard applies what
the dead bridge queued); a bounded volume still refuses the write that does
not fit, at that write, with nothing answered early lost; and the grant's
table (slates.node.grants) against a model.  No timing is asserted.  Seeded
randomness prints its seed in every failure message (BEHIND_SEED=<n> replays
the streamed-file test's).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates import Client
from slates.core.volume import MAX_FILE_SIZE
from slates.errors import InvalidArgument
from slates.node.grants import SCATTER_COST, Grant, GrantState, LinkGrant
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted, wait_for_restart
from tests.test_mount_clean_reads import counters, uncached_read
from tests.test_mount_prefetch import settled

__all__ = ["service"]

needs_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)
MIB = 1 << 20


def _payload(seed: int, size: int) -> bytes:
    """Seeded bytes, a MiB at a time (randbytes takes at most 256 MiB at once)."""
    blocks = (random.Random(seed * 1_000_003 + i).randbytes(MIB) for i in range(-(-size // MIB)))
    return b"".join(blocks)[:size]


@needs_fuse
def test_a_streamed_file_reads_back_and_every_read_between_sees_the_writes(
    service: Service, tmp_path: Path
) -> None:
    seed = int(os.environ.get("BEHIND_SEED") or random.randrange(1 << 32))
    data = _payload(seed, 24 * MIB + 1234)
    base = tmp_path / "base"
    base.mkdir()
    with Client(service.runtime) as client:
        vid = client.create_volume("stream", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            path = mnt / "big.bin"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            reader = os.open(path, os.O_RDONLY)
            try:
                rng = random.Random(seed)
                at = 0
                while at < len(data):
                    n = min(len(data) - at, rng.choice([4096, 65536, MIB, MIB, 3000]))
                    assert os.write(fd, data[at : at + n]) == n, seed
                    at += n
                    assert os.fstat(fd).st_size == at, seed
                    if rng.random() < 0.2:  # a READ the shard answers, after the writes
                        os.posix_fadvise(reader, 0, 0, os.POSIX_FADV_DONTNEED)
                        lo = rng.randrange(at)
                        expected = data[lo : min(lo + 8192, at)]  # the file ends at `at`
                        assert os.pread(reader, 8192, lo) == expected, seed
                os.fsync(fd)
            finally:
                os.close(reader)
                os.close(fd)
            assert uncached_read(path) == data, seed
            assert client.read(vid, "/big.bin") == data, seed
            seen = counters(service, vid)
    assert seen["behind_writes"] > 0, seen  # the stream was answered early
    assert seen["behind_replies"] == seen["behind_writes"], seen  # and every reply came


STREAMER = r"""
import os, random, sys
path, seed, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
blocks = [random.Random(seed * 1_000_003 + i).randbytes(1 << 20) for i in range(-(-size >> 20))]
data = b"".join(blocks)[:size]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
at = 0
while at < size:
    try:
        n = os.write(fd, data[at : at + (1 << 20)])
    except OSError as exc:
        print("error", exc.errno, flush=True)
        sys.exit(3)
    at += n
    print("answered", at, flush=True)
try:
    os.fsync(fd)
except OSError as exc:
    print("error", exc.errno, flush=True)
    sys.exit(4)
print("synced", flush=True)
"""


def _stream(path: Path, seed: int, size: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", STREAMER, str(path), str(seed), str(size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _answered_at_least(writer: subprocess.Popen[str], nbytes: int) -> int:
    """Read the writer's progress until it was answered `nbytes`; the count."""
    assert writer.stdout is not None
    while line := writer.stdout.readline():
        word, _, value = line.partition(" ")
        assert word == "answered", line
        if int(value) >= nbytes:
            return int(value)
    problem = writer.stderr.read() if writer.stderr else ""
    raise AssertionError(f"the writer stopped early: {problem}")


def _until_quiet(writer: subprocess.Popen[str], answered: int) -> int:
    """Follow the writer's progress until it stops (a second without a line)."""
    assert writer.stdout is not None
    os.set_blocking(writer.stdout.fileno(), False)
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        line = writer.stdout.readline()
        if not line:
            time.sleep(0.05)
            continue
        word, _, value = line.partition(" ")
        if word == "answered":
            answered, quiet_since = int(value), time.monotonic()
    os.set_blocking(writer.stdout.fileno(), True)
    return answered


@contextlib.contextmanager
def _streaming(
    service: Service, tmp_path: Path, size: int
) -> Iterator[tuple[Client, dict[str, Any], Path, subprocess.Popen[str], int]]:
    """A mount of a fresh volume, and a writer streaming `size` seeded bytes into
    big.bin there: (client, the volume, the mount, the writer, the seed).  The writer
    is killed on the way out if it still runs."""
    seed = random.randrange(1 << 32)
    base = tmp_path / "base"
    base.mkdir()
    with Client(service.runtime) as client:
        created = client.create_volume("streamed", base=base)
        with mounted(client, created["id"], tmp_path / "mnt") as mnt:
            writer = _stream(mnt / "big.bin", seed, size)
            try:
                yield client, created, mnt, writer, seed
            finally:
                if writer.poll() is None:
                    writer.kill()
                    writer.wait()


@needs_fuse
def test_a_shard_killed_mid_stream_loses_no_answered_write(
    service: Service, tmp_path: Path
) -> None:
    size = 96 * MIB
    with _streaming(service, tmp_path, size) as (client, created, mnt, writer, seed):
        rng = random.Random(seed)
        for _ in range(2):  # twice, at seeded points of the stream
            _answered_at_least(writer, rng.randrange(8, 40) * MIB)
            old = service.kill_shard(int(created["shard"]))
            service.wait_restarted(int(created["shard"]), old)
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, (seed, out[-300:], err)
        assert out.rstrip().endswith("synced"), (seed, out[-300:])
        data = _payload(seed, size)
        assert uncached_read(mnt / "big.bin") == data, seed
        assert client.read(created["id"], "/big.bin") == data, seed
        seen = counters(service, created["id"])
    assert seen["behind_writes"] > 0 and seen["reconnects"] >= 1, seen


@needs_fuse
def test_a_bridge_killed_mid_stream_leaves_every_answered_write(
    service: Service, tmp_path: Path
) -> None:
    size = 192 * MIB
    with _streaming(service, tmp_path, size) as (client, created, mnt, writer, seed):
        shard = service.shard_pids()[int(created["shard"])]
        try:
            answered = _answered_at_least(writer, random.Random(seed).randrange(8, 24) * MIB)
            # The shard stopped: the bridge answers what the grant lets it, those
            # writes wait in the ring, and the writer then waits on the full ring.
            os.kill(shard, signal.SIGSTOP)
            answered = _until_quiet(writer, answered)
            (info,) = client.mounts()
            os.kill(int(info["pid"]), signal.SIGKILL)
        finally:
            os.kill(shard, signal.SIGCONT)
        out, _err = writer.communicate(timeout=120)
        for word, _, value in (line.partition(" ") for line in out.splitlines()):
            if word == "answered":
                answered = max(answered, int(value))
        assert writer.returncode in (0, 3, 4), (seed, out[-300:])
        wait_for_restart(client, mnt, int(info["pid"]))
        stored = client.read(created["id"], "/big.bin")
        # Every byte the writer was answered is there (the kill may have landed
        # between a write's answer and its line, so more may be).
        assert len(stored) >= answered, (seed, len(stored), answered)
        assert stored == _payload(seed, size)[: len(stored)], seed


MAKER = """
import os, random, sys
where, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
for i in range(count):
    data = rng.randbytes(rng.randrange(1, 5000))
    fd = os.open(os.path.join(where, f"f{i:04}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if i % 2:  # as an assembler does: the body first, then back for the header
            assert os.pwrite(fd, data[64:], 64) == len(data[64:])
            assert os.pwrite(fd, data[:64], 0) == len(data[:64])
        else:
            assert os.write(fd, data) == len(data)
    except OSError as exc:
        print("error", i, exc.errno, flush=True)
        sys.exit(3)
    os.close(fd)
    print("answered", i + 1, flush=True)
"""


def _small_files(seed: int, count: int) -> list[bytes]:
    """What MAKER writes: each file's bytes, in order."""
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(1, 5000)) for _ in range(count)]


@needs_fuse
def test_small_files_made_while_the_shard_is_killed_are_all_there(
    service: Service, tmp_path: Path
) -> None:
    """A tool making many small files (git checkout, tar x) has each file's first
    write answered early, under the grant its create brought, and so has one that
    writes every other file in two pieces, header last (an assembler); a shard killed
    in the middle loses none of them."""
    seed, count = random.randrange(1 << 32), 600
    base = tmp_path / "base"
    base.mkdir()
    with Client(service.runtime) as client:
        created = client.create_volume("small-files", base=base)
        with mounted(client, created["id"], tmp_path / "mnt") as mnt:
            (mnt / "out").mkdir()
            before = counters(service, created["id"])
            maker = subprocess.Popen(
                [sys.executable, "-c", MAKER, str(mnt / "out"), str(seed), str(count)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                _answered_at_least(maker, random.Random(seed).randrange(100, 300))
                old = service.kill_shard(int(created["shard"]))
                service.wait_restarted(int(created["shard"]), old)
                out, err = maker.communicate(timeout=300)
            finally:
                if maker.poll() is None:
                    maker.kill()
                    maker.wait()
            assert maker.returncode == 0, (seed, out[-300:], err)
            expected = _small_files(seed, count)
            for i, data in enumerate(expected):
                assert client.read(created["id"], f"/out/f{i:04}") == data, (seed, i)
                assert (mnt / "out" / f"f{i:04}").read_bytes() == data, (seed, i)
            seen = counters(service, created["id"])
    early = seen["behind_writes"] - before.get("behind_writes", 0)
    # Without a grant at create, a file's only write waits for the shard.
    assert early > count // 2 and seen["reconnects"] >= 1, (seed, early, seen)


def _answered_while_stopped(shard: int, write: Any) -> None:
    """Stop the shard and run `write` (a write(2) through the mount): it must be
    answered early, from the ring, and the shard stays stopped; a write that waits
    for the shard fails the test (after the shard is let go, so nothing hangs)."""
    done = threading.Event()

    def run() -> None:
        write()
        done.set()

    writer = threading.Thread(target=run)
    os.kill(shard, signal.SIGSTOP)
    try:
        writer.start()
        answered = done.wait(10)
    finally:
        if not done.is_set():
            os.kill(shard, signal.SIGCONT)
    writer.join(60)
    assert answered, "a write under the grant waited for the stopped shard"


def _asked_while_stopped(shard: int, ask: Any) -> Any:
    """What `ask` (an SDK call) returns when asked for while the shard is stopped
    (stopped by _answered_while_stopped), the shard let go once the request waits."""
    got: list[Any] = []
    asker = threading.Thread(target=lambda: got.append(ask()))
    try:
        asker.start()
        time.sleep(0.2)  # the request waits at the stopped shard
    finally:
        os.kill(shard, signal.SIGCONT)
    asker.join(60)
    assert got, "the SDK request failed"
    return got[0]


@needs_fuse
def test_sdk_requests_see_and_follow_every_write_a_mount_answered(
    service: Service, tmp_path: Path
) -> None:
    """Writes answered early wait in the ring while the shard is stopped.  An SDK read
    asked for then must see them, and an SDK write asked for then must land after
    them (Shard._quiesce): what a program saw succeed is what every other client sees,
    and comes before what they do next.  Which of the ring and the socket the resumed
    shard serves first is up to its scheduler, so each is tried in several rounds."""
    base = tmp_path / "base"
    base.mkdir()
    with Client(service.runtime) as client:
        created = client.create_volume("order", base=base)
        vid = created["id"]
        shard = service.shard_pids()[int(created["shard"])]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            settled(service.runtime, vid)  # the prefetch walk's requests would end grants
            for round_ in range(6):
                path = f"/r{round_}"
                with open(mnt / path[1:], "xb", buffering=0) as f:
                    f.write(b"a" * 4096)  # under the grant its create brought
                    _answered_while_stopped(shard, lambda: f.write(b"b" * 4096))
                    seen = _asked_while_stopped(shard, functools.partial(client.read, vid, path))
                    assert seen == b"a" * 4096 + b"b" * 4096, (round_, len(seen))
                    _answered_while_stopped(shard, lambda: f.write(b"c" * 4096))
                    _asked_while_stopped(
                        shard, functools.partial(client.write, vid, path, b"d" * 4096, 8192)
                    )
                held = client.read(vid, path)
                assert held == b"a" * 4096 + b"b" * 4096 + b"d" * 4096, (round_, held[8192:8200])
                assert (mnt / path[1:]).read_bytes() == held, round_


# What an assembler does to its object file: sections forward with gaps, back to fill
# in a section's tail, the header last, and a write far past the end (a hole).
SCATTERED = ((16384, 997), (64, 4032), (4096, 8192), (12288, 123), (19344, 5504), (0, 64))
FAR = 1 << 30


@needs_fuse
def test_an_object_file_written_in_pieces_is_answered_early_and_reads_back_whole(
    service: Service, tmp_path: Path
) -> None:
    """A new file's writes go behind anywhere in it (the grant its create brought
    covers scattered writes, slates.node.grants): every write of an assembler-like
    pattern is answered early, and the file then reads back, through the mount and the
    SDK, exactly as the same writes make it on a plain file system, hole included."""
    base = tmp_path / "base"
    base.mkdir()
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    writes = [(offset, rng.randbytes(size)) for offset, size in SCATTERED]
    writes.append((FAR, rng.randbytes(100)))
    reference = tmp_path / "reference.o"
    with open(reference, "xb", buffering=0) as f:
        for offset, data in writes:
            os.pwrite(f.fileno(), data, offset)
    expected_head = reference.read_bytes()[: 1 << 16]
    with Client(service.runtime) as client:
        vid = client.create_volume("scattered", base=base)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            settled(service.runtime, vid)  # the prefetch walk's requests would end grants
            before = counters(service, vid)
            fd = os.open(mnt / "lapi.o", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for i, (offset, data) in enumerate(writes):
                    assert os.pwrite(fd, data, offset) == len(data), seed
                    if i == 2:  # the assembler reads back a header: the grant stays
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        assert os.pread(fd, 64, 64) == writes[1][1][:64], seed
                os.fsync(fd)  # nothing answered early failed
            finally:
                os.close(fd)
            after = counters(service, vid)
            early = after.get("behind_writes", 0) - before.get("behind_writes", 0)
            sent = after.get("WRITE", 0) - before.get("WRITE", 0)  # the kernel may split one
            assert early == sent >= len(writes), (seed, before, after)
            # Written again later (no create): the first write waits for the shard and
            # brings a scattered grant, as the file holds nothing read from the base.
            fd = os.open(mnt / "lapi.o", os.O_RDWR)
            try:
                for offset, data in reversed(writes[:-1]):
                    assert os.pwrite(fd, data, offset) == len(data), seed
                os.fsync(fd)
            finally:
                os.close(fd)
            again = counters(service, vid)
            early = again.get("behind_writes", 0) - after.get("behind_writes", 0)
            sent = again.get("WRITE", 0) - after.get("WRITE", 0)
            assert early == sent - 1 >= len(writes) - 2, (seed, after, again)
            assert os.stat(mnt / "lapi.o").st_size == FAR + 100, seed
            fd = os.open(mnt / "lapi.o", os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel sends READs
                assert os.pread(fd, 1 << 16, 0) == expected_head, seed
                assert os.pread(fd, 100, FAR) == writes[-1][1], seed
            finally:
                os.close(fd)
            assert client.read(vid, "/lapi.o", 0, 1 << 16) == expected_head, seed
            assert client.read(vid, "/lapi.o", FAR, 100) == writes[-1][1], seed


@needs_fuse
def test_a_snapshot_holds_every_write_answered_before_it(service: Service, tmp_path: Path) -> None:
    """The attachment barrier: writes answered early but still in the ring when a
    snapshot is asked for are in the snapshot.  The shard is stopped while the writer
    streams, so answered writes wait in the ring, then the snapshot is asked for and
    the shard let go: it must apply them first."""
    seed = random.randrange(1 << 32)
    size = 64 * MIB
    data = _payload(seed, size)
    base = tmp_path / "base"
    base.mkdir()
    with Client(service.runtime) as client:
        created = client.create_volume("barrier", base=base)
        vid = created["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            progress: list[int] = [0]
            failures: list[BaseException] = []

            def write() -> None:
                try:
                    with open(mnt / "big.bin", "xb", buffering=0) as f:
                        # Quarter-MiB writes: the ring holds the FIFO's worth of them.
                        for at in range(0, size, MIB // 4):
                            f.write(data[at : at + MIB // 4])
                            progress[0] = at + MIB // 4
                except BaseException as exc:
                    failures.append(exc)

            writer = threading.Thread(target=write)
            writer.start()
            shard = service.shard_pids()[int(created["shard"])]
            snapped: list[str] = []
            try:
                while progress[0] < random.Random(seed).randrange(4, 24) * MIB:
                    time.sleep(0.005)
                os.kill(shard, signal.SIGSTOP)
                answered, quiet_since = progress[0], time.monotonic()
                while time.monotonic() - quiet_since < 1.0:
                    if progress[0] != answered:
                        answered, quiet_since = progress[0], time.monotonic()
                    time.sleep(0.01)
                asker = threading.Thread(target=lambda: snapped.append(client.snapshot(vid)))
                asker.start()
                time.sleep(0.3)  # the request waits at the stopped shard
            finally:
                os.kill(shard, signal.SIGCONT)
            asker.join(120)
            writer.join(120)
            assert not failures, (seed, failures)
            (snapshot,) = snapped
            copy = client.create_volume("copy", from_snapshot=snapshot)["id"]
            held = client.read(copy, "/big.bin")
            assert len(held) >= answered, (seed, len(held), answered)
            assert held == data[: len(held)], seed


@needs_fuse
def test_a_bounded_volume_refuses_the_write_that_does_not_fit_at_that_write(
    service: Service, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    chunk = _payload(7, MIB)
    with Client(service.runtime) as client:
        vid = client.create_volume("small", base=base, bounded=24 * MIB)["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            fd = os.open(mnt / "fill.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            written = 0
            try:
                with pytest.raises(OSError) as refused:
                    for _ in range(64):
                        assert os.write(fd, chunk) == len(chunk)
                        written += len(chunk)
                assert refused.value.errno in (errno.ENOSPC, errno.EDQUOT), refused.value
                os.fsync(fd)  # nothing answered early failed
            finally:
                os.close(fd)
            assert 0 < written < 24 * MIB
            assert client.read(vid, "/fill.bin") == chunk * (written // MIB)
            seen = counters(service, vid)
    assert seen["behind_writes"] > 0, seen


# -- the grant's table against a model ----------------------------------------------


class GrantMachine(RuleBasedStateMachine):
    """LinkGrant against a model: at most one grant, ended by every request but a read,
    and a write is under it only when it is a granted write where the grant says (at
    its end, or anywhere for a scattered grant) and what it costs fits."""

    def __init__(self) -> None:
        super().__init__()
        self.link = LinkGrant()
        self.model: Grant | None = None

    @rule(
        end=st.integers(0, 1 << 30),
        left=st.integers(1, 1 << 24),
        extra=st.integers(0, 99),
        scattered=st.booleans(),
    )
    def offer(self, end: int, left: int, extra: int, scattered: bool) -> None:
        if self.model is not None:
            with pytest.raises(InvalidArgument):
                self.link.offer("v", 5, end, left, left + extra, scattered=scattered)
            return
        self.model = self.link.offer("v", 5, end, left, left + extra, scattered=scattered)
        assert self.model.scattered is scattered

    @rule(
        granted=st.booleans(),
        op=st.sampled_from(["fs.write", "fs.getattr", "fs.read"]),
        shift=st.sampled_from([-1, 0, 1, -(1 << 31), 1 << 20, MAX_FILE_SIZE]),
        size=st.integers(0, 1 << 25),
        ino=st.sampled_from([5, 6]),
    )
    def receive(self, granted: bool, op: str, shift: int, size: int, ino: int) -> None:
        model = self.model
        offset = (model.end if model else 0) + shift
        args = {"volume": "v", "ino": ino, "offset": offset, "data": b"x" * min(size, 64)}
        if granted:
            args["granted"] = True
        ended, covered = self.link.receive(op, args)
        if op == "fs.read":  # a read keeps whatever the link holds
            assert ended is None and not covered
            return
        assert ended == model
        written = min(size, 64)
        expected = (
            model is not None
            and op == "fs.write"
            and granted
            and ino == 5
            and (shift == 0 or (model.scattered and offset >= 0))
            and written > 0
            and offset + written <= MAX_FILE_SIZE
            and written + (SCATTER_COST if model.scattered else 0) <= model.left
        )
        assert covered == expected
        self.model = None

    @rule()
    def end(self) -> None:
        assert self.link.end() == self.model
        self.model = None

    @rule(left=st.integers(-5, 0))
    def a_grant_of_nothing_is_refused(self, left: int) -> None:
        if self.model is None:
            with pytest.raises(InvalidArgument):
                self.link.offer("v", 5, 0, left, 10)

    @invariant()
    def state_follows_the_grant(self) -> None:
        assert self.link.grant == self.model
        held = GrantState.HELD if self.model is not None else GrantState.IDLE
        assert self.link.state is held


TestGrantMachine = GrantMachine.TestCase


def test_the_link_ends_its_grant_on_any_request_even_undecodable_ones() -> None:
    link = LinkGrant()
    link.offer("v", 5, 100, 10, 20)
    ended, covered = link.receive("fs.write", {"granted": True, "volume": "v"})  # no data
    assert ended is not None and not covered and link.state is GrantState.IDLE
