"""Fencing at the owner: may this host's shard still make versions of a green?

Theory of operation (DESIGN.md section 7, "Failover": "the old owner, even if
alive, cannot gather a quorum under its old epoch").  The holders refuse an
old epoch, but a shard makes a version before its link ships it, so an owner
that is alive and cut off would go on answering its local clients with
versions nobody else will ever hold.  The fleet link therefore keeps, per
green it knows, whether this host can still *prove* that it owns it, and the
shard refuses a submission (EpochFenced, or NotOwner naming the committed
owner) once it cannot:

- Ownership is proven by the host's lease in etcd.  A successor commits a
  takeover only after the owner boot's alive key is gone from etcd
  (slates.fleet.link_replicate: Takeover), i.e. after its lease lapsed, and
  etcd lets a lease lapse no sooner than its TTL after the last keepalive
  it granted; the takeover's transaction also compares that alive key with
  what the successor read (slates.fleet.etcd.Council.commit_config), so an
  old owner that put it back under a new lease first stops the takeover.
  So from a keepalive *sent* at monotonic time t the host owns what it
  owned until t + TTL (less CLOCK_MARGIN of it, for the clocks'
  rates): that is the table's `until`, the same for every green.
- The configuration read from etcd says who owns each green.  A read proves
  anything only if it began after the alive key was put back under the
  current lease (`lease_since`: a lease that lapsed may have let a successor
  commit before that): until such a read, a green this host owned is
  `unproven`.
- A green whose configuration names another peer is `moved` (NotOwner with
  that host and epoch); one naming this host with another boot id (an
  earlier boot's) is `stale` (EpochFenced), and so is this host's original
  copy of a green it later adopted again from the holders (a new local id
  serves the fleet name; the old one is no copy of it any more).
- A green the table does not name (not registered in etcd yet, or a host
  without a fleet) is not fenced: it has no other owner to defer to.

`build_table` makes the table from those records (pure), `encode_table` /
`decode_table` its msgpack form, `admit` the shard's decision (pure, `now`
passed in).  The table travels as a file the link rewrites atomically
(slates.fleet.link_fence), which the shard reads only when it changed: the
shard's loop never waits on the link or the network, and a link that hangs
or dies stops renewing `until`, so its shard fences itself (fail safe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import msgpack

from slates.errors import EpochFenced, InvalidArgument, NotOwner
from slates.fleet.config import GreenConfig, Peer

__all__ = [
    "CLOCK_MARGIN",
    "FenceEntry",
    "FenceTable",
    "admit",
    "build_table",
    "decode_table",
    "encode_table",
    "lease_until",
]

CLOCK_MARGIN: Final = 0.1  # of the TTL, kept back for the clocks' rates
STATES: Final = frozenset({"owner", "unproven", "moved", "stale"})
MAX_ENTRIES: Final = 1 << 16
FORMAT: Final = 1


@dataclasses.dataclass(frozen=True, slots=True)
class FenceEntry:
    state: str  # one of STATES
    owner_host: str  # the committed owner's host
    epoch: int  # the committed epoch


@dataclasses.dataclass(frozen=True, slots=True)
class FenceTable:
    until: float  # monotonic seconds: this host's ownership is proven until then
    greens: Mapping[tuple[int, str], FenceEntry]  # (shard, local green id) -> entry


def lease_until(sent_at: float, ttl: float) -> float:
    """How long a keepalive (or grant) sent at `sent_at` proves the lease alive."""
    return sent_at + ttl * (1.0 - CLOCK_MARGIN)


def build_table(
    me: Peer,
    configs: Iterable[GreenConfig],
    local_of: Callable[[str], tuple[int, str] | None],
    until: float,
    lease_since: float,
    configs_read_at: float,
    superseded: Iterable[tuple[int, str]] = (),
) -> FenceTable:
    """The table for `configs` (read from etcd starting at `configs_read_at`) while the
    alive key, put under the current lease at `lease_since`, is proven until `until`.  `local_of`
    names a green's local copy here ((shard, id)), None for a green not here;
    `superseded` are local greens that are no copy of their fleet green any more (this
    host's original copy of a green it later adopted again from the holders)."""
    proven = configs_read_at >= lease_since
    greens: dict[tuple[int, str], FenceEntry] = {
        local: FenceEntry("stale", me.host, 0) for local in superseded
    }
    for config in configs:
        local = local_of(config.green)
        if local is None:
            continue
        owner = config.owner
        if owner == me:
            state = "owner" if proven else "unproven"
        elif owner.host == me.host:
            state = "stale"
        else:
            state = "moved"
        greens[local] = FenceEntry(state, owner.host, config.epoch)
    if len(greens) > MAX_ENTRIES:
        raise InvalidArgument("too many greens to fence", limit=MAX_ENTRIES)
    return FenceTable(until, greens)


def admit(table: FenceTable | None, shard: int, green: str, now: float) -> None:
    """Raise unless shard `shard` may make a version of its green `green` at `now`."""
    entry = None if table is None else table.greens.get((shard, green))
    if table is None or entry is None:
        return
    match entry.state:
        case "owner" if now <= table.until:
            return
        case "owner":
            raise EpochFenced(
                "this host's lease in etcd was not renewed in time: it cannot prove it "
                "still owns the green, so it makes no versions of it",
                green=green,
                epoch=entry.epoch,
                owner_host=entry.owner_host,
            )
        case "unproven":
            raise EpochFenced(
                "this host's lease in etcd lapsed and its ownership is not proven again yet",
                green=green,
                epoch=entry.epoch,
            )
        case "moved":
            raise NotOwner(
                "etcd has committed another owner of this green",
                green=green,
                owner_host=entry.owner_host,
                epoch=entry.epoch,
            )
        case "stale":
            raise EpochFenced(
                "etcd names an earlier boot of this host as the green's owner",
                green=green,
                epoch=entry.epoch,
            )
        case other:
            raise InvalidArgument("unknown fence state", state=other)


def encode_table(table: FenceTable) -> bytes:
    rows = [
        [shard, local, e.state, e.owner_host, e.epoch]
        for (shard, local), e in sorted(table.greens.items())
    ]
    packed: bytes = msgpack.packb({"format": FORMAT, "until": table.until, "greens": rows})
    return packed


def decode_table(data: bytes) -> FenceTable:
    try:
        raw: Any = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as exc:
        raise InvalidArgument("a fence table is msgpack", reason=str(exc)) from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise InvalidArgument("not a fence table of a known format")
    until, rows = raw.get("until"), raw.get("greens")
    if not isinstance(until, (int, float)) or isinstance(until, bool):
        raise InvalidArgument("a fence table has its time", field="until")
    if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
        raise InvalidArgument("a fence table has a bounded list of greens", field="greens")
    greens: dict[tuple[int, str], FenceEntry] = {}
    for row in rows:
        match row:
            case [int(shard), str(local), str(state), str(owner_host), int(epoch)] if (
                state in STATES
            ):
                greens[(shard, local)] = FenceEntry(state, owner_host, epoch)
            case _:
                raise InvalidArgument("a fence table row is malformed", row=repr(row)[:100])
    return FenceTable(float(until), greens)
