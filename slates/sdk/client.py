"""The Python SDK: AsyncClient (trio) and Client (blocking), thin over the wire protocol.

Theory of operation: a client finds the local anchor through the runtime
directory's state file and keeps one connection per shard, opened on first
use (hello, ring pair, and a bounded reconnect that resends the same
request, so a retry never runs an operation twice: slates.sdk.session).

Routing needs no lookup: a volume or snapshot id names its shard, and a
new volume goes to the shard its name hashes to.  A volume *name* becomes
an id through `resolve` (the one rule of slates.sdk.names, shared by the
CLI and the MCP server).  Errors come back as the named exceptions of
slates.errors.

One implementation, two transports.  Every rule of the SDK (routing,
resolution, reads in bounded pieces, the attachment barrier, what each
call sends) is written once, in AsyncClient, whose coroutines do I/O only
by awaiting its transport (slates.sdk.transport.Transport) or each other.
AsyncClient runs on trio's transport (slates.sdk.connection).  `Client` is
the blocking face: the same AsyncClient over the blocking transport
(slates.sdk.blocking), whose coroutines never suspend, so each Client
method (a `_Blocking` descriptor over the AsyncClient method of the same
name, with its parameters and result type) runs the coroutine to its end
in one step on the caller's thread: no event loop, no thread, and trio is
never imported.  Invariant: an AsyncClient coroutine awaits nothing but the
transport and AsyncClient coroutines (a Client call that suspends is
VerificationFailed).  Threads may share one Client: each shard connection
takes one request at a time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from slates.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    NotSupported,
    SnapshotBarrierFailed,
    VerificationFailed,
)
from slates.node.runtime import MountInfo, Runtime
from slates.sdk.names import Role, check_reference, is_volume_id, pick_volume
from slates.sdk.session import RECONNECT_SECONDS
from slates.wire import shard_of

if TYPE_CHECKING:
    from slates.sdk.transport import Transport  # a Protocol: only annotations need it

__all__ = ["AsyncClient", "Client", "RECONNECT_SECONDS"]

READ_PIECE = 8 << 20  # the shard answers at most 16 MiB per read
BARRIER_SECONDS = 60.0
_T = TypeVar("_T")
_P = ParamSpec("_P")


def _size(value: int | None, what: str) -> int | None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise InvalidArgument(f"{what} must be a positive number of bytes", value=str(value))
    return value


def _resolved(path: str | os.PathLike[str]) -> str:
    """`str(Path(path).resolve())` without pathlib (a command's start-up would pay ~5 ms
    for it): absolute, symlinks resolved; a symlink loop is RuntimeError, as there."""
    resolved = os.path.realpath(path)
    try:
        os.stat(resolved)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeError(f"Symlink loop from {exc.filename!r}") from None
    return resolved


def _mount_view(mount: MountInfo) -> dict[str, Any]:
    return {
        "directory": mount.directory,
        "volume": mount.volume,
        "pid": mount.pid,
        "health": mount.health,
    }


class AsyncClient:
    """A trio client of the local Slates service (an async context manager)."""

    def __init__(
        self,
        runtime_dir: str | os.PathLike[str] | None = None,
        *,
        client_id: str | None = None,
        rings: bool = True,
        token: str | None = None,
    ) -> None:
        """`token`: an agent's credential (`slates agent add`); default $SLATES_TOKEN,
        else none: the client acts as the operator (the anchor's own user)."""
        self.runtime = Runtime(runtime_dir)
        # Unique enough to keep clients apart; os.urandom spares the CLI importing uuid, and
        # uname's node name (what gethostname returns) importing socket.
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        self.rings = rings
        self.token = token if token is not None else os.environ.get("SLATES_TOKEN") or None
        self._forwarder: Any = None  # slates.fleet.link_client.Forwarder, made on first use
        self._transport: Transport | None = None  # Client sets the blocking one before opening
        self._shard_count = 0

    async def __aenter__(self) -> AsyncClient:
        state = self.runtime.read_state()
        if self._transport is None:
            from slates.sdk.connection import TrioTransport

            self._transport = TrioTransport(self.client_id, self.rings, self.token)
        self._transport.open([shard.socket for shard in state.shards])
        self._shard_count = len(state.shards)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Say goodbye (the shards forget this client's saved replies), then disconnect."""
        if self._transport is not None:
            await self._transport.close()

    def _opened(self) -> Transport:
        if self._transport is None or not self._shard_count:
            raise InvalidArgument("the client is not open; use `async with AsyncClient()`")
        return self._transport

    async def call(self, /, shard: int, op: str, **args: Any) -> Any:
        """Send one request to a shard (the typed methods below wrap this)."""
        transport = self._opened()
        if not 0 <= shard < self._shard_count:
            raise NotFound("the id names a shard this host does not have", shard=shard)
        return await transport.request(shard, op, args)

    async def _each(self, shards: Sequence[int], op: str, **args: Any) -> list[Any]:
        """One request to each of `shards` (serving shards' indices), at once where the
        transport can (Transport.request_each)."""
        transport = self._opened()
        if not all(0 <= shard < self._shard_count for shard in shards):
            raise NotFound("the id names a shard this host does not have", shards=list(shards))
        return await transport.request_each(shards, op, args) if shards else []

    async def _on(self, object_id: str, op: str, **args: Any) -> Any:
        if "@" in object_id:  # "<id>@<host>": a volume whose original owner is another host
            return await self._forward(object_id, op, args)
        return await self.call(shard_of(object_id), op, **args)

    async def _forward(self, object_id: str, op: str, args: dict[str, Any]) -> Any:
        """A request for another host's volume, through this host's fleet link (which
        keeps its request identity across resends and follows NotOwner); the blocking
        Client's forwarder waits without an event loop."""
        from slates.fleet.link_client import Forwarder, link_socket
        from slates.fleet.link_rules import fleet_name, split_fleet_name

        host, local_id = split_fleet_name(object_id)
        if self.token is not None:
            raise NotSupported("an agent's requests do not travel between hosts yet", host=host)
        if self._forwarder is None:
            self._forwarder = Forwarder(
                self.client_id, link_socket(self.runtime.path), blocking=not _in_trio()
            )
        suffix = "@" + host  # the other host's shard knows its own ids only
        local_args = {
            key: value[: -len(suffix)]
            if isinstance(value, str) and value.endswith(suffix)
            else value
            for key, value in args.items()
        }
        result = await self._forwarder.request(host, shard_of(local_id), op, local_args)
        if (
            isinstance(result, dict)
            and isinstance(result.get("id"), str)
            and "@" not in result["id"]
        ):
            result = {**result, "id": fleet_name(host, result["id"])}  # ids keep their host
        return result

    def _fleet_host(self) -> str | None:
        """This host's id in its fleet (the fleet link's state file), None without one."""
        try:
            with open(self.runtime.file("fleet-link.json"), "rb") as state:
                found = json.loads(state.read())
        except (OSError, ValueError):
            return None
        host = found.get("host") if isinstance(found, dict) else None
        return host if isinstance(host, str) and host else None

    def _home(self, name: str) -> int:
        """The shard a new volume named `name` goes to (its name's BLAKE3 hash)."""
        self._opened()
        import blake3  # here: only creating a volume needs it

        digest = blake3.blake3(name.encode()).digest()[:8]
        return int.from_bytes(digest, "big") % self._shard_count

    async def resolve(self, ref: str, role: Role | None = None) -> str:
        """The volume id that `ref` names: an id as is, else the one volume (of `role`)
        with that name (slates.sdk.names: NotFound or InvalidArgument naming candidates)."""
        check_reference(ref, role)
        if is_volume_id(ref) or is_volume_id(ref.rpartition("@")[0]):
            return ref  # an id, or another host's volume by its fleet name (<id>@<host>)
        return pick_volume(ref, await self.list_volumes(), role)

    # -- service ----------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        state = self.runtime.read_state()
        serving = [info.index for info in state.shards if info.state != "failed"]
        answered = dict(zip(serving, await self._each(serving, "status"), strict=True))
        shards = []
        for info in state.shards:
            if info.state == "failed":  # it kept dying: the anchor left it down
                shard = {"shard": info.index, "volumes": [], "snapshots": [], "failed": {}}
                shard.update(host_physical_bytes=0)
            else:
                shard = answered[info.index]
            shard.update(pid=info.pid, restarts=info.restarts, state=info.state)
            shards.append(shard)
        mounts = [_mount_view(m) for m in state.mounts]
        lost: Any = None  # what the previous anchor took with it when it died, if one did
        with (
            contextlib.suppress(FileNotFoundError, json.JSONDecodeError),
            open(self.runtime.file("lost.json"), "rb") as lost_file,
        ):
            lost = json.loads(lost_file.read())
        return {
            "anchor_pid": state.pid,
            "capacity": state.capacity,
            "shards": shards,
            "mounts": mounts,
            "previous_anchor_lost": lost,
        }

    async def _anchor(self, request: dict[str, Any]) -> Any:
        """One request to the anchor's control socket (mounts), with the client's token:
        an agent mounts and unmounts as itself."""
        if self.token is not None:
            request = {**request, "token": self.token}
        return await self._opened().control(self.runtime.file("anchor.sock"), request)

    async def mount(
        self,
        volume: str,
        directory: str | os.PathLike[str],
        *,
        writeback: bool = False,
        allow_other: bool = False,
    ) -> dict[str, Any]:
        """Serve a volume at an empty directory you own (returns once it serves).

        By default every write goes through to the shard at once: the kernel's
        attributes stay valid across closes (warm rereads send no requests),
        SEEK_DATA/SEEK_HOLE see holes, and changes other clients make, size
        included, reach even files held open.  writeback=True lets the kernel
        gather writes (fewer, larger requests: a build of many small writes
        runs faster), but every close makes the next stat ask again, each
        closed file's times cost a request, holes read as data, and a file
        held open while another client changes its size keeps the old size
        until it is closed (bench/RESULTS.md).
        allow_other=True lets other users' processes enter the mount (FUSE's
        allow_other; the kernel still checks each file's permissions).
        """
        shard_of(volume)
        request: dict[str, Any] = {
            "op": "mount",
            "volume": volume,
            "directory": _resolved(directory),
            "writeback": writeback,
        }
        if allow_other:  # sent only when asked, so an ordinary mount sends what it always did
            request["allow_other"] = True
        result: dict[str, Any] = await self._anchor(request)
        return result

    async def unmount(
        self, directory: str | os.PathLike[str], *, force: bool = False
    ) -> dict[str, Any]:
        """Flush and detach a mount; refused while a process uses it, unless forced (lazy)."""
        path = _resolved(directory)
        with contextlib.suppress(OSError):
            await self._opened().syncfs(path, None)
        result: dict[str, Any] = await self._anchor(
            {"op": "unmount", "directory": path, "force": force}
        )
        return result

    async def _barrier(self, volume: str) -> None:
        """The attachment barrier: every mount of the volume writes back its kernel cache.

        syncfs returns once the kernel has sent every dirty page and the bridge
        has had each write acknowledged by the shard, so those bytes belong to
        the snapshot; writes after it belong to the next generation.
        """
        for mount in self.runtime.read_state().mounts:
            if mount.volume != volume:
                continue
            try:
                await self._opened().syncfs(mount.directory, BARRIER_SECONDS)
            except OSError as exc:  # TimeoutError too: the transport's bound ran out
                raise SnapshotBarrierFailed(
                    "a mount could not write back its cached changes",
                    directory=mount.directory,
                    reason=str(exc) or "timed out",
                ) from None

    # -- volumes ----------------------------------------------------------------

    async def create_volume(
        self,
        name: str,
        *,
        base: str | os.PathLike[str] | None = None,
        from_snapshot: str | None = None,
        capture: bool = False,
        bounded: int | None = None,
        dynamic: int | None = None,
        case_insensitive: bool = False,
    ) -> dict[str, Any]:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a volume needs a name")
        args: dict[str, Any] = {
            "name": name,
            "case_insensitive": case_insensitive,
            "capture": capture,
        }
        if base is not None:
            args["base"] = _resolved(base)
        if from_snapshot is not None:
            args["from"] = from_snapshot
        if _size(bounded, "bounded") is not None:
            args["bounded"] = bounded
        if _size(dynamic, "dynamic") is not None:
            args["dynamic"] = dynamic
        shard = shard_of(from_snapshot) if from_snapshot is not None else self._home(name)
        await self._check_name_free(name, shard)
        result: dict[str, Any] = await self.call(shard, "volume.create", **args)
        return result

    async def _check_name_free(self, name: str, shard: int) -> None:
        """Names are unique among the host's live volumes: the shard that makes the volume
        refuses a name its own volumes have (atomically), and this asks the other
        shards first, since clones and work volumes live on their snapshot's or
        green's shard rather than their name's.  (Two clients racing to make one
        name on two shards at once can both pass; resolution then names both.)"""
        others = [index for index in self._serving_shards() if index != shard]
        for listed in await self._each(others, "volume.list"):
            taken = [v for v in listed if v.get("name") == name]
            if taken:
                raise AlreadyExists(
                    f"volume {taken[0]['id']} has that name already",
                    name=name,
                    volume=taken[0]["id"],
                )

    async def list_volumes(self) -> list[dict[str, Any]]:
        """The volumes of every shard that serves (a shard left down has none to list)."""
        volumes: list[dict[str, Any]] = []
        for listed in await self._each(self._serving_shards(), "volume.list"):
            volumes.extend(listed)
        return volumes

    def _serving_shards(self) -> list[int]:
        """The shards that serve (the anchor leaves one that keeps dying down)."""
        return sorted(
            info.index for info in self.runtime.read_state().shards if info.state != "failed"
        )

    async def show_volume(self, volume: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(volume, "volume.show", volume=volume)
        return result

    async def counters(self, volume: str) -> dict[str, Any]:
        result: dict[str, Any] = (await self.show_volume(volume))["counters"]
        return result

    async def delete_volume(self, volume: str, *, force: bool = False) -> None:
        """Delete a volume.  Refused, unless `force`, while it is mounted, and for a green
        volume while it has work volumes or versions no landing has written yet."""
        if force:
            await self._on(volume, "volume.delete", volume=volume, force=True)
        else:
            await self._on(volume, "volume.delete", volume=volume)

    async def delete_snapshot(self, snapshot: str, *, force: bool = False) -> None:
        """Delete a snapshot (refused while a plan or a green's ledger needs it, and,
        unless `force`, while volumes cloned from it live)."""
        args: dict[str, Any] = {"snapshot": snapshot}
        if force:
            args["force"] = True
        await self.call(shard_of(snapshot), "snapshot.delete", **args)

    async def gc(self) -> dict[str, Any]:
        """Collect now on every serving shard (prune greens, free unused content) and at the
        anchor (orphaned bridges and their stale mounts)."""
        total: dict[str, Any] = {"pruned": {}, "freed_bytes": 0, "host_physical_bytes": 0}
        for index in self._serving_shards():
            result = await self.call(index, "gc")
            total["pruned"].update(result["pruned"])
            total["freed_bytes"] += result["freed_bytes"]
            total["host_physical_bytes"] += result["host_physical_bytes"]
        # The anchor's part: bridges of this runtime directory serving no mount of its own
        # (killed), and their mounts (detached).
        total["reaped"] = await self._anchor({"op": "gc"})
        return total

    async def mounts(self) -> list[dict[str, Any]]:
        """This host's mounts (directory, volume, bridge pid), from the anchor's state."""
        return [_mount_view(m) for m in self.runtime.read_state().mounts]

    async def snapshot(self, volume: str) -> str:
        await self._barrier(volume)
        result = await self._on(volume, "snapshot", volume=volume)
        return str(result["id"])

    async def clone(
        self, snapshot: str, name: str, *, bounded: int | None = None, dynamic: int | None = None
    ) -> dict[str, Any]:
        return await self.create_volume(
            name, from_snapshot=snapshot, bounded=bounded, dynamic=dynamic
        )

    async def seal(self, volume: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(volume, "seal", volume=volume)
        return result

    # -- green and work volumes ------------------------------------------------------

    async def create_green(
        self,
        name: str,
        *,
        base: str | os.PathLike[str] | None = None,
        bounded: int | None = None,
        dynamic: int | None = None,
        case_insensitive: bool = False,
        private: Sequence[str] = (),
        submit_ignored: bool = False,
        rewrites: str = "refine",
        keep: int | None = None,
    ) -> str:
        """A green volume (version 0): empty, or a captured copy of `base`; returns its id.

        `private`: more gitignore patterns that work volumes keep to themselves (besides
        `.git/` and what the repository's ignore files ignore, unless `submit_ignored`);
        `rewrites="exact"` submits whole-file rewrites as they were recorded.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a green volume needs a name")
        args: dict[str, Any] = {"name": name, "case_insensitive": case_insensitive}
        if private:
            args["private"] = list(private)
        if submit_ignored:
            args["submit_ignored"] = True
        if rewrites != "refine":
            args["rewrites"] = rewrites
        if keep is not None:
            args["keep"] = keep
        if base is not None:
            args["base"] = _resolved(base)
        for key, value in (("bounded", bounded), ("dynamic", dynamic)):
            if _size(value, key) is not None:
                args[key] = value
        home = self._home(name)
        await self._check_name_free(name, home)
        result = await self.call(home, "green.create", **args)
        return str(result["id"])

    async def create_work(
        self,
        green: str,
        name: str,
        *,
        version: int | None = None,
        bounded: int | None = None,
        dynamic: int | None = None,
        at: str = "here",
    ) -> dict[str, Any]:
        """A work volume on a green version (the head by default): O(1), nothing copied.

        Returns its description with `id` and `base` (the version it started from).

        Another host's green (`<id>@<host>`): with `at="here"` (the default, on a
        host of a fleet) the work volume is made on this host, over the version's
        tree record, its content fetched from the green's holders as it is read
        (slates.node.remote_ops; `remote` in its description); `at="owner"` makes it
        on the green's owner, reached through the fleet link (`<id>@<owner>`).
        """
        if at not in ("here", "owner"):
            raise InvalidArgument("a work volume is made here or at the owner", at=at)
        args: dict[str, Any] = {"green": green, "name": name}
        if version is not None:
            args["version"] = version
        for key, value in (("bounded", bounded), ("dynamic", dynamic)):
            if _size(value, key) is not None:
                args[key] = value
        if "@" in green and at == "here":
            here = self._fleet_host()
            if here is not None and green.rpartition("@")[2] != here:
                home = self._home(name)
                await self._check_name_free(name, home)
                made: dict[str, Any] = await self.call(home, "work.create", **args)
                return made
        if "@" not in green:  # another host's green: its host checks the name
            await self._check_name_free(name, shard_of(green))
        result: dict[str, Any] = await self._on(green, "work.create", **args)
        return result

    async def submit(
        self,
        work: str,
        *,
        dry_run: bool = False,
        durability: str | None = None,
        durability_timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Offer a work volume's changes to its green volume.

        Mounts of the work volume write back first (the attachment barrier),
        then the shard seals it and maps its changes through every version
        accepted since its base.  Returns `ok`, `version` (the new head, or
        None) and `conflicts`; on a conflict nothing changes anywhere.  Also
        `made_version` (True only when a new version was made), `nothing`
        (nothing to submit), `private` (how many changed paths stayed private,
        e.g. under .git/), `paths` (the submitted paths), `refined` and
        `literal` (paths whose rewrites were refined, or went as a literal
        replacement) and `dry_run`.

        dry_run=True reports what would be submitted (`paths`) and makes no
        version; a reply that does not confirm the dry run (a service that
        does not know it) is VerificationFailed.

        `durability` ("restart", "host" or "region"; DESIGN.md section 7): after
        a version is made, wait (at most `durability_timeout` s) until it reaches
        that scope; the reply's `durability` says the widest scope reached and
        `scopes` all of them.  `restart` is reached when the shard replies (it
        journals first); `host` and `region` need the fleet link of the work
        volume's host (slates.fleet.link_replicate).  None: no wait, no field.
        """
        if durability is not None and durability not in ("restart", "host", "region"):
            raise InvalidArgument("a durability scope is restart, host or region", scope=durability)
        await self._barrier(work)
        args: dict[str, Any] = {"volume": work}
        if dry_run:
            args["dry_run"] = True
        if durability is not None and "@" not in work:  # a remote work volume waits itself
            args.update(durability=durability, durability_timeout=durability_timeout)
        result: dict[str, Any] = await self._on(work, "submit", **args)
        if dry_run and result.get("dry_run") is not True:
            raise VerificationFailed(
                "the service did not confirm the dry run (it may have submitted for real)",
                volume=work,
                version=result.get("version"),
            )
        if durability is not None and not dry_run and "durability" not in result:
            result = {**result, **await self._durable(work, result, durability, durability_timeout)}
        return result

    async def _durable(
        self, work: str, result: dict[str, Any], scope: str, timeout: float
    ) -> dict[str, Any]:
        """The durability fields of a submit's reply (submit's doc)."""
        version = result.get("version")
        if scope == "restart" or not result.get("made_version") or not isinstance(version, int):
            return {"durability": "restart", "scopes": ["restart"]}  # journaled before the reply
        from slates.fleet.link_client import acall_link, call_link, link_socket
        from slates.fleet.link_rules import split_fleet_name

        host, local = split_fleet_name(work) if "@" in work else ("", work)
        message = {
            "op": "durable",
            "host": host,
            "shard": shard_of(local),
            "work": local,
            "version": version,
            "scope": scope,
            "timeout": timeout,
        }
        socket_path = link_socket(self.runtime.path)
        if _in_trio():
            found = await acall_link(socket_path, message, timeout=timeout + 20)
        else:  # the blocking Client: no event loop to wait on
            found = call_link(socket_path, message, timeout=timeout + 20)
        return {"durability": found["durability"], "scopes": found["scopes"]}

    async def rebase(self, work: str) -> dict[str, Any]:
        """Move a work volume onto its green head, keeping its changes; publishes nothing."""
        await self._barrier(work)
        result: dict[str, Any] = await self._on(work, "rebase", volume=work)
        return result

    async def versions(self, green: str) -> int:
        """The green volume's head version."""
        return int((await self.ledger(green, limit=0))["head"])

    async def ledger(self, green: str, *, limit: int = 100) -> dict[str, Any]:
        """The head and the last `limit` versions, each with its base and changed paths."""
        result: dict[str, Any] = await self._on(green, "versions", green=green, limit=limit)
        return result

    async def changed_since(self, green: str, version: int) -> list[str]:
        """Paths changed by the versions after `version`."""
        result = await self._on(green, "changed_since", green=green, version=version)
        return [str(path) for path in result]

    # -- landing (requesting only: no call here approves) -------------------------

    async def land_plan(
        self,
        volume: str,
        target: str | os.PathLike[str],
        *,
        paths: list[str] | None = None,
        version: int | None = None,
    ) -> dict[str, Any]:
        """A landing plan: the manifest that would write a green version (or a work
        volume, snapshotted now) into `target`, entry by entry, with its id.

        Landing it needs a human's approval (`slates land approve MANIFEST`).
        """
        args: dict[str, Any] = {"volume": volume, "target": _resolved(target)}
        if paths is not None:
            args["paths"] = list(paths)
        if version is not None:
            args["version"] = version
        result: dict[str, Any] = await self._on(volume, "land.plan", **args)
        return result

    async def land_show(self, manifest: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(manifest, "land.show", manifest=manifest)
        return result

    async def land_content(self, manifest: str, path: str) -> dict[str, bytes | None]:
        """The proposed bytes of one entry and what the disk holds there now."""
        result: dict[str, bytes | None] = await self._on(
            manifest, "land.content", manifest=manifest, path=path
        )
        return result

    async def read_base(self, manifest: str, path: str) -> bytes | None:
        """What the target directory holds at `path` now (None when absent)."""
        result = await self._on(manifest, "land.read_base", manifest=manifest, path=path)
        return None if result is None else bytes(result)

    async def rewitness(
        self, manifest: str, paths: list[str] | None = None, *, merge: bool = False
    ) -> dict[str, Any]:
        """Record what the disk holds now as the witness (after review): a new manifest,
        which needs a new approval.  Changes neither the proposal nor the disk.

        merge=True asks the service to merge the disk's changes into the proposal
        (sent as "merge" only when set)."""
        args: dict[str, Any] = {"manifest": manifest}
        if paths is not None:
            args["paths"] = list(paths)
        if merge:
            args["merge"] = True
        result: dict[str, Any] = await self._on(manifest, "land.rewitness", **args)
        return result

    async def land_apply(self, manifest: str, grant: str) -> dict[str, Any]:
        """Land an approved manifest with its grant (issued only by the approval interface)."""
        result: dict[str, Any] = await self._on(
            manifest, "land.apply", manifest=manifest, grant=grant
        )
        return result

    # -- files ------------------------------------------------------------------

    async def read(self, volume: str, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """Bytes of a file (all of it from `offset` when size is None), in bounded pieces."""
        pieces: list[bytes] = []
        while size is None or size > 0:
            want = READ_PIECE if size is None else min(size, READ_PIECE)
            piece = bytes(
                await self._on(volume, "read", volume=volume, path=path, offset=offset, size=want)
            )
            pieces.append(piece)
            offset += len(piece)
            if size is not None:
                size -= len(piece)
            if len(piece) < want:
                break
        return b"".join(pieces)

    async def write(
        self,
        volume: str,
        path: str,
        data: bytes,
        offset: int = 0,
        *,
        truncate: bool = False,
        create: bool = True,
    ) -> int:
        result = await self._on(
            volume,
            "write",
            volume=volume,
            path=path,
            data=bytes(data),
            offset=offset,
            truncate=truncate,
            create=create,
        )
        return int(result["written"])

    async def edit(self, volume: str, path: str, start: int, end: int, data: bytes) -> int:
        """Replace bytes [start, end) of a file with `data`, moving what follows.

        An insert is start == end, a delete has empty data; the file is
        created when absent.  Returns the file's new size.
        """
        result = await self._on(
            volume, "edit", volume=volume, path=path, start=start, end=end, data=bytes(data)
        )
        return int(result["size"])

    async def truncate(self, volume: str, path: str, size: int) -> None:
        await self._on(volume, "truncate", volume=volume, path=path, size=size)

    async def mkdir(self, volume: str, path: str, mode: int = 0o755) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(
            volume, "mkdir", volume=volume, path=path, mode=mode
        )
        return result

    async def symlink(self, volume: str, path: str, target: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(
            volume, "symlink", volume=volume, path=path, target=target
        )
        return result

    async def readlink(self, volume: str, path: str) -> str:
        return str(await self._on(volume, "readlink", volume=volume, path=path))

    async def unlink(self, volume: str, path: str) -> None:
        await self._on(volume, "unlink", volume=volume, path=path)

    async def rmdir(self, volume: str, path: str) -> None:
        await self._on(volume, "rmdir", volume=volume, path=path)

    async def rename(self, volume: str, src: str, dst: str) -> None:
        await self._on(volume, "rename", volume=volume, src=src, dst=dst)

    async def list(self, volume: str, path: str = "/") -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._on(volume, "list", volume=volume, path=path)
        return result

    async def stat(self, volume: str, path: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._on(volume, "stat", volume=volume, path=path)
        return result


def _in_trio() -> bool:
    import trio  # here: only a fleet wait needs it

    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def _run_to_end(step: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that never suspends (AsyncClient over the blocking transport)."""
    try:
        step.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    step.close()
    raise VerificationFailed("a blocking client call waited on an event loop; it has none")


class _Blocking(Generic[_P, _T]):
    """A Client method: the AsyncClient method of the same name, run to its end over the
    blocking transport, with the same parameters and result type (mypy sees both)."""

    def __init__(
        self, method: Callable[Concatenate[AsyncClient, _P], Coroutine[Any, Any, _T]]
    ) -> None:
        self.method = method
        self.__doc__ = method.__doc__
        self.name = method.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"Client.{name} must wrap AsyncClient.{name}, not {self.name}")

    @overload
    def __get__(self, client: None, owner: type) -> _Blocking[_P, _T]: ...

    @overload
    def __get__(self, client: Client, owner: type | None = None) -> Callable[_P, _T]: ...

    def __get__(
        self, client: Client | None, owner: type | None = None
    ) -> _Blocking[_P, _T] | Callable[_P, _T]:
        if client is None:  # looked up on the class (help, inspect): the wrapper itself
            return self
        method = self.method

        def blocking(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            return _run_to_end(method(client._live(), *args, **kwargs))

        blocking.__name__ = self.name
        blocking.__doc__ = self.__doc__
        return blocking


class Client:
    """The blocking client: every AsyncClient method, on the caller's thread (no trio)."""

    def __init__(self, runtime_dir: str | os.PathLike[str] | None = None, **options: Any) -> None:
        from slates.sdk.blocking import BlockingTransport

        self._async = AsyncClient(runtime_dir, **options)
        self._async._transport = BlockingTransport(
            self._async.client_id, self._async.rings, self._async.token
        )
        self._closed = False
        _run_to_end(self._async.__aenter__())

    def _live(self) -> AsyncClient:
        if self._closed:
            raise InvalidArgument("the client is closed")
        return self._async

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _run_to_end(self._async.aclose())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Every public AsyncClient method but aclose (close does that), in its order.
    call = _Blocking(AsyncClient.call)
    resolve = _Blocking(AsyncClient.resolve)
    status = _Blocking(AsyncClient.status)
    mount = _Blocking(AsyncClient.mount)
    unmount = _Blocking(AsyncClient.unmount)
    create_volume = _Blocking(AsyncClient.create_volume)
    list_volumes = _Blocking(AsyncClient.list_volumes)
    show_volume = _Blocking(AsyncClient.show_volume)
    counters = _Blocking(AsyncClient.counters)
    delete_volume = _Blocking(AsyncClient.delete_volume)
    delete_snapshot = _Blocking(AsyncClient.delete_snapshot)
    gc = _Blocking(AsyncClient.gc)
    mounts = _Blocking(AsyncClient.mounts)
    snapshot = _Blocking(AsyncClient.snapshot)
    clone = _Blocking(AsyncClient.clone)
    seal = _Blocking(AsyncClient.seal)
    create_green = _Blocking(AsyncClient.create_green)
    create_work = _Blocking(AsyncClient.create_work)
    submit = _Blocking(AsyncClient.submit)
    rebase = _Blocking(AsyncClient.rebase)
    versions = _Blocking(AsyncClient.versions)
    ledger = _Blocking(AsyncClient.ledger)
    changed_since = _Blocking(AsyncClient.changed_since)
    land_plan = _Blocking(AsyncClient.land_plan)
    land_show = _Blocking(AsyncClient.land_show)
    land_content = _Blocking(AsyncClient.land_content)
    read_base = _Blocking(AsyncClient.read_base)
    rewitness = _Blocking(AsyncClient.rewitness)
    land_apply = _Blocking(AsyncClient.land_apply)
    read = _Blocking(AsyncClient.read)
    write = _Blocking(AsyncClient.write)
    edit = _Blocking(AsyncClient.edit)
    truncate = _Blocking(AsyncClient.truncate)
    mkdir = _Blocking(AsyncClient.mkdir)
    symlink = _Blocking(AsyncClient.symlink)
    readlink = _Blocking(AsyncClient.readlink)
    unlink = _Blocking(AsyncClient.unlink)
    rmdir = _Blocking(AsyncClient.rmdir)
    rename = _Blocking(AsyncClient.rename)
    list = _Blocking(AsyncClient.list)
    stat = _Blocking(AsyncClient.stat)
