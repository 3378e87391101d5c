"""The fleet link's serf membership and the takeovers it drives (DESIGN.md section 7).

Theory of operation.  `attach` (blocking: the link runs it in a thread at
start) attaches to the host's serf agent at serf_rpc_address when one
answers there (the testbed starts one), else starts one itself, joined to
the serf addresses of the enrolled hosts whose alive key holds the boot
they enrolled with (alone when that join fails); `stop` stops an agent
started here, by pid, when the link leaves.  A serf member's name is its
host id (the testbed's agents and ours are named so): that is how a verdict
is matched with an enrolled host.

`loop` polls the membership (slates.fleet.serf.MembershipWatch) every poll
interval: each verdict change is logged, kept in `events` (the last
MAX_EVENTS) and handed to routing (slates.fleet.link_routing's
`on_verdict`: requests to a failed host fail fast).  A failed verdict
starts a takeover (slates.fleet.link_replicate's `on_failed`: this host
takes over the greens the failed host owned if it is their chosen
successor, once the failed boot's lease lapsed, by one etcd transaction
comparing the old epoch, then recovery from the holders); a verdict only
starts it, etcd's transaction decides.

`takeover` is the operator's `{"op": "takeover", "green", "epoch"}`:
commit this host as the green's owner at epoch+1 and recover it, as a
failed verdict does; EpochFenced (with the committed owner) when etcd is
no longer at that epoch, InvalidArgument while serf sees the owner's host
alive (its shard would go on accepting submissions: no live moves yet).

Invariants.  Takeovers run in the link's nursery (`nursery`, set by the
link once it serves; a verdict seen before that is left to the next
start's first poll), so they end with the link; a takeover that fails with a
SlatesError is reported ("takeover"), not raised into the nursery.

Callers: slates.fleet.link (one Membership per link).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

import trio

from slates.errors import InvalidArgument, SlatesError
from slates.fleet.etcd import Council
from slates.fleet.hostconfig import HostConfig
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_routing import Routing
from slates.fleet.serf import MemberEvent, MembershipWatch, SerfAgent

__all__ = ["MAX_EVENTS", "Membership"]

MAX_EVENTS: Final = 64

Report = Callable[[str, BaseException | None], None]


class Membership:
    """One link's serf agent, verdicts and takeovers (module doc)."""

    def __init__(
        self,
        config: HostConfig,
        boot_id: str,
        council: Council,
        watch: MembershipWatch,
        routing: Routing,
        replicator: Replicator,
        *,
        data_dir: Path,
        profile: Literal["lan", "local", "wan"],
        poll_interval: float,
        report: Report,
        log: Callable[[str], None],
    ) -> None:
        self.config = config
        self.boot_id = boot_id
        self.council = council
        self.watch = watch
        self.routing = routing
        self.replicator = replicator
        self.data_dir = data_dir
        self.profile: Literal["lan", "local", "wan"] = profile
        self.poll_interval = poll_interval
        self._report = report
        self._log = log
        self.serf_agent: SerfAgent | None = None
        self.events: collections.deque[MemberEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.nursery: trio.Nursery | None = None  # the link's, once it serves

    # -- the serf agent

    def attach(self) -> None:
        try:
            self.watch.client.members()
            self._log(f"attached to the serf agent at {self.config.serf_rpc_address}")
            return
        except SlatesError:
            pass  # nobody answers there: this link runs the host's agent
        alive = self.council.alive_hosts()
        joins = [
            r.serf_address
            for r in self.council.hosts()
            if r.host != self.config.host_id and alive.get(r.host) == r.boot_id
        ]
        try:
            self.serf_agent = self._start_serf(joins)
        except SlatesError as exc:
            if not joins:
                raise
            self._log(f"serf could not join {joins} ({exc.message}); starting alone")
            joins = []
            self.serf_agent = self._start_serf(joins)
        self._log(f"started a serf agent (pid {self.serf_agent.pid}), joined {joins}")

    def _start_serf(self, joins: list[str]) -> SerfAgent:
        return SerfAgent.start(
            self.config.host_id,
            self.config.serf_address,
            self.config.serf_rpc_address,
            {"boot": self.boot_id},
            joins,
            data_dir=self.data_dir,
            profile=self.profile,
        )

    def stop(self) -> None:
        if self.serf_agent is not None:
            self.serf_agent.stop()

    # -- verdicts and takeovers

    async def loop(self) -> None:
        while True:
            try:
                for event in await trio.to_thread.run_sync(self.watch.poll):
                    self.events.append(event)
                    self._log(f"serf: {event.member.name} {event.kind}")
                    self.routing.on_verdict(event.member.name, event.kind)
                    if event.kind == "failed" and self.nursery is not None:
                        # A verdict only starts a takeover; etcd's transaction decides it.
                        self.nursery.start_soon(self._on_failed, event.member.name)
                self._report("membership", None)
            except SlatesError as exc:
                self._report("membership", exc)
            await trio.sleep(self.poll_interval)

    async def _on_failed(self, host: str) -> None:
        nursery = self.nursery
        if nursery is None:
            return  # not serving yet: the first poll of the next start sees the verdict
        try:
            await self.replicator.on_failed(host, nursery.start_soon)
        except SlatesError as exc:
            self._report("takeover", exc)

    async def takeover(self, green: str, epoch: int) -> dict[str, Any]:
        """The operator's takeover of `green` from `epoch` (module doc)."""
        current = await self.replicator.config(green, epoch)
        verdict = self.watch.known.get(current.owner.host)
        alive = verdict is not None and verdict.status == "alive"
        if alive and current.epoch == epoch and current.owner.host != self.config.host_id:
            # Its shard would go on accepting submissions: no live moves yet.
            raise InvalidArgument(
                "the owner's host is alive; a takeover follows a failed verdict",
                green=green,
                owner_host=current.owner.host,
            )
        return await self.replicator.take_over(green, epoch)
