"""Fairness (issue 12): one slow or greedy client cannot stall or starve the others.

Real anchor, raw sockets: a client that dribbles its hello is dropped after
HELLO_SECONDS while another client works; an agent gets at most
MAX_AGENT_CONNECTIONS connections per shard; its unfinished frames count,
together, against MAX_AGENT_BUFFERED; it holds at most MAX_AGENT_VOLUMES
volumes.  Each refusal is a clear error, and the operator keeps working.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slates import Client
from slates.errors import CapacityExhausted
from slates.node.protocol import FrameReader, frame, pack, unpack
from slates.node.runtime import Runtime
from slates.node.service import MAX_AGENT_VOLUMES
from slates.node.shard import HELLO_SECONDS, MAX_AGENT_BUFFERED, MAX_AGENT_CONNECTIONS
from tests.anchor_fixture import Service, service

__all__ = ["service"]

SLATES = str(Path(sys.executable).with_name("slates"))


def agent_token(service: Service, name: str) -> str:
    done = subprocess.run(
        [SLATES, "agent", "add", name, "--runtime-dir", str(service.runtime)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def connect(service: Service, shard: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(Runtime(service.runtime).shard_socket(shard)))
    sock.settimeout(30)
    return sock


def hello(sock: socket.socket, client: str, token: str | None = None) -> dict[str, object]:
    message: dict[str, object] = {"client": client, "rings": False}
    if token is not None:
        message["token"] = token
    sock.sendall(frame(pack(message)))
    reader = FrameReader()
    while (answer := reader.next_frame()) is None:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        reader.feed(data)
    return unpack(answer)


@pytest.fixture
def operator(service: Service) -> Iterator[Client]:
    with Client(service.runtime) as client:
        yield client


def test_a_client_that_dribbles_its_hello_is_dropped_and_others_go_on(
    service: Service, operator: Client
) -> None:
    slow = connect(service)
    stop = threading.Event()

    def dribble() -> None:
        for byte in frame(pack({"client": "slow", "rings": False})):
            if stop.is_set():
                return
            try:
                slow.send(bytes([byte]))
            except OSError:
                return
            time.sleep(1.0)

    thread = threading.Thread(target=dribble, daemon=True)
    thread.start()
    try:
        volume = operator.create_volume("busy")["id"]
        started = time.monotonic()
        for number in range(20):  # others are served meanwhile
            operator.write(volume, "/f", b"%d" % number)
        assert operator.read(volume, "/f") == b"19"
        slow.settimeout(HELLO_SECONDS * 4)
        assert slow.recv(1) == b""  # the shard closed it: no hello in time
        assert time.monotonic() - started < HELLO_SECONDS * 4
    finally:
        stop.set()
        slow.close()
        thread.join(timeout=5)


def test_an_agent_gets_a_bounded_number_of_connections(service: Service, operator: Client) -> None:
    token = agent_token(service, "greedy")
    held = [connect(service) for _ in range(MAX_AGENT_CONNECTIONS + 1)]
    try:
        for number, sock in enumerate(held[:-1]):
            assert hello(sock, f"greedy-{number}", token)["ok"] is True
        refused = hello(held[-1], "greedy-last", token)
        assert refused["ok"] is False
        assert refused["error"]["code"] == "CapacityExhausted"  # type: ignore[index]
        assert operator.create_volume("still-served")["name"] == "still-served"
    finally:
        for sock in held:
            sock.close()


def test_an_agents_unfinished_frames_count_together(service: Service, operator: Client) -> None:
    token = agent_token(service, "hoarder")
    part = 50 << 20  # three of these exceed the budget
    assert 2 * part < MAX_AGENT_BUFFERED < 3 * part
    held = [connect(service) for _ in range(3)]
    try:
        closed = 0
        for number, sock in enumerate(held):
            assert hello(sock, f"hoarder-{number}", token)["ok"] is True
            try:
                sock.sendall((60 << 20).to_bytes(4, "big") + b"\0" * part)  # never finished
                sock.settimeout(2)
                if sock.recv(1) == b"":
                    closed += 1
            except TimeoutError:
                pass  # still open: within the budget
            except OSError:
                closed += 1
        assert closed == 1  # the third went over the budget and was closed
        assert operator.create_volume("not-starved")["name"] == "not-starved"
    finally:
        for sock in held:
            sock.close()


def test_an_agent_holds_a_bounded_number_of_volumes(service: Service) -> None:
    token = agent_token(service, "collector")
    with Client(service.runtime, token=token) as agent:
        made = 0
        with pytest.raises(CapacityExhausted):
            for number in range(2 * MAX_AGENT_VOLUMES + 10):  # two shards
                refused = f"v{number}"
                agent.create_volume(refused)
                made += 1
        assert MAX_AGENT_VOLUMES <= made <= 2 * MAX_AGENT_VOLUMES
        by_shard: dict[str, list[str]] = {}
        for volume in agent.list_volumes():
            by_shard.setdefault(volume["id"].split("-")[1], []).append(volume["id"])
        (full,) = [ids for ids in by_shard.values() if len(ids) == MAX_AGENT_VOLUMES]
        agent.delete_volume(full[0])
        agent.create_volume(refused)  # room again on that shard once it deleted one


def test_a_control_client_sending_a_byte_at_a_time_cannot_hold_up_the_anchor(
    service: Service, operator: Client, tmp_path: Path
) -> None:
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(str(Runtime(service.runtime).anchor_socket))
    request = frame(pack({"op": "mount", "volume": "vol-0-1", "directory": "/nowhere"}))
    dropped = False
    try:
        for byte in request[:12]:  # a byte every 0.7 s: each within any per-byte timeout
            slow.send(bytes([byte]))
            time.sleep(0.7)
            try:
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    dropped = True
                    break
            except BlockingIOError:
                continue
    except OSError:
        dropped = True
    finally:
        slow.close()
    assert dropped  # the whole request has a deadline, so the anchor let go of it
    # The anchor goes on serving control requests (a mount and an unmount).
    volume = operator.create_volume("mountable")["id"]
    where = tmp_path / "mnt"
    where.mkdir()
    operator.mount(volume, where)
    operator.unmount(where)
