"""A shard's remote work volumes: work volumes here of greens owned on other hosts.

Theory of operation (DESIGN.md section 7, "Remote reads").  Called by
ShardService for the ops below; every wait on the network is an `Io` of a
job (slates.node.jobs), so it runs in a worker thread and the shard's loop
goes on serving other requests meanwhile.  The network itself is the
host's fleet link, reached on RUNTIME/fleet.sock (`LinkCalls`, blocking,
used only inside those Ios); the link finds holders and the owner
(slates.fleet.link_remote).

- `create_work` (`work.create` whose green is a fleet name "<id>@<host>"):
  the link fetches the version's tree record (from a holder that committed
  it, else the owner; the head unless a version is given); it must decode
  and is stored as one chunk under its BLAKE3 id, and a VolumeMade over
  the base key `fleet:<green>:<version>:<tree id>` makes the volume
  (slates.node.remote_base).  No file bytes move.
- `fetching`: a request on such a volume whose base read raised
  MissingContent naming `remote` chunks becomes a job: the link fetches
  the named pieces (from this host's holder copy, other holders, then the
  owner), each is checked against its BLAKE3 id in the worker
  (`verified`: one damaged piece refuses the whole batch with
  VerificationFailed and nothing is stored), admitted against the volume's
  capacity (CapacityExhausted), stored in this shard's chunk store (the
  arena: counted in host_physical_bytes) and the request runs again, at
  most FETCH_ROUNDS times.  A piece another job is fetching already (the
  kernel's parallel read-ahead) is waited for, not asked for again
  (`inflight`).  A second volume of the same version shares the pieces
  already here.  The pieces are kept while a volume or snapshot
  uses the base (`kept_chunks`, which the service's collection hook adds).
  This is why requests are retried whole: a base read happens before an
  operation publishes anything (a write reads its partial pages first).
- `submit`: the volume's changes against its base tree (`changes`: only
  bound names are walked, so untouched content is never fetched; a
  changed file travels whole, at most MAX_SUBMIT_BYTES in all) go to the
  link with the submission's identity `request`: "<volume>/<client>/<seq>"
  of the agent's submit request, which the SDK's retry after a lost reply
  keeps, also when this shard restarted meanwhile and runs the request
  again; the green owner's link runs one identity once and answers its
  retries the kept reply (slates.fleet.link_submit).  The owner merges the
  changes as any submission; the reply (version, structured conflicts)
  comes back as it is.  After a submission that made version N the
  volume moves onto N (`_move`), as a local work volume does: its next
  submission holds only what changes from then on; the pieces of the
  files it sent whole are stored here (`_keep_written`), so reading them
  back over the new base fetches nothing.  While a submission
  or rebase runs, the volume's writes are refused Unavailable (the
  `submitting` set, in memory: a restart ends the job with it).
- `rebase`: onto the green's head (or `version`): the volume's changes
  against its base are kept over the new version where the green did not
  change the same path differently (`rebase_plan`, by whole paths: a path
  both sides changed to different results, a removal of what the green
  changed, a write into a directory the green removed, a removal of a
  directory the green added to); otherwise the conflicts come back
  structured and nothing moves.
- `_move` is journaled only with events the shard replays already: a
  carrier volume over the new base key (VolumeMade), its snapshot (a
  record), the volume reset onto it (VolumeReset, keeping numbering,
  handles and kernel references), the carrier dropped and its snapshot
  deleted, then the kept changes as the volume's own records; all in one
  step of the job, so they commit together.  Because a replay opens every
  base the journal names, the tree and pieces of those bases stay
  (`journaled`, until a checkpoint without them is published:
  ShardService.checkpoint_document), and a replay collects once, after
  the whole journal (ShardState.replay), never between its events.
"""

from __future__ import annotations

import dataclasses
import posixpath
import stat as stat_mode
import threading
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import blake3

