"""What a successor adopts from the promises it collected.

Theory of operation (DESIGN.md section 7, "Owner Failure and Recovery").
A successor authorized at epoch e+1 collects Promises from a write quorum
of the configured holders (both sets while joint).  Any quorum intersects
every quorum that committed a position, and a holder that accepted the
committed value at epoch b reports it or a value from a later epoch, which
is the same value (every later owner adopted it).  So per position the
highest-epoch proposal among the promises is the committed value whenever
one was committed.

The owner proposes position p+1 only after p committed, so any proposal at
p+1, from any epoch, was made on top of the one value committed at p: the
adopted chain is consistent position by position, and it ends at the first
position no promiser holds (nothing after a gap can have been committed).
`adopt` checks what can be checked without content (each base is its
predecessor, the reported committed prefix lies inside the chain) and
`verify` recomputes the chain's contents from the gathered chunks; either
raises VerificationFailed instead of serving an unverified history.  Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from slates.errors import VerificationFailed
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.ledger import ChunkStore, recompute
from slates.fleet.messages import Entry, Promise

__all__ = ["adopt", "verify", "needed_chunks", "Successor"]


def adopt(promises: Iterable[Promise]) -> tuple[tuple[Entry, ...], int]:
    """The adopted chain (positions 1..n, highest epoch each) and the known committed prefix."""
    best: dict[int, Entry] = {}
    known = 0
    for promise in promises:
        known = max(known, promise.prefix)
        for entry in promise.entries:
            current = best.get(entry.position)
            if current is None or entry.epoch > current.epoch:
                best[entry.position] = entry
    chain: list[Entry] = []
    while len(chain) + 1 in best:
        entry = best[len(chain) + 1]
        if entry.value.base_version != entry.position - 1:
            raise VerificationFailed(
                "an adopted proposal is not based on its predecessor", position=entry.position
            )
        chain.append(entry)
    if known > len(chain):
        raise VerificationFailed(
            "a holder reports a committed prefix the promises do not hold",
            prefix=known,
            chain=len(chain),
        )
    return tuple(chain), known


def needed_chunks(chain: Sequence[Entry], chunks: ChunkStore) -> tuple[bytes, ...]:
    wanted: dict[bytes, None] = {}
    for entry in chain:
        for chunk, _ in entry.value.manifest():
            if chunk not in chunks:
                wanted[chunk] = None
    return tuple(wanted)


def verify(chain: Sequence[Entry], chunks: ChunkStore) -> list[bytes]:
    """The content after each adopted position, recomputed and root-checked."""
    contents: list[bytes] = []
    content = b""
    for entry in chain:
        content = recompute(content, entry.value, chunks)
        contents.append(content)
    return contents


class Successor:
    """One recovery attempt at one epoch: promises in, an adopted chain out.

    `add` records a Promise from a configured member (a write quorum of
    them, both sets while joint, is needed); once the quorum holds it adopts
    (`chain`, `known`) and never changes its mind.  `due` paces the
    retransmission of Prepare or Gather (re-armed if the clock jumps back).
    """

    __slots__ = ("asked_at", "chain", "known", "promises")

    def __init__(self, now: float) -> None:
        self.promises: dict[Peer, Promise] = {}
        self.chain: tuple[Entry, ...] | None = None
        self.known = 0
        self.asked_at = now

    @property
    def adopted(self) -> bool:
        return self.chain is not None

    def add(self, config: GreenConfig, promise: Promise) -> bool:
        """Record a promise; True when this one completed the quorum."""
        if self.chain is not None or promise.sender not in config.members():
            return False  # adopted already, or an identity that claims nothing
        self.promises[promise.sender] = promise
        if not config.write_quorum(self.promises):
            return False
        self.chain, self.known = adopt(self.promises.values())
        return True

    def unpromised(self, config: GreenConfig) -> list[Peer]:
        return [p for p in sorted(config.members()) if p not in self.promises]

    def due(self, now: float, retry: float) -> bool:
        if now < self.asked_at:
            self.asked_at = now  # the clock jumped back: re-arm
        if now - self.asked_at < retry:
            return False
        self.asked_at = now
        return True
