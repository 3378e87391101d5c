"""Shard recovery in one process: the same segments, a fresh Shard, checkpoints in between."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from slates.base.live import LiveDirectory
from slates.core.host import Host
from slates.errors import MissingContent
from slates.node import shard as shard_module
from slates.node.journal import create_segment
from slates.node.protocol import Hello, pack, parse_request, unpack
from slates.node.service import ShardService
from tests.jobs_inline import finish


class Segments:
    def __init__(self) -> None:
        self.fds = (
            create_segment("journal", 64 << 20),
            create_segment("checkpoint", 256 << 20),
            create_segment("arena", 256 << 20),
        )

    def shard(self) -> shard_module.Shard:
        return shard_module.Shard(0, *self.fds, capacity=1 << 30)


def call(shard: shard_module.Shard, seq: int, op: str, client: str = "c", **args: Any) -> Any:
    message = pack({"seq": seq, "ack": seq - 1, "op": op, "args": args})
    answered = shard.handle(Hello(client, False), message)
    if not isinstance(answered, bytes):
        raise AssertionError(f"{op} became a job: drive it through Shard.answer")
    reply = unpack(answered)
    if not reply["ok"]:
        raise AssertionError(f"{op} failed: {reply['error']}")
    return reply["result"]


def test_recovery_with_checkpoints_at_random_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_module, "CHECKPOINT_EVERY_BYTES", 30_000)  # also inside requests
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"recovery seed {seed}")
    rng = random.Random(seed)
    segments = Segments()
    shard = segments.shard()
    shard.recover()
    seq = 1
    vid = call(shard, seq, "volume.create", name="v")["id"]
    files: dict[str, bytes] = {}
    for step in range(400):
        seq += 1
        path = f"/f{rng.randrange(5)}"
        action = rng.random()
        if action < 0.6:
            data = rng.randbytes(rng.randrange(1, 9000))
            offset = rng.randrange(0, 5000)
            call(shard, seq, "write", volume=vid, path=path, data=data, offset=offset)
            old = bytearray(files.get(path, b""))
            old.extend(bytes(max(0, offset - len(old))))
            old[offset : offset + len(data)] = data
            files[path] = bytes(old)
        elif action < 0.7 and path in files:
            call(shard, seq, "unlink", volume=vid, path=path)
            del files[path]
        elif action < 0.8:
            call(shard, seq, "seal", volume=vid)
        elif action < 0.9:
            shard.checkpoint()
        else:
            call(shard, seq, "snapshot", volume=vid)
        if rng.random() < 0.15:  # crash: a new shard process over the same segments
            shard = segments.shard()
            shard.recover()
            checker = f"checker-{step}"
            listed = sorted(
                e["name"] for e in call(shard, 1, "list", checker, volume=vid, path="/")
            )
            assert listed == sorted(p[1:] for p in files), f"seed {seed} step {step}"
            for name, data in files.items():
                got = call(shard, 2, "read", checker, volume=vid, path=name)
                assert got == data, f"seed {seed} step {step} {name}"
            assert not shard.service.failed, f"seed {seed}: {shard.service.failed}"


def test_a_checkpoint_bounds_replay() -> None:
    segments = Segments()
    shard = segments.shard()
    shard.recover()
    vid = call(shard, 1, "volume.create", name="v")["id"]
    for seq in range(2, 200):
        call(shard, seq, "write", volume=vid, path="/f", data=b"x" * 100, offset=seq)
    shard.checkpoint()
    call(shard, 200, "write", volume=vid, path="/g", data=b"after")
    replacement = segments.shard()
    assert replacement.recover() <= 4  # only the events after the checkpoint
    assert call(replacement, 201, "read", volume=vid, path="/g") == b"after"


def test_recovery_refuses_a_volume_whose_content_is_missing() -> None:
    host = Host()
    service = ShardService(0, host, LiveDirectory)
    service._run("volume.create", {"name": "a"}, 0)
    service._run("volume.create", {"name": "b"}, 0)
    for vid, data in (("vol-0-1", b"A" * 5000), ("vol-0-2", b"B" * 5000)):
        service._run("write", {"volume": vid, "path": "/f", "data": data}, 0)
        service._run("seal", {"volume": vid}, 0)
    blob = service.checkpoint()
    chunks = dict(host._chunks)
    lost = next(cid for cid, data in chunks.items() if data.startswith(b"A"))
    del chunks[lost]
    restored = ShardService(0, Host(chunks=chunks), LiveDirectory)
    restored.restore(blob)
    assert isinstance(restored.failed["vol-0-1"], MissingContent)
    reply, _events = finish(
        restored,
        *restored.handle(
            "c",
            parse_request(
                {"seq": 1, "ack": 0, "op": "read", "args": {"volume": "vol-0-1", "path": "/f"}}
            ),
            0,
        ),
    )
    assert reply["ok"] is False and reply["error"]["code"] == "MissingContent"
    assert restored._run("read", {"volume": "vol-0-2", "path": "/f"}, 0) == b"B" * 5000
