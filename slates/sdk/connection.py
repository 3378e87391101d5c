"""The trio transport: AsyncClient's connections to shards and to the anchor.

Theory of operation: a ShardConnection is opened on first use.  It says
hello (slates.sdk.session.ShardSession: the client's id and token),
receives a ring pair (four descriptors over SCM_RIGHTS), and then sends
one request at a time over the rings, watching the socket for the shard's
death (a reply too large for a ring comes as a socket frame).  If the
shard dies or the connection breaks it reconnects, waiting for the
anchor's replacement, and resends the *same* request (same client id and
sequence number): the shard answers from its saved result if the request
had already run, so a retry never runs an operation twice.  Reconnection
is bounded (slates.sdk.session.Reconnect, RECONNECT_SECONDS); past it the
call fails with a SlatesError.  A request interrupted part way
(cancelled, or failing otherwise) closes its connection, so no late reply
can meet the next request.

TrioTransport is the slates.sdk.transport.Transport over these
connections, used by slates.sdk.client.AsyncClient; the blocking twin is
slates.sdk.blocking.  What the bytes mean lives in slates.sdk.session, so
both transports follow the same rules.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from typing import Any

import trio

from slates.errors import SlatesError
from slates.sdk.session import (
    FDS_SPACE,
    RECONNECT_SECONDS,
    ConnectionLost,
    Outgoing,
    Reconnect,
    ShardSession,
    control_message,
    control_result,
    received_fds,
)
from slates.sdk.transport import syncfs
from slates.wire import FrameReader, frame

__all__ = ["BYE_SECONDS", "RECONNECT_SECONDS", "ShardConnection", "TrioTransport", "send_all"]

BYE_SECONDS = 5.0
"""How long closing waits for a shard's answer to goodbye."""
RING_FULL_WAIT = 0.0005


class ShardConnection:
    def __init__(self, path: str, session: ShardSession) -> None:
        self.path = path
        self.session = session
        self.sock: trio.socket.SocketType | None = None
        self.pair: Any = None  # a slates.node.ring.RingPair once connected with rings
        self.reader = FrameReader()
        self.lock = trio.Lock()

    async def _connect(self) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.connect(self.path)
            await send_all(sock, self.session.hello())
            self.reader = FrameReader()
            fds: list[int] = []
            while (answer := self.reader.next_frame()) is None:
                data, ancillary, _flags, _addr = await sock.recvmsg(1 << 16, FDS_SPACE)
                fds.extend(received_fds(ancillary))
                if not data:
                    raise ConnectionLost()
                self.reader.feed(data)
            ring_fds = self.session.accept_hello(answer, fds)
            if ring_fds is not None:
                from slates.node.ring import RingPair

                self.pair = RingPair.attach(ring_fds)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def _exchange(self, message: bytes) -> bytes:
        if self.sock is None:
            raise ConnectionLost()
        if self.pair is None:
            await send_all(self.sock, frame(message))
            while (reply := self.reader.next_frame()) is None:
                data = await self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionLost()
                self.reader.feed(data)
            return reply
        pair, sock, reader = self.pair, self.sock, self.reader
        received: bytes | None = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                # A large reply comes as a frame on the socket; its end means the shard died.
                nonlocal received
                with contextlib.suppress(OSError):
                    while (received := reader.next_frame()) is None:
                        data = await sock.recv(1 << 16)
                        if not data:
                            break
                        reader.feed(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            if len(message) > pair.requests.max_message:
                await send_all(sock, frame(message))  # too large for the ring: a socket frame
            else:
                while not pair.requests.push(message):
                    await trio.sleep(RING_FULL_WAIT)  # bounded ring: the shard drains it
            received = await pair.replies.receive()
            nursery.cancel_scope.cancel()
        if received is None:
            raise ConnectionLost()
        return received

    async def request(self, op: str, args: dict[str, Any]) -> Any:
        async with self.lock:
            outgoing: Outgoing = self.session.start(op, args)
            reconnect = Reconnect(trio.current_time(), self.path)
            while True:
                try:
                    if self.sock is None:
                        await self._connect()
                    payload = await self._exchange(outgoing.message)
                    break
                except (OSError, ConnectionLost, trio.BrokenResourceError):
                    self.close()
                    await trio.sleep(reconnect.after_failure(trio.current_time()))
                except BaseException:
                    self.close()  # a half-done exchange must not meet the next request
                    raise
            return self.session.finish(outgoing, payload)


class TrioTransport:
    """slates.sdk.transport.Transport on trio (see the module docstring)."""

    def __init__(self, client_id: str, rings: bool, token: str | None) -> None:
        self.client_id = client_id
        self.rings = rings
        self.token = token
        self.shards: list[ShardConnection] = []

    def open(self, sockets: Sequence[str]) -> None:
        self.shards = [
            ShardConnection(path, ShardSession(self.client_id, self.rings, self.token))
            for path in sockets
        ]

    async def request(self, shard: int, op: str, args: dict[str, Any]) -> Any:
        return await self.shards[shard].request(op, args)

    async def request_each(self, shards: Sequence[int], op: str, args: dict[str, Any]) -> list[Any]:
        """The same request to each of `shards`, one after the other (as AsyncClient
        always asked them)."""
        return [await self.shards[index].request(op, args) for index in shards]

    async def control(self, path: str, request: dict[str, Any]) -> Any:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            try:
                await sock.connect(path)
            except OSError:
                raise SlatesError(
                    "the anchor does not answer; is `slates anchor` running?", socket=path
                ) from None
            await send_all(sock, control_message(request))
            reader = FrameReader()
            while (payload := reader.next_frame()) is None:
                data = await sock.recv(1 << 16)
                if not data:
                    raise SlatesError("the anchor closed the connection")
                reader.feed(data)
        return control_result(payload)

    async def syncfs(self, directory: str, timeout: float | None) -> None:
        if timeout is None:
            await trio.to_thread.run_sync(syncfs, directory)
            return
        try:
            with trio.fail_after(timeout):
                await trio.to_thread.run_sync(syncfs, directory, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise TimeoutError() from None

    async def close(self) -> None:
        for shard in self.shards:
            if shard.sock is not None:
                with contextlib.suppress(SlatesError, OSError, trio.TooSlowError):
                    with trio.fail_after(BYE_SECONDS):
                        await shard.request("bye", {})
            shard.close()


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]
