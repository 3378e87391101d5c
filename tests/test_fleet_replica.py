"""The pure half of real-green replication (slates.fleet.replica), with the ledger machines.

Properties: a tree record decodes to the entries it was made of; a replay
plan applied to a model file system turns the old tree into the new one
(removals before creations, parents before children); a chain of versions
exported as values, placed and proposed on the pure holders, is adopted
by a successor at the next epoch (recovery.Successor) and recomputed
(recovery.verify) into the same tree records, while the old owner's
proposals are refused EpochFenced; the successor chosen for a dead owner
is the first live candidate other than it.  And the fleet link's new
local and remote messages (durable, takeover, `names`, adopted client
ids) parse, travel and refuse what they should.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.errors import InvalidArgument, VerificationFailed
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.holder import Holder
from slates.fleet.ledger import ChunkStore, chunk_id
from slates.fleet.link_rules import (
    Durable,
    Forward,
    Takeover,
    adopted_client_id,
    durable_payload,
    forwarded_client_id,
    parse_local,
    parse_remote_durable,
    remote_payload,
    volume_refs,
)
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Fetch,
    Message,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Refused,
)
from slates.fleet.recovery import Successor, verify
from slates.fleet.replica import (
    TreeEntry,
    choose_successor,
    decode_tree,
    encode_tree,
    file_chunks,
    place_manifest,
    replay_plan,
    successor_config,
    version_value,
)
from slates.node.protocol import MAX_CLIENT_ID

NAMES = st.sampled_from(["a", "b", "c", "d.txt"])
PATHS = st.lists(NAMES, min_size=1, max_size=3).map("/".join)
CONTENT = st.binary(max_size=64)
FileTree = dict[str, tuple[str, Any]]  # path -> ("file", bytes) | ("symlink", target)


def tree_entries(files: FileTree) -> tuple[list[TreeEntry], dict[bytes, bytes]]:
    """Entries of a tree holding `files` (their directories implied), and the chunks."""
    entries: dict[str, TreeEntry] = {}
    chunks: dict[bytes, bytes] = {}
    for path, (kind, data) in sorted(files.items()):
        parts = path.split("/")
        if any("/".join(parts[:i]) in files for i in range(1, len(parts))):
            continue  # a file where a directory would be: not this tree
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            entries[parent] = TreeEntry(parent, "dir", 0o755)
        if path in entries:
            continue  # already a directory of another file
        if kind == "file":
            pieces, found = file_chunks(data)
            chunks.update(found)
            entries[path] = TreeEntry(path, "file", 0o644, chunks=pieces)
        else:
            entries[path] = TreeEntry(path, "symlink", 0o777, str(data))
    return sorted(entries.values()), chunks


TREES = st.dictionaries(
    PATHS,
    st.one_of(
        st.tuples(st.just("file"), CONTENT), st.tuples(st.just("symlink"), st.sampled_from("xy"))
    ),
    max_size=6,
)


@given(TREES)
def test_a_tree_record_decodes_to_its_entries(files: FileTree) -> None:
    entries, _ = tree_entries(files)
    assert list(decode_tree(encode_tree(reversed(entries)))) == entries


def test_a_record_that_is_not_a_tree_is_refused() -> None:
    with pytest.raises(VerificationFailed):
        decode_tree(b"\x93\x01\x02\x03")


def apply_plan(model: dict[str, TreeEntry], plan: list[Any], chunks: dict[bytes, bytes]) -> None:
    """The shard's path ops on a model: each refuses what the shard would."""
    for op in plan:
        path = op.args["path"].lstrip("/")
        parent = path.rpartition("/")[0]
        if parent and (parent not in model or model[parent].kind != "dir"):
            raise AssertionError(f"{op.op} {path}: no parent directory")
        match op.op:
            case "unlink":
                assert model.pop(path).kind != "dir"
            case "rmdir":
                assert not [p for p in model if p.startswith(path + "/")], "rmdir of a full dir"
                assert model.pop(path).kind == "dir"
            case "mkdir":
                assert path not in model
                model[path] = TreeEntry(path, "dir", op.args["mode"])
            case "symlink":
                assert path not in model
                model[path] = TreeEntry(path, "symlink", 0o777, op.args["target"])
            case "write":
                old = model.get(path)
                assert old is None or old.kind == "file"
                before = b"" if op.args.get("truncate") or old is None else _bytes(old, chunks)
                data = before[: op.args.get("offset", 0)] + op.args["data"]
                pieces, found = file_chunks(data)
                chunks.update(found)
                model[path] = TreeEntry(path, "file", op.args["mode"], chunks=pieces)
            case other:
                raise AssertionError(f"unexpected op {other}")


