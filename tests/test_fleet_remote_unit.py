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
import types
from typing import Any, ClassVar

import blake3
import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.errors import MissingContent, Unavailable, VerificationFailed
from slates.fleet.config import Peer
from slates.fleet.link_identity import MadeBy, submission_request
from slates.fleet.link_submit import Submissions
from slates.fleet.replica import CHUNK_BYTES, TreeEntry, decode_tree, encode_tree, file_chunks
from slates.node.events import Event
from slates.node.jobs import Io, Job
from slates.node.protocol import Request
from slates.node.remote_base import READ_AHEAD_BYTES, RemoteBase, RemoteKey
from slates.node.remote_ops import LinkCalls, changes, rebase_plan, verified
from slates.node.service import ShardService
from tests.jobs_inline import finish

GREEN = "vol-0-1@h1"
NAMES = ("a", "b", "c")


class FakeLink(LinkCalls):
    """The fleet link as a holder of a green's versions, their trees and pieces; with a
    `model` (version 0's files and directories) a submission makes the next version."""

    def __init__(
        self,
        tree: bytes,
        pieces: dict[bytes, bytes],
        model: tuple[dict[str, bytes], set[str]] | None = None,
    ) -> None:
        super().__init__(None)
        self.trees = [tree]
        self.models = None if model is None else [model]
        self.pieces = pieces
        self.served: list[bytes] = []
        self.damage = 0
        self.submitted: list[list[Any]] = []
        self.requests: list[str] = []

    def on_fleet(self) -> bool:
        return True

    def call(self, message: dict[str, Any], timeout: float = 60.0) -> Any:
        match message["op"]:
            case "remote.tree":
                version = message["version"]
                version = len(self.trees) - 1 if version is None else version
                return {"version": version, "tree": self.trees[version], "source": "h2"}
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
                self.requests.append(message["request"])
                tree = self.trees[-1]
                if self.models is not None:
                    files, dirs = self.models[message["version"]]
                    files, dirs = dict(files), set(dirs)
                    apply_ops(files, dirs, message["ops"])
                    tree, pieces = make_tree(files, dirs)
                    self.pieces.update(pieces)
                    self.models.append((files, dirs))
                self.trees.append(tree)
                version = len(self.trees) - 1
                return {"ok": True, "version": version, "made_version": True, "conflicts": []}
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
    shard.call("gc")  # nothing uses the version now, but the journal names it
    assert shard.service.host.chunk_count == 2  # its tree and its piece, for a replay
    # A checkpoint published without the volumes (ShardService.checkpoint_document's hook):
    # the journal after it needs nothing of the version.
    shard.service.remote.checkpointed(shard.service.remote.in_use())
    shard.call("gc")
    assert shard.service.host.chunk_count == 0


def test_a_submission_moves_the_volume_onto_its_version_also_after_a_replay() -> None:
    files, dirs = {"/a": b"z", "/d/b": b"in d\n"}, {"/d"}
    tree, pieces = make_tree(files, dirs)
    link = FakeLink(tree, pieces, model=(files, dirs))
    shard = Shard(link)
    work = shard.call("work.create", green=GREEN, name="w")["id"]
    shard.call("write", volume=work, path="/n", data=b"new")
    first = shard.call("submit", volume=work)
    assert first["version"] == 1 and first["rebased"] is True, first
    assert shard.call("volume.show", volume=work)["remote"]["version"] == 1
    served = len(link.served)
    assert shard.call("read", volume=work, path="/n") == b"new"  # now the base's
    assert len(link.served) == served  # its piece was kept from the submission
    shard.call("write", volume=work, path="/a", data=b"second")
    second = shard.call("submit", volume=work)
    assert second["version"] == 2 and second["rebased"] is True
    assert [[op, a["path"]] for op, a in link.submitted[1]] == [["write", "/a"]]  # only that
    assert link.requests[0] != link.requests[1]
    # The moves are journaled as events a replay applies: the same volume, on version 2;
    # what the replay reads of the versions before is kept until a checkpoint.
    shard.call("gc")
    replayed = Shard(link, Host(chunks=dict(shard.service.host._chunks)))
    # The journal's frames as one stream, as the shard replays them (Shard.recover): the
    # one collection, after the last, frees nothing a later frame opens again.
    assert replayed.service.replay(iter(shard.events)) == len(shard.events)
    replayed.seq = shard.seq
    assert replayed.call("volume.show", volume=work)["remote"]["version"] == 2
    # Its base key names version 2's base, not the first it was made over; also after a
    # checkpoint of the replayed state is restored.
    moved_key = shard.service.base_keys[work]
    assert moved_key is not None and moved_key.startswith(f"fleet:{GREEN}:2:"), moved_key
    assert replayed.service.base_keys[work] == moved_key
    assert replayed.call("volume.show", volume=work)["base"] == moved_key
    restored = Shard(link, Host(chunks=dict(replayed.service.host._chunks)))
    restored.service.restore(replayed.service.checkpoint())
    assert restored.service.base_keys[work] == moved_key
    assert restored.service.volumes[work].base is not None
    assert getattr(restored.service.volumes[work].base, "root", None) == moved_key
    assert replayed.call("read", volume=work, path="/a") == b"second"
    assert replayed.call("read", volume=work, path="/d/b") == b"in d\n"
    names = {v["name"] for v in replayed.call("volume.list")}
    assert names == {"w"}  # the moves' carrier volumes are gone


