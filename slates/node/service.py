"""One shard's service: client requests turned into replies and journal events.

Theory of operation: a daemon shard owns some volumes.  ShardService is
its whole logic, with no I/O of its own (the base reader it is given reads
source directories): `handle` turns one client request into a reply plus
the list of events that changed state (slates.node.events); the driver
commits those events to the journal as one frame, and only then sends the
reply.  The state itself, how each event changes it, replay and
checkpoints are in slates.node.state (ShardState, the base class): a
request changes state only by emitting events, each applied before it is
kept, so a request that fails half way journals only what it applied.

Op families live beside this module: slates.node.path_ops (file
operations by path), slates.node.fsops (the mount bridge's, by inode),
slates.node.green_ops (green and work volumes, over slates.node.ledger),
slates.node.landing_ops.  Agents are checked by slates.node.principals
before an op runs, and see only their own volumes and the greens.

Remote work volumes (slates.node.remote_ops): `work.create` naming another
host's green by its fleet name ("<id>@<host>") makes a volume here over a
remote base (slates.node.remote_base, opened through the same `open_base`
for its `fleet:` key); any op on such a volume whose base read lacks
content becomes a job that fetches it off the loop and runs the op again;
`submit` of one goes to the green's owner; the collection keeps what such
bases fetched (`kept_chunks`, ShardState's hook).

Request identity is (client, seq).  A retry of a saved request returns the
saved reply; a retry at or below the client's acknowledgement gets
RequestExpired.  Saved replies per client are bounded (MAX_UNACKED).

Ids name their shard: "vol-<shard>-<n>", "snap-<shard>-<n>", so a client
routes by id without any lookup.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from types import GeneratorType
from typing import Any

from slates.base.beneath import Anchored
from slates.base.capturing import CaptureReader, CaptureWriter
from slates.base.live import LiveDirectory
from slates.core.checkpoint import PageStore
from slates.core.host import Host
from slates.core.records import Kind
from slates.core.volume import BaseReader, Capacity, Volume
from slates.errors import (
    AccessDenied,
    AlreadyExists,
    CapacityExhausted,
    ConsistentBaseUnavailable,
    InvalidArgument,
    MissingContent,
    NotFound,
    NotPermitted,
    RequestExpired,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.link_fence import FenceReader
from slates.merge.private import PrivateMatcher
from slates.node.args import int_arg as _int_arg
from slates.node.args import path_arg as _path_arg
from slates.node.args import str_arg as _str_arg
from slates.node.events import (
    ClientBound,
    ClientEnded,
    Event,
    OwnerSet,
    RepliesAcked,
    ReplySaved,
    SnapshotDeleted,
    VolumeCloned,
    VolumeDropped,
    VolumeMade,
)
from slates.node.fsops import run_fs_op
from slates.node.green_ops import OPS as GREEN_OPS
from slates.node.green_ops import GreenOps
from slates.node.green_ops import bool_arg as _bool_arg
from slates.node.jobs import Io, Job, JobBody, Outcome, Pause, Sent, Thrown
from slates.node.landing_ops import LandingOps
from slates.node.path_ops import run_path_op
from slates.node.principals import OPERATOR, Principal, authorize
from slates.node.protocol import Request, error_reply, ok_reply, shard_of
from slates.node.remote_base import RemoteBase
from slates.node.remote_ops import LinkCalls, RemoteOps
from slates.node.state import ShardState

__all__ = ["ShardService", "Event", "MAX_UNACKED", "READ_ONLY_OPS", "shard_of"]

MAX_UNACKED = 1024
LARGE_BASE_READ = 1 << 20  # a read of this many base bytes or more reads the disk off the loop
CAPTURE_SUFFIX = " (capturing)"  # a capture job's scratch volume (never a volume's own name)
MAX_AGENT_VOLUMES = 256  # per agent and shard
MAX_AGENT_CLIENTS = 64  # client ids with saved replies, per agent and shard
READ_ONLY_OPS = frozenset(
    {"status", "volume.list", "volume.show", "read", "list", "stat", "readlink"}
    | {"versions", "changed_since", "land.show", "land.read_base", "land.content", "land.check"}
    | {"fs.getattr", "fs.read", "fs.readlink", "fs.getxattr", "fs.listxattr", "fs.statfs"}
    | {"fs.lseek", "fs.access", "fs.fsync", "fs.base", "bye"}
)
# What a green volume refuses: it changes only by submission.
GREEN_REFUSES = frozenset(
    {"write", "edit", "truncate", "mkdir", "symlink", "unlink", "rmdir", "rename"}
    | {"fs.setattr", "fs.mknod", "fs.mkdir", "fs.unlink", "fs.rmdir", "fs.symlink", "fs.rename"}
    | {"fs.link", "fs.create", "fs.write", "fs.setxattr", "fs.removexattr", "fs.fallocate"}
    | {"fs.copy_file_range"}
)


def _capacity(args: dict[str, Any]) -> Capacity:
    bounded, dynamic = args.get("bounded"), args.get("dynamic")
    if bounded is not None and dynamic is not None:
        raise InvalidArgument("choose --bounded or --dynamic, not both")
    if bounded is not None:
        return Capacity.reserved(_int_arg(args, "bounded"))
    if dynamic is not None:
        return Capacity.dynamic(_int_arg(args, "dynamic"))
    return Capacity.dynamic()


class ShardService(ShardState):
    def __init__(
        self,
        index: int,
        host: Host,
        open_base: Callable[[str], BaseReader],
        approver_key: bytes | None = None,
        protected: tuple[str, ...] = (),
        allow_roots: tuple[str, ...] = (),
    ) -> None:
        def open_any_base(key: str) -> BaseReader:
            remote = self.remote.open(key)  # a remote green version (slates.node.remote_ops)
            return open_base(key) if remote is None else remote

        runtime_dir = protected[0] if protected else None
        self.remote = RemoteOps(self, LinkCalls(runtime_dir))
        # The fleet link's fence table: whether this host may still make versions of a
        # green it owns in the fleet (slates.fleet.fencing); one stat per submission.
        self.fence = FenceReader(
            runtime_dir, lambda text: print(f"shard {index}: {text}", file=sys.stderr)
        )
        super().__init__(index, host, open_any_base, approver_key, protected)
        # Where agents may name bases and landing targets (the operator anywhere).
        self.allow_roots = tuple(os.path.realpath(root) for root in allow_roots)
        # Connections of mount bridges, per volume (not journaled: bridges reconnect).
        self.mounted: dict[str, int] = {}
        self.green_ops = GreenOps(self)
        self.landing = LandingOps(self)
        self._client = ""
        self._principal = OPERATOR  # who asked the request being run
        self._seq = 0  # the seq of the request being run (with _client: its identity)

    # -- requests -------------------------------------------------------------

    def _begin(self, client: str, principal: Principal, seq: int) -> None:
        """Before running a request (or a job's step): no events or applied records
        yet, and whose request it is, for the records and saved replies it makes."""
        self._events = []
        self.applied = []
        self._client = client
        self._principal = principal
        self._seq = seq

    def handle(
        self, client: str, request: Request, now_ns: int, principal: Principal = OPERATOR
    ) -> tuple[dict[str, Any] | Job, list[Event]]:
        """Run one request; returns (reply, events to commit before replying).  A long
        request (a capture) returns its Job instead of a reply: see `step`.

        A client id belongs to the principal that first used it: saved replies
        (grant tokens among them) are never answered to another principal.
        """
        self._begin(client, principal, request.seq)
        bound = self.client_principals.get(client)
        if bound is not None and bound != principal.name:
            denied = AccessDenied("that client id belongs to another principal", client=client)
            return error_reply(request.seq, denied), []
        if request.seq <= self.acked.get(client, 0):
            expired = RequestExpired("the request was already acknowledged", seq=request.seq)
            return error_reply(request.seq, expired), []
        saved = self.results.get(client, {}).get(request.seq)
        if saved is not None:
            return saved, []
        if request.ack > self.acked.get(client, 0):
            self._emit(RepliesAcked(client, request.ack))
        if bound is None:
            if not principal.is_operator and (
                sum(1 for name in self.client_principals.values() if name == principal.name)
                >= MAX_AGENT_CLIENTS
            ):
                full = CapacityExhausted(
                    "this agent has too many client ids with saved replies: end some (bye)",
                    limit=MAX_AGENT_CLIENTS,
                )
                return error_reply(request.seq, full), []
            self._emit(ClientBound(client, principal.name))
        mutating = request.op not in READ_ONLY_OPS
        if mutating and len(self.results.get(client, {})) >= MAX_UNACKED:
            error = InvalidArgument("too many unacknowledged requests", limit=MAX_UNACKED)
            return error_reply(request.seq, error), self._take_events()
        try:
            authorize(principal, request.op, request.args, self.owners, self.greens, self._allowed)
            if request.op in ("volume.create", "work.create") and not principal.is_operator:
                owned = sum(1 for name in self.owners.values() if name == principal.name)
                if owned >= MAX_AGENT_VOLUMES:
                    raise CapacityExhausted(
                        "this agent has as many volumes as it may: delete some",
                        limit=MAX_AGENT_VOLUMES,
                    )
            result = self._run(request.op, request.args, now_ns)
        except Exception as exc:
            return self._done(client, principal, request, error=exc), self._take_events()
        if isinstance(result, GeneratorType):  # a long request: a job (slates.node.jobs)
            job = Job(client, principal, request, result, Pause())
            return self._resume(job, Sent()), self._take_events()
        return self._done(client, principal, request, result=result), self._take_events()

    def handle_write_run(
        self, client: str, requests: list[Request], now_ns: int, principal: Principal = OPERATOR
    ) -> tuple[list[dict[str, Any]], list[Event]] | None:
        """A run of fs.write requests to one file, each starting where the one before
        ended, applied as one write (one record, one journal frame): the reply each
        would have had, and the events.  None, with nothing changed, when any of them
        would not run as a plain new write (a retry, the client's first request, its
        saved replies' bound, a refusal): the caller then runs them one by one."""
        first = requests[0]
        args = first.args
        self._begin(client, principal, first.seq)  # the run's record is the first request's
        acked, saved = self.acked.get(client, 0), self.results.get(client, {})
        if self.client_principals.get(client) != principal.name:
            return None
        if any(r.seq <= acked or r.seq in saved for r in requests):
            return None
        if len(saved) + len(requests) > MAX_UNACKED:
            return None
        if self.remote.view(args["volume"]) is not None:
            return None  # another host's version: a write may wait for its pages (a job)
        data = b"".join(r.args["data"] for r in requests)
        merged = {**args, "data": data}
        try:
            authorize(principal, "fs.write", merged, self.owners, self.greens, self._allowed)
            result = self._run("fs.write", merged, now_ns)
        except SlatesError as exc:
            if not self._events:
                return None  # refused before any change: one by one, each its own answer
            # Changed, then refused (a volume refuses before it changes: not expected):
            # every request gets the refusal, and the journal keeps what changed.
            errors = [self._done(client, principal, r, error=exc) for r in requests]
            return errors, self._take_events()
        if isinstance(result, GeneratorType):  # a job after all: run them one by one
            result.close()
            if self._events:
                raise VerificationFailed("a write run became a job after changing the volume")
            return None
        ack = max(r.ack for r in requests)
        if ack > acked:
            self._emit(RepliesAcked(client, ack))
        replies = []
        for request in requests:
            size = len(request.args["data"])
            each = {**result, "written": size} if isinstance(result, dict) else size
            replies.append(self._done(client, principal, request, result=each))
        return replies, self._take_events()

    def step(
        self, job: Job, outcome: Outcome, now_ns: int
    ) -> tuple[dict[str, Any] | Job, list[Event]]:
        """Advance a job with what its I/O gave; returns (its reply, or the job still
        running, and the events to commit now).  The shard calls it between requests."""
        self._begin(job.client, job.principal, job.request.seq)
        return self._resume(job, outcome), self._take_events()

    def abandon(self, job: Job) -> list[Event]:
        """End a job that will not be resumed (its connection went away): its cleanup
        runs now (a capture drops its scratch volume); returns the events to commit."""
        self._events = []
        self.applied = []
        self._client = job.client
        job.body.close()
        return self._take_events()

    def _resume(self, job: Job, outcome: Outcome) -> dict[str, Any] | Job:
        try:
            if isinstance(outcome, Thrown):
                job.waiting = job.body.throw(outcome.error)
            else:
                job.waiting = job.body.send(outcome.value)
        except StopIteration as finished:
            return self._done(job.client, job.principal, job.request, result=finished.value)
        except Exception as exc:
            return self._done(job.client, job.principal, job.request, error=exc)
        return job

    def on_internal_error(self, client: str, request: Request, error: Exception) -> None:
        """A request failed with an exception that is no SlatesError (a bug): the
        driver may log it (slates.node.shard does, with the traceback)."""

    def _done(
        self,
        client: str,
        principal: Principal,
        request: Request,
        *,
        result: Any = None,
        error: Exception | None = None,
    ) -> dict[str, Any]:
        """A request's reply, saved if it changed anything."""
        if error is None:
            if not principal.is_operator:
                result = self._as_agent(principal, request.op, result)
            reply = ok_reply(request.seq, result)
        elif isinstance(error, SlatesError):
            reply = error_reply(request.seq, error)
        else:  # a bug: answer it, and keep memory and journal in step
            self.on_internal_error(client, request, error)
            failure = VerificationFailed(
                "internal error", op=request.op, reason=f"{type(error).__name__}: {error}"
            )
            reply = error_reply(request.seq, failure)
        if request.op not in READ_ONLY_OPS:
            self._emit(ReplySaved(client, request.seq, reply))
        return reply

    def _allowed(self, path: object) -> bool:
        """Whether `path` lies under a root the operator allowed agents."""
        if not isinstance(path, str) or not path.startswith("/"):
            return False
        real = os.path.realpath(path)
        return any(
            real == root or real.startswith(root.rstrip("/") + "/") for root in self.allow_roots
        )

    def _check_deletable(self, vid: str) -> None:
        """Refuse to delete what someone still uses (`--force` deletes it anyway): a
        mounted volume, a green with live work volumes or with versions no landing
        has written to disk yet."""
        if self.mounted.get(vid):
            raise InvalidArgument(
                "the volume is mounted: unmount it first (or delete with --force)", volume=vid
            )
        self.ledger.check_deletable(vid)

    def _check_name(self, name: str) -> None:
        """Names are unique among the live volumes of a shard."""
        if name.endswith(CAPTURE_SUFFIX):
            raise InvalidArgument("that name is kept for captures in progress", name=name)
        if name in self.names.values():
            taken = next(v for v, n in self.names.items() if n == name)
            raise AlreadyExists(f"volume {taken} has that name already", name=name, volume=taken)

    def _as_agent(self, principal: Principal, op: str, result: Any) -> Any:
        """An agent's view of a result: it owns what it made, and lists only its own
        volumes and the greens."""
        if op in ("volume.create", "work.create") and isinstance(result, dict):
            self._emit(OwnerSet(str(result["id"]), principal.name))
            return {**result, "owner": principal.label}
        if op == "volume.list" and isinstance(result, list):
            return [
                v
                for v in result
                if self.owners.get(v["id"]) == principal.name or v["id"] in self.greens
            ]
        return result

    def release_mount(self, vid: str) -> list[Event]:
        """A mount's connection ended: drop the kernel references it held (journaled)."""
        self._events = []
        volume = self.volumes.get(vid)
        if volume is not None and vid not in self.failed:
            for ino in volume.held_inodes():
                volume.forget(ino, volume.handles(ino))
        return self._take_events()

    def take_moved(self) -> dict[str, list[list[Any]]]:
        """Invalidations for mounted volumes that moved onto another version (driver)."""
        moved, self.moved = self.moved, {}
        return moved

    def _new_id(self, kind: str) -> str:
        object_id = f"{kind}-{self.index}-{self.next_id}"
        self.next_id += 1
        return object_id

    def _volume(self, args: dict[str, Any]) -> tuple[str, Volume]:
        vid = _str_arg(args, "volume")
        if vid in self.failed:
            raise self.failed[vid]
        volume = self.volumes.get(vid)
        if volume is None:
            raise NotFound("no such volume", volume=vid)
        return vid, volume

    def _reader(self, root: Any) -> Volume:
        return Volume(self.host, root)

    def private_matcher(self, green: str, root: Any) -> PrivateMatcher:
        """The green's private-path rule over the ignore files of `root` (landing plans)."""
        return self.green_ops.private_matcher(green, root)

    def _run(self, op: str, args: dict[str, Any], now: int) -> Any:
        match op:
            # A mount's requests, nearly all a shard serves, match none of the names
            # below: they go straight to their volume.
            case op if op.startswith("fs."):
                return self._volume_op(op, args, now)
            case "status":
                return self.status()
            case "volume.list":
                return [self.info(vid) for vid in sorted(self.volumes)]
            case "volume.show":
                vid, _volume = self._volume(args)
                return self.info(vid)
            case "volume.create":
                return self._create_volume(args, now)
            case "volume.delete":
                vid = _str_arg(args, "volume")
                if vid not in self.volumes and vid not in self.failed:
                    raise NotFound("no such volume", volume=vid)
                if not _bool_arg(args, "force"):
                    self._check_deletable(vid)
                self._emit(VolumeDropped(vid))  # a failed volume can be deleted too
                return {"deleted": vid}
            case "bye":
                # The client will not use its id again: forget its saved replies.
                self._emit(ClientEnded(self._client))
                return {}
            case "clone":
                return self._clone(args)
            case "work.create" if "@" in str(args.get("green", "")):
                return self.remote.create_work(args, now)  # another host's green, made here
            case "submit" if self.remote.base_of(str(args.get("volume", ""))) is not None:
                return self.remote.submit(_str_arg(args, "volume"), args, now)
            case "rebase" if self.remote.base_of(str(args.get("volume", ""))) is not None:
                return self.remote.rebase(_str_arg(args, "volume"), args, now)
            case op if op in GREEN_OPS:
                return self.green_ops.run(op, args, now)
            case op if op.startswith("land."):
                return self.landing.run(op, args)
            case "snapshot.delete":
                return self._delete_snapshot(args)
            case "gc":
                return self._gc()
            case "snapshot":
                vid, volume = self._volume(args)
                snapshot = volume.snapshot(self._new_id("snap"))
                return {"id": snapshot.snapshot_id, "volume": vid}
            case "seal":
                _vid, volume = self._volume(args)
                report = volume.seal()
                return {
                    "files": report.files,
                    "chunks_new": report.chunks_new,
                    "chunks_shared": report.chunks_shared,
                    "bytes_sealed": report.bytes_sealed,
                }
            case _:
                return self._volume_op(op, args, now)

    def _volume_op(self, op: str, args: dict[str, Any], now: int) -> Any:
        """An op on one volume: a mount's fs.* request or a path op (`_run`'s last case)."""
        vid, volume = self._volume(args)
        if vid in self.greens and op in GREEN_REFUSES:
            raise NotPermitted("a green volume changes only by submission", volume=vid, op=op)
        if isinstance(volume.base, RemoteBase):
            if op in GREEN_REFUSES and vid in self.remote.submitting:
                raise Unavailable(
                    "this remote work volume is being submitted or rebased: try "
                    "again when that is answered",
                    volume=vid,
                )
            return self._remote_op(vid, volume, op, args, now)
        if op.startswith("fs."):
            return run_fs_op(volume, op, args, now)
        if op == "read" and (warm := self._base_read_warmer(volume, args)) is not None:
            return self._large_base_read(vid, warm, args, now)
        return run_path_op(volume, op, args, now)

    def _remote_op(self, vid: str, volume: Volume, op: str, args: dict[str, Any], now: int) -> Any:
        """An op on a volume over a remote green version: a read of content not here yet
        becomes a job that fetches it, then runs the op again (slates.node.remote_ops)."""

        def run() -> Any:
            current = self.volumes.get(vid)
            if current is None:
                raise NotFound("no such volume", volume=vid)
            if op.startswith("fs."):
                return run_fs_op(current, op, args, now)
            return run_path_op(current, op, args, now)

        try:
            return run()
        except MissingContent as missing:
            if not self.remote.fetchable(missing):
                raise
            return self.remote.fetching(vid, run, missing)

    def request_identity(self) -> str:
        """The (client, seq) of the request being run, as text: the same for its retries."""
        return f"{self._client}/{self._seq}"

    def info(self, vid: str) -> dict[str, Any]:
        found = super().info(vid)
        remote = self.remote.view(vid)
        if remote is None:
            return found
        # A work volume of another host's green: named by the green's fleet name.
        return {**found, "role": "work", "green": remote["green"], "version": remote["version"]} | {
            "remote": remote
        }

    def checkpoint_document(self, pages: PageStore) -> tuple[bytes, Callable[[], None]]:
        """ShardState's, and once it is published the remote bases the journal before
        it named are no longer kept for a replay (slates.node.remote_ops)."""
        document, published = super().checkpoint_document(pages)
        in_use = self.remote.in_use()

        def on_published() -> None:
            published()
            self.remote.checkpointed(in_use)

        return document, on_published

    def kept_chunks(self) -> Iterable[bytes]:
        """The pieces remote bases fetched, which a collection keeps: no extent names
        them (their extents are the base's), yet the volumes read them.  A replay
        collects once, after the whole journal (ShardState.replay), so a remote base
        a later event opens again still finds its tree record and pieces."""
        return self.remote.kept_chunks()

    def _base_read_warmer(self, volume: Volume, args: dict[str, Any]) -> Callable[[], None] | None:
        """For a large read of a file that is wholly its base file's: something that reads
        those bytes from the disk into the page cache (in a worker thread), so the read
        itself, on the loop, copies from memory.  None for anything else."""
        anchor = getattr(volume.base, "anchor", None)
        if not isinstance(anchor, Anchored):
            return None
        try:
            ino = volume.resolve(_path_arg(args))
        except SlatesError:
            return None  # the read itself says what is wrong
        found = volume.base_content(ino)
        if found is None:
            return None
        relative = found[0].lstrip("/")
        offset = max(0, _int_arg(args, "offset", 0))
        size = min(found[1].size - offset, _int_arg(args, "size", found[1].size))
        if size < LARGE_BASE_READ:
            return None

        def warm() -> None:
            fd = anchor.open(relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
                buffer = bytearray(1 << 20)
                for at in range(offset, offset + size, len(buffer)):
                    os.preadv(fd, [buffer], at)
            finally:
                os.close(fd)

        return warm

    def _large_base_read(
        self, vid: str, warm: Callable[[], None], args: dict[str, Any], now: int
    ) -> JobBody:
        """A large read of unchanged base bytes as a job: the disk is read off the loop
        first (a failure there is left to the read itself: drift is its to report)."""
        with contextlib.suppress(SlatesError):
            yield Io(warm)
        volume = self.volumes.get(vid)
        if volume is None:
            raise NotFound("no such volume", volume=vid)
        return run_path_op(volume, "read", args, now)

    # -- volumes and snapshots --------------------------------------------------

    def _create_volume(self, args: dict[str, Any], now: int) -> dict[str, Any] | JobBody:
        name = _str_arg(args, "name")
        self._check_name(name)
        capacity = _capacity(args)
        case_insensitive = bool(args.get("case_insensitive", False))
        base_path, source = args.get("base"), args.get("from")
        if base_path is not None and source is not None:
            raise InvalidArgument("a volume starts from a base directory or a snapshot, not both")
        if args.get("capture", False) and base_path is None:
            raise InvalidArgument("--capture needs a base directory to capture")
        if source is not None:
            return self._clone({"snapshot": source, "name": name, **args})
        if base_path is None:
            return self._new_volume(name, None, capacity, case_insensitive, now)
        if not isinstance(base_path, str) or not base_path.startswith("/"):
            raise InvalidArgument("the base is an absolute directory path", base=str(base_path))
        if not args.get("capture", False):
            return self._new_volume(name, base_path, capacity, case_insensitive, now)
        return self._capture(name, base_path, capacity, case_insensitive, args, now)

    def _capture(
        self,
        name: str,
        base_path: str,
        capacity: Capacity,
        case_insensitive: bool,
        args: dict[str, Any],
        now: int,
    ) -> JobBody:
        """A capture as a job (slates.node.jobs): every read of the source runs off the
        loop, and each batch of records it applies to a scratch volume is committed on
        its own, so other clients' requests run between batches.  The scratch volume
        (named NAME + CAPTURE_SUFFIX) is dropped at the end, or, if the shard dies
        mid-way, by recovery (`abandoned_captures`)."""
        protected = self.protected
        live = yield Io(lambda: LiveDirectory(base_path, protected=protected))
        self._check_allowed(live)
        try:
            reader = yield Io(lambda: CaptureReader(live))
            scratch = self._new_volume(name + CAPTURE_SUFFIX, None, capacity, case_insensitive, now)
            vid = scratch["id"]
            try:
                writer = CaptureWriter(self._scratch(vid), reader.top)
                batches = reader.batches()
                while (batch := (yield Io(lambda: next(batches, None)))) is not None:
                    self._scratch(vid)  # still there: other requests ran meanwhile
                    writer.apply(batch)
                    yield Pause()
                    # Seal as it goes, so the snapshot at the end has little left to hash.
                    self._scratch(vid).seal()
                    yield Pause()
                yield Io(reader.verify)
                self._scratch(vid)
                snapshot = writer.finish(self._new_id("snap"))
            finally:
                if vid in self.volumes:
                    self._emit(VolumeDropped(vid))
        finally:
            live.close()  # closing fds does not wait on the disk; no yield in a finally
        return self._clone(
            {"snapshot": snapshot.snapshot_id, "name": name, **args}, capacity=capacity
        )

    def _scratch(self, vid: str) -> Volume:
        volume = self.volumes.get(vid)
        if volume is None:
            raise ConsistentBaseUnavailable("the capture's scratch volume was deleted", volume=vid)
        return volume

    def abandoned_captures(self) -> list[Event]:
        """After recovery: drop the scratch volumes of captures the last shard did not
        finish (their jobs died with it); returns the events to commit."""
        self._events = []
        for vid, volume_name in sorted(self.names.items()):
            if volume_name.endswith(CAPTURE_SUFFIX):
                self._emit(VolumeDropped(vid))
        return self._take_events()

    def _new_volume(
        self, name: str, base_key: str | None, capacity: Capacity, ci: bool, now: int
    ) -> dict[str, Any]:
        """A volume, empty or over a base directory.  The base is opened here, once
        (never on FUSE, never reaching the runtime directory, for an agent only under an
        allowed root, judged by the opened directory's ancestors), and that very open
        directory is what the volume reads; its (dev, ino) goes into the event, so a
        restart reopening the path refuses another directory put there since."""
        if base_key is None:
            event = VolumeMade(
                self._new_id("vol"), name, None, capacity.bounded, capacity.limit, ci,
                0o755, 0, 0, now,
            )  # fmt: skip
            self._emit(event)
            return self.info(event.vid)
        base = LiveDirectory(base_key, protected=self.protected)
        try:
            self._check_allowed(base)
            top = base.stat("/")
            if top is None or top.kind != Kind.DIR:
                raise InvalidArgument("the base must be a directory", base=base_key)
            event = VolumeMade(
                self._new_id("vol"), name, base_key, capacity.bounded, capacity.limit, ci,
                top.mode, top.uid, top.gid, now, tuple(base.identity),
            )  # fmt: skip
            self.opening[base_key] = base
            self._emit(event)  # the volume takes `base` from `opening`
        finally:
            if self.opening.pop(base_key, None) is base:
                base.close()  # not taken: the event failed
        return self.info(event.vid)

    def _check_allowed(self, base: LiveDirectory) -> None:
        """An agent's base lies under a root the operator allowed (by the open directory)."""
        if not self._principal.is_operator and not base.anchor.lies_within(self.allow_roots):
            base.close()
            raise AccessDenied(
                "an agent's base lies under a root the operator allowed (anchor --allow-root)",
                base=base.root,
                principal=self._principal.label,
            )

    def _clone(self, args: dict[str, Any], capacity: Capacity | None = None) -> dict[str, Any]:
        self._check_name(_str_arg(args, "name"))
        snapshot_id = _str_arg(args, "snapshot")
        if snapshot_id not in self.snapshots:
            raise NotFound("no such snapshot on this shard", snapshot=snapshot_id)
        capacity = capacity or _capacity(args)
        vid = self._new_id("vol")
        self._emit(
            VolumeCloned(vid, _str_arg(args, "name"), snapshot_id, capacity.bounded, capacity.limit)
        )
        return self.info(vid)

    def _delete_snapshot(self, args: dict[str, Any]) -> dict[str, Any]:
        """Delete a snapshot: refused while a green's ledger or a landing plan needs it
        (prune or land first), or, unless forced, while a volume cloned from it lives.
        Its content goes once nothing else shares it."""
        snapshot_id = _str_arg(args, "snapshot")
        if snapshot_id not in self.snapshots:
            raise NotFound("no such snapshot", snapshot=snapshot_id)
        green = self.ledger.green_holding(snapshot_id)
        if green is not None:
            raise InvalidArgument(
                "the snapshot is a version of a green volume (its pruning drops it)",
                snapshot=snapshot_id,
                green=green,
            )
        if snapshot_id in self.desk.sources():
            raise InvalidArgument("a landing plan lands from the snapshot", snapshot=snapshot_id)
        clones = sorted(v for v, origin in self.origins.items() if origin == snapshot_id)
        if clones and not _bool_arg(args, "force"):
            raise InvalidArgument(
                f"{len(clones)} volumes were cloned from the snapshot (delete with --force: "
                "they keep what they share)",
                snapshot=snapshot_id,
                clones=clones[:10],
            )
        self._emit(SnapshotDeleted(snapshot_id))
        return {"deleted": snapshot_id}

    def _gc(self) -> dict[str, Any]:
        """Collect now: prune every green by its policy, then free what nothing uses."""
        pruned = {green: self.green_ops.prune(green) for green in list(self.greens)}
        before = self.host.physical_bytes
        self.garbage_bytes = max(self.garbage_bytes, 1)
        self.collect_garbage(force=True)
        return {
            "pruned": {green: numbers for green, numbers in pruned.items() if numbers},
            "freed_bytes": max(0, before - self.host.physical_bytes),
            "host_physical_bytes": self.host.physical_bytes,
        }

    def _check_unprotected(
        self, path: str, what: str, *, agents_allowed_roots: bool = False
    ) -> tuple[int, int]:
        """Refuse a directory that is, holds or lies inside a protected one, or is on
        FUSE (compared by (dev, ino), never entering a mount), and with
        `agents_allowed_roots`, for an agent one outside the allowed roots (by the
        opened directory's ancestors); returns its identity."""
        with Anchored(path, protected=self.protected, what=what) as anchor:
            if (
                agents_allowed_roots
                and not self._principal.is_operator
                and not anchor.lies_within(self.allow_roots)
            ):
                raise AccessDenied(
                    f"an agent's {what} lies under a root the operator allowed",
                    path=path,
                    principal=self._principal.label,
                )
            return anchor.identity
