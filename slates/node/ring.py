"""Shared-memory request/reply rings between a local client and a daemon shard.

Theory of operation
-------------------
A `Ring` is one direction of traffic: a single-producer/single-consumer
message queue (C, `native/ring.c`) laid out inside a sealed memfd, plus an
eventfd the consumer parks on.  A `RingPair` is two rings, requests
(client -> shard) and replies (shard -> client).  The process that creates a
ring owns its two fds; the other side gets them (SCM_RIGHTS, or inheritance)
and calls `Ring.attach`, which takes ownership of the fds it is given.

Invariants:

- Bounded: a ring never grows.  `push` returns False when the ring is full;
  the caller decides whether to wait, shed load or fail the request.
- Exactly one producer and one consumer per ring at a time (per process and
  across processes); the ring does no locking of its own.
- The peer is not trusted: the memfd is sealed against resizing (so the peer
  cannot make our mapping fault), the header is validated on attach, and
  every length read from shared memory is bounds-checked in C.  Corruption
  surfaces as `VerificationFailed`, never as a crash or an out-of-bounds
  read.
- No lost wake-ups: a consumer sets the shared "parked" flag and re-checks
  the ring before sleeping on the eventfd; a producer writes the eventfd
  after a push only when the flag is set (a Dekker pair with seq_cst fences,
  see ring.c).  Spurious wake-ups are possible and harmless.

Waiting: an idle consumer first spins for `spin_ns` nanoseconds, which
should equal the measured cost of an eventfd wake-up (`calibrate_spin`):
spinning for as long as a wake-up would cost keeps the wasted CPU within a
factor of two of the best choice made with hindsight.  The spin runs in C
with the GIL released but does hold up the trio run loop for that long.
Calibrating takes tens of milliseconds (200 cross-CPU round trips), too
much for every mount's bridge process, so `cached_spin_ns` remembers the
result in the runtime directory (SPIN_CACHE_NAME: "v1 <boot id> <ns>",
replaced atomically, 0644) and later processes of the same boot read it.
The file is a hint, never trusted: whoever wrote it, a value is clamped
to [MIN_SPIN_NS, MAX_SPIN_NS]; a missing, malformed, oversized, non-regular
or other-boot file means calibrating again, and a runtime directory we
cannot write only means the next process calibrates too.

A server's wake-up also waits for a CPU: on a host whose CPUs run compilers,
the fair scheduler let a woken shard wait out the compiler's slice (1.4 ms
here).  So shards and bridges ask for the shortest slice (`ask_short_slice`,
native/sched_slice.c): woken, they preempt at once, with no more CPU share.

Callers: the anchor creates rings and passes their fds; daemon shards
consume requests with `receive_request` (trio; the message is decoded before
the next is taken, so it is not copied out of the ring's buffer, and a split
message's raw tail, a large write's data, is copied out once) and push
replies; clients (SDK, CLI) push requests and wait for replies with `receive` or `receive_blocking`.
Messages are opaque bytes here; the protocol layer encodes them (msgpack).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import math
import mmap
import os
import select
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from slates._native import ffi, lib
from slates.errors import InvalidArgument, VerificationFailed
from slates.wire import SPLIT_PREFIX, split_point


@dataclass(frozen=True, slots=True)
class Parts:
    """A split message out of the ring: its msgpack head and its raw tail, each its
    own private copy (see `Ring.pop_request`)."""

    head: bytes
    tail: bytes


_Message = TypeVar("_Message", bound=bytes | memoryview | Parts)

__all__ = [
    "DEFAULT_CAPACITY",
    "MAX_CAPACITY",
    "MIN_CAPACITY",
    "MAX_SPIN_NS",
    "MIN_SPIN_NS",
    "Parts",
    "Ring",
    "RingPair",
    "SPIN_CACHE_NAME",
    "cached_spin_ns",
    "calibrate_spin",
    "default_spin_ns",
    "parse_spin_cache",
    "SERVER_SLICE_NS",
    "ask_short_slice",
]

DEFAULT_CAPACITY = 1 << 20
MIN_CAPACITY: int = lib.RING_MIN_CAPACITY
MAX_CAPACITY: int = lib.RING_MAX_CAPACITY
# A wake-up slower than this means an overloaded host, where spinning longer
# would only take more CPU from the agents.
MAX_SPIN_NS = 200_000
MIN_SPIN_NS = 1_000
SPIN_CACHE_NAME = "spin-ns"  # in the runtime directory; see cached_spin_ns
_SPIN_CACHE_VERSION = "v1"
_SPIN_CACHE_MOST = 128  # bytes read: the file is one short line
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# The scheduler slice a server (shard, bridge) asks for: the fair scheduler's
# least, so a request that wakes it on a CPU a compiler holds is served now.
SERVER_SLICE_NS = 100_000

_alloc_uncleared = ffi.new_allocator(should_clear_after_alloc=False)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _check_capacity(capacity: int) -> int:
    region = int(lib.ring_region_size(capacity)) if 0 < capacity <= MAX_CAPACITY else 0
    if region == 0:
        raise InvalidArgument(
            f"ring capacity must be a power of two between {MIN_CAPACITY} and {MAX_CAPACITY} bytes",
            capacity=capacity,
        )
    return region


class Ring:
    """One direction of a shared-memory message ring (see the module docstring)."""

    def __init__(self, memfd: int, eventfd: int, *, spin_ns: int | None = None) -> None:
        """Map and validate an initialised ring; takes ownership of both fds.

        Use `create` or `attach` rather than calling this directly.
        """
        self._memfd = memfd
        self._eventfd = eventfd
        self._map: mmap.mmap | None = None
        self._mem: Any = None
        self._ring: Any = None
        try:
            try:
                seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise VerificationFailed("ring fd is not a memfd", fd=memfd) from exc
            if seals & _SEALS != _SEALS:
                raise VerificationFailed("ring memfd is not sealed against resizing", fd=memfd)
            size = os.fstat(memfd).st_size
            if size < lib.RING_HEADER_SIZE:
                raise VerificationFailed("ring memfd is too small for a header", size=size)
            self._map = mmap.mmap(memfd, size)
            self._mem = ffi.from_buffer(self._map)
            ring = ffi.new("ring_t *")
            rc = lib.ring_attach(ring, self._mem, size)
            if rc < 0:
                raise VerificationFailed(
                    "shared memory does not hold a valid ring header",
                    reason=os.strerror(-rc),
                )
            # Draining must never block, whatever flags the sender gave the fd.
            os.set_blocking(eventfd, False)
        except BaseException:
            self.close()
            raise
        self._ring = ring
        self.capacity: int = ring.capacity
        self.max_message: int = lib.ring_max_message(ring)
        self.spin_ns = default_spin_ns() if spin_ns is None else spin_ns
        # Uncleared, so a ring this process only produces into costs no pages.
        self._out = _alloc_uncleared("uint8_t[]", self.max_message)
        self._peeked = ffi.new("const uint8_t **")
        self._poll = select.poll()
        self._poll.register(eventfd, select.POLLIN)

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, *, spin_ns: int | None = None) -> Self:
        """A new, empty ring holding up to `capacity` bytes of framed messages."""
        region = _check_capacity(capacity)
        memfd = os.memfd_create("slates-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(memfd, region)
            with mmap.mmap(memfd, region) as mem:
                buf = ffi.from_buffer(mem)
                rc = lib.ring_init(buf, region, capacity)
                ffi.release(buf)
            if rc < 0:
                raise InvalidArgument("cannot initialise ring", reason=os.strerror(-rc))
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
            eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            os.close(memfd)
            raise
        return cls(memfd, eventfd, spin_ns=spin_ns)

    @classmethod
    def attach(cls, memfd: int, eventfd: int, *, spin_ns: int | None = None) -> Self:
        """Attach to a ring another process created; takes ownership of the fds."""
        return cls(memfd, eventfd, spin_ns=spin_ns)

    @property
    def fds(self) -> tuple[int, int]:
        """(memfd, eventfd): what a peer needs to `attach`."""
        return (self._memfd, self._eventfd)

    def positions(self) -> tuple[int, int]:
        """(produced, consumed): the byte positions up to which the producer has pushed
        and the consumer has taken frames.  The produced figure is the peer's to write:
        a waiter on it bounds its wait."""
        ring = self._live()
        return int(lib.ring_produced(ring)), int(lib.ring_consumed(ring))

    @property
    def parked(self) -> bool:
        """Whether the consumer has announced it is asleep on the eventfd."""
        return bool(lib.ring_is_parked(self._live()))

    def _live(self) -> Any:
        # C would read unmapped memory through a closed ring's handle.
        if self._ring is None:
            raise InvalidArgument("ring is closed")
        return self._ring

    def push(self, data: bytes) -> bool:
        """Queue one message and wake a parked consumer; False when full."""
        if len(data) > self.max_message:
            raise InvalidArgument(
                "message larger than the ring accepts",
                size=len(data),
                max_message=self.max_message,
            )
        ring = self._live()
        rc = lib.ring_push(ring, data, len(data))
        if rc == -errno.EAGAIN:
            return False
        if rc < 0:
            raise VerificationFailed("ring indices are corrupt", reason=os.strerror(-rc))
        rc = lib.ring_notify(ring, self._eventfd)
        if rc < 0:
            raise OSError(-rc, "cannot wake the ring's consumer")
        return True

    def pop_view(self) -> memoryview | None:
        """Take the next message without copying it, or None when the ring is empty.
        The view is this ring's own buffer: valid only until the next pop."""
        n = lib.ring_pop(self._live(), self._out, self.max_message)
        if n >= 0:
            return memoryview(ffi.buffer(self._out, n))
        if n == -errno.EAGAIN:
            return None
        raise VerificationFailed("corrupt message in ring", reason=os.strerror(-n))

    def pop_request(self) -> memoryview | Parts | None:
        """`pop_view`, except that a split message comes as its `Parts`: the head and
        the tail each copied once out of the shared area into bytes of their own, so a
        large write's data reaches the volume without another copy (msgpack's).  Every value
        is read from the shared area once, into private memory, before it is used."""
        ring = self._live()
        n = lib.ring_peek(ring, self._peeked)
        if n < 0:
            if n == -errno.EAGAIN:
                return None
            raise VerificationFailed("corrupt message in ring", reason=os.strerror(-n))
        try:
            frame = ffi.buffer(self._peeked[0], n)
            split = split_point(frame[0 : SPLIT_PREFIX.size], n)
            if split is not None:
                return Parts(frame[SPLIT_PREFIX.size : split], frame[split:n])
            # Any other message, a malformed split one too, as pop_view gives it.
            ffi.memmove(self._out, self._peeked[0], n)
            return memoryview(ffi.buffer(self._out, n))
        finally:
            lib.ring_consume(ring)

    def pop(self) -> bytes | None:
        """Take the next message, or None when the ring is empty."""
        view = self.pop_view()
        return None if view is None else bytes(view)

    async def receive(self) -> bytes:
        """Wait (trio) for the next message: spin for `spin_ns`, then park."""
        return await self._receive(self.pop)

    async def receive_request(self) -> memoryview | Parts:
        """`receive` without the copy (`pop_request`): for a consumer that decodes each
        message before it takes the next (the shard)."""
        return await self._receive(self.pop_request)

    async def _receive(self, pop: Callable[[], _Message | None]) -> _Message:
        import trio  # here, so that processes without trio (the bridge) start quickly

        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            data = pop()
            if data is not None:
                if not parked:  # a message taken at once: the other tasks' turn first
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return data
            if self._spin_then_prepare_park():
                continue
            try:
                await trio.lowlevel.wait_readable(self._eventfd)  # their turn was now
            finally:
                self._unpark()
            parked = True

    def receive_blocking(self, timeout: float | None = None) -> bytes | None:
        """Blocking `receive` for threads and non-trio processes; None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            data = self.pop()
            if data is not None:
                return data
            if self._spin_then_prepare_park():
                continue
            try:
                if deadline is None:
                    self._poll.poll()
                else:
                    self._poll.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000)))
            finally:
                self._unpark()
            if deadline is not None and time.monotonic() >= deadline:
                return self.pop()

    def _spin_then_prepare_park(self) -> bool:
        """True if a message arrived; False once parked (the caller must wait)."""
        ring = self._live()
        if self.spin_ns > 0 and lib.ring_spin_wait(ring, self.spin_ns):
            return True
        return bool(lib.ring_prepare_park(ring))

    def _unpark(self) -> None:
        if self._ring is None:
            return  # another task closed the ring while we waited
        lib.ring_unpark(self._ring)
        rc = lib.ring_drain_eventfd(self._eventfd)
        if rc < 0:
            raise OSError(-rc, "cannot read the ring's eventfd")

    def close(self) -> None:
        """Unmap the ring and close both fds (idempotent).

        Not thread-safe: no other call on this ring may be running.
        """
        self._ring = None
        if self._mem is not None:
            ffi.release(self._mem)
            self._mem = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._eventfd >= 0:
            # Outside trio (RuntimeError) no task of this thread can be waiting on it.
            trio = sys.modules.get("trio")
            if trio is not None:
                with contextlib.suppress(RuntimeError):
                    trio.lowlevel.notify_closing(self._eventfd)
        for fd in (self._memfd, self._eventfd):
            if fd >= 0:
                os.close(fd)
        self._memfd = self._eventfd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RingPair:
    """A request ring (client -> shard) and a reply ring (shard -> client)."""

    def __init__(self, requests: Ring, replies: Ring) -> None:
        self.requests = requests
        self.replies = replies

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, *, spin_ns: int | None = None) -> Self:
        requests = Ring.create(capacity, spin_ns=spin_ns)
        try:
            replies = Ring.create(capacity, spin_ns=spin_ns)
        except BaseException:
            requests.close()
            raise
        return cls(requests, replies)

    @classmethod
    def attach(cls, fds: Sequence[int], *, spin_ns: int | None = None) -> Self:
        """Attach from `fds` as returned by `RingPair.fds`; takes ownership of them."""
        if len(fds) != 4:
            raise InvalidArgument("a ring pair needs exactly four fds", count=len(fds))
        requests = Ring.attach(fds[0], fds[1], spin_ns=spin_ns)
        try:
            replies = Ring.attach(fds[2], fds[3], spin_ns=spin_ns)
        except BaseException:
            requests.close()
            raise
        return cls(requests, replies)

    @property
    def fds(self) -> tuple[int, int, int, int]:
        """(request memfd, request eventfd, reply memfd, reply eventfd)."""
        return (*self.requests.fds, *self.replies.fds)

    def close(self) -> None:
        self.requests.close()
        self.replies.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def calibrate_spin(rounds: int = 200) -> int:
    """Measure an eventfd wake-up (ns) and return it as the spin budget.

    A helper thread sleeps in a blocking eventfd read; we write it and sleep
    until it writes back.  Half the median round trip is one wake-up of a
    sleeping Python waiter, the cost a parked consumer pays.  The two threads
    are pinned to different CPUs for the measurement (the caller's affinity
    is restored), because a ring's producer and consumer are separate
    processes: a same-CPU wake-up is far cheaper than the cross-CPU one they
    pay, especially in a VM where an idle virtual CPU halts.

    Returns 0 when only one CPU is usable (a spinning consumer would only
    delay the producer it waits for); otherwise the wake-up cost clamped to
    [MIN_SPIN_NS, MAX_SPIN_NS].
    """
    if rounds < 1:
        raise InvalidArgument("calibration needs at least one round", rounds=rounds)
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return 0
    here, there = sorted(allowed)[:2]
    ping = os.eventfd(0, os.EFD_CLOEXEC)
    pong = os.eventfd(0, os.EFD_CLOEXEC)

    def echo() -> None:
        # pid 0 is this thread only.  Unpinned, the result is merely optimistic;
        # an exception here would leave the caller waiting for ever.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {there})
        for _ in range(rounds):
            os.eventfd_read(ping)
            os.eventfd_write(pong, 1)

    helper = threading.Thread(target=echo, name="slates-ring-calibrate", daemon=True)
    samples: list[int] = []
    try:
        os.sched_setaffinity(0, {here})
        helper.start()
        for _ in range(rounds):
            start = time.perf_counter_ns()
            os.eventfd_write(ping, 1)
            os.eventfd_read(pong)
            samples.append(time.perf_counter_ns() - start)
        helper.join()
    finally:
        os.sched_setaffinity(0, allowed)
        os.close(ping)
        os.close(pong)
    wake = sorted(samples)[len(samples) // 2] // 2
    return min(MAX_SPIN_NS, max(MIN_SPIN_NS, wake))


def ask_short_slice() -> str | None:
    """Ask the scheduler for SERVER_SLICE_NS slices for this thread and the threads it
    starts later (native/sched_slice.c says why): None when granted, else why not,
    for the caller to log.  Call it on the main thread before starting threads."""
    rc = int(lib.servers_short_slice(SERVER_SLICE_NS))
    return None if rc == 0 else os.strerror(-rc)


@functools.cache
def default_spin_ns() -> int:
    """This process's spin budget, calibrated on first use."""
    return calibrate_spin()


