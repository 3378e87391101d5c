"""The fleet link: the process that joins one host to the fleet (DESIGN.md section 7).

Theory of operation.  `python -m slates.fleet.link --config FILE
--runtime-dir DIR` runs beside the anchor (which starts and supervises
it) and is the host's only speaker to other hosts.  This module composes
the link's parts, each of which owns its piece and says how in its own
docstring.  At start the link

1. reads the host's fleet config (slates.fleet.hostconfig) and loads its
   credentials (slates.fleet.pki.load_credentials); the certificate must
   name the configured host id;
2. takes RUNTIME/fleet-link.lock before it touches anything: one link per
   runtime directory, a second one is refused AlreadyExists
   (slates.fleet.link_process);
3. enrolls in etcd (slates.fleet.etcd.Council) with a boot id made fresh
   at every start (a host that lost its RAM comes back as a new identity
   that holds nothing) and keeps its alive key under a lease
   (slates.fleet.link_lease; LinkOptions.lease_ttl, or the host config's
   lease_ttl when --lease-ttl is not given);
4. attaches to the host's serf agent, or starts one (stopped by pid when
   the link ends), and polls its membership (slates.fleet.link_membership);
5. serves QUIC on quic_address (slates.fleet.quic.serve) for forwards from
   enrolled peers, and RUNTIME/fleet.sock (mode 0600) for local clients;
6. runs its loops in one nursery: the lease's keepalive and the fence
   table the shards read (link_lease); serf's verdicts and the takeovers
   a failed verdict starts (link_membership); the registration of this
   host's greens in etcd (slates.fleet.link_register); shipping (below);
   and the watch on the anchor (link_process);
7. writes RUNTIME/fleet-link.json (pid, host, boot id, QUIC port,
   fleet.sock's path) once everything serves: it says the link is ready
   (link_process).

Shipping (slates.fleet.link_replicate, whose docstring has the details):
about once a poll interval the link reads every green's configuration
from etcd (the cache routing, fencing and takeovers use) and ships each
new version of the greens this host owns to their holder candidates; it
holds, in RAM, what other owners ship here, and serves the greens it took
over under their fleet names.  The registration's listings and the
replication's exports, imports and replays run on local shards as the
link's own client (`_own_request`, one request at a time).

fleet.sock's requests (forward, hosts, owner, durable, remote.*, takeover)
are answered by slates.fleet.link_requests, whose docstring lists them.

Routing by ownership, the trust in QUIC peers and failing fast against a
host serf declared failed are slates.fleet.link_routing's; the framing and
bounds of fleet.sock are slates.fleet.link_local's.  Only the operator's
requests are forwarded this session (link_forward's docstring): an
agent's principal does not yet travel between hosts.

Bounds: local connections and frames (link_local), QUIC requests and
replies (LINK_LIMITS: 17 MiB, enough for a shard's largest read), peers
and forwarding lines (link_forward), etcd threads (ETCD_THREADS at once),
greens created per poll and greens remembered (link_register), serf
events kept (link_membership).  A failed loop pass (etcd, serf or a shard
not answering) is logged once per distinct error (`_report`) and retried
at the next interval.

The link ends with its anchor (link_process: when the anchor whose state
file it first read is gone, or another anchor's pid stands there): it
leaves as below, so the host's boot id is never kept alive by a link that
outlived its volumes.  On SIGTERM or SIGINT, too, it leaves: fleet.sock
and its state file removed, the fence table rewritten with `until` 0 and
then the lease revoked (link_lease: peers see it gone from etcd at once),
a serf agent it started stopped (link_membership); it exits 0.

Callers: slates.node.anchor starts it as a process (`main`, which runs
`run_link`, which runs one FleetLink until a signal); the tests start it
the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import trio

from slates.errors import InvalidArgument, SlatesError, VerificationFailed, error_from_wire
from slates.fleet.config import Peer
from slates.fleet.etcd import Council, HostRecord
from slates.fleet.hostconfig import HostConfig, load_host_config
from slates.fleet.link_fence import FenceWriter
from slates.fleet.link_forward import PeerPool, ShardLines
from slates.fleet.link_lease import LeaseKeeper
from slates.fleet.link_local import LocalSocket
from slates.fleet.link_membership import Membership
from slates.fleet.link_process import STATE_NAME, LinkProcess
from slates.fleet.link_register import Registrar
from slates.fleet.link_remote import RemoteReads
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_requests import LocalRequests
from slates.fleet.link_routing import Routing
from slates.fleet.link_rules import RemoteForward
from slates.fleet.pki import HostCredentials, load_credentials
from slates.fleet.quic import TransportLimits, serve
from slates.fleet.serf import MembershipWatch, SerfClient
from slates.node.protocol import unpack
from slates.node.runtime import Runtime

__all__ = ["FleetLink", "LinkOptions", "SOCKET_NAME", "STATE_NAME", "main", "run_link"]

SOCKET_NAME: Final = "fleet.sock"
# A shard answers at most 16 MiB per read (and the SDK reads 8 MiB pieces): requests and
# replies up to 17 MiB cross, with fewer streams per connection to bound what is buffered
# (32 x 17 MiB per connection at worst).  Every link uses these, so both ends agree.
LINK_LIMITS: Final = TransportLimits(
    max_concurrent_streams=32, max_request_bytes=17 << 20, max_reply_bytes=17 << 20
)
ETCD_THREADS: Final = 4

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
        self.quic_port = 0
        self._etcd = trio.CapacityLimiter(ETCD_THREADS)
        self._last_error: dict[str, str] = {}
        self._own_seq = 0
        self._own_lock = trio.Lock()
        self.process = LinkProcess(
            runtime,
            config.host_id,
            self.boot_id,
            self.socket_path,
            self.options.poll_interval,
            _log,
        )
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
        self.lease_keeper = LeaseKeeper(
            self.record,
            self.options.lease_ttl,
            council,
            self._council,
            self.replicator,
            FenceWriter(runtime.path),
            self._report,
            _log,
        )
        self.registrar = Registrar(
            self.record,
            runtime,
            council,
            self._council,
            self._own_request,
            self.replicator,
            self.options.poll_interval,
            self._report,
            _log,
        )
        self.membership = Membership(
            config,
            self.boot_id,
            council,
            self.watch,
            self.routing,
            self.replicator,
            data_dir=runtime.path / "fleet-serf",
            profile=self.options.serf_profile,
            poll_interval=self.options.poll_interval,
            report=self._report,
            log=_log,
        )
        self.requests = LocalRequests(
            config.host_id,
            self.boot_id,
            council,
            self._council,
            self.watch,
            self.routing,
            self.remote,
            self.replicator,
            self.registrar,
            self.membership,
        )

    @property
    def peers(self) -> PeerPool | None:
        return self.routing.peers

    @property
    def socket_path(self) -> Path:
        return self.runtime.path / SOCKET_NAME

    @property
    def state_path(self) -> Path:
        return self.process.state_path

    async def _council(self, call: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(call, *args, limiter=self._etcd)

    def _report(self, loop: str, error: BaseException | None) -> None:
        """Log a loop's failure once per distinct message, and its recovery."""
        text = "" if error is None else f"{type(error).__name__}: {error}"
        if text != self._last_error.get(loop, ""):
            _log(f"{loop}: {text}" if text else f"{loop}: recovered")
            self._last_error[loop] = text

    # -- start and stop

    def take_the_lock(self) -> None:
        """One link per runtime directory (slates.fleet.link_process)."""
        self.process.take_the_lock()

    def _leave(self) -> None:
        """Best effort, at exit: our files gone, the lease revoked, our serf agent stopped."""
        for path in (self.socket_path, self.state_path):
            path.unlink(missing_ok=True)
        self.lease_keeper.leave()  # the fence table first: a successor may take over at once
        self.membership.stop()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if not self.process.locked:
            self.take_the_lock()
        try:
            await self.lease_keeper.join()
            await trio.to_thread.run_sync(self.membership.attach)
            async with trio.open_nursery() as nursery:
                peers = PeerPool(self.creds, self.routing.resolve, nursery, limits=LINK_LIMITS)
                self.routing.peers = peers
                bind = self.config.quic_endpoint
                async with serve(
                    bind, self.creds, self.routing.handle_remote, limits=LINK_LIMITS
                ) as server:
                    self.quic_port = server.port
                    nursery.start_soon(self.lease_keeper.keepalive_loop)
                    nursery.start_soon(self.lease_keeper.fence_loop)
                    nursery.start_soon(self.membership.loop)
                    nursery.start_soon(self.registrar.loop)
                    nursery.start_soon(self._ship_loop)
                    self.membership.nursery = nursery
                    nursery.start_soon(self.process.anchor_loop)
                    await nursery.start(self.local.serve)
                    self.process.write_state(self.quic_port)
                    _log(f"serving QUIC on {bind[0]}:{server.port} and {self.socket_path}")
                    task_status.started()
                    try:
                        await self.process.ended.wait()
                        nursery.cancel_scope.cancel()
                    finally:
                        peers.close()
        finally:
            self.lines.close()  # trio sockets close in trio's thread
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._leave)

    # -- the link's own loop and client

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

    async def local_request(self, message: dict[str, Any]) -> Any:
        """One of fleet.sock's requests (slates.fleet.link_requests)."""
        return await self.requests.handle(message)


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
