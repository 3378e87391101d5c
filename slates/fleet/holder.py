"""A holder: one host's acceptor for the ledgers of many green volumes.

Theory of operation (DESIGN.md section 7).  Per green a holder keeps its
promised epoch, the proposal it accepted at each position (epoch, value,
digest), the positions it knows are committed (with their digests) and the
contiguous committed prefix; per host it keeps the verified chunks
(`ChunkStore`) that those values reference.  It answers:

- Place: refuse an epoch older than the promise (EpochFenced); reserve
  space for the chunks it lacks (CapacityExhausted if they cannot fit),
  Fetch them from the owner, and send PlaceAck only when every chunk of
  the manifest is held and verified (Chunk bytes that do not match their
  BLAKE3 id are dropped and fetched again on the owner's retry).
- Propose: refuse an older epoch, refuse a value whose chunks are not held
  (MissingContent); otherwise accept it, raise the promise to its epoch and
  answer Accepted with the committed prefix.  `committed=True` (catch-up of
  a position the owner already committed) marks it committed too.
- Commit: mark the position committed if the accepted value has that
  digest (a lagging holder that accepted something else learns it by
  catch-up, never by trusting a digest alone).
- Prepare at epoch e >= promise: promise e and report every accepted
  proposal and the committed prefix (Promise).  Gather: send verified
  chunks to a successor.
- Read: serve a committed version only after recomputing it from the
  retained inputs, root by root from version 0 (MissingContent when an
  input is gone, VerificationFailed and an alarm on a mismatch).

Installing a configuration raises the promise to its epoch (old owners are
fenced as soon as the holder learns the new one) and records which peer
owns which epoch, so a message claiming an epoch for another peer is
refused (NotOwner).  A host that lost its RAM builds a new Holder with a
new boot id: it holds nothing and its replies carry the new identity.
Invariants: the promise never decreases; a position's accepted epoch never
decreases; a committed digest never changes (a conflicting one raises
VerificationFailed: it would mean two values committed at one position).
Called by `node.Node`; pure.
"""

from __future__ import annotations

import dataclasses

from slates.errors import (
    CapacityExhausted,
    InvalidArgument,
    MissingContent,
    SlatesError,
    VerificationFailed,
)
from slates.fleet.config import GreenConfig, Peer
from slates.fleet.ledger import ChunkStore, Value, recompute, value_digest
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Commit,
    Entry,
    Fetch,
    Gather,
    Gathered,
    Message,
    Outgoing,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Read,
    ReadReply,
    Refused,
)

__all__ = ["Holder", "Slot", "MAX_PLACEMENTS"]

MAX_PLACEMENTS = 64  # concurrent placements per green; more is CapacityExhausted


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    epoch: int
    value: Value
    digest: bytes


@dataclasses.dataclass(slots=True)
class _Placement:
    epoch: int
    owner: str
    manifest: tuple[tuple[bytes, int], ...]
    missing: dict[bytes, int]  # chunk id -> reserved size


@dataclasses.dataclass(slots=True)
class _Green:
    promised: int = 0
    revision: int = 0
    accepted: dict[int, Slot] = dataclasses.field(default_factory=dict)
    committed: dict[int, bytes] = dataclasses.field(default_factory=dict)
    prefix: int = 0
    placing: dict[int, _Placement] = dataclasses.field(default_factory=dict)
    owners: dict[int, Peer] = dataclasses.field(default_factory=dict)


