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

fleet.sock speaks framed msgpack (slates.node.protocol's frame/pack/unpack),
any number of requests per connection, one at a time, each answered
`{"ok": true, "result": ...}` or `{"ok": false, "error": {...}}`:

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
  "remote.damage", ...}`: remote work volumes, a shard's asks for another
  host's green version (its tree record, its pieces, a submission on the
  owner), slates.fleet.link_remote's (peers ask each other as `{"kind":
  "remote"}` over QUIC);
- `{"op": "takeover", "green": NAME, "epoch": E}`: commit this host as
  NAME's owner at E+1 and recover it, as a failed verdict does;
  EpochFenced (with the committed owner) when etcd is no longer at E,
  InvalidArgument while serf sees the owner's host alive (its shard
  would go on accepting submissions: no live moves yet).

Routing by ownership.  A forward names the host whose ids it carries
(`names`, the volume's original owner; the target host by default).  When
the cached configuration of the green such an id names (`<id>@<names>`)
has an owner on another host than the target, the link answers NotOwner
with `owner_host` and the client resends there (slates.fleet.link_client).
The serving link refuses the same way, and translates the ids of a green
it adopted into its local copy's (as another client id,
link_rules.adopted_client_id, since the client numbers its requests per
original host); new volumes it makes for such a request are answered as
`<id>@<this host>`.  A local client's forward to another host for a green
this host owns now (it took it over) is served here, not sent to the
green's old host.  Only the link routes by ownership: a local client of
a host's anchor reaches its shard directly (known gap, below).

Requests arriving over QUIC come from a host the handshake authenticated
against the fleet's CA; the link also requires that host to be enrolled in
etcd (AccessDenied otherwise).  It cannot compare the peer certificate's
fingerprint with the HostRecord's (the transport hands the handler only
the host id): a re-issued certificate for an enrolled host id is accepted.

A forward to a host serf has declared failed (or left) is refused at once
with Unavailable, and the connection to it is dropped when the verdict
arrives, ending the requests in flight to it with Unavailable too: the
caller learns in milliseconds, not after the transport's timeouts, and
may go elsewhere.  Before serf's verdict a forward to a dead
host waits out its own timeout (LinkOptions.forward_timeout, all retries
included).

Only the operator's requests are forwarded this session (link_forward's
docstring): an agent's principal does not yet travel between hosts.
Known gap: a shard does not consult the fleet's ownership, so an old
owner that is alive but cut off (a partition, not a loss) still accepts
submissions from its own local clients; its link's shipping is then
refused EpochFenced by the holders and a durability wait on it reaches
only `restart`.

Bounds: local connections (MAX_LOCAL_CONNECTIONS, then CapacityExhausted),
local frames (MAX_LOCAL_FRAME), QUIC requests and replies (LINK_LIMITS: 17
MiB, enough for a shard's largest read), peers and forwarding lines (link_forward),
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
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import trio

from slates.errors import (
    AccessDenied,
    AlreadyExists,
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    NotOwner,
    SlatesError,
    Unavailable,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.config import GreenConfig, HolderSet, Peer
from slates.fleet.etcd import Council, HostRecord, Lease
from slates.fleet.hostconfig import HostConfig, load_host_config, parse_address
from slates.fleet.link_forward import PeerPool, ShardLines
from slates.fleet.link_remote import RemoteReads
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_rules import (
    Durable,
    Forward,
    LocalRequest,
    RemoteForward,
    Takeover,
    adopted_client_id,
    durable_payload,
    first_config,
    fleet_name,
    host_listing,
    parse_local,
    parse_remote,
    parse_remote_durable,
    remote_payload,
    volume_refs,
)
from slates.fleet.pki import HostCredentials, load_credentials
from slates.fleet.quic import TransportLimits, serve
from slates.fleet.serf import MemberEvent, MembershipWatch, SerfAgent, SerfClient
from slates.node.protocol import FrameReader, frame, pack, unpack
from slates.node.runtime import Runtime, pid_alive

__all__ = ["FleetLink", "LinkOptions", "SOCKET_NAME", "STATE_NAME", "main", "run_link"]

SOCKET_NAME: Final = "fleet.sock"
STATE_NAME: Final = "fleet-link.json"
LOCK_NAME: Final = "fleet-link.lock"
MAX_LOCAL_CONNECTIONS: Final = 64
# A shard answers at most 16 MiB per read (and the SDK reads 8 MiB pieces): requests and
# replies up to 17 MiB cross, with fewer streams per connection to bound what is buffered
# (32 x 17 MiB per connection at worst).  Every link uses these, so both ends agree.
LINK_LIMITS: Final = TransportLimits(
    max_concurrent_streams=32, max_request_bytes=17 << 20, max_reply_bytes=17 << 20
)
MAX_LOCAL_FRAME: Final = 18 << 20
MAX_EVENTS: Final = 64
MAX_GREENS_PER_POLL: Final = 64
MAX_REGISTERED: Final = 1 << 16
ETCD_THREADS: Final = 4
RECEIVE_BYTES: Final = 1 << 16
ENROLLED_REFRESH_SECONDS: Final = 1.0

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
        self.serf_agent: SerfAgent | None = None
        self.events: collections.deque[MemberEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.registered: set[str] = set()
        self.conflicts: dict[str, str] = {}
        self.peers: PeerPool | None = None
        self.lease: Lease | None = None
        self.quic_port = 0
        self._etcd = trio.CapacityLimiter(ETCD_THREADS)
        self._enrolled: dict[str, HostRecord] = {}
        self._enrolled_at = -1e9
        self._last_error: dict[str, str] = {}
        self._local_connections = 0
        self._own_seq = 0
        self.ended = trio.Event()  # the anchor is gone: the link ends with it
        self.anchor_pid: int | None = None
        self._lock_fd: int | None = None
        self._own_lock = trio.Lock()
        self._down: dict[str, trio.Event] = {}  # per host: set while serf says it is not alive
        self._nursery: trio.Nursery | None = None
        self.replicator = Replicator(
            Peer(config.host_id, self.boot_id),
            self.options.hold_bytes,
            runtime.path,
            self._own_request,
            self._peer_request,
            self._council,
            council,
            self._alive_hosts,
            _log,
        )

        self.remote = RemoteReads(
            config.host_id,
            self.boot_id,
            self.replicator,
            self._peer_request,
            self.forward,
            self._durable,
            self._alive_hosts,
        )

    def _alive_hosts(self) -> set[str]:
        return {name for name, m in self.watch.known.items() if m.status == "alive"}

    def _down_event(self, host: str) -> trio.Event:
        event = self._down.get(host)
        if event is None:
            event = self._down[host] = trio.Event()
            verdict = self.watch.known.get(host)
            if verdict is not None and verdict.status != "alive":
                event.set()
        return event

    async def _peer_request(self, host: str, payload: bytes, timeout: float) -> bytes:
        """One request to a peer's link, given up at once when serf declares it failed
        (the caller learns then, not after the transport's timeouts)."""
        if self.peers is None:
            raise Unavailable("the fleet link is not serving yet")
        peers, down = self.peers, self._down_event(host)
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
        self.lease = await self._council(self.council.grant_lease, self.options.lease_ttl)
        await self._council(self.council.mark_alive, self.config.host_id, self.boot_id, self.lease)
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
                self.peers = PeerPool(self.creds, self._resolve, nursery, limits=LINK_LIMITS)
                bind = self.config.quic_endpoint
                async with serve(
                    bind, self.creds, self._handle_remote, limits=LINK_LIMITS
                ) as server:
                    self.quic_port = server.port
                    nursery.start_soon(self._keepalive_loop)
                    nursery.start_soon(self._membership_loop)
                    nursery.start_soon(self._register_loop)
                    nursery.start_soon(self._ship_loop)
                    self._nursery = nursery
                    nursery.start_soon(self._anchor_loop)
                    await nursery.start(self._serve_local)
                    self._write_state()
                    _log(f"serving QUIC on {bind[0]}:{server.port} and {self.socket_path}")
                    task_status.started()
                    try:
                        await self.ended.wait()
                        nursery.cancel_scope.cancel()
                    finally:
                        self.peers.close()
        finally:
            self.lines.close()  # trio sockets close in trio's thread
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._leave)

    # -- loops

    async def _keepalive_loop(self) -> None:
        interval = self.options.lease_ttl / 3
        while True:
            await trio.sleep(interval)
            try:
                if self.lease is None:
                    raise NotFound("no lease yet")
                await self._council(self.council.keepalive, self.lease)
                self._report("keepalive", None)
            except NotFound:
                try:
                    lease = await self._council(self.council.grant_lease, self.options.lease_ttl)
                    await self._council(
                        self.council.mark_alive, self.config.host_id, self.boot_id, lease
                    )
                    self.lease = lease
                    _log("the lease had lapsed: a new one holds the alive key")
                except SlatesError as exc:
                    self._report("keepalive", exc)
            except SlatesError as exc:
                self._report("keepalive", exc)

    async def _membership_loop(self) -> None:
        while True:
            try:
                for event in await trio.to_thread.run_sync(self.watch.poll):
                    self.events.append(event)
                    _log(f"serf: {event.member.name} {event.kind}")
                    if event.kind == "alive":
                        if self._down_event(event.member.name).is_set():
                            self._down[event.member.name] = trio.Event()
                    else:
                        self._down_event(event.member.name).set()  # its requests end now
                    if event.kind != "alive" and self.peers is not None:
                        self.peers.drop(event.member.name)  # its connection is as dead
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

    # -- QUIC

    async def _resolve(self, host: str) -> tuple[str, int]:
        record = await self._council(self.council.host, host)
        if record is None:
            raise NotFound("that host is not enrolled in the fleet", host=host)
        return parse_address(record.quic_address, "quic_address")

    async def _check_enrolled(self, host: str) -> None:
        if host in self._enrolled:
            return
        now = time.monotonic()
        if now - self._enrolled_at >= ENROLLED_REFRESH_SECONDS:
            records = await self._council(self.council.hosts)
            self._enrolled = {r.host: r for r in records}
            self._enrolled_at = now
        if host not in self._enrolled:
            raise AccessDenied("the peer host is not enrolled in the fleet", host=host)

    async def _handle_remote(self, peer_host: str, payload: bytes) -> bytes:
        await self._check_enrolled(peer_host)
        message = unpack(payload)
        if not isinstance(message, dict):
            raise InvalidArgument("a fleet request is a map")
        match message.get("kind", "forward"):
            case "forward":
                return await self._serve(parse_remote(peer_host, message))
            case "ledger":
                return await self.replicator.handle_ledger(peer_host, message)
            case "durable":
                result = await self._durable(parse_remote_durable(message))
                return pack(result)
            case "remote":
                return pack(await self.remote.serve(peer_host, message))
            case kind:
                raise InvalidArgument("unknown fleet request kind", kind=str(kind))

    async def _serve(self, forward: RemoteForward) -> bytes:
        """Run a forward on a shard of this host, its ids translated (module doc: owners)."""
        names = forward.names or self.config.host_id
        me = self.config.host_id
        refs = volume_refs(forward.request)
        shard, args, translated = forward.shard, dict(forward.request.get("args") or {}), False
        for key, local_id in refs.items():
            name = fleet_name(names, local_id)
            owner = self.replicator.owner_elsewhere(name)
            if owner is not None and owner != me:  # etcd moved it on: even an adopted copy
                raise NotOwner("the green has another owner", green=name, owner_host=owner)
            if names != me:
                adopted = self.replicator.adopted.get(name)
                if adopted is None and self.replicator.recovering(name):
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
        raw = await self.lines.run(forward, timeout=self.options.shard_timeout)
        if not translated:
            return raw
        reply = unpack(raw)
        result = reply.get("result") if isinstance(reply, dict) else None
        if reply.get("ok") is True and isinstance(result, dict):
            if isinstance(result.get("id"), str) and "@" not in result["id"]:
                result["id"] = fleet_name(me, result["id"])  # a new volume here is ours
            if isinstance(result.get("green"), str) and "@" not in result["green"]:
                result["green"] = self.replicator.name_of(result["green"], shard)
            return pack(reply)
        return raw

    async def _durable(self, request: Durable) -> dict[str, Any]:
        if request.host and request.host != self.config.host_id:
            raw = await self._peer_request(
                request.host, pack(durable_payload(request)), request.timeout + 10
            )
            result = unpack(raw)
            if not isinstance(result, dict):
                raise VerificationFailed("a durability answer is a map")
            return result
        return await self.replicator.durable(
            request.shard, request.work, request.version, request.scope, request.timeout
        )

    # -- the local socket

    async def _serve_local(self, *, task_status: trio.TaskStatus[None]) -> None:
        path = self.socket_path
        path.unlink(missing_ok=True)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            previous = os.umask(0o177)  # the socket is born 0600: nobody else may connect first
            try:
                await listener.bind(str(path))
            finally:
                os.umask(previous)
            os.chmod(path, 0o600)
            listener.listen(MAX_LOCAL_CONNECTIONS)
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    conn, _ = await listener.accept()
                    if self._local_connections >= MAX_LOCAL_CONNECTIONS:
                        full = CapacityExhausted(
                            "the fleet link has as many local connections as it takes",
                            limit=MAX_LOCAL_CONNECTIONS,
                        )
                        with conn, trio.move_on_after(1):
                            await _send_all(conn, frame(pack(_error(full))))
                        continue
                    self._local_connections += 1
                    nursery.start_soon(self._local_connection, conn)

    async def _local_connection(self, conn: trio.socket.SocketType) -> None:
        reader = FrameReader(limit=MAX_LOCAL_FRAME)
        try:
            with conn:
                while True:
                    try:
                        while (message := reader.next_frame()) is None:
                            data = await conn.recv(RECEIVE_BYTES)
                            if not data:
                                return
                            reader.feed(data)
                    except InvalidArgument as exc:  # an oversize frame: no way to resynchronize
                        await _send_all(conn, frame(pack(_error(exc))))
                        return
                    try:
                        answer = {"ok": True, "result": await self.local_request(unpack(message))}
                    except SlatesError as exc:
                        answer = _error(exc)
                    await _send_all(conn, frame(pack(answer)))
        except (OSError, trio.BrokenResourceError):
            return
        finally:
            self._local_connections -= 1

    async def local_request(self, message: dict[str, Any]) -> Any:
        op = message.get("op") if isinstance(message, dict) else None
        if isinstance(op, str) and op.startswith("remote."):
            return await self.remote.local(message)  # remote work volumes (link_remote)
        request = parse_local(message)
        match request:
            case Forward():
                return await self.forward(request)
            case LocalRequest(op="hosts"):
                return await self.hosts()
            case Durable():
                return await self._durable(request)
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

    async def forward(self, request: Forward) -> bytes:
        names = request.names or request.host
        for local_id in volume_refs(request.request).values():
            owner = self.replicator.owner_elsewhere(fleet_name(names, local_id))
            if owner is not None and owner != request.host:
                # etcd has committed another owner: the client follows it (same request id).
                raise NotOwner(
                    "the green has another owner",
                    green=fleet_name(names, local_id),
                    owner_host=owner,
                )
        me = self.config.host_id
        refs = volume_refs(request.request).values()
        if request.host != me and refs and all(self._owned_here(names, r) for r in refs):
            # This host took the green over: serve it here (its old host may be gone).
            request = dataclasses.replace(request, host=me, names=names)
        if request.host == self.config.host_id:
            remote = RemoteForward(
                request.host,
                request.shard,
                request.client,
                request.request,
                "" if names == request.host else names,
            )
            return await self._serve(remote)
        if self.peers is None:
            raise Unavailable("the fleet link is not serving yet")
        # Fail fast: waiting out timeouts against a host serf declared gone helps nobody.
        return await self._peer_request(
            request.host, pack(remote_payload(request)), self.options.forward_timeout
        )

    def _owned_here(self, names: str, local_id: str) -> bool:
        config = self.replicator.configs.get(fleet_name(names, local_id))
        return config is not None and config.owner == self.replicator.me

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


def _error(error: SlatesError) -> dict[str, Any]:
    return {"ok": False, "error": error.to_wire()}


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


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
