"""The green/work ledger (slates.node.ledger) and the journal events (slates.node.events).

First a hypothesis state machine drives a Ledger with the events a shard
journals for one green volume (work volumes made, moved, held and dropped;
versions made and pruned) against a plain model: a work volume's role is
None, ("based", v) or ("held", base, v, snapshot), and only the moves the
model allows may succeed (the rest raise VerificationFailed and change
nothing).  Pruning never drops v0 or a version a live work volume is based
on, and a checkpoint of the ledger restores the same ledger.

Then every journal event type round-trips through its wire list and its
msgpack bytes; the wire lists keep the layout journals already hold; and
unknown tags, wrong field counts and wrong field types are refused.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.core.records import Kind
from slates.errors import VerificationFailed
from slates.merge.changes import Add, Change, Edit, Link, Meta, Move, Remove
from slates.merge.private import PrivatePolicy
from slates.merge.ranges import Replace
from slates.merge.submission import GreenPolicy
from slates.node import events
from slates.node.events import (
    EVENT_TYPES,
    ClientBound,
    ClientEnded,
    Event,
    GrantIssued,
    GrantUsed,
    GreenMade,
    OwnerSet,
    PlanRegistered,
    RecordApplied,
    RepliesAcked,
    ReplySaved,
    SnapshotDeleted,
    VersionLanded,
    VersionMade,
    VersionsPruned,
    VolumeCloned,
    VolumeDropped,
    VolumeMade,
    VolumeReset,
    WorkHeld,
    WorkMade,
    WorkRebased,
)
from slates.node.ledger import TRANSITIONS, Based, Held, Ledger, Role, step

GREEN = "vol-0-1"
WORKS = [f"vol-0-{n}" for n in range(2, 6)]
ModelRole = tuple[Any, ...] | None


def _as_model(role: Role | None) -> ModelRole:
    match role:
        case None:
            return None
        case Based():
            return ("based", role.version)
        case Held():
            return ("held", role.base, role.version, role.snapshot_id)
    raise AssertionError(role)


class LedgerMachine(RuleBasedStateMachine):
    """One green volume's ledger against a model of its roles and versions."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.keep = 5
        self.ledger.apply(GreenMade(GREEN, "snap-0-1", None, GreenPolicy(keep=self.keep)))
        self.roles: dict[str, ModelRole] = dict.fromkeys(WORKS)
        self.versions = 1  # v0
        self.pruned: set[int] = set()
        self.snapshots = 1

    def _live(self) -> list[int]:
        """Versions a work volume may be made on or moved to (the service checks)."""
        return [n for n in range(self.versions) if n not in self.pruned]

    def _snapshot(self) -> str:
        self.snapshots += 1
        return f"snap-0-{self.snapshots + 100}"

    def _expect(self, vid: str, event: WorkMade | WorkRebased | WorkHeld, after: ModelRole) -> None:
        """Apply `event`: it must succeed iff the model allows it (`after` not None)."""
        before = _as_model(self.ledger.works[vid].role) if vid in self.ledger.works else None
        if after is None:
            with pytest.raises(VerificationFailed):
                self.ledger.apply(event)
            now = _as_model(self.ledger.works[vid].role) if vid in self.ledger.works else None
            assert now == before  # a refused move changes nothing
            return
        self.ledger.apply(event)
        self.roles[vid] = after

    @rule(vid=st.sampled_from(WORKS), data=st.data())
    def make_work(self, vid: str, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(self._live()), label="version")
        start = (len(self.ledger.works) + 1) << 32
        after = ("based", version) if self.roles[vid] is None else None
        self._expect(vid, WorkMade(vid, GREEN, version, start, start + (1 << 32)), after)

    @rule(vid=st.sampled_from(WORKS), data=st.data())
    def rebase(self, vid: str, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(self._live()), label="version")
        after = ("based", version) if self.roles[vid] is not None else None
        self._expect(vid, WorkRebased(vid, version), after)

    @rule(vid=st.sampled_from(WORKS))
    def hold(self, vid: str) -> None:
        role, snapshot = self.roles[vid], self._snapshot()
        after = None
        if role is not None and role[0] == "based":
            after = ("held", role[1], self.versions - 1, snapshot)
        self._expect(vid, WorkHeld(vid, self.versions - 1, snapshot), after)

    @rule(vid=st.sampled_from(WORKS))
    def drop(self, vid: str) -> None:
        self.ledger.drop(vid)
        self.roles[vid] = None

    @rule(data=st.data())
    def make_version(self, data: st.DataObject) -> None:
        base = data.draw(st.integers(0, self.versions - 1), label="base")
        edit = Edit(2, "/f", (Replace(0, 1, b"x"),))
        event = VersionMade(GREEN, self._snapshot(), base, WORKS[0], (edit,), (edit,))
        self.ledger.apply(event)
        self.versions += 1

    @rule()
    def prune(self) -> None:
        bases = [role[1] for role in self.roles.values() if role is not None]
        limit = min([self.versions - self.keep, *bases])
        expected = [n for n in range(1, max(limit, 1)) if n not in self.pruned]
        numbers = self.ledger.prunable(GREEN, set())
        assert numbers == expected
        if not numbers:
            return
        held = [self.ledger.greens[GREEN][n].snapshot_id for n in numbers]
        assert self.ledger.apply(VersionsPruned(GREEN, tuple(numbers))) == tuple(held)
        self.pruned |= set(numbers)

    @invariant()
    def roles_match_the_model(self) -> None:
        actual = {vid: _as_model(work.role) for vid, work in self.ledger.works.items()}
        assert actual == {vid: role for vid, role in self.roles.items() if role is not None}
        for vid in WORKS:
            role = self.roles[vid]
            view = self.ledger.role_view(vid)
            assert view == (("volume", None, None) if role is None else ("work", GREEN, role[1]))
        assert self.ledger.works_of(GREEN) == sorted(v for v, r in self.roles.items() if r)

    @invariant()
    def versions_match_the_model(self) -> None:
        ledger = self.ledger.greens[GREEN]
        assert [v.number for v in ledger] == list(range(self.versions))
        assert {v.number for v in ledger if not v.snapshot_id} == self.pruned
        assert 0 not in self.pruned
        for role in self.roles.values():  # what a live work volume maps through stays
            assert role is None or role[1] not in self.pruned

    @invariant()
    def a_checkpoint_restores_the_same_ledger(self) -> None:
        wire = msgpack.unpackb(msgpack.packb(self.ledger.to_wire()), strict_map_key=False)
        restored = Ledger.from_wire(wire)
        assert restored.works == self.ledger.works
        assert restored.greens == self.ledger.greens
        assert restored.policies == self.ledger.policies


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_table_holds_exactly_the_moves_of_the_model() -> None:
    """Every (role, event) pair: `step` answers the model's move or raises."""
    roles: list[Role | None] = [None, Based(3), Held(3, 5, "snap-0-9")]
    moves: list[WorkMade | WorkRebased | WorkHeld] = [
        WorkMade("w", GREEN, 4, 1 << 32, 2 << 32),
        WorkRebased("w", 6),
        WorkHeld("w", 7, "snap-0-8"),
    ]
    allowed = {
        (None, "work"): Based(4),
        ("Based", "based"): Based(6),
        ("Held", "based"): Based(6),
        ("Based", "held"): Held(3, 7, "snap-0-8"),
    }
    for role in roles:
        for move in moves:
            key = (None if role is None else type(role).__name__, move.tag)
            if key in allowed:
                assert step(role, move) == allowed[key]
            else:
                with pytest.raises(VerificationFailed):
                    step(role, move)
    assert len(TRANSITIONS) == len(allowed)


