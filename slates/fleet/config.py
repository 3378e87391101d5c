"""The fleet configuration of one green volume, as an input record.

Theory of operation (DESIGN.md section 7).  The configuration group (etcd
in production, the simulator's council in tests) commits, per green
volume, who may write it and who may hold it: the owner `Peer` and its
ownership `epoch`, and a `HolderSet` of 2f+1 candidates in distinct hosts
and distinct failure domains.  During a joint reconfiguration the record
carries the old set too (`old_holders`) and every write needs a quorum in
both sets; a `mirror` set in another region holds prefixes for the
`region` durability scope.  `revision` is the group's commit index: a
machine installs only newer revisions.

A `Peer` is a host *and its boot id*: a host that lost its RAM comes back
with a new boot id, and until the configuration names that new identity
its acknowledgements and promises count for nothing ("claims nothing").

Quorum counting (`HolderSet.quorum`) counts distinct candidate peers; the
candidates are validated to be in distinct hosts and distinct failure
domains, so f+1 counted peers are f+1 hosts in f+1 domains, and a second
acknowledgement from one peer is the same set element.  Nothing here does
I/O; the owner, the holder and the simulator call these functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from slates.errors import InvalidArgument

__all__ = ["Peer", "Candidate", "HolderSet", "GreenConfig"]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Peer:
    host: str
    boot: str


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    peer: Peer
    domain: str
    region: str


@dataclasses.dataclass(frozen=True, slots=True)
class HolderSet:
    """2f+1 eligible holders of one green, in distinct hosts and failure domains."""

    f: int
    candidates: tuple[Candidate, ...]

    def __post_init__(self) -> None:
        if self.f < 0 or len(self.candidates) != 2 * self.f + 1:
            raise InvalidArgument(
                "a holder set has 2f+1 candidates", f=self.f, count=len(self.candidates)
            )
        hosts = {c.peer.host for c in self.candidates}
        domains = {c.domain for c in self.candidates}
        if len(hosts) != len(self.candidates) or len(domains) != len(self.candidates):
            raise InvalidArgument("holder candidates need distinct hosts and failure domains")

    @property
    def peers(self) -> frozenset[Peer]:
        return frozenset(c.peer for c in self.candidates)

    def quorum(self, acks: Iterable[Peer]) -> bool:
        """f+1 distinct candidate peers (hence hosts and domains) among `acks`."""
        return len(self.peers.intersection(acks)) >= self.f + 1

    def count(self, acks: Iterable[Peer]) -> int:
        return len(self.peers.intersection(acks))


@dataclasses.dataclass(frozen=True, slots=True)
class GreenConfig:
    green: str
    revision: int
    epoch: int
    owner: Peer
    holders: HolderSet
    old_holders: HolderSet | None = None
    mirror: HolderSet | None = None

    def __post_init__(self) -> None:
        if self.epoch < 1 or self.revision < 1:
            raise InvalidArgument("epochs and revisions start at 1", epoch=self.epoch)
        if self.mirror is not None:
            home = {c.peer.host for c in self.holders.candidates}
            if self.old_holders is not None:
                home |= {c.peer.host for c in self.old_holders.candidates}
            if home & {c.peer.host for c in self.mirror.candidates}:
                raise InvalidArgument("mirror holders live outside the home holder sets")

    @property
    def joint(self) -> bool:
        return self.old_holders is not None

    def sets(self) -> tuple[HolderSet, ...]:
        if self.old_holders is None:
            return (self.holders,)
        return (self.old_holders, self.holders)

    def members(self) -> frozenset[Peer]:
        """Every peer whose promise or acceptance a write or recovery may need."""
        found = self.holders.peers
        if self.old_holders is not None:
            found = found | self.old_holders.peers
        return found

    def write_quorum(self, acks: Iterable[Peer]) -> bool:
        """A quorum in the holder set, and in the old set too while joint."""
        acked = frozenset(acks)
        return all(s.quorum(acked) for s in self.sets())

    def host_quorum(self, acks: Iterable[Peer]) -> bool:
        """`host` durability: f+1 acknowledgements outside the owner's host."""
        outside = [p for p in acks if p.host != self.owner.host]
        return all(s.quorum(outside) for s in self.sets())
