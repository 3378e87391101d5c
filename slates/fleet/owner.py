"""The owner of one green volume on one host: propose, commit, recover, reply.

Theory of operation (DESIGN.md section 7).  One `Owner` per (host, green)
follows the installed configuration; it writes only while the
configuration names its `Peer` (host and boot id) as owner.  States:

    IDLE        not the configured owner: Submit gets NotOwner with the
                configured owner as redirect.
    RECOVERING  authorized at a newer epoch: Prepare to every member,
                collect Promises until a write quorum (both sets while
                joint: `recovery.Successor`), adopt the chain, Gather
                missing chunks from every recorded holder (a copy may have
                rotted), `recovery.verify` it; positions beyond
                the committed prefix any promiser reported are re-accepted
                under the new epoch before any new submission is proposed.
    SERVING     the pipeline: one position in flight at a time (so every
                proposal builds on a committed predecessor, see recovery).
    SEALING     write intent reached: drain, then ask the configuration
                group to move ownership (TransferRequest); new submissions
                are redirected; a refusal or timeout resumes SERVING.
    FENCED      a holder refused our epoch: stop writing until a newer
                configuration names us again.

A position in flight (`flight.Flight`): Place on the preferred candidates,
Propose to each that acknowledged placement, commit on a write quorum of
distinct configured peers; retries, and replacement of lagging holders,
never lower what a quorum is.  Refusals: EpochFenced (or NotOwner) fences
this owner; CapacityExhausted replaces that holder; MissingContent places
again.  A submission is merged onto the head with the merge engine
(`ranges.rebase` through the increments since its base version; overlaps
are a Conflict reply that changes nothing).

Replies wait for the requested durability scope: `restart` is reached at
commit, `host` with f+1 acceptances outside the owner's host (the owner
keeps placing the committed position on outside candidates until then),
`region` with f+1 mirror holders whose committed prefix reaches the
version (mirror streams ship committed positions in order); see copies.py.
Every reply lists the scopes reached and the mirror's lag in versions, None
when no mirror holder has reported since this owner started.

During a joint configuration every write needs both quorums and the owner
ships its committed prefix to the new set; once a quorum of the new set
reports a prefix through the head, and no position placed before the joint
configuration is still in flight (an old quorum may have chosen it
unbeknown to us), it sends JointReady and the configuration group may
retire the old set.  Saved results (`results`)
come from the committed values themselves, so a successor has them too.
`commits` logs (epoch, position, digest, latency) for the simulator.
Bounded: MAX_QUEUE queued submissions and MAX_RESULTS unacknowledged
results, beyond which submissions are refused with CapacityExhausted.
Pure: inputs are messages, configurations and `now`; outputs are Outgoing.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from slates.errors import (
    CapacityExhausted,
    Conflict,
    EpochFenced,
    InvalidArgument,
    MissingContent,
    NotOwner,
    RequestExpired,
    SlatesError,
    VerificationFailed,
)
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.copies import Copies
from slates.fleet.flight import RETRY, Flight, Pending, place, preferred
from slates.fleet.ledger import (
    ChunkStore,
    RequestId,
    Value,
    increment_of,
    make_value,
    value_digest,
)
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Commit,
    Fetch,
    Gather,
    Gathered,
    JointReady,
    Message,
    Outgoing,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Refused,
    Submit,
    SubmitReply,
    TransferRequest,
)
from slates.fleet.recovery import Successor, needed_chunks, verify
from slates.fleet.results import Results
from slates.merge.ranges import Replace, apply, rebase

__all__ = ["Owner", "State", "SCOPES", "MAX_QUEUE", "WRITE_INTENT_THRESHOLD"]

SCOPES = ("restart", "host", "region")
MAX_QUEUE = 16  # queued submissions; more is CapacityExhausted
MAX_RESULTS = 256
WRITE_INTENT_THRESHOLD = 3  # consecutive remote writes from one host that move ownership
TRANSFER_TIMEOUT = 40.0


class State(enum.Enum):
    IDLE = "idle"
    RECOVERING = "recovering"
    SERVING = "serving"
    SEALING = "sealing"
    FENCED = "fenced"


@dataclasses.dataclass(slots=True)
class _Wait:
    version: int
    scope: str
    reply_to: set[str]


class Owner:
    def __init__(self, me: Peer, green: str, capacity: int) -> None:
        self.me = me
        self.green = green
        self.config: GreenConfig | None = None
        self.epoch = 0
        self.state = State.IDLE
        self.chunks = ChunkStore(capacity)
        self.ledger: list[Value] = []
        self.head_content = b""
        self.results = Results(MAX_RESULTS)
        # (epoch, position, digest, local time from first Place to commit)
        self.commits: list[tuple[int, int, bytes, float]] = []
        self.recovered = False  # recovery's re-accepted positions all committed
        self.alarms: list[str] = []
        self._queue: collections.deque[Pending] = collections.deque()
        self._fixed: collections.deque[tuple[Value, bytes]] = collections.deque()
        self._flight: Flight | None = None
        self._waits: dict[RequestId, _Wait] = {}
        self.copies = Copies()
        self._digests: list[bytes] = []
        self._successor: Successor | None = None
        self._avoid: set[Peer] = set()
        self._intent: tuple[str, int] = ("", 0)
        self._transfer_target = ""
        self._sealed_at = 0.0

    @property
    def head(self) -> int:
        return len(self.ledger)

    @property
    def in_flight(self) -> tuple[int, bytes, tuple[Peer, ...]] | None:
        """The position in flight, its digest and the candidates it was placed on."""
        if self._flight is None:
            return None
        flight = self._flight
        return flight.position, flight.digest, tuple(flight.targets)

    # -- configuration --

    def install(self, config: GreenConfig, now: float) -> list[Outgoing]:
        if self.config is not None and config.revision <= self.config.revision:
            return []  # an older or repeated configuration changes nothing
        self.config = config
        if config.owner != self.me:
            return self._lose_authority(config.owner.host)
        if config.epoch > self.epoch:
            return self._start_recovery(config, now)
        if config.epoch < self.epoch:
            raise InvalidArgument("a newer revision cannot lower the epoch", epoch=config.epoch)
        # Same authority, new holder sets (joint or retired) or mirror.
        out: list[Outgoing] = []
        if self._flight is not None:
            out += self._flight.add_targets(preferred(config, self.me.host, self._avoid))
        out += self._ship(now)
        return out

    def _lose_authority(self, redirect: str) -> list[Outgoing]:
        was = self.state
        self.state = State.IDLE
        self.epoch = max(self.epoch, self.config.epoch if self.config else 0)
        if was in (State.IDLE,):
            return []
        return self._redirect_everyone(redirect)

    def _redirect_everyone(self, redirect: str) -> list[Outgoing]:
        out: list[Outgoing] = []
        pending = list(self._queue)
        if self._flight is not None and self._flight.source is not None:
            pending.append(self._flight.source)
        for item in pending:
            for dest in item.reply_to:
                out.append(self._error(dest, item.submit, NotOwner.code, redirect))
        self._queue.clear()
        self._flight = None
        self._fixed.clear()
        self._waits.clear()
        return out

    def _start_recovery(self, config: GreenConfig, now: float) -> list[Outgoing]:
        if self._flight is not None and self._flight.source is not None:
            self._queue.appendleft(self._flight.source)
        self._flight = None
        self._fixed.clear()
        self._waits.clear()
        self.epoch = config.epoch
        self.state = State.RECOVERING
        self.recovered = False
        self._successor = Successor(now)
        self.copies.reset()
        self._intent = ("", 0)
        prepare = Prepare(self.me, self.green, self.epoch)
        return [Outgoing(peer.host, prepare) for peer in sorted(config.members())]

    # -- messages --

    def receive(self, message: Message, now: float) -> list[Outgoing]:
        match message:
            case Submit():
                return self._submit(message, now)
            case Promise():
                return self._promise(message, now)
            case Gathered():
                return self._gathered(message, now)
            case Fetch():
                return self._fetch(message)
            case PlaceAck():
                return self._place_ack(message)
            case Accepted():
                return self._accepted(message, now)
            case Refused():
                return self._refused(message, now)
            case _:
                raise InvalidArgument("not an owner message", type=type(message).__name__)

    def _authorized(self, epoch: int) -> bool:
        return (
            self.config is not None
            and self.config.owner == self.me
            and epoch == self.epoch
            and self.state in (State.RECOVERING, State.SERVING, State.SEALING)
        )

    def _submit(self, message: Submit, now: float) -> list[Outgoing]:
        dest = message.sender.host
        if self.config is None or self.state in (State.IDLE, State.FENCED):
            redirect = self.config.owner.host if self.config is not None else ""
            return [self._error(dest, message, NotOwner.code, redirect)]
        if message.scope not in SCOPES:
            return [self._error(dest, message, InvalidArgument.code, "")]
        if self.state != State.RECOVERING:
            try:
                version = self.results.lookup(message.request)
            except RequestExpired:
                return [self._error(dest, message, RequestExpired.code, "")]
            if version is not None:
                return self._await(message.request, version, message.scope, {dest}, now)
        if self._join_existing(message, dest):
            return []
        if self.state == State.SEALING:
            return [self._error(dest, message, NotOwner.code, self._transfer_target)]
        if len(self._queue) >= MAX_QUEUE or not self.results.has_room():
            return [self._error(dest, message, CapacityExhausted.code, "")]
        self._count_intent(message.route, now)
        self._queue.append(Pending(message, {dest}))
        return self._advance(now)

    def _join_existing(self, message: Submit, dest: str) -> bool:
        """A retry of a request already queued, in flight or awaiting scope joins it."""
        wait = self._waits.get(message.request)
        if wait is not None:
            wait.reply_to.add(dest)
            return True
        candidates = list(self._queue)
        if self._flight is not None and self._flight.source is not None:
            candidates.append(self._flight.source)
        for item in candidates:
            if item.submit.request == message.request:
                item.reply_to.add(dest)
                return True
        return False

    def _count_intent(self, route: str, now: float) -> None:
        if self.config is None or route == self.me.host:
            self._intent = ("", 0)
            return
        eligible = {p.host for p in self.config.holders.peers}
        if route not in eligible:
            return
        host, count = self._intent
        count = count + 1 if host == route else 1
        self._intent = (route, count)
        if count >= WRITE_INTENT_THRESHOLD and self.state == State.SERVING:
            self.state = State.SEALING
            self._transfer_target = route
            self._sealed_at = now

    def _promise(self, message: Promise, now: float) -> list[Outgoing]:
        if self.config is None or not self._authorized(message.epoch):
            return []  # a promise to an epoch we no longer act at
        successor = self._successor
        if self.state != State.RECOVERING or successor is None:
            return []  # late: recovery is done
        if message.sender in self.config.members():
            self.copies.heard(self.config, message.sender, message.prefix)
        if not successor.add(self.config, message):
            return []
        return self._gather_or_finish(now)

    def _gather_or_finish(self, now: float) -> list[Outgoing]:
        successor = self._successor
        if successor is None or successor.chain is None:
            return []
        chain, known = successor.chain, successor.known
        missing = needed_chunks(chain, self.chunks)
        if missing:
            successor.asked_at = now
            gather = Gather(self.me, self.green, missing)
            return [Outgoing(peer.host, gather) for peer in self._gather_from()]
        contents = verify(chain, self.chunks)
        self.ledger = [entry.value for entry in chain[:known]]
        self._digests = [value_digest(value) for value in self.ledger]
        self.head_content = contents[known - 1] if known else b""
        self.results = Results(MAX_RESULTS)
        for position, value in enumerate(self.ledger, start=1):
            self.results.record(value.request, value.acked_through, position)
        self._fixed = collections.deque(
            (entry.value, contents[index]) for index, entry in enumerate(chain) if index >= known
        )
        self.state = State.SERVING
        self._successor = None
        return self._advance(now)

    def _gather_from(self) -> list[Peer]:
        """Every recorded holder, not just the promisers: one copy may have rotted."""
        if self.config is None:
            return []
        peers = set(self.config.members())
        if self.config.mirror is not None:
            peers |= self.config.mirror.peers
        return sorted(peers)

    def _gathered(self, message: Gathered, now: float) -> list[Outgoing]:
        successor = self._successor
        if self.state != State.RECOVERING or successor is None or successor.chain is None:
            return []  # a late answer to a finished gather
        try:
            self.chunks.put(message.chunk, message.data)
        except VerificationFailed:
            self.alarms.append("a gathered chunk failed verification")
            return []
        except CapacityExhausted:
            # This host cannot hold the history it should serve: recovery stays
            # visibly unfinished (and alarmed) until the configuration moves it.
            self.alarms.append("no room to gather the recovered history")
            return []
        if needed_chunks(successor.chain, self.chunks):
            return []
        return self._gather_or_finish(now)

    def _fetch(self, message: Fetch) -> list[Outgoing]:
        out: list[Outgoing] = []
        for chunk in message.chunks:
            try:
                data = self.chunks.get(chunk)
            except (MissingContent, VerificationFailed):
                continue  # we cannot place what we do not hold; the holder will not ack
            out.append(Outgoing(message.sender.host, Chunk(self.me, self.green, chunk, data)))
        return out

    def _place_ack(self, message: PlaceAck) -> list[Outgoing]:
        if not self._authorized(message.epoch):
            return []  # an acknowledgement for an epoch we no longer act at
        flight = self._flight
        if flight is not None and message.position == flight.position:
            return flight.placed_on(message.sender)
        if 1 <= message.position <= self.head:
            value = self.ledger[message.position - 1]
            propose = Propose(self.me, self.green, self.epoch, message.position, value, True)
            return [Outgoing(message.sender.host, propose)]
        return []  # a placement for a position recovery discarded

    def _accepted(self, message: Accepted, now: float) -> list[Outgoing]:
        if self.config is None or not self._authorized(message.epoch):
            return []
        peer = message.sender
        self.copies.heard(self.config, peer, message.prefix)
        out: list[Outgoing] = []
        flight = self._flight
        if flight is not None and message.position == flight.position:
            if flight.accepted_by(self.config, peer, message.digest):
                out += self._commit(flight, now)
        elif 1 <= message.position <= self.head:
            if message.digest != self._digests[message.position - 1]:
                raise VerificationFailed(
                    "a holder accepted another value at a committed position",
                    position=message.position,
                )
            self.copies.accepted(message.position, peer)
            out += self._ship(now, peer=peer)
        out += self._reply_ready()
        return out

    def _refused(self, message: Refused, now: float) -> list[Outgoing]:
        if not self._authorized(message.epoch):
            return []
        match message.code:
            case EpochFenced.code | NotOwner.code:
                self.state = State.FENCED
                return self._redirect_everyone("")
            case CapacityExhausted.code:
                self._avoid.add(message.sender)
                flight = self._flight
                if self.config is None or flight is None or message.position != flight.position:
                    return []
                return flight.replace_one(self.config, self._avoid)
            case MissingContent.code:
                flight = self._flight
                if flight is not None and message.position == flight.position:
                    return [self._place_message(message.sender, flight.position, flight.value)]
                if 1 <= message.position <= self.head:
                    value = self.ledger[message.position - 1]
                    return [self._place_message(message.sender, message.position, value)]
                return []
            case _:
                raise VerificationFailed(
                    "a holder refused a proposal for an unexpected reason", code=message.code
                )

    # -- the pipeline --

    def _advance(self, now: float) -> list[Outgoing]:
        out: list[Outgoing] = []
        while self._flight is None and self.state in (State.SERVING, State.SEALING):
            if not self._fixed:
                self.recovered = True
            if self._fixed:
                value, content = self._fixed.popleft()
                out += self._start_flight(value, content, None, now)
                break
            if not self._queue:
                if self.state == State.SEALING:
                    out += self._request_transfer()
                break
            pending = self._queue.popleft()
            out += self._merge(pending, now)
        return out

    def _merge(self, pending: Pending, now: float) -> list[Outgoing]:
        submit = pending.submit
        try:
            version = self.results.lookup(submit.request)
        except RequestExpired:
            return [self._error(d, submit, RequestExpired.code, "") for d in pending.reply_to]
        if version is not None:
            return self._await(submit.request, version, submit.scope, pending.reply_to, now)
        if not 0 <= submit.base_version <= self.head:
            return [self._error(d, submit, InvalidArgument.code, "") for d in pending.reply_to]
        edits: tuple[Replace, ...] = submit.edits
        try:
            for value in self.ledger[submit.base_version :]:
                edits, conflicts = rebase(edits, increment_of(value, self.chunks))
                if conflicts:
                    raise Conflict("the submission overlaps accepted work")
            apply(self.head_content, edits)
        except SlatesError as error:
            return [self._error(d, submit, error.code, "") for d in pending.reply_to]
        value, chunks, content = make_value(
            submit.request, submit.acked_through, self.head, self.head_content, edits
        )
        need = sum(len(data) for chunk, data in chunks.items() if chunk not in self.chunks)
        if self.chunks.used + need > self.chunks.capacity:
            code = CapacityExhausted.code  # the owner's host cannot hold the new content
            return [self._error(d, submit, code, "") for d in pending.reply_to]
        for chunk, data in chunks.items():
            self.chunks.put(chunk, data)
        return self._start_flight(value, content, pending, now)

    def _start_flight(
        self, value: Value, content: bytes, source: Pending | None, now: float
    ) -> list[Outgoing]:
        if self.config is None:
            return []
        targets = preferred(self.config, self.me.host, self._avoid)
        flight = Flight(
            self.me,
            self.green,
            self.epoch,
            self.head + 1,
            value,
            value_digest(value),
            content,
            source,
            targets,
            started_at=now,
            sent_at=now,
            revision=self.config.revision,
        )
        self._flight = flight
        return flight.begin()

    def _place_message(self, peer: Peer, position: int, value: Value) -> Outgoing:
        return place(self.me, self.green, self.epoch, peer, position, value)

    def _commit(self, flight: Flight, now: float) -> list[Outgoing]:
        self.ledger.append(flight.value)
        self._digests.append(flight.digest)
        self.head_content = flight.content
        self.results.record(flight.value.request, flight.value.acked_through, flight.position)
        self.copies.committed(flight.position, flight.accepted)
        self.commits.append((self.epoch, flight.position, flight.digest, now - flight.started_at))
        self._flight = None
        notice = Commit(self.me, self.green, self.epoch, flight.position, flight.digest)
        out = [Outgoing(peer.host, notice) for peer in flight.targets]
        if flight.source is not None:
            submit = flight.source.submit
            self._waits[submit.request] = _Wait(
                flight.position, submit.scope, set(flight.source.reply_to)
            )
        else:
            # A re-accepted position: a retry already waiting in the queue for
            # this request finds the saved result when the pipeline reaches it.
            pass
        out += self._ship(now)
        out += self._advance(now)
        return out

    def _await(
        self, request: RequestId, version: int, scope: str, reply_to: set[str], now: float
    ) -> list[Outgoing]:
        wait = self._waits.get(request)
        if wait is None:
            self._waits[request] = _Wait(version, scope, set(reply_to))
        else:
            wait.reply_to |= reply_to
        return self._reply_ready()

    # -- durability scopes --

    def scopes(self, version: int) -> tuple[str, ...]:
        """The durability scopes `version` has reached (see copies.py)."""
        if self.config is None:
            return ()
        return self.copies.scopes(self.config, version, self.head)

    def mirror_lag(self) -> int | None:
        """Versions the mirror's quorum prefix trails the head; None when unknown."""
        if self.config is None:
            return None
        return self.copies.mirror_lag(self.config, self.head)

    def _reply_ready(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        for request, wait in list(self._waits.items()):
            reached = self.scopes(wait.version)
            if wait.scope not in reached:
                continue
            del self._waits[request]
            for dest in sorted(wait.reply_to):
                reply = SubmitReply(
                    self.me, self.green, request, wait.version, "", "", reached, self.mirror_lag()
                )
                out.append(Outgoing(dest, reply))
        return out

    def _error(self, dest: str, submit: Submit, code: str, redirect: str) -> Outgoing:
        reply = SubmitReply(
            self.me, self.green, submit.request, 0, code, redirect, (), self.mirror_lag()
        )
        return Outgoing(dest, reply)

    # -- streams of committed positions: mirror, joint catch-up, host scope --

    def _stream_targets(self) -> list[Peer]:
        if self.config is None or self.state not in (State.SERVING, State.SEALING):
            return []
        targets: list[Peer] = []
        if self.config.mirror is not None:
            targets += sorted(self.config.mirror.peers)
        if self.config.joint:
            targets += sorted(self.config.holders.peers)
        return targets

    def _ship(self, now: float, peer: Peer | None = None) -> list[Outgoing]:
        """Place the next committed position on each stream target that lacks it.

        One position in flight per target; it is sent again after RETRY (or
        at once if the clock jumped back).
        """
        targets = [t for t in self._stream_targets() if peer is None or t == peer]
        return [
            self._place_message(target, position, self.ledger[position - 1])
            for target, position in self.copies.stream_due(targets, self.head, now, RETRY)
        ]

    def _reinforce(self, now: float) -> list[Outgoing]:
        """Keep placing a committed position outside our host until `host` scope holds."""
        if self.config is None:
            return []
        out: list[Outgoing] = []
        for wait in self._waits.values():
            if wait.scope != "host" or "host" in self.scopes(wait.version):
                continue
            value = self.ledger[wait.version - 1]
            for peer in self.copies.lacking_outside(self.config, self.me.host, wait.version):
                out.append(self._place_message(peer, wait.version, value))
        return out

    def _joint_ready(self) -> list[Outgoing]:
        if self.config is None or not self.config.joint or self.state != State.SERVING:
            return []
        if not self.recovered:
            return []  # re-accepted positions are not yet in `head`: the prefix is unknown
        if self._flight is not None and self._flight.revision < self.config.revision:
            # Placed before the joint configuration: an old quorum alone may have
            # accepted it without our knowing, so it must commit (under both
            # quorums) before the old set may go.
            return []
        if not self.copies.new_set_holds(self.config, self.head):
            return []
        ready = JointReady(self.me, self.green, self.config.revision)
        return [Outgoing("council", ready)]

    def _request_transfer(self) -> list[Outgoing]:
        request = TransferRequest(self.me, self.green, self.epoch, self._transfer_target)
        return [Outgoing("council", request)]

    # -- time --

    def tick(self, now: float) -> list[Outgoing]:
        if self.config is None or self.state in (State.IDLE, State.FENCED):
            return []
        if self.state == State.RECOVERING:
            successor = self._successor
            if successor is None or not successor.due(now, RETRY):
                return []
            if successor.adopted:
                return self._gather_or_finish(now)
            prepare = Prepare(self.me, self.green, self.epoch)
            return [Outgoing(p.host, prepare) for p in successor.unpromised(self.config)]
        out: list[Outgoing] = []
        if self._flight is not None:
            out += self._flight.retry(self.config, self._avoid, now)
        out += self._ship(now)
        out += self._reinforce(now)
        out += self._joint_ready()
        if self.state == State.SEALING:
            if now - self._sealed_at > TRANSFER_TIMEOUT or now < self._sealed_at:
                self.state = State.SERVING  # the move did not happen: keep serving here
                self._intent = ("", 0)
                out += self._advance(now)
            elif self._flight is None and not self._queue and not self._fixed:
                out += self._request_transfer()
        return out
