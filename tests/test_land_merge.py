"""Merging a developer's outside edit into a landing's proposal, and why entries conflict.

Pure tests of slates.land.merge (`rewitness --merge`, issue 11 item 7) and of
slates.land.manifest.explain.  The oracle for a merge is `git merge-file`: an
outside edit and the agents' change on separate lines merge to what git makes
of them (the developer's line kept, the agents' change applied); edits of the
same bytes stay conflicts and say where.  `explain` gives `decide`'s decision
for every combination of states and a reason for every conflict.
"""

from __future__ import annotations

from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.errors import CapacityExhausted, VerificationFailed
from slates.land.manifest import Decision, Entry, Manifest, State, decide, explain
from slates.land.merge import Merged, Unmerged, merge_entry, needs_merge
from slates.merge.ranges import apply, compose
from slates.node.landing import LandingDesk
from tests.merge_helpers import git_merge
from tests.test_land_manifest import _states
from tests.test_merge_ranges import draw_line_edits


def file_state(data: bytes, mode: int = 0o644) -> State:
    return State("file", blake3.blake3(data).hexdigest(), mode)


def merge(
    witness: bytes,
    disk: bytes,
    proposal: bytes,
    modes: tuple[int, int, int] = (0o644, 0o644, 0o644),
) -> Merged | Unmerged:
    entry = Entry("settings.conf", file_state(witness, modes[0]), file_state(proposal, modes[2]))
    return merge_entry(entry, file_state(disk, modes[1]), witness, disk, proposal)


BASE = b"quality=80\ncache=off\nsize=10\n"


def test_an_outside_edit_on_another_line_is_kept_and_the_proposal_merged_in() -> None:
    disk = b"quality=80\ncache=off\nsize=12\n"  # the developer's line
    proposal = b"quality=90\ncache=off\nsize=10\n"  # the agents' change
    result = merge(BASE, disk, proposal)
    assert isinstance(result, Merged)
    assert result.content == b"quality=90\ncache=off\nsize=12\n"
    assert result.content == git_merge(BASE, disk, proposal)
    assert result.disk == disk
    assert result.entry.witnessed == file_state(disk)  # the disk now is the new witness
    assert result.entry.proposed == file_state(result.content)


def test_an_overlapping_outside_edit_is_not_merged_and_says_where() -> None:
    disk = b"quality=60\ncache=off\nsize=10\n"
    proposal = b"quality=90\ncache=off\nsize=10\n"
    result = merge(BASE, disk, proposal)
    assert isinstance(result, Unmerged)
    assert "overlaps the proposal" in result.reason and "line 1 " in result.reason
    assert git_merge(BASE, disk, proposal) is None  # git agrees: a conflict


def test_the_same_change_on_both_sides_merges_to_it() -> None:
    both = b"quality=90\ncache=off\nsize=12\n"
    result = merge(BASE, both, b"quality=90\ncache=off\nsize=10\n")
    assert isinstance(result, Merged) and result.content == both


def test_modes_merge_three_ways() -> None:
    disk = b"quality=80\ncache=off\nsize=12\n"
    proposal = b"quality=90\ncache=off\nsize=10\n"
    agents_chmod = merge(BASE, disk, proposal, (0o644, 0o644, 0o755))
    assert isinstance(agents_chmod, Merged) and agents_chmod.entry.proposed is not None
    assert agents_chmod.entry.proposed.mode == 0o755
    developers_chmod = merge(BASE, disk, proposal, (0o644, 0o600, 0o644))
    assert isinstance(developers_chmod, Merged) and developers_chmod.entry.proposed is not None
    assert developers_chmod.entry.proposed.mode == 0o600
    both = merge(BASE, disk, proposal, (0o644, 0o600, 0o755))
    assert isinstance(both, Unmerged) and "both changed the mode" in both.reason


