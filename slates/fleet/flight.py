"""One ledger position in flight: placement, proposal, quorum, retries.

Theory of operation (DESIGN.md section 7, "Replication").  The owner keeps
at most one `Flight` (so every proposal builds on a committed predecessor;
see recovery.py).  A flight:

- starts by sending Place (the value's chunk manifest) to `preferred`
  candidates: per holder set, f+1 outside the owner's host (so that a
  commit soon reaches `host` scope) plus the owner's own host's holder,
  which answers without a network round trip;
- sends Propose to each target that acknowledged placement (`placed`);
- counts Accepted with the flight's digest from its targets as a *set of
  configured peers* (`accepted`): a duplicate is the same element, a peer
  with another boot id is not a member, and the quorum is the
  configuration's write quorum (both sets while joint);
- on every RETRY without a quorum re-sends to the targets that have not
  accepted, and every REPLACE_AFTER retries adds one more eligible
  candidate (a lagging or full holder is replaced).  Nothing ever removes
  a target or lowers what a quorum is.

`Pending` is a queued submission with the clients waiting for it.  Pure;
owned by `owner.Owner`.
"""

from __future__ import annotations

import dataclasses

from slates.fleet.config import GreenConfig, Peer
from slates.fleet.ledger import Value
from slates.fleet.messages import Outgoing, Place, Propose, Submit

__all__ = ["Flight", "Pending", "preferred", "place", "RETRY", "REPLACE_AFTER"]

RETRY = 4.0  # simulated time between retransmissions
REPLACE_AFTER = 2  # retries without a quorum before another candidate is tried


@dataclasses.dataclass(slots=True)
class Pending:
    submit: Submit
    reply_to: set[str]


def place(me: Peer, green: str, epoch: int, peer: Peer, position: int, value: Value) -> Outgoing:
    return Outgoing(peer.host, Place(me, green, epoch, position, value.manifest()))


def preferred(config: GreenConfig, own_host: str, avoid: set[Peer]) -> list[Peer]:
    """Per holder set f+1 candidates outside `own_host`, and `own_host`'s holder."""
    chosen: list[Peer] = []
    for holder_set in config.sets():
        order = sorted(holder_set.peers, key=lambda p: (p in avoid, p.host))
        outside = sum(1 for p in chosen if p in holder_set.peers and p.host != own_host)
        for peer in order:
            if peer in chosen:
                continue
            if peer.host == own_host:
                chosen.append(peer)
            elif outside <= holder_set.f:
                chosen.append(peer)
                outside += 1
    return chosen


@dataclasses.dataclass(slots=True)
class Flight:
    me: Peer
    green: str
    epoch: int
    position: int
    value: Value
    digest: bytes
    content: bytes  # the green's content once this position commits
    source: Pending | None  # None: a position recovery re-accepts
    targets: list[Peer]
    started_at: float
    sent_at: float
    revision: int  # the configuration revision it started under
    placed: set[Peer] = dataclasses.field(default_factory=set)
    accepted: set[Peer] = dataclasses.field(default_factory=set)
    attempts: int = 0

    def begin(self) -> list[Outgoing]:
        return [self._place(peer) for peer in self.targets]

    def _place(self, peer: Peer) -> Outgoing:
        return place(self.me, self.green, self.epoch, peer, self.position, self.value)

    def _propose(self, peer: Peer) -> Outgoing:
        propose = Propose(self.me, self.green, self.epoch, self.position, self.value, False)
        return Outgoing(peer.host, propose)

    def add_targets(self, peers: list[Peer]) -> list[Outgoing]:
        """Place on more candidates (a new holder set came into force)."""
        new = [p for p in peers if p not in self.targets]
        self.targets.extend(new)
        return [self._place(peer) for peer in new]

    def placed_on(self, peer: Peer) -> list[Outgoing]:
        if peer not in self.targets:
            return []  # a placement we never asked for, or a peer we stopped asking
        self.placed.add(peer)
        return [self._propose(peer)]

    def accepted_by(self, config: GreenConfig, peer: Peer, digest: bytes) -> bool:
        """Count an acceptance; True once the write quorum holds."""
        if digest == self.digest and peer in self.targets:
            self.accepted.add(peer)
        return config.write_quorum(self.accepted)

    def replace_one(self, config: GreenConfig, avoid: set[Peer]) -> list[Outgoing]:
        """Add one more eligible candidate (never removing one)."""
        spare = sorted(
            (p for p in config.members() if p not in self.targets),
            key=lambda p: (p in avoid, p.host == self.me.host, p.host),
        )
        return self.add_targets(spare[:1])

    def retry(self, config: GreenConfig, avoid: set[Peer], now: float) -> list[Outgoing]:
        if now < self.sent_at:
            self.sent_at = now  # the clock jumped back: re-arm
        if now - self.sent_at < RETRY:
            return []
        self.sent_at = now
        self.attempts += 1
        out: list[Outgoing] = []
        for peer in self.targets:
            if peer in self.accepted:
                continue
            out.append(self._propose(peer) if peer in self.placed else self._place(peer))
        if self.attempts % REPLACE_AFTER == 0:
            out += self.replace_one(config, avoid)
        return out
