"""Conflict reports (issue 11): the smallest region where accepted and proposed differ.

Conflicts here come from the real range engine (slates.merge.ranges.rebase)
over files built by applying each side's edit to a base, as the service
sees them; the region is checked against the files themselves.
"""

from __future__ import annotations

import io
from typing import TypeVar

import msgpack
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from slates.errors import InvalidArgument
from slates.merge import report
from slates.merge.changes import Conflict, conflict_to_wire
from slates.merge.ranges import Replace, apply, rebase
from slates.merge.report import (
    BINARY_CONTEXT,
    MAX_REGION_BYTES,
    Region,
    proposed_offset,
    region_from_wire,
    region_to_wire,
    smallest_region,
)
from slates_cli.conflicts import SHOWN_WIDTH, render_conflict


def _conflict(base: bytes, accepted: Replace, proposed: Replace) -> tuple[Conflict, bytes, bytes]:
    """The conflict the range engine reports, with the head and the work file."""
    _mapped, clashes = rebase([proposed], [accepted])
    if len(clashes) != 1:
        raise AssertionError(f"expected one conflict, got {clashes}")
    (clash,) = clashes
    conflict = Conflict(
        path="/f",
        kind=clash.kind,
        base=clash.base,
        head=clash.head,
        accepted=clash.accepted,
        proposed=clash.proposed,
        ino=7,
    )
    return conflict, apply(base, [accepted]), apply(base, [proposed])


def _region(
    base: bytes, accepted: Replace, proposed: Replace, *, with_base: bool = True
) -> tuple[Region, bytes, bytes]:
    conflict, head, work = _conflict(base, accepted, proposed)
    region = smallest_region(
        conflict,
        head_file=head,
        work_file=work,
        proposed_at=proposed.start,
        base_file=base if with_base else None,
    )
    if region is None:
        raise AssertionError("no region for a byte-range conflict")
    _check(region, conflict, (head, work, base if with_base else None))
    return region, head, work


def _line_of(data: bytes, offset: int) -> int:
    return data[:offset].count(b"\n") + 1


def _check(
    region: Region,
    conflict: Conflict,
    files: tuple[bytes, bytes, bytes | None],
) -> None:
    """What every region promises, whatever the files."""
    head, work, base = files
    assert conflict.head is not None and conflict.proposed is not None
    sides = [(region.accepted, head), (region.proposed, work)]
    if region.base is not None:
        assert base is not None
        sides.append((region.base, base))
    for side, data in sides:
        assert 0 <= side.start <= side.end <= len(data)
        assert side.truncated == (side.end - side.start > MAX_REGION_BYTES)
        assert side.data == data[side.start : min(side.end, side.start + MAX_REGION_BYTES)]
        if region.text:
            assert side.line == _line_of(data, side.start)
            assert side.end_line == _line_of(data, max(side.start, side.end - 1))
        else:
            assert side.line is None and side.end_line is None
    accepted, proposed = region.accepted, region.proposed
    if region.text:  # whole characters on both sides
        for side in (accepted, proposed):
            if not side.truncated:
                side.data.decode("utf-8")
    assert head[: accepted.start].endswith(region.before)
    assert work[: proposed.start].endswith(region.before)
    assert head[accepted.end :].startswith(region.after)
    assert work[proposed.end :].startswith(region.after)
    # The region stays on the conflict: it touches the accepted range.  (The
    # proposed range too when a difference touches both: the examples check it.)
    h0, h1 = conflict.head
    assert accepted.start <= h1 and h0 <= accepted.end
    assert region.text == report.looks_like_text(head, work)


def _lines(count: int) -> list[bytes]:
    return [b"line %d: value = %d\n" % (n, n * 7) for n in range(1, count + 1)]


def _offset(lines: list[bytes], number: int) -> int:
    return sum(len(line) for line in lines[: number - 1])


# -- the case ------------------------------------------------------------


