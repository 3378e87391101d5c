"""The serf driver: member transitions against a model, and real agents on 127.0.0.1."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from slates.errors import CapacityExhausted, SlatesError, VerificationFailed
from slates.fleet.serf import (
    EventKind,
    Member,
    MemberEvent,
    MembershipWatch,
    MemberStatus,
    SerfAgent,
    member_transitions,
    parse_members,
)
from tests.fleet_services import free_port, serf_agents, serf_bind_port, start_serf

# -- pure: parsing and transitions

NAMES = ["n0", "n1", "n2"]
STATUSES: list[MemberStatus] = ["alive", "leaving", "left", "failed"]


def listing(*members: tuple[str, str, dict[str, str]]) -> bytes:
    return json.dumps(
        {
            "members": [
                {"name": n, "addr": f"127.0.0.1:{7946 + i}", "port": 7946 + i, "tags": t,
                 "status": s, "protocol": {"max": 5, "min": 2, "version": 5}}
                for i, (n, s, t) in enumerate(members)
            ]
        }
    ).encode()  # fmt: skip


def test_parse_members_reads_serfs_json() -> None:
    members = parse_members(listing(("n0", "alive", {"boot": "b", "a": "1"}), ("n1", "failed", {})))
    assert members == [
        Member("n0", "127.0.0.1:7946", "alive", (("a", "1"), ("boot", "b"))),
        Member("n1", "127.0.0.1:7947", "failed", ()),
    ]
    assert members[0].tag("boot") == "b"
    assert members[1].tag("boot") is None


@pytest.mark.parametrize(
    "output", [b"", b"[]", b'{"members": 3}', listing(("n0", "zombie", {})), b'{"members": [{}]}']
)
def test_unparsable_member_lists_are_verification_failures(output: bytes) -> None:
    with pytest.raises(VerificationFailed):
        parse_members(output)


def test_member_lists_are_bounded() -> None:
    with pytest.raises(CapacityExhausted):
        parse_members(listing(("a", "alive", {}), ("b", "alive", {})), max_members=1)


def test_a_member_listed_twice_is_refused() -> None:
    twice = [Member("n0", "a:1", "alive", ())] * 2
    with pytest.raises(VerificationFailed):
        member_transitions({}, twice)


class TransitionMachine(RuleBasedStateMachine):
    """A consumer applying the events must believe serf's current verdict after every poll.

    Belief per member: the last event's (kind, member).  After a poll, a
    listed failed or left member is believed so, an alive one alive with its
    current address and tags; a leaving one
    keeps its earlier belief; one gone from the list is believed left.
    No event repeats what the consumer already believes, and a second poll
    of the same list reports nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.listed: dict[str, Member] = {}
        self.known: dict[str, Member] = {}
        self.belief: dict[str, tuple[EventKind, Member]] = {}

    @rule(
        name=st.sampled_from(NAMES),
        status=st.sampled_from(STATUSES),
        boot=st.sampled_from(["b1", "b2"]),
        port=st.sampled_from([7946, 7947]),
    )
    def serf_reports(self, name: str, status: MemberStatus, boot: str, port: int) -> None:
        self.listed[name] = Member(name, f"10.0.0.1:{port}", status, (("boot", boot),))

    @rule(name=st.sampled_from(NAMES))
    def serf_reaps(self, name: str) -> None:
        self.listed.pop(name, None)

    @rule()
    def poll(self) -> None:
        before = dict(self.belief)
        self.known, events = member_transitions(self.known, list(self.listed.values()))
        for event in events:
            assert self.belief.get(event.member.name) != (event.kind, event.member), event
            self.belief[event.member.name] = (event.kind, event.member)
        for name, member in self.listed.items():
            if member.status == "leaving":
                assert self.belief.get(name) == before.get(name)
            elif member.status == "alive":  # alive as described now: address and tags
                assert self.belief[name] == ("alive", member)
            else:
                assert self.belief[name][0] == member.status
        for name in before.keys() - self.listed.keys():
            kind, member = self.belief[name]
            assert (kind, member.status) == ("left", "left")
        assert member_transitions(self.known, list(self.listed.values()))[1] == []


