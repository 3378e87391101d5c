"""One shard's service: volumes, snapshots and saved results, as a machine over events.

Theory of operation: a daemon shard owns some volumes.  This class is its
whole logic, with no I/O of its own (the base reader it is given reads
source directories): `handle` turns one client request into a reply plus
the list of *events* that changed state; the driver commits those events
to the journal as one frame, and only then sends the reply.  `replay`
applies committed events to rebuild the same state after a crash, and
`checkpoint`/`restore` bound how many events replay must read.

Events are plain lists:
    ["new", vid, name, base_key, bounded, limit, case_insensitive, mode, uid, gid, time_ns]
    ["rec", vid, encoded record]      a record applied to a volume
    ["clone", vid, name, snapshot_id, bounded, limit]
    ["drop", vid]                     a volume deleted
    ["done", client, seq, reply]      the saved reply of a mutating request
    ["ack", client, upto]             replies the client has received
    ["green", vid, snapshot_id, source, policy]   a volume becomes green; the snapshot is v0
    ["work", vid, green, version, start, limit]   a volume is work on a green version,
                                      numbering its new inodes in [start, limit)
    ["reset", vid, snapshot_id, remade]   the volume restarts as a clone of the snapshot,
                                      keeping its numbering, handles and kernel references
                                      (those on `remade` objects are retained by records)
    ["version", green, snapshot_id, base, work, changes, own edits]   a submission accepted
    ["based", vid, version]           a work volume was rebased onto the version
    ["held", vid, version, snapshot]  accepted, but no room to move: it keeps its base
    ["client", client, principal]     a client id's first use binds it to its principal
    ["owner", vid, principal]         an agent made this volume
    ["landed", green, version]        a landing of that version completed
    ["prune", green, [version, ...]]  those versions' content and edits are dropped
    ["unsnap", snapshot_id]           a snapshot deleted
Everything an event needs from outside (base facts, times) is inside it,
so replay needs no base directory except to serve later reads.

Request identity is (client, seq).  A retry of a saved request returns the
saved reply; a retry at or below the client's acknowledgement gets
RequestExpired.  Saved replies per client are bounded (MAX_UNACKED).

Ids name their shard: "vol-<shard>-<n>", "snap-<shard>-<n>", so a client
routes by id without any lookup.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from slates.base.beneath import Anchored
from slates.base.capturing import capture_into
from slates.core import checkpoint
from slates.core.host import Host
from slates.core.records import Attr, Kind, Record, TakeSnapshot, decode, encode
from slates.core.volume import NO_INO_LIMIT, BaseReader, Capacity, Snapshot, Volume, chunk_ids
from slates.errors import (
    AccessDenied,
    AlreadyExists,
    CapacityExhausted,
    InvalidArgument,
    IsADirectory,
    MissingContent,
    NotFound,
    NotPermitted,
    RequestExpired,
    SlatesError,
    VerificationFailed,
    error_from_wire,
)
from slates.merge import changes as merge_changes
from slates.merge import report as merge_report
from slates.merge import tree as merge_tree
from slates.merge.private import PrivateMatcher, PrivatePolicy
from slates.merge.submission import DEFAULT_KEEP, GreenPolicy, Submission, prepare
from slates.node.args import int_arg as _int_arg
from slates.node.args import path_arg as _path_arg
from slates.node.args import str_arg as _str_arg
from slates.node.fsops import run_fs_op
from slates.node.landing import LandingDesk
from slates.node.landing_ops import LandingOps
from slates.node.principals import OPERATOR, Principal, authorize
from slates.node.protocol import Request, error_reply, ok_reply, shard_of

__all__ = ["ShardService", "MAX_UNACKED", "READ_ONLY_OPS", "shard_of"]

MAX_UNACKED = 1024
MAX_AGENT_VOLUMES = 256  # per agent and shard
MAX_AGENT_CLIENTS = 64  # client ids with saved replies, per agent and shard
MAX_READ_BYTES = 16 << 20  # one reply stays well under the 64 MiB frame limit
READ_ONLY_OPS = frozenset(
    {"status", "volume.list", "volume.show", "read", "list", "stat", "readlink"}
    | {"versions", "changed_since", "land.show", "land.read_base", "land.content", "land.check"}
    | {"fs.getattr", "fs.read", "fs.readlink", "fs.getxattr", "fs.listxattr", "fs.statfs"}
    | {"fs.lseek", "fs.access", "fs.fsync", "bye"}
)
Event = list[Any]
# What a green volume refuses: it changes only by submission.
GREEN_REFUSES = frozenset(
    {"write", "edit", "truncate", "mkdir", "symlink", "unlink", "rmdir", "rename"}
    | {"fs.setattr", "fs.mknod", "fs.mkdir", "fs.unlink", "fs.rmdir", "fs.symlink", "fs.rename"}
    | {"fs.link", "fs.create", "fs.write", "fs.setxattr", "fs.removexattr", "fs.fallocate"}
    | {"fs.copy_file_range"}
)
GARBAGE_BATCH_BYTES = 4 << 20
# Work volume n of a green numbers its new inodes in [n << 32, (n + 1) << 32): the
# green adopts those numbers, so no two work volumes' objects ever share one.
WORK_INO_SHIFT = 32
MAX_IGNORE_FILE = 1 << 20  # a .gitignore read for private paths (bigger ones are skipped)
MAX_REPORTED_FILE = 64 << 20  # a conflict's region is found in files up to this size
_NOTHING = Submission((), (), (), ())
MAX_PATH_INDEXES = 16  # versions whose path index is kept for reporting


@dataclasses.dataclass(frozen=True, slots=True)
class Version:
    """One entry of a green volume's ledger."""

    number: int
    snapshot_id: str
    base: int  # the version the submission started from (-1 for v0)
    work: str  # the submitting work volume ("" for v0)
    increment: tuple[merge_changes.Change, ...]  # relative to version number - 1
    # The submission's own byte-range edits, relative to `base` (before mapping).
    originals: tuple[merge_changes.Change, ...] = ()


def _in_base(
    conflict: merge_changes.Conflict, originals: tuple[merge_changes.Change, ...]
) -> merge_changes.Conflict:
    """A range conflict found after mapping, with the range of the author's own edit."""
    if conflict.base is None:
        return conflict
    for change in originals:
        if isinstance(change, merge_changes.Edit) and change.ino == conflict.ino:
            for edit in change.edits:
                if edit.data == conflict.proposed:
                    return dataclasses.replace(conflict, base=(edit.start, edit.end))
    return conflict