# -- events ------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=8)
ids = st.from_regex(r"(vol|snap)-[0-9]-[0-9]{1,4}", fullmatch=True)
paths = st.lists(names.filter(lambda n: n not in (".", "..")), min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)
)
numbers = st.integers(0, 1 << 40)
changes: st.SearchStrategy[tuple[Change, ...]] = st.lists(
    st.one_of(
        st.builds(
            lambda ino, path, start, length, data, rewrite: Edit(
                ino, path, (Replace(start, start + length, data),), rewrite
            ),
            numbers,
            paths,
            numbers,
            st.integers(0, 64),
            st.binary(max_size=16),
            st.booleans(),
        ),
        st.builds(
            Meta,
            numbers,
            paths,
            st.none() | st.integers(0, 0o7777),
            st.lists(st.tuples(names, st.none() | st.binary(max_size=8)), max_size=2).map(tuple),
            st.none() | st.tuples(numbers, numbers),
        ),
        st.builds(
            Add,
            st.integers(-(1 << 20), -1),
            numbers,
            names.filter(lambda n: n not in (".", "..")),
            paths,
            st.sampled_from([Kind.FILE, Kind.DIR, Kind.SYMLINK]),
            st.integers(0, 0o7777),
            st.binary(max_size=16),
            st.lists(st.tuples(names, st.binary(max_size=8)), max_size=2).map(tuple),
        ),
        st.builds(Link, numbers, numbers, names.filter(lambda n: n not in (".", "..")), paths),
        st.builds(
            Move,
            numbers,
            numbers,
            names.filter(lambda n: n not in (".", "..")),
            paths,
            numbers,
            names.filter(lambda n: n not in (".", "..")),
            paths,
        ),
        st.builds(
            Remove,
            numbers,
            numbers,
            names.filter(lambda n: n not in (".", "..")),
            paths,
            st.sampled_from([Kind.FILE, Kind.DIR]),
            st.booleans(),
        ),
    ),
    max_size=4,
).map(tuple)
policies = st.builds(
    GreenPolicy,
    st.builds(
        PrivatePolicy,
        st.lists(st.sampled_from(["*.o", "build/", "/out", "secret.txt"]), max_size=3).map(tuple),
        st.booleans(),
    ),
    st.sampled_from(["refine", "exact"]),
    st.integers(1, 1000),
)
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 60), 1 << 60) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
STRATEGIES: dict[type[Event], st.SearchStrategy[Any]] = {
    VolumeMade: st.builds(
        VolumeMade,
        ids,
        names,
        st.none() | paths,
        st.booleans(),
        numbers,
        st.booleans(),
        st.integers(0, 0o7777),
        numbers,
        numbers,
        numbers,
        st.just(()) | st.tuples(numbers, numbers),
    ),
    RecordApplied: st.builds(RecordApplied, ids, st.binary(max_size=32)),
    VolumeCloned: st.builds(VolumeCloned, ids, names, ids, st.booleans(), numbers),
    VolumeDropped: st.builds(VolumeDropped, ids),
    VolumeReset: st.builds(VolumeReset, ids, ids, st.lists(numbers, max_size=4).map(tuple)),
    SnapshotDeleted: st.builds(SnapshotDeleted, ids),
    ReplySaved: st.builds(
        ReplySaved, names, numbers, st.dictionaries(st.text(max_size=6), wire_values, max_size=4)
    ),
    RepliesAcked: st.builds(RepliesAcked, names, numbers),
    ClientEnded: st.builds(ClientEnded, names),
    ClientBound: st.builds(ClientBound, names, st.text(max_size=8)),
    OwnerSet: st.builds(OwnerSet, ids, names),
    GreenMade: st.builds(GreenMade, ids, ids, st.none() | paths, policies),
    WorkMade: st.builds(WorkMade, ids, ids, numbers, numbers, numbers),
    VersionMade: st.builds(VersionMade, ids, ids, st.integers(-1, 1 << 20), ids, changes, changes),
    WorkRebased: st.builds(WorkRebased, ids, numbers),
    WorkHeld: st.builds(WorkHeld, ids, numbers, ids),
    VersionLanded: st.builds(VersionLanded, ids, numbers),
    VersionsPruned: st.builds(VersionsPruned, ids, st.lists(numbers, max_size=5).map(tuple)),
    PlanRegistered: st.builds(
        PlanRegistered,
        st.lists(wire_values, max_size=4),
        st.none() | st.dictionaries(st.text(max_size=8), st.binary(max_size=8), max_size=3),
    ),
    GrantIssued: st.builds(GrantIssued, st.text(max_size=16), st.text(max_size=16)),
    GrantUsed: st.builds(GrantUsed, st.text(max_size=16)),
}


