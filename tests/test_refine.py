"""Refining whole-file rewrites (slates.merge.refine): exact, small, and merging like git.

Properties: refined edits reproduce the new content and form a valid edit
list; no edit carries a byte it could leave out without splitting a word,
a changed word is an edit of that word and no edit splits a UTF-8 character; two agents' refined
rewrites of one base merge, through the project's own merge, whenever
`git merge-file` merges the same three files, and to the same bytes.  Then
the limit and `worth_refining`.  A failing example prints its seed;
`pytest --hypothesis-seed=N` reproduces it.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import slates.merge.refine as refine_module
from slates.errors import VerificationFailed
from slates.merge.changes import Edit, map_edits_pairwise
from slates.merge.ranges import Replace, apply, check_edits, compose, rebase
from slates.merge.refine import REFINE_LIMIT, is_binary, refine, worth_refining
from tests.merge_helpers import git_merge

WORD = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_" + bytes(range(128, 256))
)

# Few letters, so lines repeat and alignments are ambiguous; blanks and
# brackets, so lines have words to split at.
WORDS = [b"a", b"b", b"ab", b"a b", b"x(a)", b"x(b)", b""]
# Fewer still: long runs of equal lines, where a diff may place a change anywhere.
REPEATS = [b"x", b"y", b"x y"]
ENDINGS = [b"\n", b"\n", b"\n", b"\r\n"]


@st.composite
def text_lines(
    draw: st.DrawFn, max_lines: int = 12, raw: bool = True, words: list[bytes] = WORDS
) -> list[bytes]:
    """A file as its lines (each with its ending; the last may lack one)."""
    line_bodies = st.sampled_from(words)
    if raw:  # now and then bytes that are not UTF-8, or a lone CR
        raw_bytes = st.lists(st.sampled_from(b"\x80\xc3\xff\ra"), max_size=4).map(bytes)
        line_bodies = st.one_of(line_bodies, raw_bytes)
    lines = draw(st.lists(st.tuples(line_bodies, st.sampled_from(ENDINGS)), max_size=max_lines))
    out = [body + ending for body, ending in lines]
    binary: bool = raw and draw(st.integers(0, 9)) == 0
    if out and binary:  # a NUL byte makes the content binary
        where = draw(st.integers(0, len(out) - 1))
        out[where] = b"\0" + out[where]
    no_final_newline: bool = draw(st.booleans())
    if out and no_final_newline:
        out[-1] = out[-1].rstrip(b"\r\n")  # no final newline
    return out


@st.composite
def rewrite(
    draw: st.DrawFn, lines: list[bytes], max_changes: int = 3, words: list[bytes] = WORDS
) -> list[bytes]:
    """The lines after a few changes: whole lines replaced, inserted or deleted, or one
    byte inside a line inserted, deleted or changed."""
    out = list(lines)
    for _ in range(draw(st.integers(1, max_changes), label="changes")):
        kind = draw(st.sampled_from(["replace", "insert", "delete", "byte"]), label="kind")
        where = draw(st.integers(0, len(out)), label="where")
        if kind == "insert" or not out:
            out.insert(where, draw(st.sampled_from(words)) + b"\n")
            continue
        where = min(where, len(out) - 1)
        if kind == "replace":
            out[where] = draw(st.sampled_from(words)) + out[where][len(out[where].rstrip()) :]
        elif kind == "delete":
            del out[where]
        else:
            line = out[where]
            at = draw(st.integers(0, len(line)), label="at")
            byte = draw(st.sampled_from([b"a", b"c", b" ", b"("]), label="byte")
            cut = draw(st.integers(0, 1), label="cut")
            out[where] = line[:at] + byte + line[at + cut :]
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_refined_edits_reproduce_the_rewrite_and_are_valid(data: st.DataObject) -> None:
    base_lines = data.draw(text_lines(), label="base")
    new_lines = data.draw(st.one_of(rewrite(base_lines), text_lines()), label="new")
    base, new = b"".join(base_lines), b"".join(new_lines)
    edits = refine(base, new)
    assert edits is not None
    assert apply(base, edits) == new
    check_edits(edits)
    for left, right in itertools.pairwise(edits):
        assert left.end < right.start  # separated: touching edits would be one
    assert (edits == ()) == (base == new)
    if base != new and (is_binary(base) or is_binary(new)):
        event("binary")
        assert edits == (Replace(0, len(base), new),)
    elif base.isascii() and new.isascii():
        for edit in edits:
            old = base[edit.start : edit.end]
            assert old or edit.data  # no empty edit
            if old and edit.data and old[0] == edit.data[0]:  # only to keep a word whole
                assert old[0] in WORD, edit
            if old and edit.data and old[-1] == edit.data[-1]:
                assert old[-1] in WORD, edit
        assert sum(e.end - e.start for e in edits) <= len(base)


def word_around(content: bytes, at: int) -> tuple[int, int]:
    """The word (run of WORD bytes) that holds content[at], or just that byte."""
    if content[at] not in WORD:
        return at, at + 1
    lo, hi = at, at + 1
    while lo and content[lo - 1] in WORD:
        lo -= 1
    while hi < len(content) and content[hi] in WORD:
        hi += 1
    return lo, hi


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_changed_byte_is_an_edit_of_its_word(data: st.DataObject) -> None:
    lines = data.draw(text_lines(raw=False).filter(lambda ls: any(ls)), label="base")
    base = b"".join(lines)
    candidates = [i for i, byte in enumerate(base) if byte not in b"\r\n"]
    assume(candidates)
    at = data.draw(st.sampled_from(candidates), label="at")
    byte = data.draw(st.sampled_from([b for b in (b"a", b"b", b"z", b" ") if b[0] != base[at]]))
    new = base[:at] + byte + base[at + 1 :]
    (edit,) = refine(base, new) or ()
    # Within the word the byte belongs to (in the base or the new content), no more.
    lo = min(word_around(base, at)[0], word_around(new, at)[0])
    hi = max(word_around(base, at)[1], word_around(new, at)[1])
    assert lo <= edit.start <= at < edit.end <= hi, (edit, lo, hi)
    assert apply(base, (edit,)) == new
    if base[at] not in WORD and byte[0] not in WORD:
        assert edit == Replace(at, at + 1, byte)  # punctuation or blanks: just that byte


def test_one_word_changed_two_ways_conflicts_instead_of_merging_into_a_third() -> None:
    base = b"    int y = x * 4;\n"
    ours, theirs = refine(base, base.replace(b"4", b"44")), refine(base, base.replace(b"4", b"77"))
    assert ours == (Replace(16, 17, b"44"),) and theirs == (Replace(16, 17, b"77"),)
    _mapped, conflicts = map_edits_pairwise([Edit(1, "/f", ours)], [[Edit(1, "/f", theirs)]])
    assert [c.kind for c in conflicts] == ["overlap"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="aé€𝄞 \n", max_size=12), min_size=2, max_size=2))
def test_no_edit_splits_a_utf8_character(texts: list[str]) -> None:
    base, new = (text.encode() for text in texts)
    edits = refine(base, new)
    assert edits is not None and apply(base, edits) == new
    for edit in edits:
        base[: edit.start].decode()  # raises UnicodeDecodeError on a split character
        base[edit.start : edit.end].decode()
        edit.data.decode()


def test_examples_refine_to_the_bytes_that_changed() -> None:
    conf = b"quality=80\ncache=off\n"
    assert refine(conf, b"quality=90\ncache=on\n") == (
        Replace(8, 10, b"90"),  # the product description's [8, 10): words stay whole
        Replace(17, 20, b"on"),
    )
    # Two separate changes in one line are two edits ...
    assert refine(b"x = f(a, b)\n", b"y = f(a, c)\n") == (
        Replace(0, 1, b"y"),
        Replace(9, 10, b"c"),
    )
    # ... but a rewritten line is one, not words interleaved at a shared blank.
    assert refine(b"apple pie\n", b"mango tart\n") == (Replace(0, 9, b"mango tart"),)
    assert refine(b"a\nb", b"a\nb\nc\n") == (Replace(3, 3, b"\nc\n"),)  # final newline added
    assert refine(b"a\r\nb\r\n", b"a\r\nB\r\n") == (Replace(3, 4, b"B"),)  # CRLF kept
    assert refine(b"\xff\xfe\n", b"\xff\xfd\n") == (Replace(0, 2, b"\xff\xfd"),)  # a "word"
    assert refine(b"", b"new\n") == (Replace(0, 0, b"new\n"),)
    assert refine(b"old\n", b"") == (Replace(0, 4, b""),)
    assert refine(b"same\n", b"same\n") == ()
    # Binary content (a NUL byte, as git decides) is one whole replacement.
    assert refine(b"bin\0ary", b"bin\0Ary") == (Replace(0, 7, b"bin\0Ary"),)


def test_a_one_mebibyte_single_line_refines_to_its_change() -> None:
    base = b"x" * (1 << 20)
    new = base[:500_000] + b"y" + base[500_001:]
    # One huge word: its edit keeps at most _WORD_REACH bytes on either side.
    (edit,) = refine(base, new) or ()
    assert apply(base, (edit,)) == new
    assert edit.start >= 500_000 - 64 and edit.end <= 500_001 + 64


def test_every_line_changed_is_an_edit_per_line() -> None:
    # A hunk far bigger than the token diff takes, with as many lines on each side.
    base = b"".join(b"value_%05d = old\n" % i for i in range(8000))
    new = base.replace(b"old", b"new")
    edits = refine(base, new)
    assert edits is not None and apply(base, edits) == new
    assert len(edits) == 8000
    assert all(base[e.start : e.end] == b"old" and e.data == b"new" for e in edits)


def test_many_changed_hunks_still_refine_to_bytes() -> None:
    # More hunks than get a token diff: each changed line is still trimmed to its bytes.
    lines = [b"key_%05d = a b c d\n" % i for i in range(12000)]
    new_lines = [line.replace(b"a b", b"A b") if i % 2 else line for i, line in enumerate(lines)]
    base, new = b"".join(lines), b"".join(new_lines)
    edits = refine(base, new)
    assert edits is not None and apply(base, edits) == new
    assert len(edits) == 6000 and all(e.data == b"A" and e.end - e.start == 1 for e in edits)


# -- merging two agents' refined rewrites, against git merge-file ---------------------


def merge_ours(base: bytes, ours: bytes, theirs: bytes) -> tuple[bytes | None, bytes | None]:
    """Both agents' rewrites refined and merged the way the service merges same-base
    submissions (map_edits_pairwise) and different-base ones (rebase), theirs accepted
    first; each result is None on a conflict."""
    mine, accepted = refine(base, ours), refine(base, theirs)
    assert mine is not None and accepted is not None
    head = apply(base, accepted)
    changes, conflicts = map_edits_pairwise([Edit(1, "/f", mine)], [[Edit(1, "/f", accepted)]])
    pairwise = None
    if not conflicts:
        mapped = [e for change in changes if isinstance(change, Edit) for e in change.edits]
        pairwise = apply(head, mapped)
    rebased, range_conflicts = rebase(mine, accepted)
    return pairwise, (None if range_conflicts else apply(head, rebased))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_refined_rewrites_merge_whenever_git_merge_file_does(data: st.DataObject) -> None:
    words = data.draw(st.sampled_from([WORDS, REPEATS]), label="words")
    base_lines = data.draw(text_lines(max_lines=14, words=words), label="base")
    ours_lines = data.draw(rewrite(base_lines, words=words), label="ours")
    # Theirs changes the base, or makes ours' changes and more (identical changes on
    # both sides, which git and Slates both accept).
    theirs_lines = data.draw(
        st.one_of(rewrite(base_lines, words=words), rewrite(ours_lines, words=words)),
        label="theirs",
    )
    base, ours, theirs = (b"".join(lines) for lines in (base_lines, ours_lines, theirs_lines))
    expected = git_merge(base, ours, theirs)
    pairwise, rebased = merge_ours(base, ours, theirs)
    swapped, _ = merge_ours(base, theirs, ours)
    if pairwise is not None:  # whoever is accepted first, one result
        assert swapped == pairwise
        assert rebased == pairwise
    if expected is None:
        event("git conflicts")
        return
    if git_merge(base, ours, theirs, compare_texts=False) is None:
        # git settled changes to adjacent or overlapping lines by finding both sides'
        # texts there equal (its conflict refinement), as when both delete one of two
        # equal lines and xdiff, led by their other changes, picked a different one
        # for each.  Slates merges byte ranges, and those are two edits that do not
        # overlap; no placement of them agrees with git in every such case.
        event("git merges only by comparing the two sides' texts")
        return
    event("git merges")
    assert pairwise == expected
    assert swapped == expected
    assert rebased == expected


# -- the limit and when to refine ----------------------------------------------------


def test_content_over_the_limit_is_not_refined() -> None:
    assert REFINE_LIMIT == 64 << 20
    assert refine(b"a" * 11, b"b", limit=10) is None
    assert refine(b"b", b"a" * 11, limit=10) is None
    assert refine(b"a" * 10, b"a" * 9 + b"b", limit=10) == (Replace(0, 10, b"a" * 9 + b"b"),)
    assert refine(b"a a a a a", b"a a a a b", limit=10) == (Replace(8, 9, b"b"),)


def test_a_refinement_that_does_not_reproduce_the_content_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bug in the diff step must surface as VerificationFailed, never as wrong edits.
    def off_by_one(base: bytes, new: bytes, hunk: object, by_tokens: bool) -> list[Replace]:
        return [Replace(0, 1, b"?")]

    monkeypatch.setattr(refine_module, "_refine_hunk", off_by_one)
    with pytest.raises(VerificationFailed):
        refine(b"a\nb\n", b"a\nc\n")

    def overlapping(base: bytes, new: bytes, hunk: object, by_tokens: bool) -> list[Replace]:
        return [Replace(0, 2, b""), Replace(1, 2, b"")]

    monkeypatch.setattr(refine_module, "_refine_hunk", overlapping)
    with pytest.raises(VerificationFailed):
        refine(b"a\nb\n", b"a\nc\n")


def test_worth_refining_is_for_rewrites() -> None:
    size = 100
    # What recording a rewrite leaves: truncate and write again, as one replacement.
    rewritten = compose(size, [Replace(0, size, b""), Replace(0, 0, b"new content")])
    assert worth_refining(size, rewritten)
    assert worth_refining(size, [Replace(0, size, b"")])  # the file emptied
    assert worth_refining(0, [Replace(0, 0, b"first content")])  # the whole (empty) base
    assert worth_refining(size, [Replace(0, 30, b"x"), Replace(60, 80, b"y")])  # exactly half
    assert not worth_refining(size, [Replace(0, 30, b"x"), Replace(60, 79, b"y")])
    assert not worth_refining(size, [Replace(10, 12, b"precise")])
    assert not worth_refining(size, [Replace(size, size, b"appended")])
    assert not worth_refining(size, [])
    assert not worth_refining(0, [])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1000), st.data())
def test_worth_refining_counts_replaced_base_bytes(size: int, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=8)))
    edits = [Replace(lo, hi, b"z") for lo, hi in zip(cuts[::2], cuts[1::2], strict=False)]
    edits = [e for e in edits if e.start < e.end]
    replaced = sum(e.end - e.start for e in edits)
    assert worth_refining(size, edits) == (replaced * 2 >= size)
    # Inserts replace nothing, wherever they are.
    assert not worth_refining(size, [Replace(p, p, b"i") for p in sorted(set(cuts))[:1]])
