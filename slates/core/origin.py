"""Where each byte of a file came from: the recorded byte ranges of a work volume.

Theory of operation (DESIGN.md section 5, product description "Recording
File Operations").  A file being recorded carries an *origin*: its bytes
as an ordered run of pieces, each either `length` bytes copied unchanged
from offset `source` of the file as it was when recording began, or
`length` new bytes (source NEW).  Every content operation (write,
truncate, splice, punch hole, shared range) is one call of `replace_span`:
replace [start, end) of the current file with `new_length` new bytes.  A
write over bytes that happen to be equal still counts as new: the record
over-approximates what changed, never under-approximates.

`edits_of` reads the result off as the edit list relative to the start
(gaps in the unchanged runs plus the new runs), so temporary content
inserted and deleted again leaves nothing and a truncate-and-rewrite stays
one whole replacement.  The cost is in the number of pieces, never the
file size; nothing here holds file bytes.

Pieces are a flat tuple (source, length, source, length, ...) so the inode
that carries them stays small and hashable.  Pure; called by
slates.core.volume for every content record and by slates.merge.
"""

from __future__ import annotations

from slates.errors import InvalidArgument

__all__ = ["NEW", "Pieces", "identity", "replace_span", "edit_spans"]

NEW = -1
Pieces = tuple[int, ...]


def identity(size: int) -> Pieces:
    """The origin of a file nobody has changed since recording began."""
    return (0, size) if size else ()


def _append(out: list[int], source: int, length: int) -> None:
    if length <= 0:
        return
    if out:
        last_source, last_length = out[-2], out[-1]
        if (source == NEW and last_source == NEW) or (
            source != NEW and last_source != NEW and last_source + last_length == source
        ):
            out[-1] = last_length + length
            return
    out += (source, length)


def replace_span(pieces: Pieces, start: int, end: int, new_length: int) -> Pieces:
    """The origin after [start, end) of the file is replaced by `new_length` new bytes."""
    size = sum(pieces[1::2])
    if not 0 <= start <= end <= size or new_length < 0:
        raise InvalidArgument("the span does not fit the file", start=start, end=end, size=size)
    before: list[int] = []
    after: list[int] = []
    offset = 0
    for i in range(0, len(pieces), 2):
        source, length = pieces[i], pieces[i + 1]
        lo, hi = offset, offset + length
        offset = hi
        if lo < start:
            _append(before, source, min(hi, start) - lo)
        if hi > end:
            skip = max(0, end - lo)
            _append(after, source if source == NEW else source + skip, length - skip)
    _append(before, NEW, new_length)
    for i in range(0, len(after), 2):
        _append(before, after[i], after[i + 1])
    return tuple(before)


def edit_spans(pieces: Pieces, original_size: int) -> list[tuple[int, int, int, int]]:
    """The edits relative to the original: (start, end, at, length) each.

    Replace [start, end) of the original with `length` bytes found at offset
    `at` of the current file.  Sorted, non-overlapping, never empty edits.
    """
    edits: list[tuple[int, int, int, int]] = []
    cursor = 0  # next original byte not yet accounted for
    at = 0  # offset in the current file
    pending_at, pending_length = 0, 0
    for i in range(0, len(pieces), 2):
        source, length = pieces[i], pieces[i + 1]
        if source == NEW:
            if not pending_length:
                pending_at = at
            pending_length += length
        else:
            if source < cursor:
                raise InvalidArgument("original bytes out of order in an origin")
            if source > cursor or pending_length:
                edits.append((cursor, source, pending_at, pending_length))
                pending_length = 0
            cursor = source + length
        at += length
    if cursor < original_size or pending_length:
        edits.append((cursor, original_size, pending_at if pending_length else at, pending_length))
    return edits