TestTransitions = TransitionMachine.TestCase
TestTransitions.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


@given(st.lists(st.sampled_from(STATUSES), min_size=1, max_size=6))
def test_a_first_poll_reports_every_settled_member_once(statuses: list[MemberStatus]) -> None:
    current = [Member(f"n{i}", f"h:{i}", s, ()) for i, s in enumerate(statuses)]
    settled = [m for m in current if m.status != "leaving"]
    reported, events = member_transitions({}, current)
    assert reported == {m.name: m for m in settled}
    assert [(e.kind, e.member) for e in events] == [(m.status, m) for m in settled]


def test_left_tombstones_are_dropped_past_the_bound() -> None:
    gone = Member("a", "h:1", "left", ())
    here = Member("b", "h:2", "alive", ())
    reported, events = member_transitions({"a": gone, "b": here}, [here], max_reported=1)
    assert (reported, events) == ({"b": here}, [])
    reported, events = member_transitions({"a": gone, "b": here}, [here], max_reported=2)
    assert (reported, events) == ({"a": gone, "b": here}, [])


# -- real agents


def wait_all_alive(agents: list[SerfAgent], names: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for agent in agents:
        while {m.name for m in agent.members() if m.status == "alive"} != names:
            if time.monotonic() > deadline:
                raise AssertionError(f"{agent.node_name} sees {agent.members()}")
            time.sleep(0.1)


def wait_for_event(
    watch: MembershipWatch, kind: EventKind, name: str, timeout: float = 45.0
) -> MemberEvent:
    deadline = time.monotonic() + timeout
    seen: list[MemberEvent] = []
    while time.monotonic() < deadline:
        for event in watch.poll():
            seen.append(event)
            if (event.kind, event.member.name) == (kind, name):
                return event
        time.sleep(0.2)
    raise AssertionError(f"no {kind} event for {name}; saw {seen}")


def test_a_killed_agent_is_reported_failed_and_its_restart_alive() -> None:
    with serf_agents(2) as agents:
        base = agents[0].data_dir.parent
        seed = f"127.0.0.1:{serf_bind_port(agents[0])}"
        third = start_serf(base, "n2", [], boot="boot-1")
        agents.append(third)
        third.join([seed])
        wait_all_alive(agents, {"n0", "n1", "n2"})
        watches = [MembershipWatch(agent.client) for agent in agents[:2]]
        for watch in watches:
            first = watch.poll()
            assert sorted((e.kind, e.member.name) for e in first) == [
                ("alive", "n0"),
                ("alive", "n1"),
                ("alive", "n2"),
            ]

        port = serf_bind_port(third)
        third.kill()  # SIGKILL by pid: a crash, no leave
        for watch in watches:
            failed = wait_for_event(watch, "failed", "n2")
            assert failed.member.tag("boot") == "boot-1"
            assert watch.known["n0"].status == "alive"  # only the dead one is reported

        # The host comes back without its RAM: same name and address, new boot id.
        restarted = start_serf(base, "n2", [seed], boot="boot-2", bind_port=port)
        agents.append(restarted)
        for watch in watches:
            alive = wait_for_event(watch, "alive", "n2")
            assert alive.member.tag("boot") == "boot-2"


def test_a_member_that_leaves_is_reported_left() -> None:
    with serf_agents(3) as agents:
        wait_all_alive(agents, {"n0", "n1", "n2"})
        watch = MembershipWatch(agents[0].client)
        assert len(watch.poll()) == 3
        agents[2].leave()
        assert agents[2].process.returncode is not None  # the agent exited after leaving
        left = wait_for_event(watch, "left", "n2")
        assert left.member.status == "left"
        assert watch.poll() == []


def test_an_agent_whose_join_fails_does_not_start() -> None:
    with tempfile.TemporaryDirectory(prefix="slates-serf-") as base:
        with pytest.raises(SlatesError) as raised:
            start_serf(Path(base), "lonely", [f"127.0.0.1:{free_port()}"], boot="b")
        assert "exited" in raised.value.message