def _bytes(entry: TreeEntry, chunks: dict[bytes, bytes]) -> bytes:
    return b"".join(chunks[c] for c, _ in entry.chunks)


@given(TREES, TREES)
def test_a_replay_plan_turns_the_old_tree_into_the_new(old: FileTree, new: FileTree) -> None:
    old_entries, old_chunks = tree_entries(old)
    new_entries, new_chunks = tree_entries(new)
    model = {e.path: e for e in old_entries}
    chunks = {**old_chunks, **new_chunks}
    apply_plan(model, replay_plan(old_entries, new_entries, new_chunks), chunks)
    assert {p: (e.kind, e.target, _bytes(e, chunks)) for p, e in model.items()} == {
        e.path: (e.kind, e.target, _bytes(e, chunks)) for e in new_entries
    }


def test_a_replay_without_the_chunk_is_refused() -> None:
    entries, _ = tree_entries({"f": ("file", b"bytes")})
    with pytest.raises(VerificationFailed):
        replay_plan([], entries, {})


def peer(host: str) -> Peer:
    return Peer(host, f"boot-{host}")


def config_for(owner: str, epoch: int = 1, revision: int = 1) -> GreenConfig:
    candidates = tuple(Candidate(peer(h), h, "r") for h in ("h1", "h2", "h3"))
    return GreenConfig("g@h1", revision, epoch, peer(owner), HolderSet(1, candidates))


def deliver(holder: Holder, messages: list[Message]) -> list[Message]:
    return [o.message for m in messages for o in holder.receive(m, 0.0)]


def place(holder: Holder, owner: Peer, epoch: int, position: int, tree: bytes,
          value: Any, chunks: dict[bytes, bytes]) -> list[Message]:  # fmt: skip
    """The owner's side of slates.fleet.link_replicate's placement, without the network."""
    out = deliver(holder, [Place(owner, "g@h1", epoch, position, place_manifest(tree))])
    while not any(isinstance(m, (PlaceAck, Refused)) for m in out):
        wanted = [c for m in out if isinstance(m, Fetch) for c in m.chunks]
        out = deliver(holder, [Chunk(owner, "g@h1", c, chunks[c]) for c in wanted])
    if any(isinstance(m, Refused) for m in out):
        return out
    return deliver(holder, [Propose(owner, "g@h1", epoch, position, value, True)])


@settings(max_examples=30, deadline=None)
@given(st.lists(TREES, min_size=1, max_size=4))
def test_exported_versions_are_adopted_and_recomputed_by_a_successor(
    versions: list[FileTree],
) -> None:
    first = config_for("h1")
    holders = {h: Holder(peer(h), 1 << 20) for h in ("h1", "h2", "h3")}
    for holder in holders.values():
        holder.install(first)
    trees: list[bytes] = []
    previous = b""
    for version, files in enumerate(versions):
        entries, chunks = tree_entries(files)
        tree = encode_tree(entries)
        value, tree_chunk = version_value("h1", version, previous, tree)
        chunks[tree_chunk] = tree
        for holder in holders.values():
            out = place(holder, peer("h1"), 1, version + 1, tree, value, chunks)
            assert any(isinstance(m, Accepted) for m in out), out
        trees.append(tree)
        previous = tree
    # h1 is lost; h2 commits epoch 2 and collects promises from itself and h3.
    second = successor_config(first, peer("h2"))
    second = GreenConfig(second.green, 2, second.epoch, second.owner, second.holders)
    successor = Successor(0.0)
    for host in ("h2", "h3"):
        holders[host].install(second)
        for answer in deliver(holders[host], [Prepare(peer("h2"), "g@h1", 2)]):
            assert isinstance(answer, Promise)
            successor.add(second, answer)
    assert successor.chain is not None
    store = ChunkStore(1 << 20)
    for entry in successor.chain:
        for chunk, _ in entry.value.manifest():
            store.put(chunk, holders["h3"].chunks.get(chunk))
    assert verify(successor.chain, store) == trees
    # The old owner, at its old epoch, can no longer place anything.
    entries, chunks = tree_entries({"late": ("file", b"late")})
    tree = encode_tree(entries)
    value, tree_chunk = version_value("h1", len(trees), previous, tree)
    chunks[tree_chunk] = tree
    out = place(holders["h3"], peer("h1"), 1, len(trees) + 1, tree, value, chunks)
    assert [m.code for m in out if isinstance(m, Refused)] == ["EpochFenced"]


