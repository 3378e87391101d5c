"""Content a landing needs that no snapshot holds, kept for the manifests that name it.

Theory of operation (DESIGN.md section 6, issue 11 item 7).  `rewitness
--merge` proposes the agents' change merged with a developer's outside
edit: bytes no volume ever held.  It also witnesses the disk's bytes of
that moment, the base of a later merge.  `HeldContent` keeps such
content keyed by its BLAKE3, together with which manifest (by id) holds
which hashes; a blob lives while some manifest holds it.

Invariants: every blob's key is the BLAKE3 of its bytes (checked on
`add`); every blob is held by at least one manifest; a manifest holds
only hashes it names.  The store has bounds (`max_blobs`, `max_bytes`):
`check_room` refuses one manifest whose content alone exceeds them
(CapacityExhausted, before anything is journaled), and `over_bounds`
tells the owner (slates.node.landing.LandingDesk, which knows the age of
its plans) to release the oldest holders until it is within them.

Pure bookkeeping: no I/O.  The desk journals every change as part of its
plan events and checkpoints `to_wire`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import blake3

from slates.errors import CapacityExhausted, VerificationFailed

__all__ = ["HeldContent"]


class HeldContent:
    def __init__(self, max_blobs: int, max_bytes: int) -> None:
        self.max_blobs = max_blobs
        self.max_bytes = max_bytes
        self.blobs: dict[str, bytes] = {}  # BLAKE3 -> bytes
        self.holders: dict[str, set[str]] = {}  # manifest id -> the hashes it holds
        self.size = 0

    def get(self, digest: str) -> bytes | None:
        return self.blobs.get(digest)

    def fresh(self, named: Iterable[str], offered: Mapping[str, bytes]) -> dict[str, bytes]:
        """Of `offered`, what a manifest naming `named` would add to the store; refused
        (CapacityExhausted) when all it would hold exceeds the bounds on its own."""
        wanted = set(named)
        new = {d: b for d, b in offered.items() if d in wanted and d not in self.blobs}
        if new:
            everything = {**self.blobs, **new}
            needed = [everything[d] for d in wanted if d in everything]
            size = sum(len(b) for b in needed)
            if len(needed) > self.max_blobs or size > self.max_bytes:
                raise CapacityExhausted(
                    "the merged content is too large to hold for a landing",
                    files=len(needed),
                    size=size,
                    limit_files=self.max_blobs,
                    limit_bytes=self.max_bytes,
                )
        return new

    def add(self, manifest_id: str, named: Iterable[str], blobs: Mapping[str, bytes]) -> None:
        """`manifest_id` (re)registered naming `named`: it holds those of them the store
        has, `blobs` included (each checked against its hash)."""
        wanted = set(named)
        for digest, blob in blobs.items():
            if not isinstance(blob, bytes) or blake3.blake3(blob).hexdigest() != digest:
                raise VerificationFailed("held landing content does not match its hash")
        for digest, blob in blobs.items():
            if digest in wanted and digest not in self.blobs:
                self.blobs[digest] = blob
                self.size += len(blob)
        holds = wanted & self.blobs.keys()
        if holds:
            self.holders[manifest_id] = holds
        else:
            self.release(manifest_id)

    def release(self, manifest_id: str) -> None:
        """The manifest is gone: what no other manifest holds is dropped."""
        holds = self.holders.pop(manifest_id, set())
        if not holds:
            return
        still: set[str] = set().union(*self.holders.values())
        for digest in holds - still:
            self.size -= len(self.blobs.pop(digest))

    def holds(self, manifest_id: str) -> bool:
        return manifest_id in self.holders

    def over_bounds(self) -> bool:
        return len(self.blobs) > self.max_blobs or self.size > self.max_bytes

    def to_wire(self) -> dict[str, Any]:
        return {
            "blobs": dict(self.blobs),
            "holders": {m: sorted(holds) for m, holds in self.holders.items()},
        }

    def restore(self, raw: Mapping[str, Any]) -> None:
        self.blobs = {str(d): bytes(b) for d, b in raw["blobs"].items()}
        self.holders = {str(m): {str(d) for d in holds} for m, holds in raw["holders"].items()}
        self.size = sum(len(b) for b in self.blobs.values())
        if any(not holds <= self.blobs.keys() for holds in self.holders.values()):
            raise VerificationFailed("held landing content is missing for a manifest")