def test_a_whole_file_rewrite_against_one_line_shows_only_that_line() -> None:
    """A changed line 40; B rewrote the whole file, changing 40 differently and 300."""
    lines = _lines(600)
    base = b"".join(lines)
    at = _offset(lines, 40) + lines[39].index(b"280")
    accepted = Replace(at, at + 3, b"281")
    rewritten = list(lines)
    rewritten[39] = b"line 40: value = 999\n"
    rewritten[299] = b"line 300: changed by B\n"
    work_content = b"".join(rewritten)
    proposed = Replace(0, len(base), work_content)
    region, _head, _work = _region(base, accepted, proposed)
    assert region.accepted.data == b"281" and region.proposed.data == b"999"
    assert region.base is not None and region.base.data == b"280"
    assert (region.accepted.line, region.accepted.end_line) == (40, 40)
    assert (region.proposed.line, region.proposed.end_line) == (40, 40)
    assert region.before == b"line 38: value = 266\nline 39: value = 273\nline 40: value = "
    assert region.after == b"\nline 41: value = 287\nline 42: value = 294\n"
    assert region.text


def test_without_the_base_it_still_keeps_to_the_accepted_line() -> None:
    lines = _lines(600)
    base = b"".join(lines)
    at = _offset(lines, 40)
    accepted = Replace(at, at + len(lines[39]), b"line 40: from A\n")
    rewritten = list(lines)
    rewritten[39] = b"line 40: by B\n"
    rewritten[299] = b"line 300: changed by B\n"
    proposed = Replace(0, len(base), b"".join(rewritten))
    region, _head, _work = _region(base, accepted, proposed, with_base=False)
    assert (region.accepted.data, region.proposed.data) == (b"from A", b"by B")
    assert region.accepted.line == region.proposed.line == 40
    assert region.base is None


def test_an_accepted_rewrite_against_one_proposed_line() -> None:
    """The other way round: the accepted side rewrote the file (40 and 300), B changed 40."""
    lines = _lines(600)
    base = b"".join(lines)
    rewritten = list(lines)
    rewritten[39] = b"line 40: value = 1000\n"
    rewritten[299] = b"line 300: changed by A\n"
    accepted = Replace(0, len(base), b"".join(rewritten))
    at = _offset(lines, 40) + lines[39].index(b"280")
    proposed = Replace(at, at + 3, b"999")
    region, _head, _work = _region(base, accepted, proposed)
    assert (region.accepted.data, region.proposed.data) == (b"1000", b"999")
    assert region.accepted.line == 40


def test_both_rewrote_the_file_whole_only_the_line_both_changed_counts() -> None:
    lines = _lines(600)
    base = b"".join(lines)
    theirs, mine = list(lines), list(lines)
    theirs[39] = b"line 40: theirs\n"
    mine[39] = b"line 40: mine\n"
    mine[299] = b"line 300: mine only\n"  # only one side changed it: it would merge
    accepted = Replace(0, len(base), b"".join(theirs))
    proposed = Replace(0, len(base), b"".join(mine))
    region, _head, _work = _region(base, accepted, proposed)
    assert (region.accepted.data, region.proposed.data) == (b"theirs", b"mine")
    assert region.accepted.line == region.accepted.end_line == 40
    # Without the base, accepted and proposed differ on line 300 as well: both are shown.
    two_way, _head, _work = _region(base, accepted, proposed, with_base=False)
    assert (two_way.accepted.line, two_way.accepted.end_line) == (40, 300)


def test_a_long_line_is_refined_byte_by_byte() -> None:
    """One 24 KB line (minified code): only the bytes around A's change, not B's other one."""
    base = b"".join(b"f%04d(x);" % n for n in range(3000)) + b"\n"
    at = base.index(b"f0100")
    accepted = Replace(at + 1, at + 5, b"AAAA")
    changed = base.replace(b"f0100", b"fBBBB").replace(b"f2000", b"fCCCC")
    proposed = Replace(0, len(base), changed)
    region, _head, _work = _region(base, accepted, proposed)
    assert (region.accepted.data, region.proposed.data) == (b"AAAA", b"BBBB")
    assert region.accepted.start == at + 1 and region.accepted.line == 1


# -- shapes of edits -------------------------------------------------------------


def test_two_insertions_at_one_point() -> None:
    base = b"alpha\nbeta\n"
    region, _head, _work = _region(base, Replace(6, 6, b"gamma 1\n"), Replace(6, 6, b"gamma 2\n"))
    assert (region.accepted.data, region.proposed.data) == (b"1", b"2")
    assert region.accepted.line == 2
    assert region.base is not None and region.base.data == b""
    assert region.before == b"alpha\ngamma " and region.after == b"\nbeta\n"


