"""The etcd council driver against real etcd 3.4 processes on 127.0.0.1."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    Unavailable,
    VerificationFailed,
)
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.etcd import (
    Council,
    HostRecord,
    check_successor,
    decode_green,
    decode_host,
    encode_green,
    encode_host,
)
from tests.fleet_services import EtcdCluster, etcd_cluster, free_port

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture
def council(etcd: EtcdCluster) -> Iterator[Council]:
    with Council(etcd.endpoints, prefix=f"/test/{next(_prefixes)}/") as c:
        yield c


def holders(hosts: tuple[str, ...] = ("h1", "h2", "h3"), boot: str = "b1") -> HolderSet:
    f = (len(hosts) - 1) // 2
    return HolderSet(f, tuple(Candidate(Peer(h, boot), f"d-{h}", "r1") for h in hosts))


def config(name: str, epoch: int = 1, owner: str = "h1", boot: str = "b1") -> GreenConfig:
    return GreenConfig(name, 1, epoch, Peer(owner, boot), holders())


def host_record(host: str, boot: str = "b1") -> HostRecord:
    return HostRecord(host, f"sha256:{host}", f"d-{host}", boot, f"{host}:4433", f"{host}:7946")


# -- pure encodings and rules


names = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=8)


@st.composite
def holder_sets(draw: st.DrawFn) -> HolderSet:
    f = draw(st.integers(0, 2))
    hosts = draw(st.lists(names, min_size=2 * f + 1, max_size=2 * f + 1, unique=True))
    domains = draw(st.lists(names, min_size=2 * f + 1, max_size=2 * f + 1, unique=True))
    return HolderSet(
        f,
        tuple(
            Candidate(Peer(h, draw(names)), d, draw(names))
            for h, d in zip(hosts, domains, strict=True)
        ),
    )


@st.composite
def green_configs(draw: st.DrawFn) -> GreenConfig:
    home = draw(holder_sets())
    old = draw(st.none() | holder_sets())
    mirror = draw(st.none() | holder_sets())
    home_hosts = {c.peer.host for s in (home, old) if s is not None for c in s.candidates}
    if mirror is not None and home_hosts & {c.peer.host for c in mirror.candidates}:
        mirror = None  # a mirror lives outside the home sets
    return GreenConfig(
        draw(names),
        draw(st.integers(1, 2**40)),
        draw(st.integers(1, 2**40)),
        Peer(draw(names), draw(names)),
        home,
        old,
        mirror,
    )


@given(green_configs())
def test_green_encoding_round_trips_with_the_store_revision(green: GreenConfig) -> None:
    assert decode_green(encode_green(green), 77) == dataclasses.replace(green, revision=77)


@given(st.builds(HostRecord, names, names, names, names, names, names))
def test_host_encoding_round_trips(record: HostRecord) -> None:
    assert decode_host(encode_host(record)) == record


@given(st.binary(max_size=64))
def test_undecodable_bytes_are_verification_failures(data: bytes) -> None:
    with pytest.raises(VerificationFailed):
        decode_green(data, 1)
    with pytest.raises(VerificationFailed):
        decode_host(data)


@given(st.integers(1, 5), st.integers(-2, 3), st.booleans())
def test_successor_rule(epoch: int, step: int, new_owner: bool) -> None:
    assume(epoch + step >= 1)
    current = config("g", epoch=epoch)
    new = config("g", epoch=epoch + step, owner="h2" if new_owner else "h1")
    allowed = step == 1 or (step == 0 and not new_owner)
    if allowed:
        check_successor(current, new)
    else:
        with pytest.raises(InvalidArgument):
            check_successor(current, new)


def test_a_configuration_keeps_its_green() -> None:
    with pytest.raises(InvalidArgument):
        check_successor(config("g"), config("other", epoch=2))


# -- against etcd


def test_enroll_and_read_hosts(council: Council) -> None:
    records = [host_record(h) for h in ("c", "a", "b")]
    for record in records:
        council.enroll_host(record)
    assert council.hosts() == sorted(records, key=lambda r: r.host)
    assert council.host("b") == host_record("b")
    assert council.host("missing") is None
    council.enroll_host(host_record("b", boot="b2"))  # the host restarted without its RAM
    assert council.host("b") == host_record("b", boot="b2")
    assert len(council.hosts()) == 3
    with pytest.raises(InvalidArgument):
        council.host("a/b")


def test_create_green_only_once(council: Council) -> None:
    assert council.green("g") is None
    assert council.create_green(config("g", owner="h1"))
    assert not council.create_green(config("g", owner="h2", epoch=5))
    stored = council.green("g")
    assert stored is not None
    assert (stored.owner, stored.epoch) == (Peer("h1", "b1"), 1)
    assert [g.green for g in council.greens()] == ["g"]


def test_commit_config_compares_the_epoch(council: Council) -> None:
    council.create_green(config("g"))
    first = council.green("g")
    assert first is not None
    assert council.commit_config(config("g", epoch=2, owner="h2"), expected_epoch=1)
    second = council.green("g")
    assert second is not None
    assert (second.owner.host, second.epoch) == ("h2", 2)
    assert second.revision > first.revision
    # A candidate that still believes epoch 1 changes nothing.
    assert not council.commit_config(config("g", epoch=2, owner="h3"), expected_epoch=1)
    assert council.green("g") == second
    # Rules checked before the transaction: a new owner needs e+1, no skipping.
    with pytest.raises(InvalidArgument):
        council.commit_config(config("g", epoch=2, owner="h3"), expected_epoch=2)
    with pytest.raises(InvalidArgument):
        council.commit_config(config("g", epoch=4, owner="h3"), expected_epoch=2)
    with pytest.raises(NotFound):
        council.commit_config(config("nope", epoch=2), expected_epoch=1)
    assert council.green("g") == second


def test_commit_config_can_require_an_alive_key_unchanged(council: Council) -> None:
    council.create_green(config("g", owner="h1"))
    assert council.alive_revision("h1") == (None, 0)  # the owner's lease lapsed
    # The old owner puts its alive key back under a new lease before the successor's commit.
    council.mark_alive("h1", "b1", council.grant_lease(60))
    boot, revision = council.alive_revision("h1")
    assert boot == "b1" and revision > 0
    assert not council.commit_config(config("g", epoch=2, owner="h2"), 1, ("h1", 0))
    stored = council.green("g")
    assert stored is not None and stored.epoch == 1
    assert council.commit_config(config("g", epoch=2, owner="h2"), 1, ("h1", revision))


def _campaign(
    endpoints: list[str],
    prefix: str,
    host: str,
    epoch: int,
    barrier: threading.Barrier,
    won: dict[str, bool],
) -> None:
    with Council(endpoints, prefix=prefix) as own:
        barrier.wait()
        won[host] = own.commit_config(
            config("g", epoch=epoch + 1, owner=host), expected_epoch=epoch
        )


def test_racing_candidates_exactly_one_wins(council: Council, etcd: EtcdCluster) -> None:
    council.create_green(config("g"))
    candidates = ["h1", "h2", "h3"]
    for epoch in range(1, 9):
        barrier = threading.Barrier(len(candidates))
        won: dict[str, bool] = {}
        threads = [
            threading.Thread(
                target=_campaign,
                args=(etcd.endpoints, council.prefix.decode(), h, epoch, barrier, won),
            )
            for h in candidates
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [h for h, ok in won.items() if ok]
        assert len(winners) == 1, won
        stored = council.green("g")
        assert stored is not None
        assert (stored.owner.host, stored.epoch) == (winners[0], epoch + 1)


def test_the_transaction_refuses_a_configuration_changed_after_the_read(
    council: Council, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    council.create_green(config("g"))
    read_before = council._get(council.prefix + b"greens/g")
    assert council.commit_config(config("g", epoch=2, owner="h2"), expected_epoch=1)
    with Council(etcd.endpoints, prefix=council.prefix.decode()) as late:
        # The late candidate read epoch 1 just before the winner committed.
        monkeypatch.setattr(late, "_get", lambda key: read_before)
        assert not late.commit_config(config("g", epoch=2, owner="h3"), expected_epoch=1)
    stored = council.green("g")
    assert stored is not None
    assert (stored.owner.host, stored.epoch) == ("h2", 2)


def test_changes_since_reports_only_later_commits(council: Council) -> None:
    council.create_green(config("a"))
    council.create_green(config("b"))
    everything = council.changes_since(0)
    assert sorted(g.green for g in everything.greens) == ["a", "b"]
    assert council.changes_since(everything.revision).greens == ()
    council.commit_config(config("b", epoch=2, owner="h2"), expected_epoch=1)
    later = council.changes_since(everything.revision)
    assert [(g.green, g.epoch) for g in later.greens] == [("b", 2)]
    assert later.revision > everything.revision
    assert council.changes_since(later.revision).greens == ()


def test_a_corrupt_stored_value_is_a_verification_failure(
    council: Council, etcd: EtcdCluster
) -> None:
    key = base64.b64encode(council.prefix + b"greens/bad").decode()
    value = base64.b64encode(b"not msgpack \xc1").decode()
    httpx.post(etcd.endpoints[0] + "/v3/kv/put", json={"key": key, "value": value}, timeout=5)
    with pytest.raises(VerificationFailed):
        council.green("bad")


def test_lease_expiry_removes_the_alive_key(council: Council) -> None:
    lease = council.grant_lease(2)
    council.mark_alive("h1", "b1", lease)
    assert council.alive_hosts() == {"h1": "b1"}
    assert council.keepalive(lease) >= 1
    deadline = time.monotonic() + 20
    while "h1" in council.alive_hosts():
        if time.monotonic() > deadline:
            raise AssertionError("the alive key outlived its lease")
        time.sleep(0.1)
    with pytest.raises(NotFound):
        council.keepalive(lease)
    with pytest.raises(NotFound):
        council.mark_alive("h1", "b1", lease)


def test_revoking_a_lease_removes_the_alive_key(council: Council) -> None:
    lease = council.grant_lease(60)
    council.mark_alive("h2", "b7", lease)
    assert council.alive_hosts() == {"h2": "b7"}
    council.revoke_lease(lease)
    assert council.alive_hosts() == {}


def test_no_endpoint_answering_is_a_bounded_error() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with Council(dead, rounds=3, backoff=0.01) as c, pytest.raises(Unavailable) as raised:
        c.hosts()
    assert raised.value.details["attempts"] == 6


def test_listings_are_bounded(etcd: EtcdCluster) -> None:
    with Council(etcd.endpoints, prefix=f"/test/{next(_prefixes)}/", max_records=2) as small:
        small.enroll_host(host_record("a"))
        small.enroll_host(host_record("b"))
        assert len(small.hosts()) == 2
        small.enroll_host(host_record("c"))
        with pytest.raises(CapacityExhausted):
            small.hosts()


def _timing_out_first(calls: list[str]) -> httpx.MockTransport:
    """The first endpoint times out after the request was sent; the second answers."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.url.host}:{request.url.port}")
        if request.url.port == 1:
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, json={"header": {"revision": "9"}, "succeeded": True})

    return httpx.MockTransport(handle)


