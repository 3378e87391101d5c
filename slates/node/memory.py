"""What the host really holds, read from the kernel; and the segments' default sizes.

Theory of operation: counters are honest when they come from what the
kernel says a process and its segments hold, not from what the code meant
to allocate.  Three readers, the heap's two knobs and one rule live here:

- `segment_bytes(fd)`: the pages a memfd holds now (fstat st_blocks * 512).
  A memfd is sparse: its size is virtual, untouched or punched pages
  (MADV_REMOVE) cost nothing, so this is the segment's physical memory.
- `process_memory(pid)`: resident memory of a process from
  /proc/PID/smaps_rollup (rss, anon, shmem; shmem is the part of rss that
  maps shared memory, such as these segments), or /proc/PID/status
  (VmRSS, RssAnon, RssShmem) where smaps_rollup is missing.
- `shard_memory(journal_fd, checkpoint_fd, arena_fd)`: one shard's figures,
  for its status: the three segments' allocated bytes and its heap (this
  process's anonymous resident memory: the Python objects and indexes
  that are not in a segment; a shard's private page buffers are in its
  checkpoint segment, slates.node.page_area).  Shared pages are counted
  once, by the segment, never again in a process's rss.  Freed space a
  shard keeps resident for reuse (the page area's warm space, the
  journal's pages past its frames, each bounded) is allocated, so it is in
  these figures; the shard's status also names it ("warm", a part of the
  journal's and checkpoints' figures, not added to the total twice).
- `trim_heap()`: give the heap's free pages back to the kernel (glibc's
  malloc_trim(0)).  Once freed, malloc keeps pages for reuse (request
  buffers, metadata of deleted volumes) and the process's anonymous RSS
  stays high (measured by bench/soak_bench.py --probe-trim: a shard's heap
  of 130 MiB after the agents' volumes were deleted came down to 63 MiB).
  The shard calls it after requests that freed much, and before it reports
  its memory.
- `keep_heap()`: between those trims, glibc by default gives the heap's
  top back as soon as a little of it is free (its trim threshold adapts to
  about twice the largest freed buffer: 2 MiB for 1 MiB writes), so every
  1 MiB request's buffers (the decoded data, its encoded record) fault
  fresh zeroed pages in again (measured: 22,000 faults, 88 MiB, per 64 MiB
  file written).  The shard fixes the thresholds at start: buffers up to
  HEAP_MMAP_BYTES come from the heap, and up to HEAP_KEEP_BYTES of its free
  top stay resident for the next request, until the next trim_heap.  They
  are anonymous resident memory, so the heap figure counts them.  For the
  same reason the shard trims only once more than HEAP_KEEP_BYTES of the
  heap is free (`heap_free_bytes`): a trim after every deleted file gave
  back the request buffers' free space, which the next file's requests
  faulted in again (a 64 MiB file written and removed, over and over:
  16,000 heap faults a round).
- `default_segment_sizes(capacity, shards, ram_bytes)`: the virtual sizes
  the anchor gives each shard's segments.  The rule:
    * the pool the host may fill is C = min(capacity, RAM);
    * all shards' segments together reserve at most RAM: each shard has a
      budget of RAM // shards;
    * the journal gets JOURNAL_BYTES (room for a checkpoint trigger's worth
      of frames and one largest request after it), or a quarter of the
      budget if that is smaller;
    * the rest is split one third arena, two thirds checkpoint (its page
      area is twice the arena: it holds the shard's private page buffers,
      and a piece the published checkpoint names is copied on write, the
      old copy freed by the next checkpoint, slates.node.page_area); each
      is capped by what the
      pool can hold: the arena at C, a slot (half the page area) at C.
      One shard may thus hold the whole pool when the budget allows
      (C <= (RAM // shards - journal) / 3), and otherwise a third of its
      budget; filling a segment is CapacityExhausted.
  Every size is a multiple of the page size.

Callers: the anchor (default sizes; pool creation), the shard (status),
bench/soak_bench.py (the same readers, from outside).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import mmap
import os
from collections.abc import Callable

from slates.errors import InvalidArgument, NotFound

__all__ = [
    "JOURNAL_BYTES",
    "SegmentSizes",
    "HEAP_KEEP_BYTES",
    "HEAP_MMAP_BYTES",
    "default_segment_sizes",
    "heap_free_bytes",
    "keep_heap",
    "process_memory",
    "ram_bytes",
    "segment_bytes",
    "shard_memory",
    "trim_heap",
]

PAGE = mmap.PAGESIZE
# A checkpoint is taken once the journal passes 64 MiB (slates.node.shard), between
# requests, and one request's frame is at most 64 MiB (protocol.MAX_FRAME) plus its
# envelope: 192 MiB holds both with room.
JOURNAL_BYTES = 192 << 20
_SMAPS_KEYS = {"Rss": "rss", "Anonymous": "anon", "Shmem": "shmem"}
_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentSizes:
    """Virtual sizes of one shard's three segments, in bytes."""

    journal: int
    checkpoint: int
    arena: int

    @property
    def total(self) -> int:
        return self.journal + self.checkpoint + self.arena


