"""Saved results keyed by request identity, released by acknowledged sequences.

Theory of operation (DESIGN.md section 7, "Network Transfers and Request
Retries").  A request is identified by (authenticated origin, client,
sequence), never by the connection or route it came over; the same
sequence from another client or origin is another request.  The owner
saves, for each committed request, the version it produced; a retry of it
(over any route, to any owner, after any failover) gets that version back
instead of a second commit.  Every submission carries the client's
acknowledged sequence: requests at or below it are released and a later
retry of one is refused (RequestExpired) rather than executed again.

Because both the request id and the acknowledged sequence travel inside
each committed ledger value, a successor rebuilds this table exactly by
replaying the recovered ledger (`record` in position order): saved results
survive failover without a separate replication path.  Bounded: at most
`limit` unreleased results: the owner asks `has_room` before proposing and
refuses new work (CapacityExhausted) instead of forgetting results.
"""

from __future__ import annotations

from slates.errors import RequestExpired
from slates.fleet.ledger import RequestId

__all__ = ["Results"]


class Results:
    __slots__ = ("_released", "_saved", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._saved: dict[RequestId, int] = {}
        self._released: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def lookup(self, request: RequestId) -> int | None:
        """The version a committed request produced, None if it never committed.

        Raises RequestExpired for a request its client already acknowledged.
        """
        version = self._saved.get(request)
        if version is not None:
            return version
        if request.seq <= self._released.get((request.origin, request.client), 0):
            raise RequestExpired(
                "the client acknowledged this request; its result is released",
                origin=request.origin,
                client=request.client,
                seq=request.seq,
            )
        return None

    def has_room(self) -> bool:
        return len(self._saved) < self.limit

    def record(self, request: RequestId, acked_through: int, version: int) -> None:
        """Save a committed request's version and release what its client acknowledged."""
        key = (request.origin, request.client)
        if acked_through > self._released.get(key, 0):
            self._released[key] = acked_through
            for old in [r for r in self._saved if (r.origin, r.client) == key]:
                if old.seq <= acked_through:
                    del self._saved[old]
        if request.seq > self._released.get(key, 0):
            self._saved[request] = version
