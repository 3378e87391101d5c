"""Anchor and bridge death (issue 13, item 5).

A bridge killed with SIGKILL is started again by the anchor on the same
directory: the mount works again.  An anchor killed with SIGKILL takes its
volumes with its RAM: its bridges unmount and exit at once (no mount is
left answering EIO), and the next anchor on the runtime directory says so
(the volume names, from the shards' volume files), cleans the stale mount
and the orphaned bridge, and `status` reports the loss.  Real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slates import Client
from slates.node.anchor import is_mounted
from tests.anchor_fixture import Service, service, start_service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)


def wait_for(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def own_state(service: Service) -> bool:
    """Whether the runtime directory's state file is this anchor's (it replaces the dead
    one's: for a moment there is none)."""
    try:
        return service.state()["pid"] == service.process.pid
    except (FileNotFoundError, ValueError):
        return False


def test_a_killed_bridge_is_started_again(service: Service, tmp_path: Path) -> None:
    with Client(service.runtime) as client:
        volume = client.create_volume("agent")["id"]
        client.write(volume, "/notes", b"kept\n")
        with mounted(client, volume, tmp_path / "mnt") as where:
            assert (where / "notes").read_bytes() == b"kept\n"
            (old,) = [m["pid"] for m in client.status()["mounts"]]
            os.kill(old, signal.SIGKILL)

            def restarted() -> bool:
                pids = [m["pid"] for m in client.status()["mounts"]]
                return bool(pids) and pids[0] != old

            wait_for(restarted)
            assert (where / "notes").read_bytes() == b"kept\n"  # a pause, then it goes on
            (where / "more").write_bytes(b"after\n")
        assert client.read(volume, "/more") == b"after\n"


def test_a_dead_anchor_is_reported_and_cleaned_up_by_the_next(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    first = start_service(runtime)
    where = tmp_path / "mnt"
    where.mkdir()
    try:
        with Client(runtime) as client:
            for name in ("alpha", "beta"):
                client.create_volume(name)
            volume = client.resolve("alpha")
            client.mount(volume, where)
            (bridge,) = [m["pid"] for m in client.status()["mounts"]]
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        # The bridge goes with its anchor (and unmounts), not only when the next comes.
        wait_for(lambda: not Path(f"/proc/{bridge}").exists())
        wait_for(lambda: not is_mounted(str(where)))
    finally:
        first.stop()
    second = start_service(runtime)  # it finds the old state file at once: wait for its own
    try:
        wait_for(lambda: own_state(second))
        assert not is_mounted(str(where))  # the stale mount is gone
        wait_for(lambda: not Path(f"/proc/{bridge}").exists())  # and its bridge
        with Client(runtime) as client:
            lost = client.status()["previous_anchor_lost"]
            assert lost["pid"] == first.process.pid
            assert lost["volumes"] == ["alpha", "beta"]
            assert lost["mounts"] == [str(where)]
            assert client.list_volumes() == []  # RAM is gone: nothing pretends otherwise
    finally:
        second.stop()


def test_gc_reaps_an_orphaned_bridge_and_its_mount(service: Service, tmp_path: Path) -> None:
    """A bridge of this runtime directory that serves no mount of the anchor's (started
    by hand here, as one a dead anchor left would be) is killed, and its mount detached."""
    with Client(service.runtime) as client:
        volume = client.create_volume("orphan")["id"]
        client.write(volume, "/f", b"x")
        where = tmp_path / "orphan-mnt"
        where.mkdir()
        ready_read, ready_write = os.pipe()
        orphan = subprocess.Popen(
            [sys.executable, "-m", "slates.fuse.bridge", "--runtime-dir", str(service.runtime),
             "--volume", volume, "--mountpoint", str(where), "--ready-fd", str(ready_write)],
            pass_fds=(ready_write,),
        )  # fmt: skip
        os.close(ready_write)
        with os.fdopen(ready_read, "rb") as ready:
            assert ready.read(1) == b"1"
        try:
            assert (where / "f").read_bytes() == b"x"
            assert client.status()["mounts"] == []  # the anchor knows nothing of it
            reaped = client.gc()["reaped"]
            assert reaped == {"bridges": [orphan.pid], "mounts": [str(where)]}
            assert orphan.wait(timeout=30) != 0
            assert not is_mounted(str(where))
            assert client.gc()["reaped"] == {"bridges": [], "mounts": []}
        finally:
            if orphan.poll() is None:
                orphan.kill()
                orphan.wait()