from slates.core.records import Kind
from slates.core.volume import Capacity, Volume
from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    MissingContent,
    NotFound,
    NotSupported,
    SlatesError,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.replica import TreeEntry, decode_tree, file_chunks
from slates.node.args import str_arg
from slates.node.events import SnapshotDeleted, VolumeDropped, VolumeMade
from slates.node.jobs import Io, JobBody
from slates.node.path_ops import run_path_op
from slates.node.remote_base import ROOT_MODE, RemoteBase, RemoteKey, remote_key

if TYPE_CHECKING:
    from slates.node.service import ShardService

__all__ = ["FETCH_ROUNDS", "LinkCalls", "MAX_SUBMIT_BYTES", "RemoteOps", "rebase_plan", "verified"]

FETCH_ROUNDS: Final = 64  # fetches one request may need (each up to READ_AHEAD_BYTES)
MAX_SUBMIT_BYTES: Final = 16 << 20  # changed files' bytes one remote submission carries
MAX_SUBMIT_OPS: Final = 1 << 14
LINK_TIMEOUT: Final = 60.0


def verified(wanted: Iterable[bytes], found: list[Any]) -> dict[bytes, bytes]:
    """The fetched pieces by id, each checked against its BLAKE3 id; VerificationFailed
    for any damaged or unasked piece, MissingContent for any wanted one not found."""
    pieces: dict[bytes, bytes] = {}
    asked = set(wanted)
    for item in found:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise VerificationFailed("a fetched piece is not (id, bytes)")
        chunk, data = item
        if not isinstance(chunk, bytes) or not isinstance(data, bytes) or chunk not in asked:
            raise VerificationFailed("the link answered a piece nobody asked for")
        if blake3.blake3(data).digest() != chunk:
            raise VerificationFailed(
                "a fetched piece does not match its BLAKE3 id", chunk=chunk.hex()
            )
        pieces[chunk] = data
    lacking = asked - pieces.keys()
    if lacking:
        raise MissingContent(
            "no holder or owner has these pieces", chunks=sorted(c.hex() for c in lacking)
        )
    return pieces


class LinkCalls:
    """Blocking requests to this host's fleet link (only ever run inside an Io)."""

    def __init__(self, runtime_dir: str | None) -> None:
        self.socket = None if runtime_dir is None else Path(runtime_dir) / "fleet.sock"

    def on_fleet(self) -> bool:
        """Whether this host runs a fleet link (its socket is there)."""
        return self.socket is not None and self.socket.exists()

    def call(self, message: dict[str, Any], timeout: float = LINK_TIMEOUT) -> Any:
        if self.socket is None:
            raise NotSupported("this shard has no runtime directory: no fleet link")
        from slates.fleet.link_client import call_link  # here: only fleet hosts need it

        return call_link(self.socket, message, timeout=timeout)


@dataclasses.dataclass(frozen=True, slots=True)
class Fetched:
    chunks: int
    bytes: int