def _boot_id() -> str:
    """This boot's id (the kernel's random boot_id), "" where there is none."""
    try:
        with open(_BOOT_ID, "rb") as source:
            return source.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


def parse_spin_cache(data: bytes, boot_id: str) -> int | None:
    """The spin budget a cache file's bytes hold, clamped to [MIN_SPIN_NS, MAX_SPIN_NS];
    None when they are not one well-formed line of this boot ("v1 <boot id> <ns>")."""
    try:
        fields = data.decode("ascii").split()
    except UnicodeDecodeError:
        return None
    if len(fields) != 3 or fields[0] != _SPIN_CACHE_VERSION or fields[1] != boot_id:
        return None
    if not boot_id or not fields[2].isdigit() or len(fields[2]) > 12:
        return None
    return min(MAX_SPIN_NS, max(MIN_SPIN_NS, int(fields[2])))


def _read_spin_cache(path: str, boot_id: str) -> int | None:
    # O_NONBLOCK: a FIFO planted in the directory must not hang the reader.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return parse_spin_cache(os.read(fd, _SPIN_CACHE_MOST + 1)[:_SPIN_CACHE_MOST], boot_id)
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_spin_cache(path: str, boot_id: str, spin_ns: int) -> None:
    temp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
    except OSError:
        return  # not ours to write (an agent's bridge), or no directory: calibrate next time
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, 0o644)  # whatever the umask: agents' bridges read it too (no secret)
            out.write(f"{_SPIN_CACHE_VERSION} {boot_id} {spin_ns}\n".encode("ascii"))
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def cached_spin_ns(directory: str | os.PathLike[str]) -> int:
    """This host's spin budget, calibrated once per boot and runtime directory.

    Reads SPIN_CACHE_NAME in `directory` (a runtime directory); when it is
    missing or unusable, calibrates (`calibrate_spin`) and writes it for the
    next process.  0 on a single usable CPU, as calibrate_spin, without
    touching the file; otherwise always within [MIN_SPIN_NS, MAX_SPIN_NS].
    """
    if len(os.sched_getaffinity(0)) < 2:
        return 0
    path = os.path.join(os.fspath(directory), SPIN_CACHE_NAME)
    boot_id = _boot_id()
    remembered = _read_spin_cache(path, boot_id) if boot_id else None
    if remembered is not None:
        return remembered
    measured = min(MAX_SPIN_NS, max(MIN_SPIN_NS, calibrate_spin()))
    if boot_id:
        _write_spin_cache(path, boot_id, measured)
    return measured
