"""What an owner knows about where the copies of its ledger are.

Theory of operation (DESIGN.md section 7, "Durability scopes").  The owner
learns from every Accepted and Promise which committed prefix a peer holds
(`prefix`) and, for recent positions, which peers accepted them
(`accepts`).  From those alone it answers:

- `scopes(version)`: `restart` once committed; `host` once f+1 peers
  outside the owner's host (in each configured set) accepted it; `region`
  once f+1 mirror holders report a committed prefix through it;
- `mirror_lag()`: how many versions the mirror's quorum prefix trails the
  head, or None when no mirror holder has reported to this owner (an
  unknown lag is never 0);
- `stream_due(...)`: the next committed position to place on each peer
  that streams the prefix (the mirror, and a joint configuration's new set),
  one position in flight per peer, again after RETRY;
- `new_set_holds(...)`: whether a quorum of the new holder set reports the
  committed prefix through the head (the condition for JointReady).

Knowledge only grows while one owner serves; `reset` forgets it when a new
epoch begins.  Peers are (host, boot id): a host that lost its RAM reports
as a new peer and is credited with nothing.  Pure; owned by `owner.Owner`.
"""

from __future__ import annotations

from slates.fleet.config import GreenConfig, Peer

__all__ = ["Copies", "KEEP_ACCEPTS"]

KEEP_ACCEPTS = 64  # positions whose acceptances are kept for `host` scope; older re-place


class Copies:
    __slots__ = ("_shipped", "accepts", "mirror_heard", "prefix")

    def __init__(self) -> None:
        self.prefix: dict[Peer, int] = {}
        self.accepts: dict[int, set[Peer]] = {}
        self.mirror_heard = False
        self._shipped: dict[Peer, tuple[int, float]] = {}

    def reset(self) -> None:
        self.prefix.clear()
        self.accepts.clear()
        self.mirror_heard = False

    def heard(self, config: GreenConfig, peer: Peer, prefix: int) -> None:
        self.prefix[peer] = max(self.prefix.get(peer, 0), prefix)
        if config.mirror is not None and peer in config.mirror.peers:
            self.mirror_heard = True

    def committed(self, position: int, peers: set[Peer]) -> None:
        self.accepts[position] = set(peers)
        self.accepts.pop(position - KEEP_ACCEPTS, None)

    def accepted(self, position: int, peer: Peer) -> None:
        accepts = self.accepts.get(position)
        if accepts is not None:
            accepts.add(peer)

    def scopes(self, config: GreenConfig, version: int, head: int) -> tuple[str, ...]:
        if version > head:
            return ()
        reached = ["restart"]
        accepts = self.accepts.get(version)
        if accepts is not None and config.host_quorum(accepts):
            reached.append("host")
        mirror = config.mirror
        if mirror is not None:
            holding = [p for p in mirror.peers if self.prefix.get(p, 0) >= version]
            if mirror.quorum(holding):
                reached.append("region")
        return tuple(reached)

    def mirror_lag(self, config: GreenConfig, head: int) -> int | None:
        mirror = config.mirror
        if mirror is None or not self.mirror_heard:
            return None
        prefixes = sorted((self.prefix.get(p, 0) for p in mirror.peers), reverse=True)
        return max(0, head - prefixes[mirror.f])

    def lacking_outside(self, config: GreenConfig, owner_host: str, version: int) -> list[Peer]:
        """Members outside the owner's host not known to hold `version` (for `host` scope)."""
        accepts = self.accepts.setdefault(version, set())
        return [p for p in sorted(config.members()) if p.host != owner_host and p not in accepts]

    def stream_due(
        self, targets: list[Peer], head: int, now: float, retry: float
    ) -> list[tuple[Peer, int]]:
        due: list[tuple[Peer, int]] = []
        for target in targets:
            position = self.prefix.get(target, 0) + 1
            if position > head:
                continue
            sent = self._shipped.get(target)
            if sent is not None and sent[0] == position and 0 <= now - sent[1] < retry:
                continue  # in flight; `now < sent` means the clock jumped back: send again
            self._shipped[target] = (position, now)
            due.append((target, position))
        return due

    def new_set_holds(self, config: GreenConfig, head: int) -> bool:
        holding = [p for p in config.holders.peers if self.prefix.get(p, 0) >= head]
        return config.holders.quorum(holding)