class RemoteOps:
    def __init__(self, service: ShardService, link: LinkCalls) -> None:
        self.service = service
        self.link = link
        self.readers: dict[str, RemoteBase] = {}  # by base key: one reader per version
        self.fetched: dict[str, Fetched] = {}  # per volume: what fetches stored for it
        # Remote bases events since the last checkpoint name: a replay of the journal
        # opens them again (and reads what their records read), so they are kept.
        self.journaled: dict[str, None] = {}
        self.submitting: set[str] = set()  # volumes a submission or rebase moves now
        self.inflight: dict[bytes, threading.Event] = {}  # pieces a job is fetching now

    # -- bases

    def open(self, key: str) -> RemoteBase | None:
        """The reader of a remote base key (None: not one), reopened from the store."""
        parsed = remote_key(key)
        if parsed is None:
            return None
        self.journaled[key] = None
        found = self.readers.get(key)
        if found is None:
            host = self.service.host
            tree = host.get_chunk(parsed.tree)  # MissingContent: the volume fails
            found = self.readers[key] = RemoteBase(parsed, bytes(tree), self._lookup)
        return found

    def _lookup(self, chunk: bytes) -> bytes | None:
        host = self.service.host
        return host.get_chunk(chunk) if host.has_chunk(chunk) else None

    def base_of(self, vid: str) -> RemoteBase | None:
        volume = self.service.volumes.get(vid)
        base = None if volume is None else volume.base
        return base if isinstance(base, RemoteBase) else None

    def kept_chunks(self) -> set[bytes]:
        """The pieces of every remote base a volume or snapshot still uses, or an event
        since the last checkpoint names (`journaled`: a replay needs them)."""
        used = self.in_use()
        kept: set[bytes] = set()
        for key, reader in list(self.readers.items()):
            if key in used or key in self.journaled:
                kept |= reader.chunk_ids()
            else:
                del self.readers[key]
        return kept

    def in_use(self) -> set[str]:
        """The keys of the remote bases volumes and snapshots read now."""
        service = self.service
        bases = [v.base for v in service.volumes.values()]
        bases += [s.base for s in service.snapshots.values()]
        return {b.root for b in bases if isinstance(b, RemoteBase)}

    def checkpointed(self, in_use: set[str]) -> None:
        """A checkpoint holding the bases `in_use` (when it was made) is published: the
        journal's events from now on name only those and newer ones."""
        self.journaled = dict.fromkeys(in_use)

    def view(self, vid: str) -> dict[str, Any] | None:
        base = self.base_of(vid)
        if base is None:
            return None
        fetched = self.fetched.get(vid, Fetched(0, 0))
        return {
            "green": base.key.green,
            "version": base.key.version,
            "fetched_chunks": fetched.chunks,
            "fetched_bytes": fetched.bytes,
            "moving": vid in self.submitting,
        }

    # -- work.create

    def create_work(self, args: dict[str, Any], now: int) -> JobBody:
        green = str_arg(args, "green")
        name = str_arg(args, "name")
        service = self.service
        service._check_name(name)
        version = args.get("version")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise InvalidArgument("a version is a number from 0", version=str(version))
        message = {"op": "remote.tree", "green": green, "version": version}
        found = yield Io(lambda: self.link.call(message))
        if not isinstance(found, dict) or not isinstance(found.get("tree"), bytes):
            raise VerificationFailed("the fleet link answered no tree record")
        tree, at = bytes(found["tree"]), found.get("version")
        if not isinstance(at, int) or (version is not None and at != version):
            raise VerificationFailed("the fleet link answered another version", version=at)
        decode_tree(tree)  # VerificationFailed before anything is stored
        service._check_name(name)  # other requests ran meanwhile
        service.host.put_chunk(tree)
        key = RemoteKey(green, at, blake3.blake3(tree).digest()).text()
        vid = service._new_id("vol")
        capacity = _capacity(args)
        event = VolumeMade(
            vid, name, key, capacity.bounded, capacity.limit, False, ROOT_MODE, 0, 0, now
        )
        service._emit(event)
        self.fetched[vid] = Fetched(0, 0)
        return {**service.info(vid), "source": found.get("source")}

    # -- fetching

    def fetchable(self, error: SlatesError) -> bool:
        return isinstance(error, MissingContent) and error.details.get("remote") in self.readers

    def fetching(self, vid: str, run: Callable[[], Any], error: MissingContent) -> JobBody:
        """`run` again once the pieces `error` names are here (module doc)."""
        for _ in range(FETCH_ROUNDS):
            yield from self._fetch(vid, error)
            try:
                return run()
            except MissingContent as again:
                if not self.fetchable(again):
                    raise
                error = again
        raise MissingContent("a request needed more fetches than it may", rounds=FETCH_ROUNDS)

    def _fetch(self, vid: str, error: MissingContent) -> JobBody:
        reader = self.readers[str(error.details["remote"])]
        raw = error.details.get("chunks")
        if not isinstance(raw, list) or not raw:
            raise VerificationFailed("a remote read named no pieces")
        sizes = reader.sizes()
        wanted = [bytes.fromhex(str(c)) for c in raw]
        if any(c not in sizes for c in wanted):
            raise VerificationFailed("a remote read named a piece of another version")
        # Pieces another job fetches already (the kernel reads ahead in parallel): wait
        # for that one instead of asking again; a failed one leaves them missing, and
        # the retried request asks itself.
        mine = [c for c in wanted if c not in self.inflight]
        theirs = {id(e): e for c in wanted if (e := self.inflight.get(c)) is not None}
        message = {
            "op": "remote.chunks",
            "green": reader.key.green,
            "version": reader.key.version,
            "chunks": [[c, sizes[c]] for c in mine],
        }

        def fetch() -> dict[bytes, bytes]:
            pieces: dict[bytes, bytes] = {}
            if mine:
                found = self.link.call(message)
                if not isinstance(found, dict) or not isinstance(found.get("chunks"), list):
                    raise VerificationFailed("the fleet link answered no pieces")
                pieces = verified(mine, found["chunks"])  # in the worker: hashing is slow
            for event in theirs.values():
                event.wait(LINK_TIMEOUT)
            return pieces

        done = threading.Event()
        for chunk in mine:
            self.inflight[chunk] = done
        try:
            pieces: dict[bytes, bytes] = yield Io(fetch)
            self._store(vid, pieces)
        finally:
            for chunk in mine:
                if self.inflight.get(chunk) is done:
                    del self.inflight[chunk]
            done.set()

    def _store(self, vid: str, pieces: dict[bytes, bytes]) -> None:
        service = self.service
        volume = service.volumes.get(vid)
        if volume is None:
            raise NotFound("the volume went away while its content was fetched", volume=vid)
        new = {c: d for c, d in pieces.items() if not service.host.has_chunk(c)}
        total = sum(len(d) for d in new.values())
        service.host.admit(volume, total)  # CapacityExhausted: nothing stored
        for data in new.values():
            service.host.put_chunk(data)
        before = self.fetched.get(vid, Fetched(0, 0))
        self.fetched[vid] = Fetched(before.chunks + len(new), before.bytes + total)

    # -- submit and rebase

    def submit(self, vid: str, args: dict[str, Any], now: int) -> JobBody:
        identity = f"{vid}/{self.service.request_identity()}"  # before any yield
        base = self._claim(vid)
        try:
            ops = yield from self._changes(vid, base)
            message: dict[str, Any] = {
                "op": "remote.submit",
                "green": base.key.green,
                "version": base.key.version,
                "ops": ops,
                "request": identity,
            }
            for key in ("dry_run", "durability", "durability_timeout"):
                if args.get(key) is not None:
                    message[key] = args[key]
            timeout = LINK_TIMEOUT + float(args.get("durability_timeout") or 0)
            result = yield Io(lambda: self.link.call(message, timeout=timeout))
            if not isinstance(result, dict):
                raise VerificationFailed("the fleet link answered no submission")
            made = result.get("made_version") is True and args.get("dry_run") is not True
            if not made or not isinstance(result.get("version"), int):
                return {**result, "remote": True, "rebased": False}
            # As a local work volume: onto the version it made, so its next submission
            # holds only what changes from now on.
            version = int(result["version"])
            try:
                tree = yield from self._tree(base.key.green, version)
            except SlatesError as failure:
                return {**result, "remote": True, "rebased": False, "kept_base": str(failure)}
            self._move(vid, base.key.green, version, tree, [], now)
            self._keep_written(vid, ops)
            return {**result, "remote": True, "rebased": True}
        finally:
            self.submitting.discard(vid)

    def rebase(self, vid: str, args: dict[str, Any], now: int) -> JobBody:
        """Onto the green's head (or `version`), keeping the volume's changes; a path
        both sides changed differently is a conflict and nothing moves (module doc)."""
        version = args.get("version")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise InvalidArgument("a version is a number from 0", version=str(version))
        base = self._claim(vid)
        try:
            ops = yield from self._changes(vid, base)
            message = {"op": "remote.tree", "green": base.key.green, "version": version}
            found = yield Io(lambda: self.link.call(message))
            if not isinstance(found, dict) or not isinstance(found.get("tree"), bytes):
                raise VerificationFailed("the fleet link answered no tree record")
            target = found.get("version")
            if not isinstance(target, int) or (version is not None and target != version):
                raise VerificationFailed("the fleet link answered another version", version=target)
            tree = bytes(found["tree"])
            if target == base.key.version:
                return {"ok": True, "version": target, "conflicts": [], "remote": True}
            onto = RemoteBase(
                RemoteKey(base.key.green, target, blake3.blake3(tree).digest()), tree, self._lookup
            )
            kept, conflicts = rebase_plan(ops, base, onto)
            if conflicts:
                return {
                    "ok": False,
                    "version": base.key.version,
                    "conflicts": [{**c, "version": target} for c in conflicts],
                    "remote": True,
                }
            self._move(vid, base.key.green, target, tree, kept, now)
            return {"ok": True, "version": target, "conflicts": [], "remote": True}
        finally:
            self.submitting.discard(vid)

    def _claim(self, vid: str) -> RemoteBase:
        """The volume's base, the volume marked as moving (its writes wait: ShardService)."""
        base = self.base_of(vid)
        if base is None:
            raise NotFound("not a remote work volume", volume=vid)
        if vid in self.submitting:
            raise Unavailable("a submission or rebase of this volume is running", volume=vid)
        self.submitting.add(vid)
        return base

    def _changes(self, vid: str, base: RemoteBase) -> Generator[Any, Any, list[list[Any]]]:
        for _ in range(FETCH_ROUNDS):
            volume = self.service.volumes.get(vid)
            if volume is None:
                raise NotFound("no such volume", volume=vid)
            try:
                return changes(volume, base)
            except MissingContent as error:
                if not self.fetchable(error):
                    raise
                yield from self._fetch(vid, error)
        raise MissingContent("the changes needed more fetches than they may")

    def _tree(self, green: str, version: int) -> Generator[Any, Any, bytes]:
        message = {"op": "remote.tree", "green": green, "version": version}
        found = yield Io(lambda: self.link.call(message))
        if not isinstance(found, dict) or not isinstance(found.get("tree"), bytes):
            raise VerificationFailed("the fleet link answered no tree record")
        if found.get("version") != version:
            raise VerificationFailed("the fleet link answered another version", version=version)
        return bytes(found["tree"])

    def _keep_written(self, vid: str, ops: list[list[Any]]) -> None:
        """The pieces of the files this volume submitted whole that its new base names:
        stored here, so reading them back fetches nothing (best effort: a volume without
        room for them fetches them when they are read)."""
        base = self.base_of(vid)
        volume = self.service.volumes.get(vid)
        if base is None or volume is None:
            return
        sizes = base.sizes()
        pieces: dict[bytes, bytes] = {}
        for op, args in ops:
            if op == "write":
                found = file_chunks(bytes(args["data"]))[1]
                pieces.update((c, d) for c, d in found.items() if c in sizes)
        new = {c: d for c, d in pieces.items() if not self.service.host.has_chunk(c)}
        try:
            self.service.host.admit(volume, sum(len(d) for d in new.values()))
        except CapacityExhausted:
            return
        for data in new.values():
            self.service.host.put_chunk(data)

    def _move(
        self, vid: str, green: str, version: int, tree: bytes, ops: list[list[Any]], now: int
    ) -> None:
        """The volume restarts over version `version`'s tree, then `ops` run on it.

        Journaled as events the shard already replays (no event of its own): a
        carrier volume over the new base (VolumeMade), its snapshot (a record),
        the volume reset onto that snapshot (VolumeReset, keeping its numbering,
        handles and kernel references: GreenOps._restart_as), the carrier dropped
        and its snapshot deleted, then the ops as the volume's own records.  All
        in one step of the job, so they commit together.
        """
        decode_tree(tree)  # VerificationFailed before anything is stored
        service = self.service
        service.host.put_chunk(tree)
        key = RemoteKey(green, version, blake3.blake3(tree).digest()).text()
        carrier = service._new_id("vol")
        unlimited = Capacity.dynamic()
        service._emit(
            VolumeMade(
                carrier,
                f".remote-move-{carrier}",
                key,
                unlimited.bounded,
                unlimited.limit,
                False,
                ROOT_MODE,
                0,
                0,
                now,
            )
        )
        snapshot = service.volumes[carrier].snapshot(service._new_id("snap"))
        service.green_ops._restart_as(vid, snapshot.snapshot_id, (), now)
        service._emit(VolumeDropped(carrier))
        service._emit(SnapshotDeleted(snapshot.snapshot_id))
        service.base_keys[vid] = key
        self.fetched.setdefault(vid, Fetched(0, 0))
        volume = service.volumes[vid]
        for op, op_args in ops:
            run_path_op(volume, op, op_args, now)


