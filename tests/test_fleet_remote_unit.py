"""Remote work volumes in-process: a ShardService over a fake fleet link.

The link is a dict of pieces (`FakeLink`, which counts what it serves and
can damage a piece); the service runs its jobs inline (tests/jobs_inline).
A RuleBasedStateMachine edits a remote work volume against a plain model
(path -> bytes, and directories): every read returns the model's bytes,
only pieces of files read are fetched, each at most once, a replayed
service (the journal's events) reads the same without fetching, and the
submission's ops (`remote_ops.changes`) applied to the base tree give the
model.  Properties cover `RemoteBase` reads and `verified`.
"""

from __future__ import annotations

import posixpath
import random
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.errors import MissingContent, VerificationFailed
from slates.fleet.replica import CHUNK_BYTES, TreeEntry, encode_tree, file_chunks
from slates.node.events import Event
from slates.node.protocol import Request
from slates.node.remote_base import READ_AHEAD_BYTES, RemoteBase, RemoteKey
from slates.node.remote_ops import LinkCalls, changes, verified
from slates.node.service import ShardService
from tests.jobs_inline import finish

GREEN = "vol-0-1@h1"
NAMES = ("a", "b", "c")


class FakeLink(LinkCalls):
    """The fleet link as a holder of one version's tree and pieces."""

    def __init__(self, tree: bytes, pieces: dict[bytes, bytes]) -> None:
        super().__init__(None)
        self.tree = tree
        self.pieces = pieces
        self.served: list[bytes] = []
        self.damage = 0
        self.submitted: list[list[Any]] = []

    def call(self, message: dict[str, Any], timeout: float = 60.0) -> Any:
        match message["op"]:
            case "remote.tree":
                return {"version": 0, "tree": self.tree, "source": "h2"}
            case "remote.chunks":
                out = []
                for chunk, _size in message["chunks"]:
                    data = self.pieces[chunk]
                    if self.damage:
                        self.damage -= 1
                        data = bytes([data[0] ^ 1]) + data[1:]
                    out.append([chunk, data])
                    self.served.append(chunk)
                return {"chunks": out, "sources": {"h2": len(out)}}
            case "remote.submit":
                self.submitted.append(message["ops"])
                return {"ok": True, "version": 1, "made_version": True, "conflicts": []}
        raise AssertionError(message)


def make_tree(files: dict[str, bytes], dirs: set[str]) -> tuple[bytes, dict[bytes, bytes]]:
    entries = [TreeEntry(d.lstrip("/"), "dir", 0o755) for d in dirs]
    pieces: dict[bytes, bytes] = {}
    for path, data in files.items():
        chunks, found = file_chunks(data)
        pieces.update(found)
        entries.append(TreeEntry(path.lstrip("/"), "file", 0o644, chunks=chunks))
    entries.append(TreeEntry("link", "symlink", 0o777, target="a"))
    return encode_tree(entries), pieces


class Shard:
    def __init__(self, link: FakeLink, host: Host | None = None) -> None:
        self.service = ShardService(0, host or Host(), LiveDirectory)
        self.service.remote.link = link
        self.events: list[Event] = []
        self.seq = 0

    def call(self, op: str, **args: Any) -> Any:
        self.seq += 1
        request = Request(self.seq, self.seq - 1, op, args)
        reply, events = finish(self.service, *self.service.handle("t", request, self.seq))
        self.events += events
        if not reply["ok"]:
            error = reply["error"]
            raise {"MissingContent": MissingContent, "VerificationFailed": VerificationFailed}.get(
                error["code"], AssertionError
            )(str(error))
        return reply["result"]


def apply_ops(files: dict[str, bytes], dirs: set[str], ops: list[list[Any]]) -> None:
    for op, args in ops:
        path = args["path"]
        match op:
            case "unlink":
                files.pop(path, None)
            case "rmdir":
                assert not any(p.startswith(path + "/") for p in [*files, *dirs]), path
                dirs.discard(path)
            case "mkdir":
                dirs.add(path)
            case "write":
                files[path] = args["data"]
            case "symlink":
                pass


