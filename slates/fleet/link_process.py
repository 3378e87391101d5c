"""The fleet link process: its lock and state file in RUNTIME, its life tied to the anchor.

Theory of operation.  One link runs per runtime directory: `take_the_lock`
takes an exclusive flock on RUNTIME/fleet-link.lock before the link
touches anything, and a second link is refused (AlreadyExists); the lock's
descriptor is never closed, so it is released only when the process ends.
`write_state` writes RUNTIME/fleet-link.json (pid, host, boot id, QUIC
port, fleet.sock's path: a temporary file renamed over it) once everything
serves: it says the link is ready; the link removes it when it leaves.

The link ends with its anchor: `anchor_loop` reads the anchor's state file
every poll interval, remembers the first pid it finds there, and sets
`ended` when that anchor is no longer alive or another anchor's pid stands
there (a restart: the RAM and its volumes are gone), so the host's boot id
is never kept alive by a link that outlived its volumes.  A new anchor
starts a new link, with a new boot id.

Invariants.  `ended` is set at most once: the loop returns after setting
it.  A state file with no anchor in it (not written yet, or removed) is
never taken for a restart: only the remembered anchor's death or another
pid in its place ends the link.

Callers: slates.fleet.link (one LinkProcess per link).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

import trio

from slates.errors import AlreadyExists, InvalidArgument
from slates.node.runtime import Runtime, pid_alive

__all__ = ["LOCK_NAME", "LinkProcess", "STATE_NAME"]

STATE_NAME: Final = "fleet-link.json"
LOCK_NAME: Final = "fleet-link.lock"


class LinkProcess:
    """One link's lock, state file and anchor watch (module doc)."""

    def __init__(
        self,
        runtime: Runtime,
        host: str,
        boot_id: str,
        socket_path: Path,
        poll_interval: float,
        log: Callable[[str], None],
    ) -> None:
        self.runtime = runtime
        self.host = host
        self.boot_id = boot_id
        self.socket_path = socket_path
        self.poll_interval = poll_interval
        self._log = log
        self.ended = trio.Event()  # the anchor is gone: the link ends with it
        self.anchor_pid: int | None = None
        self._lock_fd: int | None = None

    @property
    def state_path(self) -> Path:
        return self.runtime.path / STATE_NAME

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def take_the_lock(self) -> None:
        """One link per runtime directory: an exclusive lock held for the process's life."""
        fd = os.open(self.runtime.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyExists(
                "a fleet link runs on this runtime directory", runtime=str(self.runtime.path)
            ) from None
        self._lock_fd = fd  # closed (and so released) only when the process ends

    def write_state(self, quic_port: int) -> None:
        state = {
            "pid": os.getpid(),
            "host": self.host,
            "boot_id": self.boot_id,
            "quic_port": quic_port,
            "socket": str(self.socket_path),
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    async def anchor_loop(self) -> None:
        """End with the anchor: once the anchor whose state file we first read is gone (or
        another anchor took its place), this boot's RAM is gone, and so is this boot."""
        while True:
            try:
                pid: int | None = self.runtime.read_state().pid
            except InvalidArgument:  # NotFound among them: no anchor (yet, or any more)
                pid = None
            if self.anchor_pid is None:
                self.anchor_pid = pid
            elif not pid_alive(self.anchor_pid) or pid not in (None, self.anchor_pid):
                self._log(f"the anchor (pid {self.anchor_pid}) is gone: leaving the fleet")
                self.ended.set()
                return
            await trio.sleep(self.poll_interval)