def _capacity(args: dict[str, Any]) -> Any:
    from slates.node.service import _capacity as capacity_of  # one parser of the sizes

    return capacity_of(args)


def changes(volume: Volume, base: RemoteBase) -> list[list[Any]]:
    """The shard requests that turn the base tree into the volume's tree (module doc):
    removals deepest first, then directories, then symlinks and files whole."""
    removed: list[tuple[str, Kind]] = []
    dirs: list[tuple[str, int]] = []
    files: list[list[Any]] = []
    total = 0
    pending: list[tuple[int, str]] = [(1, "/")]
    while pending:
        ino, path = pending.pop()
        info = volume.dir_info(ino)
        untouched = info.base_path == path  # unbound names here are the base's own
        items = volume.readdir(ino)
        seen = {item.name for item in items}
        for name, kind in base.list(path):  # also under a directory made again here
            if name not in seen:
                removed.append((posixpath.join(path, name), kind))
        for item in items:
            child = posixpath.join(path, item.name)
            original = base.stat(child)
            if item.ino == 0 and untouched:
                continue  # never looked at: the base's, unchanged
            attr = volume.getattr(item.ino) if item.ino else volume.lookup(ino, item.name)
            if original is not None and original.kind != attr.kind:
                removed.append((child, original.kind))
                original = None
            match attr.kind:
                case Kind.DIR:
                    if original is None:
                        dirs.append((child, attr.mode))
                    pending.append((attr.ino, child))
                case Kind.SYMLINK:
                    target = volume.readlink(attr.ino)
                    if original is None or original.target != target:
                        if original is not None:
                            removed.append((child, Kind.SYMLINK))
                        files.append(["symlink", {"path": child, "target": target}])
                case Kind.FILE:
                    if (
                        original is not None
                        and attr.mode == original.mode
                        and volume.base_content(attr.ino) == (child, base.fingerprint(child))
                    ):
                        continue  # all of it still the base's own bytes
                    total += attr.size
                    if total > MAX_SUBMIT_BYTES:
                        raise CapacityExhausted(
                            "a remote submission carries at most this many changed bytes",
                            limit=MAX_SUBMIT_BYTES,
                        )
                    data = volume.read(attr.ino, 0, attr.size)
                    mode = stat_mode.S_IMODE(attr.mode)
                    files.append(
                        ["write", {"path": child, "data": data, "truncate": True, "mode": mode}]
                    )
                case _:
                    raise NotSupported("a remote submission carries files, dirs and symlinks")
    for path, kind in list(removed):
        if kind == Kind.DIR:  # its base content goes first: a directory is removed empty
            removed += _descendants(base, path)
    ordered = sorted(set(removed), key=lambda r: (-r[0].count("/"), r[0]))
    ops: list[list[Any]] = [
        ["rmdir" if k == Kind.DIR else "unlink", {"path": p}] for p, k in ordered
    ]
    for at, mode in sorted(dirs, key=lambda d: (d[0].count("/"), d[0])):
        mkdir: dict[str, Any] = {"path": at, "mode": mode}
        ops.append(["mkdir", mkdir])
    ops += files
    if len(ops) > MAX_SUBMIT_OPS:
        raise CapacityExhausted("a remote submission has too many changes", limit=MAX_SUBMIT_OPS)
    return ops