def test_an_accepted_deletion_against_a_change_inside_it() -> None:
    base = b"one\ntwo\nthree\nfour\n"
    region, _head, _work = _region(base, Replace(4, 14, b""), Replace(8, 13, b"THREE"))
    assert region.accepted.data == b""
    assert region.accepted.start == region.accepted.end == 4
    assert region.proposed.data == b"two\nTHREE\n"
    assert region.base is not None and region.base.data == b"two\nthree\n"
    assert region.before == b"one\n" and region.after == b"four\n"


def test_a_proposed_deletion_against_an_accepted_change() -> None:
    base = b"one\ntwo\nthree\n"
    region, _head, _work = _region(base, Replace(4, 7, b"TWO"), Replace(4, 8, b""))
    assert region.accepted.data == b"TWO\n"
    assert region.proposed.data == b""
    assert region.proposed.line == 2


def test_crlf_lines_count_and_keep_their_carriage_returns() -> None:
    base = b"a\r\nb\r\nc\r\nd\r\n"
    region, _head, _work = _region(base, Replace(6, 7, b"C1"), Replace(6, 7, b"C2"))
    assert (region.accepted.data, region.proposed.data) == (b"1", b"2")
    assert region.accepted.line == 3
    assert region.before == b"a\r\nb\r\nC" and region.after == b"\r\nd\r\n"


def test_a_file_without_a_final_newline() -> None:
    base = b"first\nlast"
    region, _head, _work = _region(base, Replace(6, 10, b"end A"), Replace(6, 10, b"end B"))
    assert (region.accepted.data, region.proposed.data) == (b"A", b"B")
    assert region.accepted.line == 2 and region.after == b""
    assert region.before == b"first\nend "


def test_text_regions_hold_whole_characters() -> None:
    base = "naïve café\n".encode()
    at = base.index("é".encode())
    region, _head, _work = _region(
        base, Replace(at, at + 2, "è".encode()), Replace(at, at + 2, "ê".encode())
    )
    assert (region.accepted.data, region.proposed.data) == ("è".encode(), "ê".encode())
    assert region.before == "naïve caf".encode()


def test_binary_content_has_bytes_of_context_and_no_lines() -> None:
    base = bytes(range(256)) * 8
    region, _head, _work = _region(base, Replace(1000, 1002, b"\0\1"), Replace(1000, 1002, b"\0\2"))
    assert not region.text
    assert (region.accepted.data, region.proposed.data) == (b"\1", b"\2")
    assert region.accepted.line is None
    assert len(region.before) == len(region.after) == BINARY_CONTEXT


def test_a_very_large_difference_is_cut_and_says_so() -> None:
    base = b"start\n" + b"y" * 100_000 + b"\nend\n"
    size = len(base)
    region, _head, _work = _region(
        base,
        Replace(6, size - 5, b"a" * 50_000),
        Replace(6, size - 5, b"b" * 60_000),
    )
    accepted, proposed = region.accepted, region.proposed
    assert accepted.truncated and proposed.truncated
    assert len(accepted.data) == len(proposed.data) == MAX_REGION_BYTES
    assert (accepted.end - accepted.start, proposed.end - proposed.start) == (50_000, 60_000)
    wire = msgpack.packb(region_to_wire(region))
    assert len(wire) < 4 * MAX_REGION_BYTES + 4 * report.MAX_CONTEXT_BYTES


def test_sides_that_agree_around_the_range_give_an_empty_region() -> None:
    """B's rewrite made line 2 what A made it, and changed line 5: nothing differs at line 2."""
    base = b"1\n2\n3\n4\n5\n"
    accepted = Replace(2, 3, b"two")
    proposed = Replace(0, len(base), b"1\ntwo\n3\n4\nfive\n")
    region, _head, _work = _region(base, accepted, proposed)
    assert region.accepted.data == region.proposed.data == b""
    assert region.accepted.line == 2


