"""Shared-memory rings: native/ring.c through slates.node.ring."""

from __future__ import annotations

import collections
import errno
import fcntl
import importlib
import mmap
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import slates.node.ring
from slates.errors import InvalidArgument, VerificationFailed
from slates.node.ring import MAX_SPIN_NS, MIN_SPIN_NS, Parts, Ring, RingPair, calibrate_spin
from slates.wire import SPLIT_MARK, SPLIT_PREFIX

# By name: the compiled module has no .py or .pyi, so ruff's import sorting
# would take a plain import of it for a third-party module.
_native = importlib.import_module("slates._native")
ffi, lib = _native.ffi, _native.lib

# Shared header layout, mirrored from struct ring_shared in native/ring.c.
MAGIC, VERSION, HEADER_SIZE, CAPACITY = 0, 8, 12, 16
TAIL, HEAD = 128, 256
DATA = lib.RING_HEADER_SIZE
WRAP = 0xFFFFFFFF

SMALL = 256  # data bytes: small enough that tests wrap and fill it quickly


def frame_size(length: int) -> int:
    return (4 + length + 7) & ~7


def poke(ring: Ring, offset: int, value: int, width: int) -> None:
    """Scribble on the ring's shared memory, as a broken or hostile peer could."""
    with mmap.mmap(ring.fds[0], 0) as mem:
        mem[offset : offset + width] = value.to_bytes(width, "little")


def attach_copy(ring: Ring) -> Ring:
    return Ring.attach(os.dup(ring.fds[0]), os.dup(ring.fds[1]), spin_ns=0)


@pytest.fixture
def ring() -> Iterator[Ring]:
    with Ring.create(SMALL, spin_ns=0) as r:
        yield r


# --- basic behaviour ------------------------------------------------------


def test_a_message_pushed_in_two_parts_is_the_two_joined(ring: Ring) -> None:
    lib = _native.lib
    handle = ring._live()
    assert lib.ring_push2(handle, b"head-", 5, b"and the body", 12) == 0
    assert lib.ring_push2(handle, b"", 0, b"", 0) == 0
    assert ring.pop() == b"head-and the body"
    assert ring.pop() == b""
    most = ring.max_message
    assert lib.ring_push2(handle, b"a" * most, most, b"b", 1) == -errno.EMSGSIZE
    assert lib.ring_push2(handle, b"a", 1, b"b" * most, most) == -errno.EMSGSIZE
    assert ring.pop() is None


def test_a_peeked_message_stays_until_consumed(ring: Ring) -> None:
    lib = _native.lib
    handle = ring._live()
    payload = _native.ffi.new("const uint8_t **")
    assert lib.ring_consume(handle) == -errno.EINVAL  # nothing peeked
    assert ring.push(b"first") and ring.push(b"second")
    assert lib.ring_peek(handle, payload) == 5
    assert bytes(_native.ffi.buffer(payload[0], 5)) == b"first"
    out = _native.ffi.new("uint8_t[]", 64)
    assert lib.ring_pop(handle, out, 64) == -errno.EBUSY  # it would be taken twice
    assert lib.ring_consume(handle) == 0
    assert lib.ring_consume(handle) == -errno.EINVAL
    assert ring.pop() == b"second"


def test_roundtrip(ring: Ring) -> None:
    messages = [b"", b"x", b"hello ring", bytes(range(100)), b"m" * ring.max_message]
    for message in messages:
        assert ring.push(message)
        assert ring.pop() == message
    assert ring.pop() is None


def test_messages_come_out_in_order(ring: Ring) -> None:
    for i in range(5):
        assert ring.push(b"%d" % i)
    assert [ring.pop() for _ in range(6)] == [b"0", b"1", b"2", b"3", b"4", None]


def test_wrap_around_keeps_content(ring: Ring) -> None:
    near_half = ring.max_message - 8  # two frames leave 16 bytes before the end
    assert ring.push(b"a" * near_half)
    assert ring.push(b"b" * near_half)
    assert ring.pop() == b"a" * near_half
    assert ring.pop() == b"b" * near_half
    # This frame does not fit the 16 bytes left: a wrap marker, then offset 0.
    assert ring.push(b"c" * near_half)
    with mmap.mmap(ring.fds[0], 0) as mem:
        assert int.from_bytes(mem[DATA + 240 : DATA + 244], "little") == WRAP
    assert ring.pop() == b"c" * near_half
    assert ring.pop() is None


