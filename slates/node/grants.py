"""Write grants: a shard's promise to a mount that its next appending writes will apply.

Theory of operation: a write-through mount's bridge waits for the shard's
reply to every write(2) before it answers the kernel, so a writer streaming
a file waits on the shard's work for each write in turn.  When a write that
asked ("behind") extended its file to its end, or a create that asked made
(or found) an empty file, the shard may answer with a grant: the next
writes to that inode, each starting where the last ended (0 after a
create), up to GRANT_BYTES in all, will be applied.  It holds their room
first (the volume's in-flight bytes, so neither the quota nor the host can
refuse them), and a write under the grant ("granted") is not refused for
journal room.  The bridge then answers such writes to the kernel as soon as
they are in the ring (native/bridge_behind.c).  A grant lives until the
next request the shard takes from that ring that is not a write under it:
both sides end it there, so they agree on it without saying so.  A read
(fs.read) does not end it: it comes after the granted writes in the ring, so
it sees them, and it holds no room (an assembler reads back what it wrote).
Another client's request that names the volume waits until the mount's ring is
answered up to where it was when that request came (Shard._quiesce), so
what a program saw written is what an SDK read, write or snapshot sees.

This module is the pure part, one `LinkGrant` per ring link: the table of
(state, input) -> state the shard drives, and what room to hold.  The shard
(slates.node.shard) does the holding and releasing on the volume.

Two kinds.  An append grant (after a write at its file's end) covers writes
each starting where the last ended, and each costs its bytes.  A scattered
grant (after a create of an empty file, or a write to a file of at most
SCATTER_EXTENTS extents none of which is read from the base) covers writes
anywhere in the file short of the volume's largest file (MAX_FILE_SIZE): an
assembler or linker writes its output in pieces and goes back to fill in
headers, and such a file has no base content a write could need, so none
can fail on BaseDrift.  Each costs its bytes plus SCATTER_COST, a bound on
the pages around it (its partial first and last pages) and its extent, so
the room held still covers every write the bridge may answer early.  Both
sides count a grant's `left` the same way (`cost`).  (SCATTER_EXTENTS keeps
the look at the extents, one per write that asked, short.)

    state   input                                   next    effect
    IDLE    a write that asked, applied at its end  HELD    hold room, reply "grant"
    IDLE    a write that asked, to a file with no   HELD    hold room, reply "grant" (scattered)
            base content (SCATTER_EXTENTS)
    IDLE    a create that asked, of an empty file   HELD    hold room, reply "grant" (scattered)
    IDLE    anything else                           IDLE    -
    HELD    a write under it that fits              HELD*   release, apply, hold what is left
    HELD    a read (fs.read)                        HELD    -
    HELD    anything else (and the link's end)      IDLE    release the room

(*) or IDLE when nothing is left to promise.  A "granted" write that arrives
with no grant (the bridge resending after a restart, whose grant died with
the old shard) is an ordinary write: it may be refused like any other, and
the bridge reports that on the inode's next write or fsync.

Runs.  When the shard falls behind a writer, writes under the grant queue in
the ring (the bridge answers up to eight early).  Writes queued one after
another, each under what the one before leaves of the grant and starting
where it ended, asking for the same things, may be applied as one write
(`joins_run`; the shard keeps each one's reply): what they leave of the
grant is what they would have left one by one, since `left` counts each
write's cost and `held` less what the volume charged them all.  At most
RUN_WRITES writes and RUN_BYTES bytes go as one.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from slates.core.volume import MAX_FILE_SIZE
from slates.errors import InvalidArgument

__all__ = [
    "GRANT_BYTES",
    "GRANT_MARGIN",
    "SCATTER_COST",
    "SCATTER_EXTENTS",
    "Grant",
    "GrantState",
    "LinkGrant",
    "RUN_BYTES",
    "RUN_WRITES",
    "cost",
    "joins_run",
]

GRANT_BYTES = 8 << 20  # what a bridge may answer early before it hears back
# What the writes of one grant may be charged beyond their bytes (their first and
# last partial pages, extent metadata): held with the grant so it cannot run out.
GRANT_MARGIN = 256 << 10
# What a scattered grant counts a write beyond its bytes (see the module docstring):
# two partial pages and a page's worth for its extent.  The shard sends it with the
# grant ("scatter"), so the bridge counts with the same number.
SCATTER_COST = 3 * 4096
# The most extents a file may have for a write to it to bring a scattered grant.
SCATTER_EXTENTS = 256
RUN_WRITES = 16  # queued writes under a grant applied as one write, at most
RUN_BYTES = 1 << 20  # ... and their bytes


class GrantState(enum.Enum):
    IDLE = "idle"
    HELD = "held"


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """What is promised: writes to `ino` of `volume` from `end` on (anywhere in it,
    for a file with no base content: `scattered`), costing `left` in all (`cost`),
    with `held` bytes of the volume's room held for them."""

    volume: str
    ino: int
    end: int
    left: int
    held: int
    scattered: bool = False


