"""Merging an outside edit of the target into a landing's proposal (`rewitness --merge`).

Theory of operation (DESIGN.md section 6 and 5a, issue 11 item 7).  A
manifest entry conflicts when the developer edited the disk after the
witness.  For a regular file on all three sides (witness, disk,
proposal) the two changes of the witness are refined into edit lists
(slates.merge.refine: a line-anchored diff, byte-exact inside the changed
lines) and merged with the range engine (slates.merge.ranges.rebase, the
same rule submit uses): the agents' edits are mapped into the disk's
coordinates and applied to the disk's bytes, so the developer's own line
is kept.  The new entry witnesses the disk as it is now and proposes the
merged bytes; it needs a new approval like any new manifest.

Edits that overlap (different bytes for the same bytes or insertion
point), a mode both sides changed differently, a file too large to
refine, or content that no longer matches its state are not merged: the
entry stays as it was (it will conflict) and `Unmerged` says why.

`merge_entry` is pure: it takes the entry, the disk's state and the three
contents (the caller reads them) and returns `Merged` or `Unmerged`.
`needs_merge` tells which entries have something to merge.  Called by
slates.node.landing_ops for `land.rewitness` with merge.
"""

from __future__ import annotations

import dataclasses

import blake3

from slates.land.manifest import Entry, State, explain
from slates.merge.ranges import apply, rebase
from slates.merge.refine import REFINE_LIMIT, is_binary, refine

__all__ = ["Merged", "Unmerged", "merge_entry", "needs_merge"]


@dataclasses.dataclass(frozen=True, slots=True)
class Merged:
    """The new entry (witness: the disk now; proposal: the merge) and the bytes of both."""

    entry: Entry
    content: bytes  # the merged proposal
    disk: bytes  # the disk's bytes, the new witness


@dataclasses.dataclass(frozen=True, slots=True)
class Unmerged:
    path: str
    reason: str


def needs_merge(entry: Entry, disk: State | None) -> bool:
    """Whether landing `entry` would conflict now (the disk is neither witness nor proposal)."""
    return disk != entry.witnessed and disk != entry.proposed


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def merge_entry(
    entry: Entry,
    disk_state: State | None,
    witness: bytes | None,
    disk: bytes | None,
    proposal: bytes | None,
    *,
    limit: int = REFINE_LIMIT,
) -> Merged | Unmerged:
    """The entry with the outside edit merged into its proposal, or why it cannot be.

    `witness`, `disk` and `proposal` are the contents of the three states
    (None when the caller could not get one); each is checked against its
    state's BLAKE3 before anything is merged.
    """
    _decision, reason = explain(entry.witnessed, disk_state, entry.proposed)
    why = reason or "the disk holds the witness or the proposal"  # needs_merge says no
    witnessed, proposed = entry.witnessed, entry.proposed
    if not (
        witnessed is not None
        and proposed is not None
        and disk_state is not None
        and witnessed.kind == proposed.kind == disk_state.kind == "file"
    ):
        if witnessed is None:
            return Unmerged(entry.path, f"{why}; nothing was witnessed here to merge on")
        if proposed is None:
            return Unmerged(entry.path, f"{why}; the proposal deletes it, nothing to merge")
        return Unmerged(entry.path, f"{why}; not a regular file on all sides, so nothing is merged")
    if witness is None or _digest(witness) != witnessed.digest:
        return Unmerged(
            entry.path,
            f"{why}; the witnessed content is no longer held (an earlier rewitness read it"
            " from disk), so there is no base to merge on: review it and rewitness",
        )
    if disk is None or _digest(disk) != disk_state.digest:
        return Unmerged(entry.path, "the disk changed again while it was being read")
    if proposal is None or _digest(proposal) != proposed.digest:
        return Unmerged(entry.path, "the proposed content is not held any more")
    mode = _merged_mode(witnessed.mode, disk_state.mode, proposed.mode)
    if mode is None:
        return Unmerged(
            entry.path,
            f"both changed the mode: {disk_state.mode:o} on disk, {proposed.mode:o} proposed,"
            f" {witnessed.mode:o} witnessed",
        )
    if any(is_binary(content) for content in (witness, disk, proposal)):
        return Unmerged(entry.path, f"{why}; binary content is not merged (as git would not)")
    outside = refine(witness, disk, limit=limit)
    agents = refine(witness, proposal, limit=limit)
    if outside is None or agents is None:
        return Unmerged(entry.path, f"{why}; too large to refine (the limit is {limit:,} B)")
    mapped, conflicts = rebase(agents, outside)
    if conflicts:
        first = conflicts[0]
        start, end = first.base
        lines = (_line_of(witness, start), _line_of(witness, max(start, end - 1)))
        where = f"line {lines[0]}" if lines[0] == lines[1] else f"lines {lines[0]}-{lines[1]}"
        return Unmerged(
            entry.path,
            f"the outside edit overlaps the proposal ({first.kind} at {where} of the witness,"
            f" bytes {start}-{end}; {len(conflicts)} overlapping region"
            f"{'s' if len(conflicts) > 1 else ''}): left for a person or agent to resolve",
        )
    merged = apply(disk, mapped)
    renewed = Entry(entry.path, disk_state, State("file", _digest(merged), mode))
    return Merged(renewed, merged, disk)


def _merged_mode(witnessed: int, disk: int, proposed: int) -> int | None:
    """The three-way merge of permission bits: whichever side changed them (None: both did,
    differently)."""
    if proposed == witnessed or disk == proposed:
        return disk
    if disk == witnessed:
        return proposed
    return None
