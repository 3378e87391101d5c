"""Fencing's pure rules (slates.fleet.fencing), its file (link_fence) and the identity table.

Properties: `admit` against a direct model of the rules (a green the table
does not name is admitted; an owned one while `now <= until` and the
configurations were read under the current lease; a moved one is NotOwner
naming the committed host; everything else EpochFenced); a table survives
its msgpack form; malformed tables are refused.  The file: a reader sees
each write, and no file means nothing is fenced.  The identities
(link_identity.MadeBy): what is recorded is found both ways, the export
identity is never a submission's, a recovered chain rebuilds the table, and
a version's value carries the identity of the submission that made it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import EpochFenced, InvalidArgument, NotOwner
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.fencing import FenceTable, admit, build_table, decode_table, encode_table
from slates.fleet.ledger import RequestId
from slates.fleet.link_fence import FenceReader, FenceWriter
from slates.fleet.link_identity import MadeBy, submission_request
from slates.fleet.replica import EXPORT_CLIENT, version_value

ME = Peer("h1", "boot-1")
HOSTS = ("h1", "h2", "h3")


def _config(green: str, owner: Peer, epoch: int) -> GreenConfig:
    holders = HolderSet(1, tuple(Candidate(Peer(h, f"boot-{h}"), f"dom-{h}", "r") for h in HOSTS))
    return GreenConfig(green=green, revision=epoch, epoch=epoch, owner=owner, holders=holders)


owners = st.sampled_from([ME, Peer("h1", "boot-0"), Peer("h2", "boot-2"), Peer("h3", "boot-3")])
greens = st.lists(
    st.tuples(st.sampled_from(["g0@h1", "g1@h1", "g2@h2", "g3@h3"]), owners, st.integers(1, 9)),
    max_size=4,
    unique_by=lambda row: row[0],
)


def _local(green: str) -> tuple[int, str] | None:
    return None if green == "g3@h3" else (int(green[1]) % 2, green.partition("@")[0])


@given(
    rows=greens,
    until=st.floats(0, 100),
    since=st.floats(0, 100),
    read_at=st.floats(0, 100),
    now=st.floats(0, 100),
    asked=st.sampled_from(["g0", "g1", "g2", "g3", "other"]),
)
def test_admit_follows_the_rules(
    rows: list[tuple[str, Peer, int]],
    until: float,
    since: float,
    read_at: float,
    now: float,
    asked: str,
) -> None:
    configs = [_config(g, o, e) for g, o, e in rows]
    table = build_table(ME, configs, _local, until, since, read_at)
    assert decode_table(encode_table(table)) == table
    shard = int(asked[1]) % 2 if asked[1:].isdigit() else 0
    found = next((r for r in rows if r[0].startswith(asked + "@") and asked != "g3"), None)
    if found is None:
        admit(table, shard, asked, now)  # not named: nothing to defer to
        return
    _green, owner, epoch = found
    if owner == ME and read_at >= since and now <= until:
        admit(table, shard, asked, now)
    elif owner.host != ME.host:
        with pytest.raises(NotOwner) as moved:
            admit(table, shard, asked, now)
        assert moved.value.details["owner_host"] == owner.host
        assert moved.value.details["epoch"] == epoch
    else:
        with pytest.raises(EpochFenced):
            admit(table, shard, asked, now)


def test_a_superseded_copy_is_fenced_and_no_table_fences_nothing() -> None:
    table = build_table(ME, [], _local, 10.0, 0.0, 1.0, superseded=[(0, "vol-0-1")])
    with pytest.raises(EpochFenced):
        admit(table, 0, "vol-0-1", 0.0)
    admit(None, 0, "vol-0-1", 0.0)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"format": 2, "until": 0, "greens": []}),
        msgpack.packb({"format": 1, "until": "x", "greens": []}),
        msgpack.packb({"format": 1, "until": 0, "greens": [[0, "g", "gone", "h", 1]]}),
        msgpack.packb({"format": 1, "until": 0, "greens": [[0, "g"]]}),
    ],
)
def test_malformed_tables_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidArgument):
        decode_table(raw)


def test_the_reader_sees_every_write_and_no_file_fences_nothing() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        reader = FenceReader(tmp)
        writer = FenceWriter(Path(tmp))
        reader.admit(0, "g0")  # no file yet
        owned = build_table(ME, [_config("g0@h1", ME, 1)], _local, 1e12, 0.0, 1.0)
        assert writer.write(owned) and not writer.write(owned)  # unchanged: not rewritten
        reader.admit(0, "g0")
        lapsed = FenceTable(0.0, owned.greens)
        writer.write(lapsed)
        with pytest.raises(EpochFenced):
            reader.admit(0, "g0")
        writer.write(build_table(ME, [_config("g0@h1", Peer("h2", "b"), 2)], _local, 1e12, 0, 1))
        with pytest.raises(NotOwner):
            reader.admit(0, "g0")
        writer.remove()
        reader.admit(0, "g0")
        assert FenceReader(None).table() is None


@given(
    made=st.lists(
        st.tuples(st.integers(0, 50), st.sampled_from(HOSTS), st.text(min_size=1, max_size=8)),
        max_size=20,
    )
)
def test_made_by_finds_what_it_recorded(made: list[tuple[int, str, str]]) -> None:
    table = MadeBy()
    model: dict[int, RequestId] = {}
    for version, origin, identity in made:
        request = submission_request(origin, identity)
        table.record("g@h1", version, request)
        model = {v: r for v, r in model.items() if r != request}
        model[version] = request
    for version, request in model.items():
        assert table.request_of("g@h1", version) == request
        assert table.version_of("g@h1", request.origin, request.client) == version
    assert table.version_of("other@h1", "h1", "x") is None


def test_a_chain_rebuilds_the_table_and_a_value_carries_its_identity() -> None:
    request = submission_request("h3", "vol-1-2/client/7")
    first, _ = version_value("h1", 0, b"", b"tree-0")
    second, _ = version_value("h1", 1, b"tree-0", b"tree-1", request)
    assert first.request.client == EXPORT_CLIENT and second.request == request
    again, _ = version_value("h1", 1, b"tree-0", b"tree-1", request)
    assert again == second  # a re-export makes the same value
    table = MadeBy()
    table.adopt_chain("g@h1", [first, second])
    assert table.version_of("g@h1", "h3", "vol-1-2/client/7") == 1
    assert table.request_of("g@h1", 0) is None  # the export identity answers no retry


def test_an_export_waits_for_a_run_that_may_be_making_its_version() -> None:
    order: list[str] = []

    async def main() -> None:
        table = MadeBy()
        table.started("g@h1")

        async def export() -> None:
            await table.quiet("g@h1")
            order.append(f"export sees {table.request_of('g@h1', 4)}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(export)
            await trio.sleep(0.01)
            order.append("run ended")
            table.ended("g@h1", (4, submission_request("h2", "id")))

    trio.run(main)
    assert order == ["run ended", f"export sees {submission_request('h2', 'id')}"]
