"""The fleet link's registration of its host's greens in etcd (DESIGN.md section 7).

Theory of operation.  About once a poll interval `loop` runs
`register_greens`: it lists the volumes of every serving shard (through the
link's own client, `shard_call`) and creates, only if absent, a GreenConfig
in etcd for each green it has not registered yet
(slates.fleet.link_rules.first_config: owned by this host and boot at
epoch 1, its holder candidates chosen among the enrolled hosts, those etcd
holds alive first: link_rules' Placement).  A green whose name etcd
already gives to another owner (a volume id reused after a RAM loss, whose
old green another host took over) is not taken back: it is reported in
`conflicts`.  A green deleted here keeps its etcd configuration (not
removed yet).  Left out: greens a shard is importing (a recovery's copy in
the making, slates.fleet.link_tree) and the local copies of greens this
host adopted, which are served under their original fleet names.

Invariants.  A name enters `registered` once, whether etcd took this
host's configuration or named another owner, and is not asked about again
while the link lives.  Bounds: at most MAX_GREENS_PER_POLL creations per
pass; at most MAX_REGISTERED names remembered, past which a pass raises
CapacityExhausted (reported by the loop, retried at the next interval).

Callers: slates.fleet.link (one Registrar per link, its `loop` in the
link's nursery; `registered` and `conflicts` for the `hosts` listing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from slates.errors import CapacityExhausted, SlatesError, VerificationFailed
from slates.fleet.config import Peer
from slates.fleet.etcd import Council, HostRecord
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_rules import first_config, fleet_name
from slates.node.runtime import Runtime

__all__ = ["MAX_GREENS_PER_POLL", "MAX_REGISTERED", "Registrar"]

MAX_GREENS_PER_POLL: Final = 64
MAX_REGISTERED: Final = 1 << 16

CouncilCall = Callable[..., Awaitable[Any]]
ShardCall = Callable[[int, str, dict[str, Any]], Awaitable[Any]]
Report = Callable[[str, BaseException | None], None]


class Registrar:
    """One link's registration of greens (module doc)."""

    def __init__(
        self,
        record: HostRecord,
        runtime: Runtime,
        council: Council,
        council_call: CouncilCall,
        shard_call: ShardCall,
        replicator: Replicator,
        poll_interval: float,
        report: Report,
        log: Callable[[str], None],
    ) -> None:
        self.record = record
        self.runtime = runtime
        self.council = council
        self._council = council_call
        self._own_request = shard_call
        self.replicator = replicator
        self.poll_interval = poll_interval
        self._report = report
        self._log = log
        self.registered: set[str] = set()
        self.conflicts: dict[str, str] = {}

    async def loop(self) -> None:
        while True:
            try:
                await self.register_greens()
                self._report("registration", None)
            except SlatesError as exc:
                self._report("registration", exc)
            await trio.sleep(self.poll_interval)

    async def register_greens(self) -> int:
        """One registration pass (module doc); returns how many greens it registered."""
        state = self.runtime.read_state()
        greens: list[str] = []
        for info in state.shards:
            if info.state != "serving":
                continue
            volumes = await self._own_request(info.index, "volume.list", {})
            if not isinstance(volumes, list):
                raise VerificationFailed("volume.list answered something other than a list")
            adopted = {local for _, local in self.replicator.adopted.values()}
            greens += [
                str(v["id"])
                for v in volumes
                if isinstance(v, dict)
                and v.get("role") == "green"
                and v.get("name") not in self.replicator.trees.importing
                and v.get("id") not in adopted  # served under its original fleet name
            ]
        pending = [g for g in greens if fleet_name(self.record.host, g) not in self.registered]
        if not pending:
            return 0
        if len(self.registered) + len(pending) > MAX_REGISTERED:
            raise CapacityExhausted("more greens than the link remembers", limit=MAX_REGISTERED)
        enrolled = await self._council(self.council.hosts)
        alive = await self._council(self.council.alive_hosts)
        own = Peer(self.record.host, self.record.boot_id)
        done = 0
        for local_id in pending[:MAX_GREENS_PER_POLL]:
            name = fleet_name(self.record.host, local_id)
            config = first_config(name, self.record, enrolled, alive)
            if not await self._council(self.council.create_green, config):
                existing = await self._council(self.council.green, name)
                if existing is not None and existing.owner != own:
                    owner = f"{existing.owner.host} boot {existing.owner.boot}"
                    self.conflicts[name] = f"etcd names another owner: {owner}"
                    self._log(f"green {name}: {self.conflicts[name]}; not registered")
            else:
                self._log(f"registered green {name} (holders f={config.holders.f})")
            self.registered.add(name)
            done += 1
        return done