def _descendants(base: RemoteBase, path: str) -> list[tuple[str, Kind]]:
    """Every base entry under directory `path` (its removal removes them first)."""
    out: list[tuple[str, Kind]] = []
    pending = [path]
    while pending:
        top = pending.pop()
        for name, kind in base.list(top):
            child = posixpath.join(top, name)
            out.append((child, kind))
            if kind == Kind.DIR:
                pending.append(child)
    return out


def rebase_plan(
    ops: list[list[Any]], base: RemoteBase, onto: RemoteBase
) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Which of a volume's changes (`changes`' ops against `base`) still apply over
    `onto`, and the conflicts: a path both sides changed to different results, a
    removal of what the green changed, a write into a directory the green removed,
    a removal of a directory the green added to.  A change the green made the same
    way is dropped (it is there already).  Pure."""
    made_dirs = {str(a["path"]) for op, a in ops if op == "mkdir"}
    removed = {str(a["path"]) for op, a in ops if op in ("unlink", "rmdir")}
    kept: list[list[Any]] = []
    conflicts: list[dict[str, Any]] = []

    def conflict(path: str, kind: str) -> None:
        # As slates.merge's conflicts on the wire, by whole paths: no ranges; what
        # this volume proposes, the green's bytes are not fetched for it.
        proposed = args.get("data") if op == "write" else None
        if op == "symlink":
            proposed = str(args["target"]).encode()
        conflicts.append(
            {
                "path": path,
                "kind": kind,
                "base": None,
                "head": None,
                "base_bytes": None,
                "accepted": None,
                "proposed": proposed,
                "rewrite": False,
            }
        )

    def parent_there(path: str) -> bool:
        parent = posixpath.dirname(path)
        found = onto.entries.get(parent)
        return parent == "/" or parent in made_dirs or (found is not None and found.kind == "dir")

    for op, args in ops:
        path = str(args["path"])
        old, new = base.entries.get(path), onto.entries.get(path)
        theirs = not (old is None and new is None) and (old is None or not old.same_content(new))
        match op:
            case "unlink" | "rmdir":
                if new is None:
                    continue  # removed on the green too
                if theirs:
                    conflict(path, "changed on the green, removed here")
                elif op == "rmdir" and any(
                    posixpath.join(path, name) not in removed for name, _ in onto.list(path)
                ):
                    conflict(path, "the green added to a directory removed here")
                else:
                    kept.append([op, args])
            case "mkdir":
                if new is not None and new.kind == "dir":
                    continue
                if new is not None:
                    conflict(path, "the green made something else there")
                elif not parent_there(path):
                    conflict(path, "its directory was removed on the green")
                else:
                    kept.append([op, args])
            case "write" | "symlink":
                if not parent_there(path):
                    conflict(path, "its directory was removed on the green")
                elif not theirs:
                    kept.append([op, args])
                elif new is not None and _same_result(op, args, new):
                    continue  # the green has it this way already
                else:
                    conflict(path, "changed on the green and here")
            case _:
                raise InvalidArgument("not a change of a remote work volume", op=str(op))
    return kept, conflicts


def _same_result(op: str, args: dict[str, Any], entry: TreeEntry) -> bool:
    if op == "symlink":
        return entry.kind == "symlink" and entry.target == args["target"]
    chunks, _pieces = file_chunks(bytes(args["data"]))
    mode = int(args.get("mode", entry.mode))
    return entry.kind == "file" and entry.chunks == chunks and entry.mode & 0o7777 == mode