def test_a_chunk_that_does_not_match_its_id_is_not_held() -> None:
    store = ChunkStore(1 << 10)
    with pytest.raises(VerificationFailed):
        store.put(chunk_id(b"right"), b"wrong")


@given(st.sets(st.sampled_from(["h1", "h2", "h3"])), st.sampled_from(["h1", "h2", "h3"]))
def test_the_successor_is_the_first_live_candidate_but_the_dead(
    alive: set[str], owner: str
) -> None:
    config = config_for(owner)
    chosen = choose_successor(config, owner, alive)
    expected = sorted(alive - {owner})
    assert chosen == (expected[0] if expected else None)
    other = next(h for h in ("h1", "h2", "h3") if h != owner)
    assert choose_successor(config, other, alive) is None  # not the owner: no takeover
    new = successor_config(config, peer(chosen or "h1"))
    assert new.epoch == config.epoch + 1 and new.holders == config.holders


# -- the link's new messages (slates.fleet.link_rules) -------------------------------------


@given(st.sampled_from(["restart", "host", "region"]), st.integers(0, 10**6))
def test_a_durable_request_parses_and_travels(scope: str, version: int) -> None:
    message = {"op": "durable", "host": "h1", "shard": 0, "work": "vol-0-3"}
    parsed = parse_local({**message, "version": version, "scope": scope, "timeout": 5})
    assert isinstance(parsed, Durable)
    assert (parsed.host, parsed.version, parsed.scope) == ("h1", version, scope)
    remote = parse_remote_durable(durable_payload(parsed))
    assert (remote.host, remote.work, remote.version, remote.scope) == (
        "",
        "vol-0-3",
        version,
        scope,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"scope": "export"},
        {"version": -1},
        {"timeout": 0},
        {"timeout": 10_000},
        {"work": "vol-0-3@h1"},
        {"host": "not a host!"},
    ],
)
def test_a_bad_durable_request_is_refused(change: dict[str, Any]) -> None:
    message = {"op": "durable", "host": "", "shard": 0, "work": "vol-0-3", "version": 1}
    with pytest.raises(InvalidArgument):
        parse_local({**message, "scope": "host", "timeout": 5, **change})


def test_a_takeover_request_names_a_green_and_an_epoch() -> None:
    assert parse_local({"op": "takeover", "green": "g@h1", "epoch": 3}) == Takeover("g@h1", 3)
    for bad in ({"green": "", "epoch": 1}, {"green": "g@h1", "epoch": 0}):
        with pytest.raises(InvalidArgument):
            parse_local({"op": "takeover", **bad})


@given(st.text(min_size=1, max_size=128).filter(lambda c: "\x00" not in c))
def test_adopted_client_ids_are_stable_valid_and_apart(client: str) -> None:
    first = adopted_client_id("h1", client)
    assert first == adopted_client_id("h1", client)
    assert first != adopted_client_id("h2", client)
    assert 0 < len(forwarded_client_id("h3", first)) <= MAX_CLIENT_ID


def test_volume_refs_are_the_ids_a_request_names() -> None:
    request = {"seq": 1, "ack": 0, "op": "x", "args": {"volume": "vol-0-1", "green": "name"}}
    assert volume_refs(request) == {"volume": "vol-0-1"}
    forward = Forward("h2", 0, "c", request, "h1")
    assert remote_payload(forward)["names"] == "h1"
    assert "names" not in remote_payload(Forward("h1", 0, "c", request, "h1"))
