"""The fleet link: the process that joins one host to the fleet (DESIGN.md section 7).

Theory of operation.  `python -m slates.fleet.link --config FILE
--runtime-dir DIR` runs beside the anchor (which starts and supervises
it) and is the host's only speaker to other hosts.  At start it

1. reads the host's fleet config (slates.fleet.hostconfig) and loads its
   credentials (slates.fleet.pki.load_credentials); the certificate must
   name the configured host id;
2. enrolls in etcd (slates.fleet.etcd.Council): a HostRecord with the
   certificate's fingerprint, the failure domain, the QUIC and serf
   addresses and a boot id made fresh at every start (a host that lost its
   RAM comes back as a new identity that holds nothing);
3. puts its alive key under a lease (LinkOptions.lease_ttl, or the host
   config's lease_ttl when --lease-ttl is not given) and keeps the lease
   alive (a lapsed lease, e.g. after a long etcd outage, is replaced by a
   new one);
4. attaches to the host's serf agent at serf_rpc_address when one answers
   there (the testbed starts one), else starts one itself (joined to the
   enrolled hosts' serf addresses, stopped by pid when the link ends), and
   polls its membership (slates.fleet.serf.MembershipWatch): each verdict
   change is logged and kept (the last MAX_EVENTS).  A serf member's name
   is its host id (the testbed's agents and ours are named so): that is how
   a verdict is matched with an enrolled host;
5. serves QUIC on quic_address (slates.fleet.quic.serve) for forwards from
   enrolled peers, and RUNTIME/fleet.sock (mode 0600) for local clients;
6. registers greens: about once a second it lists its shards' volumes and
   creates, only if absent, a GreenConfig in etcd for each green it has not
   registered (slates.fleet.link_rules.first_config: owned by this host and
   boot at epoch 1).  A green whose name etcd already gives to another
   owner (a volume id reused after a RAM loss, whose old green another
   host took over) is not taken back: it is reported in `conflicts`.  A
   green deleted here keeps its etcd configuration (not removed yet);
7. replicates (slates.fleet.link_replicate, whose docstring has the
   details): about once a second it reads every green's configuration
   from etcd (the cache the routing below uses), ships each new version
   of the greens this host owns to their holder candidates, and holds,
   in RAM, what other owners ship here; on serf's failed verdict for a
   host it takes over the greens that host owned if it is their chosen
   successor (one etcd transaction comparing the old epoch, then
   recovery from the holders), and serves them under their fleet names.

fleet.sock (slates.fleet.link_local) takes these requests:

- `{"op": "forward", "host": H, "shard": N, "client": C, "request": R}`: run
  wire request R on host H's shard N as client C; the result is the
  shard's reply bytes (slates.fleet.link_forward; a request for this host
  runs here directly, under the same identity rules);
- `{"op": "hosts"}`: this host and boot, etcd's enrolled hosts with their
  lease and serf's verdict (link_rules.host_listing), recent serf events;
- `{"op": "owner", "green": NAME}`: etcd's configuration of green NAME
  (owner host and boot, epoch, revision, holders), NotFound without one;
- `{"op": "durable", "host": H, "shard": N, "work": ID, "version": V,
  "scope": S, "timeout": T}`: wait (at most T s) until version V of work
  volume ID's green reaches scope S ("restart", "host", "region") and
  answer `{"durability", "scopes", ...}`; H ("" for this host) is where
  the work volume lives, whose link does the waiting;
- `{"op": "remote.tree" | "remote.chunks" | "remote.submit" | "remote.stats" |
  "remote.damage" | "remote.drop_replies", ...}`: remote work volumes, a
  shard's asks for another host's green version (its tree record, its
  pieces: slates.fleet.link_remote; a submission, run once on the owner:
  slates.fleet.link_submit; peers ask each other as `{"kind": "remote"}`
  over QUIC);
- `{"op": "takeover", "green": NAME, "epoch": E}`: commit this host as
  NAME's owner at E+1 and recover it, as a failed verdict does;
  EpochFenced (with the committed owner) when etcd is no longer at E,
  InvalidArgument while serf sees the owner's host alive (its shard
  would go on accepting submissions: no live moves yet).

Routing by ownership, the trust in QUIC peers and failing fast against a
host serf declared failed are slates.fleet.link_routing's; the framing and
bounds of fleet.sock are slates.fleet.link_local's.

Only the operator's requests are forwarded this session (link_forward's
docstring): an agent's principal does not yet travel between hosts.
Fencing (slates.fleet.fencing, slates.fleet.link_fence): a fence loop
rewrites RUNTIME/fleet-fence.msgpack every FENCE_INTERVAL when it changed:
per green with a local copy here, whether etcd's configuration names this
boot as owner (read since the current lease was granted), and until when
the lease's last keepalive proves this host alive in etcd (`until`: the
keepalive's send time plus the TTL, less a margin).  The shards read it
before they make a version (slates.node.green_ops's submit): an owner that
is cut off (its keepalives fail, so `until` passes; a successor can commit
only after the lease lapsed) or superseded (etcd names another owner)
refuses new submissions with EpochFenced, or NotOwner naming the committed
owner, and a link that dies stops renewing `until`.  At leave the table is
rewritten with `until` 0 before the lease is revoked; the anchor removes a
leftover table when it starts.

Bounds: local connections and frames (link_local), QUIC requests and
replies (LINK_LIMITS: 17 MiB, enough for a shard's largest read), peers
and forwarding lines (link_forward),
etcd threads (ETCD_THREADS at once), greens created per poll
(MAX_GREENS_PER_POLL) and greens remembered (MAX_REGISTERED, then the
registration loop reports CapacityExhausted), serf events kept
(MAX_EVENTS).  A failed poll (etcd, serf or a shard not answering) is
logged once per distinct error and retried at the next interval.

The link ends with its anchor: when the anchor whose state file it first
read is no longer alive, or another anchor's pid stands there (a restart:
the RAM and its volumes are gone), it leaves as below, so the host's boot
id is never kept alive by a link that outlived its volumes.  A new anchor
starts a new link, with a new boot id.

On SIGTERM or SIGINT the link revokes its lease (peers see it gone from
etcd at once), stops a serf agent it started, removes fleet.sock and its
state file and exits 0.  RUNTIME/fleet-link.json (pid, host, boot id,
QUIC port) is written once everything serves: it says the link is ready.
One link runs per runtime directory: a second one is refused
(AlreadyExists) by an exclusive lock on RUNTIME/fleet-link.lock, held
until the first one's process ends, before it touches anything.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import json
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import trio

from slates.errors import (
    AlreadyExists,
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    SlatesError,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.config import GreenConfig, HolderSet, Peer
from slates.fleet.etcd import Council, HostRecord, Lease
from slates.fleet.fencing import build_table, lease_until
from slates.fleet.hostconfig import HostConfig, load_host_config
from slates.fleet.link_fence import FenceWriter
from slates.fleet.link_forward import PeerPool, ShardLines
from slates.fleet.link_local import LocalSocket
from slates.fleet.link_remote import RemoteReads
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_routing import Routing
from slates.fleet.link_rules import (
    Durable,
    Forward,
    LocalRequest,
    RemoteForward,
    Takeover,
    first_config,
    fleet_name,
    host_listing,
    parse_local,
    split_fleet_name,
)
from slates.fleet.pki import HostCredentials, load_credentials
from slates.fleet.quic import TransportLimits, serve
from slates.fleet.serf import MemberEvent, MembershipWatch, SerfAgent, SerfClient
from slates.node.protocol import shard_of, unpack
from slates.node.runtime import Runtime, pid_alive

__all__ = ["FleetLink", "LinkOptions", "SOCKET_NAME", "STATE_NAME", "main", "run_link"]

SOCKET_NAME: Final = "fleet.sock"
STATE_NAME: Final = "fleet-link.json"
LOCK_NAME: Final = "fleet-link.lock"
# A shard answers at most 16 MiB per read (and the SDK reads 8 MiB pieces): requests and
# replies up to 17 MiB cross, with fewer streams per connection to bound what is buffered
# (32 x 17 MiB per connection at worst).  Every link uses these, so both ends agree.
LINK_LIMITS: Final = TransportLimits(
    max_concurrent_streams=32, max_request_bytes=17 << 20, max_reply_bytes=17 << 20
)
MAX_EVENTS: Final = 64
MAX_GREENS_PER_POLL: Final = 64
MAX_REGISTERED: Final = 1 << 16
ETCD_THREADS: Final = 4
KEEPALIVE_RETRY: Final = 0.5  # seconds before a failed keepalive is tried again
FENCE_INTERVAL: Final = 0.25  # seconds between rebuilds of the fence table

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class LinkOptions:
    lease_ttl: int = 10
    poll_interval: float = 1.0
    forward_timeout: float = 30.0  # one forwarded request, end to end
    shard_timeout: float = 25.0  # the serving side's share of it
    serf_profile: Literal["lan", "local", "wan"] = "lan"
    hold_bytes: int = 512 << 20  # what this host's holder keeps of other owners' versions

    def __post_init__(self) -> None:
        if self.lease_ttl < 2 or self.poll_interval <= 0:
            raise InvalidArgument("the lease lives 2 s or more and polls have an interval")
        if not 0 < self.shard_timeout < self.forward_timeout:
            raise InvalidArgument("the shard's timeout is within the forward's")
        if self.serf_profile not in ("lan", "local", "wan"):
            raise InvalidArgument("serf profiles are lan, local and wan")


DEFAULTS: Final = LinkOptions()


def _log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    print(f"fleet link: {stamp} {message}", file=sys.stderr, flush=True)


def _config_view(config: GreenConfig) -> dict[str, Any]:
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


class FleetLink:
    """One host's link (module doc); `run` until cancelled."""

    def __init__(
        self,
        config: HostConfig,
        runtime: Runtime,
        creds: HostCredentials,
        council: Council,
        options: LinkOptions | None = None,
    ) -> None:
        if creds.host_id != config.host_id:
            raise VerificationFailed(
                "the certificate names another host", config=config.host_id, cert=creds.host_id
            )
        self.config = config
        self.runtime = runtime
        self.creds = creds
        self.council = council
        self.options = options or LinkOptions()
        self.boot_id = uuid.uuid4().hex
        self.record = HostRecord(
            host=config.host_id,
            fingerprint=creds.fingerprint,
            failure_domain=config.failure_domain,
            boot_id=self.boot_id,
            quic_address=config.quic_address,
            serf_address=config.serf_address,
        )
        self.lines = ShardLines(runtime)
        self.watch = MembershipWatch(SerfClient(config.serf_rpc_address))
        self.routing = Routing(
            config.host_id,
            council,
            self._council,
            self.lines,
            self.watch,
            forward_timeout=self.options.forward_timeout,
            shard_timeout=self.options.shard_timeout,
        )
        self.local = LocalSocket(runtime.path / SOCKET_NAME, self.local_request)
        self.serf_agent: SerfAgent | None = None
        self.events: collections.deque[MemberEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.registered: set[str] = set()
        self.conflicts: dict[str, str] = {}
        self.lease: Lease | None = None
        # Fencing (slates.fleet.fencing): when the current lease was granted and until
        # when its last keepalive proves it alive (monotonic seconds).
        self.lease_since = 0.0
        self.lease_proven_until = 0.0
        self.fence = FenceWriter(runtime.path)
        self.quic_port = 0
        self._etcd = trio.CapacityLimiter(ETCD_THREADS)
        self._last_error: dict[str, str] = {}
        self._own_seq = 0
        self.ended = trio.Event()  # the anchor is gone: the link ends with it
        self.anchor_pid: int | None = None
        self._lock_fd: int | None = None
        self._own_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self.replicator = Replicator(
            Peer(config.host_id, self.boot_id),
            self.options.hold_bytes,
            runtime.path,
            self._own_request,
            self.routing.peer_request,
            self._council,
            council,
            self.routing.alive_hosts,
            _log,
        )
        self.routing.replicator = self.replicator
        self.remote = RemoteReads(
            config.host_id,
            self.boot_id,
            self.replicator,
            self.routing.peer_request,
            self.routing.forward,
            self.routing.alive_hosts,
        )
        self.routing.serve_remote = self.remote.serve

    @property
    def peers(self) -> PeerPool | None:
        return self.routing.peers

    @property
    def socket_path(self) -> Path:
        return self.runtime.path / SOCKET_NAME

    @property
    def state_path(self) -> Path:
        return self.runtime.path / STATE_NAME

    async def _council(self, call: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(call, *args, limiter=self._etcd)

    def _report(self, loop: str, error: BaseException | None) -> None:
        """Log a loop's failure once per distinct message, and its recovery."""
        text = "" if error is None else f"{type(error).__name__}: {error}"
        if text != self._last_error.get(loop, ""):
            _log(f"{loop}: {text}" if text else f"{loop}: recovered")
            self._last_error[loop] = text

    # -- start and stop

    async def _join_fleet(self) -> None:
        await self._council(self.council.enroll_host, self.record)
        sent = time.monotonic()
        self.lease = await self._council(self.council.grant_lease, self.options.lease_ttl)
        self.lease_proven_until = lease_until(sent, self.lease_ttl)
        await self._council(self.council.mark_alive, self.config.host_id, self.boot_id, self.lease)
        self.lease_since = time.monotonic()
        _log(f"{self.config.host_id} enrolled with boot {self.boot_id}")

    def _attach_serf(self) -> None:
        try:
            self.watch.client.members()
            _log(f"attached to the serf agent at {self.config.serf_rpc_address}")
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
            _log(f"serf could not join {joins} ({exc.message}); starting alone")
            joins = []
            self.serf_agent = self._start_serf(joins)
        _log(f"started a serf agent (pid {self.serf_agent.pid}), joined {joins}")

    def _start_serf(self, joins: list[str]) -> SerfAgent:
        return SerfAgent.start(
            self.config.host_id,
            self.config.serf_address,
            self.config.serf_rpc_address,
            {"boot": self.boot_id},
            joins,
            data_dir=self.runtime.path / "fleet-serf",
            profile=self.options.serf_profile,
        )

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "host": self.config.host_id,
            "boot_id": self.boot_id,
            "quic_port": self.quic_port,
            "socket": str(self.socket_path),
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def _leave(self) -> None:
        """Best effort, at exit: the lease revoked, our serf agent stopped, our files gone."""
        for path in (self.socket_path, self.state_path):
            path.unlink(missing_ok=True)
        try:  # our lease is revoked: a successor may take over at once (fencing.py)
            self.lease_proven_until = 0.0
            self.write_fence()
        except (OSError, SlatesError) as exc:
            _log(f"could not fence this host's greens: {exc}")
        if self.lease is not None:
            try:
                self.council.revoke_lease(self.lease)
            except SlatesError as exc:
                _log(f"could not revoke the lease: {exc.message}")
        if self.serf_agent is not None:
            self.serf_agent.stop()

    def take_the_lock(self) -> None:
        """One link per runtime directory: an exclusive lock held for the process's life."""
        fd = os.open(self.runtime.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyExists(
                "a fleet link runs on this runtime directory", runtime=str(self.runtime.path)
            ) from None
        self._lock_fd = fd  # closed (and so released) only when the process ends

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._lock_fd is None:
            self.take_the_lock()
        try:
            await self._join_fleet()
            await trio.to_thread.run_sync(self._attach_serf)
            async with trio.open_nursery() as nursery:
                peers = PeerPool(self.creds, self.routing.resolve, nursery, limits=LINK_LIMITS)
                self.routing.peers = peers
                bind = self.config.quic_endpoint
                async with serve(
                    bind, self.creds, self.routing.handle_remote, limits=LINK_LIMITS
                ) as server:
                    self.quic_port = server.port
                    nursery.start_soon(self._keepalive_loop)
                    nursery.start_soon(self._fence_loop)
                    nursery.start_soon(self._membership_loop)
                    nursery.start_soon(self._register_loop)
                    nursery.start_soon(self._ship_loop)
                    self._nursery = nursery
                    nursery.start_soon(self._anchor_loop)
                    await nursery.start(self.local.serve)
                    self._write_state()
                    _log(f"serving QUIC on {bind[0]}:{server.port} and {self.socket_path}")
                    task_status.started()
                    try:
                        await self.ended.wait()
                        nursery.cancel_scope.cancel()
                    finally:
                        peers.close()
        finally:
            self.lines.close()  # trio sockets close in trio's thread
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._leave)

    # -- loops

    async def _keepalive_loop(self) -> None:
        interval = self.options.lease_ttl / 3
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
                    lease = await self._council(self.council.grant_lease, self.options.lease_ttl)
                    self.lease_proven_until = lease_until(sent, self.lease_ttl)
                    await self._council(
                        self.council.mark_alive, self.config.host_id, self.boot_id, lease
                    )
                    self.lease_since = time.monotonic()
                    self.lease = lease
                    pause = interval
                    _log("the lease had lapsed: a new one holds the alive key")
                except SlatesError as exc:
                    self._report("keepalive", exc)
            except SlatesError as exc:
                self._report("keepalive", exc)

    @property
    def lease_ttl(self) -> float:
        return float(self.options.lease_ttl)

    async def _fence_loop(self) -> None:
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

    async def _membership_loop(self) -> None:
        while True:
            try:
                for event in await trio.to_thread.run_sync(self.watch.poll):
                    self.events.append(event)
                    _log(f"serf: {event.member.name} {event.kind}")
                    self.routing.on_verdict(event.member.name, event.kind)
                    if event.kind == "failed" and self._nursery is not None:
                        # A verdict only starts a takeover; etcd's transaction decides it.
                        self._nursery.start_soon(self._on_failed, event.member.name)
                self._report("membership", None)
            except SlatesError as exc:
                self._report("membership", exc)
            await trio.sleep(self.options.poll_interval)

    async def _anchor_loop(self) -> None:
        """End with the anchor: once the anchor whose state file we first read is gone (or
        another anchor took its place), this boot's RAM is gone, and so is this boot."""
        while True:
            try:
                pid: int | None = self.runtime.read_state().pid
            except InvalidArgument:  # NotFound among them: no anchor (yet, or any more)
                pid = None
            if self.anchor_pid is None:
                self.anchor_pid = pid
            elif not pid_alive(self.anchor_pid) or pid not in (None, self.anchor_pid):
                _log(f"the anchor (pid {self.anchor_pid}) is gone: leaving the fleet")
                self.ended.set()
                return
            await trio.sleep(self.options.poll_interval)

    async def _on_failed(self, host: str) -> None:
        nursery = self._nursery
        if nursery is None:
            return  # not serving yet: the first poll of the next start sees the verdict
        try:
            await self.replicator.on_failed(host, nursery.start_soon)
        except SlatesError as exc:
            self._report("takeover", exc)

    async def _ship_loop(self) -> None:
        """Ship every new version of the greens this host owns to their holders."""
        while True:
            try:
                await self.replicator.refresh()
                owned = [
                    name
                    for name, config in self.replicator.configs.items()
                    if config.owner == self.replicator.me
                ]
                await self.replicator.ship_all(owned)
                self._report("shipping", None)
            except SlatesError as exc:
                self._report("shipping", exc)
            await trio.sleep(self.options.poll_interval)

    async def _register_loop(self) -> None:
        while True:
            try:
                await self.register_greens()
                self._report("registration", None)
            except SlatesError as exc:
                self._report("registration", exc)
            await trio.sleep(self.options.poll_interval)

    async def _own_request(self, shard: int, op: str, args: dict[str, Any]) -> Any:
        """A request of the link's own client on a local shard, one at a time (the
        registration's listings; the replication's exports, imports and replays)."""
        async with self._own_lock:
            self._own_seq += 1
            client = f"fleet-link-{self.boot_id[:16]}"
            forward = RemoteForward(
                self.config.host_id,
                shard,
                client,
                {"seq": self._own_seq, "ack": self._own_seq - 1, "op": op, "args": args},
            )
            raw = await self.lines.run(forward, timeout=self.options.shard_timeout)
        reply = unpack(raw)
        if reply.get("ok") is not True:
            error = reply.get("error")
            raise error_from_wire(error if isinstance(error, dict) else {})
        return reply.get("result")

    async def register_greens(self) -> int:
        """One registration pass (module doc, 6); returns how many greens it registered."""
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
        pending = [g for g in greens if fleet_name(self.config.host_id, g) not in self.registered]
        if not pending:
            return 0
        if len(self.registered) + len(pending) > MAX_REGISTERED:
            raise CapacityExhausted("more greens than the link remembers", limit=MAX_REGISTERED)
        enrolled = await self._council(self.council.hosts)
        alive = await self._council(self.council.alive_hosts)
        own = Peer(self.config.host_id, self.boot_id)
        done = 0
        for local_id in pending[:MAX_GREENS_PER_POLL]:
            name = fleet_name(self.config.host_id, local_id)
            config = first_config(name, self.record, enrolled, alive)
            if not await self._council(self.council.create_green, config):
                existing = await self._council(self.council.green, name)
                if existing is not None and existing.owner != own:
                    owner = f"{existing.owner.host} boot {existing.owner.boot}"
                    self.conflicts[name] = f"etcd names another owner: {owner}"
                    _log(f"green {name}: {self.conflicts[name]}; not registered")
            else:
                _log(f"registered green {name} (holders f={config.holders.f})")
            self.registered.add(name)
            done += 1
        return done

    async def local_request(self, message: dict[str, Any]) -> Any:
        op = message.get("op") if isinstance(message, dict) else None
        if isinstance(op, str) and op.startswith("remote."):
            found = await self.remote.local(message)  # remote work volumes (link_remote)
            if op == "remote.stats":  # and how often a lost reply was resent anew
                found["reconnects"] = 0 if self.peers is None else self.peers.reconnects
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
            case LocalRequest(op="owner", green=str(green)):
                config = await self._council(self.council.green, green)
                if config is None:
                    raise NotFound("no such green in the fleet", green=green)
                return _config_view(config)
            case _:
                raise InvalidArgument("unknown fleet link request", request=repr(request))

    async def hosts(self) -> dict[str, Any]:
        records = await self._council(self.council.hosts)
        alive = await self._council(self.council.alive_hosts)
        serf = {name: member.status for name, member in self.watch.known.items()}
        return {
            "host": self.config.host_id,
            "boot_id": self.boot_id,
            "hosts": host_listing(records, alive, serf),
            "events": [{"member": e.member.name, "kind": e.kind} for e in self.events],
            "conflicts": dict(self.conflicts),
            "peers": [] if self.peers is None else self.peers.connected,
            "adopted": {name: local for name, (_, local) in self.replicator.adopted.items()},
            "takeovers": dict(self.replicator.takeovers),
            "held": {  # per green this host holds versions of: its committed prefix
                name: self.replicator.holder.prefix(name)
                for name in self.replicator.configs
                if self.replicator.holder.accepted(name)
            },
        }


async def _run_until_signalled(link: FleetLink) -> None:
    """Run the link until a signal, or until it ends by itself (its anchor is gone)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def run_then_stop() -> None:
                await link.run()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run_then_stop)
            async for signum in signals:
                _log(f"stopping on signal {signum}")
                nursery.cancel_scope.cancel()
                break


def run_link(
    config_path: str | os.PathLike[str],
    runtime_dir: str | os.PathLike[str],
    options: LinkOptions | None = None,
) -> int:
    """Run the link until SIGTERM/SIGINT; the process's exit code."""
    config = load_host_config(config_path)
    if config.lease_ttl is not None and (
        options is None or options.lease_ttl == DEFAULTS.lease_ttl
    ):
        options = dataclasses.replace(options or DEFAULTS, lease_ttl=config.lease_ttl)
    creds = load_credentials(config.cert_dir)
    runtime = Runtime(runtime_dir)
    with Council(config.etcd_endpoints) as council:
        link = FleetLink(config, runtime, creds, council, options)
        link.take_the_lock()
        try:
            trio.run(_run_until_signalled, link)
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if len(leaves) == 1 and isinstance(leaves[0], Exception):
                raise leaves[0] from None  # one failure reaches main() as itself
            raise
    return 0


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        item = pending.pop()
        if isinstance(item, BaseExceptionGroup):
            pending.extend(item.exceptions)
        else:
            found.append(item)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slates.fleet.link", description=__doc__)
    parser.add_argument("--config", required=True, help="the host's fleet config (JSON)")
    parser.add_argument("--runtime-dir", required=True, help="the anchor's runtime directory")
    parser.add_argument("--lease-ttl", type=int, default=DEFAULTS.lease_ttl)
    parser.add_argument("--poll-interval", type=float, default=DEFAULTS.poll_interval)
    parser.add_argument(
        "--serf-profile", default=DEFAULTS.serf_profile, choices=("lan", "local", "wan")
    )
    args = parser.parse_args(argv)
    try:
        options = LinkOptions(
            lease_ttl=args.lease_ttl,
            poll_interval=args.poll_interval,
            serf_profile=args.serf_profile,
        )
        return run_link(args.config, args.runtime_dir, options)
    except SlatesError as exc:
        _log(f"error: {exc.code}: {exc.message} {exc.details}")
        return 2 if exc.fault == "caller" else 1
    except OSError as exc:  # e.g. the QUIC address is taken or not this host's
        _log(f"error: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
