"""Anchor-owned shared memory: the journal, checkpoints and the chunk arena.

Theory of operation: the anchor creates three memfd segments per shard and
keeps them open; the shard maps them.  A SIGKILLed shard loses nothing
that these segments hold, and its replacement maps the same segments.

- Journal: append-only frames [length u32][crc32 u32][payload], each one
  commit.  A frame counts only once the header's `committed` offset covers
  it, and that offset is one aligned 8-byte store made after the frame's
  bytes are in place: a shard killed mid-append leaves the frame out, so
  the request it belonged to was never answered and its retry runs it.
- Checkpoints: slates.node.checkpoints.  A checkpoint records the journal
  generation it covers; starting a new generation empties the journal.  A
  crash between the two steps leaves a journal of an older generation,
  which replay ignores (the checkpoint covers it).
  The pages of a journal's first bytes may stay across generations (the
  shard keeps a bounded warm part: `start_generation(keep=)`); frames past
  `committed` are never read, whatever those pages still hold.
- Arena: sealed chunks (slates.node.arena), their space reused and their
  pages returned to the host when they are deleted.

A frame's CRC is each byte's CRC computed once: a part handed in as
`Checksummed` (bytes whose CRC32 the caller already computed, the page
area's while it copied a write's data into place) joins the frame's CRC by
zlib's crc32_combine (`combine_crc`, libz through ctypes) instead of being
read again.  Without libz's symbol, every part is read (crc32) as before.
The other parts' CRC is computed from the frame's bytes in the segment,
after they are copied there (`crc32`: libdeflate's PCLMUL CRC32 through
ctypes, the same numbers as zlib's at several times its speed, where the
library is installed; zlib's otherwise), so the CRC is that of the bytes
the journal holds.

Every segment has a fixed virtual size (memfds are sparse: untouched
pages cost nothing) and filling one is a visible CapacityExhausted, never
unbounded growth.  Bytes read back are checked (magic, bounds, CRC):
damage raises VerificationFailed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from slates.errors import CapacityExhausted, VerificationFailed

__all__ = [
    "FAST_CRC_BYTES",
    "PAGE",
    "Checksummed",
    "Segment",
    "Journal",
    "combine_crc",
    "crc32",
    "create_segment",
]

PAGE = _PAGE = mmap.PAGESIZE
# Data at least this large has its CRC computed by libdeflate (below that, zlib's is
# quicker than the ctypes call).
FAST_CRC_BYTES = 4 << 10
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@functools.cache
def _crc32_combine() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("z")
    try:
        function = ctypes.CDLL(name or "libz.so.1").crc32_combine
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
    function.restype = ctypes.c_ulong
    combine: Callable[[int, int, int], int] = function
    return combine


@functools.cache
def _deflate_crc32() -> Callable[[int, Any, int], int] | None:
    for name in ("libdeflate.so.0", ctypes.util.find_library("deflate")):
        if not name:
            continue
        try:
            function = ctypes.CDLL(name).libdeflate_crc32
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        function.restype = ctypes.c_uint32
        crc: Callable[[int, Any, int], int] = function
        return crc
    return None


def crc32(data: bytes | bytearray | memoryview | mmap.mmap, value: int = 0) -> int:
    """zlib.crc32(data, value), the same numbers: libdeflate's (PCLMUL, several times
    zlib's speed; ctypes releases the GIL) for data of FAST_CRC_BYTES or more that is
    bytes or a writable buffer (an mmap's view), where the library is there; else zlib's."""
    function = _deflate_crc32() if len(data) >= FAST_CRC_BYTES else None
    if function is None:
        return zlib.crc32(data, value)
    if type(data) is bytes:
        return function(value, data, len(data))
    view = memoryview(data)
    if view.readonly or not view.c_contiguous:
        return zlib.crc32(data, value)
    array = (ctypes.c_char * view.nbytes).from_buffer(view)
    try:
        return function(value, array, view.nbytes)
    finally:
        del array  # the buffer export ends now: the mapping may be closed later
        view.release()


def combine_crc(first: int, second: int, second_length: int) -> int | None:
    """The CRC32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine,
    a pure C function); None where libz does not have it."""
    function = _crc32_combine()
    return None if function is None else function(first, second, second_length) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True, slots=True)
class Checksummed:
    """A frame part whose CRC32 the caller computed already (from the same bytes)."""

    data: bytes | memoryview
    crc: int


def create_segment(name: str, size: int) -> int:
    """A new sparse memfd of `size` bytes (the anchor calls this)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


