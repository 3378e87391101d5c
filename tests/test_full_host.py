"""A full host never loses everything (issue 13, item 4).

With the host's capacity used up, new work is refused (CapacityExhausted
through the SDK, ENOSPC in a mount) while reads and deletes go on; a shard
killed while full recovers (replay needs no free space) and the other
shard never stops; deleting gives the space back.  Real processes, a real
mount, SIGKILL.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from slates import Client
from slates.errors import CapacityExhausted
from tests.anchor_fixture import Service, start_service

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

PIECE = 1 << 20


def _fill(client: Client, volume: str, prefix: str, limit: int = 400) -> int:
    """Write 1 MiB files until the host refuses; returns how many were written."""
    for n in range(limit):
        try:
            client.write(volume, f"/{prefix}{n}", os.urandom(PIECE))
        except CapacityExhausted:
            return n
    raise AssertionError(f"the host took {limit} MiB without refusing")


def _wait_restarted(service: Service, index: int, old_pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shard = service.state()["shards"][index]  # type: ignore[index]
        if shard["pid"] != old_pid and shard["state"] == "serving":
            return
        time.sleep(0.05)
    raise AssertionError("the shard was not restarted")


def test_a_full_host_refuses_new_work_serves_the_rest_and_survives_a_shard_kill(
    tmp_path: Path,
) -> None:
    service = start_service(tmp_path / "run", shards=2, capacity="160MiB")
    try:
        with Client(service.runtime) as client:
            volumes: dict[str, str] = {}
            for name in ("a", "b", "c", "d"):
                info = client.create_volume(name)
                volumes.setdefault(info["id"].split("-")[1], info["id"])
            assert set(volumes) == {"0", "1"}, volumes  # one volume on each shard
            full, other = volumes["0"], volumes["1"]
            client.write(other, "/kept", b"the other shard's file")
            written = _fill(client, full, "f")
            assert written > 10
            # Full: new content is refused everywhere, with its error.
            with pytest.raises(CapacityExhausted):
                client.write(full, "/one-more", os.urandom(PIECE))
            with pytest.raises(CapacityExhausted):  # one pool: the other shard is full too
                client.write(other, "/one-more", os.urandom(PIECE))
            with pytest.raises(CapacityExhausted):  # a quota cannot be reserved either
                client.create_volume("quota", bounded=80 << 20)
            sealed = client.snapshot(full)  # sealing needs no free space: it moves what is there
            # In a mount too: ENOSPC, and the mount still reads.
            where = tmp_path / "mnt"
            where.mkdir()
            client.mount(full, where)
            try:
                with pytest.raises(OSError) as failed, open(where / "big", "wb") as out:
                    for _ in range(64):
                        out.write(os.urandom(PIECE))
                assert failed.value.errno == errno.ENOSPC
                assert len((where / "f0").read_bytes()) == PIECE
            finally:
                client.unmount(where, force=True)
            other_pid = service.shard_pids()[1]
            killed = service.kill_shard(0)
            _wait_restarted(service, 0, killed)
            assert service.shard_pids()[1] == other_pid  # the other shard never stopped
            assert client.read(other, "/kept") == b"the other shard's file"
        with Client(service.runtime) as client:
            # Recovered while full: every file is there and reads; deletes go on.
            names = {e["name"] for e in client.list(full, "/")}
            assert {f"f{n}" for n in range(written)} <= names
            assert len(client.read(full, "/f1")) == PIECE
            for n in range(written):
                client.unlink(full, f"/f{n}")
            client.delete_snapshot(sealed)  # it held every byte
            # The space came back: new work is admitted again.
            for n in range(8):
                client.write(full, f"/again{n}", os.urandom(PIECE))
            client.create_volume("quota", bounded=16 << 20)
    finally:
        service.stop()
