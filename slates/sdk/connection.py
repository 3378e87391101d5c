"""One connection from a client to a shard: hello, ring pair, one request at a time.

Theory of operation: a ShardConnection is opened on first use.  It says
hello with the client's id, receives a ring pair (four descriptors over
SCM_RIGHTS), and then sends one request at a time over the rings, watching
the socket for the shard's death (a reply too large for a ring comes as a
socket frame).  If the shard dies or the connection breaks it reconnects,
waiting for the anchor's replacement, and resends the *same* request (same
client id and sequence number): the shard answers from its saved result if
the request had already run, so a retry never runs an operation twice.
Reconnection is bounded (RECONNECT_SECONDS); past it the call fails with a
SlatesError.  Called only by slates.sdk.client.AsyncClient.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from typing import Any

import trio

from slates.errors import SlatesError, VerificationFailed
from slates.node.protocol import FrameReader, check_ok, frame, pack, parse_reply, unpack
from slates.node.ring import RingPair

__all__ = ["RECONNECT_SECONDS", "ShardConnection", "send_all"]

RECONNECT_SECONDS = 30.0


class _ConnectionLost(Exception):
    pass


class ShardConnection:
    def __init__(self, path: str, client_id: str, rings: bool, token: str | None = None) -> None:
        self.path = path
        self.client_id = client_id
        self.rings = rings
        self.token = token
        self.sock: trio.socket.SocketType | None = None
        self.pair: RingPair | None = None
        self.reader = FrameReader()
        self.next_seq = 1
        self.acked = 0
        self.lock = trio.Lock()

    async def _connect(self) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.connect(self.path)
            hello: dict[str, object] = {"client": self.client_id, "rings": self.rings}
            if self.token is not None:
                hello["token"] = self.token
            await send_all(sock, frame(pack(hello)))
            self.reader = FrameReader()
            fds: list[int] = []
            while (answer := self.reader.next_frame()) is None:
                data, ancillary, _flags, _addr = await sock.recvmsg(
                    1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize)
                )
                if not data:
                    raise _ConnectionLost()
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", payload[: len(payload) // 4 * 4]))
                self.reader.feed(data)
            try:
                check_ok(unpack(answer))
            except SlatesError:
                for fd in fds:
                    os.close(fd)
                raise
            if self.rings:
                if len(fds) != 4:
                    raise VerificationFailed("the shard did not pass a ring pair")
                self.pair = RingPair.attach(fds)
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
        assert self.sock is not None
        if self.pair is None:
            await send_all(self.sock, frame(message))
            while (reply := self.reader.next_frame()) is None:
                data = await self.sock.recv(1 << 16)
                if not data:
                    raise _ConnectionLost()
                self.reader.feed(data)
            return reply
        pair, sock, reader = self.pair, self.sock, self.reader
        if len(message) > pair.requests.max_message:
            await send_all(sock, frame(message))  # too large for the ring: a socket frame
        else:
            while not pair.requests.push(message):
                await trio.sleep(0.0005)  # bounded ring: wait for the shard to drain it
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
            received = await pair.replies.receive()
            nursery.cancel_scope.cancel()
        if received is None:
            raise _ConnectionLost()
        return received

    async def request(self, op: str, args: dict[str, Any]) -> Any:
        async with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            message = pack({"seq": seq, "ack": self.acked, "op": op, "args": args})
            deadline = trio.current_time() + RECONNECT_SECONDS
            delay = 0.01
            while True:
                try:
                    if self.sock is None:
                        await self._connect()
                    payload = await self._exchange(message)
                    break
                except (OSError, _ConnectionLost, trio.BrokenResourceError):
                    self.close()
                    if trio.current_time() > deadline:
                        raise SlatesError(
                            "the shard did not answer; is `slates anchor` running?",
                            socket=self.path,
                        ) from None
                    await trio.sleep(delay)
                    delay = min(delay * 2, 0.5)
            reply = parse_reply(unpack(payload))
            if reply.seq != seq:
                raise VerificationFailed("a reply answered another request", expected=seq)
            self.acked = seq
            if reply.error is not None:
                raise reply.error
            return reply.result


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]
