"""Records: msgpack round trips, hostile input, and deterministic replay."""

from __future__ import annotations

import contextlib
import os
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slates.core import ROOT_INO, Host, Kind, Volume
from slates.core.records import (
    BaseEntry,
    BindBase,
    Create,
    Fingerprint,
    Mknod,
    Record,
    Rename,
    SetAttr,
    Write,
    decode,
    encode,
)
from slates.errors import InvalidArgument
from tests.test_volume_model import BASE_DIRS, BASE_FILES, MemoryBase
from tests.volume_check import check_invariants, tree

ENTRY = BaseEntry("/a", Kind.FILE, 0o644, 1, 2, 3, 4, 5, 6, 0, Fingerprint(7, 8, 3, 5))


@pytest.mark.parametrize(
    "record",
    [
        BindBase(1, "a", ENTRY),
        Create(1, "f", 0o644, 0, 0, 12),
        Mknod(1, "p", Kind.FIFO, 0o600, 0, 0, 0, 1),
        Rename(1, "a", 2, "b", 1, 3),
        Write(2, 10, b"\x00\xffdata", 4),
        SetAttr(2, 5, mode=0o600),
        SetAttr(2, 5),
    ],
)
def test_records_round_trip(record: Record) -> None:
    assert decode(encode(record)) == record


def test_kind_survives_as_an_enum() -> None:
    decoded = decode(encode(Mknod(1, "p", Kind.FIFO, 0o600, 0, 0, 0, 1)))
    assert isinstance(decoded, Mknod) and decoded.kind is Kind.FIFO


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["NoSuchRecord", 1]))),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Write", "2", 0, b"", 0]))),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Write", 2, 0]))),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Write", True, 0, b"", 0]))),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Mknod", 1, "p", 99, 0, 0, 0, 0, 0]))),
        msgpack.packb(msgpack.ExtType(9, b"")),
    ],
)
def test_malformed_payloads_are_invalid_arguments(payload: bytes) -> None:
    with pytest.raises(InvalidArgument):
        decode(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_invalid_argument(payload: bytes) -> None:
    with contextlib.suppress(InvalidArgument):
        decode(payload)


def test_unknown_objects_are_refused_by_apply() -> None:
    volume = Volume.new(Host())
    with pytest.raises(InvalidArgument):
        volume.apply("not a record")  # type: ignore[arg-type]


def _random_workload(volume: Volume, rng: random.Random, steps: int) -> None:
    names = ["a", "b", "c", "dd", "x"]
    for step in range(steps):
        dirs = [ROOT_INO] + [
            i.ino for i in volume.readdir(ROOT_INO) if i.kind == Kind.DIR and i.ino
        ]
        parent = rng.choice(dirs)
        name = rng.choice(names)
        op = rng.choice(
            [
                "create",
                "mkdir",
                "write",
                "truncate",
                "rename",
                "unlink",
                "seal",
                "snapshot",
                "lookup",
            ]
        )
        try:
            if op == "create":
                volume.create(parent, name, time_ns=step)
            elif op == "mkdir":
                volume.mkdir(parent, name, time_ns=step)
            elif op == "lookup":
                volume.lookup(parent, name)
            elif op in ("write", "truncate"):
                ino = volume.lookup(parent, name).ino
                if op == "write":
                    volume.write(
                        ino, rng.randrange(20000), os.urandom(rng.randrange(9000)), time_ns=step
                    )
                else:
                    volume.truncate(ino, rng.randrange(20000), time_ns=step)
            elif op == "rename":
                volume.rename(parent, name, rng.choice(dirs), rng.choice(names), time_ns=step)
            elif op == "unlink":
                volume.unlink(parent, name, time_ns=step)
            elif op == "seal":
                volume.seal()
            else:
                volume.snapshot(f"s{step}")
        except InvalidArgument:
            pass  # the model test checks errors; here only replay matters


def test_replaying_the_record_stream_rebuilds_the_same_volume() -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"replay seed {seed}")
    rng = random.Random(seed)
    base = MemoryBase(dict(BASE_FILES), BASE_DIRS)
    original = Volume.new(Host(), base=base)
    journal: list[bytes] = []
    original.on_applied = lambda record, result: journal.append(encode(record))
    _random_workload(original, rng, 300)
    replica = Volume.new(Host(), base=base)
    for payload in journal:
        replica.apply(decode(payload))
    assert replica.root.next_ino == original.root.next_ino, f"seed {seed}"
    assert set(replica.root.inodes.keys()) == set(original.root.inodes.keys()), f"seed {seed}"
    assert tree(replica) == tree(original), f"seed {seed}"
    assert replica.counters() == original.counters(), f"seed {seed}"
    check_invariants(replica)
