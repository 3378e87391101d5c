"""Servers ask the scheduler for short slices, so a woken shard or bridge does not
wait out a compiler's slice (native/sched_slice.c, slates.node.ring.ask_short_slice).

Checked on real processes: every thread of every shard and of a mount's bridge
(a spare that got its job, raised from SCHED_IDLE first) runs with
SERVER_SLICE_NS, read from /proc/PID/task/TID/sched as the kernel reports it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from slates._native import lib

from slates import Client
from slates.node.ring import SERVER_SLICE_NS, ask_short_slice
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]


def _custom_slices_work() -> bool:
    """Whether this kernel keeps a SCHED_OTHER thread's slice request (Linux 6.12+):
    asked on a thread of its own, so the test process keeps its slice."""
    got: list[int] = []

    def ask() -> None:
        if ask_short_slice() is None:
            got.append(int(lib.servers_slice()))

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    return got == [SERVER_SLICE_NS] and "se.slice" in Path("/proc/self/sched").read_text()


pytestmark = [
    pytest.mark.skipif(
        not os.path.exists("/dev/fuse") or os.geteuid() != 0,
        reason="FUSE mounts need /dev/fuse and root (CI has both)",
    ),
    pytest.mark.skipif(
        not _custom_slices_work(),
        reason="the kernel keeps no slice requests for SCHED_OTHER threads (before 6.12)",
    ),
]


def thread_slices(pid: int) -> dict[int, int]:
    """Each thread of `pid` and its slice in ns (se.slice in its sched file)."""
    slices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        for line in text.splitlines():
            if line.startswith("se.slice"):
                slices[int(tid)] = int(line.split(":")[1])
    return slices


def test_shards_and_bridges_run_with_short_slices(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        vid = client.create_volume("sliced")["id"]
        with mounted(client, vid, tmp_path / "mnt") as mnt:
            (mnt / "made").write_bytes(b"x" * 100_000)  # the shard's and bridge's threads at work
            bridges = [int(m["pid"]) for m in client.mounts() if m["volume"] == vid]
            assert bridges
            for pid in [*service.shard_pids(), *bridges]:
                slices = thread_slices(pid)
                assert slices and set(slices.values()) == {SERVER_SLICE_NS}, (pid, slices)
