"""The holder alone: a hypothesis state machine against a small model, plus examples.

The machine places content (with chunks delivered intact or corrupted),
proposes, commits, prepares and installs configurations at arbitrary
epochs; the model predicts every reply (EpochFenced below the promise,
MissingContent before placement, Fetch/PlaceAck by held chunks) and the
holder's promise, accepted proposals and committed prefix after each step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slates.errors import VerificationFailed
from slates.fleet.config import Candidate, GreenConfig, HolderSet, Peer
from slates.fleet.holder import Holder
from slates.fleet.ledger import (
    EditRef,
    RequestId,
    Value,
    chunk_id,
    make_value,
    root_of,
    value_digest,
)
from slates.fleet.messages import (
    Accepted,
    Chunk,
    Commit,
    Fetch,
    Outgoing,
    Place,
    PlaceAck,
    Prepare,
    Promise,
    Propose,
    Read,
    ReadReply,
    Refused,
    decode,
    encode,
)
from slates.merge.ranges import Replace

G = "g"
ME = Peer("h", "h.boot0")
CHUNKS = [b"alpha", b"bravo!", b"charlie", b"d"]
IDS = [chunk_id(c) for c in CHUNKS]


def owner_of(epoch: int) -> Peer:
    return Peer(f"o{epoch}", "boot")


def config_at(epoch: int, revision: int) -> GreenConfig:
    candidates = tuple(Candidate(Peer(f"x{i}", "b"), f"d{i}", "home") for i in range(3))
    return GreenConfig(G, revision, epoch, owner_of(epoch), HolderSet(1, candidates))


def value_for(epoch: int, position: int, chunk: int) -> Value:
    """One value per (epoch, position): an owner proposes one value per position."""
    edits = (EditRef(0, 0, IDS[chunk], len(CHUNKS[chunk])),)
    request = RequestId("o", f"c{epoch}", position)
    return Value(request, 0, position - 1, edits, root_of(bytes([epoch, position])))


def wire(out: list[Outgoing]) -> list[Outgoing]:
    """Every reply survives its msgpack form unchanged."""
    for item in out:
        assert decode(encode(item.message)) == item.message
    return out


class HolderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.holder = Holder(ME, capacity=1 << 16)
        self.promised = 0
        self.revision = 0
        self.held: set[bytes] = set()
        self.placing: dict[int, tuple[int, set[bytes]]] = {}
        self.accepted: dict[int, tuple[int, bytes]] = {}
        self.committed: dict[int, bytes] = {}
        self.now = 0.0

    def send(self, message: object) -> list[Outgoing]:
        self.now += 1
        return wire(self.holder.receive(message, self.now))  # type: ignore[arg-type]

    @rule(epoch=st.integers(1, 5))
    def install(self, epoch: int) -> None:
        self.revision += 1
        self.holder.install(config_at(epoch, self.revision))
        self.promised = max(self.promised, epoch)

    @rule(epoch=st.integers(1, 5), position=st.integers(1, 4), chunk=st.integers(0, 3))
    def place(self, epoch: int, position: int, chunk: int) -> None:
        manifest = value_for(epoch, position, chunk).manifest()
        out = self.send(Place(owner_of(epoch), G, epoch, position, manifest))
        assert len(out) == 1 and out[0].dest == owner_of(epoch).host
        reply = out[0].message
        if epoch < self.promised:
            assert isinstance(reply, Refused) and reply.code == "EpochFenced"
            assert reply.promised == self.promised
            return
        missing = {c for c, _ in manifest if c not in self.held}
        if missing:
            assert isinstance(reply, Fetch) and set(reply.chunks) == missing
            self.placing[position] = (epoch, missing)
        else:
            assert reply == PlaceAck(ME, G, epoch, position)
            self.placing.pop(position, None)

    @rule(chunk=st.integers(0, 3), corrupt=st.booleans())
    def deliver_chunk(self, chunk: int, corrupt: bool) -> None:
        data = CHUNKS[chunk] + (b"?" if corrupt else b"")
        out = self.send(Chunk(Peer("o", "boot"), G, IDS[chunk], data))
        waiting = {p for p, (_, missing) in self.placing.items() if IDS[chunk] in missing}
        if corrupt or not waiting:
            assert out == []
            return
        self.held.add(IDS[chunk])
        acked = set()
        for position in waiting:
            _, missing = self.placing[position]
            missing.discard(IDS[chunk])
            if not missing:
                acked.add(position)
                del self.placing[position]
        assert {o.message.position for o in out if isinstance(o.message, PlaceAck)} == acked

    @rule(
        epoch=st.integers(1, 5),
        position=st.integers(1, 4),
        chunk=st.integers(0, 3),
        committed=st.booleans(),
    )
    def propose(self, epoch: int, position: int, chunk: int, committed: bool) -> None:
        value = value_for(epoch, position, 0)
        value = Value(
            value.request,
            0,
            position - 1,
            (EditRef(0, 0, IDS[chunk], len(CHUNKS[chunk])),),
            value.result_root,
        )
        digest = value_digest(value)
        existing = self.accepted.get(position)
        if epoch >= self.promised and IDS[chunk] in self.held:
            if existing is not None and existing[0] == epoch and existing[1] != digest:
                with pytest.raises(VerificationFailed):
                    self.send(Propose(owner_of(epoch), G, epoch, position, value, committed))
                return
            known = self.committed.get(position)
            if committed and known is not None and known != digest:
                with pytest.raises(VerificationFailed):
                    self.send(Propose(owner_of(epoch), G, epoch, position, value, committed))
                return
        out = self.send(Propose(owner_of(epoch), G, epoch, position, value, committed))
        [reply] = [o.message for o in out]
        if epoch < self.promised:
            assert isinstance(reply, Refused) and reply.code == "EpochFenced"
            return
        if IDS[chunk] not in self.held:
            assert isinstance(reply, Refused) and reply.code == "MissingContent"
            return
        self.accepted[position] = (epoch, digest)
        self.promised = epoch
        if committed:
            self.committed[position] = digest
        assert isinstance(reply, Accepted) and reply.digest == digest
        assert reply.prefix == self.model_prefix()

    @rule(position=st.integers(1, 4), epoch=st.integers(1, 5))
    def commit(self, position: int, epoch: int) -> None:
        slot = self.accepted.get(position)
        if slot is None or slot[0] != epoch:
            return  # a commit notice only for what an owner could have committed
        known = self.committed.get(position)
        if known is not None and known != slot[1]:
            return
        assert self.send(Commit(owner_of(epoch), G, epoch, position, slot[1])) == []
        self.committed[position] = slot[1]

    @rule(position=st.integers(1, 4), digest=st.binary(min_size=32, max_size=32))
    def commit_unknown_digest(self, position: int, digest: bytes) -> None:
        """A digest this holder did not accept marks nothing (it is lagging)."""
        assert self.send(Commit(owner_of(1), G, 1, position, digest)) == []

    @rule(epoch=st.integers(1, 5))
    def prepare(self, epoch: int) -> None:
        [reply] = [o.message for o in self.send(Prepare(owner_of(epoch), G, epoch))]
        if epoch < self.promised:
            assert isinstance(reply, Refused) and reply.code == "EpochFenced"
            return
        self.promised = epoch
        assert isinstance(reply, Promise)
        assert {(e.position, e.epoch, value_digest(e.value)) for e in reply.entries} == {
            (p, e, d) for p, (e, d) in self.accepted.items()
        }
        assert reply.prefix == self.model_prefix()

    @rule(epoch=st.integers(1, 5))
    def impostor(self, epoch: int) -> None:
        """A peer claiming an epoch the installed configuration gives another owner."""
        if epoch < self.promised or epoch not in self.installed_epochs():
            return
        [reply] = [o.message for o in self.send(Prepare(Peer("mallory", "b"), G, epoch))]
        assert isinstance(reply, Refused) and reply.code == "NotOwner"

    def installed_epochs(self) -> set[int]:
        return set(self.holder._green(G).owners)

    def model_prefix(self) -> int:
        prefix = 0
        while prefix + 1 in self.committed:
            prefix += 1
        return prefix

    @invariant()
    def agrees(self) -> None:
        holder = self.holder
        assert holder.promised(G) == self.promised
        assert {p: (s.epoch, s.digest) for p, s in holder.accepted(G).items()} == self.accepted
        assert holder.committed(G) == self.committed
        assert holder.prefix(G) == self.model_prefix()
        held = {c for c in IDS if c in holder.chunks}
        assert held == self.held
        assert holder.reserved == sum(
            len(CHUNKS[IDS.index(c)]) for _, missing in self.placing.values() for c in missing
        )


TestHolderMachine = HolderMachine.TestCase
TestHolderMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _chain(holder: Holder, texts: list[bytes]) -> None:
    """Place, accept and commit a real chain of versions on `holder`."""
    owner = owner_of(1)
    content = b""
    for position, text in enumerate(texts, start=1):
        value, chunks, content = make_value(
            RequestId("o", "c", position), 0, position - 1, content, [Replace(0, 0, text)]
        )
        out = holder.receive(Place(owner, G, 1, position, value.manifest()), 0.0)
        for reply in out:
            if isinstance(reply.message, Fetch):
                for chunk in reply.message.chunks:
                    holder.receive(Chunk(owner, G, chunk, chunks[chunk]), 0.0)
        holder.receive(Propose(owner, G, 1, position, value, False), 0.0)
        holder.receive(Commit(owner, G, 1, position, value_digest(value)), 0.0)


def _read(holder: Holder, position: int) -> ReadReply:
    [out] = holder.receive(Read(Peer("client", ""), G, position, 7), 0.0)
    assert isinstance(out.message, ReadReply)
    return out.message


def test_served_versions_are_recomputed_from_retained_inputs() -> None:
    holder = Holder(ME, 1 << 10)
    _chain(holder, [b"one ", b"two ", b"three "])
    assert _read(holder, 3).data == b"three two one "
    assert _read(holder, 1).data == b"one "
    assert _read(holder, 4).error == "MissingContent"


def test_a_rotted_chunk_is_refused_not_served() -> None:
    holder = Holder(ME, 1 << 10)
    _chain(holder, [b"one ", b"two "])
    holder.chunks.corrupt(chunk_id(b"one "))
    reply = _read(holder, 2)
    assert (reply.error, reply.data) == ("VerificationFailed", b"")
    assert holder.alarms


def test_a_wrong_result_root_is_refused_when_served() -> None:
    holder = Holder(ME, 1 << 10)
    owner = owner_of(1)
    value, _, _ = make_value(RequestId("o", "c", 1), 0, 0, b"", [Replace(0, 0, b"x")])
    bad = Value(value.request, 0, 0, value.edits, root_of(b"y"))
    [fetch] = holder.receive(Place(owner, G, 1, 1, bad.manifest()), 0.0)
    assert isinstance(fetch.message, Fetch)
    holder.receive(Chunk(owner, G, fetch.message.chunks[0], b"x"), 0.0)
    holder.receive(Propose(owner, G, 1, 1, bad, True), 0.0)
    assert _read(holder, 1).error == "VerificationFailed"


def test_placement_that_cannot_fit_is_capacity_exhausted() -> None:
    holder = Holder(ME, capacity=4)
    [reply] = holder.receive(Place(owner_of(1), G, 1, 1, ((IDS[2], len(CHUNKS[2])),)), 0.0)
    assert isinstance(reply.message, Refused) and reply.message.code == "CapacityExhausted"
    assert holder.reserved == 0


def test_a_holder_that_lost_its_ram_holds_nothing_and_claims_its_new_identity() -> None:
    holder = Holder(ME, 1 << 10)
    _chain(holder, [b"one "])
    reborn = Holder(Peer(ME.host, "h.boot1"), 1 << 10)
    [promise] = reborn.receive(Prepare(owner_of(2), G, 2), 0.0)
    assert isinstance(promise.message, Promise)
    assert promise.message.entries == () and promise.message.prefix == 0
    assert promise.message.sender != ME


def test_installing_a_newer_epoch_fences_the_old_owner() -> None:
    holder = Holder(ME, 1 << 10)
    holder.install(config_at(1, 1))
    holder.install(config_at(2, 2))
    [reply] = holder.receive(Place(owner_of(1), G, 1, 1, ()), 0.0)
    assert isinstance(reply.message, Refused)
    assert (reply.message.code, reply.message.promised) == ("EpochFenced", 2)
