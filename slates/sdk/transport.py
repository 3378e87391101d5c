"""What the SDK's request logic needs from I/O: the Transport interface, and syncfs.

Theory of operation: slates.sdk.client.AsyncClient holds every rule of the
SDK (name resolution, routing, chunking, the attachment barrier) and does
its I/O only through a Transport, awaiting nothing else.  Two transports
implement it:

- slates.sdk.connection.TrioTransport (AsyncClient's own): trio sockets,
  ring pairs awaited on the trio loop, syncfs on a worker thread.
- slates.sdk.blocking.BlockingTransport (Client's): plain blocking sockets
  and blocking ring waits.  Its coroutines never suspend, so
  `slates.sdk.client.Client` runs AsyncClient's coroutines to completion
  in one step on the caller's thread, with no event loop and no trio.

A transport is opened with the shards' socket paths (from the anchor's
state file) and connects to a shard on its first request.  Errors: a
request that cannot reach its shard within the reconnect bound is a
SlatesError (slates.sdk.session.Reconnect); the shard's refusals are the
named errors of slates.errors; `syncfs` raises OSError, or TimeoutError
past its timeout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Transport", "syncfs"]


class Transport(Protocol):
    """The I/O under one AsyncClient (see the module docstring)."""

    def open(self, sockets: Sequence[str]) -> None:
        """Prepare one connection per shard socket (each connects on first use)."""

    async def request(self, shard: int, op: str, args: dict[str, Any]) -> Any:
        """One request to shard `shard` (an index into the opened sockets): its result."""

    async def request_each(self, shards: Sequence[int], op: str, args: dict[str, Any]) -> list[Any]:
        """The same request to each of `shards`: their results, in order, or the first
        error a shard answers (a transport that sends them all before awaiting any
        raises it once every reply is in, so none is left behind)."""

    async def control(self, path: str, request: dict[str, Any]) -> Any:
        """One request to the anchor's control socket at `path`: its result."""

    async def syncfs(self, directory: str, timeout: float | None) -> None:
        """Write back the kernel's cached changes of the file system at `directory`."""

    async def close(self) -> None:
        """Say goodbye to each connected shard (it forgets our saved replies); disconnect."""


@functools.cache
def _libc() -> Any:
    import ctypes  # here: only the attachment barrier and unmount need it

    return ctypes.CDLL(None, use_errno=True)


def syncfs(directory: str) -> None:
    """syncfs(2) on the file system holding `directory` (blocking)."""
    import ctypes

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc().syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), directory)
    finally:
        os.close(fd)