def cost(grant: Grant, size: int) -> int:
    """What a write of `size` bytes takes of `grant`'s `left`."""
    return size + SCATTER_COST if grant.scattered else size


def _write_under(grant: Grant, op: str, args: dict[str, Any]) -> bool:
    data, offset = args.get("data"), args.get("offset")
    return (
        op == "fs.write"
        and args.get("granted") is True
        and args.get("volume") == grant.volume
        and args.get("ino") == grant.ino
        and isinstance(offset, int)
        and (offset == grant.end or (grant.scattered and offset >= 0))
        and isinstance(data, bytes)
        and len(data) > 0
        and offset + len(data) <= MAX_FILE_SIZE
        and cost(grant, len(data)) <= grant.left
    )


def joins_run(grant: Grant, run: list[dict[str, Any]], args: dict[str, Any]) -> bool:
    """Whether a write with `args` may be applied with `run` (the args of writes
    already taken as one run under `grant`, in ring order) as one write."""
    if len(run) >= RUN_WRITES:
        return False
    end, left, size = grant.end, grant.left, 0
    for earlier in run:
        length = len(earlier["data"])
        end, left, size = earlier["offset"] + length, left - cost(grant, length), size + length
    if run:
        first = run[0]
        same = all(args.get(k) == v for k, v in first.items() if k not in ("offset", "data"))
        if not same or len(args) != len(first) or args.get("offset") != end:
            return False
    data = args.get("data")
    if not isinstance(data, bytes) or size + len(data) > RUN_BYTES:
        return False
    return _write_under(dataclasses.replace(grant, end=end, left=left), "fs.write", args)


class LinkGrant:
    """One ring link's grant (see the module docstring)."""

    __slots__ = ("grant",)

    def __init__(self) -> None:
        self.grant: Grant | None = None

    @property
    def state(self) -> GrantState:
        return GrantState.IDLE if self.grant is None else GrantState.HELD

    def receive(self, op: str, args: dict[str, Any]) -> tuple[Grant | None, bool]:
        """A request arrives: (the grant whose room to release now, or None; whether
        the request is a write under it).  The link is IDLE after, but for a read,
        which keeps what it holds (it sees the writes before it in the ring and
        changes no room)."""
        if op == "fs.read":  # any state, a read: the same state
            return None, False
        grant, self.grant = self.grant, None
        if grant is None:  # IDLE, any other request: IDLE
            return None, False
        return grant, _write_under(grant, op, args)  # HELD, any other request: IDLE

    def offer(
        self, volume: str, ino: int, end: int, left: int, held: int, *, scattered: bool = False
    ) -> Grant:
        """After a write at its file's end, or to a file with no base content, or a
        create of an empty file (those two `scattered`):
        the grant now held (IDLE -> HELD; a HELD link must have been through `receive`
        first, so that is refused)."""
        if self.grant is not None:
            raise InvalidArgument("a link holds one grant at a time", ino=self.grant.ino)
        if left <= 0 or held < left or end < 0:
            raise InvalidArgument("a grant promises some bytes and holds room for them")
        self.grant = Grant(volume, ino, end, left, held, scattered)
        return self.grant

    def end(self) -> Grant | None:
        """The link ends: the grant whose room to release, if any (-> IDLE)."""
        grant, self.grant = self.grant, None
        return grant