def test_what_is_not_a_file_on_all_sides_or_not_held_is_not_merged() -> None:
    proposal = b"quality=90\ncache=off\nsize=10\n"
    entry = Entry("settings.conf", file_state(BASE), file_state(proposal))
    disk = b"quality=80\ncache=off\nsize=12\n"
    as_dir = merge_entry(entry, State("dir", None, 0o755), BASE, None, proposal)
    assert isinstance(as_dir, Unmerged)
    assert "the disk is a directory, the witness a file and the proposal a file" in as_dir.reason
    vanished = merge_entry(entry, None, BASE, None, proposal)
    assert isinstance(vanished, Unmerged) and "vanished" in vanished.reason
    deleting = Entry("settings.conf", file_state(BASE), None)
    deleted = merge_entry(deleting, file_state(disk), BASE, disk, None)
    assert isinstance(deleted, Unmerged) and "the proposal deletes it" in deleted.reason
    creating = Entry("settings.conf", None, file_state(proposal))
    both_made = merge_entry(creating, file_state(disk), None, disk, proposal)
    assert isinstance(both_made, Unmerged) and "nothing was witnessed" in both_made.reason
    assert "not a regular file on all sides" in as_dir.reason
    lost = merge_entry(entry, file_state(disk), None, disk, proposal)
    assert isinstance(lost, Unmerged) and "witnessed content is no longer held" in lost.reason
    wrong = merge_entry(entry, file_state(disk), b"other\n", disk, proposal)
    assert isinstance(wrong, Unmerged) and "no longer held" in wrong.reason
    moved = merge_entry(entry, file_state(disk), BASE, disk + b"more\n", proposal)
    assert isinstance(moved, Unmerged) and "changed again while it was being read" in moved.reason
    binary = b"\0\1\2" + BASE
    raw = merge(binary, binary + b"x", b"y" + binary)
    assert isinstance(raw, Unmerged) and "binary" in raw.reason
    big = merge_entry(entry, file_state(disk), BASE, disk, proposal, limit=8)
    assert isinstance(big, Unmerged) and "too large to refine" in big.reason


def test_only_an_entry_that_would_conflict_needs_a_merge() -> None:
    entry = Entry("a", file_state(b"1\n"), file_state(b"2\n"))
    assert not needs_merge(entry, file_state(b"1\n"))  # untouched: it applies
    assert not needs_merge(entry, file_state(b"2\n"))  # already the proposal
    assert needs_merge(entry, file_state(b"3\n"))
    assert needs_merge(entry, None)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_disjoint_line_edits_merge_like_git_merge_file(data: st.DataObject) -> None:
    base, edits = draw_line_edits(data, max_lines=30)
    outside = compose(len(base), reversed(edits[1::2]))  # the developer's lines
    agents = compose(len(base), reversed(edits[0::2]))
    disk, proposal = apply(base, outside), apply(base, agents)
    expected = git_merge(base, disk, proposal)
    result = merge(base, disk, proposal)
    if disk == base or proposal == base:
        assert isinstance(result, Merged) and result.content == (proposal if disk == base else disk)
        return
    assume(expected is not None)  # hypothesis fails the test if git rarely merges cleanly
    assert isinstance(result, Merged), result
    assert result.content == expected
    assert result.entry.witnessed == file_state(disk)
    assert result.entry.proposed == file_state(expected)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_edits_of_the_same_line_stay_conflicts(data: st.DataObject) -> None:
    lines = [f"key{i}=value{i}\n".encode() for i in range(data.draw(st.integers(1, 12)))]
    base = b"".join(lines)
    at = data.draw(st.integers(0, len(lines) - 1))
    ours, theirs = data.draw(
        st.lists(st.sampled_from([b"60", b"90", b"75", b"x"]), min_size=2, max_size=2, unique=True)
    )

    def edited(value: bytes) -> bytes:
        return b"".join(
            (f"key{i}=".encode() + value + b"\n") if i == at else line
            for i, line in enumerate(lines)
        )

    result = merge(base, edited(ours), edited(theirs))
    assert isinstance(result, Unmerged)
    assert f"line {at + 1} " in result.reason
    assert git_merge(base, edited(ours), edited(theirs)) is None


@settings(max_examples=300, deadline=None)
@given(_states, _states, _states)
def test_explain_decides_like_decide_and_every_conflict_has_a_reason(
    witnessed: State | None, disk: State | None, proposed: State | None
) -> None:
    decision, reason = explain(witnessed, disk, proposed)
    assert decision is decide(witnessed, disk, proposed)
    assert (reason is not None) == (decision is Decision.CONFLICT)
    if reason is not None:
        assert reason.startswith("the disk")
        if disk is not None and witnessed is not None and disk.kind != witnessed.kind:
            assert {"dir": "directory"}.get(disk.kind, disk.kind) in reason
        if disk is not None and witnessed is not None and disk.kind == witnessed.kind:
            if disk.digest != witnessed.digest:
                assert f"BLAKE3 {str(disk.digest)[:12]} on disk" in reason
            else:
                assert f"{disk.mode:o} on disk" in reason


def test_explain_words() -> None:
    old, new = file_state(b"80\n"), file_state(b"90\n")
    assert explain(old, None, new)[1] == "the disk entry vanished (removed since the witness)"
    assert explain(None, old, new)[1] == (
        "the disk has a file here where the witness had nothing (the proposal is a file)"
    )
    assert explain(old, State("dir", None, 0o755), new)[1] == (
        "the disk is a directory, the witness a file and the proposal a file"
    )
    assert explain(old, State("other", "", 0o644), new)[1] == (
        "the disk holds a fifo, device or socket here"
    )
    assert explain(old, file_state(b"80\n", 0o600), new)[1] == (
        "the disk's mode changed since the witness (600 on disk, 644 witnessed)"
    )