def test_a_retried_submit_carries_the_identity_of_the_first() -> None:
    tree, pieces = make_tree({"/a": b"z"}, set())
    link = FakeLink(tree, pieces)
    shard = Shard(link)
    work = shard.call("work.create", green=GREEN, name="w")["id"]
    shard.call("write", volume=work, path="/n", data=b"new")
    shard.seq += 1
    request = Request(shard.seq, shard.seq - 1, "submit", {"volume": work})
    job, _events = shard.service.handle("t", request, shard.seq)
    assert isinstance(job, Job) and isinstance(job.waiting, Io)
    job.waiting.fn()  # the submission reaches the owner, then its connection goes away
    shard.service.abandon(job)
    reply, _events = finish(shard.service, *shard.service.handle("t", request, shard.seq))
    assert reply["ok"] is True
    assert link.requests[0] == link.requests[1]  # the owner's link answers its kept reply
    shard.call("write", volume=work, path="/m", data=b"more")
    shard.call("submit", volume=work)
    assert link.requests[2] != link.requests[0]


def test_a_remote_rebase_keeps_the_changes_or_answers_conflicts() -> None:
    files: dict[str, bytes] = {"/a": b"one\n", "/b": b"two\n"}
    dirs: set[str] = set()
    tree, pieces = make_tree(files, dirs)
    link = FakeLink(tree, pieces, model=(files, dirs))
    shard = Shard(link)
    mine = shard.call("work.create", green=GREEN, name="mine")["id"]
    other = shard.call("work.create", green=GREEN, name="other")["id"]
    shard.call("write", volume=other, path="/b", data=b"TWO\n")
    assert shard.call("submit", volume=other)["version"] == 1
    shard.call("write", volume=mine, path="/a", data=b"ONE\n")
    shard.call("write", volume=mine, path="/c", data=b"three\n")
    moved = shard.call("rebase", volume=mine)
    assert moved == {"ok": True, "version": 1, "conflicts": [], "remote": True}
    assert shard.call("volume.show", volume=mine)["remote"]["version"] == 1
    assert shard.call("read", volume=mine, path="/a") == b"ONE\n"  # kept
    assert shard.call("read", volume=mine, path="/b") == b"TWO\n"  # the green's
    assert shard.call("read", volume=mine, path="/c") == b"three\n"
    shard.call("write", volume=other, path="/a", data=b"uno\n")
    assert shard.call("submit", volume=other)["version"] == 2
    refused = shard.call("rebase", volume=mine)
    assert refused["ok"] is False and refused["version"] == 1
    assert [(c["path"], c["version"]) for c in refused["conflicts"]] == [("/a", 2)]
    assert shard.call("volume.show", volume=mine)["remote"]["version"] == 1  # not moved


@given(
    ours=st.dictionaries(st.sampled_from(["/a", "/b", "/c"]), st.binary(max_size=8), max_size=3),
    theirs=st.dictionaries(st.sampled_from(["/a", "/b", "/c"]), st.binary(max_size=8), max_size=3),
)
def test_rebase_plan_conflicts_exactly_where_both_changed_differently(
    ours: dict[str, bytes], theirs: dict[str, bytes]
) -> None:
    start = {"/a": b"a", "/b": b"b"}
    base = RemoteBase(*_keyed(make_tree(start, set())[0]), lambda _c: None)
    onto = RemoteBase(*_keyed(make_tree({**start, **theirs}, set())[0]), lambda _c: None)
    ops: list[list[Any]] = [
        ["write", {"path": p, "data": d, "truncate": True, "mode": 0o644}] for p, d in ours.items()
    ]
    kept, conflicts = rebase_plan(ops, base, onto)
    changed_there = {p for p, d in theirs.items() if start.get(p) != d}
    expected = {p for p, d in ours.items() if p in changed_there and theirs[p] != d}
    assert {c["path"] for c in conflicts} == expected
    assert {a["path"] for _op, a in kept} == set(ours) - changed_there


