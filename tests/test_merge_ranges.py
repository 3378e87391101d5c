"""The byte-range merge engine: the product description's examples and properties."""

from __future__ import annotations

import itertools
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slates.errors import InvalidArgument
from slates.merge.ranges import Replace, apply, compose, overlaps, rebase

BASE = b"quality=80\ncache=off\n"


def test_an_insert_before_a_range_shifts_it() -> None:
    agent1 = compose(len(BASE), [Replace(0, 0, b"format=webp\n")])
    agent2 = compose(len(BASE), [Replace(8, 10, b"90")])
    mapped, conflicts = rebase(agent2, agent1)
    assert conflicts == ()
    assert mapped == (Replace(20, 22, b"90"),)
    assert apply(apply(BASE, agent1), mapped) == b"format=webp\nquality=90\ncache=off\n"


def test_separate_settings_combine() -> None:
    quality = compose(len(BASE), [Replace(8, 10, b"90")])
    cache = compose(len(BASE), [Replace(17, 20, b"on")])
    mapped, conflicts = rebase(cache, quality)
    assert conflicts == ()
    assert apply(apply(BASE, quality), mapped) == b"quality=90\ncache=on\n"


def test_competing_values_conflict_with_all_three_values() -> None:
    accepted = compose(len(BASE), [Replace(8, 10, b"90")])
    proposed = compose(len(BASE), [Replace(8, 10, b"60")])
    mapped, conflicts = rebase(proposed, accepted)
    assert mapped == ()
    (conflict,) = conflicts
    assert conflict.kind == "overlap"
    assert BASE[conflict.base[0] : conflict.base[1]] == b"80"
    assert conflict.accepted == b"90" and conflict.proposed == b"60"
    head = apply(BASE, accepted)
    assert head[conflict.head[0] : conflict.head[1]] == b"90"


def test_identical_bytes_are_accepted() -> None:
    accepted = compose(len(BASE), [Replace(8, 10, b"90")])
    mapped, conflicts = rebase(compose(len(BASE), [Replace(8, 10, b"90")]), accepted)
    assert (mapped, conflicts) == ((), ())


def test_inserting_where_the_other_deleted_is_a_conflict() -> None:
    accepted = compose(len(BASE), [Replace(0, 11, b"")])  # the quality line is gone
    proposed = compose(len(BASE), [Replace(9, 9, b"5")])
    _mapped, conflicts = rebase(proposed, accepted)
    assert [c.kind for c in conflicts] == ["insertion point deleted"]


def test_temporary_content_composes_away_and_rewrites_stay_whole() -> None:
    assert compose(5, [Replace(2, 2, b"tmp"), Replace(2, 5, b"")]) == ()
    rewrite = compose(len(BASE), [Replace(0, len(BASE), b""), Replace(0, 0, BASE)])
    assert rewrite == (Replace(0, len(BASE), BASE),)


def test_bad_edits_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        compose(3, [Replace(2, 5, b"x")])
    with pytest.raises(InvalidArgument):
        rebase((Replace(4, 6, b""), Replace(0, 1, b"")), ())
    with pytest.raises(InvalidArgument):
        apply(b"abc", [Replace(2, 9, b"")])


@st.composite
def base_and_ops(
    draw: st.DrawFn, max_base: int = 40, max_ops: int = 8
) -> tuple[bytes, list[Replace]]:
    """A base and operations on it, each in the coordinates of the file at its turn."""
    base = draw(st.binary(max_size=max_base))
    size = len(base)
    ops = []
    for _ in range(draw(st.integers(0, max_ops))):
        start = draw(st.integers(0, size))
        end = draw(st.integers(start, size))
        data = draw(st.binary(max_size=6))
        ops.append(Replace(start, end, data))
        size += len(data) - (end - start)
    return base, ops


@settings(max_examples=500, deadline=None)
@given(base_and_ops())
def test_compose_equals_applying_the_operations_in_turn(case: tuple[bytes, list[Replace]]) -> None:
    base, ops = case
    expected = base
    for op in ops:
        expected = apply(expected, [op])
    edits = compose(len(base), ops)
    assert apply(base, edits) == expected
    for left, right in itertools.pairwise(edits):
        assert left.end < right.start  # sorted, separated: adjacent edits are merged


@settings(max_examples=500, deadline=None)
@given(base_and_ops(), st.data())
def test_merging_two_agents(case: tuple[bytes, list[Replace]], data: st.DataObject) -> None:
    base, ops1 = case
    size = len(base)
    ops2 = []
    for _ in range(data.draw(st.integers(0, 5))):
        start = data.draw(st.integers(0, size))
        end = data.draw(st.integers(start, size))
        payload = data.draw(st.binary(max_size=5))
        ops2.append(Replace(start, end, payload))
        size += len(payload) - (end - start)
    first, second = compose(len(base), ops1), compose(len(base), ops2)
    clash = any(overlaps(a, b) and a != b for a in first for b in second)
    mapped, conflicts = rebase(second, first)
    back, conflicts_back = rebase(first, second)
    assert bool(conflicts) == clash == bool(conflicts_back)
    if not clash:
        merged = apply(apply(base, first), mapped)
        assert merged == apply(apply(base, second), back)  # either order, one result
        union = sorted(set(first) | set(second), key=lambda e: (e.start, e.end))
        assert merged == apply(base, union)  # all edits applied to the base


def draw_line_edits(data: st.DataObject, max_lines: int) -> tuple[bytes, list[Replace]]:
    """A file of lines and sorted edits of whole lines (delete, insert or replace),
    with at least two untouched lines between any two: git's merge-file calls
    changes separated by one line a conflict; Slates does not."""
    lines = [
        f"line {i}\n".encode() for i in range(data.draw(st.integers(6, max_lines), label="lines"))
    ]
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(lines) - 1), max_size=6), label="cuts"))
    chosen: list[tuple[int, int]] = []
    for cut in cuts:
        if chosen and cut <= chosen[-1][1] + 2:
            continue
        chosen.append((cut, min(cut + data.draw(st.integers(0, 1)), len(lines) - 1)))
    edits = []
    for first, last in chosen:
        new = data.draw(st.lists(st.sampled_from([b"alpha\n", b"beta\n", b"gamma\n"]), max_size=3))
        edits.append(Replace(offsets[first], offsets[last + 1], b"".join(new)))
    return b"".join(lines), edits


def git_merge(base: bytes, ours: bytes, theirs: bytes) -> bytes | None:
    """What `git merge-file` makes of two versions of a base; None if it conflicts."""
    with tempfile.TemporaryDirectory() as directory:
        paths = [Path(directory) / name for name in ("ours", "base", "theirs")]
        for path, content in zip(paths, (ours, base, theirs), strict=True):
            path.write_bytes(content)
        done = subprocess.run(
            ["git", "merge-file", "-p", *map(str, paths)], capture_output=True, check=False
        )
        return done.stdout if done.returncode == 0 else None


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_disjoint_line_edits_match_git_merge_file(data: st.DataObject) -> None:
    base, edits = draw_line_edits(data, max_lines=30)
    ours_edits = edits[1::2]
    theirs_edits = edits[0::2]
    # Applied from the end, base-coordinate edits are also valid sequential operations.
    ours = compose(len(base), reversed(ours_edits))
    theirs = compose(len(base), reversed(theirs_edits))
    mapped, conflicts = rebase(theirs, ours)
    assert conflicts == ()
    merged = apply(apply(base, ours), mapped)
    expected = git_merge(base, apply(base, ours), apply(base, theirs))
    assume(expected is not None)  # hypothesis fails the test if git rarely merges cleanly
    assert merged == expected
