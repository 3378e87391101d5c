"""Long requests run as jobs off the shard's loop (issue 12, item 4; slates.node.jobs).

A capture reads its source in worker threads and commits batch by batch, so
another client's requests on the same shard are answered while it runs; a
shard killed mid-capture recovers without the capture's scratch volume, and
the capture can simply be asked again; a client that leaves mid-capture
leaves nothing behind.  Real anchor processes, SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slates import Client
from slates.errors import InvalidArgument
from slates.node.service import CAPTURE_SUFFIX
from tests.anchor_fixture import start_service

FILES = 48
FILE_SIZE = 1 << 20


@pytest.fixture
def source(tmp_path: Path) -> Path:
    top = tmp_path / "src"
    for n in range(FILES):
        sub = top / f"d{n % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{n}.bin").write_bytes(os.urandom(FILE_SIZE))
    return top


@contextlib.contextmanager
def another_client_writing(runtime: Path, volume: str) -> Iterator[list[float]]:
    """A second client writing one byte to `volume` in a loop until the block ends; yields
    the times its writes were answered (once the first one is)."""
    answered: list[float] = []
    stop = threading.Event()

    def writer() -> None:
        with Client(runtime) as other:
            while not stop.is_set():
                other.write(volume, "/x", b"b")
                answered.append(time.monotonic())

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while not answered:
            time.sleep(0.01)
        yield answered
    finally:
        stop.set()
        thread.join()


def _scratch_volumes(client: Client) -> list[str]:
    return [v["name"] for v in client.list_volumes() if v["name"].endswith(CAPTURE_SUFFIX)]


def test_other_clients_are_answered_during_a_capture(tmp_path: Path, source: Path) -> None:
    service = start_service(tmp_path / "run", shards=1, capacity="1GiB")
    try:
        with Client(service.runtime) as client:
            busy = client.create_volume("busy")["id"]
            client.write(busy, "/x", b"a")
            with another_client_writing(service.runtime, busy) as answered:
                started = time.monotonic()
                captured = client.create_volume("captured", base=str(source), capture=True)
                ended = time.monotonic()
            during = [t for t in answered if started < t < ended]
            # The shard answered the other client between the capture's batches (one
            # stall of the whole capture would leave at most one answer in its window).
            assert len(during) >= 5, (len(during), ended - started)
            assert client.read(captured["id"], "/d1/f1.bin") == (source / "d1/f1.bin").read_bytes()
            assert len(client.list(captured["id"], "/d2")) == FILES // 4
            assert _scratch_volumes(client) == []
            with pytest.raises(InvalidArgument):
                client.create_volume("sneaky" + CAPTURE_SUFFIX)
    finally:
        service.stop()


def test_a_shard_killed_mid_capture_recovers_without_its_scratch(
    tmp_path: Path, source: Path
) -> None:
    service = start_service(tmp_path / "run", shards=1, capacity="1GiB")
    try:
        outcome: list[object] = []

        def capture() -> None:
            try:
                with Client(service.runtime) as client:
                    outcome.append(client.create_volume("cap", base=str(source), capture=True))
            except Exception as exc:  # the shard's death reaches this client somehow
                outcome.append(exc)

        thread = threading.Thread(target=capture)
        with Client(service.runtime) as client:
            thread.start()
            deadline = time.monotonic() + 60
            while not _scratch_volumes(client) and not outcome:
                assert time.monotonic() < deadline, "the capture never started"
                time.sleep(0.005)
            killed = service.kill_shard(0)
        service.wait_restarted(0, killed)
        thread.join(timeout=120)
        with Client(service.runtime) as client:
            assert _scratch_volumes(client) == []
            names = {v["name"] for v in client.list_volumes()}
            if "cap" not in names:  # the client's retry may have captured it already
                client.create_volume("cap", base=str(source), capture=True)
            cap = next(v["id"] for v in client.list_volumes() if v["name"] == "cap")
            assert client.read(cap, "/d3/f7.bin") == (source / "d3/f7.bin").read_bytes()
            assert _scratch_volumes(client) == []
    finally:
        service.stop()


def test_other_clients_are_answered_during_a_landing(tmp_path: Path) -> None:
    from tests.test_land_service import approve

    service = start_service(tmp_path / "run", shards=1, capacity="1GiB")
    target = tmp_path / "target"
    target.mkdir()
    try:
        with Client(service.runtime) as client:
            green = client.create_green("g")
            work = client.create_work(green, "w")["id"]
            client.mkdir(work, "/out")
            for n in range(400):
                client.write(work, f"/out/f{n}.bin", os.urandom(64 << 10))
            assert client.submit(work)["ok"]
            busy = client.create_volume("busy")["id"]
            plan = client.land_plan(green, str(target))
            grant = approve(client, service.runtime, plan["manifest"])
            with another_client_writing(service.runtime, busy) as answered:
                started = time.monotonic()
                result = client.land_apply(plan["manifest"], grant)
                ended = time.monotonic()
            assert result["complete"] is True
            assert len(list((target / "out").iterdir())) == 400
            during = [t for t in answered if started < t < ended]
            assert len(during) >= 5, (len(during), ended - started)
    finally:
        service.stop()


def test_a_large_read_of_base_bytes_reads_the_disk_off_the_loop(tmp_path: Path) -> None:
    """A read of unchanged base bytes this large is a job (the disk read in a worker
    thread, then the read itself from memory); its bytes and its drift rules are the
    read's as ever."""
    from slates.errors import BaseDrift

    base = tmp_path / "project"
    base.mkdir()
    data = os.urandom(8 << 20)
    (base / "big.bin").write_bytes(data)
    service = start_service(tmp_path / "run", shards=1, capacity="1GiB")
    try:
        with Client(service.runtime) as client:
            vid = client.create_volume("over", base=str(base))["id"]
            assert client.read(vid, "/big.bin") == data
            client.write(vid, "/big.bin", b"X", offset=5)  # no longer wholly the base's
            assert client.read(vid, "/big.bin") == data[:5] + b"X" + data[6:]
            (base / "other.bin").write_bytes(data)
            assert client.read(vid, "/other.bin") == data
            (base / "other.bin").write_bytes(b"changed under the volume" + data[24:])
            with pytest.raises(BaseDrift):
                client.read(vid, "/other.bin")
    finally:
        service.stop()
