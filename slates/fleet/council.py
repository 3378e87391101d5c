"""The simulated configuration group (the regional council, etcd in production).

Theory of operation (DESIGN.md section 7, "Configuration in etcd").  The
council holds the authoritative `GreenConfig` and is the only one that
changes it, always as a new revision delivered to every host with a delay
(`World` redelivers the latest after restarts and healed partitions):

- failover: a new epoch with a live host as owner (a holder candidate if
  one is reachable), when the owner's host is down or lost its RAM, or on
  the chaos's false suspicion (the old owner may still be running);
- transfer: a TransferRequest from the current owner at the current epoch
  moves ownership to a live target at epoch + 1 (compare-and-set on the
  epoch, as one etcd transaction would);
- replacement: a member whose identity is gone (the host lost its RAM) is
  replaced, by the host's new identity or a spare host, through a joint
  configuration (old and new sets) that is retired only on the owner's
  JointReady for that revision.  One reconfiguration at a time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from slates.fleet.config import GreenConfig, HolderSet
from slates.fleet.invariants import InvariantViolated
from slates.fleet.messages import JointReady, Message, TransferRequest

if TYPE_CHECKING:
    from slates.fleet.world import World

__all__ = ["Council"]


class Council:
    def __init__(self, world: World, config: GreenConfig) -> None:
        self.world = world
        self.config = config

    def commit(self, config: GreenConfig) -> None:
        self.config = config
        self.world.checker.configured(config)
        for host in self.world.hosts + self.world.mirror_hosts:
            self.world.schedule(self.world.rng.uniform(0.2, 3.0), "config", host)

    def next(self, **changes: Any) -> GreenConfig:
        return dataclasses.replace(self.config, revision=self.config.revision + 1, **changes)

    def failover(self, *, false_suspicion: bool) -> None:
        live = [h for h in self.world.hosts if self.world.up[h] and h not in self.world.isolated]
        if not live:
            return
        members = {p.host for p in self.config.holders.peers}
        preferred = [h for h in live if h in members] or live
        current = self.config.owner.host
        choices = [h for h in preferred if h != current] or preferred
        new_owner = self.world.rng.choice(choices)
        self.world.stats.failovers += 1
        self.world.stats.false_suspicions += int(false_suspicion)
        self.commit(self.next(epoch=self.config.epoch + 1, owner=self.world.peer(new_owner)))

    def owner_dead(self) -> bool:
        owner = self.config.owner
        return not self.world.up[owner.host] or self.world.peer(owner.host) != owner

    def receive(self, message: Message) -> None:
        config = self.config
        match message:
            case TransferRequest():
                target = message.target
                if (
                    message.epoch == config.epoch
                    and message.sender == config.owner
                    and target in self.world.up
                    and self.world.up[target]
                    and target not in self.world.isolated
                ):
                    self.world.stats.transfers += 1
                    self.commit(self.next(epoch=config.epoch + 1, owner=self.world.peer(target)))
            case JointReady():
                if (
                    message.revision == config.revision
                    and config.joint
                    and message.sender == config.owner
                ):
                    self.commit(self.next(old_holders=None))
                    self.repair()
            case _:
                raise InvariantViolated(
                    f"seed {self.world.seed}: the council got {type(message).__name__}",
                    seed=self.world.seed,
                )

    def repair(self) -> None:
        """Fail over a dead owner; replace a member that lost its RAM (joint)."""
        if self.owner_dead() and self.world.rng.random() < 0.7:
            self.failover(false_suspicion=False)
        config = self.config
        if config.joint:
            return  # one reconfiguration at a time
        holders = config.holders
        for index, candidate in enumerate(holders.candidates):
            host = candidate.peer.host
            if self.world.peer(host) == candidate.peer:
                continue
            replacement = host if self.world.up[host] else None
            if replacement is None:
                spares = [
                    h
                    for h in self.world.hosts
                    if self.world.up[h] and h not in {c.peer.host for c in holders.candidates}
                ]
                replacement = spares[0] if spares else None
            if replacement is None:
                continue
            candidates = list(holders.candidates)
            candidates[index] = self.world.candidate(replacement)
            new = HolderSet(holders.f, tuple(candidates))
            self.world.stats.joints += 1
            self.commit(self.next(holders=new, old_holders=holders))
            return