# -- the desk's held content: bounded, kept for its manifests, the same after a restart ----

_POOL = [bytes([65 + i]) * (3 + 7 * i) for i in range(8)]  # 3 to 52 bytes each
MAX_BLOBS, MAX_BYTES = 4, 96


class HeldContent(RuleBasedStateMachine):
    """LandingDesk's merged-content store against the rules it promises: every plan still
    present can land what it was given, the store stays within its bounds, the newest plan
    is never the one dropped, and a restart (checkpoint + journal replay) rebuilds it."""

    def __init__(self) -> None:
        super().__init__()
        self.desk = LandingDesk(None, max_held_blobs=MAX_BLOBS, max_held_bytes=MAX_BYTES)
        self.checkpoint: bytes | None = None
        self.events: list[list[Any]] = []  # journaled since the checkpoint
        self.given: dict[str, set[str]] = {}  # manifest id -> the content it was registered with
        self.newest = ""
        self.count = 0

    def _emit(self, event: list[Any]) -> None:
        self.desk.apply_event(event)
        self.events.append(event)

    @rule(
        given=st.sets(st.integers(0, len(_POOL) - 1), max_size=3),
        named=st.sets(st.integers(0, len(_POOL) - 1), max_size=2),
    )
    def register(self, given: set[int], named: set[int]) -> None:
        self.count += 1
        entries = tuple(Entry(f"f{i}", None, file_state(_POOL[i])) for i in sorted(given | named))
        manifest = Manifest(f"snap-0-{self.count}", "/project", entries)
        held = {file_state(_POOL[i]).digest or "": _POOL[i] for i in given}
        before = self.desk.to_wire()
        try:
            self.desk.register(manifest, self._emit, held)
        except CapacityExhausted:
            held_now = self.desk.held.blobs
            needed = {i for i in given | named if file_state(_POOL[i]).digest in held_now}
            needed |= given
            assert len(needed) > MAX_BLOBS or sum(len(_POOL[i]) for i in needed) > MAX_BYTES
            assert self.desk.to_wire() == before  # refused before anything was journaled
            return
        self.newest = manifest.manifest_id
        self.given[self.newest] = set(held)

    @rule(data=st.data())
    def grant(self, data: st.DataObject) -> None:
        if self.desk.plans:
            manifest_id = data.draw(st.sampled_from(sorted(self.desk.plans)))
            self._emit(["grant", f"token-{len(self.events)}", manifest_id])

    @rule()
    def take_a_checkpoint(self) -> None:
        self.checkpoint = msgpack.packb(self.desk.to_wire(), use_bin_type=True)
        self.events = []

    @rule()
    def restart(self) -> None:
        restarted = LandingDesk(None, max_held_blobs=MAX_BLOBS, max_held_bytes=MAX_BYTES)
        if self.checkpoint is not None:
            restarted.restore(msgpack.unpackb(self.checkpoint, raw=False))
        for event in self.events:
            restarted.apply_event(msgpack.unpackb(msgpack.packb(event), raw=False))
        assert restarted.to_wire() == self.desk.to_wire()
        self.desk = restarted

    @invariant()
    def within_bounds_and_every_plan_can_land(self) -> None:
        desk, held = self.desk, self.desk.held
        assert len(held.blobs) <= MAX_BLOBS and held.size <= MAX_BYTES
        assert held.size == sum(len(b) for b in held.blobs.values())
        if self.newest:
            assert self.newest in desk.plans
        for manifest_id, manifest in desk.plans.items():
            for digest in self.given.get(manifest_id, set()):
                assert desk.content(State("file", digest, 0o644)) is not None, manifest_id
            named = {e.proposed.digest for e in manifest.entries if e.proposed is not None}
            assert held.holders.get(manifest_id, set()) <= named & held.blobs.keys()
        assert set(held.blobs) == set().union(set(), *held.holders.values())  # none for nobody
        assert held.holders.keys() <= desk.plans.keys()
        assert all(grant[0] in desk.plans for grant in desk.grants.values())
        for digest, blob in held.blobs.items():
            assert blake3.blake3(blob).hexdigest() == digest


TestHeldContent = HeldContent.TestCase
TestHeldContent.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_held_content_that_does_not_match_its_hash_is_refused() -> None:
    desk = LandingDesk(None)
    manifest = Manifest("snap-0-1", "/project", (Entry("f", None, file_state(b"merged\n")),))
    event = ["plan", {"manifest": manifest.to_wire(), "held": {"0" * 64: b"merged\n"}}]
    with pytest.raises(VerificationFailed):
        desk.apply_event(event)
