"""The host: content-addressed chunk store and the memory budget all volumes share.

Theory of operation: one Host object stands for one machine's Slates RAM.
It owns the sealed chunks (named by BLAKE3, stored once however many
volumes and snapshots refer to them) and the accounting that decides
whether an operation may grow memory use.

Capacity rules (product description, "Memory Limits and Shared Content"):
- `physical_bytes` is what the host really holds: chunk bytes (deduplicated),
  private page bytes and metadata of every volume.
- A bounded volume reserves its whole quota when it is created; the host
  refuses to create it if the quota does not fit beside other reservations.
  Inside its quota it may always grow, up to the host's hard capacity.
- A dynamic volume grows while the host has room outside every bounded
  volume's unused reservation and outside the host reserve.
- The reserve (a slice of capacity no new dynamic growth may take) keeps
  room so work already admitted can finish or be cancelled.
- Shrinking never needs capacity.
Refusals raise CapacityExhausted before any effect is published; callers
ask `admit` first and `charge` after.

One pool for the host: a daemon host runs one Host per shard process, and
`capacity` is the whole machine's, shared.  The Host is then given a pool
(an injected object, like `chunks`, that follows the `Pool` protocol: in a
daemon, slates.node.pool's shared-memory slots).  Admission counts what the
other shards claim (`pool.others()`), and every change to this Host's own
claim is published (`pool.publish(claimed_bytes)`) before the next
admission.  A shard's claim is what it holds (`held_bytes`: physical bytes
plus `overhead_bytes`, what the shard's journal and checkpoints hold, set
by the shard) plus its bounded volumes' unused reservations.  Shards
admitting at once can each overshoot by one request (slates.node.pool
bounds it); the reserve absorbs that for dynamic growth.  A recovering
shard joins the pool (`attach_pool`) only once it has rebuilt its state.

Page memory: where volumes keep their private page buffers is injected
too (`pages`, following `PageMemory`): the heap by default (`HeapPages`:
each buffer a bytearray), a shard's checkpoint segment in a daemon
(slates.node.page_area), so a written byte is copied once into shared
memory and a checkpoint need not copy it again.  A volume asks
`pages.ensure(nbytes)` for the fresh space a record will take before any
of its effects (a full page area is CapacityExhausted for that record),
then makes, changes and frees buffers through it.  The byte counts stay
here: a buffer's bytes are private bytes wherever they live.

Garbage: chunks are shared through persistent structures, so the host does
not count references; `collect` keeps every chunk reachable from the roots
it is given and frees the rest (called when a volume or snapshot is
dropped).  Pure data and arithmetic: no I/O, clock or randomness.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import Protocol, SupportsIndex, overload

import blake3

from slates.errors import CapacityExhausted, InvalidArgument, MissingContent

__all__ = [
    "Host",
    "Account",
    "Pool",
    "PageBuffer",
    "PageMemory",
    "HeapBuffer",
    "HeapPages",
    "chunk_id_of",
    "UNLIMITED",
]

UNLIMITED = 1 << 62


def chunk_id_of(data: bytes | bytearray) -> bytes:
    return blake3.blake3(data).digest()


class Account(Protocol):
    """What the host needs to know of a volume to decide admissions."""

    bounded: bool
    limit: int

    @property
    def charged_bytes(self) -> int: ...


class Pool(Protocol):
    """The host-wide capacity pool other shards publish into (slates.node.pool.HostPool)."""

    def others(self) -> int:
        """Bytes every other shard claims now."""
        ...

    def publish(self, used: int) -> None:
        """Make this shard's claim visible to the others."""
        ...


Bytes = bytes | bytearray | memoryview


class PageBuffer(Protocol):
    """One private page buffer: read by slices, changed only through these methods."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> bytes | bytearray:
        """A copy of the bytes in `index` (a plain slice)."""
        ...

    def write(self, offset: int, data: Bytes) -> None:
        """Overwrite [offset, offset + len(data)), which lies inside the buffer."""
        ...

    def extend(self, data: Bytes, /) -> None:
        """Append `data`."""
        ...

    def shrink(self, length: int) -> None:
        """Drop every byte from `length` on."""
        ...

    def rewrite_cost(self, lo: int, hi: int) -> int:
        """Fresh bytes of page memory `write` into [lo, hi) would take (copy-on-write)."""
        ...


class PageMemory(Protocol):
    """Where a host's volumes keep their page buffers."""

    def new(self, pieces: Sequence[Bytes]) -> PageBuffer:
        """A buffer holding the join of `pieces` (its space was `ensure`d)."""
        ...

    def free(self, buffer: PageBuffer) -> None:
        """`buffer` is dead: its space may go back (it is never used again)."""
        ...

    def ensure(self, nbytes: int) -> None:
        """CapacityExhausted unless `nbytes` of fresh buffer space can be taken now."""
        ...