def test_many_laps_with_varied_sizes(ring: Ring) -> None:
    pending: collections.deque[bytes] = collections.deque()
    for i in range(5000):
        message = bytes([i % 251]) * (i * 7 % (ring.max_message + 1))
        while not ring.push(message):
            assert ring.pop() == pending.popleft()
        pending.append(message)
    while pending:
        assert ring.pop() == pending.popleft()
    assert ring.pop() is None


def test_full_ring_returns_false_and_never_grows(ring: Ring) -> None:
    region = os.fstat(ring.fds[0]).st_size
    # Two largest messages fill the ring exactly.
    assert ring.push(b"1" * ring.max_message)
    assert ring.push(b"2" * ring.max_message)
    assert not ring.push(b"")
    assert not ring.push(b"3")
    assert os.fstat(ring.fds[0]).st_size == region
    assert ring.pop() == b"1" * ring.max_message
    assert ring.push(b"3")
    assert ring.pop() == b"2" * ring.max_message
    assert ring.pop() == b"3"


def test_oversized_message_is_rejected(ring: Ring) -> None:
    with pytest.raises(InvalidArgument):
        ring.push(b"x" * (ring.max_message + 1))
    assert ring.pop() is None
    assert ring.push(b"still usable")
    assert ring.pop() == b"still usable"


@pytest.mark.parametrize("capacity", [0, -64, 32, 100, 255, 3 << 10, 1 << 31, 1 << 40])
def test_bad_capacity_is_rejected(capacity: int) -> None:
    with pytest.raises(InvalidArgument):
        Ring.create(capacity)


def test_pair_carries_requests_and_replies() -> None:
    with RingPair.create(SMALL, spin_ns=0) as client:
        server = RingPair.attach([os.dup(fd) for fd in client.fds], spin_ns=0)
        with server:
            assert client.requests.push(b"ping")
            assert server.requests.pop() == b"ping"
            assert server.replies.push(b"pong")
            assert client.replies.pop() == b"pong"


# --- a peer we cannot trust -------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "value", "width"),
    [
        pytest.param(MAGIC, int.from_bytes(b"NOTARING", "little"), 8, id="magic"),
        pytest.param(VERSION, 1, 4, id="version"),
        pytest.param(HEADER_SIZE, 64, 4, id="header-size"),
        pytest.param(CAPACITY, 200, 8, id="capacity-not-power-of-two"),
        pytest.param(CAPACITY, 2 * SMALL, 8, id="capacity-beyond-region"),
        pytest.param(TAIL, 3, 8, id="tail-misaligned"),
        pytest.param(HEAD, 12, 8, id="head-misaligned"),
    ],
)
def test_corrupt_header_is_rejected_on_attach(
    ring: Ring, offset: int, value: int, width: int
) -> None:
    poke(ring, offset, value, width)
    with pytest.raises(VerificationFailed):
        attach_copy(ring)


def test_region_that_was_never_a_ring_is_rejected() -> None:
    fd = os.memfd_create("not-a-ring", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    with pytest.raises(VerificationFailed):
        Ring.attach(fd, os.eventfd(0, os.EFD_NONBLOCK))


def test_unsealed_memfd_is_rejected(ring: Ring) -> None:
    # A peer could shrink an unsealed memfd under our mapping and crash us (SIGBUS).
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, os.fstat(ring.fds[0]).st_size)
    with pytest.raises(VerificationFailed):
        Ring.attach(fd, os.dup(ring.fds[1]))


def test_fd_that_is_not_a_memfd_is_rejected() -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(VerificationFailed):
        Ring.attach(read_end, os.eventfd(0, os.EFD_NONBLOCK))


@pytest.mark.parametrize(
    ("offset", "value", "width"),
    [
        pytest.param(DATA, 0xFFFFFFF0, 4, id="huge-length"),
        pytest.param(DATA, 100, 4, id="length-past-tail"),
        pytest.param(DATA, WRAP, 4, id="wrap-at-offset-0"),
        pytest.param(TAIL, 4 * SMALL, 8, id="tail-beyond-capacity"),
        pytest.param(TAIL, 4, 8, id="tail-misaligned"),
        pytest.param(HEAD, 16, 8, id="head-past-tail"),
    ],
)
def test_corrupt_message_fails_verification(
    ring: Ring, offset: int, value: int, width: int
) -> None:
    assert ring.push(b"hi")
    poke(ring, offset, value, width)
    with pytest.raises(VerificationFailed):
        ring.pop()


