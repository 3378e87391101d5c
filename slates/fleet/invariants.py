"""The simulator's model and the invariants it checks after every step.

Theory of operation.  The `Checker` watches the world (sim.py, world.py)
and keeps a model: every position known to be *chosen* (a write quorum of
one configuration revision accepted one value at one epoch, a holder
marked it committed, or an owner committed it), every acknowledged
request (a SubmitReply without error) and the content of each chosen
version, rebuilt from the clients' own bytes, not the machines'.

Checked, raising InvariantViolated with the seed:
- no two values are chosen at one position, and no holder accepts another
  value at a chosen position at the chosen epoch or later;
- a request id is chosen at most once (a retry never commits twice);
- an acknowledged version is the chosen value of that request, and stays
  recoverable: for some configured holder set, fewer than f+1 members
  whose identity still exists lack it (so no quorum can miss it); a copy
  disappears only when a host loses its RAM (a holder overwrites a slot
  only at a higher epoch, and a different value there is caught by the
  first rule after that step), and quorums change only with the
  configuration, so this is checked at exactly those steps and at the end;
- a fenced owner never commits: an owner at epoch e commits nothing new
  once an owner at a later epoch has recovered and served;
- every served version verifies: a Read's bytes equal the model's;
- replies claim only what holds: the requested scope is reached; `host`
  means f+1 acceptances outside the owner's host; `region` means f+1
  mirror holders hold the prefix; a reported mirror lag is never smaller
  than the real one (unknown is None, never 0).
`may_lose_ram` is the fault budget the chaos respects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slates.errors import VerificationFailed
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.ledger import RequestId, Value, root_of
from slates.fleet.messages import Outgoing, ReadReply, SubmitReply
from slates.fleet.owner import State
from slates.merge.ranges import Replace, apply

if TYPE_CHECKING:
    from slates.fleet.world import World

__all__ = ["Checker", "InvariantViolated"]

GREEN = "g"


class InvariantViolated(VerificationFailed):
    code = "InvariantViolated"


class Checker:
    def __init__(self, world: World) -> None:
        self.world = world
        self.configs: dict[int, list[GreenConfig]] = {}
        self.chosen: dict[int, tuple[bytes, int, Value]] = {}
        self.request_at: dict[RequestId, int] = {}
        self.acked: dict[RequestId, int] = {}
        self.requested: dict[RequestId, str] = {}
        self.max_served_epoch = 0
        self._accept_log: dict[tuple[int, int, bytes], set[Peer]] = {}
        self._seen_accepts: dict[Peer, dict[int, tuple[int, bytes]]] = {}
        self._seen_changes: dict[Peer, int] = {}
        self._seen_commits: dict[Peer, int] = {}
        self._contents: list[bytes] = [b""]

    def fail(self, message: str) -> InvariantViolated:
        seed = self.world.seed
        return InvariantViolated(f"seed {seed} at t={self.world.now:.2f}: {message}", seed=seed)

    # -- the model --

    def _choose(self, position: int, digest: bytes, epoch: int, value: Value, why: str) -> None:
        have = self.chosen.get(position)
        if have is not None:
            if have[0] != digest:
                raise self.fail(f"two values committed at position {position} ({why})")
            if epoch < have[1]:
                self.chosen[position] = (digest, epoch, value)
            return
        other = self.request_at.get(value.request)
        if other is not None and other != position:
            raise self.fail(f"request {value.request} committed at {other} and {position}")
        self.chosen[position] = (digest, epoch, value)
        self.request_at[value.request] = position

    def content(self, version: int) -> bytes:
        while len(self._contents) <= version:
            position = len(self._contents)
            have = self.chosen.get(position)
            if have is None:
                raise self.fail(f"version {position} is used but was never committed")
            value = have[2]
            edits = [Replace(e.start, e.end, self.world.chunk_data[e.chunk]) for e in value.edits]
            data = apply(self._contents[-1], edits)
            if root_of(data) != value.result_root:
                raise self.fail(f"committed version {position} does not verify")
            self._contents.append(data)
        return self._contents[version]

    def acked_top(self) -> int:
        return max(self.acked.values(), default=0)

    # -- events --

    def configured(self, config: GreenConfig) -> None:
        self.configs.setdefault(config.epoch, []).append(config)
        self.check_not_lost()

    def lost_ram(self, host: str) -> None:
        self.check_not_lost()

    def rotted(self, host: str) -> None:
        """A held chunk rotted: that holder must now refuse, never serve wrong bytes."""

    def may_lose_ram(self, host: str) -> bool:
        world = self.world
        if host in world.mirror_hosts:
            return False  # the mirror's budget is not modelled: its hosts restart with RAM
        peer = world.peer(host)
        for holder_set in world.config.sets():
            if peer in holder_set.peers:
                amnesic = sum(1 for p in holder_set.peers if world.peer(p.host) != p)
                if amnesic + 1 > holder_set.f:
                    return False
        return True

    def after_host(self, host: str) -> None:
        node = self.world.nodes[host]
        me = node.me
        owner = node.owners.get(GREEN)
        if owner is not None:
            seen = self._seen_commits.get(me, 0)
            if len(owner.commits) > seen:
                for epoch, position, digest, latency in owner.commits[seen:]:
                    self._owner_committed(owner.ledger, epoch, position, digest, latency)
                self._seen_commits[me] = len(owner.commits)
            if owner.recovered and owner.state in (State.SERVING, State.SEALING):
                self.max_served_epoch = max(self.max_served_epoch, owner.epoch)
        holder = node.holder
        if self._seen_changes.get(me, -1) == holder.changes:
            return
        self._seen_changes[me] = holder.changes
        cache = self._seen_accepts.setdefault(me, {})
        accepted = holder.accepted(GREEN)
        for position, slot in accepted.items():
            key = (slot.epoch, slot.digest)
            if cache.get(position) == key:
                continue
            cache[position] = key
            peers = self._accept_log.setdefault((position, slot.epoch, slot.digest), set())
            peers.add(me)
            have = self.chosen.get(position)
            if have is not None and have[0] != slot.digest and slot.epoch >= have[1]:
                raise self.fail(
                    f"{host} accepted another value at chosen position {position} "
                    f"at epoch {slot.epoch} >= {have[1]}"
                )
            if any(c.write_quorum(peers) for c in self.configs.get(slot.epoch, ())):
                self._choose(position, slot.digest, slot.epoch, slot.value, "accept quorum")
        for position, digest in holder.committed(GREEN).items():
            slot = accepted[position]
            self._choose(position, digest, slot.epoch, slot.value, f"{host} marked it")

    def _owner_committed(
        self, ledger: list[Value], epoch: int, position: int, digest: bytes, latency: float
    ) -> None:
        if epoch < self.max_served_epoch and position not in self.chosen:
            raise self.fail(
                f"an owner fenced at epoch {epoch} committed new position {position} "
                f"after epoch {self.max_served_epoch} served"
            )
        self._choose(position, digest, epoch, ledger[position - 1], "owner commit")
        self.world.stats.commits += 1
        if 0 <= latency < 1000:
            self.world.stats.latencies.append(latency)

    def emitted(self, source: str, out: Outgoing) -> None:
        reply = out.message
        if not isinstance(reply, SubmitReply) or reply.error:
            return
        have = self.chosen.get(reply.version)
        if have is None or have[2].request != reply.request:
            raise self.fail(f"{source} acknowledged {reply.request} at an uncommitted version")
        wanted = self.requested.get(reply.request)
        if wanted is not None and wanted not in reply.scopes:
            raise self.fail(f"{source} replied {reply.scopes} to a {wanted} request")
        config = self.world.config
        if "host" in reply.scopes:
            outside = {
                peer
                for (position, _, digest), peers in self._accept_log.items()
                if position == reply.version and digest == have[0]
                for peer in peers
                if peer.host != source
            }
            if len({p.host for p in outside}) < config.holders.f + 1:
                raise self.fail(f"{source} claimed host scope for {reply.version} without f+1")
        mirror = config.mirror
        if mirror is not None:
            nodes = self.world.nodes
            prefixes = sorted(
                (nodes[p.host].holder.prefix(GREEN) for p in mirror.peers), reverse=True
            )
            real = prefixes[mirror.f]
            if "region" in reply.scopes and real < reply.version:
                raise self.fail(f"{source} claimed region scope for {reply.version}")
            owner = nodes[source].owners[GREEN]
            if reply.mirror_lag is not None and owner.head - reply.mirror_lag > real:
                raise self.fail(f"{source} reported mirror lag {reply.mirror_lag} below the real")
        elif reply.mirror_lag is not None:
            raise self.fail(f"{source} reported a mirror lag without a mirror")

    def acknowledged(self, reply: SubmitReply) -> None:
        known = self.acked.get(reply.request)
        if known is not None and known != reply.version:
            raise self.fail(f"{reply.request} acknowledged as {known} and {reply.version}")
        if known is None:
            self.acked[reply.request] = reply.version
            self.world.stats.acked += 1

    def served(self, reply: ReadReply) -> None:
        if reply.data != self.content(reply.position):
            raise self.fail(f"{reply.sender.host} served wrong bytes for {reply.position}")

    def check_not_lost(self) -> None:
        world = self.world
        for version in sorted(set(self.acked.values())):
            digest = self.chosen[version][0]
            safe = False
            for holder_set in world.config.sets():
                lacking = 0
                for peer in holder_set.peers:
                    if world.peer(peer.host) != peer:
                        continue  # that identity is gone: it can never promise anything
                    slot = world.nodes[peer.host].holder.accepted(GREEN).get(version)
                    if slot is None or slot.digest != digest:
                        lacking += 1
                if lacking <= holder_set.f:
                    safe = True
                    break
            if not safe:
                raise self.fail(f"acknowledged version {version} is lost: {self._holding(version)}")

    def _holding(self, version: int) -> str:
        world = self.world
        parts = []
        for holder_set in world.config.sets():
            for peer in sorted(holder_set.peers):
                if world.peer(peer.host) != peer:
                    parts.append(f"{peer.boot}:gone")
                    continue
                slot = world.nodes[peer.host].holder.accepted(GREEN).get(version)
                held = "none" if slot is None else f"e{slot.epoch}:{slot.digest.hex()[:6]}"
                parts.append(f"{peer.boot}:{held}")
            parts.append("|")
        return " ".join(parts) + f" chosen {self.chosen[version][0].hex()[:6]}"

    def final(self) -> None:
        self.check_not_lost()
        for request, version in self.acked.items():
            if self.request_at.get(request) != version:
                raise self.fail(f"acknowledged {request} is not chosen at {version}")
