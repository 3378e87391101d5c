"""Conflict reports: the smallest region where the accepted and the proposed file differ.

Theory of operation (DESIGN.md section 5a, issue 11).  A byte-range
conflict names the accepted edit's range in the head file and the author's
bytes, but either range can be far larger than the difference that matters:
a file rewritten whole is one edit of all its bytes, identical on both
sides almost everywhere.  `smallest_region` finds what to show instead:

1. Diff the head file (which holds the accepted change) against the work
   file (the author's) with libgit2's line diff on buffers; every hunk is a
   pair of byte ranges, one in each file, and the bytes between hunks are
   the same on both sides; a hunk of as many lines on each side is split
   into its pairs of differing lines.  Files above MAX_DIFF_BYTES are diffed in a
   window of DIFF_WINDOW bytes around the two ranges (a range too long for
   a window is looked for where the other one lies); if even that is too
   big, the two ranges themselves are compared.
2. Keep the hunks that touch both the accepted range (in the head file) and
   the proposed range (in the work file), allowing for a hunk that could
   slide over equal bytes to touch them.  A hunk that touches only one of
   them is some other change (agent B's rewrite also changed line 300, the
   head holds other accepted edits) and is not this conflict's business.
   Given the base file, of those the hunks that both sides changed from
   the base (what `git merge` would call the conflict; with both sides a
   whole-file rewrite, the lines only one of them changed merge).  If none
   touches both, the hunks that touch the accepted range; if none
   does either, the two sides agree around the accepted range and the
   region is empty on both sides.
3. The span from the first kept hunk to the last is refined byte by byte
   (a diff of one byte per line) when it is longer than REFINE_ABOVE and at
   most MAX_BYTE_DIFF, so a long line or a binary file yields the bytes that
   differ, not the whole line; then the common prefix and suffix of the
   span are trimmed (prefix first), never sliding it off the accepted range;
   in text, whole UTF-8 characters are trimmed, and a region that still
   cuts one (a byte-level hunk did) is widened over the bytes they share.
4. Context is what precedes and follows the region on both sides alike: up
   to `context_lines` lines (text) or BINARY_CONTEXT bytes, at most
   MAX_CONTEXT_BYTES.  Line numbers count b"\\n" (so CRLF files count
   right and the b"\\r" stays in the bytes).  Given the base file, the
   region is mapped back through the diffs of base to head and base to
   work: the base bytes either side replaced there.
5. The bytes of each side are cut at MAX_REGION_BYTES and flagged
   `truncated`; offsets and line numbers always describe the whole region.

Invariants of a returned Region: head_file[accepted.start:accepted.end]
starts with accepted.data (equals it unless truncated), likewise proposed
in work_file; `before` ends both head_file[:accepted.start] and
work_file[:proposed.start], `after` starts both head_file[accepted.end:]
and work_file[proposed.end:]; the region touches the accepted range
[head[0], head[1]] (and the proposed range too whenever a difference
touching both exists and no repeated bytes make its place ambiguous);
accepted and proposed bytes do not both start, nor both end, alike (but
for the bytes of a UTF-8 character they share, in text).

Pure: bytes in, records out (libgit2's diff runs on buffers).  Called by
slates.node.service when it turns a conflict into its wire form, and by
the tests; slates_cli/conflicts.py renders the wire form.
"""

from __future__ import annotations

import bisect
import codecs
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import pygit2

from slates.errors import InvalidArgument
from slates.merge.changes import Conflict
from slates.merge.ranges import Replace

__all__ = [
    "MAX_REGION_BYTES",
    "MAX_CONTEXT_BYTES",
    "BINARY_CONTEXT",
    "MAX_DIFF_BYTES",
    "Side",
    "Region",
    "smallest_region",
    "proposed_offset",
    "looks_like_text",
    "region_to_wire",
    "region_from_wire",
]

MAX_REGION_BYTES = 4096  # bytes of each side carried in a report
MAX_CONTEXT_BYTES = 1024  # bytes of context before and after
BINARY_CONTEXT = 32  # bytes of context for binary files
MAX_DIFF_BYTES = 4 << 20  # files up to this are line-diffed whole
DIFF_WINDOW = 512 << 10  # beyond it, this many bytes around the ranges
REFINE_ABOVE = 256  # a kept span longer than this is refined byte by byte ...
MAX_BYTE_DIFF = 256 << 10  # ... if neither side exceeds this
_CHUNK = 1 << 16  # largest block compared, counted or decoded at once