class HeapBuffer(bytearray):
    """A page buffer on the heap: a bytearray with PageBuffer's methods."""

    @overload
    def __getitem__(self, index: SupportsIndex, /) -> int: ...

    @overload
    def __getitem__(self, index: slice, /) -> bytearray: ...

    def __getitem__(self, index: SupportsIndex | slice, /) -> int | bytearray:
        return bytearray.__getitem__(self, index)

    def write(self, offset: int, data: Bytes) -> None:
        self[offset : offset + len(data)] = data

    def shrink(self, length: int) -> None:
        del self[length:]

    def rewrite_cost(self, lo: int, hi: int) -> int:
        return 0  # changed in place, always


class HeapPages:
    """PageMemory on the heap (in-process hosts and tests): the host's admission is
    its only bound, and a dead buffer goes with its last reference."""

    def new(self, pieces: Sequence[Bytes]) -> HeapBuffer:
        return HeapBuffer(pieces[0]) if len(pieces) == 1 else HeapBuffer(b"".join(pieces))

    def free(self, buffer: PageBuffer) -> None:
        if not isinstance(buffer, HeapBuffer):
            raise InvalidArgument("freeing a page buffer the heap did not make")

    def ensure(self, nbytes: int) -> None:
        if nbytes < 0:
            raise InvalidArgument("a negative page memory request", nbytes=nbytes)


