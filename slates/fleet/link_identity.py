"""Which submission made which version: the identities that travel with the ledger.

Theory of operation (DESIGN.md section 7, "request identity = (authenticated
origin, client id, sequence)").  A remote submission (slates.fleet.link_submit)
has an identity: the host that sent it (the QUIC handshake authenticated it)
and its `request` string.  The owner's link runs it once and keeps its reply,
but those kept replies are the owner link's RAM: a successor after a failover
would run a retry again and make a second version.  So the identity travels
inside the replicated version itself: the ledger value of a version made by a
remote submission carries `RequestId(origin host, request, 0)` instead of the
owner's export identity (slates.fleet.replica.version_value), every holder
stores it with the value, and a successor's recovery reads it back from the
adopted chain (`adopt_chain`), so the new owner answers a retry with the
original version.

`MadeBy` keeps, per green (fleet name), version -> identity (what an export
of that version must carry: a re-export after the export cache dropped it
makes the same value, digest and all) and identity -> version (what a retry
is answered with).  Ordering: a version's identity must be known before the
version is exported, or its value would go out without it.  The submission
path brackets each run with `started` / `ended`, and an export waits
(`quiet`, at most QUIET_SECONDS) while a run of that green is going, so the
background shipping loop never exports a version whose run has not reported
it yet.  Past QUIET_SECONDS the export goes on without the identity (a run
that long has failed or hangs; a retry of it then runs again, as before).

Bounds: MAX_IDENTITIES per green (the oldest versions' identities are
forgotten first: a retry that old runs again).  Runs in the link's trio
thread only; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import trio

from slates.fleet.ledger import RequestId, Value
from slates.fleet.replica import EXPORT_CLIENT

__all__ = ["MAX_IDENTITIES", "QUIET_SECONDS", "MadeBy", "submission_request"]

MAX_IDENTITIES: Final = 1 << 16
QUIET_SECONDS: Final = 120.0


def submission_request(origin: str, identity: str) -> RequestId:
    """The ledger's request id of a remote submission from host `origin`."""
    return RequestId(origin, identity, 0)


class MadeBy:
    def __init__(self) -> None:
        self._identity: dict[str, dict[int, RequestId]] = {}
        self._version: dict[str, dict[tuple[str, str], int]] = {}
        self._runs: dict[str, int] = {}
        self._changed = trio.Event()

    # -- the table

    def record(self, green: str, version: int, request: RequestId) -> None:
        if request.client == EXPORT_CLIENT:
            return  # the owner's own export identity: no submission to answer again
        identities = self._identity.setdefault(green, {})
        versions = self._version.setdefault(green, {})
        identities[version] = request
        versions[(request.origin, request.client)] = version
        while len(identities) > MAX_IDENTITIES:
            oldest = min(identities)
            gone = identities.pop(oldest)
            versions.pop((gone.origin, gone.client), None)

    def adopt_chain(self, green: str, values: Iterable[Value]) -> None:
        """A recovered chain (position 1 first, i.e. version 0 first)."""
        for version, value in enumerate(values):
            self.record(green, version, value.request)

    def request_of(self, green: str, version: int) -> RequestId | None:
        """The identity an export of `version` carries (None: the export identity)."""
        return self._identity.get(green, {}).get(version)

    def version_of(self, green: str, origin: str, identity: str) -> int | None:
        """The version the submission (origin, identity) made, if it made one."""
        return self._version.get(green, {}).get((origin, identity))

    # -- ordering against exports

    def started(self, green: str) -> None:
        self._runs[green] = self._runs.get(green, 0) + 1

    def ended(self, green: str, made: tuple[int, RequestId] | None) -> None:
        if made is not None:
            self.record(green, *made)
        left = self._runs.get(green, 0) - 1
        if left > 0:
            self._runs[green] = left
        else:
            self._runs.pop(green, None)
        self._changed.set()
        self._changed = trio.Event()

    async def quiet(self, green: str) -> None:
        """Wait (at most QUIET_SECONDS) until no run of `green` is going."""
        with trio.move_on_after(QUIET_SECONDS):
            while self._runs.get(green):
                await self._changed.wait()
