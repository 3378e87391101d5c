"""A real anchor process in a temporary runtime directory, for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slates.errors import SlatesError
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["Service", "checkpointing_service", "service", "start_service", "stop_process"]


class Service:
    def __init__(self, runtime: Path, process: subprocess.Popen[bytes]) -> None:
        self.runtime = runtime
        self.process = process

    def state(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.runtime / "anchor.json").read_text())
        return data

    def shard_pids(self) -> list[int]:
        shards = self.state()["shards"]
        assert isinstance(shards, list)
        return [int(s["pid"]) for s in shards]

    def kill_shard(self, index: int) -> int:
        """SIGKILL one shard; returns the pid killed.  ProcessLookupError while the
        shard has no process (the state file says pid 0 between a death and its
        restart): os.kill(0, ...) would kill this test's own process group."""
        pid = self.shard_pids()[index]
        if pid <= 0:
            raise ProcessLookupError(f"shard {index} has no process now")
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, index: int, old_pid: int, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.shard_pids()[index]
            if pid not in (old_pid, 0):  # 0: between the death and the restart
                return pid
            time.sleep(0.02)
        raise AssertionError(f"shard {index} was not restarted")

    def stop(self) -> None:
        stop_process(self.process)


def start_service(
    runtime: Path, shards: int = 2, capacity: str = "2GiB", env: dict[str, str] | None = None
) -> Service:
    log_path = runtime.parent / f"{runtime.name}.log"
    with open(log_path, "ab") as log:
        try:
            process = spawn_anchor(runtime, shards=shards, capacity=capacity, log=log, env=env)
        except SlatesError:
            raise AssertionError("the anchor did not start: " + log_path.read_text()) from None
    return Service(runtime, process)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    running = start_service(tmp_path / "run")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def checkpointing_service(tmp_path: Path) -> Iterator[Service]:
    """Shards that checkpoint every 64 KiB of journal, so crashes land around checkpoints."""
    running = start_service(tmp_path / "run", env={"SLATES_CHECKPOINT_BYTES": "65536"})
    try:
        yield running
    finally:
        running.stop()
