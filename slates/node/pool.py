"""The host's one capacity pool, shared by every shard process through a small memfd.

Theory of operation: `--capacity` is what the whole host may hold, not a
per-shard share.  The anchor creates the pool (`HostPool.create`): one page
of shared memory holding a header (magic, capacity, shard count) and one
aligned 8-byte slot per shard.  It passes the fd to each shard, which
attaches to its own slot (`HostPool.attach(fd, index)`).

- Single writer per slot: shard i alone stores into slot i (`publish`), one
  aligned 8-byte store of the bytes it claims from the pool (what it holds
  plus what its bounded volumes have reserved and not yet used).  Readers
  (`others`, `slots`, `claimed`) load each slot with one aligned 8-byte load,
  so they never see a torn value, only an older or a newer one.
- A replacement shard attaches to the same slot; until it has recovered and
  published, the slot keeps its predecessor's figure, which is the right
  one: the predecessor's content is still in the anchor's segments.
- The anchor only reads (status); a shard slot whose shard is gone for good
  keeps its last figure, an over-count (never an under-count) of the host.

The race, and its bound: admission reads the others' slots, then charges
and publishes.  Two shards admitting at the same moment each see the
other's figure from before its request, so together they may overshoot
the pool by at most one request each: with N shards and requests of at
most R bytes, by at most (N - 1) * R.  Each shard is one thread that
publishes after every charge and before its next admission, so no shard
can have two unpublished requests.  `overshoot_bound` gives that figure;
the host's reserve (a slice no dynamic growth may take) is sized by the
caller to cover it, so the hard capacity holds for dynamic volumes.

Who calls it: the anchor (`create`, status reads), each shard's Host
(through the `Pool` protocol of slates.core.host: `publish`, `others`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

from slates.errors import InvalidArgument, VerificationFailed

__all__ = ["HostPool", "MAX_SHARDS", "overshoot_bound"]

_MAGIC = b"SLPOOL01"
_HEADER = struct.Struct("<8sQQ")  # magic, capacity, shards
_SLOTS_AT = 32  # 8-byte aligned, after the header
_SIZE = mmap.PAGESIZE
MAX_SHARDS = (_SIZE - _SLOTS_AT) // 8


def overshoot_bound(shards: int, largest_request: int) -> int:
    """How far concurrent admissions on `shards` shards can exceed the pool, at most."""
    if shards < 1 or largest_request < 0:
        raise InvalidArgument("the bound needs shards >= 1 and a request size >= 0")
    return (shards - 1) * largest_request


class HostPool:
    """One process's view of the pool: its own slot (or none, for the anchor) and the others'."""

    def __init__(self, fd: int, index: int | None) -> None:
        size = os.fstat(fd).st_size
        if size < _SIZE:
            raise VerificationFailed("the pool segment is too small", size=size)
        self._map = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, capacity, shards = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC or not 1 <= shards <= MAX_SHARDS or capacity <= 0:
            self._map.close()
            raise VerificationFailed("the segment is not a Slates capacity pool")
        if index is not None and not 0 <= index < shards:
            self._map.close()
            raise InvalidArgument("no such shard slot in the pool", index=index, shards=shards)
        self.capacity: int = capacity
        self.shards: int = shards
        self.index = index
        # A ctypes array over the mapping: each element access is one aligned
        # 8-byte load or store (struct's memcpy does not promise that).
        self._slots = (ctypes.c_uint64 * shards).from_buffer(self._map, _SLOTS_AT)

    @classmethod
    def create(cls, capacity: int, shards: int) -> tuple[HostPool, int]:
        """A new pool (the anchor's, reading only) and its fd to hand to each shard."""
        if capacity <= 0:
            raise InvalidArgument("the pool's capacity must be positive", capacity=capacity)
        if not 1 <= shards <= MAX_SHARDS:
            raise InvalidArgument("a pool holds 1 to MAX_SHARDS shards", shards=shards)
        fd = os.memfd_create("slates-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _SIZE)
            with mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_WRITE) as setup:
                _HEADER.pack_into(setup, 0, _MAGIC, capacity, shards)
            return cls(fd, None), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, index: int) -> HostPool:
        """Shard `index`'s view: it publishes into its own slot only."""
        return cls(fd, index)

    def publish(self, used: int) -> None:
        """Store this shard's claim on the pool (bytes held plus unused reservations)."""
        if self.index is None:
            raise InvalidArgument("the anchor's view of the pool has no slot to publish into")
        if used < 0:
            raise InvalidArgument("a shard cannot claim a negative amount", used=used)
        self._slots[self.index] = used

    def others(self) -> int:
        """What every other shard claims (all of them, for the anchor's view)."""
        return sum(value for at, value in enumerate(self._slots) if at != self.index)

    def slots(self) -> tuple[int, ...]:
        """Each shard's published claim, by index."""
        return tuple(self._slots)

    def claimed(self) -> int:
        """The whole host's claim on the pool."""
        return sum(self._slots)

    def close(self) -> None:
        del self._slots  # the array holds an export of the mapping
        self._map.close()