def test_every_event_type_has_a_strategy_and_its_own_tag() -> None:
    assert set(STRATEGIES) == set(EVENT_TYPES)
    assert len({cls.tag for cls in EVENT_TYPES}) == len(EVENT_TYPES)


@settings(max_examples=400, deadline=None)
@given(st.one_of(*STRATEGIES.values()))
def test_every_event_round_trips_through_its_wire_form_and_msgpack(event: Event) -> None:
    wire = events.to_wire(event)
    assert wire[0] == event.tag
    assert events.from_wire(wire) == event
    assert events.decode(events.encode(event)) == event
    # The journal frame holds the wire lists: packed with the frame, they come back the same.
    assert events.from_wire(msgpack.unpackb(msgpack.packb(wire), strict_map_key=False)) == event


@given(STRATEGIES[VolumeMade], STRATEGIES[VersionMade], STRATEGIES[PlanRegistered])
def test_the_wire_lists_keep_the_layout_journals_hold(
    made: VolumeMade, version: VersionMade, plan: PlanRegistered
) -> None:
    """Frames written before the events were typed replay the same."""
    assert events.to_wire(made) == [
        "new",
        made.vid,
        made.name,
        made.base_key,
        made.bounded,
        made.limit,
        made.case_insensitive,
        made.mode,
        made.uid,
        made.gid,
        made.time_ns,
        list(made.base_identity),  # added since: the base directory's (dev, ino)
    ]
    wire = events.to_wire(version)
    assert wire[:5] == ["version", version.green, version.snapshot_id, version.base, version.work]
    assert events.from_wire(wire).increment == version.increment  # type: ignore[attr-defined]
    plain = ["plan", plan.manifest]
    held = ["plan", {"manifest": plan.manifest, "held": plan.held}]
    assert events.to_wire(plan) == (plain if plan.held is None else held)


