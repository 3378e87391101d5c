"""The fleet link's local socket: RUNTIME/fleet.sock, framed msgpack, for this host only.

Theory of operation (the requests themselves are answered by
slates.fleet.link_requests).  The socket is born mode 0600 (bound under umask 0177,
so nobody else may connect first) and speaks framed msgpack
(slates.node.protocol's frame/pack/unpack): any number of requests per
connection, one at a time, each answered `{"ok": true, "result": ...}` or
`{"ok": false, "error": {...}}`.  Bounds: MAX_LOCAL_CONNECTIONS at once
(the next one is answered CapacityExhausted and closed), MAX_LOCAL_FRAME
per request (an oversize frame is answered InvalidArgument and the
connection closed: there is no way to resynchronize).

Callers: slates.fleet.link (one LocalSocket per link).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import trio

from slates.errors import CapacityExhausted, InvalidArgument, SlatesError
from slates.node.protocol import FrameReader, frame, pack, unpack

__all__ = ["LocalSocket", "MAX_LOCAL_CONNECTIONS", "MAX_LOCAL_FRAME"]

MAX_LOCAL_CONNECTIONS: Final = 64
MAX_LOCAL_FRAME: Final = 18 << 20
RECEIVE_BYTES: Final = 1 << 16

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class LocalSocket:
    """fleet.sock's listener and connections (module doc)."""

    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = path
        self._handle = handle
        self.connections = 0

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        path = self.path
        path.unlink(missing_ok=True)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            previous = os.umask(0o177)  # the socket is born 0600: nobody else may connect first
            try:
                await listener.bind(str(path))
            finally:
                os.umask(previous)
            os.chmod(path, 0o600)
            listener.listen(MAX_LOCAL_CONNECTIONS)
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    conn, _ = await listener.accept()
                    if self.connections >= MAX_LOCAL_CONNECTIONS:
                        full = CapacityExhausted(
                            "the fleet link has as many local connections as it takes",
                            limit=MAX_LOCAL_CONNECTIONS,
                        )
                        with conn, trio.move_on_after(1):
                            await _send_all(conn, frame(pack(_error(full))))
                        continue
                    self.connections += 1
                    nursery.start_soon(self._connection, conn)

    async def _connection(self, conn: trio.socket.SocketType) -> None:
        reader = FrameReader(limit=MAX_LOCAL_FRAME)
        try:
            with conn:
                while True:
                    try:
                        while (message := reader.next_frame()) is None:
                            data = await conn.recv(RECEIVE_BYTES)
                            if not data:
                                return
                            reader.feed(data)
                    except InvalidArgument as exc:  # an oversize frame: no way to resynchronize
                        await _send_all(conn, frame(pack(_error(exc))))
                        return
                    try:
                        answer = {"ok": True, "result": await self._handle(unpack(message))}
                    except SlatesError as exc:
                        answer = _error(exc)
                    await _send_all(conn, frame(pack(answer)))
        except (OSError, trio.BrokenResourceError):
            return
        finally:
            self.connections -= 1


def _error(error: SlatesError) -> dict[str, Any]:
    return {"ok": False, "error": error.to_wire()}


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]