class RemoteWork(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        rng = random.Random(7)
        self.base_files = {
            "/a": rng.randbytes(2 * CHUNK_BYTES + 5),
            "/b": b"small\n",
            "/d/c": b"in a dir\n",
        }
        self.base_dirs = {"/d"}
        tree, pieces = make_tree(self.base_files, self.base_dirs)
        self.link = FakeLink(tree, pieces)
        self.shard = Shard(self.link)
        self.work = self.shard.call("work.create", green=GREEN, name="w")["id"]
        self.files = dict(self.base_files)
        self.dirs = set(self.base_dirs)
        self.read_paths: set[str] = set()

    @rule(path=st.sampled_from(["/a", "/b", "/d/c", "/d/a", "/e/b"]))
    def read(self, path: str) -> None:
        if path not in self.files:
            return
        assert self.shard.call("read", volume=self.work, path=path) == self.files[path]
        if path in self.base_files:
            self.read_paths.add(path)

    @rule(
        path=st.sampled_from(["/a", "/b", "/d/c", "/d/a", "/e/b"]),
        data=st.binary(max_size=64),
    )
    def write(self, path: str, data: bytes) -> None:
        if posixpath.dirname(path) not in self.dirs | {"/"}:
            return
        self.shard.call("write", volume=self.work, path=path, data=data, truncate=True)
        self.files[path] = data

    @rule(path=st.sampled_from(["/a", "/b", "/d/c", "/d/a"]), at=st.integers(0, 3))
    def edit(self, path: str, at: int) -> None:
        if path not in self.files:
            return
        at = min(at, len(self.files[path]))
        self.shard.call("edit", volume=self.work, path=path, start=at, end=at, data=b"+")
        self.files[path] = self.files[path][:at] + b"+" + self.files[path][at:]

    @rule(path=st.sampled_from(["/a", "/b", "/d/c", "/d/a"]))
    def unlink(self, path: str) -> None:
        if path in self.files:
            self.shard.call("unlink", volume=self.work, path=path)
            del self.files[path]

    @rule(path=st.sampled_from(["/d", "/e"]))
    def mkdir_or_rmdir(self, path: str) -> None:
        if path not in self.dirs:
            self.shard.call("mkdir", volume=self.work, path=path)
            self.dirs.add(path)
        elif not any(p.startswith(path + "/") for p in self.files):
            self.shard.call("rmdir", volume=self.work, path=path)
            self.dirs.discard(path)

    @invariant()
    def fetched_only_what_was_read_and_once(self) -> None:
        served = self.link.served
        assert len(served) == len(set(served))
        # A read of the big base file fetches its pieces (read-ahead within that file).
        read_base = {c for p in self.read_paths for c, _ in file_chunks(self.base_files[p])[0]}
        assert set(served) <= read_base

    @rule()
    def changes_rebuild_the_model(self) -> None:
        volume = self.shard.service.volumes[self.work]
        base = volume.base
        assert isinstance(base, RemoteBase)
        files, dirs = dict(self.base_files), set(self.base_dirs)
        for _ in range(8):
            try:
                ops = changes(volume, base)
                break
            except MissingContent:
                # The walk reads changed files whole: fetch as a read would.
                for path in self.files:
                    self.shard.call("read", volume=self.work, path=path)
                    if path in self.base_files:
                        self.read_paths.add(path)
        apply_ops(files, dirs, ops)
        assert files == self.files
        assert dirs == self.dirs

    def teardown(self) -> None:
        served = len(self.link.served)
        replayed = ShardService(
            0, Host(chunks=dict(self.shard.service.host._chunks)), LiveDirectory
        )
        replayed.remote.link = self.link
        replayed.replay(self.shard.events)
        volume = replayed.volumes[self.work]
        for path in self.read_paths & set(self.files):
            ino = volume.resolve(path)
            assert volume.read(ino, 0, len(self.files[path])) == self.files[path]
        assert len(self.link.served) == served  # kept across the replay's collection


TestRemoteWork = RemoteWork.TestCase
TestRemoteWork.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_a_damaged_piece_stores_nothing_and_the_next_read_works() -> None:
    tree, pieces = make_tree({"/a": b"x" * 5000}, set())
    link = FakeLink(tree, pieces)
    shard = Shard(link)
    work = shard.call("work.create", green=GREEN, name="w")["id"]
    shard.call("stat", volume=work, path="/a")
    stored = shard.service.host.chunk_count
    link.damage = 1
    with pytest.raises(VerificationFailed):
        shard.call("read", volume=work, path="/a")
    assert shard.service.host.chunk_count == stored
    assert shard.call("read", volume=work, path="/a") == b"x" * 5000
    assert shard.service.host.chunk_count == stored + 1
    assert shard.call("volume.show", volume=work)["remote"]["fetched_chunks"] == 1


def test_a_second_volume_of_the_version_shares_the_pieces() -> None:
    tree, pieces = make_tree({"/a": b"y" * 100}, set())
    link = FakeLink(tree, pieces)
    shard = Shard(link)
    one = shard.call("work.create", green=GREEN, name="one")["id"]
    two = shard.call("work.create", green=GREEN, name="two")["id"]
    assert shard.call("read", volume=one, path="/a") == b"y" * 100
    assert shard.call("read", volume=two, path="/a") == b"y" * 100
    assert len(link.served) == 1
    assert shard.call("readlink", volume=one, path="/link") == "a"
    shard.call("gc")  # a collection keeps what remote bases fetched: no extent names it
    assert shard.call("read", volume=two, path="/a") == b"y" * 100
    assert len(link.served) == 1
    shard.call("volume.delete", volume=one)
    shard.call("volume.delete", volume=two)
    shard.call("gc")  # nothing uses the version now: its tree and pieces go
    assert shard.service.host.chunk_count == 0


def test_a_submission_is_refused_after_it_made_a_version() -> None:
    tree, pieces = make_tree({"/a": b"z"}, set())
    shard = Shard(FakeLink(tree, pieces))
    work = shard.call("work.create", green=GREEN, name="w")["id"]
    shard.call("write", volume=work, path="/n", data=b"new")
    assert shard.call("submit", volume=work)["version"] == 1
    with pytest.raises(AssertionError, match="NotSupported"):
        shard.call("submit", volume=work)


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * CHUNK_BYTES // 1024), min_size=1, max_size=3),
    offset=st.integers(0, 4 * CHUNK_BYTES),
    size=st.integers(0, 2 * CHUNK_BYTES),
    held=st.sets(st.integers(0, 8)),
)
def test_remote_base_reads_what_it_holds_and_names_what_it_lacks(
    sizes: list[int], offset: int, size: int, held: set[int]
) -> None:
    rng = random.Random(sum(sizes) + offset)
    data = rng.randbytes(sum(sizes) * 1024)
    tree, pieces = make_tree({"/f": data}, set())
    ids = list(pieces)
    store = {c: pieces[c] for i, c in enumerate(ids) if i in held}
    key = RemoteKey(GREEN, 0, blake3.blake3(tree).digest())
    base = RemoteBase(key, tree, store.get)
    fingerprint = base.fingerprint("/f")
    try:
        assert base.read("/f", fingerprint, offset, size) == data[offset : offset + size]
    except MissingContent as missing:
        named = [bytes.fromhex(c) for c in missing.details["chunks"]]
        assert named and not set(named) & set(store)
        assert sum(len(pieces[c]) for c in named) <= max(READ_AHEAD_BYTES, CHUNK_BYTES)


