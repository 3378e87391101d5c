"""A shard that cannot stay up fails alone (issue 13, item 4).

A shard killed more than MAX_RESTARTS times within RESTART_WINDOW is left
down and marked failed in the anchor's state; the anchor and the other
shard go on serving their volumes, mounts and control requests.  Real
processes, SIGKILL.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from slates import Client
from slates.node.anchor import MAX_RESTARTS
from tests.anchor_fixture import Service, service

__all__ = ["service"]


def test_a_shard_that_keeps_dying_is_left_down_and_the_other_goes_on(
    service: Service, tmp_path: Path
) -> None:
    with Client(service.runtime) as client:
        kept = {}
        for name in ("a", "b", "c", "d", "e", "f"):
            kept[name] = client.create_volume(name)["id"]
            client.write(kept[name], "/f", name.encode())
        on_zero = {n: v for n, v in kept.items() if v.startswith("vol-0-")}
        assert on_zero and len(on_zero) < len(kept)  # both shards hold some
    for _ in range(MAX_RESTARTS + 1):
        pid = service.kill_shard(1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shard = service.state()["shards"][1]  # type: ignore[index]
            if shard["state"] == "failed" or shard["pid"] != pid:
                break
            time.sleep(0.02)
    shard = service.state()["shards"][1]  # type: ignore[index]
    assert shard["state"] == "failed", shard
    assert service.process.poll() is None  # the anchor is still there
    # Its socket went with it: a client is refused at once, never left waiting for a
    # hello nobody answers.
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
        pytest.raises((FileNotFoundError, ConnectionRefusedError)),
    ):
        sock.connect(str(shard["socket"]))
    os.kill(service.shard_pids()[0], 0)  # and so is shard 0
    with Client(service.runtime) as client:
        for name, vid in on_zero.items():
            assert client.read(vid, "/f") == name.encode()
        assert {v["id"] for v in client.list_volumes()} == set(on_zero.values())
        status = client.status()
        assert [s["state"] for s in status["shards"]] == ["serving", "failed"]
        where = tmp_path / "mnt"
        where.mkdir()
        volume = next(iter(on_zero.values()))
        client.mount(volume, where)
        try:
            assert (where / "f").read_bytes() in {n.encode() for n in on_zero}
        finally:
            client.unmount(where)
