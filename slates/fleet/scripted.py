"""A scripted network of fleet Nodes for scenario tests (no randomness).

Theory of operation.  Where the simulator (sim.py) draws its schedules
from a seed, a scenario test scripts one: it decides what is dropped,
when time moves and what each host installs, and then checks the result.

`Net` holds one `Node` per host, a council inbox and client inboxes, and
`pump()` delivers queued messages in order until nothing is left, dropping
whatever `blocked(dest, message)` says.  Time only moves when a test calls
`tick(dt)`.  Every message passes through its msgpack form on the way.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from slates.errors import CapacityExhausted
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.ledger import RequestId
from slates.fleet.messages import Message, Outgoing, Submit, SubmitReply, decode, encode
from slates.fleet.node import Node
from slates.fleet.owner import Owner
from slates.merge.ranges import Replace

G = "g"


def peer(host: str, boot: int = 0) -> Peer:
    return Peer(host, f"{host}.boot{boot}")


def holder_set(hosts: list[str], f: int = 1, boots: dict[str, int] | None = None) -> HolderSet:
    boots = boots or {}
    return HolderSet(
        f,
        tuple(
            Candidate(peer(h, boots.get(h, 0)), f"domain-{h}", "mirror" if h[0] == "m" else "home")
            for h in hosts
        ),
    )


class Net:
    def __init__(self, hosts: list[str]) -> None:
        self.nodes = {h: Node(peer(h), 1 << 16) for h in hosts}
        self.queue: collections.deque[tuple[str, Message]] = collections.deque()
        self.council: list[Message] = []
        self.replies: dict[str, list[SubmitReply]] = collections.defaultdict(list)
        self.blocked: Callable[[str, Message], bool] = lambda dest, message: False
        self.now = 0.0
        self.delivered = 0

    def owner(self, host: str) -> Owner:
        return self.nodes[host].owners[G]

    def send(self, out: list[Outgoing]) -> None:
        for item in out:
            self.queue.append((item.dest, decode(encode(item.message))))

    def install(self, config: GreenConfig, hosts: list[str] | None = None) -> None:
        for host in hosts or sorted(self.nodes):
            self.send(self.nodes[host].install(config, self.now))

    def pump(self, limit: int = 10_000) -> None:
        left = limit
        while self.queue:
            left -= 1
            if left < 0:
                raise CapacityExhausted("the scripted network did not settle", limit=limit)
            dest, message = self.queue.popleft()
            if self.blocked(dest, message):
                continue
            self.delivered += 1
            if dest == "council":
                self.council.append(message)
            elif dest in self.nodes:
                self.send(self.nodes[dest].receive(message, self.now))
            elif isinstance(message, SubmitReply):
                self.replies[dest].append(message)

    def tick(self, dt: float = 5.0) -> None:
        self.now += dt
        for host in sorted(self.nodes):
            self.send(self.nodes[host].tick(self.now))

    def submit(
        self,
        host: str,
        seq: int,
        data: bytes,
        *,
        client: str = "cl",
        scope: str = "restart",
        base: int | None = None,
        acked: int = 0,
        route: str | None = None,
        origin: str = "o",
    ) -> RequestId:
        request = RequestId(origin, client, seq)
        owner = self.nodes[host].owners.get(G)
        base_version = base if base is not None else (owner.head if owner else 0)
        submit = Submit(
            Peer(client, ""),
            G,
            request,
            acked,
            base_version,
            (Replace(0, 0, data),),
            scope,
            route or host,
        )
        self.send([Outgoing(host, submit)])
        return request