def test_corrupt_head_fails_the_producer(ring: Ring) -> None:
    while ring.push(b"fill"):
        pass
    poke(ring, HEAD, 5, 8)
    with pytest.raises(VerificationFailed):
        ring.push(b"more")


# --- the C API directly -----------------------------------------------------


class RawRing:
    """A ring in private memory with separate producer and consumer views."""

    def __init__(self, capacity: int = SMALL) -> None:
        self.size = lib.ring_region_size(capacity)
        self.mem = ffi.new("uint8_t[]", self.size)
        assert lib.ring_init(self.mem, self.size, capacity) == 0
        self.producer = ffi.new("ring_t *")
        self.consumer = ffi.new("ring_t *")
        assert lib.ring_attach(self.producer, self.mem, self.size) == 0
        assert lib.ring_attach(self.consumer, self.mem, self.size) == 0


def test_c_pop_into_small_buffer_keeps_the_message() -> None:
    raw = RawRing()
    assert lib.ring_push(raw.producer, b"0123456789", 10) == 0
    small = ffi.new("uint8_t[]", 5)
    assert lib.ring_pop(raw.consumer, small, 5) == -errno.EMSGSIZE
    assert lib.ring_peek_length(raw.consumer) == 10
    big = ffi.new("uint8_t[]", 10)
    assert lib.ring_pop(raw.consumer, big, 10) == 10
    assert ffi.buffer(big, 10)[:] == b"0123456789"
    assert lib.ring_pop(raw.consumer, big, 10) == -errno.EAGAIN


def test_c_errors() -> None:
    raw = RawRing()
    too_big = lib.ring_max_message(raw.producer) + 1
    assert lib.ring_push(raw.producer, b"x" * too_big, too_big) == -errno.EMSGSIZE
    assert lib.ring_region_size(100) == 0
    mem = ffi.new("uint8_t[]", 4096)
    assert lib.ring_init(mem, 4096, 100) == -errno.EINVAL
    assert lib.ring_init(mem, 100, 64) == -errno.EINVAL  # region too small
    assert lib.ring_attach(ffi.new("ring_t *"), mem, 4096) == -errno.EPROTO
    assert lib.ring_attach(ffi.new("ring_t *"), mem, 16) == -errno.EINVAL


def test_c_notify_writes_eventfd_only_when_parked() -> None:
    raw = RawRing()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        assert lib.ring_push(raw.producer, b"a", 1) == 0
        assert lib.ring_notify(raw.producer, efd) == 0
        # Data is present, so the consumer must not go to sleep.
        assert lib.ring_prepare_park(raw.consumer) == 1
        assert not lib.ring_is_parked(raw.consumer)
        assert lib.ring_pop(raw.consumer, ffi.new("uint8_t[]", 8), 8) == 1

        assert lib.ring_prepare_park(raw.consumer) == 0
        assert lib.ring_is_parked(raw.consumer)
        assert lib.ring_push(raw.producer, b"b", 1) == 0
        assert lib.ring_notify(raw.producer, efd) == 1
        assert lib.ring_drain_eventfd(efd) == 1
        assert lib.ring_drain_eventfd(efd) == 0
        lib.ring_unpark(raw.consumer)
        assert lib.ring_spin_wait(raw.consumer, 0) == 1
    finally:
        os.close(efd)


def test_c_consumer_parked_until_a_count_sleeps_through_the_messages_before() -> None:
    """A bridge waiting for a reply behind two early-answered writes' replies is woken
    once, by the third push, and counts go on across messages taken by peek too."""
    raw = RawRing()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    out = ffi.new("uint8_t[]", 8)
    try:
        for _ in range(2):  # the counts start past messages already taken
            assert lib.ring_push(raw.producer, b"x", 1) == 0
            assert lib.ring_pop(raw.consumer, out, 8) == 1
        assert lib.ring_prepare_park_until(raw.consumer, 3) == 0
        for n in (1, 2):
            assert lib.ring_push(raw.producer, b"%d" % n, 1) == 0
            assert lib.ring_notify(raw.producer, efd) == 0
        assert lib.ring_push(raw.producer, b"3", 1) == 0
        assert lib.ring_notify(raw.producer, efd) == 1
        assert lib.ring_drain_eventfd(efd) == 1
        lib.ring_unpark(raw.consumer)
        payload = ffi.new("uint8_t **")
        for want in (b"1", b"2", b"3"):
            assert lib.ring_peek(raw.consumer, payload) == 1
            assert ffi.buffer(payload[0], 1)[:] == want
            assert lib.ring_consume(raw.consumer) == 0
        # Parked until one more: the next push wakes it, as ring_prepare_park does.
        assert lib.ring_prepare_park_until(raw.consumer, 0) == 0
        assert lib.ring_push(raw.producer, b"4", 1) == 0
        assert lib.ring_notify(raw.producer, efd) == 1
    finally:
        os.close(efd)