def test_big_files_are_diffed_in_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_DIFF_BYTES", 8192)
    monkeypatch.setattr(report, "DIFF_WINDOW", 1024)
    lines = _lines(600)
    base = b"".join(lines)
    at = _offset(lines, 400) + lines[399].index(b"2800")
    accepted = Replace(at, at + 4, b"2801")
    proposed = Replace(at, at + 4, b"9999")
    region, _head, _work = _region(base, accepted, proposed)
    assert (region.accepted.data, region.proposed.data) == (b"2801", b"9999")
    assert region.base is None  # too big to map back
    # B rewrote the whole (big) file: its counterpart is looked for where A's range is.
    rewrite = Replace(0, len(base), base.replace(b"line 400: value = 2800", b"line 400: value = 7"))
    region, _head, _work = _region(base, accepted, rewrite)
    assert (region.accepted.data, region.proposed.data) == (b"2801", b"7")
    assert region.accepted.line == region.proposed.line == 400
    # Both rewrote it whole: too big for any window, the two ranges themselves are compared.
    theirs = Replace(0, len(base), base.replace(b"line 400: value = 2800", b"line 400: value = 1"))
    both, _head, _work = _region(base, theirs, rewrite)
    assert (both.accepted.data, both.proposed.data) == (b"1", b"7")
    assert both.accepted.line == 400


def test_kinds_without_byte_ranges_and_inputs_that_do_not_match() -> None:
    gone = Conflict(path="/f", kind="modify vs delete", ino=3)
    assert smallest_region(gone, head_file=b"", work_file=b"x", proposed_at=0) is None
    conflict, head, work = _conflict(b"quality=80\n", Replace(8, 10, b"90"), Replace(8, 10, b"60"))
    assert smallest_region(conflict, head_file=head, work_file=work, proposed_at=0) is None
    assert smallest_region(conflict, head_file=b"short", work_file=work, proposed_at=8) is None
    with pytest.raises(InvalidArgument):
        smallest_region(conflict, head_file=head, work_file=work, proposed_at=8, context_lines=-1)


def test_proposed_offset_follows_the_authors_earlier_edits() -> None:
    base = b"quality=80\ncache=off\n"
    own = (Replace(0, 0, b"# tuned\n"), Replace(8, 10, b"60"), Replace(17, 20, b"on"))
    conflict = Conflict(path="/f", kind="overlap", base=(8, 10), proposed=b"60")
    at = proposed_offset(own, conflict)
    assert at is not None and apply(base, own)[at : at + 2] == b"60"
    assert proposed_offset(own, Conflict(path="/f", kind="overlap", proposed=b"70")) is None


def test_the_wire_form_round_trips_through_msgpack() -> None:
    region, _head, _work = _region(b"a\nb\nc\n", Replace(2, 3, b"B"), Replace(2, 3, b"beta"))
    wire = msgpack.unpackb(msgpack.packb(region_to_wire(region)))
    assert region_from_wire(wire) == region
    for broken in ({**wire, "before": "text"}, {**wire, "accepted": {"data": b"x"}}, [1]):
        with pytest.raises(InvalidArgument):
            region_from_wire(broken)


_Seq = TypeVar("_Seq", bytes, str)

# -- properties ------------------------------------------------------------------

_pieces = st.sampled_from(
    [b"a", b"b", b"ab", b"\n", b"\r\n", b"xyz\n", b" ", "é".encode(), "è".encode(), "✓".encode()]
)
_text = st.lists(_pieces, max_size=30).map(b"".join)
_content = st.one_of(_text, st.binary(max_size=40))


@st.composite
def _edit(draw: st.DrawFn, size: int, content: st.SearchStrategy[bytes]) -> Replace:
    start = draw(st.integers(0, size))
    end = draw(st.integers(start, size))
    return Replace(start, end, draw(content))


@st.composite
def _clash(draw: st.DrawFn) -> tuple[bytes, Replace, Replace]:
    base = draw(_content)
    pieces = _text if b"\0" not in base else _content
    return base, draw(_edit(len(base), pieces)), draw(_edit(len(base), pieces))


