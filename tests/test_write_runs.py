"""Writes under a grant that queued in a mount's ring, applied as one write.

When the shard falls behind a writer, the bridge's early-answered writes queue
in the ring; the shard takes those that continue one another as one run
(slates.node.grants, "Runs"; Shard._write_run) and keeps each one's reply.
Checked here: which writes may join a run (the pure rule), and that a run
leaves exactly what the same writes one by one leave: the file's bytes, each
request's reply, the grant left for the next writes, each reply saved for a
retry, and all of it after recovery from the journal.  Through a real mount,
tests/test_mount_write_behind.py streams writes while the shard is stopped
and killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slates import Client
from slates.node.grants import RUN_BYTES, RUN_WRITES, SCATTER_COST, Grant, LinkGrant, joins_run
from slates.node.protocol import Hello, Request, pack, parse_request, unpack
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted
from tests.test_mount_content import seeded
from tests.test_shard_recovery import Segments, call

__all__ = ["service"]

GRANT = Grant("vol-0-1", 5, 100, 1 << 20, 2 << 20)


def write(offset: int, data: bytes, **extra: Any) -> dict[str, Any]:
    return {"volume": "vol-0-1", "ino": 5, "offset": offset, "data": data, "granted": True} | extra


def test_which_writes_join_a_run() -> None:
    first = write(100, b"a" * 10)
    assert joins_run(GRANT, [], first)
    assert not joins_run(GRANT, [], write(99, b"a"))  # not where the grant starts
    assert joins_run(GRANT, [first], write(110, b"b"))
    assert not joins_run(GRANT, [first], write(111, b"b"))  # a gap
    assert not joins_run(GRANT, [first], write(110, b"b", kill=1000))  # asks for more
    assert not joins_run(GRANT, [first], {**write(110, b"b"), "ino": 6})
    assert not joins_run(GRANT, [first], {**write(110, b"b"), "granted": False})
    small = Grant("vol-0-1", 5, 100, 15, 30)
    assert not joins_run(small, [first], write(110, b"b" * 6))  # past what the grant has left
    full = [write(100 + i, b"x") for i in range(RUN_WRITES)]
    assert not joins_run(GRANT, full, write(100 + RUN_WRITES, b"x"))
    big = [write(100, b"x" * RUN_BYTES)]
    assert not joins_run(GRANT, big, write(100 + RUN_BYTES, b"x"))
    scattered = Grant("vol-0-1", 5, 0, 1 << 20, 2 << 20, scattered=True)
    assert joins_run(scattered, [], write(4096, b"h"))  # anywhere, first
    assert not joins_run(scattered, [write(4096, b"h")], write(0, b"h"))  # then in order
    costly = Grant("vol-0-1", 5, 0, 2 * SCATTER_COST + 2, 1 << 20, scattered=True)
    assert joins_run(costly, [write(0, b"a")], write(1, b"b"))
    assert not joins_run(costly, [write(0, b"a"), write(1, b"b")], write(2, b"c"))


class Mount:
    """A shard in this process and one mount's ring link to it, as its bridge talks."""

    def __init__(self, segments: Segments | None = None) -> None:
        self.segments = segments or Segments()
        self.shard = self.segments.shard()
        self.shard.recover()
        self.link = LinkGrant()
        self.hello = Hello("bridge", True, mount="vol-0-1")

    def request(self, seq: int, op: str, **args: Any) -> bytes:
        return pack({"seq": seq, "ack": 0, "op": op, "args": args})

    def send(self, message: bytes) -> dict[str, Any]:
        answered = self.shard.handle(self.hello, message, self.link)
        assert isinstance(answered, bytes)
        reply: dict[str, Any] = unpack(answered)
        return reply

    def grant(self) -> tuple[int, int, int] | None:
        held = self.link.grant
        return None if held is None else (held.end, held.left, held.held)

    def read(self, ino: int) -> bytes:
        reply = self.send(
            self.request(10_000, "fs.read", volume="vol-0-1", ino=ino, offset=0, size=1 << 20)
        )
        assert reply["ok"], reply
        data: bytes = reply["result"]
        return data


def made(mount: Mount) -> int:
    """A volume and an empty file created as a bridge creates one: with a grant."""
    assert call(mount.shard, 1, "volume.create", client="sdk", name="v")["id"] == "vol-0-1"
    reply = mount.send(
        mount.request(
            1,
            "fs.create",
            volume="vol-0-1",
            parent=1,
            name="out.o",
            mode=0o644,
            uid=0,
            gid=0,
            behind=True,
        )
    )
    assert reply["ok"] and reply["result"]["grant"], reply
    ino: int = reply["result"]["ino"]
    return ino


