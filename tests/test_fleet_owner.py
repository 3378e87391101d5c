"""The owner alone: a hypothesis state machine, then scenarios with real holders.

The state machine plays every holder and client against one Owner: it
delivers placement acknowledgements, acceptances (right or wrong digest,
duplicated, from members, from a member's old boot id, from strangers),
fencing refusals, retries and ticks in any order; the model counts
distinct member acknowledgements and predicts exactly when the owner may
commit.  The scenarios (slates/fleet/scripted.py) run the owner with real
holders for failover, durability scopes, request identity, joint
reconfiguration and write-intent transfer.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from slates.errors import VerificationFailed
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.flight import REPLACE_AFTER, RETRY
from slates.fleet.holder import Holder
from slates.fleet.ledger import RequestId, Value, make_value
from slates.fleet.messages import (
    Accepted,
    Commit,
    Entry,
    Gather,
    Gathered,
    JointReady,
    Outgoing,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Refused,
    Submit,
    SubmitReply,
    TransferRequest,
)
from slates.fleet.node import Node
from slates.fleet.owner import WRITE_INTENT_THRESHOLD, Owner, State
from slates.fleet.recovery import adopt
from slates.fleet.scripted import G, Net, holder_set, peer
from slates.merge.ranges import Replace

MEMBERS = [peer("a"), peer("b"), peer("c")]
STRANGERS = [peer("a", 1), Peer("z", "z.boot0")]  # a's lost identity's successor; a non-member
ME = peer("o")


def first_config() -> GreenConfig:
    return GreenConfig(G, 1, 1, ME, holder_set(["a", "b", "c"]))


class OwnerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.owner = Owner(ME, G, 1 << 16)
        self.now = 0.0
        self.acks: dict[int, set[Peer]] = {}
        self.fenced = False
        self.seq = 0
        self.versions: dict[RequestId, int] = {}
        self.targets_seen: dict[int, int] = {}

    def run(self, out: list[Outgoing]) -> None:
        for item in out:
            message = item.message
            if isinstance(message, SubmitReply) and not message.error:
                assert self.owner.ledger[message.version - 1].request == message.request
                known = self.versions.setdefault(message.request, message.version)
                assert known == message.version
            if isinstance(message, (Place, Propose)):
                assert not self.fenced
                assert message.epoch == 1

    @initialize()
    def start(self) -> None:
        out = self.owner.install(first_config(), self.now)
        assert sorted(o.dest for o in out if isinstance(o.message, Prepare)) == ["a", "b", "c"]
        for member in MEMBERS[:2]:
            self.run(self.owner.receive(Promise(member, G, 1, (), 0), self.now))
        assert self.owner.state == State.SERVING

    @rule(retry=st.booleans(), scope=st.sampled_from(["restart", "host"]))
    def submit(self, retry: bool, scope: str) -> None:
        if not retry or self.seq == 0:
            self.seq += 1
        request = RequestId("o", "c", self.seq)
        submit = Submit(
            Peer("c", ""), G, request, 0, self.owner.head, (Replace(0, 0, b"x"),), scope, "o"
        )
        head = self.owner.head
        self.run(self.owner.receive(submit, self.now))
        assert self.owner.head == head  # submitting alone never commits

    @precondition(lambda self: self.owner.in_flight is not None)
    @rule(who=st.sampled_from(MEMBERS + STRANGERS))
    def place_ack(self, who: Peer) -> None:
        position, _, targets = self.owner.in_flight or (0, b"", ())
        out = self.owner.receive(PlaceAck(who, G, 1, position), self.now)
        self.run(out)
        proposes = [o for o in out if isinstance(o.message, Propose)]
        if not self.fenced and who in targets:
            assert [o.dest for o in proposes] == [who.host]
        else:
            assert proposes == []

    @precondition(lambda self: self.owner.in_flight is not None)
    @rule(who=st.sampled_from(MEMBERS + STRANGERS), right=st.booleans(), copies=st.integers(1, 3))
    def accept(self, who: Peer, right: bool, copies: int) -> None:
        position, digest, targets = self.owner.in_flight or (0, b"", ())
        sent = digest if right else bytes(32)
        for _ in range(copies):
            head = self.owner.head
            self.run(self.owner.receive(Accepted(who, G, 1, position, sent, 0), self.now))
            if right and who in MEMBERS and who in targets and not self.fenced:
                self.acks.setdefault(position, set()).add(who)
            if len(self.acks.get(position, ())) >= 2:
                assert self.owner.head == position  # committed at exactly f+1 distinct members
                assert self.owner.ledger[-1] is not None
            else:
                assert self.owner.head == head == position - 1

    @rule()
    def fence(self) -> None:
        flight = self.owner.in_flight
        position = flight[0] if flight else 0
        self.run(self.owner.receive(Refused(MEMBERS[0], G, 1, position, "EpochFenced", 2), 0))
        self.fenced = True
        assert self.owner.state == State.FENCED and self.owner.in_flight is None

    @rule(dt=st.sampled_from([0.5, RETRY, 3 * RETRY, -20.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        flight = self.owner.in_flight
        before = len(flight[2]) if flight else 0
        head = self.owner.head
        self.run(self.owner.tick(self.now))
        after = self.owner.in_flight
        if flight is not None and after is not None and after[0] == flight[0]:
            assert len(after[2]) >= before  # replacement only ever adds candidates
        assert self.owner.head == head  # time alone never commits

    @invariant()
    def one_position_per_request(self) -> None:
        requests = [value.request for value in self.owner.ledger]
        assert len(requests) == len(set(requests))
        assert [e[1] for e in self.owner.commits] == list(range(1, self.owner.head + 1))


TestOwnerMachine = OwnerMachine.TestCase
TestOwnerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- scenarios with real holders --


def three_host_net(owner: str = "a") -> tuple[Net, GreenConfig]:
    net = Net(["a", "b", "c", "d"])
    config = GreenConfig(G, 1, 1, peer(owner), holder_set(["a", "b", "c"]))
    net.install(config)
    net.pump()
    assert net.owner(owner).state == State.SERVING
    return net, config


def test_commit_needs_f_plus_one_distinct_hosts_and_a_duplicate_counts_once() -> None:
    net, _ = three_host_net("d")
    net.blocked = lambda dest, m: dest == "c" or (dest == "b" and isinstance(m, Propose))
    net.submit("d", 1, b"x")
    net.pump()
    owner = net.owner("d")
    position, digest, _ = owner.in_flight or (0, b"", ())
    for _ in range(3):  # a's acceptance, delivered again and again
        net.send(owner.receive(Accepted(peer("a"), G, 1, position, digest, 0), net.now))
    net.send(owner.receive(Accepted(peer("a", 1), G, 1, position, digest, 0), net.now))
    assert owner.head == 0  # one distinct member, however often; a's new boot claims nothing
    net.blocked = lambda dest, m: False
    net.tick(RETRY)
    net.pump()
    assert owner.head == 1
    assert net.replies["cl"][-1].version == 1


def test_a_lagging_holder_is_replaced_and_a_timeout_never_lowers_the_count() -> None:
    net, _ = three_host_net("d")
    net.blocked = lambda dest, m: dest == "b"  # b lags: it never answers
    net.submit("d", 1, b"x")
    net.pump()
    owner = net.owner("d")
    _, _, targets = owner.in_flight or (0, b"", ())
    assert {p.host for p in targets} == {"a", "b"}  # f+1 preferred candidates
    net.tick(RETRY)
    net.pump()
    assert owner.head == 0  # one acknowledgement is not a quorum after a timeout either
    for _ in range(REPLACE_AFTER):
        net.tick(RETRY)
        net.pump()
    assert owner.head == 1  # c replaced b
    assert {p.host for p in (owner.copies.accepts[1])} == {"a", "c"}


def test_failover_adopts_the_highest_epoch_reaccepts_it_and_keeps_saved_results() -> None:
    net, config = three_host_net("a")
    request = net.submit("a", 1, b"one ")
    net.pump()
    assert net.replies["cl"][-1].version == 1
    # Version 2 reaches only b before a stops.
    net.blocked = lambda dest, m: (
        (dest == "c" and isinstance(m, (Place, Propose))) or isinstance(m, Commit)
    )  # b accepts version 2 and never learns that a committed it
    net.submit("a", 2, b"two ")
    net.pump()
    del net.nodes["a"]  # the owner's host is gone
    net.blocked = lambda dest, m: dest == "a"
    successor = dataclass_replace(config, revision=2, epoch=2, owner=peer("b"))
    net.install(successor, ["b", "c", "d"])
    net.pump()
    net.tick(RETRY)
    net.pump()
    new = net.owner("b")
    assert new.state == State.SERVING and new.head == 2
    assert net.nodes["c"].holder.accepted(G)[2].epoch == 2  # re-accepted under epoch 2
    # A retry of the committed request, over another route, after failover: saved result.
    again = net.submit("b", 1, b"one ")
    net.pump()
    assert again == request
    assert [r.version for r in net.replies["cl"] if r.request == request] == [1, 1]
    assert net.nodes["b"].holder.serve(G, 2) == b"two one "


def test_an_old_owner_is_fenced_and_never_commits_after_failover() -> None:
    net, config = three_host_net("a")
    net.install(dataclass_replace(config, revision=2, epoch=2, owner=peer("b")), ["b", "c"])
    net.pump()
    old = net.owner("a")  # a never installed epoch 2: it still believes it owns epoch 1
    net.submit("a", 1, b"late")
    net.pump()
    net.tick(RETRY)
    net.pump()
    assert old.head == 0 and old.state == State.FENCED
    assert net.replies["cl"][-1].error == "NotOwner"


def test_acknowledged_sequences_release_results() -> None:
    net, _ = three_host_net("a")
    net.submit("a", 1, b"x")
    net.pump()
    net.submit("a", 2, b"y", acked=1)
    net.pump()
    net.submit("a", 1, b"x")  # a stale retry of an acknowledged request
    net.pump()
    assert net.replies["cl"][-1].error == "RequestExpired"
    other = net.submit("a", 1, b"z", client="other")  # same sequence, another client
    net.pump()
    assert net.replies["other"][-1].version == 3 and other.client == "other"


def test_host_scope_needs_f_plus_one_outside_the_owner_host() -> None:
    net, _ = three_host_net("a")
    net.blocked = lambda dest, m: dest == "b" and isinstance(m, Place)
    net.submit("a", 1, b"x", scope="host")
    for _ in range(REPLACE_AFTER + 1):
        net.pump()
        net.tick(RETRY)
    net.pump()
    owner = net.owner("a")
    assert owner.head == 1 and "host" not in owner.scopes(1)  # a (own host) + c
    assert not net.replies["cl"]  # a host-scope reply waits
    net.blocked = lambda dest, m: False
    net.tick(RETRY)
    net.pump()
    reply = net.replies["cl"][-1]
    assert reply.version == 1 and reply.scopes == ("restart", "host")


def test_region_scope_waits_for_the_mirror_prefix_and_unknown_lag_is_none() -> None:
    net = Net(["a", "b", "c", "m0"])
    config = GreenConfig(
        G, 1, 1, peer("a"), holder_set(["a", "b", "c"]), None, holder_set(["m0"], f=0)
    )
    net.blocked = lambda dest, m: dest == "m0" and not isinstance(m, Prepare)
    net.install(config)
    net.pump()
    net.submit("a", 1, b"x")
    net.pump()
    first = net.replies["cl"][-1]
    assert first.scopes[0] == "restart" and first.mirror_lag is None  # unknown, not 0
    net.submit("a", 2, b"y", scope="region")
    net.pump()
    assert len(net.replies["cl"]) == 1  # waiting for the mirror
    net.blocked = lambda dest, m: False
    for _ in range(4):
        net.tick(RETRY)
        net.pump()
    reply = net.replies["cl"][-1]
    assert reply.version == 2 and "region" in reply.scopes and reply.mirror_lag == 0
    assert net.nodes["m0"].holder.prefix(G) == 2


def test_joint_configuration_needs_both_quorums_then_retires() -> None:
    net = Net(["a", "b", "c", "d", "e"])
    config = GreenConfig(G, 1, 1, peer("a"), holder_set(["a", "b", "c"]))
    net.install(config)
    net.pump()
    net.submit("a", 1, b"x")
    net.pump()
    joint = dataclass_replace(
        config, revision=2, holders=holder_set(["a", "d", "e"]), old_holders=config.holders
    )
    net.blocked = lambda dest, m: dest in ("d", "e")
    net.install(joint, ["a", "b", "c"])
    net.pump()
    net.submit("a", 2, b"y")
    for _ in range(4):
        net.pump()
        net.tick(RETRY)
    owner = net.owner("a")
    assert owner.head == 1  # the old quorum answered; the new set has only a
    assert not any(isinstance(m, JointReady) for m in net.council)
    net.blocked = lambda dest, m: False
    for _ in range(6):
        net.tick(RETRY)
        net.pump()
    assert owner.head == 2
    assert net.nodes["d"].holder.prefix(G) == 2 or net.nodes["e"].holder.prefix(G) == 2
    assert any(isinstance(m, JointReady) and m.revision == 2 for m in net.council)


def test_write_intent_seals_transfers_and_only_then_serves_there() -> None:
    net, config = three_host_net("a")
    for seq in range(1, WRITE_INTENT_THRESHOLD + 1):
        net.submit("a", seq, b"w", route="b")
        net.pump()
    owner = net.owner("a")
    assert owner.head == WRITE_INTENT_THRESHOLD
    [request] = [m for m in net.council if isinstance(m, TransferRequest)][:1]
    assert (request.epoch, request.target) == (1, "b")
    net.submit("a", 9, b"z")
    net.pump()
    assert net.replies["cl"][-1].error == "NotOwner"  # sealed: redirected, not accepted
    net.install(dataclass_replace(config, revision=2, epoch=2, owner=peer("b")))
    net.pump()
    assert net.owner("b").state == State.SERVING and net.owner("b").head == 3
    net.submit("b", 9, b"z")
    net.pump()
    assert net.replies["cl"][-1].version == 4


def test_regression_joint_ready_waits_for_reaccepted_positions_seed_202() -> None:
    """Found by the simulator (seed 202): a successor in a joint configuration sent
    JointReady while its recovered positions were still being re-accepted (its head
    was 0, so every member "held the prefix"); the council retired the old set and
    an acknowledged version was left on one holder.  JointReady now waits for
    recovery to finish."""
    old = holder_set(["a", "b", "c"])
    config = GreenConfig(G, 1, 2, peer("d"), holder_set(["a", "b", "d"]), old)
    value, _, _ = make_value(RequestId("o", "c", 1), 0, 0, b"", [Replace(0, 0, b"x")])
    entries = (Entry(1, 1, value),)
    owner = Owner(peer("d"), G, 1 << 16)
    owner.install(config, 0.0)
    council: list[object] = []
    for member in (peer("a"), peer("b"), peer("d")):
        for out in owner.receive(Promise(member, G, 2, entries, 0), 0.0):
            council.append(out.message)
    for out in owner.receive(Gathered(peer("a"), G, value.edits[0].chunk, b"x"), 0.0):
        council.append(out.message)
    assert owner.state == State.SERVING and owner.head == 0 and not owner.recovered
    for out in owner.tick(RETRY):
        council.append(out.message)
    assert not any(isinstance(m, JointReady) for m in council)


def test_regression_recovery_gathers_from_every_holder_seed_60() -> None:
    """Found by the simulator (seed 60, a schedule that ended with its owner still
    recovering): the successor asked only its promisers for missing chunks, and the
    one promiser holding the chunk had a rotted copy; another holder had it intact.
    Gather now goes to every recorded holder, and a corrupted copy is dropped."""
    value, _, _ = make_value(RequestId("o", "c", 1), 0, 0, b"", [Replace(0, 0, b"x")])
    owner = Owner(peer("b"), G, 1 << 16)
    owner.install(GreenConfig(G, 1, 2, peer("b"), holder_set(["a", "b", "c"])), 0.0)
    out: list[Outgoing] = []
    for member in (peer("a"), peer("c")):
        out = owner.receive(Promise(member, G, 2, (Entry(1, 1, value),), 1), 0.0)
    gather = [o for o in out if isinstance(o.message, Gather)]
    assert sorted(o.dest for o in gather) == ["a", "b", "c"]  # not only the promisers
    chunk = value.edits[0].chunk
    assert owner.receive(Gathered(peer("a"), G, chunk, b"y"), 0.0) == []
    assert owner.state == State.RECOVERING and owner.alarms
    owner.receive(Gathered(peer("c"), G, chunk, b"x"), 0.0)
    assert owner.state.value == "serving" and owner.head == 1 and owner.recovered
    assert owner.head_content == b"x"


def dataclass_replace(config: GreenConfig, **changes: object) -> GreenConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def test_regression_an_owner_without_room_refuses_the_submission_seed_309() -> None:
    """Found by the simulator (seed 309, in a schedule where one host can hold only a
    few chunks): the owner's own store could not take a submission's new chunk and
    CapacityExhausted escaped from `receive`.  The owner now refuses that submission
    with CapacityExhausted, changes nothing, and keeps serving smaller ones."""
    net = Net(["a", "b", "c"])
    net.nodes["a"] = Node(peer("a"), 8)
    net.install(GreenConfig(G, 1, 1, peer("a"), holder_set(["a", "b", "c"])))
    net.pump()
    net.submit("a", 1, b"much too large")
    net.pump()
    assert net.replies["cl"][-1].error == "CapacityExhausted"
    assert net.owner("a").head == 0 and net.owner("a").in_flight is None
    net.submit("a", 2, b"tiny")
    net.pump()
    assert net.replies["cl"][-1].version == 1


def _value(seq: int, base: int, text: bytes) -> Value:
    value, _, _ = make_value(RequestId("o", "c", seq), 0, base, b"", [Replace(0, 0, text)])
    return value


def test_adopt_takes_the_highest_epoch_per_position_and_stops_at_a_gap() -> None:
    old, new = _value(1, 0, b"old"), _value(2, 0, b"new")
    later = _value(3, 1, b"later")
    beyond = _value(4, 3, b"beyond")  # position 4 with no position 3 anywhere
    promises = [
        Promise(peer("a"), G, 3, (Entry(1, 1, old), Entry(2, 1, later)), 0),
        Promise(peer("b"), G, 3, (Entry(1, 2, new), Entry(4, 2, beyond)), 0),
    ]
    chain, known = adopt(promises)
    assert [(e.position, e.epoch, e.value) for e in chain] == [(1, 2, new), (2, 1, later)]
    assert known == 0


def test_adopt_refuses_a_chain_whose_base_is_not_its_predecessor() -> None:
    promise = Promise(peer("a"), G, 2, (Entry(1, 1, _value(1, 5, b"x")),), 0)
    with pytest.raises(VerificationFailed):
        adopt([promise])


def test_an_idle_owner_redirects_to_the_configured_owner() -> None:
    net, _ = three_host_net("a")
    net.submit("b", 1, b"x")
    net.pump()
    reply = net.replies["cl"][-1]
    assert (reply.error, reply.redirect) == ("NotOwner", "a")


def test_one_holder_keeps_many_greens_apart() -> None:
    holder = Holder(peer("a"), 1 << 10)
    holder.install(GreenConfig("g1", 1, 3, peer("o"), holder_set(["a", "b", "c"])))
    [fenced] = holder.receive(Prepare(peer("o"), "g1", 2), 0.0)
    [promise] = holder.receive(Prepare(peer("o"), "g2", 2), 0.0)
    assert isinstance(fenced.message, Refused) and isinstance(promise.message, Promise)
    assert holder.promised("g1") == 3 and holder.promised("g2") == 2


def test_regression_joint_ready_waits_for_a_position_placed_before_the_joint_seed_30419() -> None:
    """Found by `make sim SEEDS=100000` (seeds 16739, 23538, 30419): version 1 was
    accepted by b and c (a quorum of the old set) but the owner only heard c; b then
    lost its RAM and was replaced.  With its head still 0 the owner sent JointReady
    at once, the old set was retired, and a successor whose promises came from the
    new set adopted another value at position 1.  JointReady now waits for every
    position placed before the joint configuration to commit under both quorums."""
    net = Net(["a", "b", "c", "d", "e"])
    config = GreenConfig(G, 1, 1, peer("a"), holder_set(["b", "c", "d"]))
    net.install(config)
    net.pump()
    net.blocked = lambda dest, m: (
        dest == "d" or (dest == "a" and isinstance(m, Accepted) and m.sender.host == "b")
    )
    net.submit("a", 1, b"x")
    net.pump()
    owner = net.owner("a")
    assert owner.head == 0 and 1 in net.nodes["b"].holder.accepted(G)
    joint = dataclass_replace(
        config, revision=2, holders=holder_set(["c", "d", "e"]), old_holders=config.holders
    )
    net.blocked = lambda dest, m: dest in ("b", "d")  # b is gone; d is unreachable for now
    net.install(joint, ["a", "c", "e"])
    for _ in range(4):
        net.pump()
        net.tick(RETRY)
    net.pump()
    assert owner.head == 0
    assert not any(isinstance(m, JointReady) for m in net.council)
    net.blocked = lambda dest, m: dest == "b"
    net.install(joint, ["d"])
    for _ in range(6):
        net.pump()
        net.tick(RETRY)
    assert owner.head == 1
    assert any(isinstance(m, JointReady) for m in net.council)
