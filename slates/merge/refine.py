"""Refining a whole-file rewrite into the edits that remain (DESIGN.md section 5a).

Theory of operation.  Agents' tools rewrite files whole (`open(p, "w")`, an
editor saving through a temporary file and a rename, `sed -i`), so the edit
a work volume records for such a file is one replacement of its whole base,
which conflicts with any other change to the file.  At submit, a file whose
recorded edits replace most of its base (`worth_refining`) is submitted
instead as `refine(base, new)`: the small edit list that turns the base into
the new content.  It then merges like precise edits.

How `refine` finds it, in three steps, each only narrowing the one before:

1. Lines.  libgit2's xdiff (through pygit2, on the two buffers, no context
   lines) gives the changed line hunks: the Myers diff and hunk placement
   that `git merge-file` computes (no indent heuristic), so where git merges
   two rewrites cleanly their refined edits merge too, to the same bytes
   (tests/test_refine.py holds that).  A line is
   its bytes up to and including b"\\n"; a last line without one is a line
   of its own that differs from the same text with one (as in git), and
   b"\\r\\n" is just the end of a line's bytes.  Bytes that are not UTF-8 are
   bytes like any other (text mode is forced).  Hunks are separated by at
   least one unchanged line, so their edits never touch.
2. Bytes.  Inside a hunk, the common prefix and suffix of its old and new
   bytes are unchanged and are left out.
3. Words.  What remains of a hunk, when it is longer than a few bytes and
   not huge (`_TOKEN_LIMIT`), is split into tokens (runs of letters, digits,
   `_` and bytes >= 0x80; runs of blanks; a line end; any other byte) and
   diffed again with xdiff, one token per line, so that separate changes in
   one line become separate edits.  Unchanged stretches that are short next
   to the changes on both sides of them are folded back into one edit (the
   semantic clean-up of diff-match-patch): two rewrites of one sentence then
   overlap and conflict instead of interleaving where they happen to share a
   blank or a bracket.  Each edit is trimmed once more.  A huge hunk with as
   many new lines as old ones (a rename or a reformat of every line) is
   instead trimmed line against line.  A rewrite with more than
   `_TOKEN_HUNKS` changed hunks skips this step, which costs tens of
   microseconds a hunk: its edits are lines trimmed to bytes.

An edit never starts or ends inside a word (a run of letters, digits, `_`
and bytes >= 0x80, so never inside a UTF-8 sequence either): a boundary
that would split one moves outward, within its hunk, by at most
`_WORD_REACH` bytes.  So `x * 4` made `x * 44` by one agent and `x * 77` by
another are two replacements of the word `4` that overlap and conflict,
instead of an insert after the `4` and a replacement of it that merge into
`x * 774`; and `quality=80` made `quality=90` is the edit [8, 10) of the
product description.  A changed word is an edit of just that word.

Binary content (a NUL byte among the first 8000 bytes of either side, git's
own test) is not refined: it becomes one replacement of the whole base.
Byte-level merges of archives, images or object files produce files that
are silently corrupt, and `git merge` refuses them too; a whole replacement
conflicts with any other change to the file, as before.

The result is checked (`apply(base, edits) == new`) before it is returned; a
mismatch is a bug in this module and raises VerificationFailed.  Content
bigger than `limit` is not diffed (None): the caller keeps the literal
replacement.  Cost: one xdiff of the two buffers (11 to 30 ms for 1 MiB with
scattered changes on the shared 2-core development machine, about what one
`git diff --no-index` of the two files costs) plus a small diff per changed
hunk; bench/refine_bench.py measures it.

Pure: bytes in, edit lists out (libgit2's diff runs on the buffers, no
repository).  Called at submit by slates.merge.submission (for
slates.node.service) and by the tests and bench/refine_bench.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence

import pygit2
from pygit2.enums import DiffOption

from slates.errors import InvalidArgument, VerificationFailed
from slates.merge.ranges import Replace, apply, check_edits, merge_adjacent

__all__ = ["REFINE_LIMIT", "refine", "worth_refining", "is_binary"]

REFINE_LIMIT = 64 << 20  # bytes; bigger base or new content is not diffed

# git's test for binary content (xdiff-interface.c buffer_is_binary).
_BINARY_PROBE = 8000
# A hunk whose trimmed old plus new bytes are fewer than this stays one edit:
# splitting it further cannot give meaningfully separate changes.
_TOKEN_MIN = 8
# A hunk whose trimmed old plus new bytes exceed this stays one edit: the
# token diff is for changed lines, not for rewritten files.
_TOKEN_LIMIT = 1 << 16
# A rewrite with more changed hunks than this is refined to lines and bytes only:
# a token diff costs tens of microseconds a hunk.
_TOKEN_HUNKS = 4096
_CHUNK = 1 << 12  # compare this many bytes at a time when trimming

_WORD_BYTES = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_" + bytes(range(0x80, 0x100))
)
_WORD_REACH = 64  # bytes an edit's end moves outward to keep a word whole, at most
_TOKEN = re.compile(rb"[A-Za-z0-9_\x80-\xff]+|[ \t]+|\r?\n|.", re.DOTALL)

# One span of a hunk: old bytes [old_lo, old_hi) of the base become new bytes
# [new_lo, new_hi) of the new content.
_Span = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class _Hunk:
    """A changed line hunk: its span, and where each of its lines starts on either side
    (then where the last one ends); a side without lines has just its insertion point."""

    span: _Span
    old_lines: tuple[int, ...]
    new_lines: tuple[int, ...]


def worth_refining(base_size: int, edits: Sequence[Replace]) -> bool:
    """True when recorded edits replace most of the base (a rewrite): the base bytes they
    replace are at least half of a non-empty base, or the edits are one replacement of the
    whole base."""
    if len(edits) == 1 and edits[0].start == 0 and edits[0].end == base_size:
        return True
    replaced = sum(edit.end - edit.start for edit in edits)
    return base_size > 0 and 2 * replaced >= base_size


def is_binary(content: bytes) -> bool:
    """Whether git would call this content binary (a NUL among its first 8000 bytes)."""
    return b"\0" in content[:_BINARY_PROBE]


def refine(base: bytes, new: bytes, *, limit: int = REFINE_LIMIT) -> tuple[Replace, ...] | None:
    """The smallest edit list (sorted, non-overlapping, relative to base;
    slates.merge.ranges.Replace) with ranges.apply(base, edits) == new; None when base or
    new exceeds `limit` (the caller then keeps the literal replacement and says so)."""
    if len(base) > limit or len(new) > limit:
        return None
    if base == new:
        return ()
    if is_binary(base) or is_binary(new):
        edits: list[Replace] = [Replace(0, len(base), new)]
    else:
        hunks = _line_hunks(base, new)
        by_tokens = len(hunks) <= _TOKEN_HUNKS
        edits = []
        for hunk in hunks:
            edits += _refine_hunk(base, new, hunk, by_tokens)
    result = tuple(merge_adjacent(edits))
    try:
        check_edits(result)
        reproduced = apply(base, result)
    except InvalidArgument as invalid:
        raise VerificationFailed("refined edits are not a valid edit list") from invalid
    if reproduced != new:
        raise VerificationFailed(
            "refined edits do not reproduce the new content",
            base_size=len(base),
            new_size=len(new),
            edits=len(result),
        )
    return result


def _line_hunks(base: bytes, new: bytes) -> list[_Hunk]:
    """The changed line hunks, in order.

    A changed line says where its bytes are in its own file (`content_offset`); a
    side with no lines is where the unchanged bytes before the hunk end, found from
    the other side and the size change of the hunks before it.  Only the changed
    lines are visited, so scattered changes to a big file cost no scan of it."""
    patch = pygit2.Patch.create_from(
        base, new, context_lines=0, interhunk_lines=0, flag=DiffOption.FORCE_TEXT
    )
    hunks: list[_Hunk] = []
    growth = 0  # new offset minus base offset in the unchanged bytes before a hunk
    for hunk in patch.hunks:
        old: list[int] = []
        added: list[int] = []
        old_end = new_end = 0
        for line in hunk.lines:
            # Other origins than these mark a missing final newline; they hold no bytes.
            if line.origin == "-":
                old.append(line.content_offset)
                old_end = line.content_offset + len(line.raw_content)
            elif line.origin == "+":
                added.append(line.content_offset)
                new_end = line.content_offset + len(line.raw_content)
        if old:
            old.append(old_end)
        else:
            old = [added[0] - growth]
        if added:
            added.append(new_end)
        else:
            added = [old[0] + growth]
        hunks.append(_Hunk((old[0], old[-1], added[0], added[-1]), tuple(old), tuple(added)))
        growth += (added[-1] - added[0]) - (old[-1] - old[0])
    return hunks


def _refine_hunk(base: bytes, new: bytes, hunk: _Hunk, by_tokens: bool) -> list[Replace]:
    span = _trim(base, new, hunk.span)
    old_lo, old_hi, new_lo, new_hi = span
    size = (old_hi - old_lo) + (new_hi - new_lo)
    if size == 0:
        return []
    if size > _TOKEN_LIMIT and 2 < len(hunk.old_lines) == len(hunk.new_lines):
        # Many lines, each changed (a rename, a reformat): line by line.
        return [
            edit
            for old, added in zip(
                itertools.pairwise(hunk.old_lines), itertools.pairwise(hunk.new_lines), strict=True
            )
            for edit in _trimmed_edit(base, new, (*old, *added))
        ]
    if not by_tokens or size < _TOKEN_MIN or size > _TOKEN_LIMIT:
        return [Replace(old_lo, old_hi, new[new_lo:new_hi])]
    if old_lo == old_hi or new_lo == new_hi:
        return [Replace(old_lo, old_hi, new[new_lo:new_hi])]  # a pure insert or delete
    return [
        edit
        for piece in _fold_short_gaps(_token_spans(base, new, span))
        for edit in _trimmed_edit(base, new, piece)
    ]


def _trimmed_edit(base: bytes, new: bytes, span: _Span) -> list[Replace]:
    """The span as one edit without its common ends; none if nothing is left."""
    old_lo, old_hi, new_lo, new_hi = _trim(base, new, span)
    if old_lo == old_hi and new_lo == new_hi:
        return []
    return [Replace(old_lo, old_hi, new[new_lo:new_hi])]


def _trim(base: bytes, new: bytes, span: _Span) -> _Span:
    """Leave out the common prefix and suffix of a span, never splitting a word or a
    UTF-8 sequence (a boundary inside one moves outward, within the span)."""
    old_lo, old_hi, new_lo, new_hi = span
    room = min(old_hi - old_lo, new_hi - new_lo)
    prefix = _common_prefix(base, old_lo, new, new_lo, room)
    suffix = _common_suffix(base, old_hi, new, new_hi, room - prefix)
    reach = _WORD_REACH
    while (
        reach
        and prefix
        and base[old_lo + prefix - 1] in _WORD_BYTES
        and (_in_word(base, old_lo + prefix, old_hi) or _in_word(new, new_lo + prefix, new_hi))
    ):
        prefix -= 1
        reach -= 1
    reach = _WORD_REACH
    while (
        reach
        and suffix
        and base[old_hi - suffix] in _WORD_BYTES
        and (
            _in_word(base, old_hi - suffix - 1, old_hi, old_lo + prefix)
            or _in_word(new, new_hi - suffix - 1, new_hi, new_lo + prefix)
        )
    ):
        suffix -= 1
        reach -= 1
    while prefix and (
        _continues(base, old_lo + prefix, old_hi) or _continues(new, new_lo + prefix, new_hi)
    ):
        prefix -= 1
    while suffix and (_continues(base, old_hi - suffix, old_hi)):
        suffix -= 1  # base and new hold the same bytes there
    return old_lo + prefix, old_hi - suffix, new_lo + prefix, new_hi - suffix


def _in_word(content: bytes, at: int, hi: int, lo: int = 0) -> bool:
    """Whether content[at] (lo <= at < hi) is a word byte."""
    return lo <= at < hi and content[at] in _WORD_BYTES


def _continues(content: bytes, at: int, hi: int) -> bool:
    """Whether a boundary before content[at] (at < hi) falls inside a UTF-8 sequence."""
    return at < hi and 0x80 <= content[at] < 0xC0


def _common_prefix(a: bytes, a_lo: int, b: bytes, b_lo: int, room: int) -> int:
    done = 0
    while done + _CHUNK <= room and (
        a[a_lo + done : a_lo + done + _CHUNK] == b[b_lo + done : b_lo + done + _CHUNK]
    ):
        done += _CHUNK
    while done < room and a[a_lo + done] == b[b_lo + done]:
        done += 1
    return done


def _common_suffix(a: bytes, a_hi: int, b: bytes, b_hi: int, room: int) -> int:
    done = 0
    while done + _CHUNK <= room and (
        a[a_hi - done - _CHUNK : a_hi - done] == b[b_hi - done - _CHUNK : b_hi - done]
    ):
        done += _CHUNK
    while done < room and a[a_hi - done - 1] == b[b_hi - done - 1]:
        done += 1
    return done


def _token_spans(base: bytes, new: bytes, span: _Span) -> list[_Span]:
    """The changed token runs of a span (xdiff over one token per line)."""
    old_lo, old_hi, new_lo, new_hi = span
    old_tokens = _TOKEN.findall(base, old_lo, old_hi)
    new_tokens = _TOKEN.findall(new, new_lo, new_hi)
    ids: dict[bytes, int] = {}
    old_lines = b"".join(b"%x\n" % ids.setdefault(t, len(ids)) for t in old_tokens)
    new_lines = b"".join(b"%x\n" % ids.setdefault(t, len(ids)) for t in new_tokens)
    old_at = list(itertools.accumulate(map(len, old_tokens), initial=old_lo))
    new_at = list(itertools.accumulate(map(len, new_tokens), initial=new_lo))
    patch = pygit2.Patch.create_from(old_lines, new_lines, context_lines=0, interhunk_lines=0)
    spans: list[_Span] = []
    for hunk in patch.hunks:
        old_first = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        new_first = hunk.new_start - 1 if hunk.new_lines else hunk.new_start
        spans.append(
            (
                old_at[old_first],
                old_at[old_first + hunk.old_lines],
                new_at[new_first],
                new_at[new_first + hunk.new_lines],
            )
        )
    return spans


def _fold_short_gaps(spans: list[_Span]) -> list[_Span]:
    """Join changed runs across an unchanged gap no longer than the changes on each side
    of it (diff-match-patch's semantic clean-up), until none is left to join."""

    def weight(span: _Span) -> int:
        return max(span[1] - span[0], span[3] - span[2])

    folded = list(spans)
    changed = True
    while changed and len(folded) > 1:
        changed = False
        out: list[_Span] = [folded[0]]
        for span in folded[1:]:
            last = out[-1]
            gap = span[0] - last[1]
            if gap <= weight(last) and gap <= weight(span):
                out[-1] = (last[0], span[1], last[2], span[3])
                changed = True
            else:
                out.append(span)
        folded = out
    return folded
