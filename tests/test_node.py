"""The service with real processes: anchor, shards, SIGKILL, retries, hostile clients."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from slates import AsyncClient, Client
from slates.errors import CapacityExhausted, InvalidArgument, NotFound, RequestExpired
from slates.node.protocol import FrameReader, frame, pack, unpack
from slates.node.ring import RingPair
from slates.wire import SPLIT_MARK, SPLIT_PREFIX
from tests.anchor_fixture import Service, checkpointing_service, service, start_service

__all__ = ["checkpointing_service", "service"]  # fixtures, re-exported for pytest


class RawClient:
    """A hand-driven protocol client over the socket (no rings), for exact control."""

    def __init__(self, path: str, client_id: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.reader = FrameReader()
        self.sock.sendall(frame(pack({"client": client_id, "rings": False})))
        answer = self.receive()
        assert answer.get("ok") is True, answer

    def receive(self) -> dict[str, Any]:
        while (payload := self.reader.next_frame()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.reader.feed(data)
        return unpack(payload)

    def call(self, seq: int, ack: int, op: str, **args: Any) -> dict[str, Any]:
        self.sock.sendall(frame(pack({"seq": seq, "ack": ack, "op": op, "args": args})))
        return self.receive()

    def close(self) -> None:
        self.sock.close()


def _socket(service: Service, index: int) -> str:
    return str(service.runtime / f"shard-{index}.sock")


def test_sdk_round_trip_and_named_errors(service: Service, tmp_path: Path) -> None:
    base = tmp_path / "project"
    base.mkdir()
    (base / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    with Client(service.runtime) as client:
        volume = client.create_volume("work", base=base)
        assert client.read(volume["id"], "/image.conf") == b"quality=80\ncache=off\n"
        client.write(volume["id"], "/image.conf", b"90", offset=8)
        assert client.read(volume["id"], "/image.conf") == b"quality=90\ncache=off\n"
        assert (base / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
        client.mkdir(volume["id"], "/src")
        client.rename(volume["id"], "/image.conf", "/src/image.conf")
        assert [e["name"] for e in client.list(volume["id"], "/src")] == ["image.conf"]
        snapshot = client.snapshot(volume["id"])
        clone = client.clone(snapshot, "attempt")
        client.write(clone["id"], "/src/image.conf", b"60", offset=8)
        assert client.read(volume["id"], "/src/image.conf")[8:10] == b"90"
        assert client.counters(clone["id"])["unique_bytes"] == 4096
        with pytest.raises(NotFound):
            client.read(volume["id"], "/missing")
        with pytest.raises(NotFound):
            client.show_volume("vol-0-999")
        with pytest.raises(InvalidArgument):
            client.show_volume("not-an-id")
        before = client.list_volumes()
        with pytest.raises(InvalidArgument):
            client.call(0, "volume.create", name="x", bounded=-5)
        with pytest.raises(InvalidArgument):
            client.create_volume("x", bounded=1, dynamic=1)
        assert client.list_volumes() == before  # nothing was created
        client.delete_volume(clone["id"])
        with pytest.raises(NotFound):
            client.read(clone["id"], "/src/image.conf")


async def test_async_client_runs_under_trio(service: Service) -> None:
    async with AsyncClient(service.runtime) as client:
        volume = await client.create_volume("async")
        await client.write(volume["id"], "/a", b"hello")
        assert await client.read(volume["id"], "/a") == b"hello"
        status = await client.status()
        assert len(status["shards"]) == 2
        assert all(shard["pid"] > 0 for shard in status["shards"])
        assert status["mounts"] == []
        owner = status["shards"][volume["shard"]]
        assert volume["id"] in [v["id"] for v in owner["volumes"]]


def test_a_retry_after_a_crash_before_the_reply_returns_the_same_snapshot(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "crash-once"
    os.environ["SLATES_CRASH_AFTER_COMMIT"] = str(flag)
    try:
        running = start_service(tmp_path / "run", shards=1)
    finally:
        del os.environ["SLATES_CRASH_AFTER_COMMIT"]
    try:
        with Client(running.runtime, client_id="agent-1") as client:
            volume = client.create_volume("v")
            client.write(volume["id"], "/f", b"before")
            old_pid = running.shard_pids()[0]
            flag.write_bytes(b"")  # the shard commits the snapshot, then dies before replying
            snapshot = client.snapshot(volume["id"])  # the SDK reconnects and retries
            assert not flag.exists()
            assert running.wait_restarted(0, old_pid) != old_pid
            status = client.status()
            assert status["shards"][0]["snapshots"] == [snapshot]  # one, not two
            assert status["shards"][0]["restarts"] == 1
            clone = client.clone(snapshot, "c")
            assert client.read(clone["id"], "/f") == b"before"
    finally:
        running.stop()


def test_request_identity_survives_reconnects_and_acks_expire_results(service: Service) -> None:
    path = _socket(service, 0)
    first = RawClient(path, "raw-client")
    created = first.call(1, 0, "volume.create", name="raw")
    assert created["ok"], created
    vid = created["result"]["id"]
    snap = first.call(2, 0, "snapshot", volume=vid)
    first.close()
    second = RawClient(path, "raw-client")  # a new connection, the same client
    again = second.call(2, 0, "snapshot", volume=vid)
    assert again == snap  # the saved result, not a second snapshot
    assert second.call(3, 2, "volume.show", volume=vid)["ok"]  # acknowledges 1 and 2
    expired = second.call(2, 0, "snapshot", volume=vid)  # a stale retry
    assert expired["ok"] is False and expired["error"]["code"] == RequestExpired.code
    other = RawClient(path, "another-client")  # same sequence number, another client
    assert other.call(2, 0, "snapshot", volume=vid)["result"]["id"] != snap["result"]["id"]
    second.close()
    other.close()


def test_hostile_clients_get_errors_and_cannot_crash_a_shard(service: Service) -> None:
    path = _socket(service, 0)
    pids = service.shard_pids()
    # Garbage instead of a hello.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(frame(b"\xc1\xc1 not msgpack"))
        reader = FrameReader()
        reader.feed(sock.recv(65536))
        reply = unpack(reader.next_frame() or b"")
        assert reply["ok"] is False and reply["error"]["code"] == "InvalidArgument"
    # An absurd frame length.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(struct.pack(">I", 0xFFFFFFF0) + b"xx")
        reader = FrameReader()
        while chunk := sock.recv(65536):  # an error, then the shard hangs up
            reader.feed(chunk)
        reply = unpack(reader.next_frame() or b"")
        assert reply["ok"] is False and reply["error"]["code"] == "InvalidArgument"
    # Malformed requests after a good hello.
    raw = RawClient(path, "hostile")
    for message in (
        {"seq": "1", "ack": 0, "op": "status", "args": {}},
        {"seq": 1, "ack": 5, "op": "status", "args": {}},
        {"seq": 1, "ack": 0, "op": "no.such.op", "args": {}},
        {"seq": 2, "ack": 0, "op": "write", "args": {"volume": 7, "path": None}},
        {"seq": 3, "ack": 0, "op": "read", "args": {"volume": "vol-0-1", "path": "rel"}},
    ):
        raw.sock.sendall(frame(pack(message)))
        reply = raw.receive()
        assert reply["ok"] is False, reply
    raw.sock.sendall(frame(msgpack.packb([1, 2, 3])))
    assert raw.receive()["ok"] is False
    raw.close()
    # Garbage pushed straight into a ring.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(frame(pack({"client": "ring-hostile", "rings": True})))
        _data, ancillary, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(16))
        fds = [fd for *_, payload in ancillary for fd in struct.unpack("4i", payload[:16])]
        with RingPair.attach(fds) as pair:
            head = pack({"seq": 1, "ack": 0, "op": "status", "args": {"data": b"x"}})
            listless = pack({"seq": 1, "ack": 0, "op": "status", "args": [1]})
            for garbage in (
                b"\x00\xff garbage",
                # Split requests (PROTOCOL.md): a head that overruns the message, a
                # head that is not msgpack, args that already hold data or are no map.
                SPLIT_PREFIX.pack(SPLIT_MARK, 1 << 20) + b"short",
                SPLIT_PREFIX.pack(SPLIT_MARK, 3) + b"\xc1\xc1\xc1tail",
                SPLIT_PREFIX.pack(SPLIT_MARK, len(head)) + head + b"tail",
                SPLIT_PREFIX.pack(SPLIT_MARK, len(listless)) + listless + b"tail",
            ):
                assert pair.requests.push(garbage)
                reply = unpack(pair.replies.receive_blocking(timeout=30) or b"")
                assert reply["ok"] is False, garbage
    assert service.shard_pids() == pids  # no shard died
    with Client(service.runtime) as client:
        assert client.status()["shards"][0]["pid"] == pids[0]


def test_creating_a_volume_over_50k_files_reads_none_of_them(
    service: Service, tmp_path: Path
) -> None:
    base = tmp_path / "big"
    payload = b"x" * 200
    for d in range(50):
        directory = base / f"d{d:02}"
        directory.mkdir(parents=True)
        for f in range(1000):
            (directory / f"f{f:04}.txt").write_bytes(payload)
    with Client(service.runtime) as client:
        home = client._async._home("big")  # the shard that will own it
        pid = service.shard_pids()[home]

        def read_bytes() -> int:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("rchar:"):
                    return int(line.split()[1])
            raise AssertionError("no rchar")

        before = read_bytes()
        volume = client.create_volume("big", base=base)
        used = read_bytes() - before
        assert volume["shard"] == home
        assert used < 64 * 1024, f"creating the volume read {used} bytes"  # the tree is 10 MB
        assert client.read(volume["id"], "/d07/f0123.txt") == payload


KILL_EVERY_STEPS = 10


@pytest.mark.parametrize("fixture", ["service", "checkpointing_service"])
def test_random_workload_survives_random_shard_kills(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    service: Service = request.getfixturevalue(fixture)
    seed = int.from_bytes(os.urandom(4), "big")
    print(f"kill workload seed {seed}")
    rng = random.Random(seed)
    stop = threading.Event()
    kills = []

    progress = [0]  # workload steps done: the main thread counts them

    def killer() -> None:
        pace = random.Random(seed + 1)  # the main thread owns rng
        killed_at = -KILL_EVERY_STEPS
        while not stop.wait(pace.uniform(0.05, 0.3)):
            # Kill only once the workload got through since the last kill: a shard
            # killed again before it recovered proves nothing, and on a slow host
            # enough of those make the anchor give up on it.
            if progress[0] - killed_at < KILL_EVERY_STEPS:
                continue
            index = pace.randrange(2)
            with contextlib.suppress(ProcessLookupError):  # already being replaced
                kills.append(service.kill_shard(index))
                killed_at = progress[0]

    expected: dict[str, dict[str, bytes]] = {}
    snapshots: dict[str, dict[str, bytes]] = {}
    thread = threading.Thread(target=killer)
    with Client(service.runtime, client_id=f"killer-{seed}") as client:
        volumes = [client.create_volume(f"v{i}")["id"] for i in range(4)]
        for vid in volumes:
            expected[vid] = {}
        thread.start()
        try:
            step = 0
            while len(kills) < 6 and step < 50_000:  # bounded: stop after six crashes
                step += 1
                progress[0] = step
                vid = rng.choice(volumes)
                files = expected[vid]
                op = rng.random()
                if op < 0.6 or not files:
                    path = f"/f{rng.randrange(6)}"
                    data = rng.randbytes(rng.randrange(1, 6000))
                    offset = rng.randrange(0, 3000)
                    client.write(vid, path, data, offset=offset)
                    old = bytearray(files.get(path, b""))
                    if len(old) < offset:
                        old.extend(bytes(offset - len(old)))
                    old[offset : offset + len(data)] = data
                    files[path] = bytes(old)
                elif op < 0.75:
                    path = rng.choice(sorted(files))
                    client.unlink(vid, path)
                    del files[path]
                elif op < 0.85:
                    snapshots[client.snapshot(vid)] = dict(files)
                else:
                    got = client.read(vid, rng.choice(sorted(files)))
                    assert got in files.values(), f"seed {seed} step {step}"
        finally:
            stop.set()
            thread.join()
        assert len(kills) >= 6, f"seed {seed}: the workload finished before six kills"
        for vid, files in expected.items():
            listed = sorted(e["name"] for e in client.list(vid, "/"))
            assert listed == sorted(p[1:] for p in files), f"seed {seed} volume {vid}"
            for path, data in files.items():
                assert client.read(vid, path) == data, f"seed {seed} {vid}{path}"
        for snapshot, files in snapshots.items():
            clone = client.clone(snapshot, "check")
            for path, data in files.items():
                assert client.read(clone["id"], path) == data, f"seed {seed} {snapshot}{path}"
            client.delete_volume(clone["id"])
        assert sum(s["restarts"] for s in client.status()["shards"]) >= len(set(kills)) - 2


def test_peer_credentials_are_checked() -> None:
    # The runtime directory is private (0700), so another user cannot even reach
    # the socket; open it up here to test the second line of defence.
    parent = Path(tempfile.mkdtemp(prefix="slates-peer-"))
    os.chmod(parent, 0o755)
    service = start_service(parent / "run", shards=1)
    try:
        _check_peer_refused(service)
    finally:
        service.stop()
        shutil.rmtree(parent, ignore_errors=True)


def _check_peer_refused(service: Service) -> None:
    path = _socket(service, 0)
    os.chmod(service.runtime, 0o755)
    os.chmod(path, 0o777)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(path)
                sock.sendall(frame(pack({"client": "intruder", "rings": False})))
                reader = FrameReader()
                reader.feed(sock.recv(65536))
                reply = unpack(reader.next_frame() or b"")
                os.write(write_end, str(reply.get("error", {}).get("code")).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b"AccessDenied"


def test_trio_client_and_ring_transport_under_load(service: Service) -> None:
    async def main() -> None:
        async with AsyncClient(service.runtime) as client:
            volume = await client.create_volume("load")
            async with trio.open_nursery() as nursery:
                for worker in range(4):
                    nursery.start_soon(_hammer, client, volume["id"], worker)
            for worker in range(4):
                data = await client.read(volume["id"], f"/w{worker}")
                assert data == bytes([worker]) * 200

    async def _hammer(client: AsyncClient, vid: str, worker: int) -> None:
        for i in range(200):
            await client.write(vid, f"/w{worker}", bytes([worker]), offset=i)

    trio.run(main)
    time.sleep(0)


def test_anchor_daemon_mode_detaches_and_stops_cleanly(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "slates_cli.main",
            "anchor",
            "--daemon",
            "--runtime-dir",
            str(runtime),
            "--shards",
            "1",
            "--capacity",
            "256MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    state = json.loads((runtime / "anchor.json").read_text())
    anchor_pid, shard_pid = state["pid"], state["shards"][0]["pid"]
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    try:
        with Client(runtime) as client:
            volume = client.create_volume("d")
            client.write(volume["id"], "/x", b"1")
            assert client.read(volume["id"], "/x") == b"1"
        # A second anchor in the same runtime directory is refused.
        again = subprocess.run(
            [sys.executable, "-m", "slates_cli.main", "anchor", "--runtime-dir", str(runtime)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert again.returncode == 2 and "already running" in again.stderr
    finally:
        os.kill(anchor_pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (runtime / "anchor.json").exists() or _alive(shard_pid) or _alive(anchor_pid):
        assert time.monotonic() < deadline, "the anchor did not stop"
        time.sleep(0.05)
    assert not list(runtime.glob("*.sock"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of an exited parent is reaped by init; /proc tells the state.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_messages_larger_than_a_ring_travel_on_the_socket(service: Service) -> None:
    big = os.urandom(3 << 20)
    with Client(service.runtime) as client:
        volume = client.create_volume("big-messages")
        assert client.write(volume["id"], "/blob", big) == len(big)
        assert client.read(volume["id"], "/blob") == big
        pids = service.shard_pids()
        assert client.status()["shards"][volume["shard"]]["pid"] == pids[volume["shard"]]


def test_a_stale_state_file_fails_fast(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (runtime / "anchor.json").write_text(json.dumps({"pid": dead.pid, "capacity": 1, "shards": []}))
    with pytest.raises(NotFound):  # at once, not after the reconnect budget
        Client(runtime)


def test_refused_and_broken_volumes_never_take_a_shard_down(
    service: Service, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "f").write_bytes(b"base")
    with Client(service.runtime) as client:
        keep = client.create_volume("keep")
        client.write(keep["id"], "/x", b"acknowledged")
        with pytest.raises(CapacityExhausted):
            client.call(keep["shard"], "volume.create", name="huge", bounded=1 << 50)
        doomed = client.create_volume("doomed", base=base)
        shutil.rmtree(base)  # the live base disappears
        for index in range(2):
            old = service.kill_shard(index)
            service.wait_restarted(index, old)
        assert client.read(keep["id"], "/x") == b"acknowledged"
        with pytest.raises(NotFound):
            client.read(doomed["id"], "/f")  # the volume failed, the shard did not
        client.delete_volume(doomed["id"])
        assert [v["id"] for v in client.list_volumes()] == [keep["id"]]
        big = os.urandom(20 << 20)  # beyond one reply: the SDK reads in pieces
        client.write(keep["id"], "/big", big)
        assert client.read(keep["id"], "/big") == big
        assert all(s["restarts"] == 1 for s in client.status()["shards"])


def test_edit_inserts_replaces_and_deletes_byte_ranges(service: Service) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("edits")["id"]
        assert client.edit(volume, "/image.conf", 0, 0, b"quality=80\ncache=off\n") == 21
        client.edit(volume, "/image.conf", 0, 0, b"format=webp\n")  # an insert moves the rest
        client.edit(volume, "/image.conf", 20, 22, b"90")
        client.edit(volume, "/image.conf", 23, 33, b"")  # a delete
        assert client.read(volume, "/image.conf") == b"format=webp\nquality=90\n"
        with pytest.raises(InvalidArgument):
            client.edit(volume, "/image.conf", 5, 500, b"x")  # beyond the end: nothing changes
        assert client.read(volume, "/image.conf") == b"format=webp\nquality=90\n"
