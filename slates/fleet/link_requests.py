"""The fleet link's answers to RUNTIME/fleet.sock's requests (DESIGN.md section 7).

Theory of operation.  The socket (slates.fleet.link_local) hands each
decoded request to the link's `local_request`, which is `handle` here:
requests are parsed by slates.fleet.link_rules.parse_local (anything else
is InvalidArgument) and answered by the part that owns what they ask for:

- `{"op": "forward", "host": H, "shard": N, "client": C, "request": R}`: run
  wire request R on host H's shard N as client C; the result is the
  shard's reply bytes (slates.fleet.link_routing and link_forward; a
  request for this host runs here directly, under the same identity rules);
- `{"op": "hosts"}`: this host and boot, etcd's enrolled hosts with their
  lease and serf's verdict (link_rules.host_listing), recent serf events
  (link_membership), registration conflicts (link_register), connected
  peers, adopted greens and takeovers, and per green held here its
  committed prefix (link_replicate);
- `{"op": "owner", "green": NAME}`: etcd's configuration of green NAME
  (owner host and boot, epoch, revision, holders), NotFound without one;
- `{"op": "durable", "host": H, "shard": N, "work": ID, "version": V,
  "scope": S, "timeout": T}`: wait (at most T s) until version V of work
  volume ID's green reaches scope S ("restart", "host", "region") and
  answer `{"durability", "scopes", ...}`; H ("" for this host) is where
  the work volume lives, whose link does the waiting (link_routing);
- `{"op": "remote.tree" | "remote.chunks" | "remote.submit" | "remote.stats" |
  "remote.damage" | "remote.drop_replies", ...}`: remote work volumes, a
  shard's asks for another host's green version (its tree record, its
  pieces: slates.fleet.link_remote; a submission, run once on the owner:
  slates.fleet.link_submit; peers ask each other as `{"kind": "remote"}`
  over QUIC); `remote.stats` adds how often the peer pool reconnected;
- `{"op": "takeover", "green": NAME, "epoch": E}`: commit this host as
  NAME's owner at E+1 and recover it, as a failed verdict does
  (slates.fleet.link_membership's `takeover`: EpochFenced, with the
  committed owner, when etcd is no longer at E; InvalidArgument while
  serf sees the owner's host alive).

Invariants.  Holds no state of its own: every answer is read from the
part that owns it at the time of the request.  Only the operator's
requests are forwarded this session (link_forward's docstring).

Callers: slates.fleet.link (one LocalRequests per link, behind its
LocalSocket).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from slates.errors import InvalidArgument, NotFound
from slates.fleet.config import GreenConfig, HolderSet
from slates.fleet.etcd import Council
from slates.fleet.link_membership import Membership
from slates.fleet.link_register import Registrar
from slates.fleet.link_remote import RemoteReads
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_routing import Routing
from slates.fleet.link_rules import (
    Durable,
    Forward,
    LocalRequest,
    Takeover,
    host_listing,
    parse_local,
)
from slates.fleet.serf import MembershipWatch

__all__ = ["LocalRequests", "config_view"]

CouncilCall = Callable[..., Awaitable[Any]]


def config_view(config: GreenConfig) -> dict[str, Any]:
    """A green's configuration as the `owner` request answers it."""

    def holders(found: HolderSet | None) -> dict[str, Any] | None:
        if found is None:
            return None
        return {
            "f": found.f,
            "candidates": [
                {"host": c.peer.host, "boot": c.peer.boot, "domain": c.domain, "region": c.region}
                for c in found.candidates
            ],
        }

    return {
        "green": config.green,
        "owner": {"host": config.owner.host, "boot": config.owner.boot},
        "epoch": config.epoch,
        "revision": config.revision,
        "holders": holders(config.holders),
        "old_holders": holders(config.old_holders),
    }


class LocalRequests:
    """fleet.sock's requests, answered (module doc)."""

    def __init__(
        self,
        host: str,
        boot_id: str,
        council: Council,
        council_call: CouncilCall,
        watch: MembershipWatch,
        routing: Routing,
        remote: RemoteReads,
        replicator: Replicator,
        registrar: Registrar,
        membership: Membership,
    ) -> None:
        self.host = host
        self.boot_id = boot_id
        self.council = council
        self._council = council_call
        self.watch = watch
        self.routing = routing
        self.remote = remote
        self.replicator = replicator
        self.registrar = registrar
        self.membership = membership

    async def handle(self, message: dict[str, Any]) -> Any:
        op = message.get("op") if isinstance(message, dict) else None
        if isinstance(op, str) and op.startswith("remote."):
            found = await self.remote.local(message)  # remote work volumes (link_remote)
            if op == "remote.stats":  # and how often a lost reply was resent anew
                peers = self.routing.peers
                found["reconnects"] = 0 if peers is None else peers.reconnects
            return found
        request = parse_local(message)
        match request:
            case Forward():
                return await self.routing.forward(request)
            case LocalRequest(op="hosts"):
                return await self.hosts()
            case Durable():
                return await self.routing.durable(request)
            case Takeover(green=green, epoch=epoch):
                return await self.membership.takeover(green, epoch)
            case LocalRequest(op="owner", green=str(green)):
                config = await self._council(self.council.green, green)
                if config is None:
                    raise NotFound("no such green in the fleet", green=green)
                return config_view(config)
            case _:
                raise InvalidArgument("unknown fleet link request", request=repr(request))

    async def hosts(self) -> dict[str, Any]:
        records = await self._council(self.council.hosts)
        alive = await self._council(self.council.alive_hosts)
        serf = {name: member.status for name, member in self.watch.known.items()}
        peers = self.routing.peers
        return {
            "host": self.host,
            "boot_id": self.boot_id,
            "hosts": host_listing(records, alive, serf),
            "events": [{"member": e.member.name, "kind": e.kind} for e in self.membership.events],
            "conflicts": dict(self.registrar.conflicts),
            "peers": [] if peers is None else peers.connected,
            "adopted": {name: local for name, (_, local) in self.replicator.adopted.items()},
            "takeovers": dict(self.replicator.takeovers),
            "held": {  # per green this host holds versions of: its committed prefix
                name: self.replicator.holder.prefix(name)
                for name in self.replicator.configs
                if self.replicator.holder.accepted(name)
            },
        }
