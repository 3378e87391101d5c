"""Checkpoints come by replay cost and by bytes freed (issue 13, item 2).

A shard with a small event trigger (SLATES_CHECKPOINT_EVENTS) checkpoints
often enough that a restart after many writes replays only the events
since the last checkpoint; one with a small freed-bytes trigger checkpoints
after a large delete, so the deleted pages do not wait in the journal.
Both are read from the restarted shard's own "recovered ... events" line.
Real processes, SIGKILL.
"""

from __future__ import annotations

import re
from pathlib import Path

from slates import Client
from tests.anchor_fixture import Service, start_service


def replayed_after_kill(runtime: Path, service: Service) -> int:
    """SIGKILL shard 0, wait for its replacement, and return how many events it replayed."""
    old = service.kill_shard(0)
    service.wait_restarted(0, old)
    with Client(runtime) as client:
        client.status()  # it serves again, so it has logged its recovery
    log = (runtime.parent / f"{runtime.name}.log").read_text()
    counts = re.findall(r"shard 0 recovered \d+ volumes, (\d+) events", log)
    return int(counts[-1])


def test_a_restart_replays_only_the_events_since_the_last_checkpoint(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    service = start_service(runtime, shards=1, env={"SLATES_CHECKPOINT_EVENTS": "100"})
    try:
        with Client(runtime) as client:
            volume = client.create_volume("busy")["id"]
            for number in range(600):
                client.write(volume, "/f", b"%d" % number)
        assert replayed_after_kill(runtime, service) <= 2 * 100 + 10
        with Client(runtime) as client:
            assert client.read(volume, "/f") == b"599"  # nothing acknowledged was lost
    finally:
        service.stop()


def test_freeing_many_bytes_makes_a_checkpoint(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    service = start_service(runtime, shards=1, env={"SLATES_CHECKPOINT_FREED_BYTES": "1048576"})
    try:
        with Client(runtime) as client:
            volume = client.create_volume("scratch")["id"]
            for number in range(8):
                client.write(volume, f"/big{number}", b"x" * (1 << 20))
            kept = client.create_volume("kept")["id"]
            client.write(kept, "/f", b"kept")
            client.delete_volume(volume)  # 8 MiB of private pages freed
            client.write(kept, "/g", b"after")  # the next request checkpoints first
        assert replayed_after_kill(runtime, service) < 10
        with Client(runtime) as client:
            assert client.read(kept, "/f") == b"kept" and client.read(kept, "/g") == b"after"
    finally:
        service.stop()