def _attr_dict(attr: Attr) -> dict[str, Any]:
    return {
        "ino": attr.ino,
        "st_ino": attr.st_ino,
        "kind": attr.kind.name.lower(),
        "mode": attr.mode,
        "nlink": attr.nlink,
        "uid": attr.uid,
        "gid": attr.gid,
        "size": attr.size,
        "mtime_ns": attr.mtime_ns,
        "ctime_ns": attr.ctime_ns,
    }


def _bool_arg(args: dict[str, Any], key: str) -> bool:
    value = args.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{key} is true or false", value=str(value))
    return value


def _green_policy(args: dict[str, Any]) -> GreenPolicy:
    """A green's policy from `green create`'s arguments (InvalidArgument on bad patterns)."""
    patterns = args.get("private", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise InvalidArgument("private is a list of gitignore patterns")
    rewrites = args.get("rewrites", "refine")
    if not isinstance(rewrites, str):
        raise InvalidArgument("rewrites is refine or exact")
    private = PrivatePolicy(tuple(patterns), _bool_arg(args, "submit_ignored"))
    keep = args.get("keep", DEFAULT_KEEP)
    return GreenPolicy.from_wire(GreenPolicy(private, rewrites, keep).to_wire())  # checks it


def _small_file(volume: Volume, path: str) -> bytes | None:
    """A small regular file's bytes (an ignore file), or None."""
    try:
        attr = volume.getattr(volume.resolve(path))
    except SlatesError:
        return None
    if attr.kind != Kind.FILE or attr.size > MAX_IGNORE_FILE:
        return None
    return volume.read(attr.ino, 0, attr.size)


def _capacity(args: dict[str, Any]) -> Capacity:
    bounded, dynamic = args.get("bounded"), args.get("dynamic")
    if bounded is not None and dynamic is not None:
        raise InvalidArgument("choose --bounded or --dynamic, not both")
    if bounded is not None:
        return Capacity.reserved(_int_arg(args, "bounded"))
    if dynamic is not None:
        return Capacity.dynamic(_int_arg(args, "dynamic"))
    return Capacity.dynamic()


class ShardService:
    def __init__(
        self,
        index: int,
        host: Host,
        open_base: Callable[[str], BaseReader],
        approver_key: bytes | None = None,
        protected: tuple[str, ...] = (),
        allow_roots: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        # Where agents may name bases and landing targets (the operator anywhere).
        self.allow_roots = tuple(os.path.realpath(root) for root in allow_roots)
        self.host = host
        self.open_base = open_base
        self.volumes: dict[str, Volume] = {}
        self.names: dict[str, str] = {}  # volume id -> name
        self.base_keys: dict[str, str | None] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.failed: dict[str, SlatesError] = {}  # volumes recovery could not rebuild
        self.results: dict[str, dict[int, dict[str, Any]]] = {}
        self.acked: dict[str, int] = {}
        self.next_id = 1
        # Bytes that retired volumes may have left unreferenced: their own
        # content since their last snapshot (older content belongs to snapshots).
        self.garbage_bytes = 0
        self.greens: dict[str, list[Version]] = {}  # green volume id -> its ledger
        self.works: dict[str, tuple[str, int]] = {}  # work volume id -> (green, base version)
        self.green_policies: dict[str, GreenPolicy] = {}
        # Connections of mount bridges, per volume (not journaled: bridges reconnect).
        self.mounted: dict[str, int] = {}
        self.landed: dict[str, int] = {}  # green -> the newest version a landing completed
        self.origins: dict[str, str] = {}  # volume id -> the snapshot it was cloned from
        self.owners: dict[str, str] = {}  # volume id -> the agent that made it (operator: absent)
        self.client_principals: dict[str, str] = {}  # client id -> its principal's name
        self.work_counts: dict[str, int] = {}  # green -> work volumes made (numbering ranges)
        # Invalidations for mounts whose volume moved onto another version.
        self.moved: dict[str, list[list[Any]]] = {}
        # Work volumes accepted while mounted (they keep their base): the version
        # they made and a snapshot of what they held then.
        self.held: dict[str, tuple[int, str]] = {}
        self._path_indexes: dict[str, dict[int, str]] = {}  # snapshot id -> path index
        self.landing = LandingOps(self)
        # Directories no base and no landing may reach: the runtime directory,
        # which holds the approver credential.
        self.protected = tuple(os.path.realpath(p) for p in protected)
        self.desk = LandingDesk(approver_key, protected=self.protected)
        self.green_sources: dict[str, str | None] = {}  # the directory a green captured
        self._events: list[Event] = []
        # The records applied by the current request, for the driver's cache
        # invalidations (so it need not decode the journal events again).
        self.applied: list[tuple[str, Record]] = []
        self._client = ""

    # -- requests -------------------------------------------------------------

    def handle(
        self, client: str, request: Request, now_ns: int, principal: Principal = OPERATOR
    ) -> tuple[dict[str, Any], list[Event]]:
        """Run one request; returns (reply, events to commit before replying).

        A client id belongs to the principal that first used it: saved replies
        (grant tokens among them) are never answered to another principal.
        """
        self._events = []
        self.applied = []
        self._client = client
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
            self._emit(["ack", client, request.ack])
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
            self._emit(["client", client, principal.name])
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
            if not principal.is_operator:
                result = self._as_agent(principal, request.op, result)
            reply = ok_reply(request.seq, result)
        except SlatesError as exc:
            reply = error_reply(request.seq, exc)
        except Exception as exc:  # a bug: answer it, and keep memory and journal in step
            failure = VerificationFailed(
                "internal error", op=request.op, reason=f"{type(exc).__name__}: {exc}"
            )
            reply = error_reply(request.seq, failure)
        if mutating:
            self._emit(["done", client, request.seq, reply])
        return reply, self._take_events()

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
        if vid in self.greens:
            works = sorted(w for w, (green, _base) in self.works.items() if green == vid)
            if works:
                raise InvalidArgument(
                    f"the green volume has {len(works)} work volumes: delete them first "
                    "(or delete with --force)",
                    volume=vid,
                    works=works[:10],
                )
            head = len(self.greens[vid]) - 1
            landed = self.landed.get(vid, 0)
            if head > landed:
                raise InvalidArgument(
                    f"versions {landed + 1} to {head} of this green volume were never landed: "
                    "land them, or delete with --force",
                    volume=vid,
                )

    def _check_name(self, name: str) -> None:
        """Names are unique among the live volumes of a shard."""
        if name in self.names.values() and not name.endswith(" (capturing)"):
            taken = next(v for v, n in self.names.items() if n == name)
            raise AlreadyExists(f"volume {taken} has that name already", name=name, volume=taken)

    def _as_agent(self, principal: Principal, op: str, result: Any) -> Any:
        """An agent's view of a result: it owns what it made, and lists only its own
        volumes and the greens."""
        if op in ("volume.create", "work.create") and isinstance(result, dict):
            self._emit(["owner", str(result["id"]), principal.name])
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

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: Event) -> None:
        # Applied first: an event that fails (a quota refused) is never journaled.
        self._apply_event(event, live=True)
        self._events.append(event)

    def _watch(self, vid: str, volume: Volume) -> None:
        def on_applied(record: Record, result: object) -> None:
            self._events.append(["rec", vid, encode(record)])
            self.applied.append((vid, record))
            self._after_record(record, result)

        volume.on_applied = on_applied

    def _after_record(self, record: Record, result: object) -> None:
        if isinstance(record, TakeSnapshot) and isinstance(result, Snapshot):
            self.snapshots[result.snapshot_id] = result
            self._saw_id(result.snapshot_id)

    def _saw_id(self, object_id: str) -> None:
        """Ids are never reused, also after replay."""
        self.next_id = max(self.next_id, int(object_id.rsplit("-", 1)[1]) + 1)

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

    def _run(self, op: str, args: dict[str, Any], now: int) -> Any:
        match op:
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
                self._emit(["drop", vid])  # a failed volume can be deleted too
                return {"deleted": vid}
            case "bye":
                # The client will not use its id again: forget its saved replies.
                self._emit(["bye", self._client])
                return {}

            case "clone":
                return self._clone(args)
            case "green.create":
                return self._create_green(args, now)
            case "work.create":
                return self._create_work(args)
            case "submit":
                return self._submit(args, now)
            case "rebase":
                return self._rebase(args, now)
            case "versions":
                return self._versions(args)
            case op if op.startswith("land."):
                return self.landing.run(op, args)
            case "changed_since":
                green, ledger = self._green(args)
                since = _int_arg(args, "version")
                if since >= len(ledger):
                    raise NotFound("no such version", green=green, version=since)
                paths: set[str] = set()
                for version in ledger[since + 1 :]:
                    if not version.snapshot_id:
                        raise InvalidArgument(
                            "versions after that one were pruned: ask since a later one",
                            version=version.number,
                        )
                    paths |= merge_changes.changed_paths(version.increment)
                return sorted(paths)
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
                return self._run_file_op(op, args, now)

    def _run_file_op(self, op: str, args: dict[str, Any], now: int) -> Any:
        vid, volume = self._volume(args)
        if vid in self.greens and op in GREEN_REFUSES:
            raise NotPermitted("a green volume changes only by submission", volume=vid, op=op)
        if op.startswith("fs."):
            return run_fs_op(volume, op, args, now)
        match op:
            case "read":
                ino = volume.resolve(_path_arg(args))
                size = args.get("size")
                limit = volume.getattr(ino).size if size is None else _int_arg(args, "size")
                if limit > MAX_READ_BYTES:
                    raise InvalidArgument("read at most 16 MiB at a time", size=limit)
                return volume.read(ino, _int_arg(args, "offset", 0), limit)
            case "stat":
                return _attr_dict(volume.getattr(volume.resolve(_path_arg(args))))
            case "list":
                ino = volume.resolve(_path_arg(args))
                return [
                    {"name": item.name, "kind": item.kind.name.lower()}
                    for item in volume.readdir(ino)
                ]
            case "readlink":
                return volume.readlink(volume.resolve(_path_arg(args)))
            case "write":
                return self._write(volume, args, now)
            case "edit":
                return self._edit(volume, args, now)
            case "truncate":
                volume.truncate(
                    volume.resolve(_path_arg(args)), _int_arg(args, "size"), time_ns=now
                )
                return {}
            case "mkdir":
                parent, name = self._parent(volume, _path_arg(args))
                mode = _int_arg(args, "mode", 0o755)
                return _attr_dict(volume.mkdir(parent, name, mode, time_ns=now))
            case "symlink":
                parent, name = self._parent(volume, _path_arg(args))
                target = _str_arg(args, "target")
                return _attr_dict(volume.symlink(parent, name, target, time_ns=now))
            case "unlink":
                parent, name = self._parent(volume, _path_arg(args))
                volume.unlink(parent, name, time_ns=now)
                return {}
            case "rmdir":
                parent, name = self._parent(volume, _path_arg(args))
                volume.rmdir(parent, name, time_ns=now)
                return {}
            case "rename":
                src_parent, src_name = self._parent(volume, _path_arg(args, "src"))
                dst_parent, dst_name = self._parent(volume, _path_arg(args, "dst"))
                volume.rename(src_parent, src_name, dst_parent, dst_name, time_ns=now)
                return {}
            case _:
                raise InvalidArgument("unknown operation", op=op)

    @staticmethod
    def _parent(volume: Volume, path: str) -> tuple[int, str]:
        head, name = posixpath.split(path)
        if not name:
            raise InvalidArgument("the root has no parent", path=path)
        return volume.resolve(head), name

    def _file_and_data(self, volume: Volume, args: dict[str, Any], now: int) -> tuple[int, bytes]:
        """The file at args' path (created when absent, unless create is false) and args' data."""
        path = _path_arg(args)
        data = args.get("data")
        if not isinstance(data, bytes):
            raise InvalidArgument("data must be bytes")
        parent, name = self._parent(volume, path)
        try:
            ino = volume.lookup(parent, name).ino
        except NotFound:
            if not args.get("create", True):
                raise
            ino = volume.create(parent, name, _int_arg(args, "mode", 0o644), time_ns=now).ino
        if volume.getattr(ino).kind == Kind.DIR:
            raise IsADirectory("is a directory", path=path)
        return ino, data

    def _write(self, volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
        ino, data = self._file_and_data(volume, args, now)
        if args.get("truncate", False):
            volume.truncate(ino, 0, time_ns=now)
        written = volume.write(ino, _int_arg(args, "offset", 0), data, time_ns=now)
        return {"written": written, "ino": ino}

    def _edit(self, volume: Volume, args: dict[str, Any], now: int) -> dict[str, Any]:
        """Replace [start, end) of a file with data (creating the file when absent)."""
        start, end = _int_arg(args, "start"), _int_arg(args, "end")
        parent, name = self._parent(volume, _path_arg(args))
        try:
            volume.lookup(parent, name)
        except NotFound:
            if (start, end) != (0, 0):  # checked before the file is created
                raise InvalidArgument(
                    "a new file is edited at [0, 0)", start=start, end=end
                ) from None
        ino, data = self._file_and_data(volume, args, now)
        volume.splice(ino, start, end, data, time_ns=now)
        return {"size": volume.getattr(ino).size}

    def _create_volume(self, args: dict[str, Any], now: int) -> dict[str, Any]:
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
        self._check_unprotected(base_path, "base")
        if not args.get("capture", False):
            return self._new_volume(name, base_path, capacity, case_insensitive, now)
        scratch = self._new_volume(f"{name} (capturing)", None, capacity, case_insensitive, now)
        vid = scratch["id"]
        try:
            volume = self.volumes[vid]
            snapshot = capture_into(
                base_path, volume, snapshot_id=self._new_id("snap"), protected=self.protected
            )
        finally:
            self._emit(["drop", vid])
        return self._clone(
            {"snapshot": snapshot.snapshot_id, "name": name, **args}, capacity=capacity
        )

    def _new_volume(
        self, name: str, base_key: str | None, capacity: Capacity, ci: bool, now: int
    ) -> dict[str, Any]:
        mode, uid, gid = 0o755, 0, 0
        if base_key is not None:
            top = self.open_base(base_key).stat("/")
            if top is None or top.kind != Kind.DIR:
                raise InvalidArgument("the base must be a directory", base=base_key)
            mode, uid, gid = top.mode, top.uid, top.gid
        vid = self._new_id("vol")
        self._emit(
            ["new", vid, name, base_key, capacity.bounded, capacity.limit, ci, mode, uid, gid, now]
        )
        return self.info(vid)

    def _clone(self, args: dict[str, Any], capacity: Capacity | None = None) -> dict[str, Any]:
        self._check_name(_str_arg(args, "name"))
        snapshot_id = _str_arg(args, "snapshot")
        if snapshot_id not in self.snapshots:
            raise NotFound("no such snapshot on this shard", snapshot=snapshot_id)
        capacity = capacity or _capacity(args)
        vid = self._new_id("vol")
        self._emit(
            ["clone", vid, _str_arg(args, "name"), snapshot_id, capacity.bounded, capacity.limit]
        )
        return self.info(vid)

    # -- green and work volumes ------------------------------------------------

    def _green(self, args: dict[str, Any], key: str = "green") -> tuple[str, list[Version]]:
        green = _str_arg(args, key)
        ledger = self.greens.get(green)
        if ledger is None:
            if green in self.volumes:
                raise InvalidArgument("not a green volume", volume=green)
            raise NotFound("no such green volume", green=green)
        return green, ledger

    def _create_green(self, args: dict[str, Any], now: int) -> dict[str, Any]:
        """A green volume: empty, or a captured copy of a base directory (never read live).

        A live base could change under the versions agents share, so a green
        volume's base is captured: every version holds its own bytes.  Its
        policy (private paths, rewrites) is checked before anything is made.
        """
        if args.get("from") is not None:
            raise InvalidArgument("a green volume starts empty or from a base directory")
        policy = _green_policy(args)
        base = args.get("base")
        create = {**args, "capture": base is not None}
        vid = self._create_volume(create, now)["id"]
        snapshot = self.volumes[vid].snapshot(self._new_id("snap"))
        source = os.path.realpath(base) if isinstance(base, str) else None
        self._emit(["green", vid, snapshot.snapshot_id, source, policy.to_wire()])
        return {**self.info(vid), "version": 0}

    def _create_work(self, args: dict[str, Any]) -> dict[str, Any]:
        green, ledger = self._green(args)
        version = _int_arg(args, "version", len(ledger) - 1)
        if version >= len(ledger):
            raise NotFound("no such version", green=green, version=version)
        if not ledger[version].snapshot_id:
            raise NotFound("that version was pruned (green create --keep)", version=version)
        serial = self.work_counts.get(green, 0) + 1
        start, limit = serial << WORK_INO_SHIFT, (serial + 1) << WORK_INO_SHIFT
        if limit > NO_INO_LIMIT:
            raise CapacityExhausted("this green volume has made all the work volumes it can")
        info = self._clone(
            {**args, "snapshot": ledger[version].snapshot_id, "name": _str_arg(args, "name")}
        )
        self._emit(["work", info["id"], green, version, start, limit])
        return {**self.info(info["id"]), "base": version}

    def _work(self, args: dict[str, Any]) -> tuple[str, Volume, str, int]:
        vid, volume = self._volume(args)
        found = self.works.get(vid)
        if found is None:
            raise InvalidArgument("not a work volume", volume=vid)
        green, base = found
        if green not in self.greens:
            raise NotFound("the work volume's green volume is gone", green=green)
        return vid, volume, green, base

    def _path_index(self, snapshot_id: str) -> dict[int, str]:
        index = self._path_indexes.pop(snapshot_id, None)
        if index is None:
            index = merge_tree.path_index(self.snapshots[snapshot_id].root)
            while len(self._path_indexes) >= MAX_PATH_INDEXES:
                del self._path_indexes[next(iter(self._path_indexes))]
        self._path_indexes[snapshot_id] = index
        return index

    def _reader(self, root: Any) -> Volume:
        return Volume(self.host, root)

    def private_matcher(self, green: str, root: Any) -> PrivateMatcher:
        """The green's private-path rule over the ignore files of `root` (a version or a
        work volume's snapshot): for landing plans."""

        def read_file(path: str) -> bytes | None:
            reader = self._reader(root)
            try:
                return _small_file(reader, path)
            finally:
                reader.close()

        return PrivateMatcher(self.green_policies.get(green, GreenPolicy()).private, read_file)

    def _prepare(self, volume: Volume, green: str, base: int) -> Submission:
        """What the work volume submits from `base`: its changes less the private ones,
        saves folded and rewrites refined (slates.merge.submission)."""
        snapshot_id = self.greens[green][base].snapshot_id
        base_root = self.snapshots[snapshot_id].root
        paths = self._path_index(snapshot_id)
        changes = merge_tree.diff(
            base_root, volume.root, volume.read, lambda ino: paths.get(ino, f"#{ino}")
        )
        if not changes:
            return Submission((), (), (), ())
        policy = self.green_policies.get(green, GreenPolicy())
        reader = self._reader(base_root)

        def whole(source: Volume, ino: int) -> bytes:
            return source.read(ino, 0, source.getattr(ino).size)

        def is_dir(ino: int) -> bool:
            inode = volume.root.inodes.get(ino) or base_root.inodes.get(ino)
            return inode is not None and inode.kind == Kind.DIR

        try:
            return prepare(
                changes,
                policy,
                PrivateMatcher(policy.private, lambda path: _small_file(volume, path)),
                base_whole=lambda ino: whole(reader, ino),
                work_whole=lambda ino: whole(volume, ino),
                base_size=lambda ino: reader.getattr(ino).size,
                base_mode=lambda ino: reader.getattr(ino).mode & 0o7777,
                is_dir=is_dir,
            )
        finally:
            reader.close()

    def _mapped_changes(
        self,
        changes: tuple[merge_changes.Change, ...],
        green: str,
        base: int,
        work: Volume | None = None,
    ) -> tuple[tuple[merge_changes.Change, ...], list[dict[str, Any]]]:
        """Changes made since `base`, mapped to the green head, or the conflicts."""
        ledger = self.greens[green]
        snapshot_id = ledger[base].snapshot_id
        originals = tuple(c for c in changes if isinstance(c, merge_changes.Edit))
        later = ledger[base + 1 :]
        found: list[dict[str, Any]] = []
        same_base = all(version.base == base for version in later)
        for version in later:
            # Names and objects version by version; bytes too when bases differ.
            changes, conflicts = merge_changes.map_through(
                changes, version.increment, map_edits=not same_base
            )
            found += [
                self._conflict_wire(_in_base(c, originals), snapshot_id, version, work, originals)
                for c in conflicts
            ]
        if same_base:
            # Every accepted submission since started from this base too: bytes
            # are checked against their own edits, all in the base's coordinates.
            changes, conflicts = merge_changes.map_edits_pairwise(
                changes, [version.originals for version in later]
            )
            found += [
                self._conflict_wire(c, snapshot_id, ledger[-1], work, originals) for c in conflicts
            ]
        return ((), found) if found else (changes, [])

    def _conflict_wire(
        self,
        conflict: merge_changes.Conflict,
        base_snapshot: str,
        version: Version,
        work: Volume | None = None,
        originals: tuple[merge_changes.Change, ...] = (),
    ) -> dict[str, Any]:
        """A conflict as the wire carries it, with the base bytes of its range and, for
        byte ranges, the smallest region where the accepted and proposed bytes differ
        (slates.merge.report).  Files are read only here: a conflict is rare."""
        wire = merge_changes.conflict_to_wire(conflict)
        wire["version"] = version.number
        if conflict.base is None or not conflict.ino:
            return wire
        base = Volume.clone(self.snapshots[base_snapshot], self.host)
        head = Volume.clone(self.snapshots[version.snapshot_id], self.host)
        try:
            start, end = conflict.base
            wire["base_bytes"] = base.read(conflict.ino, start, end - start)
        except SlatesError:
            wire["base_bytes"] = None
        try:
            wire["region"] = self._region(conflict, base, head, work, originals)
        finally:
            base.close()
            head.close()
        return wire

    @staticmethod
    def _region(
        conflict: merge_changes.Conflict,
        base: Volume,
        head: Volume,
        work: Volume | None,
        originals: tuple[merge_changes.Change, ...],
    ) -> dict[str, Any] | None:
        own = next(
            (
                c.edits
                for c in originals
                if isinstance(c, merge_changes.Edit) and c.ino == conflict.ino
            ),
            (),
        )
        at = merge_report.proposed_offset(own, conflict)
        if work is None or at is None:
            return None

        def whole(volume: Volume, ino: int) -> bytes:
            return volume.read(ino, 0, volume.getattr(ino).size)

        try:
            head_file, base_file = whole(head, conflict.ino), whole(base, conflict.ino)
            # A file saved over (sed -i) is another object in the work volume, at the path.
            inode = work.root.inodes.get(conflict.ino)
            mine = (
                conflict.ino if inode is not None and inode.nlink else work.resolve(conflict.path)
            )
            work_file = whole(work, mine)
        except SlatesError:
            return None
        if max(len(head_file), len(work_file), len(base_file)) > MAX_REPORTED_FILE:
            return None
        region = merge_report.smallest_region(
            conflict, head_file=head_file, work_file=work_file, proposed_at=at, base_file=base_file
        )
        return None if region is None else merge_report.region_to_wire(region)

    def _restart_as(
        self,
        vid: str,
        snapshot_id: str,
        changes: tuple[merge_changes.Change, ...],
        now: int,
        private: tuple[merge_changes.Change, ...] = (),
    ) -> tuple[Volume, tuple[merge_changes.Change, ...]]:
        """Make `vid` a clone of the snapshot with `changes` applied, or change nothing.

        The new volume replaces the old one only if every change applied; its
        records are journaled after a "reset" event, so replay rebuilds it the
        same way.  It keeps the old one's inode numbering, open handles and
        kernel references (an inode the snapshot lacks stays as an orphan), so
        a mount goes on; what changed under the mount is invalidated.  The
        `private` changes (a work volume's own, never submitted) are applied
        after `changes` and keep their times, so build tools see them as built.
        """
        old = self.volumes[vid]
        mark = len(self._events)
        fresh = Volume.clone(
            self.snapshots[snapshot_id], self.host, Capacity(old.bounded, old.limit)
        )
        # Objects the changes make again keep their numbers; a kernel reference to
        # one is taken up once it exists (the others' before any record, as replay).
        remade = sorted(
            -c.key
            for c in (*changes, *private)
            if isinstance(c, merge_changes.Add) and c.key < 0 and old.handles(-c.key)
        )
        self._events.append(["reset", vid, snapshot_id, remade])
        fresh.number_from(*old.numbering)
        fresh.adopt_handles(old, remade)
        self._watch(vid, fresh)

        def kept_times(ino: int) -> tuple[int, int] | None:
            inode = old.root.inodes.get(ino)
            return None if inode is None else (inode.atime_ns, inode.mtime_ns)

        try:
            applied = merge_tree.apply(fresh, changes, now)
            merge_tree.apply(fresh, private, now, kept_times)
            for ino in remade:
                fresh.retain(ino, old.handles(ino))
        except BaseException:
            del self._events[mark:]
            fresh.close()
            raise
        if old.held_inodes():
            self.moved.setdefault(vid, []).extend(merge_tree.changed_entries(old.root, fresh.root))
        self._retire(old)
        self.volumes[vid] = fresh
        return fresh, applied

    def take_moved(self) -> dict[str, list[list[Any]]]:
        """Invalidations for mounted volumes that moved onto another version (driver)."""
        moved, self.moved = self.moved, {}
        return moved

    def _unchanged_since_held(self, vid: str, volume: Volume) -> bool:
        """For a work volume accepted but left on its base: True if nothing changed since.

        Its later changes cannot be told from the ones already accepted (it kept
        its base), so they are refused, never merged twice or dropped.
        """
        found = self.held.get(vid)
        if found is None:
            return False
        version, snapshot_id = found
        if merge_tree.changed_since(self.snapshots[snapshot_id].root, volume.root):
            raise InvalidArgument(
                "this work volume was accepted but could not move onto its version "
                "(no room) and has changed since; its new changes cannot be separated "
                "from the accepted ones: make them in a new work volume",
                volume=vid,
                version=version,
            )
        return True

    @staticmethod
    def _submit_reply(
        ledger: list[Version], submission: Submission, **fields: Any
    ) -> dict[str, Any]:
        reply: dict[str, Any] = {
            "ok": True,
            "version": len(ledger) - 1,
            "conflicts": [],
            "made_version": False,
            "nothing": False,
            "dry_run": False,
            "private": submission.private_paths,
            "paths": sorted(merge_changes.changed_paths(submission.public)),
            "refined": list(submission.refined),
            "literal": list(submission.literal),
        }
        reply.update(fields)
        return reply

    def _submit(self, args: dict[str, Any], now: int) -> dict[str, Any]:
        vid, volume, green, base = self._work(args)
        dry_run = _bool_arg(args, "dry_run")
        ledger = self.greens[green]
        if self._unchanged_since_held(vid, volume):
            return self._submit_reply(ledger, _NOTHING, nothing=True, dry_run=dry_run)
        if not dry_run:
            volume.seal()
        submission = self._prepare(volume, green, base)
        if dry_run:  # what would be submitted, and whether it would conflict
            found = self._mapped_changes(submission.public, green, base, volume)[1]
            return self._submit_reply(
                ledger,
                submission,
                dry_run=True,
                nothing=not submission.public,
                ok=not found,
                conflicts=found,
            )
        if not submission.public:
            return self._submit_reply(ledger, submission, nothing=True)
        changes, conflicts = self._mapped_changes(submission.public, green, base, volume)
        if conflicts:
            return self._submit_reply(
                ledger, submission, ok=False, version=None, conflicts=conflicts
            )
        if not changes:  # only what the head holds already
            return self._submit_reply(ledger, submission, nothing=True)
        head = ledger[-1]
        try:
            fresh, applied = self._restart_as(green, head.snapshot_id, changes, now)
        except merge_tree.ApplyConflict as on_head:
            wire = self._conflict_wire(on_head.conflict, ledger[base].snapshot_id, head)
            return self._submit_reply(ledger, submission, ok=False, version=None, conflicts=[wire])
        snapshot = fresh.snapshot(self._new_id("snap"))
        originals = tuple(c for c in submission.public if isinstance(c, merge_changes.Edit))
        self._emit(
            [
                "version",
                green,
                snapshot.snapshot_id,
                base,
                vid,
                merge_changes.changes_to_wire(applied),
                merge_changes.changes_to_wire(originals),
            ]
        )
        self._prune(green)
        # The work volume moves onto the version it made, with its private paths,
        # so its next submission holds only what it changes from now on.  A
        # mounted one keeps every inode number the kernel holds.
        try:
            self._restart_as(vid, snapshot.snapshot_id, (), now, submission.private)
        except (SlatesError, merge_tree.ApplyConflict) as failure:
            # No room for the move (a bounded volume), say: it keeps its base.
            held = volume.snapshot(self._new_id("snap"))
            self._emit(["held", vid, len(ledger) - 1, held.snapshot_id])
            return self._submit_reply(
                ledger, submission, made_version=True, rebased=False, kept_base=str(failure)
            )
        self._emit(["based", vid, len(ledger) - 1])
        return self._submit_reply(ledger, submission, made_version=True, rebased=True)

    def _rebase(self, args: dict[str, Any], now: int) -> dict[str, Any]:
        vid, volume, green, base = self._work(args)
        ledger = self.greens[green]
        if self._unchanged_since_held(vid, volume):
            # All of it is in the head already, but for its private paths.
            submission = self._prepare(volume, green, base)
            changes: tuple[merge_changes.Change, ...] = ()
            conflicts: list[dict[str, Any]] = []
        else:
            volume.seal()  # sealed content can move onto the head as it is
            submission = self._prepare(volume, green, base)
            changes, conflicts = self._mapped_changes(submission.public, green, base, volume)
        if conflicts:
            return {"ok": False, "version": base, "conflicts": conflicts}
        try:
            self._restart_as(vid, ledger[-1].snapshot_id, changes, now, submission.private)
        except merge_tree.ApplyConflict as on_head:
            wire = self._conflict_wire(on_head.conflict, ledger[base].snapshot_id, ledger[-1])
            return {"ok": False, "version": base, "conflicts": [wire]}
        self._emit(["based", vid, len(ledger) - 1])
        return {"ok": True, "version": len(ledger) - 1, "conflicts": []}

    def _delete_snapshot(self, args: dict[str, Any]) -> dict[str, Any]:
        """Delete a snapshot: refused while a green's ledger or a landing plan needs it
        (prune or land first), or, unless forced, while a volume cloned from it lives.
        Its content goes once nothing else shares it."""
        snapshot_id = _str_arg(args, "snapshot")
        if snapshot_id not in self.snapshots:
            raise NotFound("no such snapshot", snapshot=snapshot_id)
        for green, ledger in self.greens.items():
            if any(v.snapshot_id == snapshot_id for v in ledger):
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
        self._emit(["unsnap", snapshot_id])
        return {"deleted": snapshot_id}

    def _gc(self) -> dict[str, Any]:
        """Collect now: prune every green by its policy, then free what nothing uses."""
        pruned = {green: self._prune(green) for green in list(self.greens)}
        before = self.host.physical_bytes
        self.garbage_bytes = max(self.garbage_bytes, 1)
        self.collect_garbage(force=True)
        return {
            "pruned": {green: numbers for green, numbers in pruned.items() if numbers},
            "freed_bytes": max(0, before - self.host.physical_bytes),
            "host_physical_bytes": self.host.physical_bytes,
        }

    def _prune(self, green: str, keep: int | None = None) -> list[int]:
        """Drop the content and edits of versions nothing needs any more: not v0 (the
        landing witness), not the last `keep`, not one a live work volume starts from
        or comes after (submissions map through them), not one a plan lands."""
        ledger = self.greens[green]
        keep = self.green_policies.get(green, GreenPolicy()).keep if keep is None else keep
        bases = [base for g, base in self.works.values() if g == green]
        planned = self.desk.sources()
        limit = min([len(ledger) - keep, *bases])
        pruned = [
            v.number for v in ledger[1:limit] if v.snapshot_id and v.snapshot_id not in planned
        ]
        if pruned:
            self._emit(["prune", green, pruned])
        return pruned

    def _versions(self, args: dict[str, Any]) -> dict[str, Any]:
        green, ledger = self._green(args)
        limit = _int_arg(args, "limit", 100)
        return {
            "green": green,
            "head": len(ledger) - 1,
            "versions": [
                {
                    "version": v.number,
                    "snapshot": v.snapshot_id,
                    "base": v.base,
                    "work": v.work,
                    "paths": sorted(merge_changes.changed_paths(v.increment)),
                    "pruned": not v.snapshot_id,
                }
                for v in ledger[-limit:]
                if limit
            ],
        }

    def _check_unprotected(self, path: str, what: str) -> tuple[int, int]:
        """Refuse a directory that is, holds or lies inside a protected one, or is on
        FUSE (compared by (dev, ino), never entering a mount); returns its identity."""
        with Anchored(path, protected=self.protected, what=what) as anchor:
            return anchor.identity

    def replay(self, events: Iterable[Event]) -> None:
        """Apply committed events (recovery); replies are not produced again.

        Replay never stops the shard: an event that cannot be applied now (its
        base directory was deleted, say) fails only its volume, which then
        answers every request with that error until it is deleted.
        """
        for event in events:
            try:
                self._apply_event(event, live=False)
            except SlatesError as exc:
                vid = event[1] if len(event) > 1 and isinstance(event[1], str) else None
                if vid is None or event[0] not in ("new", "clone"):
                    raise
                self.names.setdefault(vid, str(event[2]))
                self.base_keys.setdefault(vid, event[3] if isinstance(event[3], str) else None)
                self.failed[vid] = exc
                self._saw_id(vid)
        self.collect_garbage(force=True)

    def _apply_event(self, event: Event, *, live: bool) -> None:
        match event:
            case [
                "new",
                str(vid),
                str(name),
                base_key,
                bool(bounded),
                int(limit),
                bool(ci),
                int(mode),
                int(uid),
                int(gid),
                int(now),
            ]:
                base = self.open_base(base_key) if isinstance(base_key, str) else None
                volume = Volume.new(
                    self.host,
                    base=base,
                    capacity=Capacity(bounded, limit),
                    case_insensitive=ci,
                    mode=mode,
                    uid=uid,
                    gid=gid,
                    time_ns=now,
                )
                self._add_volume(vid, name, base_key if isinstance(base_key, str) else None, volume)
            case ["clone", str(vid), str(name), str(snapshot_id), bool(bounded), int(limit)]:
                snapshot = self.snapshots.get(snapshot_id)
                if snapshot is None:
                    self.names[vid] = name
                    self.base_keys[vid] = None
                    self.failed[vid] = MissingContent(
                        "the snapshot it was cloned from is lost", snapshot=snapshot_id
                    )
                    self._saw_id(vid)
                    return
                volume = Volume.clone(snapshot, self.host, Capacity(bounded, limit))
                key = self._base_key_of(snapshot)
                self._add_volume(vid, name, key, volume)
                self.origins[vid] = snapshot_id
            case ["rec", str(vid), bytes(payload)] if not live:
                if vid in self.failed:
                    return
                record = decode(payload)
                volume = self.volumes[vid]
                hook, volume.on_applied = volume.on_applied, None  # replay journals nothing
                try:
                    result = volume.apply(record)
                except SlatesError as exc:
                    self.failed[vid] = VerificationFailed(
                        "replaying the journal failed", volume=vid, reason=str(exc)
                    )
                    return
                finally:
                    volume.on_applied = hook
                self._after_record(record, result)
            case ["plan", _] | ["grant", _, _] | ["grant_used", _]:
                self.desk.apply_event(event)
            case ["green", str(vid), str(snapshot_id), source, list(policy)] if (
                source is None or isinstance(source, str)
            ):
                self.greens[vid] = [Version(0, snapshot_id, -1, "", ())]
                self.green_sources[vid] = source
                self.green_policies[vid] = GreenPolicy.from_wire(policy)
                green_volume = self.volumes[vid]
                green_volume.number_from(green_volume.root.next_ino, 1 << WORK_INO_SHIFT)
            case ["work", str(vid), str(green), int(version), int(start), int(limit)]:
                self.works[vid] = (green, version)
                serial = start >> WORK_INO_SHIFT
                self.work_counts[green] = max(self.work_counts.get(green, 0), serial)
                if vid not in self.failed:
                    self.volumes[vid].number_from(start, limit)
            case ["based", str(vid), int(version)] if vid in self.works:
                self.works[vid] = (self.works[vid][0], version)
                self.held.pop(vid, None)
            case ["held", str(vid), int(version), str(snapshot_id)]:
                self.held[vid] = (version, snapshot_id)
            case [
                "version",
                str(green),
                str(snapshot_id),
                int(base),
                str(work),
                list(raw),
                list(originals),
            ]:
                ledger = self.greens[green]
                increment = merge_changes.changes_from_wire(raw)
                own = merge_changes.changes_from_wire(originals)
                ledger.append(Version(len(ledger), snapshot_id, base, work, increment, own))
            case ["reset", str(vid), str(snapshot_id), list(remade)] if not live:
                if vid in self.failed:
                    return
                old = self.volumes[vid]
                try:
                    fresh = Volume.clone(
                        self.snapshots[snapshot_id], self.host, Capacity(old.bounded, old.limit)
                    )
                except SlatesError as exc:  # it fitted when it ran; the volume fails alone
                    self.failed[vid] = exc
                    return
                fresh.number_from(*old.numbering)
                fresh.adopt_handles(old, {int(ino) for ino in remade})
                self._retire(old)
                self.volumes[vid] = fresh
                self._watch(vid, fresh)
            case ["drop", str(vid)]:
                self.owners.pop(vid, None)
                self.origins.pop(vid, None)
                self.landed.pop(vid, None)
                self.greens.pop(vid, None)
                self.green_policies.pop(vid, None)
                self.work_counts.pop(vid, None)
                self.works.pop(vid, None)
                self.held.pop(vid, None)
                dropped = self.volumes.pop(vid, None)
                self.names.pop(vid, None)
                self.base_keys.pop(vid, None)
                self.failed.pop(vid, None)
                if dropped is not None:
                    self._retire(dropped)  # collected after the drop is committed
            case ["done", str(client), int(seq), dict(reply)]:
                self.results.setdefault(client, {})[seq] = reply
            case ["bye", str(client)]:
                self.results.pop(client, None)
                self.acked.pop(client, None)
                self.client_principals.pop(client, None)
            case ["client", str(client), str(name)]:
                self.client_principals[client] = name
            case ["owner", str(vid), str(name)]:
                self.owners[vid] = name
            case ["prune", str(green), list(numbers)]:
                ledger = self.greens[green]
                for number in numbers:
                    gone = ledger[int(number)]
                    self.snapshots.pop(gone.snapshot_id, None)
                    ledger[gone.number] = Version(gone.number, "", gone.base, gone.work, (), ())
                self.garbage_bytes += GARBAGE_BATCH_BYTES  # their chunks may be free now
            case ["unsnap", str(snapshot_id)]:
                self.snapshots.pop(snapshot_id, None)
                self.garbage_bytes += GARBAGE_BATCH_BYTES
            case ["landed", str(green), int(version)]:
                self.landed[green] = max(self.landed.get(green, 0), version)
            case ["ack", str(client), int(upto)]:
                self.acked[client] = max(self.acked.get(client, 0), upto)
                saved = self.results.get(client, {})
                for seq in [s for s in saved if s <= upto]:
                    del saved[seq]
            case _:
                raise VerificationFailed("unknown journal event", event=repr(event)[:80])
        if event[0] in ("new", "clone"):
            self._saw_id(event[1])

    def _add_volume(self, vid: str, name: str, base_key: str | None, volume: Volume) -> None:
        self.volumes[vid] = volume
        self.names[vid] = name
        self.base_keys[vid] = base_key
        self._watch(vid, volume)

    def _base_key_of(self, snapshot: Snapshot) -> str | None:
        return getattr(snapshot.base, "root", None) if snapshot.base is not None else None

    def _retire(self, volume: Volume) -> None:
        self.garbage_bytes += volume.unique_bytes
        volume.close()

    def collect_garbage(self, *, force: bool = False) -> None:
        """Free chunks no volume or snapshot refers to (call once the drop is committed).

        A collection walks every distinct inode on the shard, so it runs once
        retired volumes may have left GARBAGE_BATCH_BYTES behind (or when
        forced): at most that much waits to be freed, and a submission does
        not pay for a walk of the whole ledger.
        """
        if not self.garbage_bytes or (self.garbage_bytes < GARBAGE_BATCH_BYTES and not force):
            return
        self.garbage_bytes = 0
        roots = [v.root for v in self.volumes.values()] + [s.root for s in self.snapshots.values()]
        self.host.collect([chunk_ids(*roots)])

    # -- views ----------------------------------------------------------------

    def info(self, vid: str) -> dict[str, Any]:
        volume = self.volumes[vid]
        counters = volume.counters()
        return {
            "id": vid,
            "name": self.names[vid],
            "shard": self.index,
            "base": self.base_keys[vid],
            "bounded": volume.bounded,
            "limit": volume.limit,
            "role": "green" if vid in self.greens else "work" if vid in self.works else "volume",
            "green": self.works[vid][0] if vid in self.works else None,
            "version": (
                len(self.greens[vid]) - 1
                if vid in self.greens
                else self.works[vid][1]
                if vid in self.works
                else None
            ),
            "counters": {
                "referenced_bytes": counters.referenced_bytes,
                "unique_bytes": counters.unique_bytes,
                "metadata_bytes": counters.metadata_bytes,
                "charged_bytes": counters.charged_bytes,
                "host_physical_bytes": counters.host_physical_bytes,
            },
        }

    def status(self) -> dict[str, Any]:
        return {
            "shard": self.index,
            "volumes": [self.info(vid) for vid in sorted(self.volumes)],
            "snapshots": sorted(self.snapshots),
            "failed": {vid: error.to_wire() for vid, error in self.failed.items()},
            "host_physical_bytes": self.host.physical_bytes,
        }

    # -- checkpoints ----------------------------------------------------------

    def checkpoint(self) -> bytes:
        state = checkpoint.dump_state(self.volumes, self.snapshots, self._base_key, host=self.host)
        meta = {
            "names": self.names,
            "base_keys": self.base_keys,
            "results": {c: list(r.items()) for c, r in self.results.items()},
            "acked": self.acked,
            "next_id": self.next_id,
            "failed": {vid: error.to_wire() for vid, error in self.failed.items()},
            "greens": {
                green: [
                    [
                        v.snapshot_id,
                        v.base,
                        v.work,
                        merge_changes.changes_to_wire(v.increment),
                        merge_changes.changes_to_wire(v.originals),
                    ]
                    for v in ledger
                ]
                for green, ledger in self.greens.items()
            },
            "works": {vid: list(found) for vid, found in self.works.items()},
            "green_policies": {g: p.to_wire() for g, p in self.green_policies.items()},
            "owners": self.owners,
            "landed": self.landed,
            "origins": self.origins,
            "client_principals": self.client_principals,
            "work_counts": self.work_counts,
            "green_sources": self.green_sources,
            "held": {vid: list(found) for vid, found in self.held.items()},
            "landing": self.desk.to_wire(),
        }
        out: bytes = msgpack.packb(
            {"state": state, "meta": meta}, use_bin_type=True, unicode_errors="surrogateescape"
        )
        return out

    @staticmethod
    def _base_key(base: BaseReader) -> str:
        root = getattr(base, "root", None)
        if not isinstance(root, str):
            raise InvalidArgument("this base reader cannot be checkpointed")
        return root

    def restore(self, blob: bytes) -> None:
        try:
            data = msgpack.unpackb(
                blob, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
            )
            meta = data["meta"]
            loaded = checkpoint.load_state(data["state"], self.host, self.open_base)
            self.names = dict(meta["names"])
            self.base_keys = dict(meta["base_keys"])
            self.results = {
                c: {int(s): r for s, r in items} for c, items in meta["results"].items()
            }
            self.acked = {c: int(a) for c, a in meta["acked"].items()}
            self.next_id = int(meta["next_id"])
            failed = dict(meta["failed"])
            greens = {
                green: [
                    Version(
                        n,
                        str(snap),
                        int(base),
                        str(work),
                        merge_changes.changes_from_wire(raw),
                        merge_changes.changes_from_wire(own),
                    )
                    for n, (snap, base, work, raw, own) in enumerate(entries)
                ]
                for green, entries in meta["greens"].items()
            }
            works = {vid: (str(g), int(v)) for vid, (g, v) in meta["works"].items()}
            self.green_sources = dict(meta["green_sources"])
            self.green_policies = {
                str(g): GreenPolicy.from_wire(p) for g, p in meta["green_policies"].items()
            }
            self.work_counts = {str(g): int(n) for g, n in meta["work_counts"].items()}
            self.owners = {str(v): str(n) for v, n in meta["owners"].items()}
            self.landed = {str(g): int(n) for g, n in meta["landed"].items()}
            self.origins = {str(v): str(o) for v, o in meta["origins"].items()}
            self.client_principals = {str(c): str(n) for c, n in meta["client_principals"].items()}
            self.held = {vid: (int(v), str(s)) for vid, (v, s) in meta["held"].items()}
            self.desk.restore(meta["landing"])
        except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
            raise VerificationFailed("the checkpoint is malformed", reason=str(exc)) from None
        self.failed = {vid: error_from_wire(wire) for vid, wire in failed.items()}
        self.greens, self.works = greens, works
        self.failed.update(loaded.failures)
        self.snapshots = dict(loaded.snapshots)
        self.volumes = dict(loaded.volumes)
        for vid, volume in self.volumes.items():
            self._watch(vid, volume)
