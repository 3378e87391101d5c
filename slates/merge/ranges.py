"""Byte-range edits of one file: composing them, mapping them, finding conflicts.

Theory of operation (DESIGN.md section 5).  An edit is `Replace(start, end,
data)`: replace the half-open byte range [start, end) of some version of
the file with `data` (an insert has start == end; a delete has no data).
An *edit list* is sorted, non-overlapping and relative to one version.

- `compose(base_size, ops)` turns the operations a work volume recorded,
  each in the coordinates of the file as it was at that moment, into the
  edit list that remains relative to the base: content inserted and deleted
  again leaves nothing, and a truncate-and-rewrite stays one replacement.
  It keeps a piece table (base ranges and new bytes) and reads the edits
  off it, so its cost is in the number of operations, never the file size.
- `rebase(edits, accepted, base)` maps a submission made against version k
  through the increment accepted after k (another edit list relative to
  k): an insert or replacement before a range shifts it, and overlaps are
  conflicts unless both sides wrote the same bytes there.  Mapping through
  several increments is repeated rebase.
- `apply(data, edits)` applies an edit list (for tests and small files;
  volumes splice extents instead).

Pure: bytes and tuples in, bytes and tuples out.  Called by the green
volume's submit and rebase (issue 5) and by the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from slates.errors import InvalidArgument

__all__ = [
    "Replace",
    "RangeConflict",
    "compose",
    "apply",
    "rebase",
    "check_edits",
    "overlaps",
    "lies_before",
    "merge_adjacent",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Replace:
    start: int
    end: int
    data: bytes

    @property
    def delta(self) -> int:
        return len(self.data) - (self.end - self.start)


@dataclasses.dataclass(frozen=True, slots=True)
class RangeConflict:
    """Two edits of one version that cannot both stand.

    kind: "overlap" (different bytes for shared bytes or one insertion
    point) or "insertion point deleted".  `base` is the range in the
    version both edits started from; `head` is where the accepted edit put
    its bytes in the version after it.
    """

    kind: str
    base: tuple[int, int]
    head: tuple[int, int]
    accepted: bytes
    proposed: bytes


def check_edits(edits: Sequence[Replace]) -> None:
    """Raise InvalidArgument unless `edits` is a valid edit list."""
    end = -1
    for edit in edits:
        if edit.start < 0 or edit.end < edit.start:
            raise InvalidArgument("an edit range must be 0 <= start <= end", edit=repr(edit))
        if edit.start < end or (edit.start == end and edit.start == edit.end):
            raise InvalidArgument("edits must be sorted and must not overlap", edit=repr(edit))
        end = edit.end


def apply(data: bytes, edits: Iterable[Replace]) -> bytes:
    out = bytearray()
    cursor = 0
    for edit in edits:
        if edit.start < cursor or edit.end > len(data):
            raise InvalidArgument("the edit does not fit the data", edit=repr(edit))
        out += data[cursor : edit.start]
        out += edit.data
        cursor = edit.end
    out += data[cursor:]
    return bytes(out)


# A piece is (base_start, base_end) for unchanged base bytes, or bytes.
_Piece = tuple[int, int] | bytes


def _length(piece: _Piece) -> int:
    return piece[1] - piece[0] if isinstance(piece, tuple) else len(piece)


def _cut(piece: _Piece, at: int) -> tuple[_Piece, _Piece]:
    if isinstance(piece, tuple):
        return (piece[0], piece[0] + at), (piece[0] + at, piece[1])
    return piece[:at], piece[at:]


def compose(base_size: int, ops: Iterable[Replace]) -> tuple[Replace, ...]:
    """The edit list relative to the base that the sequence of `ops` amounts to."""
    if base_size < 0:
        raise InvalidArgument("a base size is not negative")
    pieces: list[_Piece] = [(0, base_size)] if base_size else []
    for op in ops:
        size = sum(_length(p) for p in pieces)
        if op.start < 0 or op.end < op.start or op.end > size:
            raise InvalidArgument("the operation does not fit the file", op=repr(op), size=size)
        before: list[_Piece] = []
        after: list[_Piece] = []
        offset = 0
        for piece in pieces:
            length = _length(piece)
            lo, hi = offset, offset + length
            if hi <= op.start:
                before.append(piece)
            elif lo >= op.end:
                after.append(piece)
            else:
                if lo < op.start:
                    head, piece = _cut(piece, op.start - lo)
                    before.append(head)
                    lo = op.start
                if hi > op.end:
                    _dropped, tail = _cut(piece, op.end - lo)
                    after.append(tail)
            offset = hi
        pieces = [*before, *([op.data] if op.data else []), *after]
    return _edits_from(pieces, base_size)


def _edits_from(pieces: Sequence[_Piece], base_size: int) -> tuple[Replace, ...]:
    """Read an edit list off a piece table: base ranges kept in order are unchanged."""
    edits: list[Replace] = []
    cursor = 0  # next base byte not yet accounted for
    pending = bytearray()
    for piece in pieces:
        if isinstance(piece, bytes):
            pending += piece
            continue
        start, end = piece
        if start < cursor:
            raise InvalidArgument("base ranges out of order in the piece table")
        if start > cursor or pending:
            edits.append(Replace(cursor, start, bytes(pending)))
            pending.clear()
        cursor = end
    if cursor < base_size or pending:
        edits.append(Replace(cursor, base_size, bytes(pending)))
    return tuple(merge_adjacent(edits))


def merge_adjacent(edits: Iterable[Replace]) -> list[Replace]:
    out: list[Replace] = []
    for edit in edits:
        if edit.start == edit.end and not edit.data:
            continue
        if out and out[-1].end == edit.start:
            last = out.pop()
            edit = Replace(last.start, edit.end, last.data + edit.data)
        out.append(edit)
    return out


def overlaps(a: Replace, b: Replace) -> bool:
    """Whether two edits of one version touch the same bytes or insertion point."""
    if a.start == a.end and b.start == b.end:
        return a.start == b.start  # two inserts at one point
    if a.start == a.end:
        return b.start < a.start < b.end
    if b.start == b.end:
        return a.start < b.start < a.end
    return a.start < b.end and b.start < a.end


def rebase(
    edits: Sequence[Replace], accepted: Sequence[Replace]
) -> tuple[tuple[Replace, ...], tuple[RangeConflict, ...]]:
    """Map `edits` (against version k) through `accepted` (also against k).

    Returns the edits in the coordinates of the version after `accepted`,
    and the conflicts.  An edit identical to an accepted one is already
    there and maps to nothing.  With any conflict the mapped edits are not
    to be applied.
    """
    check_edits(edits)
    check_edits(accepted)
    mapped: list[Replace] = []
    conflicts: list[RangeConflict] = []
    shift = 0  # accumulated delta of accepted edits wholly before the current edit
    position = 0  # index of the first accepted edit not yet wholly before it
    for edit in edits:
        while position < len(accepted) and lies_before(accepted[position], edit):
            shift += accepted[position].delta
            position += 1
        clashing = [a for a in accepted[position:] if overlaps(a, edit)]
        if not clashing:
            mapped.append(Replace(edit.start + shift, edit.end + shift, edit.data))
            continue
        if len(clashing) == 1 and clashing[0] == edit:
            continue  # the same bytes were accepted already
        for other in clashing:
            head_start = other.start + shift + _deltas_between(accepted, position, other)
            kind = "overlap"
            if edit.start == edit.end and other.start < edit.start < other.end:
                kind = "insertion point deleted"
            conflicts.append(
                RangeConflict(
                    kind=kind,
                    base=(min(edit.start, other.start), max(edit.end, other.end)),
                    head=(head_start, head_start + len(other.data)),
                    accepted=other.data,
                    proposed=edit.data,
                )
            )
    return tuple(merge_adjacent(mapped)), tuple(conflicts)


def lies_before(accepted: Replace, edit: Replace) -> bool:
    """Whether an accepted edit lies wholly before `edit` (it only shifts it)."""
    if accepted.end < edit.start:
        return True
    if accepted.end > edit.start:
        return False
    # It ends exactly where the edit starts: a shift, unless both are inserts at
    # that one point (a clash).
    return not (accepted.start == accepted.end and edit.start == edit.end)


def _deltas_between(accepted: Sequence[Replace], position: int, other: Replace) -> int:
    total = 0
    for candidate in accepted[position:]:
        if candidate is other:
            break
        total += candidate.delta
    return total