@settings(max_examples=300, deadline=None)
@given(_clash(), st.booleans())
@example((b"ab\n", Replace(0, 2, b"ab"), Replace(0, 2, b"abab")), True)
def test_any_two_clashing_edits_give_a_consistent_region(
    case: tuple[bytes, Replace, Replace], with_base: bool
) -> None:
    """Offsets, bytes, line numbers and context agree with the files, for any two edits."""
    base, accepted, proposed = case
    _mapped, clashes = rebase([proposed], [accepted])
    assume(len(clashes) == 1)
    region, _head, _work = _region(base, accepted, proposed, with_base=with_base)
    a, p = region.accepted, region.proposed
    whole_characters = region.text and not (a.data + p.data).isascii()
    if a.data and p.data and not (a.truncated or p.truncated or whole_characters):
        assert a.data[:1] != p.data[:1] and a.data[-1:] != p.data[-1:]


@settings(max_examples=300, deadline=None)
@given(_content, st.data())
@example(b"ab\n", None)
def test_two_changes_of_one_region_give_exactly_what_differs(
    base: bytes, data: st.DataObject | None
) -> None:
    """Both sides replaced the same range: the region turns the head into the work file,
    and it is as small as one region can be (the trimming is maximal)."""
    if data is None:  # the example: "ab" becomes "ab" on one side, "abab" on the other
        start, end, mine, theirs = 0, 2, b"ab", b"abab"
    else:
        start = data.draw(st.integers(0, len(base)))
        end = data.draw(st.integers(start, len(base)))
        mine, theirs = data.draw(_text), data.draw(_text)
    assume(mine != theirs)
    region, head, work = _region(
        base, Replace(start, end, mine), Replace(start, end, theirs), with_base=False
    )
    a, p = region.accepted, region.proposed
    assert not (a.truncated or p.truncated)
    assert head[: a.start] + p.data + head[a.end :] == work
    assert work[: p.start] + a.data + work[p.end :] == head
    if region.text:  # the smallest region of whole characters
        chars_h, chars_w = head.decode(), work.decode()
        chars = len(_common_prefix(chars_h, chars_w))
        prefix = len(chars_h[:chars].encode())
        chars_s = len(_common_prefix(chars_h[chars:][::-1], chars_w[chars:][::-1]))
        suffix = len(chars_h[len(chars_h) - chars_s :].encode())
    else:
        prefix = len(_common_prefix(head, work))
        suffix = len(_common_prefix(head[prefix:][::-1], work[prefix:][::-1]))
    assert (len(a.data), len(p.data)) == (len(head) - prefix - suffix, len(work) - prefix - suffix)
    if a.data and p.data and (a.data + p.data).isascii():
        assert a.data[0] != p.data[0] and a.data[-1] != p.data[-1]
    assert a.start - start == p.start - start  # the same place on both sides


def _common_prefix(a: _Seq, b: _Seq) -> _Seq:
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return a[:size]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.booleans())
def test_a_rewrite_is_reported_on_the_contested_line_only(
    data: st.DataObject, both_rewrote: bool
) -> None:
    """A changed one line (or rewrote the file changing it and other lines); B rewrote
    the file changing that line and others: the region is that line's differing bytes on
    both sides and never reaches the lines only one of them changed."""
    count = data.draw(st.integers(3, 40))
    lines = [
        b"%d %s\n" % (n, data.draw(st.sampled_from([b"x", b"yy", b"x y"]))) for n in range(count)
    ]
    base = b"".join(lines)
    target = data.draw(st.integers(0, count - 1))
    others = data.draw(st.sets(st.integers(0, count - 1)))
    theirs = data.draw(st.sets(st.integers(0, count - 1))) - others if both_rewrote else set()
    if both_rewrote:
        accepted_lines = [
            b"%d A %d\n" % (n, n) if n in theirs else ln for n, ln in enumerate(lines)
        ]
        accepted_lines[target] = b"%d acc\n" % target
        accepted = Replace(0, len(base), b"".join(accepted_lines))
    else:
        at = _offset(lines, target + 1)
        accepted = Replace(at, at + len(lines[target]), b"%d acc\n" % target)
    rewritten = [b"%d B %d\n" % (n, n) if n in others else ln for n, ln in enumerate(lines)]
    rewritten[target] = b"%d prop\n" % target
    proposed = Replace(0, len(base), b"".join(rewritten))
    region, _head, _work = _region(base, accepted, proposed)
    assert region.accepted.line == region.accepted.end_line == target + 1
    assert region.proposed.line == region.proposed.end_line == target + 1
    assert region.accepted.data == b"acc" and region.proposed.data == b"prop"
    assert region.base is not None and region.base.data == lines[target][len(b"%d " % target) : -1]