def test_reads_move_on_after_a_timeout_but_transactions_do_not() -> None:
    calls: list[str] = []
    with Council(["http://127.0.0.1:1", "http://127.0.0.1:2"]) as c:
        c._gateway.client.close()
        c._gateway.client = httpx.Client(transport=_timing_out_first(calls))
        assert c.host("h1") is None
        assert calls == ["127.0.0.1:1", "127.0.0.1:2"]
        c._gateway.preferred = 0
        calls.clear()
        with pytest.raises(Unavailable) as raised:
            c.create_green(config("g"))
        assert raised.value.details["outcome"] == "unknown"
        assert calls == ["127.0.0.1:1"]  # a transaction that may have committed is not replayed


def test_failover_to_another_member_after_one_is_killed() -> None:
    with etcd_cluster(3) as cluster, Council(cluster.endpoints) as council:
        assert council.create_green(config("g"))
        council.enroll_host(host_record("h1"))
        cluster.kill(0)  # the endpoint the council prefers; perhaps the leader
        assert council.host("h1") == host_record("h1")
        assert council.commit_config(config("g", epoch=2, owner="h2"), expected_epoch=1)
        stored = council.green("g")
        assert stored is not None
        assert (stored.owner.host, stored.epoch) == ("h2", 2)
        assert not council.create_green(config("g"))


