"""Checkpoints: a shard's published state in anchor-owned shared memory.

Theory of operation: two slots in one memfd segment (slates.node.journal's
Segment); a checkpoint is written into the inactive slot and published by
one aligned 4-byte store of the active-slot index, so a shard killed while
writing one leaves the previous checkpoint published.  Each slot records
the journal generation its checkpoint covers, its length and its CRC;
bytes read back are checked, and damage raises VerificationFailed.  The
shard (slates.node.shard) writes and reads them; ShardState makes and
loads the blob.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from slates.errors import CapacityExhausted, VerificationFailed
from slates.node.journal import PAGE as _PAGE
from slates.node.journal import Segment

__all__ = ["Checkpoints"]


_CHECKPOINT_HEADER = struct.Struct("<8sII")  # magic, version, active slot (0, 1, or 2 = none)
_SLOT = struct.Struct("<QQI")  # generation, length, crc32
_CHECKPOINT_MAGIC = b"SLCKPT01"
_NO_SLOT = 2


class Checkpoints:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.slot_size = (segment.size - _PAGE) // 2 // _PAGE * _PAGE
        magic, version, active = _CHECKPOINT_HEADER.unpack_from(segment.map, 0)
        if magic == bytes(8):
            _CHECKPOINT_HEADER.pack_into(segment.map, 0, _CHECKPOINT_MAGIC, 1, _NO_SLOT)
        elif magic != _CHECKPOINT_MAGIC or version != 1 or active > _NO_SLOT:
            raise VerificationFailed("the checkpoint segment is not a Slates checkpoint")

    def _active(self) -> int:
        value: int = _CHECKPOINT_HEADER.unpack_from(self.segment.map, 0)[2]
        return value

    def _slot_offset(self, slot: int) -> int:
        return _PAGE + slot * self.slot_size

    def read(self) -> tuple[int, bytes] | None:
        """The published checkpoint as (journal generation it covers, blob), if any."""
        active = self._active()
        if active == _NO_SLOT:
            return None
        generation, length, crc = _SLOT.unpack_from(
            self.segment.map, _CHECKPOINT_HEADER.size + active * _SLOT.size
        )
        if length > self.slot_size:
            raise VerificationFailed("the checkpoint length is out of bounds")
        start = self._slot_offset(active)
        blob = bytes(self.segment.map[start : start + length])
        if zlib.crc32(blob) != crc:
            raise VerificationFailed("the checkpoint fails its checksum")
        return generation, blob

    def write(self, generation: int, pieces: Iterable[bytes | bytearray]) -> None:
        """Write a checkpoint into the inactive slot and publish it.  It comes in pieces
        (ShardState.checkpoint_pieces), each copied in as it comes, so the whole
        never has to exist in the heap.  One that does not fit raises
        CapacityExhausted, and the published checkpoint stays as it was."""
        active = self._active()
        slot = 0 if active != 0 else 1
        start = self._slot_offset(slot)
        mm = self.segment.map
        length = crc = 0
        for piece in pieces:
            if length + len(piece) > self.slot_size:
                self.segment.release(start, start + self.slot_size)
                raise CapacityExhausted(
                    "the checkpoint does not fit its segment",
                    at_least=length + len(piece),
                    room=self.slot_size,
                )
            mm[start + length : start + length + len(piece)] = piece
            crc = zlib.crc32(piece, crc)
            length += len(piece)
        _SLOT.pack_into(mm, _CHECKPOINT_HEADER.size + slot * _SLOT.size, generation, length, crc)
        struct.pack_into("<I", mm, 12, slot)  # the publish point: one aligned 4-byte store
        if active != _NO_SLOT:
            old = self._slot_offset(active)
            self.segment.release(old, old + self.slot_size)