# -- rendering -------------------------------------------------------------------


def _rendered(conflict: dict[str, object]) -> str:
    output = io.StringIO()
    Console(file=output, width=200, color_system=None).print(render_conflict(1, 2, conflict))
    return output.getvalue()


def _wire(base: bytes, accepted: Replace, proposed: Replace) -> dict[str, object]:
    region, _head, _work = _region(base, accepted, proposed)
    conflict, _head, _work = _conflict(base, accepted, proposed)
    return {**conflict_to_wire(conflict), "version": 3, "region": region_to_wire(region)}


def test_the_table_shows_the_differing_line_with_its_number_not_the_file_start() -> None:
    lines = _lines(600)
    base = b"".join(lines)
    at = _offset(lines, 40) + lines[39].index(b"280")
    rewritten = list(lines)
    rewritten[39] = b"line 40: value = 999\n"
    rewritten[299] = b"line 300: changed by B\n"
    shown = _rendered(
        _wire(base, Replace(at, at + 3, b"281"), Replace(0, len(base), b"".join(rewritten)))
    )
    assert "Conflict 1 of 2: /f" in shown and "overlap" in shown and "version 3" in shown
    assert "accepted (v3)" in shown and "line 40: line 40: value = 281" in shown
    assert "line 40: line 40: value = 999" in shown
    assert "'281'" in shown and "'999'" in shown and "'280'" in shown
    assert "39 │ line 39: value = 273" in shown and "41 │ line 41: value = 287" in shown
    assert "line 1:" not in shown and "changed by B" not in shown


def test_the_table_escapes_control_characters_and_shows_several_lines() -> None:
    base = b"a\r\nb\r\nc\r\n"
    shown = _rendered(_wire(base, Replace(3, 4, b"B\tone"), Replace(3, 4, b"B\x1b[31m\r\nX")))
    assert "\x1b" not in shown and "\\x1b[31m" in shown and "\\t" in shown
    assert "lines 2-3:" in shown and "2 │ B\\x1b[31m\\r" in shown and "3 │ X\\r" in shown


def test_a_binary_region_and_a_conflict_without_one_show_bytes() -> None:
    base = bytes(range(256)) * 4
    shown = _rendered(_wire(base, Replace(500, 502, b"\0\1"), Replace(500, 502, b"\0\2")))
    assert "bytes [501, 502): b'\\x01'" in shown and "bytes [501, 502): b'\\x02'" in shown
    plain = {
        **conflict_to_wire(Conflict(path="/d/f", kind="add vs add", accepted=b"x", proposed=b"y")),
        "version": 1,
    }
    shown = _rendered(plain)
    assert "add vs add" in shown and "b'x'" in shown and "b'y'" in shown


def test_the_table_shows_insertion_points_cuts_and_agreement() -> None:
    base = b"one\ntwo\nthree\nfour\n"
    shown = _rendered(_wire(base, Replace(4, 14, b""), Replace(8, 13, b"THREE")))
    assert "accepted (v3) │ line 2:" in shown and "nothing (an insertion point)" in shown
    assert "2 │ two" in shown and "3 │ THREE" in shown and "'two\\nthree\\n'" in shown
    assert "2 │ four" in shown  # the context after an insertion point starts on its line
    big = b"x\n" + b"y" * 10_000 + b"\n"
    cut = _rendered(_wire(big, Replace(2, 10_002, b"a" * 9_000), Replace(2, 10_002, b"b" * 9_500)))
    assert "(9,000 B in all)" in cut and "(9,500 B in all)" in cut
    assert "a" * SHOWN_WIDTH not in cut  # a long line is cut
    same = _rendered(_wire(b"1\n2\n3\n", Replace(2, 3, b"two"), Replace(0, 6, b"1\ntwo\nthree\n")))
    assert "nowhere here" in same
    flagged = {**_wire(base, Replace(4, 7, b"TWO"), Replace(4, 7, b"2")), "rewrite": True}
    assert "refined from a whole-file rewrite" in _rendered(flagged)