def test_a_run_leaves_what_the_same_writes_one_by_one_leave() -> None:
    rng = seeded()
    single, runs = Mount(), Mount()
    ino = made(single)
    assert made(runs) == ino
    offset, seq = 0, 1
    for _batch in range(6):
        pieces = []
        for _ in range(rng.randrange(2, RUN_WRITES + 1)):
            data = rng.randbytes(rng.randrange(1, 3000))
            seq += 1
            pieces.append(
                runs.request(
                    seq,
                    "fs.write",
                    volume="vol-0-1",
                    ino=ino,
                    offset=offset,
                    data=data,
                    granted=True,
                )
            )
            offset += len(data)
        one_by_one = [single.send(message) for message in pieces]
        requests = [parse_request(unpack(message)) for message in pieces]
        assert all(isinstance(r, Request) for r in requests)
        packed = runs.shard._write_run(runs.hello, requests, runs.link)
        assert packed is not None, "the run went one by one"
        as_run = [unpack(reply) for reply in packed]
        assert as_run == one_by_one
        assert runs.grant() == single.grant()
    content = single.read(ino)
    assert len(content) == offset and runs.read(ino) == content
    # Later writes over the whole file; then retries of the run's writes (the bridge
    # resending after a reconnect) get their saved replies and write nothing again.
    covered = bytes(len(content))
    for mount in (single, runs):
        reply = mount.send(
            mount.request(seq + 1, "fs.write", volume="vol-0-1", ino=ino, offset=0, data=covered)
        )
        assert reply["ok"], reply
    for index, message in enumerate(pieces):
        assert runs.send(message) == one_by_one[index]
    assert runs.read(ino) == covered
    # Recovered from the journal: the bytes, and the saved replies for retries.
    recovered = Mount(runs.segments)
    assert recovered.read(ino) == covered
    for index, message in enumerate(pieces):
        assert recovered.send(message) == one_by_one[index]
    assert recovered.read(ino) == covered


def test_a_run_the_volume_cannot_take_goes_one_by_one_and_changes_nothing() -> None:
    mount = Mount()
    ino = made(mount)
    messages = [
        mount.request(2, "fs.write", volume="vol-0-1", ino=ino, offset=0, data=b"a", granted=True),
        mount.request(3, "fs.write", volume="vol-0-1", ino=ino, offset=1, data=b"b", granted=True),
    ]
    before = mount.grant()
    retried = mount.send(messages[0])  # its reply is saved: the run cannot be new
    requests = [parse_request(unpack(message)) for message in messages]
    assert mount.shard._write_run(mount.hello, requests, mount.link) is None
    assert mount.read(ino) == b"a"  # nothing of the run applied
    assert retried["ok"] and before is not None and mount.grant() is not None
    assert mount.send(messages[1])["ok"]
    assert mount.read(ino) == b"ab"


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)
@pytest.mark.parametrize("crash", [False, True], ids=["paused", "killed"])
def test_small_writes_queued_behind_a_paused_or_killed_shard_all_land(
    service: Service, tmp_path: Path, crash: bool
) -> None:
    """dd writes 100-byte pieces through a mount while its shard is stopped now and
    then (SIGSTOP: the bridge answers eight early and they queue) or killed (SIGKILL:
    they are sent again to the new shard): every byte lands, and runs were taken."""
    rng = seeded()
    source = tmp_path / "source"
    data = rng.randbytes(300_000)
    source.write_bytes(data)
    with Client(service.runtime) as client:
        created = client.create_volume("pieces")
        index = int(created["shard"])
        with mounted(client, created["id"], tmp_path / "mnt") as mnt:
            writer = subprocess.Popen(
                ["dd", f"if={source}", f"of={mnt / 'out'}", "bs=100", "status=none"]
            )
            try:
                for _ in range(3):
                    time.sleep(rng.uniform(0.05, 0.2))
                    if crash:
                        service.wait_restarted(index, service.kill_shard(index))
                    else:
                        pid = service.shard_pids()[index]
                        os.kill(pid, signal.SIGSTOP)
                        time.sleep(0.1)
                        os.kill(pid, signal.SIGCONT)
                assert writer.wait(timeout=120) == 0  # seeded() printed the seed
            finally:
                if writer.poll() is None:
                    writer.kill()
            assert (mnt / "out").read_bytes() == data
            assert client.read(created["id"], "/out") == data
        if not crash:  # a killed shard's count starts again at its restart
            shard = client.status()["shards"][index]
            assert shard["write_runs"]["runs"] > 0, shard["write_runs"]