class Host:
    def __init__(
        self,
        capacity: int = UNLIMITED,
        reserve: int | None = None,
        chunks: MutableMapping[bytes, bytes] | None = None,
        pool: Pool | None = None,
        pages: PageMemory | None = None,
    ) -> None:
        if capacity <= 0:
            raise InvalidArgument("host capacity must be positive", capacity=capacity)
        if reserve is None:
            reserve = min(capacity // 16, 64 << 20)
        if not 0 <= reserve < capacity:
            raise InvalidArgument("host reserve must lie in [0, capacity)", reserve=reserve)
        self.capacity = capacity
        self.reserve = reserve
        # The chunk storage is injected: a dict here, a shared-memory arena in a
        # daemon shard (so sealed content survives the shard's restart).
        self._chunks: MutableMapping[bytes, bytes] = {} if chunks is None else chunks
        self.pages: PageMemory = HeapPages() if pages is None else pages
        self.chunk_bytes = sum(len(self._chunks[cid]) for cid in self._chunks)
        self.private_bytes = 0  # page buffers, metadata and in-flight buffers of all volumes
        self.snapshot_metadata_bytes = 0  # metadata volumes handed to their snapshots
        self.overhead_bytes = 0  # what the shard holds outside these counters (journal, ...)
        self._accounts: list[Account] = []
        self._bounded: list[Account] = []  # walked on every publish: only the bounded ones
        self._pool = pool
        self._published = -1
        self._publish()

    # -- chunks -------------------------------------------------------------

    def put_chunk(self, data: bytes | bytearray) -> tuple[bytes, bool]:
        """Store `data` under its BLAKE3 id; returns (id, newly stored)."""
        chunk_id = chunk_id_of(data)
        if chunk_id in self._chunks:
            return chunk_id, False
        self._chunks[chunk_id] = bytes(data)
        self.chunk_bytes += len(data)
        self._publish()
        return chunk_id, True

    def get_chunk(self, chunk_id: bytes) -> bytes:
        try:
            return self._chunks[chunk_id]
        except KeyError:
            raise MissingContent("chunk is not stored", chunk=chunk_id.hex()) from None

    def has_chunk(self, chunk_id: bytes) -> bool:
        return chunk_id in self._chunks

    @property
    def chunk_count(self) -> int:
        return len(self._chunks)

    def collect(self, live_chunk_sets: Iterable[Iterable[bytes]]) -> int:
        """Free every chunk not named by any of the live sets; returns bytes freed."""
        live: set[bytes] = set()
        for chunk_ids in live_chunk_sets:
            live.update(chunk_ids)
        dead = [cid for cid in list(self._chunks) if cid not in live]
        freed = 0
        for cid in dead:
            freed += len(self._chunks.pop(cid))
        self.chunk_bytes -= freed
        self._publish()
        return freed

    # -- capacity -----------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        return self.chunk_bytes + self.private_bytes + self.snapshot_metadata_bytes

    @property
    def held_bytes(self) -> int:
        """What this Host's process holds for it: counted bytes plus the shard's overhead."""
        return self.physical_bytes + self.overhead_bytes

    @property
    def claimed_bytes(self) -> int:
        """This Host's claim on the pool: what it holds and what it has promised."""
        return self.held_bytes + self._unused_reservations()

    def set_overhead(self, nbytes: int) -> None:
        """The shard's bytes outside the counters (journal, checkpoints): counted in
        admission and published, so the pool sees what the process really holds."""
        if nbytes < 0:
            raise InvalidArgument("overhead bytes cannot be negative", overhead=nbytes)
        self.overhead_bytes = nbytes
        self._publish()

    def _publish(self) -> None:
        if self._pool is None:
            return
        claimed = self.claimed_bytes
        if claimed != self._published:  # one store per change, none for a no-op
            self._pool.publish(claimed)
            self._published = claimed

    def attach_pool(self, pool: Pool) -> None:
        """Join the host's pool now (a shard does so once it has recovered: until then
        its slot keeps its predecessor's figure, which the segments still hold)."""
        if self._pool is not None:
            raise InvalidArgument("this host already belongs to a pool")
        self._pool = pool
        self._publish()

    def _others(self) -> int:
        return 0 if self._pool is None else self._pool.others()

    def hand_over_metadata(self, nbytes: int) -> None:
        """A snapshot now holds inodes a volume created: keep counting their metadata.

        It stays counted until the next collection recounts what snapshots still
        hold (`recount_snapshot_metadata`): between collections an over-count,
        never an under-count, of what the host holds.
        """
        self.charge(-nbytes)
        self.snapshot_metadata_bytes += nbytes
        self._publish()

    def recount_snapshot_metadata(self, nbytes: int) -> None:
        """Set the metadata snapshots hold to a collection's count of it (the inodes
        no live volume counts as its own, `slates.core.volume.held`): deleted
        snapshots' inodes then leave the counters."""
        if nbytes < 0:
            raise InvalidArgument("snapshot metadata cannot be negative", metadata=nbytes)
        self.snapshot_metadata_bytes = nbytes
        self._publish()

    def _unused_reservations(self, excluding: Account | None = None) -> int:
        return sum(max(0, a.limit - a.charged_bytes) for a in self._bounded if a is not excluding)

    def open_account(self, account: Account) -> None:
        """Register a volume; a bounded one must fit its whole quota now."""
        if account.bounded:
            room = self.capacity - self.reserve - self.claimed_bytes - self._others()
            if account.limit > room:
                raise CapacityExhausted(
                    "the host cannot reserve the requested quota",
                    requested=account.limit,
                    available=max(0, room),
                )
        self._accounts.append(account)
        if account.bounded:
            self._bounded.append(account)
        self._publish()

    def close_account(self, account: Account) -> None:
        self._accounts = [a for a in self._accounts if a is not account]
        self._bounded = [a for a in self._bounded if a is not account]
        self._publish()

    def admit(self, account: Account, nbytes: int) -> None:
        """Raise CapacityExhausted unless `account` may grow by `nbytes` now."""
        if nbytes <= 0:
            return
        if account.charged_bytes + nbytes > account.limit:
            raise CapacityExhausted(
                "the volume's quota is exhausted",
                requested=nbytes,
                charged=account.charged_bytes,
                limit=account.limit,
            )
        # Other shards' claims include their unused reservations: a bounded volume
        # growing inside its own quota still fits, since its reservation is in
        # this Host's claim and the claims were admitted below the capacity.
        others = self._others()
        if account.bounded:
            ceiling = self.capacity
            used = self.held_bytes + others
        else:
            ceiling = self.capacity - self.reserve
            used = self.claimed_bytes + others
        if used + nbytes > ceiling:
            raise CapacityExhausted(
                "the host has no room for this operation",
                requested=nbytes,
                physical=self.physical_bytes,
                others=others,
                capacity=self.capacity,
            )

    def charge(self, nbytes: int) -> None:
        """Record private bytes allocated (positive) or released (negative)."""
        self.private_bytes += nbytes
        if self.private_bytes < 0:
            raise RuntimeError("host private byte count went negative")
        self._publish()