def _keyed(tree: bytes) -> tuple[RemoteKey, bytes]:
    return RemoteKey(GREEN, 0, blake3.blake3(tree).digest()), tree


def test_an_owner_runs_a_submission_once_and_answers_its_retries() -> None:
    class Owning:
        me = Peer("h1", "d1")
        configs: ClassVar[dict[str, Any]] = {}

        def __init__(self) -> None:
            self.made_by = MadeBy()

        async def config(self, green: str) -> Any:
            return types.SimpleNamespace(owner=self.me)

    runs: list[str] = []

    async def run(green: str, message: dict[str, Any]) -> dict[str, Any]:
        runs.append(message["request"])
        await trio.sleep(0.01)
        return {"ok": True, "version": len(runs), "made_version": True}

    async def after(green: str, message: dict[str, Any], reply: dict[str, Any]) -> Any:
        return reply

    async def peer_call(host: str, payload: bytes, timeout: float) -> bytes:
        raise AssertionError("the owner is this host")

    async def main() -> None:
        owner = Submissions("h1", Owning(), peer_call, run, after)  # type: ignore[arg-type]
        message = {"green": GREEN, "version": 0, "ops": [], "request": "vol-0-1/t/4"}
        answers: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:  # a retry while the first still runs
            for _ in range(2):
                nursery.start_soon(lambda: _append(answers, owner.serve("h2", message)))
        owner.drop_replies(1)
        with pytest.raises(Unavailable):
            await owner.serve("h2", message)  # answered, its reply dropped
        answers.append(await owner.serve("h2", message))
        assert [a["version"] for a in answers] == [1, 1, 1] and len(runs) == 1
        other = await owner.serve("h3", message)  # another host's identity is its own
        assert other["version"] == 2 and len(runs) == 2
        # A successor's link has no kept replies, only the ledger's identities: a retry
        # is answered from those, and runs nothing.
        successor = Submissions("h1", Owning(), peer_call, run, after)  # type: ignore[arg-type]
        successor.replicator.made_by.record(GREEN, 1, submission_request("h2", "vol-0-1/t/4"))
        recovered = await successor.serve("h2", message)
        assert recovered["version"] == 1 and recovered["recovered"] and len(runs) == 2
        fresh = await successor.serve("h3", {**message, "request": "vol-0-1/t/5"})
        assert fresh["version"] == 3 and len(runs) == 3
        assert successor.replicator.made_by.version_of(GREEN, "h3", "vol-0-1/t/5") == 3

    trio.run(main)


async def _append(out: list[dict[str, Any]], answer: Any) -> None:
    out.append(await answer)


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


def test_a_remote_base_answers_owner_group_mode_and_time_of_its_record() -> None:
    entries = [
        TreeEntry("d", "dir", 0o750, uid=7, gid=8, mtime_ns=11),
        TreeEntry("d/f", "file", 0o640, "", file_chunks(b"x")[0], 1001, 1002, 123_456),
        TreeEntry("l", "symlink", 0o777, "d/f", (), 3, 4, 5),
    ]
    tree = encode_tree(entries)
    base = RemoteBase(RemoteKey(GREEN, 0, blake3.blake3(tree).digest()), tree, lambda _c: None)
    found = base.stat("/d/f")
    assert found is not None
    assert (found.uid, found.gid, found.mode, found.mtime_ns) == (1001, 1002, 0o640, 123_456)
    assert found.size == 1
    link = base.stat("/l")
    assert link is not None and (link.uid, link.gid, link.mtime_ns) == (3, 4, 5)
    directory = base.stat("/d")
    assert directory is not None and (directory.uid, directory.mode) == (7, 0o750)


def test_a_format_1_tree_record_still_reads_with_owner_and_time_zero() -> None:
    old = msgpack.packb([1, [["a", "file", 0o644, "", [[b"\x01" * 32, 3]]]]], use_bin_type=True)
    (entry,) = decode_tree(old)
    assert (entry.path, entry.size, entry.uid, entry.gid, entry.mtime_ns) == ("a", 3, 0, 0, 0)


@given(
    uid=st.integers(0, 1 << 32),
    gid=st.integers(0, 1 << 32),
    mtime_ns=st.integers(0, 1 << 63),
    mode=st.integers(0, 0o7777),
)
def test_tree_records_keep_owner_group_mode_and_time(
    uid: int, gid: int, mtime_ns: int, mode: int
) -> None:
    entry = TreeEntry("f", "file", mode, "", file_chunks(b"data")[0], uid, gid, mtime_ns)
    assert decode_tree(encode_tree([entry])) == (entry,)