def test_c_spin_wait_times_out_on_an_empty_ring() -> None:
    raw = RawRing()
    assert lib.ring_spin_wait(raw.consumer, 1000) == 0


# --- model-based ------------------------------------------------------------


class RingAgainstDeque(RuleBasedStateMachine):
    """The ring must behave as a FIFO with a byte budget that includes padding.

    The model charges each message its 8-byte-aligned frame, plus the bytes
    skipped at the end of the data area when the frame would straddle it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ring = Ring.create(SMALL, spin_ns=0)
        self.messages: collections.deque[bytes] = collections.deque()
        self.charges: collections.deque[int] = collections.deque()
        self.tail = 0
        self.used = 0
        # The consumer parked until this many more messages (None: awake), and
        # how many were pushed since it parked.
        self.parked_until: int | None = None
        self.pushed_since_park = 0

    @rule(data=st.binary(max_size=SMALL // 2 - 4))
    def push(self, data: bytes) -> None:
        frame = frame_size(len(data))
        room_to_end = SMALL - self.tail % SMALL
        charge = frame if frame <= room_to_end else room_to_end + frame
        fits = self.used + charge <= SMALL
        assert self.ring.push(data) == fits
        if fits:
            self.messages.append(data)
            self.charges.append(charge)
            self.tail += charge
            self.used += charge
        # The push woke the consumer exactly when it had pushed what it parked until.
        woken = lib.ring_drain_eventfd(self.ring.fds[1]) > 0
        if fits and self.parked_until is not None:
            self.pushed_since_park += 1
        wanted = self.parked_until is not None and self.pushed_since_park >= self.parked_until
        assert woken == wanted

    @rule(messages=st.integers(min_value=0, max_value=4))
    def park_until(self, messages: int) -> None:
        """The consumer parks until `messages` more (0 counts as 1): refused while any
        message is queued."""
        if self.parked_until is not None:
            self.wake()
        parked = lib.ring_prepare_park_until(self.ring._ring, messages)
        if self.messages:
            assert parked == 1 and not self.ring.parked
            return
        assert parked == 0 and self.ring.parked
        self.parked_until, self.pushed_since_park = max(messages, 1), 0

    def wake(self) -> None:
        lib.ring_unpark(self.ring._ring)
        self.parked_until = None

    @rule()
    def pop(self) -> None:
        self.wake()
        got = self.ring.pop()
        if not self.messages:
            assert got is None
            return
        assert got == self.messages.popleft()
        self.used -= self.charges.popleft()

    @rule(
        head=st.binary(max_size=40),
        tail=st.binary(max_size=40),
        overrun=st.integers(min_value=0, max_value=3),
    )
    def push_split(self, head: bytes, tail: bytes, overrun: int) -> None:
        """A split message, its head length honest or (overrun) past its end."""
        claimed = len(head) + len(tail) + overrun if overrun else len(head)
        self.push(SPLIT_PREFIX.pack(SPLIT_MARK, claimed) + head + tail)

    @rule()
    def pop_request(self) -> None:
        """As pop, but a split message comes as its parts; one whose head overruns it
        comes whole, as any other message does."""
        self.wake()
        if not self.messages:
            assert self.ring.pop_request() is None
            return
        want = self.messages.popleft()
        self.used -= self.charges.popleft()
        got = self.ring.pop_request()
        if len(want) >= SPLIT_PREFIX.size and want[0] == SPLIT_MARK:
            _mark, head_len = SPLIT_PREFIX.unpack(want[: SPLIT_PREFIX.size])
            split = SPLIT_PREFIX.size + head_len
            if split <= len(want):
                assert got == Parts(want[SPLIT_PREFIX.size : split], want[split:])
                return
        assert isinstance(got, memoryview) and bytes(got) == want

    @rule(extra=st.integers(min_value=1, max_value=64))
    def push_oversized(self, extra: int) -> None:
        with pytest.raises(InvalidArgument):
            self.ring.push(b"o" * (SMALL // 2 - 4 + extra))

    @invariant()
    def within_budget(self) -> None:
        assert 0 <= self.used <= SMALL

    def teardown(self) -> None:
        self.ring.close()


TestRingAgainstDeque = RingAgainstDeque.TestCase
TestRingAgainstDeque.settings = settings(max_examples=150, stateful_step_count=80, deadline=None)


# --- two processes ----------------------------------------------------------

ECHO_SERVER = textwrap.dedent(
    """
    import sys
    import trio
    from slates.node.ring import RingPair

    async def serve(fds, count):
        with RingPair.attach(fds, spin_ns=0) as pair:
            for _ in range(count):
                request = await pair.requests.receive()
                while not pair.replies.push(request[::-1]):
                    await trio.sleep(0)

    trio.run(serve, tuple(int(a) for a in sys.argv[1:5]), int(sys.argv[5]))
    """
)


def test_two_processes_exchange_10000_messages() -> None:
    """A separate process attaches from the fds alone; both sides park (spin 0)."""
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    count = 10_000
    with RingPair.create(4096, spin_ns=0) as pair:
        largest = pair.requests.max_message
        requests = [rng.randbytes(rng.randrange(largest + 1)) for _ in range(count)]
        package_root = Path(slates.node.ring.__file__).resolve().parents[2]
        server = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER, *map(str, pair.fds), str(count)],
            pass_fds=pair.fds,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    [str(package_root), os.environ.get("PYTHONPATH", "")]
                ),
            },
        )
        try:
            sent = received = 0
            while received < count:
                while sent < count and pair.requests.push(requests[sent]):
                    sent += 1
                reply = pair.replies.receive_blocking(timeout=60)
                assert reply is not None, f"no reply to request {received} (seed={seed})"
                assert reply == requests[received][::-1], f"request {received} (seed={seed})"
                received += 1
            assert server.wait(timeout=60) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        assert pair.replies.pop() is None


# --- trio parking -------------------------------------------------------------


async def test_parked_consumer_is_woken_by_push(ring: Ring) -> None:
    received: list[bytes] = []

    async def consume() -> None:
        received.append(await ring.receive())

    with trio.fail_after(30):  # a lost wake-up would hang, not fail
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            assert ring.parked
            assert ring.push(b"wake up")
    assert received == [b"wake up"]
    assert not ring.parked


async def test_receive_returns_queued_message_without_parking(ring: Ring) -> None:
    assert ring.push(b"ready")
    assert await ring.receive() == b"ready"
    assert not ring.parked


async def test_cancelled_receive_unparks(ring: Ring) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ring.receive)
        await trio.testing.wait_all_tasks_blocked()
        assert ring.parked
        nursery.cancel_scope.cancel()
    assert not ring.parked
    assert ring.push(b"after")
    assert ring.pop() == b"after"


async def test_woken_from_another_thread(ring: Ring) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, ring.push, b"from a thread")
            assert await ring.receive() == b"from a thread"


async def test_closing_wakes_a_parked_receiver() -> None:
    ring = Ring.create(SMALL, spin_ns=0)
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await ring.receive()

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        ring.close()


def test_closed_ring_refuses_use(ring: Ring) -> None:
    ring.close()
    ring.close()
    with pytest.raises(InvalidArgument):
        ring.push(b"x")
    with pytest.raises(InvalidArgument):
        ring.pop()
    with pytest.raises(InvalidArgument):
        ring.receive_blocking(timeout=0)


def test_receive_blocking_times_out_on_empty_ring(ring: Ring) -> None:
    assert ring.receive_blocking(timeout=0.01) is None
    assert not ring.parked


# --- calibration --------------------------------------------------------------


def test_calibrate_spin_stays_in_bounds() -> None:
    allowed = os.sched_getaffinity(0)
    spin = calibrate_spin(rounds=20)
    assert os.sched_getaffinity(0) == allowed
    if len(allowed) > 1:
        assert MIN_SPIN_NS <= spin <= MAX_SPIN_NS
    with pytest.raises(InvalidArgument):
        calibrate_spin(rounds=0)


def test_calibrate_spin_does_not_spin_on_one_cpu() -> None:
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert calibrate_spin(rounds=5) == 0
    finally:
        os.sched_setaffinity(0, allowed)
    assert os.sched_getaffinity(0) == allowed