@given(st.one_of(*STRATEGIES.values()), st.data())
def test_malformed_events_are_refused(event: Event, data: st.DataObject) -> None:
    wire = events.to_wire(event)
    with pytest.raises(VerificationFailed):
        events.from_wire([*wire, "extra"])
    if len(wire) > 2 and not isinstance(event, PlanRegistered):
        with pytest.raises(VerificationFailed):
            events.from_wire(wire[:-1])
    at = data.draw(st.integers(1, len(wire) - 1), label="field")
    if not isinstance(event, PlanRegistered):  # a plan's content is the desk's to check
        wrong = object() if isinstance(wire[at], (list, dict)) else [wire[at]]
        with pytest.raises(VerificationFailed):
            events.from_wire([*wire[:at], wrong, *wire[at + 1 :]])


@pytest.mark.parametrize(
    "raw",
    [["nope", "vol-0-1"], [], "drop", [7, "vol-0-1"], ["drop", 5], ["drop", True]],
)
def test_unknown_or_malformed_events_raise(raw: Any) -> None:
    with pytest.raises(VerificationFailed):
        events.from_wire(raw)
    with pytest.raises(VerificationFailed):
        events.decode(msgpack.packb(raw))
    with pytest.raises(VerificationFailed):
        events.decode(b"\xc1")  # not msgpack