# -- a state machine against a model of the council's greens


class GreenCouncilMachine(RuleBasedStateMachine):
    endpoints: tuple[str, ...] = ()  # set by the test to the running etcd

    def __init__(self) -> None:
        super().__init__()
        self.council = Council(self.endpoints, prefix=f"/machine/{next(_prefixes)}/")
        self.model: dict[str, tuple[int, str]] = {}  # green -> (epoch, owner host)

    @rule(name=st.sampled_from(["g1", "g2"]), owner=st.sampled_from(["h1", "h2", "h3"]))
    def create(self, name: str, owner: str) -> None:
        created = self.council.create_green(config(name, owner=owner))
        assert created == (name not in self.model)
        if created:
            self.model[name] = (1, owner)

    @precondition(lambda self: bool(self.model))
    @rule(
        data=st.data(),
        stale=st.integers(0, 2),
        step=st.integers(0, 1),
        owner=st.sampled_from(["h1", "h2", "h3"]),
    )
    def commit(self, data: st.DataObject, stale: int, step: int, owner: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        epoch, current_owner = self.model[name]
        believed = max(1, epoch - stale)
        new = config(name, epoch=believed + step, owner=owner)
        if believed != epoch:
            assert not self.council.commit_config(new, expected_epoch=believed)
        elif step == 0 and owner != current_owner:
            with pytest.raises(InvalidArgument):
                self.council.commit_config(new, expected_epoch=believed)
        else:
            before = self.council.green(name)
            assert self.council.commit_config(new, expected_epoch=believed)
            after = self.council.green(name)
            assert before is not None and after is not None
            assert after.revision > before.revision
            self.model[name] = (believed + step, owner)

    @invariant()
    def matches_the_model(self) -> None:
        stored = {g.green: g for g in self.council.greens()}
        assert {n: (g.epoch, g.owner.host) for n, g in stored.items()} == self.model
        revisions = [g.revision for g in stored.values()]
        assert all(r >= 1 for r in revisions)

    def teardown(self) -> None:
        self.council.close()


def test_council_state_machine(etcd: EtcdCluster) -> None:
    class Machine(GreenCouncilMachine):
        endpoints = tuple(etcd.endpoints)

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=15, stateful_step_count=15, deadline=None),
    )