_DIFF_FLAGS = pygit2.enums.DiffOption.FORCE_TEXT  # we decide what is text, not libgit2


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """The region in one file: byte offsets in that whole file, its bytes, its lines."""

    start: int
    end: int
    data: bytes  # the differing bytes, at most MAX_REGION_BYTES of them
    line: int | None  # 1-based line of `start` (text files), else None
    end_line: int | None  # 1-based line of the last byte (of `start` when empty)
    truncated: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    accepted: Side  # in the head file
    proposed: Side  # in the work volume's file
    base: Side | None  # in the base file, where the region maps back (None: unknown)
    before: bytes  # the same bytes precede the region on both sides
    after: bytes  # the same bytes follow it on both sides
    text: bool  # the files look like text (UTF-8, no NUL)


@dataclasses.dataclass(frozen=True, slots=True)
class _Hunk:
    """One difference: old[old_start:old_end] became new[new_start:new_end]."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int


# A span: (head start, head end, work start, work end).
_Span = tuple[int, int, int, int]


def looks_like_text(*files: bytes) -> bool:
    """Text: every file decodes as UTF-8 and holds no NUL byte."""
    for data in files:
        if b"\0" in data:
            return False
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:  # a block at a time: a big file is never held as a str
            for at in range(0, len(data), _CHUNK):
                decoder.decode(data[at : at + _CHUNK])
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
    return True


def proposed_offset(own_edits: Sequence[Replace], conflict: Conflict) -> int | None:
    """Where the author's conflicting bytes sit in the work file, from its own edit list.

    `own_edits` is the author's edit list of the file relative to the base
    (as recorded, before mapping); the edit is the one whose bytes are
    conflict.proposed and that meets conflict.base; it lands shifted by the
    author's earlier edits.  None if no edit matches.
    """
    if conflict.proposed is None:
        return None
    shift = 0
    for edit in own_edits:
        meets = conflict.base is None or (
            edit.start <= conflict.base[1] and conflict.base[0] <= edit.end
        )
        if edit.data == conflict.proposed and meets:
            return edit.start + shift
        shift += edit.delta
    return None


def smallest_region(
    conflict: Conflict,
    *,
    head_file: bytes,
    work_file: bytes,
    proposed_at: int,
    base_file: bytes | None = None,
    context_lines: int = 2,
) -> Region | None:
    """The smallest region where the accepted and the proposed file differ, for a conflict.

    conflict.head is the accepted edit's range in head_file and
    conflict.accepted its bytes; conflict.proposed are the author's bytes,
    at offset `proposed_at` of work_file; base_file (optional) is the file
    in the submission's base version.  None for kinds without byte ranges,
    or when the files do not hold those bytes there.
    """
    if context_lines < 0:
        raise InvalidArgument("context_lines is not negative", context_lines=context_lines)
    if conflict.head is None or conflict.accepted is None or conflict.proposed is None:
        return None
    h0, h1 = conflict.head
    p0, p1 = proposed_at, proposed_at + len(conflict.proposed)
    if not (0 <= h0 <= h1 <= len(head_file)) or not (0 <= p0 <= p1 <= len(work_file)):
        return None
    if head_file[h0:h1] != conflict.accepted or work_file[p0:p1] != conflict.proposed:
        return None
    head, work = bytes(head_file), bytes(work_file)
    text = looks_like_text(head, work)
    changes: _Changes | None = None
    if base_file is not None and max(len(base_file), len(head), len(work)) <= MAX_DIFF_BYTES:
        changes = _Changes.of(bytes(base_file), head, work)
    span = _region(head, work, (h0, h1), (p0, p1), changes, text)
    if text:
        span = _whole_characters(head, work, span)
    start_h, end_h, start_w, end_w = span
    before, after = _context(head, work, span, text, context_lines)
    base = None if changes is None else _base_side(changes, head, work, span, text)
    return Region(
        accepted=_side(head, start_h, end_h, text),
        proposed=_side(work, start_w, end_w, text),
        base=base,
        before=before,
        after=after,
        text=text,
    )


# -- finding the region -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Changes:
    """What each side changed relative to the base: line hunks of base to head, base to work."""

    base: bytes
    to_head: Sequence[_Hunk]
    to_work: Sequence[_Hunk]
    head_ends: Sequence[int]  # new_end of each hunk of to_head, for bisecting
    work_ends: Sequence[int]

    @classmethod
    def of(cls, base: bytes, head: bytes, work: bytes) -> _Changes:
        to_head, to_work = _line_hunks(base, head), _line_hunks(base, work)
        return cls(
            base, to_head, to_work, [h.new_end for h in to_head], [h.new_end for h in to_work]
        )

    def both(self, hunk: _Hunk) -> bool:
        """Whether both sides changed the bytes of this head-to-work hunk (a real conflict)."""
        return _changed(self.to_head, self.head_ends, hunk.old_start, hunk.old_end) and _changed(
            self.to_work, self.work_ends, hunk.new_start, hunk.new_end
        )


def _changed(hunks: Sequence[_Hunk], ends: Sequence[int], start: int, end: int) -> bool:
    """Whether a base-to-file hunk shares bytes with [start, end) of the file (or, for an
    insertion point on either side, touches it): a neighbouring line changed is not enough."""
    at = bisect.bisect_left(ends, start)
    while at < len(hunks) and hunks[at].new_start <= end:
        hunk = hunks[at]
        if hunk.new_start == hunk.new_end or start == end:
            if hunk.new_start <= end and start <= hunk.new_end:
                return True
        elif hunk.new_start < end and start < hunk.new_end:
            return True
        at += 1
    return False


def _region(
    head: bytes,
    work: bytes,
    accepted: tuple[int, int],
    proposed: tuple[int, int],
    changes: _Changes | None,
    text: bool,
) -> _Span:
    h0, h1 = accepted
    p0, p1 = proposed
    window = _windows(len(head), len(work), accepted, proposed)
    if window is None:  # too big to diff: compare the two ranges themselves
        return _trim(head, work, (h0, h1, p0, p1), accepted, text=text)
    lo_h, hi_h, lo_w, hi_w = window
    hunks = [
        _Hunk(h.old_start + lo_h, h.old_end + lo_h, h.new_start + lo_w, h.new_end + lo_w)
        for h in _line_hunks(head[lo_h:hi_h], work[lo_w:hi_w])
    ]
    span = _kept_span(head, work, hunks, window, accepted, proposed, changes)
    if span is None:
        position = _aligned(head, work, hunks, window, h0)
        return (h0, h0, position, position)
    longest = max(span[1] - span[0], span[3] - span[2])
    if REFINE_ABOVE < longest <= MAX_BYTE_DIFF:
        lo_h, hi_h, lo_w, hi_w = span
        fine = [
            _Hunk(h.old_start + lo_h, h.old_end + lo_h, h.new_start + lo_w, h.new_end + lo_w)
            for h in _byte_hunks(head[lo_h:hi_h], work[lo_w:hi_w])
        ]
        span = _kept_span(head, work, fine, span, accepted, proposed, changes) or span
    return _trim(head, work, span, accepted, text=text)


def _windows(
    head_size: int, work_size: int, accepted: tuple[int, int], proposed: tuple[int, int]
) -> _Span | None:
    """The parts of the files to diff: all of them, a window around the ranges, or None.

    A range too long for a window (a big file rewritten whole) is looked
    for where the other range lies: a rewrite keeps most bytes in place.
    """
    if head_size <= MAX_DIFF_BYTES and work_size <= MAX_DIFF_BYTES:
        return (0, head_size, 0, work_size)
    longest = MAX_DIFF_BYTES - 2 * DIFF_WINDOW
    on_head, on_work = accepted, proposed
    if proposed[1] - proposed[0] > longest:
        on_work = (min(accepted[0], work_size), min(accepted[1], work_size))
    if accepted[1] - accepted[0] > longest:
        on_head = (min(proposed[0], head_size), min(proposed[1], head_size))
    lo_h, hi_h = max(0, on_head[0] - DIFF_WINDOW), min(head_size, on_head[1] + DIFF_WINDOW)
    lo_w, hi_w = max(0, on_work[0] - DIFF_WINDOW), min(work_size, on_work[1] + DIFF_WINDOW)
    if max(hi_h - lo_h, hi_w - lo_w) > MAX_DIFF_BYTES:
        return None  # both ranges are too long
    return (lo_h, hi_h, lo_w, hi_w)


def _hunks(old: bytes, new: bytes, *, by_byte: bool) -> list[_Hunk]:
    """libgit2's hunks of a diff of old and new, as byte ranges of each.

    By line, or by byte (each byte becomes a line of hex, so a line number
    is an offset).  A hunk of as many lines on both sides is split into its
    pairs of lines that differ ("line-anchored, then byte-exact"), so that
    two neighbouring changed lines are two differences, not one.
    """
    if by_byte:
        diffed = [data.hex("\n").encode() + b"\n" if data else b"" for data in (old, new)]
    else:
        diffed = [old, new]
    patch = pygit2.Patch.create_from(
        diffed[0], diffed[1], context_lines=0, interhunk_lines=0, flag=_DIFF_FLAGS
    )
    spans: list[tuple[int, int, int, int]] = []  # first line and line count, old then new
    for hunk in patch.hunks:
        # A side with no lines names the line after which the other side's lines go.
        first_old = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        first_new = hunk.new_start - 1 if hunk.new_lines else hunk.new_start
        if hunk.old_lines == hunk.new_lines:
            spans += [(first_old + k, 1, first_new + k, 1) for k in range(hunk.old_lines)]
        else:
            spans.append((first_old, hunk.old_lines, first_new, hunk.new_lines))
    if by_byte:
        old_at: dict[int, int] | None = None
        new_at: dict[int, int] | None = None
    else:
        old_at = _line_offsets(old, [n for s in spans for n in (s[0], s[0] + s[1])])
        new_at = _line_offsets(new, [n for s in spans for n in (s[2], s[2] + s[3])])
    out: list[_Hunk] = []
    for first_old, old_lines, first_new, new_lines in spans:
        found = _Hunk(
            first_old if old_at is None else old_at[first_old],
            first_old + old_lines if old_at is None else old_at[first_old + old_lines],
            first_new if new_at is None else new_at[first_new],
            first_new + new_lines if new_at is None else new_at[first_new + new_lines],
        )
        if old[found.old_start : found.old_end] != new[found.new_start : found.new_end]:
            out.append(found)
    return out


def _line_offsets(data: bytes, lines: Iterable[int]) -> dict[int, int]:
    """Where the given (0-based) lines start; len(data) for the line after the last.

    Newlines are counted a block at a time, so the cost is in blocks and
    wanted lines, not in the lines of the file.
    """
    out: dict[int, int] = {}
    position, seen = 0, 0  # `seen` newlines lie before `position`
    for wanted in sorted(set(lines)):
        while seen < wanted:
            end = min(len(data), position + _CHUNK)
            count = data.count(b"\n", position, end)
            if seen + count >= wanted:
                break
            seen, position = seen + count, end
            if end == len(data):
                break
        while seen < wanted and position < len(data):
            newline = data.find(b"\n", position)
            if newline < 0:
                position = len(data)
                break
            seen, position = seen + 1, newline + 1
        out[wanted] = position if seen >= wanted else len(data)
    return out


def _line_hunks(old: bytes, new: bytes) -> list[_Hunk]:
    return _hunks(old, new, by_byte=False)


def _byte_hunks(old: bytes, new: bytes) -> list[_Hunk]:
    return _hunks(old, new, by_byte=True)


def _touches(lo: int, hi: int, target: tuple[int, int]) -> bool:
    """Closed intervals meet: an insertion point at either end of a range touches it."""
    return lo <= target[1] and target[0] <= hi


def _kept_span(
    head: bytes,
    work: bytes,
    hunks: Sequence[_Hunk],
    window: _Span,
    accepted: tuple[int, int],
    proposed: tuple[int, int],
    changes: _Changes | None,
) -> _Span | None:
    """The bounds of the hunks that belong to this conflict (step 2), or None.

    The bounds reach over equal bytes to the neighbouring hunks (or the
    window's edges), no further than the accepted range, so that trimming
    can slide the region over equal bytes onto the ranges.
    """
    reaches = []
    for index in range(len(hunks)):
        bounds = _bounds(hunks, index, index, window)
        right = _trim(head, work, bounds, None)
        left = _trim(head, work, bounds, None, suffix_first=True)
        reaches.append(((left[0], right[1]), (left[2], right[3])))
    kept = [
        i
        for i, (on_head, on_work) in enumerate(reaches)
        if _touches(*on_head, accepted) and _touches(*on_work, proposed)
    ]
    if changes is not None:
        # A hunk only one side changed from the base merges; it is not this conflict.
        kept = [i for i in kept if changes.both(hunks[i])] or kept
    if not kept:
        kept = [i for i, (on_head, _) in enumerate(reaches) if _touches(*on_head, accepted)]
    if not kept:
        return None
    first, last = hunks[kept[0]], hunks[kept[-1]]
    prev_h, next_h, _prev_w, _next_w = _bounds(hunks, kept[0], kept[-1], window)
    start_h = max(prev_h, min(first.old_start, accepted[0]))
    end_h = min(next_h, max(last.old_end, accepted[1]))
    # Between hunks the bytes are equal, so the work side's bounds follow the head's.
    return (
        start_h,
        end_h,
        first.new_start - (first.old_start - start_h),
        last.new_end + (end_h - last.old_end),
    )


def _bounds(hunks: Sequence[_Hunk], first: int, last: int, window: _Span) -> _Span:
    """From the end of the hunk before `first` to the start of the one after `last`."""
    lo_h, hi_h, lo_w, hi_w = window
    if first > 0:
        lo_h, lo_w = hunks[first - 1].old_end, hunks[first - 1].new_end
    if last + 1 < len(hunks):
        hi_h, hi_w = hunks[last + 1].old_start, hunks[last + 1].new_start
    return (lo_h, hi_h, lo_w, hi_w)


def _aligned(head: bytes, work: bytes, hunks: Sequence[_Hunk], window: _Span, position: int) -> int:
    """Where a head offset that no difference touches lies in the work file.

    Between hunks the bytes are equal; inside a hunk the offset lies in the
    bytes its two sides share at their start or at their end.
    """
    shift = window[2] - window[0]
    for hunk in hunks:
        if position < hunk.old_start:
            break
        if position < hunk.old_end:
            into = position - hunk.old_start
            prefix = _common_prefix(
                head, hunk.old_start, hunk.old_end, work, hunk.new_start, hunk.new_end
            )
            if into <= prefix:
                return hunk.new_start + into
            return max(hunk.new_start, hunk.new_end - (hunk.old_end - position))
        shift = hunk.new_end - hunk.old_end
    return position + shift


def _trim(
    head: bytes,
    work: bytes,
    span: _Span,
    accepted: tuple[int, int] | None,
    *,
    suffix_first: bool = False,
    text: bool = False,
) -> _Span:
    """Drop the common prefix and suffix of head[span] and work[span].

    Prefix first (suffix first when asked); in text, whole characters only.
    With the accepted range given, the region never slides past its ends,
    so it keeps touching it (the work side follows; where the two ranges
    cannot both be touched by a smallest region, which needs repeated
    bytes, the accepted one wins).
    """
    start_h, end_h, start_w, end_w = span
    if suffix_first:
        suffix = _common_suffix(head, start_h, end_h, work, start_w, end_w)
        end_h, end_w = end_h - suffix, end_w - suffix
        prefix = _common_prefix(head, start_h, end_h, work, start_w, end_w)
        return (start_h + prefix, end_h, start_w + prefix, end_w)
    prefix = _common_prefix(head, start_h, end_h, work, start_w, end_w)
    if accepted is not None:
        prefix = min(prefix, max(0, accepted[1] - start_h))
    while text and prefix and _splits(head, work, start_h + prefix, start_w + prefix):
        prefix -= 1
    start_h, start_w = start_h + prefix, start_w + prefix
    suffix = _common_suffix(head, start_h, end_h, work, start_w, end_w)
    if accepted is not None:
        suffix = min(suffix, max(0, end_h - max(accepted[0], start_h)))
    while text and suffix and _splits(head, work, end_h - suffix, end_w - suffix):
        suffix -= 1
    return (start_h, end_h - suffix, start_w, end_w - suffix)


def _splits(head: bytes, work: bytes, at_head: int, at_work: int) -> bool:
    """Whether a cut there splits a UTF-8 character on either side."""
    return _continues(head, at_head) or _continues(work, at_work)


def _common_prefix(a: bytes, a0: int, a1: int, b: bytes, b0: int, b1: int) -> int:
    """Length of the common prefix of a[a0:a1] and b[b0:b1], comparing blocks at once."""
    limit = min(a1 - a0, b1 - b0)
    done, step = 0, 64
    while done < limit:
        size = min(step, limit - done)
        if a[a0 + done : a0 + done + size] == b[b0 + done : b0 + done + size]:
            done, step = done + size, min(step * 2, _CHUNK)
        elif size == 1:
            return done
        else:
            step = size // 2
    return limit


def _common_suffix(a: bytes, a0: int, a1: int, b: bytes, b0: int, b1: int) -> int:
    limit = min(a1 - a0, b1 - b0)
    done, step = 0, 64
    while done < limit:
        size = min(step, limit - done)
        if a[a1 - done - size : a1 - done] == b[b1 - done - size : b1 - done]:
            done, step = done + size, min(step * 2, _CHUNK)
        elif size == 1:
            return done
        else:
            step = size // 2
    return limit


def _continues(data: bytes, at: int) -> bool:
    """Whether data[at] continues a UTF-8 character (a cut there would split it)."""
    return at < len(data) and 0x80 <= data[at] < 0xC0


def _whole_characters(head: bytes, work: bytes, span: _Span) -> _Span:
    """Widen a text region over shared bytes until neither side splits a character."""
    start_h, end_h, start_w, end_w = span
    while (
        start_h > 0
        and start_w > 0
        and (_continues(head, start_h) or _continues(work, start_w))
        and head[start_h - 1] == work[start_w - 1]
    ):
        start_h, start_w = start_h - 1, start_w - 1
    end_h, end_w = max(end_h, start_h), max(end_w, start_w)
    while (
        end_h < len(head)
        and end_w < len(work)
        and (_continues(head, end_h) or _continues(work, end_w))
        and head[end_h] == work[end_w]
    ):
        end_h, end_w = end_h + 1, end_w + 1
    return (start_h, end_h, start_w, end_w)


# -- context, lines, the base -------------------------------------------------------


def _context(
    head: bytes, work: bytes, span: _Span, text: bool, context_lines: int
) -> tuple[bytes, bytes]:
    """The bytes before and after the region that both sides share (a few lines or bytes)."""
    start_h, end_h, start_w, end_w = span
    if text:
        first = _line_start(head, start_h)
        for _ in range(context_lines):
            if first == 0:
                break
            first = _line_start(head, first - 1)
        first = max(first, start_h - MAX_CONTEXT_BYTES)
        last = end_h
        wanted = context_lines + (1 if end_h > 0 and head[end_h - 1 : end_h] != b"\n" else 0)
        for _ in range(wanted):
            newline = head.find(b"\n", last)
            last = len(head) if newline < 0 else newline + 1
            if newline < 0:
                break
        last = min(last, end_h + MAX_CONTEXT_BYTES)
    else:
        first = max(0, start_h - BINARY_CONTEXT)
        last = min(len(head), end_h + BINARY_CONTEXT)
    shared_before = _common_suffix(head, first, start_h, work, 0, start_w)
    shared_after = _common_prefix(head, end_h, last, work, end_w, len(work))
    return head[start_h - shared_before : start_h], head[end_h : end_h + shared_after]


def _line_start(data: bytes, offset: int) -> int:
    return data.rfind(b"\n", 0, offset) + 1


def _side(data: bytes, start: int, end: int, text: bool) -> Side:
    line = end_line = None
    if text:
        line = data.count(b"\n", 0, start) + 1
        end_line = line + data.count(b"\n", start, max(start, end - 1))
    cut = end - start > MAX_REGION_BYTES
    return Side(
        start=start,
        end=end,
        data=data[start : min(end, start + MAX_REGION_BYTES)],
        line=line,
        end_line=end_line,
        truncated=cut,
    )


def _base_side(changes: _Changes, head: bytes, work: bytes, span: _Span, text: bool) -> Side:
    """The base bytes that the head or the work replaced inside the region."""
    start_h, end_h, start_w, end_w = span
    base, to_head, to_work = changes.base, changes.to_head, changes.to_work
    start = min(
        _map_back(base, head, to_head, start_h, left=True),
        _map_back(base, work, to_work, start_w, left=True),
    )
    end = max(
        _map_back(base, head, to_head, end_h, left=False),
        _map_back(base, work, to_work, end_w, left=False),
    )
    return _side(base, start, max(start, end), text)


def _map_back(
    old: bytes,
    new: bytes,
    hunks: Sequence[_Hunk],
    position: int,
    *,
    left: bool,
    refine: bool = True,
) -> int:
    """Where an offset of the new file lies in the old one.

    Inside a changed hunk it is refined byte by byte (if the hunk is small
    enough), else it widens to the hunk's old range (its start for a
    region's start, its end for a region's end); at a point where the new
    file dropped old bytes it widens over them.
    """
    shift = 0
    for hunk in hunks:
        if position < hunk.new_start or (
            position == hunk.new_start and hunk.new_end > hunk.new_start
        ):
            break
        if position < hunk.new_end or hunk.new_start == hunk.new_end == position:
            sizes = (hunk.old_end - hunk.old_start, hunk.new_end - hunk.new_start)
            if not refine or max(sizes) > MAX_BYTE_DIFF or min(sizes) == 0:
                return hunk.old_start if left else hunk.old_end
            old_part = old[hunk.old_start : hunk.old_end]
            new_part = new[hunk.new_start : hunk.new_end]
            fine = _byte_hunks(old_part, new_part)
            inner = _map_back(
                old_part, new_part, fine, position - hunk.new_start, left=left, refine=False
            )
            return hunk.old_start + inner
        shift = hunk.new_end - hunk.old_end
    return position - shift


# -- wire form -------------------------------------------------------------------


def _side_to_wire(side: Side) -> dict[str, Any]:
    return {
        "start": side.start,
        "end": side.end,
        "data": side.data,
        "line": side.line,
        "end_line": side.end_line,
        "truncated": side.truncated,
    }


def region_to_wire(region: Region) -> dict[str, Any]:
    """msgpack- and JSON-friendly (the bytes stay bytes; the CLI's JSON makes them latin-1)."""
    return {
        "accepted": _side_to_wire(region.accepted),
        "proposed": _side_to_wire(region.proposed),
        "base": None if region.base is None else _side_to_wire(region.base),
        "before": region.before,
        "after": region.after,
        "text": region.text,
    }


def _optional_int(raw: Any) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise InvalidArgument("a malformed number in a conflict region", value=repr(raw)[:32])
    return raw


def _side_from_wire(raw: Any) -> Side:
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), bytes):
        raise InvalidArgument("a malformed side of a conflict region")
    start, end = _optional_int(raw.get("start")), _optional_int(raw.get("end"))
    if start is None or end is None or end < start or len(raw["data"]) > end - start:
        raise InvalidArgument("a malformed range in a conflict region")
    return Side(
        start=start,
        end=end,
        data=raw["data"],
        line=_optional_int(raw.get("line")),
        end_line=_optional_int(raw.get("end_line")),
        truncated=bool(raw.get("truncated", False)),
    )


def region_from_wire(raw: Any) -> Region:
    """Decode and validate a region (as a client receives it)."""
    if not isinstance(raw, dict):
        raise InvalidArgument("a conflict region must be a map")
    before, after = raw.get("before"), raw.get("after")
    if not isinstance(before, bytes) or not isinstance(after, bytes):
        raise InvalidArgument("a conflict region's context must be bytes")
    return Region(
        accepted=_side_from_wire(raw.get("accepted")),
        proposed=_side_from_wire(raw.get("proposed")),
        base=None if raw.get("base") is None else _side_from_wire(raw["base"]),
        before=before,
        after=after,
        text=bool(raw.get("text", False)),
    )
