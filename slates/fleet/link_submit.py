"""The fleet link's remote submissions: run once on the green's owner, answered again.

Theory of operation (DESIGN.md section 7, "Remote reads"; the shard's side
is slates.node.remote_ops, the link's other remote asks are
slates.fleet.link_remote).  A shard of this host submits a remote work
volume as `{"op": "remote.submit", "green", "version", "ops", "request",
"dry_run"?, "durability"?, "durability_timeout"?}` on fleet.sock.
`request` is the submission's identity: the shard makes it from the
volume and the (client, seq) of the agent's submit request, so the SDK's
retry of a lost reply (the same client and seq, over a new connection)
carries the same identity, also after a shard restart dropped the job.

- Origin (`origin`): the message goes to the green's committed owner
  (etcd's configuration) as `{"kind": "remote", "op": "submit", ...}` over
  QUIC, or is run here when this host owns the green.  The peer pool
  resends the same bytes over a new connection when a reply is lost
  (slates.fleet.link_forward.PeerPool); NotOwner refreshes the
  configuration and goes again, at most OWNER_ATTEMPTS times.
- Owner (`owned`): the identity is keyed by the host that sent it (the one
  the QUIC handshake authenticated, never a field of the message), so a
  host can neither replay nor read another's submissions.  A first ask
  runs the submission (`run`, given by slates.fleet.link_remote: a
  scratch work volume of the base version gets the ops, is submitted and
  deleted) and keeps its reply in `answered`, the most recent
  MAX_ANSWERED of them; an ask whose identity is answered gets the kept
  reply; an ask whose identity is running waits for that run, at most
  WAIT_SECONDS.  A failed run keeps nothing: the owner answered no version,
  so running it again is safe.  The reply is kept as soon as the owner
  answers the submission, before a durability wait, so a retry after a
  wait that timed out waits again instead of submitting again.
- `{"op": "remote.drop_replies", "count": N}` on fleet.sock: a fault for
  tests, the next N submissions this host answers for a peer are run and
  kept, and their replies dropped (the peer sees Unavailable, as if the
  reply were lost, and resends over a new connection).

A retry that reaches a new owner after a failover (or this owner after
`answered` forgot it) is answered from the ledger: the version a submission
made carries its identity into the replicated value, and the successor's
recovery rebuilds identity -> version (slates.fleet.link_identity), so
`owned` answers `recovered_reply` (the version, `recovered: true`) instead of
running it again.  Each run is bracketed by `made_by.started` / `ended`, so
no export of the green goes out before the run reported its version.
Known gap: a restarted owner link (a new boot) has neither its kept replies
nor its own ledger table; the successor's recovery is what restores them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from slates.errors import InvalidArgument, NotOwner, SlatesError, Unavailable
from slates.fleet.ledger import RequestId
from slates.fleet.link_identity import submission_request
from slates.fleet.link_replicate import Replicator
from slates.node.protocol import pack, unpack

__all__ = ["MAX_ANSWERED", "Submissions", "recovered_reply", "submission_identity"]

MAX_ANSWERED: Final = 1024  # kept replies per owner link
MAX_IDENTITY: Final = 200
MAX_DROPS: Final = 100
OWNER_ATTEMPTS: Final = 4
WAIT_SECONDS: Final = 600.0
SUBMIT_TIMEOUT: Final = 60.0  # one submission on the owner, beyond its durability wait
DURABILITY_SECONDS: Final = 60.0  # the owner's durability wait when none is given

PeerCall = Callable[[str, bytes, float], Awaitable[bytes]]
RunSubmission = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
AfterSubmission = Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any]]]


def submission_identity(message: dict[str, Any]) -> str:
    """The `request` of a submission message: 1..MAX_IDENTITY characters."""
    found = message.get("request")
    if not isinstance(found, str) or not 0 < len(found) <= MAX_IDENTITY:
        raise InvalidArgument(
            f"a remote submission names its request identity (1..{MAX_IDENTITY} characters)"
        )
    return found


@dataclasses.dataclass(slots=True)
class _Running:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


class Submissions:
    """One per fleet link (module doc)."""

    def __init__(
        self,
        me: str,
        replicator: Replicator,
        peer_call: PeerCall,
        run: RunSubmission,
        after: AfterSubmission,
    ) -> None:
        self.me = me
        self.replicator = replicator
        self._peer = peer_call
        self._run = run
        self._after = after  # the durability wait, on every answer (kept or new)
        self.answered: collections.OrderedDict[tuple[str, str], dict[str, Any]] = (
            collections.OrderedDict()
        )
        self.running: dict[tuple[str, str], _Running] = {}
        self.runs = 0  # submissions this link ran on its shards (kept answers excluded)
        self.recovered = 0  # retries answered from the ledger's identities (link_identity)
        self.drops = 0

    # -- origin

    async def origin(self, green: str, message: dict[str, Any]) -> dict[str, Any]:
        identity = submission_identity(message)
        body: dict[str, Any] = {
            key: message[key]
            for key in ("green", "version", "ops", "dry_run", "durability", "durability_timeout")
            if key in message
        }
        wait = message.get("durability_timeout") or (
            DURABILITY_SECONDS if "durability" in body else 0
        )
        timeout = SUBMIT_TIMEOUT + (float(wait) if isinstance(wait, (int, float)) else 0.0)
        failure: SlatesError = Unavailable("the owner did not answer", green=green)
        for _ in range(OWNER_ATTEMPTS):
            owner = (await self.replicator.config(green)).owner.host
            try:
                if owner == self.me:
                    return await self.owned(self.me, identity, green, body)
                payload = pack({"kind": "remote", "op": "submit", "request": identity, **body})
                answer = unpack(await self._peer(owner, payload, timeout))
            except NotOwner as exc:
                failure = exc
                await self.replicator.refresh()
                continue
            if not isinstance(answer, dict):
                raise Unavailable("the owner answered no submission", owner=owner)
            return answer
        raise failure

    # -- owner

    async def serve(self, peer: str, message: dict[str, Any]) -> dict[str, Any]:
        """A peer's submission (module doc); the test fault drops its reply."""
        identity = submission_identity(message)
        green = message.get("green")
        if not isinstance(green, str):
            raise InvalidArgument("names a green", field="green")
        reply = await self.owned(peer, identity, green, message)
        if self.drops:
            self.drops -= 1
            raise Unavailable("the reply was dropped (a test fault)", request=identity)
        return reply

    async def owned(
        self, peer: str, identity: str, green: str, message: dict[str, Any]
    ) -> dict[str, Any]:
        config = self.replicator.configs.get(green)
        if config is None or config.owner != self.replicator.me:
            config = await self.replicator.config(green)
            if config.owner != self.replicator.me:
                raise NotOwner(
                    "this host does not own the green", green=green, owner_host=config.owner.host
                )
        key = (peer, identity)
        while key in self.running:  # a retry of a run still going: its answer is ours
            with trio.move_on_after(WAIT_SECONDS):
                await self.running[key].done.wait()
            if key in self.running:
                raise Unavailable("the first run of this submission did not end", request=identity)
        reply = self.answered.get(key)
        if reply is None:
            made = self.replicator.made_by.version_of(green, peer, identity)
            if made is not None:  # made before a failover (or long ago): the ledger knows
                reply = recovered_reply(made, message)
                self.recovered += 1
                self._keep(key, reply)
        if reply is None:
            running = self.running[key] = _Running()
            made_here: tuple[int, RequestId] | None = None
            self.replicator.made_by.started(green)
            try:
                reply = await self._run(green, message)
                self.runs += 1
                version = reply.get("version")
                if reply.get("made_version") is True and isinstance(version, int):
                    made_here = (version, submission_request(peer, identity))
                self._keep(key, reply)
            finally:
                self.replicator.made_by.ended(green, made_here)
                del self.running[key]
                running.done.set()
        else:
            self.answered.move_to_end(key)
        return await self._after(green, message, reply)

    def _keep(self, key: tuple[str, str], reply: dict[str, Any]) -> None:
        self.answered[key] = reply
        while len(self.answered) > MAX_ANSWERED:
            self.answered.popitem(last=False)

    def drop_replies(self, count: object) -> dict[str, Any]:
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_DROPS:
            raise InvalidArgument(f"drop 0..{MAX_DROPS} replies", count=str(count))
        self.drops = count
        return {"drop_replies": count}

    def stats(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "answered": len(self.answered),
            "running": len(self.running),
            "recovered": self.recovered,
        }


def recovered_reply(version: int, message: dict[str, Any]) -> dict[str, Any]:
    """The answer to a retry of a submission that made `version` under an earlier owner
    (its reply was that owner's RAM): the version, and the paths the ops named."""
    ops = message.get("ops")
    paths: set[str] = set()
    if isinstance(ops, list):
        for item in ops:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict):
                path = item[1].get("path")
                if isinstance(path, str):
                    paths.add(path)
    return {
        "ok": True,
        "version": version,
        "conflicts": [],
        "made_version": True,
        "nothing": False,
        "dry_run": False,
        "private": [],
        "paths": sorted(paths),
        "refined": [],
        "literal": [],
        "recovered": True,
    }
