"""The fleet link's lease in etcd and the fence table it proves (DESIGN.md section 7).

Theory of operation.  `LeaseKeeper.join` enrolls the host in etcd (its
HostRecord: certificate fingerprint, failure domain, QUIC and serf
addresses, this start's boot id) and puts its alive key under a lease of
`ttl` seconds.  `keepalive_loop` renews the lease every ttl/3; a failed
keepalive is tried again after KEEPALIVE_RETRY (the fence's proof runs out
at the TTL), and a lapsed lease (NotFound, e.g. after a long etcd outage)
is replaced by a new one holding the alive key again.

Fencing (the rules are slates.fleet.fencing's, the file
slates.fleet.link_fence's): `fence_loop` rewrites RUNTIME/fleet-fence.msgpack
every FENCE_INTERVAL when it changed: per green with a local copy here,
whether etcd's configuration (the replicator's cache) names this boot as
owner, read since the current lease was granted, and until when the lease's
last keepalive proves this host alive in etcd (`until`: the keepalive's
send time plus the TTL, less a margin).  The shards read it before they
make a version (slates.node.green_ops's submit): an owner that is cut off
(its keepalives fail, so `until` passes; a successor can commit only after
the lease lapsed) or superseded (etcd names another owner) refuses new
submissions with EpochFenced, or NotOwner naming the committed owner, and a
link that dies stops renewing `until`.  A green being recovered here has no
local copy in the table until it is adopted, and this host's original copy
of a green it adopted (or is adopting) again is listed as superseded.

Invariants.  `lease_proven_until` only grows while one lease lives (a keepalive
never shortens the proof); it is reset from the send time when a new lease
is granted.  `lease_since` is math.inf from the moment a new lease is asked for
until the alive key is under it: configurations read before then prove
nothing (a successor may have committed meanwhile).  `leave` writes the
table with `until` 0 before it revokes the lease, so no shard here makes a
version once a successor may take over.

Callers: slates.fleet.link (one LeaseKeeper per link: `join` at start, the
two loops in its nursery, `leave` at exit, from a thread).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from slates.errors import NotFound, SlatesError
from slates.fleet.etcd import Council, HostRecord, Lease
from slates.fleet.fencing import build_table, lease_until
from slates.fleet.link_fence import FenceWriter
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_rules import split_fleet_name
from slates.node.protocol import shard_of

__all__ = ["FENCE_INTERVAL", "KEEPALIVE_RETRY", "LeaseKeeper"]

KEEPALIVE_RETRY: Final = 0.5  # seconds before a failed keepalive is tried again
FENCE_INTERVAL: Final = 0.25  # seconds between rebuilds of the fence table

CouncilCall = Callable[..., Awaitable[Any]]
Report = Callable[[str, BaseException | None], None]


class LeaseKeeper:
    """One link's lease and fence table (module doc)."""

    def __init__(
        self,
        record: HostRecord,
        ttl: int,
        council: Council,
        council_call: CouncilCall,
        replicator: Replicator,
        fence: FenceWriter,
        report: Report,
        log: Callable[[str], None],
    ) -> None:
        self.record = record
        self.ttl = ttl
        self.council = council
        self._council = council_call
        self.replicator = replicator
        self.fence = fence
        self._report = report
        self._log = log
        self.lease: Lease | None = None
        # Fencing (slates.fleet.fencing): when the current lease was granted and until
        # when its last keepalive proves it alive (monotonic seconds).
        self.lease_since = 0.0
        self.lease_proven_until = 0.0

    @property
    def lease_ttl(self) -> float:
        return float(self.ttl)

    async def join(self) -> None:
        """Enroll this host and put its alive key under a new lease."""
        await self._council(self.council.enroll_host, self.record)
        sent = time.monotonic()
        self.lease = await self._council(self.council.grant_lease, self.ttl)
        self.lease_proven_until = lease_until(sent, self.lease_ttl)
        await self._council(
            self.council.mark_alive, self.record.host, self.record.boot_id, self.lease
        )
        self.lease_since = time.monotonic()
        self._log(f"{self.record.host} enrolled with boot {self.record.boot_id}")

    async def keepalive_loop(self) -> None:
        interval = self.ttl / 3
        pause = interval
        while True:
            await trio.sleep(pause)
            # A failed keepalive is tried again soon: the fence's proof runs out at the TTL.
            pause = min(interval, KEEPALIVE_RETRY)
            try:
                if self.lease is None:
                    raise NotFound("no lease yet")
                sent = time.monotonic()
                await self._council(self.council.keepalive, self.lease)
                self.lease_proven_until = max(
                    self.lease_proven_until, lease_until(sent, self.lease_ttl)
                )
                pause = interval
                self._report("keepalive", None)
            except NotFound:
                try:
                    # A new lease: what etcd said before our alive key is back under it
                    # proves nothing (a successor may have committed meanwhile: fencing.py).
                    self.lease_since = math.inf
                    sent = time.monotonic()
                    lease = await self._council(self.council.grant_lease, self.ttl)
                    self.lease_proven_until = lease_until(sent, self.lease_ttl)
                    await self._council(
                        self.council.mark_alive, self.record.host, self.record.boot_id, lease
                    )
                    self.lease_since = time.monotonic()
                    self.lease = lease
                    pause = interval
                    self._log("the lease had lapsed: a new one holds the alive key")
                except SlatesError as exc:
                    self._report("keepalive", exc)
            except SlatesError as exc:
                self._report("keepalive", exc)

    async def fence_loop(self) -> None:
        """Keep RUNTIME/fleet-fence.msgpack current for this host's shards (fencing.py)."""
        while True:
            try:
                self.write_fence()
                self._report("fencing", None)
            except (OSError, SlatesError) as exc:
                self._report("fencing", exc)
            await trio.sleep(FENCE_INTERVAL)

    def write_fence(self) -> None:
        replicator = self.replicator

        def local_of(green: str) -> tuple[int, str] | None:
            if replicator.recovering(green) and green not in replicator.adopted:
                return None  # its copy here is being made; the old one is superseded
            try:
                return replicator.local_of(green)
            except NotFound:
                return None

        # Our original copy of a green adopted (or being adopted) again here.
        superseded = []
        for name in [*replicator.adopted, *replicator.configs]:
            host, local = split_fleet_name(name)
            if host == replicator.me.host and (
                name in replicator.adopted or replicator.recovering(name)
            ):
                superseded.append((shard_of(local), local))
        table = build_table(
            replicator.me,
            replicator.configs.values(),
            local_of,
            self.lease_proven_until,
            self.lease_since,
            replicator.configs_read_at,
            superseded,
        )
        self.fence.write(table)

    def leave(self) -> None:
        """Best effort, at exit (blocking: from a thread): fence, then revoke the lease."""
        try:  # our lease is revoked: a successor may take over at once (fencing.py)
            self.lease_proven_until = 0.0
            self.write_fence()
        except (OSError, SlatesError) as exc:
            self._log(f"could not fence this host's greens: {exc}")
        if self.lease is not None:
            try:
                self.council.revoke_lease(self.lease)
            except SlatesError as exc:
                self._log(f"could not revoke the lease: {exc.message}")
