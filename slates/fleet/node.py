"""One host's fleet machines: its holder and an owner per green volume.

Theory of operation.  A `Node` is what a host runs for the ledger: one
`Holder` (shared by every green; one chunk store) and one `Owner` per green
whose configuration it installed.  It routes each message by type to the
role that answers it (holder: Place, Chunk, Propose, Commit, Prepare,
Gather, Read; owner: Submit, Promise, Gathered, Fetch, PlaceAck, Accepted,
Refused) and installs configurations in both roles.  A host restarted with
its RAM keeps its Node; a host that lost its RAM gets a new Node with a new
boot id, which holds nothing and is owner of nothing until a configuration
names its new identity.  Pure; the simulator (or the QUIC driver) feeds it.
"""

from __future__ import annotations

from slates.errors import InvalidArgument, NotOwner
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.holder import Holder
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Commit,
    Fetch,
    Gather,
    Gathered,
    Message,
    Outgoing,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Read,
    Refused,
    Submit,
    SubmitReply,
)
from slates.fleet.owner import Owner

__all__ = ["Node"]


class Node:
    def __init__(self, me: Peer, capacity: int) -> None:
        self.me = me
        self.capacity = capacity
        self.holder = Holder(me, capacity)
        self.owners: dict[str, Owner] = {}

    def install(self, config: GreenConfig, now: float) -> list[Outgoing]:
        self.holder.install(config)
        owner = self.owners.get(config.green)
        if owner is None:
            owner = self.owners[config.green] = Owner(self.me, config.green, self.capacity)
        return owner.install(config, now)

    def receive(self, message: Message, now: float) -> list[Outgoing]:
        match message:
            case Place() | Chunk() | Propose() | Commit() | Prepare() | Gather() | Read():
                return self.holder.receive(message, now)
            case Submit() | Promise() | Gathered() | Fetch() | PlaceAck() | Accepted() | Refused():
                owner = self.owners.get(message.green)
                if owner is not None:
                    return owner.receive(message, now)
                if isinstance(message, Submit):
                    reply = SubmitReply(
                        self.me, message.green, message.request, 0, NotOwner.code, "", (), None
                    )
                    return [Outgoing(message.sender.host, reply)]
                return []  # an answer for a green this identity never owned (a prior boot's)
            case _:
                raise InvalidArgument("not a message a host answers", type=type(message).__name__)

    def tick(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        for green in sorted(self.owners):
            out += self.owners[green].tick(now)
        return out
