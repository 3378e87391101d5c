"""The fleet link's remote work volumes: tree records and pieces on demand, submissions.

Theory of operation (DESIGN.md section 7, "Remote reads"; the shard's side
is slates.node.remote_ops).  A shard of this host that holds a work
volume of another host's green asks its link, on fleet.sock:

- `{"op": "remote.tree", "green": NAME, "version": V | None}`: the tree
  record of version V (None: the owner's head, asked with a forwarded
  `versions`).  Sources, in order (`sources`): this host's holder copy,
  the other holder candidates serf sees alive, then the owner.  A holder
  answers from its committed prefix only (`Holder.serve`, which recomputes
  and checks every tree root of the chain); the owner from its export of
  the version (slates.fleet.link_replicate).  Answers `{"version",
  "tree", "source"}`.
- `{"op": "remote.chunks", "green", "version", "chunks": [[id, size]...]}`:
  the pieces by BLAKE3 id, asked of the same sources in the same order,
  in batches of at most BATCH_BYTES, each source asked only for what the
  ones before it lacked.  Answers `{"chunks": [[id, bytes]...], "sources":
  {host: count}}`.  The link passes the bytes on as they came: the shard
  checks every piece against its id before it stores any (so a damaged
  piece is refused where it would be stored).
- `{"op": "remote.submit", "green", "version", "ops", "request", ...}`:
  slates.fleet.link_submit sends it to the green's committed owner, whose
  link runs it once per identity (`run_submission` here: a scratch work
  volume of version V (`fleet-remote-*`) gets the ops (shard requests by
  path: unlink, rmdir, mkdir, symlink, write), is submitted (the owner
  merges it as any submission: conflicts come back structured) and
  deleted) and answers a retry its kept reply; `after_submission` waits
  for a durability scope on every answer.  The owner's shard requests go
  as the link's own client `fleet-remote-<boot>`, one at a time (each
  acknowledges the one before, so the owner keeps no saved replies of
  them).
- `{"op": "remote.stats"}`: pieces this link served to each peer and
  fetched from each source, and its submissions' counts; `{"op":
  "remote.damage", "count": N}`: a fault for tests, the next N pieces this
  link serves have one byte flipped (at most MAX_DAMAGE).

Peers ask each other over QUIC as `{"kind": "remote", "op": "tree" |
"chunks" | "submit", ...}` (handled by `serve`), from an enrolled host
(slates.fleet.link_routing checks).  Bounds: BATCH_BYTES per answer, MAX_WANTED pieces per ask,
REMOTE_TIMEOUT per peer exchange.
"""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from slates.errors import (
    InvalidArgument,
    MissingContent,
    NotFound,
    NotOwner,
    SlatesError,
    Unavailable,
    VerificationFailed,
    error_from_wire,
)
from slates.fleet.config import GreenConfig
from slates.fleet.link_replicate import Replicator
from slates.fleet.link_rules import Forward, split_fleet_name
from slates.fleet.link_submit import DURABILITY_SECONDS, Submissions
from slates.fleet.replica import position_of
from slates.node.protocol import pack, shard_of, unpack

__all__ = ["BATCH_BYTES", "RemoteReads", "sources"]

BATCH_BYTES: Final = 16 << 20
MAX_WANTED: Final = 4096
MAX_DAMAGE: Final = 1000
OWNER_ATTEMPTS: Final = 4
REMOTE_TIMEOUT: Final = 30.0
MAX_OPS: Final = 1 << 14

PeerCall = Callable[[str, bytes, float], Awaitable[bytes]]
ForwardCall = Callable[[Forward], Awaitable[bytes]]


def sources(config: GreenConfig, me: str, alive: set[str]) -> list[str]:
    """Where a green's content is asked for: this host if it holds copies, the other
    live holder candidates by host id, the owner last."""
    holders = sorted({p.host for p in config.members()})
    owner = config.owner.host
    first = [me] if me in holders and me != owner else []
    others = [h for h in holders if h not in (me, owner) and h in alive]
    return [*first, *others, owner]


def _wanted(raw: object) -> list[tuple[bytes, int]]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_WANTED:
        raise InvalidArgument("chunks is a bounded list of [id, size]", limit=MAX_WANTED)
    out: list[tuple[bytes, int]] = []
    for item in raw:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], bytes)
            or len(item[0]) != 32
            or not isinstance(item[1], int)
            or not 0 <= item[1] <= BATCH_BYTES
        ):
            raise InvalidArgument("a wanted piece is [32-byte id, size]")
        out.append((bytes(item[0]), int(item[1])))
    return out


def _version(raw: object, *, optional: bool = False) -> int | None:
    if raw is None and optional:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise InvalidArgument("a version is a number from 0", version=str(raw))
    return raw


def _green(message: dict[str, Any]) -> str:
    green = message.get("green")
    if not isinstance(green, str):
        raise InvalidArgument("names a green", field="green")
    split_fleet_name(green)
    return green


