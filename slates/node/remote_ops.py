"""A shard's remote work volumes: work volumes here of greens owned on other hosts.

Theory of operation (DESIGN.md section 7, "Remote reads").  Called by
ShardService for three things; every wait on the network is an `Io` of a
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
  uses the base (`kept_chunks`, which the service's collection adds).
  This is why requests are retried whole: a base read happens before an
  operation publishes anything (a write reads its partial pages first).
- `submit`: the volume's changes against its base tree (`changes`: only
  bound names are walked, so untouched content is never fetched; a
  changed file travels whole, at most MAX_SUBMIT_BYTES in all) go to the
  link, which replays them on a fresh work volume of the base version on
  the green's owner and submits it there: the owner merges them as any
  submission and the reply (version, structured conflicts) comes back as
  it is.  After a submission that made a version the volume is spent
  (`spent`, in memory): a rebase onto the new version is not built yet,
  so a second submit or a rebase is refused NotSupported.  `rebase` is
  NotSupported too.

Known gaps: `spent` does not survive a shard restart; a retry after a lost
reply of a remote submit that the shard did not answer yet may submit on
the owner twice (the owner's side is a new scratch work volume each time).
"""

from __future__ import annotations

import dataclasses
import posixpath
import stat as stat_mode
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import blake3

from slates.core.records import Kind
from slates.core.volume import Volume
from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    MissingContent,
    NotFound,
    NotSupported,
    SlatesError,
    VerificationFailed,
)
from slates.fleet.replica import decode_tree
from slates.node.args import str_arg
from slates.node.events import VolumeMade
from slates.node.jobs import Io, JobBody
from slates.node.remote_base import ROOT_MODE, RemoteBase, RemoteKey, remote_key

if TYPE_CHECKING:
    from slates.node.service import ShardService

__all__ = ["FETCH_ROUNDS", "LinkCalls", "MAX_SUBMIT_BYTES", "RemoteOps", "verified"]

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
        self.spent: dict[str, int] = {}  # volume -> the version its submission made
        self.inflight: dict[bytes, threading.Event] = {}  # pieces a job is fetching now

    # -- bases

    def open(self, key: str) -> RemoteBase | None:
        """The reader of a remote base key (None: not one), reopened from the store."""
        parsed = remote_key(key)
        if parsed is None:
            return None
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
        """The pieces of every remote base a volume or snapshot still uses."""
        service = self.service
        used = {id(v.base) for v in service.volumes.values()}
        used |= {id(s.base) for s in service.snapshots.values()}
        kept: set[bytes] = set()
        for key, reader in list(self.readers.items()):
            if id(reader) in used:
                kept |= reader.chunk_ids()
            else:
                del self.readers[key]
        return kept

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
            "submitted_version": self.spent.get(vid),
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

    # -- submit

    def submit(self, vid: str, args: dict[str, Any]) -> JobBody:
        base = self.base_of(vid)
        if base is None:
            raise NotFound("not a remote work volume", volume=vid)
        if vid in self.spent:
            raise NotSupported(
                "this remote work volume made a version already; moving it onto that "
                "version is not built yet: make a new work volume of the green",
                volume=vid,
                version=self.spent[vid],
            )
        for _ in range(FETCH_ROUNDS):
            volume = self.service.volumes.get(vid)
            if volume is None:
                raise NotFound("no such volume", volume=vid)
            try:
                ops = changes(volume, base)
                break
            except MissingContent as error:
                if not self.fetchable(error):
                    raise
                yield from self._fetch(vid, error)
        else:
            raise MissingContent("the changes needed more fetches than they may")
        message: dict[str, Any] = {
            "op": "remote.submit",
            "green": base.key.green,
            "version": base.key.version,
            "ops": ops,
        }
        for key in ("dry_run", "durability", "durability_timeout"):
            if args.get(key) is not None:
                message[key] = args[key]
        timeout = LINK_TIMEOUT + float(args.get("durability_timeout") or 0)
        result = yield Io(lambda: self.link.call(message, timeout=timeout))
        if not isinstance(result, dict):
            raise VerificationFailed("the fleet link answered no submission")
        if result.get("made_version") and isinstance(result.get("version"), int):
            self.spent[vid] = int(result["version"])
        return {**result, "remote": True, "rebased": False}


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
        for name, kind in base.list(path) if untouched else ():
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