class Segment:
    """A shared mapping of a whole memfd.

    `resident_changes` moves whenever the pages the memfd holds may have changed: pages
    given back (`release`), faulted in (`populate`), or written for the first time (the
    writer says so: `touched`).  While it stands still, the memfd's allocated bytes are
    what they were when last read (the shard reads them, an fstat, only after it moves).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.resident_changes = 0

    def touched(self) -> None:
        """Pages that may not have been resident were written (or faulted in)."""
        self.resident_changes += 1

    def release(self, start: int, end: int) -> None:
        """Give the pages of [start, end) back to the kernel (they read as zeros)."""
        start = -(-start // _PAGE) * _PAGE
        end = end // _PAGE * _PAGE
        if end > start:
            self.map.madvise(mmap.MADV_REMOVE, start, end - start)
            self.resident_changes += 1

    def populate(self, start: int, end: int) -> None:
        """Fault the pages of [start, end) in for writing, in one call (MADV_POPULATE_WRITE,
        Linux 5.14): cheaper than the page faults of a copy into them.  Where the kernel
        lacks it, the copy faults them in as before."""
        start = start // _PAGE * _PAGE
        if end > start:
            self.resident_changes += 1
            with contextlib.suppress(OSError):
                self.map.madvise(_MADV_POPULATE_WRITE, start, end - start)

    def close(self) -> None:
        self.map.close()


_JOURNAL_HEADER = struct.Struct("<8sIIQQ")  # magic, version, pad, generation, committed
_JOURNAL_MAGIC = b"SLJRNL01"
_FRAME = struct.Struct("<II")
_JOURNAL_START = _PAGE


class Journal:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        magic, version, _pad, _generation, committed = _JOURNAL_HEADER.unpack_from(segment.map, 0)
        if magic == bytes(8):
            self._write_header(0, 0)
        elif magic != _JOURNAL_MAGIC or version != 1:
            raise VerificationFailed("the journal segment is not a Slates journal")
        elif not 0 <= committed <= segment.size - _JOURNAL_START:
            raise VerificationFailed("the journal's committed offset is out of bounds")
        # The header's two numbers as this, their only writer, last stored them: read on
        # every request (room, committed), kept here instead of unpacked from the map.
        self._generation: int = _JOURNAL_HEADER.unpack_from(segment.map, 0)[3]
        self._committed: int = _JOURNAL_HEADER.unpack_from(segment.map, 0)[4]
        # Every page below this offset is resident (frames are written from the start
        # on, and only pages past what a generation keeps go back): a frame that ends
        # past it touches pages that may be fresh (Segment.touched).
        self._resident_end = 0

    def _write_header(self, generation: int, committed: int) -> None:
        _JOURNAL_HEADER.pack_into(self.segment.map, 0, _JOURNAL_MAGIC, 1, 0, generation, committed)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def committed(self) -> int:
        return self._committed

    @property
    def room(self) -> int:
        return self.segment.size - _JOURNAL_START - self.committed

    def append(self, payload: bytes | Sequence[bytes | memoryview | Checksummed]) -> None:
        """Commit one frame: `payload`, or the join of its parts (each copied once; a
        Checksummed part's CRC taken as given, not computed again).  The CRC of the other
        parts is computed from the frame's own bytes once they are in place, a run of
        parts between two Checksummed ones at a time."""
        if type(payload) is bytes:  # the usual frame, one packed message: no parts to walk
            self._append_bytes(payload)
            return
        parts = [payload] if isinstance(payload, bytes) else payload
        length = sum(len(p.data if isinstance(p, Checksummed) else p) for p in parts)
        at = self._frame_at(length)
        mm = self.segment.map
        crc = 0
        cursor = run = at + _FRAME.size  # `run`: where the bytes not yet checksummed start
        for part in parts:
            data = part.data if isinstance(part, Checksummed) else part
            mm[cursor : cursor + len(data)] = data
            if isinstance(part, Checksummed):
                head = crc32(memoryview(mm)[run:cursor], crc) if cursor > run else crc
                joined = combine_crc(head, part.crc, len(data))
                if joined is not None:  # None without libz: the part is read with the run
                    crc, run = joined, cursor + len(data)
            cursor += len(data)
        if cursor > run:
            crc = crc32(memoryview(mm)[run:cursor], crc)
        self._seal_frame(at, length, crc, cursor)

    def _append_bytes(self, payload: bytes) -> None:
        """`append` of one bytes payload: copied into place, its CRC computed from the
        frame's own bytes there, exactly as the general path does for a lone part."""
        length = len(payload)
        at = self._frame_at(length)
        mm = self.segment.map
        start = at + _FRAME.size
        cursor = start + length
        mm[start:cursor] = payload
        crc = crc32(memoryview(mm)[start:cursor]) if length else 0
        self._seal_frame(at, length, crc, cursor)

    def _frame_at(self, length: int) -> int:
        """Where the next frame of `length` payload bytes starts, if it fits."""
        need = _FRAME.size + length
        if need > self.room:
            raise CapacityExhausted("the journal segment is full", needed=need, room=self.room)
        return _JOURNAL_START + self._committed

    def _seal_frame(self, at: int, length: int, crc: int, cursor: int) -> None:
        """Write a frame's header, then commit it: the frame's bytes end at `cursor`."""
        mm = self.segment.map
        _FRAME.pack_into(mm, at, length, crc)
        if cursor > self._resident_end:
            self._resident_end = -(-cursor // _PAGE) * _PAGE
            self.segment.touched()
        # The commit point: one aligned 8-byte store.
        committed = self._committed + _FRAME.size + length
        struct.pack_into("<Q", mm, 24, committed)
        self._committed = committed

    def entries(self) -> Iterator[bytes]:
        mm = self.segment.map
        end = _JOURNAL_START + self.committed
        at = _JOURNAL_START
        while at < end:
            length, crc = _FRAME.unpack_from(mm, at)
            start = at + _FRAME.size
            if start + length > end:
                raise VerificationFailed("a journal frame runs past the committed end", at=at)
            payload = bytes(mm[start : start + length])
            if crc32(payload) != crc:
                raise VerificationFailed("a journal frame fails its checksum", at=at)
            yield payload
            at = start + length

    def start_generation(self, generation: int, keep: int = 0) -> None:
        """Empty the journal into a new generation.  The pages of its first `keep` bytes
        stay (the next frames are copied into them without faulting fresh pages in:
        measured, that fault costs more than the copy); the rest go back."""
        used = self.committed
        # Two aligned 8-byte stores, emptying first: a crash between them leaves
        # an empty journal of the old generation, which recovery also accepts.
        struct.pack_into("<Q", self.segment.map, 24, 0)
        self._committed = 0
        struct.pack_into("<Q", self.segment.map, 16, generation)
        self._generation = generation
        kept = _JOURNAL_START + min(keep, used)
        self.segment.release(kept, _JOURNAL_START + used)
        self._resident_end = min(self._resident_end, -(-kept // _PAGE) * _PAGE)