class RemoteReads:
    """One per fleet link (module doc)."""

    def __init__(
        self,
        me: str,
        boot_id: str,
        replicator: Replicator,
        peer_call: PeerCall,
        forward: ForwardCall,
        alive_hosts: Callable[[], set[str]],
    ) -> None:
        self.me = me
        self.client = f"fleet-remote-{boot_id[:16]}"
        self.replicator = replicator
        self._peer = peer_call
        self._forward = forward
        self._alive = alive_hosts
        self.served: collections.Counter[str] = collections.Counter()
        self.fetched: collections.Counter[str] = collections.Counter()
        self.damage = 0
        self._seq = 0
        self._lock = trio.Lock()
        self.submissions = Submissions(
            me, replicator, peer_call, self.run_submission, self.after_submission
        )

    # -- fleet.sock

    async def local(self, message: dict[str, Any]) -> Any:
        match message.get("op"):
            case "remote.tree":
                version = _version(message.get("version"), optional=True)
                return await self.tree(_green(message), version)
            case "remote.chunks":
                version = _version(message.get("version"))
                assert version is not None
                return await self.chunks(_green(message), version, _wanted(message.get("chunks")))
            case "remote.submit":
                return await self.submissions.origin(_green(message), message)
            case "remote.stats":
                return {
                    "served": dict(self.served),
                    "fetched": dict(self.fetched),
                    "submissions": self.submissions.stats(),
                }
            case "remote.drop_replies":
                return self.submissions.drop_replies(message.get("count"))
            case "remote.damage":
                count = message.get("count")
                if not isinstance(count, int) or not 0 <= count <= MAX_DAMAGE:
                    raise InvalidArgument(f"damage 0..{MAX_DAMAGE} pieces", count=str(count))
                self.damage = count
                return {"damage": count}
            case op:
                raise InvalidArgument("unknown remote request", op=str(op))

    async def tree(self, green: str, version: int | None) -> dict[str, Any]:
        config = await self.replicator.config(green)
        if version is None:
            view = await self._owner_call(green, "versions", {"limit": 0}, on_green=True)
            version = int(view["head"])
        failure: SlatesError = NotFound("no holder or owner has that version", green=green)
        for host in sources(config, self.me, self._alive()):
            try:
                found = await self._ask(host, {"op": "tree", "green": green, "version": version})
            except SlatesError as exc:
                failure = exc
                continue
            tree = found.get("tree") if isinstance(found, dict) else None
            if isinstance(tree, bytes):
                return {"version": version, "tree": tree, "source": host}
        raise failure

    async def chunks(
        self, green: str, version: int, wanted: list[tuple[bytes, int]]
    ) -> dict[str, Any]:
        config = await self.replicator.config(green)
        remaining = dict(wanted)
        found: dict[bytes, bytes] = {}
        used: collections.Counter[str] = collections.Counter()
        for host in sources(config, self.me, self._alive()):
            for batch in _batches(list(remaining.items())):
                body = {"op": "chunks", "green": green, "version": version, "chunks": batch}
                try:
                    answer = await self._ask(host, body)
                except SlatesError:
                    break  # the next source
                for item in answer.get("chunks", []) if isinstance(answer, dict) else []:
                    if isinstance(item, list) and len(item) == 2 and item[0] in remaining:
                        del remaining[item[0]]
                        found[bytes(item[0])] = bytes(item[1])
                        used[host] += 1
            if not remaining:
                break
        self.fetched.update(used)
        return {"chunks": [[c, d] for c, d in found.items()], "sources": dict(used)}

    # -- peers (and this host, for its own holder copy)

    async def _ask(self, host: str, body: dict[str, Any]) -> Any:
        if host == self.me:
            return await self.serve(self.me, body)
        raw = await self._peer(host, pack({"kind": "remote", **body}), REMOTE_TIMEOUT)
        return unpack(raw)

    async def serve(self, peer: str, message: dict[str, Any]) -> dict[str, Any]:
        """A peer's (or this host's) ask for a tree record, pieces or a submission."""
        green = _green(message)
        if message.get("op") == "submit":
            return await self.submissions.serve(peer, message)
        version = _version(message.get("version"))
        assert version is not None
        position = position_of(version)
        holder = self.replicator.holder
        match message.get("op"):
            case "tree":
                if holder.prefix(green) >= position:
                    return {"tree": holder.serve(green, position)}
                export = await self._export(green, position)
                return {"tree": export.tree}
            case "chunks":
                wanted = _wanted(message.get("chunks"))
                out: list[list[Any]] = []
                lacking: list[bytes] = []
                for chunk, _size in wanted:
                    if chunk in holder.chunks:
                        out.append([chunk, holder.chunks.get(chunk)])
                    else:
                        lacking.append(chunk)
                if lacking and self._owns(green):
                    export = await self._export(green, position)
                    out += [[c, export.chunks[c]] for c in lacking if c in export.chunks]
                if self.damage and out:
                    self.damage -= 1
                    data = bytearray(out[0][1])
                    if data:
                        data[0] ^= 0xFF
                    out[0][1] = bytes(data)
                self.served[peer] += len(out)
                return {"chunks": out}
            case op:
                raise InvalidArgument("unknown remote request", op=str(op))

    def _owns(self, green: str) -> bool:
        config = self.replicator.configs.get(green)
        return config is not None and config.owner == self.replicator.me

    async def _export(self, green: str, position: int) -> Any:
        if not self._owns(green):
            raise MissingContent("this host holds no copy of that version", green=green)
        shipping = await self.replicator.shipping_for(green)
        return await self.replicator.export_version(shipping, position)

    # -- submissions on the owner (slates.fleet.link_submit runs each once)

    async def run_submission(self, green: str, message: dict[str, Any]) -> dict[str, Any]:
        """A remote work volume's ops, submitted on this host, the green's owner: a
        scratch work volume of the base version gets them, is submitted and deleted."""
        version = _version(message.get("version"))
        ops = message.get("ops")
        if not isinstance(ops, list) or len(ops) > MAX_OPS:
            raise InvalidArgument("ops is a bounded list of [op, args]", limit=MAX_OPS)
        for item in ops:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or item[0] not in ("unlink", "rmdir", "mkdir", "symlink", "write")
                or not isinstance(item[1], dict)
            ):
                raise InvalidArgument("an op is [unlink|rmdir|mkdir|symlink|write, args]")
        name = f"fleet-remote-{uuid.uuid4().hex[:12]}"
        args = {"name": name, "version": version}
        made = await self._owner_call(green, "work.create", args, on_green=True)
        work_id = str(made["id"])
        host, work = split_fleet_name(work_id) if "@" in work_id else (None, work_id)
        try:
            for op, op_args in ops:
                await self._work_call(green, host, work, op, op_args)
            submit: dict[str, Any] = {}
            if message.get("dry_run") is True:
                submit["dry_run"] = True
            reply = await self._work_call(green, host, work, "submit", submit)
            if not isinstance(reply, dict):
                raise VerificationFailed("the owner answered no submission")
            return reply
        finally:
            # A scratch volume left behind (the owner unreachable) is named fleet-remote-*.
            with trio.CancelScope(shield=True), contextlib.suppress(SlatesError):
                await self._work_call(green, host, work, "volume.delete", {"force": True})

    async def after_submission(
        self, green: str, message: dict[str, Any], reply: dict[str, Any]
    ) -> dict[str, Any]:
        """The reply, with the durability scope the version reached when one is asked."""
        scope = message.get("durability")
        if scope is None or not reply.get("made_version") or message.get("dry_run") is True:
            return reply
        if scope == "restart":
            return {**reply, "durability": "restart", "scopes": ["restart"]}
        timeout = message.get("durability_timeout") or DURABILITY_SECONDS
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise InvalidArgument("durability_timeout is 0..600 s")
        found = await self.replicator.durable_of(
            green, int(reply["version"]), str(scope), float(timeout)
        )
        return {**reply, "durability": found["durability"], "scopes": found["scopes"]}

    async def _owner_call(
        self, green: str, op: str, args: dict[str, Any], *, on_green: bool
    ) -> Any:
        """`op` on the green's committed owner, naming the green by its original ids."""
        names, local = split_fleet_name(green)
        full = {**args, "green": local} if on_green else args
        return await self._call(green, None, names, shard_of(local), op, full)

    async def _work_call(
        self, green: str, host: str | None, work: str, op: str, args: dict[str, Any]
    ) -> Any:
        """`op` on the scratch work volume (on `host`, or the owner when None)."""
        return await self._call(green, host, "", shard_of(work), op, {**args, "volume": work})

    async def _call(
        self, green: str, host: str | None, names: str, shard: int, op: str, args: dict[str, Any]
    ) -> Any:
        failure: SlatesError = Unavailable("the owner did not answer", green=green)
        for _ in range(OWNER_ATTEMPTS):
            target = host or (await self.replicator.config(green)).owner.host
            async with self._lock:
                self._seq += 1
                request = {"seq": self._seq, "ack": self._seq - 1, "op": op, "args": args}
                forward = Forward(target, shard, self.client, request, names)
                try:
                    raw = await self._forward(forward)
                except NotOwner as exc:
                    failure = exc
                    await self.replicator.refresh()
                    continue
            reply = unpack(raw)
            if reply.get("ok") is True:
                return reply.get("result")
            error = error_from_wire(reply.get("error") or {})
            if isinstance(error, NotOwner) and host is None:
                failure = error
                await self.replicator.refresh()
                continue
            raise error
        raise failure


def _batches(wanted: list[tuple[bytes, int]]) -> list[list[list[Any]]]:
    out: list[list[list[Any]]] = []
    size = 0
    for chunk, piece in wanted:
        if not out or size + piece > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append([chunk, piece])
        size += piece
    return out
