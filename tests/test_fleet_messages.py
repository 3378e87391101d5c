"""Fleet records: msgpack round trips, configuration validation, saved results."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import InvalidArgument, RequestExpired
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.ledger import EditRef, RequestId, Value
from slates.fleet.messages import (
    Accepted,
    Entry,
    Place,
    Promise,
    Propose,
    Refused,
    Submit,
    SubmitReply,
    decode,
    encode,
)
from slates.fleet.results import Results
from slates.merge.ranges import Replace

names = st.text(min_size=1, max_size=6)
peers = st.builds(Peer, names, names)
digests = st.binary(min_size=32, max_size=32)
requests = st.builds(RequestId, names, names, st.integers(0, 2**40))
values = st.builds(
    Value,
    requests,
    st.integers(0, 100),
    st.integers(0, 100),
    st.lists(
        st.builds(EditRef, st.integers(0, 9), st.integers(0, 9), digests, st.integers(0, 99))
    ).map(tuple),
    digests,
)
small = st.integers(0, 2**31)
messages = st.one_of(
    st.builds(
        Place,
        peers,
        names,
        small,
        small,
        st.lists(st.tuples(digests, small)).map(tuple),
    ),
    st.builds(Propose, peers, names, small, small, values, st.booleans()),
    st.builds(Accepted, peers, names, small, small, digests, small),
    st.builds(
        Promise,
        peers,
        names,
        small,
        st.lists(st.builds(Entry, small, small, values), max_size=3).map(tuple),
        small,
    ),
    st.builds(Refused, peers, names, small, small, names, small),
    st.builds(
        Submit,
        peers,
        names,
        requests,
        small,
        small,
        st.lists(st.builds(Replace, small, small, st.binary(max_size=8))).map(tuple),
        st.sampled_from(["restart", "host", "region"]),
        names,
    ),
    st.builds(
        SubmitReply,
        peers,
        names,
        requests,
        small,
        names,
        names,
        st.lists(names).map(tuple),
        st.none() | small,
    ),
)


@given(messages)
def test_every_message_survives_msgpack(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def test_garbage_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        decode(b"\xc1")
    with pytest.raises(InvalidArgument):
        decode(encode(Entry(1, 1, Value(RequestId("o", "c", 1), 0, 0, (), b""))))  # type: ignore[arg-type]


def _candidates(*pairs: tuple[str, str]) -> tuple[Candidate, ...]:
    return tuple(Candidate(Peer(h, "b"), d, "home") for h, d in pairs)


def test_holder_sets_need_two_f_plus_one_distinct_hosts_and_domains() -> None:
    with pytest.raises(InvalidArgument):
        HolderSet(1, _candidates(("a", "d1"), ("b", "d2")))
    with pytest.raises(InvalidArgument):
        HolderSet(1, _candidates(("a", "d1"), ("b", "d1"), ("c", "d3")))  # one failure domain
    with pytest.raises(InvalidArgument):
        HolderSet(1, _candidates(("a", "d1"), ("a", "d2"), ("c", "d3")))  # one host
    holders = HolderSet(1, _candidates(("a", "d1"), ("b", "d2"), ("c", "d3")))
    assert holders.quorum([Peer("a", "b"), Peer("c", "b")])
    assert not holders.quorum([Peer("a", "b"), Peer("a", "b"), Peer("a", "other-boot")])


def test_joint_configurations_need_both_quorums() -> None:
    old = HolderSet(1, _candidates(("a", "d1"), ("b", "d2"), ("c", "d3")))
    new = HolderSet(1, _candidates(("a", "d1"), ("d", "d4"), ("e", "d5")))
    joint = GreenConfig("g", 2, 1, Peer("a", "b"), new, old)
    assert not joint.write_quorum([Peer("b", "b"), Peer("c", "b")])
    assert not joint.write_quorum([Peer("d", "b"), Peer("e", "b")])
    assert joint.write_quorum([Peer("a", "b"), Peer("b", "b"), Peer("d", "b")])
    assert not joint.host_quorum([Peer("a", "b"), Peer("b", "b"), Peer("d", "b")])


def test_results_are_keyed_by_origin_client_and_sequence_and_released_by_acks() -> None:
    table = Results(limit=8)
    first = RequestId("h1", "c", 1)
    table.record(first, 0, 1)
    assert table.lookup(first) == 1
    assert table.lookup(RequestId("h2", "c", 1)) is None  # another origin, another request
    assert table.lookup(RequestId("h1", "d", 1)) is None  # another client
    table.record(RequestId("h1", "c", 2), 1, 2)  # the client acknowledged sequence 1
    with pytest.raises(RequestExpired):
        table.lookup(first)
    assert table.lookup(RequestId("h1", "c", 2)) == 2 and len(table) == 1