@given(st.lists(st.binary(min_size=1, max_size=32), min_size=1, max_size=5, unique=True))
def test_verified_refuses_any_damaged_piece(blobs: list[bytes]) -> None:
    ids = [blake3.blake3(b).digest() for b in blobs]
    assert verified(ids, [[c, b] for c, b in zip(ids, blobs, strict=True)]) == dict(
        zip(ids, blobs, strict=True)
    )
    damaged = [[c, b] for c, b in zip(ids, blobs, strict=True)]
    damaged[-1][1] = bytes([damaged[-1][1][0] ^ 0x80]) + damaged[-1][1][1:]
    with pytest.raises(VerificationFailed):
        verified(ids, damaged)
    with pytest.raises(MissingContent):
        verified(ids, damaged[:-1])


def test_a_checkpointed_remote_volume_reopens_its_base() -> None:
    tree, pieces = make_tree({"/a": b"q" * 300, "/b": b"r"}, set())
    link = FakeLink(tree, pieces)
    shard = Shard(link)
    work = shard.call("work.create", green=GREEN, name="w")["id"]
    assert shard.call("read", volume=work, path="/a") == b"q" * 300
    blob = shard.service.checkpoint()
    restored = Shard(link, Host(chunks=dict(shard.service.host._chunks)))
    restored.service.restore(blob)
    restored.seq = shard.seq  # the same client goes on numbering
    assert restored.call("read", volume=work, path="/a") == b"q" * 300
    assert restored.call("read", volume=work, path="/b") == b"r"  # fetched after the restore
    assert len(link.served) == 2
    assert restored.call("volume.show", volume=work)["remote"]["green"] == GREEN