def _pages_down(nbytes: int) -> int:
    return nbytes // PAGE * PAGE


def default_segment_sizes(capacity: int, shards: int, ram_bytes: int) -> SegmentSizes:
    """Each shard's segment sizes: together under `ram_bytes` (the rule is in the docstring)."""
    if capacity <= 0 or shards < 1 or ram_bytes <= 0:
        raise InvalidArgument(
            "segment sizes need a positive capacity, RAM and shard count",
            capacity=capacity,
            shards=shards,
            ram=ram_bytes,
        )
    pool = min(capacity, ram_bytes)
    budget = _pages_down(ram_bytes // shards)
    journal = _pages_down(min(JOURNAL_BYTES, budget // 4))
    third = _pages_down((budget - journal - 2 * PAGE) // 3)  # two header pages
    if journal < 2 * PAGE or third < 2 * PAGE:
        raise InvalidArgument(
            "too little RAM per shard for its segments", ram=ram_bytes, shards=shards
        )
    slot = min(_pages_down(pool) or PAGE, third)
    # The checkpoint segment's first page is its header; then a page area of two slots.
    return SegmentSizes(journal=journal, checkpoint=PAGE + 2 * slot, arena=PAGE + slot)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc: nothing to trim with
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    trim: Callable[[int], int] = function
    return trim


# glibc mallopt parameters (malloc.h) and the shard's values for them (keep_heap).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_KEEP_BYTES = 64 << 20  # free heap top kept resident between trims, at most
HEAP_MMAP_BYTES = 8 << 20  # larger buffers are mapped apart (and unmapped when freed)


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    try:
        function = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    mallopt: Callable[[int, int], int] = function
    return mallopt


def keep_heap() -> bool:
    """Fix malloc's thresholds (see the module docstring); whether it took (False off glibc)."""
    function = _mallopt()
    if function is None:
        return False
    return bool(function(_M_MMAP_THRESHOLD, HEAP_MMAP_BYTES)) and bool(
        function(_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)
    )


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2  # glibc 2.33
    except AttributeError:
        return None
    function.argtypes = []
    function.restype = _Mallinfo2
    mallinfo2: Callable[[], _Mallinfo2] = function
    return mallinfo2


def heap_free_bytes() -> int | None:
    """Bytes malloc holds free for reuse in the main arena (mallinfo2's fordblks; it
    walks the free lists, so not for every request), or None off glibc."""
    function = _mallinfo2()
    return None if function is None else int(function().fordblks)


def trim_heap() -> bool:
    """Return the heap's free pages to the kernel; whether any went back (False off glibc)."""
    function = _malloc_trim()
    return function is not None and bool(function(0))


def ram_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def segment_bytes(fd: int) -> int:
    """The bytes a memfd holds in memory now (allocated pages, not its virtual size)."""
    return os.fstat(fd).st_blocks * 512


def _read_kib(path: str, keys: dict[str, str]) -> dict[str, int]:
    found: dict[str, int] = {}
    with open(path, encoding="ascii", errors="replace") as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            key = keys.get(name)
            if key is not None:
                fields = rest.split()
                if fields and fields[0].isdigit():
                    found[key] = int(fields[0]) * 1024  # the kernel writes kB (KiB)
    return found


def process_memory(pid: int) -> dict[str, int]:
    """Resident memory of `pid`: {"rss", "anon", "shmem"} in bytes (NotFound if it is gone)."""
    try:
        try:
            found = _read_kib(f"/proc/{pid}/smaps_rollup", _SMAPS_KEYS)
        except FileNotFoundError:
            found = {}
        if len(found) < len(_SMAPS_KEYS):
            found = _read_kib(f"/proc/{pid}/status", _STATUS_KEYS)
    except (FileNotFoundError, ProcessLookupError):
        raise NotFound("no such process", pid=pid) from None
    if len(found) < len(_STATUS_KEYS):  # a zombie, or a kernel thread: nothing resident
        return {"rss": 0, "anon": 0, "shmem": 0}
    return found


def shard_memory(journal_fd: int, checkpoint_fd: int, arena_fd: int) -> dict[str, int]:
    """This shard's memory: its segments' allocated bytes and its own heap, and their sum."""
    figures = {
        "arena": segment_bytes(arena_fd),
        "journal": segment_bytes(journal_fd),
        "checkpoints": segment_bytes(checkpoint_fd),
        "heap": process_memory(os.getpid())["anon"],
    }
    figures["total"] = sum(figures.values())
    return figures
