"""The simulator's clients: submissions, retries over any route, reads.

Theory of operation.  Each client is attached to a host (its route, which
becomes the request's authenticated origin) and issues at most
REQUESTS_PER_CLIENT submissions one at a time, each a random edit of the
version it last saw acknowledged, with a random durability scope.  An
unanswered request is sent again with the same request id (to the
redirect it was given, or to another host every other attempt) up to
CLIENT_BUDGET times; it acknowledges each finished sequence in its next
request.  Now and then it reads a version from a random host, or replays
an old finished request (which must get its saved result or
RequestExpired).  Every reply goes through the world's `Checker`.
Randomness comes only from the world's seeded generator.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slates.fleet.config import Peer
from slates.fleet.invariants import InvariantViolated
from slates.fleet.ledger import RequestId, chunk_id
from slates.fleet.messages import Message, Read, ReadReply, Submit, SubmitReply
from slates.merge.ranges import Replace

if TYPE_CHECKING:
    from slates.fleet.world import World

__all__ = ["Client", "Clients", "CLIENT_RETRY", "CLIENT_BUDGET", "REQUESTS_PER_CLIENT"]

GREEN = "g"
CLIENT_RETRY = 12.0
CLIENT_BUDGET = 10
REQUESTS_PER_CLIENT = 6


@dataclasses.dataclass(slots=True)
class Client:
    name: str
    route: str
    hint: str
    seq: int = 0
    acked_through: int = 0
    base_version: int = 0
    finished: int = 0
    waiting: Submit | None = None
    sent_at: float = 0.0
    attempts: int = 0
    token: int = 0
    done: list[Submit] = dataclasses.field(default_factory=list)


class Clients:
    def __init__(self, world: World, routes: list[str]) -> None:
        self.world = world
        self.clients = [Client(f"c{i}", route, route) for i, route in enumerate(routes)]

    def get(self, name: str) -> Client:
        return self.clients[int(name[1:])]

    def act(self, client: Client) -> None:
        rng = self.world.rng
        self.world.schedule(rng.uniform(1, 6), "client", client.name)
        if client.waiting is not None:
            if not 0 <= self.world.now - client.sent_at < CLIENT_RETRY:
                client.attempts += 1
                if client.attempts > CLIENT_BUDGET:
                    client.waiting = None  # abandoned unresolved: its seq is never acknowledged
                    return
                if client.attempts % 2 == 0:
                    client.hint = rng.choice(self.world.hosts)  # another route, the same request id
                self._client_send(client, client.waiting)
            return
        roll = rng.random()
        if roll < 0.15:
            self._client_read(client)
        elif roll < 0.2 and client.done:
            # A stale retry of a finished request: its saved result or RequestExpired.
            old = rng.choice(client.done)
            self.world.send(client.name, client.hint, old)
        elif client.finished < REQUESTS_PER_CLIENT:
            self._client_submit(client)

    def _client_submit(self, client: Client) -> None:
        rng = self.world.rng
        content = self.world.checker.content(client.base_version)
        start = rng.randint(0, len(content))
        end = min(len(content), start + rng.randint(0, 3))
        data = bytes(rng.choice(b"abcdefgh") for _ in range(rng.randint(1, 4)))
        self.world.chunk_data[chunk_id(data)] = data
        scopes = ["restart", "host"] + (["region"] if self.world.mirror_hosts else [])
        client.seq += 1
        submit = Submit(
            Peer(client.name, ""),
            GREEN,
            RequestId(client.route, client.name, client.seq),
            client.acked_through,
            client.base_version,
            (Replace(start, end, data),),
            rng.choice(scopes),
            client.route,
        )
        self.world.checker.requested[submit.request] = submit.scope
        client.waiting = submit
        client.attempts = 0
        self._client_send(client, submit)

    def _client_send(self, client: Client, submit: Submit) -> None:
        client.sent_at = self.world.now
        self.world.send(client.name, client.hint, submit)

    def _client_read(self, client: Client) -> None:
        top = self.world.checker.acked_top()
        if top == 0:
            return
        client.token += 1
        host = self.world.rng.choice(self.world.hosts + self.world.mirror_hosts)
        version = self.world.rng.randint(1, top)
        self.world.send(
            client.name, host, Read(Peer(client.name, ""), GREEN, version, client.token)
        )

    def receive(self, client: Client, message: Message) -> None:
        match message:
            case SubmitReply():
                self._client_reply(client, message)
            case ReadReply():
                if message.error:
                    self.world.stats.reads_refused += 1
                else:
                    self.world.checker.served(message)
                    self.world.stats.reads_ok += 1
            case _:
                raise InvariantViolated(
                    f"seed {self.world.seed}: a client got {type(message).__name__}",
                    seed=self.world.seed,
                )

    def _client_reply(self, client: Client, reply: SubmitReply) -> None:
        request = reply.request
        if not reply.error:
            self.world.checker.acknowledged(reply)
        elif reply.error == "RequestExpired" and request.seq > client.acked_through:
            raise InvariantViolated(
                f"seed {self.world.seed}: unacknowledged {request} refused as expired",
                seed=self.world.seed,
            )
        waiting = client.waiting
        if waiting is None or waiting.request != request:
            return  # an answer to an earlier attempt or a stale retry
        if not reply.error:
            client.base_version = reply.version
            self._finish(client)
        elif reply.error == "NotOwner":
            client.hint = reply.redirect or self.world.rng.choice(self.world.hosts)
            client.sent_at = self.world.now - CLIENT_RETRY + 1.0  # retry soon, same request id
        elif reply.error in ("Conflict", "InvalidArgument"):
            client.base_version = self.world.checker.acked_top()
            self._finish(client)
        elif reply.error in ("CapacityExhausted", "RequestExpired"):
            pass  # retried on the usual schedule
        else:
            raise InvariantViolated(
                f"seed {self.world.seed}: unexpected submit error {reply.error}",
                seed=self.world.seed,
            )

    def _finish(self, client: Client) -> None:
        if client.waiting is not None:
            client.done.append(client.waiting)
            client.acked_through = client.waiting.request.seq
        client.waiting = None
        client.finished += 1
