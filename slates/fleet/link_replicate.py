"""The fleet link's ledger: versions shipped to holders, durability, takeover, recovery.

Theory of operation (DESIGN.md section 7).  One `Replicator` per fleet link
(slates.fleet.link) plays both ledger roles of its host with the pure
machines, over QUIC:

- Holder.  One `holder.Holder` (identity: host and this boot's id) keeps,
  in the link's RAM, what owners place and propose: the accepted values and
  the verified chunks (at most LinkOptions.hold_bytes).  RAM, not the state
  directory, on purpose: a held copy must not outlive the boot that
  acknowledged it, since a host that comes back with a new boot id is a new
  peer that holds nothing (and the pure holder's fencing is per identity).
  `handle_ledger` answers a peer's messages (`{"kind": "ledger",
  "messages": [...]}`, each sent by the authenticated peer) after
  installing the green's configuration from etcd, so the promise is never
  below the committed epoch (an old owner's Place or Propose is refused
  EpochFenced, and one claiming an epoch for another peer NotOwner).
- Owner.  For every green this host owns (registered here, or adopted at a
  takeover) the shipping loop exports each new version of the shard's
  ledger as a self-contained tree record plus chunks (slates.fleet.replica:
  the scratch clone of the version's snapshot is walked with ordinary
  shard requests and deleted), and places it on each live holder
  candidate: Place -> Fetch -> Chunk... -> PlaceAck, then Propose (marked
  committed: the owner's shard has committed it already) -> Accepted.
  Acknowledgements are counted by `copies.Copies` (`host` scope: f+1
  acceptances outside the owner's host, per configured set).  `durable`
  ships through a version now and waits (bounded) for a scope, returning
  the scopes reached.
- Takeover.  On serf's failed verdict for a host, each link computes
  `replica.choose_successor` for the greens that host owned; the chosen
  one waits (at most LEASE_WAIT_SECONDS) until the owner boot's alive key
  is gone from etcd as well (its lease lapsed: a host that serf alone
  suspects, e.g. on a loaded machine, but that still reaches etcd keeps
  its greens), gives up if serf sees the host alive again meanwhile, and
  then commits the successor configuration in etcd (one transaction
  comparing the old epoch and the old owner's alive key as read, so an
  owner that renewed its presence first keeps its greens:
  `Council.commit_config`, slates.fleet.fencing).  Only a won commit
  leads to recovery: Prepare to the holders, `recovery.Successor` until a
  write quorum promised, `recovery.adopt`, Gather the chunks it lacks,
  `recovery.verify` (every tree record root-checked, every file chunk
  BLAKE3-checked on arrival), then the versions are replayed into a new
  local green of one of its shards (version 0 captured from a directory
  written in TMPDIR and removed after, each later version
  one submission of a scratch work volume), whose numbering is therefore
  the original's.  The adopted green answers under its fleet name:
  `adopted` maps the name to (shard, local id) for slates.fleet.link_routing's
  request translation.  A commit that loses, or names an epoch that is no
  longer etcd's, raises EpochFenced with the committed owner.
- Identities.  The value of a version made by a remote submission carries
  that submission's identity (`made_by`, slates.fleet.link_identity, fed by
  slates.fleet.link_submit), and a takeover rebuilds the identity ->
  version table from the adopted chain; `configs_read_at` says when the
  last whole read of etcd's configurations began (the fence table's proof,
  slates.fleet.fencing).

Exports and imports of trees through the shard are slates.fleet.link_tree's.
Bounds: exports are cached up to EXPORT_CACHE_BYTES, placement rounds MAX_PLACE_ROUNDS,
recovery rounds RECOVERY_ROUNDS, chunk batches CHUNK_BATCH_BYTES, each
peer exchange LEDGER_TIMEOUT.  Known gaps: the green's policy (private
paths, rewrites) is not carried to the successor (the adopted green takes
everything submitted as public), nor are the shard's saved replies of
local clients (a retry after failover of a local submission the old owner
answered finds its work volume gone with the old owner's RAM: NotFound,
never a second version; remote submissions are answered from `made_by`),
and every export walks the whole tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgpack
import trio

from slates.errors import (
    AccessDenied,
    EpochFenced,
    InvalidArgument,
    NotFound,
    NotOwner,
    SlatesError,
    Unavailable,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.copies import Copies
from slates.fleet.holder import Holder
from slates.fleet.ledger import ChunkStore, Value, chunk_id
from slates.fleet.link_identity import MadeBy
from slates.fleet.link_rules import fleet_name, split_fleet_name
from slates.fleet.link_tree import ShardTrees
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Fetch,
    Gather,
    Gathered,
    Message,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Refused,
    decode,
    encode,
)
from slates.fleet.recovery import Successor, needed_chunks, verify
from slates.fleet.replica import (
    choose_successor,
    decode_tree,
    place_manifest,
    position_of,
    successor_config,
    version_value,
)
from slates.node.protocol import shard_of

__all__ = ["Replicator", "SCOPES", "best_scope"]

SCOPES: Final = ("restart", "host", "region")
EXPORT_CACHE_BYTES: Final = 64 << 20
MAX_PLACE_ROUNDS: Final = 8
RECOVERY_ROUNDS: Final = 30
CHUNK_BATCH_BYTES: Final = 8 << 20
LEDGER_TIMEOUT: Final = 20.0
MAX_LEDGER_MESSAGES: Final = 4096
LEASE_WAIT_SECONDS: Final = 60.0  # after serf's verdict, for the dead boot's lease to lapse
LEASE_POLL_SECONDS: Final = 0.5

ShardCall = Callable[[int, str, dict[str, Any]], Awaitable[Any]]
PeerCall = Callable[[str, bytes, float], Awaitable[bytes]]


def best_scope(scopes: tuple[str, ...]) -> str:
    """The widest scope reached ("restart" is reached at commit)."""
    reached = [s for s in SCOPES if s in scopes]
    return reached[-1] if reached else "restart"


@dataclasses.dataclass(slots=True)
class Export:
    tree: bytes
    chunks: dict[bytes, bytes]
    value: Value

    @property
    def size(self) -> int:
        return len(self.tree) + sum(len(c) for c in self.chunks.values())


@dataclasses.dataclass(slots=True)
class Shipping:
    """What the owner knows of one green it ships (module doc: Owner)."""

    name: str
    shard: int
    local: str
    config: GreenConfig
    copies: Copies = dataclasses.field(default_factory=Copies)
    exports: dict[int, Export] = dataclasses.field(default_factory=dict)  # by position
    head: int = 0  # the highest position exported
    lock: trio.Lock = dataclasses.field(default_factory=trio.Lock)
    stale: set[Peer] = dataclasses.field(default_factory=set)  # answered as someone else


class Replicator:
    def __init__(
        self,
        me: Peer,
        hold_bytes: int,
        runtime_dir: Path,
        shard_call: ShardCall,
        peer_call: PeerCall,
        council_call: Callable[..., Awaitable[Any]],
        council: Any,
        alive_hosts: Callable[[], set[str]],
        log: Callable[[str], None],
    ) -> None:
        self.me = me
        self.holder = Holder(me, hold_bytes)
        self.trees = ShardTrees(shard_call, runtime_dir, log)
        self._shard = shard_call
        self._peer = peer_call
        self._council_call = council_call
        self._council = council
        self._alive = alive_hosts
        self._log = log
        self.configs: dict[str, GreenConfig] = {}
        self.configs_read_at = 0.0  # monotonic start of the last whole read (fencing.py)
        self.made_by = MadeBy()  # which remote submission made which version
        self.shipping: dict[str, Shipping] = {}
        self.adopted: dict[str, tuple[int, str]] = {}  # fleet name -> (shard, local id)
        self.takeovers: dict[str, str] = {}  # fleet name -> outcome, for `hosts`
        self._taking: set[str] = set()

    # -- configurations

    async def refresh(self) -> None:
        """Every green's configuration from etcd (the link calls it once per poll)."""
        started = time.monotonic()
        configs = await self._council_call(self._council.greens)
        self.configs = {c.green: c for c in configs}
        self.configs_read_at = started
        for config in configs:
            self.holder.install(config)
            shipping = self.shipping.get(config.green)
            if shipping is not None and config.revision > shipping.config.revision:
                if config.owner != self.me:
                    self._log(f"green {config.green}: now owned by {config.owner.host}")
                    del self.shipping[config.green]
                else:
                    shipping.config = config

    async def config(self, green: str, at_least: int = 0) -> GreenConfig:
        found = self.configs.get(green)
        if found is None or found.epoch < at_least:
            fresh = await self._council_call(self._council.green, green)
            if fresh is None:
                raise NotFound("no such green in the fleet", green=green)
            self.configs[green] = found = fresh
            self.holder.install(fresh)
        return found

    def owner_elsewhere(self, green: str) -> str | None:
        """The committed owner's host when the cached configuration names another one."""
        config = self.configs.get(green)
        if config is None or config.owner == self.me:
            return None
        return config.owner.host

    def recovering(self, green: str) -> bool:
        """Whether this host is taking `green` over (committed or not, not serving yet)."""
        return green in self._taking

    def local_of(self, green: str) -> tuple[int, str]:
        adopted = self.adopted.get(green)
        if adopted is not None:
            return adopted
        host, local = split_fleet_name(green)
        if host != self.me.host:
            raise NotFound("this host holds no local copy of that green", green=green)
        return shard_of(local), local

    def name_of(self, local: str, shard: int) -> str:
        for name, (s, adopted) in self.adopted.items():
            if (s, adopted) == (shard, local):
                return name
        return fleet_name(self.me.host, local)

    # -- holder side

    async def handle_ledger(self, peer_host: str, body: dict[str, Any]) -> bytes:
        raw = body.get("messages")
        if not isinstance(raw, list) or len(raw) > MAX_LEDGER_MESSAGES:
            raise InvalidArgument("a ledger request is a bounded list of messages")
        out: list[bytes] = []
        for item in raw:
            if not isinstance(item, bytes):
                raise InvalidArgument("a ledger message is bytes")
            message = decode(item)
            if message.sender.host != peer_host:
                raise AccessDenied("a ledger message names another sender", host=peer_host)
            epoch = getattr(message, "epoch", 0)
            await self.config(message.green, epoch if isinstance(epoch, int) else 0)
            for outgoing in self.holder.receive(message, time.monotonic()):
                out.append(encode(outgoing.message))
        return bytes(msgpack.packb(out, use_bin_type=True))

    async def deliver(self, host: str, messages: list[Message]) -> list[Message]:
        """Messages to `host`'s holder (this host's own directly), and its answers."""
        if host == self.me.host:
            answers: list[Message] = []
            for message in messages:
                answers += [o.message for o in self.holder.receive(message, time.monotonic())]
            return answers
        payload = {"kind": "ledger", "messages": [encode(m) for m in messages]}
        reply = await self._peer(host, msgpack.packb(payload, use_bin_type=True), LEDGER_TIMEOUT)
        try:
            items = msgpack.unpackb(reply, raw=False)
        except (ValueError, msgpack.UnpackException) as error:
            raise VerificationFailed("a holder's answer does not decode", host=host) from error
        if not isinstance(items, list) or not all(isinstance(i, bytes) for i in items):
            raise VerificationFailed("a holder answered something other than a message list")
        return [decode(bytes(item)) for item in items]

    # -- owner side: exports

    async def _export(self, shipping: Shipping, position: int) -> Export:
        found = shipping.exports.get(position)
        if found is not None:
            return found
        await self.made_by.quiet(shipping.name)  # a run going may be making this version
        found = shipping.exports.get(position)
        if found is not None:
            return found
        tree, chunks = await self.trees.export(shipping.shard, shipping.local, position - 1)
        if position == 1:
            previous = b""
        else:
            before = shipping.exports.get(position - 1)
            previous = (
                before.tree
                if before is not None
                else (await self.trees.export(shipping.shard, shipping.local, position - 2))[0]
            )
        origin = split_fleet_name(shipping.name)[0]  # every owner of the green makes one value
        request = self.made_by.request_of(shipping.name, position - 1)
        value, tree_chunk = version_value(origin, position - 1, previous, tree, request)
        chunks[tree_chunk] = tree
        export = Export(tree, chunks, value)
        shipping.exports[position] = export
        while (
            sum(e.size for e in shipping.exports.values()) > EXPORT_CACHE_BYTES
            and len(shipping.exports) > 1
        ):
            del shipping.exports[min(shipping.exports)]
        return export

    async def export_version(self, shipping: Shipping, position: int) -> Export:
        """The export of one version of a green this host owns (cached; remote reads ask
        for it when no holder has the version yet: slates.fleet.link_remote)."""
        return await self._export(shipping, position)

    # -- owner side: placement

    async def _place(self, shipping: Shipping, peer: Peer, position: int, export: Export) -> None:
        config = shipping.config
        green, epoch = shipping.name, config.epoch
        manifest = place_manifest(export.tree)
        out = await self.deliver(peer.host, [Place(self.me, green, epoch, position, manifest)])
        for _ in range(MAX_PLACE_ROUNDS):
            _refusal(out)
            if any(isinstance(m, PlaceAck) for m in out):
                break
            wanted = [c for m in out if isinstance(m, Fetch) for c in m.chunks]
            if not wanted:
                raise Unavailable("a holder neither fetched nor acknowledged", host=peer.host)
            out = []
            for batch in _batches(self.me, green, wanted, export.chunks):
                out += await self.deliver(peer.host, batch)
        else:
            raise Unavailable("placement did not complete", host=peer.host, position=position)
        propose = Propose(self.me, green, epoch, position, export.value, True)
        for message in await self.deliver(peer.host, [propose]):
            if isinstance(message, Refused):
                _refusal([message])
            if isinstance(message, Accepted) and message.position == position:
                if message.sender not in config.members():
                    shipping.stale.add(peer)  # another boot answers: it holds nothing of ours
                    return
                shipping.copies.heard(config, message.sender, message.prefix)
                shipping.copies.accepted(position, message.sender)

    def _targets(self, shipping: Shipping) -> list[Peer]:
        alive = self._alive() | {self.me.host}
        return [
            p
            for p in sorted(shipping.config.members())
            if p.host in alive and p not in shipping.stale
        ]

    async def ship(self, shipping: Shipping, through: int) -> None:
        """Place every position up to `through` on each live holder lacking it."""
        async with shipping.lock:
            if shipping.config.owner != self.me:
                raise NotOwner(
                    "this host no longer owns the green", owner_host=shipping.config.owner.host
                )
            targets = self._targets(shipping)
            prefix = shipping.copies.prefix
            lagging = [p for p in targets if prefix.get(p, 0) < through]
            if not lagging:
                return
            failed: set[Peer] = set()
            fenced: list[EpochFenced] = []
            for position in range(min(prefix.get(p, 0) for p in lagging) + 1, through + 1):
                export = await self._export(shipping, position)
                shipping.head = max(shipping.head, position)
                if position not in shipping.copies.accepts:
                    shipping.copies.committed(position, set())
                due = [p for p in lagging if p not in failed and prefix.get(p, 0) < position]

                async def place(
                    peer: Peer, position: int = position, export: Export = export
                ) -> None:
                    try:
                        with trio.fail_after(LEDGER_TIMEOUT * 2):
                            await self._place(shipping, peer, position, export)
                    except EpochFenced as exc:
                        fenced.append(exc)
                        failed.add(peer)
                    except (SlatesError, trio.TooSlowError) as exc:
                        self._log(f"placing {shipping.name}@{position} on {peer.host}: {exc}")
                        failed.add(peer)  # this holder later; the others now

                async with trio.open_nursery() as nursery:  # the holders at once
                    for peer in due:
                        nursery.start_soon(place, peer)
                if fenced:
                    raise fenced[0]

    async def shipping_for(self, green: str) -> Shipping:
        config = await self.config(green)
        if config.owner != self.me:
            raise NotOwner("this host does not own the green", owner_host=config.owner.host)
        found = self.shipping.get(green)
        if found is None:
            shard, local = self.local_of(green)
            found = self.shipping[green] = Shipping(green, shard, local, config)
        return found

    async def head_position(self, shipping: Shipping) -> int:
        view = await self._shard(shipping.shard, "versions", {"green": shipping.local, "limit": 1})
        return position_of(int(view["head"]))

    async def ship_all(self, greens: list[str]) -> None:
        """One pass of the shipping loop over the greens this host owns."""
        for green in greens:
            config = self.configs.get(green)
            if config is None or config.owner != self.me or green in self._taking:
                continue  # not ours, or recovered first
            shipping = await self.shipping_for(green)
            await self.ship(shipping, await self.head_position(shipping))

    async def durable(
        self, shard: int, work: str, version: int, scope: str, timeout: float
    ) -> dict[str, Any]:
        if scope not in SCOPES:
            raise InvalidArgument("a durability scope is restart, host or region", scope=scope)
        info = await self._shard(shard, "volume.show", {"volume": work})
        local = info.get("green") if isinstance(info, dict) else None
        if not isinstance(local, str):
            raise InvalidArgument("not a work volume of a green", volume=work)
        return await self.durable_of(self.name_of(local, shard_of(local)), version, scope, timeout)

    async def durable_of(
        self, green: str, version: int, scope: str, timeout: float
    ) -> dict[str, Any]:
        """Wait until `version` of the green this host owns (by fleet name) reaches
        `scope`, at most `timeout` seconds; answers the scope it reached."""
        if scope not in SCOPES:
            raise InvalidArgument("a durability scope is restart, host or region", scope=scope)
        shipping = await self.shipping_for(green)
        position = position_of(version)
        reached: tuple[str, ...] = ("restart",)
        with trio.move_on_after(timeout):
            while True:
                await self.ship(shipping, position)
                head = max(shipping.head, position)
                reached = shipping.copies.scopes(shipping.config, position, head)
                if scope in reached or (scope == "region" and shipping.config.mirror is None):
                    break
                await trio.sleep(0.2)
        return {
            "durability": best_scope(reached),
            "scopes": list(reached),
            "wanted": scope,
            "green": shipping.name,
            "epoch": shipping.config.epoch,
        }

    # -- takeover and recovery

    async def on_failed(self, dead_host: str, spawn: Callable[..., None]) -> None:
        """serf declared `dead_host` failed: start the takeovers this host is chosen for,
        once the dead boot's alive key is gone from etcd too (module doc: Takeover)."""
        await self.refresh()
        alive = self._alive() | {self.me.host}
        chosen = [
            c
            for c in self.configs.values()
            if choose_successor(c, dead_host, alive) == self.me.host and c.green not in self._taking
        ]
        if not chosen:
            return
        leases: dict[str, str] | None = None
        with trio.move_on_after(LEASE_WAIT_SECONDS):
            while True:
                if dead_host in self._alive():
                    self._log(f"{dead_host} is alive again: no takeover")
                    return
                leases = await self._council_call(self._council.alive_hosts)
                if all(leases.get(dead_host) != c.owner.boot for c in chosen):
                    break
                await trio.sleep(LEASE_POLL_SECONDS)
        if leases is None:
            self._log(f"etcd did not say whether {dead_host}'s lease lapsed: no takeover")
            return
        for config in chosen:
            if leases.get(dead_host) == config.owner.boot:
                self._log(f"{config.green}: the owner's lease still lives; no takeover")
                continue
            spawn(self._takeover_logged, config.green, config.epoch)

    async def _takeover_logged(self, green: str, epoch: int) -> None:
        try:
            result = await self.take_over(green, epoch)
            self.takeovers[green] = f"adopted as {result['local']} at epoch {result['epoch']}"
        except SlatesError as exc:
            self.takeovers[green] = f"{exc.code}: {exc.message}"
            self._log(f"takeover of {green}: {exc.code}: {exc.message}")

    async def take_over(self, green: str, expected_epoch: int) -> dict[str, Any]:
        """Commit this host as owner at expected_epoch + 1, recover and serve (module doc)."""
        if green in self._taking:
            raise InvalidArgument("a takeover of that green is under way", green=green)
        self._taking.add(green)
        try:
            current = await self._council_call(self._council.green, green)
            if current is None:
                raise NotFound("no such green in the fleet", green=green)
            if current.epoch != expected_epoch or current.owner == self.me:
                raise EpochFenced(
                    "the green's committed epoch is not the one this takeover expected",
                    green=green,
                    epoch=current.epoch,
                    expected=expected_epoch,
                    owner_host=current.owner.host,
                )
            # The owner boot's lease must have lapsed, and its host must not put its alive
            # key back before our commit (the transaction compares it): until then the
            # owner may still prove its ownership and serve (slates.fleet.fencing).
            owner_host = current.owner.host
            boot, alive = await self._council_call(self._council.alive_revision, owner_host)
            if boot == current.owner.boot:
                raise Unavailable(
                    "the owner's lease in etcd still lives: it may still be serving",
                    green=green,
                    owner_host=owner_host,
                )
            new = successor_config(current, self.me)
            if not await self._council_call(
                self._council.commit_config, new, expected_epoch, (owner_host, alive)
            ):
                now = await self._council_call(self._council.green, green)
                if now is not None and now.epoch == expected_epoch:
                    raise Unavailable(
                        "the owner's host came back to etcd before the takeover committed",
                        green=green,
                        owner_host=owner_host,
                    )
                raise EpochFenced(
                    "another candidate committed first",
                    green=green,
                    owner_host=now.owner.host if now is not None else "",
                )
            committed = await self.config(green, new.epoch)
            self._log(f"committed {green} at epoch {committed.epoch}: recovering")
            started = time.monotonic()
            shard, local, successor, store = await self._recover(committed)
            chain = successor.chain or ()
            # The submissions that made the versions: a retry gets its version back.
            self.made_by.adopt_chain(green, (entry.value for entry in chain))
            self.adopted[green] = (shard, local)
            shipping = Shipping(green, shard, local, committed)
            # What the promisers hold is not shipped again, and the adopted values are
            # the ones shipped for those positions (never a re-export's).
            for peer, promise in successor.promises.items():
                shipping.copies.heard(committed, peer, promise.prefix)
            for position, tree in enumerate(verify(chain, store), start=1):
                chunks = {chunk_id(tree): tree}
                for entry in decode_tree(tree):
                    chunks.update((c, store.get(c)) for c, _ in entry.chunks)
                shipping.exports[position] = Export(tree, chunks, chain[position - 1].value)
                shipping.copies.committed(position, {self.me})
            shipping.head = len(chain)
            self.shipping[green] = shipping
            trees = chain
            seconds = time.monotonic() - started
            self._log(f"serving {green} as {local} ({len(trees)} versions, {seconds:.1f} s)")
            return {
                "green": green,
                "epoch": committed.epoch,
                "local": local,
                "versions": len(trees),
            }
        finally:
            self._taking.discard(green)

    async def _gather(
        self, config: GreenConfig, promisers: list[Peer], wanted: list[bytes], into: ChunkStore
    ) -> None:
        for chunk in wanted:
            if chunk in into:
                continue
            with contextlib.suppress(SlatesError):  # not held here: a promiser has it
                into.put(chunk, self.holder.chunks.get(chunk))
        for peer in promisers:
            missing = [c for c in wanted if c not in into]
            if not missing:
                return
            try:
                answers = await self.deliver(
                    peer.host, [Gather(self.me, config.green, tuple(missing))]
                )
            except SlatesError as exc:
                self._log(f"gathering from {peer.host}: {exc.message}")
                continue
            for answer in answers:
                if isinstance(answer, Gathered):
                    try:
                        into.put(answer.chunk, answer.data)  # BLAKE3-checked
                    except VerificationFailed:
                        self._log(f"{peer.host} sent a chunk that fails verification")
        if any(c not in into for c in wanted):
            raise VerificationFailed("chunks no promiser could give", green=config.green)

    async def _recover(self, config: GreenConfig) -> tuple[int, str, Successor, ChunkStore]:
        successor = Successor(time.monotonic())
        for _ in range(RECOVERY_ROUNDS):
            alive = self._alive() | {self.me.host}
            for peer in successor.unpromised(config):
                if peer.host not in alive:
                    continue
                try:
                    answers = await self.deliver(
                        peer.host, [Prepare(self.me, config.green, config.epoch)]
                    )
                except SlatesError as exc:
                    self._log(f"prepare to {peer.host}: {exc.message}")
                    continue
                _refusal(answers)
                for answer in answers:
                    if isinstance(answer, Promise):
                        successor.add(config, answer)
            if successor.adopted:
                break
            await trio.sleep(1.0)
        if successor.chain is None:
            raise Unavailable("no write quorum of holders promised", green=config.green)
        chain = successor.chain
        store = ChunkStore(self.holder.chunks.capacity)
        promisers = sorted(successor.promises)
        await self._gather(config, promisers, list(needed_chunks(chain, store)), store)
        trees = verify(chain, store)  # every tree record recomputed and root-checked
        files = [c for tree in trees for e in decode_tree(tree) for c, _ in e.chunks]
        await self._gather(config, promisers, list(dict.fromkeys(files)), store)
        shard, local = await self.trees.import_green(config.green, trees, store)
        return shard, local, successor, store


def _refusal(messages: list[Message]) -> None:
    for message in messages:
        if isinstance(message, Refused):
            raise error_from_wire(
                {
                    "code": message.code,
                    "message": f"the holder {message.sender.host} refused",
                    "details": {"promised": message.promised, "holder": message.sender.host},
                }
            )


def _batches(
    me: Peer, green: str, wanted: list[bytes], chunks: dict[bytes, bytes]
) -> list[list[Message]]:
    """Chunk messages for the ids a holder fetched, in batches of bounded bytes."""
    batches: list[list[Message]] = []
    batch: list[Message] = []
    size = 0
    for chunk in dict.fromkeys(wanted):
        data = chunks.get(chunk)
        if data is None:
            raise VerificationFailed("a holder fetched a chunk the export lacks")
        if batch and size + len(data) > CHUNK_BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
        batch.append(Chunk(me, green, chunk, data))
        size += len(data)
    if batch:
        batches.append(batch)
    return batches