class Holder:
    def __init__(self, me: Peer, capacity: int) -> None:
        self.me = me
        self.chunks = ChunkStore(capacity)
        self.reserved = 0
        self.alarms: list[str] = []
        self.changes = 0  # counts acceptances and commit marks (cheap change detection)
        self._greens: dict[str, _Green] = {}

    # -- inspection (tests, the simulator's invariants) --

    def promised(self, green: str) -> int:
        return self._green(green).promised

    def accepted(self, green: str) -> dict[int, Slot]:
        return self._green(green).accepted

    def committed(self, green: str) -> dict[int, bytes]:
        return self._green(green).committed

    def prefix(self, green: str) -> int:
        return self._green(green).prefix

    def _green(self, green: str) -> _Green:
        state = self._greens.get(green)
        if state is None:
            state = self._greens[green] = _Green()
        return state

    # -- inputs --

    def install(self, config: GreenConfig) -> None:
        state = self._green(config.green)
        if config.revision <= state.revision:
            return  # an older or repeated configuration changes nothing
        state.revision = config.revision
        state.owners[config.epoch] = config.owner
        state.promised = max(state.promised, config.epoch)

    def receive(self, message: Message, now: float) -> list[Outgoing]:
        match message:
            case Place():
                return self._place(message)
            case Chunk():
                return self._chunk(message)
            case Propose():
                return self._propose(message)
            case Commit():
                self._commit(message)
                return []
            case Prepare():
                return self._prepare(message)
            case Gather():
                return self._gather(message)
            case Read():
                return [self._read(message)]
            case _:
                raise InvalidArgument(
                    "not a holder message", type=type(message).__name__, host=self.me.host
                )

    # -- transitions --

    def _refuse(self, message: Place | Propose | Prepare, code: str) -> list[Outgoing]:
        state = self._green(message.green)
        position = 0 if isinstance(message, Prepare) else message.position
        refusal = Refused(self.me, message.green, message.epoch, position, code, state.promised)
        return [Outgoing(message.sender.host, refusal)]

    def _authority(self, message: Place | Propose | Prepare) -> str:
        """'' if the sender may act at the message's epoch, else an error code."""
        state = self._green(message.green)
        if message.epoch < state.promised:
            return "EpochFenced"
        owner = state.owners.get(message.epoch)
        if owner is not None and owner != message.sender:
            return "NotOwner"
        return ""

    def _place(self, message: Place) -> list[Outgoing]:
        refusal = self._authority(message)
        if refusal:
            return self._refuse(message, refusal)
        state = self._green(message.green)
        existing = state.placing.get(message.position)
        if (
            existing is not None
            and existing.epoch == message.epoch
            and existing.manifest == message.manifest
        ):
            placement = existing  # a retransmitted Place: ask again for what is missing
        else:
            if existing is not None:
                self._release(existing)
                del state.placing[message.position]
            missing = dict(self.chunks.missing(message.manifest))
            need = sum(missing.values())
            if len(state.placing) >= MAX_PLACEMENTS or (
                self.chunks.used + self.reserved + need > self.chunks.capacity
            ):
                return self._refuse(message, CapacityExhausted.code)
            placement = _Placement(message.epoch, message.sender.host, message.manifest, missing)
            self.reserved += need
            state.placing[message.position] = placement
        if not placement.missing:
            del state.placing[message.position]
            ack = PlaceAck(self.me, message.green, message.epoch, message.position)
            return [Outgoing(message.sender.host, ack)]
        fetch = Fetch(self.me, message.green, tuple(placement.missing))
        return [Outgoing(message.sender.host, fetch)]

    def _release(self, placement: _Placement) -> None:
        self.reserved -= sum(placement.missing.values())
        placement.missing.clear()

    def _chunk(self, message: Chunk) -> list[Outgoing]:
        state = self._green(message.green)
        waiting = [(p, pl) for p, pl in state.placing.items() if message.chunk in pl.missing]
        if not waiting:
            return []  # a duplicate or late chunk nobody waits for: normal on a lossy network
        try:
            self.chunks.put(message.chunk, message.data)
        except (VerificationFailed, CapacityExhausted):
            # Corrupted in transit (or larger than its manifest said): keep
            # waiting, still reserved; the owner's retransmitted Place fetches it again.
            self.alarms.append(f"chunk {message.chunk.hex()[:8]} failed verification")
            return []
        for _, placement in waiting:
            self.reserved -= placement.missing.pop(message.chunk)
        out: list[Outgoing] = []
        for position, placement in waiting:
            if not placement.missing:
                del state.placing[position]
                ack = PlaceAck(self.me, message.green, placement.epoch, position)
                out.append(Outgoing(placement.owner, ack))
        return out

    def _propose(self, message: Propose) -> list[Outgoing]:
        refusal = self._authority(message)
        if refusal:
            return self._refuse(message, refusal)
        if self.chunks.missing(message.value.manifest()):
            return self._refuse(message, MissingContent.code)
        state = self._green(message.green)
        digest = value_digest(message.value)
        slot = state.accepted.get(message.position)
        if slot is not None and slot.epoch == message.epoch and slot.digest != digest:
            raise VerificationFailed(
                "two values proposed at one position in one epoch",
                position=message.position,
                epoch=message.epoch,
            )
        known = state.committed.get(message.position)
        if message.committed and known is not None and known != digest:
            raise VerificationFailed(
                "two values committed at one position", position=message.position
            )
        if slot is None or slot.epoch <= message.epoch:
            state.accepted[message.position] = Slot(message.epoch, message.value, digest)
            self.changes += 1
        state.promised = max(state.promised, message.epoch)
        if message.committed:
            self._mark(state, message.position, digest)
        reply = Accepted(
            self.me, message.green, message.epoch, message.position, digest, state.prefix
        )
        return [Outgoing(message.sender.host, reply)]

    def _mark(self, state: _Green, position: int, digest: bytes) -> None:
        known = state.committed.get(position)
        if known is not None and known != digest:
            raise VerificationFailed("two values committed at one position", position=position)
        if known is None:
            state.committed[position] = digest
            self.changes += 1
        while state.prefix + 1 in state.committed:
            state.prefix += 1

    def _commit(self, message: Commit) -> None:
        state = self._green(message.green)
        slot = state.accepted.get(message.position)
        if slot is not None and slot.digest == message.digest:
            self._mark(state, message.position, message.digest)
        # Otherwise this holder accepted another value or none: it is lagging,
        # and only a catch-up Propose (which brings the value) may mark it.

    def _prepare(self, message: Prepare) -> list[Outgoing]:
        refusal = self._authority(message)
        if refusal:
            return self._refuse(message, refusal)
        state = self._green(message.green)
        state.promised = message.epoch
        entries = tuple(
            Entry(position, slot.epoch, slot.value)
            for position, slot in sorted(state.accepted.items())
        )
        promise = Promise(self.me, message.green, message.epoch, entries, state.prefix)
        return [Outgoing(message.sender.host, promise)]

    def _gather(self, message: Gather) -> list[Outgoing]:
        out: list[Outgoing] = []
        for chunk in message.chunks:
            try:
                data = self.chunks.get(chunk)
            except MissingContent:
                continue  # another promiser has it; the successor asks all of them
            except VerificationFailed:
                self.alarms.append(f"held chunk {chunk.hex()[:8]} rotted")
                continue
            out.append(Outgoing(message.sender.host, Gathered(self.me, message.green, chunk, data)))
        return out

    def serve(self, green: str, position: int) -> bytes:
        """A committed version's content, recomputed and verified from retained inputs."""
        state = self._green(green)
        if position < 0 or position > state.prefix:
            raise MissingContent(
                "the version is not in this holder's committed prefix",
                position=position,
                prefix=state.prefix,
            )
        content = b""
        for p in range(1, position + 1):
            slot = state.accepted[p]
            if slot.digest != state.committed[p]:
                raise VerificationFailed("the held value is not the committed one", position=p)
            if slot.value.base_version != p - 1:
                raise VerificationFailed("a version's base is not its predecessor", position=p)
            content = recompute(content, slot.value, self.chunks)
        return content

    def _read(self, message: Read) -> Outgoing:
        data, error = b"", ""
        try:
            data = self.serve(message.green, message.position)
        except VerificationFailed as failure:
            self.alarms.append(f"refused to serve {message.green}@{message.position}")
            error = failure.code
        except SlatesError as failure:
            error = failure.code
        reply = ReadReply(self.me, message.green, message.position, message.token, data, error)
        return Outgoing(message.sender.host, reply)
