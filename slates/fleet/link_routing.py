"""The fleet link's routing: forwards by ownership, QUIC requests in, peer requests out.

Theory of operation (DESIGN.md section 7; the process around it is
slates.fleet.link, the transport slates.fleet.link_forward).

Routing by ownership.  A forward names the host whose ids it carries
(`names`, the volume's original owner; the target host by default).  When
the cached configuration of the green such an id names (`<id>@<names>`)
has an owner on another host than the target, `forward` answers NotOwner
with `owner_host` and the client resends there (slates.fleet.link_client).
The serving link (`serve`) refuses the same way, and translates the ids
of a green it adopted into its local copy's (this host's own ids too, when
it adopted its own original green again after a failover and back; as another client id,
link_rules.adopted_client_id, since the client numbers its requests per
original host); new volumes it makes for such a request are answered as
`<id>@<this host>`.  A local client's forward to another host for a green
this host owns now (it took it over) is served here, not sent to the
green's old host.  Only the link routes by ownership: a local client of
a host's anchor reaches its shard directly: a submission there to a green
this host no longer owns is refused by the fence table (slates.fleet.fencing),
but a read of a superseded local id reads that old copy (known gap).

Requests arriving over QUIC (`handle_remote`: forwards, ledger messages
for slates.fleet.link_replicate, durability waits, remote work volume asks
for slates.fleet.link_remote) come from a host the handshake
authenticated against the fleet's CA; the link also requires that host to
be enrolled in etcd (AccessDenied otherwise; the enrolled hosts are
re-read at most every ENROLLED_REFRESH_SECONDS).  It cannot compare the
peer certificate's fingerprint with the HostRecord's (the transport hands
the handler only the host id): a re-issued certificate for an enrolled
host id is accepted.

A request to a host serf has declared failed (or left) is refused at once
with Unavailable (`peer_request`), and `on_verdict` drops the connection
to it when the verdict arrives, ending the requests in flight to it with
Unavailable too: the caller learns in milliseconds, not after the
transport's timeouts, and may go elsewhere.  Before serf's verdict a
forward to a dead host waits out its own timeout (forward_timeout, all
retries included).

Callers: slates.fleet.link (one Routing per link).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import trio

from slates.errors import (
    AccessDenied,
    InvalidArgument,
    NotFound,
    NotOwner,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.etcd import Council, HostRecord
from slates.fleet.hostconfig import parse_address
from slates.fleet.link_forward import PeerPool, ShardLines
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_rules import (
    Durable,
    Forward,
    RemoteForward,
    adopted_client_id,
    durable_payload,
    fleet_name,
    parse_remote,
    parse_remote_durable,
    remote_payload,
    volume_refs,
)
from slates.fleet.serf import MembershipWatch
from slates.node.protocol import pack, unpack

__all__ = ["ENROLLED_REFRESH_SECONDS", "Routing"]

ENROLLED_REFRESH_SECONDS: Final = 1.0

T = TypeVar("T")
CouncilCall = Callable[..., Awaitable[Any]]
ServeRemote = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class Routing:
    """One link's routing (module doc); `peers` is set once the link serves."""

    def __init__(
        self,
        me: str,
        council: Council,
        council_call: CouncilCall,
        lines: ShardLines,
        watch: MembershipWatch,
        *,
        forward_timeout: float,
        shard_timeout: float,
    ) -> None:
        self.me = me
        self.council = council
        self._council = council_call
        self.lines = lines
        self.watch = watch
        self.forward_timeout = forward_timeout
        self.shard_timeout = shard_timeout
        self.peers: PeerPool | None = None
        self.replicator: Replicator | None = None  # set by the link once it is made
        self.serve_remote: ServeRemote | None = None  # slates.fleet.link_remote's serve
        self._down: dict[str, trio.Event] = {}  # per host: set while serf says it is not alive
        self._enrolled: dict[str, HostRecord] = {}
        self._enrolled_at = -1e9

    def _replicator(self) -> Replicator:
        if self.replicator is None:
            raise Unavailable("the fleet link is not serving yet")
        return self.replicator

    # -- serf's verdicts

    def alive_hosts(self) -> set[str]:
        return {name for name, m in self.watch.known.items() if m.status == "alive"}

    def down_event(self, host: str) -> trio.Event:
        event = self._down.get(host)
        if event is None:
            event = self._down[host] = trio.Event()
            verdict = self.watch.known.get(host)
            if verdict is not None and verdict.status != "alive":
                event.set()
        return event

    def on_verdict(self, host: str, kind: str) -> None:
        """Serf's verdict on `host` changed: requests to a host not alive end now."""
        if kind == "alive":
            if self.down_event(host).is_set():
                self._down[host] = trio.Event()
        else:
            self.down_event(host).set()  # its requests end now
        if kind != "alive" and self.peers is not None:
            self.peers.drop(host)  # its connection is as dead

    # -- out

    async def peer_request(self, host: str, payload: bytes, timeout: float) -> bytes:
        """One request to a peer's link, given up at once when serf declares it failed
        (the caller learns then, not after the transport's timeouts)."""
        if self.peers is None:
            raise Unavailable("the fleet link is not serving yet")
        peers, down = self.peers, self.down_event(host)
        if down.is_set():
            verdict = self.watch.known.get(host)
            status = verdict.status if verdict is not None else "failed"
            raise Unavailable(f"serf declares the host {status}", host=host, serf=status)
        answer: list[bytes] = []
        failure: list[SlatesError] = []
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                try:
                    answer.append(await peers.request(host, payload, timeout=timeout))
                except SlatesError as exc:  # raised below as itself, not in a group
                    failure.append(exc)
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                await down.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(call)
            nursery.start_soon(watch)
        if failure:
            raise failure[0]
        if not answer:
            raise Unavailable("serf declares the host failed", host=host, serf="failed")
        return answer[0]

    async def resolve(self, host: str) -> tuple[str, int]:
        record = await self._council(self.council.host, host)
        if record is None:
            raise NotFound("that host is not enrolled in the fleet", host=host)
        return parse_address(record.quic_address, "quic_address")

    async def forward(self, request: Forward) -> bytes:
        replicator = self._replicator()
        names = request.names or request.host
        for local_id in volume_refs(request.request).values():
            owner = replicator.owner_elsewhere(fleet_name(names, local_id))
            if owner is not None and owner != request.host:
                # etcd has committed another owner: the client follows it (same request id).
                raise NotOwner(
                    "the green has another owner",
                    green=fleet_name(names, local_id),
                    owner_host=owner,
                )
        me = self.me
        refs = volume_refs(request.request).values()
        if request.host != me and refs and all(self._owned_here(names, r) for r in refs):
            # This host took the green over: serve it here (its old host may be gone).
            request = dataclasses.replace(request, host=me, names=names)
        if request.host == me:
            remote = RemoteForward(
                request.host,
                request.shard,
                request.client,
                request.request,
                "" if names == request.host else names,
            )
            return await self.serve(remote)
        if self.peers is None:
            raise Unavailable("the fleet link is not serving yet")
        # Fail fast: waiting out timeouts against a host serf declared gone helps nobody.
        return await self.peer_request(
            request.host, pack(remote_payload(request)), self.forward_timeout
        )

    def _owned_here(self, names: str, local_id: str) -> bool:
        replicator = self._replicator()
        config = replicator.configs.get(fleet_name(names, local_id))
        return config is not None and config.owner == replicator.me

    async def durable(self, request: Durable) -> dict[str, Any]:
        if request.host and request.host != self.me:
            raw = await self.peer_request(
                request.host, pack(durable_payload(request)), request.timeout + 10
            )
            result = unpack(raw)
            if not isinstance(result, dict):
                raise VerificationFailed("a durability answer is a map")
            return result
        return await self._replicator().durable(
            request.shard, request.work, request.version, request.scope, request.timeout
        )

    # -- in

    async def check_enrolled(self, host: str) -> None:
        if host in self._enrolled:
            return
        now = time.monotonic()
        if now - self._enrolled_at >= ENROLLED_REFRESH_SECONDS:
            records = await self._council(self.council.hosts)
            self._enrolled = {r.host: r for r in records}
            self._enrolled_at = now
        if host not in self._enrolled:
            raise AccessDenied("the peer host is not enrolled in the fleet", host=host)

    async def handle_remote(self, peer_host: str, payload: bytes) -> bytes:
        await self.check_enrolled(peer_host)
        message = unpack(payload)
        if not isinstance(message, dict):
            raise InvalidArgument("a fleet request is a map")
        match message.get("kind", "forward"):
            case "forward":
                return await self.serve(parse_remote(peer_host, message))
            case "ledger":
                return await self._replicator().handle_ledger(peer_host, message)
            case "durable":
                result = await self.durable(parse_remote_durable(message))
                return pack(result)
            case "remote" if self.serve_remote is not None:
                return pack(await self.serve_remote(peer_host, message))
            case kind:
                raise InvalidArgument("unknown fleet request kind", kind=str(kind))

    async def serve(self, forward: RemoteForward) -> bytes:
        """Run a forward on a shard of this host, its ids translated (module doc)."""
        replicator = self._replicator()
        names = forward.names or self.me
        me = self.me
        refs = volume_refs(forward.request)
        shard, args, translated = forward.shard, dict(forward.request.get("args") or {}), False
        for key, local_id in refs.items():
            name = fleet_name(names, local_id)
            owner = replicator.owner_elsewhere(name)
            if owner is not None and owner != me:  # etcd moved it on: even an adopted copy
                raise NotOwner("the green has another owner", green=name, owner_host=owner)
            adopted = replicator.adopted.get(name)
            # This host's own id, too, once it adopted that green again from the holders
            # (its original copy here is superseded: slates.fleet.fencing).
            if names != me or adopted is not None:
                if adopted is None and replicator.recovering(name):
                    raise Unavailable("the green is being recovered here", green=name)
                if adopted is None:
                    raise NotFound("this host serves no such volume of that host", volume=name)
                shard, args[key] = adopted
                translated = True
        if translated:
            # The client numbers its requests per (original host, shard): on this shard
            # they are another client than its requests for this host's own volumes.
            client = adopted_client_id(names, forward.client)
            request = {**forward.request, "args": args}
            forward = dataclasses.replace(forward, shard=shard, client=client, request=request)
        raw = await self.lines.run(forward, timeout=self.shard_timeout)
        if not translated:
            return raw
        reply = unpack(raw)
        result = reply.get("result") if isinstance(reply, dict) else None
        if reply.get("ok") is True and isinstance(result, dict):
            if isinstance(result.get("id"), str) and "@" not in result["id"]:
                result["id"] = fleet_name(me, result["id"])  # a new volume here is ours
            if isinstance(result.get("green"), str) and "@" not in result["green"]:
                result["green"] = replicator.name_of(result["green"], shard)
            return pack(reply)
        return raw
